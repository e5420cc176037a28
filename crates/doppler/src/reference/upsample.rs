//! Pixel shuffle and nearest upsampling in f64, NCHW, written as scatters (the GPU gathers).

pub fn pixel_shuffle(x: &[f64], [n, cr, h, w]: [usize; 4], r: usize) -> Vec<f64> {
    let c = cr / (r * r);
    let mut y = vec![0.0; x.len()];
    for b in 0..n {
        for ic in 0..cr {
            let (oc, i, j) = (ic / (r * r), (ic / r) % r, ic % r);
            for hh in 0..h {
                for ww in 0..w {
                    let src = ((b * cr + ic) * h + hh) * w + ww;
                    y[((b * c + oc) * h * r + hh * r + i) * w * r + ww * r + j] = x[src];
                }
            }
        }
    }
    y
}

/// The inverse permutation.
pub fn pixel_shuffle_backward(dy: &[f64], [n, cr, h, w]: [usize; 4], r: usize) -> Vec<f64> {
    let c = cr / (r * r);
    let mut dx = vec![0.0; dy.len()];
    for b in 0..n {
        for ic in 0..cr {
            let (oc, i, j) = (ic / (r * r), (ic / r) % r, ic % r);
            for hh in 0..h {
                for ww in 0..w {
                    dx[((b * cr + ic) * h + hh) * w + ww] =
                        dy[((b * c + oc) * h * r + hh * r + i) * w * r + ww * r + j];
                }
            }
        }
    }
    dx
}

/// x (NC, H, W) -> (NC, H*sh, W*sw)
pub fn upsample_nearest2d(x: &[f64], h: usize, w: usize, sh: usize, sw: usize) -> Vec<f64> {
    let nc = x.len() / (h * w);
    let mut y = vec![0.0; x.len() * sh * sw];
    for p in 0..nc {
        for oh in 0..h * sh {
            for ow in 0..w * sw {
                y[(p * h * sh + oh) * w * sw + ow] = x[(p * h + oh / sh) * w + ow / sw];
            }
        }
    }
    y
}

pub fn upsample_nearest2d_backward(
    dy: &[f64],
    h: usize,
    w: usize,
    sh: usize,
    sw: usize,
) -> Vec<f64> {
    let nc = dy.len() / (h * w * sh * sw);
    let mut dx = vec![0.0; nc * h * w];
    for p in 0..nc {
        for oh in 0..h * sh {
            for ow in 0..w * sw {
                dx[(p * h + oh / sh) * w + ow / sw] += dy[(p * h * sh + oh) * w * sw + ow];
            }
        }
    }
    dx
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{assert_close, finite_diff};

    fn dot(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    #[test]
    fn backwards_match_finite_differences() {
        let shape = [2, 8, 2, 3];
        let x: Vec<f64> = (0..96).map(|i| ((i * 5 % 13) as f64 - 6.0) * 0.2).collect();
        let g: Vec<f64> = (0..96).map(|i| ((i * 7 % 11) as f64 - 5.0) * 0.3).collect();
        let fd = finite_diff(|x| dot(&pixel_shuffle(x, shape, 2), &g), &x);
        assert_close(
            "pixel_shuffle backward vs finite differences",
            &pixel_shuffle_backward(&g, shape, 2),
            &fd,
            1e-8,
        );
        let x = &x[..2 * 3 * 2 * 2];
        let g: Vec<f64> = (0..x.len() * 6)
            .map(|i| ((i * 7 % 11) as f64 - 5.0) * 0.3)
            .collect();
        let fd = finite_diff(|x| dot(&upsample_nearest2d(x, 2, 2, 2, 3), &g), x);
        assert_close(
            "upsample backward vs finite differences",
            &upsample_nearest2d_backward(&g, 2, 2, 2, 3),
            &fd,
            1e-8,
        );
    }
}
