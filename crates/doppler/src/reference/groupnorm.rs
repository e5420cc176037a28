//! GroupNorm in f64, two-pass statistics. x is (N, C, S).

pub struct Dims {
    pub n: usize,
    pub c: usize,
    pub s: usize,
    pub g: usize,
}

/// (y, mean (N, G), rstd (N, G))
pub fn group_norm(
    x: &[f64],
    gamma: &[f64],
    beta: &[f64],
    d: &Dims,
    eps: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let cpg = d.c / d.g;
    let m = cpg * d.s;
    let mut y = vec![0.0; x.len()];
    let (mut mean, mut rstd) = (vec![0.0; d.n * d.g], vec![0.0; d.n * d.g]);
    for n in 0..d.n {
        for g in 0..d.g {
            let lo = (n * d.c + g * cpg) * d.s;
            let grp = &x[lo..lo + m];
            let mu = grp.iter().sum::<f64>() / m as f64;
            let var = grp.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / m as f64;
            let r = 1.0 / (var + eps).sqrt();
            mean[n * d.g + g] = mu;
            rstd[n * d.g + g] = r;
            for k in 0..m {
                let c = g * cpg + k / d.s;
                y[lo + k] = (grp[k] - mu) * r * gamma[c] + beta[c];
            }
        }
    }
    (y, mean, rstd)
}

/// (dx, dgamma, dbeta)
pub fn group_norm_backward(
    x: &[f64],
    gamma: &[f64],
    dy: &[f64],
    d: &Dims,
    eps: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (_, mean, rstd) = group_norm(x, gamma, &vec![0.0; d.c], d, eps);
    let cpg = d.c / d.g;
    let m = cpg * d.s;
    let mut dx = vec![0.0; x.len()];
    let (mut dgamma, mut dbeta) = (vec![0.0; d.c], vec![0.0; d.c]);
    for n in 0..d.n {
        for g in 0..d.g {
            let (mu, r) = (mean[n * d.g + g], rstd[n * d.g + g]);
            let lo = (n * d.c + g * cpg) * d.s;
            let (mut a, mut b) = (0.0, 0.0);
            for k in 0..m {
                let c = g * cpg + k / d.s;
                let xhat = (x[lo + k] - mu) * r;
                a += dy[lo + k] * gamma[c];
                b += dy[lo + k] * gamma[c] * xhat;
                dgamma[c] += dy[lo + k] * xhat;
                dbeta[c] += dy[lo + k];
            }
            let (a, b) = (a / m as f64, b / m as f64);
            for k in 0..m {
                let c = g * cpg + k / d.s;
                let xhat = (x[lo + k] - mu) * r;
                dx[lo + k] = r * (dy[lo + k] * gamma[c] - a - xhat * b);
            }
        }
    }
    (dx, dgamma, dbeta)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{assert_close, finite_diff};

    #[test]
    fn backward_matches_finite_differences() {
        let d = Dims {
            n: 2,
            c: 4,
            s: 3,
            g: 2,
        };
        let len = d.n * d.c * d.s;
        let x: Vec<f64> = (0..len)
            .map(|i| ((i * 7 % 13) as f64 - 6.0) * 0.3)
            .collect();
        let gamma = [0.5, -1.0, 2.0, 1.5];
        let beta = [0.1, 0.2, -0.3, 0.0];
        let g: Vec<f64> = (0..len)
            .map(|i| ((i * 5 % 11) as f64 - 5.0) * 0.2)
            .collect();
        let eps = 1e-5;
        let loss = |x: &[f64], gm: &[f64], bt: &[f64]| {
            group_norm(x, gm, bt, &d, eps)
                .0
                .iter()
                .zip(&g)
                .map(|(a, b)| a * b)
                .sum::<f64>()
        };
        let (dx, dgamma, dbeta) = group_norm_backward(&x, &gamma, &g, &d, eps);
        assert_close(
            "groupnorm dx vs finite differences",
            &dx,
            &finite_diff(|x| loss(x, &gamma, &beta), &x),
            1e-6,
        );
        assert_close(
            "groupnorm dgamma",
            &dgamma,
            &finite_diff(|gm| loss(&x, gm, &beta), &gamma),
            1e-6,
        );
        assert_close(
            "groupnorm dbeta",
            &dbeta,
            &finite_diff(|bt| loss(&x, &gamma, bt), &beta),
            1e-6,
        );
    }
}
