//! GGUF tensor types on the GPU: dequantization, row gathers (embeddings) and matrix
//! products that read the quantized blocks directly (no dequantized copy of a weight is
//! kept). Shader: `quant.wgsl` (block layouts in its header; the CPU oracle is
//! `reference::quant`).

use super::kvcache::{rope_store, AttnParts, RopeStore};
use super::rope::Pairing;
use crate::error::{Error, Result};
use crate::formats::gguf::GgmlType;
use crate::gpu::{Binding::*, DType, Gpu, Grid, Kernel, Recorder, Tensor};
use crate::shaders::{QUANT, QUANT_COOP};

#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub n: u32,
    pub m: u32,
    pub k: u32,
    /// RMSNorm epsilon of a fused product (f32 bits).
    pub eps: u32,
    /// MERGE: head size and key ranges of the attention parts x holds.
    pub d: u32,
    pub splits: u32,
    /// ROPE: position of the first row of x, query heads.
    pub pos: u32,
    pub heads: u32,
}

static DEQUANT: Kernel = Kernel::new(&QUANT, "dequantize", &[(1, Read), (2, ReadWrite)]);
// W (1, and as 16-byte words 13), out (2).
static DEQUANT_RUNS: Kernel = Kernel::new(
    &QUANT,
    "dequantize_runs",
    &[(1, Read), (2, ReadWrite), (13, Read)],
);
/// Types the cooperative product decodes a run of 32 at a time from the run's raw words
/// (`quant_blocks.wgsl`'s RAW); [`dequantize_runs`] checks that decoding.
pub const RAW_TYPES: &[&str] = &["Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q6_K"];
static GET_ROWS: Kernel = Kernel::new(&QUANT, "get_rows", &[(1, Read), (2, ReadWrite), (4, Read)]);
// Products bind the norm weight (5) and the residual (6) always (x stands in when unused),
// x and the norm weight again as vec4s (7, 8), and the matrix-vector ones W as 16-byte
// words (13).
const MATVEC_BINDINGS: &[(u32, crate::gpu::Binding)] = &[
    (1, Read),
    (2, ReadWrite),
    (3, Read),
    (5, Read),
    (6, Read),
    (7, Read),
    (8, Read),
    (13, Read),
];
static QMATVEC: Kernel = Kernel::new(&QUANT, "qmatvec", MATVEC_BINDINGS);
static QMATVEC1: Kernel = Kernel::new(&QUANT, "qmatvec1", MATVEC_BINDINGS);
static QMATVEC_ROWS: Kernel = Kernel::new(&QUANT, "qmatvec_rows", MATVEC_BINDINGS);
// The products with RoPE and the cache store (no residual): bias (9), RoPE table (10),
// key and value caches (11, 12); dst (2) gets q.
const ROPE_BINDINGS: &[(u32, crate::gpu::Binding)] = &[
    (1, Read),
    (2, ReadWrite),
    (3, Read),
    (5, Read),
    (7, Read),
    (8, Read),
    (9, Read),
    (10, Read),
    (11, ReadWrite),
    (12, ReadWrite),
    (13, Read),
];
static QMATVEC_ROPE: Kernel = Kernel::new(&QUANT, "qmatvec_rope", ROPE_BINDINGS);
// `qmatvec_rows_rope`: the same and the paged rows' positions and page lists (4).
const ROWS_ROPE_BINDINGS: &[(u32, crate::gpu::Binding)] = &[
    (1, Read),
    (2, ReadWrite),
    (3, Read),
    (4, Read),
    (5, Read),
    (7, Read),
    (8, Read),
    (9, Read),
    (10, Read),
    (11, ReadWrite),
    (12, ReadWrite),
    (13, Read),
];
static QMATVEC_ROWS_ROPE: Kernel = Kernel::new(&QUANT, "qmatvec_rows_rope", ROWS_ROPE_BINDINGS);
static QMATVEC1_ROPE: Kernel = Kernel::new(&QUANT, "qmatvec1_rope", ROPE_BINDINGS);
// The tiled product: the matrix-vector ones' bindings but W as 16-byte words.
static QMATMUL: Kernel = Kernel::new(&QUANT, "qmatmul", MATVEC_BINDINGS.split_at(7).0);
// W untransposed (the backward's dX = dY W): W, dX, dY and the running sum (residual).
static QMATMUL_T: Kernel = Kernel::new(
    &QUANT,
    "qmatmul_t",
    &[(1, Read), (2, ReadWrite), (3, Read), (6, Read)],
);

// The decode product on x rounded (XQ8) that can also round its output (X8_OUT): x's words
// (3, 7), the next norm's weight (5), the residual (6), the rounded output (14).
static QMATVEC1_X8: Kernel = Kernel::new(
    &QUANT,
    "qmatvec1_x8",
    &[
        (1, Read),
        (2, ReadWrite),
        (3, Read),
        (5, Read),
        (6, Read),
        (7, Read),
        (13, Read),
        (14, ReadWrite),
    ],
);
// Batched decode: up to 8 rows of x rounded (qmatvec1_x8's bindings but xq_out).
static QMATVEC_X8ROWS: Kernel = Kernel::new(
    &QUANT,
    "qmatvec_x8rows",
    &[
        (1, Read),
        (2, ReadWrite),
        (3, Read),
        (5, Read),
        (6, Read),
        (7, Read),
        (13, Read),
    ],
);

// x rounded for the XQ8 decode products: x as vec4s (7), the norm weight as vec4s (8), out (14).
static QUANTIZE_X8: Kernel = Kernel::new(
    &QUANT,
    "quantize_x8",
    &[(7, Read), (8, Read), (14, ReadWrite)],
);

/// `quant_coop.wgsl`'s parameter block.
#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct CoopParams {
    /// Outputs a row of x (rows of W, or half of them with SWIGLU).
    pub n: u32,
    /// Rows of x.
    pub m: u32,
    /// Row length.
    pub k: u32,
    /// SPLITK: slices of k.
    pub splits: u32,
}

// Rows of x (times the norm) into f16 for the cooperative product (`quant.wgsl`): x and
// the norm weight as vec4s (7, 8), the rows' factors (2) and the halves (14) out.
static X_HALF: Kernel = Kernel::new(
    &QUANT,
    "x_half",
    &[(2, ReadWrite), (7, Read), (8, Read), (14, ReadWrite)],
);
const COOP_FEATURES: wgpu::Features =
    wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX.union(wgpu::Features::SHADER_F16);
// The product on cooperative matrices: W, y, xh, the rows' factors, the residual, W
// again as 16-byte words.
static QMATMUL_COOP: Kernel = Kernel {
    shader: &QUANT_COOP,
    entry: "qmatmul_coop",
    storage: &[
        (1, Read),
        (2, ReadWrite),
        (3, Read),
        (4, Read),
        (5, Read),
        (13, Read),
    ],
    features: COOP_FEATURES,
};
// The same for few rows of x (tiles of 16 to 64 rows).
static QMATMUL_COOP_SKINNY: Kernel = Kernel {
    shader: &QUANT_COOP,
    entry: "qmatmul_coop_skinny",
    storage: QMATMUL_COOP.storage,
    features: COOP_FEATURES,
};
/// Output tile of `qmatmul_coop` (rows and columns).
const COOP_TILE: usize = 128;

// act(gate) * up from the cooperative product's (m, 2n) output: y (2), the product (3).
static GLU_ROWS: Kernel = Kernel::new(&QUANT, "glu_rows", &[(2, ReadWrite), (3, Read)]);
// glu_rows and x_half (no norm) in one pass: the rows' factors (2), the product (3), the
// halves (14) and act(gate) * up (15) out.
static GLU_HALF: Kernel = Kernel::new(
    &QUANT,
    "glu_half",
    &[(2, ReadWrite), (3, Read), (14, ReadWrite), (15, ReadWrite)],
);
static SPLITK_SUM: Kernel = Kernel::new(
    &QUANT,
    "splitk_sum",
    &[(2, ReadWrite), (3, Read), (6, Read)],
);
// splitk_sum with the residual and x_half with a norm in one pass: the rows' factors (2),
// the residual (6), the partials as vec4s (7), the norm weight (8), the halves (14) and
// y (15) out.
static X_HALF_SUM: Kernel = Kernel::new(
    &QUANT,
    "x_half_sum",
    &[
        (2, ReadWrite),
        (6, Read),
        (7, Read),
        (8, Read),
        (14, ReadWrite),
        (15, ReadWrite),
    ],
);

/// Workgroups the tiled product aims for when its output has few tiles (two per core of a
/// large GPU: the H200 has 132), by splitting k into slices of at least
/// [`SLICE_MIN_COLS`] columns, at most [`MAX_SPLITS`] of them.
const SPLITK_TARGET: usize = 256;
const SLICE_MIN_COLS: usize = 128;
const MAX_SPLITS: usize = 8;

/// Slices of k for a tiled product of `tiles` output tiles over `k` columns (1: no split).
fn split_k(tiles: usize, k: usize) -> usize {
    split_k_to(SPLITK_TARGET, tiles, k)
}

/// The cooperative product's [`SPLITK_TARGET`]: its workgroups (128 x 128 tiles, 4
/// subgroups each) want ~4 a core of the H200 (the 8B's o, down and q/k/v over 512 tokens:
/// 52.4 ms a prefill unsplit, 41.5 split to reach 512 workgroups, 48.8 to reach 1024).
const COOP_SPLITK_TARGET: usize = 512;

/// Workgroups an invariant cooperative product keeps at least when it takes tiles of more
/// than 16 rows (one for each of the H200's 132 SMs: at 264 the 8B's gate/up product, 224
/// workgroups of 32 rows, stayed at 16-row tiles and its 32-row step took 23.8 ms, not
/// 16.7).
const INVARIANT_BUSY: usize = 132;

fn split_k_to(target: usize, tiles: usize, k: usize) -> usize {
    split_k_max(target, tiles, k, MAX_SPLITS)
}

/// [`split_k_to`] with at most `max` slices.
fn split_k_max(target: usize, tiles: usize, k: usize, max: usize) -> usize {
    if tiles * 2 >= target {
        return 1;
    }
    target
        .div_ceil(tiles)
        .min(k / SLICE_MIN_COLS)
        .clamp(1, max.max(1))
}

/// How the skinny cooperative product (`qmatmul_coop_skinny`, batched decode steps) is
/// laid out, for measuring the choices on a GPU: k a step (`DOPPLER_SKINNY_BK`: 32, 64
/// or 128; default 32), the tile's columns (`DOPPLER_SKINNY_N`: 32, 64 or 128, one
/// thread a column; default 128; below 128 the step stays at 32 k) and, for invariant
/// products, the workgroups split k aims for and the most slices
/// (`DOPPLER_INVARIANT_SPLITS=TARGET,MAX[,glu]`; default 512,8, as [`COOP_SPLITK_TARGET`]
/// and [`MAX_SPLITS`]; `glu`: the gate/up product split too). Read once a process.
/// Results are the same bits at every step size and tile width (the split is still
/// chosen by 128-column tiles); the split changes an invariant product's slices of k (the
/// same for every batch size, so still batch-invariant). On an H100 no other step, split
/// or tile width beat the defaults (docs/benchmarks.md, sessions 30 and 32: 64 columns
/// as fast as 128, 32 columns 1.8x slower).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SkinnyLayout {
    pub bk: usize,
    /// Columns of W a workgroup (threads).
    pub n: usize,
    pub split_target: usize,
    pub split_max: usize,
    /// Whether an invariant gate/up product (SwiGLU / GeGLU) splits k too, its slices
    /// summed where the GLU is applied (`glu_rows`, `glu_half`).
    pub split_glu: bool,
}

impl Default for SkinnyLayout {
    fn default() -> Self {
        SkinnyLayout {
            bk: 32,
            n: COOP_TILE,
            split_target: COOP_SPLITK_TARGET,
            split_max: MAX_SPLITS,
            split_glu: false,
        }
    }
}

impl SkinnyLayout {
    /// From the environment (see the type), warning about and ignoring bad values.
    pub fn from_env() -> SkinnyLayout {
        let var = |name| std::env::var(name).ok();
        let (bk, n) = (var("DOPPLER_SKINNY_BK"), var("DOPPLER_SKINNY_N"));
        let splits = var("DOPPLER_INVARIANT_SPLITS");
        SkinnyLayout::parse(bk.as_deref(), n.as_deref(), splits.as_deref())
    }

    /// From the three variables' values (see the type).
    pub fn parse(bk: Option<&str>, n: Option<&str>, splits: Option<&str>) -> SkinnyLayout {
        let mut l = SkinnyLayout::default();
        if let Some(v) = bk {
            match v.trim().parse() {
                Ok(bk @ (32 | 64 | 128)) => l.bk = bk,
                _ => tracing::warn!("DOPPLER_SKINNY_BK={v:?} is not 32, 64 or 128: 32"),
            }
        }
        if let Some(v) = n {
            match v.trim().parse() {
                Ok(n @ (32 | 64 | 128)) => l.n = n,
                _ => tracing::warn!("DOPPLER_SKINNY_N={v:?} is not 32, 64 or 128: 128"),
            }
        }
        if let Some(v) = splits {
            let parts: Vec<&str> = v.split(',').map(str::trim).collect();
            let parsed = match parts[..] {
                [t, m] => Some((t.parse().ok(), m.parse().ok(), false)),
                [t, m, "glu"] => Some((t.parse().ok(), m.parse().ok(), true)),
                _ => None,
            };
            match parsed {
                Some((Some(t), Some(m), glu)) if t >= 1 && (1..=64).contains(&m) => {
                    (l.split_target, l.split_max, l.split_glu) = (t, m, glu)
                }
                _ => tracing::warn!(
                    "DOPPLER_INVARIANT_SPLITS={v:?} is not TARGET,MAX[,glu] (MAX 1 to 64): 512,8"
                ),
            }
        }
        l
    }

