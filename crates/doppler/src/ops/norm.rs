//! Row normalisations over the last axis: LayerNorm and RMSNorm (also the `(1 + w)` weight
//! variant), forward saving per-row statistics, backward giving dx, dw (and db).
//! Shader: `norm.wgsl` (derivatives in its header).

use super::expect_f32;
use crate::error::{Error, Result};
use crate::gpu::{Binding::*, DType, Grid, Kernel, Recorder, Tensor};
use crate::shaders::NORM;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub rows: u32,
    pub d: u32,
    pub eps: f32,
    pub blocks: u32,
}

static FWD: Kernel = Kernel::new(
    &NORM,
    "norm_fwd",
    &[
        (1, Read),
        (2, Read),
        (3, Read),
        (4, ReadWrite),
        (5, ReadWrite),
        (6, ReadWrite),
    ],
);
static BWD_DX: Kernel = Kernel::new(
    &NORM,
    "norm_bwd_dx",
    &[
        (1, Read),
        (2, Read),
        (7, Read),
        (8, ReadWrite),
        (12, Read),
        (13, Read),
        (14, Read),
    ],
);
static BWD_WP: Kernel = Kernel::new(
    &NORM,
    "norm_bwd_wp",
    &[(1, Read), (7, Read), (9, ReadWrite), (12, Read), (13, Read)],
);
static BWD_W: Kernel = Kernel::new(
    &NORM,
    "norm_bwd_w",
    &[(9, ReadWrite), (10, ReadWrite), (11, ReadWrite)],
);

static HEADS: Kernel = Kernel::new(&NORM, "norm_heads", &[(2, Read), (4, ReadWrite)]);

/// RMSNorm of every query and key head in place (Qwen3's q_norm and k_norm; Gemma 3's with
/// `one_plus`): `qkv` (T, (Hq + 2 Hkv) D) holds each token's q heads, then k, then v; `w`
/// (2, D) holds q's weight, then k's. v is left as it is.
///   q[t, h] = q[t, h] * rsqrt(mean(q[t, h]^2) + eps) * w[0]   (and k with w[1])
pub fn rms_norm_heads(
    rec: &mut Recorder<'_>,
    qkv: &Tensor,
    w: &Tensor,
    hq: usize,
    hkv: usize,
    eps: f32,
    one_plus: bool,
) -> Result<()> {
    expect_f32("rms_norm_heads", qkv)?;
    expect_f32("rms_norm_heads", w)?;
    let sh = qkv.shape();
    let d = w.numel() / 2;
    let width = (hq + 2 * hkv) * d;
    if hq == 0 || hkv == 0 || d == 0 || w.numel() != 2 * d || sh.len() != 2 || sh[1] != width {
        return Err(Error::Shape {
            op: "rms_norm_heads",
            detail: format!(
                "qkv {sh:?}, weights {:?}, {hq} query and {hkv} key/value heads: expected qkv (T, (Hq + 2 Hkv) D) and weights (2, D)",
                w.shape()
            ),
        });
    }
    let rows = sh[0] * (hq + hkv);
    let p = params(rows, d, eps);
    let c = [
        ("WG", 64.0),
        ("ONE_PLUS", one_plus as u32 as f64),
        ("HQ", hq as f64),
        ("HKV", hkv as f64),
    ];
    rec.dispatch(
        &HEADS,
        &c,
        bytemuck::bytes_of(&p),
        &[w, qkv],
        Grid::Linear(rows as u64),
    )
}

/// Rows per weight-gradient block (`ROWS_PER_BLOCK` in the shader).
const ROWS_PER_BLOCK: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    Layer,
    /// `one_plus`: the weight is applied as (1 + w).
    Rms {
        one_plus: bool,
    },
}

