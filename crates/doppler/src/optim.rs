//! Optimizers on the GPU: AdamW and SGD (momentum, dampening, Nesterov), with global-norm
//! gradient clipping and loss-scale division computed on the GPU (no gradient readback).
//! Shader: `optim.wgsl` (PyTorch's update formulas in its header).

use crate::error::{Error, Result};
use crate::gpu::{Binding, Binding::*, DType, Gpu, Grid, Kernel, Recorder, Tensor};
use crate::shaders::OPTIM;

#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub n: u32,
    pub offset: u32,
    pub lr: f32,
    pub wd: f32,
    pub b1: f32,
    pub b2: f32,
    pub omb1: f32,
    pub omb2: f32,
    pub eps: f32,
    pub decay: f32,
    pub step_size: f32,
    pub bc2_sqrt: f32,
    pub max_norm: f32,
    pub loss_scale: f32,
    pub _pad: [u32; 2],
    /// Multi-tensor kernels: per slot, the cumulative end of its workgroups, its element
    /// count, and AdamW's 1 - lr * wd.
    /// (`SLOTS` of the 8 entries used.)
    pub ends: [u32; 8],
    pub ns: [u32; 8],
    pub decays: [f32; 8],
}

static ADAMW: Kernel = Kernel::new(
    &OPTIM,
    "adamw_step",
    &[
        (1, ReadWrite),
        (2, Read),
        (3, ReadWrite),
        (4, ReadWrite),
        (5, Read),
    ],
);
// The same on vec4 views (sizes a multiple of 4).
static ADAMW4: Kernel = Kernel::new(
    &OPTIM,
    "adamw_step4",
    &[
        (8, ReadWrite),
        (9, Read),
        (10, ReadWrite),
        (11, ReadWrite),
        (5, Read),
    ],
);
static SGD: Kernel = Kernel::new(
    &OPTIM,
    "sgd_step",
    &[(1, ReadWrite), (2, Read), (3, ReadWrite), (5, Read)],
);
static SUMSQ: Kernel = Kernel::new(&OPTIM, "sumsq_partial", &[(2, Read), (6, ReadWrite)]);

/// Tensors a multi-tensor dispatch takes (`SLOTS` in optim.wgsl): 4 x 7 + 1 = 29 storage
/// buffers, within the 32 lavapipe allows.
pub const SLOTS: usize = 7;

/// `adamw_multi`'s bindings: p of each slot, then g, m, v of each slot, then the scale.
const ADAMW_MULTI_BINDINGS: [(u32, Binding); 4 * SLOTS + 1] = {
    let mut b = [(5, Read); 4 * SLOTS + 1];
    let mut i = 0;
    while i < SLOTS {
        b[i] = (16 + i as u32, ReadWrite);
        b[SLOTS + i] = (24 + i as u32, Read);
        b[2 * SLOTS + i] = (32 + i as u32, ReadWrite);
        b[3 * SLOTS + i] = (40 + i as u32, ReadWrite);
        i += 1;
    }
    b
};
static ADAMW_MULTI: Kernel = Kernel::new(&OPTIM, "adamw_multi", &ADAMW_MULTI_BINDINGS);

/// `sumsq_multi`'s bindings: g of each slot, then the partials.
const SUMSQ_MULTI_BINDINGS: [(u32, Binding); SLOTS + 1] = {
    let mut b = [(6, ReadWrite); SLOTS + 1];
    let mut i = 0;
    while i < SLOTS {
        b[i] = (24 + i as u32, Read);
        i += 1;
    }
    b
};
static SUMSQ_MULTI: Kernel = Kernel::new(&OPTIM, "sumsq_multi", &SUMSQ_MULTI_BINDINGS);

/// Whether the adapter binds enough storage buffers a stage for the multi-tensor kernels
/// (29; WebGPU's default limit is 8, lavapipe's 32).
pub fn multi_tensor_supported(gpu: &Gpu) -> bool {
    gpu.limits.max_storage_buffers_per_shader_stage >= ADAMW_MULTI_BINDINGS.len() as u32
}

