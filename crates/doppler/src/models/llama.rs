//! Llama-family decoder for inference: `llama` (SmolLM2, Llama 3.x, TinyLlama), `qwen2`
//! (biases on q, k, v), `qwen3` (no biases; each q and k head RMS-normalised before RoPE,
//! with weights q_norm and k_norm of the head size), `mistral` (Llama's layout; a sliding
//! attention window), `phi3` (q, k, v and gate, up each one tensor in the file; LongRoPE's
//! per-frequency factors and attention factor) and `gemma3` (see below). Weights stay in
//! their file's encoding on the GPU (GGUF blocks, or f32 / f16 / bf16 from SafeTensors)
//! and every product reads them directly (`ops::quant::qmatmul`); keys and values go into a
//! cache (`ops::kvcache`: f32, f16 or q8_0; a ring of the last keys for a windowed layer).
//!
//! One step over T new tokens at positions pos..pos+T (E = n_embd, D = head dim):
//!   x = embd[ids]                                         (T, E)
//!   per layer: h = rmsnorm(x) * attn_norm
//!              q, k, v = h Wq^T (+bq), h Wk^T (+bk), h Wv^T (+bv)   (T, Hq|Hkv, D)
//!              (qwen3: q, k = rmsnorm(q) * q_norm, rmsnorm(k) * k_norm, per head)
//!              q, k = rope(q, k, pos); cache[pos..pos+T] = k, v
//!              x += attend(q, cache) Wo^T        (a window: the last W keys only)
//!              h = rmsnorm(x) * ffn_norm;  x += (silu(h Wg^T) * h Wu^T) Wd^T
//!   logits = rmsnorm(x[last]) * out_norm @ Wout^T         (V) (Wout = embd when tied)
//! in five dispatches a layer when decoding: Wq, Wk, Wv are stacked into one matrix at load
//! (as Wg, Wu), the norms run inside the products that follow them, the residual adds
//! inside the products before them, SwiGLU inside the gate/up product, the q/k/v product
//! adds the biases, turns q and k and stores k and v (`ops::quant::qmatmul_rope_store`;
//! a prompt of more than 32 tokens runs `ops::kvcache::rope_store` after its product), and
//! one token's attention key ranges merge inside the o product.
//!
//! Gemma 3 differs: x = embd[ids] * sqrt(E); norms multiply by 1 + w (Hugging Face stores
//! w, GGUF 1 + w); q and k heads normalised (q's weight carries query_pre_attn_scalar's
//! scale); x += rmsnorm(attend(q, cache) Wo^T) * post_attn_norm; h = rmsnorm(x) * ffn_norm;
//! x += rmsnorm((gelu_tanh(h Wg^T) * h Wu^T) Wd^T) * post_ffw_norm; five layers in six
//! attend to a window with their own RoPE base; logits = cap tanh(logits / cap) where the
//! model has a cap. Its products run one after the other (no chaining).
//!
//! The same architecture runs two more ways: with a LoRA adapter at inference
//! (`Llama::set_lora`: products unfused, s (x A^T) B^T added into each adapted one), and on
//! the autograd tape for fine-tuning (`Llama::train_logits`: the frozen weights read in
//! their encoding both ways, `ops::quant::qmatmul_t` for dX).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::formats::gguf::{GgmlType, Value};
use crate::formats::{FileData, LocalFuture};
use crate::gpu::{DType, Gpu, Recorder, Tensor};
use crate::ops::elementwise::{add, scale, softcap};
use crate::ops::kvcache::{
    self, kv_attend, kv_attend_paged, kv_attend_parts, rope_store, rope_store_split, KvCache,
    KvType, PagedRows, RopeStore, RING_STEP,
};
use crate::ops::norm::{rms_norm, rms_norm_heads};
use crate::ops::quant::{
    qmatmul_chain, qmatmul_fused, qmatmul_rope_store, qmatmul_rows_rope, qmatmul_unsummed,
    qmatvec_parts, Fuse, Next, QMatrix, RowSplit,
};
use crate::ops::rope::{inv_freq, Pairing, RopeTable};

/// Architectures this decoder runs, as GGUF's `general.architecture` names them (llama.cpp
/// writes Mistral models as `llama`)...
pub const ARCHITECTURES: &[&str] = &["llama", "qwen2", "qwen3", "phi3", "gemma3"];
/// ...and as a Hugging Face `config.json`'s `model_type` does (`gemma3_text`: Gemma 3's
/// text-only checkpoints, 270M and 1B; `gemma3`: the multimodal ones, whose text model
/// runs, the vision tower left unread).
pub const HF_ARCHITECTURES: &[&str] = &[
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "phi3",
    "gemma3_text",
    "gemma3",
];

/// Gemma 3's layers by default: five attend to a window, the sixth to everything.
const GEMMA3_PATTERN: usize = 6;

/// LongRoPE (Phi-3's "su"/"longrope" scaling): each frequency divided by its factor, the
/// short ones for contexts up to `original_context`, the long ones past it (chosen once
/// for the context a model is loaded with, as llama.cpp does), and cos and sin
/// multiplied by `attn_factor`.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct LongRope {
    pub short: Vec<f64>,
    pub long: Vec<f64>,
    pub original_context: usize,
    pub attn_factor: f64,
}

/// Llama 3's frequency-dependent RoPE rescaling (`rope_scaling.rope_type = "llama3"`).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_context: f64,
}

impl Llama3Scaling {
    /// Per frequency as Meta's reference: long wavelengths divided by `factor`, short ones
    /// kept, a linear blend between.
    fn apply(&self, f: f64) -> f64 {
        let wavelen = 2.0 * std::f64::consts::PI / f;
        let (lo, hi) = (
            self.original_context / self.low_freq_factor,
            self.original_context / self.high_freq_factor,
        );
        if wavelen < hi {
            f
        } else if wavelen > lo {
            f / self.factor
        } else {
            let s = (self.original_context / wavelen - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor);
            (1.0 - s) * f / self.factor + s * f
        }
    }
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct LlamaConfig {
    pub arch: String,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub ffn_hidden: usize,
    pub vocab_size: usize,
    pub norm_eps: f64,
    pub rope_theta: f64,
    /// Positions the model was trained for.
    pub context_length: usize,
    /// RoPE pairing: GGUF's llama has its q/k rows permuted for adjacent pairs; Hugging
    /// Face checkpoints and qwen2 rotate halves.
    #[serde(skip)]
    pub pairing: Pairing,
    pub rope_llama3: Option<Llama3Scaling>,
    /// Linear position scaling (angle / factor).
    pub rope_linear: Option<f64>,
    pub rope_long: Option<LongRope>,
    /// The attention window of a model trained with one (Mistral, Phi-3, Gemma 3's local
    /// layers): a token attends to the last `sliding_window` tokens, itself included.
    pub sliding_window: Option<usize>,
    /// Which layers attend to the window (empty: all of them); the others attend to
    /// everything (Gemma 3: five local layers, then a global one).
    pub sliding_layers: Vec<bool>,
    /// RoPE base of the sliding-window layers where it is their own (Gemma 3's local
    /// base; the global layers' scaling does not apply to them).
    pub rope_local_theta: Option<f64>,
    /// The attention scores' scale where it is not 1/sqrt(head size) (Gemma's
    /// query_pre_attn_scalar^-1/2).
    pub attn_scale: Option<f64>,
    /// Logits capped to cap * tanh(logits / cap) (Gemma's final_logit_softcapping).
    pub final_softcap: Option<f64>,
    /// Added to every norm weight as read (Gemma's Hugging Face checkpoints store w for a
    /// norm that multiplies by 1 + w; llama.cpp's converter stores 1 + w).
    pub norm_shift: f32,
    pub tied_embeddings: bool,
}

impl LlamaConfig {
    /// Refuses values no model has (`path` names the file in the error): zero layers,
    /// widths or positions, a non-positive or non-finite epsilon, RoPE base or scale.
    pub fn check(&self, path: &str) -> Result<()> {
        let sizes = [
            ("layers", self.n_layer),
            ("width", self.n_embd),
            ("head size", self.head_dim),
            ("feed-forward width", self.ffn_hidden),
            ("vocabulary", self.vocab_size),
            ("context length", self.context_length),
        ];
        if let Some((what, _)) = sizes.iter().find(|(_, n)| *n == 0) {
            return Err(format_err(
                path,
                format!("{what} 0: the metadata describes no model"),
            ));
        }
        if self.head_dim % 2 != 0 {
            return Err(format_err(
                path,
                format!("head size {} is odd: RoPE rotates pairs", self.head_dim),
            ));
        }
        let positive = |v: f64| v > 0.0 && v.is_finite();
        if !positive(self.norm_eps) {
            return Err(format_err(
                path,
                format!("RMSNorm epsilon {} must be positive", self.norm_eps),
            ));
        }
        if !positive(self.rope_theta)
            || self.rope_linear.is_some_and(|f| !positive(f))
            || self.rope_local_theta.is_some_and(|f| !positive(f))
        {
            return Err(format_err(
                path,
                format!(
                    "RoPE base {} (local {:?}) and scale {:?} must be positive",
                    self.rope_theta, self.rope_local_theta, self.rope_linear
                ),
            ));
        }
        if self.attn_scale.is_some_and(|f| !positive(f))
            || self.final_softcap.is_some_and(|f| !positive(f))
        {
            return Err(format_err(
                path,
                format!(
                    "attention scale {:?} and logit soft-cap {:?} must be positive",
                    self.attn_scale, self.final_softcap
                ),
            ));
        }
        if self.sliding_window == Some(0)
            || (!self.sliding_layers.is_empty() && self.sliding_layers.len() != self.n_layer)
        {
            return Err(format_err(
                path,
                format!(
                    "sliding window {:?} over {} layer kinds for {} layers",
                    self.sliding_window,
                    self.sliding_layers.len(),
                    self.n_layer
                ),
            ));
        }
        Ok(())
    }

    /// Layer `li`'s attention window (None: every earlier token).
    pub fn window(&self, li: usize) -> Option<usize> {
        let slides = self.sliding_layers.get(li).copied().unwrap_or(true);
        self.sliding_window.filter(|_| slides)
    }

    /// Gemma's layer: embeddings scaled by sqrt(width), norms after attention and after
    /// the feed-forward too, GeGLU.
    pub fn gemma(&self) -> bool {
        self.arch == "gemma3"
    }

    /// RoPE frequencies after the model's scaling for a context of `context` positions;
    /// `factors` are GGUF's `rope_freqs.weight` (frequency divisors, Llama 3 in llama.cpp's
    /// files).
    fn inv_freq(&self, factors: Option<&[f32]>, context: usize) -> Vec<f64> {
        let mut f = inv_freq(self.head_dim, self.rope_theta);
        if let Some(lr) = &self.rope_long {
            let ext = match context > lr.original_context {
                true => &lr.long,
                false => &lr.short,
            };
            f.iter_mut().zip(ext).for_each(|(v, e)| *v /= e);
        }
        if let Some(s) = self.rope_llama3 {
            f.iter_mut().for_each(|v| *v = s.apply(*v));
        }
        if let Some(fac) = factors {
            f.iter_mut().zip(fac).for_each(|(v, d)| *v /= *d as f64);
        }
        if let Some(l) = self.rope_linear {
            f.iter_mut().for_each(|v| *v /= l);
        }
        f
    }
}

struct Layer {
    attn_norm: Tensor,
    /// Gemma: the norms of the attention's and the feed-forward's outputs (E).
    post_attn_norm: Option<Tensor>,
    post_ffn_norm: Option<Tensor>,
    /// Wq, Wk, Wv stacked: ((Hq + 2 Hkv) D, E); in parts where their types differ
    /// (llama.cpp's Q4_K_M files give some layers' v more bits)
    qkv: RowSplit,
    /// bq, bk, bv stacked (qwen2)
    qkv_bias: Option<Tensor>,
    /// q_norm, k_norm stacked: (2, D) (qwen3, gemma3; q's times Gemma's query scale
    /// times sqrt(D), the kernels' scale being 1/sqrt(D))
    qk_norm: Option<Tensor>,
    o: QMatrix,
    ffn_norm: Tensor,
    /// Wg, Wu stacked: (2 F, E)
    gate_up: QMatrix,
    down: QMatrix,
}

pub struct Llama {
    pub cfg: LlamaConfig,
    /// The embedding table and the output head (the table again when tied), split by rows
    /// where one storage binding cannot hold them.
    embd: RowSplit,
    layers: Vec<Layer>,
    out_norm: Tensor,
    output: RowSplit,
    rope: Arc<RopeTable>,
    /// The sliding-window layers' table where their RoPE differs (Gemma 3).
    rope_local: Option<Arc<RopeTable>>,
    /// Largest context (positions) this instance serves: the RoPE table's length.
    pub max_context: usize,
    /// Bytes of the weights (as the file stores them).
    pub weight_bytes: u64,
    /// Bytes of weights a decode step reads: all but a separate embedding table's.
    pub decode_bytes: u64,
    /// A LoRA adapter applied at inference (`--lora`), with a multiplier of its scale
    /// (`--lora-scale`): the products run unfused, each adapted one plus s (x A^T) B^T.
    lora: Option<(crate::finetune::lora::Lora, f32)>,
}

/// One step of [`Llama::decode_reads`]: its name and what it reads (buffer, bytes).
pub type DecodeRead<'a> = (&'static str, Vec<(&'a Tensor, u64)>);

/// A tensor as stored: bytes, type, dims innermost first.
pub struct Stored<'a> {
    pub bytes: std::borrow::Cow<'a, [u8]>,
    pub ty: GgmlType,
    pub dims: Vec<u64>,
}

/// Where a model's tensors come from, under GGUF's names (`blk.N.attn_q.weight`, ...).
/// Reading is async: a browser reads a file a tensor at a time.
pub trait Source {
    fn path(&self) -> &str;
    /// Whether the tensor is there (nothing read).
    fn has(&self, name: &str) -> bool;
    /// The tensor, None when absent.
    fn tensor<'a>(&'a self, name: &'a str) -> LocalFuture<'a, Result<Option<Stored<'a>>>>;
    /// Every tensor's name, where the source can list them under GGUF's names (a GGUF
    /// file): the loader refuses a file with tensors it never read.
    fn names(&self) -> Option<Vec<String>> {
        None
    }
    /// The tensor's type without reading it, where the source knows it (None: read it).
    fn type_of(&self, _name: &str) -> Option<GgmlType> {
        None
    }
}

/// A source that remembers which tensors the loader asked for.
struct Tracked<'s> {
    src: &'s dyn Source,
    asked: std::cell::RefCell<std::collections::BTreeSet<String>>,
}

