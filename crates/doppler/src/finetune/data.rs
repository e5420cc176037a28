//! Fine-tuning data: JSONL, one sample a line, in one of three shapes (as TRL's SFT
//! trainer reads them):
//!   {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}
//!       rendered through the model's chat template; the loss covers the assistant turns
//!       (their text and the token that closes them), nothing else;
//!   {"prompt": "...", "completion": "..."}   the loss covers the completion (and EOS);
//!   {"text": "..."}                          the loss covers every token (and EOS).
//! A sample becomes one row of `seq_len` positions (padding: attention never crosses
//! samples); one longer than that is truncated or refused, as configured.

use crate::error::{Error, Result};
use crate::infer::chat::{Message, Template};
use crate::infer::tokenizer::Tokenizer;

/// Targets no token is scored against (padding, prompts).
pub const IGNORE: u32 = u32::MAX;

/// One tokenized sample: `train[i]` says whether token i is learned (predicted from the
/// tokens before it).
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub ids: Vec<u32>,
    pub train: Vec<bool>,
    /// The line of the file it came from (1-based), for messages.
    pub line: usize,
}

/// What to do with a sample longer than a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Overflow {
    /// Keep its first seq_len + 1 tokens (said once, with the count).
    Truncate,
    /// Stop with an error naming the line.
    Refuse,
}

fn bad(path: &str, line: usize, detail: impl Into<String>) -> Error {
    Error::Invalid {
        op: "finetune data",
        detail: format!("{path} line {line}: {}", detail.into()),
    }
}

/// Every sample of a JSONL text (blank lines skipped), tokenized with its mask.
pub fn parse_jsonl(
    text: &str,
    path: &str,
    tok: &Tokenizer,
    template: Option<&Template>,
) -> Result<Vec<Sample>> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(raw).map_err(|e| bad(path, line, format!("not JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| bad(path, line, "expected a JSON object"))?;
        let field = |k: &str| -> Result<Option<&str>> {
            match obj.get(k) {
                None => Ok(None),
                Some(serde_json::Value::String(s)) => Ok(Some(s)),
                Some(other) => Err(bad(
                    path,
                    line,
                    format!("\"{k}\" must be a string, got {other}"),
                )),
            }
        };
        let segments: Vec<(String, bool)> = if let Some(m) = obj.get("messages") {
            let template = template.ok_or_else(|| {
                bad(
                    path,
                    line,
                    "\"messages\" needs the model's chat template, and it has none we render",
                )
            })?;
            let msgs: Vec<Message> = serde_json::from_value(m.clone()).map_err(|e| {
                bad(
                    path,
                    line,
                    format!(
                        "\"messages\" must be a list of {{\"role\", \"content\"}} strings: {e}"
                    ),
                )
            })?;
            chat_segments(&msgs, template).map_err(|e| bad(path, line, e))?
        } else if let (Some(p), Some(c)) = (field("prompt")?, field("completion")?) {
            vec![(p.to_string(), false), (c.to_string(), true)]
        } else if let Some(t) = field("text")? {
            vec![(t.to_string(), true)]
        } else {
            return Err(bad(
                path,
                line,
                "expected \"messages\", \"prompt\" and \"completion\", or \"text\"",
            ));
        };
        let mut s = Sample {
            ids: Vec::new(),
            train: Vec::new(),
            line,
        };
        if tok.add_bos {
            if let Some(b) = tok.bos {
                s.ids.push(b);
                s.train.push(false);
            }
        }
        let chat = obj.contains_key("messages");
        for (text, train) in &segments {
            // Control tokens written in a chat template's text are tokens; in plain text
            // they are text.
            let ids = tok.encode(text, chat)?;
            s.train.extend(std::iter::repeat_n(*train, ids.len()));
            s.ids.extend(ids);
        }
        if !chat {
            // The end of a completion is learned too, as the model must learn to stop.
            if let Some(e) = tok.eos {
                s.ids.push(e);
                s.train.push(true);
            }
        }
        if !s.train.iter().skip(1).any(|&t| t) {
            return Err(bad(
                path,
                line,
                "nothing to learn (no assistant turn or completion text)",
            ));
        }
        out.push(s);
    }
    if out.is_empty() {
        return Err(Error::Invalid {
            op: "finetune data",
            detail: format!("{path}: no samples"),
        });
    }
    Ok(out)
}

/// A conversation as text segments: (text, learned), the assistant turns learned; what
/// follows the last assistant turn is dropped.
fn chat_segments(
    msgs: &[Message],
    template: &Template,
) -> std::result::Result<Vec<(String, bool)>, String> {
    for m in msgs {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant") {
            return Err(format!(
                "unknown role {:?} (system, user or assistant)",
                m.role
            ));
        }
    }
    let mut segs = Vec::new();
    let mut done = String::new();
    for (i, m) in msgs.iter().enumerate() {
        if m.role != "assistant" {
            continue;
        }
        let prompt = template.render(&msgs[..i], true);
        let Some(rest) = prompt.strip_prefix(&done) else {
            return Err("the chat template renders earlier turns differently once later ones follow; it cannot be split into prompt and answer".into());
        };
        segs.push((rest.to_string(), false));
        let answer = template.assistant_turn(&m.content);
        segs.push((answer.clone(), true));
        done = prompt + &answer;
    }
    if segs.is_empty() {
        return Err("no assistant message to learn".into());
    }
    Ok(segs)
}

