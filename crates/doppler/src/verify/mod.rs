//! Kernel checks on the current adapter: every op against the CPU reference on odd shapes,
//! with batches, past 65535 workgroups, and reruns for determinism. `doppler verify`
//! prints these; the test suite asserts them. One file per op family.

mod attention;
mod basic;
mod bias;
mod conv2d;
mod cross_entropy;
mod dropout;
mod embedding;
mod gelu;
mod groupnorm;
mod kvcache;
pub mod llama;
pub mod lora;
pub mod model;
mod norm;
mod optim;
mod pool;
pub mod quant;
mod rope;
mod sample;
mod silu;
mod softmax;
mod upsample;

pub use basic::{
    ABSMAX_CASES, ARGMAX_SHAPES, ELEMENTWISE_SIZES, MATMUL_CASES, SUM_SHAPES, WORDS_CASES,
};
pub use kvcache::{kv_attend_checks, KV_CASES, WINDOW_CASES};

use std::future::Future;
use std::pin::Pin;

use crate::check::Stats;
use crate::gpu::Gpu;

#[derive(Clone, Debug, serde::Serialize)]
pub struct CheckResult {
    pub op: String,
    pub shape: String,
    pub max_abs: f64,
    pub max_rel: f64,
    pub pass: bool,
    /// Why it failed: the first bad index, or the error the op returned.
    pub error: Option<String>,
}

pub(crate) type Outcome = Result<Stats, String>;

pub(crate) fn push(out: &mut Vec<CheckResult>, op: &str, shape: String, r: Outcome) {
    let (stats, error) = match r {
        Ok(s) => (s, None),
        Err(e) => (Stats::default(), Some(e)),
    };
    out.push(CheckResult {
        op: op.to_string(),
        shape,
        max_abs: stats.max_abs,
        max_rel: stats.max_rel,
        pass: error.is_none(),
        error,
    });
}

/// Error to String, for `?` inside checks.
pub(crate) fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// What a family runs: its async function, boxed so that one table holds them all.
type Checks =
    for<'a> fn(&'a Gpu, &'a mut Vec<CheckResult>) -> Pin<Box<dyn Future<Output = ()> + 'a>>;

/// A family of checks: the op names it reports, and the function that runs them.
type Family = (&'static [&'static str], Checks);

/// A family's `async fn(&Gpu, &mut Vec<CheckResult>)` as [`Checks`].
macro_rules! family {
    ($f:path) => {{
        fn boxed<'a>(
            gpu: &'a Gpu,
            out: &'a mut Vec<CheckResult>,
        ) -> Pin<Box<dyn Future<Output = ()> + 'a>> {
            Box::pin($f(gpu, out))
        }
        boxed as Checks
    }};
}

const FAMILIES: &[Family] = &[
    (
        &["add", "mul", "scale", "softcap"],
        family!(basic::elementwise_checks),
    ),
    (&["sum_rows"], family!(basic::sum_checks)),
    (&["argmax_rows"], family!(basic::argmax_checks)),
    (&["sum_words"], family!(basic::words_checks)),
    (&["matmul"], family!(basic::matmul_checks)),
    (&[basic::RECORDER_CHAIN], family!(basic::recorder_checks)),
    (&["gelu"], family!(gelu::checks)),
    (&["cross_entropy"], family!(cross_entropy::checks)),
    (&["embedding"], family!(embedding::checks)),
    (&["group_norm"], family!(groupnorm::checks)),
    (&["conv2d"], family!(conv2d::checks)),
    (
        &["layer_norm", "rms_norm", "rms_norm_heads"],
        family!(norm::checks),
    ),
    (&["softmax"], family!(softmax::checks)),
    (&["silu", "swiglu"], family!(silu::checks)),
    (&["rope"], family!(rope::checks)),
    (&["adamw", "sgd"], family!(optim::checks)),
    (&["dropout"], family!(dropout::checks)),
    (&["attention"], family!(attention::checks)),
    (&["transformer gradients"], family!(model::checks)),
    (&["dequantize"], family!(quant::checks)),
    (&["get_rows", "qmatmul"], family!(quant::product_checks)),
    (&["qmatmul fused"], family!(quant::fused_checks)),
    (
        &["qmatmul coop", "qmatmul_t coop"],
        family!(quant::coop_checks),
    ),
    (&["x_half"], family!(quant::half_checks)),
    (&["qmatmul decode"], family!(quant::decode_checks)),
    (&["qmatmul batch"], family!(quant::batch_checks)),
    (&["qmatmul invariant"], family!(quant::invariant_checks)),
    (
        &["qmatmul invariant chain"],
        family!(quant::invariant_chain_checks),
    ),
    (&["qmatmul_chain"], family!(quant::chain_checks)),
    (&["row_split"], family!(quant::split_checks)),
    (&["kv_attend"], family!(kvcache::checks)),
    (&["sample_rows"], family!(sample::checks)),
    (&["rope_store"], family!(kvcache::rope_store_checks)),
    (&["kv_paged"], family!(kvcache::paged_checks)),
    (&["qmatmul_rows_rope"], family!(kvcache::rows_rope_checks)),
    (
        &["qmatmul_rope_store"],
        family!(kvcache::rope_product_checks),
    ),
    (
        &["qmatvec_merged", "qmatvec_parts"],
        family!(kvcache::merged_checks),
    ),
    (&["llama gguf vs safetensors"], family!(llama::checks)),
    (&["lora gradients"], family!(lora::checks)),
    (&["bias_add"], family!(bias::checks)),
    (
        &["pixel_shuffle", "upsample_nearest2d"],
        family!(upsample::checks),
    ),
    (&["avg_pool2d"], family!(pool::checks)),
];

