//! The training transformer's forward loss in f64, written out from the reference ops; its
//! gradients come from central finite differences, so it checks the whole tape.

use std::collections::HashMap;

use super::{attention as attn, cross_entropy, embedding, gelu, norm, rope, silu};
use crate::models::transformer::{site_seed, Arch, ModelConfig, ATTN_SITES};
use crate::ops::attention::AttnDropout;
use crate::ops::gelu::GeluMode;
use crate::ops::norm::NormKind;
use crate::ops::rope::Pairing;

/// x (R, in) @ w^T (out, in) + b
pub fn linear(x: &[f64], w: &[f64], b: Option<&[f64]>, din: usize) -> Vec<f64> {
    let dout = w.len() / din;
    x.chunks(din)
        .flat_map(|row| {
            (0..dout).map(move |o| {
                let s: f64 = row
                    .iter()
                    .zip(&w[o * din..(o + 1) * din])
                    .map(|(a, c)| a * c)
                    .sum();
                s + b.map_or(0.0, |b| b[o])
            })
        })
        .collect()
}

fn add(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

/// Inverted dropout of x with the GPU kernel's mask (a hash of (seed, element index)); x
/// itself when p is 0.
fn dropout(x: Vec<f64>, p: f64, seed: u64) -> Vec<f64> {
    if p == 0.0 {
        return x;
    }
    let prm = crate::ops::dropout::params(x.len(), p, seed);
    x.iter()
        .enumerate()
        .map(|(i, v)| {
            if super::dropout::keep(&prm, i as u32) {
                v * prm.scale as f64
            } else {
                0.0
            }
        })
        .collect()
}

/// Mean next-token loss of ids (B, T) against targets (B, T); with `dropout_seed`, a
/// training step's (the model's masks at every site, from the same seeds), without, an
/// evaluation's.
pub fn loss(
    cfg: &ModelConfig,
    w: &HashMap<String, Vec<f64>>,
    ids: &[u32],
    targets: &[u32],
    t: usize,
    dropout_seed: Option<u64>,
) -> f64 {
    loss_with(cfg, w, ids, targets, t, dropout_seed, None)
}

/// [`loss`] without dropout, the mean over the targets that are not `ignore` (a
/// fine-tuning loss: prompt tokens masked).
pub fn loss_ignoring(
    cfg: &ModelConfig,
    w: &HashMap<String, Vec<f64>>,
    ids: &[u32],
    targets: &[u32],
    t: usize,
    ignore: u32,
) -> f64 {
    loss_with(cfg, w, ids, targets, t, None, Some(ignore))
}

fn loss_with(
    cfg: &ModelConfig,
    w: &HashMap<String, Vec<f64>>,
    ids: &[u32],
    targets: &[u32],
    t: usize,
    dropout_seed: Option<u64>,
    ignore: Option<u32>,
) -> f64 {
    let (drop, attn_drop) = match dropout_seed {
        Some(_) => (cfg.dropout, cfg.attn_drop()),
        None => (0.0, 0.0),
    };
    let seed = |site: u64| dropout_seed.map_or(0, |s| site_seed(s, site));
    let (c, h, hkv, d, f) = (
        cfg.n_embd,
        cfg.n_head,
        cfg.kv_heads(),
        cfg.head_dim(),
        cfg.hidden(),
    );
    let b = ids.len() / t;
    let gpt = cfg.arch == Arch::Gpt2;
    let eps = cfg.norm_eps as f64;
    let g = |name: &str| w[name].as_slice();
    let layer = |x: &[f64], wn: &str, bn: Option<&str>| -> Vec<f64> {
        if gpt {
            norm::norm(x, g(wn), Some(g(bn.unwrap())), c, eps, NormKind::Layer).0
        } else {
            norm::norm(x, g(wn), None, c, eps, NormKind::Rms { one_plus: false }).0
        }
    };
    let mut x = embedding::embedding(g("tok_emb"), c, ids);
    if gpt {
        let pos: Vec<u32> = (0..b * t).map(|i| (i % t) as u32).collect();
        x = add(&x, &embedding::embedding(g("pos_emb"), c, &pos));
    }
    x = dropout(x, drop, seed(0));
    for l in 0..cfg.n_layer {
        let n = |s: &str| format!("blocks.{l}.{s}");
        let hn = if gpt {
            layer(&x, &n("ln1.weight"), Some(&n("ln1.bias")))
        } else {
            layer(&x, &n("attn_norm.weight"), None)
        };
        let proj = |name: &str| {
            let bias = gpt.then(|| g(&n(&format!("attn.{name}.bias"))));
            linear(&hn, g(&n(&format!("attn.{name}.weight"))), bias, c)
        };
        let (mut q, mut k, v) = (proj("q"), proj("k"), proj("v"));
        if !gpt {
            q = rope::rope(&q, t, h, d, 0, cfg.rope_theta, Pairing::Half, 1.0);
            k = rope::rope(&k, t, hkv, d, 0, cfg.rope_theta, Pairing::Half, 1.0);
        }
        let dm = attn::Dims {
            b,
            tq: t,
            tk: t,
            hq: h,
            hkv,
            d,
            causal: true,
            window: 0,
            scale: 1.0 / (d as f64).sqrt(),
            dropout: (attn_drop > 0.0).then(|| AttnDropout {
                p: attn_drop,
                seed: seed(ATTN_SITES + l as u64),
            }),
        };
        let a = attn::attention(&q, &k, &v, dm).0;
        let o = linear(
            &a,
            g(&n("attn.o.weight")),
            gpt.then(|| g(&n("attn.o.bias"))),
            c,
        );
        x = add(&x, &dropout(o, drop, seed(2 * l as u64 + 1)));
        let m = if gpt {
            let hn = layer(&x, &n("ln2.weight"), Some(&n("ln2.bias")));
            let u = gelu::gelu(
                &linear(&hn, g(&n("mlp.fc.weight")), Some(g(&n("mlp.fc.bias"))), c),
                GeluMode::Tanh,
            );
            linear(
                &u,
                g(&n("mlp.proj.weight")),
                Some(g(&n("mlp.proj.bias"))),
                f,
            )
        } else {
            let hn = layer(&x, &n("mlp_norm.weight"), None);
            let gate = linear(&hn, g(&n("mlp.gate.weight")), None, c);
            let up = linear(&hn, g(&n("mlp.up.weight")), None, c);
            linear(&silu::swiglu(&gate, &up), g(&n("mlp.down.weight")), None, f)
        };
        x = add(&x, &dropout(m, drop, seed(2 * l as u64 + 2)));
    }
    x = if gpt {
        layer(&x, "norm.weight", Some("norm.bias"))
    } else {
        layer(&x, "norm.weight", None)
    };
    let head = if cfg.tied() {
        g("tok_emb")
    } else {
        g("lm_head.weight")
    };
    let logits = linear(&x, head, None, c);
    cross_entropy::cross_entropy(&logits, targets, cfg.vocab_size, ignore, 0.0).2
}
