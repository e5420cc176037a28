//! Seeded dropout. Shader: `dropout.wgsl`. The mask is a hash of (seed, element index),
//! so the backward (the same map applied to dy) regenerates it instead of storing it.

use super::expect_f32;
use crate::error::{Error, Result};
use crate::gpu::{Binding::*, DType, Grid, Kernel, Recorder, Tensor};
use crate::shaders::DROPOUT;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub n: u32,
    pub seed_lo: u32,
    pub seed_hi: u32,
    pub threshold: u32,
    pub scale: f32,
    pub _pad: [u32; 3],
}

static DROPOUT_K: Kernel = Kernel::new(&DROPOUT, "dropout", &[(1, Read), (2, ReadWrite)]);

/// The kernel parameters for drop probability `p` and `seed` (also used by the reference).
pub fn params(n: usize, p: f64, seed: u64) -> Params {
    Params {
        n: n as u32,
        seed_lo: seed as u32,
        seed_hi: (seed >> 32) as u32,
        threshold: (p * (1u64 << 24) as f64).round() as u32,
        scale: (1.0 / (1.0 - p)) as f32,
        _pad: [0; 3],
    }
}

fn run(rec: &mut Recorder<'_>, op: &'static str, x: &Tensor, p: f64, seed: u64) -> Result<Tensor> {
    expect_f32(op, x)?;
    if !(0.0..1.0).contains(&p) {
        return Err(Error::Invalid {
            op,
            detail: format!("drop probability {p} not in [0, 1)"),
        });
    }
    let y = Tensor::empty(rec.gpu(), x.shape(), DType::F32, "dropout.y")?;
    let prm = params(x.numel(), p, seed);
    rec.dispatch(
        &DROPOUT_K,
        &[],
        bytemuck::bytes_of(&prm),
        &[x, &y],
        Grid::cover(x.numel() as u64, 256),
    )?;
    Ok(y)
}

/// y = mask * x / (1 - p), mask from (seed, index).
pub fn dropout(rec: &mut Recorder<'_>, x: &Tensor, p: f64, seed: u64) -> Result<Tensor> {
    run(rec, "dropout", x, p, seed)
}

/// dx = mask * dy / (1 - p) with the forward's p and seed.
pub fn dropout_backward(rec: &mut Recorder<'_>, dy: &Tensor, p: f64, seed: u64) -> Result<Tensor> {
    run(rec, "dropout_backward", dy, p, seed)
}