    /// This process's layout ([`SkinnyLayout::from_env`], read once).
    pub fn get() -> SkinnyLayout {
        static LAYOUT: std::sync::OnceLock<SkinnyLayout> = std::sync::OnceLock::new();
        *LAYOUT.get_or_init(SkinnyLayout::from_env)
    }

    /// Slices of k of an invariant product of `gn` tiles of 128 columns over `k`.
    fn invariant_splits(&self, gn: usize, k: usize) -> usize {
        split_k_max(self.split_target, gn, k, self.split_max)
    }
}

/// k a step of `qmatmul_coop_skinny` with tiles of 16 `sk_r` rows: `want` (32, 64 or 128)
/// or the largest below it whose staging fits in `limit` bytes of workgroup memory (the
/// H200 has 48 KiB: 128 k with 64-row tiles takes 59 KiB). Any step gives the same bits
/// (slices of k in whole 32s), so it may follow the tile.
fn skinny_bk(want: usize, sk_r: usize, limit: u32) -> usize {
    let bytes = |bk: usize| (16 * sk_r + 128) * (bk / 4 + 2) * 8 + 4096;
    [128, 64]
        .into_iter()
        .find(|&bk| bk <= want && bytes(bk) <= limit as usize)
        .unwrap_or(32)
}

/// Rows of x up to which [`qmatmul`] runs the matrix-vector kernel (it reads W once per 8
/// rows; the tiled kernel computes 64-row tiles).
pub const MATVEC_MAX_ROWS: usize = 32;

/// Rows of W from which one row of x runs the decode kernel `qmatvec1` (32 rows of W a
/// workgroup): below, it would leave a large GPU's cores idle (measured on the H200:
/// faster from 6144 rows, slower at 4096), and the 8-rows-a-workgroup kernel runs.
pub const MATVEC1_MIN_ROWS: usize = 5120;

/// Columns of W from which one row of x with fewer than [`MATVEC1_MIN_ROWS`] rows of W
/// runs `qmatvec1` with each workgroup's 256 threads splitting k over 4 rows of W (the
/// 8B's 4096 x 4096 and 4096 x 14336 products), not 8 rows a workgroup with 32 threads on
/// each row's k.
pub const SPLITK_MIN_COLS: usize = 4096;

/// Types the kernel decodes.
pub const SUPPORTED: &[&str] = &[
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
];

/// Bytes of a Q6_K block as the file stores it and as the GPU holds it: 210-byte blocks
/// are padded to 224 on upload, so that every block starts on a 16-byte boundary and the
/// kernels read its quants, scales and d as 16-byte words, not byte by byte (the 8B's
/// Q6_K output head on the H200: 0.43 -> 0.14 ms a token, 1.0 -> 3.2 TB/s).
const Q6K_FILE_BYTES: usize = 210;
const Q6K_GPU_BYTES: usize = 224;

/// A block of `ty` in GPU memory: (elements, bytes).
fn gpu_block(ty: GgmlType) -> (usize, usize) {
    if ty.name() == "Q6_K" {
        return (256, Q6K_GPU_BYTES);
    }
    ty.block()
        .map_or((1, 1), |(per, bytes)| (per as usize, bytes as usize))
}

/// Blocks of type `ty` (a GGUF tensor's bytes, whole blocks) into the u32 tensor the
/// kernels read: the bytes as they are, except Q6_K's blocks, each padded with zeros to
/// 224 bytes (see `quant.wgsl`).
pub fn upload_blocks(
    gpu: &crate::gpu::Gpu,
    bytes: &[u8],
    ty: GgmlType,
    label: &str,
) -> Result<Tensor> {
    if ty.name() != "Q6_K" {
        return Tensor::from_raw_bytes(gpu, bytes, label);
    }
    if bytes.len() % Q6K_FILE_BYTES != 0 {
        return Err(Error::Invalid {
            op: "upload_blocks",
            detail: format!(
                "{label}: {} bytes are not whole Q6_K blocks of {Q6K_FILE_BYTES}",
                bytes.len()
            ),
        });
    }
    let mut padded = Vec::with_capacity(bytes.len() / Q6K_FILE_BYTES * Q6K_GPU_BYTES);
    for block in bytes.chunks_exact(Q6K_FILE_BYTES) {
        padded.extend_from_slice(block);
        padded.resize(padded.len() + Q6K_GPU_BYTES - Q6K_FILE_BYTES, 0);
    }
    Tensor::from_raw_bytes(gpu, &padded, label)
}

/// `n` elements of type `ty` from `raw` (the blocks as [`upload_blocks`] puts them on the
/// GPU) into a new f32 tensor of shape `shape`.
pub fn dequantize(
    rec: &mut Recorder<'_>,
    raw: &Tensor,
    ty: GgmlType,
    shape: &[usize],
) -> Result<Tensor> {
    dequantize_with(rec, raw, ty, shape, false)
}

/// [`dequantize`] of a [`RAW_TYPES`] tensor by the run decoding the cooperative-matrix
/// product reads W with (`quant_blocks.wgsl`'s fetch_raw and raw_value4), a run of 32
/// values a thread: what `doppler verify` checks that decoding with on any adapter.
pub fn dequantize_runs(
    rec: &mut Recorder<'_>,
    raw: &Tensor,
    ty: GgmlType,
    shape: &[usize],
) -> Result<Tensor> {
    if !RAW_TYPES.contains(&ty.name()) {
        return Err(Error::Invalid {
            op: "dequantize_runs",
            detail: format!(
                "{} is not decoded in runs (those are {RAW_TYPES:?})",
                ty.name()
            ),
        });
    }
    dequantize_with(rec, raw, ty, shape, true)
}

fn dequantize_with(
    rec: &mut Recorder<'_>,
    raw: &Tensor,
    ty: GgmlType,
    shape: &[usize],
    runs: bool,
) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let bad = |detail: String| {
        Err(Error::Invalid {
            op: "dequantize",
            detail,
        })
    };
    if !SUPPORTED.contains(&ty.name()) {
        return bad(format!(
            "tensor type {} ({}) has no GPU dequantizer",
            ty.name(),
            ty.0
        ));
    }
    let (per, bytes) = gpu_block(ty);
    if raw.dtype() != DType::U32 || n % per != 0 || raw.numel() * 4 < n / per * bytes {
        return bad(format!(
            "{n} elements of {} need {} bytes; raw tensor {:?} {:?}",
            ty.name(),
            n / per * bytes,
            raw.dtype(),
            raw.shape()
        ));
    }
    let y = Tensor::empty(rec.gpu(), shape, DType::F32, "dequantize.y")?;
    let p = Params {
        n: n as u32,
        ..Default::default()
    };
    let c = [("TYPE", ty.0 as f64)];
    let pb = bytemuck::bytes_of(&p);
    match runs {
        true => {
            let grid = Grid::cover((n / 32) as u64, 256);
            rec.dispatch(&DEQUANT_RUNS, &c, pb, &[raw, &y, raw], grid)?
        }
        false => rec.dispatch(&DEQUANT, &c, pb, &[raw, &y], Grid::cover(n as u64, 256))?,
    }
    Ok(y)
}

/// A matrix W (rows, cols) kept in its file's encoding on the GPU: `raw` holds the blocks
/// as u32 words, row after row (GGUF's `[cols, rows]`, innermost first).
#[derive(Clone)]
pub struct QMatrix {
    pub raw: Tensor,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
}

impl QMatrix {
    /// Checks the type, that rows are whole blocks, and that `bytes` holds them all.
    pub fn new(
        gpu: &crate::gpu::Gpu,
        name: &str,
        bytes: &[u8],
        ty: GgmlType,
        rows: usize,
        cols: usize,
    ) -> Result<QMatrix> {
        let bad = |detail: String| {
            Err(Error::Invalid {
                op: "qmatrix",
                detail: format!("{name}: {detail}"),
            })
        };
        if !SUPPORTED.contains(&ty.name()) {
            return bad(format!(
                "tensor type {} ({}) is not supported (supported: {})",
                ty.name(),
                ty.0,
                SUPPORTED.join(", ")
            ));
        }
        let (per, block) = ty
            .block()
            .map(|(a, b)| (a as usize, b as usize))
            .unwrap_or((1, 1));
        if cols % per != 0 {
            return bad(format!(
                "rows of {cols} elements are not whole {} blocks of {per}",
                ty.name()
            ));
        }
        let need = rows * (cols / per) * block;
        if bytes.len() != need {
            return bad(format!(
                "({rows}, {cols}) {} needs {need} bytes, got {}",
                ty.name(),
                bytes.len()
            ));
        }
        let raw = upload_blocks(gpu, bytes, ty, name)?;
        Ok(QMatrix {
            raw,
            ty,
            rows,
            cols,
        })
    }

    /// Bytes of the matrix as the file stores it.
    pub fn file_bytes(&self) -> u64 {
        let (per, block) = self.ty.block().unwrap_or((1, 1));
        (self.rows * self.cols) as u64 / per * block
    }

    fn params(&self, m: usize) -> Params {
        Params {
            n: self.rows as u32,
            m: m as u32,
            k: self.cols as u32,
            ..Default::default()
        }
    }

    /// One matrix of these stacked row-wise (all of one type and width), e.g. q, k and v.
    pub fn stacked(
        gpu: &crate::gpu::Gpu,
        name: &str,
        parts: &[(&[u8], GgmlType, usize)],
        cols: usize,
    ) -> Result<QMatrix> {
        let ty = parts.first().map(|p| p.1).ok_or_else(|| Error::Invalid {
            op: "qmatrix",
            detail: format!("{name}: nothing to stack"),
        })?;
        if let Some(p) = parts.iter().find(|p| p.1 != ty) {
            return Err(Error::Invalid {
                op: "qmatrix",
                detail: format!(
                    "{name}: parts of types {} and {} cannot be stacked",
                    ty.name(),
                    p.1.name()
                ),
            });
        }
        let bytes: Vec<u8> = parts.iter().flat_map(|p| p.0.iter().copied()).collect();
        QMatrix::new(gpu, name, &bytes, ty, parts.iter().map(|p| p.2).sum(), cols)
    }
}

/// Rows `ids` (T) of the table W (rows, cols) as f32 (T, cols): an embedding lookup.
/// Ids must be < rows (checked by the caller, which knows where they came from).
pub fn get_rows(rec: &mut Recorder<'_>, w: &QMatrix, ids: &Tensor) -> Result<Tensor> {
    let y = gather_out(rec, ids, w.cols)?;
    // The whole table: ids past it read as zeros.
    gather(rec, w, ids, &y, 0, true)?;
    Ok(y)
}

/// The (T, cols) output of a row gather of `ids` (u32, (T)), or an error.
fn gather_out(rec: &mut Recorder<'_>, ids: &Tensor, cols: usize) -> Result<Tensor> {
    if ids.dtype() != DType::U32 || ids.shape().len() != 1 {
        return Err(Error::Shape {
            op: "get_rows",
            detail: format!("ids {:?} {:?}, expected u32 (T)", ids.dtype(), ids.shape()),
        });
    }
    Tensor::empty(rec.gpu(), &[ids.shape()[0], cols], DType::F32, "get_rows.y")
}

/// Writes the rows of `ids` that `w` holds (rows row0.. of a table) into `y`; with `last`,
/// zeros for ids past the table.
fn gather(
    rec: &mut Recorder<'_>,
    w: &QMatrix,
    ids: &Tensor,
    y: &Tensor,
    row0: usize,
    last: bool,
) -> Result<()> {
    let t = ids.shape()[0];
    let mut p = w.params(t);
    p.pos = row0 as u32;
    p.heads = last as u32;
    rec.dispatch(
        &GET_ROWS,
        &[("TYPE", w.ty.0 as f64)],
        bytemuck::bytes_of(&p),
        &[&w.raw, y, ids],
        Grid::cover((t * w.cols) as u64, 256),
    )
}

/// A matrix as consecutive ranges of rows, each in its own buffer: what one storage
/// binding cannot hold (Gemma 3's embedding of 262,144 rows is 178 MB in Q8_0, past
/// WebGPU's default binding limit of 128 MiB), else one part. Row gathers and products
/// run part by part.
#[derive(Clone)]
pub struct RowSplit {
    /// (first row, the part).
    pub parts: Vec<(usize, QMatrix)>,
    pub rows: usize,
    pub cols: usize,
}

impl RowSplit {
    /// `bytes` of `rows` rows of type `ty`, in parts no larger than the adapter's storage
    /// binding allows (3/4 of it: room for a type's padding on the GPU).
    pub fn new(
        gpu: &crate::gpu::Gpu,
        name: &str,
        bytes: &[u8],
        ty: GgmlType,
        rows: usize,
        cols: usize,
    ) -> Result<RowSplit> {
        let limit = (gpu.limits.max_storage_buffer_binding_size / 4 * 3) as usize;
        Self::with_part_bytes(gpu, name, bytes, ty, rows, cols, limit)
    }

    /// [`RowSplit::new`] with parts of at most `limit` bytes (checks split small tables).
    pub fn with_part_bytes(
        gpu: &crate::gpu::Gpu,
        name: &str,
        bytes: &[u8],
        ty: GgmlType,
        rows: usize,
        cols: usize,
        limit: usize,
    ) -> Result<RowSplit> {
        let row_bytes = match rows {
            0 => 0,
            _ => bytes.len() / rows,
        };
        if rows == 0 || row_bytes == 0 || row_bytes * rows != bytes.len() || row_bytes > limit {
            // One part: QMatrix::new names what is wrong (sizes, or one row too large).
            let m = QMatrix::new(gpu, name, bytes, ty, rows, cols)?;
            return Ok(RowSplit {
                parts: vec![(0, m)],
                rows,
                cols,
            });
        }
        let per = (limit / row_bytes).max(1);
        let mut parts = Vec::with_capacity(rows.div_ceil(per));
        for r0 in (0..rows).step_by(per) {
            let n = per.min(rows - r0);
            let b = &bytes[r0 * row_bytes..(r0 + n) * row_bytes];
            parts.push((r0, QMatrix::new(gpu, name, b, ty, n, cols)?));
        }
        Ok(RowSplit { parts, rows, cols })
    }

