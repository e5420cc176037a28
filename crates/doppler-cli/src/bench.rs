//! `doppler bench`: copy bandwidth and f32 matmul throughput, medians over repeated runs.
//! Two clocks: the wall clock around submit + wait of a batch (divided by the batch size)
//! and, where the adapter has timestamp queries, the GPU's own time per dispatch.

use clap::{Args, ValueEnum};
use doppler::check::Rng;
use doppler::gpu::{trace::median, Gpu, MatmulMode, Tensor};
use doppler::ops::{elementwise, matmul};
use std::process::ExitCode;
use std::time::Instant;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Which {
    All,
    Copy,
    Matmul,
    /// The seed kernels: conv2d, group_norm, cross_entropy, embedding (forward + backward).
    Kernels,
    /// Training steps of a GPT-2-124M-shaped model (AdamW, random tokens): tokens/s and the
    /// time per kernel. Not part of `all`.
    Train,
    /// Inference of a Llama-family model, batch 1: load, time to first token, prefill and
    /// decode tokens/s (p50/p95 ms per token), dispatches and CPU time per token. Not part
    /// of `all`.
    Generate,
    /// LoRA fine-tuning steps of a Llama-family model (synthetic weights of a preset, or
    /// --model) over made-up rows that fill the sequence: tokens/s and the buffer pool's
    /// peak. Not part of `all`.
    Finetune,
    /// The cost of a dispatch: chains of tiny dispatches in one submission, each reading
    /// the previous one's output (a barrier between them) or all independent; wall-clock
    /// µs per dispatch (the floor under a decode step of N dispatches).
    Launch,
    /// Quantized products x (M, K) @ W^T, W (N, K) in GGUF blocks (random), as serving's
    /// batch-invariant product and as the default path: GPU ms a product, W's bytes a
    /// second against a plain read of the same bytes (`sum_words`), TFLOP/s. Not part of
    /// `all`.
    Qmatmul,
}

#[derive(Args)]
pub struct BenchArgs {
    /// What to measure.
    #[arg(value_enum, default_value = "all")]
    which: Which,
    /// Copy buffer size in MiB (default 1024 on a GPU, 32 on a CPU adapter).
    #[arg(long)]
    mib: Option<u64>,
    /// Matmul sizes M=N=K (default 4096 on a GPU, 256 on a CPU adapter); repeatable.
    #[arg(long)]
    size: Vec<usize>,
    /// Matmul shapes MxNxK, optionally with ":ta" (A stored K x M) and/or ":tb" (B stored
    /// N x K), e.g. 8192x768x768:tb; repeatable, instead of --size. "gpt2" stands for the
    /// products of a GPT-2-124M training step (B8 T1024).
    #[arg(long)]
    shape: Vec<String>,
    /// qmatmul shapes TYPE:MxNxK, optionally with ":glu" (W holds gate and up, N rows in
    /// all: SwiGLU after the product), e.g. q4_k:32x28672x4096:glu; repeatable (default:
    /// the products of a Llama-3-8B Q4_K layer at 32 rows).
    #[arg(long)]
    qshape: Vec<String>,
    /// Matmul slab depths to try (8, 16); repeatable.
    #[arg(long, default_values_t = [16u32])]
    bk: Vec<u32>,
    /// Timed batches (the median is reported).
    #[arg(long, default_value_t = 10)]
    repeat: usize,
    /// Operations per batch.
    #[arg(long, default_value_t = 10)]
    batch: usize,
    /// Also write the per-dispatch GPU timings as a Chrome trace (Perfetto) to this file.
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    /// train: time this training config (its model, batch, corpus and optimizer, as
    /// `doppler train` runs it; nothing is written) instead of a preset.
    #[arg(long, conflicts_with_all = ["preset", "train_batch", "seq"])]
    config: Option<std::path::PathBuf>,
    /// train: model shape, "gpt2-124m" (12 layers, 768 wide, 12 heads, vocab 50304) or
    /// "gpt2-tiny" (2 layers, 64 wide); default gpt2-tiny on a CPU adapter.
    /// generate, finetune: synthetic weights of "smollm2-135m" (default; Q8_0 embeddings,
    /// Q4_1 blocks) or "llama3-8b-q4k" (Q4_K, Q6_K output), unless --model is given.
    #[arg(long)]
    preset: Option<String>,
    /// finetune: LoRA rank on all seven projections.
    #[arg(long, default_value_t = 16)]
    rank: usize,
    /// finetune: recompute each layer in the backward (the default, as `finetune` runs).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    recompute: bool,
    /// generate, finetune: a model file or directory instead of synthetic weights.
    #[arg(short, long)]
    model: Option<std::path::PathBuf>,
    /// generate: prompt tokens (prefill) and generated tokens (decode).
    #[arg(long, default_value_t = 512)]
    prompt: usize,
    #[arg(long, default_value_t = 128)]
    gen: usize,
    /// generate: KV cache storage (auto: f16 where the adapter has shader-f16).
    #[arg(long, value_enum, default_value = "auto")]
    cache_type: crate::generate::CacheType,
    /// generate: also time forward passes of these numbers of rows (e.g. 2,4,8,32,64: the
    /// products a batched decode step of that many sequences runs, each weight read once
    /// for all rows), as tokens/s and the weights' read rate against the decode floor's.
    #[arg(long, value_delimiter = ',')]
    rows: Vec<usize>,
    /// generate: also decode this many sequences together (e.g. 1,8,32,64), as `doppler
    /// serve` runs them: tokens/s, where a step's time goes (recording, GPU and readback,
    /// sampling at temperature 0.8: on the GPU, as serve does for such requests) and its
    /// kernels.
    #[arg(long, value_delimiter = ',')]
    streams: Vec<usize>,
    /// generate --streams: sample each row on the host from its logits (as serve does for
    /// requests with log-probabilities, penalties or a grammar) instead of on the GPU.
    #[arg(long)]
    host_sampling: bool,
    /// train, finetune: sequences per step (default 8) and their length (default 1024;
    /// finetune 512).
    #[arg(long)]
    train_batch: Option<usize>,
    #[arg(long)]
    seq: Option<usize>,
    /// train: timed steps (after 2 warm-up steps).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// train: submit a step's commands this many at a time as they are recorded, so the GPU
    /// starts while the CPU records the rest (0: one submission a step).
    #[arg(long, default_value_t = doppler::gpu::FLUSH_EVERY)]
    flush_every: usize,
}

