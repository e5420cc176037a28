//! A decoder-only transformer for training, in two flavours:
//! - `gpt2`: LayerNorm, GELU (tanh), learned positions, biases, tied embeddings;
//! - `llama`: RMSNorm, RoPE (rotate-half pairing), SwiGLU, grouped-query attention, no biases.
//! Every op records on an autograd [`Tape`]; the backward is the tape's.
//!
//! Shapes: B batch, T time, C = n_embd, H heads, Hkv key/value heads, D = C / H, V vocab.

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::autograd::{ParamStore, Tape, Var};
use crate::check::Rng;
use crate::error::{Error, Result};
use crate::gpu::{Gpu, Recorder, Tensor};
use crate::ops::attention::{AttnDropout, AttnOpts, MAX_HEAD_DIM};
use crate::ops::cross_entropy::CrossEntropyOpts;
use crate::ops::gelu::GeluMode;
use crate::ops::rope::{Pairing, RopeTable};

/// Bounds on a training config's sizes (a model past them holds more than 2^36 parameters
/// or positions no GPU keeps).
const MAX_LAYERS: usize = 1000;
const MAX_BLOCK: usize = 1 << 20;
const MAX_PARAMS: u128 = 1 << 36;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    Gpt2,
    Llama,
}

/// How the weights start. Both draw matrices from N(0, 0.02) with the residual
/// projections scaled by 1/sqrt(2 n_layer), biases 0 and norm weights 1; they differ in
/// gpt2's learned positions:
/// - `gpt2` (the default): N(0, 0.01), as OpenAI's GPT-2 code drew them;
/// - `nanogpt`: N(0, 0.02), as nanoGPT does (its curves need it: docs/benchmarks.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InitScheme {
    #[default]
    Gpt2,
    Nanogpt,
}

