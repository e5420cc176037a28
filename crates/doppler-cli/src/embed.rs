//! `doppler embed`: sentence vectors from a BERT-family encoder directory.

use std::path::PathBuf;
use std::process::ExitCode;

use doppler::gpu::Gpu;
use doppler::models::bert::Encoder;

#[derive(clap::Args)]
pub struct EmbedArgs {
    /// The encoder: a Hugging Face / sentence-transformers directory (config.json,
    /// model.safetensors, tokenizer.json; modules.json for pooling and normalisation).
    #[arg(short, long)]
    model: PathBuf,
    /// Texts to embed (or --file).
    #[arg(required_unless_present = "file", conflicts_with = "file")]
    texts: Vec<String>,
    /// A file of texts, one a line (empty lines skipped).
    #[arg(long)]
    file: Option<PathBuf>,
    /// Texts run together at most (texts of one token count at a time).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    batch: u64,
    /// Refuse a text longer than the encoder's limit instead of cutting it to it.
    #[arg(long)]
    no_truncate: bool,
    /// One JSON object: the vectors, their token counts, the pooling.
    #[arg(long)]
    json: bool,
}

pub fn embed(gpu: &Gpu, args: &EmbedArgs) -> doppler::Result<ExitCode> {
    let lines: Vec<String> = match &args.file {
        Some(f) => std::fs::read_to_string(f)
            .map_err(|source| doppler::Error::Io {
                path: f.display().to_string(),
                source,
            })?
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect(),
        None => args.texts.clone(),
    };
    if lines.is_empty() {
        return Err(doppler::Error::Invalid {
            op: "embed",
            detail: "no text to embed".into(),
        });
    }
    let enc = Encoder::open(gpu, &args.model)?;
    let texts: Vec<&str> = lines.iter().map(String::as_str).collect();
    let t0 = std::time::Instant::now();
    let out = enc.embed(gpu, &texts, args.batch as usize, !args.no_truncate)?;
    let secs = t0.elapsed().as_secs_f64();
    let cut = out.iter().filter(|e| e.truncated).count();
    if cut > 0 {
        tracing::warn!(
            "{cut} of {} texts were longer than the encoder's {} tokens and were cut to them (--no-truncate refuses them)",
            out.len(),
            enc.max_tokens
        );
    }
    if args.json {
        let v = serde_json::json!({
            "model": args.model, "dim": enc.bert.cfg.hidden, "pooling": enc.pooling,
            "normalized": enc.normalize, "max_tokens": enc.max_tokens,
            "embeddings": out.iter().map(|e| &e.vector).collect::<Vec<_>>(),
            "tokens": out.iter().map(|e| e.tokens).collect::<Vec<_>>(),
            "truncated": out.iter().map(|e| e.truncated).collect::<Vec<_>>(),
            "seconds": secs,
        });
        println!("{v}");
    } else {
        for e in &out {
            let s: Vec<String> = e.vector.iter().map(|x| format!("{x:.7}")).collect();
            println!("{}", s.join(" "));
        }
        eprintln!(
            "{} texts, {} dimensions ({:?} pooling{}), {:.2} s",
            out.len(),
            enc.bert.cfg.hidden,
            enc.pooling,
            if enc.normalize { ", L2-normalised" } else { "" },
            secs
        );
    }
    Ok(ExitCode::SUCCESS)
}
