//! Bias add over the last axis, and its gradient (a fixed-order column sum). Shader:
//! `bias.wgsl`. Derivatives of y = x + b: dx = dy, db = sum of dy over all leading axes.

use super::expect_f32;
use crate::error::{Error, Result};
use crate::gpu::{Binding::*, DType, Grid, Kernel, Recorder, Tensor};
use crate::shaders::BIAS;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub rows: u32,
    pub n: u32,
    pub chunks: u32,
    pub _pad: u32,
}

static ADD: Kernel = Kernel::new(&BIAS, "bias_add", &[(1, Read), (2, Read), (3, ReadWrite)]);
// The same on vec4 views (N a multiple of 4).
static ADD4: Kernel = Kernel::new(&BIAS, "bias_add4", &[(4, Read), (5, Read), (6, ReadWrite)]);
static GRAD: Kernel = Kernel::new(&BIAS, "bias_grad", &[(1, Read), (3, ReadWrite)]);
static GRAD4: Kernel = Kernel::new(&BIAS, "bias_grad4", &[(4, Read), (6, ReadWrite)]);

/// Rows one bias_grad workgroup sums (`ROWS` in the shader) and columns it covers (vec4
/// kernel: 4 x COLS).
const ROWS: usize = 128;
const COLS: usize = 64;

fn rows_n(op: &'static str, x: &Tensor, n: usize) -> Result<usize> {
    expect_f32(op, x)?;
    match x.shape().last() {
        Some(&last) if last == n && n > 0 => Ok(x.numel() / n),
        _ => Err(Error::Shape {
            op,
            detail: format!("x {:?}, bias of length {n}", x.shape()),
        }),
    }
}

/// y = x + b, b (N) broadcast over x (..., N).
pub fn bias_add(rec: &mut Recorder<'_>, x: &Tensor, b: &Tensor) -> Result<Tensor> {
    expect_f32("bias_add", b)?;
    if b.shape().len() != 1 {
        return Err(Error::Shape {
            op: "bias_add",
            detail: format!("bias {:?} must be 1-D", b.shape()),
        });
    }
    let n = b.numel();
    let rows = rows_n("bias_add", x, n)?;
    let y = Tensor::empty(rec.gpu(), x.shape(), DType::F32, "bias_add.y")?;
    let p = Params {
        rows: rows as u32,
        n: n as u32,
        chunks: 0,
        _pad: 0,
    };
    let (kernel, threads) = match n % 4 {
        0 => (&ADD4, x.numel() / 4),
        _ => (&ADD, x.numel()),
    };
    rec.dispatch(
        kernel,
        &[],
        bytemuck::bytes_of(&p),
        &[x, b, &y],
        Grid::cover(threads as u64, 256),
    )?;
    Ok(y)
}

/// db (N) = sum of dy (..., N) over its leading axes.
pub fn bias_add_backward(rec: &mut Recorder<'_>, dy: &Tensor) -> Result<Tensor> {
    let n = dy.shape().last().copied().unwrap_or(0);
    let mut rows = rows_n("bias_add_backward", dy, n)?;
    let mut cur = dy.clone();
    loop {
        let chunks = rows.div_ceil(ROWS);
        let out = Tensor::empty(rec.gpu(), &[chunks, n], DType::F32, "bias_add.db")?;
        let p = Params {
            rows: rows as u32,
            n: n as u32,
            chunks: chunks as u32,
            _pad: 0,
        };
        let (kernel, cols) = match n % 4 {
            0 => (&GRAD4, 4 * COLS),
            _ => (&GRAD, COLS),
        };
        let groups = (chunks * n.div_ceil(cols)) as u64;
        rec.dispatch(
            kernel,
            &[],
            bytemuck::bytes_of(&p),
            &[&cur, &out],
            Grid::Linear(groups),
        )?;
        if chunks == 1 {
            return out.reshape(&[n]);
        }
        cur = out;
        rows = chunks;
    }
}
