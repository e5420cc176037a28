//! Chat templates. Models carry a Jinja template (`tokenizer.chat_template`); we recognise
//! the common formats by their markers and render them in Rust: ChatML (SmolLM2, Qwen2),
//! Llama 3, Zephyr, Phi-3, Gemma and Mistral's [INST]. A template that sets a default system message (SmolLM2's does)
//! has it taken out and used when the conversation has none.

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum ChatStyle {
    /// `<|im_start|>role\ncontent<|im_end|>\n`
    ChatMl,
    /// `<|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>`, after `<|begin_of_text|>`
    Llama3,
    /// `<|role|>\ncontent</s>\n`
    Zephyr,
    /// `<|role|>\ncontent<|end|>\n` (Phi-3)
    Phi3,
    /// `<start_of_turn>user\ncontent<end_of_turn>\n<start_of_turn>model\n` (Gemma; a system
    /// message opens the first user turn, followed by a blank line; contents trimmed)
    Gemma,
    /// `[INST] content [/INST]answer</s>` (Mistral 7B v0.1/v0.2), or with `spaced`
    /// false `[INST] content[/INST] answer</s>` (v0.3); a system message opens the user
    /// turn after it, followed by a blank line
    Mistral { spaced: bool },
}

#[derive(Clone, Debug)]
pub struct Template {
    pub style: ChatStyle,
    /// System message used when the conversation starts without one.
    pub default_system: Option<String>,
}

impl Template {
    /// The format of a Jinja chat template; None when it is none of ours.
    pub fn detect(jinja: &str) -> Option<Template> {
        let style = if jinja.contains("<|im_start|>") {
            ChatStyle::ChatMl
        } else if jinja.contains("<|start_header_id|>") {
            ChatStyle::Llama3
        } else if jinja.contains("<|user|>") && jinja.contains("<|end|>") {
            ChatStyle::Phi3
        } else if jinja.contains("<|user|>") && jinja.contains("<|assistant|>") {
            ChatStyle::Zephyr
        } else if jinja.contains("<start_of_turn>") {
            ChatStyle::Gemma
        } else if jinja.contains("[INST]") && jinja.contains("[/INST]") {
            ChatStyle::Mistral {
                spaced: jinja.contains("' [/INST]'"),
            }
        } else {
            return None;
        };
        // A literal default system turn written into the template (SmolLM2, Qwen2).
        let default_system = match style {
            ChatStyle::ChatMl => jinja.split("<|im_start|>system\n").nth(1).and_then(|rest| {
                let text = rest.split("<|im_end|>").next()?;
                // Only a literal: a template that prints a variable here has no default.
                (!text.contains("{{") && !text.contains("{%") && !text.contains('\''))
                    .then(|| text.to_string())
            }),
            _ => None,
        };
        Some(Template {
            style,
            default_system,
        })
    }

    /// Text of `messages` (the start of a conversation when `first`), then the header of
    /// the assistant's turn.
    pub fn render(&self, messages: &[Message], first: bool) -> String {
        let mut out = String::new();
        if first && self.style == ChatStyle::Llama3 {
            out.push_str("<|begin_of_text|>");
        }
        let mut all: Vec<Message> = Vec::new();
        if first && messages.first().is_none_or(|m| m.role != "system") {
            if let Some(s) = &self.default_system {
                all.push(Message::new("system", s));
            }
        }
        all.extend(messages.iter().cloned());
        // Gemma and Mistral have no system turn: its text opens the next user turn.
        let fold = matches!(self.style, ChatStyle::Gemma | ChatStyle::Mistral { .. });
        let mut system: Option<String> = None;
        for m in &all {
            let content = match self.style {
                ChatStyle::Gemma => m.content.trim().to_string(),
                _ => m.content.clone(),
            };
            if fold && m.role == "system" {
                system = Some(content);
                continue;
            }
            let content = match (m.role.as_str(), system.take()) {
                ("user", Some(s)) => format!("{s}\n\n{content}"),
                _ => content,
            };
            out.push_str(&self.turn(&m.role, &content));
        }
        out.push_str(&self.header("assistant"));
        out
    }

    fn header(&self, role: &str) -> String {
        match self.style {
            ChatStyle::ChatMl => format!("<|im_start|>{role}\n"),
            ChatStyle::Llama3 => format!("<|start_header_id|>{role}<|end_header_id|>\n\n"),
            ChatStyle::Zephyr | ChatStyle::Phi3 => format!("<|{role}|>\n"),
            ChatStyle::Gemma => {
                let role = if role == "assistant" { "model" } else { role };
                format!("<start_of_turn>{role}\n")
            }
            // The answer follows [/INST] (the model writes v0.3's space itself).
            ChatStyle::Mistral { .. } => String::new(),
        }
    }

