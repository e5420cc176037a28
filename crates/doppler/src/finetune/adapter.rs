//! LoRA adapters on disk as PEFT writes them: a directory with `adapter_config.json` and
//! `adapter_model.safetensors` (tensors `base_model.model.model.layers.{i}.{block}.
//! {module}.lora_A.weight` (r, in) and `lora_B.weight` (out, r)), loadable by
//! `peft.PeftModel.from_pretrained` and written by it. Written into a temporary directory
//! and renamed into place: an interrupted save leaves no partial adapter.
//!
//! A GGUF `llama` base stores q and k with each head's rows permuted for adjacent RoPE
//! pairs (llama.cpp's converter); PEFT's B rows for q and k are in Hugging Face's order, so
//! they are permuted on the way in and back on the way out.

use std::path::{Path, PathBuf};

use super::lora::{peft_name, Lora, LoraSpec, Target};
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::models::llama::LlamaConfig;
use crate::ops::rope::Pairing;

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

fn bad(path: &Path, detail: impl Into<String>) -> Error {
    Error::Invalid {
        op: "lora adapter",
        detail: format!("{}: {}", path.display(), detail.into()),
    }
}

/// Whether q and k rows of this base are in GGUF's permuted order.
pub(crate) fn permuted(cfg: &LlamaConfig) -> bool {
    cfg.pairing == Pairing::Interleaved
}

/// Row r of a head-permuted matrix (GGUF order) holds Hugging Face's row `hf_row(r)`.
fn hf_row(r: usize, d: usize) -> usize {
    let (h, e) = (r / d, r % d);
    h * d + (e % 2) * (d / 2) + e / 2
}

/// A matrix of `rank` columns (B (out, r), or a weight (out, in)) with its rows reordered
/// per head of `d` rows: GGUF -> Hugging Face (`to_hf`) or back.
pub(crate) fn reorder_rows(b: &[f32], rank: usize, d: usize, to_hf: bool) -> Vec<f32> {
    let rows = b.len() / rank;
    let mut out = vec![0.0; b.len()];
    for r in 0..rows {
        let (dst, src) = match to_hf {
            true => (hf_row(r, d), r),
            false => (r, hf_row(r, d)),
        };
        out[dst * rank..(dst + 1) * rank].copy_from_slice(&b[src * rank..(src + 1) * rank]);
    }
    out
}

/// PEFT's adapter_config.json for `spec` on the base at `base`.
pub fn config_json(spec: &LoraSpec, base: &str) -> serde_json::Value {
    serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": spec.targets.iter().map(|t| t.peft()).collect::<Vec<_>>(),
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_rslora": false,
        "use_dora": false,
        "revision": null,
    })
}

/// Writes `lora` (for a base of `cfg`, named `base` in the config) as a PEFT adapter
/// directory `dir`, replacing one that is there only once the new one is complete.
#[cfg(not(target_arch = "wasm32"))]
pub fn save(gpu: &Gpu, lora: &Lora, cfg: &LlamaConfig, base: &str, dir: &Path) -> Result<PathBuf> {
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in lora.params.names.iter().zip(&lora.params.values) {
        let mut v = t.read_f32(gpu)?;
        let qk = name.contains(".q_proj.") || name.contains(".k_proj.");
        if qk && name.ends_with("lora_B.weight") && permuted(cfg) {
            v = reorder_rows(&v, lora.spec.rank, cfg.head_dim, true);
        }
        tensors.push((
            name.clone(),
            t.shape().to_vec(),
            bytemuck::cast_slice(&v).to_vec(),
        ));
    }
    let views = tensors
        .iter()
        .map(|(n, s, b)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .map(|v| (n.clone(), v))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| bad(dir, e.to_string()))?;
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = safetensors::serialize(views, Some(meta)).map_err(|e| bad(dir, e.to_string()))?;
    let json = serde_json::to_string_pretty(&config_json(&lora.spec, base))
        .map_err(|e| bad(dir, e.to_string()))?;
    let io = |p: &Path| {
        let p = p.display().to_string();
        move |source| Error::Io { path: p, source }
    };
    let name = dir
        .file_name()
        .ok_or_else(|| bad(dir, "not a directory name"))?
        .to_string_lossy()
        .to_string();
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io(parent))?;
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let written = (|| {
        crate::train::checkpoint::write_atomic(&tmp.join(WEIGHTS_FILE), &bytes)?;
        crate::train::checkpoint::write_atomic(&tmp.join(CONFIG_FILE), json.as_bytes())?;
        let old = parent.join(format!(".{name}.old-{}", std::process::id()));
        if dir.exists() {
            std::fs::rename(dir, &old).map_err(io(dir))?;
        }
        std::fs::rename(&tmp, dir).map_err(io(dir))?;
        let _ = std::fs::remove_dir_all(&old);
        Ok(())
    })();
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    written.map(|_| dir.to_path_buf())
}

