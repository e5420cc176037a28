//! Choosing the next token from logits: a constraint's mask (e.g. a JSON grammar), the
//! logit bias, the repetition penalty (llama.cpp's), presence and frequency penalties
//! (OpenAI's), then in llama.cpp's order top-k, top-p, min-p, temperature and a draw from
//! the distribution (or the argmax when the temperature is 0). Seeded: the same logits,
//! history and seed give the same tokens. Optionally the chosen token's log-probability
//! and the most likely alternatives, from the model's logits as they came (before any of
//! the above, as vLLM reports them by default).

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
    /// OpenAI's presence penalty: subtracted from the logit of every token this sampler
    /// has chosen before (0: off; OpenAI allows -2..2).
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty: subtracted once for each time this sampler chose the
    /// token before (0: off).
    pub frequency_penalty: f32,
    /// Added to the logits of these tokens before anything else (OpenAI's logit_bias:
    /// -100 bans a token, 100 all but forces it).
    pub logit_bias: Vec<(u32, f32)>,
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
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
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
        for (name, v) in [
            ("presence penalty", self.presence_penalty),
            ("frequency penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} {v} must be in [-2, 2]"));
            }
        }
        if let Some((t, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return Err(format!(
                "logit bias {b} of token {t} must be in [-100, 100]"
            ));
        }
        Ok(())
    }
}

/// What may come next, checked token by token (a grammar: see `infer::grammar`).
pub trait TokenConstraint {
    /// Marks in `allowed` (one flag a vocabulary entry, all false on entry) the tokens that
    /// may come next. At least one: where nothing else can, a stop token.
    fn allowed(&mut self, allowed: &mut [bool]);
    /// Takes the token chosen.
    fn accept(&mut self, id: u32);
}

/// A chosen token's log-probability and, when asked, the most likely tokens' (most
/// likely first, equal ones by id), from the model's logits.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// log softmax of `logits` at `id` and the `top` most likely (f64 sums; non-finite logits
/// have probability 0: -inf).
pub fn logprobs(logits: &[f32], id: u32, top: usize) -> TokenLogprob {
    let m = logits
        .iter()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let z: f64 = logits
        .iter()
        .filter(|v| v.is_finite())
        .map(|&v| (v as f64 - m).exp())
        .sum();
    let lse = m + z.ln();
    let lp = |i: usize| match logits.get(i) {
        Some(v) if v.is_finite() => (*v as f64 - lse) as f32,
        _ => f32::NEG_INFINITY,
    };
    let mut best: Vec<(u32, f32)> = Vec::new();
    if top > 0 {
        let mut all: Vec<(u32, f32)> = (0..logits.len()).map(|i| (i as u32, lp(i))).collect();
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let k = top.min(all.len());
        if k < all.len() {
            all.select_nth_unstable_by(k - 1, order);
            all.truncate(k);
        }
        all.sort_by(order);
        best = all;
    }
    TokenLogprob {
        id,
        logprob: lp(id as usize),
        top: best,
    }
}

