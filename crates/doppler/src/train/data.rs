//! Corpus, tokenizers and batches. Batches are a pure function of (seed, step,
//! micro-batch): a resumed run draws exactly the batches the uninterrupted one would.

use std::collections::HashMap;

use crate::check::Rng;
use crate::error::{Error, Result};

use super::config::{DataConfig, TokenizerKind};

/// Char-level (one id per distinct character, in sorted order) or byte-level BPE.
pub enum Tokenizer {
    Char {
        chars: Vec<char>,
        index: HashMap<char, u32>,
    },
    Bpe(Box<tokenizers::Tokenizer>),
}

fn tok_err(detail: impl std::fmt::Display) -> Error {
    Error::Invalid {
        op: "tokenizer",
        detail: detail.to_string(),
    }
}

impl Tokenizer {
    fn from_chars(mut chars: Vec<char>) -> Tokenizer {
        chars.sort_unstable();
        chars.dedup();
        let index = chars
            .iter()
            .enumerate()
            .map(|(i, &c)| (c, i as u32))
            .collect();
        Tokenizer::Char { chars, index }
    }

    /// Builds the tokenizer `cfg` asks for from the corpus text (deterministic).
    pub fn train(cfg: &DataConfig, text: &str) -> Result<Tokenizer> {
        match cfg.tokenizer {
            TokenizerKind::Char => Ok(Tokenizer::from_chars(text.chars().collect())),
            TokenizerKind::Bpe => {
                super::bpe::train(text, cfg.vocab_size).map(|t| Tokenizer::Bpe(Box::new(t)))
            }
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Char { chars, .. } => chars.len(),
            Tokenizer::Bpe(t) => t.get_vocab_size(true),
        }
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Char { index, .. } => text
                .chars()
                .map(|c| {
                    index.get(&c).copied().ok_or_else(|| {
                        tok_err(format!(
                            "character {c:?} is not in the char-level vocabulary"
                        ))
                    })
                })
                .collect(),
            Tokenizer::Bpe(t) => Ok(t.encode(text, false).map_err(tok_err)?.get_ids().to_vec()),
        }
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match self {
            Tokenizer::Char { chars, .. } => ids
                .iter()
                .map(|&i| {
                    chars.get(i as usize).copied().ok_or_else(|| {
                        tok_err(format!("id {i} out of range (vocabulary {})", chars.len()))
                    })
                })
                .collect(),
            Tokenizer::Bpe(t) => t.decode(ids, false).map_err(tok_err),
        }
    }

    /// JSON: the `tokenizers` format for BPE, {"kind": "char", "chars": "..."} for chars.
    pub fn to_json(&self) -> Result<Vec<u8>> {
        match self {
            Tokenizer::Char { chars, .. } => {
                let s: String = chars.iter().collect();
                Ok(
                    serde_json::to_vec(&serde_json::json!({ "kind": "char", "chars": s }))
                        .map_err(tok_err)?,
                )
            }
            Tokenizer::Bpe(t) => Ok(t.to_string(false).map_err(tok_err)?.into_bytes()),
        }
    }

    pub fn from_json(bytes: &[u8]) -> Result<Tokenizer> {
        let v: serde_json::Value = serde_json::from_slice(bytes).map_err(tok_err)?;
        if v["kind"] == "char" {
            let chars = v["chars"]
                .as_str()
                .ok_or_else(|| tok_err("char tokenizer without \"chars\""))?;
            return Ok(Tokenizer::from_chars(chars.chars().collect()));
        }
        let t = tokenizers::Tokenizer::from_bytes(bytes).map_err(tok_err)?;
        Ok(Tokenizer::Bpe(Box::new(t)))
    }
}

/// Token ids of the corpus, split: the first (1 - val_fraction) trains, the rest validates.
pub struct Dataset {
    pub train: Vec<u32>,
    pub val: Vec<u32>,
}

impl Dataset {
    pub fn new(tokens: Vec<u32>, val_fraction: f64, block: usize) -> Result<Dataset> {
        let cut = ((tokens.len() as f64) * (1.0 - val_fraction)) as usize;
        let (train, val) = (tokens[..cut].to_vec(), tokens[cut..].to_vec());
        if train.len() <= block + 1 || val.len() <= block + 1 {
            return Err(Error::Invalid {
                op: "dataset",
                detail: format!("{} training and {} validation tokens; each split needs more than block_size + 1 = {}", train.len(), val.len(), block + 1),
            });
        }
        Ok(Dataset { train, val })
    }
}

/// SplitMix64-style mixing of several words into one seed.
pub fn mix(words: &[u64]) -> u64 {
    words
        .iter()
        .fold(0x243F_6A88_85A3_08D3u64, |h, &w| Rng::new(h ^ w).next_u64())
}

/// (ids, targets), each (batch, block) row-major: random windows of `tokens` chosen by
/// `key`; targets are the ids shifted by one.
pub fn batch(tokens: &[u32], batch: usize, block: usize, key: u64) -> (Vec<u32>, Vec<u32>) {
    let mut rng = Rng::new(key);
    let span = (tokens.len() - block - 1) as u64;
    let (mut ids, mut targets) = (
        Vec::with_capacity(batch * block),
        Vec::with_capacity(batch * block),
    );
    for _ in 0..batch {
        let start = (rng.next_u64() % span) as usize;
        ids.extend_from_slice(&tokens[start..start + block]);
        targets.extend_from_slice(&tokens[start + 1..start + block + 1]);
    }
    (ids, targets)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn char_tokenizer_round_trips_and_names_unknown_chars() {
        let cfg = DataConfig {
            corpus: "x".into(),
            tokenizer: TokenizerKind::Char,
            vocab_size: 0,
            val_fraction: 0.1,
        };
        let t = Tokenizer::train(&cfg, "hello world").unwrap();
        assert_eq!(t.vocab_size(), 8);
        let ids = t.encode("low").unwrap();
        assert_eq!(t.decode(&ids).unwrap(), "low");
        let e = t.encode("xyz").unwrap_err().to_string();
        assert!(e.contains("'x'"), "{e}");
        let back = Tokenizer::from_json(&t.to_json().unwrap()).unwrap();
        assert_eq!(back.encode("hello").unwrap(), t.encode("hello").unwrap());
    }

    #[test]
    fn batches_are_a_function_of_the_key() {
        let tokens: Vec<u32> = (0..100).collect();
        let (a, ta) = batch(&tokens, 3, 8, 42);
        assert_eq!(batch(&tokens, 3, 8, 42), (a.clone(), ta.clone()));
        assert_ne!(batch(&tokens, 3, 8, 43).0, a);
        assert!(a.iter().zip(&ta).all(|(x, y)| y == &(x + 1)));
    }
}
