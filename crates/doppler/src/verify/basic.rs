//! Elementwise ops, sums, matmul and the recorder.

use super::{push, s, CheckResult, Outcome};
use crate::check::{compare, same_bits, Rng, Tolerance};
use crate::gpu::{DType, Gpu, MatmulMode, Tensor};
use crate::ops::{elementwise, matmul, reduce};
use crate::reference as cpu;

/// Sizes: odd, a multiple of 4 (vec4 path), and one needing a 2-D grid (> 65535 groups of 256).
pub const ELEMENTWISE_SIZES: [usize; 4] = [1, 1003, 4096, 65_539 * 256 + 1];

pub(super) async fn elementwise_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (i, &n) in ELEMENTWISE_SIZES.iter().enumerate() {
        let mut rng = Rng::new(100 + i as u64);
        let (a, b) = (rng.vec(n), rng.vec(n));
        let shape = format!("[{n}]");
        let run = async |f: &dyn Fn(
            &mut crate::gpu::Recorder<'_>,
            &Tensor,
            &Tensor,
        ) -> crate::Result<Tensor>,
                         want: Vec<f64>,
                         op: &str|
               -> Outcome {
            let ta = Tensor::from_f32(gpu, &[n], &a, "a").map_err(s)?;
            let tb = Tensor::from_f32(gpu, &[n], &b, "b").map_err(s)?;
            let t = gpu.run_async(|rec| f(rec, &ta, &tb)).await.map_err(s)?;
            let got = t.to_vec_f32(gpu).await.map_err(s)?;
            compare(op, &got, &want, None, Tolerance::ELEMENTWISE).map_err(s)
        };
        push(
            out,
            "add",
            shape.clone(),
            run(
                &|r, x, y| elementwise::add(r, x, y),
                cpu::add(&a, &b),
                "add",
            )
            .await,
        );
        push(
            out,
            "mul",
            shape.clone(),
            run(
                &|r, x, y| elementwise::mul(r, x, y),
                cpu::mul(&a, &b),
                "mul",
            )
            .await,
        );
        push(
            out,
            "scale",
            shape,
            run(
                &|r, x, _| elementwise::scale(r, x, -1.75),
                cpu::scale(&a, -1.75),
                "scale",
            )
            .await,
        );
        // Inputs up to 40 against a cap of 3: tanh's linear part and its saturation.
        let wide: Vec<f32> = a.iter().map(|v| 40.0 * v).collect();
        let want: Vec<f64> = wide
            .iter()
            .map(|&v| 3.0 * (v as f64 / 3.0).tanh())
            .collect();
        let softcap = async || -> Outcome {
            let ta = Tensor::from_f32(gpu, &[n], &wide, "a").map_err(s)?;
            let t = gpu
                .run_async(|rec| elementwise::softcap(rec, &ta, 3.0))
                .await
                .map_err(s)?;
            let got = t.to_vec_f32(gpu).await.map_err(s)?;
            // exp and a division: a few f32 roundings, relative to the cap.
            let tol = Tolerance {
                abs: 3.0 * 4e-7,
                rel: 4e-7,
            };
            compare("softcap", &got, &want, None, tol).map_err(s)
        };
        push(out, "softcap", format!("[{n}], cap 3"), softcap().await);
    }
}

/// (rows, n): a single element, odd lengths, multi-pass rows (n > 4096), and more rows
/// than fit one grid dimension.
pub const SUM_SHAPES: [(usize, usize); 5] = [
    (1, 1),
    (3, 1000),
    (5, 70_001),
    (1, (1 << 20) + 7),
    (70_000, 3),
];

pub(super) async fn sum_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (i, &(rows, n)) in SUM_SHAPES.iter().enumerate() {
        let x = Rng::new(200 + i as u64).vec(rows * n);
        let shape = format!("[{rows}, {n}]");
        let run = async || -> crate::Result<Vec<f32>> {
            let t = Tensor::from_f32(gpu, &[rows, n], &x, "x")?;
            let y = gpu.run_async(|rec| reduce::sum_rows(rec, &t)).await?;
            y.to_vec_f32(gpu).await
        };
        let r: Outcome = async {
            let got = run().await.map_err(s)?;
            let (want, mag) = cpu::sum_rows(&x, rows, n);
            let stats =
                compare("sum_rows", &got, &want, Some(&mag), Tolerance::sum(n)).map_err(s)?;
            same_bits("sum_rows", &got, &run().await.map_err(s)?).map_err(s)?;
            Ok(stats)
        }
        .await;
        push(out, "sum_rows", shape, r);
    }
}

