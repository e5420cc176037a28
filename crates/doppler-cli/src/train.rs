//! `doppler train` and `doppler sample`.

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
    /// rate) to this SafeTensors file, for a replay in PyTorch: bench/torch_parity.py
    /// (transformers), bench/torch_convnet.py (conv nets).
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

#[derive(clap::Args)]
pub struct SampleArgs {
    /// A U-Net's run directory or checkpoint (`doppler train` with `arch = "unet"`).
    #[arg(long)]
    checkpoint: PathBuf,
    /// The class to draw (0 .. the config's classes).
    #[arg(long)]
    class: usize,
    /// Images to draw.
    #[arg(short, default_value_t = 16)]
    n: usize,
    /// The PNG grid to write (written atomically).
    #[arg(short, long, default_value = "grid.png")]
    output: PathBuf,
    /// Seed of the starting noise and of every step's noise.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Each image's pixels drawn as squares of this many pixels.
    #[arg(long, default_value_t = 4)]
    scale: usize,
    /// One JSON object at the end (output path, grid size, seconds) instead of text.
    #[arg(long)]
    json: bool,
}

pub fn sample(gpu: &Gpu, args: &SampleArgs) -> doppler::Result<ExitCode> {
    let bad = |detail: String| doppler::Error::Invalid {
        op: "sample",
        detail,
    };
    if !(1..=4096).contains(&args.n) || !(1..=64).contains(&args.scale) {
        return Err(bad(format!(
            "-n {} must be in 1..=4096 and --scale {} in 1..=64",
            args.n, args.scale
        )));
    }
    let model = doppler::train::load_conv(gpu, &args.checkpoint)?;
    let [c, h, w] = model.cfg.image_shape();
    if c != 1 && c != 3 {
        return Err(bad(format!(
            "a PNG grid needs 1 or 3 channels, the model's images have {c}"
        )));
    }
    // The grid's size, refused before any sampling work when too large.
    let cols = (args.n as f64).sqrt().ceil() as usize;
    let gw = cols * (w * args.scale + 2) + 2;
    let gh = args.n.div_ceil(cols) * (h * args.scale + 2) + 2;
    if gw * gh * c > 1 << 28 || gw.max(gh) > 1 << 16 {
        return Err(bad(format!(
            "a grid of {} images of {h}x{w} at --scale {} is {gw}x{gh} pixels: at most 65536 a side and 256 MiB",
            args.n, args.scale
        )));
    }
    let t0 = std::time::Instant::now();
    let bar = match args.json {
        true => ProgressBar::hidden(),
        false => ProgressBar::new(model.cfg.steps() as u64).with_style(
            ProgressStyle::with_template(
                "{bar:30} step {pos}/{len} [{elapsed_precise} < {eta_precise}]",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        ),
    };
    let images = pollster::block_on(model.sample_async(
        gpu,
        args.class,
        args.n,
        args.seed,
        &mut |done, _| bar.set_position(done as u64),
    ))?;
    bar.finish_and_clear();
    let (png, width, height) = grid_png(&images, args.n, [c, h, w], args.scale)?;
    doppler::train::checkpoint::write_atomic(&args.output, &png)?;
    let seconds = t0.elapsed().as_secs_f64();
    if args.json {
        println!(
            "{}",
            serde_json::json!({ "output": args.output, "class": args.class, "n": args.n,
                "width": width, "height": height, "steps": model.cfg.steps(), "seconds": seconds })
        );
    } else {
        eprintln!(
            "{} images of class {} ({} steps, {seconds:.1} s): {} ({width}x{height})",
            args.n,
            args.class,
            model.cfg.steps(),
            args.output.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `n` images (N, C, H, W) in [-1, 1] as a PNG: ceil(sqrt(n)) to a row, each pixel a
/// `scale` x `scale` square, 2-pixel grey gaps. (bytes, width, height)
fn grid_png(
    images: &[f32],
    n: usize,
    [c, h, w]: [usize; 3],
    scale: usize,
) -> doppler::Result<(Vec<u8>, usize, usize)> {
    let cols = (n as f64).sqrt().ceil() as usize;
    let rows = n.div_ceil(cols);
    let gap = 2;
    let (cw, ch) = (w * scale + gap, h * scale + gap);
    let (width, height) = (cols * cw + gap, rows * ch + gap);
    let mut px = vec![128u8; width * height * c];
    for i in 0..n {
        let (ox, oy) = (gap + (i % cols) * cw, gap + (i / cols) * ch);
        for y in 0..h * scale {
            for x in 0..w * scale {
                for k in 0..c {
                    let v = images[((i * c + k) * h + y / scale) * w + x / scale];
                    let byte = ((v as f64 + 1.0) * 127.5).round().clamp(0.0, 255.0) as u8;
                    px[((oy + y) * width + ox + x) * c + k] = byte;
                }
            }
        }
    }
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, width as u32, height as u32);
    enc.set_color(if c == 1 {
        png::ColorType::Grayscale
    } else {
        png::ColorType::Rgb
    });
    enc.set_depth(png::BitDepth::Eight);
    let err = |e: png::EncodingError| doppler::Error::Invalid {
        op: "sample",
        detail: format!("PNG: {e}"),
    };
    let mut writer = enc.write_header().map_err(err)?;
    writer.write_image_data(&px).map_err(err)?;
    writer.finish().map_err(err)?;
    Ok((out, width, height))
}
