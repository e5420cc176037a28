//! Model definitions: the training transformer and the conv nets (a classifier and a
//! U-Net denoiser), recorded on the autograd tape; the Llama-family decoder for inference;
//! the BERT sentence encoder.

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

/// `n` standard normal draws from `key`, in chunks of NORMALS_CHUNK each drawn from its own
/// generator (seeded from `key` and the chunk's index), so that threads draw them at once
/// (natively; in order on wasm32): the same values for any thread count. A DDPM batch of
/// 64 x 3 x 32 x 32 took ~9 ms a step drawn in one thread on the H200's host.
pub fn normals_keyed(key: u64, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    let fill = |c: usize, chunk: &mut [f32]| {
        let mut rng = crate::check::Rng::new(crate::train::data::mix(&[key, c as u64]));
        chunk
            .iter_mut()
            .for_each(|v| *v = normal(&mut rng, 1.0) as f32);
    };
    let chunks: Vec<(usize, &mut [f32])> = out.chunks_mut(NORMALS_CHUNK).enumerate().collect();
    // More than one chunk: on threads (natively), each taking a run of them.
    #[cfg(not(target_arch = "wasm32"))]
    let chunks = match chunks.len() {
        0 | 1 => chunks,
        _ => {
            let threads = std::thread::available_parallelism().map_or(1, |t| t.get().min(8));
            let per = chunks.len().div_ceil(threads).max(1);
            let mut rest = chunks;
            std::thread::scope(|s| {
                while !rest.is_empty() {
                    let mine: Vec<(usize, &mut [f32])> =
                        rest.drain(..per.min(rest.len())).collect();
                    s.spawn(move || mine.into_iter().for_each(|(c, ch)| fill(c, ch)));
                }
            });
            rest
        }
    };
    chunks.into_iter().for_each(|(c, ch)| fill(c, ch));
    out
}

/// Values a generator of [`normals_keyed`] draws.
const NORMALS_CHUNK: usize = 16384;

/// Normal draws of standard deviation `std` from the seeded generator (Box-Muller in f64).
pub fn normals(rng: &mut crate::check::Rng, n: usize, std: f64) -> Vec<f32> {
    (0..n).map(|_| normal(rng, std) as f32).collect()
}

/// One normal draw of standard deviation `std` (Box-Muller in f64, the cosine half).
fn normal(rng: &mut crate::check::Rng, std: f64) -> f64 {
    let u1 = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    let u2 = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    let r = (-2.0 * (1.0 - u1).ln()).sqrt();
    std * r * (2.0 * std::f64::consts::PI * u2).cos()
}
