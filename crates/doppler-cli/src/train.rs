//! `doppler train` and `doppler generate --checkpoint`.

use std::path::PathBuf;
use std::process::ExitCode;

use doppler::gpu::Gpu;
use doppler::train::{config::TrainConfig, Event, Trainer};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(clap::Args)]
pub struct TrainArgs {
    /// The run: model, data and training settings (TOML; see configs/).
    #[arg(long)]
    config: PathBuf,
    /// Continue from the newest checkpoint in the config's out_dir.
    #[arg(long)]
    resume: bool,
    /// Stop after this many steps in this process (the run can be resumed later).
    #[arg(long)]
    max_steps: Option<u64>,
    /// One JSON object per event on stdout instead of a progress bar.
    #[arg(long)]
    json: bool,
    /// Time every kernel of every training step: Chrome trace JSON to this file, and the
    /// slowest kernels printed at the end.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Write the batches this process trained on (with each step's loss and learning
    /// rate) to this SafeTensors file, for a replay in PyTorch: bench/torch_parity.py.
    #[arg(long, value_name = "FILE")]
    dump_batches: Option<PathBuf>,
}

pub fn train(gpu: &Gpu, args: &TrainArgs) -> doppler::Result<ExitCode> {
    let cfg = TrainConfig::load(&args.config)?;
    let mut trainer = Trainer::new(gpu, &cfg, args.resume)?;
    if args.trace.is_some() {
        trainer.trace = Some(Default::default());
    }
    // --max-steps stops early (with a checkpoint) but keeps the full run's schedule.
    let stop = args.max_steps.map_or(u64::MAX, |n| trainer.step + n);
    let mut steps = Vec::new();
    let code = run_until(&mut trainer, stop, args.json, &mut steps)?;
    if let Some(path) = &args.dump_batches {
        let bytes = trainer.batches_safetensors(&steps)?;
        doppler::train::checkpoint::write_atomic(path, &bytes)?;
        if !args.json {
            eprintln!(
                "batches of {} steps written to {}",
                steps.len(),
                path.display()
            );
        }
    }
    if let (Some(path), Some(trace)) = (&args.trace, &trainer.trace) {
        trace.write_chrome_json(path)?;
        let total: f64 = trace.events.iter().map(|e| e.dur_ns).sum();
        eprintln!(
            "{} dispatches, {:.1} ms of GPU time; slowest kernels:",
            trace.events.len(),
            total / 1e6
        );
        for k in trace.by_kernel().iter().take(15) {
            eprintln!("  {:>9.2} ms {:>6}x  {}", k.total_ns / 1e6, k.count, k.name);
        }
    }
    Ok(code)
}

/// Trains to `stop`, showing progress; `steps` receives every step's record.
fn run_until(
    trainer: &mut Trainer<'_>,
    stop: u64,
    json: bool,
    steps: &mut Vec<doppler::train::StepInfo>,
) -> doppler::Result<ExitCode> {
    let bar = ProgressBar::hidden();
    let mut on_event = |e: Event<'_>| {
        if let Event::Step(s) = &e {
            steps.push((*s).clone());
        }
        if json {
            let v = match e {
                Event::Started {
                    params,
                    vocab,
                    train_tokens,
                    val_tokens,
                    start_step,
                    steps,
                } => serde_json::json!({
                    "event": "start", "params": params, "vocab": vocab, "train_tokens": train_tokens,
                    "val_tokens": val_tokens, "start_step": start_step, "steps": steps }),
                Event::Step(s) => serde_json::json!({ "event": "step", "step": s }),
                Event::Eval { step, val_loss } => {
                    serde_json::json!({ "event": "eval", "step": step, "val_loss": val_loss })
                }
                Event::Checkpoint { step, dir } => {
                    serde_json::json!({ "event": "checkpoint", "step": step, "dir": dir })
                }
            };
            println!("{v}");
            return;
        }
        match e {
            Event::Started {
                params,
                vocab,
                train_tokens,
                val_tokens,
                start_step,
                steps,
            } => {
                eprintln!("model: {params} parameters, vocabulary {vocab}; data: {train_tokens} training / {val_tokens} validation tokens");
                bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
                bar.set_length(steps);
                bar.set_position(start_step);
                bar.set_style(
                    ProgressStyle::with_template(
                        "{bar:30} {pos}/{len} {msg} [{elapsed_precise} < {eta_precise}]",
                    )
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
                );
            }
            Event::Step(s) => {
                bar.set_position(s.step);
                bar.set_message(format!(
                    "loss {:.4}  lr {:.2e}  {:.0} tok/s{}",
                    s.loss,
                    s.lr,
                    s.tokens_per_s,
                    if s.skipped {
                        "  (overflow: step skipped)"
                    } else {
                        ""
                    }
                ));
            }
            Event::Eval { step, val_loss } => {
                bar.println(format!("step {step}: validation loss {val_loss:.4}"))
            }
            Event::Checkpoint { step, dir } => {
                bar.println(format!("step {step}: checkpoint {}", dir.display()))
            }
        }
    };
    let summary = trainer.run(stop, &mut on_event)?;
    bar.finish_and_clear();
    if json {
        println!(
            "{}",
            serde_json::json!({ "event": "done", "summary": summary })
        );
    } else {
        let first = summary
            .first_val_loss
            .map_or("-".into(), |v| format!("{v:.4}"));
        eprintln!(
            "done: steps {} -> {}, validation loss {first} -> {:.4}, {:.0} tokens/s, {:.1} s; checkpoint {}",
            summary.start_step,
            summary.steps,
            summary.final_val_loss,
            summary.tokens_per_s,
            summary.seconds,
            summary.checkpoint.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}
