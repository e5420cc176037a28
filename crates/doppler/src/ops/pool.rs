//! Average pooling (NCHW) over kh x kw windows with stride (sh, sw) and no padding, forward
//! and backward; global average pooling is the window of the whole image. Shader:
//! `pool.wgsl`. Derivative: each output is the mean of its window, so dx at a pixel is the
//! sum, over the windows holding it, of dy / (kh*kw).

use super::expect_f32;
use crate::error::{Error, Result};
use crate::gpu::{Binding::*, DType, Grid, Kernel, Recorder, Tensor};
use crate::shaders::POOL;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub total: u32,
    pub h: u32,
    pub w: u32,
    pub oh: u32,
    pub ow: u32,
    pub kh: u32,
    pub kw: u32,
    pub sh: u32,
    pub sw: u32,
    pub _pad: [u32; 3],
}

const IO: &[(u32, crate::gpu::Binding)] = &[(1, Read), (2, ReadWrite)];
static FWD: Kernel = Kernel::new(&POOL, "avg_pool_fwd", IO);
static BWD: Kernel = Kernel::new(&POOL, "avg_pool_bwd", IO);

/// A pooling window: size and stride, as (height, width) pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool {
    pub kernel: (usize, usize),
    pub stride: (usize, usize),
}

impl Pool {
    /// Windows of k x k, k apart (torch's `avg_pool2d(x, k)`).
    pub fn square(k: usize) -> Pool {
        Pool {
            kernel: (k, k),
            stride: (k, k),
        }
    }

    /// (OH, OW) for an H x W input, or an error naming the shapes.
    pub fn out_size(&self, op: &'static str, x: &[usize]) -> Result<[usize; 4]> {
        let err = |why: &str| Error::Shape {
            op,
            detail: format!("x {x:?}, {self:?}: {why}"),
        };
        let &[n, c, h, w] = x else {
            return Err(err("x must be (N, C, H, W)"));
        };
        let (kh, kw) = self.kernel;
        let (sh, sw) = self.stride;
        if [kh, kw, sh, sw].contains(&0) || n * c * h * w == 0 {
            return Err(err("sizes, window and stride must be positive"));
        }
        if kh > h || kw > w {
            return Err(err("the window is larger than the image"));
        }
        Ok([n, c, (h - kh) / sh + 1, (w - kw) / sw + 1])
    }

    fn params(&self, total: usize, h: usize, w: usize, oh: usize, ow: usize) -> Params {
        let u = |v: usize| v as u32;
        Params {
            total: u(total),
            h: u(h),
            w: u(w),
            oh: u(oh),
            ow: u(ow),
            kh: u(self.kernel.0),
            kw: u(self.kernel.1),
            sh: u(self.stride.0),
            sw: u(self.stride.1),
            _pad: [0; 3],
        }
    }
}

fn go(rec: &mut Recorder<'_>, k: &Kernel, x: &Tensor, out: &[usize], p: Params) -> Result<Tensor> {
    let y = Tensor::empty(rec.gpu(), out, DType::F32, "avg_pool")?;
    rec.dispatch(
        k,
        &[],
        bytemuck::bytes_of(&p),
        &[x, &y],
        Grid::cover(p.total as u64, 256),
    )?;
    Ok(y)
}

/// y (N, C, OH, OW) = the mean of each window of x (N, C, H, W).
pub fn avg_pool2d(rec: &mut Recorder<'_>, x: &Tensor, pool: Pool) -> Result<Tensor> {
    expect_f32("avg_pool2d", x)?;
    let [n, c, oh, ow] = pool.out_size("avg_pool2d", x.shape())?;
    let (h, w) = (x.shape()[2], x.shape()[3]);
    let p = pool.params(n * c * oh * ow, h, w, oh, ow);
    go(rec, &FWD, x, &[n, c, oh, ow], p)
}

/// dx (N, C, H, W) from dy (N, C, OH, OW); `x_shape` is the forward's input shape.
pub fn avg_pool2d_backward(
    rec: &mut Recorder<'_>,
    dy: &Tensor,
    x_shape: &[usize],
    pool: Pool,
) -> Result<Tensor> {
    expect_f32("avg_pool2d_backward", dy)?;
    let out = pool.out_size("avg_pool2d_backward", x_shape)?;
    if dy.shape() != out {
        return Err(Error::Shape {
            op: "avg_pool2d_backward",
            detail: format!("dy {:?}, expected {out:?} for x {x_shape:?}", dy.shape()),
        });
    }
    let (h, w) = (x_shape[2], x_shape[3]);
    let p = pool.params(x_shape.iter().product(), h, w, out[2], out[3]);
    go(rec, &BWD, dy, x_shape, p)
}
