//! Conv nets, recorded on the autograd tape and trained by the same trainer as the
//! transformer: an image classifier (`arch = "convnet"`, configs/digits_cnn.toml) and a
//! class-conditional U-Net denoiser trained as DDPM (`arch = "unet"`,
//! configs/digits_unet.toml), sampled by `doppler sample`.
//!
//! The classifier (N images, C_s the width of stage s, H x W halved at each stage after
//! the first):
//!   stem:      conv 3x3, pad 1            (N, C_in, H, W)   -> (N, C_0, H, W)
//!   stage s:   (s > 0) conv 3x3, stride 2, pad 1: (N, C_{s-1}, H, W) -> (N, C_s, H/2, W/2)
//!              then `blocks` residual blocks, each
//!                x + conv2(gelu(norm2(conv1(gelu(norm1(x))))))   (convs 3x3, pad 1)
//!   head:      gelu(norm(x)), global average pool -> (N, C_last), linear -> (N, classes)
//!
//! The U-Net (levels l = 0..L with widths C_l, E = 4 C_0 the embedding width):
//!   emb:        gelu(linear(time_emb[t] + class_emb[k]))                  (N, E)
//!   stem:       conv 3x3                        (N, C_in, H, W) -> (N, C_0, H, W)
//!   down l:     `blocks` residual blocks at C_l, the output kept as skip l; then (l < L-1)
//!               conv 3x3 stride 2 to C_{l+1} at half the resolution
//!   mid:        one residual block at C_{L-1}
//!   up l:       (from L-1 down to 0) x + skip l, `blocks` residual blocks; then (l > 0)
//!               nearest upsampling x2 and conv 3x3 to C_{l-1}
//!   out:        conv 3x3 of gelu(norm(x))     -> (N, C_in, H, W), the predicted noise
//!   residual block: x + conv2(gelu(norm2(conv1(gelu(norm1(x))) + linear(emb))))  (the
//!               embedding's (N, C) broadcast over H x W)
//! DDPM (Ho et al. 2020) with `timesteps` T: betas linear from 1e-4 to 0.02 scaled by
//! 1000 / T, x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) noise, the loss the mean squared
//! error of the predicted noise; sampling walks t = T-1 .. 0 with the posterior variance.
//!
//! Norms are GroupNorm over `groups` groups, GELU the exact (erf) one, every conv and
//! linear has a bias. The parameter names are those of the PyTorch twin's
//! (bench/torch_convnet.py).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::autograd::{ParamStore, Tape, Var};
use crate::check::Rng;
use crate::error::{Error, Result};
use crate::gpu::{Gpu, Recorder, Tensor};
use crate::ops::conv2d::Conv2dOpts;
use crate::ops::cross_entropy::CrossEntropyOpts;
use crate::ops::gelu::GeluMode;
use crate::ops::pool::Pool;