/// A sample as one row of `seq_len` positions: (ids, targets), targets[i] the token after
/// ids[i] where it is learned, else [`IGNORE`]; padded with `pad` ids and ignored
/// targets. Longer samples are truncated (true returned) or refused.
pub fn row(
    s: &Sample,
    seq_len: usize,
    pad: u32,
    overflow: Overflow,
    path: &str,
) -> Result<(Vec<u32>, Vec<u32>, bool)> {
    let n = s.ids.len();
    let cut = n > seq_len + 1;
    if cut && overflow == Overflow::Refuse {
        return Err(bad(
            path,
            s.line,
            format!("{n} tokens, longer than seq_len {seq_len} + 1 (set overflow = \"truncate\" to keep the start)"),
        ));
    }
    let keep = n.min(seq_len + 1);
    let mut ids = vec![pad; seq_len];
    let mut targets = vec![IGNORE; seq_len];
    for i in 0..keep.saturating_sub(1) {
        ids[i] = s.ids[i];
        if s.train[i + 1] {
            targets[i] = s.ids[i + 1];
        }
    }
    Ok((ids, targets, cut))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::infer::chat::ChatStyle;

    fn chatml() -> Template {
        Template {
            style: ChatStyle::ChatMl,
            default_system: Some("You are helpful.".into()),
        }
    }

    #[test]
    fn chat_segments_learn_only_the_assistant() {
        let msgs = vec![
            Message::new("user", "Hi"),
            Message::new("assistant", "Hello!"),
            Message::new("user", "Bye"),
            Message::new("assistant", "See you."),
        ];
        let segs = chat_segments(&msgs, &chatml()).unwrap();
        let joined: String = segs.iter().map(|s| s.0.as_str()).collect();
        // The whole conversation as the template renders it, default system included.
        assert_eq!(
            joined,
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\nSee you.<|im_end|>\n"
        );
        let learned: Vec<&str> = segs.iter().filter(|s| s.1).map(|s| s.0.as_str()).collect();
        assert_eq!(learned, ["Hello!<|im_end|>\n", "See you.<|im_end|>\n"]);
        assert!(chat_segments(&[Message::new("user", "x")], &chatml()).is_err());
        assert!(chat_segments(&[Message::new("tool", "x")], &chatml()).is_err());
    }

    /// The tiny test model's byte-level tokenizer (ChatML control tokens).
    fn tiny_tokenizer() -> Tokenizer {
        let files = crate::verify::llama::tiny_files("llama", "F32", 1).unwrap();
        let g = crate::formats::gguf::GgufFile::from_bytes(Box::new(files.gguf), "t.gguf").unwrap();
        Tokenizer::from_gguf(&g.gguf.metadata, "t.gguf").unwrap()
    }

    #[test]
    fn jsonl_samples_and_their_errors() {
        let tok = tiny_tokenizer();
        let t = chatml();
        let text = concat!(
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}\n",
            "\n",
            "{\"prompt\": \"ab\", \"completion\": \"cd\"}\n",
            "{\"text\": \"xyz\"}\n",
        );
        let s = parse_jsonl(text, "d.jsonl", &tok, Some(&t)).unwrap();
        assert_eq!(s.len(), 3);
        assert_eq!(s.iter().map(|x| x.line).collect::<Vec<_>>(), [1, 3, 4]);
        // The chat sample learns "yo<|im_end|>\n" only: 2 bytes, the control token, "\n".
        let end = tok.special("<|im_end|>").unwrap();
        let learned: Vec<u32> = s[0]
            .ids
            .iter()
            .zip(&s[0].train)
            .filter(|p| *p.1)
            .map(|p| *p.0)
            .collect();
        assert_eq!(learned.len(), 4, "{learned:?}");
        assert_eq!(learned[2], end);
        assert_eq!(tok.decode(&learned[..2]), "yo");
        // Prompt and completion: the completion learned.
        let n_prompt = tok.encode("ab", false).unwrap().len();
        assert!(s[1].train[..n_prompt].iter().all(|&t| !t));
        assert!(s[1].train[n_prompt..].iter().all(|&t| t));
        for (bad_line, want) in [
            ("{not json", "line 1: not JSON"),
            ("[1, 2]", "line 1: expected a JSON object"),
            ("{\"prompt\": \"a\"}", "expected \"messages\""),
            ("{\"text\": 5}", "\"text\" must be a string"),
            (
                "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}]}",
                "no assistant message",
            ),
            (
                "{\"messages\": [{\"role\": \"user\"}]}",
                "\"messages\" must be a list",
            ),
        ] {
            let e = parse_jsonl(bad_line, "d.jsonl", &tok, Some(&t))
                .unwrap_err()
                .to_string();
            assert!(e.contains("d.jsonl") && e.contains(want), "{bad_line}: {e}");
        }
        let e = parse_jsonl("\n\n", "e.jsonl", &tok, Some(&t))
            .unwrap_err()
            .to_string();
        assert!(e.contains("e.jsonl: no samples"), "{e}");
        let e = parse_jsonl(text, "d.jsonl", &tok, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("chat template"), "{e}");
    }

    #[test]
    fn rows_shift_targets_mask_and_pad() {
        let s = Sample {
            ids: vec![10, 11, 12, 13, 14],
            train: vec![false, false, true, true, true],
            line: 3,
        };
        let (ids, tg, cut) = row(&s, 6, 0, Overflow::Refuse, "d").unwrap();
        assert_eq!(ids, [10, 11, 12, 13, 0, 0]);
        assert_eq!(tg, [IGNORE, 12, 13, 14, IGNORE, IGNORE]);
        assert!(!cut);
        let (ids, tg, cut) = row(&s, 3, 0, Overflow::Truncate, "d").unwrap();
        assert_eq!(
            (ids, tg, cut),
            (vec![10, 11, 12], vec![IGNORE, 12, 13], true)
        );
        let e = row(&s, 3, 0, Overflow::Refuse, "d.jsonl")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("d.jsonl line 3") && e.contains("5 tokens"),
            "{e}"
        );
    }
}
