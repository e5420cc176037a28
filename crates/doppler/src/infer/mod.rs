//! Inference: a model file opened with its tokenizer and chat template, and a session that
//! keeps a conversation's keys and values on the GPU and generates from it.

pub mod batch;
pub mod chat;
pub mod grammar;
pub mod greedy;
pub mod sample;
pub mod tokenizer;

#[cfg(not(target_arch = "wasm32"))]
use std::path::Path;
use web_time::Instant;

use crate::error::{Error, Result};
use crate::formats::gguf::Value;
use crate::gpu::{Gpu, FLUSH_EVERY};
use crate::models::llama::{self, Llama};
use crate::ops::kvcache::KvCache;
use chat::Template;
use greedy::GreedyDecoder;
use sample::{Sampler, TokenLogprob};
use tokenizer::Tokenizer;

/// Prompt tokens run per forward step (bounds the activations a long prompt needs).
pub const PREFILL_CHUNK: usize = 512;

/// A model with its tokenizer and chat template.
pub struct Model {
    pub llama: Llama,
    pub tokenizer: Tokenizer,
    pub template: Option<Template>,
    pub load_ms: f64,
}

impl Model {
    /// A `.gguf` file, or a directory with `config.json`, `*.safetensors` and `tokenizer.json`
    /// (its `tokenizer_config.json` may hold the chat template). Up to `max_context`
    /// positions are served.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn open(gpu: &Gpu, path: &Path, max_context: usize) -> Result<Model> {
        let t0 = Instant::now();
        let (llama, md) = llama::open(gpu, path, max_context)?;
        let shown = path.display().to_string();
        let (tokenizer, jinja) = if path.is_dir() {
            let tk = Tokenizer::from_hf_file(&path.join("tokenizer.json"))?;
            let read = |name: &str| std::fs::read_to_string(path.join(name)).ok();
            let jinja = hf_template_of(
                read("chat_template.jinja"),
                read("chat_template.json"),
                read("tokenizer_config.json"),
            );
            (tk, jinja)
        } else {
            (Tokenizer::from_gguf(&md, &shown)?, gguf_chat_template(&md))
        };
        let model = Self::assemble(llama, tokenizer, jinja, &shown, t0)?;
        gpu.wait()?;
        Ok(model)
    }

    /// A GGUF file's bytes (a download in the browser); `name` names it in errors. The
    /// bytes are needed only while the weights upload.
    pub async fn from_gguf_bytes(
        gpu: &Gpu,
        bytes: crate::formats::gguf::Bytes,
        name: &str,
        max_context: usize,
    ) -> Result<Model> {
        let t0 = Instant::now();
        let file = crate::formats::gguf::GgufFile::from_bytes(bytes, name)?;
        Self::from_gguf_file(gpu, file, t0, max_context).await
    }

    /// A GGUF file read on demand (a `File` in the browser): the header first, then each
    /// tensor as it goes to the GPU, so the whole file is never in memory.
    pub async fn from_gguf_reader(
        gpu: &Gpu,
        reader: Box<dyn crate::formats::gguf::RangeRead>,
        name: &str,
        max_context: usize,
    ) -> Result<Model> {
        let t0 = Instant::now();
        let file = crate::formats::gguf::GgufFile::from_reader(reader, name).await?;
        Self::from_gguf_file(gpu, file, t0, max_context).await
    }

    async fn from_gguf_file(
        gpu: &Gpu,
        file: crate::formats::gguf::GgufFile,
        t0: Instant,
        max_context: usize,
    ) -> Result<Model> {
        let md = &file.gguf.metadata;
        let tokenizer = Tokenizer::from_gguf(md, &file.path)?;
        let llama = llama::from_gguf_async(gpu, &file, max_context).await?;
        let model = Self::assemble(llama, tokenizer, gguf_chat_template(md), &file.path, t0)?;
        drop(file);
        gpu.settle().await?;
        Ok(model)
    }

    /// A Hugging Face directory's files by name: `config.json`, `*.safetensors`,
    /// `tokenizer.json` and, optionally, `tokenizer_config.json`, `chat_template.jinja`
    /// and `chat_template.json` (others are ignored).
    /// SafeTensors files read on demand go to the GPU a tensor at a time.
    pub async fn from_hf_files(
        gpu: &Gpu,
        files: Vec<(String, crate::formats::FileData)>,
        max_context: usize,
    ) -> Result<Model> {
        let t0 = Instant::now();
        let shown = "Hugging Face directory";
        let missing = |what: &str| Error::Format {
            path: shown.into(),
            detail: format!(
                "{what} is missing (config.json, *.safetensors and tokenizer.json are needed)"
            ),
        };
        let base = |n: &str| n.rsplit('/').next().unwrap_or(n).to_string();
        let mut weights: Vec<(String, crate::formats::FileData)> = Vec::new();
        let (mut config, mut tokenizer, mut tk_config) = (None, None, None);
        let (mut tmpl_jinja, mut tmpl_json) = (None, None);
        for (name, bytes) in files {
            match base(&name).as_str() {
                "config.json" => config = Some(bytes),
                "tokenizer.json" => tokenizer = Some(bytes),
                "tokenizer_config.json" => tk_config = Some(bytes),
                "chat_template.jinja" => tmpl_jinja = Some(bytes),
                "chat_template.json" => tmpl_json = Some(bytes),
                b if b.ends_with(".safetensors") => weights.push((name, bytes)),
                _ => {}
            }
        }
        weights.sort_by(|a, b| a.0.cmp(&b.0));
        let text = |b: &[u8], what: &str| {
            std::str::from_utf8(b)
                .map(str::to_string)
                .map_err(|_| Error::Format {
                    path: what.into(),
                    detail: "not UTF-8 text".into(),
                })
        };
        let config = config.ok_or_else(|| missing("config.json"))?;
        let config = text(&config.read_all("config.json").await?, "config.json")?;
        let tokenizer = tokenizer.ok_or_else(|| missing("tokenizer.json"))?;
        let tokenizer = tokenizer.read_all("tokenizer.json").await?.into_owned();
        if weights.is_empty() {
            return Err(missing("a *.safetensors file"));
        }
        let tk_config = match tk_config {
            Some(b) => Some(text(
                &b.read_all("tokenizer_config.json").await?,
                "tokenizer_config.json",
            )?),
            None => None,
        };
        let src = llama::SafeTensorsDir::from_files(weights, shown).await?;
        let llama =
            llama::from_safetensors_async(gpu, &config, "config.json", &src, max_context).await?;
        drop(src);
        let tk = Tokenizer::from_hf_json(&tokenizer, tk_config.as_deref(), "tokenizer.json")?;
        let mut templates = Vec::new();
        for (b, what) in [
            (tmpl_jinja, "chat_template.jinja"),
            (tmpl_json, "chat_template.json"),
        ] {
            templates.push(match b {
                Some(b) => Some(text(&b.read_all(what).await?, what)?),
                None => None,
            });
        }
        let json = templates.pop().flatten();
        let jinja = hf_template_of(templates.pop().flatten(), json, tk_config);
        let model = Self::assemble(llama, tk, jinja, shown, t0)?;
        gpu.settle().await?;
        Ok(model)
    }

    fn assemble(
        llama: Llama,
        tokenizer: Tokenizer,
        jinja: Option<String>,
        shown: &str,
        t0: Instant,
    ) -> Result<Model> {
        if tokenizer.vocab_size() > llama.cfg.vocab_size {
            return Err(Error::Format {
                path: shown.to_string(),
                detail: format!(
                    "tokenizer has {} tokens, the model's embedding {}",
                    tokenizer.vocab_size(),
                    llama.cfg.vocab_size
                ),
            });
        }
        let template = jinja.as_deref().and_then(Template::detect);
        Ok(Model {
            llama,
            tokenizer,
            template,
            load_ms: t0.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// Token ids of `text` for the model: BOS first when the tokenizer asks for it, this is
    /// the start of the sequence (`first`), and the text does not write it itself (Llama
    /// 3's template does); control tokens parsed when `special`.
    pub fn prompt_ids(&self, text: &str, special: bool, first: bool) -> Result<Vec<u32>> {
        let tk = &self.tokenizer;
        let mut ids = Vec::new();
        if let (true, true, Some(bos)) = (first, tk.add_bos, tk.bos) {
            if !(special && tk.piece(bos).is_some_and(|p| text.starts_with(p))) {
                ids.push(bos);
            }
        }
        ids.extend(tk.encode(text, special)?);
        Ok(ids)
    }

    /// Ids that end generation: EOS and the template's end-of-turn token.
    pub fn stop_tokens(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.tokenizer.eos.into_iter().collect();
        for s in [
            "<|im_end|>",
            "<|eot_id|>",
            "<|end_of_text|>",
            "<|endoftext|>",
            "</s>",
            "<end_of_turn>",
            "<|end|>",
        ] {
            if let Some(id) = self.tokenizer.special(s) {
                v.push(id);
            }
        }
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// The chat template in a GGUF file's metadata.
fn gguf_chat_template(md: &std::collections::BTreeMap<String, Value>) -> Option<String> {
    md.get("tokenizer.chat_template")
        .and_then(Value::as_str)
        .map(str::to_string)
}

/// The chat template in a `tokenizer_config.json`'s text.
/// A Hugging Face directory's chat template: `chat_template.jinja` (transformers 4.50 on
/// writes it apart), else `chat_template.json`'s, else `tokenizer_config.json`'s.
fn hf_template_of(
    jinja: Option<String>,
    json: Option<String>,
    tokenizer_config: Option<String>,
) -> Option<String> {
    jinja
        .or_else(|| json.as_deref().and_then(hf_chat_template))
        .or_else(|| tokenizer_config.as_deref().and_then(hf_chat_template))
}

fn hf_chat_template(tokenizer_config: &str) -> Option<String> {
    serde_json::from_str::<serde_json::Value>(tokenizer_config)
        .ok()?
        .get("chat_template")?
        .as_str()
        .map(str::to_string)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// A stop token (EOS, end of turn).
    Token,
    /// A stop string appeared in the text.
    String,
    /// The requested number of tokens.
    Length,
    /// The context (KV cache) is full.
    Context,
}

/// A piece of generated text and the log-probabilities of the tokens chosen since the
/// piece before.
pub struct Piece<'a> {
    pub text: &'a str,
    pub logprobs: &'a [TokenLogprob],
}

/// What one generation produced and how long it took.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Generation {
    pub prompt_tokens: usize,
    pub tokens: Vec<u32>,
    /// Each of `tokens`' log-probabilities (a sampler [`Sampler::with_logprobs`]).
    pub logprobs: Vec<TokenLogprob>,
    pub text: String,
    pub stop: StopReason,
    /// The last sampled token when it was not run through the model: the stop token, or
    /// the last one of a length or context stop (None after a stop string: it ran).
    pub stop_token: Option<u32>,
    /// Prompt processing until the first token was chosen.
    pub prefill_ms: f64,
    /// Per generated token after the first: the time since the one before was chosen.
    pub token_ms: Vec<f64>,
}

impl Generation {
    /// Prompt tokens a second, up to the first token chosen.
    pub fn prefill_tok_s(&self) -> f64 {
        per_s(self.prompt_tokens, self.prefill_ms)
    }

    /// Tokens a second after the first.
    pub fn decode_tok_s(&self) -> f64 {
        per_s(self.token_ms.len(), self.token_ms.iter().sum())
    }
}

fn per_s(n: usize, ms: f64) -> f64 {
    if ms > 0.0 {
        n as f64 / ms * 1e3
    } else {
        0.0
    }
}

pub struct GenOptions {
    pub max_tokens: usize,
    pub stop_tokens: Vec<u32>,
    pub stop_strings: Vec<String>,
}

/// A conversation's state on the GPU: the cache and the tokens in it.
pub struct Session<'m> {
    pub model: &'m Model,
    pub cache: KvCache,
    pub tokens: Vec<u32>,
}

impl<'m> Session<'m> {
    /// A session with the adapter's default cache type (f16 where it has shader-f16).
    pub fn new(gpu: &Gpu, model: &'m Model, capacity: usize) -> Result<Session<'m>> {
        Ok(Session {
            model,
            cache: model.llama.cache(gpu, capacity)?,
            tokens: Vec::new(),
        })
    }

    /// A session whose cache stores `ty` (f32, f16 or q8_0).
    pub fn with_cache_type(
        gpu: &Gpu,
        model: &'m Model,
        capacity: usize,
        ty: crate::ops::kvcache::KvType,
    ) -> Result<Session<'m>> {
        let cache = model
            .llama
            .cache_with(gpu, capacity, crate::ops::kvcache::RING_STEP, ty)?;
        Ok(Session {
            model,
            cache,
            tokens: Vec::new(),
        })
    }

    pub fn capacity(&self) -> usize {
        self.cache.capacity
    }

    /// Forgets the conversation (the cache is reused).
    pub fn reset(&mut self) {
        self.cache.len = 0;
        self.tokens.clear();
    }

    /// Blocking [`Session::feed_async`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn feed(&mut self, gpu: &Gpu, ids: &[u32]) -> Result<Vec<f32>> {
        pollster::block_on(self.feed_async(gpu, ids))
    }

    /// Blocking [`Session::generate_async`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn generate(
        &mut self,
        gpu: &Gpu,
        prompt: &[u32],
        opts: &GenOptions,
        sampler: &mut Sampler,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<Generation> {
        pollster::block_on(self.generate_async(gpu, prompt, opts, sampler, on_text))
    }

    /// Runs `ids` through the model after what is cached; logits (V) of the last.
    pub async fn feed_async(&mut self, gpu: &Gpu, ids: &[u32]) -> Result<Vec<f32>> {
        if !self.cache.fits(ids.len()) {
            return Err(self.full(ids.len()));
        }
        let mut logits = None;
        for chunk in ids.chunks(PREFILL_CHUNK) {
            let (llama, cache) = (&self.model.llama, &mut self.cache);
            let out = gpu
                .run_async(|rec| {
                    // A prompt is submitted as it is recorded (the GPU starts on the first
                    // layers); a one-token step stays one submission.
                    if chunk.len() > 1 {
                        rec.set_flush_every(FLUSH_EVERY);
                    }
                    llama.forward(rec, chunk, cache, false)
                })
                .await?;
            logits = Some(out);
            self.tokens.extend_from_slice(chunk);
        }
        let logits = logits.ok_or_else(|| Error::Invalid {
            op: "generate",
            detail: "empty prompt".into(),
        })?;
        logits.to_vec_f32(gpu).await
    }

    /// Feeds `prompt`, then samples up to `opts.max_tokens` tokens, calling `on_text` with
    /// each piece of text as soon as it is certain (whole UTF-8 characters, not part of a
    /// stop string). The last sampled token is not run through the model (see
    /// [`Generation::stop_token`]); every other one is in the cache afterwards.
    ///
    /// A plain greedy sampler ([`Sampler::plain_greedy`]) picks on the GPU and runs each
    /// token's step before the host has read it ([`GreedyDecoder`]); a stop token found
    /// that way is taken back out of the cache.
    pub async fn generate_async(
        &mut self,
        gpu: &Gpu,
        prompt: &[u32],
        opts: &GenOptions,
        sampler: &mut Sampler,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<Generation> {
        self.generate_pieces_async(gpu, prompt, opts, sampler, &mut |p| on_text(p.text))
            .await
    }

    /// Blocking [`Session::generate_pieces_async`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn generate_pieces(
        &mut self,
        gpu: &Gpu,
        prompt: &[u32],
        opts: &GenOptions,
        sampler: &mut Sampler,
        on_piece: &mut dyn FnMut(Piece<'_>) -> Result<()>,
    ) -> Result<Generation> {
        pollster::block_on(self.generate_pieces_async(gpu, prompt, opts, sampler, on_piece))
    }

    /// [`Session::generate_async`], each piece of text with the log-probabilities of the
    /// tokens chosen since the piece before (a sampler [`Sampler::with_logprobs`]; none
    /// for tokens whose text a stop string cut off).
    pub async fn generate_pieces_async(
        &mut self,
        gpu: &Gpu,
        prompt: &[u32],
        opts: &GenOptions,
        sampler: &mut Sampler,
        on_piece: &mut dyn FnMut(Piece<'_>) -> Result<()>,
    ) -> Result<Generation> {
        let t0 = Instant::now();
        let gpu_greedy = sampler.plain_greedy();
        let mut dec = None;
        let mut logits = Vec::new();
        if gpu_greedy {
            if !self.cache.fits(prompt.len()) {
                return Err(self.full(prompt.len()));
            }
            let mut d = GreedyDecoder::new(gpu)?;
            d.prefill_async(gpu, &self.model.llama, &mut self.cache, prompt)
                .await?;
            self.tokens.extend_from_slice(prompt);
            dec = Some(d);
        } else {
            logits = self.feed_async(gpu, prompt).await?;
        }
        let mut out = Generation {
            prompt_tokens: prompt.len(),
            tokens: Vec::new(),
            logprobs: Vec::new(),
            text: String::new(),
            stop: StopReason::Length,
            stop_token: None,
            prefill_ms: t0.elapsed().as_secs_f64() * 1e3,
            token_ms: Vec::new(),
        };
        let tk = &self.model.tokenizer;
        let mut stream = TextStream::new(opts.stop_strings.clone());
        let mut t = Instant::now();
        for i in 0..opts.max_tokens {
            // Whether this token will run through the model unless it stops generation.
            let runs = i + 1 < opts.max_tokens && self.cache.fits(1);
            let next = match &mut dec {
                Some(d) => {
                    if runs {
                        d.step_async(gpu, &self.model.llama, &mut self.cache)
                            .await?;
                    }
                    d.next_token_async(gpu).await?
                }
                None => sampler.sample(&logits, &self.tokens),
            };
            if i == 0 {
                out.prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
            } else {
                out.token_ms.push(t.elapsed().as_secs_f64() * 1e3);
            }
            t = Instant::now();
            let ran = dec.is_some() && runs;
            if opts.stop_tokens.contains(&next) {
                if ran {
                    self.cache.len -= 1;
                }
                out.stop = StopReason::Token;
                out.stop_token = Some(next);
                break;
            }
            if ran {
                // In the cache already: recorded at once, so that an error below (from
                // on_text) leaves the session's tokens and cache in step.
                self.tokens.push(next);
            }
            if stream.push(tk, next, sampler.take_logprob(), on_piece)? {
                (out.tokens, out.logprobs, out.text) = stream.into_parts();
                out.stop = StopReason::String;
                if !ran && self.cache.fits(1) {
                    self.feed_async(gpu, &[next]).await?;
                }
                return Ok(out);
            }
            if i + 1 == opts.max_tokens {
                out.stop_token = Some(next);
                break;
            }
            if !self.cache.fits(1) && !ran {
                out.stop = StopReason::Context;
                out.stop_token = Some(next);
                break;
            }
            if !ran {
                logits = self.feed_async(gpu, &[next]).await?;
            }
        }
        stream.finish(on_piece)?;
        (out.tokens, out.logprobs, out.text) = stream.into_parts();
        Ok(out)
    }

    fn full(&self, n: usize) -> Error {
        Error::Invalid {
            op: "generate",
            detail: format!(
                "{} cached + {n} new tokens exceed the context of {} tokens",
                self.cache.len, self.cache.capacity
            ),
        }
    }
}

/// A chat over a [`Session`], as `doppler chat` holds it: each user message is rendered
/// with the model's template after what the cache holds, so only the new turn runs.
pub struct Conversation {
    pub template: Template,
    /// Sent before the first user message (None: the template's own default, if any).
    pub system: Option<String>,
    /// Text that must run before the next turn: the end of the assistant's last turn (its
    /// stop token, or its last sampled token, never ran through the model).
    pending: String,
}

/// The prompt of one turn.
pub struct Turn {
    pub ids: Vec<u32>,
    /// The conversation did not fit with this turn: the cache was cleared and the turn
    /// starts a new one.
    pub restarted: bool,
}

/// Tokens kept free for the reply when deciding whether a turn fits.
const TURN_ROOM: usize = 16;

impl Conversation {
    pub fn new(model: &Model, name: &str, system: Option<String>) -> Result<Conversation> {
        let template = model.template.clone().ok_or_else(|| Error::Invalid {
            op: "chat",
            detail: format!(
                "{name} has no chat template this build recognises (ChatML, Llama 3, Zephyr)"
            ),
        })?;
        Ok(Conversation {
            template,
            system,
            pending: String::new(),
        })
    }

    /// Forgets the conversation.
    pub fn reset(&mut self, session: &mut Session<'_>) {
        session.reset();
        self.pending.clear();
    }

    /// The ids of the next turn (`message` from the user), after what `session` holds; when
    /// they do not fit, the session is cleared and the turn starts over. An error when the
    /// message alone does not fit the context.
    pub fn turn(&mut self, session: &mut Session<'_>, message: &str) -> Result<Turn> {
        let model = session.model;
        let system = self.system.clone();
        let messages = |with_system: bool| {
            let mut m = Vec::new();
            if let (true, Some(s)) = (with_system, &system) {
                m.push(chat::Message::new("system", s));
            }
            m.push(chat::Message::new("user", message));
            m
        };
        let first = session.cache.len == 0;
        let text = self.pending.clone() + &self.template.render(&messages(first), first);
        let ids = model.prompt_ids(&text, true, first)?;
        if ids.len() + TURN_ROOM <= session.capacity() - session.cache.len {
            return Ok(Turn {
                ids,
                restarted: false,
            });
        }
        self.reset(session);
        let ids = model.prompt_ids(&self.template.render(&messages(true), true), true, true)?;
        if ids.len() + TURN_ROOM > session.capacity() {
            return Err(Error::Invalid {
                op: "chat",
                detail: format!(
                    "this message alone is {} tokens; the context holds {}",
                    ids.len(),
                    session.capacity()
                ),
            });
        }
        Ok(Turn {
            ids,
            restarted: true,
        })
    }

    /// Generation options for a turn: up to `max_tokens`, as many as the context leaves.
    pub fn options(&self, session: &Session<'_>, turn: &Turn, max_tokens: usize) -> GenOptions {
        let room = session.capacity() - session.cache.len - turn.ids.len();
        GenOptions {
            max_tokens: max_tokens.min(room),
            stop_tokens: session.model.stop_tokens(),
            stop_strings: vec![],
        }
    }

    /// Records how the reply ended, to close the turn before the next one.
    pub fn finish(&mut self, model: &Model, g: &Generation) {
        let end = self.template.end_of_turn();
        self.pending = match g.stop_token {
            Some(id) if model.stop_tokens().contains(&id) => end.to_string(),
            Some(id) => model.tokenizer.decode(&[id]) + end,
            None => end.to_string(),
        };
    }
}

/// Generated tokens turned into text as it becomes certain: whole UTF-8 characters, no
/// part of a possible stop string; a stop string cuts the text where it starts. Each piece
/// goes out with the log-probabilities of the tokens since the piece before.
pub struct TextStream {
    stops: Vec<String>,
    tokens: Vec<u32>,
    /// The tokens' bytes, where the tokenizer's text is those bytes read as UTF-8.
    bytes: Vec<u8>,
    logprobs: Vec<TokenLogprob>,
    text: String,
    /// Bytes of `text` and entries of `logprobs` sent.
    sent: usize,
    lp_sent: usize,
    /// A stop string ended the text: nothing more goes out.
    stopped: bool,
}

impl TextStream {
    pub fn new(stops: Vec<String>) -> TextStream {
        TextStream {
            stops,
            tokens: Vec::new(),
            bytes: Vec::new(),
            logprobs: Vec::new(),
            text: String::new(),
            sent: 0,
            lp_sent: 0,
            stopped: false,
        }
    }

    /// Adds a token (and its log-probability): `on_piece` gets what is now certain.
    /// Returns whether a stop string ended the text (it is then cut before it).
    pub fn push(
        &mut self,
        tk: &tokenizer::Tokenizer,
        id: u32,
        logprob: Option<TokenLogprob>,
        on_piece: &mut dyn FnMut(Piece<'_>) -> Result<()>,
    ) -> Result<bool> {
        self.tokens.push(id);
        self.logprobs.extend(logprob);
        // Byte-level vocabularies: the text from the bytes so far (no decoder pass over
        // every token each time).
        let text = match tk.decode_is_bytes() {
            true => {
                self.bytes.extend_from_slice(tk.token_bytes(id));
                String::from_utf8_lossy(&self.bytes).into_owned()
            }
            false => tk.decode(&self.tokens),
        };
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| text.find(s.as_str()))
            .min()
        {
            // Text already sent held back any start of a stop string, so at >= sent.
            self.text = text;
            if at > self.sent && self.text.is_char_boundary(self.sent) {
                self.emit(at, on_piece)?;
            }
            self.text.truncate(at);
            self.stopped = true;
            return Ok(true);
        }
        let safe = safe_prefix(&text, &self.stops);
        self.text = text;
        if safe > self.sent && self.text.is_char_boundary(self.sent) {
            self.emit(safe, on_piece)?;
        }
        Ok(false)
    }

    fn emit(
        &mut self,
        end: usize,
        on_piece: &mut dyn FnMut(Piece<'_>) -> Result<()>,
    ) -> Result<()> {
        let r = on_piece(Piece {
            text: &self.text[self.sent..end],
            logprobs: &self.logprobs[self.lp_sent..],
        });
        self.sent = end;
        self.lp_sent = self.logprobs.len();
        r
    }

    /// The end: what was held back goes out (unless a stop string cut it).
    pub fn finish(&mut self, on_piece: &mut dyn FnMut(Piece<'_>) -> Result<()>) -> Result<()> {
        if !self.stopped
            && (self.sent < self.text.len() || self.lp_sent < self.logprobs.len())
            && self.text.is_char_boundary(self.sent)
        {
            self.emit(self.text.len(), on_piece)?;
        }
        Ok(())
    }

    /// Tokens, their log-probabilities and the text.
    pub fn into_parts(self) -> (Vec<u32>, Vec<TokenLogprob>, String) {
        (self.tokens, self.logprobs, self.text)
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

/// Length of the prefix of `text` that is certain: whole characters (no U+FFFD from a
/// split UTF-8 sequence at the end) and no suffix that could start a stop string.
fn safe_prefix(text: &str, stops: &[String]) -> usize {
    let mut end = text.len();
    if text.ends_with('\u{FFFD}') {
        end -= '\u{FFFD}'.len_utf8();
    }
    for s in stops {
        for (i, _) in s.char_indices().skip(1) {
            if text[..end].ends_with(&s[..i]) {
                end = end.min(text[..end].len() - i);
            }
        }
    }
    end
}

#[cfg(test)]
mod tests {
    #[test]
    fn holds_back_possible_stop_strings_and_split_characters() {
        let stops = vec!["User:".to_string()];
        assert_eq!(super::safe_prefix("Hello Us", &stops), 6);
        assert_eq!(super::safe_prefix("Hello", &stops), 5);
        assert_eq!(super::safe_prefix("caf\u{FFFD}", &[]), 3);
    }
}
