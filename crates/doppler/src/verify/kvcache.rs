//! Attention over a key/value cache against the full-matrix f64 reference: the cache filled
//! by a prefill of several tokens, then single-token steps, as generation does.

use super::{push, s, twice, CheckResult};
use crate::check::{compare, Rng, Tolerance};
use crate::formats::gguf::GgmlType;
use crate::gpu::{DType, Gpu, Tensor};
use crate::ops::kvcache::{
    kv_attend, kv_attend_parts, kv_store, prompt_on_coop, KvType, RopeStore,
};
use crate::ops::quant::{qmatmul_fused, qmatvec_parts, Fuse, QMatrix, MERGE_MAX_WIDTH};
use crate::reference::{attention as cpu, widen};

/// (capacity, Hq, Hkv, D, prefill tokens, then that many more tokens in steps of 2, 1, 1,
/// ..., or of 7, 2, 1, 1, ... from 10 on): grouped heads with an odd prefill longer than
/// one chunk of 256 keys, then steps (up to 4 queries: key ranges split over workgroups,
/// from a few keys to more than 128); prompts of heads too large for the tiled kernel (one
/// workgroup a head, or the cooperative forward to D 128); D = 64 as SmolLM2 has; a second
/// prompt chunk of 7 after cached tokens (tiled, offset causal mask), also at D = 128 with
/// four query heads a key head (Llama 3's grouping; cooperative where the GPU has it).
pub const KV_CASES: [(usize, usize, usize, usize, usize, usize); 8] = [
    (300, 6, 2, 16, 261, 4),
    (160, 8, 2, 128, 140, 2),
    (8, 1, 1, 256, 3, 2),
    (40, 9, 3, 64, 17, 2),
    (160, 9, 3, 64, 130, 3),
    (40, 4, 2, 32, 9, 12),
    // 256 dimensions over full ranges of 64 keys: attend_part's keys and values past the 8
    // vec4s a thread loads up front.
    (80, 2, 1, 256, 70, 2),
    (100, 4, 1, 128, 70, 12),
];

/// Sliding windows over caches (rows, Hq, Hkv, D, window, the tokens of each step): a
/// window that hides nothing yet (the tiled prompt kernel), one that hides keys from a
/// prompt (one workgroup a head, each query its own first key) and then from decode steps
/// whose key ranges start inside the window; rings that wrap (a window of 10 in 20 rows, a
/// prompt step of 7 across the wrap; 70 of 100 over two key ranges).
pub const WINDOW_CASES: [(usize, usize, usize, usize, usize, &[usize]); 4] = [
    (300, 6, 2, 16, 300, &[261, 2, 1, 1]),
    (64, 4, 2, 32, 8, &[20, 2, 1, 1, 3, 4, 1]),
    (20, 3, 1, 8, 10, &[12, 7, 2, 7, 1, 1, 1, 4, 1]),
    (100, 2, 1, 64, 70, &[90, 1, 2, 1, 4, 1, 3, 1, 1]),
];

/// A prompt of `pre` tokens then `steps` more: after the prefill a step of 2 tokens (when
/// there are 3 or more), then 1s; from 10 on a step of 7 first.
fn steps_of(pre: usize, steps: usize) -> Vec<usize> {
    if steps >= 10 {
        [pre, 7, 2]
            .into_iter()
            .chain(std::iter::repeat_n(1, steps - 9))
            .collect()
    } else if steps >= 3 {
        [pre, 2]
            .into_iter()
            .chain(std::iter::repeat_n(1, steps - 2))
            .collect()
    } else {
        std::iter::once(pre)
            .chain(std::iter::repeat_n(1, steps))
            .collect()
    }
}

/// Every case with f32 caches, then with f16 ones (against the reference of the same keys
/// and values rounded to f16, with the f32 tolerance: the sums are f32 either way), then
/// with q8_0 ones where the head size is a multiple of 32 (the reference fed the values
/// quantized as the kernels do).
pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for ty in [KvType::F32, KvType::F16, KvType::Q8_0] {
        let fits = |d: usize| ty != KvType::Q8_0 || d % 32 == 0;
        for (n, &(cap, hq, hkv, d, pre, steps)) in KV_CASES.iter().enumerate() {
            if !fits(d) {
                continue;
            }
            let what = format!(
                "cap {cap}, Hq {hq}/Hkv {hkv}, D {d}, {pre} + {steps}, {}",
                ty.name()
            );
            let chunks = steps_of(pre, steps);
            let case = (cap, hq, hkv, d);
            check_case(gpu, 3100 + n as u64, case, None, ty, &chunks, what, out).await;
        }
        for (n, &(rows, hq, hkv, d, w, chunks)) in WINDOW_CASES.iter().enumerate() {
            if !fits(d) {
                continue;
            }
            let total: usize = chunks.iter().sum();
            let what = format!("{rows} rows, Hq {hq}/Hkv {hkv}, D {d}, window {w}, steps {chunks:?} ({total} tokens), {}", ty.name());
            let case = (rows, hq, hkv, d);
            check_case(gpu, 3150 + n as u64, case, Some(w), ty, chunks, what, out).await;
        }
    }
}

/// How many kv_attend checks [`checks`] runs.
pub fn kv_attend_checks() -> usize {
    let q8 = KV_CASES.iter().filter(|c| c.3 % 32 == 0).count()
        + WINDOW_CASES.iter().filter(|c| c.3 % 32 == 0).count();
    2 * (KV_CASES.len() + WINDOW_CASES.len()) + q8
}

/// A q8_0 cache's words (segments of D * 9 / 32: D / 4 words of quants, D / 32 scales)
/// as values.
fn q8_read(words: &[u32], d: usize) -> Vec<f32> {
    words
        .chunks(d * 9 / 32)
        .flat_map(|seg| {
            (0..d).map(move |i| {
                let q = (seg[i / 4] >> (8 * (i % 4))) as u8 as i8;
                q as f32 * f32::from_bits(seg[d / 4 + i / 32])
            })
        })
        .collect()
}

