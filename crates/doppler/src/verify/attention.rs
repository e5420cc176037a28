//! Flash attention forward and backward against the full-matrix reference.

use super::{push, s, twice, CheckResult};
use crate::check::{compare, Rng, Tolerance};
use crate::gpu::{Gpu, Tensor};
use crate::ops::attention::{
    attention, attention_backward, coop_fits, coop_forward_fits, tiled_fits, AttnDropout, AttnOpts,
    AttnPath,
};
use crate::reference::{attention as cpu, widen};

/// (B, Tq, Tk, Hq, Hkv, D, causal): odd lengths over several row blocks with grouped heads;
/// fewer queries than keys (the causal offset a KV cache gives); full attention; the
/// largest head dim; four query heads on one key/value head over several tiles; more than
/// 65535 workgroups; head dims between 64 and 128 (grouped heads over several row
/// blocks, the causal offset, full attention, a head dim not a multiple of 16). Each runs
/// on every kernel set that applies (tiled: head dim <= 64; cooperative matrices on an
/// adapter that has them, not lavapipe: head dim <= 64, the forward alone to 128).
pub const ATTN_CASES: [(usize, usize, usize, usize, usize, usize, bool); 9] = [
    (2, 77, 77, 4, 2, 16, true),
    (1, 5, 70, 2, 1, 64, true),
    (3, 19, 23, 3, 3, 8, false),
    (1, 130, 130, 2, 2, 128, true),
    (1, 100, 100, 4, 1, 64, true),
    (1, 1, 2, 65_537, 65_537, 4, true),
    (2, 77, 77, 4, 2, 96, true),
    (1, 5, 70, 8, 2, 128, true),
    (3, 19, 83, 3, 1, 100, false),
];

pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (n, case) in ATTN_CASES.iter().enumerate() {
        check(gpu, out, n, *case, None).await;
    }
    // Dropout on the probabilities (a quarter dropped): grouped heads over several row
    // blocks, the causal offset, full attention, four query heads on one key head. The
    // reference draws the kernels' mask from the same hash, so only rounding separates
    // them (a mask differing in one (row, key) moves that row's outputs by a whole p v).
    for n in [0, 1, 2, 4] {
        let drop = AttnDropout {
            p: 0.25,
            seed: 9000 + n as u64,
        };
        check(gpu, out, n, ATTN_CASES[n], Some(drop)).await;
    }
    if coop_fits(gpu, 64) {
        coop_rescale_check(gpu, out, 64).await;
    }
    if coop_forward_fits(gpu, 128) {
        coop_rescale_check(gpu, out, 128).await;
    }
}

/// The online softmax's rescale of O, where it matters: a row from 200 on sees 200 keys
/// with scores near 0, then key 200 scoring ~10, so O (a sum over 200 keys of v ~ 1) is
/// scaled by ~e^-10 in the step that holds key 200 (v = -1) while the 200 earlier keys
/// still weigh ~1% of the result: a wrong or skipped rescale shows. (Random scores of a
/// few units barely move the max after the first step.) Inputs are exact in f16
/// (multiples of 1/64 near 1), so the cooperative kernel's scores are exact and only P's
/// rounding to f16 (2^-11) separates the result from the reference.
/// At head dim 128 (`attn_fwd_coop_wide`) the scale stays 1/8 (exact in f16).
async fn coop_rescale_check(gpu: &Gpu, out: &mut Vec<CheckResult>, d: usize) {
    let (t, jump) = (300usize, 200usize);
    let mut rng = Rng::new(1590);
    let mut small = |den: f32| ((rng.next_u64() % 9) as f32 - 4.0) / den;
    let q: Vec<f32> = (0..t * d).map(|_| 1.0 + small(64.0)).collect();
    let k: Vec<f32> = (0..t * d)
        .map(|x| if x / d == jump { 1.25 } else { small(64.0) })
        .collect();
    let v: Vec<f32> = (0..t * d)
        .map(|x| {
            if x / d == jump {
                -1.0
            } else {
                1.0 + small(256.0)
            }
        })
        .collect();
    let dm = cpu::Dims {
        b: 1,
        tq: t,
        tk: t,
        hq: 1,
        hkv: 1,
        d,
        causal: true,
        window: 0,
        scale: 0.125,
        dropout: None,
    };
    let (o, lse) = cpu::attention(&widen(&q), &widen(&k), &widen(&v), dm);
    let opts = AttnOpts {
        causal: true,
        scale: Some(0.125),
        path: AttnPath::Coop,
        dropout: None,
    };
    let r = twice("attention", async || {
        let shape = [1, t, 1, d];
        let tq_ = Tensor::from_f32(gpu, &shape, &q, "q")?;
        let tk_ = Tensor::from_f32(gpu, &shape, &k, "k")?;
        let tv_ = Tensor::from_f32(gpu, &shape, &v, "v")?;
        let f = gpu
            .run_async(|rec| attention(rec, &tq_, &tk_, &tv_, opts))
            .await?;
        Ok(vec![
            f.o.to_vec_f32(gpu).await?,
            f.lse.to_vec_f32(gpu).await?,
        ])
    })
    .await;
    let shape = format!(
        "B1 T{t} D{d} causal, key {jump} scores ~{}, cooperative",
        1.25 * 0.125 * d as f64
    );
    // P rounded to f16 (2^-11 of each weight) in a convex combination of |v| <= 1.02.
    let tols = [
        Tolerance {
            abs: 1e-3,
            rel: 0.0,
        },
        Tolerance {
            abs: 1e-5,
            rel: 1e-6,
        },
    ];
    for (i, (name, want)) in [("attention", &o), ("attention lse", &lse)]
        .into_iter()
        .enumerate()
    {
        let res = match &r {
            Ok(got) => compare(name, &got[i], want, None, tols[i]).map_err(s),
            Err(e) => Err(e.clone()),
        };
        push(out, name, shape.clone(), res);
    }
}