/// Largest image edge, stage count and width a config may ask for.
const MAX_EDGE: usize = 4096;
const MAX_STAGES: usize = 8;
const MAX_WIDTH: usize = 4096;
/// Most parameters a config may ask for (4 GiB of f32 weights).
const MAX_PARAMS: usize = 1 << 30;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ConvArch {
    /// The residual classifier above.
    Convnet,
    /// The class-conditional U-Net denoiser above.
    Unet,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConvConfig {
    pub arch: ConvArch,
    /// Channels of the input images (1 for grey).
    pub in_channels: usize,
    /// Height and width of the input images.
    pub image_size: usize,
    pub classes: usize,
    /// Width of each stage; every stage after the first halves the resolution.
    pub channels: Vec<usize>,
    /// Residual blocks per stage.
    #[serde(default = "one")]
    pub blocks: usize,
    /// GroupNorm groups (each width a multiple).
    #[serde(default = "default_groups")]
    pub groups: usize,
    #[serde(default = "default_eps")]
    pub norm_eps: f32,
    /// The U-Net's diffusion steps T (default 200); not for the classifier.
    #[serde(default)]
    pub timesteps: Option<usize>,
}

fn one() -> usize {
    1
}
fn default_groups() -> usize {
    8
}
fn default_eps() -> f32 {
    1e-5
}

impl ConvConfig {
    /// Every constraint on the shapes, as one clear error.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| {
            Err(Error::Invalid {
                op: "conv model config",
                detail: why,
            })
        };
        let c = self;
        if !(1..=MAX_WIDTH).contains(&c.in_channels) {
            return bad(format!(
                "in_channels {} must be in 1..={MAX_WIDTH}",
                c.in_channels
            ));
        }
        if !(1..=MAX_EDGE).contains(&c.image_size) {
            return bad(format!(
                "image_size {} must be in 1..={MAX_EDGE}",
                c.image_size
            ));
        }
        if c.classes < 2 || c.classes > 1 << 20 {
            return bad(format!("classes {} must be in 2..=1048576", c.classes));
        }
        if c.channels.is_empty() || c.channels.len() > MAX_STAGES {
            return bad(format!(
                "channels {:?}: one width per stage, 1 to {MAX_STAGES} stages",
                c.channels
            ));
        }
        if c.blocks > 64 {
            return bad(format!("blocks {} must be at most 64", c.blocks));
        }
        if c.groups == 0 {
            return bad("groups must be positive".into());
        }
        if !(c.norm_eps > 0.0 && c.norm_eps.is_finite()) {
            return bad(format!("norm_eps {} must be positive", c.norm_eps));
        }
        for &w in &c.channels {
            if w == 0 || w > MAX_WIDTH || w % c.groups != 0 {
                return bad(format!(
                    "channels {:?}: each width must be in 1..={MAX_WIDTH} and a multiple of groups {}",
                    c.channels, c.groups
                ));
            }
        }
        match (c.arch, c.timesteps) {
            (ConvArch::Convnet, Some(_)) => return bad("timesteps is for arch = \"unet\"".into()),
            (ConvArch::Unet, Some(t)) if !(2..=100_000).contains(&t) => {
                return bad(format!("timesteps {t} must be in 2..=100000"))
            }
            _ => {}
        }
        // In u64 with checks: on wasm32 a usize product can wrap.
        let params = layout(c).iter().try_fold(0u64, |sum, (_, shape, _)| {
            let n = shape
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d as u64))?;
            sum.checked_add(n)
        });
        let params = params.unwrap_or(u64::MAX);
        if params > MAX_PARAMS as u64 {
            return bad(format!(
                "{params} parameters: at most {MAX_PARAMS} (channels {:?}, blocks {})",
                c.channels, c.blocks
            ));
        }
        if c.arch == ConvArch::Unet && c.channels.iter().any(|&w| w / c.groups < 2) {
            return bad(format!(
                "channels {:?} with groups {}: a U-Net needs at least 2 channels a group (with 1, GroupNorm removes the time and class embedding added per channel)",
                c.channels, c.groups
            ));
        }
        let halvings = c.channels.len() - 1;
        if c.image_size % (1 << halvings) != 0 {
            return bad(format!(
                "image_size {} is not divisible by 2^{halvings} = {} (the {} stages after the first halve it)",
                c.image_size,
                1 << halvings,
                halvings
            ));
        }
        Ok(())
    }

    /// The U-Net's diffusion steps.
    pub fn steps(&self) -> usize {
        self.timesteps.unwrap_or(200)
    }

    /// The U-Net's embedding width.
    pub fn emb_dim(&self) -> usize {
        4 * self.channels[0]
    }

    /// The (C, H, W) of one input image.
    pub fn image_shape(&self) -> [usize; 3] {
        [self.in_channels, self.image_size, self.image_size]
    }
}

/// How a parameter starts: PyTorch's default for convs and linears (uniform in
/// +-1/sqrt(fan_in), weights and biases alike) and embeddings (N(0, 1)), or a constant
/// (norms: 1 and 0).
enum Init {
    Uniform(usize),
    Normal,
    Const(f32),
}

const K3: Conv2dOpts = Conv2dOpts {
    stride: (1, 1),
    padding: (1, 1),
    dilation: (1, 1),
    groups: 1,
};

