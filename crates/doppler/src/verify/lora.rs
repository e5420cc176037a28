//! LoRA fine-tuning's forward and gradients: a tiny random Llama (Hugging Face layout, f32
//! and f16 matrices; grouped-query heads) with adapters of rank 4 on all seven
//! projections, its masked next-token loss and every adapter gradient from the tape
//! (`Llama::train_logits`, the base frozen and read in its encoding) against the f64
//! reference model with the adapters merged (W + s B A) and central differences of its
//! loss.

use std::collections::HashMap;

use super::{push, s, CheckResult};
use crate::autograd::Tape;
use crate::check::{compare, Rng, Tolerance};
use crate::finetune::lora::{peft_name, Lora, LoraSpec, Target};
use crate::gpu::{Gpu, Tensor};
use crate::models::llama::{self, TrainOpts};
use crate::models::transformer::{Arch, ModelConfig};
use crate::ops::cross_entropy::CrossEntropyOpts;
use crate::reference::{finite_diff, transformer as cpu};

/// Targets no token is scored against.
const IGNORE: u32 = u32::MAX;

/// The reference model's name of a tiny model's tensor (GGUF naming).
fn ref_name(gguf: &str) -> Option<String> {
    let map = |s: &str| -> Option<&'static str> {
        Some(match s {
            "attn_norm.weight" => "attn_norm.weight",
            "attn_q.weight" => "attn.q.weight",
            "attn_k.weight" => "attn.k.weight",
            "attn_v.weight" => "attn.v.weight",
            "attn_output.weight" => "attn.o.weight",
            "ffn_norm.weight" => "mlp_norm.weight",
            "ffn_gate.weight" => "mlp.gate.weight",
            "ffn_up.weight" => "mlp.up.weight",
            "ffn_down.weight" => "mlp.down.weight",
            _ => return None,
        })
    };
    match gguf {
        "token_embd.weight" => Some("tok_emb".into()),
        "output_norm.weight" => Some("norm.weight".into()),
        "output.weight" => Some("lm_head.weight".into()),
        _ => {
            let rest = gguf.strip_prefix("blk.")?;
            let (l, t) = rest.split_once('.')?;
            Some(format!("blocks.{l}.{}", map(t)?))
        }
    }
}

/// The reference name of the matrix a target adapts.
fn ref_target(l: usize, t: Target) -> String {
    let n = match t {
        Target::Q => "attn.q",
        Target::K => "attn.k",
        Target::V => "attn.v",
        Target::O => "attn.o",
        Target::Gate => "mlp.gate",
        Target::Up => "mlp.up",
        Target::Down => "mlp.down",
    };
    format!("blocks.{l}.{n}.weight")
}

pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (n, ty) in ["F32", "F16"].into_iter().enumerate() {
        check(gpu, out, n as u64, ty).await;
    }
}

