//! `doppler export`: a Llama-family model written as a Hugging Face directory (SafeTensors
//! in f16, bf16 or f32, `config.json`, the tokenizer), with a LoRA adapter merged in where
//! one is given: W + s B A (PEFT's `merge_and_unload`), s = alpha / r times `--lora-scale`.
//!
//! The base is read tensor by tensor (GGUF blocks dequantized on the CPU as
//! `reference::quant` does); GGUF `llama` files have q and k rows permuted per head, which
//! go back to Hugging Face's order after the merge. Shards of at most 4 GiB (with
//! `model.safetensors.index.json` when there are several), written into a temporary
//! directory renamed into place at the end: an interrupted export leaves nothing at the
//! output path, and an existing one is never replaced.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::adapter::{self, permuted, reorder_rows};
use super::lora::Target;
use crate::error::{Error, Result};
use crate::formats::gguf::{GgufFile, Value};
use crate::gpu::Gpu;
use crate::infer::tokenizer::Tokenizer;
use crate::models::llama::{self, LlamaConfig, SafeTensorsDir, Source};
use crate::train::checkpoint::write_atomic;

/// The architectures written (the ones LoRA trains on).
const ARCHES: [&str; 3] = ["llama", "mistral", "qwen2"];
/// Largest shard written (bytes of tensor data).
const MAX_SHARD: u64 = 4 << 30;
/// Files of a Hugging Face base copied as they are (those present).
const HF_AUX: [&str; 10] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
];

/// The element type written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// The base's float type (its q projection's: f32, f16 or bf16; f16 for quantized).
    Auto,
    F16,
    Bf16,
    F32,
}

impl Dtype {
    fn bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            _ => 2,
        }
    }
    fn torch(self) -> &'static str {
        match self {
            Dtype::F32 => "float32",
            Dtype::Bf16 => "bfloat16",
            _ => "float16",
        }
    }
}

/// What [`export`] does.
pub struct Export<'a> {
    /// A .gguf file or a Hugging Face directory.
    pub base: &'a Path,
    /// A PEFT adapter directory to merge, and the multiplier of its scale.
    pub lora: Option<(&'a Path, f32)>,
    /// The directory to create (it must not exist).
    pub out: &'a Path,
    pub dtype: Dtype,
}

/// What was written.
#[derive(Debug, serde::Serialize)]
pub struct Exported {
    pub dir: PathBuf,
    pub tensors: usize,
    /// Projections with the adapter merged in.
    pub merged: usize,
    /// Bytes of tensor data.
    pub bytes: u64,
    pub shards: usize,
    pub dtype: &'static str,
}

fn bad(path: &Path, detail: impl Into<String>) -> Error {
    Error::Invalid {
        op: "export",
        detail: format!("{}: {}", path.display(), detail.into()),
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.display().to_string(),
        source,
    }
}

/// The base, opened without the GPU.
enum Base {
    Gguf(GgufFile),
    Hf(SafeTensorsDir, serde_json::Value),
}

impl Base {
    fn src(&self) -> &dyn Source {
        match self {
            Base::Gguf(f) => f,
            Base::Hf(d, _) => d,
        }
    }
}

/// The adapted projection a GGUF tensor name is, with its layer.
fn target_of(name: &str) -> Option<(usize, Target)> {
    let (i, what) = name.strip_prefix("blk.")?.split_once('.')?;
    let t = match what {
        "attn_q.weight" => Target::Q,
        "attn_k.weight" => Target::K,
        "attn_v.weight" => Target::V,
        "attn_output.weight" => Target::O,
        "ffn_gate.weight" => Target::Gate,
        "ffn_up.weight" => Target::Up,
        "ffn_down.weight" => Target::Down,
        _ => return None,
    };
    Some((i.parse().ok()?, t))
}

