//! Causal self-attention, flash style, with grouped-query heads: forward saves the
//! logsumexp per query row, backward recomputes the probabilities tile by tile. Shader:
//! `attention.wgsl` (derivatives in its header), or `attention_coop.wgsl` on cooperative
//! matrices (f16 operands, f32 sums) when the GPU was opened with
//! [`crate::gpu::MatmulMode::F16`] and has them. Nothing of size Tq x Tk reaches
//! global memory: not even dropout's mask on the probabilities (GPT-2's and nanoGPT's
//! attention dropout), which every kernel regenerates from (seed, row, key).

use super::expect_f32;
use crate::error::{Error, Result};
use crate::gpu::{Binding::*, DType, Grid, Kernel, Recorder, Tensor};
use crate::shaders::{ATTENTION, ATTENTION_COOP};

#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub b: u32,
    pub tq: u32,
    pub tk: u32,
    pub hq: u32,
    pub hkv: u32,
    pub causal: u32,
    pub scale: f32,
    pub _pad: u32,
    /// Dropout on the probabilities: keep p_ij when its 24-bit draw >= threshold (0: no
    /// dropout), kept ones times drop_scale = 1 / (1 - p).
    pub seed_lo: u32,
    pub seed_hi: u32,
    pub threshold: u32,
    pub drop_scale: f32,
}

static FWD: Kernel = Kernel::new(
    &ATTENTION,
    "attn_fwd",
    &[
        (1, Read),
        (2, Read),
        (3, Read),
        (4, ReadWrite),
        (5, ReadWrite),
    ],
);
static DELTA: Kernel = Kernel::new(
    &ATTENTION,
    "attn_delta",
    &[(6, Read), (7, Read), (9, ReadWrite)],
);
static BWD_DQ: Kernel = Kernel::new(
    &ATTENTION,
    "attn_bwd_dq",
    &[
        (1, Read),
        (2, Read),
        (3, Read),
        (7, Read),
        (8, Read),
        (10, Read),
        (11, ReadWrite),
    ],
);
static BWD_DKV: Kernel = Kernel::new(
    &ATTENTION,
    "attn_bwd_dkv",
    &[
        (1, Read),
        (2, Read),
        (3, Read),
        (7, Read),
        (8, Read),
        (10, Read),
        (12, ReadWrite),
        (13, ReadWrite),
    ],
);
// The tiled kernels share one staging function that can read dO (binding 7): the forward
// binds q there, unread.
static FWD_T: Kernel = Kernel::new(
    &ATTENTION,
    "attn_fwd_tiled",
    &[
        (1, Read),
        (2, Read),
        (3, Read),
        (4, ReadWrite),
        (5, ReadWrite),
        (7, Read),
    ],
);
static BWD_DQ_T: Kernel = Kernel::new(
    &ATTENTION,
    "attn_bwd_dq_tiled",
    &[
        (1, Read),
        (2, Read),
        (3, Read),
        (7, Read),
        (8, Read),
        (10, Read),
        (11, ReadWrite),
    ],
);
static BWD_DKV_T: Kernel = Kernel::new(
    &ATTENTION,
    "attn_bwd_dkv_tiled",
    &[
        (1, Read),
        (2, Read),
        (3, Read),
        (7, Read),
        (8, Read),
        (10, Read),
        (12, ReadWrite),
        (13, ReadWrite),
    ],
);

// The same three on cooperative matrices (f16 operands, f32 sums); their staging function
// can read dO too.
const COOP: wgpu::Features =
    wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX.union(wgpu::Features::SHADER_F16);
static FWD_C: Kernel = Kernel {
    shader: &ATTENTION_COOP,
    entry: "attn_fwd_coop",
    storage: FWD_T.storage,
    features: COOP,
};
/// The forward for head dims 65..=128 (forward only: prompts).
static FWD_CW: Kernel = Kernel {
    shader: &ATTENTION_COOP,
    entry: "attn_fwd_coop_wide",
    storage: &[
        (1, Read),
        (2, Read),
        (3, Read),
        (4, ReadWrite),
        (5, ReadWrite),
    ],
    features: COOP,
};
static BWD_DQ_C: Kernel = Kernel {
    shader: &ATTENTION_COOP,
    entry: "attn_bwd_dq_coop",
    storage: BWD_DQ_T.storage,
    features: COOP,
};
static BWD_DKV_C: Kernel = Kernel {
    shader: &ATTENTION_COOP,
    entry: "attn_bwd_dkv_coop",
    storage: BWD_DKV_T.storage,
    features: COOP,
};

