//! conv2d forward and backward (dx, dw, db).

use super::{push, s, twice, CheckResult};
use crate::check::{compare, Rng, Tolerance};
use crate::gpu::{Gpu, Tensor};
use crate::ops::conv2d::{conv2d_backward_on, conv2d_on, conv_params, Conv2dOpts, ConvPath};
use crate::reference::{conv2d as cpu, widen};

type Case = (&'static [usize], &'static [usize], Conv2dOpts, bool);

const fn opts(
    stride: (usize, usize),
    padding: (usize, usize),
    dilation: (usize, usize),
    groups: usize,
) -> Conv2dOpts {
    Conv2dOpts {
        stride,
        padding,
        dilation,
        groups,
    }
}

/// (x, w, options, bias): 3x3 with a batch and odd sizes; stride, padding and dilation per
/// axis with groups; depthwise; 1x1; channels spanning several 64-tiles; stride 1 with
/// dilation and groups (dx as a forward convolution with flipped weights); strided 4x4 and
/// 5x3 kernels (dx by residue classes), a strided 1x1 (a class without taps: the dx
/// gather); two groups of 32
/// output channels, strided (the cooperative kernel's partial tiles in every mode); and a
/// 1x1 on 2 x 1450 x 1450 pixels (more than 65535 tiles, and a dw reduction of 8213
/// splits).
pub const CONV_CASES: [Case; 11] = [
    (
        &[2, 3, 7, 9],
        &[8, 3, 3, 3],
        opts((1, 1), (1, 1), (1, 1), 1),
        true,
    ),
    (
        &[3, 4, 11, 10],
        &[6, 2, 3, 2],
        opts((2, 1), (1, 2), (1, 2), 2),
        true,
    ),
    (
        &[2, 8, 9, 9],
        &[8, 1, 3, 3],
        opts((2, 2), (1, 1), (1, 1), 8),
        false,
    ),
    (
        &[1, 5, 6, 7],
        &[3, 5, 1, 1],
        opts((1, 1), (0, 0), (1, 1), 1),
        false,
    ),
    (
        &[2, 70, 5, 5],
        &[130, 70, 3, 3],
        opts((1, 1), (1, 1), (1, 1), 1),
        true,
    ),
    (
        &[2, 6, 10, 9],
        &[4, 3, 3, 2],
        opts((1, 1), (2, 1), (2, 1), 2),
        true,
    ),
    (
        &[2, 3, 9, 10],
        &[4, 3, 4, 4],
        opts((2, 2), (1, 1), (1, 1), 1),
        false,
    ),
    (
        &[1, 4, 11, 13],
        &[5, 4, 5, 3],
        opts((3, 2), (2, 1), (1, 1), 1),
        true,
    ),
    (
        &[2, 5, 7, 8],
        &[6, 5, 1, 1],
        opts((2, 2), (0, 0), (1, 1), 1),
        false,
    ),
    (
        &[3, 48, 9, 17],
        &[64, 24, 3, 3],
        opts((2, 2), (1, 1), (1, 1), 2),
        true,
    ),
    (
        &[2, 1, 1450, 1450],
        &[1, 1, 1, 1],
        opts((1, 1), (0, 0), (1, 1), 1),
        true,
    ),
];

/// Every case on the f32 kernel, and on cooperative matrices where the adapter has them.
pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    check_path(gpu, ConvPath::F32, out).await;
    if gpu.coop_matmul_possible() {
        check_path(gpu, ConvPath::Coop, out).await;
    }
}

