//! Softmax over the last axis, forward and backward. Shader: `softmax.wgsl`.
//! d y_i / d x_j = y_i ([i == j] - y_j), so dx = y * (dy - sum(dy * y)): the backward needs
//! only the forward's output.

use super::expect_f32;
use crate::error::{Error, Result};
use crate::gpu::{Binding::*, DType, Grid, Kernel, Recorder, Tensor};
use crate::shaders::SOFTMAX;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub rows: u32,
    pub d: u32,
    pub _pad: [u32; 2],
}

static FWD: Kernel = Kernel::new(&SOFTMAX, "softmax_fwd", &[(1, Read), (2, ReadWrite)]);
static BWD: Kernel = Kernel::new(
    &SOFTMAX,
    "softmax_bwd",
    &[(3, Read), (4, Read), (5, ReadWrite)],
);

fn params(op: &'static str, x: &Tensor) -> Result<Params> {
    expect_f32(op, x)?;
    let d = x.shape().last().copied().unwrap_or(0);
    if d == 0 {
        return Err(Error::Shape {
            op,
            detail: format!("{:?}: no elements on the last axis", x.shape()),
        });
    }
    Ok(Params {
        rows: (x.numel() / d) as u32,
        d: d as u32,
        _pad: [0; 2],
    })
}

/// y = softmax(x) over the last axis.
pub fn softmax(rec: &mut Recorder<'_>, x: &Tensor) -> Result<Tensor> {
    let p = params("softmax", x)?;
    let y = Tensor::empty(rec.gpu(), x.shape(), DType::F32, "softmax.y")?;
    rec.dispatch(
        &FWD,
        &[],
        bytemuck::bytes_of(&p),
        &[x, &y],
        Grid::Linear(p.rows as u64),
    )?;
    Ok(y)
}

/// dx from the forward's output y and the upstream dy.
pub fn softmax_backward(rec: &mut Recorder<'_>, y: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let p = params("softmax_backward", y)?;
    expect_f32("softmax_backward", dy)?;
    if dy.shape() != y.shape() {
        return Err(Error::Shape {
            op: "softmax_backward",
            detail: format!("y {:?} vs dy {:?}", y.shape(), dy.shape()),
        });
    }
    let dx = Tensor::empty(rec.gpu(), y.shape(), DType::F32, "softmax.dx")?;
    rec.dispatch(
        &BWD,
        &[],
        bytemuck::bytes_of(&p),
        &[y, dy, &dx],
        Grid::Linear(p.rows as u64),
    )?;
    Ok(dx)
}
