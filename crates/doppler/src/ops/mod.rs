//! Op families: one file each, with its WGSL twin in `shaders/`. Every op records into a
//! [`crate::gpu::Recorder`]; "run now" is `gpu.run(|rec| op(rec, ...))`.

pub mod attention;
pub mod bias;
pub mod columns;
pub mod conv2d;
pub mod cross_entropy;
pub mod dropout;
pub mod elementwise;
pub mod embedding;
pub mod gelu;
pub mod groupnorm;
pub mod kvcache;
pub mod matmul;
pub mod norm;
pub mod pool;
pub mod quant;
pub mod reduce;
pub mod rope;
pub mod sample;
pub mod silu;
pub mod softmax;
pub mod upsample;

use crate::error::{Error, Result};
use crate::gpu::{DType, Tensor};

pub(crate) fn expect_f32(op: &'static str, t: &Tensor) -> Result<()> {
    if t.dtype() != DType::F32 {
        return Err(Error::DType {
            op,
            got: t.dtype(),
            expected: "f32",
        });
    }
    Ok(())
}

/// (uniform struct name, Rust size) for every parameter block, checked against naga's layout.
pub fn param_sizes() -> Vec<(&'static str, usize)> {
    vec![
        ("elementwise", std::mem::size_of::<elementwise::Params>()),
        ("reduce", std::mem::size_of::<reduce::Params>()),
        ("matmul", std::mem::size_of::<matmul::Params>()),
        ("gelu", std::mem::size_of::<gelu::Params>()),
        (
            "cross_entropy",
            std::mem::size_of::<cross_entropy::Params>(),
        ),
        ("embedding", std::mem::size_of::<embedding::Params>()),
        ("groupnorm", std::mem::size_of::<groupnorm::Params>()),
        ("conv2d", std::mem::size_of::<conv2d::Params>()),
        ("norm", std::mem::size_of::<norm::Params>()),
        ("softmax", std::mem::size_of::<softmax::Params>()),
        ("silu", std::mem::size_of::<silu::Params>()),
        ("rope", std::mem::size_of::<rope::Params>()),
        ("optim", std::mem::size_of::<crate::optim::Params>()),
        ("dropout", std::mem::size_of::<dropout::Params>()),
        ("attention", std::mem::size_of::<attention::Params>()),
        ("bias", std::mem::size_of::<bias::Params>()),
        ("upsample", std::mem::size_of::<upsample::Params>()),
        ("pool", std::mem::size_of::<pool::Params>()),
        ("quant", std::mem::size_of::<quant::Params>()),
        ("quant_coop", std::mem::size_of::<quant::CoopParams>()),
        ("kvcache", std::mem::size_of::<kvcache::Params>()),
        ("columns", std::mem::size_of::<columns::Params>()),
        ("sample", std::mem::size_of::<sample::Params>()),
    ]
}
