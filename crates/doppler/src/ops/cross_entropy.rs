//! Cross-entropy on logits, fused log-softmax + NLL, forward and backward.
//! Shader: `cross_entropy.wgsl` (formulas in its header).
//!
//! d loss_t / d x_tj = softmax(x_t)_j - q_tj, q = (1 - eps) onehot(y_t) + eps / V, so the
//! backward needs only the logits and the saved logsumexp: no softmax is stored.

use super::expect_f32;
use crate::error::{Error, Result};
use crate::gpu::{Binding::*, DType, Grid, Kernel, Recorder, Tensor};
use crate::shaders::CROSS_ENTROPY;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub t: u32,
    pub v: u32,
    pub ignore: u32,
    pub has_ignore: u32,
    pub eps: f32,
    pub _pad: [u32; 3],
}

static FWD: Kernel = Kernel::new(
    &CROSS_ENTROPY,
    "ce_fwd",
    &[
        (1, Read),
        (2, Read),
        (3, ReadWrite),
        (4, ReadWrite),
        (5, ReadWrite),
    ],
);
static MEAN: Kernel = Kernel::new(
    &CROSS_ENTROPY,
    "ce_mean",
    &[(2, Read), (3, ReadWrite), (6, ReadWrite)],
);
static BWD: Kernel = Kernel::new(
    &CROSS_ENTROPY,
    "ce_bwd",
    &[
        (1, Read),
        (2, Read),
        (7, ReadWrite),
        (8, Read),
        (9, Read),
        (10, Read),
    ],
);

static BWD4: Kernel = Kernel::new(
    &CROSS_ENTROPY,
    "ce_bwd4",
    &[
        (11, Read),
        (2, Read),
        (12, ReadWrite),
        (8, Read),
        (9, Read),
        (10, Read),
    ],
);

/// PyTorch's `ignore_index` and `label_smoothing`.
#[derive(Clone, Copy, Debug, Default)]
pub struct CrossEntropyOpts {
    pub ignore_index: Option<u32>,
    pub label_smoothing: f32,
}

/// What the forward produces and the backward needs.
pub struct CrossEntropyOut {
    /// Per-token loss (T); 0 for ignored tokens.
    pub loss: Tensor,
    /// Per-row logsumexp (T), saved for the backward.
    pub lse: Tensor,
    /// (mean loss over non-ignored tokens, their count) as f32 (2).
    pub stats: Tensor,
}

/// The upstream gradient: of the mean loss (a 1-element tensor) or of each token's loss (T).
#[derive(Clone, Copy)]
pub enum Upstream<'a> {
    Mean(&'a Tensor),
    PerToken(&'a Tensor),
}

fn dims(logits: &Tensor, targets: &Tensor, opts: &CrossEntropyOpts) -> Result<(usize, usize)> {
    expect_f32("cross_entropy", logits)?;
    if targets.dtype() != DType::U32 {
        return Err(Error::DType {
            op: "cross_entropy",
            got: targets.dtype(),
            expected: "u32 targets",
        });
    }
    let Some((&v, lead)) = logits.shape().split_last() else {
        return Err(Error::Shape {
            op: "cross_entropy",
            detail: "logits need a vocabulary axis".into(),
        });
    };
    let t: usize = lead.iter().product();
    if v == 0 || targets.numel() != t {
        return Err(Error::Shape {
            op: "cross_entropy",
            detail: format!(
                "logits {:?} vs targets {:?}",
                logits.shape(),
                targets.shape()
            ),
        });
    }
    if !(0.0..=1.0).contains(&opts.label_smoothing) {
        return Err(Error::Invalid {
            op: "cross_entropy",
            detail: format!("label_smoothing {} not in [0, 1]", opts.label_smoothing),
        });
    }
    Ok((t, v))
}

fn params(t: usize, v: usize, opts: &CrossEntropyOpts) -> Params {
    Params {
        t: t as u32,
        v: v as u32,
        ignore: opts.ignore_index.unwrap_or(0),
        has_ignore: opts.ignore_index.is_some() as u32,
        eps: opts.label_smoothing,
        _pad: [0; 3],
    }
}

/// Forward: logits (..., V), targets (...) u32. A target >= V that is not the ignore index
/// is reported as [`Error::IndexOutOfRange`] when the submission finishes.
pub fn cross_entropy(
    rec: &mut Recorder<'_>,
    logits: &Tensor,
    targets: &Tensor,
    opts: CrossEntropyOpts,
) -> Result<CrossEntropyOut> {
    let (t, v) = dims(logits, targets, &opts)?;
    let gpu = rec.gpu();
    let loss = Tensor::empty(gpu, &[t], DType::F32, "cross_entropy.loss")?;
    let lse = Tensor::empty(gpu, &[t], DType::F32, "cross_entropy.lse")?;
    let stats = Tensor::empty(gpu, &[2], DType::F32, "cross_entropy.stats")?;
    let flag = rec.index_check("cross_entropy", targets, v as u32)?;
    let p = params(t, v, &opts);
    rec.dispatch(
        &FWD,
        &[],
        bytemuck::bytes_of(&p),
        &[logits, targets, &loss, &lse, &flag],
        Grid::Linear(t as u64),
    )?;
    rec.dispatch(
        &MEAN,
        &[],
        bytemuck::bytes_of(&p),
        &[targets, &loss, &stats],
        Grid::Linear(1),
    )?;
    Ok(CrossEntropyOut { loss, lse, stats })
}

/// Backward: dlogits (same shape as logits), written directly (not accumulated).
pub fn cross_entropy_backward(
    rec: &mut Recorder<'_>,
    logits: &Tensor,
    targets: &Tensor,
    fwd: &CrossEntropyOut,
    upstream: Upstream<'_>,
    opts: CrossEntropyOpts,
) -> Result<Tensor> {
    let (t, v) = dims(logits, targets, &opts)?;
    let (g, mean) = match upstream {
        Upstream::Mean(g) => (g, true),
        Upstream::PerToken(g) => (g, false),
    };
    expect_f32("cross_entropy_backward", g)?;
    let want = if mean { 1 } else { t };
    if g.numel() != want || fwd.lse.numel() != t {
        return Err(Error::Shape {
            op: "cross_entropy_backward",
            detail: format!(
                "upstream {:?} (want {want} elements), lse {:?}, {t} rows",
                g.shape(),
                fwd.lse.shape()
            ),
        });
    }
    let dlogits = Tensor::empty(
        rec.gpu(),
        logits.shape(),
        DType::F32,
        "cross_entropy.dlogits",
    )?;
    let p = params(t, v, &opts);
    // Four logits a thread when rows split into whole vec4s.
    let (kernel, items) = if v % 4 == 0 {
        (&BWD4, t * v / 4)
    } else {
        (&BWD, t * v)
    };
    rec.dispatch(
        kernel,
        &[("MEAN", mean as u32 as f64)],
        bytemuck::bytes_of(&p),
        &[logits, targets, &dlogits, g, &fwd.stats, &fwd.lse],
        Grid::cover(items as u64, 256),
    )?;
    Ok(dlogits)
}
