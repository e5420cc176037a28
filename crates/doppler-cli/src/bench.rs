//! `doppler bench`: copy bandwidth and f32 matmul throughput, medians over repeated runs.
//! Two clocks: the wall clock around submit + wait of a batch (divided by the batch size)
//! and, where the adapter has timestamp queries, the GPU's own time per dispatch.

use clap::{Args, ValueEnum};
use doppler::check::Rng;
use doppler::gpu::{trace::median, Gpu, Tensor};
use doppler::ops::{elementwise, matmul};
use std::process::ExitCode;
use std::time::Instant;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Which {
    All,
    Copy,
    Matmul,
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
}

#[derive(serde::Serialize)]
struct Row {
    name: String,
    shape: String,
    /// Median wall-clock time per op, ms.
    wall_ms: f64,
    /// Median GPU time per dispatch from timestamp queries, ms (absent without them).
    gpu_ms: Option<f64>,
    /// Throughput from the GPU time where measured, else from the wall time.
    value: f64,
    unit: &'static str,
}

fn is_cpu(gpu: &Gpu) -> bool {
    gpu.info.device_type == doppler::wgpu::DeviceType::Cpu
}

/// Runs `record` (which records `batch` ops) `repeat` times after one warm-up; returns the
/// median wall time per op and, if timestamps are on, the median GPU time per dispatch.
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
        rec.submit()?;
        gpu.wait()?;
        let wall = t.elapsed().as_secs_f64() * 1e3 / args.batch as f64;
        // Same batch again with a timestamp around every dispatch.
        let mut rec = gpu.profiling_recorder("bench");
        for _ in 0..args.batch {
            record(&mut rec)?;
        }
        let tr = rec.submit()?.wait(gpu)?;
        if r > 0 {
            walls.push(wall);
            gpu_times.extend(tr.events.iter().map(|e| e.dur_ns / 1e6));
            trace.extend(tr);
        }
    }
    let g = if gpu_times.is_empty() { None } else { Some(median(&mut gpu_times)) };
    Ok((median(&mut walls), g))
}

pub fn run(gpu: &Gpu, args: &BenchArgs) -> doppler::Result<ExitCode> {
    let mut rows = Vec::new();
    let mut trace = doppler::gpu::Trace::default();
    if matches!(args.which, Which::All | Which::Copy) {
        let mib = args.mib.unwrap_or(if is_cpu(gpu) { 32 } else { 1024 });
        let n = (mib as usize) << 18; // f32 elements
        let src = Tensor::from_f32(gpu, &[n], &Rng::new(1).vec(n), "bench.src")?;
        let dst = Tensor::empty(gpu, &[n], src.dtype(), "bench.dst")?;
        let bytes = 2.0 * (n * 4) as f64; // read + written
        let shape = format!("{mib} MiB");
        // copy_buffer_to_buffer has no dispatch to time: wall clock only.
        let (wall, _) = time(gpu, args, &mut Default::default(), |rec| rec.copy(&src, &dst))?;
        rows.push(Row { name: "copy (copy_buffer_to_buffer)".into(), shape: shape.clone(), wall_ms: wall, gpu_ms: None, value: bytes / wall / 1e6, unit: "GB/s" });
        let (wall, g) = time(gpu, args, &mut trace, |rec| elementwise::scale_into(rec, &src, 1.0, &dst))?;
        let t = g.unwrap_or(wall);
        rows.push(Row { name: "copy (scale kernel, vec4)".into(), shape, wall_ms: wall, gpu_ms: g, value: bytes / t / 1e6, unit: "GB/s" });
    }
    if matches!(args.which, Which::All | Which::Matmul) {
        let sizes = if args.size.is_empty() { vec![if is_cpu(gpu) { 256 } else { 4096 }] } else { args.size.clone() };
        for s in sizes {
            let mut rng = Rng::new(2);
            let a = Tensor::from_f32(gpu, &[s, s], &rng.vec(s * s), "bench.a")?;
            let b = Tensor::from_f32(gpu, &[s, s], &rng.vec(s * s), "bench.b")?;
            let c = Tensor::empty(gpu, &[s, s], a.dtype(), "bench.c")?;
            for &bk in &args.bk {
                let tuning = matmul::Tuning { bk };
                let (wall, g) = time(gpu, args, &mut trace, |rec| {
                    matmul::matmul_into_tuned(rec, &a, &b, &c, Default::default(), 0.0, tuning)
                })?;
                let flops = 2.0 * (s as f64).powi(3);
                let t = g.unwrap_or(wall);
                rows.push(Row {
                    name: format!("matmul f32 (bk {bk})"),
                    shape: format!("{s}x{s}x{s}"),
                    wall_ms: wall,
                    gpu_ms: g,
                    value: flops / t / 1e9,
                    unit: "TFLOP/s",
                });
            }
        }
    }
    if let Some(path) = &args.trace {
        trace.write_chrome_json(path)?;
    }
    let command: Vec<String> = std::env::args().collect();
    if args.json {
        let v = serde_json::json!({
            "adapter": gpu.info.name, "backend": format!("{:?}", gpu.info.backend), "driver": gpu.info.driver_info,
            "command": command.join(" "), "repeat": args.repeat, "batch": args.batch, "results": rows,
        });
        println!("{}", serde_json::to_string_pretty(&v).unwrap());
    } else {
        println!("adapter: {} ({:?}), median of {} batches of {}", gpu.info.name, gpu.info.backend, args.repeat, args.batch);
        println!("{:<30} {:<16} {:>10} {:>10} {:>12}", "bench", "shape", "wall ms", "gpu ms", "throughput");
        for r in &rows {
            let g = r.gpu_ms.map_or("-".to_string(), |g| format!("{g:.4}"));
            println!("{:<30} {:<16} {:>10.4} {:>10} {:>9.3} {}", r.name, r.shape, r.wall_ms, g, r.value, r.unit);
        }
    }
    Ok(ExitCode::SUCCESS)
}