impl InitScheme {
    /// The standard deviation of gpt2's position embedding.
    pub fn pos_std(self) -> f64 {
        match self {
            InitScheme::Gpt2 => 0.01,
            InitScheme::Nanogpt => 0.02,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub arch: Arch,
    /// Set from the tokenizer when training.
    #[serde(default)]
    pub vocab_size: usize,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    /// Key/value heads (grouped-query attention); n_head when absent. Llama only.
    #[serde(default)]
    pub n_kv_head: Option<usize>,
    /// Longest sequence (positions).
    pub block_size: usize,
    /// MLP hidden width; 4 C for gpt2, 8/3 C rounded up to a multiple of 32 for llama.
    #[serde(default)]
    pub ffn_hidden: Option<usize>,
    #[serde(default = "default_eps")]
    pub norm_eps: f32,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    /// Output head shares the token embedding; gpt2: always; llama: default false.
    #[serde(default)]
    pub tie_embeddings: Option<bool>,
    /// Dropout on the embeddings' sum and on each residual branch (nanoGPT's `dropout`,
    /// GPT-2's embd_pdrop and resid_pdrop); training steps only, never evaluation.
    #[serde(default)]
    pub dropout: f64,
    /// Dropout on the attention probabilities (GPT-2's attn_pdrop); `dropout` when absent,
    /// as nanoGPT's one `dropout` covers both.
    #[serde(default)]
    pub attn_dropout: Option<f64>,
    /// The initial weights' scheme (see [`InitScheme`]).
    #[serde(default)]
    pub init: InitScheme,
}

fn default_eps() -> f32 {
    1e-5
}

fn default_theta() -> f64 {
    10000.0
}

impl ModelConfig {
    pub fn kv_heads(&self) -> usize {
        self.n_kv_head.unwrap_or(self.n_head)
    }

    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head.max(1)
    }

    pub fn hidden(&self) -> usize {
        self.ffn_hidden.unwrap_or(match self.arch {
            Arch::Gpt2 => self.n_embd.saturating_mul(4),
            Arch::Llama => (self.n_embd.saturating_mul(8) / 3).saturating_add(31) / 32 * 32,
        })
    }

    /// The attention probabilities' dropout: `attn_dropout`, else `dropout`.
    pub fn attn_drop(&self) -> f64 {
        self.attn_dropout.unwrap_or(self.dropout)
    }

    pub fn tied(&self) -> bool {
        match self.arch {
            Arch::Gpt2 => true,
            Arch::Llama => self.tie_embeddings.unwrap_or(false),
        }
    }

    /// Every constraint the kernels put on the shapes, as one clear error.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| {
            Err(Error::Invalid {
                op: "model config",
                detail: why,
            })
        };
        if self.vocab_size == 0
            || self.n_layer == 0
            || self.n_embd == 0
            || self.n_head == 0
            || self.block_size == 0
        {
            return bad(format!(
                "vocab_size {}, n_layer {}, n_embd {}, n_head {}, block_size {} must all be positive",
                self.vocab_size, self.n_layer, self.n_embd, self.n_head, self.block_size
            ));
        }
        if self.n_embd % self.n_head != 0 {
            return bad(format!(
                "n_embd {} is not a multiple of n_head {}",
                self.n_embd, self.n_head
            ));
        }
        let d = self.head_dim();
        if d % 4 != 0 || d > MAX_HEAD_DIM {
            return bad(format!(
                "head dim {d} (n_embd / n_head) must be a multiple of 4 up to {MAX_HEAD_DIM}"
            ));
        }
        let kv = self.kv_heads();
        if kv == 0 || self.n_head % kv != 0 {
            return bad(format!(
                "n_head {} is not a multiple of n_kv_head {kv}",
                self.n_head
            ));
        }
        if self.arch == Arch::Gpt2
            && (self.n_kv_head.is_some_and(|k| k != self.n_head)
                || self.tie_embeddings == Some(false))
        {
            return bad("gpt2 has n_kv_head = n_head and tied embeddings".into());
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad(format!("dropout {} not in [0, 1)", self.dropout));
        }
        if !(0.0..1.0).contains(&self.attn_drop()) {
            return bad(format!("attn_dropout {} not in [0, 1)", self.attn_drop()));
        }
        if self.ffn_hidden == Some(0) {
            return bad("ffn_hidden 0: the MLP needs a positive width".into());
        }
        if !(self.norm_eps > 0.0 && self.norm_eps.is_finite()) {
            return bad(format!("norm_eps {} must be positive", self.norm_eps));
        }
        if !(self.rope_theta > 0.0 && self.rope_theta.is_finite()) {
            return bad(format!("rope_theta {} must be positive", self.rope_theta));
        }
        // Sizes no GPU holds are refused here, before anything is allocated for them.
        if self.n_layer > MAX_LAYERS || self.block_size > MAX_BLOCK {
            return bad(format!(
                "n_layer {} (at most {MAX_LAYERS}), block_size {} (at most {MAX_BLOCK})",
                self.n_layer, self.block_size
            ));
        }
        let (c, v, f) = (
            self.n_embd as u128,
            self.vocab_size as u128,
            self.hidden() as u128,
        );
        let kvc = (self.kv_heads() * d) as u128;
        let layer = 2 * c * c + 2 * c * kvc + 3 * c * f + 4 * c + 2 * kvc + f;
        let params = (v * c) * 2 + self.block_size as u128 * c + self.n_layer as u128 * layer;
        if params > MAX_PARAMS {
            return bad(format!(
                "about {params} parameters (vocab_size {}, n_layer {}, n_embd {}, MLP {}): more than 2^36, past any GPU's memory",
                self.vocab_size, self.n_layer, self.n_embd, self.hidden()
            ));
        }
        Ok(())
    }
}

/// Dropout sites of a step: 0 the embeddings, 2l + 1 and 2l + 2 layer l's attention and MLP
/// branches, ATTN_SITES + l layer l's attention probabilities.
pub const ATTN_SITES: u64 = 1 << 32;

/// The mask seed of dropout site `site` in the step whose dropout seed is `step_seed`
/// (shared with the f64 reference model).
pub fn site_seed(step_seed: u64, site: u64) -> u64 {
    step_seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(site)
}

/// The weights (in a [`ParamStore`]) and the constant tables of a model.
pub struct Transformer {
    pub cfg: ModelConfig,
    pub params: ParamStore,
    index: HashMap<String, usize>,
    rope: Option<Arc<RopeTable>>,
}

/// (name, shape, init) of every parameter, in store order. Init: normal std, or a constant.
enum Init {
    Normal(f64),
    Const(f32),
}

