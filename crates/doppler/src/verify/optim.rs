//! AdamW and SGD steps and the global-norm gradient scale against torch.optim's formulas.

use super::{push, s, twice, CheckResult};
use crate::check::{compare, Rng, Tolerance};
use crate::gpu::{Gpu, Tensor};
use crate::optim::{grad_scale_with, multi_tensor_supported, unit_scale, AdamW, Sgd};
use crate::reference::{optim as cpu, widen};

const STEPS: usize = 3;
/// Steps' roundings plus the norm's (a sum over every gradient element).
const TOL: Tolerance = Tolerance {
    abs: 1e-30,
    rel: 64.0 * f32::EPSILON as f64,
};

/// AdamW with clipping and a loss scale over two odd-sized parameters and one of 100 (the
/// vec4 kernel) for 3 steps, a tensor a dispatch and (where the adapter binds enough
/// buffers) 7 a dispatch; 11 parameters, every other one without weight decay, in two
/// multi-tensor dispatches (the second partly filled); SGD with momentum, dampening,
/// Nesterov and weight decay; AdamW on 65537 x 256 + 3 elements (a 2-D grid).
pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    let multi = multi_tensor_supported(gpu);
    let three: &[&[usize]] = &[&[37], &[3, 333], &[4, 25]];
    adamw(gpu, out, three, STEPS, Some(0.5), 4.0, false).await;
    if multi {
        adamw(gpu, out, three, STEPS, Some(0.5), 4.0, true).await;
        let eleven: &[&[usize]] = &[
            &[37],
            &[3, 333],
            &[4, 25],
            &[1],
            &[256],
            &[257],
            &[2, 4097],
            &[5],
            &[7, 9],
            &[1000],
            &[3],
        ];
        adamw(gpu, out, eleven, 2, Some(0.5), 4.0, true).await;
    }
    adamw(gpu, out, &[&[65_537 * 256 + 3]], 1, None, 1.0, multi).await;
    sgd(gpu, out).await;
}

