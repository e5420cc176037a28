//! Model file formats.

pub mod gguf;