impl Source for Tracked<'_> {
    fn path(&self) -> &str {
        self.src.path()
    }
    fn has(&self, name: &str) -> bool {
        self.asked.borrow_mut().insert(name.to_string());
        self.src.has(name)
    }
    fn tensor<'a>(&'a self, name: &'a str) -> LocalFuture<'a, Result<Option<Stored<'a>>>> {
        self.asked.borrow_mut().insert(name.to_string());
        self.src.tensor(name)
    }
    fn type_of(&self, name: &str) -> Option<GgmlType> {
        self.src.type_of(name)
    }
}

impl Tracked<'_> {
    /// An error naming the tensors the source holds and nobody asked for (a layer count
    /// that contradicts the tensors, or another architecture's file).
    fn unread(&self, cfg: &LlamaConfig) -> Result<()> {
        let Some(all) = self.src.names() else {
            return Ok(());
        };
        let asked = self.asked.borrow();
        let unread: Vec<&str> = all
            .iter()
            .filter(|n| !asked.contains(n.as_str()))
            .map(String::as_str)
            .collect();
        if unread.is_empty() {
            return Ok(());
        }
        let shown = unread
            .iter()
            .take(4)
            .copied()
            .collect::<Vec<_>>()
            .join(", ");
        let more = match unread.len() {
            n if n > 4 => format!(" and {} more", n - 4),
            _ => String::new(),
        };
        Err(format_err(
            self.src.path(),
            format!(
                "{} tensors that a {}-layer {} does not read: {shown}{more} (the metadata \
                 contradicts the tensors)",
                unread.len(),
                cfg.n_layer,
                cfg.arch
            ),
        ))
    }
}

fn format_err(path: &str, detail: impl Into<String>) -> Error {
    Error::Format {
        path: path.to_string(),
        detail: detail.into(),
    }
}

async fn need<'a>(src: &'a dyn Source, name: &'a str) -> Result<Stored<'a>> {
    src.tensor(name)
        .await?
        .ok_or_else(|| format_err(src.path(), format!("tensor {name} is missing")))
}

/// The stored tensor `name`, checked to be a (rows, cols) matrix.
async fn need_matrix<'a>(
    src: &'a dyn Source,
    name: &'a str,
    rows: usize,
    cols: usize,
) -> Result<Stored<'a>> {
    let t = need(src, name).await?;
    if t.dims != [cols as u64, rows as u64] {
        return Err(format_err(
            src.path(),
            format!(
                "{name}: dims {:?}, expected [{cols}, {rows}] (innermost first)",
                t.dims
            ),
        ));
    }
    Ok(t)
}

