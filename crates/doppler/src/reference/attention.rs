//! Attention in f64 with the whole score matrix: the oracle for the flash kernels.
//! q (B, Tq, Hq, D), k and v (B, Tk, Hkv, D), o (B, Tq, Hq, D), lse (B, Hq, Tq).

#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub b: usize,
    pub tq: usize,
    pub tk: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub causal: bool,
    /// With `causal`: query i sees only the last `window` keys up to its own (0: all).
    pub window: usize,
    pub scale: f64,
    /// Dropout on the probabilities (the kernels' mask, regenerated from the same hash).
    pub dropout: Option<crate::ops::attention::AttnDropout>,
}

impl Dims {
    fn q_at(&self, b: usize, i: usize, h: usize) -> usize {
        ((b * self.tq + i) * self.hq + h) * self.d
    }
    fn k_at(&self, b: usize, j: usize, h: usize) -> usize {
        // In u64: h * Hkv passes 2^32 (a 32-bit usize: wasm32) in the 65,537-head case.
        let kv = (h as u64 * self.hkv as u64 / self.hq as u64) as usize;
        ((b * self.tk + j) * self.hkv + kv) * self.d
    }
    fn visible(&self, i: usize, j: usize) -> bool {
        // Query i sits at key position i + tk - tq.
        !self.causal
            || (j + self.tq <= i + self.tk
                && (self.window == 0 || i + self.tk < j + self.tq + self.window))
    }
    /// Dropout's multiplier of p_ij: 1 / (1 - p) in f32 where kept, 0 where dropped, 1
    /// without dropout.
    fn z(&self, b: usize, h: usize, i: usize, j: usize) -> f64 {
        let Some(d) = self.dropout.filter(|d| d.p > 0.0) else {
            return 1.0;
        };
        let prm = crate::ops::dropout::params(0, d.p, d.seed);
        let row = (b as u32)
            .wrapping_mul(self.hq as u32)
            .wrapping_add(h as u32)
            .wrapping_mul(self.tq as u32)
            .wrapping_add(i as u32);
        if crate::reference::dropout::attn_keep(&prm, row, j as u32) {
            prm.scale as f64
        } else {
            0.0
        }
    }
    /// Probabilities of row (b, h, i) over all keys (0 where masked).
    fn probs(&self, q: &[f64], k: &[f64], b: usize, h: usize, i: usize) -> Vec<f64> {
        let qa = self.q_at(b, i, h);
        let s: Vec<f64> = (0..self.tk)
            .map(|j| {
                if !self.visible(i, j) {
                    return f64::NEG_INFINITY;
                }
                let ka = self.k_at(b, j, h);
                self.scale * (0..self.d).map(|x| q[qa + x] * k[ka + x]).sum::<f64>()
            })
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
        let z: f64 = e.iter().sum();
        e.iter().map(|v| v / z).collect()
    }
}

