//! Bias add in f64: x (R, N) + b (N).

pub fn bias_add(x: &[f64], b: &[f64]) -> Vec<f64> {
    x.iter()
        .enumerate()
        .map(|(i, v)| v + b[i % b.len()])
        .collect()
}

/// db = column sums of dy.
pub fn bias_add_backward(dy: &[f64], n: usize) -> Vec<f64> {
    let mut db = vec![0.0; n];
    for (i, v) in dy.iter().enumerate() {
        db[i % n] += v;
    }
    db
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{assert_close, finite_diff};

    #[test]
    fn backward_matches_finite_differences() {
        let x: Vec<f64> = (0..15).map(|i| i as f64 * 0.3 - 2.0).collect();
        let g: Vec<f64> = (0..15).map(|i| ((i * 7 % 5) as f64 - 2.0) * 0.5).collect();
        let b = vec![0.5, -1.0, 2.0, 0.25, 1.5];
        let fd = finite_diff(
            |b| bias_add(&x, b).iter().zip(&g).map(|(a, c)| a * c).sum(),
            &b,
        );
        assert_close(
            "bias_add backward vs finite differences",
            &bias_add_backward(&g, 5),
            &fd,
            1e-8,
        );
    }
}