async fn matrix(
    gpu: &Gpu,
    src: &dyn Source,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<QMatrix> {
    let t = need_matrix(src, name, rows, cols).await?;
    QMatrix::new(gpu, name, &t.bytes, t.ty, rows, cols)
        .map_err(|e| format_err(src.path(), e.to_string()))
}

/// [`matrix`] of a table that may pass one storage binding (the embedding, the head).
async fn matrix_split(
    gpu: &Gpu,
    src: &dyn Source,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<RowSplit> {
    let t = need_matrix(src, name, rows, cols).await?;
    RowSplit::new(gpu, name, &t.bytes, t.ty, rows, cols)
        .map_err(|e| format_err(src.path(), e.to_string()))
}

/// Matrices (name, rows) of one width stacked row-wise: one matrix where they share a
/// type, else a part for each run of one type.
async fn stacked_parts(
    gpu: &Gpu,
    src: &dyn Source,
    parts: &[(String, usize)],
    cols: usize,
) -> Result<RowSplit> {
    let mut types = Vec::with_capacity(parts.len());
    for (name, _) in parts {
        types.push(match src.type_of(name) {
            Some(t) => t,
            None => need(src, name).await?.ty,
        });
    }
    let mut out = Vec::new();
    let (mut i, mut row0) = (0, 0);
    while i < parts.len() {
        let run = types[i..].iter().take_while(|t| **t == types[i]).count();
        let m = stacked(gpu, src, &parts[i..i + run], cols).await?;
        let rows = m.rows;
        out.push((row0, m));
        row0 += rows;
        i += run;
    }
    Ok(RowSplit {
        parts: out,
        rows: row0,
        cols,
    })
}

/// Matrices (name, rows) of one type and width stacked row-wise into one.
async fn stacked(
    gpu: &Gpu,
    src: &dyn Source,
    parts: &[(String, usize)],
    cols: usize,
) -> Result<QMatrix> {
    let mut stored = Vec::new();
    for (name, rows) in parts {
        let t = need(src, name).await?;
        if t.dims != [cols as u64, *rows as u64] {
            return Err(format_err(
                src.path(),
                format!(
                    "{name}: dims {:?}, expected [{cols}, {rows}] (innermost first)",
                    t.dims
                ),
            ));
        }
        stored.push((t, *rows));
    }
    let refs: Vec<(&[u8], GgmlType, usize)> = stored
        .iter()
        .map(|(t, r)| (&t.bytes[..], t.ty, *r))
        .collect();
    let label = parts
        .iter()
        .map(|p| p.0.as_str())
        .collect::<Vec<_>>()
        .join("+");
    QMatrix::stacked(gpu, &label, &refs, cols).map_err(|e| format_err(src.path(), e.to_string()))
}

/// A vector (norm weight, bias) widened to f32 on the host.
async fn vector_f32(src: &dyn Source, name: &str, n: usize) -> Result<Option<Vec<f32>>> {
    let Some(t) = src.tensor(name).await? else {
        return Ok(None);
    };
    if t.dims != [n as u64] {
        return Err(format_err(
            src.path(),
            format!("{name}: dims {:?}, expected [{n}]", t.dims),
        ));
    }
    crate::reference::quant::dequantize(t.ty, &t.bytes, n)
        .map(Some)
        .map_err(|e| format_err(src.path(), format!("{name}: {e}")))
}

/// A norm's weight (n), required, with `shift` added to each element (Gemma's 1 + w)
/// and then multiplied by `scale`.
async fn norm_weight(
    src: &dyn Source,
    name: &str,
    n: usize,
    shift: f32,
    scale: f32,
) -> Result<Vec<f32>> {
    let v = vector_f32(src, name, n)
        .await?
        .ok_or_else(|| format_err(src.path(), format!("tensor {name} is missing")))?;
    Ok(v.into_iter().map(|w| (w + shift) * scale).collect())
}

impl Llama {
    /// Uploads the weights of `cfg` from `src`; positions up to `max_context`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn load(
        gpu: &Gpu,
        cfg: LlamaConfig,
        src: &dyn Source,
        max_context: usize,
    ) -> Result<Llama> {
        pollster::block_on(Self::load_async(gpu, cfg, src, max_context))
    }

    /// [`Llama::load`], reading each tensor when it goes to the GPU (and dropping its
    /// bytes after) where `src` reads on demand.
    pub async fn load_async(
        gpu: &Gpu,
        cfg: LlamaConfig,
        src: &dyn Source,
        max_context: usize,
    ) -> Result<Llama> {
        let tracked = Tracked {
            src,
            asked: Default::default(),
        };
        let src: &dyn Source = &tracked;
        let (e, d) = (cfg.n_embd, cfg.head_dim);
        let (qd, kvd) = (cfg.n_head * d, cfg.n_kv_head * d);
        let embd = matrix_split(gpu, src, "token_embd.weight", cfg.vocab_size, e).await?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        let shift = cfg.norm_shift;
        for i in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            let norm = async |s: &str| -> Result<Tensor> {
                let w = norm_weight(src, &n(s), e, shift, 1.0).await?;
                Tensor::from_f32(gpu, &[e], &w, &n(s))
            };
            // qwen2 has q, k, v biases (all three or none).
            let mut biases: Vec<Option<Vec<f32>>> = Vec::new();
            for (s, len) in [
                ("attn_q.bias", qd),
                ("attn_k.bias", kvd),
                ("attn_v.bias", kvd),
            ] {
                biases.push(vector_f32(src, &n(s), len).await?);
            }
            let qkv_bias = match (
                biases.iter().all(Option::is_some),
                biases.iter().any(Option::is_some),
            ) {
                (true, _) => Some(Tensor::from_f32(
                    gpu,
                    &[qd + 2 * kvd],
                    &biases.into_iter().flatten().flatten().collect::<Vec<_>>(),
                    &n("qkv.bias"),
                )?),
                (false, false) if cfg.arch != "qwen2" => None,
                _ => {
                    return Err(format_err(
                        src.path(),
                        format!("layer {i}: {} needs q, k and v biases", cfg.arch),
                    ))
                }
            };
            // qwen3 and gemma3 normalise each q and k head (both weights, or neither
            // elsewhere). Gemma's query scale goes into q's weight.
            let qk_norm = match cfg.arch.as_str() {
                "qwen3" | "gemma3" => {
                    let q_scale = cfg.attn_scale.map_or(1.0, |a| a * (d as f64).sqrt()) as f32;
                    let mut w =
                        norm_weight(src, &n("attn_q_norm.weight"), d, shift, q_scale).await?;
                    w.extend(norm_weight(src, &n("attn_k_norm.weight"), d, shift, 1.0).await?);
                    Some(Tensor::from_f32(gpu, &[2, d], &w, &n("qk_norm"))?)
                }
                _ => None,
            };
            let post = async |s: &str| -> Result<Option<Tensor>> {
                match cfg.gemma() {
                    true => Ok(Some(norm(s).await?)),
                    false => Ok(None),
                }
            };
            // phi3 stores q, k, v as one tensor, and gate, up as one (under ffn_up).
            let fused = cfg.arch == "phi3";
            let qkv = match fused {
                true => vec![(n("attn_qkv.weight"), qd + 2 * kvd)],
                false => vec![
                    (n("attn_q.weight"), qd),
                    (n("attn_k.weight"), kvd),
                    (n("attn_v.weight"), kvd),
                ],
            };
            let gate_up = match fused {
                true => vec![(n("ffn_up.weight"), 2 * cfg.ffn_hidden)],
                false => vec![
                    (n("ffn_gate.weight"), cfg.ffn_hidden),
                    (n("ffn_up.weight"), cfg.ffn_hidden),
                ],
            };
            layers.push(Layer {
                attn_norm: norm("attn_norm.weight").await?,
                post_attn_norm: post("post_attention_norm.weight").await?,
                post_ffn_norm: post("post_ffw_norm.weight").await?,
                qkv: stacked_parts(gpu, src, &qkv, e).await?,
                qkv_bias,
                qk_norm,
                o: matrix(gpu, src, &n("attn_output.weight"), e, qd).await?,
                ffn_norm: norm("ffn_norm.weight").await?,
                gate_up: stacked(gpu, src, &gate_up, e).await?,
                down: matrix(gpu, src, &n("ffn_down.weight"), e, cfg.ffn_hidden).await?,
            });
        }
        let out_norm = Tensor::from_f32(
            gpu,
            &[e],
            &norm_weight(src, "output_norm.weight", e, shift, 1.0).await?,
            "output_norm.weight",
        )?;
        let output = if src.has("output.weight") {
            matrix_split(gpu, src, "output.weight", cfg.vocab_size, e).await?
        } else {
            embd.clone()
        };
        // A GGUF's LongRoPE factors are tensors (both must be there, the metadata having
        // named an original context); a Hugging Face config carries them itself.
        let mut cfg = cfg;
        if let Some(lr) = cfg.rope_long.as_mut().filter(|l| l.short.is_empty()) {
            for (name, into) in [
                ("rope_factors_short.weight", &mut lr.short),
                ("rope_factors_long.weight", &mut lr.long),
            ] {
                *into = vector_f32(src, name, d / 2)
                    .await?
                    .ok_or_else(|| format_err(src.path(), format!("tensor {name} is missing")))?
                    .into_iter()
                    .map(f64::from)
                    .collect();
            }
        }
        let factors = match src.tensor("rope_freqs.weight").await? {
            Some(t) => Some(
                crate::reference::quant::dequantize(t.ty, &t.bytes, d / 2)
                    .map_err(|e| format_err(src.path(), format!("rope_freqs.weight: {e}")))?,
            ),
            None => None,
        };
        tracked.unread(&cfg)?;
        let max_context = max_context.min(cfg.context_length).max(1);
        let rope = Arc::new(RopeTable::from_inv_freq_scaled(
            gpu,
            max_context,
            &cfg.inv_freq(factors.as_deref(), max_context),
            cfg.rope_long.as_ref().map_or(1.0, |l| l.attn_factor),
        )?);
        // Gemma 3's local layers turn by their own base, unscaled.
        let rope_local = match cfg.rope_local_theta {
            Some(theta) => Some(Arc::new(RopeTable::from_inv_freq_scaled(
                gpu,
                max_context,
                &inv_freq(cfg.head_dim, theta),
                1.0,
            )?)),
            None => None,
        };
        // A decode step reads every layer, the final norm and the output head (the
        // embedding table when tied); of a separate embedding table, one row.
        // Counted as the file stores them (Q6_K's padding on the GPU not included).
        let mut decode_bytes = out_norm.byte_size() + output.file_bytes();
        for l in &layers {
            decode_bytes += l.qkv.file_bytes();
            for m in [&l.o, &l.gate_up, &l.down] {
                decode_bytes += m.file_bytes();
            }
            decode_bytes += l.attn_norm.byte_size() + l.ffn_norm.byte_size();
        }
        let weight_bytes = match cfg.tied_embeddings {
            true => decode_bytes,
            false => decode_bytes + embd.file_bytes(),
        };
        Ok(Llama {
            cfg,
            embd,
            layers,
            out_norm,
            output,
            rope,
            rope_local,
            max_context,
            weight_bytes,
            decode_bytes,
            lora: None,
        })
    }

    /// What a one-token decode step at `cache`'s length reads, as the shortest chain of
    /// steps that each need the one before: per layer the q/k/v product, the attention
    /// (keys and values so far), the o product, gate/up, down; then the output head. Each
    /// read is (buffer, bytes from its start; whole 16-byte words): the weights as the file
    /// stores them, the norms' vectors left out (under 0.01% of an 8B step). Each step
    /// comes with its name ("qkv", "attention", "o", "gate_up", "down", "output").
    pub fn decode_reads<'a>(&'a self, cache: &'a KvCache) -> Vec<DecodeRead<'a>> {
        let w = |m: &'a QMatrix| (&m.raw, m.file_bytes() / 16 * 16);
        // The keys a token attends to: all so far, or its window's (a ring's rows).
        let kv = |t: &'a Tensor, window: Option<usize>| {
            let rows = t.shape()[0].max(1);
            let row = t.byte_size() / rows as u64;
            let seen = cache.len.min(rows).min(window.unwrap_or(usize::MAX));
            (t, row * seen as u64 / 16 * 16)
        };
        let mut steps = Vec::with_capacity(5 * self.layers.len() + 1);
        for (li, l) in self.layers.iter().enumerate() {
            let win = self.cfg.window(li);
            steps.push(("qkv", l.qkv.parts.iter().map(|(_, m)| w(m)).collect()));
            steps.push((
                "attention",
                vec![kv(&cache.k[li], win), kv(&cache.v[li], win)],
            ));
            steps.push(("o", vec![w(&l.o)]));
            steps.push(("gate_up", vec![w(&l.gate_up)]));
            steps.push(("down", vec![w(&l.down)]));
        }
        steps.push((
            "output",
            self.output.parts.iter().map(|(_, m)| w(m)).collect(),
        ));
        steps
    }

    /// An empty cache for up to `capacity` tokens (at most the model's context), of the
    /// adapter's default type ([`kvcache::default_kv_type`]: f16 where it has shader-f16):
    /// layers with an attention window keep a ring of the last keys
    /// ([`KvCache::with_windows`]).
    pub fn cache(&self, gpu: &Gpu, capacity: usize) -> Result<KvCache> {
        self.cache_with(gpu, capacity, RING_STEP, kvcache::default_kv_type(gpu))
    }

    /// [`Llama::cache`] of type `ty` (f32, f16, q8_0) whose rings take steps of up to
    /// `step` tokens (longer prompts run in several steps).
    pub fn cache_with(
        &self,
        gpu: &Gpu,
        capacity: usize,
        step: usize,
        ty: KvType,
    ) -> Result<KvCache> {
        let windows: Vec<_> = (0..self.cfg.n_layer).map(|i| self.cfg.window(i)).collect();
        KvCache::with_windows(
            gpu,
            &windows,
            capacity.min(self.max_context),
            self.cfg.n_kv_head,
            self.cfg.head_dim,
            step,
            ty,
        )
    }

    /// Records the step over `ids` (each below the vocabulary size, or an error) at the cache's position, stores
    /// their keys and values, and returns logits (V) of the last token, or (T, V) of every
    /// token when `all` is set. The cache length advances by T.
    pub fn forward(
        &self,
        rec: &mut Recorder<'_>,
        ids: &[u32],
        cache: &mut KvCache,
        all: bool,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        if let Some((i, &id)) = ids
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= c.vocab_size)
        {
            return Err(Error::IndexOutOfRange {
                op: "llama",
                position: i,
                id,
                limit: c.vocab_size as u32,
                count: ids.iter().filter(|&&v| v as usize >= c.vocab_size).count(),
            });
        }
        if ids.is_empty() {
            return Err(Error::Invalid {
                op: "llama",
                detail: "no tokens to run".into(),
            });
        }
        let ids_t = Tensor::from_u32(rec.gpu(), &[ids.len()], ids, "llama.ids")?;
        self.forward_ids(rec, &ids_t, cache, all)
    }

    /// [`Llama::forward`] of token ids already on the GPU (u32, (T)), e.g. the argmax of the
    /// previous step: the caller guarantees they are below the vocabulary size.
    pub fn forward_ids(
        &self,
        rec: &mut Recorder<'_>,
        ids_t: &Tensor,
        cache: &mut KvCache,
        all: bool,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        if ids_t.dtype() != DType::U32 || ids_t.shape().len() != 1 || ids_t.numel() == 0 {
            return Err(Error::Shape {
                op: "llama",
                detail: format!(
                    "token ids {:?} {:?}, expected u32 (T) with T > 0",
                    ids_t.dtype(),
                    ids_t.shape()
                ),
            });
        }
        let (t, pos) = (ids_t.numel(), cache.len);
        if !cache.fits(t) {
            return Err(Error::Invalid {
                op: "llama",
                detail: format!(
                    "{} + {t} tokens exceed the context of {} tokens",
                    cache.len, cache.capacity
                ),
            });
        }
        let step = cache.max_step();
        if t > step {
            return self.forward_in_steps(rec, ids_t, cache, all, step);
        }
        let eps = c.norm_eps as f32;
        let d = c.head_dim;
        let mut x = self.embd.get_rows(rec, ids_t)?; // (T, E)
        if c.gemma() {
            // Gemma scales the embeddings by sqrt(width) (rounded to f32, as transformers).
            x = scale(rec, &x, (c.n_embd as f32).sqrt())?;
        }

        if let Some((lora, mul)) = &self.lora {
            x = self.layers_adapted(rec, x, cache, lora, *mul)?;
            return self.finish_logits(rec, x, None, cache, t, all);
        }
        // x rounded to 8 bits for the next product by the product that made it, where both
        // round x (one token on large layers: see `ops::quant::qmatmul_chain`).
        let mut x8 = None;
        for (li, l) in self.layers.iter().enumerate() {
            let window = c.window(li);
            let to = self.rope_store_of(li, cache, pos);
            let fuse = Fuse {
                norm: Some((&l.attn_norm, eps)),
                x8: x8.as_ref(),
                ..Default::default()
            };
            let q = match (&l.qk_norm, l.qkv.single()) {
                (None, Some(w)) => {
                    qmatmul_rope_store(rec, &x, w, Some((&l.attn_norm, eps)), &to, x8.as_ref())?
                }
                // The heads' norms come between the product and RoPE (three dispatches); a
                // q/k/v of parts takes a product a part.
                (norms, _) => {
                    let qkv = l.qkv.product(rec, &x, fuse)?;
                    if let Some(w) = norms {
                        rms_norm_heads(rec, &qkv, w, c.n_head, c.n_kv_head, eps, false)?;
                    }
                    rope_store(rec, &qkv, &to)?
                }
            };
            if let (Some(post_attn), Some(post_ffn)) = (&l.post_attn_norm, &l.post_ffn_norm) {
                // Gemma: each block's output normalised before it joins the residual;
                // products one after the other.
                let a = kv_attend(rec, &q, &cache.k[li], &cache.v[li], pos, window)?
                    .reshape(&[t, c.n_head * d])?;
                x = self.post_normed(rec, l, (post_attn, post_ffn), &x, &a, Fuse::default())?;
                x8 = None;
                continue;
            }
            let gate_up = Next {
                w: &l.gate_up,
                norm: Some(&l.ffn_norm),
                eps,
            };
            // One token over many keys: the attention's key ranges are merged inside the
            // o product, or into its 8-bit x (one dispatch fewer a layer).
            let parts = if t == 1 {
                kv_attend_parts(rec, &q, &cache.k[li], &cache.v[li], pos, window)?
            } else {
                None
            };
            (x, x8) = match parts {
                Some(parts) => qmatvec_parts(rec, &parts, &l.o, Some(&x), Some(gate_up))?,
                None => {
                    let a = kv_attend(rec, &q, &cache.k[li], &cache.v[li], pos, window)?
                        .reshape(&[t, c.n_head * d])?;
                    let fuse = Fuse {
                        residual: Some(&x),
                        ..Default::default()
                    };
                    qmatmul_chain(rec, &a, &l.o, fuse, Some(gate_up))?
                }
            };
            let fuse = Fuse {
                norm: Some((&l.ffn_norm, eps)),
                swiglu: true,
                x8: x8.as_ref(),
                ..Default::default()
            };
            let down = Next {
                w: &l.down,
                norm: None,
                eps,
            };
            let (g, g8) = qmatmul_chain(rec, &x, &l.gate_up, fuse, Some(down))?;
            // (A head split by rows rounds its x itself, part by part.)
            let next = match self.layers.get(li + 1) {
                Some(n) => n.qkv.single().map(|w| Next {
                    w,
                    norm: Some(&n.attn_norm),
                    eps,
                }),
                None => self.output.single().map(|w| Next {
                    w,
                    norm: Some(&self.out_norm),
                    eps,
                }),
            };
            let fuse = Fuse {
                residual: Some(&x),
                x8: g8.as_ref(),
                ..Default::default()
            };
            (x, x8) = qmatmul_chain(rec, &g, &l.down, fuse, next)?;
        }
        self.finish_logits(rec, x, x8, cache, t, all)
    }

    /// Why this model cannot run [`Llama::forward_paged`] (None: it can): attention
    /// windows (their rings are not paged) or a LoRA adapter applied at inference.
    pub fn paged_unsupported(&self) -> Option<String> {
        if (0..self.cfg.n_layer).any(|i| self.cfg.window(i).is_some()) {
            return Some("layers with attention windows (sliding-window attention)".into());
        }
        if self.lora.is_some() {
            return Some("a LoRA adapter applied at inference".into());
        }
        None
    }

    /// One step of continuous batching. Row r of `ids` (u32, (M)) is the next token of its
    /// own sequence, at the position and in the pages `rows` gives ([`PagedRows`]: the
    /// pool `pool` of pages, [`kvcache::paged_pool`], holds every sequence's keys and
    /// values; a prompt's chunk is several rows of one sequence). Returns logits (S, V) of
    /// the rows `out_rows` (u32, (S)), e.g. each sequence's last row, or of every row where
    /// it is None (a step of one row a sequence: no gather). Every product runs one
    /// kernel whatever the number of rows ([`Fuse::invariant`]) and each row attends over
    /// its own pages only, so a row's logits are the same bits whatever else the step
    /// holds (batch invariance). The caller keeps the rows' pages and positions valid.
    pub fn forward_paged(
        &self,
        rec: &mut Recorder<'_>,
        ids: &Tensor,
        pool: &KvCache,
        rows: &PagedRows,
        out_rows: Option<&Tensor>,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        if let Some(why) = self.paged_unsupported() {
            return Err(Error::Invalid {
                op: "llama paged",
                detail: format!("this model has {why}"),
            });
        }
        let m = ids.numel();
        if ids.dtype() != DType::U32
            || ids.shape().len() != 1
            || m != rows.rows()
            || pool.k.len() != self.layers.len()
        {
            return Err(Error::Shape {
                op: "llama paged",
                detail: format!(
                    "token ids {:?} {:?} for {} paged rows, a pool of {} layers (the model has {})",
                    ids.dtype(),
                    ids.shape(),
                    rows.rows(),
                    pool.k.len(),
                    self.layers.len()
                ),
            });
        }
        let (eps, d, hq) = (c.norm_eps as f32, c.head_dim, c.n_head);
        let widest = c.n_embd.max(c.ffn_hidden).max(hq * d);
        let inv = Fuse {
            invariant: true,
            simt: crate::ops::quant::invariant_simt(widest),
            ..Default::default()
        };
        let mut x = self.embd.get_rows(rec, ids)?; // (M, E)
        if c.gemma() {
            x = scale(rec, &x, (c.n_embd as f32).sqrt())?;
        }
        // x's f16 halves for the next product where the product before made them with its
        // split-K sum (on cooperative matrices: `ops::quant::qmatmul_chain`).
        let mut xh = None;
        for (li, l) in self.layers.iter().enumerate() {
            let fuse = Fuse {
                norm: Some((&l.attn_norm, eps)),
                x8: xh.as_ref(),
                ..inv
            };
            let to = RopeStore {
                paged: Some(rows),
                ..self.rope_store_of(li, pool, 0)
            };
            let q = match (l.qkv.single(), &l.qk_norm) {
                // Off cooperative matrices: bias, RoPE and the store in the product's
                // epilogue where the adapter allows.
                (Some(w), None) if inv.simt && xh.is_none() => {
                    qmatmul_rows_rope(rec, &x, w, fuse.norm, &to)?
                }
                // q/k/v's partial sums over k (where the product splits k) go to
                // rope_store, which sums them: one dispatch fewer a layer.
                (Some(w), None) => {
                    let (qkv, splits) = qmatmul_unsummed(rec, &x, w, fuse)?;
                    rope_store_split(rec, &qkv, splits, &to)?
                }
                _ => {
                    let qkv = l.qkv.product(rec, &x, fuse)?;
                    if let Some(w) = &l.qk_norm {
                        rms_norm_heads(rec, &qkv, w, hq, c.n_kv_head, eps, false)?;
                    }
                    rope_store_split(rec, &qkv, 1, &to)?
                }
            };
            let a =
                kv_attend_paged(rec, &q, &pool.k[li], &pool.v[li], rows)?.reshape(&[m, hq * d])?;
            if let (Some(post_attn), Some(post_ffn)) = (&l.post_attn_norm, &l.post_ffn_norm) {
                x = self.post_normed(rec, l, (post_attn, post_ffn), &x, &a, inv)?;
                xh = None;
                continue;
            }
            let gate_up = Next {
                w: &l.gate_up,
                norm: Some(&l.ffn_norm),
                eps,
            };
            let fuse = Fuse {
                residual: Some(&x),
                ..inv
            };
            (x, xh) = qmatmul_chain(rec, &a, &l.o, fuse, Some(gate_up))?;
            let fuse = Fuse {
                norm: Some((&l.ffn_norm, eps)),
                swiglu: true,
                x8: xh.as_ref(),
                ..inv
            };
            // The down product's f16 halves made with SwiGLU (`glu_half`) where it takes them.
            let down = Next {
                w: &l.down,
                norm: None,
                eps,
            };
            let (g, gh) = qmatmul_chain(rec, &x, &l.gate_up, fuse, Some(down))?;
            let next = self.layers.get(li + 1).and_then(|n| {
                n.qkv.single().map(|w| Next {
                    w,
                    norm: Some(&n.attn_norm),
                    eps,
                })
            });
            let fuse = Fuse {
                residual: Some(&x),
                x8: gh.as_ref(),
                ..inv
            };
            (x, xh) = qmatmul_chain(rec, &g, &l.down, fuse, next)?;
        }
        let last = match out_rows {
            Some(r) => crate::ops::embedding::embedding(rec, &x, r)?, // (S, E)
            None => x,
        };
        let mut logits = self.output.product(
            rec,
            &last,
            Fuse {
                norm: Some((&self.out_norm, eps)),
                ..inv
            },
        )?;
        if let Some(cap) = c.final_softcap {
            logits = softcap(rec, &logits, cap as f32)?;
        }
        Ok(logits)
    }

    /// The step's end: the cache grows by its `t` tokens; logits of every token (`all`)
    /// or the last, from the final norm and the head.
    fn finish_logits(
        &self,
        rec: &mut Recorder<'_>,
        x: Tensor,
        x8: Option<crate::ops::quant::X8>,
        cache: &mut KvCache,
        t: usize,
        all: bool,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let (gpu, eps) = (rec.gpu(), c.norm_eps as f32);
        cache.len += t;
        let (last, x8) = if all || t == 1 {
            (x, x8)
        } else {
            let row = Tensor::empty(gpu, &[1, c.n_embd], DType::F32, "llama.last")?;
            rec.copy_elements(&x, (t - 1) * c.n_embd, &row, 0, c.n_embd)?;
            (row, None)
        };
        let mut logits = self.output.product(
            rec,
            &last,
            Fuse {
                norm: Some((&self.out_norm, eps)),
                x8: x8.as_ref(),
                ..Default::default()
            },
        )?;
        if let Some(cap) = c.final_softcap {
            logits = softcap(rec, &logits, cap as f32)?;
        }
        if all {
            Ok(logits)
        } else {
            logits.reshape(&[c.vocab_size])
        }
    }

    /// [`Llama::forward_ids`] of more tokens than one step may add to the cache's rings:
    /// steps of `step` tokens, their logits (all, or the last token's) as one step's.
    fn forward_in_steps(
        &self,
        rec: &mut Recorder<'_>,
        ids_t: &Tensor,
        cache: &mut KvCache,
        all: bool,
        step: usize,
    ) -> Result<Tensor> {
        let (t, v) = (ids_t.numel(), self.cfg.vocab_size);
        let gpu = rec.gpu();
        let out = match all {
            true => Some(Tensor::empty(gpu, &[t, v], DType::F32, "llama.logits")?),
            false => None,
        };
        let mut last = None;
        for c0 in (0..t).step_by(step) {
            let n = step.min(t - c0);
            let ids = Tensor::empty(gpu, &[n], DType::U32, "llama.ids")?;
            rec.copy_elements(ids_t, c0, &ids, 0, n)?;
            let logits = self.forward_ids(rec, &ids, cache, all)?;
            match &out {
                Some(o) => rec.copy_elements(&logits, 0, o, c0 * v, n * v)?,
                None => last = Some(logits),
            }
        }
        Ok(out.or(last).expect("at least one step"))
    }
}

