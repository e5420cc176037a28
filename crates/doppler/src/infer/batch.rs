//! Continuous batching: many sequences in one pool of KV pages, advanced together, a step
//! at a time ([`Batch::step_async`]: each sequence's new tokens, a prompt's or one
//! decoded token, as rows of one forward pass, [`Llama::forward_paged`]).
//!
//! A step in three parts, so that the host's work on the next overlaps the GPU's on this
//! one: [`Batch::record`] (pages, uploads, the forward pass recorded and encoded, for a
//! plan of sequences and row counts, before the tokens are known), [`Batch::submit`]
//! (the tokens written, the step submitted, the sequences grown), [`Batch::wait`] (the
//! logits). `doppler serve` records step n + 1 while the GPU runs step n. With
//! [`Batch::record_picking`] / [`Batch::submit_picking`] / [`Batch::wait_chosen`] the GPU
//! also chooses each row's next token (`ops::sample`, the host sampler's choice) and only
//! the tokens come back, with the logits of the rows the host samples. With
//! [`Batch::record_chained`] / [`Batch::submit_chained`] a step of one row a sequence takes
//! its tokens from the choices of the step still running before it (copied on the GPU),
//! so it is submitted before those are read back: two steps in flight, the GPU never
//! waiting for the host between them.
//!
//! Pages of [`PAGE`] tokens come from one pool and go back when a sequence is removed, so
//! memory follows the tokens held. Every row of a step runs the same kernels in the same
//! order whatever the other rows are: a sequence's logits are the same bits alone or
//! beside others (batch invariance; `tests/gpu.rs`, `tests/smollm2.rs` check it).
//!
//! Shared prefixes: a page a sequence has filled is kept in a cache under the chain of
//! its tokens (its own and every page's before it). A new sequence started with
//! [`Batch::add_prefixed`] takes the cached pages its prompt's first whole pages match,
//! token for token, and runs only the rest: a system prompt is computed once. A page
//! holds the keys and values of its tokens alone, and those depend only on the tokens up
//! to them, which the chain fixes; with batch invariance the shared pages are the bits
//! the sequence would have computed itself. A cached page nobody holds stays cached until
//! the pool needs it (free pages are taken first, then the cached ones let go longest ago,
//! a prefix's last pages before its first). Pages are cached after the step that fills
//! them: two prompts started in the same step do not share.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use web_time::Instant;

use crate::error::{Error, Result};
use crate::gpu::{DType, Encoded, Gpu, Readback, Submission, Tensor, Trace, FLUSH_EVERY};
use crate::models::llama::Llama;
use crate::ops::kvcache::{paged_pool, KvCache, KvType, PagedRows, PAGE};
use crate::ops::sample::{draw_tables, sample_rows, Pick};

/// A sequence's handle in a [`Batch`].
pub type SeqId = u64;

struct Seq {
    pages: Vec<u32>,
    len: usize,
    /// The tokens held (len of them).
    toks: Vec<u32>,
    /// The chain keys of its whole pages so far (see [`chain`]).
    keys: Vec<u64>,
    /// Of `len`, tokens of steps submitted and not yet waited for (their pages are not
    /// cached before; a chained step's token is known only once the step before is).
    unsettled: usize,
}

/// A step submitted and not yet waited for.
struct Flying {
    step: u64,
    feeds: Vec<(SeqId, usize)>,
    /// The tokens of the step chained on this one ([`Batch::submit_chained`]): (sequence,
    /// position in its tokens, this step's row whose choice it is), filled in when this
    /// step's choices come back.
    fills: Vec<(SeqId, usize, usize)>,
}

/// A cached page: its tokens and the key of the page before it (None for a first page).
struct Cached {
    page: u32,
    toks: Vec<u32>,
    parent: Option<u64>,
}

/// The key of a whole page of tokens `toks` after the page keyed `parent`.
fn chain(parent: Option<u64>, toks: &[u32]) -> u64 {
    let mut words = Vec::with_capacity(toks.len() + 2);
    words.push(parent.map_or(0x5eed, |k| k));
    words.push(parent.is_some() as u64);
    words.extend(toks.iter().map(|&t| t as u64));
    crate::train::data::mix(&words)
}

/// How a step's GPU work is timed ([`Batch::set_timing`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepTiming {
    /// Host times only.
    Off,
    /// Also the GPU time of the whole forward pass (timestamps around it).
    Whole,
    /// Also every dispatch's GPU time (each in its own pass: slower, for proportions).
    EachDispatch,
}

/// Where the last step ([`Batch::wait`]) spent its time.
#[derive(Clone, Debug, Default)]
pub struct StepTimes {
    /// [`Batch::record`]: the step's checks, pages and uploads, recording and encoding its
    /// forward pass (host; a step's part submitted as it recorded included).
    pub record_ms: f64,
    /// [`Batch::submit`]: the checks, the token ids and parameters written, the submission.
    pub submit_ms: f64,
    /// From the submission to the logits on the host: the GPU's work and the readback, and
    /// whatever the caller did before waiting (a pipelined loop records the next step).
    pub wait_ms: f64,
    /// The GPU's timestamps ([`StepTiming::Whole`]: one event; `EachDispatch`: one a
    /// dispatch; empty when off or where the adapter has no timestamps).
    pub trace: Trace,
}

/// Tokens [`Batch::warm_up`]'s second round of steps takes each sequence to hold: long
/// enough that the attention splits a row's work into more than two ranges.
pub const WARM_HISTORY: usize = 192;

