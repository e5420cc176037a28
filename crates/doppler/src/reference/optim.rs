//! torch.optim's AdamW and SGD updates in f64, one parameter tensor at a time.

/// One AdamW step (t from 1) on p with gradient g (already scaled).
#[allow(clippy::too_many_arguments)]
pub fn adamw_step(
    p: &mut [f64],
    g: &[f64],
    m: &mut [f64],
    v: &mut [f64],
    t: i32,
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    wd: f64,
) {
    let (bc1, bc2) = (1.0 - betas.0.powi(t), 1.0 - betas.1.powi(t));
    for i in 0..p.len() {
        p[i] *= 1.0 - lr * wd;
        m[i] = betas.0 * m[i] + (1.0 - betas.0) * g[i];
        v[i] = betas.1 * v[i] + (1.0 - betas.1) * g[i] * g[i];
        p[i] -= lr / bc1 * m[i] / (v[i].sqrt() / bc2.sqrt() + eps);
    }
}

/// One SGD step; `first`: the momentum buffer starts as the gradient.
#[allow(clippy::too_many_arguments)]
pub fn sgd_step(
    p: &mut [f64],
    g: &[f64],
    buf: &mut [f64],
    first: bool,
    lr: f64,
    momentum: f64,
    dampening: f64,
    nesterov: bool,
    wd: f64,
) {
    for i in 0..p.len() {
        let mut d = g[i] + wd * p[i];
        if momentum != 0.0 {
            buf[i] = if first {
                d
            } else {
                momentum * buf[i] + (1.0 - dampening) * d
            };
            d = if nesterov {
                d + momentum * buf[i]
            } else {
                buf[i]
            };
        }
        p[i] -= lr * d;
    }
}

/// (norm, factor) as `grad_scale` computes them.
pub fn grad_scale(grads: &[&[f64]], max_norm: Option<f64>, loss_scale: f64) -> (f64, f64) {
    let norm = grads
        .iter()
        .flat_map(|g| g.iter())
        .map(|x| x * x)
        .sum::<f64>()
        .sqrt()
        / loss_scale;
    let f = max_norm.map_or(1.0, |mx| (mx / (norm + 1e-6)).min(1.0));
    (norm, f / loss_scale)
}