impl Llama {
    /// Where layer `li`'s q/k/v product goes after it: its bias, its RoPE table (a
    /// windowed layer's own where the model has one), and its caches at `pos`.
    /// The rest of a Gemma layer after its attention `a`: each block's output normalised
    /// (`post`: after attention, after the feed-forward) before it joins the residual x,
    /// the products one after the other with `base`'s options (GeGLU).
    fn post_normed(
        &self,
        rec: &mut Recorder<'_>,
        l: &Layer,
        post: (&Tensor, &Tensor),
        x: &Tensor,
        a: &Tensor,
        base: Fuse<'_>,
    ) -> Result<Tensor> {
        let eps = self.cfg.norm_eps as f32;
        let o = qmatmul_fused(rec, a, &l.o, base)?;
        let o = rms_norm(rec, &o, post.0, eps, false)?.y;
        let x = add(rec, x, &o)?;
        let fuse = Fuse {
            norm: Some((&l.ffn_norm, eps)),
            swiglu: true,
            geglu: true,
            ..base
        };
        let g = qmatmul_fused(rec, &x, &l.gate_up, fuse)?;
        let down = qmatmul_fused(rec, &g, &l.down, base)?;
        let down = rms_norm(rec, &down, post.1, eps, false)?.y;
        add(rec, &x, &down)
    }

    fn rope_store_of<'a>(&'a self, li: usize, cache: &'a KvCache, pos: usize) -> RopeStore<'a> {
        let (c, l) = (&self.cfg, &self.layers[li]);
        let window = c.window(li);
        let table: &RopeTable = match (&self.rope_local, window) {
            (Some(local), Some(_)) => local,
            _ => &self.rope,
        };
        RopeStore {
            bias: l.qkv_bias.as_ref(),
            table,
            pairing: c.pairing,
            hq: c.n_head,
            k_cache: &cache.k[li],
            v_cache: &cache.v[li],
            pos,
            window,
            paged: None,
        }
    }

    /// The layers of one step with a LoRA adapter (`self.lora`): the same architecture as
    /// the fused path of [`Llama::forward_ids`], its products unfused so that each adapted
    /// projection gets s (x A^T) B^T added to its output before what follows (RoPE and
    /// the cache store for q, k, v; SwiGLU for gate, up; the residual for o, down).
    fn layers_adapted(
        &self,
        rec: &mut Recorder<'_>,
        mut x: Tensor,
        cache: &mut KvCache,
        lora: &crate::finetune::lora::Lora,
        mul: f32,
    ) -> Result<Tensor> {
        use crate::finetune::lora::Target;
        let c = &self.cfg;
        let (t, pos, eps, d) = (x.shape()[0], cache.len, c.norm_eps as f32, c.head_dim);
        let (hq, hkv, f) = (c.n_head, c.n_kv_head, c.ffn_hidden);
        for (li, l) in self.layers.iter().enumerate() {
            let window = c.window(li);
            let to = self.rope_store_of(li, cache, pos);
            let h = rms_norm(rec, &x, &l.attn_norm, eps, false)?.y;
            let qkv = l.qkv.product(rec, &h, Fuse::default())?;
            for (tg, start) in [
                (Target::Q, 0),
                (Target::K, hq * d),
                (Target::V, (hq + hkv) * d),
            ] {
                lora.add_into(rec, li, tg, &h, &qkv, start, mul)?;
            }
            if let Some(w) = &l.qk_norm {
                rms_norm_heads(rec, &qkv, w, hq, hkv, eps, false)?;
            }
            let q = rope_store(rec, &qkv, &to)?;
            let a = kv_attend(rec, &q, &cache.k[li], &cache.v[li], pos, window)?
                .reshape(&[t, hq * d])?;
            let o = qmatmul_fused(rec, &a, &l.o, Fuse::default())?;
            lora.add_into(rec, li, Target::O, &a, &o, 0, mul)?;
            x = add(rec, &x, &o)?;
            let h = rms_norm(rec, &x, &l.ffn_norm, eps, false)?.y;
            let gu = qmatmul_fused(rec, &h, &l.gate_up, Fuse::default())?; // (T, 2F)
            lora.add_into(rec, li, Target::Gate, &h, &gu, 0, mul)?;
            lora.add_into(rec, li, Target::Up, &h, &gu, f, mul)?;
            let gate = crate::ops::columns::slice(rec, &gu, 0, f)?;
            let up = crate::ops::columns::slice(rec, &gu, f, f)?;
            let u = crate::ops::silu::swiglu(rec, &gate, &up)?;
            let down = qmatmul_fused(rec, &u, &l.down, Fuse::default())?;
            lora.add_into(rec, li, Target::Down, &u, &down, 0, mul)?;
            x = add(rec, &x, &down)?;
        }
        Ok(x)
    }

