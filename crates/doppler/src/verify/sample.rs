//! Tokens chosen on the GPU (`ops::sample`) against the CPU sampler's choices: the same
//! token, row by row.

use super::{push, twice, CheckResult, Stats};
use crate::check::Rng;
use crate::gpu::{Gpu, Tensor};
use crate::infer::sample::{draw_index, draw_max, draw_weight, Sampler, SamplerConfig};
use crate::ops::sample::{draw_tables, sample_rows, Pick};

/// Rows of `vocab` logits with what samplers meet: a wide spread, NaN and infinities,
/// subnormals, equal maxima, a row with nothing finite, a row of one finite value.
fn rows(rng: &mut Rng, n: usize, vocab: usize) -> Vec<Vec<f32>> {
    (0..n)
        .map(|r| {
            let scale = [0.5f32, 4.0, 30.0, 1e-3][r % 4];
            let mut x: Vec<f32> = rng.vec(vocab).iter().map(|v| v * scale).collect();
            match r % 7 {
                1 => {
                    for (i, v) in x.iter_mut().enumerate().step_by(11) {
                        *v = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][i % 3];
                    }
                }
                2 => {
                    // Equal maxima, and subnormals around them.
                    let m = x.iter().fold(f32::MIN, |a, &b| a.max(b));
                    x[vocab / 2] = m;
                    x[vocab - 1] = m;
                    for v in x.iter_mut().step_by(5) {
                        *v = 1e-40;
                    }
                }
                3 => x.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
                4 => {
                    x.iter_mut().for_each(|v| *v = f32::NAN);
                    x[vocab - 1] = 2.0;
                }
                5 => {
                    // The largest logit subnormal: every difference near 0.
                    x.iter_mut().for_each(|v| *v = -v.abs() * 1e-39);
                }
                _ => {}
            }
            x
        })
        .collect()
}

/// The GPU's tokens for `rows` rows of `vocab` logits (`flat`), chosen as `how` says (four
/// words a row), as f32 for [`twice`].
async fn gpu_ids(
    gpu: &Gpu,
    flat: &[f32],
    rows: usize,
    vocab: usize,
    how: &[u32],
) -> crate::Result<Vec<Vec<f32>>> {
    let lt = Tensor::from_f32(gpu, &[rows, vocab], flat, "logits")?;
    let ht = Tensor::from_u32(gpu, &[rows, 4], how, "how")?;
    let tables = draw_tables(gpu)?;
    let ids = gpu
        .run_async(|rec| sample_rows(rec, &lt, &ht, &tables))
        .await?;
    let ids = ids.to_vec_u32(gpu).await?;
    Ok(vec![ids.into_iter().map(|v| v as f32).collect()])
}

pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    // (rows, vocabulary): a vocabulary smaller than the workgroup, an odd one, SmolLM2's,
    // one past Llama 3's (runs of 502 logits a thread: the last run's scan in two blocks).
    for (ci, (n, vocab)) in [(23usize, 5usize), (37, 1001), (16, 49152), (9, 128257)]
        .into_iter()
        .enumerate()
    {
        let mut rng = Rng::new(8100 + ci as u64);
        let logits = rows(&mut rng, n, vocab);
        // Row r's sampler: greedy, the draw at temperatures from tiny to huge, or the host's.
        let cfg = |r: usize| SamplerConfig {
            temperature: [0.0, 0.8, 1.0, 0.3, 2.0, 1e-30, 1e30, 0.7][r % 8],
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 1000 + r as u64,
            ..Default::default()
        };
        let host = |r: usize| r % 9 == 8;
        let mut picks = Vec::with_capacity(n);
        for r in 0..n {
            let mut a = Sampler::new(cfg(r));
            picks.push(match host(r) {
                true => Pick::Host,
                false => a.gpu_pick().expect("a plain sampler"),
            });
        }
        let how: Vec<u32> = picks.iter().flat_map(|p| p.words()).collect();
        let flat: Vec<f32> = logits.concat();
        let r = twice("sample_rows", async || {
            gpu_ids(gpu, &flat, n, vocab, &how).await
        })
        .await;
        let res = r.and_then(|got| {
            for (r, row) in logits.iter().enumerate() {
                let want = match host(r) {
                    true => 0,
                    false => Sampler::new(cfg(r)).sample(row, &[]),
                };
                if got[0][r] != want as f32 {
                    return Err(format!(
                        "row {r} ({:?}): GPU chose {}, the CPU sampler {want}",
                        picks[r], got[0][r]
                    ));
                }
            }
            Ok(Stats::default())
        });
        push(
            out,
            "sample_rows",
            format!("{n} rows of {vocab} logits (greedy, draws at T 1e-30 .. 1e30, non-finite, subnormal, ties): the CPU sampler's tokens"),
            res,
        );
    }
    // Targets one unit either side of running sums' ends (random numbers worked out from
    // the CPU's weights): a weight or sum off by one unit anywhere before moves the choice.
    let vocab = 49152;
    let mut rng = Rng::new(8300);
    let row: Vec<f32> = rng.vec(vocab).iter().map(|v| v * 9.0).collect();
    let inv = 1.0f32 / 0.8;
    let m = draw_max(&row).expect("finite");
    let w: Vec<u64> = row.iter().map(|&x| draw_weight(x, m, inv) as u64).collect();
    let total: u64 = w.iter().sum();
    let mut run = 0u64;
    let ends: Vec<u64> = w
        .iter()
        .map(|&v| {
            run += v;
            run
        })
        .collect();
    let mut draws = Vec::new();
    // Indices a fraction of the way through the sum, then the ends and starts of threads'
    // runs (sample.wgsl: ceil(V / 256) logits a thread), the first weighed and the one
    // before the last (its end: the last).
    let at_fracs = [0.001, 0.3, 0.5, 0.77, 0.999]
        .map(|frac| ends.partition_point(|&e| (e as f64) < frac * total as f64));
    let first = w.iter().position(|&v| v > 0).expect("a weight");
    let per = vocab.div_ceil(256);
    let at_runs = [
        first,
        per - 1,
        per,
        128 * per - 1,
        255 * per - 1,
        255 * per,
        vocab - 2,
    ];
    for k in at_fracs.into_iter().chain(at_runs) {
        for t in [ends[k].max(1) - 1, ends[k]] {
            if t < total {
                let r = ((t as u128) << 64).div_ceil(total as u128) as u64;
                draws.push(r);
            }
        }
    }
    let how: Vec<u32> = draws
        .iter()
        .flat_map(|&r| Pick::Draw { inv, r }.words())
        .collect();
    let flat: Vec<f32> = draws.iter().flat_map(|_| row.iter().copied()).collect();
    let nd = draws.len();
    let r = twice("sample_rows", async || {
        gpu_ids(gpu, &flat, nd, vocab, &how).await
    })
    .await;
    let res = r.and_then(|got| {
        let want: Vec<f32> = draws
            .iter()
            .map(|&r| draw_index(&row, inv, r) as f32)
            .collect();
        if got[0] != want {
            return Err(format!("GPU {:?}, CPU {want:?}", got[0]));
        }
        if want.windows(2).step_by(2).any(|p| p[0] == p[1]) {
            return Err(format!(
                "a target's two sides chose the same token: {want:?}"
            ));
        }
        Ok(Stats::default())
    });
    push(
        out,
        "sample_rows",
        format!("{nd} draws from {vocab} logits, targets a unit either side of running sums: the CPU's tokens"),
        res,
    );
    // Many draws from one row: the same tokens as the CPU sampler's, one seed through 64
    // steps (its random numbers in order).
    let vocab = 3001;
    let mut rng = Rng::new(8200);
    let row: Vec<f32> = rng.vec(vocab).iter().map(|v| v * 3.0).collect();
    let steps = 64;
    let cfg = SamplerConfig {
        temperature: 0.9,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 77,
        ..Default::default()
    };
    let mut a = Sampler::new(cfg.clone());
    let how: Vec<u32> = (0..steps)
        .flat_map(|_| a.gpu_pick().expect("plain").words())
        .collect();
    let flat: Vec<f32> = (0..steps).flat_map(|_| row.iter().copied()).collect();
    let r = twice("sample_rows", async || {
        gpu_ids(gpu, &flat, steps, vocab, &how).await
    })
    .await;
    let res = r.and_then(|got| {
        let mut b = Sampler::new(cfg.clone());
        let want: Vec<f32> = (0..steps).map(|_| b.sample(&row, &[]) as f32).collect();
        if got[0] != want {
            return Err(format!("GPU {:?}, CPU {want:?}", got[0]));
        }
        let distinct = want
            .iter()
            .map(|v| *v as u32)
            .collect::<std::collections::BTreeSet<_>>();
        if distinct.len() < steps / 2 {
            return Err(format!(
                "only {} distinct tokens in {steps} draws",
                distinct.len()
            ));
        }
        Ok(Stats::default())
    });
    push(
        out,
        "sample_rows",
        format!(
            "{steps} draws of one seed from {vocab} logits at T 0.9: the CPU sampler's, in order"
        ),
        res,
    );
}
