//! Tokenizers of model files: GGUF's `tokenizer.ggml.*` metadata (byte-level BPE as GPT-2,
//! SmolLM, Llama 3 and Qwen2 use, or SentencePiece as Llama 1/2 and TinyLlama use), or a
//! Hugging Face `tokenizer.json` beside SafeTensors weights.
//!
//! Control tokens (`<|im_start|>`, ...) written in text become their ids only when asked:
//! chat templates ask, user text does not unless `--special` is given (as llama.cpp).

use std::collections::{BTreeMap, BinaryHeap, HashMap};

use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{DecoderWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::error::{Error, Result};
use crate::formats::gguf::Value;

/// GGUF token types.
const TYPE_UNKNOWN: i64 = 2;
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;
const TYPE_BYTE: i64 = 6;

const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn err(path: &str, detail: impl Into<String>) -> Error {
    Error::Format {
        path: path.to_string(),
        detail: format!("tokenizer: {}", detail.into()),
    }
}

pub struct Tokenizer {
    kind: Kind,
    /// Text of every token (for listings and stop strings).
    pieces: Vec<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// Prepend BOS to a prompt.
    pub add_bos: bool,
    /// Control tokens by text, matched in text when special tokens are parsed.
    specials: BTreeMap<String, u32>,
    /// Pieces spell bytes in GPT-2's byte-to-character alphabet (byte-level BPE); else
    /// they are text with U+2581 for a space and `<0xXX>` byte tokens (SentencePiece).
    byte_level: bool,
    /// `decode` is the tokens' bytes joined, read as UTF-8 (lossy): byte-level BPE with
    /// nothing else in its decoder ([`Tokenizer::decode_is_bytes`]).
    decode_bytes: bool,
    /// Each token's bytes, worked out on first use ([`Tokenizer::token_bytes`]).
    bytes: std::sync::OnceLock<Vec<Vec<u8>>>,
}

enum Kind {
    Bpe(Box<tokenizers::Tokenizer>),
    Spm(Spm),
}

impl Tokenizer {
    /// From GGUF metadata (`tokenizer.ggml.model` = gpt2 or llama).
    pub fn from_gguf(md: &BTreeMap<String, Value>, path: &str) -> Result<Tokenizer> {
        let model = md
            .get("tokenizer.ggml.model")
            .and_then(Value::as_str)
            .ok_or_else(|| err(path, "tokenizer.ggml.model is missing"))?;
        let strings = |key: &str| -> Result<Vec<String>> {
            match md.get(key) {
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|v| {
                        v.as_str()
                            .map(str::to_string)
                            .ok_or_else(|| err(path, format!("{key} holds a non-string")))
                    })
                    .collect(),
                _ => Err(err(path, format!("{key} is missing"))),
            }
        };
        let pieces = strings("tokenizer.ggml.tokens")?;
        let types: Vec<i64> = match md.get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::I32(x) => *x as i64,
                    other => other.as_u64().map(|x| x as i64).unwrap_or(1),
                })
                .collect(),
            _ => vec![1; pieces.len()],
        };
        if types.len() != pieces.len() {
            return Err(err(
                path,
                format!("{} token types for {} tokens", types.len(), pieces.len()),
            ));
        }
        // A token id the metadata names: absent is None, outside the vocabulary an error
        // (an EOS that can never be sampled would let generation run on silently).
        let id = |key: &str| -> Result<Option<u32>> {
            match md.get(key).map(|v| v.as_u64()) {
                None => Ok(None),
                Some(Some(v)) if (v as usize) < pieces.len() => Ok(Some(v as u32)),
                Some(v) => Err(err(
                    path,
                    format!(
                        "{key} {} is outside the vocabulary of {} tokens",
                        v.map_or("(not an integer)".to_string(), |v| v.to_string()),
                        pieces.len()
                    ),
                )),
            }
        };
        let flag = |key: &str, d: bool| match md.get(key) {
            Some(Value::Bool(b)) => *b,
            _ => d,
        };
        let specials: BTreeMap<String, u32> = pieces
            .iter()
            .enumerate()
            .filter(|(i, _)| types[*i] == TYPE_CONTROL || types[*i] == TYPE_USER_DEFINED)
            .map(|(i, p)| (p.clone(), i as u32))
            .collect();
        let kind = match model {
            "gpt2" => {
                let pre = md
                    .get("tokenizer.ggml.pre")
                    .and_then(Value::as_str)
                    .unwrap_or("default");
                let merges: Vec<(String, String)> = strings("tokenizer.ggml.merges")?
                    .into_iter()
                    .map(|m| {
                        m.split_once(' ')
                            .map(|(a, b)| (a.to_string(), b.to_string()))
                            .ok_or_else(|| err(path, format!("merge {m:?} is not two tokens")))
                    })
                    .collect::<Result<_>>()?;
                let vocab: tokenizers::models::bpe::Vocab = pieces
                    .iter()
                    .enumerate()
                    .map(|(i, p)| (p.clone(), i as u32))
                    .collect();
                Kind::Bpe(Box::new(byte_level_bpe(vocab, merges, pre, path)?))
            }
            "llama" => {
                let scores: Vec<f32> = match md.get("tokenizer.ggml.scores") {
                    Some(Value::Array(a)) => {
                        a.iter().map(|v| v.as_f64().unwrap_or(0.0) as f32).collect()
                    }
                    _ => return Err(err(path, "tokenizer.ggml.scores is missing")),
                };
                if scores.len() != pieces.len() {
                    return Err(err(
                        path,
                        format!("{} scores for {} tokens", scores.len(), pieces.len()),
                    ));
                }
                Kind::Spm(Spm::new(
                    &pieces,
                    &scores,
                    &types,
                    id("tokenizer.ggml.unknown_token_id")?,
                    flag("tokenizer.ggml.add_space_prefix", true),
                ))
            }
            other => {
                return Err(err(
                    path,
                    format!("tokenizer model {other:?} is not supported (gpt2, llama)"),
                ))
            }
        };
        let add_bos = flag("tokenizer.ggml.add_bos_token", model == "llama");
        let (bos, eos) = (
            id("tokenizer.ggml.bos_token_id")?,
            id("tokenizer.ggml.eos_token_id")?,
        );
        Ok(Tokenizer {
            kind,
            pieces,
            bos,
            eos,
            add_bos,
            specials,
            byte_level: model == "gpt2",
            decode_bytes: model == "gpt2",
            bytes: Default::default(),
        })
    }

    /// From a Hugging Face `tokenizer.json` (and its `tokenizer_config.json` for BOS/EOS).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn from_hf_file(path: &std::path::Path) -> Result<Tokenizer> {
        let shown = path.display().to_string();
        let json = std::fs::read(path).map_err(|source| Error::Io {
            path: shown.clone(),
            source,
        })?;
        let config = path
            .parent()
            .map(|d| d.join("tokenizer_config.json"))
            .and_then(|p| std::fs::read_to_string(p).ok());
        Self::from_hf_json(&json, config.as_deref(), &shown)
    }

    /// From the bytes of a Hugging Face `tokenizer.json` and the text of its
    /// `tokenizer_config.json` (BOS/EOS), when there is one; `shown` names it in errors.
    pub fn from_hf_json(json: &[u8], config: Option<&str>, shown: &str) -> Result<Tokenizer> {
        // Malformed JSON first: the tokenizers crate panics on a syntax error inside the
        // "decoder" object (tokenizers 0.22, decoders/mod.rs: `expect("Helper")`).
        serde_json::from_slice::<serde_json::Value>(json)
            .map_err(|e| err(shown, format!("not valid JSON: {e}")))?;
        let tk = tokenizers::Tokenizer::from_bytes(json).map_err(|e| err(shown, e.to_string()))?;
        let n = tk.get_vocab_size(true);
        let mut pieces = vec![String::new(); n];
        for (p, i) in tk.get_vocab(true) {
            if (i as usize) < n {
                pieces[i as usize] = p;
            }
        }
        let specials: BTreeMap<String, u32> = tk
            .get_added_tokens_decoder()
            .values()
            .filter(|t| t.special)
            .filter_map(|t| tk.token_to_id(&t.content).map(|i| (t.content.clone(), i)))
            .collect();
        let cfg: serde_json::Value = config
            .and_then(|s| serde_json::from_str(s).ok())
            .unwrap_or_default();
        let token = |k: &str| {
            let v = cfg.get(k)?;
            let s = v
                .as_str()
                .or_else(|| v.get("content").and_then(|c| c.as_str()))?;
            tk.token_to_id(s)
        };
        let (bos, eos) = (token("bos_token"), token("eos_token"));
        let add_bos = cfg
            .get("add_bos_token")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        let decode_bytes = matches!(tk.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
        let byte_level = decode_bytes
            || matches!(
                tk.get_pre_tokenizer(),
                Some(PreTokenizerWrapper::ByteLevel(_))
            );
        Ok(Tokenizer {
            kind: Kind::Bpe(Box::new(tk)),
            pieces,
            bos,
            eos,
            add_bos,
            specials,
            byte_level,
            decode_bytes,
            bytes: Default::default(),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    /// This tokenizer as a Hugging Face `tokenizer.json` (byte-level BPE; its control
    /// tokens as special added tokens, so that chat markers stay single tokens), for
    /// `doppler export`. `shown` names the model in the error a SentencePiece one gets.
    pub fn hf_json(&self, shown: &str) -> Result<String> {
        let Kind::Bpe(tk) = &self.kind else {
            return Err(err(
                shown,
                "a SentencePiece vocabulary (tokenizer.ggml.model = llama) has no \
                 tokenizer.json form in Doppler: export from the model's Hugging Face \
                 directory instead",
            ));
        };
        let mut tk = (**tk).clone();
        let added: Vec<tokenizers::AddedToken> = self
            .specials
            .keys()
            .map(|s| tokenizers::AddedToken::from(s.clone(), true))
            .collect();
        tk.add_special_tokens(&added);
        tk.to_string(false).map_err(|e| err(shown, e.to_string()))
    }

    /// The id of a control token written out, e.g. `<|im_end|>`.
    pub fn special(&self, text: &str) -> Option<u32> {
        self.specials.get(text).copied()
    }

    /// Token ids of `text`; control tokens written in it become their ids when `special`.
    /// No BOS is added (see [`Tokenizer::add_bos`]).
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        for (piece, id) in self.split_specials(text, special) {
            match id {
                Some(id) => out.push(id),
                None => match &self.kind {
                    Kind::Bpe(tk) => out.extend(
                        tk.encode(piece, false)
                            .map_err(|e| Error::Invalid {
                                op: "tokenize",
                                detail: e.to_string(),
                            })?
                            .get_ids(),
                    ),
                    Kind::Spm(s) => s.encode(piece, out.is_empty(), &mut out),
                },
            }
        }
        Ok(out)
    }

    /// Text in `text` between control tokens (None) and the control tokens (Some(id)).
    fn split_specials<'a>(&self, text: &'a str, special: bool) -> Vec<(&'a str, Option<u32>)> {
        let mut out = Vec::new();
        let mut rest = text;
        if special && !self.specials.is_empty() {
            'scan: while !rest.is_empty() {
                for (i, _) in rest.char_indices() {
                    if let Some((s, id)) = self
                        .specials
                        .iter()
                        .filter(|(s, _)| rest[i..].starts_with(s.as_str()))
                        .max_by_key(|(s, _)| s.len())
                    {
                        if i > 0 {
                            out.push((&rest[..i], None));
                        }
                        out.push((&rest[i..i + s.len()], Some(*id)));
                        rest = &rest[i + s.len()..];
                        continue 'scan;
                    }
                }
                break;
            }
        }
        if !rest.is_empty() {
            out.push((rest, None));
        }
        out
    }

    /// Text of `ids`, control tokens written out.
    pub fn decode(&self, ids: &[u32]) -> String {
        match &self.kind {
            Kind::Bpe(tk) => tk.decode(ids, false).unwrap_or_default(),
            Kind::Spm(s) => s.decode(ids, &self.pieces),
        }
    }

    /// The token's text as stored (for listings).
    pub fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    /// Whether [`Tokenizer::decode`] is the tokens' bytes ([`Tokenizer::token_bytes`])
    /// joined and read as UTF-8, replacing what is not (text can then be built token by
    /// token).
    pub fn decode_is_bytes(&self) -> bool {
        self.decode_bytes
    }

    /// Whether `id` is a control token (`<|im_end|>`, ...): never part of plain text.
    pub fn is_special(&self, id: u32) -> bool {
        self.pieces
            .get(id as usize)
            .is_some_and(|p| self.specials.get(p) == Some(&id))
    }

    /// The bytes token `id` adds to the text (a control token: its text; a byte-level
    /// token may hold part of a UTF-8 character). Empty for an id past the vocabulary.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        let all = self.bytes.get_or_init(|| {
            let unbyte = byte_level_inverse();
            (0..self.pieces.len() as u32)
                .map(|i| {
                    let p = &self.pieces[i as usize];
                    if self.is_special(i) {
                        return p.as_bytes().to_vec();
                    }
                    if let Some(b) = p
                        .strip_prefix("<0x")
                        .and_then(|h| h.strip_suffix('>'))
                        .filter(|h| h.len() == 2 && !self.byte_level)
                        .and_then(|h| u8::from_str_radix(h, 16).ok())
                    {
                        return vec![b];
                    }
                    if self.byte_level {
                        if let Some(b) = p.chars().map(|c| unbyte.get(&c).copied()).collect() {
                            return b;
                        }
                    }
                    p.replace('\u{2581}', " ").into_bytes()
                })
                .collect()
        });
        all.get(id as usize).map_or(&[], Vec::as_slice)
    }
}