fn layout(cfg: &ModelConfig) -> Vec<(String, Vec<usize>, Init)> {
    let (c, v, f, d) = (cfg.n_embd, cfg.vocab_size, cfg.hidden(), cfg.head_dim());
    let kvc = cfg.kv_heads() * d;
    // GPT-2's init: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer).
    let std = 0.02;
    let proj = std / (2.0 * cfg.n_layer as f64).sqrt();
    let mut out: Vec<(String, Vec<usize>, Init)> =
        vec![("tok_emb".into(), vec![v, c], Init::Normal(std))];
    let gpt = cfg.arch == Arch::Gpt2;
    if gpt {
        out.push((
            "pos_emb".into(),
            vec![cfg.block_size, c],
            Init::Normal(cfg.init.pos_std()),
        ));
    }
    for l in 0..cfg.n_layer {
        let n = |s: &str| format!("blocks.{l}.{s}");
        if gpt {
            out.push((n("ln1.weight"), vec![c], Init::Const(1.0)));
            out.push((n("ln1.bias"), vec![c], Init::Const(0.0)));
        } else {
            out.push((n("attn_norm.weight"), vec![c], Init::Const(1.0)));
        }
        for (name, rows) in [("q", c), ("k", kvc), ("v", kvc)] {
            out.push((
                n(&format!("attn.{name}.weight")),
                vec![rows, c],
                Init::Normal(std),
            ));
            if gpt {
                out.push((
                    n(&format!("attn.{name}.bias")),
                    vec![rows],
                    Init::Const(0.0),
                ));
            }
        }
        out.push((n("attn.o.weight"), vec![c, c], Init::Normal(proj)));
        if gpt {
            out.push((n("attn.o.bias"), vec![c], Init::Const(0.0)));
            out.push((n("ln2.weight"), vec![c], Init::Const(1.0)));
            out.push((n("ln2.bias"), vec![c], Init::Const(0.0)));
            out.push((n("mlp.fc.weight"), vec![f, c], Init::Normal(std)));
            out.push((n("mlp.fc.bias"), vec![f], Init::Const(0.0)));
            out.push((n("mlp.proj.weight"), vec![c, f], Init::Normal(proj)));
            out.push((n("mlp.proj.bias"), vec![c], Init::Const(0.0)));
        } else {
            out.push((n("mlp_norm.weight"), vec![c], Init::Const(1.0)));
            out.push((n("mlp.gate.weight"), vec![f, c], Init::Normal(std)));
            out.push((n("mlp.up.weight"), vec![f, c], Init::Normal(std)));
            out.push((n("mlp.down.weight"), vec![c, f], Init::Normal(proj)));
        }
    }
    out.push(("norm.weight".into(), vec![c], Init::Const(1.0)));
    if gpt {
        out.push(("norm.bias".into(), vec![c], Init::Const(0.0)));
    }
    if !cfg.tied() {
        out.push(("lm_head.weight".into(), vec![v, c], Init::Normal(std)));
    }
    out
}

impl Transformer {
    /// Fresh weights from `seed`.
    pub fn new(gpu: &Gpu, cfg: &ModelConfig, seed: u64) -> Result<Transformer> {
        cfg.validate()?;
        let mut rng = Rng::new(seed);
        let weights = layout(cfg)
            .into_iter()
            .map(|(name, shape, init)| {
                let n: usize = shape.iter().product();
                let data = match init {
                    Init::Normal(std) => super::normals(&mut rng, n, std),
                    Init::Const(c) => vec![c; n],
                };
                (name, shape, data)
            })
            .collect();
        Transformer::from_weights(gpu, cfg, weights)
    }

    /// The expected (name, shape) of every weight, in store order.
    pub fn expected(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
        layout(cfg).into_iter().map(|(n, s, _)| (n, s)).collect()
    }

    /// A model from named f32 weights; every expected name must be present with its shape.
    pub fn from_weights(
        gpu: &Gpu,
        cfg: &ModelConfig,
        weights: Vec<(String, Vec<usize>, Vec<f32>)>,
    ) -> Result<Transformer> {
        cfg.validate()?;
        let (params, index) = super::store_weights(gpu, Transformer::expected(cfg), weights)?;
        let rope = match cfg.arch {
            Arch::Llama => Some(Arc::new(RopeTable::new(
                gpu,
                cfg.block_size,
                cfg.head_dim(),
                cfg.rope_theta,
            )?)),
            Arch::Gpt2 => None,
        };
        Ok(Transformer {
            cfg: cfg.clone(),
            params,
            index,
            rope,
        })
    }

    fn p(&self, tape: &mut Tape, name: &str) -> Var {
        tape.param(&self.params, self.index[name])
    }