    /// A matrix as one part.
    pub fn whole(m: &QMatrix) -> RowSplit {
        RowSplit {
            parts: vec![(0, m.clone())],
            rows: m.rows,
            cols: m.cols,
        }
    }

    /// The matrix when it is one part.
    pub fn single(&self) -> Option<&QMatrix> {
        match self.parts.as_slice() {
            [(_, m)] => Some(m),
            _ => None,
        }
    }

    /// Bytes as the file stores them.
    pub fn file_bytes(&self) -> u64 {
        self.parts.iter().map(|(_, m)| m.file_bytes()).sum()
    }

    /// Rows `ids` (u32, (T)) as f32 (T, cols): each part writes the rows it holds.
    pub fn get_rows(&self, rec: &mut Recorder<'_>, ids: &Tensor) -> Result<Tensor> {
        let y = gather_out(rec, ids, self.cols)?;
        for (i, (r0, w)) in self.parts.iter().enumerate() {
            // The last part writes zeros for ids past the table.
            gather(rec, w, ids, &y, *r0, i + 1 == self.parts.len())?;
        }
        Ok(y)
    }

    /// x (T, cols) @ W^T (T, rows) with `fuse`'s norm (and x8 when one part): each part's
    /// product, its columns copied into place.
    pub fn product(&self, rec: &mut Recorder<'_>, x: &Tensor, fuse: Fuse<'_>) -> Result<Tensor> {
        if let Some(w) = self.single() {
            return qmatmul_fused(rec, x, w, fuse);
        }
        let t = x.numel() / self.cols.max(1);
        let mut out_shape = x.shape().to_vec();
        if let Some(l) = out_shape.last_mut() {
            *l = self.rows;
        }
        let y = Tensor::empty(rec.gpu(), &out_shape, DType::F32, "qmatmul.y")?;
        let part_fuse = Fuse {
            norm: fuse.norm,
            invariant: fuse.invariant,
            ..Default::default()
        };
        for (r0, w) in &self.parts {
            let yp = qmatmul_fused(rec, x, w, part_fuse)?;
            for r in 0..t {
                rec.copy_elements(&yp, r * w.rows, &y, r * self.rows + r0, w.rows)?;
            }
        }
        Ok(y)
    }
}

impl RowSplit {
    /// dy (.., rows) @ W (rows, cols): each part's rows of dy times the part, summed in
    /// part order ([`qmatmul_t`] for a table split by rows).
    pub fn product_t(&self, rec: &mut Recorder<'_>, dy: &Tensor) -> Result<Tensor> {
        let mut acc: Option<Tensor> = None;
        for (r0, w) in &self.parts {
            acc = Some(qmatmul_t_part(rec, dy, w, *r0, self.rows, acc.as_ref())?);
        }
        acc.ok_or_else(|| Error::Invalid {
            op: "qmatmul_t",
            detail: "a split table with no parts".into(),
        })
    }
}

/// What a product does besides the product (see `quant.wgsl`).
#[derive(Clone, Copy, Default)]
pub struct Fuse<'a> {
    /// RMS-normalise each row of x first, with this weight (cols) and epsilon.
    pub norm: Option<(&'a Tensor, f32)>,
    /// Add this (.., rows of W) to the result.
    pub residual: Option<&'a Tensor>,
    /// W holds [gate; up] (2n rows): the result is silu(x gate^T) * (x up^T), (.., n).
    pub swiglu: bool,
    /// With `swiglu`: gelu(approximate='tanh') in place of silu (GeGLU).
    pub geglu: bool,
    /// x already rounded for this product by the one that made it ([`qmatmul_chain`]),
    /// with `norm`'s weight: used instead of rounding x again where the product rounds x
    /// ([`decode_rounds_x`], or f16 halves for the invariant cooperative product; x is
    /// read otherwise).
    pub x8: Option<&'a X8>,
    /// The same kernel and order of sums whatever the number of rows of x, so that each
    /// row's result is the same bits alone or beside other rows (batched serving's batch
    /// invariance): where cooperative products run ([`invariant_on_coop`]) the cooperative
    /// skinny product (tiles of 16 to 64 rows, each row's sums the same at every tile
    /// size), k split by W's shape alone (x rounded to f16 as there);
    /// elsewhere, and with `simt`, `qmatvec_rows` (x read as f32; the matrix-vector kernel
    /// where W's rows are not whole runs of 32).
    pub invariant: bool,
    /// With `invariant`: off cooperative matrices even where the adapter has them (a small
    /// model's batched steps, [`invariant_simt`]).
    pub simt: bool,
    /// Without `invariant`: the cooperative product's 128 x 128 tiles wherever they run,
    /// even for a small model's narrow prompt product ([`prompt_rows_simt`]); for checking
    /// that kernel on such shapes.
    pub tiled: bool,
}

/// x rounded for the product that takes it, by the one that made it: one row rounded to 8
/// bits for the XQ8 decode products (`quant.wgsl`'s layout: groups of 16 columns), after
/// multiplying by a norm's weight (`norm`: the groups' sums of squares are kept for the
/// norm's factor, which the product applies) or not; or (`half`) every row's f16 halves
/// and factors as `x_half` makes them (the whole norm applied where `norm` is set), for the
/// invariant cooperative product.
pub struct X8 {
    pub(crate) q: Tensor,
    pub(crate) cols: usize,
    pub(crate) norm: Option<Tensor>,
    /// Some((the rows' factors, the norm's epsilon; 0 without a norm)): `q` holds `x_half`'s f16 halves for
    /// the cooperative product (the invariant products' chain, [`qmatmul_chain`]), not
    /// XQ8 groups.
    pub(crate) half: Option<(Tensor, f32)>,
}

impl X8 {
    /// Whether a product of W with `norm` (its weight) takes this x.
    fn check(&self, op: &'static str, w: &QMatrix, norm: Option<&Tensor>) -> Result<()> {
        if self.half.is_some() {
            return Err(Error::Invalid {
                op,
                detail:
                    "x rounded to f16 halves for a cooperative product, given to a decode product"
                        .into(),
            });
        }
        self.check_any(op, w, norm)
    }

    /// [`X8::check`] for either kind.
    fn check_any(&self, op: &'static str, w: &QMatrix, norm: Option<&Tensor>) -> Result<()> {
        let same_norm = match (&self.norm, norm) {
            (None, None) => true,
            (Some(a), Some(b)) => a.same_buffer(b),
            _ => false,
        };
        if self.cols != w.cols || !same_norm {
            return Err(Error::Invalid {
                op,
                detail: format!(
                    "x rounded for {} columns {} a norm weight, given to W ({}, {}) {} a norm weight",
                    self.cols,
                    if self.norm.is_some() { "after" } else { "without" },
                    w.rows,
                    w.cols,
                    if norm.is_some() { "with" } else { "without" },
                ),
            });
        }
        Ok(())
    }
}

/// The product that takes a product's output ([`qmatmul_chain`]): its W and the weight of
/// the norm fused before it.
#[derive(Clone, Copy)]
pub struct Next<'a> {
    pub w: &'a QMatrix,
    pub norm: Option<&'a Tensor>,
    /// The norm's epsilon (f16 halves are made after the whole norm).
    pub eps: f32,
}

/// Widest attention output (heads x head size) [`qmatvec_merged`] takes: its workgroups
/// hold the merged row in workgroup memory.
pub const MERGE_MAX_WIDTH: usize = 1024;

/// y (1, rows of W) = merge(parts) @ W^T (+ `residual` (1, rows)): one token's attention,
/// split over key ranges by [`crate::ops::kvcache::kv_attend_parts`], merged inside the
/// product (each workgroup merges the row into workgroup memory as `attend_merge` would,
/// then runs the matrix-vector product): one dispatch instead of two.
pub fn qmatvec_merged(
    rec: &mut Recorder<'_>,
    parts: &AttnParts,
    w: &QMatrix,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let width = parts.heads * parts.d;
    let err = |why: String| Error::Shape {
        op: "qmatvec_merged",
        detail: format!(
            "attention parts ({} heads of {}, {} ranges) @ W^T with W ({}, {}) {}: {why}",
            parts.heads,
            parts.d,
            parts.splits,
            w.rows,
            w.cols,
            w.ty.name()
        ),
    };
    if width != w.cols || width > MERGE_MAX_WIDTH || parts.d % 4 != 0 || parts.splits == 0 {
        return Err(err(format!("needs heads x head size = W's columns, at most {MERGE_MAX_WIDTH}, head size a multiple of 4")));
    }
    if parts.part.numel() != parts.heads * parts.splits * (parts.d + 2) {
        return Err(err(format!("part tensor {:?}", parts.part.shape())));
    }
    if let Some(r) = residual {
        super::expect_f32("qmatvec_merged", r)?;
        if r.shape() != [1, w.rows] {
            return Err(err(format!(
                "residual {:?}, expected [1, {}]",
                r.shape(),
                w.rows
            )));
        }
    }
    let y = Tensor::empty(rec.gpu(), &[1, w.rows], DType::F32, "qmatvec_merged.y")?;
    let mut p = w.params(1);
    p.d = parts.d as u32;
    p.splits = parts.splits as u32;
    let c = [
        ("TYPE", w.ty.0 as f64),
        ("RESIDUAL", residual.is_some() as u32 as f64),
        ("MERGE", 1.0),
        ("MV_X", 1.0),
    ];
    let x = &parts.part;
    let res = residual.unwrap_or(x);
    rec.dispatch(
        &QMATVEC,
        &c,
        bytemuck::bytes_of(&p),
        &[&w.raw, &y, x, x, res, x, x, &w.raw],
        Grid::Linear(w.rows.div_ceil(8) as u64),
    )?;
    Ok(y)
}

/// y (1, rows of W) = merge(parts) @ W^T (+ `residual` (1, rows)) for one token's
/// attention split over key ranges, whatever its width: merged inside the product
/// ([`qmatvec_merged`]) up to [`MERGE_MAX_WIDTH`]; wider, merged straight into the 8-bit
/// rounded row where the product rounds x ([`decode_rounds_x`]; head size a multiple of
/// 16: `kvcache::attend_merge_x8`, one dispatch fewer than merging and then rounding);
/// otherwise merged, then multiplied. With `next`, y also rounded for that product where
/// both round x (see [`qmatmul_chain`]).
pub fn qmatvec_parts(
    rec: &mut Recorder<'_>,
    parts: &AttnParts,
    w: &QMatrix,
    residual: Option<&Tensor>,
    next: Option<Next<'_>>,
) -> Result<(Tensor, Option<X8>)> {
    let width = parts.heads * parts.d;
    if width <= MERGE_MAX_WIDTH {
        return Ok((qmatvec_merged(rec, parts, w, residual)?, None));
    }
    let fuse = Fuse {
        residual,
        ..Default::default()
    };
    let rounds = width == w.cols && one_row_rounds_x(1, w.ty, w.rows, w.cols);
    let path = match Path::of(1, w) {
        Path::Decode { split } if rounds && parts.d % 16 == 0 => split,
        _ => {
            let o = super::kvcache::attend_merge(rec, parts)?.reshape(&[1, width])?;
            return qmatmul_chain(rec, &o, w, fuse, next);
        }
    };
    if let Some(r) = residual {
        super::expect_f32("qmatvec_parts", r)?;
        if r.shape() != [1, w.rows] {
            return Err(Error::Shape {
                op: "qmatvec_parts",
                detail: format!("residual {:?}, expected [1, {}]", r.shape(), w.rows),
            });
        }
    }
    let xq = X8 {
        q: super::kvcache::attend_merge_x8(rec, parts)?,
        cols: width,
        norm: None,
        half: None,
    };
    let y = Tensor::empty(rec.gpu(), &[1, w.rows], DType::F32, "qmatvec_parts.y")?;
    let y8 = qmatvec1_x8(rec, &xq, w, &w.params(1), &y, fuse, path, next)?;
    Ok((y, y8))
}

/// Most threads a decode workgroup takes (`quant.wgsl`'s MV1_MAX_WG).
const MV1_MAX_WG: u32 = 512;

/// The workgroup (threads, rows of W a set) with which a one-row decode product of `w`
/// (`split` from [`Path::Decode`]) also rounds its output for `next`, or None where it
/// cannot: `next` does not take this output or does not round x, or the adapter offers
/// too few threads a workgroup (browsers: 256), and `next` then rounds x itself.
///
/// A workgroup makes 16 outputs (32 rows of W with SwiGLU): 256 threads in sets of 8 rows
/// where that fits and W has rows enough to keep the GPU busy (the 8B's gate/up: 1.28 ->
/// 1.24 ms a token with the rounding, against 1.48 with 512 threads), else 512 (or fewer)
/// threads in sets of 4 (the 8B's o and down: 1.02 -> 1.12 ms; with 8 rows a set, half
/// the workgroups, 1.67 ms). H200 figures, docs/benchmarks.md.
pub(crate) fn chain_layout(
    limits: &wgpu::Limits,
    w: &QMatrix,
    swiglu: bool,
    split: u32,
    next: Next<'_>,
) -> Option<(u32, u32)> {
    let outs = if swiglu { w.rows / 2 } else { w.rows };
    let t = 16 * (1 + swiglu as u32);
    let (wg, rw) = match w.rows >= MATVEC1_MIN_ROWS && 64 / split == t {
        true => (256, 8),
        false => (8 * t * split, 4),
    };
    let fits = wg <= MV1_MAX_WG
        && wg <= limits.max_compute_invocations_per_workgroup
        && wg <= limits.max_compute_workgroup_size_x;
    let takes = next.w.cols == outs
        && outs % 16 == 0
        && one_row_rounds_x(1, next.w.ty, next.w.rows, next.w.cols);
    (fits && takes).then_some((wg, rw))
}

