//! The Llama-family loader and decoder on tiny random models written both ways: as GGUF
//! (llama.cpp's layout: q/k rows permuted for adjacent RoPE pairs under `llama`) and as a
//! Hugging Face directory (config.json + SafeTensors, rotate-half), in f32, f16 and bf16,
//! for `llama`, `qwen2` (q/k/v biases) and `qwen3` (q/k head norms). Both must give the same logits over a prefill
//! and cached single-token steps. (SmolLM2 itself is checked against transformers by the
//! test suite: tests/smollm2.rs.)

#[cfg(not(target_arch = "wasm32"))]
use std::path::{Path, PathBuf};

use half::{bf16, f16};

use super::{push, s, CheckResult, Outcome};
use crate::check::{compare, Rng, Tolerance};
use crate::formats::gguf::{self, GgmlType, Value};
use crate::gpu::Gpu;
use crate::models::llama::{self, Llama};

/// Shapes of the tiny models: 2 layers, width 32, 4 heads of 8, 2 kv heads, SwiGLU 48, a
/// byte-level vocabulary of 256 bytes, one merge ("he") and 2 control tokens.
const LAYERS: usize = 2;
const E: usize = 32;
const H: usize = 4;
const KV: usize = 2;
const D: usize = 8;
const FF: usize = 48;
pub const VOCAB: usize = 259;

/// GPT-2's byte -> printable character table (bytes_to_unicode).
pub fn byte_chars() -> Vec<char> {
    let printable: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
    let mut next = 256;
    (0..256u32)
        .map(|b| {
            if printable.contains(&b) {
                char::from_u32(b).unwrap()
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap()
            }
        })
        .collect()
}

/// Tensors (GGUF name, shape as Hugging Face writes it, f32 values) of a tiny random model.
pub(super) fn tensors(arch: &str, seed: u64) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut rng = Rng::new(seed);
    let mut t = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
        let n = shape.iter().product();
        let v = rng.vec(n).into_iter().map(|x| x * scale + offset).collect();
        t.push((name, shape, v));
    };
    add("token_embd.weight".into(), vec![VOCAB, E], 1.0, 0.0);
    for i in 0..LAYERS {
        let p = |s: &str| format!("blk.{i}.{s}");
        add(p("attn_norm.weight"), vec![E], 0.2, 1.0);
        add(p("attn_q.weight"), vec![H * D, E], 0.3, 0.0);
        add(p("attn_k.weight"), vec![KV * D, E], 0.3, 0.0);
        add(p("attn_v.weight"), vec![KV * D, E], 0.3, 0.0);
        if arch == "qwen2" {
            add(p("attn_q.bias"), vec![H * D], 0.3, 0.0);
            add(p("attn_k.bias"), vec![KV * D], 0.3, 0.0);
            add(p("attn_v.bias"), vec![KV * D], 0.3, 0.0);
        }
        if arch == "qwen3" {
            add(p("attn_q_norm.weight"), vec![D], 0.3, 1.0);
            add(p("attn_k_norm.weight"), vec![D], 0.3, 1.0);
        }
        add(p("attn_output.weight"), vec![E, H * D], 0.3, 0.0);
        add(p("ffn_norm.weight"), vec![E], 0.2, 1.0);
        add(p("ffn_gate.weight"), vec![FF, E], 0.3, 0.0);
        add(p("ffn_up.weight"), vec![FF, E], 0.3, 0.0);
        add(p("ffn_down.weight"), vec![E, FF], 0.3, 0.0);
    }
    add("output_norm.weight".into(), vec![E], 0.2, 1.0);
    if arch == "qwen2" {
        add("output.weight".into(), vec![VOCAB, E], 1.0, 0.0);
    }
    t
}

