//! `doppler export`: a model as a Hugging Face SafeTensors directory, a LoRA adapter
//! merged in.

use std::path::PathBuf;
use std::process::ExitCode;

use doppler::finetune::export::{export, Dtype, Export};
use doppler::gpu::Gpu;
use indicatif::{ProgressBar, ProgressStyle};

#[derive(clap::Args)]
pub struct ExportArgs {
    /// The base model: a .gguf file or a Hugging Face directory (llama, mistral, qwen2).
    #[arg(short, long)]
    model: PathBuf,
    /// A PEFT LoRA adapter directory to merge into the weights (W + s B A).
    #[arg(long)]
    lora: Option<PathBuf>,
    /// Multiplier of the adapter's scale (alpha / r).
    #[arg(long, default_value_t = 1.0, requires = "lora")]
    lora_scale: f32,
    /// The directory to write (must not exist).
    #[arg(short, long)]
    out: PathBuf,
    /// Element type of the weights: auto (the base's float type; f16 for quantized
    /// bases), f16, bf16 or f32.
    #[arg(long, default_value = "auto", value_parser = ["auto", "f16", "bf16", "f32"])]
    dtype: String,
    /// One JSON object at the end instead of a progress bar.
    #[arg(long)]
    json: bool,
}

pub fn export_cmd(gpu: &Gpu, args: &ExportArgs) -> doppler::Result<ExitCode> {
    let dtype = match args.dtype.as_str() {
        "f16" => Dtype::F16,
        "bf16" => Dtype::Bf16,
        "f32" => Dtype::F32,
        _ => Dtype::Auto,
    };
    let job = Export {
        base: &args.model,
        lora: args.lora.as_deref().map(|d| (d, args.lora_scale)),
        out: &args.out,
        dtype,
    };
    let bar = match args.json {
        true => ProgressBar::hidden(),
        false => ProgressBar::new(0).with_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} tensors [{elapsed_precise}]")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        ),
    };
    let done = export(gpu, &job, &mut |i, n| {
        bar.set_length(n as u64);
        bar.set_position(i as u64);
    })?;
    bar.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string(&done).unwrap_or_default());
    } else {
        eprintln!(
            "wrote {} ({} tensors, {} with the adapter merged, {:.1} MB of {} in {} file{})",
            done.dir.display(),
            done.tensors,
            done.merged,
            done.bytes as f64 / 1e6,
            done.dtype,
            done.shards,
            if done.shards == 1 { "" } else { "s" }
        );
    }
    Ok(ExitCode::SUCCESS)
}