/// Rows per workgroup of the cooperative-matrix kernels, the workgroup memory they need
/// (bytes: three 64 x 72 f16 tiles, 4 x 16 x 68 f32 scratch, 128 floats), the largest
/// head dim.
const COOP_ROWS: u64 = 64;
const COOP_SHARED: u32 = 3 * 64 * 72 * 2 + 4 * 16 * 68 * 4 + 128 * 4;
pub const COOP_MAX_HEAD_DIM: usize = 64;
/// The same for `attn_fwd_coop_wide` (one 64 x 136 f16 tile, the probabilities' 64 x 72
/// f16, the scratch and 128 floats), and its largest head dim.
const COOP_WIDE_SHARED: u32 = 64 * 136 * 2 + 64 * 72 * 2 + 4 * 16 * 68 * 4 + 128 * 4;
pub const COOP_FORWARD_MAX_HEAD_DIM: usize = 128;

/// Rows per workgroup of the tiled kernels, and the workgroup memory they need (bytes).
const TILED_ROWS: u64 = 32;
const TILED_SHARED: u32 = 31 * 1024;
/// Largest head dimension of the tiled kernels.
pub const TILED_MAX_HEAD_DIM: usize = 64;

/// Which kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AttnPath {
    /// Tiled where the head dim (<= 64) and the device's workgroup memory allow, else rows.
    #[default]
    Auto,
    /// One thread per row: any head dim up to 128, little workgroup memory.
    Rows,
    /// Score tiles shared by 256 threads (head dim <= 64, 31 KB of workgroup memory).
    Tiled,
    /// Cooperative matrices with f16 operands (head dim <= 64, 45 KB of workgroup memory,
    /// the adapter's cooperative matrices, f16 and subgroups of 32; the forward alone to
    /// head dim 128 in 44 KB). `Auto` takes it when the GPU was opened for f16 products
    /// ([`crate::gpu::MatmulMode::F16`]) and the head dim is <= 64.
    Coop,
}

/// Rows per workgroup (one thread each), as `BR` in the shader.
const BR: u64 = 64;
/// Largest head dimension (`D4MAX * 4` in the shader).
pub const MAX_HEAD_DIM: usize = 128;

#[derive(Clone, Copy, Debug)]
pub struct AttnOpts {
    /// Query i sees key j only if j <= i + Tk - Tq.
    pub causal: bool,
    /// Multiplies q.k; 1/sqrt(D) when None.
    pub scale: Option<f32>,
    pub path: AttnPath,
    /// Dropout on the attention probabilities (training only); none when absent.
    pub dropout: Option<AttnDropout>,
}

impl Default for AttnOpts {
    fn default() -> Self {
        AttnOpts {
            causal: true,
            scale: None,
            path: AttnPath::Auto,
            dropout: None,
        }
    }
}

/// Inverted dropout on the probabilities, as PyTorch's `scaled_dot_product_attention(...,
/// dropout_p)`: o_i = sum_j z_ij p_ij v_j with z_ij = 1 / (1 - p) where kept, 0 where
/// dropped; the softmax (and its logsumexp) is over the undropped scores. The mask is a
/// hash of (seed, row (b, h, i), key j), the same in the forward and the backward, on
/// every kernel set and every device ([`crate::reference::dropout::attn_keep`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnDropout {
    /// Drop probability in [0, 1).
    pub p: f64,
    pub seed: u64,
}

