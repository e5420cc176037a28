//! What each target feeds its input to: the parsers a user's files reach, and what runs
//! on what they return (names, shapes, offsets, token ids), never the GPU. `Ok` means
//! the input was accepted (it joins the corpus); `Err` a clean refusal. A panic, an abort
//! or an allocation past the limit is a finding.

use doppler::formats::gguf::{Gguf, GgufFile};
use doppler::formats::FileData;
use doppler::infer::chat::{Message, Template};
use doppler::infer::tokenizer::Tokenizer;
use doppler::models::llama::{self, SafeTensorsDir, Source};
use doppler::train::config::TrainConfig;

pub type Outcome = Result<(), String>;

pub struct Target {
    pub name: &'static str,
    pub about: &'static str,
    pub run: fn(&[u8]) -> Outcome,
    /// Tokens the mutator splices in (the format's syntax and boundary values).
    pub dict: &'static [&'static [u8]],
}

const JSON_DICT: &[&[u8]] = &[
    b"\"",
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b"null",
    b"true",
    b"false",
    b"-1",
    b"0",
    b"1e309",
    b"-1e309",
    b"NaN",
    b"4294967296",
    b"18446744073709551616",
    b"9007199254740993",
    b"\"\"",
    b"\"\\u0000\"",
    b"\"\\ud800\"",
    b"[[[[[[[[",
    b"\xff\xfe",
    b"1.5",
];

pub const TARGETS: &[Target] = &[
    Target {
        name: "gguf",
        about: "GGUF header, metadata and tensor table (whole and read in ranges), the model config, the tokenizer and chat template in it, every tensor's bytes",
        run: gguf,
        dict: &[
            b"GGUF", b"\x00\x00\x00\x00", b"\xff\xff\xff\xff", b"\xff\xff\xff\xff\xff\xff\xff\xff",
            b"\x00\x00\x00\x80", b"\x01\x00\x00\x00\x00\x00\x00\x00", b"llama.block_count",
            b"general.architecture", b"tokenizer.ggml.tokens", b"general.alignment", b"qwen2",
            b"{%", b"%}", b"{{", b"}}", b"<|im_start|>",
        ],
    },
    Target {
        name: "safetensors",
        about: "SafeTensors headers (the safetensors crate's and Doppler's own ranged reader), tensor names, dtypes, shapes and offsets, every tensor read; config.json",
        run: safetensors,
        dict: JSON_DICT,
    },
    Target {
        name: "tokenizer",
        about: "tokenizer.json and tokenizer_config.json (BOS/EOS, chat template): load, encode, decode any ids, detect and render the chat template",
        run: tokenizer,
        dict: JSON_DICT,
    },
    Target {
        name: "train_toml",
        about: "training configs (TOML): parse, check, the model's parameter layout and the loss scaler",
        run: train_toml,
        dict: &[
            b"=", b"[model]", b"[data]", b"[train]", b"\"", b"0", b"-1", b"nan", b"inf", b"-inf",
            b"1e400", b"18446744073709551615", b"9223372036854775807", b"4294967296", b"[", b"]",
            b"\"dynamic\"", b"\"llama\"", b"\"gpt2\"", b"\"bpe\"", b"\"char\"", b"0.0", b"1.0",
            b"\n", b"#", b"'''", b"{}",
        ],
    },
    Target {
        name: "finetune",
        about: "fine-tuning inputs: the config (TOML), a PEFT adapter_config.json, JSONL data (chat through the ChatML template, prompt/completion, text) tokenized into masked rows; the first byte picks which",
        run: finetune,
        dict: &[
            b"{\"messages\": [", b"{\"role\": \"assistant\", \"content\": \"", b"\"user\"",
            b"\"prompt\": \"", b"\"completion\": \"", b"\"text\": \"", b"\"r\": ", b"\"lora_alpha\": ",
            b"\"target_modules\": [\"q_proj\"]", b"\"use_dora\": true", b"[lora]", b"[train]", b"rank = ",
            b"seq_len = ", b"\n", b"}", b"]", b"0", b"-1", b"1e400", b"18446744073709551615", b"<|im_end|>",
        ],
    },
];

