//! LoRA adapters (Hu et al. 2021, as PEFT implements them) on a Llama-family model's
//! projections: for a frozen W (out, in) the layer computes
//!   y = x W^T + s (dropout(x) A^T) B^T,   A (r, in), B (out, r), s = alpha / r
//! with A drawn as PEFT's kaiming_uniform(a = sqrt(5)) (uniform in +-1/sqrt(in)) and B
//! zero, so a fresh adapter leaves the model unchanged. Only A and B train. Their names
//! are PEFT's (`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`, ...).

use crate::autograd::{ParamStore, Tape, Var};
use crate::check::Rng;
use crate::error::{Error, Result};
use crate::gpu::{Gpu, Recorder, Tensor};
use crate::models::llama::LlamaConfig;

/// A projection LoRA can adapt, with PEFT's module name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Target {
    #[serde(rename = "q_proj")]
    Q,
    #[serde(rename = "k_proj")]
    K,
    #[serde(rename = "v_proj")]
    V,
    #[serde(rename = "o_proj")]
    O,
    #[serde(rename = "gate_proj")]
    Gate,
    #[serde(rename = "up_proj")]
    Up,
    #[serde(rename = "down_proj")]
    Down,
}

impl Target {
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// PEFT's module name (`q_proj`, ...).
    pub fn peft(self) -> &'static str {
        match self {
            Target::Q => "q_proj",
            Target::K => "k_proj",
            Target::V => "v_proj",
            Target::O => "o_proj",
            Target::Gate => "gate_proj",
            Target::Up => "up_proj",
            Target::Down => "down_proj",
        }
    }

    /// The block holding it in Hugging Face's Llama (`self_attn` or `mlp`).
    pub fn block(self) -> &'static str {
        match self {
            Target::Q | Target::K | Target::V | Target::O => "self_attn",
            _ => "mlp",
        }
    }

    /// (in, out) features of the projection in a model of `cfg`'s shapes.
    pub fn dims(self, cfg: &LlamaConfig) -> (usize, usize) {
        let (e, d, f) = (cfg.n_embd, cfg.head_dim, cfg.ffn_hidden);
        match self {
            Target::Q => (e, cfg.n_head * d),
            Target::K | Target::V => (e, cfg.n_kv_head * d),
            Target::O => (cfg.n_head * d, e),
            Target::Gate | Target::Up => (e, f),
            Target::Down => (f, e),
        }
    }

    fn index(self) -> usize {
        Target::ALL.iter().position(|&t| t == self).expect("listed")
    }
}

/// Rank, alpha, dropout and the adapted projections.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSpec {
    pub rank: usize,
    pub alpha: f64,
    /// Dropout on x before A (PEFT's lora_dropout), training steps only.
    pub dropout: f64,
    pub targets: Vec<Target>,
}

impl LoraSpec {
    /// The update's scale s = alpha / r.
    pub fn scaling(&self) -> f64 {
        self.alpha / self.rank as f64
    }
}

/// The adapters of one model: A and B of every adapted projection of every layer.
pub struct Lora {
    pub spec: LoraSpec,
    /// A, B of each (layer, target) in layer order, targets in [`Target::ALL`]'s order,
    /// under PEFT's names.
    pub params: ParamStore,
    /// (A, B) indices in `params` per layer and target.
    slots: Vec<[Option<(usize, usize)>; 7]>,
}

/// PEFT's name of a layer's adapter matrix (`which`: "lora_A" or "lora_B").
pub fn peft_name(layer: usize, t: Target, which: &str) -> String {
    format!(
        "base_model.model.model.layers.{layer}.{}.{}.{which}.weight",
        t.block(),
        t.peft()
    )
}

impl Lora {
    /// Fresh adapters for a model of `cfg`'s shapes: A uniform in +-1/sqrt(in) from `seed`
    /// (PEFT's init), B zero. Refuses a rank of 0 or larger than a layer's smaller side,
    /// dropout outside [0, 1), no targets.
    pub fn new(gpu: &Gpu, cfg: &LlamaConfig, spec: LoraSpec, seed: u64) -> Result<Lora> {
        let mut rng = Rng::new(seed);
        Lora::build(gpu, cfg, spec, |_, _, (rows, cols), which| {
            Ok(match which {
                "lora_A" => {
                    let bound = 1.0 / (cols as f64).sqrt();
                    (0..rows * cols)
                        .map(|_| ((2.0 * rng.uniform() as f64 - 1.0) * bound) as f32)
                        .collect()
                }
                _ => vec![0.0; rows * cols],
            })
        })
    }