/// One case on the row kernels and, where they apply, on the tiled and the
/// cooperative-matrix kernels; the reference is computed once for all.
async fn check(
    gpu: &Gpu,
    out: &mut Vec<CheckResult>,
    n: usize,
    (b, tq, tk, hq, hkv, d, causal): (usize, usize, usize, usize, usize, usize, bool),
    dropout: Option<AttnDropout>,
) {
    let (qs, ks) = ([b, tq, hq, d], [b, tk, hkv, d]);
    let (nq, nk) = (b * tq * hq * d, b * tk * hkv * d);
    let mut rng = Rng::new(1500 + n as u64);
    let (q, k, v, g) = (rng.vec(nq), rng.vec(nk), rng.vec(nk), rng.vec(nq));
    let dm = cpu::Dims {
        b,
        tq,
        tk,
        hq,
        hkv,
        d,
        causal,
        window: 0,
        scale: 1.0 / (d as f32).sqrt() as f64,
        dropout,
    };
    let (qd, kd, vd, gd) = (widen(&q), widen(&k), widen(&v), widen(&g));
    let (o, lse) = cpu::attention(&qd, &kd, &vd, dm);
    let (dq, dk, dv) = cpu::attention_backward(&qd, &kd, &vd, &gd, dm);
    // Scores carry a D-term dot product's error and exp() an error growing with |s|
    // (Vulkan: 3 + 2|x| ulp); both reach every output through the probabilities, so each
    // element is judged against (1 + max|s|) times the largest magnitude in its tensor.
    let smax = dm.scale * d as f64;
    let tol = Tolerance::dot(tk + d);
    let names = [
        "attention",
        "attention lse",
        "attention backward (dq)",
        "attention backward (dk)",
        "attention backward (dv)",
    ];
    let want = [o, lse, dq, dk, dv];
    let scales: Vec<Vec<f64>> = want
        .iter()
        .map(|w| {
            let big = w.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            w.iter().map(|x| (1.0 + smax) * (x.abs() + big)).collect()
        })
        .collect();
    for path in [AttnPath::Rows, AttnPath::Tiled, AttnPath::Coop] {
        let fits = match path {
            AttnPath::Tiled => tiled_fits(gpu, d),
            AttnPath::Coop => coop_forward_fits(gpu, d),
            _ => true,
        };
        if !fits {
            continue;
        }
        // Past head dim 64 the cooperative kernels have the forward alone.
        let backward = path != AttnPath::Coop || coop_fits(gpu, d);
        // f16 operands (q, k, v, dO, the probabilities and dS each rounded once, 2^-11):
        // four roundings on a path from the inputs to an output, against the same scale.
        let tol = match path {
            AttnPath::Coop => Tolerance {
                abs: 1e-30,
                rel: 4.0 * 4.9e-4,
            },
            _ => tol,
        };
        let opts = AttnOpts {
            causal,
            scale: None,
            path,
            dropout,
        };
        let r = twice("attention", async || {
            let tq_ = Tensor::from_f32(gpu, &qs, &q, "q")?;
            let tk_ = Tensor::from_f32(gpu, &ks, &k, "k")?;
            let tv_ = Tensor::from_f32(gpu, &ks, &v, "v")?;
            let tg = Tensor::from_f32(gpu, &qs, &g, "dO")?;
            let mut rec = gpu.recorder("attention");
            let f = attention(&mut rec, &tq_, &tk_, &tv_, opts)?;
            let gr = match backward {
                true => Some(attention_backward(
                    &mut rec, &tq_, &tk_, &tv_, &f, &tg, opts,
                )?),
                false => None,
            };
            rec.submit()?;
            let mut got = vec![f.o.to_vec_f32(gpu).await?, f.lse.to_vec_f32(gpu).await?];
            if let Some(gr) = gr {
                got.push(gr.dq.to_vec_f32(gpu).await?);
                got.push(gr.dk.to_vec_f32(gpu).await?);
                got.push(gr.dv.to_vec_f32(gpu).await?);
            }
            Ok(got)
        })
        .await;
        let shape = format!(
            "B{b} Tq{tq} Tk{tk} Hq{hq} Hkv{hkv} D{d}{}{}{}",
            if causal { " causal" } else { "" },
            match dropout {
                Some(dr) => format!(" dropout {}", dr.p),
                None => String::new(),
            },
            match path {
                AttnPath::Tiled => " tiled",
                AttnPath::Coop => " cooperative (f16 operands)",
                _ => "",
            }
        );
        for (i, name) in names.iter().enumerate().take(if backward { 5 } else { 2 }) {
            let res = match &r {
                Ok(got) => compare(name, &got[i], &want[i], Some(&scales[i]), tol).map_err(s),
                Err(e) => Err(e.clone()),
            };
            push(out, name, shape.clone(), res);
        }
    }
}
