//! The conv-net image classifier, recorded on the autograd tape and trained by the same
//! trainer as the transformer (`doppler train --config configs/digits_cnn.toml`).
//!
//! Shapes (N images, C_s the width of stage s, H x W halved at each stage after the first):
//!   stem:      conv 3x3, pad 1            (N, C_in, H, W)   -> (N, C_0, H, W)
//!   stage s:   (s > 0) conv 3x3, stride 2, pad 1: (N, C_{s-1}, H, W) -> (N, C_s, H/2, W/2)
//!              then `blocks` residual blocks, each
//!                x + conv2(gelu(norm2(conv1(gelu(norm1(x))))))   (convs 3x3, pad 1)
//!   head:      gelu(norm(x)), global average pool -> (N, C_last), linear -> (N, classes)
//! Norms are GroupNorm over `groups` groups, GELU the exact (erf) one, every conv and the
//! linear head have biases. The parameter names are those of the PyTorch twin's
//! state_dict (bench/torch_convnet.py).

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

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ConvArch {
    /// The residual classifier above.
    Convnet,
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
            return bad(format!("classes {} must be at least 2", c.classes));
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

    /// The (C, H, W) of one input image.
    pub fn image_shape(&self) -> [usize; 3] {
        [self.in_channels, self.image_size, self.image_size]
    }
}

/// How a parameter starts: PyTorch's default for convs and linears (uniform in
/// +-1/sqrt(fan_in), weights and biases alike), or a constant (norms: 1 and 0).
enum Init {
    Uniform(usize),
    Const(f32),
}

const K3: Conv2dOpts = Conv2dOpts {
    stride: (1, 1),
    padding: (1, 1),
    dilation: (1, 1),
    groups: 1,
};

/// (name, shape, init) of every parameter, in store order.
fn layout(cfg: &ConvConfig) -> Vec<(String, Vec<usize>, Init)> {
    let mut out = Vec::new();
    let conv = |out: &mut Vec<(String, Vec<usize>, Init)>, name: String, cin, cout| {
        let fan = cin * 9;
        out.push((
            format!("{name}.weight"),
            vec![cout, cin, 3, 3],
            Init::Uniform(fan),
        ));
        out.push((format!("{name}.bias"), vec![cout], Init::Uniform(fan)));
    };
    let norm = |out: &mut Vec<(String, Vec<usize>, Init)>, name: String, c| {
        out.push((format!("{name}.weight"), vec![c], Init::Const(1.0)));
        out.push((format!("{name}.bias"), vec![c], Init::Const(0.0)));
    };
    let ch = &cfg.channels;
    conv(&mut out, "stem".into(), cfg.in_channels, ch[0]);
    for (s, &c) in ch.iter().enumerate() {
        if s > 0 {
            conv(&mut out, format!("down.{s}"), ch[s - 1], c);
        }
        for b in 0..cfg.blocks {
            let p = format!("stages.{s}.{b}");
            norm(&mut out, format!("{p}.norm1"), c);
            conv(&mut out, format!("{p}.conv1"), c, c);
            norm(&mut out, format!("{p}.norm2"), c);
            conv(&mut out, format!("{p}.conv2"), c, c);
        }
    }
    let last = *ch.last().unwrap_or(&1);
    norm(&mut out, "head_norm".into(), last);
    out.push((
        "head.weight".into(),
        vec![cfg.classes, last],
        Init::Uniform(last),
    ));
    out.push(("head.bias".into(), vec![cfg.classes], Init::Uniform(last)));
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

    /// Class scores (N, classes) of images (N, C, H, W).
    pub fn logits(&self, tape: &mut Tape, rec: &mut Recorder<'_>, images: &Tensor) -> Result<Var> {
        let c = &self.cfg;
        let [ci, h, w] = c.image_shape();
        let n = match *images.shape() {
            [n, a, b, d] if [a, b, d] == [ci, h, w] && n > 0 => n,
            _ => {
                return Err(Error::Shape {
                    op: "convnet",
                    detail: format!(
                        "images {:?}, the config's are (N, {ci}, {h}, {w})",
                        images.shape()
                    ),
                })
            }
        };
        let x = tape.input(images.clone());
        let mut x = self.conv(tape, rec, x, "stem", K3)?;
        for s in 0..c.channels.len() {
            if s > 0 {
                let down = Conv2dOpts {
                    stride: (2, 2),
                    ..K3
                };
                x = self.conv(tape, rec, x, &format!("down.{s}"), down)?;
            }
            for b in 0..c.blocks {
                let p = format!("stages.{s}.{b}");
                let y = self.norm_gelu(tape, rec, x, &format!("{p}.norm1"))?;
                let y = self.conv(tape, rec, y, &format!("{p}.conv1"), K3)?;
                let y = self.norm_gelu(tape, rec, y, &format!("{p}.norm2"))?;
                let y = self.conv(tape, rec, y, &format!("{p}.conv2"), K3)?;
                x = tape.add(rec, x, y)?;
            }
        }
        let x = self.norm_gelu(tape, rec, x, "head_norm")?;
        let edge = c.image_size >> (c.channels.len() - 1);
        let x = tape.avg_pool(rec, x, Pool::square(edge))?;
        let last = *c.channels.last().unwrap_or(&1);
        let x = tape.reshape(x, &[n, last])?;
        let w = self.p(tape, "head.weight")?;
        let b = self.p(tape, "head.bias")?;
        tape.linear(rec, x, w, Some(b))
    }

    /// Mean cross-entropy of the class scores of images (N, C, H, W) against labels (N)
    /// u32; the value is (mean, count).
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

    /// Parameters AdamW decays: conv kernels and the head's matrix; biases and norms not.
    pub fn decayed(&self) -> Vec<bool> {
        self.params
            .values
            .iter()
            .map(|t| t.shape().len() >= 2)
            .collect()
    }
}