/// The 3x3 conv that halves the resolution (stride 2).
const K3_DOWN: Conv2dOpts = Conv2dOpts {
    stride: (2, 2),
    ..K3
};

type Layout = Vec<(String, Vec<usize>, Init)>;

fn conv_layout(out: &mut Layout, name: &str, cin: usize, cout: usize) {
    let fan = cin * 9;
    out.push((
        format!("{name}.weight"),
        vec![cout, cin, 3, 3],
        Init::Uniform(fan),
    ));
    out.push((format!("{name}.bias"), vec![cout], Init::Uniform(fan)));
}

fn linear_layout(out: &mut Layout, name: &str, din: usize, dout: usize) {
    out.push((
        format!("{name}.weight"),
        vec![dout, din],
        Init::Uniform(din),
    ));
    out.push((format!("{name}.bias"), vec![dout], Init::Uniform(din)));
}

fn norm_layout(out: &mut Layout, name: &str, c: usize) {
    out.push((format!("{name}.weight"), vec![c], Init::Const(1.0)));
    out.push((format!("{name}.bias"), vec![c], Init::Const(0.0)));
}

/// A residual block's parameters (`emb`: the U-Net's embedding width).
fn block_layout(out: &mut Layout, p: &str, c: usize, emb: Option<usize>) {
    norm_layout(out, &format!("{p}.norm1"), c);
    conv_layout(out, &format!("{p}.conv1"), c, c);
    if let Some(e) = emb {
        linear_layout(out, &format!("{p}.emb"), e, c);
    }
    norm_layout(out, &format!("{p}.norm2"), c);
    conv_layout(out, &format!("{p}.conv2"), c, c);
}

/// (name, shape, init) of every parameter, in store order.
fn layout(cfg: &ConvConfig) -> Layout {
    let mut out = Vec::new();
    let ch = &cfg.channels;
    let last = *ch.last().unwrap_or(&1);
    conv_layout(&mut out, "stem", cfg.in_channels, ch[0]);
    match cfg.arch {
        ConvArch::Convnet => {
            for (s, &c) in ch.iter().enumerate() {
                if s > 0 {
                    conv_layout(&mut out, &format!("down.{s}"), ch[s - 1], c);
                }
                for b in 0..cfg.blocks {
                    block_layout(&mut out, &format!("stages.{s}.{b}"), c, None);
                }
            }
            norm_layout(&mut out, "head_norm", last);
            linear_layout(&mut out, "head", last, cfg.classes);
        }
        ConvArch::Unet => {
            let e = cfg.emb_dim();
            out.push(("time_emb.weight".into(), vec![cfg.steps(), e], Init::Normal));
            out.push((
                "class_emb.weight".into(),
                vec![cfg.classes, e],
                Init::Normal,
            ));
            linear_layout(&mut out, "emb_proj", e, e);
            for (l, &c) in ch.iter().enumerate() {
                for b in 0..cfg.blocks {
                    block_layout(&mut out, &format!("down.{l}.{b}"), c, Some(e));
                }
                if l + 1 < ch.len() {
                    conv_layout(&mut out, &format!("downsample.{l}"), c, ch[l + 1]);
                }
            }
            block_layout(&mut out, "mid", last, Some(e));
            for (l, &c) in ch.iter().enumerate().rev() {
                for b in 0..cfg.blocks {
                    block_layout(&mut out, &format!("up.{l}.{b}"), c, Some(e));
                }
                if l > 0 {
                    conv_layout(&mut out, &format!("upsample.{l}"), c, ch[l - 1]);
                }
            }
            norm_layout(&mut out, "out_norm", ch[0]);
            conv_layout(&mut out, "out", ch[0], cfg.in_channels);
        }
    }
    out
}

pub struct ConvNet {
    pub cfg: ConvConfig,
    pub params: ParamStore,
    index: HashMap<String, usize>,
}