/// Whether [`qmatmul_chain`] of one row of x through `w` rounds its output for `next` on
/// this adapter (see [`chain_layout`]).
pub fn chain_rounds(gpu: &Gpu, w: &QMatrix, swiglu: bool, next: Next<'_>) -> bool {
    match Path::of(1, w) {
        Path::Decode { split } => {
            one_row_rounds_x(1, w.ty, w.rows, w.cols)
                && chain_layout(&gpu.limits, w, swiglu, split, next).is_some()
        }
        _ => false,
    }
}

/// The decode kernel (`qmatvec1_x8`) on x already rounded into y, with `fuse`'s residual
/// or SwiGLU (and its norm's factor; the weight went into the rounding); `split` from
/// [`Path::Decode`]. Where `next` rounds x too, the workgroups also round y for it (each
/// making one group of 16 outputs: 128 to 512 threads, as the split needs, where the
/// adapter allows).
#[allow(clippy::too_many_arguments)]
fn qmatvec1_x8(
    rec: &mut Recorder<'_>,
    xq: &X8,
    w: &QMatrix,
    p: &Params,
    y: &Tensor,
    fuse: Fuse<'_>,
    split: u32,
    next: Option<Next<'_>>,
) -> Result<Option<X8>> {
    let outs = p.n as usize;
    let chained = next.and_then(|nx| chain_layout(&rec.gpu().limits, w, fuse.swiglu, split, nx));
    let next = next.filter(|_| chained.is_some());
    let (wg, rw) = chained.unwrap_or((256, 4));
    let y8 = match next {
        Some(nx) => Some(X8 {
            q: Tensor::empty(
                rec.gpu(),
                &[1, x8_words(outs)],
                DType::U32,
                "qmatvec1_x8.y8",
            )?,
            cols: outs,
            norm: nx.norm.cloned(),
            half: None,
        }),
        None => None,
    };
    // Without X8_OUT binding 14 is not written, but the layout needs a writable buffer.
    let unused;
    let out8 = match &y8 {
        Some(y8) => &y8.q,
        None => {
            unused = Tensor::empty(rec.gpu(), &[1], DType::U32, "qmatvec1_x8.unused")?;
            &unused
        }
    };
    let c = [
        ("TYPE", w.ty.0 as f64),
        ("NORM", xq.norm.is_some() as u32 as f64),
        ("RESIDUAL", fuse.residual.is_some() as u32 as f64),
        ("SWIGLU", fuse.swiglu as u32 as f64),
        ("GEGLU", fuse.geglu as u32 as f64),
        ("MV1_SPLIT", split as f64),
        ("MV1_WG", wg as f64),
        ("MV1_RW", rw as f64),
        ("X8_OUT", next.is_some() as u32 as f64),
        (
            "X8_OUT_NORM",
            next.is_some_and(|nx| nx.norm.is_some()) as u32 as f64,
        ),
    ];
    let res = fuse.residual.unwrap_or(&xq.q);
    let nw = next.and_then(|nx| nx.norm).unwrap_or(&xq.q);
    let bind = [&w.raw, y, &xq.q, nw, res, &xq.q, &w.raw, out8];
    let grid = Grid::Linear(w.rows.div_ceil(Path::rows(split, wg, rw)) as u64);
    rec.dispatch(&QMATVEC1_X8, &c, bytemuck::bytes_of(p), &bind, grid)?;
    Ok(y8)
}

/// y (.., rows of W) = x (.., cols) @ W^T with W read in its encoding. One row of x runs
/// the decode kernel (cols a multiple of 32, at least [`MATVEC1_MIN_ROWS`] rows or
/// [`SPLITK_MIN_COLS`] columns); from [`SKINNY_MIN_ROWS`] rows the cooperative-matrix
/// products where the adapter has them ([`uses_coop`]); else up to [`MATVEC_MAX_ROWS`]
/// rows the batched decode kernel (W shaped for the decode kernel, [`decode_rounds_x`])
/// or the matrix-vector kernel, more the tiled one.
pub fn qmatmul(rec: &mut Recorder<'_>, x: &Tensor, w: &QMatrix) -> Result<Tensor> {
    qmatmul_fused(rec, x, w, Fuse::default())
}

/// [`qmatmul`] with a norm before, a residual after, or SwiGLU of stacked gate/up rows.
pub fn qmatmul_fused(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    w: &QMatrix,
    fuse: Fuse<'_>,
) -> Result<Tensor> {
    Ok(qmatmul_chain(rec, x, w, fuse, None)?.0)
}

/// [`qmatmul_fused`] whose output is also rounded for `next` (the product that takes it,
/// with its norm's weight), when both are one-row decode products that round x
/// ([`decode_rounds_x`]): the rounding is then done by this product's workgroups, not by
/// a dispatch of its own before `next` (pass it as `next`'s `Fuse::x8`); and when both
/// are invariant cooperative products and this one adds a residual over split k: its
/// output's f16 halves come from the split sum's pass (`x_half_sum`), or this one is
/// SwiGLU/GeGLU and `next` takes no norm (the down product): from the GLU's pass
/// (`glu_half`). Either is the same, bit for bit, as `next` would make.
pub fn qmatmul_chain(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    w: &QMatrix,
    fuse: Fuse<'_>,
    next: Option<Next<'_>>,
) -> Result<(Tensor, Option<X8>)> {
    match qmatmul_out(rec, x, w, fuse, next, false)? {
        Coop::Done(y, y8) => Ok((y, y8)),
        Coop::Parts(..) => unreachable!("partials only where asked for"),
    }
}

/// x (m, cols) @ W^T as the invariant cooperative product leaves it before its split-K
/// sum: the partial products over slices of k (splits, m, rows of W) and the number of
/// slices, to be summed in slice order by the kernel that takes them (`rope_store_split`
/// sums q/k/v's, one dispatch fewer than `splitk_sum` first); where k is not split, or the
/// product is not the invariant cooperative one without a residual or SwiGLU, the product
/// (m, rows) and 1.
pub fn qmatmul_unsummed(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    w: &QMatrix,
    fuse: Fuse<'_>,
) -> Result<(Tensor, usize)> {
    let keep = fuse.invariant && fuse.residual.is_none() && !fuse.swiglu;
    Ok(match qmatmul_out(rec, x, w, fuse, None, keep)? {
        Coop::Done(y, _) => (y, 1),
        Coop::Parts(part, splits) => (part, splits),
    })
}

/// What a product hands back: y (with x rounded for the next product, where made), or
/// the unsummed partials over slices of k and their number ([`qmatmul_unsummed`]).
enum Coop {
    Done(Tensor, Option<X8>),
    Parts(Tensor, usize),
}

/// [`qmatmul_chain`], or with `keep_parts` [`qmatmul_unsummed`].
fn qmatmul_out(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    w: &QMatrix,
    fuse: Fuse<'_>,
    next: Option<Next<'_>>,
    keep_parts: bool,
) -> Result<Coop> {
    super::expect_f32("qmatmul", x)?;
    let sh = x.shape();
    let err = |why: String| Error::Shape {
        op: "qmatmul",
        detail: format!(
            "x {sh:?} @ W^T with W ({}, {}) {}: {why}",
            w.rows,
            w.cols,
            w.ty.name()
        ),
    };
    if sh.is_empty() || sh[sh.len() - 1] != w.cols {
        return Err(err(format!("x's last dimension must be {}", w.cols)));
    }
    if fuse.swiglu && (w.rows % 2 != 0 || fuse.residual.is_some()) {
        return Err(err(
            "SwiGLU needs an even number of rows (gate, up) and no residual".into(),
        ));
    }
    let outs = if fuse.swiglu { w.rows / 2 } else { w.rows };
    let m = x.numel() / w.cols;
    let mut out = sh.to_vec();
    *out.last_mut().expect("non-empty") = outs;
    if let Some((nwt, _)) = fuse.norm {
        super::expect_f32("qmatmul", nwt)?;
        if nwt.shape() != [w.cols] {
            return Err(err(format!(
                "norm weight {:?}, expected [{}]",
                nwt.shape(),
                w.cols
            )));
        }
    }
    if let Some(r) = fuse.residual {
        super::expect_f32("qmatmul", r)?;
        if r.shape() != out.as_slice() {
            return Err(err(format!("residual {:?}, expected {out:?}", r.shape())));
        }
    }
    let y = Tensor::empty(rec.gpu(), &out, DType::F32, "qmatmul.y")?;
    let mut p = w.params(m);
    p.n = outs as u32;
    p.eps = fuse.norm.map_or(0.0f32, |n| n.1).to_bits();
    let c = [
        ("TYPE", w.ty.0 as f64),
        ("NORM", fuse.norm.is_some() as u32 as f64),
        ("RESIDUAL", fuse.residual.is_some() as u32 as f64),
        ("SWIGLU", fuse.swiglu as u32 as f64),
        ("GEGLU", fuse.geglu as u32 as f64),
    ];
    let nw = fuse.norm.map_or(x, |n| n.0);
    let res = fuse.residual.unwrap_or(x);
    let bind = [&w.raw, &y, x, nw, res, x, nw, &w.raw];
    if fuse.invariant {
        if invariant_on_coop(rec.gpu(), w.cols) && !fuse.simt {
            return qmatmul_coop(rec, x, w, fuse, y, next, keep_parts);
        } else if w.cols % 32 == 0 {
            rows_product(rec, &c, &p, &bind, m, w)?;
        } else {
            let (cm, grid) = matvec_grid(&c, m, w.rows, 8);
            rec.dispatch(&QMATVEC, &cm, bytemuck::bytes_of(&p), &bind, grid)?;
        }
        return Ok(Coop::Done(y, None));
    }
    if !fuse.tiled && prompt_rows_simt(rec.gpu(), m, w) {
        rows_product(rec, &c, &p, &bind, m, w)?;
        return Ok(Coop::Done(y, None));
    }
    if uses_coop(rec.gpu(), m, w.rows, w.cols) {
        return qmatmul_coop(rec, x, w, fuse, y, None, false);
    }
    if let Some(split) = batch_split(m, w.ty, w.rows, w.cols) {
        let xq = rounded_x(rec, "qmatmul", x, w, fuse.norm, fuse.x8)?;
        let xq = xq.get();
        qmatvec_x8rows(rec, xq, w, &p, &y, fuse, split)?;
        return Ok(Coop::Done(y, None));
    }
    match Path::of(m, w) {
        Path::Decode { split } => {
            if one_row_rounds_x(m, w.ty, w.rows, w.cols) {
                let xq = rounded_x(rec, "qmatmul", x, w, fuse.norm, fuse.x8)?;
                let xq = xq.get();
                let y8 = qmatvec1_x8(rec, xq, w, &p, &y, fuse, split, next)?;
                return Ok(Coop::Done(y, y8));
            }
            let c1 = [c[0], c[1], c[2], c[3], c[4], ("MV1_SPLIT", split as f64)];
            let grid = Grid::Linear(w.rows.div_ceil(Path::rows(split, 256, 4)) as u64);
            rec.dispatch(&QMATVEC1, &c1, bytemuck::bytes_of(&p), &bind, grid)?;
        }
        Path::MatVec => {
            let (cm, grid) = matvec_grid(&c, m, w.rows, if m == 1 { 1 } else { 8 });
            rec.dispatch(&QMATVEC, &cm, bytemuck::bytes_of(&p), &bind, grid)?;
        }
        Path::Tiled => {
            let (gn, gm) = (w.rows.div_ceil(64), m.div_ceil(64));
            let splits = match fuse.norm.is_none() && !fuse.swiglu {
                true => split_k(gn * gm, w.cols),
                false => 1,
            };
            if splits == 1 {
                let grid = Grid::Xyz([gn as u32, gm as u32, 1]);
                rec.dispatch(&QMATMUL, &c, bytemuck::bytes_of(&p), &bind[..7], grid)?;
            } else {
                // Partial tiles of k's slices, then their sum (+ the residual) in order.
                let part =
                    Tensor::empty(rec.gpu(), &[splits, m, outs], DType::F32, "qmatmul.part")?;
                p.splits = splits as u32;
                let cs = [c[0], ("SPLITK", 1.0)];
                let grid = Grid::Xyz([gn as u32, gm as u32, splits as u32]);
                let bind = [&w.raw, &part, x, nw, res, x, nw];
                rec.dispatch(&QMATMUL, &cs, bytemuck::bytes_of(&p), &bind, grid)?;
                splitk_sum(rec, &part, fuse.residual, &y, m, outs, splits)?;
            }
        }
    }
    Ok(Coop::Done(y, None))
}

/// Rows of x (.., k) (after `norm`'s RMSNorm) as f16 for the cooperative product, each
/// scaled by a power of two where f16 cannot hold it (`quant.wgsl`'s x_half): the halves
/// (a u32 tensor of (m, k / 2) words, two halves each, the lower first) and each row's
/// factor back (2^s, 1 for most rows). k a multiple of 4.
pub fn x_half(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    k: usize,
    norm: Option<(&Tensor, f32)>,
) -> Result<(Tensor, Tensor)> {
    x_half_scaled(rec, x, k, norm, false)
}

/// What `x_half` and the kernels that make its halves write: (m, k / 2) words of two f16
/// halves, and each row's factor.
fn halves_out(gpu: &Gpu, m: usize, k: usize) -> Result<(Tensor, Tensor)> {
    Ok((
        Tensor::empty(gpu, &[m, k / 2], DType::U32, "x_half.xh")?,
        Tensor::empty(gpu, &[m], DType::F32, "x_half.rowf")?,
    ))
}

