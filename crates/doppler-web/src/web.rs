//! The wasm-bindgen exports. Methods that run on the GPU return promises built from
//! `'static` futures: the GPU is opened once per page and leaked, models and runs are held
//! in `Rc`s the futures share.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use doppler::error::Error;
use doppler::formats::FileData;
use doppler::gpu::{Gpu, GpuOptions};
use doppler::infer::sample::Sampler;
use doppler::infer::{Conversation, GenOptions, Generation, Model, Session};
use doppler::ops::kvcache::KvCache;
use doppler::train::config::TrainConfig;
use doppler::train::{Event, Flow, Trainer};
use js_sys::{Function, Promise, Uint8Array};
use sha2::Digest;
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::future_to_promise;

use crate::{GenerateOptions, TrainOptions};

thread_local! {
    static GPU: RefCell<Option<&'static Gpu>> = const { RefCell::new(None) };
    /// Set while the device is being opened, so that concurrent calls share one device.
    static OPENING: RefCell<Option<Promise>> = const { RefCell::new(None) };
}

fn js_err(e: impl std::fmt::Display) -> JsValue {
    js_sys::Error::new(&e.to_string()).into()
}

/// A serializable value as a plain JS object.
fn to_js(v: &impl serde::Serialize) -> Result<JsValue, JsValue> {
    let text = serde_json::to_string(v).map_err(js_err)?;
    js_sys::JSON::parse(&text)
}

/// An options object as JSON text (None when undefined or null).
fn options_json(v: &JsValue) -> Result<Option<String>, JsValue> {
    if v.is_undefined() || v.is_null() {
        return Ok(None);
    }
    Ok(js_sys::JSON::stringify(v)?.as_string())
}

/// The page's GPU, opened on first use.
async fn gpu() -> Result<&'static Gpu, JsValue> {
    if let Some(g) = GPU.with(|g| *g.borrow()) {
        return Ok(g);
    }
    let opening = OPENING.with(|o| o.borrow().clone());
    if let Some(p) = opening {
        wasm_bindgen_futures::JsFuture::from(p).await?;
        return GPU
            .with(|g| *g.borrow())
            .ok_or_else(|| js_err("the GPU failed to open"));
    }
    let p = future_to_promise(async {
        let g = Gpu::new(&GpuOptions::default()).await;
        OPENING.with(|o| o.borrow_mut().take());
        let g: &'static Gpu = Box::leak(Box::new(g.map_err(js_err)?));
        GPU.with(|c| *c.borrow_mut() = Some(g));
        Ok(JsValue::UNDEFINED)
    });
    OPENING.with(|o| *o.borrow_mut() = Some(p.clone()));
    wasm_bindgen_futures::JsFuture::from(p).await?;
    GPU.with(|g| *g.borrow())
        .ok_or_else(|| js_err("the GPU failed to open"))
}

#[wasm_bindgen]
extern "C" {
    #[wasm_bindgen(js_namespace = console, js_name = error)]
    fn console_error(s: &str);
}

/// A panic is a bug, and leaves the module unusable: say what it was in the console
/// instead of a bare "unreachable".
fn panic_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        std::panic::set_hook(Box::new(|info| {
            console_error(&format!(
                "doppler: internal error (a bug; reload the page): {info}"
            ));
        }))
    });
}

/// Opens the GPU (once per page) and reports the adapter, its features and limits and the
/// kernel paths chosen from them: the same object as `doppler info --json`.
#[wasm_bindgen]
pub fn init() -> Promise {
    panic_hook();
    future_to_promise(async {
        let g = gpu().await?;
        to_js(&g.report())
    })
}

