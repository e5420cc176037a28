//! `doppler generate` (a model file or a training checkpoint) and `doppler chat`.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use doppler::gpu::Gpu;
use doppler::infer::chat::Message;
use doppler::infer::sample::{Sampler, SamplerConfig};
use doppler::infer::{Conversation, GenOptions, Generation, Model, Session, StopReason};
use doppler::train::{generate as generate_checkpoint, load_for_generation};
use doppler::Error;

/// How the KV cache stores keys and values (llama.cpp's --cache-type-k/-v).
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CacheType {
    /// f16 where the adapter has shader-f16, else f32.
    #[default]
    Auto,
    F32,
    F16,
    /// 8-bit integers with a scale per 32 values (1.125 bytes a value; head size a
    /// multiple of 32).
    #[value(name = "q8_0")]
    Q8_0,
}

impl CacheType {
    pub fn kv_type(self, gpu: &Gpu) -> doppler::ops::kvcache::KvType {
        use doppler::ops::kvcache::{default_kv_type, KvType};
        match self {
            CacheType::Auto => default_kv_type(gpu),
            CacheType::F32 => KvType::F32,
            CacheType::F16 => KvType::F16,
            CacheType::Q8_0 => KvType::Q8_0,
        }
    }
}

/// The cache's size, as said after loading: bytes, type, tokens.
pub fn cache_line(cache: &doppler::ops::kvcache::KvCache) -> String {
    let rings = cache
        .k
        .iter()
        .filter(|k| k.shape()[0] < cache.capacity)
        .count();
    let ring_note = match rings {
        0 => String::new(),
        n => format!(", {n} sliding-window layers keep rings of the last keys"),
    };
    format!(
        "KV cache: {:.1} MiB ({}) for {} tokens{ring_note}",
        cache.bytes() as f64 / (1u64 << 20) as f64,
        cache.kv_type().name(),
        cache.capacity
    )
}

#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// 0 picks the most likely token (greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Sample among the k most likely tokens (0: all).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Keep the most likely tokens up to this total probability (1: all).
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Drop tokens less likely than this times the most likely one (0: none).
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    /// Penalise recently seen tokens (1: off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Tokens the repetition penalty looks back over.
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    /// Subtracted from the logits of tokens already generated (OpenAI's; -2..2, 0: off).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    presence_penalty: f32,
    /// Subtracted once per time a token was already generated (OpenAI's; -2..2, 0: off).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    frequency_penalty: f32,
    /// Random seed: the same seed, model and prompt give the same text.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

