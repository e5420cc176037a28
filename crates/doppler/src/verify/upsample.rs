//! Pixel shuffle and nearest upsample2d, forward and backward.

use super::{push, s, twice, CheckResult};
use crate::check::{compare, Rng, Tolerance};
use crate::gpu::{Gpu, Tensor};
use crate::ops::upsample::{
    pixel_shuffle, pixel_shuffle_backward, upsample_nearest2d, upsample_nearest2d_backward,
};
use crate::reference::{upsample as cpu, widen};

/// (input NCHW, kind, sh, sw): odd sizes with batch; a 1x1 image; more than 65535 x 256
/// outputs.
pub const UPSAMPLE_CASES: [([usize; 4], &str, usize, usize); 6] = [
    ([2, 12, 5, 7], "pixel_shuffle", 2, 2),
    ([1, 9, 3, 1], "pixel_shuffle", 3, 3),
    ([1, 4, 520, 520], "pixel_shuffle", 2, 2),
    ([2, 3, 5, 7], "upsample_nearest2d", 2, 3),
    ([1, 1, 1, 1], "upsample_nearest2d", 1, 1),
    ([1, 1, 1030, 1030], "upsample_nearest2d", 4, 4),
];

pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (i, &(shape, op, sh, sw)) in UPSAMPLE_CASES.iter().enumerate() {
        let [n, c, h, w] = shape;
        let len = n * c * h * w;
        let shuffle = op == "pixel_shuffle";
        let mut rng = Rng::new(1700 + i as u64);
        let x = rng.vec(len);
        let dy = rng.vec(len * if shuffle { 1 } else { sh * sw });
        let out_shape = if shuffle {
            [n, c / (sh * sw), h * sh, w * sw]
        } else {
            [n, c, h * sh, w * sw]
        };
        let r = twice(op, async || {
            let tx = Tensor::from_f32(gpu, &shape, &x, "x")?;
            let tdy = Tensor::from_f32(gpu, &out_shape, &dy, "dy")?;
            let mut rec = gpu.recorder(op);
            let (y, dx) = if shuffle {
                (
                    pixel_shuffle(&mut rec, &tx, sh)?,
                    pixel_shuffle_backward(&mut rec, &tdy, sh)?,
                )
            } else {
                (
                    upsample_nearest2d(&mut rec, &tx, sh, sw)?,
                    upsample_nearest2d_backward(&mut rec, &tdy, sh, sw)?,
                )
            };
            rec.submit()?;
            Ok(vec![y.to_vec_f32(gpu).await?, dx.to_vec_f32(gpu).await?])
        })
        .await;
        let (xd, dyd) = (widen(&x), widen(&dy));
        let (y, dx, mag) = if shuffle {
            (
                cpu::pixel_shuffle(&xd, shape, sh),
                cpu::pixel_shuffle_backward(&dyd, shape, sh),
                None,
            )
        } else {
            let abs: Vec<f64> = dyd.iter().map(|v| v.abs()).collect();
            let mag = cpu::upsample_nearest2d_backward(&abs, h, w, sh, sw);
            (
                cpu::upsample_nearest2d(&xd, h, w, sh, sw),
                cpu::upsample_nearest2d_backward(&dyd, h, w, sh, sw),
                Some(mag),
            )
        };
        let bwd_name = format!("{op} backward");
        let (fwd, bwd) = match r {
            Err(e) => (Err(e.clone()), Err(e)),
            Ok(got) => (
                compare(op, &got[0], &y, None, Tolerance::ELEMENTWISE).map_err(s),
                compare(
                    &bwd_name,
                    &got[1],
                    &dx,
                    mag.as_deref(),
                    Tolerance::sum(sh * sw),
                )
                .map_err(s),
            ),
        };
        let what = format!("{shape:?} x{sh}x{sw}");
        push(out, op, what.clone(), fwd);
        push(out, &bwd_name, what, bwd);
    }
}
