//! LayerNorm and RMSNorm over the last axis in f64, two-pass statistics.

use crate::ops::norm::NormKind;

/// (y, mean (R), rstd (R)) for x (R, D).
pub fn norm(
    x: &[f64],
    w: &[f64],
    b: Option<&[f64]>,
    d: usize,
    eps: f64,
    kind: NormKind,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let rows = x.len() / d;
    let (mut y, mut mean, mut rstd) = (vec![0.0; x.len()], vec![0.0; rows], vec![0.0; rows]);
    for r in 0..rows {
        let row = &x[r * d..(r + 1) * d];
        let (mu, var) = match kind {
            NormKind::Layer => {
                let mu = row.iter().sum::<f64>() / d as f64;
                (
                    mu,
                    row.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / d as f64,
                )
            }
            NormKind::Rms { .. } => (0.0, row.iter().map(|v| v * v).sum::<f64>() / d as f64),
        };
        let rs = 1.0 / (var + eps).sqrt();
        mean[r] = mu;
        rstd[r] = rs;
        for c in 0..d {
            let wc = if kind == (NormKind::Rms { one_plus: true }) {
                1.0 + w[c]
            } else {
                w[c]
            };
            y[r * d + c] = (row[c] - mu) * rs * wc + b.map_or(0.0, |b| b[c]);
        }
    }
    (y, mean, rstd)
}

/// (dx, dw, db)
pub fn norm_backward(
    x: &[f64],
    w: &[f64],
    dy: &[f64],
    d: usize,
    eps: f64,
    kind: NormKind,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (_, mean, rstd) = norm(x, w, None, d, eps, kind);
    let rows = x.len() / d;
    let (mut dx, mut dw, mut db) = (vec![0.0; x.len()], vec![0.0; d], vec![0.0; d]);
    for r in 0..rows {
        let xhat: Vec<f64> = (0..d).map(|c| (x[r * d + c] - mean[r]) * rstd[r]).collect();
        let g: Vec<f64> = (0..d)
            .map(|c| {
                dy[r * d + c]
                    * if kind == (NormKind::Rms { one_plus: true }) {
                        1.0 + w[c]
                    } else {
                        w[c]
                    }
            })
            .collect();
        let mg = g.iter().sum::<f64>() / d as f64;
        let mgx = g.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / d as f64;
        for c in 0..d {
            let centre = if kind == NormKind::Layer { mg } else { 0.0 };
            dx[r * d + c] = rstd[r] * (g[c] - centre - xhat[c] * mgx);
            dw[c] += dy[r * d + c] * xhat[c];
            db[c] += dy[r * d + c];
        }
    }
    (dx, dw, db)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{assert_close, finite_diff};

    #[test]
    fn backward_matches_finite_differences() {
        let d = 5;
        let x: Vec<f64> = (0..3 * d)
            .map(|i| ((i * 7 % 11) as f64 - 5.0) * 0.3)
            .collect();
        let w: Vec<f64> = (0..d).map(|i| 0.5 + i as f64 * 0.2).collect();
        let b: Vec<f64> = (0..d).map(|i| i as f64 * 0.1 - 0.2).collect();
        let g: Vec<f64> = (0..3 * d)
            .map(|i| ((i * 3 % 7) as f64 - 3.0) * 0.4)
            .collect();
        for kind in [
            NormKind::Layer,
            NormKind::Rms { one_plus: false },
            NormKind::Rms { one_plus: true },
        ] {
            let bias = (kind == NormKind::Layer).then_some(&b[..]);
            let loss = |x: &[f64], w: &[f64], b: Option<&[f64]>| {
                norm(x, w, b, d, 1e-5, kind)
                    .0
                    .iter()
                    .zip(&g)
                    .map(|(a, c)| a * c)
                    .sum::<f64>()
            };
            let (dx, dw, db) = norm_backward(&x, &w, &g, d, 1e-5, kind);
            assert_close(
                "norm dx vs finite differences",
                &dx,
                &finite_diff(|x| loss(x, &w, bias), &x),
                1e-6,
            );
            assert_close(
                "norm dw",
                &dw,
                &finite_diff(|w| loss(&x, w, bias), &w),
                1e-6,
            );
            if kind == NormKind::Layer {
                assert_close(
                    "norm db",
                    &db,
                    &finite_diff(|b| loss(&x, &w, Some(b)), &b),
                    1e-6,
                );
            }
        }
    }
}