/// Sequences in one paged KV pool.
pub struct Batch<'m> {
    pub llama: &'m Llama,
    pool: KvCache,
    /// Free pages not in the cache, taken lowest first.
    free: BTreeSet<u32>,
    /// Cached pages nobody holds by when they were let go, the oldest first (taken when
    /// `free` is empty); each such page's stamp.
    idle: BTreeMap<u64, u32>,
    idle_stamp: Vec<Option<u64>>,
    stamp: u64,
    /// Sequences holding each page.
    refs: Vec<u32>,
    /// Whole pages by chain key, and each page's key while it is cached.
    cache: HashMap<u64, Cached>,
    page_key: Vec<Option<u64>>,
    seqs: BTreeMap<SeqId, Seq>,
    next: SeqId,
    pages: usize,
    /// Whether add_prefixed shares cached pages (on unless turned off).
    share: bool,
    timing: StepTiming,
    last: StepTimes,
    /// Steps submitted and not yet waited for, oldest first (two at most: a step and the
    /// one chained on it).
    flights: VecDeque<Flying>,
    /// Ids given to submitted steps so far.
    submitted: u64,
    /// Steps up to this id that were in flight when a step failed (rolled back).
    failed_through: Option<u64>,
    /// The draw's tables for tokens chosen on the GPU ([`Batch::record_picking`]).
    tables: Tensor,
}

/// A fed sequence's outcome of a step recorded with [`Batch::record_picking`]: the token the
/// GPU chose, or (a row the host chooses) its logits (V).
#[derive(Clone, Debug, PartialEq)]
pub enum Chosen {
    Token(u32),
    Logits(Vec<f32>),
}

impl<'m> Batch<'m> {
    /// A pool of `pages` pages of [`PAGE`] tokens of type `ty`. Refuses models
    /// [`crate::models::llama::Llama::paged_unsupported`] names.
    pub fn new(gpu: &Gpu, llama: &'m Llama, pages: usize, ty: KvType) -> Result<Batch<'m>> {
        if let Some(why) = llama.paged_unsupported() {
            return Err(Error::Invalid {
                op: "batch",
                detail: format!("continuous batching does not run a model with {why}"),
            });
        }
        if ty == KvType::Q8_0 {
            return Err(Error::Invalid {
                op: "batch",
                detail: "a q8_0 KV pool is not supported for batching (f32 or f16)".into(),
            });
        }
        if pages == 0 || pages > u32::MAX as usize / PAGE {
            return Err(Error::Invalid {
                op: "batch",
                detail: format!("{pages} pages"),
            });
        }
        let c = &llama.cfg;
        let pool = paged_pool(gpu, c.n_layer, pages, c.n_kv_head, c.head_dim, ty)?;
        Ok(Batch {
            llama,
            pool,
            free: (0..pages as u32).collect(),
            idle: BTreeMap::new(),
            idle_stamp: vec![None; pages],
            stamp: 0,
            refs: vec![0; pages],
            cache: HashMap::new(),
            page_key: vec![None; pages],
            seqs: BTreeMap::new(),
            next: 0,
            pages,
            share: true,
            timing: StepTiming::Off,
            last: StepTimes::default(),
            flights: VecDeque::new(),
            submitted: 0,
            failed_through: None,
            tables: draw_tables(gpu)?,
        })
    }

    /// How the following steps are timed (off unless set).
    pub fn set_timing(&mut self, timing: StepTiming) {
        self.timing = timing;
    }

    /// Where the last step spent its time.
    pub fn last_times(&self) -> &StepTimes {
        &self.last
    }

    /// Pages in use by sequences.
    pub fn pages_in_use(&self) -> usize {
        self.pages - self.available()
    }

    /// Pages a sequence can take: free ones and cached ones nobody holds.
    fn available(&self) -> usize {
        self.free.len() + self.idle.len()
    }

    /// Whether [`Batch::add_prefixed`] shares cached pages (default on; off, every prompt
    /// is computed whole).
    pub fn set_prefix_cache(&mut self, on: bool) {
        self.share = on;
    }

    /// Whole pages in the prefix cache (held or not).
    pub fn cached_pages(&self) -> usize {
        self.cache.len()
    }

    /// A page for new tokens: a free one, else the cached one let go longest ago (out of
    /// the cache). The caller has checked [`Batch::available`].
    fn take_page(&mut self) -> u32 {
        let p = match self.free.pop_first() {
            Some(p) => p,
            None => {
                let (_, p) = self.idle.pop_first().expect("counted");
                self.idle_stamp[p as usize] = None;
                if let Some(k) = self.page_key[p as usize].take() {
                    self.cache.remove(&k);
                }
                p
            }
        };
        self.refs[p as usize] = 1;
        p
    }

    pub fn pages(&self) -> usize {
        self.pages
    }

    /// Bytes of the pool (keys and values, every layer).
    pub fn bytes(&self) -> u64 {
        self.pool.bytes()
    }

    /// Tokens `id` holds, or None for an unknown id.
    pub fn len(&self, id: SeqId) -> Option<usize> {
        self.seqs.get(&id).map(|s| s.len)
    }

    /// Sequences held.
    pub fn sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Whether a step adding `n` tokens to `id` (0 tokens held for a new one) finds pages
    /// for them, beside what `others` more pages already promised need.
    pub fn fits(&self, id: Option<SeqId>, n: usize, others: usize) -> bool {
        let len = id.and_then(|i| self.len(i)).unwrap_or(0);
        let have = id
            .and_then(|i| self.seqs.get(&i))
            .map_or(0, |s| s.pages.len());
        (len + n).div_ceil(PAGE).saturating_sub(have) + others <= self.available()
    }

    /// Pages a step adding `n` tokens to `id` (None: a new sequence) takes from the pool.
    pub fn pages_needed(&self, id: Option<SeqId>, n: usize) -> usize {
        let len = id.and_then(|i| self.len(i)).unwrap_or(0);
        let have = id
            .and_then(|i| self.seqs.get(&i))
            .map_or(0, |s| s.pages.len());
        (len + n).div_ceil(PAGE).saturating_sub(have)
    }

    /// A new, empty sequence.
    pub fn add(&mut self) -> SeqId {
        self.add_prefixed(&[]).0
    }

    /// A new sequence for `prompt`, holding the cached pages that its first whole pages
    /// match (each page's tokens compared, the pages before it by their 64-bit chain key;
    /// at most up to the prompt's last token, which a step must
    /// still run for its logits), and how many of the prompt's tokens those hold: feed it
    /// `prompt[that..]`.
    pub fn add_prefixed(&mut self, prompt: &[u32]) -> (SeqId, usize) {
        let mut pages = Vec::new();
        let mut keys = Vec::new();
        let shareable = if self.share {
            prompt.len().saturating_sub(1)
        } else {
            0
        };
        for toks in prompt[..shareable].chunks_exact(PAGE) {
            let parent = keys.last().copied();
            let key = chain(parent, toks);
            match self.cache.get(&key) {
                Some(c) if c.toks == toks && c.parent == parent => {
                    pages.push(c.page);
                    keys.push(key);
                }
                _ => break,
            }
        }
        for &p in &pages {
            if let Some(t) = self.idle_stamp[p as usize].take() {
                self.idle.remove(&t);
            }
            self.refs[p as usize] += 1;
        }
        let len = pages.len() * PAGE;
        let id = self.next;
        self.next += 1;
        self.seqs.insert(
            id,
            Seq {
                pages,
                len,
                toks: prompt[..len].to_vec(),
                keys,
                unsettled: 0,
            },
        );
        (id, len)
    }

    /// Forgets `id`; pages nobody else holds go back to the pool (cached ones stay
    /// cached until the pool needs them, a prefix's last pages taken before its first:
    /// a prefix stays reachable, page 0 on, as long as any of it is).
    pub fn remove(&mut self, id: SeqId) {
        if let Some(s) = self.seqs.remove(&id) {
            for p in s.pages.into_iter().rev() {
                let r = &mut self.refs[p as usize];
                *r -= 1;
                if *r == 0 {
                    match self.page_key[p as usize] {
                        Some(_) => {
                            self.idle.insert(self.stamp, p);
                            self.idle_stamp[p as usize] = Some(self.stamp);
                            self.stamp += 1;
                        }
                        None => {
                            self.free.insert(p);
                        }
                    }
                }
            }
        }
    }

    /// Puts `id`'s pages that are whole and not yet keyed into the cache (unless a page
    /// of the same tokens is there already).
    fn cache_whole_pages(&mut self, id: SeqId) {
        if !self.share {
            return;
        }
        let s = self.seqs.get_mut(&id).expect("checked");
        while (s.keys.len() + 1) * PAGE <= s.len - s.unsettled {
            let i = s.keys.len();
            let toks = &s.toks[i * PAGE..(i + 1) * PAGE];
            let parent = s.keys.last().copied();
            let key = chain(parent, toks);
            let page = s.pages[i];
            if !self.cache.contains_key(&key) && self.page_key[page as usize].is_none() {
                self.cache.insert(
                    key,
                    Cached {
                        page,
                        toks: toks.to_vec(),
                        parent,
                    },
                );
                self.page_key[page as usize] = Some(key);
            }
            s.keys.push(key);
        }
    }

    /// Blocking [`Batch::step_async`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn step(&mut self, gpu: &Gpu, feeds: &[(SeqId, &[u32])]) -> Result<Vec<Vec<f32>>> {
        pollster::block_on(self.step_async(gpu, feeds))
    }

