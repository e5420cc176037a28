//! `doppler bench generate`: model load, time to first token, prefill and decode speed of
//! a Llama-family model, batch 1, greedy. A model file, or synthetic weights of a preset's
//! shapes (random blocks of the file types; the speed does not depend on the values). The
//! prompt's time (TTFT, prefill tok/s) is the median of 5 prefills after a warm-up round.

use std::borrow::Cow;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use doppler::check::Rng;
use doppler::formats::gguf::{GgmlType, LocalFuture};
use doppler::gpu::{DType, Gpu, Tensor};
use doppler::infer::greedy::GreedyDecoder;
use doppler::models::llama::{Llama, LlamaConfig, Source, Stored};
use doppler::ops::reduce;
use doppler::ops::rope::Pairing;

/// What `bench generate` runs (from `doppler bench`'s arguments).
pub struct GenBenchArgs {
    pub model: Option<PathBuf>,
    pub preset: String,
    pub prompt: usize,
    pub gen: usize,
    pub json: bool,
    pub cache_type: crate::generate::CacheType,
    /// Row counts whose forward passes are timed too (`--rows`).
    pub rows: Vec<usize>,
    /// Numbers of sequences decoded together in continuous-batching steps (`--streams`).
    pub streams: Vec<usize>,
    /// `--streams`: every row sampled on the host from its logits, not on the GPU.
    pub host_sampling: bool,
}

pub(crate) struct Synthetic {
    pub(crate) cfg: LlamaConfig,
    embd: &'static str,
    block: &'static str,
    output: Option<&'static str>,
}

impl Synthetic {
    pub(crate) fn preset(name: &str) -> doppler::Result<Synthetic> {
        let base = |n_layer, n_embd, n_head, n_kv_head, ffn, vocab, theta| LlamaConfig {
            arch: "llama".into(),
            n_layer,
            n_embd,
            n_head,
            n_kv_head,
            head_dim: n_embd / n_head,
            ffn_hidden: ffn,
            vocab_size: vocab,
            norm_eps: 1e-5,
            rope_theta: theta,
            context_length: 8192,
            pairing: Pairing::Interleaved,
            rope_llama3: None,
            rope_linear: None,
            rope_long: None,
            sliding_window: None,
            sliding_layers: Vec::new(),
            rope_local_theta: None,
            attn_scale: None,
            final_softcap: None,
            norm_shift: 0.0,
            tied_embeddings: true,
        };
        match name {
            "smollm2-135m" => Ok(Synthetic {
                cfg: base(30, 576, 9, 3, 1536, 49152, 100000.0),
                embd: "Q8_0",
                block: "Q4_1",
                output: None,
            }),
            "llama3-8b-q4k" => {
                let mut cfg = base(32, 4096, 32, 8, 14336, 128256, 500000.0);
                cfg.tied_embeddings = false;
                Ok(Synthetic {
                    cfg,
                    embd: "Q4_K",
                    block: "Q4_K",
                    output: Some("Q6_K"),
                })
            }
            other => Err(doppler::Error::Invalid {
                op: "bench generate",
                detail: format!("unknown preset {other:?} (smollm2-135m, llama3-8b-q4k)"),
            }),
        }
    }

    fn dims(&self, name: &str) -> Option<(Vec<u64>, &'static str)> {
        let c = &self.cfg;
        let (e, f, q, kv) = (
            c.n_embd as u64,
            c.ffn_hidden as u64,
            (c.n_head * c.head_dim) as u64,
            (c.n_kv_head * c.head_dim) as u64,
        );
        match name {
            "token_embd.weight" => return Some((vec![e, c.vocab_size as u64], self.embd)),
            "output.weight" => return self.output.map(|t| (vec![e, c.vocab_size as u64], t)),
            "output_norm.weight" => return Some((vec![e], "F32")),
            _ => {}
        }
        let what = name.strip_prefix("blk.")?.split_once('.')?.1;
        Some(match what {
            "attn_norm.weight" | "ffn_norm.weight" => (vec![e], "F32"),
            "attn_q.weight" => (vec![e, q], self.block),
            "attn_k.weight" | "attn_v.weight" => (vec![e, kv], self.block),
            "attn_output.weight" => (vec![q, e], self.block),
            "ffn_gate.weight" | "ffn_up.weight" => (vec![e, f], self.block),
            "ffn_down.weight" => (vec![f, e], self.block),
            _ => return None,
        })
    }
}

