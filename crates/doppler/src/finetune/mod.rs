//! Fine-tuning pretrained Llama-family models with LoRA: the base stays frozen in its
//! file's encoding on the GPU (its products read the blocks both ways), only the adapters
//! train. The forward is the model's own definition (`models::llama`), run on the tape.

pub mod adapter;
pub mod data;
pub mod lora;
