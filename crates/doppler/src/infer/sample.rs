//! Choosing the next token from logits, in llama.cpp's order: repetition penalty, top-k,
//! top-p, min-p, temperature, then a draw from the distribution (or the argmax when the
//! temperature is 0). Seeded: the same logits, history and seed give the same tokens.

#[derive(Clone, Debug, serde::Serialize)]
pub struct SamplerConfig {
    /// 0 picks the most likely token (greedy).
    pub temperature: f32,
    /// Keep the k most likely (0: all).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p (1: all).
    pub top_p: f32,
    /// Drop tokens less likely than min_p times the most likely (0: none).
    pub min_p: f32,
    /// Divide positive logits (multiply negative ones) of recent tokens (1: off).
    pub repeat_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    pub fn greedy() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..Default::default()
        }
    }

    /// A clear error for values outside their range.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!("temperature {} must be >= 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top-p {} must be in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min-p {} must be in [0, 1]", self.min_p));
        }
        if !(self.repeat_penalty > 0.0 && self.repeat_penalty.is_finite()) {
            return Err(format!(
                "repeat penalty {} must be > 0",
                self.repeat_penalty
            ));
        }
        Ok(())
    }
}

pub struct Sampler {
    pub cfg: SamplerConfig,
    state: u64,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        let state = cfg.seed ^ 0x9E37_79B9_7F4A_7C15;
        Sampler { cfg, state }
    }

    /// splitmix64: a uniform draw in [0, 1) with 53 bits.
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The next token given `logits` (V) and the tokens so far. Non-finite logits are
    /// never chosen; if none is finite, token 0.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let c = &self.cfg;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, &v)| (i as u32, v))
            .collect();
        if cand.is_empty() {
            return 0;
        }
        if c.repeat_penalty != 1.0 {
            let recent = &history[history.len().saturating_sub(c.repeat_last_n)..];
            let mut seen = std::collections::HashSet::new();
            for &t in recent {
                if seen.insert(t) {
                    if let Some(e) = cand.iter_mut().find(|e| e.0 == t) {
                        e.1 = if e.1 > 0.0 {
                            e.1 / c.repeat_penalty
                        } else {
                            e.1 * c.repeat_penalty
                        };
                    }
                }
            }
        }
        // Most likely first; equal logits by id, so the order is total.
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if c.temperature == 0.0 {
            return cand
                .iter()
                .min_by(|a, b| order(a, b))
                .map(|e| e.0)
                .unwrap_or(0);
        }
        if c.top_k > 0 && c.top_k < cand.len() {
            cand.select_nth_unstable_by(c.top_k - 1, order);
            cand.truncate(c.top_k);
        }
        cand.sort_by(order);
        // Probabilities at temperature 1 for the top-p and min-p cuts (as llama.cpp).
        let probs = |cand: &[(u32, f32)], temp: f32| -> Vec<f64> {
            let m = cand[0].1 as f64;
            let e: Vec<f64> = cand
                .iter()
                .map(|x| ((x.1 as f64 - m) / temp as f64).exp())
                .collect();
            let z: f64 = e.iter().sum();
            e.into_iter().map(|v| v / z).collect()
        };
        if c.top_p < 1.0 {
            let p = probs(&cand, 1.0);
            let mut acc = 0.0;
            let keep = p.iter().position(|&q| {
                acc += q;
                acc >= c.top_p as f64
            });
            cand.truncate(keep.map_or(cand.len(), |k| k + 1));
        }
        if c.min_p > 0.0 {
            let p = probs(&cand, 1.0);
            let cut = p[0] * c.min_p as f64;
            let keep = p.iter().take_while(|&&q| q >= cut).count().max(1);
            cand.truncate(keep);
        }
        let p = probs(&cand, c.temperature);
        let r = self.uniform();
        let mut acc = 0.0;
        for (i, q) in p.iter().enumerate() {
            acc += q;
            if r < acc {
                return cand[i].0;
            }
        }
        cand[cand.len() - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_argmax_and_lowest_id_on_ties() {
        let mut s = Sampler::new(SamplerConfig::greedy());
        assert_eq!(s.sample(&[0.1, 2.0, -1.0, 2.0, f32::NAN], &[]), 1);
    }

    #[test]
    fn penalty_top_k_and_seeds() {
        let logits = [1.0f32, 3.0, 2.9, 0.5, -2.0];
        // A strong penalty on token 1 makes 2 the argmax.
        let mut s = Sampler::new(SamplerConfig {
            repeat_penalty: 2.0,
            ..SamplerConfig::greedy()
        });
        assert_eq!(s.sample(&logits, &[1]), 2);
        // top-k 2 only ever yields 1 or 2; a seed repeats its draws, another differs.
        let cfg = SamplerConfig {
            temperature: 1.5,
            top_k: 2,
            top_p: 1.0,
            min_p: 0.0,
            seed: 7,
            ..Default::default()
        };
        let draw = |cfg: SamplerConfig| {
            let mut s = Sampler::new(cfg);
            (0..200).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        let a = draw(cfg.clone());
        assert!(a.iter().all(|&t| t == 1 || t == 2) && a.contains(&1) && a.contains(&2));
        assert_eq!(a, draw(cfg.clone()));
        assert_ne!(a, draw(SamplerConfig { seed: 8, ..cfg }));
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        // p ~ [0.64, 0.24, 0.09, 0.03]: top-p 0.8 keeps two, min-p 0.2 keeps two.
        let logits = [3.0f32, 2.0, 1.0, -0.1];
        for cfg in [
            SamplerConfig {
                top_p: 0.8,
                min_p: 0.0,
                top_k: 0,
                ..Default::default()
            },
            SamplerConfig {
                top_p: 1.0,
                min_p: 0.2,
                top_k: 0,
                ..Default::default()
            },
        ] {
            let mut s = Sampler::new(SamplerConfig {
                temperature: 1.0,
                ..cfg
            });
            let seen: std::collections::BTreeSet<u32> =
                (0..500).map(|_| s.sample(&logits, &[])).collect();
            assert_eq!(seen.into_iter().collect::<Vec<_>>(), [0, 1]);
        }
    }
}
