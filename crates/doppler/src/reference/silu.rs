//! SiLU and SwiGLU in f64.

fn sigmoid(v: f64) -> f64 {
    1.0 / (1.0 + (-v).exp())
}

pub fn silu(a: &[f64]) -> Vec<f64> {
    a.iter().map(|&v| v * sigmoid(v)).collect()
}

pub fn silu_backward(a: &[f64], dy: &[f64]) -> Vec<f64> {
    a.iter()
        .zip(dy)
        .map(|(&v, g)| g * sigmoid(v) * (1.0 + v * (1.0 - sigmoid(v))))
        .collect()
}

pub fn swiglu(a: &[f64], b: &[f64]) -> Vec<f64> {
    silu(a).iter().zip(b).map(|(s, b)| s * b).collect()
}

/// (da, db)
pub fn swiglu_backward(a: &[f64], b: &[f64], dy: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let gb: Vec<f64> = dy.iter().zip(b).map(|(g, b)| g * b).collect();
    (
        silu_backward(a, &gb),
        silu(a).iter().zip(dy).map(|(s, g)| s * g).collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{assert_close, finite_diff};

    #[test]
    fn backward_matches_finite_differences() {
        let a: Vec<f64> = (0..9).map(|i| i as f64 - 4.3).collect();
        let b: Vec<f64> = (0..9).map(|i| 0.5 - i as f64 * 0.2).collect();
        let g: Vec<f64> = (0..9).map(|i| (i % 4) as f64 - 1.5).collect();
        let dot = |y: Vec<f64>| y.iter().zip(&g).map(|(p, q)| p * q).sum::<f64>();
        assert_close(
            "silu backward",
            &silu_backward(&a, &g),
            &finite_diff(|a| dot(silu(a)), &a),
            1e-8,
        );
        let (da, db) = swiglu_backward(&a, &b, &g);
        assert_close(
            "swiglu da",
            &da,
            &finite_diff(|a| dot(swiglu(a, &b)), &a),
            1e-8,
        );
        assert_close(
            "swiglu db",
            &db,
            &finite_diff(|b| dot(swiglu(&a, b)), &b),
            1e-8,
        );
    }
}