pub struct Sampler {
    pub cfg: SamplerConfig,
    state: u64,
    /// How often this sampler chose each token (presence and frequency penalties).
    counts: std::collections::HashMap<u32, u32>,
    constraint: Option<Box<dyn TokenConstraint + Send>>,
    /// Some(n): each choice's log-probability and the n most likely.
    logprobs: Option<usize>,
    last: Option<TokenLogprob>,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        let state = cfg.seed ^ 0x9E37_79B9_7F4A_7C15;
        Sampler {
            cfg,
            state,
            counts: Default::default(),
            constraint: None,
            logprobs: None,
            last: None,
        }
    }

    /// Only tokens `c` allows are chosen.
    pub fn with_constraint(mut self, c: Box<dyn TokenConstraint + Send>) -> Sampler {
        self.constraint = Some(c);
        self
    }

    /// Each choice's log-probability and the `top` most likely ([`Sampler::take_logprob`]).
    pub fn with_logprobs(mut self, top: usize) -> Sampler {
        self.logprobs = Some(top);
        self
    }

    /// Whether the choices need nothing but the argmax of the logits (which the GPU can
    /// take without the host reading them).
    pub fn plain_greedy(&self) -> bool {
        let c = &self.cfg;
        c.temperature == 0.0
            && c.repeat_penalty == 1.0
            && c.presence_penalty == 0.0
            && c.frequency_penalty == 0.0
            && c.logit_bias.is_empty()
            && self.constraint.is_none()
            && self.logprobs.is_none()
    }

    /// Whether the choices are plain draws over the whole vocabulary: no constraint, bias,
    /// penalty or cut, a temperature above 0.
    fn plain_draw(&self) -> bool {
        let c = &self.cfg;
        self.constraint.is_none()
            && c.logit_bias.is_empty()
            && c.presence_penalty == 0.0
            && c.frequency_penalty == 0.0
            && c.repeat_penalty == 1.0
            && c.top_k == 0
            && c.top_p >= 1.0
            && c.min_p == 0.0
            && c.temperature > 0.0
    }

    /// Whether the GPU can make this sampler's choices ([`Sampler::gpu_pick`]).
    pub fn gpu_pickable(&self) -> bool {
        self.plain_greedy() || (self.plain_draw() && self.logprobs.is_none())
    }

    /// How the GPU makes this sampler's next choice (`ops::sample::sample_rows`: the same
    /// token [`Sampler::sample`] would choose from the same logits) where it can: the plain
    /// greedy choice, or the plain draw (its random number taken now, as `sample` takes
    /// it); None where the host must choose. Pass the token chosen to [`Sampler::accept`].
    pub fn gpu_pick(&mut self) -> Option<crate::ops::sample::Pick> {
        use crate::ops::sample::Pick;
        if self.plain_greedy() {
            return Some(Pick::Greedy);
        }
        if self.plain_draw() && self.logprobs.is_none() {
            let inv = self.inverse_temperature();
            return Some(Pick::Draw {
                inv,
                r: self.next_u64(),
            });
        }
        None
    }

    /// A token chosen for this sampler elsewhere ([`Sampler::gpu_pick`]), counted as its
    /// own choices are.
    pub fn accept(&mut self, id: u32) {
        if let Some(c) = &mut self.constraint {
            c.accept(id);
        }
        *self.counts.entry(id).or_insert(0) += 1;
    }

    /// The last choice's log-probabilities (with [`Sampler::with_logprobs`]).
    pub fn take_logprob(&mut self) -> Option<TokenLogprob> {
        self.last.take()
    }

    /// splitmix64: the draw's random number.
    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// The inverse temperature a draw takes ([`draw_index`]): 1 / T, held finite, flushed.
    pub fn inverse_temperature(&self) -> f32 {
        flush((1.0 / self.cfg.temperature).min(f32::MAX))
    }

    /// The next token given `logits` (V) and the tokens so far. Non-finite logits are
    /// never chosen; if none is finite, token 0 (or the constraint's first allowed).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let id = self.choose(logits, history);
        if let Some(top) = self.logprobs {
            self.last = Some(logprobs(logits, id, top));
        }
        self.accept(id);
        id
    }

    /// A draw from `xs` at the temperature ([`draw_index`]); where a penalty or bias pushed a
    /// logit to +inf, the first such.
    fn draw(&mut self, xs: &[f32]) -> usize {
        if let Some(i) = xs.iter().position(|&x| x == f32::INFINITY) {
            return i;
        }
        draw_index(xs, self.inverse_temperature(), self.next_u64())
    }

    fn choose(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        if self.plain_draw() {
            // (Non-finite logits weigh nothing: the general path's choice, without copies.)
            return draw_index(logits, self.inverse_temperature(), self.next_u64()) as u32;
        }
        let mut mask = None;
        if let Some(con) = &mut self.constraint {
            let mut allowed = vec![false; logits.len()];
            con.allowed(&mut allowed);
            mask = Some(allowed);
        }
        let ok = |i: usize| mask.as_ref().is_none_or(|m| m[i]);
        let c = &self.cfg;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|&(i, v)| v.is_finite() && ok(i))
            .map(|(i, &v)| (i as u32, v))
            .collect();
        if cand.is_empty() {
            // Nothing finite the constraint allows: its first allowed token.
            return mask.and_then(|m| m.iter().position(|&a| a)).unwrap_or(0) as u32;
        }
        // (cand is in id order until the cut below.)
        for &(t, b) in &c.logit_bias {
            if let Ok(i) = cand.binary_search_by_key(&t, |e| e.0) {
                cand[i].1 += b;
            }
        }
        if c.presence_penalty != 0.0 || c.frequency_penalty != 0.0 {
            for (&t, &n) in &self.counts {
                if let Ok(i) = cand.binary_search_by_key(&t, |e| e.0) {
                    cand[i].1 -= c.presence_penalty + c.frequency_penalty * n as f32;
                }
            }
        }
        if c.repeat_penalty != 1.0 {
            let recent = &history[history.len().saturating_sub(c.repeat_last_n)..];
            let mut seen = std::collections::HashSet::new();
            for &t in recent {
                if seen.insert(t) {
                    if let Ok(i) = cand.binary_search_by_key(&t, |e| e.0) {
                        let e = &mut cand[i];
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
        // Without top-k or top-p the candidates stay in id order (no sort of the whole
        // vocabulary); with them, most likely first.
        if c.top_k > 0 && c.top_k < cand.len() {
            cand.select_nth_unstable_by(c.top_k - 1, order);
            cand.truncate(c.top_k);
        }
        if c.top_k > 0 {
            cand.sort_unstable_by(order);
        }
        let max =
            |cand: &[(u32, f32)]| cand.iter().fold(f32::NEG_INFINITY, |m, e| m.max(e.1)) as f64;
        if c.top_p < 1.0 {
            // The smallest most-likely-first prefix whose probability (at temperature 1,
            // as llama.cpp) reaches top_p: the best k found by selection and sorted, k
            // growing until they hold that much.
            let m = max(&cand);
            let z: f64 = cand.iter().map(|x| (x.1 as f64 - m).exp()).sum();
            let n = cand.len();
            let mut k = 64.min(n);
            loop {
                if k < n {
                    cand.select_nth_unstable_by(k - 1, order);
                }
                cand[..k].sort_unstable_by(order);
                let mut acc = 0.0;
                let keep = cand[..k].iter().position(|x| {
                    acc += (x.1 as f64 - m).exp() / z;
                    acc >= c.top_p as f64
                });
                match keep {
                    Some(i) => {
                        cand.truncate(i + 1);
                        break;
                    }
                    None if k == n => break,
                    None => k = (k * 4).min(n),
                }
            }
        }
        if c.min_p > 0.0 {
            // p / p_max >= min_p, on the logits (temperature 1); the most likely stays.
            let cut = max(&cand) + (c.min_p as f64).ln();
            cand.retain(|x| x.1 as f64 >= cut);
        }
        // The draw, in the candidates' order.
        let xs: Vec<f32> = cand.iter().map(|e| e.1).collect();
        cand[self.draw(&xs)].0
    }
}

/// A row for [`SamplingPool::sample`]: its sampler and the tokens so far (both handed back
/// with the choice), and its logits.
pub struct Row {
    pub sampler: Sampler,
    pub history: Vec<u32>,
    pub logits: Vec<f32>,
}

/// A row's choice: the token, its log-probability ([`Sampler::take_logprob`]), and the
/// row's sampler and history back.
pub struct Picked {
    pub token: u32,
    pub logprob: Option<TokenLogprob>,
    pub sampler: Sampler,
    pub history: Vec<u32>,
}

fn pick(mut r: Row) -> Picked {
    let token = r.sampler.sample(&r.logits, &r.history);
    Picked {
        token,
        logprob: r.sampler.take_logprob(),
        sampler: r.sampler,
        history: r.history,
    }
}

/// Threads that sample the rows of a batched step, started once and kept: threads spawned
/// for every step cost more than the sampling itself on a many-core host (16 spawns and
/// joins ~1 ms on the H200's host, where one row takes ~0.1 ms). Each row is drawn from
/// its own sampler's state: the same choices whatever thread draws it. Rows are sampled
/// where they are when there are fewer than 4, or no threads (wasm32).
pub struct SamplingPool {
    #[cfg(not(target_arch = "wasm32"))]
    workers: Vec<std::sync::mpsc::Sender<(usize, Row)>>,
    #[cfg(not(target_arch = "wasm32"))]
    done: std::sync::mpsc::Receiver<(usize, std::thread::Result<Picked>)>,
}

impl Default for SamplingPool {
    fn default() -> Self {
        Self::new()
    }
}

impl SamplingPool {
    /// Up to 16 threads (as many as the machine runs at once).
    pub fn new() -> SamplingPool {
        #[cfg(not(target_arch = "wasm32"))]
        {
            use std::sync::mpsc;
            let threads = std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(16);
            let (done_tx, done) = mpsc::channel();
            let mut workers = Vec::new();
            for i in 0..if threads >= 2 { threads } else { 0 } {
                let (tx, rx) = mpsc::channel::<(usize, Row)>();
                let done_tx = done_tx.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("sampling-{i}"))
                    .spawn(move || {
                        for (at, row) in rx {
                            let picked =
                                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                    pick(row)
                                }));
                            if done_tx.send((at, picked)).is_err() {
                                break;
                            }
                        }
                    });
                match spawned {
                    Ok(_) => workers.push(tx),
                    Err(e) => {
                        tracing::warn!("sampling thread not started ({e}): fewer threads");
                        break;
                    }
                }
            }
            SamplingPool { workers, done }
        }
        #[cfg(target_arch = "wasm32")]
        SamplingPool {}
    }

    /// Each row's choice, in the rows' order.
    pub fn sample(&self, rows: Vec<Row>) -> Vec<Picked> {
        #[cfg(not(target_arch = "wasm32"))]
        if rows.len() >= 4 && !self.workers.is_empty() {
            let n = rows.len();
            // Contiguous runs of rows a thread (as even as they go).
            let per = n.div_ceil(self.workers.len());
            for (at, row) in rows.into_iter().enumerate() {
                self.workers[at / per]
                    .send((at, row))
                    .expect("sampling threads live as long as the pool");
            }
            let mut out: Vec<Option<Picked>> = (0..n).map(|_| None).collect();
            let mut panicked = None;
            // Every row's answer taken (none left to a later call), then a panic passed on.
            for _ in 0..n {
                let (at, picked) = self
                    .done
                    .recv()
                    .expect("sampling threads live as long as the pool");
                match picked {
                    Ok(p) => out[at] = Some(p),
                    Err(panic) => panicked = panicked.or(Some(panic)),
                }
            }
            if let Some(panic) = panicked {
                std::panic::resume_unwind(panic);
            }
            return out
                .into_iter()
                .map(|p| p.expect("every row answered"))
                .collect();
        }
        rows.into_iter().map(pick).collect()
    }
}