/// Values as a q8_0 cache holds them (blocks of 32 in order: a head's values are
/// contiguous and its size a multiple of 32), with the kernels' f32 arithmetic: scale
/// max |x| / 127, quants round-half-even(x * (127 / max |x|)).
pub fn q8_0_values(x: &[f32]) -> Vec<f64> {
    x.chunks(32)
        .flat_map(|b| {
            let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            let scale = amax / 127.0;
            b.iter()
                .map(move |&v| ((v * inv).round_ties_even() * scale) as f64)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Steps of `chunks` tokens stored (kv_store) and attended (kv_attend) over caches of `rows`
/// rows of `dtype` against the f64 reference over all tokens at once.
#[allow(clippy::too_many_arguments)]
async fn check_case(
    gpu: &Gpu,
    seed: u64,
    (rows, hq, hkv, d): (usize, usize, usize, usize),
    window: Option<usize>,
    ty: KvType,
    chunks: &[usize],
    what: String,
    out: &mut Vec<CheckResult>,
) {
    let total: usize = chunks.iter().sum();
    let mut rng = Rng::new(seed);
    let (q, k, v) = (
        rng.vec(total * hq * d),
        rng.vec(total * hkv * d),
        rng.vec(total * hkv * d),
    );
    // Reference: all tokens at once, causal (query i sees keys <= i, in the window).
    let dm = cpu::Dims {
        b: 1,
        tq: total,
        tk: total,
        hq,
        hkv,
        d,
        causal: true,
        window: window.unwrap_or(0),
        scale: 1.0 / (d as f32).sqrt() as f64,
        dropout: None,
    };
    // What the cache holds.
    let stored = |x: &[f32]| -> Vec<f64> {
        match ty {
            KvType::F32 => widen(x),
            KvType::F16 => x.iter().map(|&v| half::f16::from_f32(v).to_f64()).collect(),
            KvType::Q8_0 => q8_0_values(x),
        }
    };
    let (want, _) = cpu::attention(&widen(&q), &stored(&k), &stored(&v), dm);
    let r = twice("kv_attend", async || {
        let kc = ty.tensor(gpu, rows, hkv, d, "k")?;
        let vc = ty.tensor(gpu, rows, hkv, d, "v")?;
        let mut got = Vec::new();
        let mut pos = 0;
        for &t in chunks {
            let slice = |x: &[f32], h: usize| x[pos * h * d..(pos + t) * h * d].to_vec();
            let qt = Tensor::from_f32(gpu, &[t, hq, d], &slice(&q, hq), "q")?;
            let kt = Tensor::from_f32(gpu, &[t, hkv, d], &slice(&k, hkv), "k")?;
            let vt = Tensor::from_f32(gpu, &[t, hkv, d], &slice(&v, hkv), "v")?;
            let o = gpu
                .run_async(|rec| {
                    kv_store(rec, &kc, &kt, pos, window)?;
                    kv_store(rec, &vc, &vt, pos, window)?;
                    kv_attend(rec, &qt, &kc, &vc, pos, window)
                })
                .await?;
            got.extend(o.to_vec_f32(gpu).await?);
            pos += t;
        }
        Ok(vec![got])
    })
    .await;
    // Convex combinations of v with probabilities from D-term dots and exp(): as the
    // training kernels, judged against max |v| (here ~1) with the dot's tolerance. A
    // GPU opened for f16 products, or with cooperative prompts (the default where the
    // adapter has them), runs prompts on cooperative matrices: four f16 roundings (2^-11)
    // on the way, scaled as verify/attention.rs does (1 + max |s|).
    let coop = gpu.matmul == crate::gpu::MatmulMode::F16 || prompt_on_coop(gpu, d);
    let tol = match coop {
        true => Tolerance {
            abs: 2.0 * 4.0 * 4.9e-4 * (1.0 + (d as f64).sqrt()),
            rel: 0.0,
        },
        false => Tolerance {
            abs: 2e-6 * (d as f64).sqrt(),
            rel: 1e-5,
        },
    };
    let res = r.and_then(|got| compare("kv_attend", &got[0], &want, None, tol).map_err(s));
    push(out, "kv_attend", what, res);
}

/// A cache of `ty` holding (rows, Hkv, D) zeros.
fn zero_cache(
    gpu: &Gpu,
    ty: KvType,
    [rows, hkv, d]: [usize; 3],
    name: &str,
) -> crate::Result<Tensor> {
    let n = rows * hkv * d;
    match ty {
        KvType::F16 => Tensor::from_f16(gpu, &[rows, hkv, d], &vec![half::f16::ZERO; n], name),
        KvType::F32 => Tensor::from_f32(gpu, &[rows, hkv, d], &vec![0.0; n], name),
        KvType::Q8_0 => Tensor::from_u32(gpu, &[rows, hkv, d * 9 / 32], &vec![0; n * 9 / 32], name),
    }
}

/// rope_store against the f64 RoPE reference: biases added, q and k turned, k and v in the
/// caches at pos..pos+T; both pairings, an odd token count at an offset. And
/// rope_store_split (partial sums over slices of k) against splitk_sum then rope_store.
pub(super) async fn rope_store_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    use crate::ops::kvcache::{rope_store, rope_store_split};
    use crate::ops::quant::splitk_sum;
    use crate::ops::rope::{Pairing, RopeTable};
    let (t, hq, hkv) = (5usize, 4usize, 2usize);
    // (pairing, cache type, head size, rows, position, window): both pairings into f32,
    // f16 and q8_0 caches (heads of 64: two blocks of 32), and rings of 8 rows (a window
    // of 4) that the 5 tokens wrap around.
    let cases = [
        (Pairing::Interleaved, KvType::F32, 8, 12, 3, None),
        (Pairing::Half, KvType::F32, 8, 12, 3, None),
        (Pairing::Interleaved, KvType::F16, 8, 12, 3, None),
        (Pairing::Half, KvType::F16, 8, 8, 6, Some(4)),
        (Pairing::Interleaved, KvType::F32, 8, 8, 6, Some(4)),
        (Pairing::Half, KvType::Q8_0, 64, 12, 3, None),
        (Pairing::Interleaved, KvType::Q8_0, 64, 8, 6, Some(4)),
    ];
    for (n, &(pairing, ty, d, rows, pos, window)) in cases.iter().enumerate() {
        let width = (hq + 2 * hkv) * d;
        let mut rng = Rng::new(3300 + n as u64);
        let (qkv, bias) = (rng.vec(t * width), rng.vec(width));
        let r = twice("rope_store", async || {
            let table = RopeTable::new(gpu, pos + t, d, 10000.0)?;
            let x = Tensor::from_f32(gpu, &[t, width], &qkv, "qkv")?;
            let b = Tensor::from_f32(gpu, &[width], &bias, "bias")?;
            let zeros = |name| zero_cache(gpu, ty, [rows, hkv, d], name);
            let (kc, vc) = (zeros("k")?, zeros("v")?);
            let to = RopeStore {
                bias: Some(&b),
                table: &table,
                pairing,
                hq,
                k_cache: &kc,
                v_cache: &vc,
                pos,
                window,
                paged: None,
            };
            let q = gpu.run_async(|rec| rope_store(rec, &x, &to)).await?;
            let mut got = vec![q.to_vec_f32(gpu).await?];
            for c in [&kc, &vc] {
                got.push(match ty {
                    KvType::F16 => c
                        .to_vec_f16(gpu)
                        .await?
                        .iter()
                        .map(|h| h.to_f32())
                        .collect(),
                    KvType::F32 => c.to_vec_f32(gpu).await?,
                    KvType::Q8_0 => q8_read(&c.to_vec_u32(gpu).await?, d),
                });
            }
            Ok(got)
        })
        .await;
        // Split (T, width) + bias into q (T, Hq, D), k and v (T, Hkv, D) in f64.
        let part = |from: usize, heads: usize| -> Vec<f64> {
            (0..t)
                .flat_map(|tt| (0..heads * d).map(move |i| (tt, from + i)))
                .map(|(tt, c)| qkv[tt * width + c] as f64 + bias[c] as f64)
                .collect()
        };
        let q = crate::reference::rope::rope(&part(0, hq), t, hq, d, pos, 10000.0, pairing, 1.0);
        let k =
            crate::reference::rope::rope(&part(hq * d, hkv), t, hkv, d, pos, 10000.0, pairing, 1.0);
        let v = part((hq + hkv) * d, hkv);
        // Token pos + i in row (pos + i) % rows.
        let at_rows = |x: Vec<f64>| {
            let mut c = vec![0.0; rows * hkv * d];
            for (i, tok) in x.chunks(hkv * d).enumerate() {
                let r = (pos + i) % rows;
                c[r * hkv * d..(r + 1) * hkv * d].copy_from_slice(tok);
            }
            c
        };
        let tol = Tolerance {
            abs: 1e-6,
            rel: 1e-6,
        };
        // An f16 cache: one rounding to 11 significant bits; q8_0: half a quant step of
        // the block's scale (max |x| / 127), or a whole one where the f32 value sits at a
        // rounding boundary (up to max |x| / 127 <= 4 / 127 here: |x| < 4).
        let cache_tol = match ty {
            KvType::F16 => Tolerance {
                abs: 1e-6,
                rel: 4.9e-4,
            },
            KvType::Q8_0 => Tolerance {
                abs: 4.0 / 127.0,
                rel: 0.0,
            },
            KvType::F32 => tol,
        };
        let res = r.and_then(|got| {
            compare("rope_store q", &got[0], &q, None, tol).map_err(s)?;
            compare("rope_store k", &got[1], &at_rows(k), None, cache_tol).map_err(s)?;
            compare("rope_store v", &got[2], &at_rows(v), None, cache_tol).map_err(s)
        });
        push(
            out,
            "rope_store",
            format!("T {t} at {pos}, Hq {hq}/Hkv {hkv}, D {d}, {pairing:?}, {rows} rows {}, window {window:?}", ty.name()),
            res,
        );
        // The projections as 3 partial products over slices of k (the invariant
        // cooperative product's, `qmatmul_unsummed`), summed by rope_store_split: q and
        // both caches the same bits as splitk_sum then rope_store. Without a bias, and with
        // some elements -0.0 in every slice (their sum is +0.0 from 0.0 + -0.0: a sum that
        // started from the first slice would keep -0.0).
        let splits = 3;
        // (Values of every exponent and full mantissas: sums in another order differ.)
        let mut parts: Vec<f32> = rng
            .vec(splits * t * width)
            .iter()
            .enumerate()
            .map(|(i, v)| v * 7.3 * (1 << (i % 5)) as f32)
            .collect();
        for z in 0..splits {
            for i in (0..t * width).step_by(7) {
                parts[z * t * width + i] = -0.0;
            }
        }
        let r = twice("rope_store", async || {
            let table = RopeTable::new(gpu, pos + t, d, 10000.0)?;
            let pt = Tensor::from_f32(gpu, &[splits, t, width], &parts, "qkv parts")?;
            let mut got = Vec::new();
            for split in [true, false] {
                let zeros = |name| zero_cache(gpu, ty, [rows, hkv, d], name);
                let (kc, vc) = (zeros("k")?, zeros("v")?);
                let to = RopeStore {
                    bias: None,
                    table: &table,
                    pairing,
                    hq,
                    k_cache: &kc,
                    v_cache: &vc,
                    pos,
                    window,
                    paged: None,
                };
                let q = gpu
                    .run_async(|rec| match split {
                        true => rope_store_split(rec, &pt, splits, &to),
                        false => {
                            let y = Tensor::empty(gpu, &[t, width], crate::gpu::DType::F32, "y")?;
                            splitk_sum(rec, &pt, None, &y, t, width, splits)?;
                            rope_store(rec, &y, &to)
                        }
                    })
                    .await?;
                let bits = |b: Vec<u8>| -> Vec<f32> {
                    b.chunks_exact(4)
                        .map(|w| f32::from_bits(u32::from_le_bytes([w[0], w[1], w[2], w[3]])))
                        .collect()
                };
                got.push(q.to_vec_f32(gpu).await?);
                got.push(bits(kc.read_bytes(gpu).await?));
                got.push(bits(vc.read_bytes(gpu).await?));
            }
            Ok(got)
        })
        .await;
        let res = r.and_then(|got| {
            for (what, k) in [("q", 0), ("the k cache", 1), ("the v cache", 2)] {
                let ways = ("summed inside", "summed first");
                crate::verify::same_bits_as(what, &got[k], &got[k + 3], ways)?;
            }
            Ok(crate::verify::Stats::default())
        });
        push(
            out,
            "rope_store",
            format!("{splits} slices of k summed inside (T {t} at {pos}, D {d}, {pairing:?}, {}, window {window:?}): the same bits as splitk_sum then rope_store", ty.name()),
            res,
        );
    }
}

/// A cache of `shape` holding `x`, as f16 halves where `f16`, else f32.
fn cache_tensor(
    gpu: &Gpu,
    shape: &[usize],
    x: &[f32],
    f16: bool,
    name: &str,
) -> crate::Result<Tensor> {
    match f16 {
        true => {
            let h: Vec<half::f16> = x.iter().map(|&v| half::f16::from_f32(v)).collect();
            Tensor::from_f16(gpu, shape, &h, name)
        }
        false => Tensor::from_f32(gpu, shape, x, name),
    }
}

/// An f32 or f16 cache's values as f32.
async fn cache_values(gpu: &Gpu, c: &Tensor) -> crate::Result<Vec<f32>> {
    match c.dtype() {
        DType::F16 => Ok(c
            .to_vec_f16(gpu)
            .await?
            .iter()
            .map(|h| h.to_f32())
            .collect()),
        _ => c.to_vec_f32(gpu).await,
    }
}

/// A fused q/k/v product with RoPE and the cache store (`got[0..3]`: q, k cache, v cache)
/// against the two steps it replaces (`got[3..6]`). Two kernels of the same sums
/// (multiply-adds fused differently by the compiler), RMSNorm's factor after them and then
/// the rotation, which can cancel; into f16 caches values that close may round to
/// neighbouring halves.
fn fused_against_steps(
    got: &[Vec<f32>],
    names: [&str; 3],
    cols: usize,
    f16: bool,
) -> std::result::Result<crate::check::Stats, String> {
    let tol = Tolerance {
        abs: 1e-5,
        rel: Tolerance::dot(cols).rel,
    };
    let f16_tol = Tolerance {
        abs: 1e-5,
        rel: 9.8e-4,
    };
    let mut worst = crate::check::Stats::default();
    for (i, what) in names.iter().enumerate() {
        let want: Vec<f64> = got[i + 3].iter().map(|&v| v as f64).collect();
        let tol = if i > 0 && f16 { f16_tol } else { tol };
        let st = compare(what, &got[i], &want, None, tol).map_err(s)?;
        worst.max_abs = worst.max_abs.max(st.max_abs);
        worst.max_rel = worst.max_rel.max(st.max_rel);
    }
    Ok(worst)
}

/// (cap, Hq, Hkv, D, cols, type, tokens, position, pairing) of `qmatmul_rope_store`'s fused
/// cases: SmolLM2's heads and width (Q4_1, the 8-rows kernel) one token with either pairing;
/// three tokens at an offset over rows of 36 f32 (no 32-runs); a tall stack (6,144 rows,
/// the decode kernel) with short Q4_0 rows (one group of 32 a row) and long Q4_K rows
/// (two groups a row).
type RopeCase = (
    usize,
    usize,
    usize,
    usize,
    usize,
    &'static str,
    usize,
    usize,
    bool,
);
pub const ROPE_STORE_CASES: [RopeCase; 5] = [
    (12, 9, 3, 64, 576, "Q4_1", 1, 7, false),
    (12, 9, 3, 64, 576, "Q4_1", 1, 4, true),
    (8, 4, 2, 16, 36, "F32", 3, 2, true),
    (4, 32, 8, 128, 64, "Q4_0", 1, 3, true),
    (4, 32, 8, 128, 2048, "Q4_K", 1, 1, false),
];

/// The product with RoPE and the cache store in one (`qmatmul_rope_store`, what decoding
/// runs) against the two steps it replaces (`qmatmul_fused` with the norm, then
/// `rope_store`, itself checked against the f64 reference above): q and both whole caches
/// (filled with noise first, so a stray write shows), with the norm and a bias.
pub(super) async fn rope_product_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    use crate::ops::kvcache::rope_store;
    use crate::ops::quant::qmatmul_rope_store;
    use crate::ops::rope::{Pairing, RopeTable};
    // Every case into f32 caches, then f16 ones (adjacent pairs fused, pairs half a head
    // apart through rope_store).
    let cases = [DType::F32, DType::F16].into_iter().flat_map(|dt| {
        ROPE_STORE_CASES
            .iter()
            .enumerate()
            .map(move |(n, c)| (n, c, dt))
    });
    for (n, &(cap, hq, hkv, d, cols, ty_name, t, pos, half), dtype) in cases {
        let rows = (hq + 2 * hkv) * d;
        let pairing = if half {
            Pairing::Half
        } else {
            Pairing::Interleaved
        };
        let ty = GgmlType::from_name(ty_name).expect("known type");
        let mut rng = Rng::new(3400 + n as u64);
        let raw = super::quant::random_blocks(ty_name, rows * cols, &mut rng);
        let (x, nw, bias) = (rng.vec(t * cols), rng.vec(cols), rng.vec(rows));
        let (k0, v0) = (rng.vec(cap * hkv * d), rng.vec(cap * hkv * d));
        let r = twice("qmatmul_rope_store", async || {
            let w = QMatrix::new(gpu, "w", &raw, ty, rows, cols)?;
            let table = RopeTable::new(gpu, cap, d, 10000.0)?;
            let xt = Tensor::from_f32(gpu, &[t, cols], &x, "x")?;
            let nwt = Tensor::from_f32(gpu, &[cols], &nw, "nw")?;
            let b = Tensor::from_f32(gpu, &[rows], &bias, "bias")?;
            let mut got = Vec::new();
            let f16 = dtype == DType::F16;
            let cache = |x: &[f32], name| cache_tensor(gpu, &[cap, hkv, d], x, f16, name);
            for fused in [true, false] {
                let kc = cache(&k0, "k")?;
                let vc = cache(&v0, "v")?;
                let to = RopeStore {
                    bias: Some(&b),
                    table: &table,
                    pairing,
                    hq,
                    k_cache: &kc,
                    v_cache: &vc,
                    pos,
                    window: None,
                    paged: None,
                };
                let q = gpu
                    .run_async(|rec| {
                        let norm = Some((&nwt, 1e-5));
                        if fused {
                            qmatmul_rope_store(rec, &xt, &w, norm, &to, None)
                        } else {
                            let fuse = Fuse {
                                norm,
                                ..Default::default()
                            };
                            let qkv = qmatmul_fused(rec, &xt, &w, fuse)?;
                            rope_store(rec, &qkv, &to)
                        }
                    })
                    .await?;
                got.extend([
                    q.to_vec_f32(gpu).await?,
                    cache_values(gpu, &kc).await?,
                    cache_values(gpu, &vc).await?,
                ]);
            }
            Ok(got)
        })
        .await;
        let res = r.and_then(|got| {
            fused_against_steps(&got, ["q", "k cache", "v cache"], cols, dtype == DType::F16)
        });
        push(
            out,
            "qmatmul_rope_store",
            format!("T {t} at {pos} @ ({rows}, {cols})^T {ty_name}, Hq {hq}/Hkv {hkv}, D {d}, {pairing:?}, norm + bias, {dtype:?} cache"),
            res,
        );
    }
}

/// The attention's key ranges merged inside the o product (`qmatvec_merged` through
/// `qmatvec_parts`, what decoding runs) against the two-step path it replaces (`kv_attend`,
/// itself checked against the f64 reference above, then `qmatmul_fused`), with and without
/// the residual: SmolLM2's heads over 150 cached keys, and over 3,648 (more key ranges than
/// the kernel's per-range factors hold: the per-element merge), Q4_1 weights; and 8B-sized
/// rows (32 heads of 128, wider than the merge inside the product takes), Q4_K (merged
/// straight into the 8-bit row: `attend_merge_x8`, the same bits as merging, then rounding)
/// and F16 (merged, then multiplied).
pub(super) async fn merged_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    let smol = (9usize, 3usize, 64usize);
    let wide = (32usize, 8usize, 128usize);
    for (cap, pos, heads, ty) in [
        (160usize, 150usize, smol, "Q4_1"),
        (3700, 3648, smol, "Q4_1"),
        (200, 150, wide, "Q4_K"),
        (200, 150, wide, "F16"),
    ] {
        merged_check(gpu, cap, pos, heads, ty, out).await;
    }
}

