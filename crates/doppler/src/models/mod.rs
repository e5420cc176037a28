//! Model definitions: the training transformer (recorded on the autograd tape), the
//! Llama-family decoder for inference and the BERT sentence encoder.

pub mod bert;
pub mod llama;
pub mod transformer;