    /// Adapters whose matrices `init(layer, target, (rows, cols), "lora_A" | "lora_B")`
    /// gives (row-major f32 values).
    pub fn build(
        gpu: &Gpu,
        cfg: &LlamaConfig,
        spec: LoraSpec,
        mut init: impl FnMut(usize, Target, (usize, usize), &str) -> Result<Vec<f32>>,
    ) -> Result<Lora> {
        let bad = |detail: String| Error::Invalid { op: "lora", detail };
        if spec.targets.is_empty() {
            return Err(bad("no target modules".into()));
        }
        if !(0.0..1.0).contains(&spec.dropout) {
            return Err(bad(format!("lora dropout {} not in [0, 1)", spec.dropout)));
        }
        if !(spec.alpha.is_finite() && spec.alpha > 0.0) {
            return Err(bad(format!("lora alpha {} must be positive", spec.alpha)));
        }
        for &t in &spec.targets {
            let (i, o) = t.dims(cfg);
            if spec.rank == 0 || spec.rank > i.min(o) {
                return Err(bad(format!(
                    "rank {} for {} ({o} x {i}): must be 1 ..= {}",
                    spec.rank,
                    t.peft(),
                    i.min(o)
                )));
            }
        }
        let mut params = ParamStore::default();
        let mut slots = vec![[None; 7]; cfg.n_layer];
        for (l, slot) in slots.iter_mut().enumerate() {
            for t in Target::ALL {
                if !spec.targets.contains(&t) {
                    continue;
                }
                let (i, o) = t.dims(cfg);
                let mut push = |which: &str, shape: [usize; 2]| -> Result<usize> {
                    let v = init(l, t, (shape[0], shape[1]), which)?;
                    let name = peft_name(l, t, which);
                    let tensor = Tensor::from_f32(gpu, &shape, &v, &name)?;
                    Ok(params.push(name, tensor))
                };
                let a = push("lora_A", [spec.rank, i])?;
                let b = push("lora_B", [o, spec.rank])?;
                slot[t.index()] = Some((a, b));
            }
        }
        Ok(Lora {
            spec,
            params,
            slots,
        })
    }

    /// Checks that these adapters were made for a model of `cfg`'s shapes: as many layers,
    /// every adapted projection's A (r, in) and B (out, r) of its size.
    pub fn fits(&self, cfg: &LlamaConfig) -> Result<()> {
        let bad = |detail: String| Error::Invalid { op: "lora", detail };
        if self.slots.len() != cfg.n_layer {
            return Err(bad(format!(
                "adapters for {} layers on a model of {}",
                self.slots.len(),
                cfg.n_layer
            )));
        }
        for (l, slot) in self.slots.iter().enumerate() {
            for t in Target::ALL {
                let Some((a, b)) = slot[t.index()] else {
                    continue;
                };
                let (i, o) = t.dims(cfg);
                let (sa, sb) = (self.params.values[a].shape(), self.params.values[b].shape());
                if sa != [self.spec.rank, i] || sb != [o, self.spec.rank] {
                    return Err(bad(format!(
                        "layer {l} {}: A {sa:?} and B {sb:?}, this model needs [{}, {i}] and [{o}, {}]",
                        t.peft(),
                        self.spec.rank,
                        self.spec.rank
                    )));
                }
            }
        }
        Ok(())
    }

    /// (A, B) of layer `layer`'s `t`, when adapted.
    pub fn slot(&self, layer: usize, t: Target) -> Option<(usize, usize)> {
        self.slots.get(layer).and_then(|s| s[t.index()])
    }

    /// Inference: adds scale s (x A^T) B^T of layer `layer`'s `t` into columns
    /// `start ..` of `y` (.., C) in place (`mul` times the adapter's own scale: `--lora-scale`),
    /// x (.., in); nothing when `t` is not adapted. The base product is left as it is (no
    /// merged copy of W).
    #[allow(clippy::too_many_arguments)]
    pub fn add_into(
        &self,
        rec: &mut Recorder<'_>,
        layer: usize,
        t: Target,
        x: &Tensor,
        y: &Tensor,
        start: usize,
        mul: f32,
    ) -> Result<()> {
        use crate::ops::matmul::{matmul, MatmulOpts};
        let Some((a, b)) = self.slot(layer, t) else {
            return Ok(());
        };
        let (pa, pb) = (&self.params.values[a], &self.params.values[b]);
        let rows = x.numel() / pa.shape()[1];
        let x2 = x.reshape(&[rows, pa.shape()[1]])?;
        let tb = MatmulOpts {
            trans_b: true,
            ..Default::default()
        };
        let h = matmul(rec, &x2, pa, tb)?; // (rows, r)
        let scaled = MatmulOpts {
            trans_b: true,
            alpha: self.spec.scaling() as f32 * mul,
            ..Default::default()
        };
        let d = matmul(rec, &h, pb, scaled)?; // (rows, out)
        let cols = y.shape().last().copied().unwrap_or(0);
        let y2 = y.reshape(&[rows, cols])?;
        crate::ops::columns::place(rec, &d, start, cols, Some(&y2))?;
        Ok(())
    }

    /// y + s (dropout(x) A^T) B^T for layer `layer`'s `t` (y itself when not adapted);
    /// dropout only with `drop_seed` (a training step's).
    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &self,
        tape: &mut Tape,
        rec: &mut Recorder<'_>,
        layer: usize,
        t: Target,
        x: Var,
        y: Var,
        drop_seed: Option<u64>,
    ) -> Result<Var> {
        let Some((a, b)) = self.slot(layer, t) else {
            return Ok(y);
        };
        let x = match drop_seed {
            Some(seed) if self.spec.dropout > 0.0 => {
                let site = (layer * 7 + t.index()) as u64;
                let s = crate::models::transformer::site_seed(seed, site);
                tape.dropout(rec, x, self.spec.dropout, s)?
            }
            _ => x,
        };
        let (va, vb) = (tape.param(&self.params, a), tape.param(&self.params, b));
        let h = tape.linear(rec, x, va, None)?; // (.., r)
        let d = tape.linear(rec, h, vb, None)?; // (.., out)
        let d = tape.scale(rec, d, self.spec.scaling() as f32)?;
        tape.add(rec, y, d)
    }
}
