//! The conv-net classifier's forward loss in f64, written out from the reference ops
//! (models/convnet.rs has the shapes); its gradients come from central finite
//! differences, so it checks the whole tape.

use std::collections::HashMap;

use super::{conv2d, cross_entropy, gelu, groupnorm, pool, transformer::linear};
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

/// Class scores (N, classes) of `n` images (N, C, H, W).
pub fn logits(
    cfg: &ConvConfig,
    w: &HashMap<String, Vec<f64>>,
    images: &[f64],
    n: usize,
) -> Vec<f64> {
    let g = |name: &str| w[name].as_slice();
    // (values, [N, C, H, W])
    let conv = |x: &(Vec<f64>, [usize; 4]), name: &str, stride: usize| {
        let wt = g(&format!("{name}.weight"));
        let cout = g(&format!("{name}.bias")).len();
        let cin = x.1[1];
        let opts = Conv2dOpts {
            stride: (stride, stride),
            padding: (1, 1),
            ..Default::default()
        };
        let p = conv_params(&x.1, &[cout, cin, 3, 3], &opts).expect("shapes");
        let y = conv2d::conv2d(&x.0, wt, Some(g(&format!("{name}.bias"))), &p);
        (y, [x.1[0], cout, p.oh as usize, p.ow as usize])
    };
    let norm_gelu = |x: &(Vec<f64>, [usize; 4]), name: &str| {
        let [n, c, h, wd] = x.1;
        let d = groupnorm::Dims {
            n,
            c,
            s: h * wd,
            g: cfg.groups,
        };
        let (y, _, _) = groupnorm::group_norm(
            &x.0,
            g(&format!("{name}.weight")),
            g(&format!("{name}.bias")),
            &d,
            cfg.norm_eps as f64,
        );
        (gelu::gelu(&y, GeluMode::Exact), x.1)
    };
    let [c, h, wd] = cfg.image_shape();
    let mut x = conv(&(images.to_vec(), [n, c, h, wd]), "stem", 1);
    for s in 0..cfg.channels.len() {
        if s > 0 {
            x = conv(&x, &format!("down.{s}"), 2);
        }
        for b in 0..cfg.blocks {
            let p = format!("stages.{s}.{b}");
            let y = norm_gelu(&x, &format!("{p}.norm1"));
            let y = conv(&y, &format!("{p}.conv1"), 1);
            let y = norm_gelu(&y, &format!("{p}.norm2"));
            let y = conv(&y, &format!("{p}.conv2"), 1);
            x.0 = x.0.iter().zip(&y.0).map(|(a, b)| a + b).collect();
        }
    }
    let x = norm_gelu(&x, "head_norm");
    let [_, last, eh, ew] = x.1;
    let pooled = pool::avg_pool2d(&x.0, [eh, ew], [eh, ew], [eh, ew]);
    linear(&pooled, g("head.weight"), Some(g("head.bias")), last)
}