impl ConvNet {
    /// Fresh weights from `seed`.
    pub fn new(gpu: &Gpu, cfg: &ConvConfig, seed: u64) -> Result<ConvNet> {
        cfg.validate()?;
        let mut rng = Rng::new(seed);
        let weights = layout(cfg)
            .into_iter()
            .map(|(name, shape, init)| {
                let n: usize = shape.iter().product();
                let data = match init {
                    Init::Uniform(fan) => {
                        let bound = 1.0 / (fan as f64).sqrt();
                        (0..n)
                            .map(|_| {
                                let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                                ((2.0 * u - 1.0) * bound) as f32
                            })
                            .collect()
                    }
                    Init::Normal => super::normals(&mut rng, n, 1.0),
                    Init::Const(c) => vec![c; n],
                };
                (name, shape, data)
            })
            .collect();
        ConvNet::from_weights(gpu, cfg, weights)
    }

    /// (name, shape) of every parameter, in store order.
    pub fn expected(cfg: &ConvConfig) -> Vec<(String, Vec<usize>)> {
        layout(cfg).into_iter().map(|(n, s, _)| (n, s)).collect()
    }

    pub fn from_weights(
        gpu: &Gpu,
        cfg: &ConvConfig,
        weights: Vec<(String, Vec<usize>, Vec<f32>)>,
    ) -> Result<ConvNet> {
        cfg.validate()?;
        let (params, index) = super::store_weights(gpu, ConvNet::expected(cfg), weights)?;
        Ok(ConvNet {
            cfg: cfg.clone(),
            params,
            index,
        })
    }

    fn p(&self, tape: &mut Tape, name: &str) -> Result<Var> {
        let i = *self.index.get(name).ok_or_else(|| Error::Invalid {
            op: "convnet",
            detail: format!("no parameter {name}"),
        })?;
        Ok(tape.param(&self.params, i))
    }

    fn conv(
        &self,
        tape: &mut Tape,
        rec: &mut Recorder<'_>,
        x: Var,
        name: &str,
        opts: Conv2dOpts,
    ) -> Result<Var> {
        let w = self.p(tape, &format!("{name}.weight"))?;
        let b = self.p(tape, &format!("{name}.bias"))?;
        tape.conv2d(rec, x, w, Some(b), opts)
    }

    fn linear(&self, tape: &mut Tape, rec: &mut Recorder<'_>, x: Var, name: &str) -> Result<Var> {
        let w = self.p(tape, &format!("{name}.weight"))?;
        let b = self.p(tape, &format!("{name}.bias"))?;
        tape.linear(rec, x, w, Some(b))
    }

    /// gelu(group_norm(x)) with the norm's parameters `name`.
    fn norm_gelu(
        &self,
        tape: &mut Tape,
        rec: &mut Recorder<'_>,
        x: Var,
        name: &str,
    ) -> Result<Var> {
        let w = self.p(tape, &format!("{name}.weight"))?;
        let b = self.p(tape, &format!("{name}.bias"))?;
        let y = tape.group_norm(rec, x, w, b, self.cfg.groups, self.cfg.norm_eps)?;
        tape.gelu(rec, y, GeluMode::Exact)
    }

    /// x + conv2(gelu(norm2(conv1(gelu(norm1(x))) [+ linear(emb)]))): the residual block
    /// `p`, with the U-Net's embedding (N, E) added to every pixel of its channels.
    fn block(
        &self,
        tape: &mut Tape,
        rec: &mut Recorder<'_>,
        x: Var,
        p: &str,
        emb: Option<Var>,
    ) -> Result<Var> {
        let y = self.norm_gelu(tape, rec, x, &format!("{p}.norm1"))?;
        let mut y = self.conv(tape, rec, y, &format!("{p}.conv1"), K3)?;
        if let Some(e) = emb {
            let shape = tape.value(y)?.shape().to_vec();
            let (n, c, h, w) = (shape[0], shape[1], shape[2], shape[3]);
            let add = self.linear(tape, rec, e, &format!("{p}.emb"))?; // (N, C)
            let add = tape.reshape(add, &[n, c, 1, 1])?;
            let add = tape.upsample_nearest(rec, add, (h, w))?; // (N, C, H, W)
            y = tape.add(rec, y, add)?;
        }
        let y = self.norm_gelu(tape, rec, y, &format!("{p}.norm2"))?;
        let y = self.conv(tape, rec, y, &format!("{p}.conv2"), K3)?;
        tape.add(rec, x, y)
    }

