//! LayerNorm and RMSNorm forward and backward.

use super::{push, s, twice, CheckResult};
use crate::check::{compare, Rng, Tolerance};
use crate::gpu::{Gpu, Tensor};
use crate::ops::norm::{
    layer_norm, layer_norm_backward, rms_norm, rms_norm_backward, rms_norm_heads, NormKind,
};
use crate::reference::{norm as cpu, widen};

const L: NormKind = NormKind::Layer;
const R: NormKind = NormKind::Rms { one_plus: false };
const R1: NormKind = NormKind::Rms { one_plus: true };

/// (x shape, kind, offset added to x): odd sizes with batch dims; one element; more than
/// 65535 rows (the row grid goes 2-D; 274 weight-gradient blocks); a large mean.
pub const NORM_CASES: [(&[usize], NormKind, f32); 8] = [
    (&[3, 7, 129], L, 0.0),
    (&[1, 1], L, 0.0),
    (&[70_000, 3], L, 0.0),
    (&[4, 1000], L, 50.0),
    (&[3, 7, 129], R, 0.0),
    (&[5, 300], R1, 0.0),
    (&[70_000, 3], R, 0.0),
    (&[2, 4096], R1, 3.0),
];

const EPS: f32 = 1e-5;

/// rms_norm_heads: (tokens, query heads, key/value heads, head dim, 1 + w): Qwen3-like; an
/// odd head size, one token; past 65535 rows (the grid goes 2-D).
const HEAD_CASES: [(usize, usize, usize, usize, bool); 4] = [
    (5, 4, 2, 32, false),
    (1, 3, 1, 6, true),
    (33, 16, 8, 128, false),
    (10_000, 6, 1, 4, false),
];

pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    head_checks(gpu, out).await;
    for (i, &(shape, kind, offset)) in NORM_CASES.iter().enumerate() {
        let d = *shape.last().unwrap();
        let len: usize = shape.iter().product();
        let rows = len / d;
        let mut rng = Rng::new(1100 + i as u64);
        let x: Vec<f32> = rng.vec(len).iter().map(|v| v + offset).collect();
        let w: Vec<f32> = rng.vec(d).iter().map(|v| 1.0 + 0.5 * v).collect();
        let b = rng.vec(d);
        let dy = rng.vec(len);
        // Odd cases add another gradient of x to dx in the same pass (a residual's).
        let add = (i % 2 == 1).then(|| rng.vec(len));
        let (name, one_plus) = match kind {
            NormKind::Layer => ("layer_norm", false),
            NormKind::Rms { one_plus } => ("rms_norm", one_plus),
        };
        let what = format!(
            "{shape:?}{}{}{}",
            if one_plus { " (1 + w)" } else { "" },
            if add.is_some() { " + add" } else { "" },
            if offset != 0.0 {
                format!(" x+{offset}")
            } else {
                String::new()
            }
        );
        let r = twice(name, async || {
            let tx = Tensor::from_f32(gpu, shape, &x, "x")?;
            let tw = Tensor::from_f32(gpu, &[d], &w, "w")?;
            let tb = Tensor::from_f32(gpu, &[d], &b, "b")?;
            let tdy = Tensor::from_f32(gpu, shape, &dy, "dy")?;
            let tadd = match &add {
                Some(v) => Some(Tensor::from_f32(gpu, shape, v, "add")?),
                None => None,
            };
            let mut rec = gpu.recorder(name);
            let (f, g) = if kind == L {
                let f = layer_norm(&mut rec, &tx, &tw, &tb, EPS)?;
                let g = layer_norm_backward(&mut rec, &tx, &tw, &f, &tdy, tadd.as_ref())?;
                (f, g)
            } else {
                let f = rms_norm(&mut rec, &tx, &tw, EPS, one_plus)?;
                let g = rms_norm_backward(&mut rec, &tx, &tw, &f, &tdy, one_plus, tadd.as_ref())?;
                (f, g)
            };
            rec.submit()?;
            let db = match &g.db {
                Some(t) => t.to_vec_f32(gpu).await?,
                None => vec![],
            };
            Ok(vec![
                f.y.to_vec_f32(gpu).await?,
                f.rstd.to_vec_f32(gpu).await?,
                g.dx.to_vec_f32(gpu).await?,
                g.dw.to_vec_f32(gpu).await?,
                db,
            ])
        })
        .await;
        let (fwd, bwd) = match r {
            Err(e) => (Err(e.clone()), Err(e)),
            Ok(got) => {
                let (xd, wd, bd, dyd) = (widen(&x), widen(&w), widen(&b), widen(&dy));
                let bias = (kind == L).then_some(&bd[..]);
                let (y, mean, rstd) = cpu::norm(&xd, &wd, bias, d, EPS as f64, kind);
                let (mut dx, dw, db) = cpu::norm_backward(&xd, &wd, &dyd, d, EPS as f64, kind);
                let addd = add.as_deref().map(widen);
                if let Some(a) = &addd {
                    dx.iter_mut().zip(a).for_each(|(v, a)| *v += a);
                }
                let tol = Tolerance::sum(d.max(rows));
                // Rounding of x - mean grows with |mean| * rstd.
                let cond = |r: usize| 1.0 + mean[r].abs() * rstd[r];
                let xhat = |k: usize| (xd[k] - mean[k / d]) * rstd[k / d];
                let wv = |c: usize| if one_plus { 1.0 + wd[c] } else { wd[c] }.abs();
                let y_scale: Vec<f64> = (0..len)
                    .map(|k| {
                        (xhat(k).abs() + cond(k / d)) * wv(k % d)
                            + bias.map_or(0.0, |b| b[k % d].abs())
                    })
                    .collect();
                let mut ga = vec![0.0; rows];
                let mut gb = vec![0.0; rows];
                for k in 0..len {
                    let g = (dyd[k] * wv(k % d)).abs();
                    ga[k / d] += g / d as f64;
                    gb[k / d] += g * (xhat(k).abs() + cond(k / d)) / d as f64;
                }
                let dx_scale: Vec<f64> = (0..len)
                    .map(|k| {
                        rstd[k / d]
                            * ((dyd[k] * wv(k % d)).abs()
                                + ga[k / d]
                                + (xhat(k).abs() + cond(k / d)) * gb[k / d])
                            + addd.as_ref().map_or(0.0, |a| a[k].abs())
                    })
                    .collect();
                let mut dw_scale = vec![0.0; d];
                let mut db_scale = vec![0.0; d];
                for k in 0..len {
                    dw_scale[k % d] += dyd[k].abs() * (xhat(k).abs() + cond(k / d));
                    db_scale[k % d] += dyd[k].abs();
                }
                let rstd_scale: Vec<f64> = (0..rows).map(|r| rstd[r] * cond(r)).collect();
                let fwd = (|| {
                    let st = compare(name, &got[0], &y, Some(&y_scale), tol).map_err(s)?;
                    compare(
                        &format!("{name} rstd"),
                        &got[1],
                        &rstd,
                        Some(&rstd_scale),
                        tol,
                    )
                    .map_err(s)?;
                    Ok(st)
                })();
                let bwd = (|| {
                    let st = compare(&format!("{name} dx"), &got[2], &dx, Some(&dx_scale), tol)
                        .map_err(s)?;
                    compare(&format!("{name} dw"), &got[3], &dw, Some(&dw_scale), tol)
                        .map_err(s)?;
                    if kind == L {
                        compare(&format!("{name} db"), &got[4], &db, Some(&db_scale), tol)
                            .map_err(s)?;
                    }
                    Ok(st)
                })();
                (fwd, bwd)
            }
        };
        push(out, name, what.clone(), fwd);
        push(out, &format!("{name} backward"), what, bwd);
    }
}

