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

/// SmolLM2 with a LoRA adapter (rank 4, alpha 8, all seven projections) against
/// transformers + PEFT (`tests/fixtures/smollm2_lora.json`, made by
/// `scripts/make_smollm2_lora_fixture.py`): the adapter is written here in PEFT's layout
/// from the formula the script uses, read back by Doppler's adapter loader (the q/k rows
/// permuted into the GGUF's order) and applied unmerged (`--lora`); the top logits after
/// each prompt and along the greedy continuation are within LORA_TOL of PEFT's, the greedy
/// tokens the same, and the adapter moves the logits by far more than that.
#[test]
fn lora_logits_match_peft() {
    use doppler::finetune::adapter;
    use doppler::finetune::lora::{LoraSpec, Target};
    use doppler::ops::kvcache::KvType;
    const LORA_TOL: f32 = 1e-3;
    let fx: Value = serde_json::from_str(include_str!("fixtures/smollm2_lora.json")).unwrap();
    let gpu = gpu();
    let mut m = Model::open(gpu, &model_path(), 256).unwrap();
    let a = &fx["adapter"];
    let spec = LoraSpec {
        rank: a["rank"].as_u64().unwrap() as usize,
        alpha: a["alpha"].as_f64().unwrap(),
        dropout: 0.0,
        targets: Target::ALL.to_vec(),
    };
    // The script's formula, element (r, c) of layer l's module t.
    let element = |l: usize, t: usize, b: bool, r: usize, c: usize| {
        let shift = if b { 0.9 } else { 0.0 };
        (0.03 * (0.37 * r as f64 + 0.11 * c as f64 + 1.7 * l as f64 + 0.5 * t as f64 + shift).sin())
            as f32
    };
    let mut tensors = Vec::new();
    for l in 0..m.llama.cfg.n_layer {
        for (ti, t) in Target::ALL.iter().enumerate() {
            let (i, o) = t.dims(&m.llama.cfg);
            for (which, rows, cols) in [("lora_A", spec.rank, i), ("lora_B", o, spec.rank)] {
                let v: Vec<f32> = (0..rows * cols)
                    .map(|k| element(l, ti, which == "lora_B", k / cols, k % cols))
                    .collect();
                let name = doppler::finetune::lora::peft_name(l, *t, which);
                tensors.push((name, vec![rows, cols], bytemuck::cast_slice(&v).to_vec()));
            }
        }
    }
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, s, b)| {
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b);
            (n.clone(), v.unwrap())
        })
        .collect();
    let dir = std::env::temp_dir().join(format!("doppler-smol-lora-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join(adapter::WEIGHTS_FILE),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    std::fs::write(
        dir.join(adapter::CONFIG_FILE),
        adapter::config_json(&spec, "SmolLM2-135M-Instruct").to_string(),
    )
    .unwrap();
    let lora = adapter::load(gpu, &dir, &m.llama.cfg).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    m.llama.set_lora(Some((lora, 1.0))).unwrap();
    let mut worst = 0f32;
    for (pi, p) in fx["prompts"].as_array().unwrap().iter().enumerate() {
        let mut s = Session::with_cache_type(gpu, &m, 256, KvType::F32).unwrap();
        let mut logits = s.feed(gpu, &ids(&p["ids"])).unwrap();
        worst = worst.max(check_top(pi, 0, &logits, &p["top_logits"], LORA_TOL));
        let want = ids(&p["greedy"]);
        let mut greedy = Sampler::new(SamplerConfig::greedy());
        for (step, &w) in want.iter().enumerate() {
            worst = worst.max(check_top(
                pi,
                step,
                &logits,
                &p["steps"][step]["top"],
                LORA_TOL,
            ));
            let next = greedy.sample(&logits, &s.tokens);
            assert_eq!(next, w, "prompt {pi}: greedy token {step}");
            logits = s.feed(gpu, &[next]).unwrap();
        }
    }
    eprintln!("LoRA: largest |Doppler - PEFT| of the top logits {worst:.2e}");
    // The adapter matters: without it the same logits are far from PEFT's.
    let p = &fx["prompts"][0];
    let mut s = Session::with_cache_type(gpu, model(), 256, KvType::F32).unwrap();
    let plain = s.feed(gpu, &ids(&p["ids"])).unwrap();
    let moved = p["top_logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (plain[e[0].as_u64().unwrap() as usize] - e[1].as_f64().unwrap() as f32).abs())
        .fold(0f32, f32::max);
    eprintln!("the adapter moves the top logits by up to {moved:.3}");
    assert!(moved > 100.0 * LORA_TOL, "{moved}");
}

/// Token bytes spell the text back; the JSON constraint over the real vocabulary allows
/// only tokens that keep the text valid, and finds them quickly.
#[test]
fn token_bytes_and_the_json_constraint_over_the_vocabulary() {
    use doppler::infer::grammar::{Grammar, JsonConstraint, TokenTrie};
    use doppler::infer::sample::TokenConstraint;
    use std::sync::Arc;
    let tk = &model().tokenizer;
    let text = "Héllo, wörld! 😀 {\"a\": [1, 2]}\n\ttabs";
    let ids = tk.encode(text, false).unwrap();
    let bytes: Vec<u8> = ids
        .iter()
        .flat_map(|&i| tk.token_bytes(i).to_vec())
        .collect();
    assert_eq!(bytes, text.as_bytes());
    // Where decode is the bytes read as UTF-8 (what TextStream builds text from), any ids
    // decode so, split characters and control tokens included.
    assert!(tk.decode_is_bytes());
    let mut x = 99u64;
    for _ in 0..300 {
        let ids: Vec<u32> = (0..1 + x as usize % 9)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) % tk.vocab_size() as u64) as u32
            })
            .collect();
        let b: Vec<u8> = ids
            .iter()
            .flat_map(|&i| tk.token_bytes(i).to_vec())
            .collect();
        assert_eq!(tk.decode(&ids), String::from_utf8_lossy(&b), "{ids:?}");
    }
    let t0 = std::time::Instant::now();
    let trie = Arc::new(TokenTrie::new(tk));
    eprintln!("trie {:?}", t0.elapsed());
    let stop = vec![tk.eos.unwrap()];
    let mut c = JsonConstraint::new(Arc::new(Grammar::json_object()), trie.clone(), stop.clone());
    let v = tk.vocab_size();
    // Walk: at each step the first allowed token of a fixed preference list, else the
    // lowest allowed id; the text stays a prefix of valid JSON and ends whole.
    let prefer: Vec<u32> = tk
        .encode("{\"name\": \"Zoë\", \"n\": [1, 2.5], \"ok\": true}", false)
        .unwrap();
    let mut out: Vec<u8> = Vec::new();
    let mut worst = std::time::Duration::ZERO;
    for step in 0..200 {
        let mut allowed = vec![false; v];
        let t = std::time::Instant::now();
        c.allowed(&mut allowed);
        worst = worst.max(t.elapsed());
        let next = prefer
            .get(step)
            .copied()
            .filter(|&p| allowed[p as usize])
            .or_else(|| allowed.iter().position(|&a| a).map(|i| i as u32))
            .unwrap();
        if stop.contains(&next) {
            break;
        }
        // A stop token is allowed exactly when the text is whole.
        assert_eq!(allowed[stop[0] as usize], c.complete());
        c.accept(next);
        out.extend_from_slice(tk.token_bytes(next));
    }
    eprintln!(
        "worst allowed() {worst:?}: {}",
        String::from_utf8_lossy(&out)
    );
    assert!(c.complete());
    let parsed: Value = serde_json::from_slice(&out).expect("the walk's text parses");
    assert!(parsed.is_object());
}

