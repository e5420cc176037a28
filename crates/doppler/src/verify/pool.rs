//! Average pooling, forward and backward.

use super::{push, s, twice, CheckResult};
use crate::check::{compare, Rng, Tolerance};
use crate::gpu::{Gpu, Tensor};
use crate::ops::pool::{avg_pool2d, avg_pool2d_backward, Pool};
use crate::reference::{pool as cpu, widen};

/// (input NCHW, window, stride): non-overlapping, overlapping with leftovers, global
/// pooling, a 1x1 image, more than 65535 x 256 outputs.
pub const POOL_CASES: [([usize; 4], [usize; 2], [usize; 2]); 5] = [
    ([2, 3, 8, 6], [2, 2], [2, 2]),
    ([3, 2, 7, 9], [3, 2], [2, 3]),
    ([5, 7, 4, 4], [4, 4], [4, 4]),
    ([1, 1, 1, 1], [1, 1], [1, 1]),
    ([1, 2, 3000, 3000], [2, 1], [1, 1]),
];

pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (i, &(shape, k, st)) in POOL_CASES.iter().enumerate() {
        let [n, c, h, w] = shape;
        let pool = Pool {
            kernel: (k[0], k[1]),
            stride: (st[0], st[1]),
        };
        let (oh, ow) = ((h - k[0]) / st[0] + 1, (w - k[1]) / st[1] + 1);
        let mut rng = Rng::new(4100 + i as u64);
        let x = rng.vec(n * c * h * w);
        let dy = rng.vec(n * c * oh * ow);
        let r = twice("avg_pool2d", async || {
            let tx = Tensor::from_f32(gpu, &shape, &x, "x")?;
            let tdy = Tensor::from_f32(gpu, &[n, c, oh, ow], &dy, "dy")?;
            let mut rec = gpu.recorder("avg_pool2d");
            let y = avg_pool2d(&mut rec, &tx, pool)?;
            let dx = avg_pool2d_backward(&mut rec, &tdy, &shape, pool)?;
            rec.submit()?;
            Ok(vec![y.to_vec_f32(gpu).await?, dx.to_vec_f32(gpu).await?])
        })
        .await;
        let (xd, dyd) = (widen(&x), widen(&dy));
        let abs = |v: &[f64]| v.iter().map(|a| a.abs()).collect::<Vec<f64>>();
        let y = cpu::avg_pool2d(&xd, [h, w], k, st);
        let ymag = cpu::avg_pool2d(&abs(&xd), [h, w], k, st);
        let dx = cpu::avg_pool2d_backward(&dyd, [h, w], k, st);
        let dmag = cpu::avg_pool2d_backward(&abs(&dyd), [h, w], k, st);
        let terms = k[0] * k[1];
        let (fwd, bwd) = match r {
            Err(e) => (Err(e.clone()), Err(e)),
            Ok(got) => (
                compare(
                    "avg_pool2d",
                    &got[0],
                    &y,
                    Some(&ymag),
                    Tolerance::sum(terms),
                )
                .map_err(s),
                compare(
                    "avg_pool2d backward",
                    &got[1],
                    &dx,
                    Some(&dmag),
                    Tolerance::sum(terms),
                )
                .map_err(s),
            ),
        };
        let what = format!("{shape:?} k{k:?} s{st:?}");
        push(out, "avg_pool2d", what.clone(), fwd);
        push(out, "avg_pool2d backward", what, bwd);
    }
}