    /// N from images (N, C, H, W) of the config's shape, or an error naming both.
    fn batch_of(&self, images: &Tensor) -> Result<usize> {
        let [ci, h, w] = self.cfg.image_shape();
        match *images.shape() {
            [n, a, b, d] if [a, b, d] == [ci, h, w] && n > 0 => Ok(n),
            _ => Err(Error::Shape {
                op: "convnet",
                detail: format!(
                    "images {:?}, the config's are (N, {ci}, {h}, {w})",
                    images.shape()
                ),
            }),
        }
    }

    fn expect(&self, arch: ConvArch, op: &'static str) -> Result<()> {
        if self.cfg.arch != arch {
            return Err(Error::Invalid {
                op,
                detail: format!("the model is a {:?}, not a {arch:?}", self.cfg.arch),
            });
        }
        Ok(())
    }

    /// The classifier's class scores (N, classes) of images (N, C, H, W).
    pub fn logits(&self, tape: &mut Tape, rec: &mut Recorder<'_>, images: &Tensor) -> Result<Var> {
        self.expect(ConvArch::Convnet, "convnet logits")?;
        let c = &self.cfg;
        let n = self.batch_of(images)?;
        let x = tape.input(images.clone());
        let mut x = self.conv(tape, rec, x, "stem", K3)?;
        for s in 0..c.channels.len() {
            if s > 0 {
                x = self.conv(tape, rec, x, &format!("down.{s}"), K3_DOWN)?;
            }
            for b in 0..c.blocks {
                x = self.block(tape, rec, x, &format!("stages.{s}.{b}"), None)?;
            }
        }
        let x = self.norm_gelu(tape, rec, x, "head_norm")?;
        let edge = c.image_size >> (c.channels.len() - 1);
        let x = tape.avg_pool(rec, x, Pool::square(edge))?;
        let last = *c.channels.last().unwrap_or(&1);
        let x = tape.reshape(x, &[n, last])?;
        self.linear(tape, rec, x, "head")
    }

    /// The classifier's mean cross-entropy of the class scores of images (N, C, H, W)
    /// against labels (N) u32; the value is (mean, count).
    pub fn loss(
        &self,
        tape: &mut Tape,
        rec: &mut Recorder<'_>,
        images: &Tensor,
        labels: &Tensor,
    ) -> Result<Var> {
        let logits = self.logits(tape, rec, images)?;
        tape.cross_entropy(rec, logits, labels, CrossEntropyOpts::default())
    }

    /// The U-Net's predicted noise (N, C, H, W) in noisy images (N, C, H, W) at diffusion
    /// steps `t` (N) u32 of classes `classes` (N) u32.
    pub fn denoise(
        &self,
        tape: &mut Tape,
        rec: &mut Recorder<'_>,
        noisy: &Tensor,
        t: &Tensor,
        classes: &Tensor,
    ) -> Result<Var> {
        self.expect(ConvArch::Unet, "unet denoise")?;
        let c = &self.cfg;
        let n = self.batch_of(noisy)?;
        for (what, ids) in [("t", t), ("classes", classes)] {
            if ids.shape() != [n] {
                return Err(Error::Shape {
                    op: "unet denoise",
                    detail: format!("{what} {:?} for {n} images", ids.shape()),
                });
            }
        }
        let te = self.p(tape, "time_emb.weight")?;
        let ce = self.p(tape, "class_emb.weight")?;
        let te = tape.embedding(rec, te, t)?;
        let ce = tape.embedding(rec, ce, classes)?;
        let e = tape.add(rec, te, ce)?;
        let e = self.linear(tape, rec, e, "emb_proj")?;
        let e = tape.gelu(rec, e, GeluMode::Exact)?;
        let x = tape.input(noisy.clone());
        let mut x = self.conv(tape, rec, x, "stem", K3)?;
        let levels = c.channels.len();
        let mut skips = Vec::with_capacity(levels);
        for l in 0..levels {
            for b in 0..c.blocks {
                x = self.block(tape, rec, x, &format!("down.{l}.{b}"), Some(e))?;
            }
            skips.push(x);
            if l + 1 < levels {
                x = self.conv(tape, rec, x, &format!("downsample.{l}"), K3_DOWN)?;
            }
        }
        x = self.block(tape, rec, x, "mid", Some(e))?;
        for l in (0..levels).rev() {
            x = tape.add(rec, x, skips[l])?;
            for b in 0..c.blocks {
                x = self.block(tape, rec, x, &format!("up.{l}.{b}"), Some(e))?;
            }
            if l > 0 {
                x = tape.upsample_nearest(rec, x, (2, 2))?;
                x = self.conv(tape, rec, x, &format!("upsample.{l}"), K3)?;
            }
        }
        let x = self.norm_gelu(tape, rec, x, "out_norm")?;
        self.conv(tape, rec, x, "out", K3)
    }