/// The buffer pool's counters (bytes held by live tensors, bytes pooled for reuse).
#[wasm_bindgen(js_name = poolStats)]
pub fn pool_stats() -> Result<JsValue, JsValue> {
    let Some(g) = GPU.with(|g| *g.borrow()) else {
        return Err(js_err("poolStats: call init() first"));
    };
    let mut stats = serde_json::to_value(g.pool.stats()).map_err(js_err)?;
    // The WebAssembly memory's size: it grows to the most the page ever held at once.
    let pages = core::arch::wasm32::memory_size(0);
    stats["wasm_bytes"] = (pages as u64 * 65536).into();
    to_js(&stats)
}

/// Runs the kernel checks whose op name contains `filter` (all when absent) on this
/// page's GPU: the same JSON as `doppler verify --json`.
#[wasm_bindgen]
pub fn verify(filter: Option<String>) -> Promise {
    future_to_promise(async move {
        let g = gpu().await?;
        let checks = doppler::verify::run_async(g, filter.as_deref()).await;
        let failed = checks.iter().filter(|c| !c.pass).count();
        to_js(&serde_json::json!({ "adapter": g.info.name, "checks": checks, "failed": failed }))
    })
}

/// A file's bytes as they arrive, chunk by chunk, straight into wasm memory (the JS side
/// holds one chunk at a time), with their SHA-256.
#[wasm_bindgen]
pub struct ByteSink {
    name: String,
    data: Vec<u8>,
    hash: sha2::Sha256,
    /// Whether the bytes are kept ([`ByteSink::hash_only`] counts and hashes them only).
    keep: bool,
    len: u64,
}

#[wasm_bindgen]
impl ByteSink {
    /// `size`: the expected length in bytes (0 when unknown), reserved at once.
    #[wasm_bindgen(constructor)]
    pub fn new(name: String, size: f64) -> Result<ByteSink, JsValue> {
        let mut data = Vec::new();
        reserve(&mut data, size as usize, &name)?;
        Ok(ByteSink {
            name,
            data,
            hash: sha2::Sha256::new(),
            keep: true,
            len: 0,
        })
    }

    /// A sink that hashes and counts the bytes without keeping them (a download written
    /// to the cache, a cached file checked).
    #[wasm_bindgen(js_name = hashOnly)]
    pub fn hash_only(name: String) -> ByteSink {
        ByteSink {
            name,
            data: Vec::new(),
            hash: sha2::Sha256::new(),
            keep: false,
            len: 0,
        }
    }

    pub fn push(&mut self, chunk: &[u8]) -> Result<(), JsValue> {
        if self.keep {
            reserve(&mut self.data, chunk.len(), &self.name)?;
            self.data.extend_from_slice(chunk);
        }
        self.hash.update(chunk);
        self.len += chunk.len() as u64;
        Ok(())
    }

    #[wasm_bindgen(getter)]
    pub fn length(&self) -> f64 {
        self.len as f64
    }

    #[wasm_bindgen(getter)]
    pub fn name(&self) -> String {
        self.name.clone()
    }