// The draw, in integer arithmetic from the logits' f32 differences on, so that every
// machine and every GPU (`ops::sample`, `sample.wgsl`) choose the same token from the same
// logits and random number. Index i is drawn with probability w_i / sum w, where w_i =
// [`draw_weight`] ~ 2^31 e^((x_i - m) / T) (m the largest finite logit), a fixed-point
// number from three tables: within ~1e-6 (relative) of the exact weight, 0 for non-finite
// logits and for those more than ~21.5 T below m (weight under 2^-31 of the largest's).
// The sum is exact (u64), the target floor(r sum / 2^64) for a 64-bit random r, the
// token the first index whose running sum passes it.

/// Entries of [`draw_table`]: e^(-h / 32) for h < 737 (bits 15.. of the weight's n), then
/// e^(-j 2^-15) for j < 1024 (bits 5..15), then e^(-l 2^-20) for l < 32 (bits 0..5).
pub const DRAW_TABLE_LEN: usize = DRAW_MID + 1024 + 32;
const DRAW_MID: usize = 737;
const DRAW_LOW: usize = DRAW_MID + 1024;

/// x as the draw reads it: 0 where it is subnormal (GPUs may flush those to 0, so every
/// machine does here).
pub fn flush(x: f32) -> f32 {
    if x.to_bits() & 0x7f80_0000 == 0 {
        0.0
    } else {
        x
    }
}

