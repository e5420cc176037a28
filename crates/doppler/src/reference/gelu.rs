//! GELU in f64 (libm's erf), PyTorch's two variants.

use crate::ops::gelu::GeluMode;

const C: f64 = 0.044715;

fn k() -> f64 {
    (2.0 / std::f64::consts::PI).sqrt()
}

pub fn gelu(x: &[f64], mode: GeluMode) -> Vec<f64> {
    x.iter()
        .map(|&v| match mode {
            GeluMode::Exact => 0.5 * v * (1.0 + libm::erf(v / std::f64::consts::SQRT_2)),
            GeluMode::Tanh => 0.5 * v * (1.0 + (k() * (v + C * v * v * v)).tanh()),
        })
        .collect()
}

/// dx = dy * gelu'(x)
pub fn gelu_backward(x: &[f64], dy: &[f64], mode: GeluMode) -> Vec<f64> {
    x.iter()
        .zip(dy)
        .map(|(&v, &g)| {
            let d = match mode {
                GeluMode::Exact => {
                    let cdf = 0.5 * (1.0 + libm::erf(v / std::f64::consts::SQRT_2));
                    cdf + v * (-0.5 * v * v).exp() / (2.0 * std::f64::consts::PI).sqrt()
                }
                GeluMode::Tanh => {
                    let t = (k() * (v + C * v * v * v)).tanh();
                    0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * k() * (1.0 + 3.0 * C * v * v)
                }
            };
            g * d
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{assert_close, finite_diff};

    #[test]
    fn backward_matches_finite_differences() {
        let x: Vec<f64> = (0..23).map(|i| -5.5 + i as f64 * 0.5).collect();
        let g: Vec<f64> = (0..23).map(|i| 0.3 + (i % 5) as f64 * 0.2).collect();
        for mode in [GeluMode::Exact, GeluMode::Tanh] {
            let fd = finite_diff(
                |x| gelu(x, mode).iter().zip(&g).map(|(y, g)| y * g).sum(),
                &x,
            );
            assert_close(
                "gelu backward vs finite differences",
                &gelu_backward(&x, &g, mode),
                &fd,
                1e-7,
            );
        }
    }

    #[test]
    fn known_values() {
        // PyTorch: gelu(1.0) = 0.8413447, gelu(1.0, 'tanh') = 0.8411920
        assert!((gelu(&[1.0], GeluMode::Exact)[0] - 0.841_344_746).abs() < 1e-8);
        assert!((gelu(&[1.0], GeluMode::Tanh)[0] - 0.841_191_990).abs() < 1e-8);
    }
}
