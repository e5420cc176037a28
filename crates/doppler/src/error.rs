//! One error type for the whole library. Messages name the op and the shapes involved.

use crate::gpu::DType;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "no GPU adapter found{detail}. On Linux without a GPU install Mesa's Vulkan driver \
         (Debian/Ubuntu: `apt-get install mesa-vulkan-drivers`); on other systems update the GPU driver"
    )]
    NoAdapter { detail: String },

    #[error(
        "WebGPU is not available in this browser{detail}. It needs Chrome or Edge 113+ (on \
         Linux, start Chrome with --enable-unsafe-webgpu or turn on \
         chrome://flags/#enable-unsafe-webgpu), Safari 26+, or Firefox 141+ on Windows, and a \
         page served over https or from localhost"
    )]
    NoWebGpu { detail: String },

    #[error("{op}: aborted")]
    Aborted { op: &'static str },

    #[error("no adapter matches {wanted:?}; available: {available}")]
    AdapterNotFound { wanted: String, available: String },

    #[error("unknown backend {0:?} (expected one of vulkan, metal, dx12, gl, webgpu)")]
    UnknownBackend(String),

    #[error("could not open the device on {adapter}: {reason}")]
    RequestDevice { adapter: String, reason: String },

    #[error("{op}: shape mismatch: {detail}")]
    Shape { op: &'static str, detail: String },

    #[error("{op}: dtype {got:?} not supported (expected {expected})")]
    DType {
        op: &'static str,
        got: DType,
        expected: &'static str,
    },

    #[error("{op}: needs GPU feature {feature}, which this adapter does not offer")]
    MissingFeature {
        op: &'static str,
        feature: &'static str,
    },

    #[error("out of GPU memory allocating {bytes} bytes for {label}")]
    OutOfMemory { label: String, bytes: u64 },

    #[error("{label}: {bytes} bytes exceeds the device limit {limit_name} = {limit}")]
    TooLarge {
        label: String,
        bytes: u64,
        limit_name: &'static str,
        limit: u64,
    },

    #[error("upload to {label}: got {got} elements, tensor holds {expected}")]
    UploadSize {
        label: String,
        got: usize,
        expected: usize,
    },

    #[error("{op}: id {id} at position {position} is out of range (must be < {limit}; {count} bad ids in all)")]
    IndexOutOfRange {
        op: &'static str,
        position: usize,
        id: u32,
        limit: u32,
        count: usize,
    },

    #[error("{op}: invalid argument: {detail}")]
    Invalid { op: &'static str, detail: String },

    #[error("shader {shader}: {message}")]
    Shader { shader: String, message: String },

    #[error("GPU error: {0}")]
    Device(String),

    #[error("reading back {label} failed: {reason}")]
    Readback { label: String, reason: String },

    #[error("I/O error on {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },

    #[error("{path}: {detail}")]
    Format { path: String, detail: String },

    #[error("config {path}: {detail}")]
    Config { path: String, detail: String },

    #[error("checkpoint {path}: {detail}")]
    Checkpoint { path: String, detail: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