/// Writes the model (with the adapter merged) as a Hugging Face directory; `progress` is
/// called with (tensors done, tensors in all).
pub fn export(gpu: &Gpu, job: &Export, progress: &mut dyn FnMut(usize, usize)) -> Result<Exported> {
    let out = job.out;
    if out.exists() {
        return Err(bad(
            out,
            "already exists: export writes a new directory (remove it or choose another -o)",
        ));
    }
    let (base, mut cfg) = open(job.base)?;
    let src = base.src();
    cfg.tied_embeddings = !src.has("output.weight");
    if !ARCHES.contains(&cfg.arch.as_str()) {
        return Err(bad(
            job.base,
            format!(
                "a {} model: export writes {} (the architectures LoRA trains)",
                cfg.arch,
                ARCHES.join(", ")
            ),
        ));
    }
    // Llama 3.1's RoPE factors as a GGUF tensor without the scaling they came from.
    if src.has("rope_freqs.weight") && cfg.rope_llama3.is_none() {
        return Err(bad(
            job.base,
            "rope_freqs.weight (RoPE frequency factors) without llama3 rope scaling in the \
             metadata: a Hugging Face config cannot say it",
        ));
    }
    let lora = match job.lora {
        Some((dir, mul)) => {
            if !mul.is_finite() {
                return Err(bad(
                    dir,
                    format!("--lora-scale {mul} is not a finite number"),
                ));
            }
            let l = adapter::load(gpu, dir, &cfg)?;
            let s = (l.spec.scaling() * mul as f64) as f32;
            Some((l, s))
        }
        None => None,
    };
    let names = tensor_names(src, &cfg)?;
    let dtype = match job.dtype {
        Dtype::Auto => match src.type_of("blk.0.attn_q.weight").map(|t| t.0) {
            Some(0) => Dtype::F32,
            Some(30) => Dtype::Bf16,
            _ => Dtype::F16,
        },
        d => d,
    };
    // Everything but the tensors first: a tokenizer that cannot be written is refused
    // before the work.
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    match &base {
        Base::Gguf(f) => {
            let md = &f.gguf.metadata;
            let tk = Tokenizer::from_gguf(md, &f.path)?;
            files.push(("tokenizer.json".into(), tk.hf_json(&f.path)?.into_bytes()));
            let piece = |id: Option<u32>| id.and_then(|i| tk.piece(i)).map(String::from);
            let mut tc = serde_json::json!({
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": piece(tk.bos),
                "eos_token": piece(tk.eos),
                "add_bos_token": tk.add_bos,
                "add_eos_token": false,
                "clean_up_tokenization_spaces": false,
                "model_max_length": cfg.context_length,
            });
            if let Some(Value::String(t)) = md.get("tokenizer.chat_template") {
                tc["chat_template"] = t.clone().into();
            }
            files.push(("tokenizer_config.json".into(), pretty(&tc)));
            let gen = serde_json::json!({"bos_token_id": tk.bos, "eos_token_id": tk.eos});
            files.push(("generation_config.json".into(), pretty(&gen)));
            files.push(("config.json".into(), pretty(&hf_config(&cfg, &tk, dtype))));
        }
        Base::Hf(_, json) => {
            let mut json = json.clone();
            json["torch_dtype"] = dtype.torch().into();
            if json.get("dtype").is_some() {
                json["dtype"] = dtype.torch().into();
            }
            files.push(("config.json".into(), pretty(&json)));
            for name in HF_AUX {
                let p = job.base.join(name);
                if p.is_file() {
                    files.push((name.into(), std::fs::read(&p).map_err(io(&p))?));
                }
            }
        }
    }
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io(parent))?;
    let leaf = out
        .file_name()
        .ok_or_else(|| bad(out, "not a directory name"))?
        .to_string_lossy()
        .to_string();
    let tmp = parent.join(format!(".{leaf}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let written = (|| {
        let mut done = write_tensors(gpu, src, &cfg, &names, lora.as_ref(), dtype, &tmp, progress)?;
        for (name, bytes) in &files {
            write_atomic(&tmp.join(name), bytes)?;
        }
        std::fs::rename(&tmp, out).map_err(io(out))?;
        done.dir = out.to_path_buf();
        Ok(done)
    })();
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    written
}

fn pretty(v: &serde_json::Value) -> Vec<u8> {
    let mut s = serde_json::to_string_pretty(v).unwrap_or_default();
    s.push('\n');
    s.into_bytes()
}

/// The base's source and config, read without the GPU.
fn open(path: &Path) -> Result<(Base, LlamaConfig)> {
    if path.is_dir() {
        let cfg_path = path.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(io(&cfg_path))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Format {
            path: cfg_path.display().to_string(),
            detail: e.to_string(),
        })?;
        let cfg = llama::config_from_hf(&json, &cfg_path.display().to_string())?;
        let files = llama::safetensors_files(path)?;
        let src = SafeTensorsDir::open(&files, &path.display().to_string())?;
        return Ok((Base::Hf(src, json), cfg));
    }
    let file = GgufFile::open(path)?;
    let cfg = llama::config_from_gguf(&file.gguf.metadata, &file.path)?;
    Ok((Base::Gguf(file), cfg))
}