    /// Records, and drops unrun, a step of each power of two of rows up to `max_rows` (and
    /// `max_rows` itself), made of up to `max_seqs` sequences (one row each, the first
    /// taking the rest), tokens chosen on the GPU but every second sequence's (its logits
    /// read back); each row count twice, the sequences new and then as if holding
    /// [`WARM_HISTORY`] tokens (attention splits a long history's work). Every pipeline
    /// such steps use, each layout the products and the attention take by row count and
    /// length among them, is compiled before a request waits on one (a server's first
    /// steps), at no GPU work. A step the pool's free pages or the model's context cannot
    /// hold is skipped; the pool and the prefix cache are left as they were. Returns the
    /// steps recorded.
    pub fn warm_up(&mut self, gpu: &Gpu, max_seqs: usize, max_rows: usize) -> Result<usize> {
        let mut counts: Vec<usize> = (0..usize::BITS)
            .map(|b| 1usize << b)
            .take_while(|&m| m < max_rows)
            .collect();
        counts.push(max_rows.max(1));
        let ctx = self.llama.max_context;
        let mut steps = 0;
        for held in [0, WARM_HISTORY.min(ctx.saturating_sub(1))] {
            for &m in &counts {
                let seqs = m.min(max_seqs.max(1));
                let first = m - (seqs - 1);
                let pages = (held + first).div_ceil(PAGE) + (seqs - 1) * (held + 1).div_ceil(PAGE);
                if held + first > ctx || pages > self.free.len() {
                    continue;
                }
                let mut plan = Vec::with_capacity(seqs);
                for i in 0..seqs {
                    let id = self.add();
                    // Never run: the pages' contents do not matter.
                    let s = self.seqs.get_mut(&id).expect("added");
                    (s.len, s.toks) = (held, vec![0; held]);
                    plan.push((id, if i == 0 { first } else { 1 }));
                }
                let host: Vec<bool> = (0..seqs).map(|i| i % 2 == 1).collect();
                let recorded = self.record_picking(gpu, &plan, &host).map(drop);
                for &(id, _) in &plan {
                    self.remove(id);
                }
                recorded?;
                steps += 1;
            }
        }
        Ok(steps)
    }

