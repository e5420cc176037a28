//! Optimizers on the GPU: AdamW and SGD (momentum, dampening, Nesterov), with global-norm
//! gradient clipping and loss-scale division computed on the GPU (no gradient readback).
//! Shader: `optim.wgsl` (PyTorch's update formulas in its header).

use crate::error::{Error, Result};
use crate::gpu::{Binding::*, DType, Grid, Gpu, Kernel, Recorder, Tensor};
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
}

static ADAMW: Kernel = Kernel::new(&OPTIM, "adamw_step", &[(1, ReadWrite), (2, Read), (3, ReadWrite), (4, ReadWrite), (5, Read)]);
static SGD: Kernel =
    Kernel::new(&OPTIM, "sgd_step", &[(1, ReadWrite), (2, Read), (3, ReadWrite), (5, Read)]);
static SUMSQ: Kernel = Kernel::new(&OPTIM, "sumsq_partial", &[(2, Read), (6, ReadWrite)]);
static CLIP: Kernel = Kernel::new(&OPTIM, "clip_factor", &[(6, ReadWrite), (7, ReadWrite)]);

/// Elements one `sumsq_partial` workgroup covers (WG x ITEMS in the shader).
const CHUNK: usize = 256 * 16;

fn zeros_like(gpu: &Gpu, t: &Tensor, label: &str) -> Result<Tensor> {
    Tensor::from_f32(gpu, t.shape(), &vec![0.0; t.numel()], label)
}

fn check_pairs(op: &'static str, params: &[&Tensor], grads: &[&Tensor], state: usize) -> Result<()> {
    if params.len() != grads.len() || params.len() != state {
        return Err(Error::Shape { op, detail: format!("{} parameters, {} gradients, state for {state}", params.len(), grads.len()) });
    }
    for (p, g) in params.iter().zip(grads) {
        super::ops::expect_f32(op, p)?;
        super::ops::expect_f32(op, g)?;
        if p.shape() != g.shape() {
            return Err(Error::Shape { op, detail: format!("{} {:?} vs its gradient {:?}", p.label(), p.shape(), g.shape()) });
        }
    }
    Ok(())
}

/// (norm, factor): the global L2 norm of `grads` and the factor every gradient is multiplied
/// by in the step: min(1, max_norm / (norm + 1e-6)) / loss_scale (no clipping when
/// `max_norm` is None). Stays on the GPU; read it only to log it.
pub fn grad_scale(rec: &mut Recorder<'_>, grads: &[&Tensor], max_norm: Option<f32>, loss_scale: f32) -> Result<Tensor> {
    let gpu = rec.gpu();
    let chunks: Vec<usize> = grads.iter().map(|g| g.numel().div_ceil(CHUNK)).collect();
    let total: usize = chunks.iter().sum();
    let partials = Tensor::empty(gpu, &[total.max(1)], DType::F32, "optim.partials")?;
    let out = Tensor::empty(gpu, &[2], DType::F32, "optim.grad_scale")?;
    rec.clear(&partials);
    let mut offset = 0;
    for (g, &c) in grads.iter().zip(&chunks) {
        super::ops::expect_f32("grad_scale", g)?;
        let p = Params { n: g.numel() as u32, offset: offset as u32, ..Default::default() };
        rec.dispatch(&SUMSQ, &[], bytemuck::bytes_of(&p), &[g, &partials], Grid::Linear(c as u64))?;
        offset += c;
    }
    let p = Params { offset: total as u32, max_norm: max_norm.unwrap_or(0.0), loss_scale, ..Default::default() };
    rec.dispatch(&CLIP, &[], bytemuck::bytes_of(&p), &[&partials, &out], Grid::Linear(1))?;
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
    step: u32,
    state: Vec<(Tensor, Tensor)>,
}

impl AdamW {
    /// PyTorch's defaults: betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
    pub fn new(gpu: &Gpu, params: &[&Tensor], lr: f64) -> Result<AdamW> {
        let state = params.iter().map(|p| Ok((zeros_like(gpu, p, "adamw.m")?, zeros_like(gpu, p, "adamw.v")?))).collect::<Result<_>>()?;
        Ok(AdamW { lr, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.01, step: 0, state })
    }

    pub fn steps(&self) -> u32 {
        self.step
    }

    /// The moment estimates (m, v) of each parameter, for checkpoints.
    pub fn state(&self) -> &[(Tensor, Tensor)] {
        &self.state
    }

    /// One update of every parameter; gradients are multiplied by `scale`'s factor first.
    pub fn step(&mut self, rec: &mut Recorder<'_>, params: &[&Tensor], grads: &[&Tensor], scale: &Tensor) -> Result<()> {
        check_pairs("adamw", params, grads, self.state.len())?;
        self.step += 1;
        let t = self.step as i32;
        let (lr, wd, (b1, b2)) = (self.lr, self.weight_decay, self.betas);
        let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        for ((p, g), (m, v)) in params.iter().zip(grads).zip(&self.state) {
            let prm = Params {
                n: p.numel() as u32,
                b1: b1 as f32,
                b2: b2 as f32,
                omb1: (1.0 - b1) as f32,
                omb2: (1.0 - b2) as f32,
                eps: self.eps as f32,
                decay: (1.0 - lr * wd) as f32,
                step_size: (lr / bc1) as f32,
                bc2_sqrt: bc2.sqrt() as f32,
                ..Default::default()
            };
            rec.dispatch(&ADAMW, &[], bytemuck::bytes_of(&prm), &[p, g, m, v, scale], Grid::cover(p.numel() as u64, 256))?;
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
        let buffers = params.iter().map(|p| zeros_like(gpu, p, "sgd.momentum")).collect::<Result<_>>()?;
        Ok(Sgd { lr, momentum, dampening: 0.0, nesterov: false, weight_decay: 0.0, step: 0, buffers })
    }

    pub fn step(&mut self, rec: &mut Recorder<'_>, params: &[&Tensor], grads: &[&Tensor], scale: &Tensor) -> Result<()> {
        check_pairs("sgd", params, grads, self.buffers.len())?;
        let first = self.step == 0;
        self.step += 1;
        let c = [("NESTEROV", self.nesterov as u32 as f64), ("FIRST", first as u32 as f64)];
        for ((p, g), buf) in params.iter().zip(grads).zip(&self.buffers) {
            let prm = Params {
                n: p.numel() as u32,
                lr: self.lr as f32,
                wd: self.weight_decay as f32,
                b1: self.momentum as f32,
                omb2: (1.0 - self.dampening) as f32,
                ..Default::default()
            };
            rec.dispatch(&SGD, &c, bytemuck::bytes_of(&prm), &[p, g, buf, scale], Grid::cover(p.numel() as u64, 256))?;
        }
        Ok(())
    }
}
