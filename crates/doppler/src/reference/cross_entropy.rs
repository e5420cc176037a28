//! Cross-entropy on logits in f64, PyTorch's semantics (mean over non-ignored tokens,
//! label smoothing as (1 - eps) NLL + eps * mean_j(-log p_j)).

/// Per-token losses (0 when ignored), per-row logsumexp, and the mean over the non-ignored
/// rows (NaN when there are none, as PyTorch), and their count.
pub fn cross_entropy(
    x: &[f64],
    y: &[u32],
    v: usize,
    ignore: Option<u32>,
    eps: f64,
) -> (Vec<f64>, Vec<f64>, f64, usize) {
    let t = y.len();
    let mut loss = vec![0.0; t];
    let mut lse = vec![0.0; t];
    let mut count = 0;
    for r in 0..t {
        let row = &x[r * v..(r + 1) * v];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        lse[r] = m + row.iter().map(|&a| (a - m).exp()).sum::<f64>().ln();
        if Some(y[r]) == ignore {
            continue;
        }
        count += 1;
        let mean_x = row.iter().sum::<f64>() / v as f64;
        loss[r] = (1.0 - eps) * (lse[r] - row[y[r] as usize]) + eps * (lse[r] - mean_x);
    }
    let mean = loss.iter().sum::<f64>() / count as f64;
    (loss, lse, mean, count)
}

/// dlogits for upstream gradients `g` of each token's loss (for the mean, pass g / count).
pub fn cross_entropy_backward(
    x: &[f64],
    y: &[u32],
    v: usize,
    ignore: Option<u32>,
    eps: f64,
    g: &[f64],
) -> Vec<f64> {
    let (_, lse, _, _) = cross_entropy(x, y, v, ignore, eps);
    let mut d = vec![0.0; x.len()];
    for r in 0..y.len() {
        if Some(y[r]) == ignore {
            continue;
        }
        for j in 0..v {
            let q = if j == y[r] as usize { 1.0 - eps } else { 0.0 } + eps / v as f64;
            d[r * v + j] = ((x[r * v + j] - lse[r]).exp() - q) * g[r];
        }
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{assert_close, finite_diff};

    #[test]
    fn backward_matches_finite_differences() {
        let (t, v) = (4, 7);
        let x: Vec<f64> = (0..t * v)
            .map(|i| ((i * 37 % 11) as f64 - 5.0) * 0.7)
            .collect();
        let y = [3, 0, 6, 2];
        let g = [0.5, -1.0, 2.0, 0.25];
        for (ignore, eps) in [(None, 0.0), (Some(6), 0.1)] {
            let f = |x: &[f64]| {
                cross_entropy(x, &y, v, ignore, eps)
                    .0
                    .iter()
                    .zip(&g)
                    .map(|(l, g)| l * g)
                    .sum()
            };
            let fd = finite_diff(f, &x);
            assert_close(
                "cross-entropy backward vs finite differences",
                &cross_entropy_backward(&x, &y, v, ignore, eps, &g),
                &fd,
                1e-7,
            );
        }
    }

    #[test]
    fn uniform_logits_give_log_v() {
        let (loss, _, mean, count) = cross_entropy(&[0.0; 8], &[1, 3], 4, None, 0.0);
        assert!(
            (loss[0] - 4f64.ln()).abs() < 1e-12 && (mean - 4f64.ln()).abs() < 1e-12 && count == 2
        );
        let (_, _, mean, count) = cross_entropy(&[0.0; 4], &[9], 4, Some(9), 0.0);
        assert!(mean.is_nan() && count == 0);
    }
}
