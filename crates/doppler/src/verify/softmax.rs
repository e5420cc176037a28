//! Softmax forward and backward.

use super::{push, s, twice, CheckResult};
use crate::check::{compare, Rng, Tolerance};
use crate::gpu::{Gpu, Tensor};
use crate::ops::softmax::{softmax, softmax_backward};
use crate::reference::{softmax as cpu, widen};

/// Odd rows with batch dims; a single element; a long row; more than 65535 rows.
pub const SOFTMAX_SHAPES: [&[usize]; 4] = [&[3, 5, 37], &[1, 1], &[2, 50_001], &[70_000, 3]];

pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (i, shape) in SOFTMAX_SHAPES.iter().enumerate() {
        let d = *shape.last().unwrap();
        let len: usize = shape.iter().product();
        let mut rng = Rng::new(1200 + i as u64);
        let x: Vec<f32> = rng.vec(len).iter().map(|v| v * 10.0).collect();
        let dy = rng.vec(len);
        let r = twice("softmax", async || {
            let tx = Tensor::from_f32(gpu, shape, &x, "x")?;
            let tdy = Tensor::from_f32(gpu, shape, &dy, "dy")?;
            let mut rec = gpu.recorder("softmax");
            let y = softmax(&mut rec, &tx)?;
            let dx = softmax_backward(&mut rec, &y, &tdy)?;
            rec.submit()?;
            Ok(vec![y.to_vec_f32(gpu).await?, dx.to_vec_f32(gpu).await?])
        })
        .await;
        let (fwd, bwd) = match r {
            Err(e) => (Err(e.clone()), Err(e)),
            Ok(got) => {
                let y = cpu::softmax(&widen(&x), d);
                // The backward is checked on the GPU's own y, so that it is judged alone.
                let gy = widen(&got[0]);
                let dx = cpu::softmax_backward(&gy, &widen(&dy), d);
                let tol = Tolerance::sum(d);
                // exp(x - max) carries |x - max| * eps; the sum carries log2(d) roundings.
                let y_scale: Vec<f64> = y
                    .iter()
                    .zip(&x)
                    .map(|(v, &xv)| v * (1.0 + 2.0 * (xv.abs() as f64 + 10.0)))
                    .collect();
                let mut dx_scale = vec![0.0; len];
                for r in 0..len / d {
                    let dot: f64 = (0..d)
                        .map(|c| (dy[r * d + c] as f64 * gy[r * d + c]).abs())
                        .sum();
                    for c in 0..d {
                        let k = r * d + c;
                        dx_scale[k] = gy[k].abs() * (dy[k].abs() as f64 + dot);
                    }
                }
                (
                    compare("softmax", &got[0], &y, Some(&y_scale), tol).map_err(s),
                    compare("softmax backward", &got[1], &dx, Some(&dx_scale), tol).map_err(s),
                )
            }
        };
        push(out, "softmax", format!("{shape:?}"), fwd);
        push(out, "softmax backward", format!("{shape:?}"), bwd);
    }
}
