//! Bias add forward and its column-sum backward.

use super::{push, s, twice, CheckResult};
use crate::check::{compare, Rng, Tolerance};
use crate::gpu::{Gpu, Tensor};
use crate::ops::bias::{bias_add, bias_add_backward};
use crate::reference::{bias as cpu, widen};

/// Odd sizes with batch dims; rows over several chunks (two passes); 70000 rows of one
/// column (three passes); more than 65535 x 256 elements; columns a multiple of 4 (the
/// vec4 kernels: three gradient passes, and rows ending inside the 4-row unrolled loop).
pub const BIAS_SHAPES: [&[usize]; 8] = [
    &[3, 7, 45],
    &[1000, 3],
    &[70_000, 1],
    &[262_150, 65],
    &[5, 12],
    &[3, 100, 768],
    &[70_001, 8],
    &[2, 130, 260],
];

pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (i, shape) in BIAS_SHAPES.iter().enumerate() {
        let n = *shape.last().unwrap();
        let len: usize = shape.iter().product();
        let mut rng = Rng::new(1600 + i as u64);
        let (x, b, dy) = (rng.vec(len), rng.vec(n), rng.vec(len));
        let r = twice("bias_add", async || {
            let (tx, tb, tdy) = (
                Tensor::from_f32(gpu, shape, &x, "x")?,
                Tensor::from_f32(gpu, &[n], &b, "b")?,
                Tensor::from_f32(gpu, shape, &dy, "dy")?,
            );
            let mut rec = gpu.recorder("bias_add");
            let y = bias_add(&mut rec, &tx, &tb)?;
            let db = bias_add_backward(&mut rec, &tdy)?;
            rec.submit()?;
            Ok(vec![y.to_vec_f32(gpu).await?, db.to_vec_f32(gpu).await?])
        })
        .await;
        let dyd = widen(&dy);
        let y = cpu::bias_add(&widen(&x), &widen(&b));
        let db = cpu::bias_add_backward(&dyd, n);
        let mag = cpu::bias_add_backward(&dyd.iter().map(|v| v.abs()).collect::<Vec<_>>(), n);
        let (fwd, bwd) = match r {
            Err(e) => (Err(e.clone()), Err(e)),
            Ok(got) => (
                compare("bias_add", &got[0], &y, None, Tolerance::ELEMENTWISE).map_err(s),
                compare(
                    "bias_add backward",
                    &got[1],
                    &db,
                    Some(&mag),
                    Tolerance::sum(len / n),
                )
                .map_err(s),
            ),
        };
        push(out, "bias_add", format!("{shape:?}"), fwd);
        push(out, "bias_add backward", format!("{shape:?}"), bwd);
    }
}