    /// The SHA-256 of the bytes so far, in hex.
    pub fn sha256(&self) -> String {
        let d = self.hash.clone().finalize();
        d.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl ByteSink {
    /// The bytes (an error for a sink that only hashed them).
    fn into_bytes(self) -> Result<Vec<u8>, JsValue> {
        match self.keep {
            true => Ok(self.data),
            false => Err(js_err(format!(
                "{}: this ByteSink only hashed its bytes (hashOnly)",
                self.name
            ))),
        }
    }
}

fn reserve(data: &mut Vec<u8>, more: usize, name: &str) -> Result<(), JsValue> {
    data.try_reserve(more).map_err(|_| {
        js_err(format!(
            "{name}: {} bytes do not fit in the page's WebAssembly memory (4 GiB at most, \
             shared with everything else the page holds)",
            data.len() + more
        ))
    })
}

/// A Hugging Face directory's files, added one by one: bytes in a [`ByteSink`], or read in
/// ranges as the model loads.
#[wasm_bindgen]
#[derive(Default)]
pub struct FileSet {
    files: Vec<(String, FileData)>,
}

#[wasm_bindgen]
impl FileSet {
    #[wasm_bindgen(constructor)]
    pub fn new() -> FileSet {
        FileSet::default()
    }

    pub fn add(&mut self, file: ByteSink) -> Result<(), JsValue> {
        let name = file.name.clone();
        self.files
            .push((name, FileData::Whole(Box::new(file.into_bytes()?))));
        Ok(())
    }

    /// A file of `size` bytes the page reads in ranges: `read(start, end)` resolves to a
    /// `Uint8Array` of those bytes.
    #[wasm_bindgen(js_name = addRanges)]
    pub fn add_ranges(&mut self, name: String, size: f64, read: Function) {
        let reader = JsReader {
            name: name.clone(),
            len: size as u64,
            read,
        };
        self.files.push((name, FileData::Ranges(Box::new(reader))));
    }
}

/// A loaded model: a GGUF file or a Hugging Face directory, with its tokenizer and chat
/// template. One generation runs at a time.
#[wasm_bindgen]
pub struct WebModel {
    inner: Rc<Loaded>,
}

struct Loaded {
    model: Model,
    name: String,
    busy: Cell<bool>,
}

/// Marks the model busy for one generation; refuses a second at the same time.
struct Busy(Rc<Loaded>);

impl Busy {
    fn take(m: &Rc<Loaded>) -> Result<Busy, JsValue> {
        if m.busy.replace(true) {
            return Err(js_err(format!(
                "{}: a generation is running on this model (await it or abort it first)",
                m.name
            )));
        }
        Ok(Busy(m.clone()))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.set(false);
    }
}

/// Loads a GGUF file's bytes. `maxContext`: the most positions a session serves (at most
/// the model's).
#[wasm_bindgen(js_name = loadGguf)]
pub fn load_gguf(file: ByteSink, max_context: usize) -> Promise {
    future_to_promise(async move {
        let g = gpu().await?;
        let name = file.name.clone();
        let bytes = file.into_bytes()?;
        let model = Model::from_gguf_bytes(g, Box::new(bytes), &name, max_context)
            .await
            .map_err(js_err)?;
        Ok(WebModel::new(model, name).into())
    })
}

/// A file the page reads in ranges: `read(start, end)` resolves to a `Uint8Array` of those
/// bytes (a `File`'s slice, an `ArrayBuffer`'s view).
struct JsReader {
    name: String,
    len: u64,
    read: Function,
}

impl doppler::formats::RangeRead for JsReader {
    fn len(&self) -> u64 {
        self.len
    }
    fn read(
        &self,
        start: u64,
        len: usize,
    ) -> doppler::formats::LocalFuture<'_, doppler::Result<Vec<u8>>> {
        let end = start + len as u64;
        let call = self
            .read
            .call2(&JsValue::NULL, &(start as f64).into(), &(end as f64).into());
        Box::pin(async move {
            let fail = |e: JsValue| Error::Io {
                path: self.name.clone(),
                source: std::io::Error::other(format!(
                    "reading bytes {start}..{end}: {}",
                    e.as_string()
                        .or_else(|| e.dyn_ref::<js_sys::Error>().map(|e| e.message().into()))
                        .unwrap_or_else(|| format!("{e:?}"))
                )),
            };
            let value =
                wasm_bindgen_futures::JsFuture::from(Promise::resolve(&call.map_err(fail)?))
                    .await
                    .map_err(fail)?;
            let bytes = value
                .dyn_into::<Uint8Array>()
                .map_err(|_| fail("the read did not give a Uint8Array".into()))?;
            // A tensor too large for the page's memory is an error, not an abort.
            let n = bytes.length() as usize;
            let mut out = Vec::new();
            out.try_reserve_exact(n).map_err(|_| {
                fail(
                    format!(
                        "{n} bytes do not fit in the page's WebAssembly memory (4 GiB at most)"
                    )
                    .into(),
                )
            })?;
            out.resize(n, 0);
            bytes.copy_to(&mut out);
            Ok(out)
        })
    }
}

/// Loads a GGUF file the page reads in ranges (`read(start, end)` resolving to a
/// `Uint8Array`): the header, then each tensor as it goes to the GPU, so the file is never
/// whole in memory.
#[wasm_bindgen(js_name = loadGgufRanges)]
pub fn load_gguf_ranges(name: String, size: f64, read: Function, max_context: usize) -> Promise {
    future_to_promise(async move {
        let g = gpu().await?;
        let reader = JsReader {
            name: name.clone(),
            len: size as u64,
            read,
        };
        let model = Model::from_gguf_reader(g, Box::new(reader), &name, max_context)
            .await
            .map_err(js_err)?;
        Ok(WebModel::new(model, name).into())
    })
}

/// Loads a Hugging Face directory: config.json, *.safetensors, tokenizer.json and
/// tokenizer_config.json.
#[wasm_bindgen(js_name = loadHf)]
pub fn load_hf(files: FileSet, max_context: usize) -> Promise {
    future_to_promise(async move {
        let g = gpu().await?;
        let list = files.files;
        let model = Model::from_hf_files(g, list, max_context)
            .await
            .map_err(js_err)?;
        Ok(WebModel::new(model, "Hugging Face directory".into()).into())
    })
}

fn generation_js(g: &Generation) -> Result<JsValue, JsValue> {
    to_js(&serde_json::json!({
        "text": g.text,
        "tokens": g.tokens,
        "promptTokens": g.prompt_tokens,
        "stop": g.stop,
        "prefillMs": g.prefill_ms,
        "prefillTokS": g.prefill_tok_s(),
        "decodeTokS": g.decode_tok_s(),
        "tokenMs": g.token_ms,
    }))
}

/// Calls `on_piece(text)` for each piece; a `false` back stops generation (abort).
fn piece_sink(on_piece: &Function) -> impl FnMut(&str) -> doppler::Result<()> + '_ {
    move |piece| {
        let r = on_piece
            .call1(&JsValue::NULL, &JsValue::from_str(piece))
            .map_err(|e| Error::Invalid {
                op: "generate",
                detail: format!("the onPiece callback threw: {e:?}"),
            })?;
        if r.as_bool() == Some(false) {
            return Err(Error::Aborted { op: "generate" });
        }
        Ok(())
    }
}

