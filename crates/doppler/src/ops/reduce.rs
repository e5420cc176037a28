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

static SUM_WORDS: Kernel = Kernel::new(
    &REDUCE,
    "sum_words",
    &[(4, Read), (5, Read), (6, Read), (7, ReadWrite)],
);

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

/// Most workgroups [`sum_words_into`] runs: its output holds this many words.
pub const WORDS_GROUPS: usize = 4096;

/// The wrapping sum of the first `a.1` bytes of buffer `a.0` and the first `b.1` of `b.0`
/// (u32 words; both counts multiples of 16), one partial a workgroup, plus `dep`'s first word in
/// each: `out[g] = dep[0] + (words group g read)`. Returns the number of groups G; summed
/// over them, `out` is `G * dep[0]` + every word (mod 2^32). A streaming reader that does
/// nothing else: `bench generate` chains it over a decode step's weights (each dispatch's
/// `dep` the `out` of the one before) for the floor of what the step's reads can take.
/// `dep` and `out` are u32 tensors, `out` of at least [`WORDS_GROUPS`] elements.
pub fn sum_words_into(
    rec: &mut Recorder<'_>,
    a: (&Tensor, u64),
    b: Option<(&Tensor, u64)>,
    dep: &Tensor,
    out: &Tensor,
) -> Result<usize> {
    let bad = |detail: String| {
        Err(Error::Shape {
            op: "sum_words",
            detail,
        })
    };
    for (t, bytes) in std::iter::once(a).chain(b) {
        if bytes % 16 != 0
            || bytes > t.byte_size()
            || t.byte_size() < 16
            || bytes / 16 > u32::MAX as u64
        {
            return bad(format!(
                "{bytes} bytes of a {}-byte buffer {:?}: whole 16-byte words of it, \
                 at least one in the buffer, under 2^32 of them",
                t.byte_size(),
                t.shape()
            ));
        }
    }
    if dep.dtype() != DType::U32
        || dep.numel() == 0
        || out.dtype() != DType::U32
        || out.numel() < WORDS_GROUPS
    {
        return bad(format!(
            "dep {:?} {:?} and out {:?} {:?}: u32, dep not empty, out of at least {WORDS_GROUPS}",
            dep.dtype(),
            dep.shape(),
            out.dtype(),
            out.shape()
        ));
    }
    let (na, nb) = (a.1 / 16, b.map_or(0, |b| b.1 / 16));
    let groups = (na + nb).div_ceil(256 * 4).clamp(1, WORDS_GROUPS as u64) as usize;
    let params = Params {
        rows: na as u32,
        n: nb as u32,
        chunks: groups as u32,
        _pad: 0,
    };
    // Without b, a stands in for its binding (no word of it is read).
    let bt = b.map_or(a.0, |b| b.0);
    rec.dispatch(
        &SUM_WORDS,
        &[],
        bytemuck::bytes_of(&params),
        &[a.0, bt, dep, out],
        Grid::Linear(groups as u64),
    )?;
    Ok(groups)
}