/// Elements one `adamw_multi` workgroup updates (WG threads, one element each).
const MULTI_WG: usize = 256;

/// Fills `p`'s slot table for one multi-tensor dispatch over tensors of `ns` elements (up
/// to SLOTS; the slots past them stay empty) at `per_wg` elements a workgroup, and returns
/// the dispatch's workgroups.
fn slot_table(p: &mut Params, ns: &[usize], per_wg: usize) -> usize {
    let mut end = 0;
    for s in 0..SLOTS {
        let n = ns.get(s).copied().unwrap_or(0);
        end += n.div_ceil(per_wg);
        p.ends[s] = end as u32;
        p.ns[s] = n as u32;
    }
    end
}

/// What slot `s` of a multi-tensor dispatch over `group` binds: its tensor, or for a slot
/// past the group the group's first again (no workgroup reads an empty slot).
fn slot<T: Copy>(group: &[T], s: usize) -> T {
    *group.get(s).unwrap_or(&group[0])
}
static CLIP: Kernel = Kernel::new(&OPTIM, "clip_factor", &[(6, ReadWrite), (7, ReadWrite)]);

/// Elements one `sumsq_partial` workgroup covers (WG x ITEMS in the shader).
const CHUNK: usize = 256 * 16;

fn zeros_like(gpu: &Gpu, t: &Tensor, label: &str) -> Result<Tensor> {
    Tensor::from_f32(gpu, t.shape(), &vec![0.0; t.numel()], label)
}

fn check_pairs(
    op: &'static str,
    params: &[&Tensor],
    grads: &[&Tensor],
    state: usize,
) -> Result<()> {
    if params.len() != grads.len() || params.len() != state {
        return Err(Error::Shape {
            op,
            detail: format!(
                "{} parameters, {} gradients, state for {state}",
                params.len(),
                grads.len()
            ),
        });
    }
    for (p, g) in params.iter().zip(grads) {
        super::ops::expect_f32(op, p)?;
        super::ops::expect_f32(op, g)?;
        if p.shape() != g.shape() {
            return Err(Error::Shape {
                op,
                detail: format!(
                    "{} {:?} vs its gradient {:?}",
                    p.label(),
                    p.shape(),
                    g.shape()
                ),
            });
        }
    }
    Ok(())
}

/// (norm, factor): the global L2 norm of the unscaled gradients (`grads` / `loss_scale`)
/// and the factor every gradient is multiplied by in the step:
/// min(1, max_norm / (norm + 1e-6)) / loss_scale (no clipping when `max_norm` is None), so
/// clipping acts as without a loss scale. Stays on the GPU; read it only to log it.
pub fn grad_scale(
    rec: &mut Recorder<'_>,
    grads: &[&Tensor],
    max_norm: Option<f32>,
    loss_scale: f32,
) -> Result<Tensor> {
    let multi = multi_tensor_supported(rec.gpu());
    grad_scale_with(rec, grads, max_norm, loss_scale, multi)
}