/// (words of a, words of b; u32 words, b absent where 0) of the streaming reader: one
/// group, a second buffer read after the first, and past `WORDS_GROUPS` groups of 1024
/// vec4 words (each thread goes round its loop, four loads and the tail).
pub const WORDS_CASES: [(usize, usize); 3] = [
    (4, 0),
    (4 * 1000 + 12, 4 * 37),
    (4 * (4100 * 1024 + 9), 4 * 3),
];

/// sum_words: each group's wrapping sum (plus the word of `dep`) exactly, from the CPU's
/// own walk of which vec4 word each group reads.
pub(super) async fn words_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (i, &(na, nb)) in WORDS_CASES.iter().enumerate() {
        let mut state = 0x9E37_79B9u32.wrapping_mul(i as u32 + 1);
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state
        };
        let a: Vec<u32> = (0..na).map(|_| next()).collect();
        let b: Vec<u32> = (0..nb).map(|_| next()).collect();
        let dep0 = next();
        let r: Outcome = async {
            let ta = Tensor::from_u32(gpu, &[na], &a, "a").map_err(s)?;
            let tb = match nb {
                0 => None,
                _ => Some(Tensor::from_u32(gpu, &[nb], &b, "b").map_err(s)?),
            };
            let dep = Tensor::from_u32(gpu, &[1], &[dep0], "dep").map_err(s)?;
            let wout = Tensor::empty(gpu, &[reduce::WORDS_GROUPS], DType::U32, "out").map_err(s)?;
            let bb = tb.as_ref().map(|t| (t, nb as u64 * 4));
            let groups = gpu
                .run_async(|rec| reduce::sum_words_into(rec, (&ta, na as u64 * 4), bb, &dep, &wout))
                .await
                .map_err(s)?;
            let got = wout.to_vec_u32(gpu).await.map_err(s)?;
            let mut want = vec![dep0; groups];
            for v in [&a, &b] {
                for (w, word) in v.chunks(4).enumerate() {
                    let g = (w % (groups * 256)) / 256;
                    for &x in word {
                        want[g] = want[g].wrapping_add(x);
                    }
                }
            }
            if let Some(g) = (0..groups).find(|&g| got[g] != want[g]) {
                return Err(format!(
                    "group {g} of {groups}: {:#x}, want {:#x}",
                    got[g], want[g]
                ));
            }
            Ok(Default::default())
        }
        .await;
        push(out, "sum_words", format!("a {na} words, b {nb}"), r);
    }
}

/// (rows, n) of the argmax checks: a single element, ties, the vocabulary of SmolLM2 with
/// NaN and infinities planted, and more rows than fit one grid dimension.
pub const ARGMAX_SHAPES: [(usize, usize); 4] = [(1, 1), (3, 1000), (2, 49_152), (70_000, 3)];

/// argmax_rows against the CPU sampler's greedy pick, exactly (an index is right or not).
pub(super) async fn argmax_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (i, &(rows, n)) in ARGMAX_SHAPES.iter().enumerate() {
        let mut x = Rng::new(300 + i as u64).vec(rows * n);
        if n == 1000 {
            // Ties: row 0's maximum appears twice, row 1 is constant, row 2 all NaN.
            x[17] = 9.0;
            x[600] = 9.0;
            x[n..2 * n].fill(0.5);
            x[2 * n..].fill(f32::NAN);
        }
        if n == 49_152 {
            // Non-finite values are never picked; the largest finite one is.
            x[5] = f32::INFINITY;
            x[6] = f32::NAN;
            x[40_000] = 1e30;
            x[n + 7] = f32::NEG_INFINITY;
        }
        let r: Outcome = async {
            let t = Tensor::from_f32(gpu, &[rows, n], &x, "x").map_err(s)?;
            let idx = gpu
                .run_async(|rec| reduce::argmax_rows(rec, &t))
                .await
                .map_err(s)?;
            let got = idx.to_vec_u32(gpu).await.map_err(s)?;
            let mut greedy =
                crate::infer::sample::Sampler::new(crate::infer::sample::SamplerConfig::greedy());
            for (r, row) in x.chunks(n).enumerate() {
                let want = greedy.sample(row, &[]);
                if got[r] != want {
                    return Err(format!(
                        "row {r}: index {} where the CPU sampler picks {want}",
                        got[r]
                    ));
                }
            }
            Ok(crate::check::Stats::default())
        }
        .await;
        push(out, "argmax_rows", format!("[{rows}, {n}]"), r);
    }
}