async fn merged_check(
    gpu: &Gpu,
    cap: usize,
    pos: usize,
    (hq, hkv, d): (usize, usize, usize),
    ty_name: &str,
    out: &mut Vec<CheckResult>,
) {
    let rows = 37usize;
    let cols = hq * d;
    let op = match cols <= MERGE_MAX_WIDTH {
        true => "qmatvec_merged",
        false => "qmatvec_parts",
    };
    let mut rng = Rng::new(3300 + pos as u64 + cols as u64);
    let (q, k, v) = (
        rng.vec(hq * d),
        rng.vec(cap * hkv * d),
        rng.vec(cap * hkv * d),
    );
    let res = rng.vec(rows);
    let raw = super::quant::random_blocks(ty_name, rows * cols, &mut rng);
    let ty = GgmlType::from_name(ty_name).expect("known type");
    for with_res in [false, true] {
        let r = twice(op, async || {
            let w = QMatrix::new(gpu, "w", &raw, ty, rows, cols)?;
            let qt = Tensor::from_f32(gpu, &[1, hq, d], &q, "q")?;
            let kc = Tensor::from_f32(gpu, &[cap, hkv, d], &k, "k")?;
            let vc = Tensor::from_f32(gpu, &[cap, hkv, d], &v, "v")?;
            let rt = Tensor::from_f32(gpu, &[1, rows], &res, "res")?;
            let residual = with_res.then_some(&rt);
            let (fused, plain) = gpu
                .run_async(|rec| {
                    let parts =
                        kv_attend_parts(rec, &qt, &kc, &vc, pos, None)?.expect("150 keys split");
                    let fused = qmatvec_parts(rec, &parts, &w, residual, None)?.0;
                    let a = kv_attend(rec, &qt, &kc, &vc, pos, None)?.reshape(&[1, cols])?;
                    let plain = qmatmul_fused(
                        rec,
                        &a,
                        &w,
                        Fuse {
                            residual,
                            ..Default::default()
                        },
                    )?;
                    Ok((fused, plain))
                })
                .await?;
            Ok(vec![
                fused.to_vec_f32(gpu).await?,
                plain.to_vec_f32(gpu).await?,
            ])
        })
        .await;
        let res = r.and_then(|got| {
            let want: Vec<f64> = got[1].iter().map(|&v| v as f64).collect();
            compare(op, &got[0], &want, None, Tolerance::dot(cols)).map_err(s)
        });
        let what = if with_res { " + residual" } else { "" };
        push(
            out,
            op,
            format!(
                "{hq} heads x {d}, {} keys @ ({rows}, {cols})^T {ty_name}{what}",
                pos + 1
            ),
            res,
        );
    }
}