    /// Appends each feed's tokens to its sequence (a sequence at most once a step) in one
    /// forward pass, and returns each feed's logits (V) after its last token. Pages are
    /// taken as needed. An error before anything is taken where the pool has too few, a
    /// token is past the vocabulary, or a sequence would pass the model's context; a
    /// failed forward pass leaves the sequences' lengths as they were.
    /// ([`Batch::record`], [`Batch::submit`] and [`Batch::wait`] in one.)
    pub async fn step_async(
        &mut self,
        gpu: &Gpu,
        feeds: &[(SeqId, &[u32])],
    ) -> Result<Vec<Vec<f32>>> {
        if feeds.is_empty() {
            return Ok(Vec::new());
        }
        let ahead = self.record_tokens(gpu, feeds)?;
        let flight = self.submit(gpu, ahead, feeds)?;
        self.wait(gpu, flight).await
    }

    fn check_tokens(&self, feeds: &[(SeqId, &[u32])]) -> Result<()> {
        let vocab = self.llama.cfg.vocab_size;
        for &(_, toks) in feeds {
            if let Some(&t) = toks.iter().find(|&&t| t as usize >= vocab) {
                return Err(bad(format!("token {t} is past the vocabulary of {vocab}")));
            }
        }
        Ok(())
    }

    /// Records a step of `plan` (each sequence's number of new tokens, a sequence at most
    /// once) before its tokens are known: the host's part of a step (pages, uploads,
    /// recording, encoding), done while the GPU runs the step before. Pages are taken as
    /// needed (they stay with their sequences if the step is dropped unsubmitted). An error,
    /// before anything is taken, where the pool has too few pages or a sequence would pass
    /// the model's context. Run it with [`Batch::submit`] while the sequences hold the
    /// lengths they had here.
    pub fn record<'g>(&mut self, gpu: &'g Gpu, plan: &[(SeqId, usize)]) -> Result<Ahead<'g>> {
        self.record_with(gpu, plan, None, None, None)
    }

    /// [`Batch::record`] of a step whose tokens the GPU chooses (`ops::sample`: the CPU
    /// sampler's greedy choice or plain draw, the same token) for each sequence except
    /// those `host` marks (one flag a plan entry), whose logits come back instead: only a
    /// token a row is read back for the others. Submit it with [`Batch::submit_picking`],
    /// wait with [`Batch::wait_chosen`].
    pub fn record_picking<'g>(
        &mut self,
        gpu: &'g Gpu,
        plan: &[(SeqId, usize)],
        host: &[bool],
    ) -> Result<Ahead<'g>> {
        self.record_with(gpu, plan, None, Some(host), None)
    }

    /// A step of one row for each of `seqs` whose tokens are the ones the GPU chooses for
    /// the same sequences in `prev` (submitted, not yet waited for: the newest step in
    /// flight), copied on the GPU at the step's start; every row's next token chosen on the
    /// GPU too ([`Batch::record_picking`]). Submit it with [`Batch::submit_chained`] while
    /// `prev` runs, then wait for both in order: the GPU goes from one step to the next
    /// without waiting for the host. Beside them, rows whose tokens are known (`known`: a
    /// prompt's chunk, a token the host chose), uploaded now, with `host` flags for those
    /// as [`Batch::record_picking`]'s; the step's rows are `seqs`' then `known`'s. An error
    /// where a sequence is not one whose token `prev` chooses on the GPU, is twice in the
    /// step, or a known token is past the vocabulary.
    pub fn record_chained<'g>(
        &mut self,
        gpu: &'g Gpu,
        prev: &InFlight,
        seqs: &[SeqId],
        known: &[(SeqId, &[u32])],
        host: &[bool],
    ) -> Result<Ahead<'g>> {
        if host.len() != known.len() {
            return Err(bad(format!(
                "{} host flags for {} known feeds",
                host.len(),
                known.len()
            )));
        }
        self.check_tokens(known)?;
        if self.flights.back().map(|f| f.step) != Some(prev.step) {
            return Err(bad(
                "a chained step follows the newest step in flight".into()
            ));
        }
        let Some((prev_host, _, chosen)) = &prev.picking else {
            return Err(bad(
                "a chained step follows a step whose tokens the GPU chooses (record_picking)"
                    .into(),
            ));
        };
        let mut rows = Vec::with_capacity(seqs.len());
        for &id in seqs {
            match prev.feeds.iter().position(|f| f.0 == id) {
                Some(k) if !prev_host[k] => rows.push(k),
                Some(_) => {
                    return Err(bad(format!(
                        "sequence {id}: the host chooses its token in the step before"
                    )))
                }
                None => return Err(bad(format!("sequence {id} is not in the step before"))),
            }
        }
        let mut plan: Vec<(SeqId, usize)> = seqs.iter().map(|&id| (id, 1)).collect();
        plan.extend(known.iter().map(|&(id, t)| (id, t.len())));
        // The chained rows' ids are copied over the zeros on the GPU.
        let mut ids = vec![0u32; seqs.len()];
        ids.extend(known.iter().flat_map(|(_, t)| t.iter().copied()));
        let mut flags = vec![false; seqs.len()];
        flags.extend_from_slice(host);
        let chain = Chain {
            from: prev.step,
            chosen: chosen.clone(),
            rows,
        };
        self.record_with(gpu, &plan, Some(&ids), Some(&flags), Some(chain))
    }

    /// [`Batch::record_tokens`] with the GPU choosing tokens ([`Batch::record_picking`]).
    pub fn record_tokens_picking<'g>(
        &mut self,
        gpu: &'g Gpu,
        feeds: &[(SeqId, &[u32])],
        host: &[bool],
    ) -> Result<Ahead<'g>> {
        self.record_known(gpu, feeds, Some(host))
    }

    /// [`Batch::record`] of a step whose tokens are known (`feeds`, submitted with the
    /// same): they are uploaded first, so that a step of many rows (a prompt) is submitted
    /// in parts as it records (the GPU starts sooner, and fewer temporaries are held at
    /// once). An error where a token is past the vocabulary.
    pub fn record_tokens<'g>(
        &mut self,
        gpu: &'g Gpu,
        feeds: &[(SeqId, &[u32])],
    ) -> Result<Ahead<'g>> {
        self.record_known(gpu, feeds, None)
    }

    /// [`Batch::record_with`] of `feeds`' tokens, checked and uploaded now.
    fn record_known<'g>(
        &mut self,
        gpu: &'g Gpu,
        feeds: &[(SeqId, &[u32])],
        host: Option<&[bool]>,
    ) -> Result<Ahead<'g>> {
        self.check_tokens(feeds)?;
        let plan: Vec<(SeqId, usize)> = feeds.iter().map(|&(id, t)| (id, t.len())).collect();
        let ids: Vec<u32> = feeds.iter().flat_map(|(_, t)| t.iter().copied()).collect();
        self.record_with(gpu, &plan, Some(&ids), host, None)
    }

    /// [`Batch::record`]; with `known` token ids uploaded now and a step of many rows
    /// submitted in parts as it records (then [`Batch::submit`] takes only those ids:
    /// [`Batch::record_tokens`]); with `host`, tokens chosen on the GPU but for the rows
    /// it marks ([`Batch::record_picking`]): the choosing and what follows it stay in the
    /// last part, submitted with the picks; with `chain`, the token ids copied from the
    /// choices of the step before ([`Batch::record_chained`]).
    fn record_with<'g>(
        &mut self,
        gpu: &'g Gpu,
        plan: &[(SeqId, usize)],
        known: Option<&[u32]>,
        host: Option<&[bool]>,
        chain: Option<Chain>,
    ) -> Result<Ahead<'g>> {
        let t0 = Instant::now();
        if let Some(h) = host {
            if h.len() != plan.len() {
                return Err(bad(format!(
                    "{} host flags for a plan of {} sequences",
                    h.len(),
                    plan.len()
                )));
            }
        }
        let llama = self.llama;
        let ctx = llama.max_context;
        let mut need = 0;
        let mut seen = BTreeSet::new();
        if plan.is_empty() {
            return Err(bad("a step of no sequences".into()));
        }
        for &(id, n) in plan {
            let s = self
                .seqs
                .get(&id)
                .ok_or_else(|| bad(format!("no sequence {id}")))?;
            if n == 0 || !seen.insert(id) {
                return Err(bad(format!("sequence {id}: no tokens, or twice in a step")));
            }
            if s.len + n > ctx {
                return Err(bad(format!(
                    "sequence {id}: {} + {n} tokens pass the context of {ctx}",
                    s.len
                )));
            }
            need += (s.len + n).div_ceil(PAGE).saturating_sub(s.pages.len());
        }
        if need > self.available() {
            return Err(bad(format!(
                "the KV pool has {} pages of {PAGE} tokens free (or cached and unheld), the step needs {need}",
                self.available()
            )));
        }
        for &(id, n) in plan {
            let want = (self.seqs[&id].len + n).div_ceil(PAGE);
            while self.seqs[&id].pages.len() < want {
                let p = self.take_page();
                self.seqs.get_mut(&id).expect("checked").pages.push(p);
            }
        }
        let mut list = Vec::new();
        let mut last = Vec::new();
        let mut held = Vec::with_capacity(plan.len());
        for &(id, n) in plan {
            let s = &self.seqs[&id];
            for i in 0..n {
                list.push((s.len + i, s.pages.as_slice()));
            }
            last.push((list.len() - 1) as u32);
            held.push((id, s.len, n));
        }
        let rows = PagedRows::new(gpu, &list)?;
        // A chained step whose rows are the step before's, in its order: the ids are its
        // choices as they stand (no copy).
        let same = chain.as_ref().is_some_and(|c| {
            c.rows.len() == list.len()
                && c.chosen.numel() == list.len()
                && c.rows.iter().enumerate().all(|(i, &r)| r == i)
        });
        // The token ids are written at the submission, unless known now.
        let ids = match (known, &chain) {
            (_, Some(c)) if same => c.chosen.clone(),
            (Some(k), _) if k.len() == list.len() => {
                Tensor::from_u32(gpu, &[k.len()], k, "batch.ids")?
            }
            (Some(k), _) => {
                return Err(bad(format!(
                    "{} token ids for {} rows",
                    k.len(),
                    list.len()
                )));
            }
            (None, _) => Tensor::empty(gpu, &[list.len()], DType::U32, "batch.ids")?,
        };
        // (Every row a sequence's last, in order: the logits of every row, no gather.)
        let every = last.iter().enumerate().all(|(i, &r)| r as usize == i);
        let last_t = match every {
            true => None,
            false => Some(Tensor::from_u32(gpu, &[last.len()], &last, "batch.last")?),
        };
        let mut rec = match self.timing {
            StepTiming::Off => gpu.recorder("batch"),
            StepTiming::Whole => gpu.timed_recorder("batch"),
            StepTiming::EachDispatch => gpu.profiling_recorder("batch"),
        };
        // (A chained step is submitted whole: its copies must follow the step before.)
        if known.is_some() && chain.is_none() && list.len() > 1 {
            rec.set_flush_every(FLUSH_EVERY); // (no-op when timed)
        }
        if let Some(c) = chain.as_ref().filter(|_| !same) {
            // ids[j] = chosen[rows[j]]: a copy a run of consecutive rows.
            let mut j = 0;
            while j < c.rows.len() {
                let mut n = 1;
                while j + n < c.rows.len() && c.rows[j + n] == c.rows[j] + n {
                    n += 1;
                }
                rec.copy_elements(&c.chosen, c.rows[j], &ids, j, n)?;
                j += n;
            }
        }
        let logits = llama.forward_paged(&mut rec, &ids, &self.pool, &rows, last_t.as_ref())?;
        if logits.dtype() != DType::F32 {
            return Err(bad("logits are not f32".into()));
        }
        let (read, picking) = match host {
            None => (Some(rec.read_later(&logits)?), None),
            Some(host) => {
                // The choices (the host's rows skipped), then the host's rows' logits
                // gathered into one tensor.
                let vocab = llama.cfg.vocab_size;
                let how = Tensor::empty(gpu, &[plan.len(), 4], DType::U32, "batch.how")?;
                // The picks are written at the submission: nothing from here on may be
                // submitted before it (a step recorded with its tokens known is otherwise
                // submitted in parts as it records).
                rec.set_flush_every(0);
                let chosen = sample_rows(&mut rec, &logits, &how, &self.tables)?;
                let rows: Vec<usize> = (0..host.len()).filter(|&r| host[r]).collect();
                let read = match rows.len() {
                    0 => None,
                    n if n == host.len() => Some(rec.read_later(&logits)?),
                    n => {
                        let some = Tensor::empty(gpu, &[n, vocab], DType::F32, "batch.host")?;
                        for (j, &r) in rows.iter().enumerate() {
                            rec.copy_elements(&logits, r * vocab, &some, j * vocab, vocab)?;
                        }
                        Some(rec.read_later(&some)?)
                    }
                };
                let picking = Picking {
                    host: host.to_vec(),
                    how,
                    chosen: rec.read_later(&chosen)?,
                    chosen_t: chosen,
                };
                (read, Some(picking))
            }
        };
        let enc = rec.encode()?;
        Ok(Ahead {
            plan: held,
            known: known.map(|k| k.to_vec()),
            ids,
            enc,
            logits: read,
            picking,
            chain,
            record_ms: t0.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// Submits a recorded step with its tokens (`feeds`: the plan's sequences in its
    /// order, each with its number of tokens) and appends them to the sequences. An error,
    /// with nothing submitted or changed, where the feeds are not the plan, a token is past
    /// the vocabulary, a sequence changed since the recording, or another step is
    /// submitted and not yet waited for. Wait for the logits with [`Batch::wait`] (another
    /// step may be recorded meanwhile, not submitted).
    pub fn submit<'g>(
        &mut self,
        gpu: &'g Gpu,
        ahead: Ahead<'g>,
        feeds: &[(SeqId, &[u32])],
    ) -> Result<InFlight> {
        self.submit_with(gpu, ahead, Some(feeds), None)
    }

    /// [`Batch::submit`] of a step recorded with [`Batch::record_picking`]: `picks` says how
    /// the GPU chooses each fed sequence's token (from [`crate::infer::sample::Sampler::gpu_pick`];
    /// [`Pick::Host`] exactly for the rows recorded as the host's; a row whose choice will
    /// not be used may take [`Pick::Greedy`]).
    pub fn submit_picking<'g>(
        &mut self,
        gpu: &'g Gpu,
        ahead: Ahead<'g>,
        feeds: &[(SeqId, &[u32])],
        picks: &[Pick],
    ) -> Result<InFlight> {
        self.submit_with(gpu, ahead, Some(feeds), Some(picks))
    }

    /// Submits a step recorded with [`Batch::record_chained`] while the step it follows is
    /// in flight (the only one): its sequences grow by a token each, known once that step
    /// is waited for. `picks` as [`Batch::submit_picking`]'s (none the host's). Wait for
    /// the step before first, then this one ([`Batch::wait_chosen`]).
    pub fn submit_chained<'g>(
        &mut self,
        gpu: &'g Gpu,
        ahead: Ahead<'g>,
        picks: &[Pick],
    ) -> Result<InFlight> {
        self.submit_with(gpu, ahead, None, Some(picks))
    }

    /// `feeds` None: a chained step.
    fn submit_with<'g>(
        &mut self,
        gpu: &'g Gpu,
        ahead: Ahead<'g>,
        feeds: Option<&[(SeqId, &[u32])]>,
        picks: Option<&[Pick]>,
    ) -> Result<InFlight> {
        let t0 = Instant::now();
        match (&ahead.picking, picks) {
            (None, None) => {}
            (Some(pk), Some(picks))
                if picks.len() == pk.host.len()
                    && picks
                        .iter()
                        .zip(&pk.host)
                        .all(|(p, &h)| (*p == Pick::Host) == h) => {}
            (Some(pk), Some(picks)) => {
                return Err(bad(format!(
                    "picks {picks:?} for a step recorded with the host choosing rows {:?}",
                    pk.host
                )))
            }
            (Some(_), None) => {
                return Err(bad(
                    "the step was recorded for the GPU to choose tokens: submit it with its picks"
                        .into(),
                ))
            }
            (None, Some(_)) => {
                return Err(bad(
                    "picks for a step recorded without them (record_picking)".into(),
                ))
            }
        }
        match (&ahead.chain, feeds) {
            (None, Some(_)) if !self.flights.is_empty() => {
                return Err(bad(
                    "a step is already submitted: wait for it before submitting the next".into(),
                ))
            }
            (None, Some(_)) => {}
            (Some(c), None) => {
                if self.flights.len() != 1 || self.flights[0].step != c.from {
                    return Err(bad(
                        "a chained step is submitted while the step it follows is the only one in flight"
                            .into(),
                    ));
                }
            }
            (Some(_), Some(_)) => {
                return Err(bad(
                    "the step was recorded chained: submit it with submit_chained".into(),
                ))
            }
            (None, None) => {
                return Err(bad(
                    "the step was not recorded chained (record_chained)".into()
                ))
            }
        }
        let feeds = feeds.unwrap_or(&[]);
        if ahead.chain.is_none() && !ahead.matches(feeds) {
            return Err(bad(format!(
                "the step was recorded for {:?} (sequence, tokens), fed {:?}",
                ahead.plan().collect::<Vec<_>>(),
                feeds
                    .iter()
                    .map(|(id, t)| (*id, t.len()))
                    .collect::<Vec<_>>()
            )));
        }
        for &(id, len, _) in &ahead.plan {
            match self.seqs.get(&id) {
                Some(s) if s.len == len => {}
                Some(s) => {
                    return Err(bad(format!(
                        "sequence {id} holds {} tokens, the step was recorded at {len}",
                        s.len
                    )))
                }
                None => return Err(bad(format!("no sequence {id}"))),
            }
        }
        let ids: Vec<u32> = feeds.iter().flat_map(|(_, t)| t.iter().copied()).collect();
        match &ahead.known {
            // (copied from the step before on the GPU, and uploaded when recorded)
            _ if ahead.chain.is_some() => {}
            None => {
                self.check_tokens(feeds)?;
                ahead.ids.write_u32(gpu, &ids)?
            }
            // (checked when recorded)
            Some(k) if *k == ids => {}
            Some(_) => return Err(bad("the step was recorded with other tokens".into())),
        }
        if let (Some(pk), Some(picks)) = (&ahead.picking, picks) {
            let words: Vec<u32> = picks.iter().flat_map(|p| p.words()).collect();
            pk.how.write_u32(gpu, &words)?;
        }
        let sub = ahead.enc.submit()?;
        let step = self.submitted;
        self.submitted += 1;
        // The tokens appended: known ones (fed, or uploaded when recorded), and for a
        // chained row the step before's choice, filled in when it comes back.
        let (chained, toks) = match &ahead.chain {
            None => (&[][..], &ids[..]),
            Some(c) => (&c.rows[..], ahead.known.as_deref().unwrap_or(&[])),
        };
        let mut fills = Vec::with_capacity(chained.len());
        let mut at = 0;
        for (j, &(id, len, n)) in ahead.plan.iter().enumerate() {
            let s = self.seqs.get_mut(&id).expect("checked");
            match chained.get(j) {
                Some(&k) => {
                    s.toks.push(u32::MAX);
                    fills.push((id, len, k));
                }
                None => s.toks.extend_from_slice(&toks[at..at + n]),
            }
            s.len += n;
            s.unsettled += n;
            at += n;
        }
        if ahead.chain.is_some() {
            self.flights[0].fills = fills;
        }
        let feeds: Vec<(SeqId, usize)> = ahead.plan.iter().map(|&(id, _, n)| (id, n)).collect();
        self.flights.push_back(Flying {
            step,
            feeds: feeds.clone(),
            fills: Vec::new(),
        });
        Ok(InFlight {
            step,
            feeds,
            sub,
            logits: ahead.logits,
            picking: ahead.picking.map(|p| (p.host, p.chosen, p.chosen_t)),
            record_ms: ahead.record_ms,
            submit_ms: t0.elapsed().as_secs_f64() * 1e3,
            submitted: Instant::now(),
        })
    }

    /// The logits (V) after each fed sequence's last token of a submitted step, in the
    /// plan's order; its whole pages go into the prefix cache. Where the step failed, its
    /// sequences are as they were before it. (A step recorded with picking: [`Batch::wait_chosen`].)
    pub async fn wait(&mut self, gpu: &Gpu, flight: InFlight) -> Result<Vec<Vec<f32>>> {
        let picked = flight.picking.is_some();
        let (_, rows) = self.wait_chosen_inner(gpu, flight).await?;
        match picked {
            // (The step ran; its choices are dropped.)
            true => Err(bad(
                "the step chose its tokens on the GPU: wait for it with wait_chosen".into(),
            )),
            false => Ok(rows),
        }
    }

    /// Each fed sequence's outcome of a step recorded with [`Batch::record_picking`], in the
    /// plan's order: the token the GPU chose, or the logits of a row the host chooses (a
    /// step recorded without picking: every row's logits). As [`Batch::wait`] otherwise.
    pub async fn wait_chosen(&mut self, gpu: &Gpu, flight: InFlight) -> Result<Vec<Chosen>> {
        let host: Option<Vec<bool>> = flight.picking.as_ref().map(|p| p.0.clone());
        let (chosen, rows) = self.wait_chosen_inner(gpu, flight).await?;
        let Some(host) = host else {
            return Ok(rows.into_iter().map(Chosen::Logits).collect());
        };
        let chosen = chosen.expect("picked");
        let mut rows = rows.into_iter();
        host.iter()
            .zip(chosen)
            .map(|(&h, t)| match h {
                true => rows
                    .next()
                    .map(Chosen::Logits)
                    .ok_or_else(|| bad("a host row's logits missing".into())),
                false => Ok(Chosen::Token(t)),
            })
            .collect()
    }

    /// The chosen ids (picking) and the logits read back (all rows, or the host's rows).
    async fn wait_chosen_inner(
        &mut self,
        gpu: &Gpu,
        flight: InFlight,
    ) -> Result<(Option<Vec<u32>>, Vec<Vec<f32>>)> {
        let vocab = self.llama.cfg.vocab_size;
        let InFlight {
            step,
            feeds,
            sub,
            logits,
            picking,
            record_ms,
            submit_ms,
            submitted,
        } = flight;
        let flying = match self.flights.front() {
            Some(f) if f.step == step => self.flights.pop_front().expect("checked"),
            _ if self.failed_through.is_some_and(|t| step <= t) => {
                return Err(bad(
                    "a step before this one failed, and this one was undone with it".into(),
                ))
            }
            _ => {
                // (Every step in flight is undone: the order is broken.)
                if let Some(f) = self.flights.pop_front() {
                    self.undo(f);
                }
                return Err(bad(
                    "steps are waited for in the order they were submitted".into()
                ));
            }
        };
        let done = async {
            let chosen = match &picking {
                Some((_, ids, _)) => Some(ids.u32s(gpu).await?),
                None => None,
            };
            // Rows straight from the mapped bytes (one copy).
            let rows = match &logits {
                Some(l) => {
                    l.map(gpu, |b| {
                        b.chunks(vocab * 4)
                            .map(bytemuck::pod_collect_to_vec::<u8, f32>)
                            .collect::<Vec<_>>()
                    })
                    .await?
                }
                None => Vec::new(),
            };
            // The GPU is done: index checks (an error here, before the logits are used) and
            // timestamps.
            let trace = sub.finish(gpu).await?;
            Ok::<_, Error>((chosen, rows, trace))
        }
        .await;
        let (chosen, rows, trace) = match done {
            Ok(d) => d,
            Err(e) => {
                self.undo(flying);
                return Err(e);
            }
        };
        for &(id, n) in &feeds {
            if let Some(s) = self.seqs.get_mut(&id) {
                s.unsettled -= n;
            }
        }
        if let Some(ch) = &chosen {
            for &(id, pos, k) in &flying.fills {
                if let Some(t) = self.seqs.get_mut(&id).and_then(|s| s.toks.get_mut(pos)) {
                    *t = ch[k];
                }
            }
        }
        self.last = StepTimes {
            record_ms,
            submit_ms,
            wait_ms: submitted.elapsed().as_secs_f64() * 1e3,
            trace,
        };
        for &(id, _) in &feeds {
            if self.seqs.contains_key(&id) {
                self.cache_whole_pages(id);
            }
        }
        Ok((chosen, rows))
    }
}