#[derive(serde::Serialize)]
struct Row {
    name: String,
    shape: String,
    /// Median wall-clock time per op, ms.
    wall_ms: f64,
    /// GPU time from timestamp queries, ms (absent without them): the median per op, or
    /// for `train` one step's, timed as a whole.
    gpu_ms: Option<f64>,
    /// Throughput from the GPU time where measured, else from the wall time.
    value: f64,
    unit: &'static str,
    /// qmatmul: the product's arithmetic rate from the same time.
    #[serde(skip_serializing_if = "Option::is_none")]
    tflop_s: Option<f64>,
}

fn is_cpu(gpu: &Gpu) -> bool {
    gpu.info.device_type == doppler::wgpu::DeviceType::Cpu
}

/// Untimed batches before each op's measured ones, for at least this long, so that the
/// GPU's clocks have risen (an H100 idles at 345 MHz). With a single warm-up batch, one
/// product's median read 0.28 ms in one run and 1.2 ms in another on an H100
/// (docs/benchmarks.md, session 32).
const WARMUP_S: f64 = 0.25;

/// Runs `record` (one op, possibly several dispatches) `batch` times per submission,
/// `repeat` times after a warm-up (one round, then untimed batches for [`WARMUP_S`]).
/// Returns the median wall time per op and, with timestamps, the median GPU time per
/// op: from its first dispatch's start to its last dispatch's end.
fn time(
    gpu: &Gpu,
    args: &BenchArgs,
    trace: &mut doppler::gpu::Trace,
    mut record: impl FnMut(&mut doppler::gpu::Recorder<'_>) -> doppler::Result<()>,
) -> doppler::Result<(f64, Option<f64>)> {
    let mut walls = Vec::new();
    let mut gpu_times = Vec::new();
    for r in 0..=args.repeat {
        // Wall-clock batch, no timestamps in the way.
        let mut rec = gpu.recorder("bench");
        for _ in 0..args.batch {
            record(&mut rec)?;
        }
        let t = Instant::now();
        rec.submit()?.wait(gpu)?;
        let wall = t.elapsed().as_secs_f64() * 1e3 / args.batch as f64;
        // Same batch again with a timestamp around every dispatch.
        let mut rec = gpu.profiling_recorder("bench");
        let mut bounds = vec![0];
        for _ in 0..args.batch {
            record(&mut rec)?;
            bounds.push(rec.dispatches());
        }
        let tr = rec.submit()?.wait(gpu)?;
        if r == 0 {
            let t0 = Instant::now();
            while t0.elapsed().as_secs_f64() < WARMUP_S {
                let mut rec = gpu.recorder("bench");
                for _ in 0..args.batch {
                    record(&mut rec)?;
                }
                rec.submit()?.wait(gpu)?;
            }
        }
        if r > 0 {
            walls.push(wall);
            if !tr.events.is_empty() {
                for w in bounds.windows(2) {
                    let ev = &tr.events[w[0]..w[1]];
                    if let (Some(a), Some(b)) = (ev.first(), ev.last()) {
                        gpu_times.push((b.start_ns + b.dur_ns - a.start_ns) / 1e6);
                    }
                }
            }
            trace.extend(tr);
        }
    }
    let g = if gpu_times.is_empty() {
        None
    } else {
        Some(median(&mut gpu_times))
    };
    Ok((median(&mut walls), g))
}

/// The training-kernel shapes, forward + backward each (embedding: backward).
fn kernels(
    gpu: &Gpu,
    args: &BenchArgs,
    trace: &mut doppler::gpu::Trace,
    rows: &mut Vec<Row>,
) -> doppler::Result<()> {
    use doppler::ops::{conv2d, cross_entropy as ce, embedding, groupnorm};
    let mut rng = Rng::new(3);
    let cpu = is_cpu(gpu);
    let mut push = |name: &str,
                    shape: String,
                    (wall, g): (f64, Option<f64>),
                    work: f64,
                    unit: &'static str| {
        let t = g.unwrap_or(wall);
        rows.push(Row {
            name: name.into(),
            shape,
            wall_ms: wall,
            gpu_ms: g,
            value: work / t / 1e6,
            unit,
            tflop_s: None,
        });
    };

    // conv2d 3x3, N=8, 64 -> 128 channels, 64x64, padding 1: forward + dx + dw + db.
    let (n, ci, co, hw) = if cpu {
        (1, 8, 16, 16)
    } else {
        (8, 64, 128, 64)
    };
    let x = Tensor::from_f32(gpu, &[n, ci, hw, hw], &rng.vec(n * ci * hw * hw), "x")?;
    let w = Tensor::from_f32(gpu, &[co, ci, 3, 3], &rng.vec(co * ci * 9), "w")?;
    let b = Tensor::from_f32(gpu, &[co], &rng.vec(co), "b")?;
    let dy = Tensor::from_f32(gpu, &[n, co, hw, hw], &rng.vec(n * co * hw * hw), "dy")?;
    let o = conv2d::Conv2dOpts {
        padding: (1, 1),
        ..Default::default()
    };
    let flops = 3.0 * 2.0 * (n * co * hw * hw * ci * 9) as f64;
    // The f32 kernel, then the cooperative-matrix one (f16 operands) where the adapter has
    // it (what `--matmul f16` runs).
    let mut paths = vec![(conv2d::ConvPath::F32, "conv2d 3x3 fwd+bwd")];
    if gpu.coop_matmul_possible() {
        paths.push((
            conv2d::ConvPath::Coop,
            "conv2d 3x3 fwd+bwd, f16 operands (cooperative matrices)",
        ));
    }
    for (path, name) in paths {
        let t = time(gpu, args, trace, |rec| {
            conv2d::conv2d_on(rec, &x, &w, Some(&b), o, path)?;
            conv2d::conv2d_backward_on(rec, &x, &w, &dy, o, true, path).map(|_| ())
        })?;
        push(
            name,
            format!("{n}x{ci}->{co}x{hw}x{hw}"),
            t,
            flops / 1e3,
            "TFLOP/s",
        );
    }

    // GroupNorm, 32 groups, N=8, C=256, 64x64: forward + backward.
    let (n, c, hw) = if cpu { (2, 64, 16) } else { (8, 256, 64) };
    let len = n * c * hw * hw;
    let x = Tensor::from_f32(gpu, &[n, c, hw, hw], &rng.vec(len), "x")?;
    let dy = Tensor::from_f32(gpu, &[n, c, hw, hw], &rng.vec(len), "dy")?;
    let gamma = Tensor::from_f32(gpu, &[c], &rng.vec(c), "gamma")?;
    let beta = Tensor::from_f32(gpu, &[c], &rng.vec(c), "beta")?;
    let t = time(gpu, args, trace, |rec| {
        let f = groupnorm::group_norm(rec, &x, &gamma, &beta, 32, 1e-5)?;
        groupnorm::group_norm_backward(rec, &x, &gamma, &f, &dy, 32).map(|_| ())
    })?;
    // Least traffic: read x, write y; read x and dy, write dx.
    push(
        "group_norm fwd+bwd",
        format!("{n}x{c}x{hw}x{hw} g32"),
        t,
        5.0 * 4.0 * len as f64,
        "GB/s",
    );

    // Cross-entropy, 4096 tokens x 49152 vocabulary: forward + backward.
    let (tk, v) = if cpu { (64, 4096) } else { (4096, 49152) };
    let logits = Tensor::from_f32(
        gpu,
        &[tk, v],
        &rng.vec(tk * v).iter().map(|a| a * 4.0).collect::<Vec<_>>(),
        "logits",
    )?;
    let targets: Vec<u32> = (0..tk)
        .map(|_| (rng.next_u64() % v as u64) as u32)
        .collect();
    let targets = Tensor::from_u32(gpu, &[tk], &targets, "targets")?;
    let g = Tensor::from_f32(gpu, &[1], &[1.0], "g")?;
    let opts = ce::CrossEntropyOpts::default();
    let t = time(gpu, args, trace, |rec| {
        let f = ce::cross_entropy(rec, &logits, &targets, opts)?;
        ce::cross_entropy_backward(rec, &logits, &targets, &f, ce::Upstream::Mean(&g), opts)
            .map(|_| ())
    })?;
    // Least traffic: read the logits twice, write dlogits once.
    push(
        "cross_entropy fwd+bwd",
        format!("{tk}x{v}"),
        t,
        3.0 * 4.0 * (tk * v) as f64,
        "GB/s",
    );

    // Embedding backward, 16384 tokens x 576 hidden, vocabulary 49152, one id in half the positions.
    let (tk, h, v) = if cpu {
        (1024, 64, 4096)
    } else {
        (16384, 576, 49152)
    };
    let ids: Vec<u32> = (0..tk)
        .map(|i| {
            if i % 2 == 0 {
                7
            } else {
                (rng.next_u64() % v as u64) as u32
            }
        })
        .collect();
    let ids = Tensor::from_u32(gpu, &[tk], &ids, "ids")?;
    let dout = Tensor::from_f32(gpu, &[tk, h], &rng.vec(tk * h), "dout")?;
    let dtable = Tensor::empty(gpu, &[v, h], doppler::gpu::DType::F32, "dtable")?;
    let t = time(gpu, args, trace, |rec| {
        embedding::embedding_backward_into(rec, &ids, &dout, &dtable, false)
    })?;
    // Least traffic: read dout, write the table gradient.
    push(
        "embedding backward",
        format!("{tk}x{h} -> {v}x{h}"),
        t,
        4.0 * (tk * h + v * h) as f64,
        "GB/s",
    );
    Ok(())
}

