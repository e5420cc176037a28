//! Labelled images for conv nets: read from a CSV file (one image a line: its C*H*W
//! pixel values, then its class), scaled to [-1, 1], split into training and held-out
//! images. Batches are a pure function of (seed, batch index): epochs of seeded
//! permutations, so a resumed run draws exactly the images the uninterrupted one would.

use std::path::Path;

use crate::check::Rng;
use crate::error::{Error, Result};

use super::config::ImageDataConfig;
use super::data::mix;

/// Images of one split: pixels (N, C, H, W) row-major and labels (N).
#[derive(Clone, Debug, Default)]
pub struct Images {
    pub pixels: Vec<f32>,
    pub labels: Vec<u32>,
}

impl Images {
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }
}

pub struct ImageSet {
    /// (C, H, W) of one image.
    pub shape: [usize; 3],
    pub classes: usize,
    pub train: Images,
    pub val: Images,
}

impl ImageSet {
    /// Parses CSV text (`path` names it in errors): every line C*H*W pixel values in
    /// [0, pixel_max] and a class in 0..classes; the last `val_fraction` held out.
    pub fn parse(
        text: &str,
        path: &Path,
        cfg: &ImageDataConfig,
        shape: [usize; 3],
        classes: usize,
    ) -> Result<ImageSet> {
        let err = |detail: String| Error::Config {
            path: path.display().to_string(),
            detail,
        };
        let [c, h, w] = shape;
        let pixels = c * h * w;
        let mut all = Images::default();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let at = i + 1;
            let values: Vec<&str> = line.split(',').map(str::trim).collect();
            if values.len() != pixels + 1 {
                return Err(err(format!(
                    "line {at}: {} values; the config's images are {c}x{h}x{w} = {pixels} pixels, then a label",
                    values.len()
                )));
            }
            for v in &values[..pixels] {
                let p: f64 = v
                    .parse()
                    .map_err(|_| err(format!("line {at}: pixel value {v:?} is not a number")))?;
                if !(0.0..=cfg.pixel_max).contains(&p) {
                    return Err(err(format!(
                        "line {at}: pixel value {v} outside [0, data.pixel_max = {}]",
                        cfg.pixel_max
                    )));
                }
                all.pixels.push((p / cfg.pixel_max * 2.0 - 1.0) as f32);
            }
            let label = values[pixels];
            match label.parse::<u32>() {
                Ok(l) if (l as usize) < classes => all.labels.push(l),
                _ => {
                    return Err(err(format!(
                        "line {at}: label {label:?} is not a class in 0..{classes} (model.classes)"
                    )))
                }
            }
        }
        let n = all.len();
        let n_val = ((n as f64) * cfg.val_fraction).round() as usize;
        if n_val == 0 || n_val >= n {
            return Err(err(format!(
                "{n} images cannot be split into training and validation images at val_fraction {}",
                cfg.val_fraction
            )));
        }
        let cut = n - n_val;
        let val = Images {
            pixels: all.pixels.split_off(cut * pixels),
            labels: all.labels.split_off(cut),
        };
        Ok(ImageSet {
            shape,
            classes,
            train: all,
            val,
        })
    }

    /// Pixels per image.
    pub fn pixels(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The `index`-th batch of `batch` images from `set` under `seed`: images `index * batch`
/// onwards of a sequence of epochs, each a permutation of the set drawn from
/// (seed, epoch). (pixels (batch, C, H, W), labels (batch)).
pub fn batch(
    set: &Images,
    pixels: usize,
    batch: usize,
    seed: u64,
    index: u64,
) -> (Vec<f32>, Vec<u32>) {
    let n = set.len() as u64;
    let mut out = (
        Vec::with_capacity(batch * pixels),
        Vec::with_capacity(batch),
    );
    let mut perm: (u64, Vec<usize>) = (u64::MAX, Vec::new());
    for j in index * batch as u64..(index + 1) * batch as u64 {
        let epoch = j / n;
        if perm.0 != epoch {
            perm = (epoch, permutation(set.len(), mix(&[seed, epoch])));
        }
        let i = perm.1[(j % n) as usize];
        out.0
            .extend_from_slice(&set.pixels[i * pixels..(i + 1) * pixels]);
        out.1.push(set.labels[i]);
    }
    out
}

/// A seeded Fisher-Yates permutation of 0..n.
fn permutation(n: usize, key: u64) -> Vec<usize> {
    let mut rng = Rng::new(key);
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ImageDataConfig {
        ImageDataConfig {
            images: "x.csv".into(),
            pixel_max: 16.0,
            val_fraction: 0.25,
        }
    }

    #[test]
    fn parses_scales_and_splits() {
        let text = "0,16,8,4,1\n16,0,0,0,0\n\n1,1,1,1,2\n2,2,2,2,1\n";
        let s = ImageSet::parse(text, Path::new("x.csv"), &cfg(), [1, 2, 2], 3).unwrap();
        assert_eq!(s.train.labels, [1, 0, 2]);
        assert_eq!(s.val.labels, [1]);
        assert_eq!(&s.train.pixels[..4], &[-1.0, 1.0, 0.0, -0.5]);
    }

    #[test]
    fn bad_lines_are_named() {
        for (text, want) in [
            (
                "0,1,2,3\n",
                "line 1: 4 values; the config's images are 1x2x2 = 4 pixels",
            ),
            ("0,1,2,3,1\n0,1,2,x,1\n", "line 2: pixel value \"x\""),
            ("0,1,2,17,1\n", "outside [0, data.pixel_max = 16]"),
            ("0,1,2,3,3\n", "label \"3\" is not a class in 0..3"),
            ("0,1,2,3,-1\n", "label \"-1\""),
            ("0,1,2,3,1\n", "1 images cannot be split"),
        ] {
            let e = ImageSet::parse(text, Path::new("x.csv"), &cfg(), [1, 2, 2], 3)
                .err()
                .unwrap_or_else(|| panic!("{text:?} accepted"))
                .to_string();
            assert!(e.contains("x.csv") && e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn batches_cover_each_epoch_once_and_repeat_from_the_seed() {
        let set = Images {
            pixels: (0..10).map(|v| v as f32).collect(),
            labels: (0..10).collect(),
        };
        // Batches of 4 over 10 images: batches 0..5 are epochs 0 and 1.
        let all: Vec<u32> = (0..5).flat_map(|i| batch(&set, 1, 4, 7, i).1).collect();
        let (mut e0, mut e1) = (all[..10].to_vec(), all[10..].to_vec());
        e0.sort();
        e1.sort();
        assert_eq!(e0, (0..10).collect::<Vec<_>>());
        assert_eq!(e1, e0);
        assert_ne!(all[..10], all[10..]);
        assert_eq!(batch(&set, 1, 4, 7, 3), batch(&set, 1, 4, 7, 3));
        assert_ne!(batch(&set, 1, 4, 7, 0).1, batch(&set, 1, 4, 8, 0).1);
    }
}