    /// Logits (B, T, V) for token ids (B, T) u32. A training step passes `dropout_seed`
    /// (it varies the masks per step and micro-batch: [`dropout_seed`] of it and the site);
    /// evaluation and sampling pass None and run without dropout, as PyTorch's eval mode.
    pub fn logits(
        &self,
        tape: &mut Tape,
        rec: &mut Recorder<'_>,
        ids: &Tensor,
        dropout_seed: Option<u64>,
    ) -> Result<Var> {
        let cfg = &self.cfg;
        let [b, t] = *ids.shape() else {
            return Err(Error::Shape {
                op: "transformer",
                detail: format!("ids {:?}, expected (B, T)", ids.shape()),
            });
        };
        if t == 0 || t > cfg.block_size {
            return Err(Error::Shape {
                op: "transformer",
                detail: format!("sequence length {t} not in 1..={}", cfg.block_size),
            });
        }
        let (c, h, hkv, d) = (cfg.n_embd, cfg.n_head, cfg.kv_heads(), cfg.head_dim());
        let gpt = cfg.arch == Arch::Gpt2;
        let (drop, attn_drop) = match dropout_seed {
            Some(_) => (cfg.dropout, cfg.attn_drop()),
            None => (0.0, 0.0),
        };
        let seed = |site: u64| dropout_seed.map_or(0, |s| site_seed(s, site));
        let emb = self.p(tape, "tok_emb");
        let mut x = tape.embedding(rec, emb, ids)?; // (B, T, C)
        if gpt {
            let pos: Vec<u32> = (0..b * t).map(|i| (i % t) as u32).collect();
            let pos = Tensor::from_u32(rec.gpu(), &[b, t], &pos, "positions")?;
            let pe = self.p(tape, "pos_emb");
            let pe = tape.embedding(rec, pe, &pos)?;
            x = tape.add(rec, x, pe)?;
        }
        x = tape.dropout(rec, x, drop, seed(0))?;
        let eps = cfg.norm_eps;
        for l in 0..cfg.n_layer {
            let attn = AttnOpts {
                dropout: (attn_drop > 0.0).then(|| AttnDropout {
                    p: attn_drop,
                    seed: seed(ATTN_SITES + l as u64),
                }),
                ..AttnOpts::default()
            };
            let n = |s: &str| format!("blocks.{l}.{s}");
            // Attention: x += o(attention(q(h), k(h), v(h))), h = norm(x)
            let hn = if gpt {
                let (w, bb) = (self.p(tape, &n("ln1.weight")), self.p(tape, &n("ln1.bias")));
                tape.layer_norm(rec, x, w, bb, eps)?
            } else {
                let w = self.p(tape, &n("attn_norm.weight"));
                tape.rms_norm(rec, x, w, eps, false)?
            };
            let proj = |tape: &mut Tape,
                        rec: &mut Recorder<'_>,
                        name: &str,
                        heads: usize|
             -> Result<Var> {
                let w = self.p(tape, &n(&format!("attn.{name}.weight")));
                let bias = gpt.then(|| self.p(tape, &n(&format!("attn.{name}.bias"))));
                let y = tape.linear(rec, hn, w, bias)?;
                tape.reshape(y, &[b, t, heads, d]) // (B, T, heads, D)
            };
            let mut q = proj(tape, rec, "q", h)?;
            let mut k = proj(tape, rec, "k", hkv)?;
            let v = proj(tape, rec, "v", hkv)?;
            if let Some(table) = &self.rope {
                q = tape.rope(rec, q, table, 0, Pairing::Half)?;
                k = tape.rope(rec, k, table, 0, Pairing::Half)?;
            }
            let a = tape.attention(rec, q, k, v, attn)?; // (B, T, H, D)
            let a = tape.reshape(a, &[b, t, c])?;
            let (w, bb) = (
                self.p(tape, &n("attn.o.weight")),
                gpt.then(|| self.p(tape, &n("attn.o.bias"))),
            );
            let o = tape.linear(rec, a, w, bb)?;
            let o = tape.dropout(rec, o, drop, seed(2 * l as u64 + 1))?;
            x = tape.add(rec, x, o)?;
            // MLP: x += down(act(up(norm(x))))
            let m = if gpt {
                let (w, bb) = (self.p(tape, &n("ln2.weight")), self.p(tape, &n("ln2.bias")));
                let hn = tape.layer_norm(rec, x, w, bb, eps)?;
                let (w, bb) = (
                    self.p(tape, &n("mlp.fc.weight")),
                    self.p(tape, &n("mlp.fc.bias")),
                );
                let u = tape.linear(rec, hn, w, Some(bb))?; // (B, T, F)
                let u = tape.gelu(rec, u, GeluMode::Tanh)?;
                let (w, bb) = (
                    self.p(tape, &n("mlp.proj.weight")),
                    self.p(tape, &n("mlp.proj.bias")),
                );
                tape.linear(rec, u, w, Some(bb))?
            } else {
                let w = self.p(tape, &n("mlp_norm.weight"));
                let hn = tape.rms_norm(rec, x, w, eps, false)?;
                let (wg, wu) = (
                    self.p(tape, &n("mlp.gate.weight")),
                    self.p(tape, &n("mlp.up.weight")),
                );
                let gate = tape.linear(rec, hn, wg, None)?; // (B, T, F)
                let up = tape.linear(rec, hn, wu, None)?;
                let u = tape.swiglu(rec, gate, up)?;
                let w = self.p(tape, &n("mlp.down.weight"));
                tape.linear(rec, u, w, None)?
            };
            let m = tape.dropout(rec, m, drop, seed(2 * l as u64 + 2))?;
            x = tape.add(rec, x, m)?;
        }
        let w = self.p(tape, "norm.weight");
        x = if gpt {
            let bb = self.p(tape, "norm.bias");
            tape.layer_norm(rec, x, w, bb, eps)?
        } else {
            tape.rms_norm(rec, x, w, eps, false)?
        };
        let head = self.p(
            tape,
            if cfg.tied() {
                "tok_emb"
            } else {
                "lm_head.weight"
            },
        );
        tape.linear(rec, x, head, None) // (B, T, V)
    }