/// GPT-2-124M-shaped training: forward, backward, global-norm clip, AdamW, each step
/// synchronised by reading its loss (as `loss.item()` does in PyTorch).
fn train(
    gpu: &Gpu,
    args: &BenchArgs,
    trace: &mut doppler::gpu::Trace,
    rows: &mut Vec<Row>,
) -> doppler::Result<()> {
    use doppler::autograd::Tape;
    use doppler::models::transformer::{Arch, ModelConfig, Transformer};
    let preset = args.preset.clone().unwrap_or(if is_cpu(gpu) {
        "gpt2-tiny".into()
    } else {
        "gpt2-124m".into()
    });
    let (n_layer, n_embd, n_head, vocab) = match preset.as_str() {
        "gpt2-124m" => (12, 768, 12, 50304),
        "gpt2-tiny" => (2, 64, 4, 512),
        other => {
            return Err(doppler::Error::Invalid {
                op: "bench train",
                detail: format!("unknown preset {other:?} (gpt2-124m, gpt2-tiny)"),
            })
        }
    };
    let (b, t) = (
        args.train_batch.unwrap_or(8),
        args.seq.unwrap_or(if is_cpu(gpu) { 64 } else { 1024 }),
    );
    let cfg = ModelConfig {
        arch: Arch::Gpt2,
        vocab_size: vocab,
        n_layer,
        n_embd,
        n_head,
        n_kv_head: None,
        block_size: t,
        ffn_hidden: None,
        norm_eps: 1e-5,
        rope_theta: 10000.0,
        tie_embeddings: None,
        dropout: 0.0,
        attn_dropout: None,
        init: Default::default(),
    };
    let mut model = Transformer::new(gpu, &cfg, 1)?;
    let params: Vec<Tensor> = model.params.values.clone();
    let refs: Vec<&Tensor> = params.iter().collect();
    let mut opt = doppler::optim::AdamW::new(gpu, &refs, 6e-4)?;
    opt.decay_mask = model.decayed();
    let mut rng = Rng::new(7);
    let mut tokens = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| (rng.next_u64() % vocab as u64) as u32)
            .collect()
    };
    let ids = Tensor::from_u32(gpu, &[b, t], &tokens(b * t), "ids")?;
    let targets = Tensor::from_u32(gpu, &[b, t], &tokens(b * t), "targets")?;
    // f16 matmul operands flush gradients below 6e-8 to zero (the logits' are ~1e-9 at
    // this vocabulary and batch): scale the loss as mixed-precision training does.
    let loss_scale = match gpu.matmul {
        MatmulMode::F16 => 65536.0,
        _ => 1.0,
    };
    // A timed step (plain recorder), a step timed as a whole on the GPU (one submission,
    // encoded as usual), or a profiled one (each dispatch in a pass with timestamps).
    #[derive(Clone, Copy, PartialEq)]
    enum Mode {
        Plain,
        Whole,
        Profile,
    }
    // (wall ms, CPU ms until the last submit, trace, loss)
    let mut step = |mode: Mode| -> doppler::Result<(f64, f64, doppler::gpu::Trace, f32)> {
        let t0 = Instant::now();
        let mut rec = match mode {
            Mode::Plain => gpu.recorder("train"),
            Mode::Whole => gpu.timed_recorder("train"),
            Mode::Profile => gpu.profiling_recorder("train"),
        };
        rec.set_flush_every(args.flush_every);
        let mut tape = Tape::new();
        let loss = model.loss(&mut tape, &mut rec, &ids, &targets, None)?;
        let lt = tape.value(loss)?.clone();
        tape.backward(&mut rec, loss, loss_scale, &mut model.params)?;
        let grads: Vec<Tensor> = model
            .params
            .grads
            .iter()
            .map(|g| g.clone().expect("gradient"))
            .collect();
        let grefs: Vec<&Tensor> = grads.iter().collect();
        let scale = doppler::optim::grad_scale(&mut rec, &grefs, Some(1.0), loss_scale)?;
        opt.step(&mut rec, &refs, &grefs, &scale)?;
        let read = rec.read_later(&lt)?;
        let sub = rec.submit()?;
        let cpu_ms = t0.elapsed().as_secs_f64() * 1e3;
        let tr = sub.wait(gpu)?;
        let l = f32::from_bits(read.read_u32(gpu)?[0]);
        model.params.zero_grad();
        Ok((t0.elapsed().as_secs_f64() * 1e3, cpu_ms, tr, l))
    };
    for _ in 0..2 {
        step(Mode::Plain)?;
    }
    let (mut ms, mut cpu) = (Vec::new(), Vec::new());
    let mut last_loss = 0.0;
    for _ in 0..args.steps {
        let (m, c, _, l) = step(Mode::Plain)?;
        ms.push(m);
        cpu.push(c);
        last_loss = l;
    }
    let (_, _, whole, _) = step(Mode::Whole)?;
    let (_, _, tr, _) = step(Mode::Profile)?;
    let med = median(&mut ms);
    let tokens_per_s = (b * t) as f64 / (med / 1e3);
    // The step's GPU time as encoded in one submission (first pass's start to last
    // pass's end); the profiled step's per-dispatch times add up to more or less than it
    // (no overlap between dispatches, a pass each).
    let gpu_ms = whole.events.first().map(|e| e.dur_ns / 1e6);
    rows.push(Row {
        name: match gpu.matmul {
            MatmulMode::F16 => format!(
                "train {preset}, f16 matmul operands, loss scale {loss_scale} (loss {last_loss:.3})"
            ),
            MatmulMode::F16x3 => format!("train {preset}, f16x3 products (loss {last_loss:.3})"),
            MatmulMode::F32 => format!("train {preset} (loss {last_loss:.3})"),
        },
        shape: format!("B{b} T{t}, {} params", model.params.numel()),
        wall_ms: med,
        gpu_ms,
        value: tokens_per_s / 1e3,
        unit: "K tok/s",
        tflop_s: None,
    });
    if !args.json {
        eprintln!(
            "CPU ms a step until its last submit (median, submitting every {} commands): {:.2}",
            args.flush_every,
            median(&mut cpu)
        );
        print_kernels(&tr);
    }
    trace.extend(tr);
    Ok(())
}