/// The seeds' byte-level tokenizer (ChatML control tokens), built once.
fn tiny_tokenizer() -> &'static Tokenizer {
    static TK: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
    TK.get_or_init(|| {
        let files = doppler::verify::llama::tiny_files("llama", "F32", 1).expect("tiny model");
        let g = GgufFile::from_bytes(Box::new(files.gguf), "t.gguf").expect("tiny gguf");
        Tokenizer::from_gguf(&g.gguf.metadata, "t.gguf").expect("tiny tokenizer")
    })
}

fn finetune(data: &[u8]) -> Outcome {
    use doppler::finetune::{config::FinetuneConfig, data as ftdata};
    let (&which, rest) = data.split_first().ok_or("empty")?;
    let text = std::str::from_utf8(rest).map_err(s)?;
    match which % 3 {
        0 => {
            let cfg = FinetuneConfig::parse(text, "fuzz.toml").map_err(s)?;
            let _ = cfg.spec().scaling();
        }
        1 => {
            let spec =
                doppler::finetune::adapter::read_config(text, std::path::Path::new("a.json"))
                    .map_err(s)?;
            let _ = spec.scaling();
        }
        _ => {
            let tmpl = Template::detect("<|im_start|>");
            let samples =
                ftdata::parse_jsonl(text, "d.jsonl", tiny_tokenizer(), tmpl.as_ref()).map_err(s)?;
            for smp in &samples {
                for (seq, ov) in [
                    (2, ftdata::Overflow::Truncate),
                    (64, ftdata::Overflow::Refuse),
                ] {
                    let _ = ftdata::row(smp, seq, 0, ov, "d.jsonl");
                }
            }
        }
    }
    Ok(())
}

/// Tensor names of the seeds' tiny Llama (2 layers), asked of every source.
fn names() -> Vec<String> {
    let mut v: Vec<String> = ["token_embd.weight", "output_norm.weight", "output.weight"]
        .map(String::from)
        .to_vec();
    for l in 0..2 {
        for t in [
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ] {
            v.push(format!("blk.{l}.{t}.weight"));
        }
        for t in ["attn_q", "attn_k", "attn_v"] {
            v.push(format!("blk.{l}.{t}.bias"));
        }
    }
    v
}

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// Reads every tensor a source lists or the seeds' names name.
fn read_all(src: &dyn Source) -> Outcome {
    let mut all = src.names().unwrap_or_default();
    all.extend(names());
    for n in &all {
        if src.has(n) {
            if let Some(t) = pollster::block_on(src.tensor(n)).map_err(s)? {
                let _ = (t.bytes.len(), &t.dims, t.ty.name());
            }
        }
    }
    Ok(())
}

fn gguf(data: &[u8]) -> Outcome {
    let g = Gguf::parse(data, "fuzz.gguf").map_err(s)?;
    for t in &g.tensors {
        let _ = g.tensor_data(data, t).len();
    }
    // The same bytes read in ranges, as the browser and the native loader read files.
    let file = pollster::block_on(GgufFile::from_reader(Box::new(data.to_vec()), "fuzz.gguf"))
        .map_err(s)?;
    read_all(&file)?;
    let md = &g.metadata;
    if let Ok(cfg) = llama::config_from_gguf(md, "fuzz.gguf") {
        let _ = cfg.check("fuzz.gguf");
    }
    if let Ok(tk) = Tokenizer::from_gguf(md, "fuzz.gguf") {
        exercise(&tk);
    }
    if let Some(jinja) = md.get("tokenizer.chat_template").and_then(|v| v.as_str()) {
        chat(jinja);
    }
    Ok(())
}