fn finite(x: f32) -> bool {
    x.to_bits() & 0x7f80_0000 != 0x7f80_0000
}

/// The draw's tables, 2^31 e^-y rounded, as [`DRAW_TABLE_LEN`] says; computed once in plain
/// f64 arithmetic (no libm: the same bits on every machine).
pub fn draw_table() -> &'static [u32] {
    static TABLE: std::sync::OnceLock<Vec<u32>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let at = |y: f64| (exp_neg_f64(y) * 2_147_483_648.0).round() as u32;
        let mut t = Vec::with_capacity(DRAW_TABLE_LEN);
        t.extend((0..DRAW_MID).map(|h| at(h as f64 / 32.0)));
        t.extend((0..1024).map(|j| at(j as f64 / 32768.0)));
        t.extend((0..32).map(|l| at(l as f64 / 1_048_576.0)));
        t
    })
}

/// e^-y for y >= 0 in plain f64 arithmetic: y = k ln 2 + r, |r| <= ln 2 / 2, a Taylor series
/// of e^-r to 22 terms, times 2^-k.
fn exp_neg_f64(y: f64) -> f64 {
    const LN2_HI: f64 = 0.693_147_180_369_123_8; // ln 2's first 32 bits
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    let k = (y / std::f64::consts::LN_2 + 0.5).floor();
    let r = (y - k * LN2_HI) - k * LN2_LO;
    let (mut term, mut sum) = (1.0f64, 1.0f64);
    for i in 1..=22 {
        term = term * -r / i as f64;
        sum += term;
    }
    let mut v = sum;
    for _ in 0..k as u32 {
        v *= 0.5;
    }
    v
}