/// The spec of a PEFT adapter_config.json's text; refuses what Doppler does not apply
/// (DoRA, rsLoRA, per-layer ranks, bias training, modules_to_save, other PEFT types).
pub fn read_config(text: &str, path: &Path) -> Result<LoraSpec> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| bad(path, format!("not JSON: {e}")))?;
    let get = |k: &str| v.get(k).filter(|x| !x.is_null());
    if let Some(t) = get("peft_type").and_then(|t| t.as_str()) {
        if t != "LORA" {
            return Err(bad(path, format!("peft_type {t}: only LORA adapters run")));
        }
    }
    for (k, why) in [("use_dora", "DoRA"), ("use_rslora", "rsLoRA scaling")] {
        if get(k).and_then(|x| x.as_bool()) == Some(true) {
            return Err(bad(path, format!("{k}: {why} is not supported")));
        }
    }
    for k in ["rank_pattern", "alpha_pattern"] {
        if get(k)
            .and_then(|x| x.as_object())
            .is_some_and(|o| !o.is_empty())
        {
            return Err(bad(
                path,
                format!("{k}: per-layer ranks and alphas are not supported"),
            ));
        }
    }
    if get("modules_to_save")
        .and_then(|x| x.as_array())
        .is_some_and(|a| !a.is_empty())
    {
        return Err(bad(
            path,
            "modules_to_save: fully trained modules are not supported",
        ));
    }
    if get("bias")
        .and_then(|x| x.as_str())
        .is_some_and(|b| b != "none")
    {
        return Err(bad(path, "bias: trained biases are not supported"));
    }
    let rank = get("r")
        .and_then(|x| x.as_u64())
        .ok_or_else(|| bad(path, "no rank \"r\""))? as usize;
    let alpha = get("lora_alpha").and_then(|x| x.as_f64()).unwrap_or(8.0);
    let dropout = get("lora_dropout").and_then(|x| x.as_f64()).unwrap_or(0.0);
    let names: Vec<String> = match get("target_modules") {
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_str().map(String::from))
            .collect(),
        Some(serde_json::Value::String(s)) if s == "all-linear" => {
            Target::ALL.iter().map(|t| t.peft().to_string()).collect()
        }
        other => {
            return Err(bad(
                path,
                format!("target_modules {other:?}: expected a list of module names"),
            ))
        }
    };
    let mut targets = Vec::new();
    for n in &names {
        let t = Target::ALL
            .into_iter()
            .find(|t| t.peft() == n)
            .ok_or_else(|| bad(path, format!("target module {n:?}: Doppler adapts q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj")))?;
        if !targets.contains(&t) {
            targets.push(t);
        }
    }
    Ok(LoraSpec {
        rank,
        alpha,
        dropout,
        targets,
    })
}