async fn check(gpu: &Gpu, out: &mut Vec<CheckResult>, n: u64, ty: &str) {
    let name = format!("lora gradients ({ty} base)");
    let (b, t) = (2usize, 6usize);
    let coop = crate::ops::quant::uses_coop(gpu, b * t, 32, 32);
    let shape = format!(
        "tiny llama L2 E32 H4/2 rank 4, all 7 projections, B{b} T{t}{}",
        if coop {
            ", cooperative base products (f16)"
        } else {
            ""
        }
    );
    let seed = 4100 + n;
    let files = match super::llama::tiny_files("llama", ty, seed) {
        Ok(f) => f,
        Err(e) => return push(out, &name, shape, Err(s(e))),
    };
    let mut rng = Rng::new(seed);
    let ids: Vec<u32> = (0..b * t).map(|_| (rng.next_u64() % 259) as u32).collect();
    // Targets: the next ids, a few positions masked (as a prompt's are).
    let targets: Vec<u32> = (0..b * t)
        .map(|i| match i % t {
            0 | 1 => IGNORE,
            _ if i % 5 == 0 => IGNORE,
            _ => (rng.next_u64() % 259) as u32,
        })
        .collect();
    let spec = LoraSpec {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: Target::ALL.to_vec(),
    };
    // Adapters away from PEFT's init (B = 0 would make A's gradient zero); the run returns
    // (loss, gradients, names, values) of every adapter matrix.
    let run = async || -> crate::Result<(Vec<f32>, Vec<Vec<f32>>, Vec<String>, Vec<Vec<f32>>)> {
        let st = llama::SafeTensorsDir::from_bytes(
            vec![("m.safetensors".into(), Box::new(files.safetensors.clone()))],
            "tiny",
        )?;
        let model =
            llama::from_safetensors_async(gpu, &files.config, "config.json", &st, 64).await?;
        let mut lrng = Rng::new(seed + 50);
        let mut lora = Lora::build(gpu, &model.cfg, spec.clone(), |_, _, (r, c), _| {
            Ok(lrng.vec(r * c).iter().map(|v| 0.3 * v).collect())
        })?;
        let ti = Tensor::from_u32(gpu, &[b, t], &ids, "ids")?;
        let tt = Tensor::from_u32(gpu, &[b * t], &targets, "targets")?;
        let mut rec = gpu.recorder("lora");
        let mut tape = Tape::new();
        let opts = TrainOpts {
            lora: Some(&lora),
            dropout_seed: None,
        };
        let logits = model.train_logits(&mut tape, &mut rec, &ti, opts)?;
        let ce = CrossEntropyOpts {
            ignore_index: Some(IGNORE),
            ..Default::default()
        };
        let loss = tape.cross_entropy(&mut rec, logits, &tt, ce)?;
        let lt = tape.value(loss)?.clone();
        tape.backward(&mut rec, loss, 1.0, &mut lora.params)?;
        rec.submit()?;
        let (mut grads, mut values) = (Vec::new(), Vec::new());
        for (g, v) in lora.params.grads.iter().zip(&lora.params.values) {
            let g = g.as_ref().ok_or_else(|| crate::Error::Invalid {
                op: "lora",
                detail: "an adapter got no gradient".into(),
            })?;
            grads.push(g.to_vec_f32(gpu).await?);
            values.push(v.to_vec_f32(gpu).await?);
        }
        Ok((
            lt.to_vec_f32(gpu).await?,
            grads,
            lora.params.names.clone(),
            values,
        ))
    };
    let got = match run().await {
        Ok(g) => g,
        Err(e) => return push(out, &name, shape, Err(s(e))),
    };
    let adapters: HashMap<String, Vec<f64>> = got
        .2
        .iter()
        .cloned()
        .zip(got.3.iter().map(|v| v.iter().map(|&x| x as f64).collect()))
        .collect();
    // The reference: the tiny model's weights as the file rounded them, in f64.
    let rounded = |v: &[f32]| -> Vec<f64> {
        match ty {
            "F16" => v.iter().map(|&x| half::f16::from_f32(x).to_f64()).collect(),
            _ => v.iter().map(|&x| x as f64).collect(),
        }
    };
    let mut base: HashMap<String, Vec<f64>> = HashMap::new();
    for (gname, _, v) in super::llama::tensors("llama", seed) {
        if let Some(r) = ref_name(&gname) {
            base.insert(r, rounded(&v));
        }
    }
    let mcfg = ModelConfig {
        arch: Arch::Llama,
        vocab_size: 259,
        n_layer: 2,
        n_embd: 32,
        n_head: 4,
        n_kv_head: Some(2),
        block_size: t,
        ffn_hidden: Some(48),
        norm_eps: 1e-5,
        rope_theta: 10000.0,
        tie_embeddings: Some(true),
        dropout: 0.0,
        attn_dropout: None,
        init: Default::default(),
    };
    let scaling = spec.scaling();
    let loss_of = |ad: &HashMap<String, Vec<f64>>| -> f64 {
        let mut w = base.clone();
        for (l, tg) in (0..2).flat_map(|l| Target::ALL.map(|t| (l, t))) {
            let a = &ad[&peft_name(l, tg, "lora_A")];
            let bm = &ad[&peft_name(l, tg, "lora_B")];
            let (i, o) = (a.len() / 4, bm.len() / 4);
            let wm = w.get_mut(&ref_target(l, tg)).expect("a projection");
            for r in 0..o {
                for c in 0..i {
                    let d: f64 = (0..4).map(|k| bm[r * 4 + k] * a[k * i + c]).sum();
                    wm[r * i + c] += scaling * d;
                }
            }
        }
        cpu::loss_ignoring(&mcfg, &w, &ids, &targets, t, IGNORE)
    };
    let ad64 = adapters;
    let want_loss = loss_of(&ad64);
    // f32 rounding through two layers: far below these; a wrong rule is off by the
    // gradient's own size. Where the base's products of these B T rows run on cooperative
    // matrices (x and W's values rounded to f16, `ops::quant::uses_coop`), f16's rounding
    // (2^-11) of every term through two layers (H200: 7.3e-5 of the loss, 3.4e-3 of the
    // largest gradient): 50 and 100 times more room, still a hundredth of what a wrong
    // rule costs.
    let (loss_rel, grad_rel) = if coop { (5e-4, 1e-2) } else { (1e-5, 1e-4) };
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
    let (mut all_got, mut all_fd, mut scale) = (Vec::new(), Vec::new(), Vec::new());
    for (pname, g) in got.2.iter().zip(&got.1) {
        let fd = finite_diff(
            |x| {
                let mut ad = ad64.clone();
                ad.insert(pname.clone(), x.to_vec());
                loss_of(&ad)
            },
            &ad64[pname],
        );
        let big = fd.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        scale.extend(std::iter::repeat_n(big, fd.len()));
        all_got.extend_from_slice(g);
        all_fd.extend(fd);
    }
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