/// (o, lse)
pub fn attention(q: &[f64], k: &[f64], v: &[f64], dm: Dims) -> (Vec<f64>, Vec<f64>) {
    let mut o = vec![0.0; q.len()];
    let mut lse = vec![0.0; dm.b * dm.hq * dm.tq];
    for b in 0..dm.b {
        for h in 0..dm.hq {
            for i in 0..dm.tq {
                let p = dm.probs(q, k, b, h, i);
                let qa = dm.q_at(b, i, h);
                for (j, pj) in p.iter().enumerate() {
                    let va = dm.k_at(b, j, h);
                    let pz = pj * dm.z(b, h, i, j);
                    for x in 0..dm.d {
                        o[qa + x] += pz * v[va + x];
                    }
                }
                // lse = log sum exp(s): recomputed from the scores for clarity.
                let s: Vec<f64> = (0..dm.tk)
                    .filter(|&j| dm.visible(i, j))
                    .map(|j| {
                        dm.scale
                            * (0..dm.d)
                                .map(|x| q[qa + x] * k[dm.k_at(b, j, h) + x])
                                .sum::<f64>()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                lse[(b * dm.hq + h) * dm.tq + i] =
                    m + s.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            }
        }
    }
    (o, lse)
}

/// (dq, dk, dv) for upstream dO: dp = dO v^T, ds = p (dp - rowsum(dO o)), dq = scale ds k,
/// dk = scale ds^T q, dv = p^T dO (summed over the query heads sharing a key head); with
/// dropout's z: ds = p (z dp - rowsum(p z dp)), dv = (z p)^T dO.
pub fn attention_backward(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    d_o: &[f64],
    dm: Dims,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    for b in 0..dm.b {
        for h in 0..dm.hq {
            for i in 0..dm.tq {
                let p = dm.probs(q, k, b, h, i);
                let qa = dm.q_at(b, i, h);
                // z dp: the gradient of the dropped probabilities' inputs.
                let zdp: Vec<f64> = (0..dm.tk)
                    .map(|j| {
                        dm.z(b, h, i, j)
                            * (0..dm.d)
                                .map(|x| d_o[qa + x] * v[dm.k_at(b, j, h) + x])
                                .sum::<f64>()
                    })
                    .collect();
                let delta: f64 = p.iter().zip(&zdp).map(|(a, b)| a * b).sum();
                for j in 0..dm.tk {
                    let ka = dm.k_at(b, j, h);
                    let ds = p[j] * (zdp[j] - delta);
                    let pz = p[j] * dm.z(b, h, i, j);
                    for x in 0..dm.d {
                        dq[qa + x] += dm.scale * ds * k[ka + x];
                        dk[ka + x] += dm.scale * ds * q[qa + x];
                        dv[ka + x] += pz * d_o[qa + x];
                    }
                }
            }
        }
    }
    (dq, dk, dv)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{assert_close, finite_diff};

    #[test]
    fn backward_matches_finite_differences() {
        // Grouped heads (4 query, 2 key/value), Tq < Tk with the causal offset, batch 2.
        let dm = Dims {
            b: 2,
            tq: 3,
            tk: 4,
            hq: 4,
            hkv: 2,
            d: 2,
            causal: true,
            window: 0,
            scale: 0.7,
            dropout: None,
        };
        let nq = dm.b * dm.tq * dm.hq * dm.d;
        let nk = dm.b * dm.tk * dm.hkv * dm.d;
        let gen = |n: usize, s: usize| -> Vec<f64> {
            (0..n)
                .map(|i| (((i * s + 3) % 11) as f64 - 5.0) * 0.3)
                .collect()
        };
        let (q, k, v, g) = (gen(nq, 7), gen(nk, 5), gen(nk, 3), gen(nq, 9));
        let (dq, dk, dv) = attention_backward(&q, &k, &v, &g, dm);
        let loss = |o: Vec<f64>| o.iter().zip(&g).map(|(a, b)| a * b).sum::<f64>();
        let fq = finite_diff(|x| loss(attention(x, &k, &v, dm).0), &q);
        let fk = finite_diff(|x| loss(attention(&q, x, &v, dm).0), &k);
        let fv = finite_diff(|x| loss(attention(&q, &k, x, dm).0), &v);
        assert_close("attention dq vs finite differences", &dq, &fq, 1e-7);
        assert_close("attention dk vs finite differences", &dk, &fk, 1e-7);
        assert_close("attention dv vs finite differences", &dv, &fv, 1e-7);
    }

    #[test]
    fn dropout_backward_matches_finite_differences() {
        // The mask is a fixed function of (seed, row, key), so the dropped attention is
        // differentiable and its derivatives are the finite differences'.
        let dm = Dims {
            b: 2,
            tq: 5,
            tk: 6,
            hq: 4,
            hkv: 2,
            d: 3,
            causal: true,
            window: 0,
            scale: 0.6,
            dropout: Some(crate::ops::attention::AttnDropout { p: 0.3, seed: 77 }),
        };
        let nq = dm.b * dm.tq * dm.hq * dm.d;
        let nk = dm.b * dm.tk * dm.hkv * dm.d;
        let gen = |n: usize, s: usize| -> Vec<f64> {
            (0..n)
                .map(|i| (((i * s + 3) % 13) as f64 - 6.0) * 0.25)
                .collect()
        };
        let (q, k, v, g) = (gen(nq, 7), gen(nk, 5), gen(nk, 3), gen(nq, 9));
        // Some probabilities dropped, some kept (a mask of all ones would test nothing).
        let zs: Vec<f64> = (0..dm.tq)
            .flat_map(|i| (0..dm.tk).map(move |j| (i, j)))
            .map(|(i, j)| dm.z(1, 3, i, j))
            .collect();
        assert!(zs.contains(&0.0) && zs.iter().any(|&z| z > 1.0), "{zs:?}");
        let (dq, dk, dv) = attention_backward(&q, &k, &v, &g, dm);
        let loss = |o: Vec<f64>| o.iter().zip(&g).map(|(a, b)| a * b).sum::<f64>();
        let fq = finite_diff(|x| loss(attention(x, &k, &v, dm).0), &q);
        let fk = finite_diff(|x| loss(attention(&q, x, &v, dm).0), &k);
        let fv = finite_diff(|x| loss(attention(&q, &k, x, dm).0), &v);
        assert_close("dropped attention dq vs finite differences", &dq, &fq, 1e-7);
        assert_close("dropped attention dk vs finite differences", &dk, &fk, 1e-7);
        assert_close("dropped attention dv vs finite differences", &dv, &fv, 1e-7);
        // The undropped result differs: the mask took effect.
        let plain = Dims {
            dropout: None,
            ..dm
        };
        assert!(attention(&q, &k, &v, plain).0 != attention(&q, &k, &v, dm).0);
    }
}
