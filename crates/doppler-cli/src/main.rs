//! `doppler`: run and check neural-network kernels on your GPU through WebGPU.

mod bench;
mod bench_finetune;
mod bench_generate;
mod embed;
mod export;
mod finetune;
mod generate;
mod inspect;
mod serve;
mod train;

use clap::{Parser, Subcommand};
use doppler::gpu::{Gpu, GpuOptions, MatmulMode};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "doppler",
    version,
    about = "WebGPU runtime for running and training neural networks on your own GPU"
)]
struct Cli {
    /// Adapter to use: a case-insensitive part of its name (see `doppler info`).
    #[arg(long, global = true, env = "DOPPLER_ADAPTER")]
    adapter: Option<String>,
    /// Backend to use: vulkan, metal, dx12 or webgpu.
    #[arg(long, global = true, env = "DOPPLER_BACKEND")]
    backend: Option<String>,
    /// Matrix products: f32 arithmetic; f16x3, f32 operands on tensor cores where the
    /// adapter has them (cooperative matrices), each split into two f16 halves, three
    /// products, f32 sums: close to f32 (22 of 24 bits an operand), f32's range; or f16,
    /// operands rounded to f16 with f32 sums (also training's attention), like PyTorch's
    /// TF32: fastest, ~3 decimal digits an operand; training then needs train.loss_scale =
    /// "dynamic".
    #[arg(long, global = true, env = "DOPPLER_MATMUL", value_parser = MatmulMode::NAMES)]
    matmul: Option<String>,
    /// More log output (-v info, -vv debug); RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show the adapter: name, backend, driver, features and key limits.
    Info {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Check every kernel against the CPU reference on this adapter.
    Verify {
        /// Only checks whose op name contains this.
        #[arg(long)]
        filter: Option<String>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Measure copy bandwidth and matmul throughput.
    Bench(bench::BenchArgs),
    /// Train a transformer or a conv net from a TOML config (progress, validation,
    /// checkpoints, loss curve).
    Train(train::TrainArgs),
    /// Draw images of a class from a trained U-Net checkpoint (DDPM), as a PNG grid.
    Sample(train::SampleArgs),
    /// Fine-tune a pretrained model with LoRA from a TOML config (the base stays frozen in
    /// its encoding; writes a PEFT adapter, metrics.jsonl and loss.svg).
    Finetune(finetune::FinetuneArgs),
    /// Write a model as a Hugging Face SafeTensors directory, a LoRA adapter merged in.
    Export(export::ExportArgs),
    /// Generate text from a model file (GGUF, SafeTensors) or a training checkpoint (streams).
    Generate(generate::GenerateArgs),
    /// Chat with a model interactively (keeps the conversation in the KV cache).
    Chat(generate::ChatArgs),
    /// Serve a model over HTTP with OpenAI's API (/v1/chat/completions, /v1/completions,
    /// /v1/models, /health, /metrics).
    Serve(serve::ServeArgs),
    /// Print a GGUF model's metadata and tensor table (needs no GPU).
    Inspect(inspect::InspectArgs),
    /// Sentence vectors from a BERT-family encoder (sentence-transformers directories).
    Embed(embed::EmbedArgs),
}

fn main() -> ExitCode {
    // Mesa's Vulkan drivers ask libwayland for a display as the instance starts; without
    // XDG_RUNTIME_DIR (a headless machine, CI, a container) libwayland printed "error:
    // XDG_RUNTIME_DIR is invalid or not set in the environment." twice on every command.
    // Doppler opens no window: point it at a folder where no display lives. (Set before
    // any thread starts.)
    let runtime_dir_ok =
        std::env::var_os("XDG_RUNTIME_DIR").is_some_and(|v| std::path::Path::new(&v).is_absolute());
    if !runtime_dir_ok && std::env::var_os("WAYLAND_DISPLAY").is_none() {
        std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir());
    }
    let cli = Cli::parse();
    let level = match cli.verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new(format!(
                    "{level},wgpu_hal=error,wgpu_core=error,naga=warn"
                ))
            }),
        )
        .with_writer(std::io::stderr)
        // Colour only for a terminal: logs piped to a file or CI stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> doppler::Result<ExitCode> {
    // Commands that need no GPU run before one is opened.
    let env = GpuOptions::from_env();
    let opts = GpuOptions {
        adapter: cli.adapter,
        backend: cli.backend,
        matmul: cli
            .matmul
            .as_deref()
            .and_then(MatmulMode::parse)
            .unwrap_or(env.matmul),
        ..env
    };
    let gpu = || Gpu::new_blocking(&opts);
    match cli.command {
        Command::Inspect(args) => inspect::inspect(&args),
        Command::Info { json } => info(&gpu()?, json),
        Command::Verify { filter, json } => verify(&gpu()?, filter.as_deref(), json),
        Command::Bench(args) => bench::run(&gpu()?, &args),
        Command::Train(args) => train::train(&gpu()?, &args),
        Command::Sample(args) => train::sample(&gpu()?, &args),
        Command::Finetune(args) => finetune::finetune(&gpu()?, &args),
        Command::Export(args) => export::export_cmd(&gpu()?, &args),
        Command::Generate(args) => generate::generate_cmd(&gpu()?, &args),
        Command::Chat(args) => generate::chat_cmd(&gpu()?, &args),
        Command::Serve(args) => serve::serve_cmd(&gpu()?, &args),
        Command::Embed(args) => embed::embed(&gpu()?, &args),
    }
}