/// GPT-2's byte-level alphabet backwards: the character that stands for each byte -> the
/// byte (printable Latin-1 bytes stand for themselves, the others for U+0100 onwards).
fn byte_level_inverse() -> HashMap<char, u8> {
    let mut out = HashMap::new();
    let mut n = 0u32;
    for b in 0..=255u8 {
        let shown = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = match shown {
            true => b as u32,
            false => {
                n += 1;
                255 + n
            }
        };
        out.insert(char::from_u32(c).unwrap_or('?'), b);
    }
    out
}

fn byte_level_bpe(
    vocab: tokenizers::models::bpe::Vocab,
    merges: Vec<(String, String)>,
    pre: &str,
    path: &str,
) -> Result<tokenizers::Tokenizer> {
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| err(path, e.to_string()))?;
    let split = |pattern: &str| -> Result<PreTokenizerWrapper> {
        Ok(PreTokenizerWrapper::Split(
            Split::new(
                SplitPattern::Regex(pattern.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| err(path, e.to_string()))?,
        ))
    };
    let bytes_only = PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false));
    let gpt2 = PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true));
    // llama.cpp's pre-tokenizer names (`tokenizer.ggml.pre`) and the regexes they stand for.
    let pre_tok = match pre {
        "default" | "gpt-2" | "gpt2" | "olmo" | "mpt" | "jais" => gpt2,
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![PreTokenizerWrapper::Digits(Digits::new(true)), gpt2]))
        }
        "llama3" | "llama-bpe" | "llama-v3" | "smaug-bpe" | "dbrx" => PreTokenizerWrapper::Sequence(Sequence::new(vec![split(LLAMA3_PATTERN)?, bytes_only])),
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" => PreTokenizerWrapper::Sequence(Sequence::new(vec![split(QWEN2_PATTERN)?, bytes_only])),
        other => return Err(err(path, format!("pre-tokenizer {other:?} is not supported (gpt2, smollm, starcoder, llama-bpe, qwen2, ...)"))),
    };
    let mut tk = tokenizers::Tokenizer::new(bpe);
    tk.with_pre_tokenizer(Some(pre_tok));
    tk.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())));
    // Control tokens are not registered with `tokenizers`: `Tokenizer::encode` splits them
    // out itself, only when asked.
    Ok(tk)
}

