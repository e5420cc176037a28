//! The JS API's option objects, checked the way the CLI checks its flags (the same
//! defaults as `doppler generate`). Plain Rust, so that they are tested natively.

use doppler::infer::sample::SamplerConfig;
use doppler::Error;

/// `generate()`'s and `chat.send()`'s options (camelCase in JS); unknown keys are refused.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct GenerateOptions {
    /// Wrap the prompt in the model's chat template as one user message.
    pub chat: bool,
    /// Treat control tokens written in the prompt as such.
    pub special: bool,
    pub max_tokens: usize,
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repeat_penalty: f32,
    pub repeat_last_n: usize,
    pub seed: u64,
    /// Stop when one of these texts appears (it is not returned).
    pub stop: Vec<String>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        let s = SamplerConfig::default();
        GenerateOptions {
            chat: false,
            special: false,
            max_tokens: 200,
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            repeat_penalty: s.repeat_penalty,
            repeat_last_n: s.repeat_last_n,
            seed: s.seed,
            stop: Vec::new(),
        }
    }
}

impl GenerateOptions {
    /// From the options object's JSON text (`undefined` or `null`: the defaults).
    pub fn parse(json: Option<&str>) -> Result<GenerateOptions, Error> {
        let o: GenerateOptions = match json {
            None | Some("null") | Some("undefined") => GenerateOptions::default(),
            Some(j) => serde_json::from_str(j).map_err(|e| Error::Invalid {
                op: "generate options",
                detail: e.to_string(),
            })?,
        };
        o.sampler().validate().map_err(|detail| Error::Invalid {
            op: "generate options",
            detail,
        })?;
        if o.stop.iter().any(String::is_empty) {
            return Err(Error::Invalid {
                op: "generate options",
                detail: "a stop text is empty".into(),
            });
        }
        Ok(o)
    }

    pub fn sampler(&self) -> SamplerConfig {
        SamplerConfig {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed: self.seed,
            ..Default::default()
        }
    }
}

/// `train()`'s options.
#[derive(Clone, Debug, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct TrainOptions {
    /// Stop after this many steps (the schedule still spans the config's `train.steps`),
    /// as `doppler train --max-steps`.
    pub max_steps: Option<u64>,
}

impl TrainOptions {
    pub fn parse(json: Option<&str>) -> Result<TrainOptions, Error> {
        match json {
            None | Some("null") | Some("undefined") => Ok(TrainOptions::default()),
            Some(j) => serde_json::from_str(j).map_err(|e| Error::Invalid {
                op: "train options",
                detail: e.to_string(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_take_the_cli_defaults_and_refuse_bad_values() {
        let d = GenerateOptions::parse(None).unwrap();
        assert_eq!((d.max_tokens, d.temperature, d.top_k), (200, 0.8, 40));
        let o = GenerateOptions::parse(Some(
            r#"{"maxTokens": 8, "temperature": 0, "stop": ["\n"]}"#,
        ))
        .unwrap();
        assert_eq!((o.max_tokens, o.temperature, o.stop.len()), (8, 0.0, 1));
        let e = GenerateOptions::parse(Some(r#"{"topP": 0}"#)).unwrap_err();
        assert!(e.to_string().contains("top-p 0 must be in (0, 1]"), "{e}");
        let e = GenerateOptions::parse(Some(r#"{"max_tokens": 8}"#)).unwrap_err();
        assert!(e.to_string().contains("unknown field `max_tokens`"), "{e}");
        let e = GenerateOptions::parse(Some(r#"{"temperature": -1}"#)).unwrap_err();
        assert!(e.to_string().contains("temperature"), "{e}");
        let e = GenerateOptions::parse(Some(r#"{"stop": [""]}"#)).unwrap_err();
        assert!(e.to_string().contains("stop text is empty"), "{e}");
        assert_eq!(
            TrainOptions::parse(Some(r#"{"maxSteps": 20}"#))
                .unwrap()
                .max_steps,
            Some(20)
        );
        assert!(TrainOptions::parse(Some(r#"{"steps": 20}"#)).is_err());
    }
}
