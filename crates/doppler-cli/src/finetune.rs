//! `doppler finetune`: LoRA on a pretrained model from a TOML config.

use std::path::PathBuf;
use std::process::ExitCode;

use doppler::finetune::{config::FinetuneConfig, Finetuner, FtEvent};
use doppler::gpu::Gpu;
use indicatif::{ProgressBar, ProgressStyle};

#[derive(clap::Args)]
pub struct FinetuneArgs {
    /// The run: base model, data, LoRA and training settings (TOML; see
    /// configs/finetune_smollm2.toml).
    #[arg(long)]
    config: PathBuf,
    /// The base model instead of the config's `base` (a .gguf or a Hugging Face directory).
    #[arg(long)]
    base: Option<PathBuf>,
    /// Continue the run from the latest checkpoint in the config's out_dir (bit for bit
    /// as if it had not stopped).
    #[arg(long)]
    resume: bool,
    /// Stop after this many steps (the schedule stays the config's).
    #[arg(long)]
    max_steps: Option<u64>,
    /// One JSON object per event on stdout instead of a progress bar.
    #[arg(long)]
    json: bool,
}

pub fn finetune(gpu: &Gpu, args: &FinetuneArgs) -> doppler::Result<ExitCode> {
    let mut cfg = FinetuneConfig::load(&args.config)?;
    if let Some(b) = &args.base {
        cfg.base = b.clone();
    }
    let mut ft = Finetuner::new(gpu, &cfg, args.resume)?;
    let bar = ProgressBar::hidden();
    let ft_step = ft.step;
    let json = args.json;
    let mut on_event = |e: FtEvent<'_>| {
        if json {
            let v = match e {
                FtEvent::Started {
                    base_bytes,
                    adapter_params,
                    train_samples,
                    eval_samples,
                    truncated,
                    steps,
                } => serde_json::json!({"event": "start", "base_bytes": base_bytes,
                    "adapter_params": adapter_params, "train_samples": train_samples,
                    "eval_samples": eval_samples, "truncated": truncated, "steps": steps}),
                FtEvent::Step(s) => serde_json::json!({"event": "step", "step": s}),
                FtEvent::Eval { step, eval_loss } => {
                    serde_json::json!({"event": "eval", "step": step, "eval_loss": eval_loss})
                }
                FtEvent::Saved { step, dir } => {
                    serde_json::json!({"event": "saved", "step": step, "dir": dir})
                }
            };
            println!("{v}");
            return;
        }
        match e {
            FtEvent::Started {
                base_bytes,
                adapter_params,
                train_samples,
                eval_samples,
                truncated,
                steps,
            } => {
                eprintln!(
                    "base: {:.1} MB of weights (frozen); adapters: {adapter_params} parameters; data: {train_samples} training / {eval_samples} held-out samples",
                    base_bytes as f64 / 1e6
                );
                if ft_step > 0 {
                    eprintln!("resuming at step {ft_step}");
                }
                if truncated > 0 {
                    eprintln!(
                        "{truncated} samples longer than seq_len {} were truncated",
                        cfg.train.seq_len
                    );
                }
                bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
                bar.set_length(steps);
                bar.set_position(ft_step);
                bar.set_style(
                    ProgressStyle::with_template(
                        "{bar:30} {pos}/{len} {msg} [{elapsed_precise} < {eta_precise}]",
                    )
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
                );
            }
            FtEvent::Step(s) => {
                bar.set_position(s.step);
                bar.set_message(format!(
                    "loss {:.4}  lr {:.2e}  {:.0} tok/s",
                    s.loss, s.lr, s.tokens_per_s
                ));
            }
            FtEvent::Eval { step, eval_loss } => {
                bar.println(format!("step {step}: held-out loss {eval_loss:.4}"))
            }
            FtEvent::Saved { step, dir } => {
                bar.println(format!("step {step}: adapter written to {}", dir.display()))
            }
        }
    };
    let stop = args.max_steps.unwrap_or(u64::MAX);
    let (loss, eval) = ft.run(stop, &mut on_event)?;
    bar.finish_and_clear();
    let out = cfg.out_dir.join("adapter");
    if json {
        println!(
            "{}",
            serde_json::json!({"event": "done", "final_loss": loss, "final_eval_loss": eval, "adapter": out})
        );
    } else {
        eprintln!(
            "done: loss {loss:.4}{}; adapter (PEFT format) in {}",
            eval.map_or(String::new(), |v| format!(", held-out {v:.4}")),
            out.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}