/// Continuous batching (`infer::batch`): the paged forward pass matches transformers'
/// logits as the one-sequence path does, greedy continuations included; and each
/// sequence's logits are the same bits alone or beside others whose prompts start, decode
/// and finish around it (batch invariance), with pages back in the pool afterwards.
#[test]
fn batched_sequences_match_transformers_and_are_batch_invariant() {
    use doppler::infer::batch::Batch;
    use doppler::ops::kvcache::KvType;
    let (gpu, m) = (gpu(), model());
    let prompts: Vec<&Value> = fixture()["prompts"].as_array().unwrap().iter().collect();
    let argmax = |l: &[f32]| Sampler::new(SamplerConfig::greedy()).sample(l, &[]);
    // Alone: each prompt in one step, then greedy tokens one a step.
    let alone = |pi: usize, steps: usize| -> Vec<Vec<f32>> {
        let mut b = Batch::new(gpu, &m.llama, 64, KvType::F32).unwrap();
        let id = b.add();
        let mut out = vec![b
            .step(gpu, &[(id, &ids(&prompts[pi]["ids"]))])
            .unwrap()
            .remove(0)];
        for _ in 0..steps {
            let next = argmax(out.last().unwrap());
            out.push(b.step(gpu, &[(id, &[next])]).unwrap().remove(0));
        }
        b.remove(id);
        assert_eq!(b.pages_in_use(), 0);
        out
    };
    let a0 = alone(0, 4);
    let want = ids(&prompts[0]["greedy"]);
    for (step, l) in a0.iter().enumerate() {
        check_top(0, step, l, &prompts[0]["steps"][step]["top"], LOGIT_TOL);
        if step < 4 {
            assert_eq!(argmax(l), want[step], "batched greedy token {step}");
        }
    }
    let a1 = alone(1, 2);
    check_top(1, 0, &a1[0], &prompts[1]["top_logits"], LOGIT_TOL);
    // Together: prompt 0 starts; next step prompt 1's prompt joins while 0 decodes; a
    // third sequence (prompt 2) comes and goes in between.
    let mut b = Batch::new(gpu, &m.llama, 64, KvType::F32).unwrap();
    let (s0, s1, s2) = (b.add(), b.add(), b.add());
    let p = |i: usize| ids(&prompts[i.min(prompts.len() - 1)]["ids"]);
    let mut got0 = b.step(gpu, &[(s0, &p(0))]).unwrap();
    let mut l0 = vec![got0.remove(0)];
    let r = b
        .step(gpu, &[(s2, &p(2)), (s0, &[argmax(&l0[0])]), (s1, &p(1))])
        .unwrap();
    l0.push(r[1].clone());
    let mut l1 = vec![r[2].clone()];
    b.remove(s2);
    for _ in 0..2 {
        let r = b
            .step(
                gpu,
                &[
                    (s1, &[argmax(l1.last().unwrap())]),
                    (s0, &[argmax(l0.last().unwrap())]),
                ],
            )
            .unwrap();
        l1.push(r[0].clone());
        l0.push(r[1].clone());
    }
    let bits = |v: &[Vec<f32>]| {
        v.iter()
            .map(|l| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        bits(&l0),
        bits(&a0[..4]),
        "sequence 0: alone and batched differ"
    );
    assert_eq!(
        bits(&l1),
        bits(&a1[..3]),
        "sequence 1: alone and batched differ"
    );
    b.remove(s0);
    b.remove(s1);
    assert_eq!((b.pages_in_use(), b.sequences()), (0, 0));
    // Bad steps are refused before anything changes.
    let s = b.add();
    assert!(b
        .step(gpu, &[(s, &[u32::MAX])])
        .unwrap_err()
        .to_string()
        .contains("vocabulary"));
    assert!(b.step(gpu, &[(s, &vec![1; 64 * 16 + 1])]).is_err());
    assert_eq!(b.pages_in_use(), 0);
    assert!(Batch::new(gpu, &m.llama, 4, KvType::Q8_0).is_err());
}

/// Pipelined steps (`Batch::record` while the step before runs, then `submit` with the
/// tokens, then `wait`), as `doppler serve` runs them: each sequence's logits are the same
/// bits as stepping it alone; a row kept for a sequence that ended (its output unused)
/// changes nobody's; a recorded step is refused for other feeds, a sequence changed
/// since, or while another is in flight; an unsubmitted one runs nothing and leaves no
/// page held once its sequences go.
#[test]
fn pipelined_steps_give_the_same_bits() {
    use doppler::infer::batch::Batch;
    use doppler::ops::kvcache::KvType;
    let (gpu, m) = (gpu(), model());
    let prompts: Vec<&Value> = fixture()["prompts"].as_array().unwrap().iter().collect();
    let argmax = |l: &[f32]| Sampler::new(SamplerConfig::greedy()).sample(l, &[]);
    let p = |i: usize| ids(&prompts[i.min(prompts.len() - 1)]["ids"]);
    let bits = |l: &[f32]| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let alone = |pi: usize, steps: usize| -> Vec<Vec<u32>> {
        let mut b = Batch::new(gpu, &m.llama, 64, KvType::F32).unwrap();
        let id = b.add();
        let mut out = vec![b.step(gpu, &[(id, &p(pi))]).unwrap().remove(0)];
        for _ in 0..steps {
            let next = argmax(out.last().unwrap());
            out.push(b.step(gpu, &[(id, &[next])]).unwrap().remove(0));
        }
        out.iter().map(|l| bits(l)).collect()
    };
    let (a0, a1) = (alone(0, 3), alone(1, 3));
    let mut b = Batch::new(gpu, &m.llama, 64, KvType::F32).unwrap();
    let (s0, s1, s2) = (b.add(), b.add(), b.add());
    let first = b
        .step(gpu, &[(s0, &p(0)), (s1, &p(1)), (s2, &p(2))])
        .unwrap();
    let mut last = vec![first[0].clone(), first[1].clone(), first[2].clone()];
    assert_eq!(bits(&last[0]), a0[0]);
    assert_eq!(bits(&last[1]), a1[0]);
    // s2 "ends" after the first pipelined step but keeps its row in the step recorded
    // meanwhile (fed its last token), then goes.
    let mut plan = vec![(s0, 1), (s1, 1), (s2, 1)];
    let mut ahead = b.record(gpu, &plan).unwrap();
    for k in 1..=3 {
        let toks: Vec<[u32; 1]> = last.iter().map(|l| [argmax(l)]).collect();
        let feeds: Vec<(u64, &[u32])> = plan
            .iter()
            .zip(&toks)
            .map(|(&(id, _), t)| (id, t.as_slice()))
            .collect();
        let flight = b.submit(gpu, ahead, &feeds).unwrap();
        let next_plan = if k == 1 {
            plan.clone()
        } else {
            vec![(s0, 1), (s1, 1)]
        };
        ahead = b.record(gpu, &next_plan).unwrap();
        if k == 1 {
            // One step in flight at a time.
            let extra = b.record(gpu, &[(s0, 1)]).unwrap();
            let err = b.submit(gpu, extra, &[(s0, &toks[0])]).err().unwrap();
            assert!(err.to_string().contains("already submitted"), "{err}");
        }
        let got = pollster::block_on(b.wait(gpu, flight)).unwrap();
        assert_eq!(bits(&got[0]), a0[k], "sequence 0, pipelined step {k}");
        assert_eq!(bits(&got[1]), a1[k], "sequence 1, pipelined step {k}");
        if k == 2 {
            b.remove(s2);
        }
        plan = next_plan;
        last = got;
    }
    // Refused: other feeds than recorded; a sequence changed since the recording.
    let t = [argmax(&last[0])];
    let err = b.submit(gpu, ahead, &[(s0, &t)]).err().unwrap();
    assert!(err.to_string().contains("recorded for"), "{err}");
    let ahead = b.record(gpu, &[(s0, 1)]).unwrap();
    b.step(gpu, &[(s0, &t)]).unwrap();
    let err = b.submit(gpu, ahead, &[(s0, &t)]).err().unwrap();
    assert!(err.to_string().contains("recorded at"), "{err}");
    drop(b.record(gpu, &[(s0, 1), (s1, 1)]).unwrap());
    b.remove(s0);
    b.remove(s1);
    assert_eq!((b.pages_in_use(), b.sequences()), (0, 0));
}

/// Tokens chosen on the GPU (`Batch::record_picking`): a greedy sequence and a seeded draw
/// get the tokens their CPU samplers choose from the logits of each sequence run alone;
/// a sequence the host samples (log-probabilities asked) gets its logits, the same bits;
/// a step recorded with picking is refused without its picks or with picks that do not
/// match, and `wait` refuses it.
#[test]
fn tokens_chosen_on_the_gpu_are_the_samplers() {
    use doppler::infer::batch::{Batch, Chosen};
    use doppler::ops::kvcache::KvType;
    use doppler::ops::sample::Pick;
    let (gpu, m) = (gpu(), model());
    let prompts: Vec<&Value> = fixture()["prompts"].as_array().unwrap().iter().collect();
    let p = |i: usize| ids(&prompts[i.min(prompts.len() - 1)]["ids"]);
    let cfg = |i: usize| SamplerConfig {
        temperature: [0.0, 0.8, 1.3][i],
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 5 + i as u64,
        ..Default::default()
    };
    let sampler = |i: usize| match i {
        2 => Sampler::new(cfg(i)).with_logprobs(1),
        _ => Sampler::new(cfg(i)),
    };
    let steps = 4;
    // Alone, sampled on the CPU: the tokens, and the logits' bits.
    let alone = |i: usize| -> (Vec<u32>, Vec<Vec<u32>>) {
        let mut b = Batch::new(gpu, &m.llama, 64, KvType::F32).unwrap();
        let id = b.add();
        let mut s = sampler(i);
        let mut l = b.step(gpu, &[(id, &p(i))]).unwrap().remove(0);
        let (mut toks, mut bits) = (Vec::new(), Vec::new());
        for _ in 0..steps {
            bits.push(l.iter().map(|x| x.to_bits()).collect());
            let t = s.sample(&l, &[]);
            toks.push(t);
            l = b.step(gpu, &[(id, &[t])]).unwrap().remove(0);
        }
        (toks, bits)
    };
    let want: Vec<_> = (0..3).map(alone).collect();
    let mut b = Batch::new(gpu, &m.llama, 64, KvType::F32).unwrap();
    let seqs = [b.add(), b.add(), b.add()];
    let mut samplers: Vec<Sampler> = (0..3).map(sampler).collect();
    assert!(
        samplers[2].gpu_pick().is_none(),
        "log-probabilities: the host's"
    );
    let host = [false, false, true];
    let mut feeds: Vec<Vec<u32>> = (0..3).map(p).collect();
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); 3];
    for step in 0..steps {
        let refs: Vec<(u64, &[u32])> = seqs
            .iter()
            .zip(&feeds)
            .map(|(&id, f)| (id, f.as_slice()))
            .collect();
        let ahead = b.record_tokens_picking(gpu, &refs, &host).unwrap();
        let picks: Vec<Pick> = samplers
            .iter_mut()
            .map(|s| s.gpu_pick().unwrap_or(Pick::Host))
            .collect();
        let flight = b.submit_picking(gpu, ahead, &refs, &picks).unwrap();
        let out = pollster::block_on(b.wait_chosen(gpu, flight)).unwrap();
        for i in 0..3 {
            let t = match &out[i] {
                Chosen::Token(t) => {
                    samplers[i].accept(*t);
                    *t
                }
                Chosen::Logits(l) => {
                    let bits: Vec<u32> = l.iter().map(|x| x.to_bits()).collect();
                    assert_eq!(bits, want[i].1[step], "sequence {i}'s logits, step {step}");
                    samplers[i].sample(l, &[])
                }
            };
            assert_eq!(matches!(out[i], Chosen::Logits(_)), host[i]);
            got[i].push(t);
            feeds[i] = vec![t];
        }
    }
    for i in 0..3 {
        assert_eq!(got[i], want[i].0, "sequence {i}'s tokens");
    }
    assert!(
        got[1]
            .iter()
            .collect::<std::collections::HashSet<_>>()
            .len()
            > 1
            || steps < 3
    );
    // Refusals.
    let refs: Vec<(u64, &[u32])> = seqs
        .iter()
        .zip(&feeds)
        .map(|(&id, f)| (id, f.as_slice()))
        .collect();
    let plan: Vec<(u64, usize)> = seqs.iter().map(|&id| (id, 1)).collect();
    let ahead = b.record_picking(gpu, &plan, &host).unwrap();
    let err = b.submit(gpu, ahead, &refs).err().unwrap();
    assert!(err.to_string().contains("its picks"), "{err}");
    let ahead = b.record_picking(gpu, &plan, &host).unwrap();
    let err = b
        .submit_picking(
            gpu,
            ahead,
            &refs,
            &[Pick::Greedy, Pick::Greedy, Pick::Greedy],
        )
        .err()
        .unwrap();
    assert!(err.to_string().contains("host choosing rows"), "{err}");
    let ahead = b.record_picking(gpu, &plan, &host).unwrap();
    let flight = b
        .submit_picking(gpu, ahead, &refs, &[Pick::Greedy, Pick::Greedy, Pick::Host])
        .unwrap();
    let err = pollster::block_on(b.wait(gpu, flight)).err().unwrap();
    assert!(err.to_string().contains("wait_chosen"), "{err}");
    for id in seqs {
        b.remove(id);
    }
    assert_eq!((b.pages_in_use(), b.sequences()), (0, 0));
}

