//! `doppler inspect MODEL.gguf`: metadata and the tensor table.

use std::path::PathBuf;
use std::process::ExitCode;

use doppler::formats::gguf::GgufFile;

#[derive(clap::Args)]
pub struct InspectArgs {
    /// A GGUF model file.
    model: PathBuf,
    /// Machine-readable output (every metadata value in full).
    #[arg(long)]
    json: bool,
}

pub fn inspect(args: &InspectArgs) -> doppler::Result<ExitCode> {
    let f = GgufFile::open(&args.model)?;
    let g = &f.gguf;
    let total: u64 = g.tensors.iter().map(|t| t.n_bytes).sum();
    let params: u64 = g.tensors.iter().map(|t| t.n_elements).sum();
    if args.json {
        let v = serde_json::json!({
            "path": args.model, "version": g.version, "alignment": g.alignment, "data_offset": g.data_offset,
            "metadata": g.metadata, "tensors": g.tensors, "tensor_bytes": total, "parameters": params,
        });
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{}: GGUF v{}, {} metadata keys, {} tensors, {params} parameters, {:.1} MiB of tensor data",
        args.model.display(),
        g.version,
        g.metadata.len(),
        g.tensors.len(),
        total as f64 / (1 << 20) as f64
    );
    println!("\nmetadata");
    for (k, v) in &g.metadata {
        println!("  {k:<44} {}", v.summary());
    }
    let mut by_type: std::collections::BTreeMap<&str, (usize, u64)> = Default::default();
    for t in &g.tensors {
        let e = by_type.entry(t.ty.name()).or_default();
        e.0 += 1;
        e.1 += t.n_bytes;
    }
    println!(
        "\ntensors ({})",
        by_type
            .iter()
            .map(|(k, (n, b))| format!("{n} {k}, {:.1} MiB", *b as f64 / (1 << 20) as f64))
            .collect::<Vec<_>>()
            .join("; ")
    );
    println!(
        "  {:<40} {:<6} {:<22} {:>12} {:>12}",
        "name", "type", "dims (innermost first)", "bytes", "offset"
    );
    for t in &g.tensors {
        println!(
            "  {:<40} {:<6} {:<22} {:>12} {:>12}",
            t.name,
            t.ty.name(),
            format!("{:?}", t.dims),
            t.n_bytes,
            t.offset
        );
    }
    Ok(ExitCode::SUCCESS)
}