/// The tiled kernels' workgroup memory as a browser's WebGPU (Dawn, Chromium 156) counts
/// it: every workgroup variable an entry point can reach, not only those it uses;
/// `attn_bwd_dkv_tiled` is the largest at 43,392 bytes (forward 40,960, dq 38,912), past
/// the 32 KiB browsers offer, so there the rows kernels run.
const TILED_SHARED_BROWSER: u32 = 43_392;

/// Whether the tiled kernels can run for head dim `d` on this GPU.
pub fn tiled_fits(gpu: &crate::gpu::Gpu, d: usize) -> bool {
    let need = match gpu.info.backend {
        wgpu::Backend::BrowserWebGpu => TILED_SHARED_BROWSER,
        _ => TILED_SHARED,
    };
    d <= TILED_MAX_HEAD_DIM && gpu.limits.max_compute_workgroup_storage_size >= need
}

/// The attention kernels [`AttnPath::Auto`] runs for head dim `d` on this GPU: `coop`,
/// `tiled` or `rows` (what `doppler info` and the browser's `init()` report).
pub fn auto_path(gpu: &crate::gpu::Gpu, d: usize) -> &'static str {
    let coop = coop_fits(gpu, d) && gpu.matmul == crate::gpu::MatmulMode::F16;
    match (coop, tiled_fits(gpu, d)) {
        (true, _) => "coop",
        (false, true) => "tiled",
        (false, false) => "rows",
    }
}

/// Whether the cooperative-matrix kernels can run for head dim `d` on this GPU.
pub fn coop_fits(gpu: &crate::gpu::Gpu, d: usize) -> bool {
    d <= COOP_MAX_HEAD_DIM
        && gpu.coop_matmul_possible()
        && gpu.limits.max_compute_workgroup_storage_size >= COOP_SHARED
}

/// Whether the cooperative-matrix forward can run for head dim `d` on this GPU (to 128:
/// `attn_fwd_coop_wide` past 64; the backward stays at [`coop_fits`]).
pub fn coop_forward_fits(gpu: &crate::gpu::Gpu, d: usize) -> bool {
    coop_fits(gpu, d)
        || (d <= COOP_FORWARD_MAX_HEAD_DIM
            && gpu.coop_matmul_possible()
            && gpu.limits.max_compute_workgroup_storage_size >= COOP_WIDE_SHARED)
}

/// The kernel set that runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Set {
    Rows,
    Tiled,
    Coop,
    /// `attn_fwd_coop_wide` (forward only).
    CoopWide,
}

/// Which kernels run for head dim `d` (in the `backward` or the forward).
fn kernel_set(rec: &Recorder<'_>, d: usize, path: AttnPath, backward: bool) -> Result<Set> {
    let gpu = rec.gpu();
    let tiled = tiled_fits(gpu, d);
    let coop = coop_fits(gpu, d);
    match path {
        AttnPath::Coop if !coop && !backward && coop_forward_fits(gpu, d) => Ok(Set::CoopWide),
        AttnPath::Auto if coop && (gpu.matmul == crate::gpu::MatmulMode::F16) => Ok(Set::Coop),
        AttnPath::Auto if tiled => Ok(Set::Tiled),
        AttnPath::Auto | AttnPath::Rows => Ok(Set::Rows),
        AttnPath::Tiled if tiled => Ok(Set::Tiled),
        AttnPath::Coop if coop => Ok(Set::Coop),
        AttnPath::Tiled => Err(Error::Invalid {
            op: "attention",
            detail: format!(
                "tiled kernels need head dim <= {TILED_MAX_HEAD_DIM} (got {d}) and {TILED_SHARED} bytes of workgroup memory (device: {})",
                gpu.limits.max_compute_workgroup_storage_size
            ),
        }),
        AttnPath::Coop => Err(Error::Invalid {
            op: "attention",
            detail: format!(
                "cooperative-matrix kernels need head dim <= {COOP_MAX_HEAD_DIM} (the forward alone: {COOP_FORWARD_MAX_HEAD_DIM}; got {d}), {COOP_SHARED} bytes of workgroup memory (device: {}), and cooperative matrices, f16 and subgroups of 32 (adapter {})",
                gpu.limits.max_compute_workgroup_storage_size, gpu.info.name
            ),
        }),
    }
}

