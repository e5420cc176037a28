//! `doppler finetune`'s TOML config, checked like `train`'s (unknown fields are errors,
//! every value in range):
//!   base = "models/smollm2.gguf"        a .gguf or a Hugging Face directory
//!   data = "data/finetune/train.jsonl"  JSONL (see `finetune::data`)
//!   eval_data = "....jsonl"             optional; else eval_fraction of data (the last)
//!   eval_fraction = 0.1
//!   out_dir = "runs/ft"                 the adapter (PEFT), checkpoints, metrics.jsonl, loss.svg
//!   [lora]  rank = 16, alpha = 32, dropout = 0.05, targets = ["q_proj", ...] (all seven)
//!   [train] seq_len, overflow ("truncate" | "refuse"), batch_size, grad_accum, steps, lr,
//!           min_lr, warmup, weight_decay, betas, grad_clip, eval_interval, save_interval,
//!           seed, recompute (true: each layer recomputed in the backward, bounding memory)
//! Relative paths are relative to the config file; "~/" starts at the home directory.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::data::Overflow;
use super::lora::{LoraSpec, Target};
use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FinetuneConfig {
    pub base: PathBuf,
    pub data: PathBuf,
    #[serde(default)]
    pub eval_data: Option<PathBuf>,
    #[serde(default = "default_eval_fraction")]
    pub eval_fraction: f64,
    pub out_dir: PathBuf,
    pub lora: LoraConfig,
    pub train: FtTrainConfig,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraConfig {
    pub rank: usize,
    pub alpha: f64,
    #[serde(default)]
    pub dropout: f64,
    #[serde(default = "all_targets")]
    pub targets: Vec<Target>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FtTrainConfig {
    pub seq_len: usize,
    #[serde(default = "default_overflow")]
    pub overflow: Overflow,
    pub batch_size: usize,
    #[serde(default = "one")]
    pub grad_accum: usize,
    pub steps: u64,
    pub lr: f64,
    #[serde(default)]
    pub min_lr: f64,
    #[serde(default)]
    pub warmup: u64,
    #[serde(default)]
    pub weight_decay: f64,
    #[serde(default = "default_betas")]
    pub betas: (f64, f64),
    #[serde(default)]
    pub grad_clip: Option<f32>,
    #[serde(default = "default_interval")]
    pub eval_interval: u64,
    /// Steps between saves of the adapter (it is always saved at the end).
    #[serde(default = "default_interval")]
    pub save_interval: u64,
    #[serde(default)]
    pub seed: u64,
    /// Recompute each layer's forward in the backward from its saved input, keeping one
    /// layer's activations at a time (and the logits in pieces) instead of the whole
    /// model's: far less memory for about a third more work.
    #[serde(default = "yes")]
    pub recompute: bool,
}

fn default_eval_fraction() -> f64 {
    0.1
}
fn all_targets() -> Vec<Target> {
    Target::ALL.to_vec()
}
fn default_overflow() -> Overflow {
    Overflow::Truncate
}
fn yes() -> bool {
    true
}
fn one() -> usize {
    1
}
fn default_betas() -> (f64, f64) {
    (0.9, 0.999)
}
fn default_interval() -> u64 {
    100
}

impl FinetuneConfig {
    /// Reads and checks a config; relative paths become relative to its directory.
    pub fn load(path: &Path) -> Result<FinetuneConfig> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.display().to_string(),
            source,
        })?;
        let mut cfg = FinetuneConfig::parse(&text, &path.display().to_string())?;
        let base = path.parent().unwrap_or(Path::new("."));
        let home = std::env::var_os("HOME").map(PathBuf::from);
        for p in [&mut cfg.base, &mut cfg.data, &mut cfg.out_dir]
            .into_iter()
            .chain(cfg.eval_data.as_mut())
        {
            // "~/..." is the user's home (the model cache: ~/.cache/doppler/models).
            if let (Ok(rest), Some(h)) = (p.strip_prefix("~"), &home) {
                *p = h.join(rest);
            } else if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        Ok(cfg)
    }

    /// Parses and checks TOML text (`shown` names it in errors).
    pub fn parse(text: &str, shown: &str) -> Result<FinetuneConfig> {
        let cfg: FinetuneConfig = toml::from_str(text).map_err(|e| Error::Invalid {
            op: "finetune config",
            detail: format!("{shown}: {e}"),
        })?;
        cfg.check(shown)?;
        Ok(cfg)
    }

    fn check(&self, shown: &str) -> Result<()> {
        let bad = |why: String| {
            Err(Error::Invalid {
                op: "finetune config",
                detail: format!("{shown}: {why}"),
            })
        };
        let t = &self.train;
        if t.seq_len < 2 || t.batch_size == 0 || t.grad_accum == 0 || t.steps == 0 {
            return bad(format!(
                "seq_len {} (at least 2), batch_size {}, grad_accum {}, steps {} must be positive",
                t.seq_len, t.batch_size, t.grad_accum, t.steps
            ));
        }
        let ok_lr = |v: f64| v.is_finite() && v >= 0.0;
        if !(ok_lr(t.lr) && t.lr > 0.0 && ok_lr(t.min_lr) && t.min_lr <= t.lr) {
            return bad(format!(
                "lr {} must be positive and min_lr {} in [0, lr]",
                t.lr, t.min_lr
            ));
        }
        if !(0.0..1.0).contains(&t.betas.0) || !(0.0..1.0).contains(&t.betas.1) {
            return bad(format!("betas {:?} must be in [0, 1)", t.betas));
        }
        if !ok_lr(t.weight_decay) {
            return bad(format!("weight_decay {} must be >= 0", t.weight_decay));
        }
        if t.grad_clip.is_some_and(|c| !(c.is_finite() && c > 0.0)) {
            return bad(format!("grad_clip {:?} must be positive", t.grad_clip));
        }
        if t.eval_interval == 0 || t.save_interval == 0 {
            return bad("eval_interval and save_interval must be positive".into());
        }
        if !(0.0..1.0).contains(&self.eval_fraction) {
            return bad(format!(
                "eval_fraction {} not in [0, 1)",
                self.eval_fraction
            ));
        }
        let l = &self.lora;
        if l.rank == 0 || l.targets.is_empty() || !(l.alpha.is_finite() && l.alpha > 0.0) {
            return bad(format!(
                "lora rank {} and alpha {} must be positive, targets non-empty",
                l.rank, l.alpha
            ));
        }
        if !(0.0..1.0).contains(&l.dropout) {
            return bad(format!("lora dropout {} not in [0, 1)", l.dropout));
        }
        Ok(())
    }

    /// Settings in which `other` differs from this config, as "section.key: a vs b"; the
    /// paths (base, data, out_dir) are not compared: a resume checks what they hold.
    pub fn differences(&self, other: &FinetuneConfig) -> Vec<String> {
        let a = serde_json::to_value(self).unwrap_or_default();
        let b = serde_json::to_value(other).unwrap_or_default();
        let mut out = Vec::new();
        let mut diff = |name: String, x: &serde_json::Value, y: Option<&serde_json::Value>| {
            if y != Some(x) {
                let y = y.cloned().unwrap_or_default();
                out.push(format!("{name}: {x} vs {y}"));
            }
        };
        diff(
            "eval_fraction".into(),
            &a["eval_fraction"],
            b.get("eval_fraction"),
        );
        for section in ["lora", "train"] {
            let (Some(x), Some(y)) = (a[section].as_object(), b[section].as_object()) else {
                continue;
            };
            for (k, v) in x {
                diff(format!("{section}.{k}"), v, y.get(k));
            }
        }
        out
    }

    pub fn spec(&self) -> LoraSpec {
        LoraSpec {
            rank: self.lora.rank,
            alpha: self.lora.alpha,
            dropout: self.lora.dropout,
            targets: self.lora.targets.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str = "base = \"m.gguf\"\ndata = \"d.jsonl\"\nout_dir = \"o\"\n\
        [lora]\nrank = 8\nalpha = 16\n\
        [train]\nseq_len = 64\nbatch_size = 2\nsteps = 10\nlr = 2e-4\n";

    #[test]
    fn the_shipped_finetune_configs_parse() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let path = e.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if name.starts_with("finetune") && name.ends_with(".toml") {
                let c = FinetuneConfig::load(&path).unwrap_or_else(|e| panic!("{e}"));
                assert!(c.data.is_file(), "{}", c.data.display());
                assert!(c.eval_data.as_ref().is_some_and(|p| p.is_file()));
                n += 1;
            }
        }
        assert!(n >= 1);
    }

    #[test]
    fn differences_name_the_settings_not_the_paths() {
        let a = FinetuneConfig::parse(OK, "a").unwrap();
        let mut b = a.clone();
        b.out_dir = "elsewhere".into();
        b.base = "other.gguf".into();
        assert!(a.differences(&b).is_empty());
        b.lora.rank = 4;
        b.train.lr = 1e-3;
        assert_eq!(
            a.differences(&b),
            ["lora.rank: 8 vs 4", "train.lr: 0.0002 vs 0.001"]
        );
    }

    #[test]
    fn configs_are_checked() {
        let c = FinetuneConfig::parse(OK, "f.toml").unwrap();
        assert_eq!(c.lora.targets, Target::ALL.to_vec());
        assert_eq!(c.train.overflow, Overflow::Truncate);
        for (edit, want) in [
            (OK.replace("rank = 8", "rank = 0"), "rank 0"),
            (
                OK.replace("steps = 10", "steps = 10\nstesp = 3"),
                "unknown field",
            ),
            (OK.replace("lr = 2e-4", "lr = -1"), "lr -1"),
            (
                OK.replace("alpha = 16", "alpha = 16\ntargets = [\"lm_head\"]"),
                "lm_head",
            ),
            (
                OK.replace("seq_len = 64", "seq_len = 64\noverflow = \"drop\""),
                "drop",
            ),
            (
                OK.replace("alpha = 16", "alpha = 16\ndropout = 1.0"),
                "dropout 1",
            ),
        ] {
            let e = FinetuneConfig::parse(&edit, "f.toml")
                .unwrap_err()
                .to_string();
            assert!(e.contains(want) && e.contains("f.toml"), "{want}: {e}");
        }
    }
}