impl WebModel {
    fn new(model: Model, name: String) -> WebModel {
        WebModel {
            inner: Rc::new(Loaded {
                model,
                name,
                busy: Cell::new(false),
            }),
        }
    }
}

#[wasm_bindgen]
impl WebModel {
    /// Architecture, sizes, context and load time.
    #[wasm_bindgen(getter)]
    pub fn info(&self) -> Result<JsValue, JsValue> {
        let m = &self.inner.model;
        let c = &m.llama.cfg;
        to_js(&serde_json::json!({
            "name": self.inner.name,
            "arch": c.arch,
            "layers": c.n_layer,
            "embedding": c.n_embd,
            "heads": c.n_head,
            "kvHeads": c.n_kv_head,
            "vocab": c.vocab_size,
            "context": c.context_length,
            "loadMs": m.load_ms,
            "chatTemplate": m.template.as_ref().map(|t| format!("{:?}", t.style)),
        }))
    }

    /// Continues `prompt` (or answers it with `chat: true`), calling `onPiece(text)` with
    /// each piece as it is decoded; resolves to the text, token ids and timings.
    pub fn generate(&self, prompt: String, options: JsValue, on_piece: Function) -> Promise {
        let m = self.inner.clone();
        future_to_promise(async move {
            let o = GenerateOptions::parse(options_json(&options)?.as_deref()).map_err(js_err)?;
            let _busy = Busy::take(&m)?;
            let g = gpu().await?;
            let model = &m.model;
            let (text, special) = if o.chat {
                let conv = Conversation::new(model, &m.name, None).map_err(js_err)?;
                let msg = doppler::infer::chat::Message::new("user", &prompt);
                (conv.template.render(&[msg], true), true)
            } else {
                (prompt, o.special)
            };
            let mut ids = model.prompt_ids(&text, special, true).map_err(js_err)?;
            if ids.is_empty() {
                ids.extend(model.tokenizer.bos.or(model.tokenizer.eos));
            }
            let mut session = Session::new(g, model, model.llama.max_context).map_err(js_err)?;
            let opts = GenOptions {
                max_tokens: o
                    .max_tokens
                    .min(session.capacity().saturating_sub(ids.len())),
                stop_tokens: model.stop_tokens(),
                stop_strings: o.stop.clone(),
            };
            let mut sampler = Sampler::new(o.sampler());
            let gen = session
                .generate_async(g, &ids, &opts, &mut sampler, &mut piece_sink(&on_piece))
                .await
                .map_err(js_err)?;
            generation_js(&gen)
        })
    }