/// Every check whose op name contains `filter` (all when None).
pub async fn run_async(gpu: &Gpu, filter: Option<&str>) -> Vec<CheckResult> {
    let want = |op: &str| filter.is_none_or(|f| op.contains(f));
    let mut out = run_families_async(gpu, filter).await;
    out.retain(|c| want(&c.op));
    out
}

/// All checks of every family that reports an op name containing `filter`.
pub async fn run_families_async(gpu: &Gpu, filter: Option<&str>) -> Vec<CheckResult> {
    let mut out = Vec::new();
    let want = |op: &str| filter.is_none_or(|f| op.contains(f));
    for (ops, f) in FAMILIES {
        // "embedding" runs the family; so does "embedding backward" (a name it reports).
        if ops
            .iter()
            .any(|op| want(op) || filter.is_some_and(|f| f.starts_with(op)))
        {
            f(gpu, &mut out).await;
        }
    }
    out
}

/// Blocking [`run_async`].
#[cfg(not(target_arch = "wasm32"))]
pub fn run(gpu: &Gpu, filter: Option<&str>) -> Vec<CheckResult> {
    pollster::block_on(run_async(gpu, filter))
}

/// Blocking [`run_families_async`].
#[cfg(not(target_arch = "wasm32"))]
pub fn run_families(gpu: &Gpu, filter: Option<&str>) -> Vec<CheckResult> {
    pollster::block_on(run_families_async(gpu, filter))
}

/// `a` and `b`, an output made two ways (`ways`: how each was made), must be the same
/// bits: else where they first differ.
pub(crate) fn same_bits_as(
    what: &str,
    a: &[f32],
    b: &[f32],
    ways: (&str, &str),
) -> Result<(), String> {
    let bits = |x: &[f32], j: usize| x.get(j).map(|v| v.to_bits());
    let show = |x: &[f32], j: usize| match x.get(j) {
        Some(v) => format!("{v} ({:#010x})", v.to_bits()),
        None => "nothing".into(),
    };
    match (0..a.len().max(b.len())).find(|&j| bits(a, j) != bits(b, j)) {
        Some(j) => Err(format!(
            "{what}, element {j}: {} {}, {} {}",
            show(a, j),
            ways.0,
            show(b, j),
            ways.1
        )),
        None => Ok(()),
    }
}

/// Runs `f` twice; the results must be the same bits. Returns the first run's outputs.
pub(crate) async fn twice<F>(op: &str, f: F) -> Result<Vec<Vec<f32>>, String>
where
    F: AsyncFn() -> crate::Result<Vec<Vec<f32>>>,
{
    let first = f().await.map_err(s)?;
    let second = f().await.map_err(s)?;
    for (a, b) in first.iter().zip(&second) {
        crate::check::same_bits(op, a, b).map_err(s)?;
    }
    Ok(first)
}
