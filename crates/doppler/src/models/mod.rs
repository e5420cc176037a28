//! Model definitions: the training transformer and the conv-net classifier (recorded on
//! the autograd tape), the Llama-family decoder for inference and the BERT sentence
//! encoder.

pub mod bert;
pub mod convnet;
pub mod llama;
pub mod transformer;

use std::collections::HashMap;

use crate::autograd::ParamStore;
use crate::error::{Error, Result};
use crate::gpu::{Gpu, Tensor};

/// A trainable model's parameters from named weights: exactly the `expected` (name, shape)
/// pairs, in that order, each uploaded; an error names a missing, misshapen or extra one.
pub(crate) fn store_weights(
    gpu: &Gpu,
    expected: Vec<(String, Vec<usize>)>,
    mut weights: Vec<(String, Vec<usize>, Vec<f32>)>,
) -> Result<(ParamStore, HashMap<String, usize>)> {
    let mut params = ParamStore::default();
    let mut index = HashMap::new();
    for (name, shape) in expected {
        let Some(pos) = weights.iter().position(|w| w.0 == name) else {
            return Err(Error::Invalid {
                op: "model weights",
                detail: format!("missing tensor {name} {shape:?}"),
            });
        };
        let (_, got, data) = weights.swap_remove(pos);
        if got != shape {
            return Err(Error::Invalid {
                op: "model weights",
                detail: format!("{name}: shape {got:?}, config expects {shape:?}"),
            });
        }
        let t = Tensor::from_f32(gpu, &shape, &data, &name)?;
        index.insert(name.clone(), params.push(name, t));
    }
    if let Some(extra) = weights.first() {
        return Err(Error::Invalid {
            op: "model weights",
            detail: format!("unexpected tensor {} for this config", extra.0),
        });
    }
    Ok((params, index))
}