/// [`grad_scale`] with the sums of squares taken `SLOTS` gradients a dispatch (`multi`) or
/// one a dispatch; the partial sums and their order are the same either way.
pub fn grad_scale_with(
    rec: &mut Recorder<'_>,
    grads: &[&Tensor],
    max_norm: Option<f32>,
    loss_scale: f32,
    multi: bool,
) -> Result<Tensor> {
    let gpu = rec.gpu();
    for g in grads {
        super::ops::expect_f32("grad_scale", g)?;
    }
    let chunks: Vec<usize> = grads.iter().map(|g| g.numel().div_ceil(CHUNK)).collect();
    let total: usize = chunks.iter().sum();
    let partials = Tensor::empty(gpu, &[total.max(1)], DType::F32, "optim.partials")?;
    let out = Tensor::empty(gpu, &[2], DType::F32, "optim.grad_scale")?;
    rec.clear(&partials);
    let mut offset = 0;
    if multi {
        for gs in grads.chunks(SLOTS) {
            let mut p = Params {
                offset: offset as u32,
                ..Default::default()
            };
            let ns: Vec<usize> = gs.iter().map(|g| g.numel()).collect();
            let end = slot_table(&mut p, &ns, CHUNK);
            let mut bound: Vec<&Tensor> = (0..SLOTS).map(|s| slot(gs, s)).collect();
            bound.push(&partials);
            rec.dispatch(
                &SUMSQ_MULTI,
                &[],
                bytemuck::bytes_of(&p),
                &bound,
                Grid::Linear(end as u64),
            )?;
            offset += end;
        }
    } else {
        for (g, &c) in grads.iter().zip(&chunks) {
            let p = Params {
                n: g.numel() as u32,
                offset: offset as u32,
                ..Default::default()
            };
            rec.dispatch(
                &SUMSQ,
                &[],
                bytemuck::bytes_of(&p),
                &[g, &partials],
                Grid::Linear(c as u64),
            )?;
            offset += c;
        }
    }
    let p = Params {
        offset: total as u32,
        max_norm: max_norm.unwrap_or(0.0),
        loss_scale,
        ..Default::default()
    };
    rec.dispatch(
        &CLIP,
        &[],
        bytemuck::bytes_of(&p),
        &[&partials, &out],
        Grid::Linear(1),
    )?;
    Ok(out)
}

/// A (norm, factor) tensor that leaves gradients as they are.
pub fn unit_scale(gpu: &Gpu) -> Result<Tensor> {
    Tensor::from_f32(gpu, &[2], &[0.0, 1.0], "optim.unit_scale")
}

/// AdamW as `torch.optim.AdamW` (decoupled weight decay, bias correction). Hyperparameters
/// are f64, like PyTorch's Python floats: derived constants such as 1 - beta2 are formed in
/// f64 and only then rounded to f32.
pub struct AdamW {
    pub lr: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    /// Which parameters weight decay applies to (all when empty).
    pub decay_mask: Vec<bool>,
    /// Update `SLOTS` parameters a dispatch (where the adapter allows it, see
    /// [`multi_tensor_supported`]); otherwise one a dispatch. Same arithmetic either way.
    pub multi_tensor: bool,
    step: u32,
    state: Vec<(Tensor, Tensor)>,
}

impl AdamW {
    /// PyTorch's defaults: betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
    pub fn new(gpu: &Gpu, params: &[&Tensor], lr: f64) -> Result<AdamW> {
        let state = params
            .iter()
            .map(|p| {
                Ok((
                    zeros_like(gpu, p, "adamw.m")?,
                    zeros_like(gpu, p, "adamw.v")?,
                ))
            })
            .collect::<Result<_>>()?;
        Ok(AdamW {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
            decay_mask: Vec::new(),
            multi_tensor: multi_tensor_supported(gpu),
            step: 0,
            state,
        })
    }

    /// Continues from a checkpoint: the step count and each parameter's (m, v).
    pub fn restore(&mut self, step: u32, state: Vec<(Tensor, Tensor)>) -> Result<()> {
        if state.len() != self.state.len()
            || state
                .iter()
                .zip(&self.state)
                .any(|(a, b)| a.0.shape() != b.0.shape() || a.1.shape() != b.1.shape())
        {
            return Err(Error::Shape {
                op: "adamw restore",
                detail: format!(
                    "state for {} parameters, optimizer has {}",
                    state.len(),
                    self.state.len()
                ),
            });
        }
        self.step = step;
        self.state = state;
        Ok(())
    }

    pub fn steps(&self) -> u32 {
        self.step
    }

    /// The moment estimates (m, v) of each parameter, for checkpoints.
    pub fn state(&self) -> &[(Tensor, Tensor)] {
        &self.state
    }

