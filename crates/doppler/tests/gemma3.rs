//! Gemma 3 270M (a Q4_K_M GGUF: Q8_0 embeddings of 262,144 rows, split by rows on adapters
//! whose storage bindings hold less; q, k and v of two types in some layers) against Hugging
//! Face transformers' numbers (`tests/fixtures/gemma3-270m.json`, made by
//! `scripts/make_gemma3_fixture.py`): the prompt's token ids (BOS first), the logits after
//! each prompt and greedy continuations, with an f32 cache (logits within 2e-3), and the
//! first prompt with the f16 cache (within 2e-2; lavapipe is slow).
//!
//! The model is not in the repository: `scripts/fetch_gemma3.sh` puts it in the cache (the
//! README's test command runs it first); `DOPPLER_GEMMA3` may name the file instead.

use std::path::PathBuf;

use doppler::gpu::{Gpu, GpuOptions};
use doppler::infer::sample::{Sampler, SamplerConfig};
use doppler::infer::{Model, Session};
use doppler::ops::kvcache::KvType;
use serde_json::Value;

fn model_path() -> PathBuf {
    if let Ok(p) = std::env::var("DOPPLER_GEMMA3") {
        return p.into();
    }
    let cache = std::env::var("DOPPLER_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/doppler")
        });
    let p = cache.join("models/gemma-3-270m-q4_k_m.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch_gemma3.sh (the README's test command does)",
        p.display()
    );
    p
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The largest difference of the fixture's top logits from `logits`, checked against `tol`.
fn check_top(what: &str, logits: &[f32], top: &Value, tol: f32) -> f32 {
    let mut worst = 0f32;
    for e in top.as_array().unwrap() {
        let (id, want) = (
            e[0].as_u64().unwrap() as usize,
            e[1].as_f64().unwrap() as f32,
        );
        let d = (logits[id] - want).abs();
        assert!(
            d <= tol,
            "{what}: logit of token {id} is {}, transformers {want} (diff {d})",
            logits[id]
        );
        worst = worst.max(d);
    }
    worst
}

#[test]
fn gemma3_270m_matches_transformers() {
    let fx: Value =
        serde_json::from_str(include_str!("fixtures/gemma3-270m.json")).expect("fixture parses");
    let gpu = Gpu::new_blocking(&GpuOptions::from_env())
        .expect("a GPU adapter (install mesa-vulkan-drivers)");
    let m = Model::open(&gpu, &model_path(), 128).expect("Gemma 3 270M loads");
    assert_eq!(m.llama.cfg.arch, "gemma3");
    let prompts = fx["prompts"].as_array().unwrap();
    for (ty, tol, n) in [(KvType::F32, 2e-3, prompts.len()), (KvType::F16, 2e-2, 1)] {
        let mut worst = 0f32;
        for (pi, p) in prompts.iter().take(n).enumerate() {
            let text = p["text"].as_str().unwrap();
            let want_ids = ids(&p["ids"]);
            assert_eq!(
                m.prompt_ids(text, false, true).unwrap(),
                want_ids,
                "tokens of {text:?}"
            );
            let mut s = Session::with_cache_type(&gpu, &m, 128, ty).unwrap();
            let mut logits = s.feed(&gpu, &want_ids).unwrap();
            let what = format!("prompt {pi}, {ty:?} cache");
            worst = worst.max(check_top(&what, &logits, &p["top_logits"], tol));
            let want = ids(&p["greedy"]);
            let mut greedy = Sampler::new(SamplerConfig::greedy());
            for (step, &w) in want.iter().enumerate() {
                let what = format!("prompt {pi} step {step}, {ty:?} cache");
                worst = worst.max(check_top(&what, &logits, &p["steps"][step]["top"], tol));
                let next = greedy.sample(&logits, &s.tokens);
                assert_eq!(next, w, "{what}: greedy token");
                if step + 1 < want.len() {
                    logits = s.feed(&gpu, &[next]).unwrap();
                }
            }
        }
        eprintln!("{ty:?} cache: largest |Doppler - transformers| of the top logits {worst:.2e}");
    }
}
