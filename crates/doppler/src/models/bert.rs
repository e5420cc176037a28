//! BERT-family sentence encoders (all-MiniLM-L6-v2, BGE-small, E5-small): a Hugging Face
//! directory (config.json, model.safetensors in f32, f16 or bf16, tokenizer.json) with, where
//! sentence-transformers wrote one, its modules.json (pooling, normalisation) and
//! sentence_bert_config.json (the longest input).
//!
//! One batch of B texts of T tokens each (H = hidden size, A heads of D = H / A):
//!   x = LN(word[ids] + position[0..T] + token_type[types])        (B, T, H)
//!   per layer: x = LN(x + (attend(x Wq^T + bq, x Wk^T + bk, x Wv^T + bv)) Wo^T + bo)
//!              x = LN(x + gelu(x Wi^T + bi) Wd^T + bd)           (post-norm; erf GELU)
//!   sentence = pool(x) (mean over the tokens, or the first token), L2-normalised when
//!   the model's modules say so
//! The attention is bidirectional. Texts are batched only with texts of the same length,
//! so no batch holds padding and no mask is needed: each sentence's numbers are those it
//! gets alone.

#[cfg(not(target_arch = "wasm32"))]
use std::collections::BTreeMap;
use std::path::Path;

use crate::error::{Error, Result};
use crate::gpu::{Gpu, Recorder, Tensor};
use crate::ops::attention::{attention, AttnOpts};
use crate::ops::gelu::{gelu, GeluMode};
use crate::ops::matmul::{matmul_bias, MatmulOpts};
use crate::ops::{elementwise, embedding::embedding, norm::layer_norm};

fn format_err(path: &Path, detail: impl Into<String>) -> Error {
    Error::Format {
        path: path.display().to_string(),
        detail: detail.into(),
    }
}

#[cfg(not(target_arch = "wasm32"))]
fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.display().to_string(),
        source,
    }
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct BertConfig {
    pub vocab_size: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub intermediate: usize,
    pub max_positions: usize,
    pub type_vocab: usize,
    pub eps: f64,
    #[serde(skip)]
    pub gelu: GeluMode,
}

/// How token vectors become one sentence vector (sentence-transformers' Pooling module).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pooling {
    Mean,
    Cls,
    Max,
}

impl BertConfig {
    pub fn from_json(json: &serde_json::Value, path: &Path) -> Result<BertConfig> {
        let ty = json
            .get("model_type")
            .and_then(|v| v.as_str())
            .unwrap_or("");
        if ty != "bert" {
            return Err(format_err(
                path,
                format!("model_type {ty:?}: the encoder runs bert models"),
            ));
        }
        let int = |k: &str| -> Result<usize> {
            json.get(k)
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .filter(|&v| v > 0)
                .ok_or_else(|| {
                    format_err(path, format!("{k} is missing or not a positive integer"))
                })
        };
        let gelu = match json.get("hidden_act").and_then(|v| v.as_str()) {
            None | Some("gelu") => GeluMode::Exact,
            Some("gelu_new" | "gelu_pytorch_tanh") => GeluMode::Tanh,
            Some(other) => {
                return Err(format_err(
                    path,
                    format!("hidden_act {other:?} is not supported (gelu, gelu_new)"),
                ))
            }
        };
        if let Some(p) = json
            .get("position_embedding_type")
            .and_then(|v| v.as_str())
            .filter(|p| *p != "absolute")
        {
            return Err(format_err(
                path,
                format!("position_embedding_type {p:?} is not supported (absolute)"),
            ));
        }
        let cfg = BertConfig {
            vocab_size: int("vocab_size")?,
            hidden: int("hidden_size")?,
            layers: int("num_hidden_layers")?,
            heads: int("num_attention_heads")?,
            intermediate: int("intermediate_size")?,
            max_positions: int("max_position_embeddings")?,
            type_vocab: int("type_vocab_size").unwrap_or(2),
            eps: json
                .get("layer_norm_eps")
                .and_then(|v| v.as_f64())
                .unwrap_or(1e-12),
            gelu,
        };
        let d = cfg.hidden / cfg.heads;
        if cfg.hidden % cfg.heads != 0 || d % 4 != 0 {
            return Err(format_err(
                path,
                format!(
                    "hidden size {} over {} heads: the head size must be a whole multiple of 4",
                    cfg.hidden, cfg.heads
                ),
            ));
        }
        if !(cfg.eps > 0.0 && cfg.eps.is_finite()) {
            return Err(format_err(
                path,
                format!("layer_norm_eps {} must be positive", cfg.eps),
            ));
        }
        Ok(cfg)
    }
}