    /// Applies a LoRA adapter at inference (`mul` times its scale), or removes it (None).
    /// Refuses architectures whose layers the adapted path does not run (Gemma 3).
    pub fn set_lora(&mut self, lora: Option<(crate::finetune::lora::Lora, f32)>) -> Result<()> {
        if let Some((l, mul)) = &lora {
            if !mul.is_finite() {
                return Err(Error::Invalid {
                    op: "llama",
                    detail: format!("LoRA scale multiplier {mul} must be finite"),
                });
            }
            l.fits(&self.cfg)?;
        }
        if lora.is_some() && self.cfg.gemma() {
            return Err(Error::Invalid {
                op: "llama",
                detail: "LoRA adapters run on llama, mistral, qwen2, qwen3 and phi3 layers; not gemma3's".into(),
            });
        }
        self.lora = lora;
        Ok(())
    }
}

/// What fine-tuning's forward ([`Llama::train_logits`]) runs: the adapters, and a training
/// step's dropout seed (None: evaluation, no dropout).
#[derive(Clone, Copy, Default)]
pub struct TrainOpts<'a> {
    pub lora: Option<&'a crate::finetune::lora::Lora>,
    pub dropout_seed: Option<u64>,
}

impl Llama {
    /// The model on the autograd tape, for fine-tuning: logits (B T, V) for ids (B, T)
    /// (u32, below the vocabulary), every sequence from position 0, causal. The same
    /// architecture as [`Llama::forward`] (the comment at the top of this file), its frozen
    /// weights read in their file's encoding (`Tape::qlinear`: dX from the same blocks),
    /// with `opts.lora`'s adapters added to the projections they adapt (q, k and v sliced
    /// from the stacked product, gate and up likewise). The architectures whose layers the
    /// tape has every op for: llama (SmolLM2, Llama 3, TinyLlama), mistral within its
    /// window, qwen2; others are refused by name.
    pub fn train_logits(
        &self,
        tape: &mut crate::autograd::Tape,
        rec: &mut Recorder<'_>,
        ids: &Tensor,
        opts: TrainOpts<'_>,
    ) -> Result<crate::autograd::Var> {
        self.train_check(ids, opts)?;
        let mut x = tape.input(self.train_embed(rec, ids)?); // (B, T, E)
        for li in 0..self.layers.len() {
            x = self.train_layer(tape, rec, li, x, opts)?;
        }
        let x = self.train_norm(tape, rec, x)?;
        self.train_output(tape, rec, x) // (B T, V)
    }

    /// Refuses what [`Llama::train_logits`] cannot run: ids not u32 (B, T), longer than the
    /// loaded context or a layer's window, an architecture without training ops, adapters
    /// made for another model.
    pub fn train_check(&self, ids: &Tensor, opts: TrainOpts<'_>) -> Result<()> {
        let c = &self.cfg;
        let bad = |detail: String| Error::Invalid {
            op: "llama train",
            detail,
        };
        let [b, t] = *ids.shape() else {
            return Err(Error::Shape {
                op: "llama train",
                detail: format!("ids {:?}, expected (B, T)", ids.shape()),
            });
        };
        if ids.dtype() != DType::U32 || b == 0 || t == 0 {
            return Err(bad(format!(
                "ids {:?} {:?}: expected u32 (B, T), B, T > 0",
                ids.dtype(),
                ids.shape()
            )));
        }
        if t > self.max_context {
            return Err(bad(format!(
                "sequences of {t} tokens exceed the {} positions this instance was loaded for",
                self.max_context
            )));
        }
        if c.gemma() || c.arch == "qwen3" || c.rope_long.is_some() {
            return Err(bad(format!(
                "fine-tuning runs llama, mistral and qwen2 models; this is {}{}",
                c.arch,
                if c.rope_long.is_some() {
                    " with LongRoPE"
                } else {
                    ""
                }
            )));
        }
        if let Some(w) = (0..c.n_layer).filter_map(|l| c.window(l)).find(|&w| w < t) {
            return Err(bad(format!(
                "sequences of {t} tokens exceed the attention window of {w}: the training kernels have no window mask"
            )));
        }
        if let Some(lo) = opts.lora {
            lo.fits(c)?;
        }
        Ok(())
    }

    /// The token embeddings of ids (B, T): (B, T, E), the training forward's first value.
    pub fn train_embed(&self, rec: &mut Recorder<'_>, ids: &Tensor) -> Result<Tensor> {
        let [b, t] = *ids.shape() else {
            return Err(Error::Shape {
                op: "llama train",
                detail: format!("ids {:?}, expected (B, T)", ids.shape()),
            });
        };
        let e = self.cfg.n_embd;
        self.embd
            .get_rows(rec, &ids.reshape(&[b * t])?)?
            .reshape(&[b, t, e])
    }

    /// Layer `li` of the training forward: x (B, T, E) to the next layer's input.
    pub fn train_layer(
        &self,
        tape: &mut crate::autograd::Tape,
        rec: &mut Recorder<'_>,
        li: usize,
        x: crate::autograd::Var,
        opts: TrainOpts<'_>,
    ) -> Result<crate::autograd::Var> {
        use crate::finetune::lora::Target;
        use crate::ops::attention::AttnOpts;
        let c = &self.cfg;
        let [b, t, _] = *tape.value(x)?.shape() else {
            return Err(Error::Shape {
                op: "llama train",
                detail: format!("x {:?}, expected (B, T, E)", tape.value(x)?.shape()),
            });
        };
        let l = &self.layers[li];
        let (d, hq, hkv, f) = (c.head_dim, c.n_head, c.n_kv_head, c.ffn_hidden);
        let eps = c.norm_eps as f32;
        let seed = opts.dropout_seed;
        let lora = |tape: &mut crate::autograd::Tape,
                    rec: &mut Recorder<'_>,
                    l: usize,
                    tg: Target,
                    x: crate::autograd::Var,
                    y: crate::autograd::Var|
         -> Result<crate::autograd::Var> {
            match opts.lora {
                Some(lo) => lo.apply(tape, rec, l, tg, x, y, seed),
                None => Ok(y),
            }
        };
        // Attention: x += o(attend(rope(q), rope(k), v)), q, k, v from rmsnorm(x).
        let nw = tape.input(l.attn_norm.clone());
        let h = tape.rms_norm(rec, x, nw, eps, false)?;
        let mut qkv = tape.qlinear(rec, h, &l.qkv)?; // (B, T, (Hq + 2 Hkv) D)
        if let Some(bias) = &l.qkv_bias {
            qkv = tape.add_bias(rec, qkv, bias)?;
        }
        let cols = (hq + 2 * hkv) * d;
        let part = |tape: &mut crate::autograd::Tape,
                    rec: &mut Recorder<'_>,
                    start: usize,
                    heads: usize,
                    tg: Target|
         -> Result<crate::autograd::Var> {
            let y = match start == 0 && heads * d == cols {
                true => qkv,
                false => tape.slice(rec, qkv, start, heads * d)?,
            };
            let y = lora(tape, rec, li, tg, h, y)?;
            tape.reshape(y, &[b, t, heads, d])
        };
        let q = part(tape, rec, 0, hq, Target::Q)?;
        let k = part(tape, rec, hq * d, hkv, Target::K)?;
        let v = part(tape, rec, (hq + hkv) * d, hkv, Target::V)?;
        let q = tape.rope(rec, q, &self.rope, 0, c.pairing)?;
        let k = tape.rope(rec, k, &self.rope, 0, c.pairing)?;
        let a = tape.attention(rec, q, k, v, AttnOpts::default())?; // (B, T, Hq, D)
        let a = tape.reshape(a, &[b, t, hq * d])?;
        let o = tape.qlinear(rec, a, &RowSplit::whole(&l.o))?;
        let o = lora(tape, rec, li, Target::O, a, o)?;
        let x = tape.add(rec, x, o)?;
        // MLP: x += down(silu(gate(h)) * up(h)), h = rmsnorm(x).
        let nw = tape.input(l.ffn_norm.clone());
        let h = tape.rms_norm(rec, x, nw, eps, false)?;
        let gu = tape.qlinear(rec, h, &RowSplit::whole(&l.gate_up))?; // (B, T, 2F)
        let gate = tape.slice(rec, gu, 0, f)?;
        let gate = lora(tape, rec, li, Target::Gate, h, gate)?;
        let up = tape.slice(rec, gu, f, f)?;
        let up = lora(tape, rec, li, Target::Up, h, up)?;
        let u = tape.swiglu(rec, gate, up)?;
        let down = tape.qlinear(rec, u, &RowSplit::whole(&l.down))?;
        let down = lora(tape, rec, li, Target::Down, u, down)?;
        tape.add(rec, x, down)
    }

    /// The final norm of the training forward: x (B, T, E) to (B T, E).
    pub fn train_norm(
        &self,
        tape: &mut crate::autograd::Tape,
        rec: &mut Recorder<'_>,
        x: crate::autograd::Var,
    ) -> Result<crate::autograd::Var> {
        let nw = tape.input(self.out_norm.clone());
        let x = tape.rms_norm(rec, x, nw, self.cfg.norm_eps as f32, false)?;
        let rows = tape.value(x)?.numel() / self.cfg.n_embd;
        tape.reshape(x, &[rows, self.cfg.n_embd])
    }

    /// Logits (rows, V) of normed rows (rows, E).
    pub fn train_output(
        &self,
        tape: &mut crate::autograd::Tape,
        rec: &mut Recorder<'_>,
        x: crate::autograd::Var,
    ) -> Result<crate::autograd::Var> {
        tape.qlinear(rec, x, &self.output)
    }
}

/// A metadata reader over a GGUF file's key-value pairs for one architecture.
struct Meta<'a> {
    md: &'a BTreeMap<String, Value>,
    arch: &'a str,
    path: &'a str,
}

impl Meta<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.md.get(&format!("{}.{key}", self.arch))
    }
    fn usize(&self, key: &str) -> Result<usize> {
        self.get(key)
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| {
                format_err(
                    self.path,
                    format!("metadata {}.{key} is missing or not an integer", self.arch),
                )
            })
    }
    fn f64_or(&self, key: &str, default: f64) -> f64 {
        self.get(key).and_then(Value::as_f64).unwrap_or(default)
    }
}

/// LongRoPE's attention factor where a model states none (transformers' rule):
/// sqrt(1 + ln(s) / ln(original)) for a context s = context / original times the original.
fn longrope_attn_factor(context: usize, original: usize) -> f64 {
    let s = context as f64 / original.max(1) as f64;
    match s <= 1.0 || original <= 1 {
        true => 1.0,
        false => (1.0 + s.ln() / (original as f64).ln()).sqrt(),
    }
}

