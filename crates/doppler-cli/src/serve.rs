//! `doppler serve`: an OpenAI-compatible HTTP server over `infer` (tokio + axum).
//!
//! The HTTP side (a tokio runtime on its own thread) parses and checks requests and
//! answers in OpenAI's wire format: JSON bodies, SSE chunks ending `data: [DONE]`, error
//! objects. The model, its GPU and one KV cache stay on the calling thread, the worker,
//! which runs one request at a time in arrival order (a bounded queue in front: 429 past
//! it) and streams each piece of text back as it is certain. A client that goes away
//! ends its generation at the next token. Each request starts from an empty cache, so its
//! tokens do not depend on what ran before or beside it.
//!
//! Sampling as OpenAI's: temperature, top_p (and llama.cpp's top_k, min_p), seed, stop
//! strings, presence and frequency penalties, logit_bias; log-probabilities of the chosen
//! tokens and the most likely others (from the model's logits, as vLLM reports them);
//! `response_format` json_object and json_schema enforced by a grammar over the
//! vocabulary (`doppler::infer::grammar`): the answer parses, and follows the schema.
//!
//! Continuous batching (`--parallel N`, default 8): up to N requests are generated at
//! once, every one's next token (or a chunk of its prompt) a row of one forward pass over
//! a pool of KV pages (`doppler::infer::batch`); a request that finishes or whose client
//! leaves gives its pages back at once and the next waiting one starts. Every row runs the
//! same kernels whatever the others are, so a request's tokens and log-probabilities are
//! the same bits alone or beside others. `--parallel 1`, and models the batched pass does
//! not run (attention windows, a LoRA adapter, a q8_0 cache), take the one-sequence path:
//! one request at a time from an empty cache.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Args;
use doppler::gpu::Gpu;
use doppler::infer::batch::{Ahead, Batch, Chosen, InFlight, SeqId};
use doppler::infer::chat::Message;
use doppler::infer::grammar::{Grammar, JsonConstraint, TokenTrie};
use doppler::infer::sample::{Row, Sampler, SamplerConfig, SamplingPool, TokenLogprob};
use doppler::infer::{GenOptions, Model, Session, StopReason, TextStream};
use doppler::ops::kvcache::PAGE;
use doppler::ops::sample::Pick;
use doppler::Error;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc as tmpsc;

use crate::generate::CacheType;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Model: a .gguf file, or a directory with config.json, *.safetensors and tokenizer.json.
    #[arg(short, long)]
    model: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port, printed when listening).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Context (KV cache) size in tokens: a request's prompt and its answer together.
    #[arg(short = 'c', long, default_value_t = 4096)]
    ctx_size: usize,
    /// KV cache storage: auto (f16 where the adapter has shader-f16, else f32), f32, f16,
    /// q8_0.
    #[arg(long, value_enum, default_value = "auto")]
    cache_type: CacheType,
    /// Requests waiting beside those running; more are answered 429.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Requests generated at once (continuous batching; each up to -c tokens, a pool of
    /// KV pages for all of them). 1: one at a time on the one-sequence path.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=1024))]
    parallel: u16,
    /// Compute every prompt whole: no KV pages of a cached prompt prefix shared between
    /// requests (continuous batching shares them by default).
    #[arg(long)]
    no_prefix_cache: bool,
    /// Start serving at once: no warm-up (by default a step of each power of two of rows is
    /// recorded first, unrun, so that no request waits on a pipeline's compilation).
    #[arg(long)]
    no_warmup: bool,
    /// Require `Authorization: Bearer KEY` on every /v1 request.
    #[arg(long, env = "DOPPLER_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The model's id in /v1/models and in requests (default: the file or directory name).
    #[arg(long)]
    alias: Option<String>,
}

/// Largest request body (bytes); larger ones are answered 413.
const BODY_LIMIT: usize = 8 << 20;

/// What the worker sends back for a request.
enum Event {
    /// The prompt was accepted: its tokens, and how many of them came from pages of a
    /// prompt prefix cached earlier.
    Started {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    /// Text and the log-probabilities of its tokens (when asked for).
    Text(String, Vec<TokenLogprob>),
    Done {
        finish: &'static str,
        completion_tokens: usize,
    },
    Failed(ApiError),
}

/// A request for the worker: the rendered prompt (or the messages to render) and its
/// options.
struct Job {
    ask: Ask,
    events: tmpsc::UnboundedSender<Event>,
    /// Given back before the last event (see [`Slot`]).
    slot: Slot,
}

enum Prompt {
    Chat(Vec<Message>),
    Text(String),
    /// Token ids as given (`prompt: [1, 2, 3]`), not tokenized again.
    Tokens(Vec<i64>),
}

/// Counters for /metrics.
#[derive(Default)]
struct Stats {
    /// Requests taken and not finished: the one running and those waiting.
    inflight: AtomicUsize,
    active: AtomicUsize,
    requests: AtomicU64,
    prompt_tokens: AtomicU64,
    /// Of prompt_tokens, those whose KV pages came from the prefix cache (continuous
    /// batching; counted, like prompt_tokens, when a request finishes).
    cached_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    /// The last request's decode rate (tokens/s, f64 bits).
    decode_tok_s: AtomicU64,
    /// Tokens the running requests hold in the KV cache.
    kv_tokens: AtomicUsize,
    /// Pages of the batched KV pool in use (0 without one).
    kv_pages: AtomicUsize,
    /// Batched steps submitted, and of those, steps chained on the one before (their
    /// tokens that step's choices on the GPU).
    steps: AtomicU64,
    chained_steps: AtomicU64,
}

struct App {
    model_id: String,
    api_key: Option<String>,
    queue: usize,
    jobs: Mutex<mpsc::Sender<Job>>,
    stats: Arc<Stats>,
    ids: AtomicU64,
    ctx: usize,
    /// Pages of the batched KV pool (0: the one-sequence path) and requests at once.
    pages: usize,
    parallel: usize,
    has_template: bool,
    vocab: usize,
    /// Token texts for log-probabilities (lossy where a token holds part of a character)
    /// and their bytes.
    tokens: Arc<Vec<(String, Vec<u8>)>>,
}

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone)]
struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<String>,
    code: Option<&'static str>,
}

