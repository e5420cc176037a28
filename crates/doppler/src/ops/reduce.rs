//! Sum reductions in a fixed order. Shader: `reduce.wgsl`.
//! Derivative: d(sum_j x_ij) / dx_ij = 1, so the backward is a broadcast of g over the row.

use super::expect_f32;
use crate::error::{Error, Result};
use crate::gpu::{Binding::*, Grid, Kernel, Recorder, Tensor};
use crate::shaders::REDUCE;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub rows: u32,
    pub n: u32,
    pub chunks: u32,
    pub _pad: u32,
}

static SUM_ROWS: Kernel =
    Kernel::new(&REDUCE, "sum_rows", &[(1, Read), (2, ReadWrite)]);

/// Elements one workgroup sums per pass: WG (256) threads x ITEMS (16), as in the shader.
pub const CHUNK: usize = 256 * 16;

/// Sum over the last axis: x (..., n) -> (...). Each pass cuts n to ceil(n / CHUNK); the
/// partition depends only on the shape, so results are the same bits on every run.
pub fn sum_rows(rec: &mut Recorder<'_>, x: &Tensor) -> Result<Tensor> {
    expect_f32("sum_rows", x)?;
    let Some((&n, lead)) = x.shape().split_last() else {
        return Err(Error::Shape { op: "sum_rows", detail: "scalar input has no axis to sum".into() });
    };
    if n == 0 {
        return Err(Error::Shape { op: "sum_rows", detail: format!("{:?}: empty last axis", x.shape()) });
    }
    let rows: usize = lead.iter().product();
    let mut cur = x.clone();
    let mut len = n;
    loop {
        let chunks = len.div_ceil(CHUNK);
        let out = Tensor::empty(rec.gpu(), &[rows, chunks], x.dtype(), "sum_rows.out")?;
        let params = Params { rows: rows as u32, n: len as u32, chunks: chunks as u32, _pad: 0 };
        rec.dispatch(&SUM_ROWS, &[], bytemuck::bytes_of(&params), &[&cur, &out], Grid::Linear((rows * chunks) as u64))?;
        cur = out;
        len = chunks;
        if chunks == 1 {
            return cur.reshape(lead);
        }
    }
}

/// Sum of all elements, as a one-element tensor of shape [].
pub fn sum(rec: &mut Recorder<'_>, x: &Tensor) -> Result<Tensor> {
    sum_rows(rec, &x.reshape(&[x.numel()])?)
}
