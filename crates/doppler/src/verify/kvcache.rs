//! Attention over a key/value cache against the full-matrix f64 reference: the cache filled
//! by a prefill of several tokens, then single-token steps, as generation does.

use super::{push, s, twice, CheckResult};
use crate::check::{compare, Rng, Tolerance};
use crate::gpu::{Gpu, Tensor};
use crate::ops::kvcache::{kv_attend, kv_store};
use crate::reference::{attention as cpu, widen};

/// (capacity, Hq, Hkv, D, prefill tokens, then steps of one token): grouped heads with an
/// odd prefill longer than one chunk of 256 keys; one head of the largest dim; D = 64 as
/// SmolLM2 has.
pub const KV_CASES: [(usize, usize, usize, usize, usize, usize); 3] = [(300, 6, 2, 16, 261, 3), (8, 1, 1, 256, 3, 2), (40, 9, 3, 64, 17, 2)];

pub(super) fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (n, &(cap, hq, hkv, d, pre, steps)) in KV_CASES.iter().enumerate() {
        let total = pre + steps;
        let mut rng = Rng::new(3100 + n as u64);
        let (q, k, v) = (rng.vec(total * hq * d), rng.vec(total * hkv * d), rng.vec(total * hkv * d));
        // Reference: all tokens at once, causal (query i sees keys <= i).
        let dm = cpu::Dims { b: 1, tq: total, tk: total, hq, hkv, d, causal: true, scale: 1.0 / (d as f32).sqrt() as f64 };
        let (want, _) = cpu::attention(&widen(&q), &widen(&k), &widen(&v), dm);
        let r = twice("kv_attend", || {
            let kc = Tensor::empty(gpu, &[cap, hkv, d], crate::gpu::DType::F32, "k")?;
            let vc = Tensor::empty(gpu, &[cap, hkv, d], crate::gpu::DType::F32, "v")?;
            let mut got = Vec::new();
            let mut pos = 0;
            for t in std::iter::once(pre).chain(std::iter::repeat_n(1, steps)) {
                let slice = |x: &[f32], h: usize| x[pos * h * d..(pos + t) * h * d].to_vec();
                let qt = Tensor::from_f32(gpu, &[t, hq, d], &slice(&q, hq), "q")?;
                let kt = Tensor::from_f32(gpu, &[t, hkv, d], &slice(&k, hkv), "k")?;
                let vt = Tensor::from_f32(gpu, &[t, hkv, d], &slice(&v, hkv), "v")?;
                let o = gpu.run(|rec| {
                    kv_store(rec, &kc, &kt, pos)?;
                    kv_store(rec, &vc, &vt, pos)?;
                    kv_attend(rec, &qt, &kc, &vc, pos)
                })?;
                got.extend(o.read_f32(gpu)?);
                pos += t;
            }
            Ok(vec![got])
        });
        // Convex combinations of v with probabilities from D-term dots and exp(): as the
        // training kernels, judged against max |v| (here ~1) with the dot's tolerance.
        let res = r.and_then(|got| compare("kv_attend", &got[0], &want, None, Tolerance { abs: 2e-6 * (d as f64).sqrt(), rel: 1e-5 }).map_err(s));
        push(out, "kv_attend", format!("cap {cap}, Hq {hq}/Hkv {hkv}, D {d}, {pre} + {steps}x1"), res);
    }
}