/// A profiled step's time per kernel (and per kernel and grid), to stderr.
fn print_kernels(tr: &doppler::gpu::Trace) {
    let total = tr.events.iter().map(|e| e.dur_ns).sum::<f64>() / 1e6;
    eprintln!(
        "per kernel, one profiled step ({} dispatches, {total:.2} ms in all):",
        tr.events.len()
    );
    for k in tr.by_kernel().iter().take(20) {
        eprintln!("  {:>9.3} ms {:>5}x  {}", k.total_ns / 1e6, k.count, k.name);
    }
    eprintln!("per kernel and grid (workgroups x, y, z), the slowest 30:");
    for k in tr.by_kernel_and_grid().iter().take(30) {
        eprintln!("  {:>9.3} ms {:>5}x  {}", k.total_ns / 1e6, k.count, k.name);
    }
}

/// `bench train --config FILE`: the config's own training steps (the trainer `doppler
/// train` runs, on its corpus; no checkpoint or metrics written): 2 warm-up steps, the
/// median of `--steps` timed ones, then one profiled step for the per-kernel table.
fn train_config(
    gpu: &Gpu,
    args: &BenchArgs,
    path: &std::path::Path,
    trace: &mut doppler::gpu::Trace,
    rows: &mut Vec<Row>,
) -> doppler::Result<()> {
    use doppler::train::{config::TrainConfig, Trainer};
    let cfg = TrainConfig::load(path)?;
    let data = cfg.data_path();
    let text = std::fs::read_to_string(data).map_err(|source| doppler::Error::Io {
        path: data.display().to_string(),
        source,
    })?;
    let mut trainer = Trainer::fresh(gpu, &cfg, &text)?;
    let tc = &cfg.train;
    let items = (cfg.items_per_batch() * tc.grad_accum) as f64;
    let (shape, unit) = match cfg.transformer() {
        Some(m) => (format!("B{} T{}", tc.batch_size, m.block_size), "K tok/s"),
        None => (format!("B{}", tc.batch_size), "K images/s"),
    };
    for _ in 0..2 {
        trainer.train_step()?;
    }
    let mut ms = Vec::new();
    let mut loss = f32::NAN;
    for _ in 0..args.steps {
        let t0 = Instant::now();
        loss = trainer.train_step()?.loss;
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    trainer.trace = Some(doppler::gpu::Trace::default());
    trainer.train_step()?;
    let tr = trainer.trace.take().unwrap_or_default();
    let med = median(&mut ms);
    rows.push(Row {
        name: format!(
            "train {} ({} products, loss {loss:.3})",
            path.display(),
            gpu.matmul.name()
        ),
        shape: format!(
            "{shape} x{}, {} params",
            tc.grad_accum,
            trainer.params().numel()
        ),
        wall_ms: med,
        gpu_ms: None,
        value: items / (med / 1e3) / 1e3,
        unit,
        tflop_s: None,
    });
    if !args.json {
        print_kernels(&tr);
    }
    trace.extend(tr);
    Ok(())
}

pub fn run(gpu: &Gpu, args: &BenchArgs) -> doppler::Result<ExitCode> {
    for (flag, n) in [
        ("--repeat", args.repeat),
        ("--batch", args.batch),
        ("--steps", args.steps),
    ] {
        if n == 0 {
            return Err(doppler::Error::Invalid {
                op: "bench",
                detail: format!("{flag} 0: at least one is needed for a median"),
            });
        }
    }
    let mut rows = Vec::new();
    if args.which == Which::Generate {
        let g = crate::bench_generate::GenBenchArgs {
            model: args.model.clone(),
            preset: args.preset.clone().unwrap_or_else(|| "smollm2-135m".into()),
            prompt: args.prompt,
            gen: args.gen,
            json: args.json,
            cache_type: args.cache_type,
            rows: args.rows.clone(),
            streams: args.streams.clone(),
            host_sampling: args.host_sampling,
        };
        return crate::bench_generate::run(gpu, &g);
    }
    if args.which == Which::Finetune {
        let f = crate::bench_finetune::FtBenchArgs {
            model: args.model.clone(),
            preset: args.preset.clone().unwrap_or_else(|| "smollm2-135m".into()),
            batch: args.train_batch.unwrap_or(8),
            seq: args.seq.unwrap_or(512),
            rank: args.rank,
            steps: args.steps,
            recompute: args.recompute,
            json: args.json,
        };
        return crate::bench_finetune::run(gpu, &f);
    }
    if args.which == Which::Train {
        let mut trace = doppler::gpu::Trace::default();
        match &args.config {
            Some(path) => train_config(gpu, args, path, &mut trace, &mut rows)?,
            None => train(gpu, args, &mut trace, &mut rows)?,
        }
        return report(gpu, args, &rows, &trace);
    }
    let mut trace = doppler::gpu::Trace::default();
    if matches!(args.which, Which::All | Which::Launch) {
        launch(gpu, args, &mut rows)?;
    }
    if matches!(args.which, Which::All | Which::Copy) {
        let mib = args.mib.unwrap_or(if is_cpu(gpu) { 32 } else { 1024 });
        let n = (mib as usize) << 18; // f32 elements
        let src = Tensor::from_f32(gpu, &[n], &Rng::new(1).vec(n), "bench.src")?;
        let dst = Tensor::empty(gpu, &[n], src.dtype(), "bench.dst")?;
        let bytes = 2.0 * (n * 4) as f64; // read + written
        let shape = format!("{mib} MiB");
        // copy_buffer_to_buffer has no dispatch to time: wall clock only.
        let (wall, _) = time(gpu, args, &mut Default::default(), |rec| {
            rec.copy(&src, &dst)
        })?;
        rows.push(Row {
            name: "copy (copy_buffer_to_buffer)".into(),
            shape: shape.clone(),
            wall_ms: wall,
            gpu_ms: None,
            value: bytes / wall / 1e6,
            unit: "GB/s",
            tflop_s: None,
        });
        let (wall, g) = time(gpu, args, &mut trace, |rec| {
            elementwise::scale_into(rec, &src, 1.0, &dst)
        })?;
        let t = g.unwrap_or(wall);
        rows.push(Row {
            name: "copy (scale kernel, vec4)".into(),
            shape,
            wall_ms: wall,
            gpu_ms: g,
            value: bytes / t / 1e6,
            unit: "GB/s",
            tflop_s: None,
        });
    }
    if matches!(args.which, Which::All | Which::Matmul) {
        let mut shapes = Vec::new();
        for spec in &args.shape {
            shapes.extend(parse_shapes(spec)?);
        }
        if shapes.is_empty() {
            let sizes = if args.size.is_empty() {
                vec![if is_cpu(gpu) { 256 } else { 4096 }]
            } else {
                args.size.clone()
            };
            shapes.extend(sizes.into_iter().map(|s| MatmulCase {
                m: s,
                n: s,
                k: s,
                opts: Default::default(),
            }));
        }
        for case in shapes {
            let MatmulCase { m, n, k, opts } = case;
            let mut rng = Rng::new(2);
            let (ashape, bshape) = (
                if opts.trans_a { [k, m] } else { [m, k] },
                if opts.trans_b { [n, k] } else { [k, n] },
            );
            let a = Tensor::from_f32(gpu, &ashape, &rng.vec(m * k), "bench.a")?;
            let b = Tensor::from_f32(gpu, &bshape, &rng.vec(k * n), "bench.b")?;
            let c = Tensor::empty(gpu, &[m, n], a.dtype(), "bench.c")?;
            // The f32 kernel at each slab depth, then the cooperative-matrix one (f16x3,
            // f16 operands) where the adapter has it.
            let mut tunings: Vec<matmul::Tuning> = (args.bk.iter())
                .map(|&bk| matmul::Tuning {
                    bk,
                    mode: Some(MatmulMode::F32),
                })
                .collect();
            if gpu.coop_matmul_possible() {
                for mode in [MatmulMode::F16x3, MatmulMode::F16] {
                    tunings.push(matmul::Tuning {
                        bk: 16,
                        mode: Some(mode),
                    });
                }
            }
            for tuning in tunings {
                let (wall, g) = time(gpu, args, &mut trace, |rec| {
                    matmul::matmul_into_tuned(rec, &a, &b, &c, None, opts, 0.0, tuning)
                })?;
                let flops = 2.0 * (m * n * k) as f64;
                let t = g.unwrap_or(wall);
                rows.push(Row {
                    name: match tuning.mode {
                        Some(MatmulMode::F16) => {
                            "matmul, f16 operands (cooperative matrices)".into()
                        }
                        Some(MatmulMode::F16x3) => {
                            "matmul, f16x3 (cooperative matrices, split operands)".into()
                        }
                        _ => format!("matmul f32 (bk {})", tuning.bk),
                    },
                    shape: format!(
                        "{m}x{n}x{k}{}{}",
                        if opts.trans_a { ":ta" } else { "" },
                        if opts.trans_b { ":tb" } else { "" }
                    ),
                    wall_ms: wall,
                    gpu_ms: g,
                    value: flops / t / 1e9,
                    unit: "TFLOP/s",
                    tflop_s: None,
                });
            }
        }
    }
    if matches!(args.which, Which::All | Which::Kernels) {
        kernels(gpu, args, &mut trace, &mut rows)?;
    }
    if args.which == Which::Qmatmul {
        qmatmul(gpu, args, &mut trace, &mut rows)?;
    }
    report(gpu, args, &rows, &trace)
}

/// One quantized product to time (`--qshape`).
struct QCase {
    ty: &'static str,
    m: usize,
    n: usize,
    k: usize,
    glu: bool,
}

/// `--qshape`: "TYPE:MxNxK[:glu]".
fn parse_qshape(spec: &str) -> doppler::Result<QCase> {
    use doppler::formats::gguf::GgmlType;
    let bad = |why: &str| doppler::Error::Invalid {
        op: "bench qmatmul",
        detail: format!(
            "--qshape {spec:?}: {why} (expected TYPE:MxNxK[:glu], e.g. q4_k:32x28672x4096:glu)"
        ),
    };
    let parts: Vec<&str> = spec.split(':').collect();
    if parts.len() < 2 || parts.len() > 3 {
        return Err(bad("wrong number of fields"));
    }
    let types = doppler::ops::quant::SUPPORTED;
    let ty = types
        .iter()
        .find(|t| t.eq_ignore_ascii_case(parts[0]))
        .copied()
        .ok_or_else(|| {
            bad(&format!(
                "type {:?} is not one of {}",
                parts[0],
                types.join(", ")
            ))
        })?;
    let dims: Vec<usize> = parts[1]
        .split('x')
        .map(|d| d.parse().map_err(|_| bad("dimensions are not numbers")))
        .collect::<doppler::Result<_>>()?;
    let [m, n, k] = dims[..] else {
        return Err(bad("three dimensions are needed"));
    };
    let glu = match parts.get(2) {
        None => false,
        Some(&"glu") => true,
        Some(_) => return Err(bad("the only flag is glu")),
    };
    let per = GgmlType::from_name(ty)
        .and_then(|t| t.block())
        .map_or(1, |b| b.0 as usize);
    if m == 0 || n == 0 || k == 0 || k % per != 0 || k % 4 != 0 || (glu && n % 2 != 0) {
        return Err(bad(&format!(
            "dimensions must be positive, K whole {ty} blocks of {per} and a multiple of 4, N even with glu"
        )));
    }
    Ok(QCase { ty, m, n, k, glu })
}

/// Each `--qshape` as serving's batch-invariant product (x rounded to f16, the skinny
/// cooperative kernel where the adapter has cooperative matrices, its split-k sum or GLU
/// pass) and as the default path, then W's bytes read by `sum_words` alone: the rate a
/// product reading each weight once could reach.
fn qmatmul(
    gpu: &Gpu,
    args: &BenchArgs,
    trace: &mut doppler::gpu::Trace,
    rows: &mut Vec<Row>,
) -> doppler::Result<()> {
    use doppler::formats::gguf::GgmlType;
    use doppler::gpu::DType;
    use doppler::ops::{quant, reduce};
    let specs = if args.qshape.is_empty() {
        // Llama-3-8B's layer at 32 rows: q/k/v, o, gate/up, down.
        [
            "32x6144x4096",
            "32x4096x4096",
            "32x28672x4096:glu",
            "32x4096x14336",
        ]
        .map(|s| format!("q4_k:{s}"))
        .to_vec()
    } else {
        args.qshape.clone()
    };
    for spec in &specs {
        let QCase { ty, m, n, k, glu } = parse_qshape(spec)?;
        let mut rng = Rng::new(5);
        let blocks = doppler::verify::quant::random_blocks(ty, n * k, &mut rng);
        let gty = GgmlType::from_name(ty).expect("listed type");
        let w = quant::QMatrix::new(gpu, "bench.w", &blocks, gty, n, k)?;
        let x = Tensor::from_f32(gpu, &[m, k], &rng.vec(m * k), "bench.x")?;
        let bytes = w.file_bytes() as f64;
        let flops = 2.0 * (m * n * k) as f64;
        let shape = format!("{ty} {m}x{n}x{k}{}", if glu { " glu" } else { "" });
        // Invariant on cooperative matrices where they run, off them (`qmatvec_rows`, the
        // small models' batched steps) there too, then the default path.
        let coop = quant::invariant_on_coop(gpu, k);
        let cases: &[(bool, bool)] = if coop {
            &[(true, false), (true, true), (false, false)]
        } else {
            &[(true, false), (false, false)]
        };
        for &(invariant, simt) in cases {
            let fuse = quant::Fuse {
                swiglu: glu,
                invariant,
                simt,
                ..Default::default()
            };
            let (wall, g) = time(gpu, args, trace, |rec| {
                quant::qmatmul_fused(rec, &x, &w, fuse).map(drop)
            })?;
            let t = g.unwrap_or(wall);
            rows.push(Row {
                name: format!(
                    "qmatmul, {}",
                    // (Off cooperative matrices the invariant product is a SIMT kernel.)
                    match (invariant, simt || !coop) {
                        (false, _) => "default path",
                        (true, false) => "invariant (cooperative)",
                        _ if k % 32 != 0 => "invariant (qmatvec)",
                        _ => "invariant (qmatvec_rows)",
                    }
                ),
                shape: shape.clone(),
                wall_ms: wall,
                gpu_ms: g,
                value: bytes / t / 1e6,
                unit: "GB/s of W",
                tflop_s: Some(flops / t / 1e9),
            });
        }
        // W's bytes (whole 16-byte words) read and summed, nothing else.
        let dep = Tensor::from_u32(gpu, &[1], &[0], "bench.dep")?;
        let out = Tensor::empty(gpu, &[reduce::WORDS_GROUPS], DType::U32, "bench.sum")?;
        let read = (w.raw.byte_size().min(w.file_bytes()) / 16 * 16).max(16);
        let (wall, g) = time(gpu, args, trace, |rec| {
            reduce::sum_words_into(rec, (&w.raw, read), None, &dep, &out).map(drop)
        })?;
        let t = g.unwrap_or(wall);
        rows.push(Row {
            name: "W read alone (sum_words)".into(),
            shape,
            wall_ms: wall,
            gpu_ms: g,
            value: read as f64 / t / 1e6,
            unit: "GB/s of W",
            tflop_s: None,
        });
    }
    Ok(())
}

/// One product to time: C (M x N) = op(A) @ op(B) with inner size K.
struct MatmulCase {
    m: usize,
    n: usize,
    k: usize,
    opts: matmul::MatmulOpts,
}

/// `--shape`: "MxNxK[:ta][:tb]", or "gpt2": the forward (x W^T), input-gradient (g W) and
/// weight-gradient (g^T x) products of a GPT-2-124M step at 8 x 1024 tokens, one of each
/// (q/k/v/o, fc, proj, head).
fn parse_shapes(spec: &str) -> doppler::Result<Vec<MatmulCase>> {
    let case = |m, n, k, trans_a, trans_b| MatmulCase {
        m,
        n,
        k,
        opts: matmul::MatmulOpts {
            trans_a,
            trans_b,
            alpha: 1.0,
        },
    };
    if spec == "gpt2" {
        let (rows, c, f, v) = (8192, 768, 3072, 50304);
        let mut out = Vec::new();
        for (din, dout) in [(c, c), (c, f), (f, c), (c, v)] {
            out.push(case(rows, dout, din, false, true)); // forward
            out.push(case(rows, din, dout, false, false)); // dx
            out.push(case(dout, din, rows, true, false)); // dW
        }
        return Ok(out);
    }
    let bad = || doppler::Error::Invalid {
        op: "bench matmul",
        detail: format!("--shape {spec:?}: expected MxNxK with optional :ta and :tb, or gpt2"),
    };
    let mut parts = spec.split(':');
    let dims: Vec<usize> = parts
        .next()
        .unwrap_or("")
        .split('x')
        .map(|d| d.parse().map_err(|_| bad()))
        .collect::<doppler::Result<_>>()?;
    let [m, n, k] = dims[..] else {
        return Err(bad());
    };
    if m == 0 || n == 0 || k == 0 {
        return Err(bad());
    }
    let (mut ta, mut tb) = (false, false);
    for flag in parts {
        match flag {
            "ta" => ta = true,
            "tb" => tb = true,
            _ => return Err(bad()),
        }
    }
    Ok(vec![case(m, n, k, ta, tb)])
}

/// Chains of `LAUNCH_CHAIN` scale dispatches over 256 floats, submitted at once: each
/// reading the one before (dependent) or its own input (independent). Median wall time
/// per dispatch over `repeat` submissions after a warm-up.
fn launch(gpu: &Gpu, args: &BenchArgs, rows: &mut Vec<Row>) -> doppler::Result<()> {
    const LAUNCH_CHAIN: usize = 1000;
    let n = 256;
    let bufs: Vec<Tensor> = (0..2)
        .map(|i| Tensor::from_f32(gpu, &[n], &vec![1.0; n], &format!("bench.launch{i}")))
        .collect::<doppler::Result<_>>()?;
    let outs: Vec<Tensor> = (0..LAUNCH_CHAIN)
        .map(|_| Tensor::empty(gpu, &[n], doppler::gpu::DType::F32, "bench.launch.out"))
        .collect::<doppler::Result<_>>()?;
    for dependent in [true, false] {
        // Wall time of recording, submitting and running the chain; and the GPU's time from
        // its first dispatch's start to its last one's end (timestamps, where the adapter has
        // them): the GPU's own cost of a dispatch after the one before.
        let (mut per, mut per_gpu) = (Vec::new(), Vec::new());
        for r in 0..=args.repeat {
            let mut rec = gpu.timed_recorder("bench.launch");
            for i in 0..LAUNCH_CHAIN {
                if dependent {
                    elementwise::scale_into(&mut rec, &bufs[i % 2], 1.0, &bufs[(i + 1) % 2])?;
                } else {
                    elementwise::scale_into(&mut rec, &bufs[0], 1.0, &outs[i])?;
                }
            }
            let t = Instant::now();
            let trace = rec.submit()?.wait(gpu)?;
            if r > 0 {
                per.push(t.elapsed().as_secs_f64() * 1e3 / LAUNCH_CHAIN as f64);
                per_gpu.extend(
                    trace
                        .events
                        .iter()
                        .map(|e| e.dur_ns / 1e6 / LAUNCH_CHAIN as f64),
                );
            }
        }
        let ms = median(&mut per);
        let gpu_ms = (!per_gpu.is_empty()).then(|| median(&mut per_gpu));
        rows.push(Row {
            name: format!(
                "dispatch, {}",
                if dependent {
                    "each reading the one before"
                } else {
                    "independent"
                }
            ),
            shape: format!("{LAUNCH_CHAIN} x scale of {n} floats, one submission"),
            wall_ms: ms,
            gpu_ms,
            value: gpu_ms.unwrap_or(ms) * 1e3,
            unit: "µs",
            tflop_s: None,
        });
    }
    Ok(())
}

fn report(
    gpu: &Gpu,
    args: &BenchArgs,
    rows: &[Row],
    trace: &doppler::gpu::Trace,
) -> doppler::Result<ExitCode> {
    if let Some(path) = &args.trace {
        trace.write_chrome_json(path)?;
    }
    let command: Vec<String> = std::env::args().collect();
    if args.json {
        let v = serde_json::json!({
            "adapter": gpu.info.name, "backend": format!("{:?}", gpu.info.backend), "driver": gpu.info.driver_info,
            "command": command.join(" "), "repeat": args.repeat, "batch": args.batch, "results": rows,
            "kernels": trace.by_kernel(),
        });
        println!("{}", serde_json::to_string_pretty(&v).unwrap());
    } else {
        match args.which {
            Which::Train => println!(
                "adapter: {} ({:?}), median of {} steps after 2 warm-up steps",
                gpu.info.name, gpu.info.backend, args.steps
            ),
            _ => println!(
                "adapter: {} ({:?}), median of {} batches of {}",
                gpu.info.name, gpu.info.backend, args.repeat, args.batch
            ),
        }
        println!(
            "{:<30} {:<26} {:>10} {:>10} {:>12}",
            "bench", "shape", "wall ms", "gpu ms", "throughput"
        );
        for r in rows {
            let g = r.gpu_ms.map_or("-".to_string(), |g| format!("{g:.4}"));
            let rate = r
                .tflop_s
                .map_or(String::new(), |f| format!(" ({f:.1} TFLOP/s)"));
            println!(
                "{:<30} {:<26} {:>10.4} {:>10} {:>9.3} {}{rate}",
                r.name, r.shape, r.wall_ms, g, r.value, r.unit
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
