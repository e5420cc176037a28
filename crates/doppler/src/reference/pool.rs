//! Average pooling in f64: x (NC, H, W), windows kh x kw, stride (sh, sw), no padding.

pub fn avg_pool2d(
    x: &[f64],
    [h, w]: [usize; 2],
    [kh, kw]: [usize; 2],
    [sh, sw]: [usize; 2],
) -> Vec<f64> {
    let (oh, ow) = ((h - kh) / sh + 1, (w - kw) / sw + 1);
    let nc = x.len() / (h * w);
    let mut y = vec![0.0; nc * oh * ow];
    for p in 0..nc {
        for oy in 0..oh {
            for ox in 0..ow {
                let mut s = 0.0;
                for i in 0..kh {
                    for j in 0..kw {
                        s += x[(p * h + oy * sh + i) * w + ox * sw + j];
                    }
                }
                y[(p * oh + oy) * ow + ox] = s / (kh * kw) as f64;
            }
        }
    }
    y
}

pub fn avg_pool2d_backward(
    dy: &[f64],
    [h, w]: [usize; 2],
    [kh, kw]: [usize; 2],
    [sh, sw]: [usize; 2],
) -> Vec<f64> {
    let (oh, ow) = ((h - kh) / sh + 1, (w - kw) / sw + 1);
    let nc = dy.len() / (oh * ow);
    let mut dx = vec![0.0; nc * h * w];
    for p in 0..nc {
        for oy in 0..oh {
            for ox in 0..ow {
                let g = dy[(p * oh + oy) * ow + ox] / (kh * kw) as f64;
                for i in 0..kh {
                    for j in 0..kw {
                        dx[(p * h + oy * sh + i) * w + ox * sw + j] += g;
                    }
                }
            }
        }
    }
    dx
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{assert_close, finite_diff};

    #[test]
    fn backward_matches_finite_differences() {
        // Overlapping windows (stride < kernel), leftover rows and columns, 2 images.
        let (hw, k, s) = ([7, 6], [3, 2], [2, 3]);
        let x: Vec<f64> = (0..2 * 7 * 6)
            .map(|i| ((i * 37 % 23) as f64 - 11.0) / 7.0)
            .collect();
        let y = avg_pool2d(&x, hw, k, s);
        let dy: Vec<f64> = (0..y.len())
            .map(|i| ((i * 13 % 11) as f64 - 5.0) / 3.0)
            .collect();
        let f = |x: &[f64]| {
            avg_pool2d(x, hw, k, s)
                .iter()
                .zip(&dy)
                .map(|(a, b)| a * b)
                .sum()
        };
        assert_close(
            "avg_pool2d dx",
            &avg_pool2d_backward(&dy, hw, k, s),
            &finite_diff(f, &x),
            1e-7,
        );
    }
}
