//! GGUF tensor types to f32 on the GPU. Shader: `quant.wgsl` (block layouts in its header;
//! the CPU oracle is `reference::quant`). Inference reads quantized blocks directly in its
//! matrix products; this is for loading, checking and the types without such a kernel.

use crate::error::{Error, Result};
use crate::formats::gguf::GgmlType;
use crate::gpu::{Binding::*, DType, Grid, Kernel, Recorder, Tensor};
use crate::shaders::QUANT;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub n: u32,
    pub _pad: [u32; 3],
}

static DEQUANT: Kernel = Kernel::new(&QUANT, "dequantize", &[(1, Read), (2, ReadWrite)]);

/// Types the kernel decodes.
pub const SUPPORTED: &[&str] = &["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"];

/// `n` elements of type `ty` from `raw` (the blocks' bytes as u32 words, see
/// [`Tensor::from_raw_bytes`]) into a new f32 tensor of shape `shape`.
pub fn dequantize(rec: &mut Recorder<'_>, raw: &Tensor, ty: GgmlType, shape: &[usize]) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let bad = |detail: String| Err(Error::Invalid { op: "dequantize", detail });
    if !SUPPORTED.contains(&ty.name()) {
        return bad(format!("tensor type {} ({}) has no GPU dequantizer", ty.name(), ty.0));
    }
    let (per, bytes) = ty.block().map(|(a, b)| (a as usize, b as usize)).unwrap_or((1, 1));
    if raw.dtype() != DType::U32 || n % per != 0 || raw.numel() * 4 < n / per * bytes {
        return bad(format!("{n} elements of {} need {} bytes; raw tensor {:?} {:?}", ty.name(), n / per * bytes, raw.dtype(), raw.shape()));
    }
    let y = Tensor::empty(rec.gpu(), shape, DType::F32, "dequantize.y")?;
    let p = Params { n: n as u32, _pad: [0; 3] };
    rec.dispatch(&DEQUANT, &[("TYPE", ty.0 as f64)], bytemuck::bytes_of(&p), &[raw, &y], Grid::cover(n as u64, 256))?;
    Ok(y)
}