impl Batch<'_> {
    /// Undoes a failed step `first` (taken from the flights) and every step in flight
    /// after it (chained on it): their sequences are as they were before them.
    fn undo(&mut self, first: Flying) {
        let mut all = vec![first];
        all.extend(self.flights.drain(..));
        self.failed_through = all.last().map(|f| f.step);
        for f in &all {
            for &(id, n) in &f.feeds {
                if let Some(s) = self.seqs.get_mut(&id) {
                    s.len -= n;
                    s.unsettled -= n;
                    s.toks.truncate(s.len);
                }
            }
        }
    }
}

fn bad(detail: String) -> Error {
    Error::Invalid {
        op: "batch",
        detail,
    }
}

/// A step recorded ahead of its tokens ([`Batch::record`]); dropped unsubmitted, it runs
/// nothing.
pub struct Ahead<'g> {
    /// (sequence, its length when recorded, its new tokens).
    plan: Vec<(SeqId, usize, usize)>,
    /// The token ids where they were uploaded with the recording.
    known: Option<Vec<u32>>,
    ids: Tensor,
    enc: Encoded<'g>,
    /// Every row's logits, or with picking the host's rows' (None where it has none).
    logits: Option<Readback>,
    picking: Option<Picking>,
    /// Where the token ids come from the step before ([`Batch::record_chained`]).
    chain: Option<Chain>,
    record_ms: f64,
}

