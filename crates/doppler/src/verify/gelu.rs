//! GELU forward and backward, both variants.

use super::{push, s, twice, CheckResult};
use crate::check::{compare, Rng, Tolerance};
use crate::gpu::{Gpu, Tensor};
use crate::ops::gelu::{gelu, gelu_backward, GeluMode};
use crate::reference::{self as cpu, widen};

/// Shapes: one element, an odd batch, one needing a 2-D grid (> 65535 groups of 256), and
/// two multiples of 4 (the vec4 kernels).
pub const GELU_SHAPES: [&[usize]; 5] = [
    &[1],
    &[3, 7, 47],
    &[65_537 * 256 + 3],
    &[2, 3, 8],
    &[4, 1000, 36],
];

/// erfc's fit (1.2e-7 relative) and exp's rounding, over |x| <= 6.
const TOL: Tolerance = Tolerance {
    abs: 1e-7,
    rel: 2e-6,
};

pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (i, shape) in GELU_SHAPES.iter().enumerate() {
        let n: usize = shape.iter().product();
        let mut rng = Rng::new(500 + i as u64);
        let x: Vec<f32> = rng.vec(n).iter().map(|v| v * 6.0).collect();
        let dy = rng.vec(n);
        for mode in [GeluMode::Exact, GeluMode::Tanh] {
            let name = match mode {
                GeluMode::Exact => "gelu",
                GeluMode::Tanh => "gelu tanh",
            };
            let r = twice(name, async || {
                let tx = Tensor::from_f32(gpu, shape, &x, "x")?;
                let tdy = Tensor::from_f32(gpu, shape, &dy, "dy")?;
                let mut rec = gpu.recorder(name);
                let y = gelu(&mut rec, &tx, mode)?;
                let dx = gelu_backward(&mut rec, &tx, &tdy, mode)?;
                rec.submit()?;
                Ok(vec![y.to_vec_f32(gpu).await?, dx.to_vec_f32(gpu).await?])
            })
            .await;
            let (fwd, bwd) = match r {
                Ok(v) => {
                    let (xd, dyd) = (widen(&x), widen(&dy));
                    (
                        compare(name, &v[0], &cpu::gelu::gelu(&xd, mode), None, TOL).map_err(s),
                        compare(
                            name,
                            &v[1],
                            &cpu::gelu::gelu_backward(&xd, &dyd, mode),
                            None,
                            TOL,
                        )
                        .map_err(s),
                    )
                }
                Err(e) => (Err(e.clone()), Err(e)),
            };
            push(out, name, format!("{shape:?}"), fwd);
            push(out, &format!("{name} backward"), format!("{shape:?}"), bwd);
        }
    }
}