/// (batch, m, n, k, trans_a, trans_b, batched_a, batched_b, beta): 1x1x1, odd sizes in
/// every transpose combination, multiples of 4 (vec4 loads), several 128-tiles with
/// ragged edges, a broadcast operand, and accumulation into C. Cases 9-11 take the split-K
/// path (A^T B, few output tiles, long K): 9 in equal chunks, 10 and 11 with a shorter last
/// chunk, 11 with beta and without vec4 loads;
/// 12 and 13 have whole 128-tiles beside ragged ones, 14 whole tiles only with beta (the
/// cooperative kernel starts its sums from C there). Odd-numbered cases without beta run
/// with alpha 1 (the cooperative kernel stores whole tiles straight to C then), the
/// others with 0.75. Cases without beta whose number is not a multiple of 3 add a bias
/// row (the cooperative kernel starts whole tiles' sums from it).
#[allow(clippy::type_complexity)]
pub const MATMUL_CASES: [(usize, usize, usize, usize, bool, bool, bool, bool, f32); 15] = [
    (1, 1, 1, 1, false, false, true, true, 0.0),
    (3, 37, 45, 29, false, false, true, true, 0.0),
    (2, 130, 129, 67, true, false, true, true, 0.0),
    (2, 64, 200, 33, false, true, true, true, 0.0),
    (2, 19, 23, 300, true, true, true, true, 0.0),
    (1, 128, 256, 64, false, false, true, true, 0.0),
    (3, 96, 68, 132, true, true, true, true, 0.0),
    (3, 17, 19, 23, false, false, true, false, 0.0),
    (2, 33, 40, 24, false, true, false, true, 1.0),
    (1, 36, 44, 2048, true, false, false, false, 0.0),
    (1, 200, 132, 4100, true, false, false, false, 0.0),
    (1, 33, 17, 2050, true, false, false, false, 1.0),
    (1, 200, 260, 48, false, true, true, true, 0.0),
    (2, 256, 260, 40, true, true, true, true, 0.0),
    (2, 256, 128, 96, false, false, true, true, 1.0),
];

pub(super) async fn matmul_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    absmax_checks(gpu, out).await;
    for bk in [8, 16] {
        let mode = Some(MatmulMode::F32);
        matmul_checks_bk(gpu, out, matmul::Tuning { bk, mode }, (1.0, 1.0)).await;
    }
    // The cooperative-matrix kernel where the adapter has one (not lavapipe): every case
    // whose operand rows are multiples of 4, f16x3 and f16 operands; f16x3 also with
    // operands far outside f16's range (2^-70 and 2^50 times the others: products near
    // 2^-20, beyond f16's 2^-24 .. 2^16), judged as f32 is.
    if gpu.coop_matmul_possible() {
        for (mode, scale) in [
            (MatmulMode::F16x3, (1.0, 1.0)),
            (MatmulMode::F16x3, (2f32.powi(-70), 2f32.powi(50))),
            (MatmulMode::F16, (1.0, 1.0)),
        ] {
            let mode = Some(mode);
            matmul_checks_bk(gpu, out, matmul::Tuning { bk: 16, mode }, scale).await;
        }
    }
}

/// Element counts of a and b for the f16x3 product's absmax partials: under one group,
/// past the 65,536 vec4s where the groups wrap around.
pub const ABSMAX_CASES: [(usize, usize); 3] = [(148, 4), (4096, 300_000), (262_148, 1_000)];