impl Source for Synthetic {
    fn path(&self) -> &str {
        "synthetic"
    }
    fn has(&self, name: &str) -> bool {
        self.dims(name).is_some()
    }
    fn tensor<'a>(&'a self, name: &'a str) -> LocalFuture<'a, doppler::Result<Option<Stored<'a>>>> {
        Box::pin(std::future::ready(self.make(name)))
    }
}

impl Synthetic {
    /// The tensor's made-up bytes.
    fn make(&self, name: &str) -> doppler::Result<Option<Stored<'static>>> {
        let Some((dims, tyname)) = self.dims(name) else {
            return Ok(None);
        };
        let ty = GgmlType::from_name(tyname).expect("known type");
        let n: u64 = dims.iter().product();
        if tyname == "F32" {
            let v: Vec<u8> = (0..n).flat_map(|_| 1.0f32.to_le_bytes()).collect();
            return Ok(Some(Stored {
                bytes: Cow::Owned(v),
                ty,
                dims,
            }));
        }
        let (per, bytes) = ty.block().expect("block type");
        let mut raw = vec![0u8; (n / per * bytes) as usize];
        let mut rng = Rng::new(n ^ name.len() as u64);
        for c in raw.chunks_mut(8) {
            let r = rng.next_u64().to_le_bytes();
            c.copy_from_slice(&r[..c.len()]);
        }
        let scale = [0x1Fu8, 0x21]; // f16 0.01
        for b in raw.chunks_exact_mut(bytes as usize) {
            for &off in doppler::verify::quant::scale_offsets(tyname) {
                b[off..off + 2].copy_from_slice(&scale);
            }
        }
        Ok(Some(Stored {
            bytes: Cow::Owned(raw),
            ty,
            dims,
        }))
    }
}

/// Prefills timed for the median.
const PREFILL_RUNS: usize = 5;
/// Timed runs of the decode floor's chain (after one to warm up).
const FLOOR_RUNS: usize = 10;
/// Timed forward passes of each `--rows` count (after one to warm up).
const ROWS_RUNS: usize = 5;
/// Decode steps (and runs of the floor's chain) profiled dispatch by dispatch.
const PROFILED_STEPS: usize = 4;

/// One timed prefill and greedy decode (`run`'s `round`).
struct Round {
    prefill_ms: f64,
    per_token: Vec<f64>,
    cpu_ms: f64,
    /// Bind groups built during the decode.
    built: u64,
    /// Its host times and dispatch count.
    dec: GreedyDecoder,
}

/// User + system CPU seconds of this process so far (Linux; 0 elsewhere).
fn cpu_seconds() -> f64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    let Some(rest) = s.rsplit(')').next() else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 (utime, stime) are at 11 and 12 after the command name.
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