/// Reads a PEFT adapter directory for a base of `cfg`: every tensor present with the
/// shapes this base needs (else an error naming them), nothing else in the file.
#[cfg(not(target_arch = "wasm32"))]
pub fn load(gpu: &Gpu, dir: &Path, cfg: &LlamaConfig) -> Result<Lora> {
    let cfg_path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&cfg_path).map_err(|source| Error::Io {
        path: cfg_path.display().to_string(),
        source,
    })?;
    let spec = read_config(&text, &cfg_path)?;
    let w_path = dir.join(WEIGHTS_FILE);
    let bytes = std::fs::read(&w_path).map_err(|source| Error::Io {
        path: w_path.display().to_string(),
        source,
    })?;
    let st =
        safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(&w_path, e.to_string()))?;
    // Keys as PEFT saves them; also without the "base_model.model." prefix.
    let find = |name: &str| {
        st.tensor(name)
            .or_else(|_| st.tensor(name.trim_start_matches("base_model.model.")))
            .ok()
    };
    let mut used = 0usize;
    let lora = Lora::build(gpu, cfg, spec.clone(), |l, t, (rows, cols), which| {
        let name = peft_name(l, t, which);
        let view = find(&name).ok_or_else(|| bad(&w_path, format!("no tensor {name}")))?;
        if view.shape() != [rows, cols] {
            return Err(bad(
                &w_path,
                format!(
                    "{name} is {:?}; this base ({} layers, width {}) needs [{rows}, {cols}]: an adapter made for another model",
                    view.shape(),
                    cfg.n_layer,
                    cfg.n_embd
                ),
            ));
        }
        used += 1;
        let mut v: Vec<f32> = match view.dtype() {
            safetensors::Dtype::F32 => view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            safetensors::Dtype::F16 => view
                .data()
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            safetensors::Dtype::BF16 => view
                .data()
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => {
                return Err(bad(
                    &w_path,
                    format!("{name} is {other:?}; F32, F16 or BF16 expected"),
                ))
            }
        };
        if matches!(t, Target::Q | Target::K) && which == "lora_B" && permuted(cfg) {
            v = reorder_rows(&v, spec.rank, cfg.head_dim, false);
        }
        Ok(v)
    })?;
    if used != st.len() {
        let extra: Vec<String> = st
            .names()
            .into_iter()
            .filter(|n| {
                lora.params.index(n).is_none()
                    && lora
                        .params
                        .index(&format!("base_model.model.{n}"))
                        .is_none()
            })
            .take(3)
            .map(String::from)
            .collect();
        return Err(bad(&w_path, format!("tensors this base has no place for (layers past {}, or modules not in target_modules): {}", cfg.n_layer, extra.join(", "))));
    }
    Ok(lora)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_rows_round_trip() {
        // d = 4: GGUF rows (0, 1, 2, 3) hold HF rows (0, 2, 1, 3).
        assert_eq!(
            (0..4).map(|r| hf_row(r, 4)).collect::<Vec<_>>(),
            [0, 2, 1, 3]
        );
        let b: Vec<f32> = (0..16).map(|v| v as f32).collect();
        let hf = reorder_rows(&b, 2, 4, true);
        assert_ne!(hf, b);
        assert_eq!(reorder_rows(&hf, 2, 4, false), b);
    }

    #[test]
    fn configs_peft_writes_are_read_and_unsupported_ones_refused() {
        let spec = LoraSpec {
            rank: 8,
            alpha: 16.0,
            dropout: 0.05,
            targets: vec![Target::Q, Target::V, Target::Down],
        };
        let text = config_json(&spec, "m").to_string();
        assert_eq!(read_config(&text, Path::new("a")).unwrap(), spec);
        let p = Path::new("adapter_config.json");
        for (json, want) in [
            (
                r#"{"r": 4, "target_modules": ["q_proj"], "use_dora": true}"#,
                "DoRA",
            ),
            (r#"{"r": 4, "target_modules": ["lm_head"]}"#, "lm_head"),
            (r#"{"target_modules": ["q_proj"]}"#, "no rank"),
            (
                r#"{"r": 4, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}"#,
                "modules_to_save",
            ),
            (r#"{"peft_type": "IA3", "r": 4}"#, "IA3"),
            ("{", "not JSON"),
        ] {
            let e = read_config(json, p).unwrap_err().to_string();
            assert!(
                e.contains(want) && e.contains("adapter_config.json"),
                "{json}: {e}"
            );
        }
    }
}
