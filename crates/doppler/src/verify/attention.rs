//! Flash attention forward and backward against the full-matrix reference.

use super::{push, s, twice, CheckResult};
use crate::check::{compare, Rng, Tolerance};
use crate::gpu::{Gpu, Tensor};
use crate::ops::attention::{attention, attention_backward, AttnOpts};
use crate::reference::{attention as cpu, widen};

/// (B, Tq, Tk, Hq, Hkv, D, causal): odd lengths over several row blocks with grouped heads;
/// fewer queries than keys (the causal offset a KV cache gives); full attention; the
/// largest head dim; more than 65535 workgroups.
pub const ATTN_CASES: [(usize, usize, usize, usize, usize, usize, bool); 5] = [
    (2, 77, 77, 4, 2, 16, true),
    (1, 5, 70, 2, 1, 64, true),
    (3, 19, 23, 3, 3, 8, false),
    (1, 130, 130, 2, 2, 128, true),
    (1, 1, 2, 65_537, 65_537, 4, true),
];

pub(super) fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (n, &(b, tq, tk, hq, hkv, d, causal)) in ATTN_CASES.iter().enumerate() {
        let (qs, ks) = ([b, tq, hq, d], [b, tk, hkv, d]);
        let (nq, nk) = (b * tq * hq * d, b * tk * hkv * d);
        let mut rng = Rng::new(1500 + n as u64);
        let (q, k, v, g) = (rng.vec(nq), rng.vec(nk), rng.vec(nk), rng.vec(nq));
        let opts = AttnOpts { causal, scale: None };
        let r = twice("attention", || {
            let tq_ = Tensor::from_f32(gpu, &qs, &q, "q")?;
            let tk_ = Tensor::from_f32(gpu, &ks, &k, "k")?;
            let tv_ = Tensor::from_f32(gpu, &ks, &v, "v")?;
            let tg = Tensor::from_f32(gpu, &qs, &g, "dO")?;
            let mut rec = gpu.recorder("attention");
            let f = attention(&mut rec, &tq_, &tk_, &tv_, opts)?;
            let gr = attention_backward(&mut rec, &tq_, &tk_, &tv_, &f, &tg, opts)?;
            rec.submit()?;
            Ok(vec![f.o.read_f32(gpu)?, f.lse.read_f32(gpu)?, gr.dq.read_f32(gpu)?, gr.dk.read_f32(gpu)?, gr.dv.read_f32(gpu)?])
        });
        let dm = cpu::Dims { b, tq, tk, hq, hkv, d, causal, scale: 1.0 / (d as f32).sqrt() as f64 };
        let (qd, kd, vd, gd) = (widen(&q), widen(&k), widen(&v), widen(&g));
        let (o, lse) = cpu::attention(&qd, &kd, &vd, dm);
        let (dq, dk, dv) = cpu::attention_backward(&qd, &kd, &vd, &gd, dm);
        // Scores carry a D-term dot product's error and exp() an error growing with |s|
        // (Vulkan: 3 + 2|x| ulp); both reach every output through the probabilities, so each
        // element is judged against (1 + max|s|) times the largest magnitude in its tensor.
        let smax = dm.scale * d as f64;
        let tol = Tolerance::dot(tk + d);
        let shape = format!("B{b} Tq{tq} Tk{tk} Hq{hq} Hkv{hkv} D{d}{}", if causal { " causal" } else { "" });
        let names = ["attention", "attention lse", "attention backward (dq)", "attention backward (dk)", "attention backward (dv)"];
        let want = [o, lse, dq, dk, dv];
        for (i, name) in names.iter().enumerate() {
            let big = want[i].iter().fold(0.0f64, |m, x| m.max(x.abs()));
            let sc: Vec<f64> = want[i].iter().map(|x| (1.0 + smax) * (x.abs() + big)).collect();
            let res = match &r {
                Ok(got) => compare(name, &got[i], &want[i], Some(&sc), tol).map_err(s),
                Err(e) => Err(e.clone()),
            };
            push(out, name, shape.clone(), res);
        }
    }
}
