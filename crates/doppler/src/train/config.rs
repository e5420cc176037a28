//! `doppler train --config FILE.toml`: the model, the data and the run, all in one file.
//! Every field is checked; unknown fields are errors (a typo must not silently fall back
//! to a default).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::models::convnet::ConvConfig;
use crate::models::transformer::ModelConfig;

/// A run's config. Two kinds, told apart by `model.arch`: a transformer ("gpt2", "llama")
/// trained on text, or a conv net ("convnet", "unet") trained on images.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    pub model: NetConfig,
    pub data: DataSpec,
    pub train: RunConfig,
}

/// The `[model]` table. Untagged in a checkpoint's state.json (as written before conv
/// nets existed); a TOML file is read by `arch`, so its errors name the right fields.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum NetConfig {
    Transformer(ModelConfig),
    Conv(ConvConfig),
}

/// The `[data]` table: a text corpus for a transformer, images for a conv net.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DataSpec {
    Text(DataConfig),
    Images(ImageDataConfig),
}

/// Labelled images in a CSV file: one image a line, its C*H*W pixel values (channel by
/// channel, rows top to bottom) and then its class (an integer in 0..classes). The shape
/// comes from the model's config.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageDataConfig {
    /// Relative paths are relative to the config file.
    pub images: PathBuf,
    /// The largest pixel value (16 for the 8x8 digits, 255 for 8-bit images): pixels are
    /// scaled from [0, pixel_max] to [-1, 1].
    pub pixel_max: f64,
    /// The last fraction of the images is held out for validation.
    #[serde(default = "default_val")]
    pub val_fraction: f64,
}

