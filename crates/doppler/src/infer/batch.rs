//! Continuous batching: many sequences in one pool of KV pages, advanced together, a step
//! at a time ([`Batch::step_async`]: each sequence's new tokens, a prompt's or one
//! decoded token, as rows of one forward pass, [`Llama::forward_paged`]).
//!
//! Pages of [`PAGE`] tokens come from one pool and go back when a sequence is removed, so
//! memory follows the tokens held. Every row of a step runs the same kernels in the same
//! order whatever the other rows are: a sequence's logits are the same bits alone or
//! beside others (batch invariance; `tests/gpu.rs`, `tests/smollm2.rs` check it).

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::gpu::{DType, Gpu, Tensor, FLUSH_EVERY};
use crate::ops::kvcache::{paged_pool, KvCache, KvType, PagedRows, PAGE};

use super::Model;

/// A sequence's handle in a [`Batch`].
pub type SeqId = u64;

struct Seq {
    pages: Vec<u32>,
    len: usize,
}

/// Sequences in one paged KV pool.
pub struct Batch<'m> {
    pub model: &'m Model,
    pool: KvCache,
    /// Free pages, the lowest last (taken first).
    free: Vec<u32>,
    seqs: BTreeMap<SeqId, Seq>,
    next: SeqId,
    pages: usize,
}

impl<'m> Batch<'m> {
    /// A pool of `pages` pages of [`PAGE`] tokens of type `ty`. Refuses models
    /// [`crate::models::llama::Llama::paged_unsupported`] names.
    pub fn new(gpu: &Gpu, model: &'m Model, pages: usize, ty: KvType) -> Result<Batch<'m>> {
        if let Some(why) = model.llama.paged_unsupported() {
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
        let c = &model.llama.cfg;
        let pool = paged_pool(gpu, c.n_layer, pages, c.n_kv_head, c.head_dim, ty)?;
        Ok(Batch {
            model,
            pool,
            free: (0..pages as u32).rev().collect(),
            seqs: BTreeMap::new(),
            next: 0,
            pages,
        })
    }

    /// Pages in use by sequences.
    pub fn pages_in_use(&self) -> usize {
        self.pages - self.free.len()
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
        (len + n).div_ceil(PAGE).saturating_sub(have) + others <= self.free.len()
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
        let id = self.next;
        self.next += 1;
        self.seqs.insert(
            id,
            Seq {
                pages: Vec::new(),
                len: 0,
            },
        );
        id
    }

    /// Forgets `id`; its pages go back to the pool.
    pub fn remove(&mut self, id: SeqId) {
        if let Some(s) = self.seqs.remove(&id) {
            self.free.extend(s.pages.into_iter().rev());
        }
    }

    /// Blocking [`Batch::step_async`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn step(&mut self, gpu: &Gpu, feeds: &[(SeqId, &[u32])]) -> Result<Vec<Vec<f32>>> {
        pollster::block_on(self.step_async(gpu, feeds))
    }

    /// Appends each feed's tokens to its sequence (a sequence at most once a step) in one
    /// forward pass, and returns each feed's logits (V) after its last token. Pages are
    /// taken as needed. An error before anything is taken where the pool has too few, a
    /// token is past the vocabulary, or a sequence would pass the model's context; a
    /// failed forward pass leaves the sequences' lengths as they were.
    pub async fn step_async(
        &mut self,
        gpu: &Gpu,
        feeds: &[(SeqId, &[u32])],
    ) -> Result<Vec<Vec<f32>>> {
        let llama = &self.model.llama;
        let (vocab, ctx) = (llama.cfg.vocab_size, llama.max_context);
        let bad = |detail: String| Error::Invalid {
            op: "batch",
            detail,
        };
        let mut need = 0;
        let mut seen = std::collections::BTreeSet::new();
        for &(id, toks) in feeds {
            let s = self
                .seqs
                .get(&id)
                .ok_or_else(|| bad(format!("no sequence {id}")))?;
            if toks.is_empty() || !seen.insert(id) {
                return Err(bad(format!("sequence {id}: no tokens, or twice in a step")));
            }
            if let Some(&t) = toks.iter().find(|&&t| t as usize >= vocab) {
                return Err(bad(format!("token {t} is past the vocabulary of {vocab}")));
            }
            if s.len + toks.len() > ctx {
                return Err(bad(format!(
                    "sequence {id}: {} + {} tokens pass the context of {ctx}",
                    s.len,
                    toks.len()
                )));
            }
            need += (s.len + toks.len())
                .div_ceil(PAGE)
                .saturating_sub(s.pages.len());
        }
        if feeds.is_empty() {
            return Ok(Vec::new());
        }
        if need > self.free.len() {
            return Err(bad(format!(
                "the KV pool has {} free pages of {PAGE} tokens, the step needs {need}",
                self.free.len()
            )));
        }
        for &(id, toks) in feeds {
            let s = self.seqs.get_mut(&id).expect("checked");
            while s.pages.len() * PAGE < s.len + toks.len() {
                s.pages.push(self.free.pop().expect("counted"));
            }
        }
        let mut ids = Vec::new();
        let mut list = Vec::new();
        let mut last = Vec::new();
        for &(id, toks) in feeds {
            let s = &self.seqs[&id];
            for (i, &t) in toks.iter().enumerate() {
                ids.push(t);
                list.push((s.len + i, s.pages.as_slice()));
            }
            last.push((ids.len() - 1) as u32);
        }
        let rows = PagedRows::new(gpu, &list)?;
        let ids_t = Tensor::from_u32(gpu, &[ids.len()], &ids, "batch.ids")?;
        let last_t = Tensor::from_u32(gpu, &[last.len()], &last, "batch.last")?;
        let pool = &self.pool;
        let many = ids.len() > 1;
        let logits = gpu
            .run_async(|rec| {
                if many {
                    rec.set_flush_every(FLUSH_EVERY);
                }
                llama.forward_paged(rec, &ids_t, pool, &rows, &last_t)
            })
            .await?;
        if logits.dtype() != DType::F32 {
            return Err(bad("logits are not f32".into()));
        }
        let all = logits.to_vec_f32(gpu).await?;
        for &(id, toks) in feeds {
            self.seqs.get_mut(&id).expect("checked").len += toks.len();
        }
        Ok(all.chunks(vocab).map(<[f32]>::to_vec).collect())
    }
}