/// The GGUF names of every tensor written, in Hugging Face's order; a GGUF file holding
/// others is refused (they would be lost).
fn tensor_names(src: &dyn Source, cfg: &LlamaConfig) -> Result<Vec<String>> {
    let mut names = vec!["token_embd.weight".to_string()];
    for i in 0..cfg.n_layer {
        for s in [
            "attn_norm.weight",
            "attn_q.weight",
            "attn_q.bias",
            "attn_k.weight",
            "attn_k.bias",
            "attn_v.weight",
            "attn_v.bias",
            "attn_output.weight",
            "ffn_norm.weight",
            "ffn_gate.weight",
            "ffn_up.weight",
            "ffn_down.weight",
        ] {
            let n = format!("blk.{i}.{s}");
            if !s.ends_with(".bias") || src.has(&n) {
                names.push(n);
            }
        }
    }
    names.push("output_norm.weight".into());
    if src.has("output.weight") {
        names.push("output.weight".into());
    }
    if let Some(all) = src.names() {
        let extra: Vec<&String> = all
            .iter()
            .filter(|n| !names.contains(n) && n.as_str() != "rope_freqs.weight")
            .collect();
        if let Some(first) = extra.first() {
            return Err(bad(
                Path::new(src.path()),
                format!(
                    "{} tensors a {}-layer {} does not have, such as {first}",
                    extra.len(),
                    cfg.n_layer,
                    cfg.arch
                ),
            ));
        }
    }
    Ok(names)
}

/// A Hugging Face config.json for a model read from GGUF.
fn hf_config(cfg: &LlamaConfig, tk: &Tokenizer, dtype: Dtype) -> serde_json::Value {
    let class = match cfg.arch.as_str() {
        "mistral" => "MistralForCausalLM",
        "qwen2" => "Qwen2ForCausalLM",
        _ => "LlamaForCausalLM",
    };
    let mut c = serde_json::json!({
        "architectures": [class],
        "model_type": cfg.arch,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.context_length,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tied_embeddings,
        "vocab_size": cfg.vocab_size,
        "bos_token_id": tk.bos,
        "eos_token_id": tk.eos,
        "attention_dropout": 0.0,
        "torch_dtype": dtype.torch(),
    });
    match cfg.arch.as_str() {
        "llama" => {
            c["attention_bias"] = false.into();
            c["mlp_bias"] = false.into();
        }
        "qwen2" => c["use_sliding_window"] = false.into(),
        _ => {}
    }
    if let Some(w) = cfg.sliding_window {
        c["sliding_window"] = w.into();
    }
    if let Some(r) = &cfg.rope_llama3 {
        c["rope_scaling"] = serde_json::json!({
            "rope_type": "llama3",
            "factor": r.factor,
            "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_context,
        });
    } else if let Some(f) = cfg.rope_linear {
        c["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": f});
    }
    c
}