async fn check_path(gpu: &Gpu, path: ConvPath, out: &mut Vec<CheckResult>) {
    let coop = path == ConvPath::Coop;
    for (i, &(xs, ws, o, has_bias)) in CONV_CASES.iter().enumerate() {
        let p = conv_params(xs, ws, &o).expect("valid case");
        let ys = [p.n as usize, p.cout as usize, p.oh as usize, p.ow as usize];
        let mut rng = Rng::new(1000 + i as u64);
        let x = rng.vec(xs.iter().product());
        let w = rng.vec(ws.iter().product());
        let b = rng.vec(ws[0]);
        let dy = rng.vec(ys.iter().product());
        let what = format!(
            "x {xs:?} w {ws:?} s{:?} p{:?} d{:?} g{}{}",
            o.stride,
            o.padding,
            o.dilation,
            o.groups,
            if has_bias { " +b" } else { "" }
        );
        let run = async || -> crate::Result<Vec<Vec<f32>>> {
            let tx = Tensor::from_f32(gpu, xs, &x, "x")?;
            let tw = Tensor::from_f32(gpu, ws, &w, "w")?;
            let tb = Tensor::from_f32(gpu, &[ws[0]], &b, "b")?;
            let tdy = Tensor::from_f32(gpu, &ys, &dy, "dy")?;
            let mut rec = gpu.recorder("conv2d");
            let y = conv2d_on(&mut rec, &tx, &tw, has_bias.then_some(&tb), o, path)?;
            let gr = conv2d_backward_on(&mut rec, &tx, &tw, &tdy, o, has_bias, path)?;
            rec.submit()?;
            let db = match &gr.db {
                Some(db) => db.to_vec_f32(gpu).await?,
                None => vec![],
            };
            Ok(vec![
                y.to_vec_f32(gpu).await?,
                gr.dx.to_vec_f32(gpu).await?,
                gr.dw.to_vec_f32(gpu).await?,
                db,
            ])
        };
        // The largest case is slow on a CPU adapter; the smaller ones check determinism.
        let r = if i + 1 == CONV_CASES.len() {
            run().await.map_err(s)
        } else {
            twice("conv2d", run).await
        };
        let (fwd, bwd) = match r {
            Err(e) => (Err(e.clone()), Err(e)),
            Ok(got) => {
                let (xd, wd, bd, dyd) = (widen(&x), widen(&w), widen(&b), widen(&dy));
                let y = cpu::conv2d(&xd, &wd, has_bias.then_some(&bd[..]), &p);
                let (dx, dw, db) = cpu::conv2d_backward(&xd, &wd, &dyd, &p);
                let (my, mdx, mdw) = cpu::magnitudes(&xd, &wd, &dyd, &p);
                let my: Vec<f64> = my
                    .iter()
                    .enumerate()
                    .map(|(k, v)| {
                        v + if has_bias {
                            bd[k / (ys[2] * ys[3]) % ys[1]].abs()
                        } else {
                            0.0
                        }
                    })
                    .collect();
                let cig = xs[1] / o.groups;
                let k_fwd = cig * ws[2] * ws[3];
                let k_dx = (ws[0] / o.groups) * ws[2] * ws[3];
                let k_dw = ys[0] * ys[2] * ys[3];
                // f16 operands: each product within 2 x 2^-11 of its magnitude, f32 sums
                // (as matmul's f16 mode).
                let tol = |k| match coop {
                    true => Tolerance {
                        abs: 1e-30,
                        rel: 1.5e-3,
                    },
                    false => Tolerance::dot(k),
                };
                let fwd = compare("conv2d y", &got[0], &y, Some(&my), tol(k_fwd)).map_err(s);
                let bwd = (|| {
                    let st =
                        compare("conv2d dx", &got[1], &dx, Some(&mdx), tol(k_dx)).map_err(s)?;
                    compare("conv2d dw", &got[2], &dw, Some(&mdw), tol(k_dw)).map_err(s)?;
                    if has_bias {
                        let mdb: Vec<f64> = (0..ys[1])
                            .map(|c| {
                                (0..dy.len())
                                    .filter(|k| k / (ys[2] * ys[3]) % ys[1] == c)
                                    .map(|k| dyd[k].abs())
                                    .sum()
                            })
                            .collect();
                        compare("conv2d db", &got[3], &db, Some(&mdb), Tolerance::sum(k_dw))
                            .map_err(s)?;
                    }
                    Ok(st)
                })();
                (fwd, bwd)
            }
        };
        let (f, b) = match coop {
            true => (
                "conv2d (cooperative, f16 operands)",
                "conv2d backward (cooperative, f16 operands)",
            ),
            false => ("conv2d", "conv2d backward"),
        };
        push(out, f, what.clone(), fwd);
        push(out, b, what, bwd);
    }
}