impl ApiError {
    fn bad(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: None,
        }
    }

    /// A 500 or 503: the server's fault, not the request's.
    fn server(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    fn body(&self) -> Value {
        json!({ "error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

/// A JSON body's rejection (not JSON, wrong types, too large) as OpenAI's error object.
fn rejection(r: JsonRejection) -> ApiError {
    let too_large = r.status() == StatusCode::PAYLOAD_TOO_LARGE;
    ApiError {
        // OpenAI answers 400 where axum says 415 or 422.
        status: match too_large {
            true => StatusCode::PAYLOAD_TOO_LARGE,
            false => StatusCode::BAD_REQUEST,
        },
        message: match too_large {
            true => format!("request body larger than {BODY_LIMIT} bytes"),
            false => format!("invalid JSON body: {}", r.body_text()),
        },
        kind: "invalid_request_error",
        param: None,
        code: too_large.then_some("request_too_large"),
    }
}

/// `doppler serve`: loads the model, listens, and runs requests until killed.
pub fn serve_cmd(gpu: &Gpu, args: &ServeArgs) -> doppler::Result<ExitCode> {
    let model = Model::open(gpu, &args.model, args.ctx_size)?;
    let ty = args.cache_type.kv_type(gpu);
    let parallel = args.parallel as usize;
    let ctx = args.ctx_size.min(model.llama.max_context);
    let batch = match parallel {
        1 => None,
        n => {
            let pages = n * ctx.div_ceil(PAGE);
            match Batch::new(gpu, &model.llama, pages, ty) {
                Ok(mut b) => {
                    b.set_prefix_cache(!args.no_prefix_cache);
                    if !args.no_warmup {
                        let t = Instant::now();
                        let steps = b.warm_up(gpu, n, STEP_PROMPT_ROWS + n)?;
                        tracing::info!(
                            "warmed up: {steps} steps of 1 to {} rows recorded in {:.0} ms",
                            STEP_PROMPT_ROWS + n,
                            t.elapsed().as_secs_f64() * 1e3
                        );
                    }
                    tracing::info!(
                        "continuous batching: {n} requests at once, KV pool of {pages} pages of {PAGE} tokens ({} {}, {:.1} MiB)",
                        ty.name(),
                        ctx,
                        b.bytes() as f64 / 1048576.0
                    );
                    Some(b)
                }
                Err(e) => {
                    tracing::warn!("{e}: one request at a time");
                    None
                }
            }
        }
    };
    let mut session = match &batch {
        Some(_) => None,
        None => {
            let s = Session::with_cache_type(gpu, &model, args.ctx_size, ty)?;
            tracing::info!("{}", crate::generate::cache_line(&s.cache));
            Some(s)
        }
    };
    let model_id = match &args.alias {
        Some(a) => a.clone(),
        None => args
            .model
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into()),
    };
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .map_err(|e| Error::Invalid {
            op: "serve",
            detail: format!("--host {} --port {}: {e}", args.host, args.port),
        })?;
    let (tx, rx) = mpsc::channel::<Job>();
    let stats = Arc::new(Stats::default());
    let app = Arc::new(App {
        model_id,
        api_key: args.api_key.clone(),
        queue: args.queue,
        jobs: Mutex::new(tx),
        stats: stats.clone(),
        ids: AtomicU64::new(0),
        ctx,
        pages: batch.as_ref().map_or(0, Batch::pages),
        parallel: match &batch {
            Some(_) => parallel,
            None => 1,
        },
        has_template: model.template.is_some(),
        vocab: model.llama.cfg.vocab_size,
        tokens: Arc::new(
            (0..model.tokenizer.vocab_size() as u32)
                .map(|i| {
                    let b = model.tokenizer.token_bytes(i).to_vec();
                    (String::from_utf8_lossy(&b).into_owned(), b)
                })
                .collect(),
        ),
    });
    // The HTTP side on its own thread; the worker (this thread) keeps the GPU.
    let (ready_tx, ready_rx) = mpsc::channel::<Result<SocketAddr, String>>();
    std::thread::Builder::new()
        .name("doppler-http".into())
        .spawn(move || http_main(app, addr, ready_tx))
        .map_err(|e| Error::Invalid {
            op: "serve",
            detail: format!("starting the HTTP thread: {e}"),
        })?;
    match ready_rx.recv() {
        Ok(Ok(bound)) => {
            // The one line a script waits for (stdout), then the logs (stderr).
            println!("doppler serve: listening on http://{bound}");
            use std::io::Write;
            let _ = std::io::stdout().flush();
        }
        Ok(Err(e)) => {
            return Err(Error::Invalid {
                op: "serve",
                detail: e,
            })
        }
        Err(_) => {
            return Err(Error::Invalid {
                op: "serve",
                detail: "the HTTP thread ended before listening".into(),
            })
        }
    }
    let mut trie = None;
    match (batch, &mut session) {
        (Some(b), _) => batch_loop(gpu, &model, b, rx, &stats, parallel, ctx, &mut trie),
        (None, Some(session)) => {
            for job in rx {
                run_job(gpu, &model, session, job, &stats, &mut trie);
            }
        }
        (None, None) => unreachable!("a session where there is no batch"),
    }
    Ok(ExitCode::SUCCESS)
}

fn http_main(app: Arc<App>, addr: SocketAddr, ready: mpsc::Sender<Result<SocketAddr, String>>) {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(format!("tokio runtime: {e}")));
            return;
        }
    };
    rt.block_on(async move {
        let listener = match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(e) => {
                let _ = ready.send(Err(format!("cannot listen on {addr}: {e}")));
                return;
            }
        };
        let bound = listener.local_addr().unwrap_or(addr);
        let router = Router::new()
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/completions", post(completions))
            .route("/v1/models", get(models))
            .route("/health", get(|| async { Json(json!({ "status": "ok" })) }))
            .route("/metrics", get(metrics))
            .fallback(|| async {
                ApiError {
                    status: StatusCode::NOT_FOUND,
                    message: "no such route".into(),
                    kind: "invalid_request_error",
                    param: None,
                    code: Some("not_found"),
                }
            })
            .layer(DefaultBodyLimit::max(BODY_LIMIT))
            .with_state(app);
        let _ = ready.send(Ok(bound));
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!("HTTP server stopped: {e}");
        }
    });
}

/// The key check: `Authorization: Bearer KEY` where the server has one.
fn authorize(app: &App, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &app.api_key else {
        return Ok(());
    };
    // The scheme is case-insensitive (RFC 6750), the key is not.
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, key)| key.trim());
    if given == Some(key.as_str()) {
        return Ok(());
    }
    Err(ApiError {
        status: StatusCode::UNAUTHORIZED,
        message: "missing or incorrect API key (Authorization: Bearer KEY)".into(),
        kind: "invalid_request_error",
        param: None,
        code: Some("invalid_api_key"),
    })
}

async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return e.into_response();
    }
    Json(json!({ "object": "list", "data": [{
        "id": app.model_id, "object": "model", "created": 0, "owned_by": "doppler",
    }]}))
    .into_response()
}

async fn metrics(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return e.into_response();
    }
    let s = &app.stats;
    let rate = f64::from_bits(s.decode_tok_s.load(Ordering::SeqCst));
    let active = s.active.load(Ordering::SeqCst);
    let waiting = s.inflight.load(Ordering::SeqCst).saturating_sub(active);
    format!(
        "# HELP doppler_queue_depth Requests waiting for the model.\n# TYPE doppler_queue_depth gauge\ndoppler_queue_depth {}\n\
         # HELP doppler_active_sequences Sequences being generated.\n# TYPE doppler_active_sequences gauge\ndoppler_active_sequences {}\n\
         # HELP doppler_requests_total Requests answered by the model.\n# TYPE doppler_requests_total counter\ndoppler_requests_total {}\n\
         # HELP doppler_prompt_tokens_total Prompt tokens processed.\n# TYPE doppler_prompt_tokens_total counter\ndoppler_prompt_tokens_total {}\n\
         # HELP doppler_prompt_tokens_cached_total Prompt tokens whose KV pages a cached prefix held (not computed again).\n# TYPE doppler_prompt_tokens_cached_total counter\ndoppler_prompt_tokens_cached_total {}\n\
         # HELP doppler_completion_tokens_total Tokens generated.\n# TYPE doppler_completion_tokens_total counter\ndoppler_completion_tokens_total {}\n\
         # HELP doppler_decode_tokens_per_second The last request's decode rate.\n# TYPE doppler_decode_tokens_per_second gauge\ndoppler_decode_tokens_per_second {rate}\n\
         # HELP doppler_kv_tokens_in_use Tokens the running requests hold in the KV cache.\n# TYPE doppler_kv_tokens_in_use gauge\ndoppler_kv_tokens_in_use {}\n\
         # HELP doppler_kv_tokens_capacity Tokens a request may hold (-c).\n# TYPE doppler_kv_tokens_capacity gauge\ndoppler_kv_tokens_capacity {}\n\
         # HELP doppler_kv_pages_in_use Pages of the KV pool in use (continuous batching).\n# TYPE doppler_kv_pages_in_use gauge\ndoppler_kv_pages_in_use {}\n\
         # HELP doppler_kv_pages_total Pages of the KV pool.\n# TYPE doppler_kv_pages_total gauge\ndoppler_kv_pages_total {}\n\
         # HELP doppler_parallel Requests generated at once.\n# TYPE doppler_parallel gauge\ndoppler_parallel {}\n\
         # HELP doppler_steps_total Batched steps submitted (continuous batching: decoding rows and prompt chunks).\n# TYPE doppler_steps_total counter\ndoppler_steps_total {}\n\
         # HELP doppler_chained_steps_total Of those, steps submitted before the step they follow was read back (its tokens chosen on the GPU).\n# TYPE doppler_chained_steps_total counter\ndoppler_chained_steps_total {}\n",
        waiting,
        active,
        s.requests.load(Ordering::SeqCst),
        s.prompt_tokens.load(Ordering::SeqCst),
        s.cached_tokens.load(Ordering::SeqCst),
        s.completion_tokens.load(Ordering::SeqCst),
        s.kv_tokens.load(Ordering::SeqCst),
        app.ctx,
        s.kv_pages.load(Ordering::SeqCst),
        app.pages,
        app.parallel,
        s.steps.load(Ordering::SeqCst),
        s.chained_steps.load(Ordering::SeqCst),
    )
    .into_response()
}

/// A message's content: a string, or a list of text parts.
#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Deserialize)]
struct InMessage {
    role: String,
    content: Option<Content>,
    #[allow(dead_code)]
    name: Option<String>,
}

/// A string or a list of strings (`stop`, `prompt`).
#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// /v1/completions' prompt as OpenAI takes it: a string, token ids, or a list of either
/// (one prompt a request here).
#[derive(Deserialize)]
#[serde(untagged)]
enum PromptIn {
    Text(String),
    Tokens(Vec<i64>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<i64>>),
}

#[derive(Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

/// The parameters both endpoints share (OpenAI's names). Unknown fields are refused, as
/// OpenAI refuses them; fields accepted but without effect here are listed as such.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Request {
    model: Option<String>,
    messages: Option<Vec<InMessage>>,
    prompt: Option<PromptIn>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    seed: Option<i64>,
    stop: Option<OneOrMany>,
    n: Option<i64>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    logprobs: Option<Value>,
    top_logprobs: Option<i64>,
    response_format: Option<Value>,
    logit_bias: Option<Value>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    echo: Option<bool>,
    suffix: Option<String>,
    best_of: Option<i64>,
    // Accepted, no effect here.
    #[allow(dead_code)]
    user: Option<Value>,
    #[allow(dead_code)]
    store: Option<Value>,
    #[allow(dead_code)]
    metadata: Option<Value>,
    #[allow(dead_code)]
    service_tier: Option<Value>,
    #[allow(dead_code)]
    parallel_tool_calls: Option<Value>,
}

/// What a request asks of the worker, after its parameters are checked.
struct Checked {
    ask: Ask,
    stream: bool,
    include_usage: bool,
}