    /// A conversation that keeps its KV cache between turns, as `doppler chat` does.
    pub fn chat(&self, system: Option<String>) -> Result<WebChat, JsValue> {
        let m = &self.inner;
        let conv = Conversation::new(&m.model, &m.name, system).map_err(js_err)?;
        Ok(WebChat {
            model: m.clone(),
            state: Rc::new(RefCell::new(ChatState {
                conv,
                cache: None,
                tokens: Vec::new(),
            })),
        })
    }

    /// Releases the model's GPU buffers now (chats made from it keep it alive until they
    /// are freed too) and hands pooled memory back to the GPU.
    pub fn dispose(self) {
        drop(self.inner);
        if let Some(g) = GPU.with(|g| *g.borrow()) {
            g.poll();
            g.pool.trim();
        }
    }
}

struct ChatState {
    conv: Conversation,
    /// None until the first turn, and while a turn runs.
    cache: Option<KvCache>,
    tokens: Vec<u32>,
}

/// A conversation over one model.
#[wasm_bindgen]
pub struct WebChat {
    model: Rc<Loaded>,
    state: Rc<RefCell<ChatState>>,
}

#[wasm_bindgen]
impl WebChat {
    /// Sends a user message; the reply streams through `onPiece`. Resolves to the reply's
    /// text, ids and timings, and whether the conversation had to restart (context full).
    pub fn send(&self, message: String, options: JsValue, on_piece: Function) -> Promise {
        let (m, state) = (self.model.clone(), self.state.clone());
        future_to_promise(async move {
            let o = GenerateOptions::parse(options_json(&options)?.as_deref()).map_err(js_err)?;
            let _busy = Busy::take(&m)?;
            let g = gpu().await?;
            let model = &m.model;
            let mut st = state
                .try_borrow_mut()
                .map_err(|_| js_err("chat: a turn is running"))?;
            let cache = match st.cache.take() {
                Some(c) => c,
                None => model
                    .llama
                    .cache(g, model.llama.max_context)
                    .map_err(js_err)?,
            };
            let tokens = std::mem::take(&mut st.tokens);
            let mut session = Session {
                model,
                cache,
                tokens,
            };
            let out = async {
                let turn = st.conv.turn(&mut session, &message)?;
                let mut opts = st.conv.options(&session, &turn, o.max_tokens);
                opts.stop_strings = o.stop.clone();
                let mut sampler = Sampler::new(o.sampler());
                let gen = session
                    .generate_async(
                        g,
                        &turn.ids,
                        &opts,
                        &mut sampler,
                        &mut piece_sink(&on_piece),
                    )
                    .await?;
                st.conv.finish(model, &gen);
                Ok::<_, Error>((gen, turn.restarted))
            }
            .await;
            let (gen, restarted) = match out {
                Ok(v) => v,
                Err(e) => {
                    // The cache may hold part of a turn: start the next one afresh.
                    let ChatState { conv, .. } = &mut *st;
                    conv.reset(&mut session);
                    st.cache = Some(session.cache);
                    return Err(js_err(e));
                }
            };
            st.cache = Some(session.cache);
            st.tokens = session.tokens;
            let v = generation_js(&gen)?;
            js_sys::Reflect::set(&v, &"restarted".into(), &restarted.into())?;
            Ok(v)
        })
    }