    /// The U-Net's DDPM loss: the mean squared error of the noise predicted in `noisy`
    /// against `noise` (both (N, C, H, W)).
    pub fn diffusion_loss(
        &self,
        tape: &mut Tape,
        rec: &mut Recorder<'_>,
        batch: &DiffusionTensors,
    ) -> Result<Var> {
        let pred = self.denoise(tape, rec, &batch.noisy, &batch.t, &batch.classes)?;
        tape.mse_loss(rec, pred, &batch.noise)
    }

    /// Parameters AdamW decays: conv kernels, linear matrices and embedding tables;
    /// biases and norms not.
    pub fn decayed(&self) -> Vec<bool> {
        self.params
            .values
            .iter()
            .map(|t| t.shape().len() >= 2)
            .collect()
    }

    /// `n` images of class `class` drawn by DDPM's ancestral sampling from noise of
    /// `seed` (N, C, H, W) in [-1, 1]; `on_step` hears each step done (of T).
    pub async fn sample_async(
        &self,
        gpu: &Gpu,
        class: usize,
        n: usize,
        seed: u64,
        on_step: &mut dyn FnMut(usize, usize),
    ) -> Result<Vec<f32>> {
        self.expect(ConvArch::Unet, "sample")?;
        let c = &self.cfg;
        if class >= c.classes || n == 0 {
            return Err(Error::Invalid {
                op: "sample",
                detail: format!(
                    "class {class} of {} (0..{}), {n} images (at least 1)",
                    c.classes, c.classes
                ),
            });
        }
        let sched = Schedule::new(c.steps());
        let [ci, h, w] = c.image_shape();
        let mut rng = Rng::new(seed);
        let mut x: Vec<f64> = super::normals_keyed(rng.next_u64(), n * ci * h * w)
            .into_iter()
            .map(f64::from)
            .collect();
        let classes = Tensor::from_u32(gpu, &[n], &vec![class as u32; n], "classes")?;
        let steps = c.steps();
        for t in (0..steps).rev() {
            let xs: Vec<f32> = x.iter().map(|&v| v as f32).collect();
            let noisy = Tensor::from_f32(gpu, &[n, ci, h, w], &xs, "noisy")?;
            let ts = Tensor::from_u32(gpu, &[n], &vec![t as u32; n], "t")?;
            let mut tape = Tape::new();
            tape.set_grad_enabled(false);
            let eps = gpu
                .run_async(|rec| {
                    let e = self.denoise(&mut tape, rec, &noisy, &ts, &classes)?;
                    Ok(tape.value(e)?.clone())
                })
                .await?
                .to_vec_f32(gpu)
                .await?;
            let (beta, abar) = (sched.betas[t], sched.alpha_bar[t]);
            let coef = beta / (1.0 - abar).sqrt();
            let scale = 1.0 / (1.0 - beta).sqrt();
            let sigma = sched.posterior_std(t);
            let z = if t > 0 {
                super::normals_keyed(rng.next_u64(), x.len())
            } else {
                vec![0.0; x.len()]
            };
            for ((v, &e), &zi) in x.iter_mut().zip(&eps).zip(&z) {
                *v = scale * (*v - coef * e as f64) + sigma * zi as f64;
            }
            on_step(steps - t, steps);
        }
        Ok(x.iter().map(|&v| v.clamp(-1.0, 1.0) as f32).collect())
    }
}