/// The batched step's q/k/v product with RoPE and the paged store in one
/// (`qmatmul_rows_rope`, serving's small models off cooperative matrices) against the two
/// steps it replaces (the invariant product off cooperative matrices, with the norm, then
/// `rope_store` into the pages, itself checked against f64 in kv_paged): q and both whole
/// pools (noise first, so a stray write shows), then each row alone (its own workgroup of
/// rows) the batch's bits. SmolLM2's heads and width (Q4_1); 13 rows of 5 sequences with
/// scattered pages; adjacent pairs without a bias and pairs half a head apart with one
/// (Qwen2's), into f32 and f16 pools.
pub(super) async fn rows_rope_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    use crate::ops::kvcache::{paged_pool, rope_store, PagedRows, PAGE};
    use crate::ops::quant::{qmatmul_rows_rope, rows_rope_fused};
    use crate::ops::rope::{Pairing, RopeTable};
    let (hq, hkv, d, cols, pages) = (9usize, 3usize, 64usize, 576usize, 30usize);
    let rows = (hq + 2 * hkv) * d;
    let order: Vec<u32> = (0..pages as u32)
        .map(|i| (7 * i + 2) % pages as u32)
        .collect();
    let seqs: [&[u32]; 5] = [
        &order[0..1],
        &order[1..4],
        &order[4..14],
        &order[14..16],
        &order[16..30],
    ];
    // (sequence, position): a prompt's chunk of 5 rows in sequence 2, single rows elsewhere.
    let rows_of = [
        (0usize, 3usize),
        (1, 40),
        (2, 100),
        (2, 101),
        (2, 102),
        (2, 103),
        (2, 104),
        (3, 17),
        (4, 0),
        (4, 200),
        (1, 41),
        (3, 31),
        (0, 15),
    ];
    let ty = GgmlType::from_name("Q4_1").expect("known type");
    for (n, (dtype, half)) in [
        (DType::F32, false),
        (DType::F16, false),
        (DType::F32, true),
        (DType::F16, true),
    ]
    .into_iter()
    .enumerate()
    {
        let pairing = if half {
            Pairing::Half
        } else {
            Pairing::Interleaved
        };
        let kv_ty = if dtype == DType::F16 {
            KvType::F16
        } else {
            KvType::F32
        };
        let mut rng = Rng::new(9100 + n as u64);
        let raw = super::quant::random_blocks("Q4_1", rows * cols, &mut rng);
        let m = rows_of.len();
        let (x, nw, bias) = (rng.vec(m * cols), rng.vec(cols), rng.vec(rows));
        let cells = pages * PAGE * hkv * d;
        let (k0, v0) = (rng.vec(cells), rng.vec(cells));
        let fused_here = rows_rope_fused(gpu, cols, dtype);
        let r = twice("qmatmul_rows_rope", async || {
            let w = QMatrix::new(gpu, "w", &raw, ty, rows, cols)?;
            let table = RopeTable::new(gpu, 256, d, 10000.0)?;
            let xt = Tensor::from_f32(gpu, &[m, cols], &x, "x")?;
            let nwt = Tensor::from_f32(gpu, &[cols], &nw, "nw")?;
            let b = Tensor::from_f32(gpu, &[rows], &bias, "bias")?;
            let pool = paged_pool(gpu, 1, pages, hkv, d, kv_ty)?;
            let f16 = dtype == DType::F16;
            let noise = |v: &[f32], name| cache_tensor(gpu, &[pages * PAGE, hkv, d], v, f16, name);
            let (kn, vn) = (noise(&k0, "k noise")?, noise(&v0, "v noise")?);
            let reset = async || {
                gpu.run_async(|rec| {
                    rec.copy_elements(&kn, 0, &pool.k[0], 0, kn.numel())?;
                    rec.copy_elements(&vn, 0, &pool.v[0], 0, vn.numel())
                })
                .await
            };
            let list: Vec<(usize, &[u32])> =
                rows_of.iter().map(|&(sq, pos)| (pos, seqs[sq])).collect();
            let pg = PagedRows::new(gpu, &list)?;
            let base = RopeStore {
                bias: half.then_some(&b),
                table: &table,
                pairing,
                hq,
                k_cache: &pool.k[0],
                v_cache: &pool.v[0],
                pos: 0,
                window: None,
                paged: None,
            };
            let norm = Some((&nwt, 1e-5));
            let mut got = Vec::new();
            for fused in [true, false] {
                reset().await?;
                let to = RopeStore {
                    paged: Some(&pg),
                    ..base
                };
                let q = gpu
                    .run_async(|rec| {
                        if fused {
                            qmatmul_rows_rope(rec, &xt, &w, norm, &to)
                        } else {
                            let fuse = Fuse {
                                norm,
                                invariant: true,
                                simt: true,
                                ..Default::default()
                            };
                            let qkv = qmatmul_fused(rec, &xt, &w, fuse)?;
                            rope_store(rec, &qkv, &to)
                        }
                    })
                    .await?;
                got.extend([
                    q.to_vec_f32(gpu).await?,
                    cache_values(gpu, &pool.k[0]).await?,
                    cache_values(gpu, &pool.v[0]).await?,
                ]);
            }
            // Each row alone into fresh noise: its q, and the pools after all of them.
            reset().await?;
            let mut alone = Vec::new();
            for (r, &(pos, list)) in list.iter().enumerate() {
                let one = PagedRows::new(gpu, &[(pos, list)])?;
                let xr = Tensor::from_f32(gpu, &[1, cols], &x[r * cols..(r + 1) * cols], "x row")?;
                let to = RopeStore {
                    paged: Some(&one),
                    ..base
                };
                let q = gpu
                    .run_async(|rec| qmatmul_rows_rope(rec, &xr, &w, norm, &to))
                    .await?;
                alone.extend(q.to_vec_f32(gpu).await?);
            }
            got.extend([
                alone,
                cache_values(gpu, &pool.k[0]).await?,
                cache_values(gpu, &pool.v[0]).await?,
            ]);
            Ok(got)
        })
        .await;
        let names = ["q", "k pool", "v pool"];
        let res = r.and_then(|got| {
            let worst = fused_against_steps(&got, names, cols, dtype == DType::F16)?;
            // Rows alone (got[6..9]) against the batch, bit for bit.
            for (i, what) in names.iter().enumerate() {
                if got[i + 6] != got[i] {
                    let at = got[i]
                        .iter()
                        .zip(&got[i + 6])
                        .position(|(a, b)| a.to_bits() != b.to_bits())
                        .unwrap_or(0);
                    return Err(format!(
                        "{what}: the rows one at a time differ from the batch at element {at} ({} against {})",
                        got[i + 6].get(at).copied().unwrap_or(f32::NAN),
                        got[i].get(at).copied().unwrap_or(f32::NAN)
                    ));
                }
            }
            Ok(worst)
        });
        let how = if fused_here {
            "one dispatch"
        } else {
            "the two steps here (too few storage buffers a stage)"
        };
        push(
            out,
            "qmatmul_rows_rope",
            format!(
                "{m} paged rows @ ({rows}, {cols})^T Q4_1, Hq {hq}/Hkv {hkv}, D {d}, {pairing:?}, norm{}, {dtype:?} pool ({how}); rows alone the same bits",
                if half { " + bias" } else { "" }
            ),
            res,
        );
    }
}