    /// Forgets the conversation (the cache is kept for the next one).
    pub fn reset(&self) -> Result<(), JsValue> {
        let mut st = self
            .state
            .try_borrow_mut()
            .map_err(|_| js_err("chat: a turn is running"))?;
        // Before the first turn there is nothing to forget.
        let st = &mut *st;
        if let Some(cache) = st.cache.take() {
            let mut s = Session {
                model: &self.model.model,
                cache,
                tokens: std::mem::take(&mut st.tokens),
            };
            st.conv.reset(&mut s);
            st.cache = Some(s.cache);
        }
        Ok(())
    }

    /// Tokens the conversation holds in its cache.
    #[wasm_bindgen(getter)]
    pub fn length(&self) -> usize {
        self.state
            .try_borrow()
            .ok()
            .and_then(|s| s.cache.as_ref().map(|c| c.len))
            .unwrap_or(0)
    }
}

/// A training run in the page: `doppler train`'s trainer over a config and a corpus.
#[wasm_bindgen]
pub struct WebRun {
    trainer: Rc<RefCell<Trainer<'static>>>,
    summary: JsValue,
}

/// Trains from a TOML config (as `doppler train --config`; its corpus path and out_dir
/// are not read: the corpus is `corpus`, and nothing is written) and reports through
/// `onEvent({type: "started" | "step" | "eval", ...})`; an `onEvent` that returns `false`
/// stops the run. Resolves to the run: its summary, weights and a sampler.
#[wasm_bindgen]
pub fn train(config_toml: String, corpus: String, options: JsValue, on_event: Function) -> Promise {
    future_to_promise(async move {
        let o = TrainOptions::parse(options_json(&options)?.as_deref()).map_err(js_err)?;
        let g = gpu().await?;
        let cfg = TrainConfig::parse(&config_toml, "config").map_err(js_err)?;
        if corpus.is_empty() {
            return Err(js_err("train: the corpus is empty"));
        }
        let mut trainer = Trainer::fresh(g, &cfg, &corpus).map_err(js_err)?;
        let stop = o.max_steps.unwrap_or(u64::MAX);
        let mut emit = |e: Event<'_>| -> doppler::Result<Flow> {
            let v = match e {
                Event::Started {
                    params,
                    outputs,
                    train_items,
                    val_items,
                    unit,
                    start_step,
                    steps,
                } => serde_json::json!({ "type": "started", "params": params, "outputs": outputs,
                    "trainItems": train_items, "valItems": val_items, "unit": unit,
                    "startStep": start_step, "steps": steps }),
                Event::Step(s) => serde_json::json!({ "type": "step", "step": s.step,
                    "steps": s.steps, "loss": s.loss, "lr": s.lr,
                    "itemsPerS": s.items_per_s, "gradNorm": s.grad_norm, "skipped": s.skipped }),
                Event::Eval {
                    step,
                    val_loss,
                    val_accuracy,
                } => serde_json::json!({ "type": "eval", "step": step, "valLoss": val_loss,
                    "valAccuracy": val_accuracy }),
                Event::Checkpoint { .. } => return Ok(Flow::Continue),
            };
            let js = to_js(&v).map_err(|e| Error::Invalid {
                op: "train",
                detail: format!("{e:?}"),
            })?;
            let r = on_event
                .call1(&JsValue::NULL, &js)
                .map_err(|e| Error::Invalid {
                    op: "train",
                    detail: format!("the onEvent callback threw: {e:?}"),
                })?;
            // false: abort (the run is dropped); "stop": end after this step, keeping it.
            if r.as_bool() == Some(false) {
                return Err(Error::Aborted { op: "train" });
            }
            Ok(match r.as_string().as_deref() {
                Some("stop") => Flow::Stop,
                _ => Flow::Continue,
            })
        };
        let summary = match trainer.run_async(stop, &mut emit).await {
            Ok(s) => s,
            Err(e) => {
                // The run is dropped: its buffers back to the pool now, as dispose() does.
                drop(trainer);
                g.poll();
                g.pool.trim();
                return Err(js_err(e));
            }
        };
        let summary = to_js(&serde_json::json!({
            "steps": summary.steps,
            "stopped": summary.stopped,
            "firstValLoss": summary.first_val_loss,
            "finalValLoss": summary.final_val_loss,
            "finalValAccuracy": summary.final_val_accuracy,
            "finalTrainLoss": summary.final_train_loss,
            "itemsPerS": summary.items_per_s,
            "seconds": summary.seconds,
            "params": trainer.params().numel(),
        }))?;
        Ok(WebRun {
            trainer: Rc::new(RefCell::new(trainer)),
            summary,
        }
        .into())
    })
}

