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
    /// Stop after this many steps in this process (the run can be resumed later; 0: a
    /// fresh run writes its initial weights as the step-0 checkpoint).
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
    let unit = match trainer.task {
        doppler::train::Task::Text { .. } => "tokens",
        doppler::train::Task::Images { .. } => "images",
    };
    let mut on_event = |e: Event<'_>| {
        if let Event::Step(s) = &e {
            steps.push((*s).clone());
        }
        if json {
            let v = match e {
                Event::Started {
                    params,
                    outputs,
                    train_items,
                    val_items,
                    unit,
                    start_step,
                    steps,
                } => {
                    let mut v = serde_json::json!({
                        "event": "start", "params": params, "start_step": start_step, "steps": steps });
                    // "vocab", "train_tokens", "val_tokens" or "classes", "train_images", ...
                    let outputs_name = if unit == "tokens" { "vocab" } else { "classes" };
                    v[outputs_name] = outputs.into();
                    v[format!("train_{unit}")] = train_items.into();
                    v[format!("val_{unit}")] = val_items.into();
                    v
                }
                Event::Step(s) => serde_json::json!({ "event": "step", "step": s }),
                Event::Eval {
                    step,
                    val_loss,
                    val_accuracy,
                } => {
                    serde_json::json!({ "event": "eval", "step": step, "val_loss": val_loss, "val_accuracy": val_accuracy })
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
                outputs,
                train_items,
                val_items,
                unit,
                start_step,
                steps,
            } => {
                let outputs = match unit {
                    "tokens" => format!("vocabulary {outputs}"),
                    _ => format!("{outputs} classes"),
                };
                eprintln!("model: {params} parameters, {outputs}; data: {train_items} training / {val_items} validation {unit}");
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
                    "loss {:.4}  lr {:.2e}  {:.0} {}/s{}",
                    s.loss,
                    s.lr,
                    s.items_per_s,
                    unit,
                    if s.skipped {
                        "  (overflow: step skipped)"
                    } else {
                        ""
                    }
                ));
            }
            Event::Eval {
                step,
                val_loss,
                val_accuracy,
            } => bar.println(format!(
                "step {step}: validation loss {val_loss:.4}{}",
                val_accuracy.map_or(String::new(), |a| format!(", accuracy {:.2}%", a * 100.0))
            )),
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
        let accuracy = summary
            .final_val_accuracy
            .map_or(String::new(), |a| format!(" (accuracy {:.2}%)", a * 100.0));
        eprintln!(
            "done: steps {} -> {}, validation loss {first} -> {:.4}{accuracy}, {:.0} {unit}/s, {:.1} s; checkpoint {}",
            summary.start_step,
            summary.steps,
            summary.final_val_loss,
            summary.items_per_s,
            summary.seconds,
            summary.checkpoint.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}