/// Reads, merges, converts and writes every tensor into `dir` (shards, index).
#[allow(clippy::too_many_arguments)]
fn write_tensors(
    gpu: &Gpu,
    src: &dyn Source,
    cfg: &LlamaConfig,
    names: &[String],
    lora: Option<&(super::lora::Lora, f32)>,
    dtype: Dtype,
    dir: &Path,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Exported> {
    let path = Path::new(src.path());
    let mut shard: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut shard_bytes = 0u64;
    let (mut total, mut merged) = (0u64, 0usize);
    let mut written: Vec<(PathBuf, Vec<String>)> = Vec::new();
    let flush = |shard: Vec<(String, Vec<usize>, Vec<u8>)>,
                 written: &mut Vec<(PathBuf, Vec<String>)>|
     -> Result<()> {
        if shard.is_empty() {
            return Ok(());
        }
        let dt = match dtype {
            Dtype::F32 => safetensors::Dtype::F32,
            Dtype::Bf16 => safetensors::Dtype::BF16,
            _ => safetensors::Dtype::F16,
        };
        let views = shard
            .iter()
            .map(|(n, s, b)| {
                safetensors::tensor::TensorView::new(dt, s.clone(), b).map(|v| (n.clone(), v))
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| bad(dir, e.to_string()))?;
        let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
        let bytes =
            safetensors::serialize(views, Some(meta)).map_err(|e| bad(dir, e.to_string()))?;
        let p = dir.join(format!("shard-{}.safetensors.part", written.len()));
        write_atomic(&p, &bytes)?;
        written.push((p, shard.into_iter().map(|t| t.0).collect()));
        Ok(())
    };
    for (k, name) in names.iter().enumerate() {
        let stored = pollster::block_on(src.tensor(name))?
            .ok_or_else(|| bad(path, format!("no tensor {name}")))?;
        let n: usize = stored.dims.iter().product::<u64>() as usize;
        // Dims innermost first: the shape is their reverse.
        let shape: Vec<usize> = stored.dims.iter().rev().map(|&d| d as usize).collect();
        let mut v = crate::reference::quant::dequantize(stored.ty, &stored.bytes, n)
            .map_err(|e| bad(path, format!("{name}: {e}")))?;
        drop(stored);
        let cols = *shape.last().unwrap_or(&1);
        if let (Some((lora, s)), Some((layer, t))) = (lora, target_of(name)) {
            if let Some((a, b)) = lora.slot(layer, t) {
                let (i, o) = t.dims(cfg);
                if shape != [o, i] {
                    return Err(bad(
                        path,
                        format!(
                            "{name} is {shape:?}, the adapter's {} needs [{o}, {i}]",
                            t.peft()
                        ),
                    ));
                }
                let am = lora.params.values[a].read_f32(gpu)?;
                let bm = lora.params.values[b].read_f32(gpu)?;
                merge(&mut v, &am, &bm, o, i, lora.spec.rank, *s);
                merged += 1;
            }
        }
        let qk = name.ends_with("attn_q.weight")
            || name.ends_with("attn_k.weight")
            || name.ends_with("attn_q.bias")
            || name.ends_with("attn_k.bias");
        if qk && permuted(cfg) {
            let c = if name.ends_with(".bias") { 1 } else { cols };
            v = reorder_rows(&v, c, cfg.head_dim, true);
        }
        let bytes = convert(&v, dtype).map_err(|x| {
            bad(
                path,
                format!(
                    "{name} holds {x}, beyond {}'s range: export with --dtype f32",
                    dtype.torch()
                ),
            )
        })?;
        let hf = SafeTensorsDir::hf_name(name)
            .ok_or_else(|| bad(path, format!("{name}: no Hugging Face name")))?;
        let len = bytes.len() as u64;
        if shard_bytes + len > MAX_SHARD && shard_bytes > 0 {
            flush(std::mem::take(&mut shard), &mut written)?;
            shard_bytes = 0;
        }
        shard_bytes += len;
        total += len;
        shard.push((hf, shape, bytes));
        progress(k + 1, names.len());
    }
    flush(shard, &mut written)?;
    // Names: model.safetensors, or model-0000i-of-0000N.safetensors with an index.
    let count = written.len();
    let mut map = BTreeMap::new();
    for (i, (p, tensors)) in written.iter().enumerate() {
        let name = match count {
            1 => "model.safetensors".to_string(),
            _ => format!("model-{:05}-of-{count:05}.safetensors", i + 1),
        };
        std::fs::rename(p, dir.join(&name)).map_err(io(p))?;
        for t in tensors {
            map.insert(t.clone(), name.clone());
        }
    }
    if count > 1 {
        let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": map});
        write_atomic(&dir.join("model.safetensors.index.json"), &pretty(&index))?;
    }
    Ok(Exported {
        dir: dir.to_path_buf(),
        tensors: names.len(),
        merged,
        bytes: total,
        shards: count,
        dtype: dtype.torch(),
    })
}

/// W (o, i) += s B A: B (o, r), A (r, i), each element's sum over r in f64.
fn merge(w: &mut [f32], a: &[f32], b: &[f32], o: usize, i: usize, r: usize, s: f32) {
    let mut row = vec![0.0f64; i];
    for (oi, wrow) in w.chunks_exact_mut(i).enumerate().take(o) {
        row.iter_mut().for_each(|x| *x = 0.0);
        for k in 0..r {
            let bk = b[oi * r + k] as f64;
            for (x, &ak) in row.iter_mut().zip(&a[k * i..(k + 1) * i]) {
                *x += bk * ak as f64;
            }
        }
        for (wv, x) in wrow.iter_mut().zip(&row) {
            *wv += (s as f64 * x) as f32;
        }
    }
}

/// Little-endian bytes of `v` in `dtype`; Err(the value) where a finite value overflows.
fn convert(v: &[f32], dtype: Dtype) -> std::result::Result<Vec<u8>, f32> {
    let mut out = Vec::with_capacity(v.len() * dtype.bytes());
    for &x in v {
        match dtype {
            Dtype::F32 => out.extend_from_slice(&x.to_le_bytes()),
            Dtype::Bf16 => {
                let h = half::bf16::from_f32(x);
                if x.is_finite() && !h.is_finite() {
                    return Err(x);
                }
                out.extend_from_slice(&h.to_le_bytes());
            }
            _ => {
                let h = half::f16::from_f32(x);
                if x.is_finite() && !h.is_finite() {
                    return Err(x);
                }
                out.extend_from_slice(&h.to_le_bytes());
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_adds_s_b_a() {
        // W 2x3 zero, B 2x1 = [1, 2], A 1x3 = [1, 0, -1], s = 0.5.
        let mut w = vec![0.0f32; 6];
        merge(&mut w, &[1.0, 0.0, -1.0], &[1.0, 2.0], 2, 3, 1, 0.5);
        assert_eq!(w, [0.5, 0.0, -0.5, 1.0, 0.0, -1.0]);
        assert_eq!(convert(&[70000.0], Dtype::F16), Err(70000.0));
        assert_eq!(convert(&[1.0], Dtype::Bf16).unwrap(), [0x80, 0x3f]);
        assert_eq!(
            target_of("blk.12.ffn_down.weight"),
            Some((12, Target::Down))
        );
        assert_eq!(target_of("blk.1.attn_norm.weight"), None);
    }
}
