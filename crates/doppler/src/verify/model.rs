//! Whole-model checks: the tape's gradients of a tiny transformer (both flavours) against
//! central finite differences of the f64 reference model's loss.

use std::collections::HashMap;

use super::{push, s, CheckResult};
use crate::autograd::Tape;
use crate::check::{compare, Rng, Tolerance};
use crate::gpu::{Gpu, Tensor};
use crate::models::transformer::{Arch, ModelConfig, Transformer};
use crate::reference::{finite_diff, transformer as cpu};

/// Tiny configurations: 2 layers, 2 heads (1 key/value head for llama), odd vocab and MLP.
pub fn tiny(arch: Arch) -> ModelConfig {
    ModelConfig {
        arch,
        vocab_size: 11,
        n_layer: 2,
        n_embd: 8,
        n_head: 2,
        n_kv_head: (arch == Arch::Llama).then_some(1),
        block_size: 6,
        ffn_hidden: Some(12),
        norm_eps: 1e-5,
        rope_theta: 10000.0,
        tie_embeddings: None,
        dropout: 0.0,
        attn_dropout: None,
        init: Default::default(),
    }
}

pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    // Relative tolerances of the loss and the gradients: f32 rounding, or with f16 matmul
    // operands (`DOPPLER_MATMUL=f16`) products rounded to 2^-11 (on an H200: loss 1.1e-5;
    // gradients 1.6e-3 of their tensor's largest at the first element past 1e-3). A wrong
    // rule is off by the gradient's own size. Gradients that are exactly zero (the key
    // bias's) are judged against `floor_rel` of the largest gradient anywhere: f16 operands
    // leave them at ~1.6e-5 of it (H200), f32 rounding far below 1e-7.
    let (loss_rel, grad_rel, floor_rel) = match gpu.matmul == crate::gpu::MatmulMode::F16 {
        true => (1e-4, 1e-2, 1e-2),
        false => (1e-5, 1e-4, 1e-3),
    };
    // Each flavour without dropout, then with dropout on the embeddings, the residual
    // branches (0.2) and the attention probabilities (0.3), as a training step runs it: the
    // reference applies the kernels' masks from the same seeds.
    let runs = [
        (Arch::Gpt2, None),
        (Arch::Llama, None),
        (Arch::Gpt2, Some(31)),
        (Arch::Llama, Some(32)),
    ];
    for (i, (arch, drop_seed)) in runs.into_iter().enumerate() {
        let mut cfg = tiny(arch);
        if drop_seed.is_some() {
            cfg.dropout = 0.2;
            cfg.attn_dropout = Some(0.3);
        }
        let (b, t) = (2, 5);
        let mut rng = Rng::new(1800 + i as u64);
        // Weights well away from zero and from the init's scale, so every rule matters.
        let weights: Vec<(String, Vec<usize>, Vec<f32>)> = Transformer::expected(&cfg)
            .into_iter()
            .map(|(name, shape)| {
                let n: usize = shape.iter().product();
                let data: Vec<f32> = if shape.len() == 1 && name.ends_with("weight") {
                    rng.vec(n).iter().map(|v| 1.0 + 0.3 * v).collect()
                } else {
                    rng.vec(n).iter().map(|v| 0.5 * v).collect()
                };
                (name, shape, data)
            })
            .collect();
        let ids: Vec<u32> = (0..b * t).map(|_| (rng.next_u64() % 11) as u32).collect();
        let targets: Vec<u32> = (0..b * t).map(|_| (rng.next_u64() % 11) as u32).collect();
        let name = format!(
            "transformer gradients ({arch:?}{})",
            if drop_seed.is_some() { ", dropout" } else { "" }
        )
        .to_lowercase();
        let shape = format!("L2 C8 H2 V11 B{b} T{t}");
        let run = async || -> crate::Result<(Vec<f32>, Vec<Vec<f32>>)> {
            let mut model = Transformer::from_weights(gpu, &cfg, weights.clone())?;
            let ti = Tensor::from_u32(gpu, &[b, t], &ids, "ids")?;
            let tt = Tensor::from_u32(gpu, &[b, t], &targets, "targets")?;
            let mut rec = gpu.recorder("model");
            let mut tape = Tape::new();
            let loss = model.loss(&mut tape, &mut rec, &ti, &tt, drop_seed)?;
            let lt = tape.value(loss)?.clone();
            tape.backward(&mut rec, loss, 1.0, &mut model.params)?;
            rec.submit()?;
            let mut grads = Vec::new();
            for g in &model.params.grads {
                let g = g.as_ref().expect("every parameter gets a gradient");
                grads.push(g.to_vec_f32(gpu).await?);
            }
            Ok((lt.to_vec_f32(gpu).await?, grads))
        };
        let got = match run().await {
            Ok(g) => g,
            Err(e) => {
                push(out, &name, shape, Err(s(e)));
                continue;
            }
        };
        let w64: HashMap<String, Vec<f64>> = weights
            .iter()
            .map(|(n, _, d)| (n.clone(), d.iter().map(|&v| v as f64).collect()))
            .collect();
        let want_loss = cpu::loss(&cfg, &w64, &ids, &targets, t, drop_seed);
        // With dropout the masks must move the loss (else the check would not see them).
        let undropped = cpu::loss(&cfg, &w64, &ids, &targets, t, None);
        if drop_seed.is_some() && ((want_loss - undropped) / undropped).abs() < 1e-3 {
            let e =
                format!("dropout moved the reference loss only from {undropped} to {want_loss}");
            push(out, &name, shape, Err(e));
            continue;
        }
        push(
            out,
            &format!("{name} loss"),
            shape.clone(),
            compare(
                "loss",
                &got.0[..1],
                &[want_loss],
                None,
                Tolerance {
                    abs: 0.0,
                    rel: loss_rel,
                },
            )
            .map_err(s),
        );
        // All gradients in one comparison, each judged against its tensor's largest value:
        // f32 rounding through two layers stays far below 1e-4 of it, a wrong rule does not.
        // (The key bias's gradient is exactly zero, softmax being shift-invariant: such
        // tensors are judged against `floor_rel` of the largest gradient anywhere.)
        let (mut all_got, mut all_fd, mut scale) = (Vec::new(), Vec::new(), Vec::new());
        for ((wname, _, _), g) in weights.iter().zip(&got.1) {
            let fd = finite_diff(
                |x| {
                    let mut w = w64.clone();
                    w.insert(wname.clone(), x.to_vec());
                    cpu::loss(&cfg, &w, &ids, &targets, t, drop_seed)
                },
                &w64[wname],
            );
            let big = fd.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            scale.extend(std::iter::repeat_n(big, fd.len()));
            all_got.extend_from_slice(g);
            all_fd.extend(fd);
        }
        let floor = floor_rel * scale.iter().fold(0.0f64, |m, v| m.max(*v));
        scale.iter_mut().for_each(|v| *v = v.max(floor));
        push(
            out,
            &name,
            shape,
            compare(
                &name,
                &all_got,
                &all_fd,
                Some(&scale),
                Tolerance {
                    abs: 0.0,
                    rel: grad_rel,
                },
            )
            .map_err(s),
        );
    }
}
