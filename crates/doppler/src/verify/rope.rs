//! RoPE forward and backward, both pairings.

use super::{push, s, twice, CheckResult};
use crate::check::{compare, Rng, Tolerance};
use crate::gpu::{Gpu, Tensor};
use crate::ops::rope::{rope, rope_backward, Pairing, RopeTable};
use crate::reference::{rope as cpu, widen};

/// (x shape (.., T, H, Dh), position offset, pairing): a batch with odd T and H; a KV-cache
/// style offset; more than 65535 workgroups of 64 pairs.
pub const ROPE_CASES: [(&[usize], usize, Pairing); 4] = [
    (&[2, 7, 3, 8], 0, Pairing::Interleaved),
    (&[2, 7, 3, 8], 0, Pairing::Half),
    (&[1, 5, 4, 64], 2000, Pairing::Half),
    (&[1, 2049, 8, 512], 0, Pairing::Interleaved),
];

const THETA: f64 = 10000.0;

pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (i, &(shape, offset, pairing)) in ROPE_CASES.iter().enumerate() {
        let n: usize = shape.iter().product();
        let (t, h, dh) = (shape[1], shape[2], shape[3]);
        let mut rng = Rng::new(1400 + i as u64);
        let x = rng.vec(n);
        let r = twice("rope", async || {
            let table = RopeTable::new(gpu, offset + t, dh, THETA)?;
            let tx = Tensor::from_f32(gpu, shape, &x, "x")?;
            let mut rec = gpu.recorder("rope");
            let y = rope(&mut rec, &tx, &table, offset, pairing)?;
            let back = rope_backward(&mut rec, &tx, &table, offset, pairing)?;
            rec.submit()?;
            Ok(vec![y.to_vec_f32(gpu).await?, back.to_vec_f32(gpu).await?])
        })
        .await;
        let what = format!("{shape:?} offset {offset} {pairing:?}");
        let xd = widen(&x);
        // cos and sin are rounded to f32 in the table: a few eps of the pair's magnitude.
        let tol = Tolerance {
            abs: 1e-30,
            rel: 4.0 * f32::EPSILON as f64,
        };
        let scale: Vec<f64> = (0..n)
            .map(|k| {
                let (base, kk) = (k - k % dh, k % dh);
                let partner = match pairing {
                    Pairing::Interleaved => base + (kk ^ 1),
                    Pairing::Half => base + (kk + dh / 2) % dh,
                };
                xd[k].abs() + xd[partner].abs()
            })
            .collect();
        for (k, (name, sign)) in [("rope", 1.0), ("rope backward", -1.0)].iter().enumerate() {
            let want = cpu::rope(&xd, t, h, dh, offset, THETA, pairing, *sign);
            let res = match &r {
                Ok(got) => compare(name, &got[k], &want, Some(&scale), tol).map_err(s),
                Err(e) => Err(e.clone()),
            };
            push(out, name, what.clone(), res);
        }
    }
}