impl SamplingArgs {
    fn sampler(&self) -> doppler::Result<Sampler> {
        let cfg = SamplerConfig {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logit_bias: Vec::new(),
            seed: self.seed,
        };
        cfg.validate().map_err(|detail| Error::Invalid {
            op: "sampling",
            detail,
        })?;
        Ok(Sampler::new(cfg))
    }
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Model: a .gguf file, or a directory with config.json, *.safetensors and tokenizer.json.
    #[arg(
        short,
        long,
        conflicts_with = "checkpoint",
        required_unless_present = "checkpoint"
    )]
    model: Option<PathBuf>,
    /// A training run directory (its latest checkpoint) or one checkpoint directory. Its
    /// models have no chat template, stop tokens or KV cache: --chat, --stop, --special
    /// and -c do not apply (the context is the model's block size).
    #[arg(long, conflicts_with_all = ["chat", "stop", "special", "ctx_size", "lora"])]
    checkpoint: Option<PathBuf>,
    /// Text to continue.
    #[arg(default_value = "")]
    prompt: String,
    /// Tokens to generate at most.
    #[arg(short = 'n', long, default_value_t = 200)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Stop when this text appears (repeatable); the text is not printed.
    #[arg(long, value_parser = clap::builder::NonEmptyStringValueParser::new())]
    stop: Vec<String>,
    /// Context (KV cache) size in tokens, at most the model's.
    #[arg(short = 'c', long, default_value_t = 4096)]
    ctx_size: usize,
    /// KV cache storage: auto (f16 where the adapter has shader-f16, else f32), f32, f16,
    /// q8_0.
    #[arg(long, value_enum, default_value = "auto")]
    cache_type: CacheType,
    /// A LoRA adapter directory as PEFT writes it (adapter_config.json,
    /// adapter_model.safetensors; `doppler finetune` writes one), applied to the model's
    /// products at every step (no merged copy of the weights).
    #[arg(long, value_name = "DIR")]
    lora: Option<PathBuf>,
    /// Multiplies the adapter's scale (alpha / r): 0 is the base model, 1 the adapter as
    /// trained.
    #[arg(long, default_value_t = 1.0, requires = "lora")]
    lora_scale: f32,
    /// Treat control tokens written in the prompt (e.g. <|im_start|>) as such.
    #[arg(long)]
    special: bool,
    /// Wrap the prompt in the model's chat template as one user message.
    #[arg(long)]
    chat: bool,
    /// Print one JSON object (text, tokens, timings) at the end instead of streaming.
    #[arg(long)]
    json: bool,
    /// Constrain the answer to one JSON object (OpenAI's json_object mode).
    #[arg(long, conflicts_with_all = ["checkpoint", "json_schema"])]
    json_object: bool,
    /// Constrain the answer to JSON following this JSON Schema: its text, or @FILE (the
    /// subset `doppler::infer::grammar` enforces; other keywords are an error).
    #[arg(long, value_name = "SCHEMA", conflicts_with = "checkpoint")]
    json_schema: Option<String>,
}

/// `--json-object` / `--json-schema`: the grammar, compiled (an error names what it cannot
/// express).
fn grammar_of(args: &GenerateArgs) -> doppler::Result<Option<doppler::infer::grammar::Grammar>> {
    use doppler::infer::grammar::Grammar;
    if args.json_object {
        return Ok(Some(Grammar::json_object()));
    }
    let Some(s) = &args.json_schema else {
        return Ok(None);
    };
    let text = match s.strip_prefix('@') {
        Some(path) => std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_string(),
            source,
        })?,
        None => s.clone(),
    };
    let bad = |detail: String| Error::Invalid {
        op: "--json-schema",
        detail,
    };
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    Grammar::from_schema(&v).map(Some).map_err(bad)
}

