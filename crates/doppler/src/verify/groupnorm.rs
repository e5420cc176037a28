//! GroupNorm forward (y, mean, rstd) and backward (dx, dgamma, dbeta).

use super::{push, s, twice, CheckResult};
use crate::check::{compare, Rng, Tolerance};
use crate::gpu::{Gpu, Tensor};
use crate::ops::groupnorm::{group_norm, group_norm_backward};
use crate::reference::{groupnorm as cpu, widen};

/// (x shape, groups, offset added to x): odd spatial sizes with a batch; C not a multiple
/// of 256; one value per group (variance 0); a large mean (stable statistics); more than
/// 65535 (n, c) workgroups; more than 65535 x 256 elements.
pub const GN_CASES: [(&[usize], usize, f32); 6] = [
    (&[2, 6, 5, 7], 3, 0.0),
    (&[3, 300, 3], 10, 0.0),
    (&[2, 4, 1], 4, 0.0),
    (&[2, 8, 33], 2, 100.0),
    (&[70_000, 1, 3], 1, 0.0),
    (&[1, 2, 2897, 2897], 1, 0.0),
];

const EPS: f32 = 1e-5;

pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (i, &(shape, groups, offset)) in GN_CASES.iter().enumerate() {
        let (n, c) = (shape[0], shape[1]);
        let sp: usize = shape[2..].iter().product();
        let len = n * c * sp;
        let mut rng = Rng::new(900 + i as u64);
        let x: Vec<f32> = rng.vec(len).iter().map(|v| v + offset).collect();
        let gamma: Vec<f32> = rng.vec(c).iter().map(|v| 1.0 + v).collect();
        let beta = rng.vec(c);
        let dy = rng.vec(len);
        let what = format!(
            "{shape:?} groups {groups}{}",
            if offset != 0.0 {
                format!(" x+{offset}")
            } else {
                String::new()
            }
        );
        let r = twice("group_norm", async || {
            let tx = Tensor::from_f32(gpu, shape, &x, "x")?;
            let tg = Tensor::from_f32(gpu, &[c], &gamma, "gamma")?;
            let tb = Tensor::from_f32(gpu, &[c], &beta, "beta")?;
            let tdy = Tensor::from_f32(gpu, shape, &dy, "dy")?;
            let mut rec = gpu.recorder("group_norm");
            let f = group_norm(&mut rec, &tx, &tg, &tb, groups, EPS)?;
            let b = group_norm_backward(&mut rec, &tx, &tg, &f, &tdy, groups)?;
            rec.submit()?;
            Ok(vec![
                f.y.to_vec_f32(gpu).await?,
                f.mean.to_vec_f32(gpu).await?,
                f.rstd.to_vec_f32(gpu).await?,
                b.dx.to_vec_f32(gpu).await?,
                b.dgamma.to_vec_f32(gpu).await?,
                b.dbeta.to_vec_f32(gpu).await?,
            ])
        })
        .await;
        let (fwd, bwd) = match r {
            Err(e) => (Err(e.clone()), Err(e)),
            Ok(got) => {
                let d = cpu::Dims {
                    n,
                    c,
                    s: sp,
                    g: groups,
                };
                let (xd, gd, bd, dyd) = (widen(&x), widen(&gamma), widen(&beta), widen(&dy));
                let (y, mean, rstd) = cpu::group_norm(&xd, &gd, &bd, &d, EPS as f64);
                let (dx, dgamma, dbeta) = cpu::group_norm_backward(&xd, &gd, &dyd, &d, EPS as f64);
                let m = (c / groups) * sp;
                let tol = Tolerance::sum(m.max(n * sp));
                // Rounding in x - mean grows with |mean| * rstd; everything else with the
                // magnitudes of the terms summed.
                let cpg = c / groups;
                let grp = |k: usize| (k / (c * sp)) * groups + (k / sp % c) / cpg;
                let cond = |k: usize| 1.0 + mean[grp(k)].abs() * rstd[grp(k)];
                let xhat = |k: usize| (xd[k] - mean[grp(k)]) * rstd[grp(k)];
                let y_scale: Vec<f64> = (0..len)
                    .map(|k| {
                        (xhat(k).abs() + cond(k)) * gd[k / sp % c].abs() + bd[k / sp % c].abs()
                    })
                    .collect();
                let mut ga = vec![0.0; n * groups];
                let mut gb = vec![0.0; n * groups];
                for k in 0..len {
                    let t = (dyd[k] * gd[k / sp % c]).abs();
                    ga[grp(k)] += t / m as f64;
                    gb[grp(k)] += t * (xhat(k).abs() + cond(k)) / m as f64;
                }
                let dx_scale: Vec<f64> = (0..len)
                    .map(|k| {
                        rstd[grp(k)]
                            * ((dyd[k] * gd[k / sp % c]).abs()
                                + ga[grp(k)]
                                + (xhat(k).abs() + cond(k)) * gb[grp(k)])
                    })
                    .collect();
                let mut dg_scale = vec![0.0; c];
                let mut db_scale = vec![0.0; c];
                for k in 0..len {
                    dg_scale[k / sp % c] += dyd[k].abs() * (xhat(k).abs() + cond(k));
                    db_scale[k / sp % c] += dyd[k].abs();
                }
                let stat_scale: Vec<f64> = (0..n * groups)
                    .map(|q| mean[q].abs() + 1.0 / rstd[q])
                    .collect();
                let rstd_scale: Vec<f64> =
                    rstd.iter().map(|r| r * (1.0 + stat_scale[0] * r)).collect();
                let fwd = (|| {
                    let st =
                        compare("group_norm y", &got[0], &y, Some(&y_scale), tol).map_err(s)?;
                    compare("group_norm mean", &got[1], &mean, Some(&stat_scale), tol)
                        .map_err(s)?;
                    compare("group_norm rstd", &got[2], &rstd, Some(&rstd_scale), tol)
                        .map_err(s)?;
                    Ok(st)
                })();
                let bwd = (|| {
                    let st =
                        compare("group_norm dx", &got[3], &dx, Some(&dx_scale), tol).map_err(s)?;
                    compare("group_norm dgamma", &got[4], &dgamma, Some(&dg_scale), tol)
                        .map_err(s)?;
                    compare("group_norm dbeta", &got[5], &dbeta, Some(&db_scale), tol)
                        .map_err(s)?;
                    Ok(st)
                })();
                (fwd, bwd)
            }
        };
        push(out, "group_norm", what.clone(), fwd);
        push(out, "group_norm backward", what, bwd);
    }
}