struct Layer {
    q: (Tensor, Tensor),
    k: (Tensor, Tensor),
    v: (Tensor, Tensor),
    o: (Tensor, Tensor),
    ln1: (Tensor, Tensor),
    up: (Tensor, Tensor),
    down: (Tensor, Tensor),
    ln2: (Tensor, Tensor),
}

pub struct Bert {
    pub cfg: BertConfig,
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    ln: (Tensor, Tensor),
    layers: Vec<Layer>,
}

/// f32 values of a tensor stored as F32, F16 or BF16.
fn widen(path: &Path, name: &str, view: &safetensors::tensor::TensorView<'_>) -> Result<Vec<f32>> {
    let b = view.data();
    Ok(match view.dtype() {
        safetensors::Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        safetensors::Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        safetensors::Dtype::BF16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => {
            return Err(format_err(
                path,
                format!("{name}: dtype {other:?} not supported (f32, f16, bf16)"),
            ))
        }
    })
}

impl Bert {
    /// The encoder of a Hugging Face directory's config.json and model.safetensors.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn open(gpu: &Gpu, dir: &Path) -> Result<Bert> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(io(&cfg_path))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format_err(&cfg_path, e.to_string()))?;
        let cfg = BertConfig::from_json(&json, &cfg_path)?;
        let st_path = dir.join("model.safetensors");
        let bytes = std::fs::read(&st_path).map_err(io(&st_path))?;
        Bert::from_safetensors(gpu, cfg, &bytes, &st_path)
    }

    /// The encoder from a SafeTensors file's bytes (`path` names it in errors); names with
    /// or without the `bert.` prefix.
    pub fn from_safetensors(gpu: &Gpu, cfg: BertConfig, bytes: &[u8], path: &Path) -> Result<Bert> {
        let st = safetensors::SafeTensors::deserialize(bytes)
            .map_err(|e| format_err(path, e.to_string()))?;
        let (h, f) = (cfg.hidden, cfg.intermediate);
        let get = |name: &str, shape: &[usize]| -> Result<Tensor> {
            let view = st
                .tensor(name)
                .or_else(|_| st.tensor(&format!("bert.{name}")))
                .map_err(|_| format_err(path, format!("tensor {name} is missing")))?;
            if view.shape() != shape {
                return Err(format_err(
                    path,
                    format!(
                        "{name}: shape {:?}, the config needs {shape:?}",
                        view.shape()
                    ),
                ));
            }
            Tensor::from_f32(gpu, shape, &widen(path, name, &view)?, name)
        };
        let pair = |w: &str, b: &str, shape: &[usize]| -> Result<(Tensor, Tensor)> {
            Ok((get(w, shape)?, get(b, &shape[..1])?))
        };
        let mut layers = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let n = |s: &str| format!("encoder.layer.{i}.{s}");
            let lin = |s: &str, shape: &[usize]| {
                pair(&n(&format!("{s}.weight")), &n(&format!("{s}.bias")), shape)
            };
            layers.push(Layer {
                q: lin("attention.self.query", &[h, h])?,
                k: lin("attention.self.key", &[h, h])?,
                v: lin("attention.self.value", &[h, h])?,
                o: lin("attention.output.dense", &[h, h])?,
                ln1: lin("attention.output.LayerNorm", &[h])?,
                up: lin("intermediate.dense", &[f, h])?,
                down: lin("output.dense", &[h, f])?,
                ln2: lin("output.LayerNorm", &[h])?,
            });
        }
        Ok(Bert {
            word: get("embeddings.word_embeddings.weight", &[cfg.vocab_size, h])?,
            position: get(
                "embeddings.position_embeddings.weight",
                &[cfg.max_positions, h],
            )?,
            token_type: get(
                "embeddings.token_type_embeddings.weight",
                &[cfg.type_vocab, h],
            )?,
            ln: pair(
                "embeddings.LayerNorm.weight",
                "embeddings.LayerNorm.bias",
                &[h],
            )?,
            layers,
            cfg,
        })
    }

    /// The last hidden states (B, T, H) of B texts of T tokens each: `ids` and `types`
    /// (B T) row-major, every id below the vocabulary and every type below type_vocab_size.
    pub fn forward(
        &self,
        rec: &mut Recorder<'_>,
        ids: &[u32],
        types: &[u32],
        b: usize,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let t = ids.len() / b.max(1);
        let bad = |detail: String| Error::Invalid { op: "bert", detail };
        if b == 0 || t == 0 || ids.len() != b * t || types.len() != ids.len() {
            return Err(bad(format!(
                "{} ids and {} types for {b} texts: expected B T of each",
                ids.len(),
                types.len()
            )));
        }
        if t > c.max_positions {
            return Err(bad(format!(
                "{t} tokens: the model has {} positions",
                c.max_positions
            )));
        }
        if let Some(&id) = ids.iter().find(|&&i| i as usize >= c.vocab_size) {
            return Err(bad(format!(
                "token id {id} past the vocabulary of {}",
                c.vocab_size
            )));
        }
        if let Some(&ty) = types.iter().find(|&&i| i as usize >= c.type_vocab) {
            return Err(bad(format!(
                "token type {ty} past the {} types",
                c.type_vocab
            )));
        }
        let gpu = rec.gpu();
        let (h, heads) = (c.hidden, c.heads);
        let eps = c.eps as f32;
        let pos: Vec<u32> = (0..b * t).map(|i| (i % t) as u32).collect();
        let ids_t = Tensor::from_u32(gpu, &[b, t], ids, "bert.ids")?;
        let types_t = Tensor::from_u32(gpu, &[b, t], types, "bert.types")?;
        let pos_t = Tensor::from_u32(gpu, &[b, t], &pos, "bert.positions")?;
        let x = embedding(rec, &self.word, &ids_t)?;
        let p = embedding(rec, &self.position, &pos_t)?;
        let x = elementwise::add(rec, &x, &p)?;
        let ty = embedding(rec, &self.token_type, &types_t)?;
        let x = elementwise::add(rec, &x, &ty)?;
        let rows = b * t;
        let mut x = layer_norm(rec, &x.reshape(&[rows, h])?, &self.ln.0, &self.ln.1, eps)?.y;
        let tb = MatmulOpts {
            trans_b: true,
            ..Default::default()
        };
        let lin = |rec: &mut Recorder<'_>, x: &Tensor, w: &(Tensor, Tensor)| {
            matmul_bias(rec, x, &w.0, &w.1, tb)
        };
        let attn = AttnOpts {
            causal: false,
            ..Default::default()
        };
        for l in &self.layers {
            let split = |y: Tensor| y.reshape(&[b, t, heads, h / heads]);
            let q = split(lin(rec, &x, &l.q)?)?;
            let k = split(lin(rec, &x, &l.k)?)?;
            let v = split(lin(rec, &x, &l.v)?)?;
            let a = attention(rec, &q, &k, &v, attn)?.o.reshape(&[rows, h])?;
            let o = lin(rec, &a, &l.o)?;
            let r = elementwise::add(rec, &x, &o)?;
            x = layer_norm(rec, &r, &l.ln1.0, &l.ln1.1, eps)?.y;
            let u = lin(rec, &x, &l.up)?;
            let u = gelu(rec, &u, c.gelu)?;
            let d = lin(rec, &u, &l.down)?;
            let r = elementwise::add(rec, &x, &d)?;
            x = layer_norm(rec, &r, &l.ln2.0, &l.ln2.1, eps)?.y;
        }
        x.reshape(&[b, t, h])
    }
}