pub fn generate_cmd(gpu: &Gpu, args: &GenerateArgs) -> doppler::Result<ExitCode> {
    let mut sampler = args.sampling.sampler()?;
    let mut out = std::io::stdout();
    if let Some(ck) = &args.checkpoint {
        let (model, tokenizer) = load_for_generation(gpu, ck)?;
        if !args.json {
            print!("{}", args.prompt);
        }
        let text = generate_checkpoint(
            gpu,
            &model,
            &tokenizer,
            &args.prompt,
            args.max_tokens,
            &mut sampler,
            &mut |piece| {
                if !args.json {
                    print!("{piece}");
                    let _ = out.flush();
                }
            },
        )?;
        if args.json {
            println!(
                "{}",
                // A checkpoint's model has no stop token: it generates all -n tokens.
                serde_json::json!({ "prompt": args.prompt, "text": text,
                    "generated_tokens": args.max_tokens, "stop": StopReason::Length })
            );
        } else {
            println!();
        }
        return Ok(ExitCode::SUCCESS);
    }
    let path = args
        .model
        .as_ref()
        .expect("clap requires --model or --checkpoint");
    let model = open_with_lora(
        gpu,
        path,
        args.ctx_size,
        args.lora.as_deref(),
        args.lora_scale,
    )?;
    let tk = &model.tokenizer;
    let (text, special) = if args.chat {
        let t = model.template.as_ref().ok_or_else(|| Error::Invalid {
            op: "generate",
            detail: format!(
                "{} has no chat template this build recognises (ChatML, Llama 3, Zephyr)",
                path.display()
            ),
        })?;
        (t.render(&[Message::new("user", &args.prompt)], true), true)
    } else {
        (args.prompt.clone(), args.special)
    };
    let mut ids = model.prompt_ids(&text, special, true)?;
    if ids.is_empty() {
        ids.extend(tk.bos.or(tk.eos));
    }
    if let Some(g) = grammar_of(args)? {
        use doppler::infer::grammar::{JsonConstraint, TokenTrie};
        let trie = std::sync::Arc::new(TokenTrie::new(tk));
        let c = JsonConstraint::new(std::sync::Arc::new(g), trie, model.stop_tokens());
        sampler = sampler.with_constraint(Box::new(c));
    }
    let mut session =
        Session::with_cache_type(gpu, &model, args.ctx_size, args.cache_type.kv_type(gpu))?;
    tracing::info!("{}", cache_line(&session.cache));
    // Room left in the context after the prompt: none is an error, less than asked for
    // ends the generation early, said as such.
    let room = session.capacity().saturating_sub(ids.len());
    if room == 0 {
        return Err(Error::Invalid {
            op: "generate",
            detail: format!(
                "the prompt's {} tokens fill the context of {} tokens (-c): no room to generate; raise -c",
                ids.len(),
                session.capacity()
            ),
        });
    }
    let opts = GenOptions {
        max_tokens: args.max_tokens.min(room),
        stop_tokens: model.stop_tokens(),
        stop_strings: args.stop.clone(),
    };
    if !args.json && !args.chat {
        print!("{}", args.prompt);
    }
    let mut g = session.generate(gpu, &ids, &opts, &mut sampler, &mut |piece| {
        if !args.json {
            print!("{piece}");
            out.flush().map_err(|source| Error::Io {
                path: "stdout".into(),
                source,
            })?;
        }
        Ok(())
    })?;
    if g.stop == StopReason::Length && args.max_tokens > room && g.tokens.len() == room {
        g.stop = StopReason::Context;
    }
    if args.json {
        let mut v = stats_json(&g, &model);
        v["kv_cache"] = serde_json::json!({
            "bytes": session.cache.bytes(),
            "type": session.cache.kv_type().name(),
            "tokens": session.capacity(),
        });
        v["prompt"] = args.prompt.clone().into();
        v["text"] = g.text.clone().into();
        println!("{v}");
    } else {
        println!();
        tracing::info!("{}", stats_line(&g));
        if g.stop == StopReason::Context {
            eprintln!(
                "(context full: {} prompt and {} generated tokens fill the {} of -c; {} asked for)",
                ids.len(),
                g.tokens.len(),
                session.capacity(),
                args.max_tokens
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

fn stats_json(g: &Generation, model: &Model) -> serde_json::Value {
    let decode_ms: f64 = g.token_ms.iter().sum();
    serde_json::json!({
        "tokens": g.tokens,
        "prompt_tokens": g.prompt_tokens,
        "generated_tokens": g.tokens.len(),
        "stop": g.stop,
        "load_ms": model.load_ms,
        "prefill_ms": g.prefill_ms,
        "decode_tok_s": if decode_ms > 0.0 { g.token_ms.len() as f64 / decode_ms * 1e3 } else { 0.0 },
        "token_ms_p50": median(&g.token_ms),
    })
}

fn stats_line(g: &Generation) -> String {
    let decode_ms: f64 = g.token_ms.iter().sum();
    format!(
        "{} prompt tokens in {:.0} ms, {} generated, {:.1} tok/s decode",
        g.prompt_tokens,
        g.prefill_ms,
        g.tokens.len(),
        if decode_ms > 0.0 {
            g.token_ms.len() as f64 / decode_ms * 1e3
        } else {
            0.0
        }
    )
}

#[derive(Args, Debug)]
pub struct ChatArgs {
    /// Model: a .gguf file, or a directory with config.json, *.safetensors and tokenizer.json.
    #[arg(short, long)]
    model: PathBuf,
    /// System message (default: the template's own, if it has one).
    #[arg(long)]
    system: Option<String>,
    /// Tokens per reply at most.
    #[arg(short = 'n', long, default_value_t = 512)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Context (KV cache) size in tokens, at most the model's.
    #[arg(short = 'c', long, default_value_t = 4096)]
    ctx_size: usize,
    /// KV cache storage: auto (f16 where the adapter has shader-f16, else f32), f32, f16,
    /// q8_0.
    #[arg(long, value_enum, default_value = "auto")]
    cache_type: CacheType,
    /// A LoRA adapter directory as PEFT writes it (adapter_config.json,
    /// adapter_model.safetensors; `doppler finetune` writes one), applied to the model's
    /// products at every step (no merged copy of the weights).
    #[arg(long, value_name = "DIR")]
    lora: Option<PathBuf>,
    /// Multiplies the adapter's scale (alpha / r): 0 is the base model, 1 the adapter as
    /// trained.
    #[arg(long, default_value_t = 1.0, requires = "lora")]
    lora_scale: f32,
}

/// Opens the model and applies `lora` (scale multiplier `scale`) when given.
fn open_with_lora(
    gpu: &Gpu,
    path: &std::path::Path,
    ctx: usize,
    lora: Option<&std::path::Path>,
    scale: f32,
) -> doppler::Result<Model> {
    let mut model = Model::open(gpu, path, ctx)?;
    if let Some(dir) = lora {
        if !scale.is_finite() {
            return Err(Error::Invalid {
                op: "generate",
                detail: format!("--lora-scale {scale} must be finite"),
            });
        }
        let adapter = doppler::finetune::adapter::load(gpu, dir, &model.llama.cfg)?;
        tracing::info!(
            "LoRA adapter {}: rank {}, alpha {}, {} projections, scale x{scale}",
            dir.display(),
            adapter.spec.rank,
            adapter.spec.alpha,
            adapter.spec.targets.len()
        );
        model.llama.set_lora(Some((adapter, scale)))?;
    }
    Ok(model)
}

/// Interactive chat: each turn is appended to the conversation in the KV cache (only the
/// new tokens run). Lines starting with `/` are commands: /reset, /exit.
pub fn chat_cmd(gpu: &Gpu, args: &ChatArgs) -> doppler::Result<ExitCode> {
    let mut sampler = args.sampling.sampler()?;
    let model = open_with_lora(
        gpu,
        &args.model,
        args.ctx_size,
        args.lora.as_deref(),
        args.lora_scale,
    )?;
    let name = args.model.display().to_string();
    let mut conv = Conversation::new(&model, &name, args.system.clone())?;
    let mut session =
        Session::with_cache_type(gpu, &model, args.ctx_size, args.cache_type.kv_type(gpu))?;
    tracing::info!("{}", cache_line(&session.cache));
    eprintln!("doppler chat: {name} ({} layers, context {} tokens). /reset clears the conversation, /exit or Ctrl-D quits.", model.llama.cfg.n_layer, session.capacity());
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin
            .lock()
            .read_line(&mut line)
            .map_err(|source| Error::Io {
                path: "stdin".into(),
                source,
            })?
            == 0
        {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                conv.reset(&mut session);
                eprintln!("(conversation cleared)");
                continue;
            }
            _ => {}
        }
        let used = session.cache.len;
        let turn = match conv.turn(&mut session, line) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("({e}: not sent)");
                continue;
            }
        };
        if turn.restarted {
            eprintln!("(context full: {used} of {} tokens used; the conversation is cleared and this message starts a new one)", session.capacity());
        }
        let opts = conv.options(&session, &turn, args.max_tokens);
        let g = session.generate(gpu, &turn.ids, &opts, &mut sampler, &mut |piece| {
            print!("{piece}");
            out.flush().map_err(|source| Error::Io {
                path: "stdout".into(),
                source,
            })?;
            Ok(())
        })?;
        println!();
        if g.stop == StopReason::Context {
            eprintln!("(context full: the reply was cut; /reset to start a new conversation)");
        }
        tracing::info!("{}", stats_line(&g));
        conv.finish(&model, &g);
    }
    Ok(ExitCode::SUCCESS)
}