fn check(app: &App, r: Request, chat: bool) -> Result<Checked, ApiError> {
    if let Some(m) = &r.model {
        if m != &app.model_id {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!(
                    "the model `{m}` does not exist: this server has `{}`",
                    app.model_id
                ),
                kind: "invalid_request_error",
                param: Some("model".into()),
                code: Some("model_not_found"),
            });
        }
    }
    let unsupported = |param: &str, what: &str| {
        Err(ApiError::bad(
            param,
            format!("{param}: {what} is not supported by this server yet"),
        ))
    };
    if r.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad(
            "n",
            "n: only 1 choice a request is supported",
        ));
    }
    if r.best_of.is_some_and(|n| n != 1) {
        return unsupported("best_of", "more than one candidate");
    }
    let penalty = |v: Option<f64>, param: &str| -> Result<f32, ApiError> {
        match v.unwrap_or(0.0) {
            p if (-2.0..=2.0).contains(&p) => Ok(p as f32),
            p => Err(ApiError::bad(
                param,
                format!("{param}: {p} must be in [-2, 2]"),
            )),
        }
    };
    let presence_penalty = penalty(r.presence_penalty, "presence_penalty")?;
    let frequency_penalty = penalty(r.frequency_penalty, "frequency_penalty")?;
    let logprobs = logprobs_of(&r, chat)?;
    let grammar = match &r.response_format {
        None | Some(Value::Null) => None,
        Some(f) => response_format(f)?,
    };
    let mut logit_bias = Vec::new();
    match &r.logit_bias {
        None | Some(Value::Null) => {}
        Some(Value::Object(o)) => {
            for (k, v) in o {
                let id = k.parse::<u32>().ok().filter(|&i| (i as usize) < app.vocab);
                let Some(id) = id else {
                    return Err(ApiError::bad(
                        "logit_bias",
                        format!(
                            "logit_bias: `{k}` is not a token id below the vocabulary's {}",
                            app.vocab
                        ),
                    ));
                };
                match v.as_f64() {
                    // The same id written twice ("5", "05"): the last one counts.
                    Some(b) if (-100.0..=100.0).contains(&b) => {
                        logit_bias.retain(|e: &(u32, f32)| e.0 != id);
                        logit_bias.push((id, b as f32))
                    }
                    _ => {
                        return Err(ApiError::bad(
                            "logit_bias",
                            format!(
                                "logit_bias: the bias of token {k} must be a number in [-100, 100]"
                            ),
                        ))
                    }
                }
            }
            logit_bias.sort_by_key(|e| e.0);
        }
        Some(_) => {
            return Err(ApiError::bad(
                "logit_bias",
                "logit_bias: an object of token ids to biases",
            ))
        }
    }
    if r.tools.as_ref().is_some_and(|t| !t.is_null()) || r.tool_choice.is_some() {
        return unsupported("tools", "tool calling");
    }
    if r.echo == Some(true) {
        return unsupported("echo", "echoing the prompt");
    }
    if r.suffix.is_some() {
        return unsupported("suffix", "a suffix");
    }
    let prompt = if chat {
        if r.prompt.is_some() {
            return Err(ApiError::bad(
                "prompt",
                "prompt: use messages in chat completions",
            ));
        }
        if !app.has_template {
            return Err(ApiError::bad(
                "messages",
                "this model has no chat template this build recognises: use /v1/completions",
            ));
        }
        let Some(msgs) = r.messages else {
            return Err(ApiError::bad("messages", "messages: required"));
        };
        if msgs.is_empty() {
            return Err(ApiError::bad("messages", "messages: must not be empty"));
        }
        let mut out = Vec::with_capacity(msgs.len());
        for (i, m) in msgs.into_iter().enumerate() {
            let role = match m.role.as_str() {
                "system" | "developer" => "system",
                "user" => "user",
                "assistant" => "assistant",
                other => {
                    return Err(ApiError::bad(
                        &format!("messages[{i}].role"),
                        format!("messages[{i}].role: `{other}` is not supported (system, developer, user, assistant)"),
                    ))
                }
            };
            let text = match m.content {
                None => String::new(),
                Some(Content::Text(t)) => t,
                Some(Content::Parts(parts)) => {
                    let mut t = String::new();
                    for (j, p) in parts.into_iter().enumerate() {
                        match (p.kind.as_str(), p.text) {
                            ("text", Some(s)) => t.push_str(&s),
                            (kind, _) => {
                                return Err(ApiError::bad(
                                    &format!("messages[{i}].content[{j}]"),
                                    format!("messages[{i}].content[{j}]: a `{kind}` part is not supported (text only)"),
                                ))
                            }
                        }
                    }
                    t
                }
            };
            out.push(Message::new(role, &text));
        }
        Prompt::Chat(out)
    } else {
        if r.messages.is_some() {
            return Err(ApiError::bad(
                "messages",
                "messages: use /v1/chat/completions",
            ));
        }
        let one = |n: usize| match n {
            1 => Ok(()),
            _ => Err(ApiError::bad(
                "prompt",
                format!("prompt: exactly one prompt a request (got {n})"),
            )),
        };
        match r.prompt {
            Some(PromptIn::Text(t)) => Prompt::Text(t),
            Some(PromptIn::Tokens(ids)) => Prompt::Tokens(ids),
            Some(PromptIn::Texts(mut v)) => {
                one(v.len())?;
                Prompt::Text(v.pop().unwrap_or_default())
            }
            Some(PromptIn::TokenLists(mut v)) => {
                one(v.len())?;
                Prompt::Tokens(v.pop().unwrap_or_default())
            }
            None => return Err(ApiError::bad("prompt", "prompt: required")),
        }
    };
    let max = r.max_completion_tokens.or(r.max_tokens);
    let param = match r.max_completion_tokens {
        Some(_) => "max_completion_tokens",
        None => "max_tokens",
    };
    let max_tokens = match max {
        // OpenAI's defaults: chat until the model stops (here: the context), text
        // completions 16 tokens.
        None if !chat => Some(16),
        None => None,
        Some(n) if n < 1 => {
            return Err(ApiError::bad(
                param,
                format!("{param}: {n} must be at least 1"),
            ))
        }
        Some(n) => Some(n as usize),
    };
    let temperature = r.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad(
            "temperature",
            format!("temperature: {temperature} must be in [0, 2]"),
        ));
    }
    let top_p = r.top_p.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&top_p) {
        return Err(ApiError::bad(
            "top_p",
            format!("top_p: {top_p} must be in [0, 1]"),
        ));
    }
    // top_p 0 keeps only the most likely token: greedy.
    let (temperature, top_p) = match top_p == 0.0 {
        true => (0.0, 1.0),
        false => (temperature, top_p),
    };
    let min_p = r.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::bad(
            "min_p",
            format!("min_p: {min_p} must be in [0, 1]"),
        ));
    }
    let top_k = match r.top_k {
        None => 0,
        Some(k) if k < 0 => return Err(ApiError::bad("top_k", format!("top_k: {k} must be >= 0"))),
        Some(k) => k as usize,
    };
    // Without a seed, one from the clock: a seed makes the answer reproducible.
    let seed = match r.seed {
        Some(s) => s as u64,
        None => SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    };
    let stop = r.stop.map(OneOrMany::into_vec).unwrap_or_default();
    if stop.len() > 4 {
        return Err(ApiError::bad("stop", "stop: at most 4 sequences"));
    }
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::bad("stop", "stop: sequences must not be empty"));
    }
    let ask = Ask {
        prompt,
        max_tokens,
        sampler: SamplerConfig {
            temperature: temperature as f32,
            top_k,
            top_p: top_p as f32,
            min_p: min_p as f32,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty,
            frequency_penalty,
            logit_bias,
            seed,
        },
        stop,
        logprobs,
        grammar,
    };
    Ok(Checked {
        ask,
        stream: r.stream.unwrap_or(false),
        include_usage: r
            .stream_options
            .is_some_and(|o| o.include_usage.unwrap_or(false)),
    })
}

/// Log-probabilities asked for: chat's `logprobs: true` with `top_logprobs` 0..20, or text
/// completions' `logprobs: N` (0..5, the legacy form).
fn logprobs_of(r: &Request, chat: bool) -> Result<Option<usize>, ApiError> {
    if chat {
        let on = match &r.logprobs {
            None | Some(Value::Null) | Some(Value::Bool(false)) => false,
            Some(Value::Bool(true)) => true,
            Some(_) => return Err(ApiError::bad("logprobs", "logprobs: true or false")),
        };
        return match r.top_logprobs {
            None => Ok(on.then_some(0)),
            Some(n) if !(0..=20).contains(&n) => Err(ApiError::bad(
                "top_logprobs",
                format!("top_logprobs: {n} must be in [0, 20]"),
            )),
            Some(_) if !on => Err(ApiError::bad(
                "top_logprobs",
                "top_logprobs: needs logprobs: true",
            )),
            Some(n) => Ok(Some(n as usize)),
        };
    }
    if r.top_logprobs.is_some() {
        return Err(ApiError::bad(
            "top_logprobs",
            "top_logprobs: text completions take logprobs: N",
        ));
    }
    match &r.logprobs {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_i64() {
            Some(n) if (0..=5).contains(&n) => Ok(Some(n as usize)),
            _ => Err(ApiError::bad(
                "logprobs",
                "logprobs: a whole number in [0, 5]",
            )),
        },
    }
}

