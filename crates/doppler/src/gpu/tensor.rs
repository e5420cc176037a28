//! Tensors: a pooled storage buffer plus shape, dtype and label. The shape is the truth
//! about how many elements there are; the buffer may be larger (size classes).

use super::pool::PooledBuffer;
use super::Gpu;
use crate::error::{Error, Result};
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum DType {
    F32,
    F16,
    U32,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::F16 => 2,
        }
    }
}

/// Usage of every tensor buffer: kernels read and write it, uploads and readbacks copy it.
pub(crate) const STORAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

/// Most dimensions a tensor has.
pub const MAX_RANK: usize = 8;

/// A shape kept inline, so that making or cloning a tensor (every dispatch records its
/// tensors) allocates nothing for it.
#[derive(Clone, Copy)]
struct Shape {
    dims: [usize; MAX_RANK],
    rank: u8,
}

impl Shape {
    fn new(op: &'static str, dims: &[usize]) -> Result<Shape> {
        if dims.len() > MAX_RANK {
            return Err(Error::Shape {
                op,
                detail: format!("{dims:?} has more than {MAX_RANK} dimensions"),
            });
        }
        let mut s = Shape {
            dims: [0; MAX_RANK],
            rank: dims.len() as u8,
        };
        s.dims[..dims.len()].copy_from_slice(dims);
        Ok(s)
    }

    fn as_slice(&self) -> &[usize] {
        &self.dims[..self.rank as usize]
    }
}

/// A GPU tensor, contiguous, row-major. Cloning shares the buffer.
#[derive(Clone)]
pub struct Tensor {
    buf: Arc<PooledBuffer>,
    shape: Shape,
    dtype: DType,
    label: Arc<str>,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor({}: {:?} {:?})",
            self.label,
            self.dtype,
            self.shape()
        )
    }
}

impl Tensor {
    /// Uninitialised contents (whatever the pooled buffer held).
    pub fn empty(gpu: &Gpu, shape: &[usize], dtype: DType, label: &str) -> Result<Tensor> {
        let dims = Shape::new("tensor", shape)?;
        let numel: usize = shape.iter().product();
        let bytes = (numel * dtype.size()) as u64;
        let binding = bytes.next_multiple_of(16).max(16);
        if binding > gpu.limits.max_storage_buffer_binding_size {
            return Err(Error::TooLarge {
                label: label.to_string(),
                bytes: binding,
                limit_name: "max_storage_buffer_binding_size",
                limit: gpu.limits.max_storage_buffer_binding_size,
            });
        }
        let buf = gpu
            .pool
            .alloc(&gpu.device, &gpu.limits, binding, STORAGE, label)?;
        Ok(Tensor {
            buf,
            shape: dims,
            dtype,
            label: label.into(),
        })
    }

    fn from_bytes(
        gpu: &Gpu,
        shape: &[usize],
        dtype: DType,
        bytes: &[u8],
        label: &str,
    ) -> Result<Tensor> {
        let t = Tensor::empty(gpu, shape, dtype, label)?;
        let expected = t.numel();
        if bytes.len() != expected * dtype.size() {
            return Err(Error::UploadSize {
                label: label.into(),
                got: bytes.len() / dtype.size(),
                expected,
            });
        }
        if bytes.len() % 4 == 0 {
            gpu.queue.write_buffer(&t.buf.buffer, 0, bytes);
        } else {
            let mut padded = bytes.to_vec();
            padded.resize(bytes.len().next_multiple_of(4), 0);
            gpu.queue.write_buffer(&t.buf.buffer, 0, &padded);
        }
        Ok(t)
    }

    /// Raw bytes (a quantized tensor's blocks) as u32 words, zero-padded to a multiple of 4.
    pub fn from_raw_bytes(gpu: &Gpu, bytes: &[u8], label: &str) -> Result<Tensor> {
        if !bytes.is_empty() && bytes.len() % 4 == 0 {
            // Whole words already: no copy (a model's largest tensors pass through here).
            return Self::from_bytes(gpu, &[bytes.len() / 4], DType::U32, bytes, label);
        }
        let mut padded = bytes.to_vec();
        padded.resize(bytes.len().next_multiple_of(4).max(4), 0);
        Self::from_bytes(gpu, &[padded.len() / 4], DType::U32, &padded, label)
    }

    pub fn from_f32(gpu: &Gpu, shape: &[usize], data: &[f32], label: &str) -> Result<Tensor> {
        Self::from_bytes(gpu, shape, DType::F32, bytemuck::cast_slice(data), label)
    }

    pub fn from_f16(gpu: &Gpu, shape: &[usize], data: &[half::f16], label: &str) -> Result<Tensor> {
        Self::from_bytes(gpu, shape, DType::F16, bytemuck::cast_slice(data), label)
    }

    pub fn from_u32(gpu: &Gpu, shape: &[usize], data: &[u32], label: &str) -> Result<Tensor> {
        Self::from_bytes(gpu, shape, DType::U32, bytemuck::cast_slice(data), label)
    }