/// `matmul::absmax_parts` against the CPU, partial by partial (exact: a maximum of bits),
/// with a planted largest magnitude (negative) and, in the last case, an infinity.
async fn absmax_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    let parts = matmul::ABSMAX_PARTS as usize;
    for (i, &(na, nb)) in ABSMAX_CASES.iter().enumerate() {
        let mut rng = Rng::new(360 + i as u64);
        let mut a = rng.vec(na);
        let mut b = rng.vec(nb);
        a[na * 2 / 3] = -7.5;
        b[nb / 3] = -1e30;
        if i == 2 {
            a[na - 1] = f32::NEG_INFINITY;
        }
        let shape = format!("a [{na}], b [{nb}]");
        let r: Outcome = async {
            let ta = Tensor::from_f32(gpu, &[na], &a, "a").map_err(s)?;
            let tb = Tensor::from_f32(gpu, &[nb], &b, "b").map_err(s)?;
            let t = gpu
                .run_async(|rec| matmul::absmax_parts(rec, &ta, &tb))
                .await
                .map_err(s)?;
            let got = t.to_vec_u32(gpu).await.map_err(s)?;
            let mut want = vec![0u32; 2 * parts];
            for (o, x) in [(0, &a), (parts, &b)] {
                for (j, v) in x.iter().enumerate() {
                    let g = o + (j / 4 % 65_536) / 256;
                    want[g] = want[g].max(v.abs().to_bits());
                }
            }
            match got.iter().zip(&want).position(|(g, w)| g != w) {
                None => Ok(Default::default()),
                Some(j) => Err(format!(
                    "partial {j}: got bits {:#x}, want {:#x}",
                    got[j], want[j]
                )),
            }
        }
        .await;
        push(out, "matmul absmax", shape, r);
    }
}

/// `MATMUL_CASES` with `tuning`, a's and b's values multiplied by `scale`.
async fn matmul_checks_bk(
    gpu: &Gpu,
    out: &mut Vec<CheckResult>,
    tuning: matmul::Tuning,
    scale: (f32, f32),
) {
    let mode = tuning.mode.unwrap_or(MatmulMode::F32);
    for (i, &(batch, m, n, k, ta, tb, ba, bb, beta)) in MATMUL_CASES.iter().enumerate() {
        let (a_inner, b_inner) = (if ta { m } else { k }, if tb { k } else { n });
        if mode != MatmulMode::F32 && (a_inner % 4 != 0 || b_inner % 4 != 0) {
            continue;
        }
        let mut rng = Rng::new(300 + i as u64);
        let (ab, bb_) = (if ba { batch } else { 1 }, if bb { batch } else { 1 });
        let a: Vec<f32> = rng.vec(ab * m * k).iter().map(|v| v * scale.0).collect();
        let b: Vec<f32> = rng.vec(bb_ * k * n).iter().map(|v| v * scale.1).collect();
        let c0: Vec<f32> = (rng.vec(batch * m * n).iter())
            .map(|v| v * scale.0 * scale.1)
            .collect();
        let bias = (beta == 0.0 && i % 3 != 0).then(|| {
            rng.vec(n)
                .iter()
                .map(|v| v * scale.0 * scale.1)
                .collect::<Vec<f32>>()
        });
        let alpha = match beta == 0.0 && i % 2 == 1 {
            true => 1.0,
            false => 0.75,
        };
        let a_shape: Vec<usize> = if ta { vec![k, m] } else { vec![m, k] };
        let b_shape: Vec<usize> = if tb { vec![n, k] } else { vec![k, n] };
        let with_batch = |batched: bool, s: &[usize]| {
            if batched {
                [&[batch][..], s].concat()
            } else {
                s.to_vec()
            }
        };
        let (a_shape, b_shape) = (with_batch(ba, &a_shape), with_batch(bb, &b_shape));
        let shape = format!(
            "{:?}{} @ {:?}{}{}{}",
            a_shape,
            if ta { "^T" } else { "" },
            b_shape,
            if tb { "^T" } else { "" },
            if beta != 0.0 { " + C" } else { "" },
            if bias.is_some() { " + bias" } else { "" }
        );
        let run = async || -> crate::Result<Vec<f32>> {
            let ta_ = Tensor::from_f32(gpu, &a_shape, &a, "a")?;
            let tb_ = Tensor::from_f32(gpu, &b_shape, &b, "b")?;
            let c = Tensor::from_f32(gpu, &with_batch(ba || bb, &[m, n]), &c0, "c")?;
            let opts = matmul::MatmulOpts {
                trans_a: ta,
                trans_b: tb,
                alpha,
            };
            let tbias = match &bias {
                Some(v) => Some(Tensor::from_f32(gpu, &[n], v, "bias")?),
                None => None,
            };
            gpu.run_async(|rec| {
                matmul::matmul_into_tuned(rec, &ta_, &tb_, &c, tbias.as_ref(), opts, beta, tuning)
            })
            .await?;
            c.to_vec_f32(gpu).await
        };
        let dims = cpu::MatmulDims {
            batch,
            m,
            n,
            k,
            trans_a: ta,
            trans_b: tb,
            batched_a: ba,
            batched_b: bb,
        };
        let r: Outcome = async {
            let got = run().await.map_err(s)?;
            let (want, mag) = cpu::matmul(&a, &b, &c0, bias.as_deref(), dims, alpha, beta);
            // f16 operands: each product within 2 x 2^-11 of its magnitude, then f32 sums;
            // f32 and f16x3 (each product within ~2^-21): f32's dot-product bound.
            let tol = match mode {
                MatmulMode::F16 => Tolerance {
                    abs: 1e-30,
                    rel: 1.5e-3,
                },
                _ => Tolerance::dot(k),
            };
            let stats = compare("matmul", &got, &want, Some(&mag), tol).map_err(s)?;
            same_bits("matmul", &got, &run().await.map_err(s)?).map_err(s)?;
            Ok(stats)
        }
        .await;
        let name = match mode {
            MatmulMode::F16 => "matmul (cooperative, f16 operands)".to_string(),
            MatmulMode::F16x3 if scale != (1.0, 1.0) => {
                "matmul (cooperative, f16x3, operands 2^-70 and 2^50)".to_string()
            }
            MatmulMode::F16x3 => "matmul (cooperative, f16x3)".to_string(),
            MatmulMode::F32 => format!("matmul (bk {})", tuning.bk),
        };
        push(out, &name, shape, r);
    }
}