/// Forward results: o (B, Tq, Hq, D) and the logsumexp of each score row (B, Hq, Tq).
pub struct AttnOut {
    pub o: Tensor,
    pub lse: Tensor,
}

pub struct AttnGrads {
    pub dq: Tensor,
    pub dk: Tensor,
    pub dv: Tensor,
}

/// (params, head dim) from q (B, Tq, Hq, D) and k, v (B, Tk, Hkv, D).
pub fn attn_params(
    q: &[usize],
    k: &[usize],
    v: &[usize],
    opts: &AttnOpts,
) -> Result<(Params, usize)> {
    let err = |why: &str| Error::Shape {
        op: "attention",
        detail: format!("q {q:?}, k {k:?}, v {v:?}: {why}"),
    };
    if q.len() != 4 || k.len() != 4 || k != v {
        return Err(err(
            "expected q (B, Tq, Hq, D) and k, v of one shape (B, Tk, Hkv, D)",
        ));
    }
    let (b, tq, hq, d) = (q[0], q[1], q[2], q[3]);
    let (tk, hkv) = (k[1], k[2]);
    if k[0] != b || k[3] != d {
        return Err(err("batch and head dimension must match"));
    }
    if d == 0 || d % 4 != 0 || d > MAX_HEAD_DIM {
        return Err(err(&format!(
            "head dimension must be a multiple of 4 up to {MAX_HEAD_DIM}"
        )));
    }
    if hkv == 0 || hq % hkv != 0 {
        return Err(err("query heads must be a multiple of key/value heads"));
    }
    if b == 0 || tq == 0 || tk == 0 {
        return Err(err("empty batch or sequence"));
    }
    if opts.causal && tk < tq {
        return Err(err(
            "causal attention needs at least as many keys as queries",
        ));
    }
    let scale = opts.scale.unwrap_or(1.0 / (d as f32).sqrt());
    let drop = match opts.dropout {
        Some(dr) if !(0.0..1.0).contains(&dr.p) => {
            return Err(Error::Invalid {
                op: "attention",
                detail: format!("dropout probability {} not in [0, 1)", dr.p),
            })
        }
        Some(dr) if dr.p > 0.0 => crate::ops::dropout::params(0, dr.p, dr.seed),
        _ => crate::ops::dropout::params(0, 0.0, 0),
    };
    let p = Params {
        b: b as u32,
        tq: tq as u32,
        tk: tk as u32,
        hq: hq as u32,
        hkv: hkv as u32,
        causal: opts.causal as u32,
        scale,
        _pad: 0,
        seed_lo: drop.seed_lo,
        seed_hi: drop.seed_hi,
        threshold: drop.threshold,
        drop_scale: drop.scale,
    };
    Ok((p, d))
}

/// Override constants: D4 and the staged tile height, the largest of 64/32/16/8 rows whose
/// two tiles (plus two floats per row) fit the device's workgroup memory.
fn constants(rec: &Recorder<'_>, d: usize) -> Result<[(&'static str, f64); 2]> {
    let limit = rec.gpu().limits.max_compute_workgroup_storage_size as usize;
    let per_row = 2 * d * 4 + 8;
    let Some(bc) = [64usize, 32, 16, 8]
        .into_iter()
        .find(|bc| bc * per_row <= limit)
    else {
        return Err(Error::Invalid {
            op: "attention",
            detail: format!(
                "head dim {d} needs {} bytes of workgroup memory, device has {limit}",
                8 * per_row
            ),
        });
    };
    Ok([("D4", (d / 4) as f64), ("BC", bc as f64)])
}

fn check_all_f32(ts: &[&Tensor]) -> Result<()> {
    ts.iter().try_for_each(|t| expect_f32("attention", t))
}