/// Chained steps (`Batch::record_chained` / `submit_chained`): each step's tokens are the
/// GPU's choices of the step before, copied on the GPU, and the step is submitted while
/// that one runs. The tokens are the CPU samplers' from each sequence alone, with rows
/// dropped (an ended request) and reordered between steps, and a prompt starting in a
/// chained step beside the chained rows (its tokens known); a page filled by chained
/// tokens is cached under those tokens; two steps in flight refuse what would break them,
/// and a step waited for out of order undoes both.
#[test]
fn chained_steps_give_the_samplers_tokens() {
    use doppler::infer::batch::{Batch, Chosen, InFlight};
    use doppler::ops::kvcache::{KvType, PAGE};
    use doppler::ops::sample::Pick;
    let (gpu, m) = (gpu(), model());
    let prompts: Vec<&Value> = fixture()["prompts"].as_array().unwrap().iter().collect();
    // The first prompt 2 * PAGE - 3 tokens: three chained tokens fill its second page.
    let mut long: Vec<u32> = Vec::new();
    while long.len() < 2 * PAGE - 3 {
        for p in &prompts {
            long.extend(ids(&p["ids"]));
        }
    }
    long.truncate(2 * PAGE - 3);
    let p = |i: usize| match i {
        0 => long.clone(),
        _ => ids(&prompts[i.min(prompts.len() - 1)]["ids"]),
    };
    let cfg = |i: usize| SamplerConfig {
        temperature: [0.0, 0.8, 1.3, 0.6][i],
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 11 + i as u64,
        ..Default::default()
    };
    let steps = 5;
    // Alone, sampled on the CPU.
    let alone = |i: usize| -> Vec<u32> {
        let mut b = Batch::new(gpu, &m.llama, 64, KvType::F32).unwrap();
        let id = b.add();
        let mut s = Sampler::new(cfg(i));
        let mut l = b.step(gpu, &[(id, &p(i))]).unwrap().remove(0);
        let mut toks = Vec::new();
        for _ in 0..steps {
            let t = s.sample(&l, &[]);
            toks.push(t);
            l = b.step(gpu, &[(id, &[t])]).unwrap().remove(0);
        }
        toks
    };
    let want: Vec<Vec<u32>> = (0..4).map(alone).collect();
    let mut b = Batch::new(gpu, &m.llama, 64, KvType::F32).unwrap();
    let seqs = [b.add(), b.add(), b.add(), b.add()];
    let mut samplers: Vec<Sampler> = (0..4).map(|i| Sampler::new(cfg(i))).collect();
    let prompts3: Vec<Vec<u32>> = (0..3).map(p).collect();
    let refs: Vec<(u64, &[u32])> = seqs
        .iter()
        .zip(&prompts3)
        .map(|(&id, f)| (id, f.as_slice()))
        .collect();
    let ahead = b.record_tokens_picking(gpu, &refs, &[false; 3]).unwrap();
    let picks: Vec<Pick> = samplers[..3]
        .iter_mut()
        .map(|s| s.gpu_pick().unwrap())
        .collect();
    let mut flight = b.submit_picking(gpu, ahead, &refs, &picks).unwrap();
    // Each step's sequences in its order: sequence 2's last token is chosen in step 2 (it
    // ends), steps 3 and 4 take 0 and 1 in reverse order; sequence 3's prompt runs in step
    // 3 (known tokens, after the chained rows), its first token chained in step 4.
    let order = |k: usize| -> Vec<usize> {
        match k {
            0..=2 => vec![0, 1, 2],
            3 => vec![1, 0, 3],
            _ => vec![3, 1, 0],
        }
    };
    let p3 = p(3);
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); 4];
    for k in 0..steps {
        let next: Option<InFlight> = (k + 1 < steps).then(|| {
            let o = order(k + 1);
            let (chained, known): (Vec<u64>, Vec<(u64, &[u32])>) = match k + 1 {
                3 => (vec![seqs[1], seqs[0]], vec![(seqs[3], p3.as_slice())]),
                _ => (o.iter().map(|&i| seqs[i]).collect(), Vec::new()),
            };
            let host = vec![false; known.len()];
            let a = b
                .record_chained(gpu, &flight, &chained, &known, &host)
                .unwrap();
            let picks: Vec<Pick> = o.iter().map(|&i| samplers[i].gpu_pick().unwrap()).collect();
            b.submit_chained(gpu, a, &picks).unwrap()
        });
        if k == 1 {
            // Two steps in flight: no plain step, no step chained on the older one.
            let one: Vec<(u64, &[u32])> = vec![(seqs[0], &[1u32])];
            let a = b.record_tokens_picking(gpu, &one, &[false]).unwrap();
            let err = b
                .submit_picking(gpu, a, &one, &[Pick::Greedy])
                .err()
                .unwrap();
            assert!(err.to_string().contains("already submitted"), "{err}");
            let err = b
                .record_chained(gpu, &flight, &[seqs[0]], &[], &[])
                .err()
                .unwrap();
            assert!(err.to_string().contains("newest"), "{err}");
        }
        let out = pollster::block_on(b.wait_chosen(gpu, flight)).unwrap();
        for (&i, c) in order(k).iter().zip(out) {
            let Chosen::Token(t) = c else {
                panic!("every row the GPU's")
            };
            samplers[i].accept(t);
            got[i].push(t);
        }
        if k == 2 {
            b.remove(seqs[2]);
        }
        match next {
            Some(f) => flight = f,
            None => break,
        }
    }
    assert_eq!(got[0], want[0], "sequence 0's tokens");
    assert_eq!(got[1], want[1], "sequence 1's tokens");
    assert_eq!(got[2], want[2][..3], "sequence 2's tokens");
    assert_eq!(got[3], want[3][..2], "sequence 3's tokens");
    // Sequence 0's second page was filled by its first three chosen tokens, fed chained:
    // it is cached under them.
    let mut text = long.clone();
    text.extend(&got[0]);
    let (id, shared) = b.add_prefixed(&text);
    assert_eq!(
        shared,
        2 * PAGE,
        "pages shared by the tokens chained steps fed"
    );
    b.remove(id);
    // Waited for out of order: both steps undone.
    let len0 = b.len(seqs[0]).unwrap();
    let t: Vec<(u64, &[u32])> = vec![(seqs[0], &got[0][steps - 1..])];
    let a = b.record_tokens_picking(gpu, &t, &[false]).unwrap();
    let f1 = b.submit_picking(gpu, a, &t, &[Pick::Greedy]).unwrap();
    let a = b.record_chained(gpu, &f1, &[seqs[0]], &[], &[]).unwrap();
    let f2 = b.submit_chained(gpu, a, &[Pick::Greedy]).unwrap();
    assert_eq!(b.len(seqs[0]), Some(len0 + 2));
    let err = pollster::block_on(b.wait_chosen(gpu, f2)).err().unwrap();
    assert!(err.to_string().contains("order"), "{err}");
    let err = pollster::block_on(b.wait_chosen(gpu, f1)).err().unwrap();
    assert!(err.to_string().contains("undone"), "{err}");
    assert_eq!(b.len(seqs[0]), Some(len0));
    // The batch goes on.
    let a = b.record_tokens_picking(gpu, &t, &[false]).unwrap();
    let f = b.submit_picking(gpu, a, &t, &[Pick::Greedy]).unwrap();
    pollster::block_on(b.wait_chosen(gpu, f)).unwrap();
    for id in [seqs[0], seqs[1], seqs[3]] {
        b.remove(id);
    }
    assert_eq!((b.pages_in_use(), b.sequences()), (0, 0));
}

