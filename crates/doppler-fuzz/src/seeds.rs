//! The seed corpus: Doppler's tiny test models (GGUF, SafeTensors with config.json), a
//! byte-level BPE tokenizer.json with each chat-template style Doppler knows, and the
//! training configs in configs/ plus a llama one. `doppler-fuzz seeds` rewrites it.

use std::path::Path;

use doppler::verify::llama::{byte_chars, tiny_files};

const SEP: &str = "\n--config--\n";

fn tokenizer_json() -> String {
    let mut vocab = serde_json::Map::new();
    for (i, c) in byte_chars().iter().enumerate() {
        vocab.insert(c.to_string(), i.into());
    }
    vocab.insert("he".into(), 256.into());
    let special = |id: u32, content: &str| {
        serde_json::json!({ "id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true })
    };
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(257, "<|im_start|>"), special(258, "<|im_end|>")],
        "normalizer": null,
        "pre_tokenizer": { "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true },
        "post_processor": null,
        "decoder": { "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true },
        "model": { "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "vocab": vocab, "merges": ["h e"] },
    })
    .to_string()
}

pub fn write(dir: &Path) -> Result<(), String> {
    let put = |target: &str, name: &str, bytes: &[u8]| -> Result<(), String> {
        let d = dir.join(target);
        std::fs::create_dir_all(&d).map_err(|e| format!("{}: {e}", d.display()))?;
        let p = d.join(name);
        std::fs::write(&p, bytes).map_err(|e| format!("{}: {e}", p.display()))
    };
    for (arch, ty, seed) in [
        ("llama", "F32", 1),
        ("qwen2", "F16", 2),
        ("llama", "BF16", 3),
    ] {
        let f = tiny_files(arch, ty, seed).map_err(|e| e.to_string())?;
        let stem = format!("{arch}-{}", ty.to_lowercase());
        put("gguf", &format!("{stem}.gguf"), &f.gguf)?;
        let mut st = f.safetensors.clone();
        st.extend_from_slice(SEP.as_bytes());
        st.extend_from_slice(f.config.as_bytes());
        put("safetensors", &format!("{stem}.bin"), &st)?;
    }
    let tk = tokenizer_json();
    let templates = [
        ("chatml", "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
        ("llama3", "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"),
        ("zephyr", "{% for m in messages %}{% if m['role'] == 'user' %}{{ '<|user|>\\n' + m['content'] + eos_token }}{% elif m['role'] == 'assistant' %}{{ '<|assistant|>\\n' + m['content'] + eos_token }}{% endif %}{% endfor %}"),
    ];
    for (name, jinja) in templates {
        let cfg = serde_json::json!({ "bos_token": "<|im_start|>", "eos_token": { "content": "<|im_end|>" },
            "add_bos_token": name == "llama3", "chat_template": jinja });
        put(
            "tokenizer",
            &format!("{name}.bin"),
            format!("{tk}{SEP}{cfg}").as_bytes(),
        )?;
    }
    put("tokenizer", "bare.json", tk.as_bytes())?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    for name in ["default.toml", "shakespeare_char.toml"] {
        let text = std::fs::read(root.join(name)).map_err(|e| format!("{name}: {e}"))?;
        put("train_toml", name, &text)?;
    }
    put(
        "train_toml",
        "llama.toml",
        b"[model]\narch = \"llama\"\nn_layer = 2\nn_embd = 32\nn_head = 4\nn_kv_head = 2\nblock_size = 16\n\
          ffn_hidden = 48\ntie_embeddings = true\nnorm_eps = 1e-6\nrope_theta = 500000.0\n\
          [data]\ncorpus = \"corpus.txt\"\ntokenizer = \"bpe\"\nvocab_size = 300\nval_fraction = 0.05\n\
          [train]\nbatch_size = 4\ngrad_accum = 2\nsteps = 8\nlr = 1e-2\nmin_lr = 1e-3\nwarmup = 2\n\
          weight_decay = 0.1\nbetas = [0.9, 0.95]\ngrad_clip = 1.0\nloss_scale = \"dynamic\"\n\
          eval_interval = 4\neval_batches = 2\ncheckpoint_interval = 4\nseed = 3\nout_dir = \"run\"\n",
    )?;
    // Fine-tuning: the shipped config (byte 0), a PEFT adapter config (1), data (2).
    let ft = std::fs::read(root.join("finetune_smollm2.toml"))
        .map_err(|e| format!("finetune config: {e}"))?;
    put("finetune", "config.bin", &[&[0u8][..], &ft].concat())?;
    let peft = br#"{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "target_modules": ["q_proj", "v_proj"], "bias": "none", "use_dora": false, "rank_pattern": {}, "alpha_pattern": {}}"#;
    put("finetune", "adapter.bin", &[&[1u8][..], peft].concat())?;
    let jsonl = concat!(
        "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}\n",
        "{\"prompt\": \"2 + 2 =\", \"completion\": \" 4\"}\n",
        "{\"text\": \"hello there\"}\n",
    );
    put(
        "finetune",
        "data.bin",
        &[&[2u8][..], jsonl.as_bytes()].concat(),
    )?;
    eprintln!("seed corpus written to {}", dir.display());
    Ok(())
}
