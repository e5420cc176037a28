//! SmolLM2-135M-Instruct (Q4_1 GGUF) against Hugging Face transformers' numbers
//! (`tests/fixtures/smollm2.json`, made by `scripts/make_smollm2_fixture.py`): tokenizer,
//! chat template, the logits after each prompt and greedy continuations.
//!
//! The model is not in the repository: `scripts/fetch_model.sh` puts it in the cache (the
//! README's test command runs it first); `DOPPLER_SMOLLM2` may name the file instead.

use std::path::PathBuf;
use std::sync::OnceLock;

use doppler::gpu::{Gpu, GpuOptions};
use doppler::infer::chat::{Message, Template};
use doppler::infer::sample::{Sampler, SamplerConfig};
use doppler::infer::{GenOptions, Model, Session, StopReason};
use serde_json::Value;

fn model_path() -> PathBuf {
    if let Ok(p) = std::env::var("DOPPLER_SMOLLM2") {
        return p.into();
    }
    let cache = std::env::var("DOPPLER_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/doppler")
        });
    let p = cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch_model.sh (the README's test command does)",
        p.display()
    );
    p
}

fn fixture() -> &'static Value {
    static F: OnceLock<Value> = OnceLock::new();
    F.get_or_init(|| {
        serde_json::from_str(include_str!("fixtures/smollm2.json")).expect("fixture parses")
    })
}

fn gpu() -> &'static Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| {
        Gpu::new_blocking(&GpuOptions::from_env())
            .expect("a GPU adapter (install mesa-vulkan-drivers)")
    })
}

fn model() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| Model::open(gpu(), &model_path(), 256).expect("SmolLM2 loads"))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn tokenizer_matches_hugging_face() {
    let md = doppler::formats::gguf::GgufFile::open(&model_path())
        .unwrap()
        .gguf
        .metadata;
    let tk = doppler::infer::tokenizer::Tokenizer::from_gguf(&md, "smollm2").unwrap();
    let f = fixture();
    let cases = f["tokenize"]
        .as_array()
        .unwrap()
        .iter()
        .chain(f["prompts"].as_array().unwrap());
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["ids"]);
        assert_eq!(tk.encode(text, true).unwrap(), want, "tokens of {text:?}");
        assert_eq!(tk.decode(&want), text, "decode of {text:?}");
    }
    // Without special parsing, control tokens written in text are plain text.
    assert_ne!(
        tk.encode("<|im_start|>", false).unwrap(),
        vec![tk.special("<|im_start|>").unwrap()]
    );
}

#[test]
fn chat_template_matches_hugging_face() {
    let md = doppler::formats::gguf::GgufFile::open(&model_path())
        .unwrap()
        .gguf
        .metadata;
    let jinja = md["tokenizer.chat_template"].as_str().unwrap();
    let t = Template::detect(jinja).expect("ChatML recognised");
    let chat = &fixture()["chat"];
    let msgs: Vec<Message> = serde_json::from_value(chat["messages"].clone()).unwrap();
    assert_eq!(t.render(&msgs, true), chat["text"].as_str().unwrap());
}

/// Logits agree with transformers' f32 run within this with an f32 KV cache (they hold
/// 10-35; both sides dequantize to the same f32 weights, and differ in summation order
/// only), within F16_CACHE_TOL with the f16 cache (the default where the adapter has
/// shader-f16): keys and values rounded to 11 significant bits, and within Q8_CACHE_TOL
/// with the q8_0 cache (8-bit integers, a scale per 32 values).
const LOGIT_TOL: f32 = 2e-3;
const F16_CACHE_TOL: f32 = 2e-2;
const Q8_CACHE_TOL: f32 = 0.5;

/// The largest difference of the fixture's top logits from `logits`, after checking it
/// against `tol`.
fn check_top(pi: usize, step: usize, logits: &[f32], top: &Value, tol: f32) -> f32 {
    let mut worst = 0f32;
    for e in top.as_array().unwrap() {
        let (id, want) = (
            e[0].as_u64().unwrap() as usize,
            e[1].as_f64().unwrap() as f32,
        );
        let d = (logits[id] - want).abs();
        assert!(
            d <= tol,
            "prompt {pi} step {step}: logit of token {id} is {}, transformers {want} (diff {d})",
            logits[id]
        );
        worst = worst.max(d);
    }
    worst
}

