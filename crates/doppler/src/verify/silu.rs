//! SiLU and SwiGLU forward and backward.

use super::{push, s, twice, CheckResult};
use crate::check::{compare, Rng, Tolerance};
use crate::gpu::{Gpu, Tensor};
use crate::ops::silu::{silu, silu_backward, swiglu, swiglu_backward};
use crate::reference::{silu as cpu, widen};

/// One element, an odd batch, and more than 65535 x 256 elements.
pub const SILU_SHAPES: [&[usize]; 3] = [&[1], &[3, 7, 45], &[65_537 * 256 + 5]];

/// A few roundings; Vulkan allows exp(x) an error of 3 + 2|x| ulp, so scales carry (1 + |a|).
const TOL: Tolerance = Tolerance {
    abs: 1e-30,
    rel: 8.0 * f32::EPSILON as f64,
};

pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (i, shape) in SILU_SHAPES.iter().enumerate() {
        let n: usize = shape.iter().product();
        let mut rng = Rng::new(1300 + i as u64);
        let a: Vec<f32> = rng.vec(n).iter().map(|v| v * 12.0).collect();
        let b = rng.vec(n);
        let dy = rng.vec(n);
        let r = twice("silu", async || {
            let (ta, tb, tdy) = (
                Tensor::from_f32(gpu, shape, &a, "a")?,
                Tensor::from_f32(gpu, shape, &b, "b")?,
                Tensor::from_f32(gpu, shape, &dy, "dy")?,
            );
            let mut rec = gpu.recorder("silu");
            let y = silu(&mut rec, &ta)?;
            let da = silu_backward(&mut rec, &ta, &tdy)?;
            let z = swiglu(&mut rec, &ta, &tb)?;
            let (ga, gb) = swiglu_backward(&mut rec, &ta, &tb, &tdy)?;
            rec.submit()?;
            Ok(vec![
                y.to_vec_f32(gpu).await?,
                da.to_vec_f32(gpu).await?,
                z.to_vec_f32(gpu).await?,
                ga.to_vec_f32(gpu).await?,
                gb.to_vec_f32(gpu).await?,
            ])
        })
        .await;
        let (ad, bd, dyd) = (widen(&a), widen(&b), widen(&dy));
        let (ga, gb) = cpu::swiglu_backward(&ad, &bd, &dyd);
        let want = [
            cpu::silu(&ad),
            cpu::silu_backward(&ad, &dyd),
            cpu::swiglu(&ad, &bd),
            ga,
            gb,
        ];
        let names = [
            "silu",
            "silu backward",
            "swiglu",
            "swiglu backward (da)",
            "swiglu backward (db)",
        ];
        for (k, name) in names.iter().enumerate() {
            // The derivative's two terms can cancel: scale by their magnitudes.
            let scale: Vec<f64> = (0..n)
                .map(|j| {
                    let sg = 1.0 / (1.0 + (-ad[j]).exp());
                    let terms = sg * (1.0 + (ad[j] * (1.0 - sg)).abs());
                    let m = match k {
                        1 => dyd[j].abs() * terms,
                        3 => (dyd[j] * bd[j]).abs() * terms,
                        _ => want[k][j].abs(),
                    };
                    m * (1.0 + ad[j].abs())
                })
                .collect();
            let res = match &r {
                Ok(got) => compare(name, &got[k], &want[k], Some(&scale), TOL).map_err(s),
                Err(e) => Err(e.clone()),
            };
            push(out, name, format!("{shape:?}"), res);
        }
    }
}