#[wasm_bindgen]
impl WebRun {
    #[wasm_bindgen(getter)]
    pub fn summary(&self) -> JsValue {
        self.summary.clone()
    }

    /// The trained weights as a SafeTensors file (the names `doppler train` checkpoints use).
    pub fn safetensors(&self) -> Promise {
        let t = self.trainer.clone();
        future_to_promise(async move {
            let t = t
                .try_borrow()
                .map_err(|_| js_err("train: the run is busy"))?;
            let bytes = t.model_safetensors().await.map_err(js_err)?;
            Ok(Uint8Array::from(bytes.as_slice()).into())
        })
    }

    /// The run's tokenizer as JSON (what checkpoints hold as tokenizer.json).
    #[wasm_bindgen(js_name = tokenizerJson)]
    pub fn tokenizer_json(&self) -> Result<String, JsValue> {
        let t = self
            .trainer
            .try_borrow()
            .map_err(|_| js_err("train: the run is busy"))?;
        let (_, tokenizer) = t
            .text_model()
            .ok_or_else(|| js_err("train: this run trains a conv net: it has no tokenizer"))?;
        let bytes = tokenizer.to_json().map_err(js_err)?;
        String::from_utf8(bytes).map_err(js_err)
    }

    /// Continues `prompt` with the trained model (as `doppler generate --checkpoint`),
    /// calling `onPiece` with each piece; resolves to the new text.
    pub fn sample(&self, prompt: String, options: JsValue, on_piece: Function) -> Promise {
        let t = self.trainer.clone();
        future_to_promise(async move {
            let o = GenerateOptions::parse(options_json(&options)?.as_deref()).map_err(js_err)?;
            let g = gpu().await?;
            let t = t
                .try_borrow()
                .map_err(|_| js_err("train: the run is busy"))?;
            let mut sampler = Sampler::new(o.sampler());
            let mut aborted = false;
            let mut sink = |piece: &str| {
                if !aborted {
                    let r = on_piece.call1(&JsValue::NULL, &JsValue::from_str(piece));
                    aborted = matches!(r.map(|v| v.as_bool()), Ok(Some(false)) | Err(_));
                }
            };
            let (model, tokenizer) = t
                .text_model()
                .ok_or_else(|| js_err("train: this run trains a conv net: it generates no text"))?;
            let text = doppler::train::generate_async(
                g,
                model,
                tokenizer,
                &prompt,
                o.max_tokens,
                &mut sampler,
                &mut sink,
            )
            .await
            .map_err(js_err)?;
            Ok(JsValue::from_str(&text))
        })
    }

    /// Releases the run's GPU buffers now.
    pub fn dispose(self) {
        drop(self.trainer);
        if let Some(g) = GPU.with(|g| *g.borrow()) {
            g.poll();
            g.pool.trim();
        }
    }
}