pub(super) const RECORDER_CHAIN: &str = "recorder chain (add, scale, mul, sum_rows)";

/// Several ops in one submission, sum_rows(0.5 * (a + b) * b): checks that the recorder
/// orders dependent dispatches (the barriers between them).
pub(super) async fn recorder_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    let (rows, n) = (7, 1001);
    let mut rng = Rng::new(400);
    let (a, b) = (rng.vec(rows * n), rng.vec(rows * n));
    let r: Outcome = async {
        let ta = Tensor::from_f32(gpu, &[rows, n], &a, "a").map_err(s)?;
        let tb = Tensor::from_f32(gpu, &[rows, n], &b, "b").map_err(s)?;
        let mut rec = gpu.recorder("chain");
        let sum = elementwise::add(&mut rec, &ta, &tb).map_err(s)?;
        let half = elementwise::scale(&mut rec, &sum, 0.5).map_err(s)?;
        let prod = elementwise::mul(&mut rec, &half, &tb).map_err(s)?;
        let rowsum = reduce::sum_rows(&mut rec, &prod).map_err(s)?;
        let dispatches = rec.len();
        rec.submit().map_err(s)?;
        if dispatches != 4 {
            return Err(format!(
                "expected 4 dispatches in one submission, recorded {dispatches}"
            ));
        }
        let got = rowsum.to_vec_f32(gpu).await.map_err(s)?;
        let prod_ref: Vec<f32> = a.iter().zip(&b).map(|(&x, &y)| (x + y) * 0.5 * y).collect();
        let (want, mag) = cpu::sum_rows(&prod_ref, rows, n);
        // Each product carries up to 3 roundings before the sum.
        let tol = Tolerance {
            abs: 0.0,
            rel: Tolerance::sum(n).rel + 4.0 * f32::EPSILON as f64,
        };
        compare("recorder chain", &got, &want, Some(&mag), tol).map_err(s)
    }
    .await;
    push(out, RECORDER_CHAIN, format!("[{rows}, {n}]"), r);
}