/// `response_format`: text (no grammar), json_object, or json_schema with its schema
/// compiled (a 400 naming what the grammar cannot express).
fn response_format(f: &Value) -> Result<Option<Arc<Grammar>>, ApiError> {
    let bad = |m: String| ApiError::bad("response_format", format!("response_format: {m}"));
    let kind = f
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("an object with a type (text, json_object, json_schema)".into()))?;
    if let Some(k) = f.as_object().and_then(|o| {
        o.keys()
            .find(|k| !matches!(k.as_str(), "type" | "json_schema"))
    }) {
        return Err(bad(format!("unknown field `{k}`")));
    }
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(Arc::new(Grammar::json_object()))),
        "json_schema" => {
            let js = f
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| bad("json_schema: an object with name and schema".into()))?;
            if let Some(k) = js
                .keys()
                .find(|k| !matches!(k.as_str(), "name" | "schema" | "strict" | "description"))
            {
                return Err(bad(format!("json_schema: unknown field `{k}`")));
            }
            match js.get("name").and_then(Value::as_str) {
                Some(n) if !n.is_empty() && n.len() <= 64 => {}
                _ => return Err(bad("json_schema.name: a name of 1 to 64 characters".into())),
            }
            // No schema: any JSON value.
            let grammar = match js.get("schema") {
                None | Some(Value::Null) => Grammar::json_value(),
                Some(s) => Grammar::from_schema(s).map_err(|e| bad(format!("json_schema.{e}")))?,
            };
            Ok(Some(Arc::new(grammar)))
        }
        other => Err(bad(format!(
            "type `{other}` is not supported (text, json_object, json_schema)"
        ))),
    }
}

async fn chat_completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Json<Request>, JsonRejection>,
) -> Response {
    respond(app, headers, body, true).await
}

async fn completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Json<Request>, JsonRejection>,
) -> Response {
    respond(app, headers, body, false).await
}

/// Checks a request, queues it, and answers: one JSON object, or SSE chunks as the text
/// comes.
async fn respond(
    app: Arc<App>,
    headers: HeaderMap,
    body: Result<Json<Request>, JsonRejection>,
    chat: bool,
) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return e.into_response();
    }
    let req = match body {
        Ok(Json(r)) => r,
        Err(r) => return rejection(r).into_response(),
    };
    let c = match check(&app, req, chat) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let (tx, mut rx) = tmpsc::unbounded_channel();
    // A place: the one running and `queue` waiting, or 429.
    let stats = &app.stats;
    let taken = stats.inflight.fetch_add(1, Ordering::SeqCst);
    let slot = Slot(stats.clone());
    if taken >= app.queue + app.parallel {
        drop(slot);
        return ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: format!("the queue is full ({} requests waiting)", app.queue),
            kind: "rate_limit_error",
            param: None,
            code: Some("queue_full"),
        }
        .into_response();
    }
    let logprobs = c.ask.logprobs.is_some();
    let job = Job {
        ask: c.ask,
        events: tx,
        slot,
    };
    let sent = app
        .jobs
        .lock()
        .map(|j| j.send(job).is_ok())
        .unwrap_or(false);
    // (A job that was not sent is dropped with its slot.)
    if !sent {
        return ApiError::server(
            StatusCode::SERVICE_UNAVAILABLE,
            "the model's worker has stopped",
        )
        .into_response();
    }
    // The first event says whether the prompt was taken (an error is still an HTTP error).
    let prompt_tokens = match rx.recv().await {
        Some(Event::Started {
            prompt_tokens,
            cached_tokens,
        }) => (prompt_tokens, cached_tokens),
        Some(Event::Failed(e)) => return e.into_response(),
        _ => return no_answer(),
    };
    let n = app.ids.fetch_add(1, Ordering::SeqCst);
    let id = match chat {
        true => format!("chatcmpl-{n}"),
        false => format!("cmpl-{n}"),
    };
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let shape = Shape {
        id,
        created,
        model: app.model_id.clone(),
        chat,
        logprobs,
        tokens: app.tokens.clone(),
    };
    if !c.stream {
        let mut text = String::new();
        let mut lps = Vec::new();
        loop {
            match rx.recv().await {
                Some(Event::Text(t, lp)) => {
                    text.push_str(&t);
                    lps.extend(lp);
                }
                Some(Event::Done {
                    finish,
                    completion_tokens,
                }) => {
                    let usage = usage(prompt_tokens, completion_tokens);
                    return Json(shape.whole(&text, &lps, finish, usage)).into_response();
                }
                Some(Event::Failed(e)) => return e.into_response(),
                Some(Event::Started { .. }) | None => return no_answer(),
            }
        }
    }
    let include_usage = c.include_usage;
    let stream = async_stream(rx, shape, prompt_tokens, include_usage);
    Sse::new(stream).into_response()
}

/// The worker dropped a request without its last event (it should not happen).
fn no_answer() -> Response {
    ApiError::server(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the worker ended the request without an answer",
    )
    .into_response()
}

/// What every answer of a request carries.
struct Shape {
    id: String,
    created: u64,
    model: String,
    chat: bool,
    /// Whether the request asked for log-probabilities.
    logprobs: bool,
    tokens: Arc<Vec<(String, Vec<u8>)>>,
}

impl Shape {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.chat, chunk) {
            (true, false) => "chat.completion",
            (true, true) => "chat.completion.chunk",
            (false, _) => "text_completion",
        }
    }

    fn head(&self, chunk: bool) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": concat!("doppler-", env!("CARGO_PKG_VERSION")),
        })
    }

    fn whole(&self, text: &str, lps: &[TokenLogprob], finish: &str, usage: Value) -> Value {
        let mut v = self.head(false);
        let logprobs = self.logprobs_json(lps, 0);
        v["choices"] = match self.chat {
            true => json!([{ "index": 0, "message": { "role": "assistant", "content": text },
                "logprobs": logprobs, "finish_reason": finish }]),
            false => json!([{ "index": 0, "text": text, "logprobs": logprobs,
                "finish_reason": finish }]),
        };
        v["usage"] = usage;
        v
    }

    /// A token's text and bytes.
    fn token(&self, id: u32) -> (&str, &[u8]) {
        self.tokens
            .get(id as usize)
            .map_or(("", &[][..]), |(t, b)| (t.as_str(), b.as_slice()))
    }

    /// Log-probabilities in the endpoint's shape (null unless asked for): chat's
    /// `{"content": [{token, logprob, bytes, top_logprobs}]}`, or text completions'
    /// `{tokens, token_logprobs, top_logprobs, text_offset}`, offsets in characters from
    /// `offset` characters into the answer (as OpenAI and vLLM count them: each token's
    /// text's characters). -inf (a banned token) is written -9999 as OpenAI does.
    fn logprobs_json(&self, lps: &[TokenLogprob], offset: usize) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        let lp = |x: f32| x.max(-9999.0);
        if self.chat {
            let content: Vec<Value> = lps
                .iter()
                .map(|e| {
                    let (t, b) = self.token(e.id);
                    let top: Vec<Value> = e
                        .top
                        .iter()
                        .map(|&(id, l)| {
                            let (t, b) = self.token(id);
                            json!({ "token": t, "logprob": lp(l), "bytes": b })
                        })
                        .collect();
                    json!({ "token": t, "logprob": lp(e.logprob), "bytes": b, "top_logprobs": top })
                })
                .collect();
            return json!({ "content": content, "refusal": null });
        }
        let mut at = offset;
        let mut tokens = Vec::new();
        let mut token_logprobs = Vec::new();
        let mut top = Vec::new();
        let mut offsets = Vec::new();
        for e in lps {
            let (t, b) = self.token(e.id);
            tokens.push(json!(t));
            token_logprobs.push(json!(lp(e.logprob)));
            let mut m = serde_json::Map::new();
            for &(id, l) in &e.top {
                m.entry(self.token(id).0.to_string())
                    .or_insert(json!(lp(l)));
            }
            top.push(Value::Object(m));
            offsets.push(json!(at));
            // The characters this token starts (a character split over byte-level
            // tokens counts once, at its first byte).
            at += b.iter().filter(|&&x| x & 0xC0 != 0x80).count();
        }
        json!({ "tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets })
    }

    /// A chunk of text (chat: a delta; `first` also carries the role), or the last one
    /// with its finish reason.
    fn chunk(
        &self,
        text: Option<&str>,
        first: bool,
        finish: Option<&str>,
        logprobs: Value,
    ) -> Value {
        let mut v = self.head(true);
        let choice = match self.chat {
            true => {
                let mut delta = json!({});
                if first {
                    delta["role"] = "assistant".into();
                }
                if let Some(t) = text {
                    delta["content"] = t.into();
                }
                json!({ "index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish })
            }
            false => json!({ "index": 0, "text": text.unwrap_or(""), "logprobs": logprobs,
                "finish_reason": finish }),
        };
        v["choices"] = json!([choice]);
        v
    }
}

/// OpenAI's usage object; `prompt` is (prompt tokens, of which cached).
fn usage((prompt, cached): (usize, usize), completion: usize) -> Value {
    json!({ "prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": { "cached_tokens": cached } })
}

/// The SSE stream of a request: a first chunk (chat: the role), one chunk a piece of text,
/// the last with the finish reason, the usage when asked for, then `[DONE]`. An error
/// after the first chunk is sent as an error object in the stream (OpenAI's way).
fn async_stream(
    rx: tmpsc::UnboundedReceiver<Event>,
    shape: Shape,
    prompt_tokens: (usize, usize),
    include_usage: bool,
) -> impl futures_util::Stream<Item = Result<SseEvent, std::convert::Infallible>> {
    struct St {
        rx: tmpsc::UnboundedReceiver<Event>,
        shape: Shape,
        prompt_tokens: (usize, usize),
        include_usage: bool,
        first: bool,
        pending: std::collections::VecDeque<String>,
        ended: bool,
        /// Characters of text sent (text completions' logprob offsets).
        sent: usize,
    }
    let st = St {
        rx,
        shape,
        prompt_tokens,
        include_usage,
        sent: 0,
        first: true,
        pending: Default::default(),
        ended: false,
    };
    futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(data) = st.pending.pop_front() {
                return Some((Ok(SseEvent::default().data(data)), st));
            }
            if st.ended {
                return None;
            }
            if st.first && st.shape.chat {
                st.first = false;
                let c = st.shape.chunk(Some(""), true, None, Value::Null);
                st.pending.push_back(c.to_string());
                continue;
            }
            match st.rx.recv().await {
                Some(Event::Text(t, lp)) => {
                    let lps = st.shape.logprobs_json(&lp, st.sent);
                    st.sent += t.chars().count();
                    let c = st.shape.chunk(Some(&t), false, None, lps);
                    st.pending.push_back(c.to_string());
                }
                Some(Event::Done {
                    finish,
                    completion_tokens,
                }) => {
                    let c = st.shape.chunk(None, false, Some(finish), Value::Null);
                    st.pending.push_back(c.to_string());
                    if st.include_usage {
                        let mut u = st.shape.head(true);
                        u["choices"] = json!([]);
                        u["usage"] = usage(st.prompt_tokens, completion_tokens);
                        st.pending.push_back(u.to_string());
                    }
                    st.pending.push_back("[DONE]".into());
                    st.ended = true;
                }
                Some(Event::Failed(e)) => {
                    st.pending.push_back(e.body().to_string());
                    st.pending.push_back("[DONE]".into());
                    st.ended = true;
                }
                Some(Event::Started { .. }) => {}
                None => {
                    st.ended = true;
                }
            }
        }
    })
}