#[test]
fn logits_and_greedy_continuations_match_transformers() {
    use doppler::ops::kvcache::KvType;
    let (gpu, m) = (gpu(), model());
    let types = [
        (KvType::F32, LOGIT_TOL),
        (KvType::F16, F16_CACHE_TOL),
        (KvType::Q8_0, Q8_CACHE_TOL),
    ];
    for (dtype, tol) in types {
        let mut worst = 0f32;
        for (pi, p) in fixture()["prompts"].as_array().unwrap().iter().enumerate() {
            // The prompt in one prefill, then greedy steps of one token through the cache:
            // the first prompt for 12 tokens, the others for 3 (lavapipe is slow).
            let mut s = Session::with_cache_type(gpu, m, 256, dtype).unwrap();
            let mut logits = s.feed(gpu, &ids(&p["ids"])).unwrap();
            worst = worst.max(check_top(pi, 0, &logits, &p["top_logits"], tol));
            let want = ids(&p["greedy"]);
            let mut greedy = Sampler::new(SamplerConfig::greedy());
            for step in 0..if pi == 0 { 12 } else { 3 } {
                worst = worst.max(check_top(pi, step, &logits, &p["steps"][step]["top"], tol));
                let next = greedy.sample(&logits, &s.tokens);
                assert_eq!(
                    next, want[step],
                    "prompt {pi}: greedy token {step}, {dtype:?} cache"
                );
                logits = s.feed(gpu, &[next]).unwrap();
            }
        }
        eprintln!(
            "{dtype:?} cache: largest |Doppler - transformers| of the top logits {worst:.2e}"
        );
    }
    // Session::generate streams the same tokens.
    let p = &fixture()["prompts"][0];
    let mut s = Session::new(gpu, m, 256).unwrap();
    let opts = GenOptions {
        max_tokens: 4,
        stop_tokens: vec![],
        stop_strings: vec![],
    };
    let mut streamed = String::new();
    let g = s
        .generate(
            gpu,
            &ids(&p["ids"]),
            &opts,
            &mut Sampler::new(SamplerConfig::greedy()),
            &mut |t| {
                streamed.push_str(t);
                Ok(())
            },
        )
        .unwrap();
    assert_eq!(g.tokens, ids(&p["greedy"])[..4]);
    assert_eq!(streamed, m.tokenizer.decode(&g.tokens));
    // Greedy decoding runs each token's step before reading it: a stop token's step is
    // taken back out of the cache, and a full context stops after the last token that fit.
    let (prompt, want) = (ids(&p["ids"]), ids(&p["greedy"]));
    // want[4] is the first token that did not come before (the fixture's "\n\n" repeats).
    assert!(!want[..4].contains(&want[4]));
    // Greedy generation of up to 8 tokens in a session of `capacity`, stopping at `stop`.
    let run = |capacity: usize, stop: Vec<u32>| {
        let mut s = Session::new(gpu, m, capacity).unwrap();
        let opts = GenOptions {
            max_tokens: 8,
            stop_tokens: stop,
            stop_strings: vec![],
        };
        let mut greedy = Sampler::new(SamplerConfig::greedy());
        let g = s
            .generate(gpu, &prompt, &opts, &mut greedy, &mut |_| Ok(()))
            .unwrap();
        (s, g)
    };
    let (s, g) = run(256, vec![want[4]]);
    assert_eq!(
        (g.tokens.as_slice(), g.stop, g.stop_token),
        (&want[..4], StopReason::Token, Some(want[4]))
    );
    assert_eq!(s.cache.len, prompt.len() + 4);
    assert_eq!(s.tokens, [&prompt[..], &want[..4]].concat());
    let (s, g) = run(prompt.len() + 2, vec![]);
    assert_eq!(
        (g.tokens.as_slice(), g.stop, g.stop_token),
        (&want[..3], StopReason::Context, Some(want[2]))
    );
    assert_eq!(s.cache.len, prompt.len() + 2);
}

#[test]
fn bad_input_is_refused_clearly() {
    let (gpu, m) = (gpu(), model());
    let mut s = Session::new(gpu, m, 8).unwrap();
    let e = s.feed(gpu, &[1, 49152]).unwrap_err().to_string();
    assert!(e.contains("49152") && e.contains("out of range"), "{e}");
    let e = s.feed(gpu, &[1; 9]).unwrap_err().to_string();
    assert!(e.contains("exceed the context of 8"), "{e}");
}
