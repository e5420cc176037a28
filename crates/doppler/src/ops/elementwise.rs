//! Elementwise f32 ops: add, mul, scale, softcap. Shader: `elementwise.wgsl`.
//! Forward only for now; the derivatives (d(a+b) = (g, g), d(a*b) = (g*b, g*a),
//! d(alpha*a) = alpha*g) are composed from these same kernels by the autograd tape.

use super::expect_f32;
use crate::error::{Error, Result};
use crate::gpu::{Binding::*, Grid, Kernel, Recorder, Tensor};
use crate::shaders::ELEMENTWISE;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub n: u32,
    pub alpha: f32,
    pub _pad: [u32; 2],
}

const WG: u64 = 256;
const SCALAR3: &[(u32, crate::gpu::Binding)] = &[(1, Read), (2, Read), (3, ReadWrite)];
const VEC3: &[(u32, crate::gpu::Binding)] = &[(4, Read), (5, Read), (6, ReadWrite)];
const SCALAR2: &[(u32, crate::gpu::Binding)] = &[(1, Read), (3, ReadWrite)];
const VEC2: &[(u32, crate::gpu::Binding)] = &[(4, Read), (6, ReadWrite)];

static ADD: Kernel = Kernel::new(&ELEMENTWISE, "add", SCALAR3);
static MUL: Kernel = Kernel::new(&ELEMENTWISE, "mul", SCALAR3);
static SCALE: Kernel = Kernel::new(&ELEMENTWISE, "scale", SCALAR2);
static ADD4: Kernel = Kernel::new(&ELEMENTWISE, "add4", VEC3);
static MUL4: Kernel = Kernel::new(&ELEMENTWISE, "mul4", VEC3);
static SCALE4: Kernel = Kernel::new(&ELEMENTWISE, "scale4", VEC2);
static SOFTCAP: Kernel = Kernel::new(&ELEMENTWISE, "softcap", SCALAR2);

/// Dispatches `scalar` or, when n % 4 == 0, its vec4 twin over `tensors`.
fn dispatch(
    rec: &mut Recorder<'_>,
    (scalar, vec4): (&Kernel, &Kernel),
    alpha: f32,
    tensors: &[&Tensor],
) -> Result<()> {
    let n = tensors[0].numel() as u64;
    let (kernel, items) = if n % 4 == 0 {
        (vec4, n / 4)
    } else {
        (scalar, n)
    };
    let params = Params {
        n: items as u32,
        alpha,
        _pad: [0; 2],
    };
    rec.dispatch(
        kernel,
        &[],
        bytemuck::bytes_of(&params),
        tensors,
        Grid::cover(items, WG),
    )
}

fn same_shape(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    expect_f32(op, a)?;
    expect_f32(op, b)?;
    if a.shape() != b.shape() {
        return Err(Error::Shape {
            op,
            detail: format!("a {:?} vs b {:?}", a.shape(), b.shape()),
        });
    }
    Ok(())
}

/// out = a + b, same shapes.
pub fn add(rec: &mut Recorder<'_>, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    same_shape("add", a, b)?;
    let out = Tensor::empty(rec.gpu(), a.shape(), a.dtype(), "add.out")?;
    dispatch(rec, (&ADD, &ADD4), 0.0, &[a, b, &out])?;
    Ok(out)
}

/// out = a * b, same shapes.
pub fn mul(rec: &mut Recorder<'_>, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    same_shape("mul", a, b)?;
    let out = Tensor::empty(rec.gpu(), a.shape(), a.dtype(), "mul.out")?;
    dispatch(rec, (&MUL, &MUL4), 0.0, &[a, b, &out])?;
    Ok(out)
}

/// out = alpha * a.
pub fn scale(rec: &mut Recorder<'_>, a: &Tensor, alpha: f32) -> Result<Tensor> {
    let out = Tensor::empty(rec.gpu(), a.shape(), a.dtype(), "scale.out")?;
    scale_into(rec, a, alpha, &out)?;
    Ok(out)
}

/// out = alpha * a into an existing tensor of the same shape.
pub fn scale_into(rec: &mut Recorder<'_>, a: &Tensor, alpha: f32, out: &Tensor) -> Result<()> {
    same_shape("scale", a, out)?;
    dispatch(rec, (&SCALE, &SCALE4), alpha, &[a, out])
}

/// out = cap * tanh(a / cap) (inference only: Gemma's final logit soft-capping), cap > 0.
pub fn softcap(rec: &mut Recorder<'_>, a: &Tensor, cap: f32) -> Result<Tensor> {
    expect_f32("softcap", a)?;
    if !(cap > 0.0 && cap.is_finite()) {
        return Err(Error::Invalid {
            op: "softcap",
            detail: format!("cap {cap} must be positive"),
        });
    }
    let out = Tensor::empty(rec.gpu(), a.shape(), a.dtype(), "softcap.out")?;
    let n = a.numel() as u64;
    let params = Params {
        n: n as u32,
        alpha: cap,
        _pad: [0; 2],
    };
    rec.dispatch(
        &SOFTCAP,
        &[],
        bytemuck::bytes_of(&params),
        &[a, &out],
        Grid::cover(n, WG),
    )?;
    Ok(out)
}
