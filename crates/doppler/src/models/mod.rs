//! Model definitions: the training transformer (recorded on the autograd tape) and the
//! Llama-family decoder for inference.

pub mod bert;
pub mod llama;
pub mod transformer;