/// (a b) / 2^31 for a, b <= 2^31.
fn mul31(a: u32, b: u32) -> u32 {
    ((a as u64 * b as u64) >> 31) as u32
}

/// The largest finite logit (flushed), or None.
pub fn draw_max(xs: &[f32]) -> Option<f32> {
    xs.iter()
        .filter(|&&x| finite(x))
        .map(|&x| flush(x))
        .fold(None, |m, x| match m {
            Some(m) if m >= x => Some(m),
            _ => Some(x),
        })
}

/// The draw's weight of logit x where the largest finite one is m, at the inverse
/// temperature `inv` ([`Sampler::inverse_temperature`]): y = (x - m) inv (each step
/// flushed), held at -23 or above, n = -y 2^20 truncated, then the tables' entries of
/// n's bits multiplied in fixed point. 0 for a non-finite x.
pub fn draw_weight(x: f32, m: f32, inv: f32) -> u32 {
    if !finite(x) {
        return 0;
    }
    let y = match inv == 0.0 {
        true => 0.0,
        false => flush(flush(flush(x) - m) * inv),
    };
    if y.is_nan() || y <= -23.0 {
        // (Held at -23: the weight there, computed once.)
        return draw_floor_weight();
    }
    weight_at((-(y * 1_048_576.0)) as u32)
}

/// The weight of every logit at or more than 23 T below the largest (0 with these tables).
fn draw_floor_weight() -> u32 {
    static W: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *W.get_or_init(|| weight_at((23.0f32 * 1_048_576.0) as u32))
}

/// 2^31 e^(-n 2^-20) from the tables: n's bits 15.., 5..15 and 0..5 looked up, multiplied
/// in fixed point in that order.
fn weight_at(n: u32) -> u32 {
    let t = draw_table();
    mul31(
        mul31(
            t[(n >> 15) as usize],
            t[DRAW_MID + ((n >> 5) & 1023) as usize],
        ),
        t[DRAW_LOW + (n & 31) as usize],
    )
}

