//! Doppler: a WebGPU runtime for running and training neural networks on the user's own
//! GPU, natively (Vulkan, Metal, DX12) and in the browser.
//!
//! ```no_run
//! # fn main() -> doppler::Result<()> {
//! use doppler::{gpu::{Gpu, GpuOptions, Tensor}, ops::matmul};
//! let gpu = Gpu::new_blocking(&GpuOptions::from_env())?;
//! let a = Tensor::from_f32(&gpu, &[2, 3], &[1., 2., 3., 4., 5., 6.], "a")?;
//! let b = Tensor::from_f32(&gpu, &[3, 1], &[1., 1., 1.], "b")?;
//! let c = gpu.run(|rec| matmul::matmul(rec, &a, &b, Default::default()))?;
//! assert_eq!(c.read_f32(&gpu)?, vec![6., 15.]);
//! # Ok(()) }
//! ```

pub mod autograd;
pub mod check;
pub mod error;
pub mod finetune;
pub mod formats;
pub mod gpu;
pub mod infer;
pub mod models;
pub mod ops;
pub mod optim;
pub mod reference;
pub mod shaders;
pub mod train;
pub mod verify;

pub use error::{Error, Result};
pub use wgpu;