fn info(gpu: &Gpu, json: bool) -> doppler::Result<ExitCode> {
    let i = &gpu.info;
    let report = gpu.report();
    if json {
        println!("{}", serde_json::to_string_pretty(&report).unwrap());
        return Ok(ExitCode::SUCCESS);
    }
    let strings = |k: &str| -> Vec<String> {
        report[k]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let (features, coop) = (strings("features"), strings("cooperative_matrix"));
    println!("adapter   {}", i.name);
    println!("type      {:?}", i.device_type);
    println!("backend   {:?}", i.backend);
    println!("driver    {} {}", i.driver, i.driver_info);
    println!("subgroups {}..{}", i.subgroup_min_size, i.subgroup_max_size);
    println!(
        "features  {}",
        if features.is_empty() {
            "(none)".into()
        } else {
            features.join(", ")
        }
    );
    if !coop.is_empty() {
        println!("coop mat  {}", coop.join(", "));
    }
    println!(
        "matmul    {}",
        match gpu.matmul {
            MatmulMode::F16 => "f16 operands, f32 sums (cooperative matrices)",
            MatmulMode::F16x3 =>
                "f16x3: f32 operands split in two f16 halves, three products, f32 sums (cooperative matrices)",
            MatmulMode::F32 => "f32",
        }
    );
    println!(
        "attention {} (head dim 64)",
        report["paths"]["attention_d64"].as_str().unwrap_or("?")
    );
    println!("limits");
    for (k, v) in report["limits"].as_object().unwrap() {
        println!("  {k:<40} {v}");
    }
    Ok(ExitCode::SUCCESS)
}

fn verify(gpu: &Gpu, filter: Option<&str>, json: bool) -> doppler::Result<ExitCode> {
    let results = doppler::verify::run(gpu, filter);
    let failed = results.iter().filter(|c| !c.pass).count();
    if json {
        let v =
            serde_json::json!({ "adapter": gpu.info.name, "checks": results, "failed": failed });
        println!("{}", serde_json::to_string_pretty(&v).unwrap());
    } else {
        println!("adapter: {} ({:?})", gpu.info.name, gpu.info.backend);
        println!(
            "{:<44} {:<34} {:>10} {:>10}  result",
            "op", "shape", "max abs", "max rel"
        );
        for c in &results {
            println!(
                "{:<44} {:<34} {:>10.2e} {:>10.2e}  {}",
                c.op,
                c.shape,
                c.max_abs,
                c.max_rel,
                if c.pass {
                    "pass".to_string()
                } else {
                    format!("FAIL: {}", c.error.as_deref().unwrap_or(""))
                }
            );
        }
        println!(
            "{} checks, {} passed, {} failed",
            results.len(),
            results.len() - failed,
            failed
        );
    }
    if results.is_empty() {
        eprintln!(
            "error: no check matches the filter {:?}",
            filter.unwrap_or("")
        );
        return Ok(ExitCode::FAILURE);
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