    fn turn(&self, role: &str, content: &str) -> String {
        match (&self.style, role) {
            (ChatStyle::Mistral { spaced: true }, "user") => format!("[INST] {content} [/INST]"),
            (ChatStyle::Mistral { spaced: false }, "user") => format!("[INST] {content}[/INST]"),
            (ChatStyle::Mistral { spaced: false }, _) => format!(" {content}</s>"),
            _ => format!("{}{content}{}", self.header(role), self.end_of_turn()),
        }
    }

    /// The assistant's turn after its header: its text and what closes it (what
    /// fine-tuning learns; [`Template::render`] of the turns before gives the header).
    pub fn assistant_turn(&self, content: &str) -> String {
        let content = match self.style {
            ChatStyle::Gemma => content.trim(),
            _ => content,
        };
        let turn = self.turn("assistant", content);
        let header = self.header("assistant");
        turn.strip_prefix(&header).unwrap_or(&turn).to_string()
    }

    /// What closes a turn (the assistant's too, after its text).
    pub fn end_of_turn(&self) -> &'static str {
        match self.style {
            ChatStyle::ChatMl => "<|im_end|>\n",
            ChatStyle::Llama3 => "<|eot_id|>",
            ChatStyle::Zephyr => "</s>\n",
            ChatStyle::Phi3 => "<|end|>\n",
            ChatStyle::Gemma => "<end_of_turn>\n",
            ChatStyle::Mistral { .. } => "</s>",
        }
    }

    /// The control token that ends the assistant's turn.
    pub fn stop_token(&self) -> &'static str {
        match self.style {
            ChatStyle::ChatMl => "<|im_end|>",
            ChatStyle::Llama3 => "<|eot_id|>",
            ChatStyle::Zephyr | ChatStyle::Mistral { .. } => "</s>",
            ChatStyle::Phi3 => "<|end|>",
            ChatStyle::Gemma => "<end_of_turn>",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_three_styles() {
        let msgs = [
            Message::new("user", "Hi"),
            Message::new("assistant", "Hello"),
            Message::new("user", "Bye"),
        ];
        let chatml = Template::detect("{{'<|im_start|>' + message['role'] }}").unwrap();
        assert_eq!(
            chatml.render(&msgs[2..], true),
            "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
        );
        let llama3 = Template::detect("<|start_header_id|>").unwrap();
        assert_eq!(
            llama3.render(&msgs[..1], true),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        // Phi-3's template (microsoft/Phi-3-mini-4k-instruct's tokenizer_config.json).
        let phi3 = Template::detect("{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}").unwrap();
        assert_eq!(
            phi3.render(&msgs, true),
            "<|user|>\nHi<|end|>\n<|assistant|>\nHello<|end|>\n<|user|>\nBye<|end|>\n<|assistant|>\n"
        );
        assert_eq!(phi3.stop_token(), "<|end|>");
        let zephyr = Template::detect("<|user|> ... <|assistant|>").unwrap();
        assert_eq!(
            zephyr.render(&msgs[..1], false),
            "<|user|>\nHi</s>\n<|assistant|>\n"
        );
        assert!(Template::detect("[INST]").is_none());
    }

    /// Gemma 3 (google/gemma-3-1b-it's template: the system text opens the first user
    /// turn, contents trimmed, the assistant is "model") and Mistral's two spacings
    /// (mistralai/Mistral-7B-Instruct-v0.2 and v0.3).
    #[test]
    fn renders_gemma_and_mistral() {
        let gemma = Template::detect("{{ bos_token }}{%- for message in loop_messages -%}{{ '<start_of_turn>' + role + '\n' }}{{ '<end_of_turn>\n' }}{%- endfor -%}").unwrap();
        let msgs = [
            Message::new("system", "Be brief."),
            Message::new("user", " Hi \n"),
            Message::new("assistant", "Hello"),
            Message::new("user", "Bye"),
        ];
        assert_eq!(
            gemma.render(&msgs, true),
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(gemma.stop_token(), "<end_of_turn>");
        let v2 = Template::detect("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% endif %}{% endfor %}").unwrap();
        assert_eq!(
            v2.render(&msgs[1..], true),
            "[INST]  Hi \n [/INST]Hello</s>[INST] Bye [/INST]"
        );
        let v3 = Template::detect("{{ '[INST] ' + message['content'] + '[/INST]' }}{{ ' ' + message['content'] + eos_token}}").unwrap();
        assert_eq!(
            v3.render(&msgs, true),
            "[INST] Be brief.\n\n Hi \n[/INST] Hello</s>[INST] Bye[/INST]"
        );
    }

    #[test]
    fn takes_a_literal_default_system_message() {
        let t = Template::detect("{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}{% endif %}").unwrap();
        assert_eq!(t.default_system.as_deref(), Some("Be brief."));
        assert!(t
            .render(&[Message::new("user", "x")], true)
            .starts_with("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nx"));
        assert!(!t
            .render(&[Message::new("user", "x")], false)
            .contains("system"));
    }
}