    /// Overwrites a u32 tensor's contents (a queued write: it reaches the commands of the
    /// next submission and later ones).
    pub fn write_u32(&self, gpu: &Gpu, data: &[u32]) -> Result<()> {
        if self.dtype != DType::U32 {
            return Err(Error::DType {
                op: "write_u32",
                got: self.dtype,
                expected: "u32",
            });
        }
        if data.len() != self.numel() {
            return Err(Error::UploadSize {
                label: self.label.to_string(),
                got: data.len(),
                expected: self.numel(),
            });
        }
        if !data.is_empty() {
            gpu.queue
                .write_buffer(&self.buf.buffer, 0, bytemuck::cast_slice(data));
        }
        Ok(())
    }

    pub fn shape(&self) -> &[usize] {
        self.shape.as_slice()
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Whether `other` is this tensor's buffer (a clone of it or a view of the same).
    pub fn same_buffer(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.buf, &other.buf)
    }
    pub fn label(&self) -> &str {
        &self.label
    }
    pub fn numel(&self) -> usize {
        self.shape().iter().product()
    }
    /// Bytes of actual data (not the pooled buffer's size).
    pub fn byte_size(&self) -> u64 {
        (self.numel() * self.dtype.size()) as u64
    }
    /// Bytes a binding of this tensor covers: the data rounded up to 16, so that a kernel
    /// may view it as `array<vec4<f32>>` (pool buffers are always that large).
    pub fn binding_size(&self) -> u64 {
        self.byte_size().next_multiple_of(16).max(16)
    }
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buf.buffer
    }
    pub(crate) fn pooled(&self) -> &Arc<PooledBuffer> {
        &self.buf
    }

    /// The same data under another shape with the same element count.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        if shape.iter().product::<usize>() != self.numel() {
            return Err(Error::Shape {
                op: "reshape",
                detail: format!(
                    "{:?} ({} elements) to {:?}",
                    self.shape(),
                    self.numel(),
                    shape
                ),
            });
        }
        Ok(Tensor {
            shape: Shape::new("reshape", shape)?,
            ..self.clone()
        })
    }

    /// A view of the first elements under `shape` (no more elements than this tensor has),
    /// e.g. the filled part of a cache.
    pub fn prefix(&self, shape: &[usize]) -> Result<Tensor> {
        if shape.iter().product::<usize>() > self.numel() {
            return Err(Error::Shape {
                op: "prefix",
                detail: format!(
                    "{:?} ({} elements) of {:?}",
                    shape,
                    shape.iter().product::<usize>(),
                    self.shape()
                ),
            });
        }
        Ok(Tensor {
            shape: Shape::new("prefix", shape)?,
            ..self.clone()
        })
    }

    /// Copies the tensor's bytes to the host. Asynchronous underneath (WebGPU maps buffers
    /// asynchronously); native code can use the `*_blocking` helpers.
    pub async fn read_bytes(&self, gpu: &Gpu) -> Result<Vec<u8>> {
        let mut rec = gpu.recorder("readback");
        let read = rec.read_later(self)?;
        rec.submit()?;
        let bytes = read.bytes(gpu).await?;
        gpu.check_errors()?;
        Ok(bytes)
    }

    /// Reads an f32 tensor, or an f16 tensor widened to f32.
    pub async fn to_vec_f32(&self, gpu: &Gpu) -> Result<Vec<f32>> {
        let bytes = self.read_bytes(gpu).await?;
        match self.dtype {
            DType::F32 => Ok(bytemuck::pod_collect_to_vec(&bytes)),
            DType::F16 => Ok(bytemuck::pod_collect_to_vec::<u8, half::f16>(&bytes)
                .iter()
                .map(|h| h.to_f32())
                .collect()),
            DType::U32 => Err(Error::DType {
                op: "to_vec_f32",
                got: self.dtype,
                expected: "f32 or f16",
            }),
        }
    }

    pub async fn to_vec_u32(&self, gpu: &Gpu) -> Result<Vec<u32>> {
        if self.dtype != DType::U32 {
            return Err(Error::DType {
                op: "to_vec_u32",
                got: self.dtype,
                expected: "u32",
            });
        }
        Ok(bytemuck::pod_collect_to_vec(&self.read_bytes(gpu).await?))
    }

    pub async fn to_vec_f16(&self, gpu: &Gpu) -> Result<Vec<half::f16>> {
        if self.dtype != DType::F16 {
            return Err(Error::DType {
                op: "to_vec_f16",
                got: self.dtype,
                expected: "f16",
            });
        }
        Ok(bytemuck::pod_collect_to_vec(&self.read_bytes(gpu).await?))
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_f32(&self, gpu: &Gpu) -> Result<Vec<f32>> {
        pollster::block_on(self.to_vec_f32(gpu))
    }
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_u32(&self, gpu: &Gpu) -> Result<Vec<u32>> {
        pollster::block_on(self.to_vec_u32(gpu))
    }
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_f16(&self, gpu: &Gpu) -> Result<Vec<half::f16>> {
        pollster::block_on(self.to_vec_f16(gpu))
    }
}
