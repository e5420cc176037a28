//! Cross-entropy forward (per-token loss, logsumexp, mean) and backward.

use super::{push, s, twice, CheckResult};
use crate::check::{compare, Rng, Tolerance};
use crate::gpu::{Gpu, Tensor};
use crate::ops::cross_entropy::{
    cross_entropy, cross_entropy_backward, CrossEntropyOpts, Upstream,
};
use crate::reference::{cross_entropy as cpu, widen};

pub struct CeCase {
    pub logits: &'static [usize],
    pub ignore_index: Option<u32>,
    /// Every `ignore_every`-th token gets the ignore index (0: none).
    pub ignore_every: usize,
    pub smoothing: f32,
    pub mean: bool,
}

/// A batch of sequences, a large vocabulary row, one past 65535 x 256 logits (backward
/// grid goes 2-D), per-token upstream gradients, a batch where every token is ignored, and
/// vocabularies that are multiples of 4 (the vec4 backward).
pub const CE_CASES: [CeCase; 6] = [
    CeCase {
        logits: &[2, 3, 5],
        ignore_index: Some(2),
        ignore_every: 4,
        smoothing: 0.0,
        mean: true,
    },
    CeCase {
        logits: &[37, 1000],
        ignore_index: Some(u32::MAX),
        ignore_every: 5,
        smoothing: 0.1,
        mean: true,
    },
    CeCase {
        logits: &[5, 50_001],
        ignore_index: None,
        ignore_every: 0,
        smoothing: 0.0,
        mean: false,
    },
    CeCase {
        logits: &[512, 32_771],
        ignore_index: Some(7),
        ignore_every: 9,
        smoothing: 0.05,
        mean: true,
    },
    CeCase {
        logits: &[3, 10],
        ignore_index: Some(4),
        ignore_every: 1,
        smoothing: 0.0,
        mean: true,
    },
    CeCase {
        logits: &[2, 9, 4096],
        ignore_index: Some(0),
        ignore_every: 7,
        smoothing: 0.2,
        mean: false,
    },
];

pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (i, c) in CE_CASES.iter().enumerate() {
        let v = *c.logits.last().unwrap();
        let t: usize = c.logits.iter().product::<usize>() / v;
        let mut rng = Rng::new(600 + i as u64);
        let x: Vec<f32> = rng.vec(t * v).iter().map(|a| a * 8.0).collect();
        let y: Vec<u32> = (0..t)
            .map(|k| match c.ignore_index {
                Some(ig) if c.ignore_every > 0 && k % c.ignore_every == 0 => ig,
                _ => (rng.next_u64() % v as u64) as u32,
            })
            .collect();
        let g: Vec<f32> = if c.mean { vec![1.5] } else { rng.vec(t) };
        let opts = CrossEntropyOpts {
            ignore_index: c.ignore_index,
            label_smoothing: c.smoothing,
        };
        let shape = format!(
            "{:?}{}{}",
            c.logits,
            if c.smoothing > 0.0 { " smoothing" } else { "" },
            if c.mean { " mean" } else { " per-token" }
        );
        let r = twice("cross_entropy", async || {
            let tx = Tensor::from_f32(gpu, c.logits, &x, "logits")?;
            let ty = Tensor::from_u32(gpu, &c.logits[..c.logits.len() - 1], &y, "targets")?;
            let tg = Tensor::from_f32(gpu, &[g.len()], &g, "g")?;
            let mut rec = gpu.recorder("cross_entropy");
            let fwd = cross_entropy(&mut rec, &tx, &ty, opts)?;
            let up = if c.mean {
                Upstream::Mean(&tg)
            } else {
                Upstream::PerToken(&tg)
            };
            let dx = cross_entropy_backward(&mut rec, &tx, &ty, &fwd, up, opts)?;
            rec.submit()?.settle(gpu).await?;
            Ok(vec![
                fwd.loss.to_vec_f32(gpu).await?,
                fwd.lse.to_vec_f32(gpu).await?,
                fwd.stats.to_vec_f32(gpu).await?,
                dx.to_vec_f32(gpu).await?,
            ])
        })
        .await;
        let (fwd, bwd) = match r {
            Err(e) => (Err(e.clone()), Err(e)),
            Ok(got) => {
                let xd = widen(&x);
                let eps = c.smoothing as f64;
                let (loss, lse, mean, count) = cpu::cross_entropy(&xd, &y, v, c.ignore_index, eps);
                let gt: Vec<f64> = if c.mean {
                    vec![g[0] as f64 / count as f64; t]
                } else {
                    widen(&g)
                };
                let dx = cpu::cross_entropy_backward(&xd, &y, v, c.ignore_index, eps, &gt);
                // Rounding grows with the magnitudes involved and log2(V) (tree sums).
                let tol = Tolerance {
                    abs: 0.0,
                    rel: 4.0 * ((v as f64).log2() + 4.0) * f32::EPSILON as f64,
                };
                let row_scale: Vec<f64> = (0..t).map(|r| lse[r].abs() + 8.0 + 1.0).collect();
                let mean_scale = [row_scale.iter().sum::<f64>() / t as f64, 1.0];
                let dx_scale: Vec<f64> = (0..t * v)
                    .map(|k| {
                        let r = k / v;
                        let prob = (xd[k] - lse[r]).exp();
                        gt[r].abs()
                            * (prob
                                + 1.0 / v as f64
                                + if k % v == y[r] as usize { 1.0 } else { 0.0 })
                            * row_scale[r]
                    })
                    .collect();
                let fwd = (|| {
                    let a = compare("cross_entropy loss", &got[0], &loss, Some(&row_scale), tol)
                        .map_err(s)?;
                    compare("cross_entropy lse", &got[1], &lse, Some(&row_scale), tol)
                        .map_err(s)?;
                    if count == 0 {
                        // PyTorch gives NaN for the mean of no tokens.
                        if !got[2][0].is_nan() || got[2][1] != 0.0 {
                            return Err(format!("all ignored: stats {:?}, want [NaN, 0]", got[2]));
                        }
                    } else {
                        compare(
                            "cross_entropy mean",
                            &got[2],
                            &[mean, count as f64],
                            Some(&mean_scale),
                            tol,
                        )
                        .map_err(s)?;
                    }
                    Ok(a)
                })();
                (
                    fwd,
                    compare("cross_entropy backward", &got[3], &dx, Some(&dx_scale), tol)
                        .map_err(s),
                )
            }
        };
        push(out, "cross_entropy", shape.clone(), fwd);
        push(out, "cross_entropy backward", shape, bwd);
    }
    push(
        out,
        "cross_entropy bad target",
        "[3, 10], target 10".into(),
        bad_target(gpu).await,
    );
}

/// A target >= V must come back as an error naming the position and the id.
async fn bad_target(gpu: &Gpu) -> super::Outcome {
    let tx = Tensor::from_f32(gpu, &[3, 10], &[0.0; 30], "logits").map_err(s)?;
    let ty = Tensor::from_u32(gpu, &[3], &[1, 10, 2], "targets").map_err(s)?;
    match gpu
        .run_async(|rec| cross_entropy(rec, &tx, &ty, Default::default()))
        .await
    {
        Err(crate::Error::IndexOutOfRange {
            position: 1,
            id: 10,
            limit: 10,
            ..
        }) => Ok(Default::default()),
        Err(e) => Err(format!("wrong error: {e}")),
        Ok(_) => Err("target 10 with V = 10 was accepted".into()),
    }
}