/// One kind's sections, read from TOML with every field checked.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Sections<M, D> {
    model: M,
    data: D,
    train: RunConfig,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenizerKind {
    /// One token per character of the corpus.
    Char,
    /// Byte-level BPE trained on the corpus (GPT-2 style).
    Bpe,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// UTF-8 text; relative paths are relative to the config file.
    pub corpus: PathBuf,
    pub tokenizer: TokenizerKind,
    /// BPE vocabulary size (ignored for char).
    #[serde(default = "default_vocab")]
    pub vocab_size: usize,
    /// The last fraction of the corpus is held out for validation.
    #[serde(default = "default_val")]
    pub val_fraction: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    pub batch_size: usize,
    /// Micro-batches per optimizer step (their gradients are averaged).
    #[serde(default = "one")]
    pub grad_accum: usize,
    pub steps: u64,
    pub lr: f64,
    #[serde(default)]
    pub min_lr: f64,
    #[serde(default)]
    pub warmup: u64,
    #[serde(default = "default_wd")]
    pub weight_decay: f64,
    #[serde(default = "default_betas")]
    pub betas: (f64, f64),
    /// Global gradient-norm clip; none when absent.
    #[serde(default)]
    pub grad_clip: Option<f32>,
    pub eval_interval: u64,
    #[serde(default = "default_eval_batches")]
    pub eval_batches: usize,
    pub checkpoint_interval: u64,
    pub seed: u64,
    /// Checkpoints, metrics and the loss curve go here; relative to the config file.
    pub out_dir: PathBuf,
    /// "dynamic" (start at 2^16, halve on overflow, double after 2000 good steps) or a
    /// fixed factor (default 1).
    #[serde(default)]
    pub loss_scale: LossScaleConfig,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LossScaleConfig {
    Fixed(f32),
    Named(String),
}

impl Default for LossScaleConfig {
    fn default() -> Self {
        LossScaleConfig::Fixed(1.0)
    }
}

fn default_vocab() -> usize {
    1024
}
fn default_val() -> f64 {
    0.1
}
fn one() -> usize {
    1
}
fn default_wd() -> f64 {
    0.1
}
fn default_betas() -> (f64, f64) {
    (0.9, 0.95)
}
fn default_eval_batches() -> usize {
    8
}

impl TrainConfig {
    /// Reads and checks a TOML config; relative paths become relative to its directory.
    pub fn load(path: &Path) -> Result<TrainConfig> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.display().to_string(),
            source,
        })?;
        let mut cfg = TrainConfig::parse(&text, &path.display().to_string())?;
        let base = path.parent().unwrap_or(Path::new("."));
        let data = match &mut cfg.data {
            DataSpec::Text(d) => &mut d.corpus,
            DataSpec::Images(d) => &mut d.images,
        };
        for p in [data, &mut cfg.train.out_dir] {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        Ok(cfg)
    }

    pub fn parse(text: &str, name: &str) -> Result<TrainConfig> {
        let err = |e: toml::de::Error| Error::Config {
            path: name.into(),
            detail: toml_error(text, &e),
        };
        let table: toml::Table = toml::from_str(text).map_err(err)?;
        let arch = table.get("model").and_then(|m| m.get("arch"));
        let cfg = if matches!(arch.and_then(|a| a.as_str()), Some("convnet" | "unet")) {
            let s: Sections<ConvConfig, ImageDataConfig> = toml::from_str(text).map_err(err)?;
            TrainConfig {
                model: NetConfig::Conv(s.model),
                data: DataSpec::Images(s.data),
                train: s.train,
            }
        } else {
            let s: Sections<ModelConfig, DataConfig> = toml::from_str(text).map_err(err)?;
            TrainConfig {
                model: NetConfig::Transformer(s.model),
                data: DataSpec::Text(s.data),
                train: s.train,
            }
        };
        cfg.check(name)?;
        Ok(cfg)
    }

    /// The transformer's config, for a text run.
    pub fn transformer(&self) -> Option<&ModelConfig> {
        match &self.model {
            NetConfig::Transformer(m) => Some(m),
            NetConfig::Conv(_) => None,
        }
    }

    /// The file the run's data comes from (corpus or images).
    pub fn data_path(&self) -> &Path {
        match &self.data {
            DataSpec::Text(d) => &d.corpus,
            DataSpec::Images(d) => &d.images,
        }
    }

    /// Items (tokens or images) in one micro-batch.
    pub fn items_per_batch(&self) -> usize {
        match &self.model {
            NetConfig::Transformer(m) => self.train.batch_size * m.block_size,
            NetConfig::Conv(_) => self.train.batch_size,
        }
    }

    fn check(&self, name: &str) -> Result<()> {
        let bad = |detail: String| {
            Err(Error::Config {
                path: name.into(),
                detail,
            })
        };
        let t = &self.train;
        let val_fraction = match &self.data {
            DataSpec::Text(d) => d.val_fraction,
            DataSpec::Images(d) => d.val_fraction,
        };
        if !(0.0..1.0).contains(&val_fraction) || val_fraction == 0.0 {
            return bad(format!(
                "data.val_fraction {val_fraction} must be in (0, 1)"
            ));
        }
        match (&self.model, &self.data) {
            (NetConfig::Transformer(_), DataSpec::Text(d)) => {
                if d.tokenizer == TokenizerKind::Bpe && !(257..=1 << 20).contains(&d.vocab_size) {
                    return bad(format!(
                        "data.vocab_size {} must be at least 257 for byte-level BPE",
                        d.vocab_size
                    ));
                }
            }
            (NetConfig::Conv(_), DataSpec::Images(d)) => {
                if !(d.pixel_max > 0.0 && d.pixel_max.is_finite()) {
                    return bad(format!("data.pixel_max {} must be positive", d.pixel_max));
                }
            }
            _ => {
                return bad(
                    "a transformer trains on a text corpus (data.corpus), a conv net on images (data.images)".into(),
                )
            }
        }
        if t.batch_size == 0
            || t.grad_accum == 0
            || t.steps == 0
            || t.eval_interval == 0
            || t.checkpoint_interval == 0
            || t.eval_batches == 0
        {
            return bad("train.batch_size, grad_accum, steps, eval_interval, eval_batches and checkpoint_interval must be positive".into());
        }
        if !(t.lr > 0.0 && t.min_lr >= 0.0 && t.min_lr <= t.lr) {
            return bad(format!(
                "train.lr {} must be positive and min_lr {} in [0, lr]",
                t.lr, t.min_lr
            ));
        }
        if let Some(c) = t.grad_clip {
            if !(c > 0.0 && c.is_finite()) {
                return bad(format!("train.grad_clip {c} must be positive"));
            }
        }
        let (b1, b2) = t.betas;
        if !((0.0..1.0).contains(&b1) && (0.0..1.0).contains(&b2)) {
            return bad(format!("train.betas [{b1}, {b2}]: each must be in [0, 1)"));
        }
        if !(t.weight_decay >= 0.0 && t.weight_decay.is_finite()) {
            return bad(format!(
                "train.weight_decay {} must be 0 or positive",
                t.weight_decay
            ));
        }
        self.loss_scaler().map_err(|detail| Error::Config {
            path: name.into(),
            detail,
        })?;
        let checked = match &self.model {
            NetConfig::Transformer(m) => {
                // vocab_size comes from the tokenizer: validate the rest with a placeholder.
                let mut m = m.clone();
                m.vocab_size = m.vocab_size.max(1);
                m.validate()
            }
            NetConfig::Conv(c) => c.validate(),
        };
        checked.map_err(|e| Error::Config {
            path: name.into(),
            detail: format!("[model] {e}"),
        })
    }

    pub fn loss_scaler(&self) -> std::result::Result<crate::optim::LossScaler, String> {
        match &self.train.loss_scale {
            LossScaleConfig::Fixed(s) if *s > 0.0 && s.is_finite() => {
                Ok(crate::optim::LossScaler {
                    scale: *s,
                    ..crate::optim::LossScaler::fixed()
                })
            }
            LossScaleConfig::Named(n) if n == "dynamic" => {
                Ok(crate::optim::LossScaler::dynamic(65536.0))
            }
            other => Err(format!(
                "train.loss_scale {other:?}: a positive number or \"dynamic\""
            )),
        }
    }

    /// Fields where `self` and `other` differ, named: what a resumed run may not change
    /// (everything but the corpus path and the output directory).
    pub fn differences(&self, other: &TrainConfig) -> Vec<String> {
        let a = serde_json::to_value(self).unwrap_or_default();
        let b = serde_json::to_value(other).unwrap_or_default();
        let mut out = Vec::new();
        for section in ["model", "data", "train"] {
            let (Some(x), Some(y)) = (a[section].as_object(), b[section].as_object()) else {
                continue;
            };
            for (k, v) in x {
                if matches!(k.as_str(), "out_dir" | "corpus" | "images") {
                    continue;
                }
                if y.get(k) != Some(v) {
                    out.push(format!(
                        "{section}.{k}: {} vs {}",
                        v,
                        y.get(k).cloned().unwrap_or_default()
                    ));
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[model]
arch = "llama"
n_layer = 2
n_embd = 64
n_head = 4
n_kv_head = 2
block_size = 32
[data]
corpus = "corpus.txt"
tokenizer = "char"
[train]
batch_size = 4
steps = 10
lr = 1e-3
eval_interval = 5
checkpoint_interval = 5
seed = 1
out_dir = "runs/x"
"#;

    #[test]
    fn out_of_range_values_are_refused_by_name() {
        let with = |section: &str, line: &str| {
            let text = GOOD.replace(&format!("[{section}]\n"), &format!("[{section}]\n{line}\n"));
            TrainConfig::parse(&text, "c.toml")
                .err()
                .unwrap_or_else(|| panic!("{line} accepted"))
                .to_string()
        };
        for (section, line, names) in [
            ("train", "betas = [0.9, 1.0]", "train.betas"),
            ("train", "betas = [-0.1, 0.99]", "train.betas"),
            ("train", "weight_decay = -0.1", "train.weight_decay"),
            ("model", "norm_eps = -1e-5", "norm_eps"),
            ("model", "norm_eps = nan", "norm_eps"),
            ("model", "ffn_hidden = 0", "ffn_hidden 0"),
            ("model", "rope_theta = 0.0", "rope_theta"),
        ] {
            let e = with(section, line);
            assert!(e.contains("c.toml") && e.contains(names), "{line}: {e}");
        }
    }

    #[test]
    fn the_shipped_configs_parse() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let path = e.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            // Fine-tuning configs are `doppler finetune`'s (finetune::config checks them).
            if path.extension().is_some_and(|x| x == "toml") && !name.starts_with("finetune") {
                let c = TrainConfig::load(&path).unwrap_or_else(|e| panic!("{e}"));
                // Image sets are fetched by a script (scripts/fetch_digits.sh), not shipped.
                if matches!(c.data, DataSpec::Text(_)) {
                    assert!(c.data_path().is_file(), "{}", path.display());
                }
                n += 1;
            }
        }
        assert!(n >= 2);
        let nano = TrainConfig::load(&dir.join("shakespeare_char.toml")).unwrap();
        use crate::models::transformer::InitScheme;
        assert_eq!(nano.transformer().unwrap().init, InitScheme::Nanogpt);
        assert_eq!(nano.train.betas, (0.9, 0.99));
    }

    #[test]
    fn parses_and_fills_defaults() {
        let c = TrainConfig::parse(GOOD, "good.toml").unwrap();
        assert_eq!(c.train.grad_accum, 1);
        let DataSpec::Text(d) = &c.data else {
            panic!("text data")
        };
        assert_eq!(d.val_fraction, 0.1);
        assert!(!c.loss_scaler().unwrap().dynamic);
    }

    #[test]
    fn bad_configs_get_clear_errors() {
        let e = TrainConfig::parse(&GOOD.replace("n_head = 4", "n_haed = 4"), "t.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("t.toml") && e.contains("n_haed"), "{e}");
        let e = TrainConfig::parse(&GOOD.replace("n_head = 4", "n_head = 3"), "t.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("n_embd 64 is not a multiple of n_head 3"), "{e}");
        let e = TrainConfig::parse(&GOOD.replace("lr = 1e-3", "lr = -1.0"), "t.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("train.lr"), "{e}");
        let e = TrainConfig::parse(
            &GOOD.replace("seed = 1", "seed = 1\nloss_scale = \"dynamc\""),
            "t.toml",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("loss_scale"), "{e}");
        let e = TrainConfig::parse("[model\n", "t.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("t.toml"), "{e}");
    }

    #[test]
    fn differences_name_the_fields() {
        let a = TrainConfig::parse(GOOD, "a").unwrap();
        let mut b = a.clone();
        let NetConfig::Transformer(m) = &mut b.model else {
            panic!("a transformer config")
        };
        m.n_layer = 3;
        b.train.out_dir = "elsewhere".into();
        assert_eq!(a.differences(&b), vec!["model.n_layer: 2 vs 3".to_string()]);
    }
}

/// A TOML error in one line: where (line and column) and what.
fn toml_error(text: &str, e: &toml::de::Error) -> String {
    let what = e.message().trim().replace('\n', " ");
    match e.span() {
        Some(span) => {
            let before = text.get(..span.start).unwrap_or(text);
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            let source = text.lines().nth(line - 1).unwrap_or("").trim();
            let source: String = source.chars().take(60).collect();
            format!("line {line}, column {column} (`{source}`): {what}")
        }
        None => what,
    }
}
