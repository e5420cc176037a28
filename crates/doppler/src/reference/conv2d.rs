//! 2-D convolution in f64, direct loops over every tap.

use crate::ops::conv2d::Params;

fn taps(
    p: &Params,
) -> impl Iterator<
    Item = (
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
    ),
> + '_ {
    // (n, g, co_in_g, oy, ox, ci_in_g, ky, kx) with the input pixel folded in as (iy, ix) below.
    let (cig, cog) = ((p.cin / p.groups) as usize, (p.cout / p.groups) as usize);
    (0..p.n as usize).flat_map(move |n| {
        (0..p.groups as usize).flat_map(move |g| {
            (0..cog).flat_map(move |co| {
                (0..p.oh as usize).flat_map(move |oy| {
                    (0..p.ow as usize).flat_map(move |ox| {
                        (0..cig).flat_map(move |ci| {
                            (0..p.kh as usize).flat_map(move |ky| {
                                (0..p.kw as usize)
                                    .map(move |kx| (n, g, co, oy, ox, ci, ky, kx, cig))
                            })
                        })
                    })
                })
            })
        })
    })
}

/// For a tap, the (x index, w index, y index), or None when it falls in the padding.
fn tap_index(
    p: &Params,
    t: (
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
    ),
) -> Option<(usize, usize, usize)> {
    let (n, g, co, oy, ox, ci, ky, kx, cig) = t;
    let cog = (p.cout / p.groups) as usize;
    let iy = (oy * p.sh as usize + ky * p.dh as usize) as isize - p.ph as isize;
    let ix = (ox * p.sw as usize + kx * p.dw as usize) as isize - p.pw as isize;
    if iy < 0 || ix < 0 || iy >= p.h as isize || ix >= p.w as isize {
        return None;
    }
    let (h, w, oh, ow) = (p.h as usize, p.w as usize, p.oh as usize, p.ow as usize);
    let cin = p.cin as usize;
    let cout = p.cout as usize;
    let (kh, kw) = (p.kh as usize, p.kw as usize);
    let xi = ((n * cin + g * cig + ci) * h + iy as usize) * w + ix as usize;
    let wi = (((g * cog + co) * cig + ci) * kh + ky) * kw + kx;
    let yi = ((n * cout + g * cog + co) * oh + oy) * ow + ox;
    Some((xi, wi, yi))
}

pub fn conv2d(x: &[f64], w: &[f64], bias: Option<&[f64]>, p: &Params) -> Vec<f64> {
    let (oh, ow, cout) = (p.oh as usize, p.ow as usize, p.cout as usize);
    let mut y = vec![0.0; p.n as usize * cout * oh * ow];
    for t in taps(p) {
        if let Some((xi, wi, yi)) = tap_index(p, t) {
            y[yi] += x[xi] * w[wi];
        }
    }
    if let Some(b) = bias {
        for (i, v) in y.iter_mut().enumerate() {
            *v += b[i / (oh * ow) % cout];
        }
    }
    y
}

/// (dx, dw, db)
pub fn conv2d_backward(
    x: &[f64],
    w: &[f64],
    dy: &[f64],
    p: &Params,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut dx, mut dw) = (vec![0.0; x.len()], vec![0.0; w.len()]);
    for t in taps(p) {
        if let Some((xi, wi, yi)) = tap_index(p, t) {
            dx[xi] += dy[yi] * w[wi];
            dw[wi] += dy[yi] * x[xi];
        }
    }
    let (ohw, cout) = ((p.oh * p.ow) as usize, p.cout as usize);
    let mut db = vec![0.0; cout];
    for (i, v) in dy.iter().enumerate() {
        db[i / ohw % cout] += v;
    }
    (dx, dw, db)
}

/// Sums of |terms| per output element of the forward, dx and dw (error scales for tests).
pub fn magnitudes(x: &[f64], w: &[f64], dy: &[f64], p: &Params) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let ax: Vec<f64> = x.iter().map(|v| v.abs()).collect();
    let aw: Vec<f64> = w.iter().map(|v| v.abs()).collect();
    let ady: Vec<f64> = dy.iter().map(|v| v.abs()).collect();
    let y = conv2d(&ax, &aw, None, p);
    let (dx, dw, _) = conv2d_backward(&ax, &aw, &ady, p);
    (y, dx, dw)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::conv2d::{conv_params, Conv2dOpts};
    use crate::reference::{assert_close, finite_diff};

    #[test]
    fn backward_matches_finite_differences() {
        let o = Conv2dOpts {
            stride: (2, 1),
            padding: (1, 2),
            dilation: (1, 2),
            groups: 2,
        };
        let (xs, ws) = ([2, 4, 5, 6], [6, 2, 3, 2]);
        let p = conv_params(&xs, &ws, &o).unwrap();
        let x: Vec<f64> = (0..xs.iter().product())
            .map(|i: usize| ((i * 7 % 13) as f64 - 6.0) * 0.1)
            .collect();
        let w: Vec<f64> = (0..ws.iter().product())
            .map(|i: usize| ((i * 5 % 11) as f64 - 5.0) * 0.1)
            .collect();
        let b = [0.1, -0.2, 0.3, 0.0, 0.5, -0.1];
        let ny = conv2d(&x, &w, Some(&b), &p).len();
        let g: Vec<f64> = (0..ny).map(|i| ((i * 3 % 7) as f64 - 3.0) * 0.5).collect();
        let loss = |x: &[f64], w: &[f64], b: &[f64]| {
            conv2d(x, w, Some(b), &p)
                .iter()
                .zip(&g)
                .map(|(a, c)| a * c)
                .sum::<f64>()
        };
        let (dx, dw, db) = conv2d_backward(&x, &w, &g, &p);
        assert_close(
            "conv2d dx vs finite differences",
            &dx,
            &finite_diff(|x| loss(x, &w, &b), &x),
            1e-7,
        );
        assert_close(
            "conv2d dw",
            &dw,
            &finite_diff(|w| loss(&x, w, &b), &w),
            1e-7,
        );
        assert_close(
            "conv2d db",
            &db,
            &finite_diff(|b| loss(&x, &w, b), &b),
            1e-7,
        );
    }

    #[test]
    fn output_size_like_pytorch() {
        // torch.nn.Conv2d(3, 8, 3, stride=2, padding=1) on 1x3x7x9 gives 1x8x4x5
        let p = conv_params(
            &[1, 3, 7, 9],
            &[8, 3, 3, 3],
            &Conv2dOpts {
                stride: (2, 2),
                padding: (1, 1),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!((p.oh, p.ow), (4, 5));
        assert!(conv_params(&[1, 3, 2, 2], &[8, 3, 5, 5], &Conv2dOpts::default()).is_err());
        assert!(conv_params(
            &[1, 3, 8, 8],
            &[8, 2, 3, 3],
            &Conv2dOpts {
                groups: 2,
                ..Default::default()
            }
        )
        .is_err());
    }
}
