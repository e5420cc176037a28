//! Tokens chosen on the GPU from rows of logits: the greedy choice and the plain draw of
//! [`crate::infer::sample::Sampler`], the same bits (the draw's weights, sums and target are
//! integers: [`crate::infer::sample::draw_weight`]), so a batched step hands back a token a
//! row instead of the row's logits. Shader: `sample.wgsl`.

use super::expect_f32;
use crate::error::{Error, Result};
use crate::gpu::{Binding::*, DType, Gpu, Grid, Kernel, Recorder, Tensor};
use crate::infer::sample::{draw_table, DRAW_TABLE_LEN};
use crate::shaders::SAMPLE;

#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub rows: u32,
    pub vocab: u32,
    pub _pad: [u32; 2],
}

// logits (1), how each row is chosen (2), the draw's tables (3), the ids out (4).
static SAMPLE_ROWS: Kernel = Kernel::new(
    &SAMPLE,
    "sample_rows",
    &[(1, Read), (2, Read), (3, Read), (4, ReadWrite)],
);

/// How a row's token is chosen ([`sample_rows`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Pick {
    /// The largest finite logit, the lowest id among equal ones.
    Greedy,
    /// The draw at inverse temperature `inv` ([`crate::infer::sample::Sampler::inverse_temperature`])
    /// with the random number `r`.
    Draw { inv: f32, r: u64 },
    /// Not chosen here (the host takes the row's logits); its id is 0.
    Host,
}

impl Pick {
    /// The row's four words in `how` (mode, 1/T bits, r's low and high words).
    pub fn words(self) -> [u32; 4] {
        match self {
            Pick::Greedy => [0, 0, 0, 0],
            Pick::Draw { inv, r } => [1, inv.to_bits(), r as u32, (r >> 32) as u32],
            Pick::Host => [2, 0, 0, 0],
        }
    }
}

/// The draw's tables on the GPU ([`draw_table`]): made once, kept by the caller.
pub fn draw_tables(gpu: &Gpu) -> Result<Tensor> {
    Tensor::from_u32(gpu, &[DRAW_TABLE_LEN], draw_table(), "sample.tables")
}

/// ids (rows) u32: row r of `logits` (rows, V) chosen as `how` (u32 (rows, 4), each row
/// [`Pick::words`]) says, with `tables` from [`draw_tables`]; 0 for rows the host picks.
pub fn sample_rows(
    rec: &mut Recorder<'_>,
    logits: &Tensor,
    how: &Tensor,
    tables: &Tensor,
) -> Result<Tensor> {
    expect_f32("sample_rows", logits)?;
    let sh = logits.shape();
    let (rows, vocab) = match sh {
        [r, v] if *r > 0 && *v > 0 => (*r, *v),
        _ => {
            return Err(Error::Shape {
                op: "sample_rows",
                detail: format!("logits {sh:?}, expected (rows, vocabulary)"),
            })
        }
    };
    if how.dtype() != DType::U32
        || how.numel() != rows * 4
        || tables.dtype() != DType::U32
        || tables.numel() != DRAW_TABLE_LEN
    {
        return Err(Error::Shape {
            op: "sample_rows",
            detail: format!(
                "how {:?} {:?} for {rows} rows (u32, 4 a row), tables {:?} {:?} (u32, {DRAW_TABLE_LEN})",
                how.dtype(),
                how.shape(),
                tables.dtype(),
                tables.shape()
            ),
        });
    }
    let ids = Tensor::empty(rec.gpu(), &[rows], DType::U32, "sample.ids")?;
    let p = Params {
        rows: rows as u32,
        vocab: vocab as u32,
        ..Default::default()
    };
    rec.dispatch(
        &SAMPLE_ROWS,
        &[],
        bytemuck::bytes_of(&p),
        &[logits, how, tables, &ids],
        Grid::Linear(rows as u64),
    )?;
    Ok(ids)
}