/// [`x_half`], with `scale_up` rows whose values are small scaled up too (by a power of two,
/// the largest |value| to [2^14, 2^15)): gradients, which may sit in f16's subnormals.
pub fn x_half_scaled(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    k: usize,
    norm: Option<(&Tensor, f32)>,
    scale_up: bool,
) -> Result<(Tensor, Tensor)> {
    let m = x.numel() / k;
    let gpu = rec.gpu();
    let (xh, rowf) = halves_out(gpu, m, k)?;
    let p = Params {
        m: m as u32,
        k: k as u32,
        eps: norm.map_or(0.0f32, |n| n.1).to_bits(),
        ..Default::default()
    };
    let nw = norm.map_or(x, |n| n.0);
    let c = [
        ("NORM", norm.is_some() as u32 as f64),
        ("SCALE_UP", scale_up as u32 as f64),
    ];
    let bind = [&rowf, x, nw, &xh];
    rec.dispatch(
        &X_HALF,
        &c,
        bytemuck::bytes_of(&p),
        &bind,
        Grid::Linear(m as u64),
    )?;
    Ok((xh, rowf))
}

/// The tiled product on cooperative matrices (`quant_coop.wgsl`): x (times the fused
/// norm) rounded to f16 by `x_half` (rows that f16 cannot hold scaled down by a power of
/// two, and back after), then `qmatmul_coop` into `y` (with fuse's residual), over slices
/// of k summed in order by `splitk_sum` where the output has few tiles; SwiGLU/GeGLU: the
/// product with gate and up into an (m, 2n) tensor, then `glu_rows`. x's halves come from
/// `fuse.x8` where the product before made them. With `next` (a cooperative product
/// with a norm that takes y) and a residual over split k: `x_half_sum` sums the slices
/// and makes y's halves for `next` in one pass, returned; with `next` without a norm
/// after SwiGLU/GeGLU: `glu_half` makes them with the GLU. With `keep_parts` (no
/// residual) the slices come back unsummed ([`qmatmul_unsummed`]).
fn qmatmul_coop(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    w: &QMatrix,
    fuse: Fuse<'_>,
    y: Tensor,
    next: Option<Next<'_>>,
    keep_parts: bool,
) -> Result<Coop> {
    let gpu = rec.gpu();
    let m = x.numel() / w.cols;
    let outs = if fuse.swiglu { w.rows / 2 } else { w.rows };
    let mut p = CoopParams {
        n: outs as u32,
        m: m as u32,
        k: w.cols as u32,
        ..Default::default()
    };
    let (xh, rowf) = match fuse.x8 {
        Some(h) => {
            h.check_any("qmatmul_coop", w, fuse.norm.map(|n| n.0))?;
            match (&h.half, fuse.norm) {
                (Some((rowf, eps)), Some((_, e)))
                    if *eps == e && rowf.numel() == m && h.q.numel() * 2 == m * w.cols =>
                {
                    (h.q.clone(), rowf.clone())
                }
                // Halves made without a norm (`glu_half`), for a product without one.
                (Some((rowf, _)), None)
                    if h.norm.is_none() && rowf.numel() == m && h.q.numel() * 2 == m * w.cols =>
                {
                    (h.q.clone(), rowf.clone())
                }
                _ => {
                    return Err(Error::Invalid {
                        op: "qmatmul_coop",
                        detail: format!(
                            "x rounded for another kind of product, norm or number of rows (here {m} rows)"
                        ),
                    })
                }
            }
        }
        None => x_half(rec, x, w.cols, fuse.norm)?,
    };
    // Few rows: tiles of 16, 32 or 64 rows (SK_R 1, 2, 4), W decoded once per tile.
    // Invariant products: the skinny kernel at any m, k split as for one tile of rows (by
    // W's shape alone), and the largest tiles that still keep INVARIANT_BUSY workgroups
    // (a row's sums are the same at every SK_R: the same fragments in the same order, so
    // the choice may follow m). On the H200: the 8B's 64-row step 47.5 -> 21.2 ms with
    // tiles of 64, while SmolLM2's narrow products (20 to 40 workgroups a tile of rows)
    // ran slower on fewer workgroups (its 64-row step 3.29 -> 3.93 ms).
    let skinny = m <= SKINNY_MAX_ROWS || fuse.invariant;
    let layout = SkinnyLayout::get();
    let gn = w.rows.div_ceil(COOP_TILE);
    let most = m.div_ceil(16).next_power_of_two().min(4);
    let sk_r = match fuse.invariant {
        true => {
            let splits = match fuse.swiglu && !layout.split_glu {
                true => 1,
                false => layout.invariant_splits(gn, w.cols),
            };
            [4, 2]
                .into_iter()
                .find(|&r| r <= most && gn * m.div_ceil(16 * r) * splits >= INVARIANT_BUSY)
                .unwrap_or(1)
        }
        false => most,
    };
    let (kernel, tile_m) = match skinny {
        true => (&QMATMUL_COOP_SKINNY, 16 * sk_r),
        false => (&QMATMUL_COOP, COOP_TILE),
    };
    let gm = m.div_ceil(tile_m);
    // Workgroups along W's rows: tiles of `layout.n` columns (skinny) or 128.
    let gx = match skinny {
        true => w.rows.div_ceil(layout.n),
        false => gn,
    };
    let sk = ("SK_R", sk_r as f64);
    let bk = (
        "SK_BK",
        match layout.n {
            COOP_TILE => skinny_bk(
                layout.bk,
                sk_r,
                gpu.limits.max_compute_workgroup_storage_size,
            ),
            _ => 32,
        } as f64,
    );
    let skn = ("SK_N", layout.n as f64);
    let c = [
        ("TYPE", w.ty.0 as f64),
        ("RESIDUAL", fuse.residual.is_some() as u32 as f64),
        sk,
        bk,
        skn,
    ];
    let c = match skinny {
        true => &c[..],
        false => &c[..2],
    };
    if fuse.swiglu {
        // The product (m, 2n) whole tiles straight out, then act(gate) * up: through the
        // product's scratch instead, the 8B's gate/up took 69 ms a prefill, not 43. An
        // invariant one may split k (SkinnyLayout::split_glu): its slices' partial tiles
        // (splits, m, 2n) are summed where the GLU is applied.
        let splits = match fuse.invariant && layout.split_glu {
            true => layout.invariant_splits(gn, w.cols),
            false => 1,
        };
        let gu = Tensor::empty(
            gpu,
            &[splits, m, w.rows],
            DType::F32,
            "qmatmul_coop.gate_up",
        )?;
        p.n = w.rows as u32;
        p.splits = splits as u32;
        let grid = Grid::Xyz([gx as u32, gm as u32, splits as u32]);
        let bind = [&w.raw, &gu, &xh, &rowf, x, &w.raw];
        let cg = [c[0], sk, bk, skn, ("SPLITK", 1.0)];
        let cg = match (skinny, splits > 1) {
            (true, true) => &cg[..],
            (true, false) => &cg[..4],
            (false, _) => &cg[..1],
        };
        rec.dispatch(kernel, cg, bytemuck::bytes_of(&p), &bind, grid)?;
        // The next product (no norm: the down product) takes y's halves, made here.
        let halves = next.is_some_and(|nx| {
            nx.norm.is_none()
                && nx.w.cols == outs
                && outs % 4 == 0
                && fuse.invariant
                && invariant_on_coop(gpu, nx.w.cols)
        });
        if halves {
            let (xh, rowf) = glu_half(rec, &gu, &y, m, outs, fuse.geglu, splits)?;
            let half = X8 {
                q: xh,
                cols: outs,
                norm: None,
                half: Some((rowf, 0.0)),
            };
            return Ok(Coop::Done(y, Some(half)));
        }
        glu_rows(rec, &gu, &y, m, outs, fuse.geglu, splits)?;
        return Ok(Coop::Done(y, None));
    }
    let splits = match fuse.invariant {
        true => layout.invariant_splits(gn, w.cols),
        false => split_k_to(COOP_SPLITK_TARGET, gn * gm, w.cols),
    };
    let res = fuse.residual.unwrap_or(x);
    if splits == 1 {
        let grid = Grid::Xyz([gx as u32, gm as u32, 1]);
        let bind = [&w.raw, &y, &xh, &rowf, res, &w.raw];
        rec.dispatch(kernel, c, bytemuck::bytes_of(&p), &bind, grid)?;
        return Ok(Coop::Done(y, None));
    }
    // Partial tiles of k's slices, then their sum (+ the residual) in order.
    let part = Tensor::empty(gpu, &[splits, m, outs], DType::F32, "qmatmul_coop.part")?;
    p.splits = splits as u32;
    let cs = [c[0], ("SPLITK", 1.0), sk, bk, skn];
    let cs = if skinny { &cs[..] } else { &cs[..2] };
    let grid = Grid::Xyz([gx as u32, gm as u32, splits as u32]);
    let bind = [&w.raw, &part, &xh, &rowf, res, &w.raw];
    rec.dispatch(kernel, cs, bytemuck::bytes_of(&p), &bind, grid)?;
    if keep_parts && fuse.residual.is_none() {
        return Ok(Coop::Parts(part, splits));
    }
    match (fuse.residual, next) {
        (
            Some(r),
            Some(Next {
                w: nw,
                norm: Some(nwt),
                eps,
            }),
        ) if nw.cols == outs && outs % 4 == 0 && invariant_on_coop(gpu, nw.cols) => {
            let (xh, rowf) = x_half_sum(rec, &part, r, &y, (nwt, eps), m, outs, splits)?;
            let half = X8 {
                q: xh,
                cols: outs,
                norm: Some(nwt.clone()),
                half: Some((rowf, eps)),
            };
            Ok(Coop::Done(y, Some(half)))
        }
        _ => {
            splitk_sum(rec, &part, fuse.residual, &y, m, outs, splits)?;
            Ok(Coop::Done(y, None))
        }
    }
}

/// y (m, n) = (residual +) the sum of `part` (splits, m, n) over its slices, in order
/// (`quant.wgsl`'s `splitk_sum`).
pub(crate) fn splitk_sum(
    rec: &mut Recorder<'_>,
    part: &Tensor,
    residual: Option<&Tensor>,
    y: &Tensor,
    m: usize,
    n: usize,
    splits: usize,
) -> Result<()> {
    let ps = Params {
        n: n as u32,
        m: m as u32,
        splits: splits as u32,
        ..Default::default()
    };
    let cr = [("RESIDUAL", residual.is_some() as u32 as f64)];
    let grid = Grid::cover((m * n) as u64, 256);
    let res = residual.unwrap_or(part);
    rec.dispatch(
        &SPLITK_SUM,
        &cr,
        bytemuck::bytes_of(&ps),
        &[y, part, res],
        grid,
    )
}

/// y (m, n) = act(gate) * up from `gu` (m, 2n), the cooperative product's [gate | up]
/// rows (or `splits` > 1 partials of them, (splits, m, 2n), summed in order): silu, or
/// GeGLU's gelu with `geglu` (`quant.wgsl`'s `glu_rows`).
pub(crate) fn glu_rows(
    rec: &mut Recorder<'_>,
    gu: &Tensor,
    y: &Tensor,
    m: usize,
    n: usize,
    geglu: bool,
    splits: usize,
) -> Result<()> {
    if gu.numel() != splits.max(1) * 2 * m * n || y.numel() != m * n {
        return Err(Error::Shape {
            op: "glu_rows",
            detail: format!(
                "[gate | up] {:?} ({splits} slices) into y {:?} for {m} rows of {n}",
                gu.shape(),
                y.shape()
            ),
        });
    }
    let p = Params {
        m: m as u32,
        n: n as u32,
        splits: splits as u32,
        ..Default::default()
    };
    let grid = Grid::cover((m * n) as u64, 256);
    let c = [("GEGLU", geglu as u32 as f64)];
    rec.dispatch(&GLU_ROWS, &c, bytemuck::bytes_of(&p), &[y, gu], grid)
}

/// [`glu_rows`] and y's f16 halves and rows' factors as
/// [`x_half`] makes them without a norm, in one pass (`quant.wgsl`'s `glu_half`): the
/// same bits as the two. n a multiple of 4.
pub(crate) fn glu_half(
    rec: &mut Recorder<'_>,
    gu: &Tensor,
    y: &Tensor,
    m: usize,
    n: usize,
    geglu: bool,
    splits: usize,
) -> Result<(Tensor, Tensor)> {
    let gpu = rec.gpu();
    if n % 4 != 0 || gu.numel() != splits.max(1) * 2 * m * n || y.numel() != m * n {
        return Err(Error::Shape {
            op: "glu_half",
            detail: format!(
                "[gate | up] {:?} ({splits} slices) into y {:?} for {m} rows of {n} (a multiple of 4)",
                gu.shape(),
                y.shape()
            ),
        });
    }
    let (xh, rowf) = halves_out(gpu, m, n)?;
    let p = Params {
        m: m as u32,
        k: n as u32,
        n: n as u32,
        splits: splits as u32,
        ..Default::default()
    };
    rec.dispatch(
        &GLU_HALF,
        &[("GEGLU", geglu as u32 as f64)],
        bytemuck::bytes_of(&p),
        &[&rowf, gu, &xh, y],
        Grid::Linear(m as u64),
    )?;
    Ok((xh, rowf))
}

/// [`splitk_sum`] with a residual, then y's rows normalised by `norm` (weight, epsilon)
/// and rounded to f16 as [`x_half`] makes them, in one pass (`quant.wgsl`'s
/// `x_half_sum`): y and x_half's (halves, rows' factors), the same bits as the two.
/// n a multiple of 4.
#[allow(clippy::too_many_arguments)]
pub(crate) fn x_half_sum(
    rec: &mut Recorder<'_>,
    part: &Tensor,
    residual: &Tensor,
    y: &Tensor,
    norm: (&Tensor, f32),
    m: usize,
    n: usize,
    splits: usize,
) -> Result<(Tensor, Tensor)> {
    let gpu = rec.gpu();
    let (xh, rowf) = halves_out(gpu, m, n)?;
    let p = Params {
        m: m as u32,
        k: n as u32,
        eps: norm.1.to_bits(),
        splits: splits as u32,
        ..Default::default()
    };
    let bind = [&rowf, residual, part, norm.0, &xh, y];
    rec.dispatch(
        &X_HALF_SUM,
        &[],
        bytemuck::bytes_of(&p),
        &bind,
        Grid::Linear(m as u64),
    )?;
    Ok((xh, rowf))
}

