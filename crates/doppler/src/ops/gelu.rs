//! GELU, exact (erf) and tanh-approximated, forward and backward. Shader: `gelu.wgsl`
//! (the derivative formulas are in its header).

use super::expect_f32;
use crate::error::{Error, Result};
use crate::gpu::{Binding::*, Grid, Kernel, Recorder, Tensor};
use crate::shaders::GELU;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub n: u32,
    pub _pad: [u32; 3],
}

/// PyTorch's `approximate='none'` and `approximate='tanh'`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GeluMode {
    #[default]
    Exact,
    Tanh,
}

static FWD: Kernel = Kernel::new(&GELU, "gelu_fwd", &[(1, Read), (3, ReadWrite)]);
static BWD: Kernel = Kernel::new(&GELU, "gelu_bwd", &[(1, Read), (2, Read), (3, ReadWrite)]);
// The same on vec4 views (n a multiple of 4).
static FWD4: Kernel = Kernel::new(&GELU, "gelu_fwd4", &[(4, Read), (6, ReadWrite)]);
static BWD4: Kernel = Kernel::new(&GELU, "gelu_bwd4", &[(4, Read), (5, Read), (6, ReadWrite)]);

/// One dispatch of `k` (or `k4` when n is a multiple of 4) over the first tensor's elements.
fn run(
    rec: &mut Recorder<'_>,
    [k, k4]: [&Kernel; 2],
    mode: GeluMode,
    tensors: &[&Tensor],
) -> Result<()> {
    let n = tensors[0].numel() as u64;
    let params = Params {
        n: n as u32,
        _pad: [0; 3],
    };
    let tanh = [("TANH", (mode == GeluMode::Tanh) as u32 as f64)];
    let (k, threads) = match n % 4 {
        0 => (k4, n / 4),
        _ => (k, n),
    };
    rec.dispatch(
        k,
        &tanh,
        bytemuck::bytes_of(&params),
        tensors,
        Grid::cover(threads, 256),
    )
}

/// y = gelu(x), any shape.
pub fn gelu(rec: &mut Recorder<'_>, x: &Tensor, mode: GeluMode) -> Result<Tensor> {
    expect_f32("gelu", x)?;
    let y = Tensor::empty(rec.gpu(), x.shape(), x.dtype(), "gelu.out")?;
    run(rec, [&FWD, &FWD4], mode, &[x, &y])?;
    Ok(y)
}

/// dx = dy * gelu'(x), from the forward's input x and the upstream gradient dy.
pub fn gelu_backward(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    dy: &Tensor,
    mode: GeluMode,
) -> Result<Tensor> {
    expect_f32("gelu_backward", x)?;
    expect_f32("gelu_backward", dy)?;
    if x.shape() != dy.shape() {
        return Err(Error::Shape {
            op: "gelu_backward",
            detail: format!("x {:?} vs dy {:?}", x.shape(), dy.shape()),
        });
    }
    let dx = Tensor::empty(rec.gpu(), x.shape(), x.dtype(), "gelu.dx")?;
    run(rec, [&BWD, &BWD4], mode, &[x, dy, &dx])?;
    Ok(dx)
}
