//! Softmax over the last axis in f64.

pub fn softmax(x: &[f64], d: usize) -> Vec<f64> {
    x.chunks(d)
        .flat_map(|row| {
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let s: f64 = row.iter().map(|v| (v - m).exp()).sum();
            row.iter().map(move |v| (v - m).exp() / s)
        })
        .collect()
}

/// dx = y * (dy - sum(dy * y)) per row.
pub fn softmax_backward(y: &[f64], dy: &[f64], d: usize) -> Vec<f64> {
    y.chunks(d)
        .zip(dy.chunks(d))
        .flat_map(|(yr, gr)| {
            let dot: f64 = yr.iter().zip(gr).map(|(a, b)| a * b).sum();
            yr.iter().zip(gr).map(move |(a, b)| a * (b - dot))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{assert_close, finite_diff};

    #[test]
    fn backward_matches_finite_differences() {
        let d = 6;
        let x: Vec<f64> = (0..2 * d)
            .map(|i| ((i * 5 % 7) as f64 - 3.0) * 0.8)
            .collect();
        let g: Vec<f64> = (0..2 * d)
            .map(|i| ((i * 3 % 5) as f64 - 2.0) * 0.5)
            .collect();
        let fd = finite_diff(
            |x| softmax(x, d).iter().zip(&g).map(|(a, b)| a * b).sum(),
            &x,
        );
        assert_close(
            "softmax backward vs finite differences",
            &softmax_backward(&softmax(&x, d), &g, d),
            &fd,
            1e-8,
        );
    }
}
