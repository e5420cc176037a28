//! The conv nets' forward losses in f64 (the classifier's cross-entropy, the U-Net's
//! noise-prediction error), written out from the reference ops (models/convnet.rs has the
//! shapes); their gradients come from central finite differences, so they check the
//! whole tape.

use std::collections::HashMap;

use super::{
    conv2d, cross_entropy, embedding, gelu, groupnorm, pool, transformer::linear, upsample,
};
use crate::models::convnet::ConvConfig;
use crate::ops::conv2d::{conv_params, Conv2dOpts};
use crate::ops::gelu::GeluMode;

/// Mean cross-entropy of the class scores of `images` (N, C, H, W) against `labels` (N).
pub fn loss(
    cfg: &ConvConfig,
    w: &HashMap<String, Vec<f64>>,
    images: &[f64],
    labels: &[u32],
) -> f64 {
    let scores = logits(cfg, w, images, labels.len());
    cross_entropy::cross_entropy(&scores, labels, cfg.classes, None, 0.0).2
}

/// A feature map: values and (N, C, H, W).
type Map = (Vec<f64>, [usize; 4]);

/// Conv 3x3, padding 1, of `name`'s weight and bias.
fn conv(w: &HashMap<String, Vec<f64>>, x: &Map, name: &str, stride: usize) -> Map {
    let wt = &w[&format!("{name}.weight")];
    let b = &w[&format!("{name}.bias")];
    let opts = Conv2dOpts {
        stride: (stride, stride),
        padding: (1, 1),
        ..Default::default()
    };
    let p = conv_params(&x.1, &[b.len(), x.1[1], 3, 3], &opts).expect("shapes");
    let y = conv2d::conv2d(&x.0, wt, Some(b), &p);
    (y, [x.1[0], b.len(), p.oh as usize, p.ow as usize])
}

/// gelu(group_norm(x)) with `name`'s weight and bias.
fn norm_gelu(cfg: &ConvConfig, w: &HashMap<String, Vec<f64>>, x: &Map, name: &str) -> Map {
    let [n, c, h, wd] = x.1;
    let d = groupnorm::Dims {
        n,
        c,
        s: h * wd,
        g: cfg.groups,
    };
    let (y, _, _) = groupnorm::group_norm(
        &x.0,
        &w[&format!("{name}.weight")],
        &w[&format!("{name}.bias")],
        &d,
        cfg.norm_eps as f64,
    );
    (gelu::gelu(&y, GeluMode::Exact), x.1)
}

fn add(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

/// The residual block `p` (with the U-Net's embedding (N, E) added per channel).
fn block(
    cfg: &ConvConfig,
    w: &HashMap<String, Vec<f64>>,
    x: &Map,
    p: &str,
    emb: Option<&[f64]>,
) -> Map {
    let y = norm_gelu(cfg, w, x, &format!("{p}.norm1"));
    let mut y = conv(w, &y, &format!("{p}.conv1"), 1);
    if let Some(e) = emb {
        let [_, c, h, wd] = y.1;
        let add_nc = linear(
            e,
            &w[&format!("{p}.emb.weight")],
            Some(&w[&format!("{p}.emb.bias")]),
            cfg.emb_dim(),
        );
        for (i, v) in y.0.iter_mut().enumerate() {
            *v += add_nc[i / (h * wd)];
        }
        debug_assert_eq!(add_nc.len(), y.1[0] * c);
    }
    let y = norm_gelu(cfg, w, &y, &format!("{p}.norm2"));
    let y = conv(w, &y, &format!("{p}.conv2"), 1);
    (add(&x.0, &y.0), x.1)
}

/// The U-Net's predicted noise in `noisy` (N, C, H, W) at steps `t` of `classes`.
pub fn denoise(
    cfg: &ConvConfig,
    w: &HashMap<String, Vec<f64>>,
    noisy: &[f64],
    t: &[u32],
    classes: &[u32],
) -> Vec<f64> {
    let (n, e) = (t.len(), cfg.emb_dim());
    let emb = add(
        &embedding::embedding(&w["time_emb.weight"], e, t),
        &embedding::embedding(&w["class_emb.weight"], e, classes),
    );
    let emb = linear(&emb, &w["emb_proj.weight"], Some(&w["emb_proj.bias"]), e);
    let emb = gelu::gelu(&emb, GeluMode::Exact);
    let [c, h, wd] = cfg.image_shape();
    let mut x = conv(w, &(noisy.to_vec(), [n, c, h, wd]), "stem", 1);
    let levels = cfg.channels.len();
    let mut skips = Vec::new();
    for l in 0..levels {
        for b in 0..cfg.blocks {
            x = block(cfg, w, &x, &format!("down.{l}.{b}"), Some(&emb));
        }
        skips.push(x.clone());
        if l + 1 < levels {
            x = conv(w, &x, &format!("downsample.{l}"), 2);
        }
    }
    x = block(cfg, w, &x, "mid", Some(&emb));
    for l in (0..levels).rev() {
        x.0 = add(&x.0, &skips[l].0);
        for b in 0..cfg.blocks {
            x = block(cfg, w, &x, &format!("up.{l}.{b}"), Some(&emb));
        }
        if l > 0 {
            let [n, c, h, wd] = x.1;
            x = (
                upsample::upsample_nearest2d(&x.0, h, wd, 2, 2),
                [n, c, 2 * h, 2 * wd],
            );
            x = conv(w, &x, &format!("upsample.{l}"), 1);
        }
    }
    let x = norm_gelu(cfg, w, &x, "out_norm");
    conv(w, &x, "out", 1).0
}

/// The U-Net's DDPM loss: the mean squared error of the predicted noise.
pub fn diffusion_loss(
    cfg: &ConvConfig,
    w: &HashMap<String, Vec<f64>>,
    noisy: &[f64],
    t: &[u32],
    classes: &[u32],
    noise: &[f64],
) -> f64 {
    let pred = denoise(cfg, w, noisy, t, classes);
    pred.iter()
        .zip(noise)
        .map(|(p, e)| (p - e) * (p - e))
        .sum::<f64>()
        / pred.len() as f64
}

/// The classifier's class scores (N, classes) of `n` images (N, C, H, W).
pub fn logits(
    cfg: &ConvConfig,
    w: &HashMap<String, Vec<f64>>,
    images: &[f64],
    n: usize,
) -> Vec<f64> {
    let [c, h, wd] = cfg.image_shape();
    let mut x = conv(w, &(images.to_vec(), [n, c, h, wd]), "stem", 1);
    for s in 0..cfg.channels.len() {
        if s > 0 {
            x = conv(w, &x, &format!("down.{s}"), 2);
        }
        for b in 0..cfg.blocks {
            x = block(cfg, w, &x, &format!("stages.{s}.{b}"), None);
        }
    }
    let x = norm_gelu(cfg, w, &x, "head_norm");
    let [_, last, eh, ew] = x.1;
    let pooled = pool::avg_pool2d(&x.0, [eh, ew], [eh, ew], [eh, ew]);
    linear(&pooled, &w["head.weight"], Some(&w["head.bias"]), last)
}