/// SentencePiece BPE as llama.cpp runs it from GGUF: spaces become U+2581, a space is
/// prepended, characters merge pairwise by the highest score of the merged piece, and
/// what has no piece falls back to `<0xXX>` byte tokens.
struct Spm {
    ids: HashMap<String, u32>,
    scores: Vec<f32>,
    bytes: [Option<u32>; 256],
    unk: Option<u32>,
    add_space_prefix: bool,
    /// Token ids of byte tokens -> the byte.
    byte_of: HashMap<u32, u8>,
}

impl Spm {
    fn new(
        pieces: &[String],
        scores: &[f32],
        types: &[i64],
        unk: Option<u32>,
        add_space_prefix: bool,
    ) -> Spm {
        let mut bytes = [None; 256];
        let mut byte_of = HashMap::new();
        let mut ids = HashMap::new();
        for (i, p) in pieces.iter().enumerate() {
            if types[i] == TYPE_BYTE {
                if let Some(b) = p
                    .strip_prefix("<0x")
                    .and_then(|h| h.strip_suffix('>'))
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    bytes[b as usize] = Some(i as u32);
                    byte_of.insert(i as u32, b);
                }
            } else if types[i] != TYPE_CONTROL && types[i] != TYPE_UNKNOWN {
                ids.entry(p.clone()).or_insert(i as u32);
            }
        }
        Spm {
            ids,
            scores: scores.to_vec(),
            bytes,
            unk,
            add_space_prefix,
            byte_of,
        }
    }

    fn encode(&self, text: &str, first: bool, out: &mut Vec<u32>) {
        let mut s = String::new();
        if self.add_space_prefix && first {
            s.push(' ');
        }
        s.push_str(text);
        let s = s.replace(' ', "\u{2581}");
        // Symbols as (start, end) byte ranges of s in a linked list; merge candidates in a
        // heap by (score, leftmost first).
        let mut sym: Vec<(usize, usize)> = s
            .char_indices()
            .map(|(i, c)| (i, i + c.len_utf8()))
            .collect();
        let n = sym.len();
        let mut next: Vec<usize> = (1..=n).collect();
        let mut prev: Vec<Option<usize>> = (0..n).map(|i| i.checked_sub(1)).collect();
        let mut heap = BinaryHeap::new();
        let score = |a: (usize, usize), b: (usize, usize)| {
            self.ids
                .get(&s[a.0..b.1])
                .map(|&id| self.scores[id as usize])
        };
        let push = |heap: &mut BinaryHeap<(OrdF32, std::cmp::Reverse<usize>, usize)>,
                    sym: &[(usize, usize)],
                    l: usize,
                    r: usize| {
            if let Some(sc) = score(sym[l], sym[r]) {
                heap.push((
                    OrdF32(sc),
                    std::cmp::Reverse(l),
                    sym[l].1 - sym[l].0 + sym[r].1 - sym[r].0,
                ));
            }
        };
        for i in 0..n.saturating_sub(1) {
            push(&mut heap, &sym, i, i + 1);
        }
        while let Some((_, std::cmp::Reverse(l), len)) = heap.pop() {
            let r = next[l];
            // Stale: l merged away, or its right neighbour changed since this was pushed.
            if r >= n || sym[l].1 == sym[l].0 || sym[l].1 - sym[l].0 + sym[r].1 - sym[r].0 != len {
                continue;
            }
            sym[l].1 = sym[r].1;
            sym[r] = (0, 0);
            next[l] = next[r];
            if next[l] < n {
                prev[next[l]] = Some(l);
            }
            if let Some(p) = prev[l] {
                push(&mut heap, &sym, p, l);
            }
            if next[l] < n {
                push(&mut heap, &sym, l, next[l]);
            }
        }
        let mut i = 0;
        while i < n {
            let piece = &s[sym[i].0..sym[i].1];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for b in piece.bytes() {
                        if let Some(id) = self.bytes[b as usize].or(self.unk) {
                            out.push(id);
                        }
                    }
                }
            }
            i = next[i];
        }
    }

    fn decode(&self, ids: &[u32], pieces: &[String]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            match self.byte_of.get(&id) {
                Some(&b) => bytes.push(b),
                None => bytes.extend(
                    pieces
                        .get(id as usize)
                        .map(|p| p.replace('\u{2581}', " "))
                        .unwrap_or_default()
                        .bytes(),
                ),
            }
        }
        let text = String::from_utf8_lossy(&bytes).into_owned();
        match (self.add_space_prefix, text.strip_prefix(' ')) {
            (true, Some(t)) => t.to_string(),
            _ => text,
        }
    }
}

