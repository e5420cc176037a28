//! Every WGSL file, embedded in the binary. One file per op family, named like its
//! `ops/<name>.rs` (`matmul_coop.wgsl`, `attention_coop.wgsl`, `quant_coop.wgsl`,
//! `conv2d_coop.wgsl`: the kernels of `ops/matmul.rs`, `ops/attention.rs`, `ops/quant.rs`
//! and `ops/conv2d.rs` for adapters with
//! cooperative matrices, files of their own because they enable that extension;
//! `quant_blocks.wgsl`: the block decoding both quantized files share, put before each;
//! `conv2d_gemm.wgsl`: what both conv2d files share, likewise).

use crate::gpu::Shader;

macro_rules! shader {
    ($id:ident, $name:literal) => {
        shader!($id, $name, "");
    };
    ($id:ident, $name:literal, $prelude:expr) => {
        pub static $id: Shader = Shader {
            name: $name,
            prelude: $prelude,
            source: include_str!(concat!($name, ".wgsl")),
        };
    };
}

/// GGUF block decoding (`quant_blocks.wgsl`), the prelude of both quantized-product files.
const QUANT_BLOCKS: &str = include_str!("quant_blocks.wgsl");
/// The convolution GEMMs' parameters, bindings, dimensions and store (`conv2d_gemm.wgsl`),
/// the prelude of both conv2d files.
const CONV2D_GEMM: &str = include_str!("conv2d_gemm.wgsl");

shader!(ELEMENTWISE, "elementwise");
shader!(REDUCE, "reduce");
shader!(MATMUL, "matmul");
shader!(MATMUL_COOP, "matmul_coop");
shader!(GELU, "gelu");
shader!(CROSS_ENTROPY, "cross_entropy");
shader!(EMBEDDING, "embedding");
shader!(GROUPNORM, "groupnorm");
shader!(CONV2D, "conv2d", CONV2D_GEMM);
shader!(CONV2D_COOP, "conv2d_coop", CONV2D_GEMM);
shader!(NORM, "norm");
shader!(SOFTMAX, "softmax");
shader!(SILU, "silu");
shader!(ROPE, "rope");
shader!(OPTIM, "optim");
shader!(DROPOUT, "dropout");
shader!(ATTENTION, "attention");
shader!(ATTENTION_COOP, "attention_coop");
shader!(BIAS, "bias");
shader!(UPSAMPLE, "upsample");
shader!(POOL, "pool");
shader!(QUANT, "quant", QUANT_BLOCKS);
shader!(QUANT_COOP, "quant_coop", QUANT_BLOCKS);
shader!(KVCACHE, "kvcache");
shader!(COLUMNS, "columns");
shader!(SAMPLE, "sample");

/// All shaders, for validation and listing.
pub static ALL: &[&Shader] = &[
    &ELEMENTWISE,
    &REDUCE,
    &MATMUL,
    &MATMUL_COOP,
    &GELU,
    &CROSS_ENTROPY,
    &EMBEDDING,
    &GROUPNORM,
    &CONV2D,
    &CONV2D_COOP,
    &NORM,
    &SOFTMAX,
    &SILU,
    &ROPE,
    &OPTIM,
    &DROPOUT,
    &ATTENTION,
    &ATTENTION_COOP,
    &BIAS,
    &UPSAMPLE,
    &POOL,
    &QUANT,
    &QUANT_COOP,
    &COLUMNS,
    &KVCACHE,
    &SAMPLE,
];
