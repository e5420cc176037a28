//! RoPE in f64, angles computed directly.

use crate::ops::rope::Pairing;

/// x (rows, T, H, Dh) flattened; `sign` -1 turns backwards (the backward pass).
pub fn rope(
    x: &[f64],
    t: usize,
    h: usize,
    dh: usize,
    offset: usize,
    theta: f64,
    pairing: Pairing,
    sign: f64,
) -> Vec<f64> {
    let mut y = x.to_vec();
    let half = dh / 2;
    for (head, chunk) in x.chunks(dh).enumerate() {
        let pos = (head / h) % t + offset;
        for k in 0..half {
            let angle = sign * pos as f64 * theta.powf(-2.0 * k as f64 / dh as f64);
            let (i, j) = match pairing {
                Pairing::Interleaved => (2 * k, 2 * k + 1),
                Pairing::Half => (k, k + half),
            };
            let (a, b) = (chunk[i], chunk[j]);
            y[head * dh + i] = a * angle.cos() - b * angle.sin();
            y[head * dh + j] = a * angle.sin() + b * angle.cos();
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{assert_close, finite_diff};

    #[test]
    fn backward_matches_finite_differences() {
        let (t, h, dh) = (3, 2, 6);
        let x: Vec<f64> = (0..2 * t * h * dh)
            .map(|i| ((i * 7 % 13) as f64 - 6.0) * 0.2)
            .collect();
        let g: Vec<f64> = (0..x.len())
            .map(|i| ((i * 5 % 11) as f64 - 5.0) * 0.3)
            .collect();
        for pairing in [Pairing::Interleaved, Pairing::Half] {
            let fd = finite_diff(
                |x| {
                    rope(x, t, h, dh, 4, 10000.0, pairing, 1.0)
                        .iter()
                        .zip(&g)
                        .map(|(a, b)| a * b)
                        .sum()
                },
                &x,
            );
            assert_close(
                "rope backward vs finite differences",
                &rope(&g, t, h, dh, 4, 10000.0, pairing, -1.0),
                &fd,
                1e-8,
            );
        }
    }
}