/// Shared prompt prefixes (`Batch::add_prefixed`): a sequence whose prompt starts with
/// whole pages another sequence filled holds those pages and runs only the rest, and its
/// logits, and the next greedy token's, are the same bits as computing the whole prompt
/// itself; cached pages outlive their sequence until the pool needs them, and nothing is
/// held afterwards.
#[test]
fn shared_prefix_pages_give_the_same_bits() {
    use doppler::infer::batch::Batch;
    use doppler::ops::kvcache::{KvType, PAGE};
    let (gpu, m) = (gpu(), model());
    let prompts: Vec<&Value> = fixture()["prompts"].as_array().unwrap().iter().collect();
    let argmax = |l: &[f32]| Sampler::new(SamplerConfig::greedy()).sample(l, &[]);
    // 40 tokens of the fixture's prompts, then two endings.
    let mut long: Vec<u32> = Vec::new();
    while long.len() < 40 {
        for p in &prompts {
            long.extend(ids(&p["ids"]));
        }
    }
    long.truncate(40);
    let mut second = long[..37].to_vec();
    second.extend(&ids(&prompts[1]["ids"])[..3]);
    let bits = |v: &[Vec<f32>]| -> Vec<Vec<u32>> {
        v.iter()
            .map(|l| l.iter().map(|x| x.to_bits()).collect())
            .collect()
    };
    // A prompt's logits and a greedy token's after it, and the tokens it held from the
    // cache.
    let run = |b: &mut Batch, prompt: &[u32]| -> (Vec<Vec<f32>>, usize) {
        let (id, held) = b.add_prefixed(prompt);
        let mut out = vec![b.step(gpu, &[(id, &prompt[held..])]).unwrap().remove(0)];
        let next = argmax(&out[0]);
        out.push(b.step(gpu, &[(id, &[next])]).unwrap().remove(0));
        b.remove(id);
        (out, held)
    };
    let mut fresh = Batch::new(gpu, &m.llama, 64, KvType::F32).unwrap();
    let (want, held) = run(&mut fresh, &second);
    assert_eq!(held, 0, "an empty cache holds nothing");

    let mut b = Batch::new(gpu, &m.llama, 64, KvType::F32).unwrap();
    let (_, held) = run(&mut b, &long);
    assert_eq!(held, 0);
    assert!(
        b.cached_pages() >= 2,
        "the first prompt's whole pages are cached"
    );
    assert_eq!(
        b.pages_in_use(),
        0,
        "cached pages nobody holds are not in use"
    );
    let (got, held) = run(&mut b, &second);
    assert_eq!(held, 2 * PAGE, "the 37 common tokens hold two whole pages");
    assert_eq!(bits(&got), bits(&want), "shared pages changed the logits");
    // While one sequence holds the pages, another shares them at once.
    let (a, _) = b.add_prefixed(&long);
    let (c, held) = b.add_prefixed(&second);
    assert_eq!(held, 2 * PAGE);
    assert_eq!(b.pages_in_use(), 2);
    b.remove(a);
    b.remove(c);
    assert_eq!((b.pages_in_use(), b.sequences()), (0, 0));
    // A pool too small to keep them: the cached pages are taken for new tokens.
    let mut small = Batch::new(gpu, &m.llama, 3, KvType::F32).unwrap();
    let (_, held) = run(&mut small, &long);
    assert_eq!(held, 0);
    let other: Vec<u32> = long.iter().map(|&t| t + 1).collect();
    run(&mut small, &other);
    let (got, held) = run(&mut small, &second);
    assert!(held < 2 * PAGE, "evicted pages are not shared");
    assert_eq!(bits(&got), bits(&want));
    assert_eq!(small.pages_in_use(), 0);
}

