//! Pixel shuffle and nearest-neighbour 2-D upsampling (NCHW), forward and backward. Shader:
//! `upsample.wgsl`. Derivatives: pixel shuffle is a permutation, so its backward is the
//! inverse permutation (pixel unshuffle); nearest upsampling copies each input to an
//! sh x sw block, so its backward sums each block.

use super::expect_f32;
use crate::error::{Error, Result};
use crate::gpu::{Binding::*, DType, Grid, Kernel, Recorder, Tensor};
use crate::shaders::UPSAMPLE;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub total: u32,
    pub c: u32,
    pub h: u32,
    pub w: u32,
    pub sh: u32,
    pub sw: u32,
    pub _pad: [u32; 2],
}

const IO: &[(u32, crate::gpu::Binding)] = &[(1, Read), (2, ReadWrite)];
static SHUFFLE: Kernel = Kernel::new(&UPSAMPLE, "pixel_shuffle", IO);
static UNSHUFFLE: Kernel = Kernel::new(&UPSAMPLE, "pixel_unshuffle", IO);
static UP_FWD: Kernel = Kernel::new(&UPSAMPLE, "upsample_fwd", IO);
static UP_BWD: Kernel = Kernel::new(&UPSAMPLE, "upsample_bwd", IO);

fn nchw(op: &'static str, t: &Tensor) -> Result<[usize; 4]> {
    expect_f32(op, t)?;
    match *t.shape() {
        [n, c, h, w] if n * c * h * w > 0 => Ok([n, c, h, w]),
        _ => Err(Error::Shape {
            op,
            detail: format!("{:?}: expected non-empty (N, C, H, W)", t.shape()),
        }),
    }
}

fn go(
    rec: &mut Recorder<'_>,
    k: &Kernel,
    x: &Tensor,
    out: &[usize],
    p: Params,
    label: &str,
) -> Result<Tensor> {
    let y = Tensor::empty(rec.gpu(), out, DType::F32, label)?;
    rec.dispatch(
        k,
        &[],
        bytemuck::bytes_of(&p),
        &[x, &y],
        Grid::cover(p.total as u64, 256),
    )?;
    Ok(y)
}

fn params(total: usize, c: usize, h: usize, w: usize, sh: usize, sw: usize) -> Params {
    Params {
        total: total as u32,
        c: c as u32,
        h: h as u32,
        w: w as u32,
        sh: sh as u32,
        sw: sw as u32,
        _pad: [0; 2],
    }
}

/// x (N, C*r*r, H, W) -> (N, C, H*r, W*r), as torch.nn.PixelShuffle(r).
pub fn pixel_shuffle(rec: &mut Recorder<'_>, x: &Tensor, r: usize) -> Result<Tensor> {
    let [n, cr, h, w] = nchw("pixel_shuffle", x)?;
    if r == 0 || cr % (r * r) != 0 {
        return Err(Error::Shape {
            op: "pixel_shuffle",
            detail: format!(
                "x {:?}: channels not divisible by r^2 = {}",
                x.shape(),
                r * r
            ),
        });
    }
    let c = cr / (r * r);
    go(
        rec,
        &SHUFFLE,
        x,
        &[n, c, h * r, w * r],
        params(x.numel(), c, h, w, r, r),
        "pixel_shuffle.y",
    )
}

/// dx (N, C*r*r, H, W) from dy (N, C, H*r, W*r).
pub fn pixel_shuffle_backward(rec: &mut Recorder<'_>, dy: &Tensor, r: usize) -> Result<Tensor> {
    let [n, c, hr, wr] = nchw("pixel_shuffle_backward", dy)?;
    if r == 0 || hr % r != 0 || wr % r != 0 {
        return Err(Error::Shape {
            op: "pixel_shuffle_backward",
            detail: format!("dy {:?} not divisible by r = {r}", dy.shape()),
        });
    }
    let (h, w) = (hr / r, wr / r);
    go(
        rec,
        &UNSHUFFLE,
        dy,
        &[n, c * r * r, h, w],
        params(dy.numel(), c, h, w, r, r),
        "pixel_shuffle.dx",
    )
}

/// x (N, C, H, W) -> (N, C, H*sh, W*sw), as torch's nearest interpolation with integer scales.
pub fn upsample_nearest2d(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    sh: usize,
    sw: usize,
) -> Result<Tensor> {
    let [n, c, h, w] = nchw("upsample_nearest2d", x)?;
    if sh == 0 || sw == 0 {
        return Err(Error::Shape {
            op: "upsample_nearest2d",
            detail: format!("scale {sh} x {sw}"),
        });
    }
    let total = x.numel() * sh * sw;
    go(
        rec,
        &UP_FWD,
        x,
        &[n, c, h * sh, w * sw],
        params(total, n * c, h, w, sh, sw),
        "upsample.y",
    )
}

/// dx (N, C, H, W) from dy (N, C, H*sh, W*sw).
pub fn upsample_nearest2d_backward(
    rec: &mut Recorder<'_>,
    dy: &Tensor,
    sh: usize,
    sw: usize,
) -> Result<Tensor> {
    let [n, c, hs, ws] = nchw("upsample_nearest2d_backward", dy)?;
    if sh == 0 || sw == 0 || hs % sh != 0 || ws % sw != 0 {
        return Err(Error::Shape {
            op: "upsample_nearest2d_backward",
            detail: format!("dy {:?}, scale {sh} x {sw}", dy.shape()),
        });
    }
    let (h, w) = (hs / sh, ws / sw);
    go(
        rec,
        &UP_BWD,
        dy,
        &[n, c, h, w],
        params(n * c * h * w, n * c, h, w, sh, sw),
        "upsample.dx",
    )
}