async fn adamw(
    gpu: &Gpu,
    out: &mut Vec<CheckResult>,
    shapes: &[&[usize]],
    steps: usize,
    max_norm: Option<f32>,
    loss_scale: f32,
    multi: bool,
) {
    let sizes: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
    let mut rng = Rng::new(1500 + sizes[0] as u64);
    let init: Vec<Vec<f32>> = sizes.iter().map(|&n| rng.vec(n)).collect();
    let grads: Vec<Vec<Vec<f32>>> = (0..steps)
        .map(|_| {
            sizes
                .iter()
                .map(|&n| rng.vec(n).iter().map(|g| g * 3.0).collect())
                .collect()
        })
        .collect();
    let (lr, wd) = (1e-2f64, 0.1f64);
    // Past 3 parameters, every other one is not decayed.
    let decayed: Vec<bool> = (0..sizes.len()).map(|k| k < 3 || k % 2 == 0).collect();
    let r = twice("adamw", async || {
        let params: Vec<Tensor> = shapes
            .iter()
            .zip(&init)
            .map(|(s, v)| Tensor::from_f32(gpu, s, v, "p"))
            .collect::<crate::Result<_>>()?;
        let pr: Vec<&Tensor> = params.iter().collect();
        let mut opt = AdamW::new(gpu, &pr, lr)?;
        opt.weight_decay = wd;
        opt.multi_tensor = multi;
        opt.decay_mask = decayed.clone();
        let mut scales = Vec::new();
        for step in &grads {
            let gs: Vec<Tensor> = shapes
                .iter()
                .zip(step)
                .map(|(s, v)| Tensor::from_f32(gpu, s, v, "g"))
                .collect::<crate::Result<_>>()?;
            let gr: Vec<&Tensor> = gs.iter().collect();
            let mut rec = gpu.recorder("adamw");
            let sc = grad_scale_with(&mut rec, &gr, max_norm, loss_scale, multi)?;
            opt.step(&mut rec, &pr, &gr, &sc)?;
            rec.submit()?;
            scales.extend(sc.to_vec_f32(gpu).await?);
        }
        let mut res = vec![scales];
        for (p, (m, v)) in params.iter().zip(opt.state()) {
            res.extend([
                p.to_vec_f32(gpu).await?,
                m.to_vec_f32(gpu).await?,
                v.to_vec_f32(gpu).await?,
            ]);
        }
        Ok(res)
    })
    .await;
    let what = format!(
        "{shapes:?} x{steps} steps{}, {}",
        max_norm.map_or(String::new(), |m| format!(
            ", clip {m}, loss scale {loss_scale}"
        )),
        if multi {
            "7 a dispatch"
        } else {
            "one a dispatch"
        }
    );
    let res = r.and_then(|got| {
        let mut p: Vec<Vec<f64>> = init.iter().map(|v| widen(v)).collect();
        let mut m: Vec<Vec<f64>> = sizes.iter().map(|&n| vec![0.0; n]).collect();
        let mut v = m.clone();
        // m sums terms of both signs: its error scale is the same sum of magnitudes.
        let mut m_scale = m.clone();
        let mut scales = Vec::new();
        for (t, step) in grads.iter().enumerate() {
            let gd: Vec<Vec<f64>> = step.iter().map(|g| widen(g)).collect();
            let (norm, f) = cpu::grad_scale(
                &gd.iter().map(|g| &g[..]).collect::<Vec<_>>(),
                max_norm.map(|x| x as f64),
                loss_scale as f64,
            );
            scales.extend([norm, f]);
            for k in 0..p.len() {
                let g: Vec<f64> = gd[k].iter().map(|x| x * f).collect();
                for (ms, gi) in m_scale[k].iter_mut().zip(&g) {
                    *ms = 0.9 * *ms + 0.1 * gi.abs();
                }
                cpu::adamw_step(
                    &mut p[k],
                    &g,
                    &mut m[k],
                    &mut v[k],
                    t as i32 + 1,
                    lr,
                    (0.9, 0.999),
                    1e-8,
                    if decayed[k] { wd } else { 0.0 },
                );
            }
        }
        let st = compare("grad_scale (norm, factor)", &got[0], &scales, None, TOL).map_err(s)?;
        for k in 0..p.len() {
            let p_scale: Vec<f64> = p[k]
                .iter()
                .map(|x| x.abs() + 2.0 * lr * steps as f64)
                .collect();
            compare("adamw param", &got[1 + 3 * k], &p[k], Some(&p_scale), TOL).map_err(s)?;
            compare("adamw m", &got[2 + 3 * k], &m[k], Some(&m_scale[k]), TOL).map_err(s)?;
            compare("adamw v", &got[3 + 3 * k], &v[k], None, TOL).map_err(s)?;
        }
        Ok(st)
    });
    push(out, "adamw", what, res);
}

async fn sgd(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    let shape = [5, 201];
    let n = 1005;
    let mut rng = Rng::new(1600);
    let init = rng.vec(n);
    let grads: Vec<Vec<f32>> = (0..STEPS).map(|_| rng.vec(n)).collect();
    let (lr, mom, damp, wd) = (0.05f64, 0.9f64, 0.1f64, 0.01f64);
    let r = twice("sgd", async || {
        let p = Tensor::from_f32(gpu, &shape, &init, "p")?;
        let mut opt = Sgd::new(gpu, &[&p], lr, mom)?;
        opt.dampening = damp;
        opt.nesterov = true;
        opt.weight_decay = wd;
        let unit = unit_scale(gpu)?;
        for g in &grads {
            let tg = Tensor::from_f32(gpu, &shape, g, "g")?;
            gpu.run_async(|rec| opt.step(rec, &[&p], &[&tg], &unit))
                .await?;
        }
        Ok(vec![p.to_vec_f32(gpu).await?])
    })
    .await;
    let res = r.and_then(|got| {
        let mut p = widen(&init);
        let mut buf = vec![0.0; n];
        for (t, g) in grads.iter().enumerate() {
            cpu::sgd_step(&mut p, &widen(g), &mut buf, t == 0, lr, mom, damp, true, wd);
        }
        let scale: Vec<f64> = p
            .iter()
            .map(|x| x.abs() + lr * STEPS as f64 * 3.0)
            .collect();
        compare("sgd param", &got[0], &p, Some(&scale), TOL).map_err(s)
    });
    push(
        out,
        "sgd",
        format!("{shape:?} x{STEPS} steps, momentum {mom}, dampening {damp}, nesterov, wd {wd}"),
        res,
    );
}