/// f32 with a total order, for the merge heap (scores are finite).
#[derive(Clone, Copy)]
struct OrdF32(f32);
impl PartialEq for OrdF32 {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == std::cmp::Ordering::Equal
    }
}
impl Eq for OrdF32 {}
impl PartialOrd for OrdF32 {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for OrdF32 {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by doppler-fuzz: a syntax error inside tokenizer.json's "decoder" made the
    /// tokenizers crate panic (`expect("Helper")`) instead of returning an error.
    #[test]
    fn malformed_tokenizer_json_is_an_error_not_a_panic() {
        for bad in [
            &br#"{"model": {"type": "BPE", "vocab": {}, "merges": []}, "decoder": {"type": "ByteLevel" "x": 1}}"#[..],
            br#"{"model": {"type": "BPE", "vocab": {}, "merges": []}, "decoder": {"type": "\ud800"}}"#,
        ] {
            let e = Tokenizer::from_hf_json(bad, None, "t/tokenizer.json")
                .err()
                .expect("refused")
                .to_string();
            assert!(e.contains("t/tokenizer.json") && e.contains("not valid JSON"), "{e}");
        }
    }

    /// A tiny SentencePiece vocabulary: merges by score, byte fallback for the rest.
    fn spm() -> (Spm, Vec<String>) {
        let mut pieces: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        let mut types = vec![TYPE_UNKNOWN, TYPE_CONTROL, TYPE_CONTROL];
        let mut scores = vec![0.0, 0.0, 0.0];
        for b in 0..256 {
            pieces.push(format!("<0x{b:02X}>"));
            types.push(TYPE_BYTE);
            scores.push(0.0);
        }
        for (p, s) in [
            ("\u{2581}", -1.0),
            ("h", -2.0),
            ("e", -2.0),
            ("l", -2.0),
            ("o", -2.0),
            ("\u{2581}h", -3.0),
            ("ll", -1.5),
            ("\u{2581}he", -4.0),
            ("llo", -2.5),
            ("\u{2581}hello", -0.5),
            ("w", -2.0),
        ] {
            pieces.push(p.into());
            types.push(1);
            scores.push(s);
        }
        (Spm::new(&pieces, &scores, &types, Some(0), true), pieces)
    }

    #[test]
    fn sentencepiece_merges_by_score_and_falls_back_to_bytes() {
        let (s, pieces) = spm();
        let mut out = Vec::new();
        s.encode("hello wé", true, &mut out);
        let text: Vec<&str> = out.iter().map(|&i| pieces[i as usize].as_str()).collect();
        // "▁hello" is reachable: ▁+h, then ll, llo, ▁h+e, ▁he+llo; "é" has no piece: bytes.
        assert_eq!(text, ["\u{2581}hello", "\u{2581}", "w", "<0xC3>", "<0xA9>"]);
        assert_eq!(s.decode(&out, &pieces), "hello wé");
    }
}
