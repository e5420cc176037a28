//! Embedding: gather forward (f32 or f16 table), deterministic backward. Shader:
//! `embedding.wgsl` (the backward's counting-sort pipeline is described in its header).
//!
//! d out[n, :] / d table[v, :] = [ids[n] == v], so dtable[v] = sum of dout rows whose id is
//! v. Summing them in position order after a stable sort makes the result independent of
//! thread timing; long runs of one id are cut into segments summed in parallel.

use crate::error::{Error, Result};
use crate::gpu::{Binding::*, DType, Grid, Kernel, Recorder, Tensor};
use crate::shaders::EMBEDDING;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub n: u32,
    pub h: u32,
    pub v: u32,
    pub block: u32,
    pub blocks: u32,
    pub _pad: [u32; 3],
}

/// Positions per segment (`S` in the shader).
pub const SEGMENT: usize = 32;

// The table is bound twice, as f32s (2) and as packed f16 pairs (3); F16 picks the view.
static FWD: Kernel = Kernel::new(
    &EMBEDDING,
    "embed_fwd",
    &[
        (1, Read),
        (2, Read),
        (3, Read),
        (4, ReadWrite),
        (5, ReadWrite),
    ],
);
static COUNT: Kernel = Kernel::new(
    &EMBEDDING,
    "embed_count",
    &[(1, Read), (5, ReadWrite), (6, ReadWrite)],
);
static BLOCK_SCAN: Kernel = Kernel::new(
    &EMBEDDING,
    "embed_block_scan",
    &[(6, ReadWrite), (9, ReadWrite)],
);
static TILE_SUMS: Kernel = Kernel::new(
    &EMBEDDING,
    "embed_tile_sums",
    &[(9, ReadWrite), (15, ReadWrite)],
);
static TILE_SCAN: Kernel = Kernel::new(
    &EMBEDDING,
    "embed_tile_scan",
    &[
        (7, ReadWrite),
        (8, ReadWrite),
        (9, ReadWrite),
        (15, ReadWrite),
    ],
);
static SORT: Kernel = Kernel::new(
    &EMBEDDING,
    "embed_sort",
    &[(1, Read), (6, ReadWrite), (7, ReadWrite), (10, ReadWrite)],
);
static SEGMENTS: Kernel = Kernel::new(
    &EMBEDDING,
    "embed_segments",
    &[
        (7, ReadWrite),
        (8, ReadWrite),
        (9, ReadWrite),
        (11, ReadWrite),
    ],
);
static PARTIAL: Kernel = Kernel::new(
    &EMBEDDING,
    "embed_partial",
    &[
        (8, ReadWrite),
        (10, ReadWrite),
        (11, ReadWrite),
        (12, Read),
        (13, ReadWrite),
    ],
);
static REDUCE: Kernel = Kernel::new(
    &EMBEDDING,
    "embed_reduce",
    &[
        (7, ReadWrite),
        (8, ReadWrite),
        (10, ReadWrite),
        (12, Read),
        (13, ReadWrite),
        (14, ReadWrite),
        (16, Read),
    ],
);

/// Ids per scan tile (`TILE` in the shader).
const SCAN_TILE: usize = 1024;
/// Most sort blocks, and the most bytes their per-block histograms may take.
const MAX_BLOCKS: usize = 64;
const MAX_HIST_BYTES: usize = 64 << 20;

fn check_ids(op: &'static str, ids: &Tensor) -> Result<()> {
    if ids.dtype() != DType::U32 {
        return Err(Error::DType {
            op,
            got: ids.dtype(),
            expected: "u32 ids",
        });
    }
    Ok(())
}

fn table_dims(op: &'static str, table: &[usize]) -> Result<(usize, usize)> {
    match table {
        &[v, h] if v > 0 && h > 0 => Ok((v, h)),
        _ => Err(Error::Shape {
            op,
            detail: format!("table {table:?}, expected (vocab, hidden)"),
        }),
    }
}

/// out (ids..., H) f32 = table[ids]. An id >= V is reported as [`Error::IndexOutOfRange`]
/// when the submission finishes (its row reads as zeros).
pub fn embedding(rec: &mut Recorder<'_>, table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    check_ids("embedding", ids)?;
    let (v, h) = table_dims("embedding", table.shape())?;
    let f16 = match table.dtype() {
        DType::F32 => false,
        DType::F16 => true,
        d => {
            return Err(Error::DType {
                op: "embedding",
                got: d,
                expected: "f32 or f16 table",
            })
        }
    };
    let n = ids.numel();
    let mut shape = ids.shape().to_vec();
    shape.push(h);
    let out = Tensor::empty(rec.gpu(), &shape, DType::F32, "embedding.out")?;
    let flag = rec.index_check("embedding", ids, v as u32)?;
    let p = Params {
        n: n as u32,
        h: h as u32,
        v: v as u32,
        block: 0,
        blocks: 0,
        _pad: [0; 3],
    };
    let c = [("F16", f16 as u32 as f64)];
    rec.dispatch(
        &FWD,
        &c,
        bytemuck::bytes_of(&p),
        &[ids, table, table, &out, &flag],
        Grid::cover((n * h) as u64, 256),
    )?;
    Ok(out)
}