async fn head_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (i, &(t, hq, hkv, d, one_plus)) in HEAD_CASES.iter().enumerate() {
        let width = (hq + 2 * hkv) * d;
        let mut rng = Rng::new(1190 + i as u64);
        let x: Vec<f32> = rng.vec(t * width).iter().map(|v| 2.0 * v).collect();
        let w: Vec<f32> = rng.vec(2 * d).iter().map(|v| 1.0 + 0.5 * v).collect();
        let r = twice("rms_norm_heads", async || {
            let tx = Tensor::from_f32(gpu, &[t, width], &x, "qkv")?;
            let tw = Tensor::from_f32(gpu, &[2, d], &w, "w")?;
            let mut rec = gpu.recorder("rms_norm_heads");
            rms_norm_heads(&mut rec, &tx, &tw, hq, hkv, EPS, one_plus)?;
            rec.submit()?;
            Ok(vec![tx.to_vec_f32(gpu).await?])
        })
        .await;
        let kind = NormKind::Rms { one_plus };
        let result = r.and_then(|got| {
            // q and k heads normed with their weight; v exactly as it was.
            let mut want = widen(&x);
            let mut scale: Vec<f64> = want.iter().map(|v| v.abs()).collect();
            for tok in 0..t {
                for h in 0..hq + hkv {
                    let at = tok * width + h * d;
                    let wh = widen(&w[(h >= hq) as usize * d..][..d]);
                    let (y, _, rstd) = cpu::norm(&want[at..at + d], &wh, None, d, EPS as f64, kind);
                    for c in 0..d {
                        let wc = if one_plus { 1.0 + wh[c] } else { wh[c] };
                        scale[at + c] = (want[at + c].abs() * rstd[0] + 1.0) * wc.abs();
                    }
                    want[at..at + d].copy_from_slice(&y);
                }
            }
            compare(
                "rms_norm_heads",
                &got[0],
                &want,
                Some(&scale),
                Tolerance::sum(d),
            )
            .map_err(s)
        });
        let what = format!(
            "T{t} Hq{hq} Hkv{hkv} D{d}{}",
            if one_plus { " (1 + w)" } else { "" }
        );
        push(out, "rms_norm_heads", what, result);
    }
}