/// The configuration a GGUF file's metadata describes (`general.architecture` and its keys).
pub fn config_from_gguf(md: &BTreeMap<String, Value>, path: &str) -> Result<LlamaConfig> {
    let arch = md
        .get("general.architecture")
        .and_then(Value::as_str)
        .ok_or_else(|| format_err(path, "metadata general.architecture is missing"))?;
    if !ARCHITECTURES.contains(&arch) {
        return Err(format_err(
            path,
            format!(
                "unsupported architecture {arch} (supported: {})",
                ARCHITECTURES.join(", ")
            ),
        ));
    }
    let m = Meta { md, arch, path };
    let n_embd = m.usize("embedding_length")?;
    let n_head = m.usize("attention.head_count")?;
    let n_kv_head = m
        .get("attention.head_count_kv")
        .and_then(Value::as_u64)
        .map(|v| v as usize)
        .unwrap_or(n_head);
    if n_head == 0 || n_embd % n_head != 0 || n_kv_head == 0 || n_head % n_kv_head != 0 {
        return Err(format_err(path, format!("{n_head} heads, {n_kv_head} kv heads, width {n_embd}: heads must divide the width and kv heads the heads")));
    }
    let head_dim = m
        .get("attention.key_length")
        .and_then(Value::as_u64)
        .map(|v| v as usize)
        .unwrap_or(n_embd / n_head);
    if let Some(r) = m.get("rope.dimension_count").and_then(Value::as_u64) {
        if r as usize != head_dim {
            return Err(format_err(
                path,
                format!("partial rotary embedding ({r} of {head_dim} dims) is not supported"),
            ));
        }
    }
    let vocab_size = match m.get("vocab_size").and_then(Value::as_u64) {
        Some(v) => v as usize,
        None => match md.get("tokenizer.ggml.tokens") {
            Some(Value::Array(a)) => a.len(),
            _ => {
                return Err(format_err(
                    path,
                    format!("metadata {arch}.vocab_size and tokenizer.ggml.tokens are missing"),
                ))
            }
        },
    };
    let scaling = md
        .get(&format!("{arch}.rope.scaling.type"))
        .and_then(Value::as_str);
    let rope_linear = match scaling {
        None | Some("none") => None,
        Some("linear") => Some(m.f64_or("rope.scaling.factor", 1.0)),
        Some(other) => {
            return Err(format_err(
                path,
                format!(
                    "RoPE scaling {other:?} is not supported (none, linear, llama3 via rope_freqs)"
                ),
            ))
        }
    };
    // Phi-3's LongRoPE: the original context in the metadata, the factors as tensors
    // (read by the loader); the attention factor stored, or derived as transformers does.
    let context_length = m.usize("context_length")?;
    let rope_long = match m
        .get("rope.scaling.original_context_length")
        .and_then(Value::as_u64)
    {
        Some(orig) if arch == "phi3" => Some(LongRope {
            short: Vec::new(),
            long: Vec::new(),
            original_context: orig as usize,
            attn_factor: m
                .get("rope.scaling.attn_factor")
                .and_then(Value::as_f64)
                .unwrap_or_else(|| longrope_attn_factor(context_length, orig as usize)),
        }),
        _ => None,
    };
    // Phi-3 mini attends to a window (llama.cpp: `phi3.attention.sliding_window`), as do
    // Gemma 3's local layers (five of every six unless the file says otherwise, with their
    // own RoPE base: llama.cpp's rules).
    let n_layer = m.usize("block_count")?;
    let sliding_window = m
        .get("attention.sliding_window")
        .and_then(Value::as_u64)
        .map(|w| w as usize)
        .filter(|&w| w > 0 && w < context_length && matches!(arch, "phi3" | "gemma3"));
    let gemma = arch == "gemma3";
    let sliding_layers = match gemma {
        true => {
            let every = m
                .get("attention.sliding_window_pattern")
                .and_then(Value::as_u64)
                .map_or(GEMMA3_PATTERN, |v| v as usize);
            (0..n_layer)
                .map(|i| every == 0 || (i + 1) % every != 0)
                .collect()
        }
        false => Vec::new(),
    };
    let cfg = LlamaConfig {
        arch: arch.to_string(),
        n_layer,
        n_embd,
        n_head,
        n_kv_head,
        head_dim,
        ffn_hidden: m.usize("feed_forward_length")?,
        vocab_size,
        norm_eps: m.f64_or("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta: m.f64_or("rope.freq_base", 10000.0),
        context_length,
        pairing: if arch == "llama" {
            Pairing::Interleaved
        } else {
            Pairing::Half
        },
        rope_llama3: None,
        rope_linear,
        rope_long,
        sliding_window,
        sliding_layers,
        rope_local_theta: gemma.then(|| m.f64_or("rope.freq_base_swa", 10000.0)),
        // `attention.scale` where the file has it; else llama.cpp's rule: Gemma 3 27B
        // (62 layers) scales by 1/sqrt(width / heads), the others by 1/sqrt(head size),
        // which the kernels do.
        attn_scale: m
            .get("attention.scale")
            .and_then(Value::as_f64)
            .filter(|_| gemma)
            .or_else(|| (gemma && n_layer == 62).then(|| (n_head as f64 / n_embd as f64).sqrt())),
        final_softcap: m.get("final_logit_softcapping").and_then(Value::as_f64),
        norm_shift: 0.0,
        tied_embeddings: false, // set by the loader from the tensors present
    };
    cfg.check(path)?;
    Ok(cfg)
}

/// A Gemma 3 text config with transformers' Gemma3TextConfig defaults under its own keys.
fn gemma3_text_defaults(cfg: &serde_json::Value) -> serde_json::Value {
    let mut out = serde_json::json!({
        "model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 2304,
        "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_local_base_freq": 1e4,
        "sliding_window_pattern": 6, "tie_word_embeddings": true,
    });
    if let (Some(o), Some(c)) = (out.as_object_mut(), cfg.as_object()) {
        for (k, v) in c {
            // A null is an unset value, except for the soft-caps (null: none).
            if !v.is_null() || k.ends_with("softcapping") {
                o.insert(k.clone(), v.clone());
            }
        }
        o.insert("model_type".into(), "gemma3_text".into());
    }
    out
}

/// The configuration of a Hugging Face `config.json`.
pub fn config_from_hf(json: &serde_json::Value, path: &str) -> Result<LlamaConfig> {
    let arch = json
        .get("model_type")
        .and_then(|v| v.as_str())
        .ok_or_else(|| format_err(path, "model_type is missing"))?;
    // Gemma 3's multimodal checkpoints (4B and up) hold the text model's config in
    // `text_config` (its tensors under language_model); Gemma 3 configs may leave out what
    // transformers' Gemma3TextConfig defaults.
    let owned;
    let json = match arch {
        "gemma3" => {
            let tc = json
                .get("text_config")
                .filter(|v| v.is_object())
                .ok_or_else(|| {
                    format_err(
                        path,
                        "gemma3: text_config is missing (the text model's config)",
                    )
                })?;
            owned = gemma3_text_defaults(tc);
            &owned
        }
        "gemma3_text" => {
            owned = gemma3_text_defaults(json);
            &owned
        }
        _ => json,
    };
    let arch = json
        .get("model_type")
        .and_then(|v| v.as_str())
        .unwrap_or(arch);
    if !HF_ARCHITECTURES.contains(&arch) {
        return Err(format_err(
            path,
            format!(
                "unsupported architecture {arch} (supported: {})",
                HF_ARCHITECTURES.join(", ")
            ),
        ));
    }
    let int = |k: &str| -> Result<usize> {
        json.get(k)
            .and_then(|v| v.as_u64())
            .map(|v| v as usize)
            .ok_or_else(|| format_err(path, format!("{k} is missing or not an integer")))
    };
    let num = |k: &str, d: f64| json.get(k).and_then(|v| v.as_f64()).unwrap_or(d);
    let n_embd = int("hidden_size")?;
    let n_head = int("num_attention_heads")?;
    let n_kv_head = int("num_key_value_heads").unwrap_or(n_head);
    if n_head == 0 || n_embd % n_head != 0 || n_kv_head == 0 || n_head % n_kv_head != 0 {
        return Err(format_err(path, format!("{n_head} heads, {n_kv_head} kv heads, width {n_embd}: heads must divide the width and kv heads the heads")));
    }
    let head_dim = json
        .get("head_dim")
        .and_then(|v| v.as_u64())
        .map(|v| v as usize)
        .unwrap_or(n_embd / n_head);
    let gemma = arch == "gemma3_text";
    // Sliding-window layers: Gemma 3's (layer_types, or every sixth layer global); Qwen2/3
    // with use_sliding_window would attend to a window in layers this reader does not
    // know from their config: refused, not approximated.
    let layer_types = json.get("layer_types").and_then(|v| v.as_array());
    let sliding = json.get("use_sliding_window").and_then(|v| v.as_bool()) == Some(true)
        || layer_types.is_some_and(|a| a.iter().any(|t| t.as_str() != Some("full_attention")));
    if sliding && !gemma {
        return Err(format_err(
            path,
            "sliding-window attention layers (use_sliding_window, layer_types) are not supported",
        ));
    }
    if let Some(c) = json.get("attn_logit_softcapping").filter(|v| !v.is_null()) {
        return Err(format_err(
            path,
            format!("attention logit soft-capping ({c}) is not supported"),
        ));
    }
    let act = json
        .get("hidden_activation")
        .or_else(|| json.get("hidden_act"))
        .and_then(|v| v.as_str());
    let want_act = if gemma { "gelu_pytorch_tanh" } else { "silu" };
    if act.is_some_and(|a| a != want_act) {
        return Err(format_err(
            path,
            format!("activation {act:?} is not supported for {arch} ({want_act})"),
        ));
    }
    // RoPE: `rope_theta` and `rope_scaling` (transformers 4), or both in `rope_parameters`
    // (transformers 5: rope_theta and rope_type with the scaling's fields; Gemma 3's per
    // layer kind, full_attention and sliding_attention).
    let mut rope_params = json.get("rope_parameters").filter(|v| v.is_object());
    let local_params = rope_params.and_then(|r| r.get("sliding_attention"));
    if let Some(full) = rope_params.and_then(|r| r.get("full_attention")) {
        rope_params = Some(full);
    }
    let rope_theta = json
        .get("rope_theta")
        .or_else(|| rope_params.and_then(|r| r.get("rope_theta")))
        .and_then(|v| v.as_f64())
        .unwrap_or(10000.0);
    let rope_local_theta = gemma.then(|| {
        json.get("rope_local_base_freq")
            .or_else(|| local_params.and_then(|r| r.get("rope_theta")))
            .and_then(|v| v.as_f64())
            .unwrap_or(10000.0)
    });
    let (mut rope_llama3, mut rope_linear, mut rope_long) = (None, None, None);
    let context_length = int("max_position_embeddings").unwrap_or(4096);
    let scaling = json
        .get("rope_scaling")
        .filter(|v| !v.is_null())
        .or(rope_params);
    if let Some(rs) = scaling {
        let kind = rs
            .get("rope_type")
            .or_else(|| rs.get("type"))
            .and_then(|v| v.as_str())
            .unwrap_or("");
        let f = |k: &str| {
            rs.get(k)
                .and_then(|v| v.as_f64())
                .ok_or_else(|| format_err(path, format!("rope_scaling.{k} is missing")))
        };
        match kind {
            "llama3" => {
                rope_llama3 = Some(Llama3Scaling {
                    factor: f("factor")?,
                    low_freq_factor: f("low_freq_factor")?,
                    high_freq_factor: f("high_freq_factor")?,
                    original_context: f("original_max_position_embeddings")?,
                })
            }
            "linear" => rope_linear = Some(f("factor")?),
            "longrope" | "su" => {
                let factors = |k: &str| -> Result<Vec<f64>> {
                    rs.get(k)
                        .and_then(|v| v.as_array())
                        .filter(|a| a.len() == head_dim / 2)
                        .and_then(|a| a.iter().map(|v| v.as_f64().filter(|f| *f > 0.0)).collect())
                        .ok_or_else(|| {
                            format_err(
                                path,
                                format!("rope_scaling.{k}: expected {} positive numbers (head size / 2)", head_dim / 2),
                            )
                        })
                };
                let orig = json
                    .get("original_max_position_embeddings")
                    .or_else(|| rs.get("original_max_position_embeddings"))
                    .and_then(|v| v.as_u64())
                    .map_or(context_length, |v| v as usize);
                let attn_factor = match rs.get("attention_factor").and_then(|v| v.as_f64()) {
                    Some(a) => a,
                    None => longrope_attn_factor(context_length, orig),
                };
                rope_long = Some(LongRope {
                    short: factors("short_factor")?,
                    long: factors("long_factor")?,
                    original_context: orig,
                    attn_factor,
                });
            }
            "default" => {}
            other => {
                return Err(format_err(
                    path,
                    format!(
                        "rope_scaling type {other:?} is not supported (llama3, linear, longrope)"
                    ),
                ))
            }
        }
    }
    let partial = json
        .get("partial_rotary_factor")
        .or_else(|| rope_params.and_then(|r| r.get("partial_rotary_factor")))
        .and_then(|v| v.as_f64())
        .unwrap_or(1.0);
    if partial != 1.0 {
        return Err(format_err(
            path,
            format!("partial rotary embedding (partial_rotary_factor {partial}) is not supported"),
        ));
    }
    // A model trained with an attention window (Mistral 7B v0.1, Phi-3 mini, Gemma 3's
    // local layers).
    let n_layer = int("num_hidden_layers")?;
    let sliding_window = json
        .get("sliding_window")
        .and_then(|v| v.as_u64())
        .map(|w| w as usize)
        .filter(|&w| {
            w > 0 && w < context_length && matches!(arch, "mistral" | "phi3" | "gemma3_text")
        });
    let sliding_layers = match (gemma, layer_types) {
        (true, Some(a)) => {
            if a.len() != n_layer {
                return Err(format_err(
                    path,
                    format!("layer_types lists {} layers for {n_layer}", a.len()),
                ));
            }
            a.iter()
                .map(|t| t.as_str() == Some("sliding_attention"))
                .collect()
        }
        (true, None) => {
            let every = json
                .get("sliding_window_pattern")
                .and_then(|v| v.as_u64())
                .map_or(GEMMA3_PATTERN, |v| v as usize);
            (0..n_layer)
                .map(|i| every == 0 || (i + 1) % every != 0)
                .collect()
        }
        (false, _) => Vec::new(),
    };
    let attn_scale = match gemma {
        true => Some(num("query_pre_attn_scalar", head_dim as f64).powf(-0.5)),
        false => None,
    };
    let cfg = LlamaConfig {
        arch: if gemma { "gemma3" } else { arch }.to_string(),
        n_layer,
        n_embd,
        n_head,
        n_kv_head,
        head_dim,
        ffn_hidden: int("intermediate_size")?,
        vocab_size: int("vocab_size")?,
        norm_eps: num("rms_norm_eps", 1e-6),
        rope_theta,
        context_length,
        pairing: Pairing::Half,
        rope_llama3,
        rope_linear,
        rope_long,
        sliding_window,
        sliding_layers,
        rope_local_theta,
        attn_scale,
        final_softcap: json.get("final_logit_softcapping").and_then(|v| v.as_f64()),
        norm_shift: if gemma { 1.0 } else { 0.0 },
        tied_embeddings: json
            .get("tie_word_embeddings")
            .and_then(|v| v.as_bool())
            .unwrap_or(false),
    };
    cfg.check(path)?;
    Ok(cfg)
}

/// GGUF tensors under their own names.
impl Source for crate::formats::gguf::GgufFile {
    fn path(&self) -> &str {
        &self.path
    }
    fn has(&self, name: &str) -> bool {
        self.gguf.tensor(name).is_some()
    }
    fn names(&self) -> Option<Vec<String>> {
        Some(self.gguf.tensors.iter().map(|t| t.name.clone()).collect())
    }
    fn type_of(&self, name: &str) -> Option<GgmlType> {
        self.gguf.tensor(name).map(|t| t.ty)
    }
    fn tensor<'a>(&'a self, name: &'a str) -> LocalFuture<'a, Result<Option<Stored<'a>>>> {
        Box::pin(async move {
            let Some(t) = self.gguf.tensor(name) else {
                return Ok(None);
            };
            Ok(Some(Stored {
                bytes: self.read_tensor(t).await?,
                ty: t.ty,
                dims: t.dims.clone(),
            }))
        })
    }
}

