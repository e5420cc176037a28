//! Dropout: the mask bit for bit against the reference hash, its keep rate, and the
//! backward regenerating the same mask.

use super::{push, s, twice, CheckResult};
use crate::check::{same_bits, Rng, Stats};
use crate::gpu::{Gpu, Tensor};
use crate::ops::dropout::{dropout, dropout_backward, params};
use crate::reference::dropout as cpu;

/// (elements, p, seed): small odd; a large seed; more than 65535 x 256 elements.
pub const DROPOUT_CASES: [(usize, f64, u64); 3] = [
    (1001, 0.1, 7),
    (4096, 0.5, 0xDEAD_BEEF_0000_0001),
    (65_537 * 256 + 9, 0.25, 42),
];

pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (i, &(n, p, seed)) in DROPOUT_CASES.iter().enumerate() {
        let mut rng = Rng::new(1700 + i as u64);
        let x = rng.vec(n);
        let dy = rng.vec(n);
        let r = twice("dropout", async || {
            let tx = Tensor::from_f32(gpu, &[n], &x, "x")?;
            let tdy = Tensor::from_f32(gpu, &[n], &dy, "dy")?;
            let mut rec = gpu.recorder("dropout");
            let y = dropout(&mut rec, &tx, p, seed)?;
            let dx = dropout_backward(&mut rec, &tdy, p, seed)?;
            rec.submit()?;
            Ok(vec![y.to_vec_f32(gpu).await?, dx.to_vec_f32(gpu).await?])
        })
        .await
        .and_then(|got| {
            let prm = params(n, p, seed);
            same_bits("dropout", &cpu::dropout(&x, &prm), &got[0]).map_err(s)?;
            same_bits("dropout backward", &cpu::dropout(&dy, &prm), &got[1]).map_err(s)?;
            // The hash must actually drop about p of the elements (5 standard deviations).
            let dropped = (0..n as u32).filter(|&k| !cpu::keep(&prm, k)).count() as f64;
            let sd = (n as f64 * p * (1.0 - p)).sqrt();
            if (dropped - n as f64 * p).abs() > 5.0 * sd + 1.0 {
                return Err(format!(
                    "dropped {dropped} of {n}, expected {:.0} +- {:.0}",
                    n as f64 * p,
                    5.0 * sd
                ));
            }
            Ok(Stats::default())
        });
        push(
            out,
            "dropout (fwd + bwd, bit-exact mask)",
            format!("[{n}] p {p} seed {seed:#x}"),
            r,
        );
    }
}