fn safetensors(data: &[u8]) -> Outcome {
    // The input is a SafeTensors file, optionally followed by "\n--config--\n" and a
    // config.json.
    let sep = b"\n--config--\n";
    let (st, config) = match data.windows(sep.len()).position(|w| w == sep) {
        Some(i) => (&data[..i], Some(&data[i + sep.len()..])),
        None => (data, None),
    };
    if let Some(c) = config {
        if let Ok(json) = serde_json::from_slice::<serde_json::Value>(c) {
            if let Ok(cfg) = llama::config_from_hf(&json, "config.json") {
                let _ = cfg.check("config.json");
            }
        }
    }
    let whole = SafeTensorsDir::from_bytes(
        vec![("a.safetensors".into(), Box::new(st.to_vec()))],
        "fuzz",
    );
    let ranged = pollster::block_on(SafeTensorsDir::from_files(
        vec![(
            "a.safetensors".into(),
            FileData::Ranges(Box::new(st.to_vec())),
        )],
        "fuzz",
    ));
    // Both readers must agree on what is a SafeTensors file.
    match (&whole, &ranged) {
        (Ok(w), Ok(r)) => {
            read_all(w)?;
            read_all(r)
        }
        (Err(_), Err(e)) => Err(e.to_string()),
        (Ok(_), Err(e)) => panic!("the ranged reader refused what the safetensors crate took: {e}"),
        (Err(e), Ok(_)) => panic!("the ranged reader took what the safetensors crate refused: {e}"),
    }
}

fn tokenizer(data: &[u8]) -> Outcome {
    // tokenizer.json, optionally followed by "\n--config--\n" and tokenizer_config.json.
    let sep = b"\n--config--\n";
    let (json, config) = match data.windows(sep.len()).position(|w| w == sep) {
        Some(i) => (
            &data[..i],
            Some(String::from_utf8_lossy(&data[i + sep.len()..]).into_owned()),
        ),
        None => (data, None),
    };
    if let Some(c) = &config {
        if let Some(jinja) = serde_json::from_str::<serde_json::Value>(c)
            .ok()
            .and_then(|v| v.get("chat_template")?.as_str().map(String::from))
        {
            chat(&jinja);
        }
    }
    let tk = Tokenizer::from_hf_json(json, config.as_deref(), "tokenizer.json").map_err(s)?;
    exercise(&tk);
    Ok(())
}

/// Encodes and decodes what a user might type, and decodes ids out of range.
fn exercise(tk: &Tokenizer) {
    for text in [
        "",
        "hello world",
        "<|im_start|>user\nhi<|im_end|>",
        "\u{0}\u{fffd}é漢字🙂",
        " \n\t ",
    ] {
        for special in [false, true] {
            if let Ok(ids) = tk.encode(text, special) {
                let _ = tk.decode(&ids);
            }
        }
    }
    let n = tk.vocab_size() as u32;
    let _ = tk.decode(&[0, n.saturating_sub(1), n, n.saturating_add(1), u32::MAX]);
    for id in [0, n, u32::MAX] {
        let _ = tk.piece(id);
    }
    let _ = tk.special("<|im_end|>");
}

fn chat(jinja: &str) {
    if let Some(t) = Template::detect(jinja) {
        let msgs = [
            Message::new("system", "s"),
            Message::new("user", "hi"),
            Message::new("assistant", "yo"),
        ];
        let _ = t.render(&msgs, true);
        let _ = t.render(&msgs[1..], false);
        let _ = (t.end_of_turn(), t.stop_token());
    }
}

fn train_toml(data: &[u8]) -> Outcome {
    let text = std::str::from_utf8(data).map_err(s)?;
    let cfg = TrainConfig::parse(text, "fuzz.toml").map_err(s)?;
    match &cfg.model {
        doppler::train::config::NetConfig::Transformer(m) => {
            let mut m = m.clone();
            m.vocab_size = m.vocab_size.max(1);
            if m.validate().is_ok() {
                let _ = doppler::models::transformer::Transformer::expected(&m);
            }
        }
        // parse() validated it: its layout must build.
        doppler::train::config::NetConfig::Conv(c) => {
            let _ = doppler::models::convnet::ConvNet::expected(c);
        }
    }
    let _ = cfg.loss_scaler();
    let _ = cfg.differences(&cfg);
    Ok(())
}