    /// One update of every parameter; gradients are multiplied by `scale`'s factor first.
    pub fn step(
        &mut self,
        rec: &mut Recorder<'_>,
        params: &[&Tensor],
        grads: &[&Tensor],
        scale: &Tensor,
    ) -> Result<()> {
        check_pairs("adamw", params, grads, self.state.len())?;
        self.step += 1;
        let t = self.step as i32;
        let (lr, wd, (b1, b2)) = (self.lr, self.weight_decay, self.betas);
        let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        let decay = |i: usize| {
            let on = self.decay_mask.get(i).copied().unwrap_or(true);
            (1.0 - lr * if on { wd } else { 0.0 }) as f32
        };
        let common = Params {
            b1: b1 as f32,
            b2: b2 as f32,
            omb1: (1.0 - b1) as f32,
            omb2: (1.0 - b2) as f32,
            eps: self.eps as f32,
            step_size: (lr / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            ..Default::default()
        };
        if self.multi_tensor {
            let idx: Vec<usize> = (0..params.len()).collect();
            for group in idx.chunks(SLOTS) {
                let mut prm = common;
                let ns: Vec<usize> = group.iter().map(|&i| params[i].numel()).collect();
                let end = slot_table(&mut prm, &ns, MULTI_WG);
                for (s, &i) in group.iter().enumerate() {
                    prm.decays[s] = decay(i);
                }
                let at = |s: usize| slot(group, s);
                let mut bound: Vec<&Tensor> = Vec::with_capacity(ADAMW_MULTI_BINDINGS.len());
                bound.extend((0..SLOTS).map(|s| params[at(s)]));
                bound.extend((0..SLOTS).map(|s| grads[at(s)]));
                bound.extend((0..SLOTS).map(|s| &self.state[at(s)].0));
                bound.extend((0..SLOTS).map(|s| &self.state[at(s)].1));
                bound.push(scale);
                rec.dispatch(
                    &ADAMW_MULTI,
                    &[],
                    bytemuck::bytes_of(&prm),
                    &bound,
                    Grid::Linear(end as u64),
                )?;
            }
            return Ok(());
        }
        for (i, ((p, g), (m, v))) in params.iter().zip(grads).zip(&self.state).enumerate() {
            let prm = Params {
                n: p.numel() as u32,
                decay: decay(i),
                ..common
            };
            let (kernel, threads) = match p.numel() % 4 {
                0 => (&ADAMW4, p.numel() / 4),
                _ => (&ADAMW, p.numel()),
            };
            rec.dispatch(
                kernel,
                &[],
                bytemuck::bytes_of(&prm),
                &[p, g, m, v, scale],
                Grid::cover(threads as u64, 256),
            )?;
        }
        Ok(())
    }
}

/// SGD as `torch.optim.SGD` (momentum, dampening, Nesterov, L2 weight decay).
pub struct Sgd {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
    step: u32,
    buffers: Vec<Tensor>,
}

impl Sgd {
    pub fn new(gpu: &Gpu, params: &[&Tensor], lr: f64, momentum: f64) -> Result<Sgd> {
        let buffers = params
            .iter()
            .map(|p| zeros_like(gpu, p, "sgd.momentum"))
            .collect::<Result<_>>()?;
        Ok(Sgd {
            lr,
            momentum,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
            step: 0,
            buffers,
        })
    }

