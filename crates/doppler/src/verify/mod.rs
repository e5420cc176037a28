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
pub mod model;
mod norm;
mod optim;
pub mod quant;
mod rope;
mod silu;
mod softmax;
mod upsample;

pub use basic::{
    ABSMAX_CASES, ARGMAX_SHAPES, ELEMENTWISE_SIZES, MATMUL_CASES, SUM_SHAPES, WORDS_CASES,
};
pub use kvcache::KV_CASES;

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

/// A family of checks: the op names it reports, and the function that runs them.
type Family = (&'static [&'static str], fn(&Gpu, &mut Vec<CheckResult>));

const FAMILIES: &[Family] = &[
    (&["add", "mul", "scale"], basic::elementwise_checks),
    (&["sum_rows"], basic::sum_checks),
    (&["argmax_rows"], basic::argmax_checks),
    (&["sum_words"], basic::words_checks),
    (&["matmul"], basic::matmul_checks),
    (&[basic::RECORDER_CHAIN], basic::recorder_checks),
    (&["gelu"], gelu::checks),
    (&["cross_entropy"], cross_entropy::checks),
    (&["embedding"], embedding::checks),
    (&["group_norm"], groupnorm::checks),
    (&["conv2d"], conv2d::checks),
    (&["layer_norm", "rms_norm"], norm::checks),
    (&["softmax"], softmax::checks),
    (&["silu", "swiglu"], silu::checks),
    (&["rope"], rope::checks),
    (&["adamw", "sgd"], optim::checks),
    (&["dropout"], dropout::checks),
    (&["attention"], attention::checks),
    (&["transformer gradients"], model::checks),
    (&["dequantize"], quant::checks),
    (&["get_rows", "qmatmul"], quant::product_checks),
    (&["qmatmul fused"], quant::fused_checks),
    (&["qmatmul decode"], quant::decode_checks),
    (&["qmatmul_chain"], quant::chain_checks),
    (&["kv_attend"], kvcache::checks),
    (&["rope_store"], kvcache::rope_store_checks),
    (&["qmatmul_rope_store"], kvcache::rope_product_checks),
    (&["qmatvec_merged", "qmatvec_parts"], kvcache::merged_checks),
    (&["llama gguf vs safetensors"], llama::checks),
    (&["bias_add"], bias::checks),
    (&["pixel_shuffle", "upsample_nearest2d"], upsample::checks),
];

/// Every check whose op name contains `filter` (all when None).
pub fn run(gpu: &Gpu, filter: Option<&str>) -> Vec<CheckResult> {
    let want = |op: &str| filter.is_none_or(|f| op.contains(f));
    let mut out = run_families(gpu, filter);
    out.retain(|c| want(&c.op));
    out
}

/// All checks of every family that reports an op name containing `filter`.
pub fn run_families(gpu: &Gpu, filter: Option<&str>) -> Vec<CheckResult> {
    let mut out = Vec::new();
    let want = |op: &str| filter.is_none_or(|f| op.contains(f));
    for (ops, f) in FAMILIES {
        // "embedding" runs the family; so does "embedding backward" (a name it reports).
        if ops
            .iter()
            .any(|op| want(op) || filter.is_some_and(|f| f.starts_with(op)))
        {
            f(gpu, &mut out);
        }
    }
    out
}

/// Runs `f` twice; the results must be the same bits. Returns the first run's outputs.
pub(crate) fn twice<F>(op: &str, f: F) -> Result<Vec<Vec<f32>>, String>
where
    F: Fn() -> crate::Result<Vec<Vec<f32>>>,
{
    let first = f().map_err(s)?;
    let second = f().map_err(s)?;
    for (a, b) in first.iter().zip(&second) {
        crate::check::same_bits(op, a, b).map_err(s)?;
    }
    Ok(first)
}