/// A place among the requests taken (the one running and those waiting): given back when
/// dropped, which the worker does before a request's last event, so that a client that
/// sends its next request as soon as it has the answer finds the place free.
struct Slot(Arc<Stats>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One request on the worker ([`generate_job`]), its place given back and the model
/// marked idle before its last event goes out.
fn run_job(
    gpu: &Gpu,
    model: &Model,
    session: &mut Session<'_>,
    job: Job,
    stats: &Stats,
    trie: &mut Option<Arc<TokenTrie>>,
) {
    let Job { ask, events, slot } = job;
    stats.active.store(1, Ordering::SeqCst);
    // A client that left while its request waited costs nothing more.
    let last = match events.is_closed() {
        true => None,
        false => generate_job(gpu, model, session, ask, &events, stats, trie),
    };
    drop(slot);
    stats.kv_tokens.store(0, Ordering::SeqCst);
    stats.active.store(0, Ordering::SeqCst);
    if let Some(ev) = last {
        let _ = events.send(ev);
    }
}

/// What a request asks the model for.
struct Ask {
    prompt: Prompt,
    max_tokens: Option<usize>,
    sampler: SamplerConfig,
    stop: Vec<String>,
    /// Some(n): each token's log-probability and the n most likely.
    logprobs: Option<usize>,
    grammar: Option<Arc<Grammar>>,
}

/// `text` as the model's token ids (`special`: special tokens' text as those tokens).
fn tokenize(model: &Model, text: &str, special: bool, param: &str) -> Result<Vec<u32>, ApiError> {
    model
        .prompt_ids(text, special, true)
        .map_err(|e| ApiError::bad(param, format!("tokenizing the prompt: {e}")))
}

/// A request's prompt rendered (chat template) and tokenized, checked against the context
/// `ctx`: its token ids and how many tokens it may generate.
fn prepare(model: &Model, ask: &Ask, ctx: usize) -> Result<(Vec<u32>, usize), ApiError> {
    let vocab = model.llama.cfg.vocab_size;
    let (mut ids, param) = match &ask.prompt {
        Prompt::Tokens(given) => {
            let mut ids = Vec::with_capacity(given.len());
            for &t in given {
                if t < 0 || t as u64 >= vocab as u64 {
                    return Err(ApiError::bad(
                        "prompt",
                        format!("prompt: token id {t} is not in the model's vocabulary of {vocab}"),
                    ));
                }
                ids.push(t as u32);
            }
            (ids, "prompt")
        }
        Prompt::Chat(msgs) => match &model.template {
            Some(t) => (
                tokenize(model, &t.render(msgs, true), true, "messages")?,
                "messages",
            ),
            None => return Err(ApiError::bad("messages", "this model has no chat template")),
        },
        Prompt::Text(t) => (tokenize(model, t, false, "prompt")?, "prompt"),
    };
    if ids.is_empty() {
        ids.extend(model.tokenizer.bos.or(model.tokenizer.eos));
    }
    if ids.is_empty() {
        return Err(ApiError::bad(
            param,
            format!("{param}: empty, and this model has no BOS or EOS token to start from"),
        ));
    }
    if let Some(&t) = ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad(
            param,
            format!("{param}: token {t} is past the model's vocabulary of {vocab}"),
        ));
    }
    let room = ctx.saturating_sub(ids.len());
    let too_long = |message: String, param: &str| ApiError {
        status: StatusCode::BAD_REQUEST,
        message,
        kind: "invalid_request_error",
        param: Some(param.into()),
        code: Some("context_length_exceeded"),
    };
    if room == 0 {
        return Err(too_long(
            format!(
                "the prompt's {} tokens fill this server's context of {ctx} tokens: nothing left to generate",
                ids.len(),
            ),
            param,
        ));
    }
    if let Some(m) = ask.max_tokens {
        if ids.len() + m > ctx {
            return Err(too_long(
                format!(
                    "the prompt's {} tokens and max_tokens {m} exceed this server's context of {ctx} tokens",
                    ids.len(),
                ),
                "max_tokens",
            ));
        }
    }
    Ok((ids, ask.max_tokens.unwrap_or(room).min(room)))
}