/// dy (.., rows) @ W (rows, cols) -> (.., cols): the product with W as stored (the
/// backward of [`qmatmul`]: dX = dY W through a frozen weight, reading its blocks, never
/// a dequantized copy). Tiled for any number of rows of dy; sums in a fixed order.
pub fn qmatmul_t(rec: &mut Recorder<'_>, dy: &Tensor, w: &QMatrix) -> Result<Tensor> {
    qmatmul_t_part(rec, dy, w, 0, w.rows, None)
}

/// dy's columns c0 .. c0 + w.rows (dy's rows `width` long) times W, plus `acc` when given.
fn qmatmul_t_part(
    rec: &mut Recorder<'_>,
    dy: &Tensor,
    w: &QMatrix,
    c0: usize,
    width: usize,
    acc: Option<&Tensor>,
) -> Result<Tensor> {
    super::expect_f32("qmatmul_t", dy)?;
    let sh = dy.shape();
    if sh.is_empty() || sh[sh.len() - 1] != width || c0 + w.rows > width {
        return Err(Error::Shape {
            op: "qmatmul_t",
            detail: format!(
                "dy {sh:?} @ W ({}, {}) {}: dy's last dimension must be {width}",
                w.rows,
                w.cols,
                w.ty.name()
            ),
        });
    }
    let m = dy.numel() / width;
    let mut out = sh.to_vec();
    *out.last_mut().expect("non-empty") = w.cols;
    let y = Tensor::empty(rec.gpu(), &out, DType::F32, "qmatmul_t.y")?;
    if c0 == 0 && width == w.rows && acc.is_none() && uses_coop_t(rec.gpu(), m, w.rows, w.cols) {
        qmatmul_t_coop(rec, dy, w, &y)?;
        return Ok(y);
    }
    let mut p = w.params(m);
    p.d = width as u32;
    p.pos = c0 as u32;
    let c = [
        ("TYPE", w.ty.0 as f64),
        ("RESIDUAL", acc.is_some() as u32 as f64),
    ];
    let grid = Grid::Xyz([w.cols.div_ceil(64) as u32, m.div_ceil(64) as u32, 1]);
    let res = acc.unwrap_or(dy);
    rec.dispatch(
        &QMATMUL_T,
        &c,
        bytemuck::bytes_of(&p),
        &[&w.raw, &y, dy, res],
        grid,
    )?;
    Ok(y)
}

/// Whether dY (m, rows) @ W ([`qmatmul_t`]) runs on cooperative matrices here
/// (`quant_coop.wgsl` with TRANS_W: dY's rows scaled by powers of two into f16 and W's
/// values rounded to f16, f32 sums): where the forward's products of m rows take 128-row
/// tiles ([`uses_coop`], m past [`SKINNY_MAX_ROWS`]), rows of dY and of W a multiple of
/// 4 long.
pub fn uses_coop_t(gpu: &Gpu, m: usize, rows: usize, cols: usize) -> bool {
    m > SKINNY_MAX_ROWS && rows % 4 == 0 && cols % 4 == 0 && uses_coop(gpu, m, cols, rows)
}

/// [`qmatmul_t`] on cooperative matrices (see [`uses_coop_t`]): y (m, cols).
fn qmatmul_t_coop(rec: &mut Recorder<'_>, dy: &Tensor, w: &QMatrix, y: &Tensor) -> Result<()> {
    let gpu = rec.gpu();
    let m = dy.numel() / w.rows;
    let mut p = CoopParams {
        n: w.cols as u32,
        m: m as u32,
        k: w.rows as u32,
        ..Default::default()
    };
    let (xh, rowf) = x_half_scaled(rec, dy, w.rows, None, true)?;
    let (gn, gm) = (w.cols.div_ceil(COOP_TILE), m.div_ceil(COOP_TILE));
    let ty = ("TYPE", w.ty.0 as f64);
    let splits = split_k_to(COOP_SPLITK_TARGET, gn * gm, w.rows);
    if splits == 1 {
        let grid = Grid::Xyz([gn as u32, gm as u32, 1]);
        let bind = [&w.raw, y, &xh, &rowf, dy, &w.raw];
        let c = [ty, ("TRANS_W", 1.0)];
        return rec.dispatch(&QMATMUL_COOP, &c, bytemuck::bytes_of(&p), &bind, grid);
    }
    let part = Tensor::empty(gpu, &[splits, m, w.cols], DType::F32, "qmatmul_t.part")?;
    p.splits = splits as u32;
    let c = [ty, ("SPLITK", 1.0), ("TRANS_W", 1.0)];
    let grid = Grid::Xyz([gn as u32, gm as u32, splits as u32]);
    let bind = [&w.raw, &part, &xh, &rowf, dy, &w.raw];
    rec.dispatch(&QMATMUL_COOP, &c, bytemuck::bytes_of(&p), &bind, grid)?;
    splitk_sum(rec, &part, None, y, m, w.cols, splits)
}

/// Types whose decode products ([`Path::Decode`]) round x to 8 bits (`quant.wgsl`'s XQ8:
/// integer dot products with the quants), from [`XQ8_MIN_COLS`] columns.
const XQ8_TYPES: &[&str] = &["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"];

/// Row length from which the decode products round x to 8 bits: below, a thread reads at
/// most one run of a row and the float work is not what limits (SmolLM2's 576-column
/// output head: the same decode speed either way on the H200), so x stays f32 there.
pub const XQ8_MIN_COLS: usize = 1024;

/// Words of a row of `cols` rounded for the XQ8 products (`quant.wgsl`'s x8_row_words):
/// the quants, each group's scale and quants' sum, and each group's sum of squares.
fn x8_words(cols: usize) -> usize {
    cols / 4 + cols / 8 + cols / 16
}

/// x (.., cols) rounded for the XQ8 decode products (`quantize_x8`: groups of 16 columns
/// to 8-bit integers, a scale and the quants' sum each), after `norm`'s weight (and its
/// epsilon) if given, with the groups' sums of squares for the norm's factor.
pub(crate) fn quantize_x8(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    cols: usize,
    norm: Option<(&Tensor, f32)>,
) -> Result<X8> {
    let m = x.numel() / cols;
    let xq = Tensor::empty(
        rec.gpu(),
        &[m, x8_words(cols)],
        DType::U32,
        "quantize_x8.xq",
    )?;
    // Workgroups a row: slices of 256 groups of 16.
    let slices = (cols / 16).div_ceil(256);
    let p = Params {
        n: slices as u32,
        m: m as u32,
        k: cols as u32,
        ..Default::default()
    };
    let c = [("NORM", norm.is_some() as u32 as f64)];
    let nw = norm.map_or(x, |n| n.0);
    rec.dispatch(
        &QUANTIZE_X8,
        &c,
        bytemuck::bytes_of(&p),
        &[x, nw, &xq],
        Grid::Linear((m * slices) as u64),
    )?;
    Ok(X8 {
        q: xq,
        cols,
        norm: norm.map(|n| n.0.clone()),
        half: None,
    })
}

/// x rounded for an XQ8 product: the caller's (checked against W and the norm) or made
/// here by [`quantize_x8`].
enum RoundedX<'a> {
    Given(&'a X8),
    Made(X8),
}

impl RoundedX<'_> {
    fn get(&self) -> &X8 {
        match self {
            RoundedX::Given(x8) => x8,
            RoundedX::Made(x8) => x8,
        }
    }
}

fn rounded_x<'a>(
    rec: &mut Recorder<'_>,
    op: &'static str,
    x: &Tensor,
    w: &QMatrix,
    norm: Option<(&Tensor, f32)>,
    given: Option<&'a X8>,
) -> Result<RoundedX<'a>> {
    match given {
        Some(x8) => {
            x8.check(op, w, norm.map(|n| n.0))?;
            Ok(RoundedX::Given(x8))
        }
        None => Ok(RoundedX::Made(quantize_x8(rec, x, w.cols, norm)?)),
    }
}

/// Whether a product of `m` rows of x with W (`rows`, `cols`) of type `ty` ([`qmatmul`],
/// [`qmatmul_fused`], [`qmatmul_rope_store`]) rounds x (after the fused norm's weight) to
/// 8-bit integers in groups of 16 columns, as `reference::quant::round_x8` does, and
/// multiplies those on this adapter: the one-row decode kernel does, for the types with
/// integer quants and rows of [`XQ8_MIN_COLS`] or more (as llama.cpp's quantized
/// matrix-vector products do), for a quarter of the float work a weight; so does the
/// batched decode kernel for 2 ..= [`MATVEC_MAX_ROWS`] rows through the same W where no
/// cooperative product takes them ([`uses_coop`]).
pub fn decode_rounds_x(gpu: &Gpu, m: usize, ty: GgmlType, rows: usize, cols: usize) -> bool {
    one_row_rounds_x(m, ty, rows, cols)
        || (!uses_coop(gpu, m, rows, cols) && batch_split(m, ty, rows, cols).is_some())
}

/// [`decode_rounds_x`] for one row of x (no adapter needed: no cooperative product takes
/// one row).
fn one_row_rounds_x(m: usize, ty: GgmlType, rows: usize, cols: usize) -> bool {
    matches!(Path::of_shape(m, rows, cols), Path::Decode { .. })
        && cols >= XQ8_MIN_COLS
        && XQ8_TYPES.contains(&ty.name())
}

/// Most rows of x a batched decode workgroup takes (`quant.wgsl`'s MvxAcc).
const BATCH_ROWS: usize = 8;

/// Where 2 ..= [`MATVEC_MAX_ROWS`] rows of x through W (`rows`, `cols`) of type `ty` run
/// the batched decode kernel (`qmatvec_x8rows`: x rounded to 8 bits as one row's decode
/// product does, W read once per 8 rows of x, not once a row): the decode kernel's split
/// (W shaped for it, a type it rounds x for, rows of x a multiple of 64 long so that
/// rounded rows stay 16-byte aligned). None: the matrix-vector kernel.
fn batch_split(m: usize, ty: GgmlType, rows: usize, cols: usize) -> Option<u32> {
    if !(2..=MATVEC_MAX_ROWS).contains(&m) || cols % 64 != 0 {
        return None;
    }
    match Path::of_shape(1, rows, cols) {
        Path::Decode { split } if one_row_rounds_x(1, ty, rows, cols) => Some(split),
        _ => None,
    }
}

/// The batched decode product (`qmatvec_x8rows`) on rows of x already rounded, with
/// `fuse`'s residual or SwiGLU (and its norm's factor; the weight went into the rounding):
/// workgroups of 256 threads over W as the decode kernel's (`split`), each taking 2, 4 or
/// 8 rows of x.
fn qmatvec_x8rows(
    rec: &mut Recorder<'_>,
    xq: &X8,
    w: &QMatrix,
    p: &Params,
    y: &Tensor,
    fuse: Fuse<'_>,
    split: u32,
) -> Result<()> {
    let m = p.m as usize;
    let mv_x = m.min(BATCH_ROWS).next_power_of_two();
    let c = [
        ("TYPE", w.ty.0 as f64),
        ("NORM", xq.norm.is_some() as u32 as f64),
        ("RESIDUAL", fuse.residual.is_some() as u32 as f64),
        ("SWIGLU", fuse.swiglu as u32 as f64),
        ("GEGLU", fuse.geglu as u32 as f64),
        ("MV1_SPLIT", split as f64),
        ("MV1_X", mv_x as f64),
    ];
    let res = fuse.residual.unwrap_or(&xq.q);
    let bind = [&w.raw, y, &xq.q, &xq.q, res, &xq.q, &w.raw];
    let groups = w.rows.div_ceil(Path::rows(split, 256, 4)) * m.div_ceil(mv_x);
    let grid = Grid::Linear(groups as u64);
    rec.dispatch(&QMATVEC_X8ROWS, &c, bytemuck::bytes_of(p), &bind, grid)
}

/// Whether products with [`Fuse::invariant`] run on cooperative matrices here (whatever
/// the rows of x: adapters with them, rows of W a multiple of 4 long).
pub fn invariant_on_coop(gpu: &Gpu, cols: usize) -> bool {
    gpu.quant_coop && cols % 4 == 0
}

/// Longest row of W (columns) up to which a model's invariant products take `qmatvec_rows`
/// ([`Fuse::simt`]) where cooperative matrices run too. A small model's batched step is
/// made of fixed costs (the cooperative product's chain of k steps, and the f16 halves,
/// split sums and GLU passes around it): on an H100, SmolLM2-135M (rows of 576 and 1536)
/// stepped 1 / 8 / 32 / 64 rows at 731 / 4,782 / 12,349 / 17,323 tok/s this way against 378
/// / 2,938 / 10,783 / 19,910 (docs/benchmarks.md, session 35); the 8B's products (4096 and
/// 14336) are 3x slower this way from 8 rows.
pub const SIMT_MAX_COLS: usize = 2048;

/// Whether a model whose longest row of W is `max_cols` takes [`Fuse::simt`] for its
/// invariant products: up to [`SIMT_MAX_COLS`], or as `DOPPLER_INVARIANT=simt|coop` says
/// (read once a process; for measuring).
pub fn invariant_simt(max_cols: usize) -> bool {
    static FORCED: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let forced = FORCED.get_or_init(|| {
        let v = std::env::var("DOPPLER_INVARIANT").ok()?;
        match v.trim() {
            "simt" => Some(true),
            "coop" => Some(false),
            _ => {
                tracing::warn!("DOPPLER_INVARIANT={v:?} is not simt or coop: ignored");
                None
            }
        }
    });
    forced.unwrap_or(max_cols <= SIMT_MAX_COLS)
}