/// llama.cpp's q/k row order for `llama`: within each head, row 2i + j holds Hugging Face's
/// row j * D/2 + i (rotate-half pairs become adjacent pairs).
fn permute_rows(w: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; w.len()];
    for h in 0..heads {
        for i in 0..D / 2 {
            for j in 0..2 {
                let (dst, src) = (h * D + 2 * i + j, h * D + j * D / 2 + i);
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

fn encode(v: &[f32], ty: &str) -> Vec<u8> {
    match ty {
        "F16" => v
            .iter()
            .flat_map(|x| f16::from_f32(*x).to_le_bytes())
            .collect(),
        "BF16" => v
            .iter()
            .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
            .collect(),
        _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// The files of one tiny random model, in memory: what [`write_tiny`] writes.
pub struct TinyFiles {
    /// `model.gguf`.
    pub gguf: Vec<u8>,
    /// The Hugging Face directory's `model.safetensors`.
    pub safetensors: Vec<u8>,
    /// The Hugging Face directory's `config.json`.
    pub config: String,
}

/// One tiny random model with matrices in `ty` (F32, F16 or BF16; norms F32 in the GGUF as
/// llama.cpp writes them), as GGUF and as a Hugging Face directory. The GGUF carries a
/// byte-level tokenizer and a ChatML template, for command tests.
pub fn tiny_files(arch: &str, ty: &str, seed: u64) -> crate::Result<TinyFiles> {
    let tensors = tensors(arch, seed);
    // Hugging Face directory.
    let st_dtype = match ty {
        "F16" => safetensors::Dtype::F16,
        "BF16" => safetensors::Dtype::BF16,
        _ => safetensors::Dtype::F32,
    };
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|(_, _, v)| encode(v, ty)).collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, sh, _), b)| {
            (
                llama::SafeTensorsDir::hf_name(n).expect("a Hugging Face name"),
                safetensors::tensor::TensorView::new(st_dtype, sh.clone(), b)
                    .expect("consistent view"),
            )
        })
        .collect();
    let safetensors = safetensors::serialize(views, None).map_err(|e| crate::Error::Invalid {
        op: "safetensors",
        detail: e.to_string(),
    })?;
    let config = serde_json::json!({
        "model_type": arch, "hidden_size": E, "num_hidden_layers": LAYERS, "num_attention_heads": H,
        "num_key_value_heads": KV, "intermediate_size": FF, "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": arch != "qwen2",
    })
    .to_string();
    // GGUF.
    let gty = GgmlType::from_name(ty).expect("known type");
    let mut g: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)> = Vec::new();
    for (name, shape, v) in &tensors {
        let gname = name.clone();
        let mut v = v.clone();
        if arch == "llama" && (name.ends_with("attn_q.weight") || name.ends_with("attn_k.weight")) {
            v = permute_rows(&v, shape[0] / D, shape[1]);
        }
        // Vectors as F32 (as llama.cpp writes norms), holding the values the SafeTensors
        // file rounded to its dtype.
        let (t, b) = if shape.len() == 1 {
            let rounded = crate::reference::quant::dequantize(gty, &encode(&v, ty), v.len())
                .map_err(|e| crate::Error::Invalid {
                    op: "write_tiny",
                    detail: e.to_string(),
                })?;
            (GgmlType(0), encode(&rounded, "F32"))
        } else {
            (gty, encode(&v, ty))
        };
        g.push((gname, shape.iter().rev().map(|&d| d as u64).collect(), t, b));
    }
    let chars = byte_chars();
    let mut tokens: Vec<Value> = chars.iter().map(|c| Value::String(c.to_string())).collect();
    tokens.extend([
        Value::String("he".into()),
        Value::String("<|im_start|>".into()),
        Value::String("<|im_end|>".into()),
    ]);
    let mut types = vec![Value::I32(1); 257];
    types.extend([Value::I32(3), Value::I32(3)]);
    let a = |k: &str| format!("{arch}.{k}");
    let md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (a("block_count"), Value::U32(LAYERS as u32)),
        (a("context_length"), Value::U32(64)),
        (a("embedding_length"), Value::U32(E as u32)),
        (a("feed_forward_length"), Value::U32(FF as u32)),
        (a("attention.head_count"), Value::U32(H as u32)),
        (a("attention.head_count_kv"), Value::U32(KV as u32)),
        (a("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        (a("rope.freq_base"), Value::F32(10000.0)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("gpt-2".into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.merges".into(), Value::Array(vec![Value::String("h e".into())])),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(257)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(258)),
        ("tokenizer.chat_template".into(), Value::String("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}".into())),
    ];
    let md_ref: Vec<(&str, Value)> = md.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let t_ref: Vec<(&str, &[u64], GgmlType, &[u8])> = g
        .iter()
        .map(|(n, d, t, b)| (n.as_str(), d.as_slice(), *t, b.as_slice()))
        .collect();
    Ok(TinyFiles {
        gguf: gguf::write(&md_ref, &t_ref, 32),
        safetensors,
        config,
    })
}