/// The index a draw from `xs` picks with the random number `r` (see above); 0 where no
/// logit is finite.
pub fn draw_index(xs: &[f32], inv: f32, r: u64) -> usize {
    let Some(m) = draw_max(xs) else {
        return 0;
    };
    // Sums a chunk at a time; the target's chunk walked again.
    const CHUNK: usize = 256;
    let sums: Vec<u64> = xs
        .chunks(CHUNK)
        .map(|c| c.iter().map(|&x| draw_weight(x, m, inv) as u64).sum())
        .collect();
    let total: u64 = sums.iter().sum();
    let target = ((r as u128 * total as u128) >> 64) as u64;
    let mut run = 0u64;
    for (c, &sum) in sums.iter().enumerate() {
        if run + sum <= target {
            run += sum;
            continue;
        }
        for (i, &x) in xs[c * CHUNK..].iter().enumerate() {
            run += draw_weight(x, m, inv) as u64;
            if run > target {
                return c * CHUNK + i;
            }
        }
    }
    unreachable!("the running sum reaches the total, past the target")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pool's choices (and log-probabilities, and the samplers' states after) are the
    /// ones each sampler makes alone, in the rows' order, over two rounds of 37 rows.
    #[test]
    fn the_sampling_pool_chooses_as_each_sampler_alone() {
        let make = |i: usize| {
            let s = Sampler::new(SamplerConfig {
                temperature: 0.7 + 0.01 * i as f32,
                top_k: i % 3 * 20,
                presence_penalty: 0.5,
                seed: i as u64,
                ..Default::default()
            });
            if i % 4 == 0 {
                s.with_logprobs(2)
            } else {
                s
            }
        };
        let logits = |i: usize, round: usize| -> Vec<f32> {
            (0..3000)
                .map(|j| (((i * 31 + j * 7 + round * 13) % 97) as f32) * 0.05)
                .collect()
        };
        let pool = SamplingPool::new();
        let mut alone: Vec<Sampler> = (0..37).map(make).collect();
        let mut pooled: Vec<Sampler> = (0..37).map(make).collect();
        for round in 0..2 {
            let want: Vec<(u32, Option<TokenLogprob>)> = alone
                .iter_mut()
                .enumerate()
                .map(|(i, s)| (s.sample(&logits(i, round), &[i as u32]), s.take_logprob()))
                .collect();
            let rows = pooled
                .drain(..)
                .enumerate()
                .map(|(i, sampler)| Row {
                    sampler,
                    history: vec![i as u32],
                    logits: logits(i, round),
                })
                .collect();
            for (i, p) in pool.sample(rows).into_iter().enumerate() {
                assert_eq!(p.token, want[i].0, "row {i}, round {round}");
                assert_eq!(p.logprob, want[i].1, "row {i}, round {round}");
                assert_eq!(p.history, vec![i as u32]);
                pooled.push(p.sampler);
            }
        }
    }

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

    #[test]
    fn presence_frequency_penalties_and_logit_bias() {
        let logits = [2.0f32, 1.5, 0.0];
        let run = |cfg: SamplerConfig| {
            let mut s = Sampler::new(cfg);
            (0..4).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        let g = SamplerConfig::greedy;
        // Frequency 1: each use costs 1 (2.0 -> 1.0 < 1.5, then 0.5 < 1.0, ...).
        let f = run(SamplerConfig {
            frequency_penalty: 1.0,
            ..g()
        });
        assert_eq!(f, [0, 1, 0, 1]);
        // Presence 1: once, whatever the count (1.0 vs 0.5 after both were used).
        let p = run(SamplerConfig {
            presence_penalty: 1.0,
            ..g()
        });
        assert_eq!(p, [0, 1, 0, 0]);
        let b = run(SamplerConfig {
            logit_bias: vec![(2, 2.5)],
            ..g()
        });
        assert_eq!(b, [2, 2, 2, 2]);
        assert!(SamplerConfig {
            frequency_penalty: 2.5,
            ..g()
        }
        .validate()
        .is_err());
        assert!(SamplerConfig {
            logit_bias: vec![(1, -101.0)],
            ..g()
        }
        .validate()
        .is_err());
    }

    #[test]
    fn logprobs_are_the_log_softmax_and_the_top_in_order() {
        let logits = [1.0f32, 3.0, f32::NEG_INFINITY, 3.0, -2.0];
        let lp = logprobs(&logits, 0, 3);
        let z: f64 = [1.0f64, 3.0, 3.0, -2.0].iter().map(|v| v.exp()).sum();
        assert!((lp.logprob as f64 - (1.0 - z.ln())).abs() < 1e-6);
        // Ties by id; -inf last.
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3, 0]);
        assert_eq!(logprobs(&logits, 2, 0).logprob, f32::NEG_INFINITY);
        // The sampler reports what it chose, from the logits before penalties and masks.
        let mut s = Sampler::new(SamplerConfig {
            logit_bias: vec![(4, 10.0)],
            ..SamplerConfig::greedy()
        })
        .with_logprobs(1);
        assert!(!s.plain_greedy());
        assert_eq!(s.sample(&logits, &[]), 4);
        let t = s.take_logprob().unwrap();
        assert_eq!((t.id, t.top[0].0), (4, 1));
        assert!((t.logprob as f64 - (-2.0 - z.ln())).abs() < 1e-6);
    }

    #[test]
    fn top_p_over_a_large_vocabulary_is_the_sorted_nucleus() {
        // 5000 logits from a fixed generator; the nucleus needs hundreds of tokens, past
        // the first selection's 64.
        let mut x = 12345u64;
        let logits: Vec<f32> = (0..5000)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) as f32 / (1u64 << 31) as f32) * 4.0
            })
            .collect();
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let m = logits[idx[0]] as f64;
        let z: f64 = logits.iter().map(|&l| (l as f64 - m).exp()).sum();
        let mut acc = 0.0;
        let n = idx
            .iter()
            .position(|&i| {
                acc += (logits[i] as f64 - m).exp() / z;
                acc >= 0.5
            })
            .unwrap()
            + 1;
        assert!(n > 256, "{n}");
        let nucleus: std::collections::HashSet<u32> = idx[..n].iter().map(|&i| i as u32).collect();
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
            min_p: 0.0,
            seed: 3,
            ..Default::default()
        });
        let seen: std::collections::HashSet<u32> =
            (0..3000).map(|_| s.sample(&logits, &[])).collect();
        assert!(
            seen.is_subset(&nucleus) && seen.len() > n / 2,
            "{} of {n}",
            seen.len()
        );
    }

    #[test]
    fn the_draw_weights_are_exp() {
        // The tables within one unit of 2^31 e^-y; the weights within 2e-6 of
        // e^((x - m) / T) relative (2^-31 absolute), 0 for non-finite logits.
        let t = draw_table();
        assert_eq!(t.len(), DRAW_TABLE_LEN);
        let check = |k: usize, y: f64| {
            let want = 2_147_483_648.0 * (-y).exp();
            assert!(
                (t[k] as f64 - want).abs() <= 1.0,
                "entry {k}: {} vs {want}",
                t[k]
            );
        };
        (0..DRAW_MID).for_each(|h| check(h, h as f64 / 32.0));
        (0..1024).for_each(|j| check(DRAW_MID + j, j as f64 / 32768.0));
        (0..32).for_each(|l| check(DRAW_LOW + l, l as f64 / 1_048_576.0));
        let mut worst = 0f64;
        for i in 0..200_000 {
            let x = 3.0 - i as f32 * 1.3e-4;
            let inv = 1.0 / 0.7f32;
            let want = ((x as f64 - 3.0) * inv as f64).exp();
            let got = draw_weight(x, 3.0, inv) as f64 / 2_147_483_648.0;
            worst = worst.max((got - want).abs() / want.max(1e-3));
        }
        assert!(worst < 2e-6, "worst {worst}");
        assert_eq!(draw_weight(3.0, 3.0, 5.0), 1 << 31);
        assert_eq!(draw_weight(f32::NAN, 3.0, 1.0), 0);
        assert_eq!(draw_weight(f32::INFINITY, 3.0, 1.0), 0);
        assert_eq!(draw_weight(-1e30, 3.0, 1.0), 0);
        // No temperature (its inverse flushed to 0): every finite logit weighs the same.
        assert_eq!(draw_weight(-1e30, 3.0, 0.0), 1 << 31);
        // Subnormal inputs read as 0.
        assert_eq!(draw_weight(1e-40, 0.0, 1.0), 1 << 31);
        assert_eq!(draw_max(&[f32::NAN, f32::NEG_INFINITY]), None);
        assert_eq!(draw_index(&[f32::NAN, f32::INFINITY], 1.0, 123), 0);
    }

    #[test]
    fn the_draw_survives_extreme_temperatures_and_penalties() {
        // A temperature whose inverse is past f32's range still picks the most likely.
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1e-40,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..Default::default()
        });
        assert_eq!(s.sample(&[0.5, 3.0, -1.0, 2.9], &[]), 1);
        // A penalty that pushes a logit past f32's range: that token, not the first.
        let mut s = Sampler::new(SamplerConfig {
            temperature: 0.7,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1e-40,
            ..Default::default()
        });
        assert_eq!(s.sample(&[-1.0, 0.5, 3.0, 2.0], &[2]), 2);
    }

    #[test]
    fn the_draw_follows_the_distribution() {
        // 3000 logits, four of them likely: the frequencies of 20000 draws at temperature
        // 0.5 match the softmax within a few standard deviations, across chunk borders.
        let mut l = vec![-30.0f32; 3000];
        for (i, v) in [(3, 2.0f32), (1023, 1.5), (1024, 1.0), (2999, 0.0)] {
            l[i] = v;
        }
        let t = 0.5f64;
        let z: f64 = l.iter().map(|&x| ((x as f64 - 2.0) / t).exp()).sum();
        let mut s = Sampler::new(SamplerConfig {
            temperature: t as f32,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 3,
            ..Default::default()
        });
        let n = 20000;
        let mut counts = std::collections::HashMap::new();
        for _ in 0..n {
            *counts.entry(s.sample(&l, &[])).or_insert(0usize) += 1;
        }
        for i in [3usize, 1023, 1024, 2999] {
            let p = ((l[i] as f64 - 2.0) / t).exp() / z;
            let got = *counts.get(&(i as u32)).unwrap_or(&0) as f64 / n as f64;
            let sd = (p * (1.0 - p) / n as f64).sqrt();
            assert!((got - p).abs() < 5.0 * sd + 1e-4, "token {i}: {got} vs {p}");
        }
    }

    #[test]
    fn the_plain_draw_is_the_general_one() {
        // No cut and no change: the copy-free draw and the general path (forced by a zero
        // bias) choose the same tokens from the same seed.
        let logits: Vec<f32> = (0..3000)
            .map(|i| ((i * 7919) % 1000) as f32 / 150.0)
            .collect();
        let mut l = logits.clone();
        l[17] = f32::NAN;
        l[2999] = f32::NEG_INFINITY;
        let cfg = SamplerConfig {
            temperature: 0.7,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 9,
            ..Default::default()
        };
        let mut a = Sampler::new(cfg.clone());
        let mut b = Sampler::new(SamplerConfig {
            logit_bias: vec![(5, 0.0)],
            ..cfg
        });
        // All finite: the plain draw runs; with a NaN and -inf both take the general path.
        for l in [&logits, &l] {
            let ta: Vec<u32> = (0..500).map(|_| a.sample(l, &[])).collect();
            let tb: Vec<u32> = (0..500).map(|_| b.sample(l, &[])).collect();
            assert_eq!(ta, tb);
            assert!(ta.iter().collect::<std::collections::HashSet<_>>().len() > 50);
        }
        let ta: Vec<u32> = (0..500).map(|_| a.sample(&l, &[])).collect();
        assert!(!ta.contains(&17) && !ta.contains(&2999));
    }
}