/// How `qmatvec_rows` lays out `m` rows of x through W with `rows` rows of `cols` on `gpu`:
/// rows of W a thread (MR_W: 1, or 2 with `DOPPLER_ROWS_W=2`, for measuring), rows of x a
/// workgroup (MR_X: up to 16 and what the workgroup memory holds for its sets, W's runs
/// decoded once for them all, fewer while the product would have fewer workgroups than the
/// target of [`rows_knobs`]) and sets of 32 threads taking k's runs in turn (MR_SETS:
/// [`rows_sets`]), whether x is staged in workgroup memory (MR_STAGE: from the knobs' least
/// MR_X that stages), and its grid. A row's sums are the same in every layout that keeps
/// MR_SETS (the batch's size may choose it; MR_SETS it never does).
fn rows_layout(gpu: &Gpu, m: usize, rows: usize, cols: usize) -> ([(&'static str, f64); 4], Grid) {
    let knobs = rows_knobs();
    let mr_w = knobs.rows_w;
    let sets = rows_sets(gpu, cols);
    let gx = rows.div_ceil(32 * mr_w);
    let mut r = m.next_power_of_two().clamp(1, rows_max_x(gpu, sets));
    while r > 2 && gx * m.div_ceil(r) < knobs.groups {
        r /= 2;
    }
    (
        [
            ("MR_X", r as f64),
            ("MR_W", mr_w as f64),
            ("MR_SETS", sets as f64),
            ("MR_STAGE", (r >= knobs.stage) as u32 as f64),
        ],
        Grid::Xyz([gx as u32, m.div_ceil(r) as u32, 1]),
    )
}

/// How many (set, row of x) slots of `qmatvec_rows`' `mr_xs` (128 bytes each: a row's staged
/// run, or a set's 32 partial sums) the adapter's workgroup memory holds beside `mr_ss`' 64
/// bytes.
fn rows_slots(gpu: &Gpu) -> usize {
    (gpu.limits.max_compute_workgroup_storage_size as usize).saturating_sub(64) / 128
}

/// The most rows of x a `qmatvec_rows` workgroup of `sets` sets takes: 16, or the largest
/// power of two whose slots ([`rows_slots`]) fit.
fn rows_max_x(gpu: &Gpu, sets: usize) -> usize {
    let mut r = 16;
    while r > 1 && sets * r > rows_slots(gpu) {
        r /= 2;
    }
    r
}

/// `qmatvec_rows`' sets of 32 threads a workgroup for rows of W `cols` long: where k's runs
/// of 32 take more passes of the base sets than the knobs' target (2), the fewest sets that
/// bring them down to it, or to what [`rows_sets_max`] sets need (SmolLM2's down product,
/// 48 runs: 16 sets in 3 passes, not 9 in 6), else the base: 9 (SmolLM2's 18 runs in two
/// passes, not three) where the adapter takes 288 threads a workgroup, else 8; or
/// `DOPPLER_ROWS_SETS=8|9` (for measuring and checking both). W's shape and the adapter
/// choose it, never the batch.
fn rows_sets(gpu: &Gpu, cols: usize) -> usize {
    let base = rows_sets_base(gpu);
    let runs = cols.div_ceil(32);
    let most = rows_sets_max(gpu).max(base);
    let passes = rows_knobs().passes.max(runs.div_ceil(most));
    runs.div_ceil(passes).max(base)
}

/// The most sets a `qmatvec_rows` workgroup takes: 16 (512 threads; on an H100 SmolLM2's
/// 32-row step ran 2.3% faster with 16 sets for its down product than with 9, 1.4% slower
/// with 24, and 8% slower with 18 sets in one pass for its other products), or
/// `DOPPLER_ROWS_MAX_SETS=N` (for measuring; 8 or 9 keeps every product on the base), within
/// the adapter's threads a workgroup and a workgroup memory of at least one row of x.
fn rows_sets_max(gpu: &Gpu) -> usize {
    let threads = gpu.limits.max_compute_invocations_per_workgroup as usize / 32;
    rows_knobs().max_sets.min(threads).min(rows_slots(gpu))
}

/// The base sets: 9 where the adapter takes 288 threads a workgroup, else 8, or as forced.
fn rows_sets_base(gpu: &Gpu) -> usize {
    let fits = gpu.limits.max_compute_invocations_per_workgroup >= 9 * 32;
    match rows_knobs().sets {
        Some(9) if !fits => {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| {
                tracing::warn!(
                    "DOPPLER_ROWS_SETS=9 needs 288 threads a workgroup; this adapter takes {}: 8",
                    gpu.limits.max_compute_invocations_per_workgroup
                )
            });
            8
        }
        Some(n) => n,
        None if fits => 9,
        None => 8,
    }
}

/// `qmatvec_rows`' layout knobs, read once a process (for measuring).
struct RowsKnobs {
    /// Workgroups below which a workgroup's rows of x are halved: 132 (one for each of an
    /// H100's or H200's SMs; measured on an H100 against 66 and 264) or
    /// `DOPPLER_ROWS_GROUPS=N`.
    groups: usize,
    /// Rows of W a thread: 1 or `DOPPLER_ROWS_W=2`.
    rows_w: usize,
    /// Sets a workgroup where forced: `DOPPLER_ROWS_SETS=8|9`.
    sets: Option<usize>,
    /// The most sets a workgroup for long rows of W: 16 or `DOPPLER_ROWS_MAX_SETS=N`.
    max_sets: usize,
    /// The passes over k's runs above which a product takes more sets than the base: 2 or
    /// `DOPPLER_ROWS_PASSES=N`.
    passes: usize,
    /// The least rows of x a workgroup (MR_X) that stage x in workgroup memory: 4 or
    /// `DOPPLER_ROWS_STAGE=N` (32: never).
    stage: usize,
}

fn rows_knobs() -> &'static RowsKnobs {
    static KNOBS: std::sync::OnceLock<RowsKnobs> = std::sync::OnceLock::new();
    KNOBS.get_or_init(|| {
        let read = |name: &str, default: usize, ok: &dyn Fn(usize) -> bool| {
            let v = std::env::var(name).ok();
            match v.as_deref().map(|v| v.trim().parse::<usize>()) {
                None => default,
                Some(Ok(n)) if ok(n) => n,
                Some(_) => {
                    tracing::warn!("{name}={v:?} is not allowed: the default");
                    default
                }
            }
        };
        RowsKnobs {
            groups: read("DOPPLER_ROWS_GROUPS", 132, &|n| n > 0),
            rows_w: read("DOPPLER_ROWS_W", 1, &|n| n == 1 || n == 2),
            sets: Some(read("DOPPLER_ROWS_SETS", 0, &|n| n == 8 || n == 9)).filter(|&n| n > 0),
            stage: read("DOPPLER_ROWS_STAGE", 4, &|n| n > 0),
            max_sets: read("DOPPLER_ROWS_MAX_SETS", 16, &|n| (1..=32).contains(&n)),
            passes: read("DOPPLER_ROWS_PASSES", 2, &|n| n > 0),
        }
    })
}

/// Whether a product of `m` rows of x with W (`rows`, `cols`) ([`qmatmul`],
/// [`qmatmul_fused`], [`qmatmul_rope_store`]) runs on cooperative matrices here: x (after
/// the fused norm) and W's values rounded to f16, f32 sums (`quant_coop.wgsl`).
pub fn uses_coop(gpu: &Gpu, m: usize, rows: usize, cols: usize) -> bool {
    let shape = matches!(Path::of_shape(m, rows, cols), Path::Tiled)
        || (SKINNY_MIN_ROWS..=SKINNY_MAX_ROWS).contains(&m);
    shape && gpu.quant_coop && cols % 4 == 0
}