/// SafeTensors files of a Hugging Face checkpoint, read under GGUF's names.
pub struct SafeTensorsDir {
    path: String,
    /// Each file's name (for errors) and bytes.
    files: Vec<(String, FileData)>,
    /// Hugging Face name -> (file, dtype, shape, byte range in the file)
    index: BTreeMap<String, (usize, GgmlType, Vec<u64>, std::ops::Range<u64>)>,
}

/// Largest SafeTensors header taken (the safetensors crate's limit).
const ST_MAX_HEADER: u64 = 100_000_000;

fn st_type(shown: &str, name: &str, dtype: &str) -> Result<(GgmlType, u64)> {
    Ok(match dtype {
        "F32" => (GgmlType(0), 4),
        "F16" => (GgmlType(1), 2),
        "BF16" => (GgmlType(30), 2),
        other => {
            return Err(format_err(
                shown,
                format!("{name}: dtype {other} not supported (f32, f16, bf16)"),
            ))
        }
    })
}

impl SafeTensorsDir {
    /// SafeTensors files on disk, read a tensor at a time (a file cut short while it loads
    /// is an error, not a SIGBUS).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn open(files: &[std::path::PathBuf], path: &str) -> Result<SafeTensorsDir> {
        let mut list = Vec::new();
        for f in files {
            let file = crate::formats::DiskFile::open(f)?;
            list.push((f.display().to_string(), FileData::Ranges(Box::new(file))));
        }
        pollster::block_on(Self::from_files(list, path))
    }

    /// SafeTensors files already in memory, each with the name its errors give.
    pub fn from_bytes(
        files: Vec<(String, crate::formats::Bytes)>,
        path: &str,
    ) -> Result<SafeTensorsDir> {
        let mut out = SafeTensorsDir {
            path: path.to_string(),
            files: Vec::new(),
            index: BTreeMap::new(),
        };
        for (fi, (shown, map)) in files.into_iter().enumerate() {
            let st = safetensors::SafeTensors::deserialize(&map)
                .map_err(|e| format_err(&shown, e.to_string()))?;
            let base = map.as_ptr() as usize;
            for (name, view) in st.tensors() {
                let dtype = format!("{:?}", view.dtype());
                let (ty, _) = st_type(&shown, &name, &dtype)?;
                let start = (view.data().as_ptr() as usize - base) as u64;
                let dims = view.shape().iter().rev().map(|&d| d as u64).collect();
                let end = start + view.data().len() as u64;
                out.index.insert(name, (fi, ty, dims, start..end));
            }
            out.files.push((shown, FileData::Whole(map)));
        }
        Ok(out)
    }

    /// SafeTensors files whole or read on demand (a browser's `File`s): of the latter,
    /// the headers now, each tensor when it goes to the GPU.
    pub async fn from_files(files: Vec<(String, FileData)>, path: &str) -> Result<SafeTensorsDir> {
        let mut whole = Vec::new();
        let mut ranged = Vec::new();
        for (shown, data) in files {
            match data {
                FileData::Whole(b) => whole.push((shown, b)),
                FileData::Ranges(r) => ranged.push((shown, FileData::Ranges(r))),
            }
        }
        let mut out = Self::from_bytes(whole, path)?;
        for (shown, data) in ranged {
            let fi = out.files.len();
            let head = data.read(0, 8, &shown).await?;
            let n = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
            if n > ST_MAX_HEADER || n.saturating_add(8) > data.len() {
                return Err(format_err(
                    &shown,
                    format!(
                        "not a SafeTensors file: a header of {n} bytes in a file of {}",
                        data.len()
                    ),
                ));
            }
            let json = data.read(8, n as usize, &shown).await?;
            let header: BTreeMap<String, serde_json::Value> = serde_json::from_slice(&json)
                .map_err(|e| format_err(&shown, format!("SafeTensors header: {e}")))?;
            let data_start = 8 + n;
            let data_len = data.len() - data_start;
            // The tensors' byte ranges, to check that they tile the data exactly (as the
            // safetensors crate requires of a whole file: no gaps, no overlap, nothing after).
            let mut spans: Vec<(u64, u64)> = Vec::new();
            for (name, info) in header {
                if name == "__metadata__" {
                    continue;
                }
                let bad = |what: &str| format_err(&shown, format!("{name}: {what}"));
                let dtype = info["dtype"].as_str().ok_or_else(|| bad("no dtype"))?;
                let (ty, size) = st_type(&shown, &name, dtype)?;
                let shape: Vec<u64> = info["shape"]
                    .as_array()
                    .ok_or_else(|| bad("no shape"))?
                    .iter()
                    .map(|d| d.as_u64().ok_or_else(|| bad("a dimension is not a count")))
                    .collect::<Result<_>>()?;
                let offs = info["data_offsets"]
                    .as_array()
                    .filter(|a| a.len() == 2)
                    .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)))
                    .ok_or_else(|| bad("data_offsets is not [begin, end]"))?;
                let numel = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
                let want = numel.and_then(|n| n.checked_mul(size));
                if offs.0 > offs.1 || offs.1 > data_len || want != Some(offs.1 - offs.0) {
                    return Err(bad(&format!(
                        "data_offsets {offs:?} do not hold a {dtype} {shape:?} tensor in the \
                         {data_len} bytes of data"
                    )));
                }
                spans.push(offs);
                let range = data_start + offs.0..data_start + offs.1;
                let dims = shape.into_iter().rev().collect();
                out.index.insert(name, (fi, ty, dims, range));
            }
            spans.sort_unstable();
            let mut end = 0;
            for (b, e) in spans {
                if b != end {
                    return Err(format_err(
                        &shown,
                        format!("tensor data has a gap or an overlap at byte {b} of the data (the previous tensor ends at {end})"),
                    ));
                }
                end = e;
            }
            if end != data_len {
                return Err(format_err(
                    &shown,
                    format!(
                        "the tensors cover {end} of the {data_len} bytes of data after the header"
                    ),
                ));
            }
            out.files.push((shown, data));
        }
        Ok(out)
    }

    /// The name in these files of a GGUF tensor name: the first of its Hugging Face
    /// names present ([`SafeTensorsDir::hf_names`]).
    fn find(&self, name: &str) -> Option<String> {
        // A multimodal checkpoint keeps its text model under language_model
        // (transformers 4: language_model.model.*, language_model.lm_head; 5:
        // model.language_model.*).
        Self::hf_names(name)
            .into_iter()
            .flat_map(|n| {
                let nested = match n.strip_prefix("model.") {
                    Some(rest) => vec![
                        format!("language_model.model.{rest}"),
                        format!("model.language_model.{rest}"),
                    ],
                    None => vec![format!("language_model.{n}")],
                };
                std::iter::once(n).chain(nested)
            })
            .find(|n| self.index.contains_key(n))
    }

    /// Hugging Face's names for a GGUF name, in the order to look for them: Gemma's
    /// pre_feedforward_layernorm is GGUF's ffn_norm where Llama's is post_attention_layernorm
    /// (Gemma's post_attention_layernorm is GGUF's post_attention_norm); GGUF's ffn_up is
    /// Phi-3's fused gate_up_proj.
    pub fn hf_names(name: &str) -> Vec<String> {
        let fixed = match name {
            "token_embd.weight" => Some("model.embed_tokens.weight"),
            "output_norm.weight" => Some("model.norm.weight"),
            "output.weight" => Some("lm_head.weight"),
            _ => None,
        };
        if let Some(f) = fixed {
            return vec![f.to_string()];
        }
        let Some((i, what)) = name.strip_prefix("blk.").and_then(|r| r.split_once('.')) else {
            return Vec::new();
        };
        let hf: &[&str] = match what {
            "attn_norm.weight" => &["input_layernorm.weight"],
            "ffn_norm.weight" => &[
                "pre_feedforward_layernorm.weight",
                "post_attention_layernorm.weight",
            ],
            "post_attention_norm.weight" => &["post_attention_layernorm.weight"],
            "post_ffw_norm.weight" => &["post_feedforward_layernorm.weight"],
            "attn_q.weight" => &["self_attn.q_proj.weight"],
            "attn_k.weight" => &["self_attn.k_proj.weight"],
            "attn_v.weight" => &["self_attn.v_proj.weight"],
            "attn_q.bias" => &["self_attn.q_proj.bias"],
            "attn_k.bias" => &["self_attn.k_proj.bias"],
            "attn_v.bias" => &["self_attn.v_proj.bias"],
            "attn_output.weight" => &["self_attn.o_proj.weight"],
            "attn_qkv.weight" => &["self_attn.qkv_proj.weight"],
            "attn_q_norm.weight" => &["self_attn.q_norm.weight"],
            "attn_k_norm.weight" => &["self_attn.k_norm.weight"],
            "ffn_gate.weight" => &["mlp.gate_proj.weight"],
            "ffn_up.weight" => &["mlp.up_proj.weight", "mlp.gate_up_proj.weight"],
            "ffn_down.weight" => &["mlp.down_proj.weight"],
            _ => &[],
        };
        hf.iter().map(|h| format!("model.layers.{i}.{h}")).collect()
    }

    /// The name a Llama-layout checkpoint gives a GGUF name (Llama's ffn_norm is
    /// post_attention_layernorm).
    pub fn hf_name(name: &str) -> Option<String> {
        let names = Self::hf_names(name);
        match name.ends_with(".ffn_norm.weight") {
            true => names.last().cloned(),
            false => names.first().cloned(),
        }
    }
}

impl Source for SafeTensorsDir {
    fn path(&self) -> &str {
        &self.path
    }
    fn has(&self, name: &str) -> bool {
        self.find(name).is_some()
    }
    fn type_of(&self, name: &str) -> Option<GgmlType> {
        self.find(name)
            .and_then(|hf| self.index.get(&hf))
            .map(|e| e.1)
    }
    fn tensor<'a>(&'a self, name: &'a str) -> LocalFuture<'a, Result<Option<Stored<'a>>>> {
        Box::pin(async move {
            let found = self.find(name).and_then(|hf| self.index.get(&hf));
            let Some((f, ty, dims, r)) = found else {
                return Ok(None);
            };
            let (shown, data) = &self.files[*f];
            Ok(Some(Stored {
                bytes: data
                    .read(r.start, (r.end - r.start) as usize, shown)
                    .await?,
                ty: *ty,
                dims: dims.clone(),
            }))
        })
    }
}

/// The `*.safetensors` files of a Hugging Face directory, sorted (at least one).
#[cfg(not(target_arch = "wasm32"))]
pub fn safetensors_files(dir: &std::path::Path) -> Result<Vec<std::path::PathBuf>> {
    let shown = dir.display().to_string();
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|source| Error::Io {
            path: shown.clone(),
            source,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format_err(
            &shown,
            "no *.safetensors files in the directory",
        ));
    }
    Ok(files)
}