/// dtable (V, H) = scatter-add of dout (ids..., H) by id, as a new tensor.
pub fn embedding_backward(
    rec: &mut Recorder<'_>,
    ids: &Tensor,
    dout: &Tensor,
    vocab: usize,
) -> Result<Tensor> {
    let h = dout.shape().last().copied().unwrap_or(0);
    let dtable = Tensor::empty(rec.gpu(), &[vocab, h], DType::F32, "embedding.dtable")?;
    embedding_backward_into(rec, ids, dout, &dtable, false)?;
    Ok(dtable)
}

/// dtable (V, H) (+)= scatter-add of dout (ids..., H) by id; `accumulate` adds to the
/// existing gradient. Same bits on every run.
pub fn embedding_backward_into(
    rec: &mut Recorder<'_>,
    ids: &Tensor,
    dout: &Tensor,
    dtable: &Tensor,
    accumulate: bool,
) -> Result<()> {
    check_ids("embedding_backward", ids)?;
    super::expect_f32("embedding_backward", dout)?;
    super::expect_f32("embedding_backward", dtable)?;
    let (v, h) = table_dims("embedding_backward", dtable.shape())?;
    let n = ids.numel();
    if dout.shape() != [ids.shape(), &[h][..]].concat().as_slice() {
        return Err(Error::Shape {
            op: "embedding_backward",
            detail: format!(
                "dout {:?} vs ids {:?} and dtable {:?}",
                dout.shape(),
                ids.shape(),
                dtable.shape()
            ),
        });
    }
    let gpu = rec.gpu();
    let u32t = |len: usize, label| Tensor::empty(gpu, &[len.max(1)], DType::U32, label);
    // Sort blocks: up to 64 (fewer when the per-block histograms would be large), each a
    // multiple of 256 positions.
    let blocks = n
        .div_ceil(256)
        .min(MAX_BLOCKS)
        .min(MAX_HIST_BYTES / (4 * v))
        .max(1);
    let block = n.div_ceil(blocks).next_multiple_of(256).max(256);
    let blocks = n.div_ceil(block).max(1);
    let tiles = v.div_ceil(SCAN_TILE);
    let max_segs = (2 * n).div_ceil(SEGMENT);
    let hist = u32t(blocks * v, "embedding.hist")?;
    let counts = u32t(v, "embedding.counts")?;
    let tile_sums = u32t(2 * tiles, "embedding.tile_sums")?;
    let offsets = u32t(v + 1, "embedding.offsets")?;
    let seg_offsets = u32t(v + 1, "embedding.seg_offsets")?;
    let sorted = u32t(n, "embedding.sorted")?;
    let segs = u32t(2 * max_segs, "embedding.segs")?;
    let partial = Tensor::empty(gpu, &[max_segs.max(1), h], DType::F32, "embedding.partial")?;
    let flag = rec.index_check("embedding_backward", ids, v as u32)?;
    rec.clear(&hist);
    let p = Params {
        n: n as u32,
        h: h as u32,
        v: v as u32,
        block: block as u32,
        blocks: blocks as u32,
        _pad: [0; 3],
    };
    let pb = bytemuck::bytes_of(&p);
    let ids_grid = Grid::cover(n as u64, 256);
    let v_grid = Grid::cover(v as u64, 256);
    rec.dispatch(&COUNT, &[], pb, &[ids, &flag, &hist], ids_grid)?;
    rec.dispatch(&BLOCK_SCAN, &[], pb, &[&hist, &counts], v_grid)?;
    rec.dispatch(
        &TILE_SUMS,
        &[],
        pb,
        &[&counts, &tile_sums],
        Grid::Xyz([tiles as u32, 1, 1]),
    )?;
    rec.dispatch(
        &TILE_SCAN,
        &[],
        pb,
        &[&offsets, &seg_offsets, &counts, &tile_sums],
        Grid::Xyz([tiles as u32, 1, 1]),
    )?;
    rec.dispatch(
        &SORT,
        &[],
        pb,
        &[ids, &hist, &offsets, &sorted],
        Grid::Xyz([blocks as u32, 1, 1]),
    )?;
    rec.dispatch(
        &SEGMENTS,
        &[],
        pb,
        &[&offsets, &seg_offsets, &counts, &segs],
        v_grid,
    )?;
    rec.dispatch(
        &PARTIAL,
        &[],
        pb,
        &[&seg_offsets, &sorted, &segs, dout, &partial],
        Grid::Linear(max_segs as u64),
    )?;
    rec.dispatch(
        &REDUCE,
        &[("ACCUMULATE", accumulate as u32 as f64)],
        pb,
        &[
            &offsets,
            &seg_offsets,
            &sorted,
            dout,
            &partial,
            dtable,
            &counts,
        ],
        Grid::cover((v * h) as u64, 256),
    )
}