/// A sentence encoder: the model, its tokenizer, and how sentence-transformers pools and
/// normalises its token vectors.
pub struct Encoder {
    pub bert: Bert,
    tokenizer: tokenizers::Tokenizer,
    pub pooling: Pooling,
    pub normalize: bool,
    /// Longest input in tokens (sentence_bert_config.json's max_seq_length, else the
    /// model's positions).
    pub max_tokens: usize,
}

/// One text's sentence vector and what became of it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Embedding {
    pub vector: Vec<f32>,
    pub tokens: usize,
    /// The text had more tokens than `max_tokens` and was cut to them.
    pub truncated: bool,
}

impl Encoder {
    /// A sentence-transformers (or plain Hugging Face BERT) directory.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn open(gpu: &Gpu, dir: &Path) -> Result<Encoder> {
        if !dir.join("config.json").is_file() {
            return Err(format_err(
                dir,
                "not a model directory: no config.json (an encoder is a Hugging Face directory with config.json, model.safetensors and tokenizer.json)",
            ));
        }
        let bert = Bert::open(gpu, dir)?;
        let tk_path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&tk_path).map_err(io(&tk_path))?;
        serde_json::from_slice::<serde_json::Value>(&bytes)
            .map_err(|e| format_err(&tk_path, format!("not valid JSON: {e}")))?;
        let mut tokenizer = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| format_err(&tk_path, e.to_string()))?;
        tokenizer.with_truncation(None).ok();
        tokenizer.with_padding(None);
        let read_json = |p: &Path| -> Result<Option<serde_json::Value>> {
            match std::fs::read_to_string(p) {
                Ok(t) => serde_json::from_str(&t)
                    .map(Some)
                    .map_err(|e| format_err(p, e.to_string())),
                Err(_) => Ok(None),
            }
        };
        // sentence-transformers' modules: a Pooling module's folder, a Normalize module.
        let (mut pooling, mut normalize) = (Pooling::Mean, false);
        if let Some(mods) = read_json(&dir.join("modules.json"))? {
            for m in mods.as_array().into_iter().flatten() {
                let ty = m.get("type").and_then(|v| v.as_str()).unwrap_or("");
                let sub = m.get("path").and_then(|v| v.as_str()).unwrap_or("");
                if ty.ends_with("Normalize") {
                    normalize = true;
                } else if ty.ends_with("Pooling") {
                    let p = dir.join(sub).join("config.json");
                    let cfg = read_json(&p)?.unwrap_or_default();
                    let on = |k: &str| cfg.get(k).and_then(|v| v.as_bool()) == Some(true);
                    // sentence-transformers concatenates several modes (a vector of 2H or
                    // more): refused rather than answered with one of them.
                    let modes = [
                        "pooling_mode_cls_token",
                        "pooling_mode_max_tokens",
                        "pooling_mode_mean_tokens",
                        "pooling_mode_mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens",
                        "pooling_mode_lasttoken",
                    ];
                    let set: Vec<&str> = modes.iter().copied().filter(|k| on(k)).collect();
                    if set.len() > 1
                        || set.iter().any(|k| {
                            k.contains("sqrt") || k.contains("weighted") || k.contains("last")
                        })
                    {
                        return Err(format_err(
                            &p,
                            format!(
                                "pooling {set:?} is not supported (one of mean, cls, max tokens)"
                            ),
                        ));
                    }
                    pooling = if on("pooling_mode_cls_token") {
                        Pooling::Cls
                    } else if on("pooling_mode_max_tokens") {
                        Pooling::Max
                    } else if on("pooling_mode_mean_tokens") || cfg.is_null() {
                        Pooling::Mean
                    } else {
                        return Err(format_err(
                            &p,
                            "no pooling mode Doppler runs (mean, cls, max tokens)",
                        ));
                    };
                } else if !ty.ends_with("Transformer") {
                    return Err(format_err(
                        &dir.join("modules.json"),
                        format!("module {ty:?} is not supported (Transformer, Pooling, Normalize)"),
                    ));
                }
            }
        }
        let max_tokens = read_json(&dir.join("sentence_bert_config.json"))?
            .and_then(|v| v.get("max_seq_length").and_then(|m| m.as_u64()))
            .map_or(bert.cfg.max_positions, |m| m as usize)
            .min(bert.cfg.max_positions);
        Ok(Encoder {
            bert,
            tokenizer,
            pooling,
            normalize,
            max_tokens,
        })
    }

    /// Token ids and types of `text` with the model's special tokens ([CLS] ... [SEP]),
    /// cut to `max_tokens` (keeping the closing special token) when `truncate`, else an
    /// error naming the text's length. Returns (ids, types, cut).
    pub fn tokenize(&self, text: &str, truncate: bool) -> Result<(Vec<u32>, Vec<u32>, bool)> {
        let enc = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| Error::Invalid {
                op: "tokenizer",
                detail: e.to_string(),
            })?;
        self.cut(&enc, truncate)
    }

    /// Every text's [`Encoder::tokenize`], on all the host's cores.
    pub fn tokenize_all(
        &self,
        texts: &[&str],
        truncate: bool,
    ) -> Result<Vec<(Vec<u32>, Vec<u32>, bool)>> {
        let encs = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| Error::Invalid {
                op: "tokenizer",
                detail: e.to_string(),
            })?;
        encs.iter().map(|e| self.cut(e, truncate)).collect()
    }

    fn cut(
        &self,
        enc: &tokenizers::Encoding,
        truncate: bool,
    ) -> Result<(Vec<u32>, Vec<u32>, bool)> {
        let (mut ids, mut types) = (enc.get_ids().to_vec(), enc.get_type_ids().to_vec());
        let n = ids.len();
        if n <= self.max_tokens {
            return Ok((ids, types, false));
        }
        if !truncate {
            return Err(Error::Invalid {
                op: "tokenizer",
                detail: format!(
                    "a text of {n} tokens is longer than the encoder's {} (truncation is off)",
                    self.max_tokens
                ),
            });
        }
        // Keep the first max - 1 tokens and the last (the closing [SEP]).
        let last = (ids[n - 1], types[n - 1]);
        ids.truncate(self.max_tokens - 1);
        types.truncate(self.max_tokens - 1);
        ids.push(last.0);
        types.push(last.1);
        Ok((ids, types, true))
    }

    /// The pooled rows (B, H) of hidden states (B, T, H) for mean and CLS pooling, as one
    /// batched product with a (B, 1, T) weight row each: 1/T everywhere (the mean; sums in
    /// a fixed order), or 1 on the first token (CLS: the row itself, exactly). Max pooling
    /// returns the states as they are (pooled on the host).
    #[cfg(not(target_arch = "wasm32"))]
    fn pool_on_gpu(
        &self,
        rec: &mut Recorder<'_>,
        x: &Tensor,
        b: usize,
        t: usize,
    ) -> Result<Tensor> {
        let w: Vec<f32> = match self.pooling {
            Pooling::Max => return Ok(x.clone()),
            Pooling::Mean => vec![1.0 / t as f32; b * t],
            Pooling::Cls => (0..b * t).map(|i| (i % t == 0) as u32 as f32).collect(),
        };
        let w = Tensor::from_f32(rec.gpu(), &[b, 1, t], &w, "bert.pool")?;
        crate::ops::matmul::matmul(rec, &w, x, MatmulOpts::default())?
            .reshape(&[b, self.bert.cfg.hidden])
    }

    /// Sentence vectors of `texts`, in order: texts of equal token count run together, up
    /// to `batch` a dispatch chain; each batch is submitted before the one before it is
    /// read back, so the GPU works while the host finishes a batch.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn embed(
        &self,
        gpu: &Gpu,
        texts: &[&str],
        batch: usize,
        truncate: bool,
    ) -> Result<Vec<Embedding>> {
        let toks = self.tokenize_all(texts, truncate)?;
        let mut by_len: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (i, (ids, _, _)) in toks.iter().enumerate() {
            by_len.entry(ids.len()).or_default().push(i);
        }
        let groups: Vec<(usize, &[usize])> = by_len
            .iter()
            .flat_map(|(&t, m)| m.chunks(batch.max(1)).map(move |g| (t, g)))
            .collect();
        let submit =
            |t: usize, group: &[usize]| -> Result<(crate::gpu::Submission, crate::gpu::Readback)> {
                let ids: Vec<u32> = group
                    .iter()
                    .flat_map(|&i| toks[i].0.iter().copied())
                    .collect();
                let types: Vec<u32> = group
                    .iter()
                    .flat_map(|&i| toks[i].1.iter().copied())
                    .collect();
                let mut rec = gpu.recorder("embed");
                let x = self.bert.forward(&mut rec, &ids, &types, group.len())?;
                let pooled = self.pool_on_gpu(&mut rec, &x, group.len(), t)?;
                let back = rec.read_later(&pooled)?;
                Ok((rec.submit()?, back))
            };
        let mut out: Vec<Option<Embedding>> = vec![None; texts.len()];
        let mut pending = None;
        for &(t, group) in &groups {
            let next = (submit(t, group)?, t, group);
            if let Some(((sub, back), pt, pg)) = pending.replace(next) {
                self.collect(gpu, sub, back, pt, pg, &toks, &mut out)?;
            }
        }
        if let Some(((sub, back), pt, pg)) = pending {
            self.collect(gpu, sub, back, pt, pg, &toks, &mut out)?;
        }
        Ok(out
            .into_iter()
            .map(|e| e.expect("every text embedded"))
            .collect())
    }

    /// Reads a submitted batch's pooled rows and finishes its sentences' vectors.
    #[cfg(not(target_arch = "wasm32"))]
    #[allow(clippy::too_many_arguments)]
    fn collect(
        &self,
        gpu: &Gpu,
        sub: crate::gpu::Submission,
        back: crate::gpu::Readback,
        t: usize,
        group: &[usize],
        toks: &[(Vec<u32>, Vec<u32>, bool)],
        out: &mut [Option<Embedding>],
    ) -> Result<()> {
        let h = self.bert.cfg.hidden;
        let words = back.read_u32(gpu)?;
        // Its ids and types were checked on the host (`Bert::forward`): the embedding's
        // GPU index checks cannot fail, and reading them would wait for the next batch.
        drop(sub);
        let all: Vec<f32> = words.into_iter().map(f32::from_bits).collect();
        for (j, &i) in group.iter().enumerate() {
            let vector = match self.pooling {
                Pooling::Max => self.max_pool(&all[j * t * h..(j + 1) * t * h], t),
                _ => self.normalized(&all[j * h..(j + 1) * h]),
            };
            out[i] = Some(Embedding {
                vector,
                tokens: t,
                truncated: toks[i].2,
            });
        }
        Ok(())
    }

    /// A pooled row, L2-normalised (in f64) when the model's modules say so.
    #[cfg(not(target_arch = "wasm32"))]
    fn normalized(&self, row: &[f32]) -> Vec<f32> {
        let mut v: Vec<f64> = row.iter().map(|&x| x as f64).collect();
        if self.normalize {
            let n = v.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
            v.iter_mut().for_each(|x| *x /= n);
        }
        v.into_iter().map(|x| x as f32).collect()
    }

    /// Max pooling of one sentence's token vectors (T, H) (mean and CLS pool on the GPU:
    /// `pool_on_gpu`), then normalised as the model says.
    #[cfg(not(target_arch = "wasm32"))]
    fn max_pool(&self, rows: &[f32], t: usize) -> Vec<f32> {
        let h = self.bert.cfg.hidden;
        let max: Vec<f32> = (0..h)
            .map(|c| (0..t).map(|r| rows[r * h + c]).fold(f32::MIN, f32::max))
            .collect();
        self.normalized(&max)
    }
}