/// A chained step's tokens: the choices of step `from` (`chosen`, one a row of its plan),
/// row `rows[j]`'s for this step's row j.
struct Chain {
    from: u64,
    chosen: Tensor,
    rows: Vec<usize>,
}

/// A step's tokens chosen on the GPU ([`Batch::record_picking`]): which rows the host
/// chooses, the picks' words (written at the submission), the chosen ids' readback.
struct Picking {
    host: Vec<bool>,
    how: Tensor,
    chosen: Readback,
    /// The choices on the GPU (what a chained step copies its tokens from).
    chosen_t: Tensor,
}

impl Ahead<'_> {
    /// The sequences and their numbers of new tokens, in the step's order.
    pub fn plan(&self) -> impl Iterator<Item = (SeqId, usize)> + '_ {
        self.plan.iter().map(|&(id, _, n)| (id, n))
    }

    /// Whether `feeds` are the plan (the same sequences in the same order, as many tokens).
    pub fn matches(&self, feeds: &[(SeqId, &[u32])]) -> bool {
        self.plan.len() == feeds.len()
            && self
                .plan
                .iter()
                .zip(feeds)
                .all(|(&(id, _, n), &(fid, t))| id == fid && n == t.len())
    }

    /// With picking ([`Batch::record_picking`]): which rows the host chooses.
    pub fn host_rows(&self) -> Option<&[bool]> {
        self.picking.as_ref().map(|p| p.host.as_slice())
    }

    /// Host time its recording took.
    pub fn record_ms(&self) -> f64 {
        self.record_ms
    }
}

/// A submitted step ([`Batch::submit`]) whose logits [`Batch::wait`] returns. Wait for
/// it: until then its batch refuses to submit another.
pub struct InFlight {
    step: u64,
    feeds: Vec<(SeqId, usize)>,
    sub: Submission,
    logits: Option<Readback>,
    /// With picking: the host's rows, the chosen ids' readback and the ids on the GPU.
    picking: Option<(Vec<bool>, Readback, Tensor)>,
    record_ms: f64,
    submit_ms: f64,
    submitted: Instant,
}