/// `qmatvec_rows` of m rows of x with `qmatmul_out`'s constants (type and fusions),
/// parameters and bindings, laid out by [`rows_layout`].
fn rows_product(
    rec: &mut Recorder<'_>,
    c: &[(&'static str, f64)],
    p: &Params,
    bind: &[&Tensor],
    m: usize,
    w: &QMatrix,
) -> Result<()> {
    let (layout, grid) = rows_layout(rec.gpu(), m, w.rows, w.cols);
    let mut cm = c.to_vec();
    cm.extend(layout);
    rec.dispatch(&QMATVEC_ROWS, &cm, bytemuck::bytes_of(p), bind, grid)
}

/// Whether a product of `m` rows of x (a prompt's: more than [`SKINNY_MAX_ROWS`]) that
/// would take the cooperative product's 128 x 128 tiles takes `qmatvec_rows` instead: a
/// small model's narrow product (rows of W at most [`SIMT_MAX_COLS`] long, whole runs of
/// 32) of at most [`prompt_simt_tiles`] tiles each way, which leaves most of a large GPU
/// idle. On an H100 at 512 rows SmolLM2's q/k/v, o and down products (8, 5 and 5 tiles of
/// W's rows) took 51, 35 and 81 us this way against 81, 72 and 95 tiled (at 1,024 rows 90,
/// 57 and 140 against 117, 92 and 144); its gate/up (24) 139 against 73; a prompt of 128
/// tokens 4.7 ms against 6.6 (docs/benchmarks.md, session 42).
fn prompt_rows_simt(gpu: &Gpu, m: usize, w: &QMatrix) -> bool {
    prompt_simt_shape(m, w.rows, w.cols, prompt_simt_tiles()) && uses_coop(gpu, m, w.rows, w.cols)
}

/// [`prompt_rows_simt`]'s test of the shape, with at most `most` tiles each way.
fn prompt_simt_shape(m: usize, rows: usize, cols: usize, most: usize) -> bool {
    m > SKINNY_MAX_ROWS
        && cols % 32 == 0
        && cols <= SIMT_MAX_COLS
        && rows.div_ceil(COOP_TILE) <= most
        && m.div_ceil(COOP_TILE) <= most
}

/// [`prompt_rows_simt`]'s most tiles each way: 8, or `DOPPLER_PROMPT_SIMT=N` (0: never;
/// for measuring). Read once a process.
fn prompt_simt_tiles() -> usize {
    static MOST: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MOST.get_or_init(|| {
        let v = std::env::var("DOPPLER_PROMPT_SIMT").ok();
        match v.as_deref().map(|v| v.trim().parse::<usize>()) {
            None => 8,
            Some(Ok(n)) => n,
            Some(Err(_)) => {
                tracing::warn!("DOPPLER_PROMPT_SIMT={v:?} is not a number: 8");
                8
            }
        }
    })
}

/// Rows of x from and up to which a cooperative product takes tiles of 16, 32 or 64 rows
/// (`qmatmul_coop_skinny`: batched decode steps); more rows take 128-row tiles. Below,
/// the batched decode kernel or the matrix-vector kernel is faster: on the H200 an 8B
/// step of 2, 4 or 8 rows took 11.3, 11.4 and 12.0 ms cooperative against 5.6, 7.6 and
/// 12.4 with `qmatvec_x8rows`; 16 rows 13.2 against 21.9 (docs/benchmarks.md, session 22).
pub const SKINNY_MIN_ROWS: usize = 9;
pub const SKINNY_MAX_ROWS: usize = 64;

/// Which kernel a product of m rows of x runs.
enum Path {
    /// One row (decode), cols a multiple of 32: `qmatvec1`, sets of `split` groups of 32
    /// threads sharing their reads of x and splitting k over 4 rows of W. x is rounded to
    /// 8 bits first where [`decode_rounds_x`].
    Decode { split: u32 },
    /// Up to [`MATVEC_MAX_ROWS`] rows: `qmatvec`, 8 rows of W x 8 rows of x a workgroup.
    MatVec,
    /// More: the tiled `qmatmul`.
    Tiled,
}

impl Path {
    fn of(m: usize, w: &QMatrix) -> Path {
        Path::of_shape(m, w.rows, w.cols)
    }

    fn of_shape(m: usize, rows: usize, cols: usize) -> Path {
        let tall = rows >= MATVEC1_MIN_ROWS;
        if m == 1 && cols % 32 == 0 && (tall || cols >= SPLITK_MIN_COLS) {
            // Tall W with long rows (the 8B's gate/up, q/k/v): 2 groups a row of 4; long rows
            // of few W rows (the 8B's o and down): 4 (8 left half the threads idle on
            // 4,096 columns: o + down 1.55 -> 1.32 ms a token on the H200).
            let split = match (tall, cols >= 2048) {
                (true, false) => 1,
                (true, true) => 2,
                (false, _) => 4,
            };
            Path::Decode { split }
        } else if m <= MATVEC_MAX_ROWS {
            Path::MatVec
        } else {
            Path::Tiled
        }
    }

    /// Rows of W a decode workgroup of `wg` threads takes (sets of `split` groups of 32
    /// threads, `rw` rows a set).
    fn rows(split: u32, wg: u32, rw: u32) -> usize {
        (wg / (32 * split) * rw) as usize
    }
}

/// Storage buffers the fused RoPE products bind (WebGPU's default limit is 8).
const ROPE_STORAGE: u32 = 11;

/// q (T, Hq, D) of x (T, cols) @ W^T, W stacking the q, k and v projections
/// ((Hq + 2 Hkv) D rows), with `norm` (an RMSNorm weight (cols) and epsilon) first: the
/// product, then [`rope_store`] (bias, RoPE, k and v into the caches at `to.pos`). Up to
/// [`MATVEC_MAX_ROWS`] rows of x this is one dispatch (the matrix-vector kernels' entry
/// points with ROPE); more rows, or an adapter with fewer than 11 storage buffers a stage,
/// run the product and `rope_store` one after the other.
pub fn qmatmul_rope_store(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    w: &QMatrix,
    norm: Option<(&Tensor, f32)>,
    to: &RopeStore<'_>,
    x8: Option<&X8>,
) -> Result<Tensor> {
    let sh = x.shape();
    let t = x.numel() / w.cols.max(1);
    let path = Path::of(t, w);
    // The fused kernels store at row pos + t: a ring cache that has wrapped (a window's
    // last keys) takes the two steps, whose `rope_store` wraps.
    // f16 caches: the kernels write whole words of halves (a pair of adjacent dims, or for
    // pairs half a head apart four columns of a thread or of four groups).
    let wraps = to.pos + t > to.k_cache.shape().first().copied().unwrap_or(0);
    // q8_0 caches always take the two steps (a block of 32 spans threads).
    let kv_f16 = to.k_cache.dtype() == DType::F16;
    // Batched decode steps take the batched product, then `rope_store`.
    let fused = !matches!(path, Path::Tiled)
        && batch_split(t, w.ty, w.rows, w.cols).is_none()
        && !uses_coop(rec.gpu(), t, w.rows, w.cols)
        && !wraps
        && to.k_cache.dtype() != DType::U32
        && rec.gpu().limits.max_storage_buffers_per_shader_stage >= ROPE_STORAGE;
    if !fused || sh.len() != 2 || sh[1] != w.cols {
        let fuse = Fuse {
            norm,
            ..Default::default()
        };
        let qkv = qmatmul_fused(rec, x, w, fuse)?;
        return rope_store(rec, &qkv, to);
    }
    super::expect_f32("qmatmul_rope_store", x)?;
    let mut p = w.params(t);
    if to.paged.is_some() {
        return Err(Error::Invalid {
            op: "qmatmul_rope_store",
            detail: "paged rows: use the product, then kvcache::rope_store".into(),
        });
    }
    let kv = to.params("qmatmul_rope_store", t, w.rows)?;
    let d = kv.d as usize;
    p.eps = rope_norm_eps("qmatmul_rope_store", norm, w.cols)?;
    p.d = d as u32;
    p.pos = to.pos as u32;
    p.heads = to.hq as u32;
    let q = Tensor::empty(
        rec.gpu(),
        &[t, to.hq, d],
        DType::F32,
        "qmatmul_rope_store.q",
    )?;
    let c = [
        ("TYPE", w.ty.0 as f64),
        ("NORM", norm.is_some() as u32 as f64),
        ("ROPE_HALF", (to.pairing == Pairing::Half) as u32 as f64),
        ("ROPE_BIAS", to.bias.is_some() as u32 as f64),
        ("ROPE_KV_F16", kv_f16 as u32 as f64),
    ];
    let nw = norm.map_or(x, |n| n.0);
    let bind = [
        &w.raw,
        &q,
        x,
        nw,
        x,
        nw,
        to.bias.unwrap_or(x),
        &to.table.table,
        to.k_cache,
        to.v_cache,
        &w.raw,
    ];
    match path {
        Path::Decode { split } => {
            let grid = Grid::Linear(w.rows.div_ceil(Path::rows(split, 256, 4)) as u64);
            let split = ("MV1_SPLIT", split as f64);
            if one_row_rounds_x(t, w.ty, w.rows, w.cols) {
                let xq = rounded_x(rec, "qmatmul_rope_store", x, w, norm, x8)?;
                let xq = xq.get();
                let c1 = [c[0], c[1], c[2], c[3], c[4], split, ("XQ8", 1.0)];
                let mut bind = bind;
                for i in [2, 3, 4, 5] {
                    bind[i] = &xq.q;
                }
                rec.dispatch(&QMATVEC1_ROPE, &c1, bytemuck::bytes_of(&p), &bind, grid)?;
            } else {
                let c1 = [c[0], c[1], c[2], c[3], c[4], split];
                rec.dispatch(&QMATVEC1_ROPE, &c1, bytemuck::bytes_of(&p), &bind, grid)?;
            }
        }
        _ => {
            let (cm, grid) = matvec_grid(&c, t, w.rows, if t == 1 { 1 } else { 8 });
            rec.dispatch(&QMATVEC_ROPE, &cm, bytemuck::bytes_of(&p), &bind, grid)?;
        }
    }
    Ok(q)
}

/// [`qmatmul_rope_store`] for the paged rows of a batched step taking [`Fuse::simt`]'s
/// invariant product (`qmatvec_rows`): q (T, Hq, D) of x (T, cols) @ W^T with `norm` first,
/// k and v into the pool's pages at each row's own position (`to.paged`). One dispatch
/// (`qmatvec_rows_rope`: the product with bias, RoPE and the store as its epilogue) where
/// the adapter allows 12 storage buffers a stage, W's rows are whole runs of 32 and the
/// caches hold f32 or f16; otherwise the product, then [`rope_store`]. Which of the two
/// runs depends on the model and the adapter only, so a row's bits do not depend on the
/// batch.
pub fn qmatmul_rows_rope(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    w: &QMatrix,
    norm: Option<(&Tensor, f32)>,
    to: &RopeStore<'_>,
) -> Result<Tensor> {
    let Some(paged) = to.paged else {
        return Err(Error::Invalid {
            op: "qmatmul_rows_rope",
            detail: "rows without pages: use qmatmul_rope_store".into(),
        });
    };
    let sh = x.shape();
    let t = x.numel() / w.cols.max(1);
    if !rows_rope_fused(rec.gpu(), w.cols, to.k_cache.dtype()) || sh.len() != 2 || sh[1] != w.cols {
        let fuse = Fuse {
            norm,
            invariant: true,
            simt: true,
            ..Default::default()
        };
        let qkv = qmatmul_fused(rec, x, w, fuse)?;
        return rope_store(rec, &qkv, to);
    }
    super::expect_f32("qmatmul_rows_rope", x)?;
    let kv = to.params("qmatmul_rows_rope", t, w.rows)?;
    let d = kv.d as usize;
    let mut p = w.params(t);
    p.eps = rope_norm_eps("qmatmul_rows_rope", norm, w.cols)?;
    p.d = d as u32;
    p.heads = to.hq as u32;
    let q = Tensor::empty(rec.gpu(), &[t, to.hq, d], DType::F32, "qmatmul_rows_rope.q")?;
    let (layout, grid) = rows_layout(rec.gpu(), t, w.rows, w.cols);
    // The whole layout, as `qmatvec_rows` takes it (until session 41 this kernel was given
    // only its first two entries and ran the shader's default sets, unstaged).
    let mut c = vec![
        ("TYPE", w.ty.0 as f64),
        ("NORM", norm.is_some() as u32 as f64),
        ("ROPE_HALF", (to.pairing == Pairing::Half) as u32 as f64),
        ("ROPE_BIAS", to.bias.is_some() as u32 as f64),
        (
            "ROPE_KV_F16",
            (to.k_cache.dtype() == DType::F16) as u32 as f64,
        ),
    ];
    c.extend(layout);
    let nw = norm.map_or(x, |n| n.0);
    let bind = [
        &w.raw,
        &q,
        x,
        &paged.info,
        nw,
        x,
        nw,
        to.bias.unwrap_or(x),
        &to.table.table,
        to.k_cache,
        to.v_cache,
        &w.raw,
    ];
    rec.dispatch(&QMATVEC_ROWS_ROPE, &c, bytemuck::bytes_of(&p), &bind, grid)?;
    Ok(q)
}

/// The q/k/v products with RoPE: their norm weight checked (f32, `cols` long) and its
/// epsilon's bits (0 without a norm).
fn rope_norm_eps(op: &'static str, norm: Option<(&Tensor, f32)>, cols: usize) -> Result<u32> {
    let Some((nwt, eps)) = norm else {
        return Ok(0);
    };
    super::expect_f32(op, nwt)?;
    if nwt.shape() != [cols] {
        return Err(Error::Shape {
            op,
            detail: format!("norm weight {:?}, expected [{cols}]", nwt.shape()),
        });
    }
    Ok(eps.to_bits())
}

/// Whether [`qmatmul_rows_rope`] runs as one dispatch here for rows of W `cols` long into
/// caches of `kv` (see there).
pub fn rows_rope_fused(gpu: &Gpu, cols: usize, kv: DType) -> bool {
    cols % 32 == 0
        && kv != DType::U32
        && gpu.limits.max_storage_buffers_per_shader_stage >= ROWS_ROPE_BINDINGS.len() as u32
}

/// The matrix-vector kernel's constants (`c` and its rows of x a workgroup, MV_X: 1 for
/// one row, so that its loops keep one sum in registers, else 8) and grid (8 rows of W by
/// MV_X rows of x a workgroup) for `m` rows of x and `rows` of W.
fn matvec_grid(
    c: &[(&'static str, f64)],
    m: usize,
    rows: usize,
    mv_x: usize,
) -> (Vec<(&'static str, f64)>, Grid) {
    let mut cm = c.to_vec();
    cm.push(("MV_X", mv_x as f64));
    (
        cm,
        Grid::Linear((rows.div_ceil(8) * m.div_ceil(mv_x)) as u64),
    )
}

#[cfg(test)]
mod tests {
    use super::{
        prompt_simt_shape, skinny_bk, split_k, split_k_to, SkinnyLayout, COOP_SPLITK_TARGET,
    };

    #[test]
    fn small_models_narrow_prompt_products_take_qmatvec_rows() {
        // SmolLM2-135M from 65 to 1,024 rows: q/k/v, o and down (8, 5, 5 tiles of W's
        // rows) do, gate/up (24) does not; at 64 rows (the skinny product's), past 1,024
        // rows (8 x 512 of LoRA fine-tuning) none; the 8B (rows of W 4096 long) never.
        let smol = [(960, 576), (576, 576), (576, 1536), (3072, 576)];
        let at = |m: usize| smol.map(|(r, c)| prompt_simt_shape(m, r, c, 8));
        for m in [65, 128, 512, 1024] {
            assert_eq!(at(m), [true, true, true, false], "{m} rows");
        }
        assert_eq!(at(64), [false; 4]);
        assert_eq!(at(1025), [false; 4]);
        assert_eq!(at(4096), [false; 4]);
        assert!(!prompt_simt_shape(512, 1024, 4096, 8));
        assert!(
            !prompt_simt_shape(512, 576, 68, 8),
            "rows of W not whole runs of 32"
        );
        assert!(!prompt_simt_shape(512, 960, 576, 0), "0: never");
    }

    #[test]
    fn rows_rope_pages_are_the_pools() {
        // qmatvec_rows_rope finds a token's cache row with kvcache.wgsl's page size.
        let want = format!("const ROWS_PAGE: u32 = {}u;", crate::ops::kvcache::PAGE);
        assert!(crate::shaders::QUANT.source.contains(&want), "{want}");
        let kv = format!("const PAGE: u32 = {}u;", crate::ops::kvcache::PAGE);
        assert!(crate::shaders::KVCACHE.source.contains(&kv), "{kv}");
    }

    #[test]
    fn skinny_steps_fit_the_workgroup_memory() {
        let h200 = 48 * 1024;
        assert_eq!(skinny_bk(128, 1, h200), 128);
        assert_eq!(skinny_bk(128, 2, h200), 128);
        assert_eq!(skinny_bk(128, 4, h200), 64);
        assert_eq!(skinny_bk(64, 4, h200), 64);
        assert_eq!(skinny_bk(32, 1, h200), 32);
        assert_eq!(skinny_bk(128, 4, 16 * 1024), 32);
    }

    #[test]
    fn skinny_layouts_parse_and_default_to_the_measured_one() {
        let d = SkinnyLayout::parse(None, None, None);
        assert_eq!(d, SkinnyLayout::default());
        // The default invariant split is the cooperative product's.
        for (gn, k) in [(224, 4096), (32, 14336), (48, 4096), (5, 576), (24, 576)] {
            assert_eq!(
                d.invariant_splits(gn, k),
                split_k_to(COOP_SPLITK_TARGET, gn, k)
            );
        }
        let l = SkinnyLayout::parse(Some("128"), Some("64"), Some("2048, 32, glu"));
        assert_eq!(
            (l.bk, l.n, l.split_target, l.split_max, l.split_glu),
            (128, 64, 2048, 32, true)
        );
        assert_eq!(l.invariant_splits(224, 4096), 10);
        let l = SkinnyLayout::parse(Some("64"), Some(" 32 "), Some("1024,4"));
        assert_eq!((l.bk, l.n, l.split_max, l.split_glu), (64, 32, 4, false));
        // Bad values: the default, not a panic.
        for (bk, n, sp) in [
            ("48", "16", "1,0"),
            ("x", "256", "512"),
            ("", "", "1,2,3"),
            ("256", "-64", "0,8"),
        ] {
            assert_eq!(
                SkinnyLayout::parse(Some(bk), Some(n), Some(sp)),
                d,
                "{bk} {n} {sp}"
            );
        }
    }

    #[test]
    fn split_k_fills_a_large_gpu_only_when_tiles_are_few() {
        // SmolLM2's o (576 x 576) and down (576 x 1536) over 512 tokens: 9 x 8 tiles.
        assert_eq!(split_k(72, 576), 4);
        assert_eq!(split_k(72, 1536), 4);
        // Its gate/up (6144 rows): 768 tiles, no split.
        assert_eq!(split_k(768, 576), 1);
        // Slices keep 128 columns at least, and there are at most 8.
        assert_eq!(split_k(3, 96), 1);
        assert_eq!(split_k(3, 300), 2);
        assert_eq!(split_k(3, 2816), 8);
        assert_eq!(split_k(128, 4096), 1);
        // The cooperative product's 128 x 128 tiles: the 8B's o and down over 512 tokens
        // (32 x 4 tiles) in 4 slices; its gate/up (224 x 4) unsplit.
        assert_eq!(split_k_to(COOP_SPLITK_TARGET, 128, 4096), 4);
        assert_eq!(split_k_to(COOP_SPLITK_TARGET, 896, 4096), 1);
    }
}