/// DDPM's noise schedule over T steps: betas linear from 1e-4 to 0.02 (scaled by
/// 1000 / T, so that a shorter chain ends as noisy), and the products of (1 - beta).
pub struct Schedule {
    pub betas: Vec<f64>,
    pub alpha_bar: Vec<f64>,
}

impl Schedule {
    pub fn new(steps: usize) -> Schedule {
        let scale = 1000.0 / steps as f64;
        let (lo, hi) = (scale * 1e-4, (scale * 0.02).min(0.999));
        let betas: Vec<f64> = (0..steps)
            .map(|i| lo + (hi - lo) * i as f64 / (steps - 1).max(1) as f64)
            .collect();
        let mut prod = 1.0;
        let alpha_bar = betas
            .iter()
            .map(|b| {
                prod *= 1.0 - b;
                prod
            })
            .collect();
        Schedule { betas, alpha_bar }
    }

    /// sqrt of the posterior variance beta_t (1 - abar_{t-1}) / (1 - abar_t); 0 at t = 0.
    pub fn posterior_std(&self, t: usize) -> f64 {
        if t == 0 {
            return 0.0;
        }
        let (b, a, prev) = (self.betas[t], self.alpha_bar[t], self.alpha_bar[t - 1]);
        (b * (1.0 - prev) / (1.0 - a)).sqrt()
    }
}

/// One DDPM batch on the host: noisy images x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t)
/// noise, their steps t, classes and the noise (the target).
#[derive(Clone, Debug, PartialEq)]
pub struct DiffusionBatch {
    pub noisy: Vec<f32>,
    pub t: Vec<u32>,
    pub classes: Vec<u32>,
    pub noise: Vec<f32>,
}

impl DiffusionBatch {
    /// Noises images `x0` (N x `pixels`) of `classes` with steps and noise drawn from
    /// `key`.
    pub fn new(sched: &Schedule, x0: &[f32], classes: Vec<u32>, pixels: usize, key: u64) -> Self {
        let mut rng = Rng::new(key);
        let n = classes.len();
        let t: Vec<u32> = (0..n)
            .map(|_| (rng.next_u64() % sched.betas.len() as u64) as u32)
            .collect();
        let noise = super::normals_keyed(rng.next_u64(), n * pixels);
        // sqrt(alpha_bar) and sqrt(1 - alpha_bar) of each image's step.
        let coef: Vec<(f64, f64)> = (t.iter())
            .map(|&s| {
                let a = sched.alpha_bar[s as usize];
                (a.sqrt(), (1.0 - a).sqrt())
            })
            .collect();
        let noisy = x0
            .iter()
            .zip(&noise)
            .enumerate()
            .map(|(i, (&x, &e))| {
                let (ca, cn) = coef[i / pixels];
                (ca * x as f64 + cn * e as f64) as f32
            })
            .collect();
        DiffusionBatch {
            noisy,
            t,
            classes,
            noise,
        }
    }

    /// The batch on the GPU, images of shape (C, H, W).
    pub fn upload(&self, gpu: &Gpu, [c, h, w]: [usize; 3]) -> Result<DiffusionTensors> {
        let n = self.t.len();
        Ok(DiffusionTensors {
            noisy: Tensor::from_f32(gpu, &[n, c, h, w], &self.noisy, "noisy")?,
            t: Tensor::from_u32(gpu, &[n], &self.t, "t")?,
            classes: Tensor::from_u32(gpu, &[n], &self.classes, "classes")?,
            noise: Tensor::from_f32(gpu, &[n, c, h, w], &self.noise, "noise")?,
        })
    }
}

pub struct DiffusionTensors {
    pub noisy: Tensor,
    pub t: Tensor,
    pub classes: Tensor,
    pub noise: Tensor,
}
