//! Greedy decoding with the argmax on the GPU, pipelined. Each step reads its token id
//! from a GPU buffer, where the previous step's argmax wrote it, so step i + 1 can be
//! recorded and submitted before step i's token is back on the host: the host records one
//! step while the GPU runs the other, and only 4 bytes a token come back.

use std::collections::VecDeque;

use super::PREFILL_CHUNK;
use crate::error::{Error, Result};
use crate::gpu::{DType, Gpu, Readback, Tensor, FLUSH_EVERY};
use crate::models::llama::Llama;
use crate::ops::kvcache::KvCache;
use crate::ops::reduce::argmax_rows_into;

pub struct GreedyDecoder {
    /// (1) u32: the token the next step runs (the last submitted step's choice).
    ids: Tensor,
    /// Tokens chosen by submitted steps and not read yet, oldest first.
    pending: VecDeque<Readback>,
    /// Whether a prefill has put a token into `ids`.
    primed: bool,
    /// Host time spent in [`GreedyDecoder::step`]: recording the ops, and submitting them
    /// (encoding, bind groups, the queue submit).
    pub record_ms: f64,
    pub submit_ms: f64,
    /// Dispatches recorded by those steps.
    pub dispatched: usize,
}

impl GreedyDecoder {
    pub fn new(gpu: &Gpu) -> Result<GreedyDecoder> {
        Ok(GreedyDecoder {
            ids: Tensor::empty(gpu, &[1], DType::U32, "greedy.ids")?,
            pending: VecDeque::new(),
            primed: false,
            record_ms: 0.0,
            submit_ms: 0.0,
            dispatched: 0,
        })
    }

    /// Runs `prompt` after what `cache` holds, in chunks of [`PREFILL_CHUNK`]; the argmax
    /// of the last position's logits becomes the first pending token.
    pub async fn prefill_async(
        &mut self,
        gpu: &Gpu,
        llama: &Llama,
        cache: &mut KvCache,
        prompt: &[u32],
    ) -> Result<()> {
        if prompt.is_empty() {
            return Err(Error::Invalid {
                op: "generate",
                detail: "empty prompt".into(),
            });
        }
        let chunks = prompt.len().div_ceil(PREFILL_CHUNK);
        for (i, chunk) in prompt.chunks(PREFILL_CHUNK).enumerate() {
            let ids = &self.ids;
            let read = gpu
                .run_async(|rec| {
                    // A prompt is submitted as it is recorded: the GPU starts on the first
                    // layers (a one-token step stays one submission).
                    if chunk.len() > 1 {
                        rec.set_flush_every(FLUSH_EVERY);
                    }
                    let logits = llama.forward(rec, chunk, cache, false)?;
                    if i + 1 < chunks {
                        return Ok(None);
                    }
                    argmax_rows_into(rec, &logits, ids)?;
                    rec.read_later(ids).map(Some)
                })
                .await?;
            if let Some(r) = read {
                self.pending.push_back(r);
                self.primed = true;
            }
        }
        Ok(())
    }

    /// Submits one step over the last submitted step's token (read or not): its key and
    /// value enter the cache, and the argmax of its logits becomes a pending token.
    pub async fn step_async(
        &mut self,
        gpu: &Gpu,
        llama: &Llama,
        cache: &mut KvCache,
    ) -> Result<()> {
        if !self.primed {
            return Err(Error::Invalid {
                op: "generate",
                detail: "a greedy step needs a prefill first".into(),
            });
        }
        let t = web_time::Instant::now();
        let (ids, mut recorded) = (&self.ids, t);
        let mut dispatched = 0;
        let read = gpu
            .run_async(|rec| {
                let logits = llama.forward_ids(rec, ids, cache, false)?;
                argmax_rows_into(rec, &logits, ids)?;
                let read = rec.read_later(ids)?;
                dispatched = rec.dispatches();
                recorded = web_time::Instant::now();
                Ok(read)
            })
            .await?;
        self.dispatched += dispatched;
        self.pending.push_back(read);
        self.record_ms += (recorded - t).as_secs_f64() * 1e3;
        self.submit_ms += recorded.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }

    /// The oldest pending token; waits for the step that chose it, not for later ones.
    pub async fn next_token_async(&mut self, gpu: &Gpu) -> Result<u32> {
        let r = self.pending.pop_front().ok_or_else(|| Error::Invalid {
            op: "generate",
            detail: "no pending token".into(),
        })?;
        Ok(r.u32s(gpu).await?[0])
    }

    /// Blocking [`GreedyDecoder::prefill_async`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn prefill(
        &mut self,
        gpu: &Gpu,
        llama: &Llama,
        cache: &mut KvCache,
        prompt: &[u32],
    ) -> Result<()> {
        pollster::block_on(self.prefill_async(gpu, llama, cache, prompt))
    }

    /// Blocking [`GreedyDecoder::step_async`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn step(&mut self, gpu: &Gpu, llama: &Llama, cache: &mut KvCache) -> Result<()> {
        pollster::block_on(self.step_async(gpu, llama, cache))
    }

    /// Blocking [`GreedyDecoder::next_token_async`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn next_token(&mut self, gpu: &Gpu) -> Result<u32> {
        pollster::block_on(self.next_token_async(gpu))
    }
}