/// Opens a model: a `.gguf` file, or a directory with `config.json` and `*.safetensors`.
/// Returns the configuration, the loaded model, and the GGUF metadata (empty for
/// SafeTensors) for the tokenizer.
#[cfg(not(target_arch = "wasm32"))]
pub fn open(
    gpu: &Gpu,
    path: &std::path::Path,
    max_context: usize,
) -> Result<(Llama, BTreeMap<String, Value>)> {
    let shown = path.display().to_string();
    if path.is_dir() {
        let cfg_path = path.join("config.json");
        if !cfg_path.is_file() {
            return Err(format_err(
                &shown,
                "a directory without config.json: a model is a .gguf file or a Hugging Face \
                 directory (config.json, *.safetensors, tokenizer.json)",
            ));
        }
        let text = std::fs::read_to_string(&cfg_path).map_err(|source| Error::Io {
            path: cfg_path.display().to_string(),
            source,
        })?;
        let src = SafeTensorsDir::open(&safetensors_files(path)?, &shown)?;
        let model = from_safetensors(
            gpu,
            &text,
            &cfg_path.display().to_string(),
            &src,
            max_context,
        )?;
        return Ok((model, BTreeMap::new()));
    }
    let file = crate::formats::gguf::GgufFile::open(path)?;
    let model = from_gguf(gpu, &file, max_context)?;
    Ok((model, file.gguf.metadata.clone()))
}

/// Loads a parsed GGUF file's model.
#[cfg(not(target_arch = "wasm32"))]
pub fn from_gguf(
    gpu: &Gpu,
    file: &crate::formats::gguf::GgufFile,
    max_context: usize,
) -> Result<Llama> {
    pollster::block_on(from_gguf_async(gpu, file, max_context))
}

/// [`from_gguf`], reading the tensors as they go to the GPU where the file is read on
/// demand ([`GgufFile::from_reader`](crate::formats::gguf::GgufFile::from_reader)).
pub async fn from_gguf_async(
    gpu: &Gpu,
    file: &crate::formats::gguf::GgufFile,
    max_context: usize,
) -> Result<Llama> {
    let mut cfg = config_from_gguf(&file.gguf.metadata, &file.path)?;
    cfg.tied_embeddings = !file.has("output.weight");
    Llama::load_async(gpu, cfg, file, max_context).await
}

/// Loads a Hugging Face checkpoint: its `config.json` text (`cfg_path` names it in errors)
/// and its SafeTensors files.
#[cfg(not(target_arch = "wasm32"))]
pub fn from_safetensors(
    gpu: &Gpu,
    config_json: &str,
    cfg_path: &str,
    src: &SafeTensorsDir,
    max_context: usize,
) -> Result<Llama> {
    pollster::block_on(from_safetensors_async(
        gpu,
        config_json,
        cfg_path,
        src,
        max_context,
    ))
}

/// [`from_safetensors`] without blocking (the browser).
pub async fn from_safetensors_async(
    gpu: &Gpu,
    config_json: &str,
    cfg_path: &str,
    src: &SafeTensorsDir,
    max_context: usize,
) -> Result<Llama> {
    let json: serde_json::Value =
        serde_json::from_str(config_json).map_err(|e| format_err(cfg_path, e.to_string()))?;
    let mut cfg = config_from_hf(&json, cfg_path)?;
    cfg.tied_embeddings = !src.has("output.weight");
    Llama::load_async(gpu, cfg, src, max_context).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranged(bytes: Vec<u8>) -> Result<SafeTensorsDir> {
        let files = vec![(
            "m.safetensors".to_string(),
            FileData::Ranges(Box::new(bytes)),
        )];
        pollster::block_on(SafeTensorsDir::from_files(files, "hf"))
    }

    /// A sliding attention window is kept with the whole context (Mistral 7B v0.1's 4096
    /// of 32768); transformers 5's rope_parameters are read, Gemma 3's per layer kind;
    /// sliding-window Qwen layers, partial rotary embeddings and Gemma 3's multimodal
    /// wrapper are refused.
    #[test]
    fn hf_configs_of_the_new_families() {
        let base = serde_json::json!({
            "model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
            "vocab_size": 300, "max_position_embeddings": 32768, "sliding_window": 4096,
            "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
        });
        let c = config_from_hf(&base, "c.json").unwrap();
        assert_eq!(
            (c.context_length, c.sliding_window, c.rope_theta),
            (32768, Some(4096), 1e6)
        );
        assert_eq!((c.window(0), c.window(1)), (Some(4096), Some(4096)));
        let mut q = base.clone();
        q["model_type"] = "qwen2".into();
        q["use_sliding_window"] = true.into();
        let e = config_from_hf(&q, "c.json").unwrap_err().to_string();
        assert!(e.contains("sliding-window"), "{e}");
        let mut p = base.clone();
        p["model_type"] = "phi3".into();
        p["partial_rotary_factor"] = 0.75.into();
        let e = config_from_hf(&p, "c.json").unwrap_err().to_string();
        assert!(e.contains("partial_rotary_factor 0.75"), "{e}");
        let mut g = base.clone();
        g["model_type"] = "gemma4".into();
        let e = config_from_hf(&g, "c.json").unwrap_err().to_string();
        assert!(e.contains("gemma4") && e.contains("phi3"), "{e}");
        g["model_type"] = "gemma3".into();
        let e = config_from_hf(&g, "c.json").unwrap_err().to_string();
        assert!(e.contains("text_config is missing"), "{e}");
        // gemma-3-4b-it's config.json (text_config as published: what it leaves out is
        // Gemma3TextConfig's default).
        let mm = serde_json::json!({
            "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
            "text_config": {
                "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                "sliding_window": 1024,
            },
            "vision_config": {"model_type": "siglip_vision_model"},
        });
        let c = config_from_hf(&mm, "c.json").unwrap();
        assert_eq!(
            (
                c.arch.as_str(),
                c.n_layer,
                c.n_embd,
                c.n_head,
                c.n_kv_head,
                c.head_dim
            ),
            ("gemma3", 34, 2560, 8, 4, 256)
        );
        assert_eq!(
            (
                c.vocab_size,
                c.sliding_window,
                c.window(5),
                c.rope_linear,
                c.rope_local_theta
            ),
            (262208, Some(1024), None, Some(8.0), Some(1e4))
        );
        // Gemma 3 text: layer kinds, each with its RoPE, the query scale, the norms' shift.
        let gemma = serde_json::json!({
            "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
            "intermediate_size": 96, "vocab_size": 300, "max_position_embeddings": 128,
            "sliding_window": 8, "query_pre_attn_scalar": 64,
            "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": null,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "rope_parameters": {
                "full_attention": {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0},
                "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"},
            },
        });
        let c = config_from_hf(&gemma, "c.json").unwrap();
        assert_eq!(
            (c.arch.as_str(), c.window(0), c.window(1), c.window(2)),
            ("gemma3", Some(8), Some(8), None)
        );
        assert_eq!(
            (
                c.rope_theta,
                c.rope_local_theta,
                c.rope_linear,
                c.attn_scale,
                c.norm_shift
            ),
            (1e6, Some(1e4), Some(8.0), Some(0.125), 1.0)
        );
        let mut g = gemma.clone();
        g["layer_types"] = serde_json::json!(["sliding_attention"]);
        let e = config_from_hf(&g, "c.json").unwrap_err().to_string();
        assert!(e.contains("layer_types lists 1 layers for 3"), "{e}");
        g["layer_types"] = serde_json::Value::Null;
        g["attn_logit_softcapping"] = 50.0.into();
        let e = config_from_hf(&g, "c.json").unwrap_err().to_string();
        assert!(e.contains("soft-capping"), "{e}");
    }

    /// Found by doppler-fuzz: the ranged reader took files the safetensors crate refuses
    /// (bytes after the last tensor, gaps between tensors).
    #[test]
    fn safetensors_read_on_demand_refuse_data_the_tensors_do_not_cover() {
        let files = crate::verify::llama::tiny_files("llama", "F32", 7).unwrap();
        assert!(ranged(files.safetensors.clone()).is_ok());
        let mut longer = files.safetensors.clone();
        longer.extend([0u8; 4]);
        let e = ranged(longer).err().unwrap().to_string();
        assert!(e.contains("m.safetensors") && e.contains("cover"), "{e}");
        // One tensor's range moved 4 bytes on: a gap before it, an overlap after.
        let data = vec![0u8; 16];
        let header = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}}"#;
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend(header.as_bytes());
        file.extend(&data);
        let e = ranged(file).err().unwrap().to_string();
        assert!(e.contains("gap or an overlap at byte 12"), "{e}");
    }

    #[test]
    fn safetensors_read_on_demand_match_the_whole_file() {
        let files = crate::verify::llama::tiny_files("qwen2", "BF16", 7).unwrap();
        let whole = SafeTensorsDir::from_bytes(
            vec![("m.safetensors".into(), Box::new(files.safetensors.clone()))],
            "hf",
        )
        .unwrap();
        let parts = ranged(files.safetensors.clone()).unwrap();
        assert_eq!(whole.index.len(), parts.index.len());
        assert!(whole.index.len() > 10);
        for name in whole.index.keys() {
            assert_eq!(whole.index[name], parts.index[name], "{name}");
        }
        for name in [
            "token_embd.weight",
            "blk.1.attn_k.bias",
            "blk.0.ffn_down.weight",
        ] {
            assert!(parts.has(name) && !parts.has("blk.9.ffn_down.weight"));
            let a = pollster::block_on(whole.tensor(name)).unwrap().unwrap();
            let b = pollster::block_on(parts.tensor(name)).unwrap().unwrap();
            assert_eq!((&a.bytes[..], a.ty, &a.dims), (&b.bytes[..], b.ty, &b.dims));
        }
    }

    /// The tiny model's GGUF metadata and config.json, to break one value at a time.
    fn tiny_meta() -> (BTreeMap<String, Value>, serde_json::Value) {
        let files = crate::verify::llama::tiny_files("llama", "F32", 7).unwrap();
        let g = crate::formats::gguf::Gguf::parse(&files.gguf, "m.gguf").unwrap();
        (g.metadata, serde_json::from_str(&files.config).unwrap())
    }

    #[test]
    fn metadata_that_describes_no_model_is_refused() {
        let (md, json) = tiny_meta();
        config_from_gguf(&md, "m.gguf").unwrap();
        config_from_hf(&json, "config.json").unwrap();
        for (key, v, says) in [
            ("llama.block_count", Value::U32(0), "layers 0"),
            (
                "llama.feed_forward_length",
                Value::U32(0),
                "feed-forward width 0",
            ),
            ("llama.context_length", Value::U32(0), "context length 0"),
            (
                "llama.attention.layer_norm_rms_epsilon",
                Value::F32(f32::NAN),
                "epsilon NaN",
            ),
            ("llama.rope.freq_base", Value::F32(-1.0), "RoPE base -1"),
        ] {
            let mut bad = md.clone();
            bad.insert(key.into(), v);
            let e = config_from_gguf(&bad, "m.gguf").unwrap_err().to_string();
            assert!(e.contains("m.gguf") && e.contains(says), "{key}: {e}");
        }
        for (key, says) in [
            ("num_hidden_layers", "layers 0"),
            ("intermediate_size", "feed-forward width 0"),
            ("vocab_size", "vocabulary 0"),
        ] {
            let mut bad = json.clone();
            bad[key] = 0.into();
            let e = config_from_hf(&bad, "config.json").unwrap_err().to_string();
            assert!(e.contains("config.json") && e.contains(says), "{key}: {e}");
        }
    }

    #[test]
    fn an_eos_outside_the_vocabulary_is_refused() {
        let (mut md, _) = tiny_meta();
        crate::infer::tokenizer::Tokenizer::from_gguf(&md, "m.gguf").unwrap();
        md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(100_000));
        let e = crate::infer::tokenizer::Tokenizer::from_gguf(&md, "m.gguf")
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("eos_token_id 100000 is outside the vocabulary"),
            "{e}"
        );
    }

    #[test]
    fn bad_safetensors_read_on_demand_are_refused_by_name() {
        let good = crate::verify::llama::tiny_files("llama", "F32", 7)
            .unwrap()
            .safetensors;
        let msg = |b: Vec<u8>| ranged(b).err().expect("refused").to_string();
        let mut header = good.clone();
        header[8] = b'|';
        let e = msg(header);
        assert!(
            e.contains("m.safetensors") && e.contains("SafeTensors header"),
            "{e}"
        );
        let e = msg(good[..good.len() - 1].to_vec());
        assert!(e.contains("data_offsets"), "{e}");
        let e = msg(vec![255, 255, 255, 255, 0, 0, 0, 0, 1]);
        assert!(e.contains("not a SafeTensors file"), "{e}");
        let e = msg(vec![1, 2, 3]);
        assert!(e.contains("truncated"), "{e}");
        let i64s = [0u8; 16];
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![2], &i64s).unwrap();
        let e = msg(safetensors::serialize([("model.norm.weight", view)], None).unwrap());
        assert!(e.contains("dtype I64 not supported"), "{e}");
    }
}