impl NormKind {
    fn constants(self) -> [(&'static str, f64); 2] {
        let (rms, one_plus) = match self {
            NormKind::Layer => (false, false),
            NormKind::Rms { one_plus } => (true, one_plus),
        };
        [
            ("RMS", rms as u32 as f64),
            ("ONE_PLUS", one_plus as u32 as f64),
        ]
    }
}

pub struct NormOut {
    pub y: Tensor,
    /// (R) row means (zeros for RMSNorm).
    pub mean: Tensor,
    /// (R) 1 / sqrt(var + eps), or 1 / sqrt(mean(x^2) + eps).
    pub rstd: Tensor,
}

pub struct NormGrads {
    pub dx: Tensor,
    pub dw: Tensor,
    /// LayerNorm only.
    pub db: Option<Tensor>,
}

fn rows_d(op: &'static str, x: &Tensor, w: &Tensor) -> Result<(usize, usize)> {
    expect_f32(op, x)?;
    expect_f32(op, w)?;
    let d = x.shape().last().copied().unwrap_or(0);
    if d == 0 || w.shape() != [d] {
        return Err(Error::Shape {
            op,
            detail: format!(
                "x {:?}, weight {:?}: weight must be [last dim of x]",
                x.shape(),
                w.shape()
            ),
        });
    }
    Ok((x.numel() / d, d))
}

fn params(rows: usize, d: usize, eps: f32) -> Params {
    Params {
        rows: rows as u32,
        d: d as u32,
        eps,
        blocks: rows.div_ceil(ROWS_PER_BLOCK) as u32,
    }
}

fn forward(
    rec: &mut Recorder<'_>,
    kind: NormKind,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    eps: f32,
) -> Result<NormOut> {
    let op = if kind == NormKind::Layer {
        "layer_norm"
    } else {
        "rms_norm"
    };
    let (rows, d) = rows_d(op, x, w)?;
    if let Some(b) = b {
        expect_f32(op, b)?;
        if b.shape() != w.shape() {
            return Err(Error::Shape {
                op,
                detail: format!("bias {:?} vs weight {:?}", b.shape(), w.shape()),
            });
        }
    }
    let gpu = rec.gpu();
    let y = Tensor::empty(gpu, x.shape(), DType::F32, "norm.y")?;
    let mean = Tensor::empty(gpu, &[rows], DType::F32, "norm.mean")?;
    let rstd = Tensor::empty(gpu, &[rows], DType::F32, "norm.rstd")?;
    let p = params(rows, d, eps);
    rec.dispatch(
        &FWD,
        &kind.constants(),
        bytemuck::bytes_of(&p),
        &[x, w, b.unwrap_or(w), &y, &mean, &rstd],
        Grid::Linear(rows as u64),
    )?;
    Ok(NormOut { y, mean, rstd })
}

fn backward(
    rec: &mut Recorder<'_>,
    kind: NormKind,
    x: &Tensor,
    w: &Tensor,
    fwd: &NormOut,
    dy: &Tensor,
    add_to: Option<&Tensor>,
) -> Result<NormGrads> {
    let op = if kind == NormKind::Layer {
        "layer_norm_backward"
    } else {
        "rms_norm_backward"
    };
    let (rows, d) = rows_d(op, x, w)?;
    expect_f32(op, dy)?;
    if dy.shape() != x.shape() || fwd.rstd.numel() != rows || fwd.mean.numel() != rows {
        return Err(Error::Shape {
            op,
            detail: format!(
                "x {:?}, dy {:?}, saved statistics {:?}",
                x.shape(),
                dy.shape(),
                fwd.rstd.shape()
            ),
        });
    }
    if let Some(t) = add_to {
        expect_f32(op, t)?;
        if t.shape() != x.shape() {
            return Err(Error::Shape {
                op,
                detail: format!(
                    "gradient to add {:?}, x {:?}: expected the same shape",
                    t.shape(),
                    x.shape()
                ),
            });
        }
    }
    let gpu = rec.gpu();
    let p = params(rows, d, 0.0);
    let c = kind.constants();
    let c_dx = [c[0], c[1], ("ADD", add_to.is_some() as u32 as f64)];
    let pb = bytemuck::bytes_of(&p);
    let dx = Tensor::empty(gpu, x.shape(), DType::F32, "norm.dx")?;
    let partial = Tensor::empty(gpu, &[p.blocks as usize, d, 2], DType::F32, "norm.partial")?;
    let dw = Tensor::empty(gpu, &[d], DType::F32, "norm.dw")?;
    let db = Tensor::empty(gpu, &[d], DType::F32, "norm.db")?;
    // Without a gradient to add, dy stands in for the unread binding.
    rec.dispatch(
        &BWD_DX,
        &c_dx,
        pb,
        &[x, w, dy, &dx, &fwd.mean, &fwd.rstd, add_to.unwrap_or(dy)],
        Grid::Linear(rows as u64),
    )?;
    rec.dispatch(
        &BWD_WP,
        &c,
        pb,
        &[x, dy, &partial, &fwd.mean, &fwd.rstd],
        Grid::cover(p.blocks as u64 * d as u64, 256),
    )?;
    rec.dispatch(
        &BWD_W,
        &c,
        pb,
        &[&partial, &dw, &db],
        Grid::cover(d as u64, 256),
    )?;
    Ok(NormGrads {
        dx,
        dw,
        db: (kind == NormKind::Layer).then_some(db),
    })
}

/// y = (x - mean) / sqrt(var + eps) * w + b over the last axis.
pub fn layer_norm(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    eps: f32,
) -> Result<NormOut> {
    forward(rec, NormKind::Layer, x, w, Some(b), eps)
}

/// dx, dw, db of [`layer_norm`] for upstream dy; `add_to` (x's shape): another gradient of
/// x added to dx in the same pass (a residual branch's), as `elementwise::add` would.
pub fn layer_norm_backward(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    w: &Tensor,
    fwd: &NormOut,
    dy: &Tensor,
    add_to: Option<&Tensor>,
) -> Result<NormGrads> {
    backward(rec, NormKind::Layer, x, w, fwd, dy, add_to)
}

/// y = x / sqrt(mean(x^2) + eps) * w (or * (1 + w)) over the last axis.
pub fn rms_norm(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    w: &Tensor,
    eps: f32,
    one_plus: bool,
) -> Result<NormOut> {
    forward(rec, NormKind::Rms { one_plus }, x, w, None, eps)
}

/// dx, dw of [`rms_norm`] for upstream dy; `add_to` as in [`layer_norm_backward`].
pub fn rms_norm_backward(
    rec: &mut Recorder<'_>,
    x: &Tensor,
    w: &Tensor,
    fwd: &NormOut,
    dy: &Tensor,
    one_plus: bool,
    add_to: Option<&Tensor>,
) -> Result<NormGrads> {
    backward(rec, NormKind::Rms { one_plus }, x, w, fwd, dy, add_to)
}