    /// Mean next-token cross-entropy of ids (B, T) against targets (B, T); the value is
    /// (mean, count). `dropout_seed` as [`Transformer::logits`]'s.
    pub fn loss(
        &self,
        tape: &mut Tape,
        rec: &mut Recorder<'_>,
        ids: &Tensor,
        targets: &Tensor,
        dropout_seed: Option<u64>,
    ) -> Result<Var> {
        let logits = self.logits(tape, rec, ids, dropout_seed)?;
        let v = self.cfg.vocab_size;
        let flat = tape.reshape(logits, &[ids.numel(), v])?;
        let targets = targets.reshape(&[ids.numel()])?;
        tape.cross_entropy(rec, flat, &targets, CrossEntropyOpts::default())
    }

    /// Weights and biases that AdamW decays (matrices, embeddings); norms' gains and biases
    /// are not decayed, as in GPT-2 / nanoGPT.
    pub fn decayed(&self) -> Vec<bool> {
        self.params
            .values
            .iter()
            .map(|t| t.shape().len() >= 2)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt2(init: &str) -> std::result::Result<ModelConfig, toml::de::Error> {
        toml::from_str(&format!(
            "arch = \"gpt2\"\nvocab_size = 10\nn_layer = 2\nn_embd = 8\nn_head = 2\nblock_size = 4\n{init}"
        ))
    }

    fn pos_std(cfg: &ModelConfig) -> Option<f64> {
        layout(cfg)
            .into_iter()
            .find_map(|(name, _, init)| match init {
                Init::Normal(s) if name == "pos_emb" => Some(s),
                _ => None,
            })
    }

    /// Found by doppler-fuzz: sizes no GPU holds went on to allocate their layout
    /// (n_layer = 10^9 asked the allocator for gigabytes before any check).
    #[test]
    fn sizes_past_any_gpu_are_refused_before_allocating() {
        let base = [
            "arch = \"llama\"",
            "n_layer = 2",
            "n_embd = 8",
            "n_head = 2",
            "block_size = 4",
            "vocab_size = 10",
        ];
        for (extra, want) in [
            ("n_layer = 1000000000", "n_layer 1000000000"),
            ("block_size = 1099511627776", "block_size 1099511627776"),
            ("ffn_hidden = 100000000000", "parameters"),
            ("vocab_size = 1000000000000", "parameters"),
        ] {
            let key = extra.split(" =").next().unwrap();
            let mut lines: Vec<&str> = base
                .iter()
                .copied()
                .filter(|l| !l.starts_with(key))
                .collect();
            lines.push(extra);
            let cfg: ModelConfig = toml::from_str(&lines.join("\n")).unwrap();
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains(want), "{extra}: {e}");
        }
    }

    #[test]
    fn the_init_scheme_sets_the_position_embedding_std() {
        let default = gpt2("").unwrap();
        assert_eq!(default.init, InitScheme::Gpt2);
        assert_eq!(pos_std(&default), Some(0.01));
        let nano = gpt2("init = \"nanogpt\"").unwrap();
        assert_eq!(pos_std(&nano), Some(0.02));
        // Everything else the same.
        let names = |c: &ModelConfig| -> Vec<(String, Vec<usize>)> {
            layout(c).into_iter().map(|(n, s, _)| (n, s)).collect()
        };
        assert_eq!(names(&default), names(&nano));
        let e = gpt2("init = \"xavier\"").unwrap_err().to_string();
        assert!(e.contains("xavier") && e.contains("nanogpt"), "{e}");
    }
}
