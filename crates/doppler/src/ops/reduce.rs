//! Reductions over the last axis in a fixed order: sums, and the argmax (greedy decoding
//! on the GPU). Shader: `reduce.wgsl`.
//! Derivative of the sum: d(sum_j x_ij) / dx_ij = 1, so the backward is a broadcast of g
//! over the row. The argmax has none (its output is an index).

use super::expect_f32;
use crate::error::{Error, Result};
use crate::gpu::{Binding::*, DType, Grid, Kernel, Recorder, Tensor};
use crate::shaders::REDUCE;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub rows: u32,
    pub n: u32,
    pub chunks: u32,
    pub _pad: u32,
}

static SUM_ROWS: Kernel = Kernel::new(&REDUCE, "sum_rows", &[(1, Read), (2, ReadWrite)]);

static ARGMAX_ROWS: Kernel = Kernel::new(&REDUCE, "argmax_rows", &[(1, Read), (3, ReadWrite)]);

/// Elements one workgroup sums per pass: WG (256) threads x ITEMS (16), as in the shader.
pub const CHUNK: usize = 256 * 16;

/// Sum over the last axis: x (..., n) -> (...). Each pass cuts n to ceil(n / CHUNK); the
/// partition depends only on the shape, so results are the same bits on every run.
pub fn sum_rows(rec: &mut Recorder<'_>, x: &Tensor) -> Result<Tensor> {
    expect_f32("sum_rows", x)?;
    let Some((&n, lead)) = x.shape().split_last() else {
        return Err(Error::Shape {
            op: "sum_rows",
            detail: "scalar input has no axis to sum".into(),
        });
    };
    if n == 0 {
        return Err(Error::Shape {
            op: "sum_rows",
            detail: format!("{:?}: empty last axis", x.shape()),
        });
    }
    let rows: usize = lead.iter().product();
    let mut cur = x.clone();
    let mut len = n;
    loop {
        let chunks = len.div_ceil(CHUNK);
        let out = Tensor::empty(rec.gpu(), &[rows, chunks], x.dtype(), "sum_rows.out")?;
        let params = Params {
            rows: rows as u32,
            n: len as u32,
            chunks: chunks as u32,
            _pad: 0,
        };
        rec.dispatch(
            &SUM_ROWS,
            &[],
            bytemuck::bytes_of(&params),
            &[&cur, &out],
            Grid::Linear((rows * chunks) as u64),
        )?;
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

/// Index of the largest finite value of each row: x (..., n) f32 -> (...) u32, the smallest
/// index on ties, 0 for a row without a finite value (the CPU sampler's greedy pick).
pub fn argmax_rows(rec: &mut Recorder<'_>, x: &Tensor) -> Result<Tensor> {
    let lead = x.shape().split_last().map_or(&[][..], |(_, l)| l);
    let out = Tensor::empty(rec.gpu(), lead, DType::U32, "argmax_rows.idx")?;
    argmax_rows_into(rec, x, &out)?;
    Ok(out)
}

/// [`argmax_rows`] written into `out` (u32, one element a row), e.g. the token ids the
/// next decode step reads.
pub fn argmax_rows_into(rec: &mut Recorder<'_>, x: &Tensor, out: &Tensor) -> Result<()> {
    expect_f32("argmax_rows", x)?;
    let Some((&n, lead)) = x.shape().split_last() else {
        return Err(Error::Shape {
            op: "argmax_rows",
            detail: "scalar input has no axis".into(),
        });
    };
    let rows: usize = lead.iter().product();
    if n == 0 || n > u32::MAX as usize {
        return Err(Error::Shape {
            op: "argmax_rows",
            detail: format!("{:?}: last axis of {n} elements", x.shape()),
        });
    }
    if out.dtype() != DType::U32 || out.numel() != rows {
        return Err(Error::Shape {
            op: "argmax_rows",
            detail: format!(
                "x {:?} needs a u32 output of {rows} elements, got {:?} {:?}",
                x.shape(),
                out.dtype(),
                out.shape()
            ),
        });
    }
    let params = Params {
        rows: rows as u32,
        n: n as u32,
        chunks: 1,
        _pad: 0,
    };
    rec.dispatch(
        &ARGMAX_ROWS,
        &[],
        bytemuck::bytes_of(&params),
        &[x, out],
        Grid::Linear(rows as u64),
    )
}
