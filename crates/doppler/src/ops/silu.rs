//! SiLU and SwiGLU (silu(a) * b), forward and backward. Shader: `silu.wgsl` (derivatives in
//! its header).

use super::expect_f32;
use crate::error::{Error, Result};
use crate::gpu::{Binding::*, DType, Grid, Kernel, Recorder, Tensor};
use crate::shaders::SILU;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub n: u32,
    pub _pad: [u32; 3],
}

static SILU_FWD: Kernel = Kernel::new(&SILU, "silu_fwd", &[(1, Read), (3, ReadWrite)]);
static SILU_BWD: Kernel = Kernel::new(&SILU, "silu_bwd", &[(1, Read), (4, Read), (5, ReadWrite)]);
static SWIGLU_FWD: Kernel =
    Kernel::new(&SILU, "swiglu_fwd", &[(1, Read), (2, Read), (3, ReadWrite)]);
static SWIGLU_BWD: Kernel = Kernel::new(
    &SILU,
    "swiglu_bwd",
    &[
        (1, Read),
        (2, Read),
        (4, Read),
        (5, ReadWrite),
        (6, ReadWrite),
    ],
);

fn same(op: &'static str, ts: &[&Tensor]) -> Result<Params> {
    for t in ts {
        expect_f32(op, t)?;
        if t.shape() != ts[0].shape() {
            return Err(Error::Shape {
                op,
                detail: format!("{:?} vs {:?}", ts[0].shape(), t.shape()),
            });
        }
    }
    Ok(Params {
        n: ts[0].numel() as u32,
        _pad: [0; 3],
    })
}

fn out(rec: &Recorder<'_>, like: &Tensor, label: &str) -> Result<Tensor> {
    Tensor::empty(rec.gpu(), like.shape(), DType::F32, label)
}

fn run(rec: &mut Recorder<'_>, k: &Kernel, p: Params, ts: &[&Tensor]) -> Result<()> {
    rec.dispatch(
        k,
        &[],
        bytemuck::bytes_of(&p),
        ts,
        Grid::cover(p.n as u64, 256),
    )
}

/// y = a * sigmoid(a)
pub fn silu(rec: &mut Recorder<'_>, a: &Tensor) -> Result<Tensor> {
    let p = same("silu", &[a])?;
    let y = out(rec, a, "silu.y")?;
    run(rec, &SILU_FWD, p, &[a, &y])?;
    Ok(y)
}

/// da = dy * silu'(a)
pub fn silu_backward(rec: &mut Recorder<'_>, a: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let p = same("silu_backward", &[a, dy])?;
    let da = out(rec, a, "silu.da")?;
    run(rec, &SILU_BWD, p, &[a, dy, &da])?;
    Ok(da)
}

/// y = silu(a) * b (the gated unit of Llama-style MLPs)
pub fn swiglu(rec: &mut Recorder<'_>, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let p = same("swiglu", &[a, b])?;
    let y = out(rec, a, "swiglu.y")?;
    run(rec, &SWIGLU_FWD, p, &[a, b, &y])?;
    Ok(y)
}

/// (da, db) from the forward's inputs and dy.
pub fn swiglu_backward(
    rec: &mut Recorder<'_>,
    a: &Tensor,
    b: &Tensor,
    dy: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let p = same("swiglu_backward", &[a, b, dy])?;
    let (da, db) = (out(rec, a, "swiglu.da")?, out(rec, a, "swiglu.db")?);
    run(rec, &SWIGLU_BWD, p, &[a, b, dy, &da, &db])?;
    Ok((da, db))
}