/// `Batch::warm_up` (what `doppler serve` runs before it listens): afterwards, steps of
/// other row counts and lengths (a prompt beside decoding rows, then those rows after it,
/// tokens chosen on the GPU and on the host) compile no pipeline, and the pool is as it
/// was.
#[test]
fn a_warmed_up_batch_compiles_nothing_more() {
    use doppler::infer::batch::Batch;
    use doppler::ops::kvcache::KvType;
    use doppler::ops::sample::Pick;
    // A GPU of its own: the pipelines compiled on it are this test's alone.
    let gpu = Gpu::new_blocking(&GpuOptions::from_env()).unwrap();
    let m = Model::open(&gpu, &model_path(), 256).unwrap();
    let mut b = Batch::new(&gpu, &m.llama, 64, KvType::F32).unwrap();
    assert_eq!(
        b.warm_up(&gpu, 4, 160).unwrap(),
        9 + 7,
        "1, 2, 4, ..., 128 and 160 rows new, up to 64 rows after 192 tokens"
    );
    assert_eq!(
        (b.pages_in_use(), b.sequences(), b.cached_pages()),
        (0, 0, 0)
    );
    let compiled = gpu.pipelines.len();
    // A prompt of 150 tokens: SmolLM2's q/k/v product takes 16 rows of x a workgroup.
    let prompt: Vec<u32> = (0..150).map(|i| 1 + (i * 7919) % 4096).collect();
    let seqs = [b.add(), b.add(), b.add()];
    let mut feeds: Vec<Vec<u32>> = vec![prompt.clone(), vec![1], vec![2]];
    for (rows, host) in [(3, [false, true, false]), (2, [true, false, false])] {
        let refs: Vec<(u64, &[u32])> = seqs[..rows]
            .iter()
            .zip(&feeds)
            .map(|(&id, f)| (id, f.as_slice()))
            .collect();
        let ahead = b.record_tokens_picking(&gpu, &refs, &host[..rows]).unwrap();
        let picks: Vec<Pick> = host[..rows]
            .iter()
            .map(|&h| if h { Pick::Host } else { Pick::Greedy })
            .collect();
        let flight = b.submit_picking(&gpu, ahead, &refs, &picks).unwrap();
        pollster::block_on(b.wait_chosen(&gpu, flight)).unwrap();
        let step_rows: usize = refs.iter().map(|r| r.1.len()).sum();
        assert_eq!(
            gpu.pipelines.len(),
            compiled,
            "a step of {step_rows} rows after the warm-up compiled a pipeline"
        );
        feeds = vec![vec![3]; 3];
    }
}