/// softmax(scale * q k^T, causal mask) v per head; q (B, Tq, Hq, D), k, v (B, Tk, Hkv, D).
pub fn attention(
    rec: &mut Recorder<'_>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: AttnOpts,
) -> Result<AttnOut> {
    check_all_f32(&[q, k, v])?;
    let (p, d) = attn_params(q.shape(), k.shape(), v.shape(), &opts)?;
    let c = constants(rec, d)?;
    let o = Tensor::empty(rec.gpu(), q.shape(), DType::F32, "attention.o")?;
    let lse = Tensor::empty(
        rec.gpu(),
        &[q.shape()[0], q.shape()[2], q.shape()[1]],
        DType::F32,
        "attention.lse",
    )?;
    let (kernel, rows, c) = match kernel_set(rec, d, opts.path, false)? {
        Set::Coop => (&FWD_C, COOP_ROWS, &c[..1]),
        Set::CoopWide => (&FWD_CW, COOP_ROWS, &c[..1]),
        Set::Tiled => (&FWD_T, TILED_ROWS, &c[..1]),
        Set::Rows => (&FWD, BR, &c[..]),
    };
    let groups = (p.b * p.hq) as u64 * (p.tq as u64).div_ceil(rows);
    // FWD_T and FWD_C also bind dO's slot (7): q goes there, unread (FWD_CW binds five).
    let bound = [q, k, v, &o, &lse, q];
    rec.dispatch(
        kernel,
        c,
        bytemuck::bytes_of(&p),
        &bound[..kernel.storage.len()],
        Grid::Linear(groups),
    )?;
    Ok(AttnOut { o, lse })
}

/// (dq, dk, dv) from the forward's inputs, its outputs and dO (B, Tq, Hq, D).
pub fn attention_backward(
    rec: &mut Recorder<'_>,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    fwd: &AttnOut,
    d_o: &Tensor,
    opts: AttnOpts,
) -> Result<AttnGrads> {
    check_all_f32(&[q, k, v, &fwd.o, &fwd.lse, d_o])?;
    let (p, d) = attn_params(q.shape(), k.shape(), v.shape(), &opts)?;
    if d_o.shape() != q.shape() || fwd.o.shape() != q.shape() {
        return Err(Error::Shape {
            op: "attention_backward",
            detail: format!(
                "dO {:?} and o {:?} must have q's shape {:?}",
                d_o.shape(),
                fwd.o.shape(),
                q.shape()
            ),
        });
    }
    let c = constants(rec, d)?;
    let gpu = rec.gpu();
    let delta = Tensor::empty(gpu, fwd.lse.shape(), DType::F32, "attention.delta")?;
    let rows = fwd.lse.numel() as u64;
    rec.dispatch(
        &DELTA,
        &c,
        bytemuck::bytes_of(&p),
        &[&fwd.o, d_o, &delta],
        Grid::cover(rows, BR),
    )?;
    let dq = Tensor::empty(gpu, q.shape(), DType::F32, "attention.dq")?;
    let dk = Tensor::empty(gpu, k.shape(), DType::F32, "attention.dk")?;
    let dv = Tensor::empty(gpu, v.shape(), DType::F32, "attention.dv")?;
    let (dq_k, dkv_k, rows, c) = match kernel_set(rec, d, opts.path, true)? {
        Set::Coop | Set::CoopWide => (&BWD_DQ_C, &BWD_DKV_C, COOP_ROWS, &c[..1]),
        Set::Tiled => (&BWD_DQ_T, &BWD_DKV_T, TILED_ROWS, &c[..1]),
        Set::Rows => (&BWD_DQ, &BWD_DKV, BR, &c[..]),
    };
    let q_groups = (p.b * p.hq) as u64 * (p.tq as u64).div_ceil(rows);
    rec.dispatch(
        dq_k,
        c,
        bytemuck::bytes_of(&p),
        &[q, k, v, d_o, &fwd.lse, &delta, &dq],
        Grid::Linear(q_groups),
    )?;
    let k_groups = (p.b * p.hkv) as u64 * (p.tk as u64).div_ceil(rows);
    rec.dispatch(
        dkv_k,
        c,
        bytemuck::bytes_of(&p),
        &[q, k, v, d_o, &fwd.lse, &delta, &dk, &dv],
        Grid::Linear(k_groups),
    )?;
    Ok(AttnGrads { dq, dk, dv })
}