/// Paged rows (continuous batching): rows of different sequences, each at its own position
/// with its own scattered pages of one pool, through `rope_store` (PAGED: q turned, k
/// turned and v stored in the row's page) then `kv_attend_paged` (each row over its own
/// sequence's keys), against f64: RoPE at each row's position, the pool's rows (noise
/// elsewhere, which no row may read) and softmax attention. A sequence with two rows (a
/// prompt's chunk) sees its first row's key from the second. Rows of 5 to 262 keys: 1 to
/// 5 ranges of 64, so short rows get empty ranges; 3 query heads a kv head, taken by one
/// workgroup. Then batch invariance: each row's attention run alone (its own range count)
/// must give the batch's bits, and so must the batch with a workgroup a range and with a
/// workgroup walking a row's ranges ([`PagedWork`]), whole and in groups of 2 rows (a
/// small scratch), and with a workgroup a query head. f32 and f16 pools.
pub(super) async fn paged_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    use crate::ops::kvcache::{
        kv_attend_paged, kv_attend_paged_as, paged_pool, rope_store, PagedRows, PagedWork,
        RopeStore, PAGE,
    };
    use crate::ops::rope::{Pairing, RopeTable};
    let (hq, hkv, d, pages) = (6usize, 2usize, 32usize, 40usize);
    let width = (hq + 2 * hkv) * d;
    // Pages 0..40 in a scattered order (7 is prime to 40), dealt to the sequences.
    let order: Vec<u32> = (0..pages as u32)
        .map(|i| (7 * i + 3) % pages as u32)
        .collect();
    let seqs: [&[u32]; 5] = [
        &order[0..1],
        &order[1..3],
        &order[3..20],
        &order[20..25],
        &order[25..35],
    ];
    // (sequence, position) of each row: 5 to 262 keys, 1 to 5 ranges of 64.
    let rows_of = [
        (0usize, 4usize),
        (1, 19),
        (2, 260),
        (2, 261),
        (3, 70),
        (4, 150),
    ];
    for (ti, ty) in [KvType::F32, KvType::F16].into_iter().enumerate() {
        let mut rng = Rng::new(7700 + ti as u64);
        let n = pages * PAGE * hkv * d;
        let (k0, v0) = (rng.vec(n), rng.vec(n));
        let qkv = rng.vec(rows_of.len() * width);
        let round = |x: f32| match ty {
            KvType::F16 => half::f16::from_f32(x).to_f32(),
            _ => x,
        };
        let r = twice("kv_paged", async || {
            let table = RopeTable::new(gpu, 512, d, 10000.0)?;
            let pool = paged_pool(gpu, 1, pages, hkv, d, ty)?;
            let f16 = ty == KvType::F16;
            let noise = |x: &[f32], name| cache_tensor(gpu, &[pages * PAGE, hkv, d], x, f16, name);
            let (kn, vn) = (noise(&k0, "k noise")?, noise(&v0, "v noise")?);
            gpu.run_async(|rec| {
                rec.copy_elements(&kn, 0, &pool.k[0], 0, kn.numel())?;
                rec.copy_elements(&vn, 0, &pool.v[0], 0, vn.numel())
            })
            .await?;
            let list: Vec<(usize, &[u32])> =
                rows_of.iter().map(|&(sq, pos)| (pos, seqs[sq])).collect();
            let pg = PagedRows::new(gpu, &list)?;
            let x = Tensor::from_f32(gpu, &[rows_of.len(), width], &qkv, "qkv")?;
            let to = RopeStore {
                bias: None,
                table: &table,
                pairing: Pairing::Half,
                hq,
                k_cache: &pool.k[0],
                v_cache: &pool.v[0],
                pos: 0,
                window: None,
                paged: Some(&pg),
            };
            let (q, o) = gpu
                .run_async(|rec| {
                    let q = rope_store(rec, &x, &to)?;
                    let o = kv_attend_paged(rec, &q, &pool.k[0], &pool.v[0], &pg)?;
                    Ok((q, o))
                })
                .await?;
            let qv = q.to_vec_f32(gpu).await?;
            // The batch again with its work laid out each way, whole and in groups of 2 rows
            // (a scratch that holds 2).
            let two = 2
                * 4
                * hq
                * (rows_of
                    .iter()
                    .map(|r| r.1 + 1)
                    .max()
                    .unwrap_or(1)
                    .div_ceil(64)
                    * (d + 2)
                    + d);
            let mut laid = Vec::new();
            let ways = [
                (usize::MAX, PagedWork::Split, None),
                (usize::MAX, PagedWork::Loop, None),
                (two, PagedWork::Split, None),
                (two, PagedWork::Loop, None),
                (usize::MAX, PagedWork::Split, Some(1)),
                (usize::MAX, PagedWork::Loop, Some(1)),
            ];
            for (scratch, work, heads) in ways {
                let o = gpu
                    .run_async(|rec| {
                        kv_attend_paged_as(
                            rec,
                            &q,
                            &pool.k[0],
                            &pool.v[0],
                            &pg,
                            Some(work),
                            heads,
                            scratch,
                        )
                    })
                    .await?;
                laid.push(o.to_vec_f32(gpu).await?);
            }
            // Each row alone, over the keys the batch stored.
            let mut alone = Vec::new();
            for (r, &(pos, list)) in list.iter().enumerate() {
                let one = PagedRows::new(gpu, &[(pos, list)])?;
                let qr = &qv[r * hq * d..(r + 1) * hq * d];
                let qr = Tensor::from_f32(gpu, &[1, hq, d], qr, "q row")?;
                let o = gpu
                    .run_async(|rec| kv_attend_paged(rec, &qr, &pool.k[0], &pool.v[0], &one))
                    .await?;
                alone.extend(o.to_vec_f32(gpu).await?);
            }
            let mut got = vec![qv, o.to_vec_f32(gpu).await?, alone];
            got.extend(laid);
            Ok(got)
        })
        .await;
        // f64: the pool as stored, each row's k and v written at its position's row.
        let phys = |sq: usize, j: usize| seqs[sq][j / PAGE] as usize * PAGE + j % PAGE;
        let (mut kp, mut vp): (Vec<f64>, Vec<f64>) = (
            k0.iter().map(|&v| round(v) as f64).collect(),
            v0.iter().map(|&v| round(v) as f64).collect(),
        );
        let mut qs = Vec::new();
        for (r, &(sq, pos)) in rows_of.iter().enumerate() {
            let row = &qkv[r * width..(r + 1) * width];
            let part = |from: usize, heads: usize| -> Vec<f64> {
                row[from..from + heads * d]
                    .iter()
                    .map(|&v| v as f64)
                    .collect()
            };
            let q = crate::reference::rope::rope(
                &part(0, hq),
                1,
                hq,
                d,
                pos,
                10000.0,
                Pairing::Half,
                1.0,
            );
            let k = crate::reference::rope::rope(
                &part(hq * d, hkv),
                1,
                hkv,
                d,
                pos,
                10000.0,
                Pairing::Half,
                1.0,
            );
            let v = part((hq + hkv) * d, hkv);
            let at = phys(sq, pos) * hkv * d;
            for i in 0..hkv * d {
                kp[at + i] = round(k[i] as f32) as f64;
                vp[at + i] = round(v[i] as f32) as f64;
            }
            qs.push(q);
        }
        let (mut want, mut mag) = (Vec::new(), Vec::new());
        for (r, &(sq, pos)) in rows_of.iter().enumerate() {
            for h in 0..hq {
                let kvh = h / (hq / hkv);
                let q = &qs[r][h * d..(h + 1) * d];
                let key = |j: usize| (phys(sq, j) * hkv + kvh) * d;
                let sc: Vec<f64> = (0..=pos)
                    .map(|j| (0..d).map(|e| q[e] * kp[key(j) + e]).sum::<f64>() / (d as f64).sqrt())
                    .collect();
                let m = sc.iter().cloned().fold(f64::MIN, f64::max);
                let w: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = w.iter().sum();
                for e in 0..d {
                    want.push((0..=pos).map(|j| w[j] / z * vp[key(j) + e]).sum::<f64>());
                    mag.push(
                        (0..=pos)
                            .map(|j| w[j] / z * vp[key(j) + e].abs())
                            .sum::<f64>(),
                    );
                }
            }
        }
        let qwant: Vec<f64> = qs.concat();
        let res = r.and_then(|got| {
            let tol = Tolerance {
                abs: 1e-6,
                rel: 1e-6,
            };
            compare("rope_store paged q", &got[0], &qwant, None, tol).map_err(s)?;
            let stats = compare(
                "kv_attend_paged",
                &got[1],
                &want,
                Some(&mag),
                Tolerance {
                    abs: 1e-6,
                    rel: 2e-5,
                },
            )
            .map_err(s)?;
            crate::check::same_bits(
                "kv_attend_paged: rows alone vs in the batch",
                &got[2],
                &got[1],
            )
            .map_err(s)?;
            let ways = [
                "split",
                "looped",
                "split in groups",
                "looped in groups",
                "split a head a workgroup",
                "looped a head a workgroup",
            ];
            for (i, how) in ways.iter().enumerate() {
                crate::check::same_bits(
                    &format!("kv_attend_paged: {how} vs as it chose"),
                    &got[3 + i],
                    &got[1],
                )
                .map_err(s)?;
            }
            Ok(stats)
        });
        push(
            out,
            "kv_paged",
            format!("{} rows of 5 sequences (positions 4, 19, 260 + 261, 70, 150) in {pages} scattered pages of {PAGE}, Hq {hq}/Hkv {hkv}, D {d}, {}, each row alone, split or looped, whole or in groups, 3 or 1 heads a workgroup the same bits", rows_of.len(), ty.name()),
            res,
        );
    }
}
