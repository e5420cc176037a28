//! `doppler bench finetune`: LoRA fine-tuning steps as `doppler finetune` runs them, on
//! synthetic weights of a preset's shapes (random blocks of its file types) or a model
//! file, over made-up text rows that fill the sequence (every token learned): tokens/s (the
//! median of the timed steps after two warm-up steps) and the most bytes Doppler's buffer
//! pool held (the frozen base included).

use std::path::PathBuf;
use std::process::ExitCode;

use doppler::finetune::{config::FinetuneConfig, Finetuner};
use doppler::gpu::Gpu;
use doppler::infer::Model;
use doppler::models::llama::Llama;

/// What `bench finetune` runs (from `doppler bench`'s arguments).
pub struct FtBenchArgs {
    pub model: Option<PathBuf>,
    pub preset: String,
    pub batch: usize,
    pub seq: usize,
    pub rank: usize,
    pub steps: usize,
    pub recompute: bool,
    pub json: bool,
}

pub fn run(gpu: &Gpu, a: &FtBenchArgs) -> doppler::Result<ExitCode> {
    let t0 = std::time::Instant::now();
    let (model, label) = match &a.model {
        Some(p) => (Model::open(gpu, p, a.seq)?, p.display().to_string()),
        None => {
            let s = crate::bench_generate::Synthetic::preset(&a.preset)?;
            let llama = Llama::load(gpu, s.cfg.clone(), &s, a.seq)?;
            // A byte-level vocabulary (the tiny test model's) for the made-up text.
            let tiny = doppler::verify::llama::tiny_files("llama", "F32", 0)?;
            let file = doppler::formats::gguf::GgufFile::from_bytes(Box::new(tiny.gguf), "tiny")?;
            let tokenizer =
                doppler::infer::tokenizer::Tokenizer::from_gguf(&file.gguf.metadata, "tiny")?;
            let model = Model {
                llama,
                tokenizer,
                template: None,
                load_ms: 0.0,
            };
            (model, format!("synthetic {}", a.preset))
        }
    };
    gpu.wait()?;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    // Rows of words, each longer than the sequence (truncated to it): every token learned.
    let rows = a.batch * (a.steps + 2);
    let words = [
        "river", "stone", "light", "cloud", "field", "green", "north", "quiet",
    ];
    let lines: Vec<String> = (0..rows)
        .map(|r| {
            let text: Vec<&str> = (0..a.seq)
                .map(|i| words[(r * 7 + i * 3) % words.len()])
                .collect();
            serde_json::json!({ "text": text.join(" ") }).to_string()
        })
        .collect();
    let toml = format!(
        "base = \"bench\"\ndata = \"bench.jsonl\"\neval_fraction = 0.0\nout_dir = \"bench\"\n\
         [lora]\nrank = {}\nalpha = {}\ndropout = 0.05\n\
         [train]\nseq_len = {}\nbatch_size = {}\nsteps = {}\nlr = 1e-4\nrecompute = {}\n",
        a.rank,
        2 * a.rank,
        a.seq,
        a.batch,
        a.steps + 2,
        a.recompute
    );
    let cfg = FinetuneConfig::parse(&toml, "bench finetune")?;
    let mut ft = Finetuner::from_parts(gpu, &cfg, model, &lines.join("\n"), None)?;
    let mut steps = Vec::new();
    for _ in 0..a.steps + 2 {
        steps.push(ft.train_step()?);
    }
    let mut tps: Vec<f64> = steps[2..].iter().map(|s| s.tokens_per_s).collect();
    tps.sort_by(f64::total_cmp);
    let median = tps[tps.len() / 2];
    let peak = gpu.pool.stats().peak_bytes;
    let c = &ft.model.llama.cfg;
    let v = serde_json::json!({
        "model": label,
        "device": gpu.info.name,
        "layers": c.n_layer, "width": c.n_embd, "vocab": c.vocab_size,
        "base_bytes": ft.model.llama.weight_bytes,
        "adapter_params": ft.lora.params.numel(),
        "rank": a.rank, "batch": a.batch, "seq": a.seq, "recompute": a.recompute,
        "load_ms": load_ms,
        "tokens_per_s_median": median,
        "tokens_per_s": tps,
        "pool_peak_bytes": peak,
        "losses": steps.iter().map(|s| s.loss).collect::<Vec<_>>(),
    });
    if a.json {
        println!("{v}");
    } else {
        println!(
            "{label}: LoRA rank {} on all seven projections, batch {} x {} tokens, recompute {}\n  \
             {:.0} tokens/s (median of {} steps), pool peak {:.2} GB (base {:.2} GB)",
            a.rank,
            a.batch,
            a.seq,
            a.recompute,
            median,
            tps.len(),
            peak as f64 / 1e9,
            ft.model.llama.weight_bytes as f64 / 1e9
        );
    }
    Ok(ExitCode::SUCCESS)
}