fn pct(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(((s.len() as f64 - 1.0) * p).round() as usize)
        .copied()
        .unwrap_or(0.0)
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

fn mix_bits(mut h: u64, v: &[f32]) -> u64 {
    for x in v {
        for b in x.to_bits().to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

/// Decode steps timed per `--streams` count.
const STREAM_STEPS: usize = 24;
/// Chained steps timed on the GPU whole after them.
const TIMED_STEPS: usize = 8;

/// `n` sequences decoded together as `doppler serve` runs them (`infer::batch`): each
/// prefilled with its own prompt of `--prompt` tokens (a sequence a step, 512 rows at a
/// time), then STREAM_STEPS steps of one row each, every row's token sampled at
/// temperature 0.8 from its own seed (the plain draw over the whole vocabulary, OpenAI's
/// defaults otherwise) on the GPU as `serve` samples such requests (`--host-sampling`: on
/// the sampling threads from each row's logits), as `serve` runs them: chained (each
/// step's tokens copied on the GPU from the choices of the step before, and the step
/// submitted while that one runs), or with host sampling pipelined (the next step recorded
/// while the GPU runs one). Host times per step (the whole step; recording the next,
/// overlapped; submission to tokens or logits, which for a chained step includes the
/// step before's GPU time; sampling or taking the GPU's tokens), the chained steps again
/// each timed on the GPU whole (its time there, sampling included, and the GPU's idle time
/// until the next one starts), then a few steps (not pipelined) timed on the GPU whole and
/// one dispatch by dispatch.
fn streams(
    gpu: &Gpu,
    llama: &Llama,
    args: &GenBenchArgs,
    n: usize,
) -> doppler::Result<serde_json::Value> {
    use doppler::infer::batch::{Batch, Chosen, StepTiming};
    use doppler::infer::sample::{Row, Sampler, SamplerConfig, SamplingPool};
    use doppler::ops::sample::Pick;
    let v = llama.cfg.vocab_size;
    let whole = 4;
    let per_seq = args.prompt + STREAM_STEPS + TIMED_STEPS + whole + 4;
    let pages = n * per_seq.div_ceil(doppler::ops::kvcache::PAGE);
    let mut b = Batch::new(gpu, llama, pages, args.cache_type.kv_type(gpu))?;
    let mut seqs = Vec::new();
    let mut samplers = Vec::new();
    let mut hist: Vec<Vec<u32>> = Vec::new();
    // FNV-1a over the bits of every prompt's last logits and the first step's: the same
    // figure from two builds means the same bits.
    let mut check = 0xcbf2_9ce4_8422_2325u64;
    for s in 0..n {
        let id = b.add();
        let prompt: Vec<u32> = (0..args.prompt.max(1))
            .map(|i| ((i * 7919 + s * 104_729) % v) as u32)
            .collect();
        let mut last = Vec::new();
        for chunk in prompt.chunks(doppler::infer::PREFILL_CHUNK) {
            last = b.step(gpu, &[(id, chunk)])?.pop().unwrap_or_default();
        }
        check = mix_bits(check, &last);
        let mut sampler = Sampler::new(SamplerConfig {
            temperature: 0.8,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: s as u64,
            ..Default::default()
        });
        let first = sampler.sample(&last, &prompt);
        seqs.push(id);
        samplers.push(sampler);
        hist.push(vec![first]);
    }
    // Each sequence's last token as its feed.
    let feeds_of = |hist: &[Vec<u32>]| -> Vec<(u64, [u32; 1])> {
        seqs.iter()
            .zip(hist)
            .map(|(&id, h)| (id, [*h.last().expect("a token")]))
            .collect()
    };
    // Each row's token chosen from its logits; the sampling's ms.
    let pool = SamplingPool::new();
    let choose = |samplers: &mut Vec<Sampler>, hist: &mut Vec<Vec<u32>>, logits: Vec<Vec<f32>>| {
        let t1 = Instant::now();
        let rows = samplers
            .drain(..)
            .zip(hist.drain(..))
            .zip(logits)
            .map(|((sampler, history), logits)| Row {
                sampler,
                history,
                logits,
            })
            .collect();
        for p in pool.sample(rows) {
            samplers.push(p.sampler);
            let mut h = p.history;
            h.push(p.token);
            hist.push(h);
        }
        t1.elapsed().as_secs_f64() * 1e3
    };
    // A step recorded, run and waited for in one (not pipelined), then its rows sampled;
    // its logits' bits mixed into `check` when given.
    let step = |b: &mut Batch<'_>,
                timing: StepTiming,
                samplers: &mut Vec<Sampler>,
                hist: &mut Vec<Vec<u32>>,
                check: Option<&mut u64>|
     -> doppler::Result<()> {
        b.set_timing(timing);
        let feeds = feeds_of(hist);
        let feeds: Vec<(u64, &[u32])> = feeds.iter().map(|(id, t)| (*id, t.as_slice())).collect();
        let logits = b.step(gpu, &feeds)?;
        if let Some(c) = check {
            for l in &logits {
                *c = mix_bits(*c, l);
            }
        }
        choose(samplers, hist, logits);
        Ok(())
    };
    step(
        &mut b,
        StepTiming::Off,
        &mut samplers,
        &mut hist,
        Some(&mut check),
    )?;
    // Pipelined as serve runs them: the next step recorded while the GPU runs this one.
    let plan: Vec<(u64, usize)> = seqs.iter().map(|&id| (id, 1)).collect();
    let host = vec![args.host_sampling; n];
    let (mut total, mut record, mut wait, mut sample) = (vec![], vec![], vec![], vec![]);
    let mut submit = vec![];
    // The pipelined steps' tokens, hashed: the same figure from two builds (and with
    // --host-sampling or not) means the same choices.
    let mut piped = 0xcbf2_9ce4_8422_2325u64;
    // The chained steps again, each timed on the GPU whole: its time there, and the GPU's
    // idle time from its end to the next one's start.
    let (mut chained_gpu, mut chained_gap) = (vec![], vec![]);
    let passes: &[bool] = if args.host_sampling {
        &[]
    } else {
        &[false, true]
    };
    for &timed in passes {
        b.set_timing(match timed {
            true => StepTiming::Whole,
            false => StepTiming::Off,
        });
        let mut last_end: Option<f64> = None;
        // Chained as serve runs them: each step's tokens are the choices of the step
        // before, copied on the GPU, and it is submitted while that one runs.
        let feeds = feeds_of(&hist);
        let feeds: Vec<(u64, &[u32])> = feeds.iter().map(|(id, t)| (*id, t.as_slice())).collect();
        let picks = |samplers: &mut Vec<Sampler>| -> Vec<Pick> {
            samplers
                .iter_mut()
                .map(|s| s.gpu_pick().expect("a plain draw"))
                .collect()
        };
        let first = b.record_picking(gpu, &plan, &host)?;
        let p = picks(&mut samplers);
        let mut flight = b.submit_picking(gpu, first, &feeds, &p)?;
        let steps = if timed { TIMED_STEPS } else { STREAM_STEPS };
        for i in 0..steps {
            let t0 = Instant::now();
            let next = match i + 1 < steps {
                true => {
                    let a = b.record_chained(gpu, &flight, &seqs, &[], &[])?;
                    if !timed {
                        record.push(a.record_ms());
                    }
                    let p = picks(&mut samplers);
                    Some(b.submit_chained(gpu, a, &p)?)
                }
                false => None,
            };
            let out = pollster::block_on(b.wait_chosen(gpu, flight))?;
            let t1 = Instant::now();
            for ((c, s), h) in out.into_iter().zip(&mut samplers).zip(&mut hist) {
                let Chosen::Token(t) = c else {
                    unreachable!("every row the GPU's")
                };
                s.accept(t);
                h.push(t);
            }
            if timed {
                let tr = &b.last_times().trace;
                if let Some(e) = tr.events.first() {
                    let start = tr.origin_ns + e.start_ns;
                    if let Some(end) = last_end {
                        chained_gap.push((start - end) / 1e6);
                    }
                    last_end = Some(start + e.dur_ns);
                    chained_gpu.push(e.dur_ns / 1e6);
                }
            } else {
                wait.push(b.last_times().wait_ms);
                submit.push(b.last_times().submit_ms);
                sample.push(t1.elapsed().as_secs_f64() * 1e3);
                total.push(t0.elapsed().as_secs_f64() * 1e3);
                for h in &hist {
                    piped = mix_bits(piped, &[f32::from_bits(*h.last().expect("a token"))]);
                }
            }
            match next {
                Some(f) => flight = f,
                None => break,
            }
        }
    }
    if args.host_sampling {
        // Pipelined as serve runs requests the host samples: the next step recorded while
        // the GPU runs this one, submitted once this one's tokens are sampled.
        let mut ahead = b.record_picking(gpu, &plan, &host)?;
        for _ in 0..STREAM_STEPS {
            let t0 = Instant::now();
            let feeds = feeds_of(&hist);
            let feeds: Vec<(u64, &[u32])> =
                feeds.iter().map(|(id, t)| (*id, t.as_slice())).collect();
            let flight = b.submit_picking(gpu, ahead, &feeds, &vec![Pick::Host; n])?;
            ahead = b.record_picking(gpu, &plan, &host)?;
            record.push(ahead.record_ms());
            let out = pollster::block_on(b.wait_chosen(gpu, flight))?;
            wait.push(b.last_times().wait_ms);
            submit.push(b.last_times().submit_ms);
            let t1 = Instant::now();
            let logits = out
                .into_iter()
                .map(|c| match c {
                    Chosen::Logits(l) => l,
                    Chosen::Token(_) => unreachable!("every row the host's"),
                })
                .collect();
            choose(&mut samplers, &mut hist, logits);
            sample.push(t1.elapsed().as_secs_f64() * 1e3);
            total.push(t0.elapsed().as_secs_f64() * 1e3);
            for h in &hist {
                piped = mix_bits(piped, &[f32::from_bits(*h.last().expect("a token"))]);
            }
        }
    }
    let mut gpu_ms = Vec::new();
    for _ in 0..whole {
        step(&mut b, StepTiming::Whole, &mut samplers, &mut hist, None)?;
        gpu_ms.extend(b.last_times().trace.events.iter().map(|e| e.dur_ns / 1e6));
    }
    step(
        &mut b,
        StepTiming::EachDispatch,
        &mut samplers,
        &mut hist,
        None,
    )?;
    let kernels: Vec<serde_json::Value> = b
        .last_times()
        .trace
        .by_kernel()
        .iter()
        .map(|k| serde_json::json!({ "kernel": k.name, "ms": k.total_ns / 1e6, "dispatches": k.count }))
        .collect();
    let p50 = pct(&total, 0.5);
    Ok(serde_json::json!({
        "streams": n,
        "logits_check": format!("{check:016x}"),
        "tokens_check_pipelined": format!("{piped:016x}"),
        "sampling": if args.host_sampling { "host" } else { "gpu" },
        "tok_s": n as f64 / p50 * 1e3,
        "step_ms_p50": p50,
        "step_ms_p95": pct(&total, 0.95),
        "record_ms_p50": pct(&record, 0.5),
        "submit_ms_p50": pct(&submit, 0.5),
        "gpu_and_readback_ms_p50": pct(&wait, 0.5),
        "sampling_ms_p50": pct(&sample, 0.5),
        "gpu_ms_p50": (!gpu_ms.is_empty()).then(|| pct(&gpu_ms, 0.5)),
        "chained_gpu_ms_p50": (!chained_gpu.is_empty()).then(|| pct(&chained_gpu, 0.5)),
        "chained_gap_ms_p50": (!chained_gap.is_empty()).then(|| pct(&chained_gap, 0.5)),
        "chained_gap_ms_p95": (!chained_gap.is_empty()).then(|| pct(&chained_gap, 0.95)),
        "kernels": kernels,
    }))
}

pub fn run(gpu: &Gpu, args: &GenBenchArgs) -> doppler::Result<ExitCode> {
    if let Some(&bad) = args.rows.iter().find(|&&m| m == 0 || m > args.prompt) {
        return Err(doppler::Error::Invalid {
            op: "bench generate",
            detail: format!(
                "--rows {bad}: each row count must be 1 ..= --prompt ({})",
                args.prompt
            ),
        });
    }
    if args.streams.contains(&0) {
        return Err(doppler::Error::Invalid {
            op: "bench generate",
            detail: "--streams 0: each count of sequences must be at least 1".into(),
        });
    }
    // Room for the timed loop, then 16 steps timed on the GPU and 4 profiled ones.
    let mut ctx = args.prompt + args.gen + 24;
    if !args.streams.is_empty() {
        // --streams: the prompt, the first sampled token and every step's.
        ctx = ctx.max(args.prompt + STREAM_STEPS + TIMED_STEPS + 16);
    }
    let t0 = Instant::now();
    let (llama, label): (Llama, String) = match &args.model {
        Some(p) => (
            doppler::infer::Model::open(gpu, p, ctx)?.llama,
            p.display().to_string(),
        ),
        None => {
            let s = Synthetic::preset(&args.preset)?;
            (
                Llama::load(gpu, s.cfg.clone(), &s, ctx)?,
                format!("synthetic {}", args.preset),
            )
        }
    };
    gpu.wait()?;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    if let (false, Some(why)) = (args.streams.is_empty(), llama.paged_unsupported()) {
        return Err(doppler::Error::Invalid {
            op: "bench generate",
            detail: format!("--streams: continuous batching does not run a model with {why}"),
        });
    }
    let v = llama.cfg.vocab_size;
    let prompt: Vec<u32> = (0..args.prompt).map(|i| (i * 7919 % v) as u32).collect();
    let kv_type = args.cache_type.kv_type(gpu);
    let mut cache = llama.cache_with(gpu, ctx, doppler::ops::kvcache::RING_STEP, kv_type)?;
    // One prefill + decode round first: pipelines compile, buffers enter the pool. Decoding
    // is greedy with the argmax on the GPU and the next step submitted before the last
    // token is read (doppler::infer::greedy, as `generate` does at temperature 0).
    let round =
        |cache: &mut doppler::ops::kvcache::KvCache, decode: usize| -> doppler::Result<Round> {
            cache.len = 0;
            let mut dec = GreedyDecoder::new(gpu)?;
            let t = Instant::now();
            dec.prefill(gpu, &llama, cache, &prompt)?;
            dec.next_token(gpu)?;
            let prefill_ms = t.elapsed().as_secs_f64() * 1e3;
            let mut per_token = Vec::new();
            let cpu0 = cpu_seconds();
            let built0 = gpu.bind_group_stats().0;
            let mut t = Instant::now();
            if decode > 0 {
                dec.step(gpu, &llama, cache)?;
            }
            for k in 0..decode {
                if k + 1 < decode {
                    dec.step(gpu, &llama, cache)?;
                }
                dec.next_token(gpu)?;
                per_token.push(t.elapsed().as_secs_f64() * 1e3);
                t = Instant::now();
            }
            Ok(Round {
                prefill_ms,
                per_token,
                cpu_ms: (cpu_seconds() - cpu0) * 1e3,
                built: gpu.bind_group_stats().0 - built0,
                dec,
            })
        };
    round(&mut cache, 2)?;
    // The prompt's time is the median of PREFILL_RUNS prefills (one sample moved by 10-25%
    // between runs of the same binary).
    let mut prefills = (1..PREFILL_RUNS)
        .map(|_| round(&mut cache, 0).map(|r| r.prefill_ms))
        .collect::<doppler::Result<Vec<f64>>>()?;
    let Round {
        prefill_ms: last_prefill,
        per_token,
        cpu_ms,
        built,
        dec,
    } = round(&mut cache, args.gen)?;
    prefills.push(last_prefill);
    let prefill_ms = pct(&prefills, 0.5);
    // GPU time of a decode step on its own (first dispatch's start to last one's end, the
    // step encoded as in the timed loop, waited for one at a time).
    let mut gpu_ms = Vec::new();
    let mut next = 0u32;
    for _ in 0..16.min(cache.capacity - cache.len) {
        let mut rec = gpu.timed_recorder("decode step");
        let l = llama.forward(&mut rec, &[next], &mut cache, false)?;
        let trace = rec.submit()?.wait(gpu)?;
        gpu_ms.extend(trace.events.iter().map(|e| e.dur_ns / 1e6));
        next = argmax(&l.read_f32(gpu)?);
    }
    // GPU time per kernel over a few more decode steps, each dispatch in its own pass with
    // timestamps (slower than the timed loop: the figures are for proportions).
    let mut trace = doppler::gpu::Trace::default();
    let profiled = PROFILED_STEPS.min(cache.capacity - cache.len);
    for _ in 0..profiled {
        let mut rec = gpu.profiling_recorder("decode");
        let l = llama.forward(&mut rec, &[next], &mut cache, false)?;
        trace.extend(rec.submit()?.wait(gpu)?);
        next = argmax(&l.read_f32(gpu)?);
    }
    let steps = profiled.max(1) as f64;
    let kernels: Vec<serde_json::Value> = trace
        .by_kernel()
        .iter()
        .map(|k| serde_json::json!({ "kernel": k.name, "ms_per_token": k.total_ns / 1e6 / steps, "dispatches_per_token": k.count as f64 / steps }))
        .collect();
    // The same for the first prefill chunk (from an empty cache).
    let mut prefill_trace = doppler::gpu::Trace::default();
    let chunk = &prompt[..prompt.len().min(doppler::infer::PREFILL_CHUNK)];
    if !chunk.is_empty() {
        cache.len = 0;
        let mut rec = gpu.profiling_recorder("prefill");
        llama.forward(&mut rec, chunk, &mut cache, false)?;
        prefill_trace = rec.submit()?.wait(gpu)?;
    }
    let prefill_kernels: Vec<serde_json::Value> = prefill_trace
        .by_kernel()
        .iter()
        .map(|k| serde_json::json!({ "kernel": k.name, "ms": k.total_ns / 1e6, "dispatches": k.count }))
        .collect();
    // Forward passes of m rows from an empty cache: every product with m rows of x (W read
    // once for all of them, as a batched decode step of m sequences would), attention
    // among the m (small next to the products at these m). GPU time, median of ROWS_RUNS
    // after one to warm up.
    // Each count's kernels from one more pass, profiled dispatch by dispatch.
    let mut row_ms = Vec::new();
    let len = cache.len;
    for &m in &args.rows {
        let mut ms = Vec::new();
        for run in 0..=ROWS_RUNS {
            cache.len = 0;
            let mut rec = gpu.timed_recorder("rows");
            llama.forward(&mut rec, &prompt[..m], &mut cache, false)?;
            let trace = rec.submit()?.wait(gpu)?;
            if run > 0 {
                ms.push(trace.events.iter().map(|e| e.dur_ns / 1e6).sum::<f64>());
            }
        }
        cache.len = 0;
        let mut rec = gpu.profiling_recorder("rows");
        llama.forward(&mut rec, &prompt[..m], &mut cache, false)?;
        let kernels: Vec<serde_json::Value> = rec
            .submit()?
            .wait(gpu)?
            .by_kernel()
            .iter()
            .map(|k| serde_json::json!({ "kernel": k.name, "ms": k.total_ns / 1e6, "dispatches": k.count }))
            .collect();
        row_ms.push((m, pct(&ms, 0.5), kernels, ms));
    }
    cache.len = len;
    // The floor of a decode step: its reads (`Llama::decode_reads`) as a chain of dependent
    // dispatches that only stream them (`sum_words`), timed as the step is. What the
    // weights' bytes and the dependent dispatches between them cost before any arithmetic.
    let reads = llama.decode_reads(&cache);
    let links: Vec<Tensor> = (0..2)
        .map(|_| Tensor::empty(gpu, &[reduce::WORDS_GROUPS], DType::U32, "bench.floor"))
        .collect::<doppler::Result<_>>()?;
    let floor_chain = |rec: &mut doppler::gpu::Recorder<'_>| -> doppler::Result<()> {
        for (i, (_, step)) in reads.iter().enumerate() {
            let (dep, out) = (&links[i % 2], &links[(i + 1) % 2]);
            reduce::sum_words_into(rec, step[0], step.get(1).copied(), dep, out)?;
        }
        Ok(())
    };
    let mut floor_ms = Vec::new();
    for r in 0..=FLOOR_RUNS {
        let mut rec = gpu.timed_recorder("decode floor");
        floor_chain(&mut rec)?;
        let trace = rec.submit()?.wait(gpu)?;
        if r > 0 {
            floor_ms.extend(trace.events.iter().map(|e| e.dur_ns / 1e6));
        }
    }
    // Each step's dispatch in its own pass (as `decode_kernels`), summed by the step's name:
    // (name, ns, dispatches) over PROFILED_STEPS runs of the chain.
    let mut floor_steps: Vec<(&str, f64, usize)> = Vec::new();
    for _ in 0..PROFILED_STEPS {
        let mut rec = gpu.profiling_recorder("decode floor");
        floor_chain(&mut rec)?;
        let trace = rec.submit()?.wait(gpu)?;
        for ((name, _), e) in reads.iter().zip(&trace.events) {
            match floor_steps.iter_mut().find(|f| f.0 == *name) {
                Some(f) => (f.1, f.2) = (f.1 + e.dur_ns, f.2 + 1),
                None => floor_steps.push((name, e.dur_ns, 1)),
            }
        }
    }
    let runs = PROFILED_STEPS as f64;
    let floor_kernels: Vec<serde_json::Value> = floor_steps
        .iter()
        .map(|(name, ns, n)| serde_json::json!({ "step": name, "ms_per_token": ns / 1e6 / runs, "dispatches_per_token": *n as f64 / runs }))
        .collect();
    let floor_bytes: u64 = reads.iter().flat_map(|r| &r.1).map(|r| r.1).sum();
    // None where the adapter has no timestamps.
    let floor_p50 = (!floor_ms.is_empty()).then(|| pct(&floor_ms, 0.5));
    let by_rows: Vec<serde_json::Value> = row_ms
        .iter()
        .map(|(m, step, kernels, runs)| {
            let (m, step) = (*m, *step);
            let gb_s = llama.decode_bytes as f64 / (step / 1e3) / 1e9;
            serde_json::json!({
                "rows": m,
                "step_ms": step,
                "tok_s": m as f64 / step * 1e3,
                "weight_gb_s": gb_s,
                "of_floor": floor_p50.map(|f| gb_s / (floor_bytes as f64 / (f / 1e3) / 1e9)),
                "runs_ms": runs,
                "kernels": kernels,
            })
        })
        .collect();
    let streams_json = args
        .streams
        .iter()
        .map(|&n| streams(gpu, &llama, args, n))
        .collect::<doppler::Result<Vec<_>>>()?;
    let n = per_token.len().max(1) as f64;
    let decode_s: f64 = per_token.iter().sum::<f64>() / 1e3;
    let p50 = pct(&per_token, 0.5);
    let result = serde_json::json!({
        "model": label,
        "adapter": gpu.info.name,
        "backend": format!("{:?}", gpu.info.backend),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "weights_mib": llama.weight_bytes as f64 / (1u64 << 20) as f64,
        "decode_read_mib": llama.decode_bytes as f64 / (1u64 << 20) as f64,
        "load_ms": load_ms,
        "kv_cache_type": kv_type.name(),
        "kv_cache_mib": cache.bytes() as f64 / (1u64 << 20) as f64,
        "prompt_tokens": args.prompt,
        "generated_tokens": per_token.len(),
        "ttft_ms": prefill_ms,
        "prefill_tok_s": args.prompt as f64 / prefill_ms * 1e3,
        "prefill_ms_runs": prefills,
        "decode_tok_s": n / decode_s,
        "token_ms_p50": p50,
        "token_ms_p95": pct(&per_token, 0.95),
        "dispatches_per_token": dec.dispatched as f64 / n,
        "record_ms_per_token": (dec.record_ms + dec.submit_ms) / n,
        "ops_ms_per_token": dec.record_ms / n,
        "submit_ms_per_token": dec.submit_ms / n,
        "cpu_ms_per_token": cpu_ms / n,
        "gpu_ms_per_token_p50": pct(&gpu_ms, 0.5),
        "bind_groups_built_per_token": built as f64 / n,
        "weight_gb_s_at_p50": llama.decode_bytes as f64 / (p50 / 1e3) / 1e9,
        "floor_ms_per_token": floor_p50,
        "floor_dispatches": reads.len(),
        "floor_read_mib": floor_bytes as f64 / (1u64 << 20) as f64,
        "floor_gb_s": floor_p50.map(|ms| floor_bytes as f64 / (ms / 1e3) / 1e9),
        "decode_kernels": kernels,
        "floor_kernels": floor_kernels,
        "prefill_kernels": prefill_kernels,
        "rows": by_rows,
        "streams": streams_json,
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&result).unwrap());
    } else {
        for (k, v) in result.as_object().unwrap() {
            println!("{k:<22} {v}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