/// Writes `dir/model.gguf` and the Hugging Face directory `dir/hf` (`model.safetensors`,
/// `config.json`) of [`tiny_files`]' model.
#[cfg(not(target_arch = "wasm32"))]
pub fn write_tiny(
    dir: &Path,
    arch: &str,
    ty: &str,
    seed: u64,
) -> crate::Result<(PathBuf, PathBuf)> {
    let io = |p: &Path| {
        let p = p.display().to_string();
        move |source| crate::Error::Io {
            path: p.clone(),
            source,
        }
    };
    let files = tiny_files(arch, ty, seed)?;
    let hf = dir.join("hf");
    std::fs::create_dir_all(&hf).map_err(io(&hf))?;
    std::fs::write(hf.join("model.safetensors"), files.safetensors).map_err(io(&hf))?;
    std::fs::write(hf.join("config.json"), files.config).map_err(io(&hf))?;
    let file = dir.join("model.gguf");
    std::fs::write(&file, files.gguf).map_err(io(&file))?;
    Ok((file, hf))
}

/// Seed of the checked models' weights.
const SEED: u64 = 4100;

/// Where the checks write their models: a directory of this process's own.
#[cfg(not(target_arch = "wasm32"))]
fn scratch() -> PathBuf {
    std::env::temp_dir().join(format!("doppler-verify-llama-{}", std::process::id()))
}

/// The tiny model opened both ways, GGUF first: from the files [`write_tiny`] writes, as
/// `doppler` opens a model.
#[cfg(not(target_arch = "wasm32"))]
async fn open_both(gpu: &Gpu, arch: &str, ty: &str) -> crate::Result<[Llama; 2]> {
    let (g, hf) = write_tiny(&scratch().join(format!("{arch}-{ty}")), arch, ty, SEED)?;
    Ok([llama::open(gpu, &g, 64)?.0, llama::open(gpu, &hf, 64)?.0])
}

/// The tiny model opened both ways, GGUF first: in the browser, which has no files, from
/// the same bytes in memory, both read on demand as a browser reads a `File`.
#[cfg(target_arch = "wasm32")]
async fn open_both(gpu: &Gpu, arch: &str, ty: &str) -> crate::Result<[Llama; 2]> {
    let files = tiny_files(arch, ty, SEED)?;
    let g = gguf::GgufFile::from_reader(Box::new(files.gguf), "model.gguf").await?;
    let st = llama::SafeTensorsDir::from_files(
        vec![(
            "hf/model.safetensors".into(),
            crate::formats::FileData::Ranges(Box::new(files.safetensors)),
        )],
        "hf",
    )
    .await?;
    Ok([
        llama::from_gguf_async(gpu, &g, 64).await?,
        llama::from_safetensors_async(gpu, &files.config, "hf/config.json", &st, 64).await?,
    ])
}

/// Logits of a 7-token prefill, then two single-token steps, concatenated.
async fn run(gpu: &Gpu, m: &Llama) -> crate::Result<Vec<f32>> {
    let mut cache = m.cache(gpu, 64)?;
    let mut out = Vec::new();
    for ids in [&[3u32, 250, 17, 99, 0, 257, 42][..], &[7], &[128]] {
        let l = gpu
            .run_async(|rec| m.forward(rec, ids, &mut cache, false))
            .await?;
        out.extend(l.to_vec_f32(gpu).await?);
    }
    Ok(out)
}

pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for arch in ["llama", "qwen2", "qwen3"] {
        for ty in ["F32", "F16", "BF16"] {
            let res: Outcome = async {
                let [g, hf] = open_both(gpu, arch, ty).await.map_err(s)?;
                let a = run(gpu, &g).await.map_err(s)?;
                let b = run(gpu, &hf).await.map_err(s)?;
                // Same weights, same math; only the row order of q/k (and the RoPE pairing
                // that undoes it) differs: agreement to rounding.
                let want: Vec<f64> = b.iter().map(|&v| v as f64).collect();
                compare(
                    "llama gguf vs safetensors",
                    &a,
                    &want,
                    None,
                    Tolerance {
                        abs: 1e-4,
                        rel: 1e-5,
                    },
                )
                .map_err(s)
            }
            .await;
            push(
                out,
                &format!("llama gguf vs safetensors {arch}"),
                format!("{ty}, 7 + 2x1 tokens"),
                res,
            );
        }
    }
    #[cfg(not(target_arch = "wasm32"))]
    let _ = std::fs::remove_dir_all(scratch());
}
