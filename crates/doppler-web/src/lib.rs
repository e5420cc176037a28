//! Doppler in the browser: wasm-bindgen bindings over the library's `infer`, `train` and
//! `verify`, the same Rust code as the native CLI. This is the raw layer; `js/doppler.js`
//! wraps it in the JS API users see (loading from files and URLs, streams, abort).
//!
//! Everything GPU-side is async: nothing here blocks the page. The device is opened once
//! per page (`init`) and lives as long as the page.

#[cfg(target_arch = "wasm32")]
mod web;
#[cfg(target_arch = "wasm32")]
pub use web::*;

mod options;
pub use options::{GenerateOptions, TrainOptions};