/// The prompt rendered and checked against the context, then the generation from an empty
/// cache, each certain piece of text sent as it comes: the request's last event (Done or
/// Failed), None when its client went away (a send that fails ends the generation).
fn generate_job(
    gpu: &Gpu,
    model: &Model,
    session: &mut Session<'_>,
    ask: Ask,
    events: &tmpsc::UnboundedSender<Event>,
    stats: &Stats,
    trie: &mut Option<Arc<TokenTrie>>,
) -> Option<Event> {
    let fail = |e: ApiError| Some(Event::Failed(e));
    session.reset();
    let (ids, max_tokens) = match prepare(model, &ask, session.capacity()) {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let started = Event::Started {
        prompt_tokens: ids.len(),
        cached_tokens: 0,
    };
    events.send(started).ok()?;
    stats.kv_tokens.store(ids.len(), Ordering::SeqCst);
    let opts = GenOptions {
        max_tokens,
        stop_tokens: model.stop_tokens(),
        stop_strings: ask.stop,
    };
    let mut sampler = make_sampler(
        model,
        ask.sampler,
        ask.logprobs,
        ask.grammar,
        &opts.stop_tokens,
        trie,
    );
    let t0 = Instant::now();
    let result = session.generate_pieces(gpu, &ids, &opts, &mut sampler, &mut |piece| {
        events
            .send(Event::Text(piece.text.to_string(), piece.logprobs.to_vec()))
            .map_err(|_| Error::Invalid {
                op: "serve",
                detail: "the client went away".into(),
            })
    });
    stats.requests.fetch_add(1, Ordering::SeqCst);
    stats
        .prompt_tokens
        .fetch_add(ids.len() as u64, Ordering::SeqCst);
    match result {
        Ok(g) => {
            stats
                .completion_tokens
                .fetch_add(g.tokens.len() as u64, Ordering::SeqCst);
            stats
                .decode_tok_s
                .store(g.decode_tok_s().to_bits(), Ordering::SeqCst);
            let finish = match g.stop {
                StopReason::Token | StopReason::String => "stop",
                StopReason::Length | StopReason::Context => "length",
            };
            // The stop token counts, as every sampled one does.
            let completion_tokens = g.tokens.len() + (g.stop == StopReason::Token) as usize;
            tracing::info!(
                "{} prompt + {} generated tokens in {:.0} ms ({finish})",
                ids.len(),
                g.tokens.len(),
                t0.elapsed().as_secs_f64() * 1e3
            );
            Some(Event::Done {
                finish,
                completion_tokens,
            })
        }
        Err(_) if events.is_closed() => {
            tracing::info!("request cancelled: the client went away");
            None
        }
        Err(e) => fail(ApiError::server(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("generation failed: {e}"),
        )),
    }
}

/// Rows of prompts a batched step takes at most (beside one row per decoding request):
/// longer prompts run in chunks, so that the others keep decoding meanwhile.
const STEP_PROMPT_ROWS: usize = 512;

/// A request the batched worker is generating.
struct Running {
    seq: SeqId,
    events: tmpsc::UnboundedSender<Event>,
    slot: Slot,
    /// (None only while the sampling pool has it.)
    sampler: Option<Sampler>,
    /// Tokens still to run: what is left of the prompt, or the last token chosen.
    todo: Vec<u32>,
    stream: TextStream,
    stop_tokens: Vec<u32>,
    max_tokens: usize,
    prompt_tokens: usize,
    /// Of those, tokens whose pages came from the prefix cache.
    cached_tokens: usize,
    started: Instant,
    /// The token chosen last where the request ended on it (its row in the next step).
    last_pick: Option<u32>,
}

/// Why a running request ends.
enum End {
    Finished(&'static str, usize),
    /// The client went away.
    Gone,
    Failed(ApiError),
}

/// The continuous-batching worker: takes waiting requests while fewer than `parallel` run
/// (each with its sampler and text stream), then steps every running one together (a
/// chunk of a prompt, or the token chosen last), samples each whose row was its last,
/// streams its text, and ends those that stop, reach their length or lose their client,
/// giving their pages back. Blocks on the queue when nothing runs.
///
/// Steps overlap the host's work. While the GPU runs a step, the worker takes new
/// requests and prepares the next step. Where no running request is due a token the host
/// chooses in the running step (those due one choose on the GPU, [`Sampler::gpu_pickable`]:
/// greedy, or a plain draw), the next step is chained on it ([`Batch::record_chained`] /
/// [`Batch::submit_chained`]): the tokens of those due are that step's choices, copied on
/// the GPU, the others' rows (a prompt's chunk) known, and it is submitted at once, so two
/// steps are in flight and the GPU goes from one to the next without waiting for the host
/// (a chained step is recorded whole, prompt rows included). Otherwise, where the next step will be one of
/// decoding rows only, it is recorded ([`Batch::record_picking`]) for the rows the
/// requests will need (each decoding request's next token unless it reaches its length)
/// and submitted once this step's tokens are chosen (on the GPU for plain samplers; from
/// the logits on the host for the others) with them ([`Batch::submit_picking`]). (A step
/// with a prompt's chunk is recorded once its tokens are known, and submitted in parts as
/// it records.) A request that ends on what nobody could foresee (a stop token or string,
/// its client gone) still has its row in the next step: the row runs once more, its output
/// unused (no other row's result depends on it). Its pages go back at once when that step
/// is already submitted (later steps run after it on the GPU), else after that step.
/// Where the recorded rows are not what the requests need, the step is recorded again.
#[allow(clippy::too_many_arguments)]
fn batch_loop(
    gpu: &Gpu,
    model: &Model,
    mut batch: Batch<'_>,
    rx: mpsc::Receiver<Job>,
    stats: &Stats,
    parallel: usize,
    ctx: usize,
    trie: &mut Option<Arc<TokenTrie>>,
) {
    let tk = &model.tokenizer;
    let mut waiting = std::collections::VecDeque::new();
    let mut running: Vec<Running> = Vec::new();
    // Steps submitted and not yet waited for, oldest first (two where one is chained).
    let mut sent: std::collections::VecDeque<Sent> = std::collections::VecDeque::new();
    // The next step, recorded (not submitted) while the GPU ran the last one.
    let mut ahead: Option<Ahead<'_>> = None;
    // Ended requests the recorded step has rows for: (sequence, the tokens of its rows).
    let mut zombies: Vec<(SeqId, Vec<u32>)> = Vec::new();
    let pool = SamplingPool::new();
    let admit = |waiting: &mut std::collections::VecDeque<Job>,
                 running: &mut Vec<Running>,
                 batch: &mut Batch<'_>,
                 trie: &mut Option<Arc<TokenTrie>>| {
        while let Ok(j) = rx.try_recv() {
            waiting.push_back(j);
        }
        // Requests whose client left while waiting give their places back now.
        waiting.retain(|j: &Job| !j.events.is_closed());
        while running.len() < parallel {
            let Some(job) = waiting.pop_front() else {
                break;
            };
            if let Some(r) = start(model, batch, job, ctx, trie) {
                running.push(r);
            }
        }
    };
    // Every running request ended with a server error.
    let fail_all = |running: &[Running], e: &doppler::Error| -> Vec<(usize, End)> {
        tracing::error!("batched step failed: {e}");
        (0..running.len())
            .map(|i| {
                let err = ApiError::server(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("generation failed: {e}"),
                );
                (i, End::Failed(err))
            })
            .collect()
    };
    loop {
        let t0 = Instant::now();
        let mut ends: Vec<(usize, End)> = Vec::new();
        if sent.is_empty() {
            if ahead.is_none() {
                if running.is_empty() && waiting.is_empty() {
                    match rx.recv() {
                        Ok(j) => waiting.push_back(j),
                        Err(_) => return,
                    }
                }
                admit(&mut waiting, &mut running, &mut batch, trie);
            }
            stats.active.store(running.len(), Ordering::SeqCst);
            if running.is_empty() {
                ahead = None;
                for (seq, _) in zombies.drain(..) {
                    batch.remove(seq);
                }
                continue;
            }
            // This step's rows: the recorded step's where they are what the requests need
            // (in its order, with its rows of ended requests), else recorded now.
            let take = step_rows(running.iter().map(|r| r.todo.len()));
            let fed = ahead
                .take()
                .and_then(|a| ahead_feeds(&a, &running, &take, &zombies).map(|f| (a, f)));
            let (ahead_now, feeds) = match fed {
                Some((a, f)) => (Some(a), f),
                None => {
                    for (seq, _) in zombies.drain(..) {
                        batch.remove(seq);
                    }
                    let feeds: Vec<(SeqId, Vec<u32>)> = running
                        .iter()
                        .zip(&take)
                        .filter(|(_, &n)| n > 0)
                        .map(|(r, &n)| (r.seq, r.todo[..n].to_vec()))
                        .collect();
                    (None, feeds)
                }
            };
            let feed_refs: Vec<(SeqId, &[u32])> =
                feeds.iter().map(|(id, t)| (*id, t.as_slice())).collect();
            // (Recorded now, the tokens known: a prompt's long step starts on the GPU as
            // it records.)
            let recorded = match ahead_now {
                Some(a) => Ok(a),
                None => {
                    let host = host_rows(&running, feeds.iter().map(|f| f.0));
                    batch.record_tokens_picking(gpu, &feed_refs, &host)
                }
            };
            let drains: Vec<(SeqId, usize)> = feeds.iter().map(|(id, t)| (*id, t.len())).collect();
            let result = recorded.and_then(|a| {
                let picks = row_picks(&mut running, &drains, a.host_rows().unwrap_or(&[]));
                batch.submit_picking(gpu, a, &feed_refs, &picks)
            });
            // The ended requests this step runs rows for: their pages go back after it.
            let spent: Vec<SeqId> = zombies.drain(..).map(|z| z.0).collect();
            match result {
                Ok(flight) => {
                    stats.steps.fetch_add(1, Ordering::SeqCst);
                    sent.push_back(Sent {
                        flight,
                        due: take_pending(&mut running, &drains),
                        feeds: drains,
                        spent,
                    });
                }
                Err(e) => {
                    for seq in spent {
                        batch.remove(seq);
                    }
                    ends = fail_all(&running, &e);
                }
            }
        }
        if sent.len() == 1 {
            // While the GPU runs the step: new requests, then the next step chained on it,
            // or recorded to be submitted once its tokens are chosen.
            admit(&mut waiting, &mut running, &mut batch, trie);
            let last = &sent[0];
            let rows = step_rows(next_rows(&running, last, &batch, ctx).into_iter());
            let plan: Vec<(SeqId, usize)> = running
                .iter()
                .zip(&rows)
                .filter(|(_, &n)| n > 0)
                .map(|(r, &n)| (r.seq, n))
                .collect();
            let chained = match chain_plan(&running, last, &rows) {
                None => None,
                Some((seqs, known)) => {
                    let known_refs: Vec<(SeqId, &[u32])> =
                        known.iter().map(|(id, t)| (*id, t.as_slice())).collect();
                    let host = host_rows(&running, known.iter().map(|k| k.0));
                    // Pending tokens each row takes (none for a chained row).
                    let drains: Vec<(SeqId, usize)> = seqs
                        .iter()
                        .map(|&id| (id, 0))
                        .chain(known.iter().map(|(id, t)| (*id, t.len())))
                        .collect();
                    match batch.record_chained(gpu, &last.flight, &seqs, &known_refs, &host) {
                        Ok(a) => {
                            // (The draws' random numbers are taken only once the step is
                            // recorded: they are the requests' next, as unchained.)
                            let mut flags = vec![false; seqs.len()];
                            flags.extend_from_slice(&host);
                            let picks = row_picks(&mut running, &drains, &flags);
                            match batch.submit_chained(gpu, a, &picks) {
                                Ok(flight) => Some(Sent {
                                    flight,
                                    due: take_pending(&mut running, &drains),
                                    feeds: drains.iter().map(|&(id, n)| (id, n.max(1))).collect(),
                                    spent: Vec::new(),
                                }),
                                Err(e) => {
                                    // (Its draws are spent: the requests cannot go on as
                                    // they would have.)
                                    ends = fail_all(&running, &e);
                                    None
                                }
                            }
                        }
                        Err(e) => {
                            tracing::debug!("the next step was not chained: {e}");
                            None
                        }
                    }
                }
            };
            match chained {
                Some(s) => {
                    stats.steps.fetch_add(1, Ordering::SeqCst);
                    stats.chained_steps.fetch_add(1, Ordering::SeqCst);
                    sent.push_back(s)
                }
                // Only steps of one row a request (decoding) are recorded ahead: a
                // prompt's chunk recorded whole, beside the running step's temporaries,
                // would hold two steps' worth of its activations at once; it is recorded
                // when its tokens are known, submitted in parts as it records.
                None if ends.is_empty()
                    && !plan.is_empty()
                    && plan.iter().all(|&(_, n)| n == 1) =>
                {
                    let host = host_rows(&running, plan.iter().map(|p| p.0));
                    match batch.record_picking(gpu, &plan, &host) {
                        Ok(a) => ahead = Some(a),
                        Err(e) => tracing::debug!("the next step was not recorded ahead: {e}"),
                    }
                }
                None => {}
            }
        }
        // The oldest step's outcome.
        let (mut rows, mut n_chosen) = (0, 0);
        if let Some(w) = sent.pop_front() {
            rows = w.feeds.iter().map(|f| f.1).sum();
            let result = pollster::block_on(batch.wait_chosen(gpu, w.flight));
            for seq in w.spent {
                batch.remove(seq);
            }
            match result {
                Ok(mut chosen) if ends.is_empty() => {
                    // The requests due a token in it: (index in running, row in chosen).
                    let due: Vec<(usize, usize)> = w
                        .feeds
                        .iter()
                        .enumerate()
                        .filter(|(_, (id, _))| w.due.contains(id))
                        .filter_map(|(li, (id, _))| {
                            running.iter().position(|r| r.seq == *id).map(|i| (i, li))
                        })
                        .collect();
                    let picks = sample_rows(&pool, &mut running, &due, &mut chosen);
                    n_chosen = picks.len();
                    // Sequences whose next token the step still in flight already runs.
                    let fed = |seq: SeqId| sent.front().is_some_and(|s| s.due.contains(&seq));
                    for (&(i, _), (next, logprob)) in due.iter().zip(picks) {
                        let r = &mut running[i];
                        if r.stop_tokens.contains(&next) {
                            // The stop token counts, as every sampled one does.
                            ends.push((i, End::Finished("stop", r.stream.tokens().len() + 1)));
                            r.last_pick = Some(next);
                            continue;
                        }
                        let events = &r.events;
                        let pushed = r.stream.push(tk, next, logprob, &mut |p| {
                            events
                                .send(Event::Text(p.text.to_string(), p.logprobs.to_vec()))
                                .map_err(|_| gone())
                        });
                        let n = r.stream.tokens().len();
                        // (Tokens held as of this step: not the one in flight after it.)
                        let held = batch.len(r.seq).unwrap_or(ctx) - fed(r.seq) as usize;
                        match pushed {
                            Err(_) => ends.push((i, End::Gone)),
                            Ok(true) => ends.push((i, End::Finished("stop", n))),
                            Ok(false) if n >= r.max_tokens || held + 1 > ctx => {
                                ends.push((i, End::Finished("length", n)))
                            }
                            Ok(false) => {
                                if !fed(r.seq) {
                                    r.todo.push(next);
                                }
                                continue;
                            }
                        }
                        r.last_pick = Some(next);
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    // (A step chained on it was undone with it: nothing of it to wait for.)
                    sent.clear();
                    ends = fail_all(&running, &e);
                }
            }
        }
        if n_chosen > 0 {
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            stats.decode_tok_s.store(
                (n_chosen as f64 / ms.max(1e-6) * 1e3).to_bits(),
                Ordering::SeqCst,
            );
            let t = batch.last_times();
            tracing::debug!(
                "step: {rows} rows, {n_chosen} sequences, {ms:.2} ms: submitting {:.2}, then to its outcome {:.2}; {}",
                t.submit_ms,
                t.wait_ms,
                match (&ahead, sent.front()) {
                    (_, Some(_)) => "the next step chained on it".to_string(),
                    (Some(a), None) => format!("the next step recorded meanwhile: {:.2}", a.record_ms()),
                    (None, None) => "no step ahead".to_string(),
                },
            );
        }
        // Requests whose client left while they ran.
        for (i, r) in running.iter().enumerate() {
            if r.events.is_closed() && !ends.iter().any(|e| e.0 == i) {
                ends.push((i, End::Gone));
            }
        }
        ends.sort_by_key(|e| std::cmp::Reverse(e.0));
        ends.dedup_by_key(|e| e.0);
        let mut ended = Vec::with_capacity(ends.len());
        for (i, end) in ends {
            let r = running.remove(i);
            // Its row in the recorded step, if any: the tokens it would have run.
            let row = ahead
                .as_ref()
                .and_then(|a| a.plan().find(|&(id, _)| id == r.seq))
                .map(|(_, n)| n);
            match row {
                Some(n) => {
                    let toks: Vec<u32> =
                        r.todo.iter().copied().chain(r.last_pick).take(n).collect();
                    if toks.len() == n {
                        zombies.push((r.seq, toks));
                    } else {
                        ahead = None;
                        batch.remove(r.seq);
                    }
                }
                // (A row in a step already submitted runs before anything later that
                // takes its pages.)
                None => batch.remove(r.seq),
            }
            ended.push((r, end));
        }
        if ahead.is_none() {
            for (seq, _) in zombies.drain(..) {
                batch.remove(seq);
            }
        }
        // The gauges before the ended requests' last events: a client that reads /metrics
        // once answered finds its request gone from them.
        let held: usize = running.iter().filter_map(|r| batch.len(r.seq)).sum();
        stats.kv_tokens.store(held, Ordering::SeqCst);
        stats.kv_pages.store(batch.pages_in_use(), Ordering::SeqCst);
        stats.active.store(running.len(), Ordering::SeqCst);
        for (r, end) in ended {
            finish(r, end, stats);
        }
    }
}

/// A step the worker submitted and has not yet waited for.
struct Sent {
    flight: InFlight,
    /// Its sequences in its order, with their rows.
    feeds: Vec<(SeqId, usize)>,
    /// The sequences whose row was their last pending token: a token is chosen for each.
    due: Vec<SeqId>,
    /// Ended requests' sequences it ran rows for: their pages go back after it.
    spent: Vec<SeqId>,
}

/// Rows each request runs in a step, from the tokens each has to run: one for each
/// decoding request (one token), then prompts' chunks from STEP_PROMPT_ROWS in order.
fn step_rows(todo: impl Iterator<Item = usize>) -> Vec<usize> {
    let todo: Vec<usize> = todo.collect();
    let mut budget = STEP_PROMPT_ROWS;
    let mut take: Vec<usize> = todo.iter().map(|&t| (t == 1) as usize).collect();
    for (i, &t) in todo.iter().enumerate() {
        if t > 1 && budget > 0 {
            take[i] = t.min(budget);
            budget -= take[i];
        }
    }
    take
}

/// The tokens each running request will have to run after the step `last` (submitted,
/// its rows taken off the requests' pending tokens): the rest of its prompt; one chosen
/// token where `last` chooses one for it, unless it then reaches its length (its stop
/// tokens and strings cannot be foreseen); none where its client has left.
fn next_rows(running: &[Running], last: &Sent, batch: &Batch<'_>, ctx: usize) -> Vec<usize> {
    running
        .iter()
        .map(|r| {
            if r.events.is_closed() {
                return 0; // (its client left: it ends after this step)
            }
            if !last.due.contains(&r.seq) {
                return r.todo.len();
            }
            // (batch.len already counts the step's tokens: they were submitted.)
            let ends = r.stream.tokens().len() + 1 >= r.max_tokens
                || batch.len(r.seq).unwrap_or(ctx) + 1 > ctx;
            (!ends) as usize
        })
        .collect()
}

/// The rows of a step chained on `last` ([`Batch::record_chained`]): the requests that go
/// on (`rows`: their rows in the next step, [`step_rows`] of their pending tokens after
/// `last`), those due the token `last` chooses on the GPU chained (one row each),
/// the others' rows known (the rest of a prompt, in chunks; a request just started). None
/// where one is due a token the host chooses in `last` (unknown until read back), or
/// where nothing goes on.
#[allow(clippy::type_complexity)]
fn chain_plan(
    running: &[Running],
    last: &Sent,
    rows: &[usize],
) -> Option<(Vec<SeqId>, Vec<(SeqId, Vec<u32>)>)> {
    let mut seqs = Vec::new();
    let mut known = Vec::new();
    for (r, &n) in running.iter().zip(rows) {
        if n == 0 {
            continue;
        }
        if last.due.contains(&r.seq) {
            let pickable = r.sampler.as_ref().is_some_and(|s| s.gpu_pickable());
            if n != 1 || !pickable {
                return None;
            }
            seqs.push(r.seq);
        } else {
            known.push((r.seq, r.todo.get(..n)?.to_vec()));
        }
    }
    (!seqs.is_empty() || !known.is_empty()).then_some((seqs, known))
}

/// The feeds of the recorded step `a` (in its order) where its rows are the ones the
/// running requests need (`take`) plus rows of ended ones (`zombies`), else None.
fn ahead_feeds(
    a: &Ahead<'_>,
    running: &[Running],
    take: &[usize],
    zombies: &[(SeqId, Vec<u32>)],
) -> Option<Vec<(SeqId, Vec<u32>)>> {
    let want: std::collections::HashMap<SeqId, &[u32]> = running
        .iter()
        .zip(take)
        .filter(|(_, &n)| n > 0)
        .map(|(r, &n)| (r.seq, &r.todo[..n]))
        .collect();
    let mut feeds = Vec::new();
    let mut found = 0;
    for (id, n) in a.plan() {
        let toks = match want.get(&id) {
            Some(t) => {
                found += 1;
                *t
            }
            None => zombies.iter().find(|z| z.0 == id)?.1.as_slice(),
        };
        if toks.len() != n {
            return None;
        }
        feeds.push((id, toks.to_vec()));
    }
    (found == want.len()).then_some(feeds)
}

/// For each sequence of a step (in its order), whether the host chooses its token (its
/// sampler is not one the GPU can run: log-probabilities, penalties, a grammar, a cut).
/// Rows of other sequences (ended requests') the GPU takes.
fn host_rows(running: &[Running], seqs: impl Iterator<Item = SeqId>) -> Vec<bool> {
    seqs.map(|id| {
        running
            .iter()
            .find(|r| r.seq == id)
            .and_then(|r| r.sampler.as_ref())
            .is_some_and(|s| !s.gpu_pickable())
    })
    .collect()
}

/// How the GPU chooses each row's token of a step (`drains`: each row's sequence and the
/// pending tokens it takes, 0 for a row chained on the step before; `host`: the rows the
/// host chooses, as recorded): a request whose row takes its last pending token (a token
/// will be chosen) from its sampler, which takes its random number now; any other row (a
/// prompt's chunk with more to come, an ended request's) greedily, its choice unused.
fn row_picks(running: &mut [Running], drains: &[(SeqId, usize)], host: &[bool]) -> Vec<Pick> {
    drains
        .iter()
        .enumerate()
        .map(|(k, &(id, n))| {
            if host.get(k).copied().unwrap_or(true) {
                return Pick::Host;
            }
            running
                .iter_mut()
                .find(|r| r.seq == id && r.todo.len() == n)
                .and_then(|r| r.sampler.as_mut())
                .and_then(|s| s.gpu_pick())
                .unwrap_or(Pick::Greedy)
        })
        .collect()
}

/// A submitted step's rows taken off their requests' pending tokens (`drains` as
/// [`row_picks`]'); the requests whose last pending token it runs, due a choice.
fn take_pending(running: &mut [Running], drains: &[(SeqId, usize)]) -> Vec<SeqId> {
    let mut due = Vec::new();
    for &(id, n) in drains {
        if let Some(r) = running.iter_mut().find(|r| r.seq == id) {
            r.todo.drain(..n);
            if r.todo.is_empty() {
                due.push(id);
            }
        }
    }
    due
}

/// The next token of each request in `due` (index in `running`, index in `chosen`, its
/// row) and its log-probability: the GPU's choice where it made it (handed to the sampler),
/// else sampled from the row's logits on the pool's threads when there are many (each
/// request's sampler is its own: the same choices whatever the threads).
fn sample_rows(
    pool: &SamplingPool,
    running: &mut [Running],
    due: &[(usize, usize)],
    chosen: &mut [Chosen],
) -> Vec<(u32, Option<TokenLogprob>)> {
    let mut out: Vec<Option<(u32, Option<TokenLogprob>)>> = vec![None; due.len()];
    let mut rows = Vec::new();
    let mut at = Vec::new();
    for (k, &(i, li)) in due.iter().enumerate() {
        match &mut chosen[li] {
            Chosen::Token(t) => {
                if let Some(s) = running[i].sampler.as_mut() {
                    s.accept(*t);
                }
                out[k] = Some((*t, None));
            }
            Chosen::Logits(l) => {
                let sampler = running[i].sampler.take().expect("a sampler between steps");
                // The tokens so far, as far back as the sampler looks (its repeat
                // penalty's window), not the whole text every step.
                let h = running[i].stream.tokens();
                let history = h[h.len().saturating_sub(sampler.cfg.repeat_last_n)..].to_vec();
                rows.push(Row {
                    sampler,
                    history,
                    logits: std::mem::take(l),
                });
                at.push(k);
            }
        }
    }
    for (k, p) in at.into_iter().zip(pool.sample(rows)) {
        running[due[k].0].sampler = Some(p.sampler);
        out[k] = Some((p.token, p.logprob));
    }
    out.into_iter()
        .map(|o| o.expect("every due row chosen"))
        .collect()
}

fn gone() -> Error {
    Error::Invalid {
        op: "serve",
        detail: "the client went away".into(),
    }
}

/// A waiting request into a running one: rendered, checked, a sequence for it (holding
/// the cached pages of its prompt's longest cached prefix, [`Batch::add_prefixed`]; only
/// the rest of the prompt runs), its `Started` event sent; None when it ended there (an
/// error answered, or its client gone).
fn start(
    model: &Model,
    batch: &mut Batch<'_>,
    job: Job,
    ctx: usize,
    trie: &mut Option<Arc<TokenTrie>>,
) -> Option<Running> {
    let Job { ask, events, slot } = job;
    if events.is_closed() {
        return None;
    }
    let (ids, max_tokens) = match prepare(model, &ask, ctx) {
        Ok(p) => p,
        Err(e) => {
            drop(slot);
            let _ = events.send(Event::Failed(e));
            return None;
        }
    };
    let stop_tokens = model.stop_tokens();
    let sampler = make_sampler(
        model,
        ask.sampler,
        ask.logprobs,
        ask.grammar,
        &stop_tokens,
        trie,
    );
    let (seq, cached) = batch.add_prefixed(&ids);
    let sent = events.send(Event::Started {
        prompt_tokens: ids.len(),
        cached_tokens: cached,
    });
    if sent.is_err() {
        batch.remove(seq);
        return None;
    }
    Some(Running {
        seq,
        events,
        slot,
        sampler: Some(sampler),
        prompt_tokens: ids.len(),
        cached_tokens: cached,
        todo: ids[cached..].to_vec(),
        stream: TextStream::new(ask.stop),
        stop_tokens,
        max_tokens,
        started: Instant::now(),
        last_pick: None,
    })
}

/// A request's sampler: its settings, log-probabilities when asked, its grammar.
fn make_sampler(
    model: &Model,
    cfg: SamplerConfig,
    logprobs: Option<usize>,
    grammar: Option<Arc<Grammar>>,
    stop_tokens: &[u32],
    trie: &mut Option<Arc<TokenTrie>>,
) -> Sampler {
    let mut sampler = Sampler::new(cfg);
    if let Some(n) = logprobs {
        sampler = sampler.with_logprobs(n);
    }
    if let Some(g) = grammar {
        // The vocabulary's trie: built for the first request that needs it.
        let trie = trie
            .get_or_insert_with(|| Arc::new(TokenTrie::new(&model.tokenizer)))
            .clone();
        let c = JsonConstraint::new(g, trie, stop_tokens.to_vec());
        sampler = sampler.with_constraint(Box::new(c));
    }
    sampler
}

/// A running request's end: the rest of its text, its place in the queue given back, then
/// its last event (the caller gives its pages back).
fn finish(r: Running, end: End, stats: &Stats) {
    let Running {
        events,
        slot,
        mut stream,
        prompt_tokens,
        cached_tokens,
        started,
        ..
    } = r;
    let last = match end {
        End::Gone => {
            tracing::info!("request cancelled: the client went away");
            None
        }
        End::Failed(e) => Some(Event::Failed(e)),
        End::Finished(finish, completion_tokens) => {
            let flushed = stream.finish(&mut |p| {
                events
                    .send(Event::Text(p.text.to_string(), p.logprobs.to_vec()))
                    .map_err(|_| gone())
            });
            stats.requests.fetch_add(1, Ordering::SeqCst);
            stats
                .prompt_tokens
                .fetch_add(prompt_tokens as u64, Ordering::SeqCst);
            stats
                .cached_tokens
                .fetch_add(cached_tokens as u64, Ordering::SeqCst);
            stats
                .completion_tokens
                .fetch_add(completion_tokens as u64, Ordering::SeqCst);
            tracing::info!(
                "{prompt_tokens} prompt + {} generated tokens in {:.0} ms ({finish})",
                stream.tokens().len(),
                started.elapsed().as_secs_f64() * 1e3
            );
            flushed.ok().map(|_| Event::Done {
                finish,
                completion_tokens,
            })
        }
    };
    drop(slot);
    if let Some(ev) = last {
        let _ = events.send(ev);
    }
}