    pub fn step(
        &mut self,
        rec: &mut Recorder<'_>,
        params: &[&Tensor],
        grads: &[&Tensor],
        scale: &Tensor,
    ) -> Result<()> {
        check_pairs("sgd", params, grads, self.buffers.len())?;
        let first = self.step == 0;
        self.step += 1;
        let c = [
            ("NESTEROV", self.nesterov as u32 as f64),
            ("FIRST", first as u32 as f64),
        ];
        for ((p, g), buf) in params.iter().zip(grads).zip(&self.buffers) {
            let prm = Params {
                n: p.numel() as u32,
                lr: self.lr as f32,
                wd: self.weight_decay as f32,
                b1: self.momentum as f32,
                omb2: (1.0 - self.dampening) as f32,
                ..Default::default()
            };
            rec.dispatch(
                &SGD,
                &c,
                bytemuck::bytes_of(&prm),
                &[p, g, buf, scale],
                Grid::cover(p.numel() as u64, 256),
            )?;
        }
        Ok(())
    }
}

/// Learning rate at `step` (0-based): linear warmup from lr / warmup to lr over `warmup`
/// steps, then a cosine from lr down to `min_lr` at `total` steps (min_lr after that).
pub fn warmup_cosine(step: u64, lr: f64, min_lr: f64, warmup: u64, total: u64) -> f64 {
    if step < warmup {
        return lr * (step + 1) as f64 / warmup as f64;
    }
    if step >= total || total <= warmup {
        return min_lr;
    }
    let progress = (step - warmup) as f64 / (total - warmup) as f64;
    min_lr + 0.5 * (lr - min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// Dynamic loss scaling, as torch.cuda.amp.GradScaler: the loss is multiplied by `scale`
/// before the backward; a step whose gradients overflow (non-finite norm) is skipped and
/// the scale halved; after `growth_interval` good steps in a row the scale doubles.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossScaler {
    pub scale: f32,
    pub growth_interval: u32,
    pub good_steps: u32,
    /// Off: scale stays 1 and no step is skipped for overflow.
    pub dynamic: bool,
}

impl LossScaler {
    pub fn fixed() -> LossScaler {
        LossScaler {
            scale: 1.0,
            growth_interval: 2000,
            good_steps: 0,
            dynamic: false,
        }
    }

    pub fn dynamic(initial: f32) -> LossScaler {
        LossScaler {
            scale: initial,
            growth_interval: 2000,
            good_steps: 0,
            dynamic: true,
        }
    }

    /// Records whether this step's gradient norm was finite; returns whether to apply the
    /// optimizer step.
    pub fn update(&mut self, grad_norm: f32) -> bool {
        if !self.dynamic {
            return true;
        }
        if !grad_norm.is_finite() {
            self.scale = (self.scale * 0.5).max(f32::MIN_POSITIVE);
            self.good_steps = 0;
            return false;
        }
        self.good_steps += 1;
        if self.good_steps >= self.growth_interval {
            self.scale = (self.scale * 2.0).min(f32::MAX / 2.0);
            self.good_steps = 0;
        }
        true
    }
}

#[cfg(test)]
mod schedule_tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_to_min() {
        assert_eq!(warmup_cosine(0, 1.0, 0.1, 10, 110), 0.1);
        assert_eq!(warmup_cosine(9, 1.0, 0.1, 10, 110), 1.0);
        assert!((warmup_cosine(10, 1.0, 0.1, 10, 110) - 1.0).abs() < 1e-12);
        assert!((warmup_cosine(60, 1.0, 0.1, 10, 110) - 0.55).abs() < 1e-12);
        assert_eq!(warmup_cosine(110, 1.0, 0.1, 10, 110), 0.1);
        assert_eq!(warmup_cosine(500, 1.0, 0.1, 10, 110), 0.1);
    }

    #[test]
    fn loss_scaler_backs_off_and_grows() {
        let mut s = LossScaler::dynamic(1024.0);
        s.growth_interval = 3;
        assert!(!s.update(f32::INFINITY));
        assert_eq!(s.scale, 512.0);
        assert!(!s.update(f32::NAN));
        assert_eq!(s.scale, 256.0);
        assert!(s.update(1.0) && s.update(1.0));
        assert_eq!(s.scale, 256.0);
        assert!(s.update(1.0));
        assert_eq!(s.scale, 512.0);
        let mut f = LossScaler::fixed();
        assert!(f.update(f32::INFINITY));
        assert_eq!(f.scale, 1.0);
    }
}
