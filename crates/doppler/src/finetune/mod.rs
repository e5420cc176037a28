//! Fine-tuning pretrained Llama-family models with LoRA: the base stays frozen in its
//! file's encoding on the GPU (its products read the blocks both ways), only the adapters
//! train, with AdamW, warmup then cosine, clipping and gradient accumulation. The forward
//! is the model's own definition (`Llama::train_logits`). The loss is the mean over the
//! learned tokens of a micro-batch (assistant turns, completions; see `data`).
//!
//! Batches: each sample is a row; the order is a fresh permutation of the training
//! samples each epoch, drawn from (seed, epoch), so a run is a pure function of its config.
//!
//! Checkpoints are `train`'s (`out_dir/step-NNNNNNNN/`, atomic, SHA-256 hashed, `latest`):
//! the adapters and AdamW's moments, the step, and what the run's data and base were; a
//! run resumed from one continues bit for bit. The PEFT adapter beside them
//! (`out_dir/adapter`) is what inference and PEFT load.

#[cfg(not(target_arch = "wasm32"))]
pub mod adapter;
pub mod config;
pub mod data;
#[cfg(not(target_arch = "wasm32"))]
pub mod export;
pub mod lora;

use std::path::PathBuf;
use web_time::Instant;

use crate::autograd::Tape;
use crate::error::{Error, Result};
use crate::gpu::{Gpu, Tensor};
use crate::infer::Model;
use crate::models::llama::TrainOpts;
use crate::ops::cross_entropy::CrossEntropyOpts;
use crate::optim::{grad_scale, warmup_cosine, AdamW};
use crate::train::checkpoint;
#[cfg(not(target_arch = "wasm32"))]
use crate::train::checkpoint::{CheckpointFiles, RunState};
use crate::train::data::mix;
use config::FinetuneConfig;
use data::{Sample, IGNORE};
use lora::Lora;

/// One optimizer step's record.
#[derive(Clone, Debug, serde::Serialize)]
pub struct FtStep {
    pub step: u64,
    pub steps: u64,
    /// Mean over the step's micro-batches of their mean loss on learned tokens.
    pub loss: f32,
    pub lr: f64,
    /// Learned tokens in the step.
    pub tokens: usize,
    pub tokens_per_s: f64,
    /// The most bytes of GPU buffers Doppler's pool has held so far (the base's weights
    /// included).
    pub gpu_peak_bytes: u64,
}

/// What [`Finetuner::run`] reports as it goes.
pub enum FtEvent<'a> {
    Started {
        base_bytes: u64,
        adapter_params: usize,
        train_samples: usize,
        eval_samples: usize,
        truncated: usize,
        steps: u64,
    },
    Step(&'a FtStep),
    Eval {
        step: u64,
        eval_loss: f32,
    },
    Saved {
        step: u64,
        dir: PathBuf,
    },
}

/// What a fine-tune's checkpoint keeps besides its tensors and step: the config, and what
/// the data and the base were, so that a resume over other data or another base is refused.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct FtRun {
    pub config: FinetuneConfig,
    /// SHA-256 of the training JSONL text, then the held-out one's (when it has its own).
    pub data_sha256: String,
    /// The base's weight bytes on the GPU and its layer count.
    pub base_bytes: u64,
    pub base_layers: usize,
}

#[cfg(not(target_arch = "wasm32"))]
const METRICS: &str = "metrics.jsonl";

/// Losses of steps up to `upto` from an earlier run's metrics.jsonl.
#[cfg(not(target_arch = "wasm32"))]
fn read_history(path: &std::path::Path, upto: u64) -> Vec<(u64, f32, Option<f32>)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut out: Vec<(u64, f32, Option<f32>)> = Vec::new();
    for v in text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
    {
        let Some(step) = v["step"].as_u64().filter(|&s| s <= upto) else {
            continue;
        };
        let loss = v["loss"].as_f64().map(|x| x as f32);
        let eval = v["eval_loss"].as_f64().map(|x| x as f32);
        match out.last_mut() {
            Some(last) if last.0 == step => {
                last.1 = loss.unwrap_or(last.1);
                last.2 = eval.or(last.2);
            }
            _ => out.push((step, loss.unwrap_or(f32::NAN), eval)),
        }
    }
    out
}

/// Bytes of logits the recomputing pass holds at once: the loss runs over pieces of this
/// many rows' logits (f32), each with its backward, before the next.
const LOSS_CHUNK_BYTES: usize = 256 << 20;

/// Bytes of buffers a submitted part of a step binds at most (with two parts in flight):
/// the temporaries the GPU has not finished with stay around this size however long the
/// rows are (`Recorder::set_flush_bytes`).
const FLUSH_BYTES: u64 = 1 << 30;

/// The cross-entropy of fine-tuning: the mean over learned tokens.
fn ce() -> CrossEntropyOpts {
    CrossEntropyOpts {
        ignore_index: Some(IGNORE),
        ..Default::default()
    }
}

/// What [`layered`] runs: the backward too (its upstream factor; the adapters' gradients
/// accumulate in their store), or the forward alone (evaluation); the dropout seed; rows
/// of logits a loss piece.
struct Pass {
    grad: Option<f32>,
    dropout_seed: Option<u64>,
    chunk_rows: usize,
}

/// One micro-batch through the model a layer at a time, keeping only each layer's input
/// (B, T, E): the loss over pieces of `chunk_rows` rows (those with no learned token
/// skipped), and with `pass.grad` the backward: each piece's into the final norm's
/// output, then each layer recomputed from its saved input on a tape of its own and
/// backpropagated with the gradient from above (`Tape::backward_from`). The adapters'
/// gradients are the ones one tape over the whole model gives (the same kernels on the
/// same values; with one piece, the same bits). Returns a readback of each piece's
/// (mean, count) of the loss.
fn layered(
    llama: &crate::models::llama::Llama,
    rec: &mut crate::gpu::Recorder<'_>,
    ids: &Tensor,
    targets: &[u32],
    lora: &mut Lora,
    pass: Pass,
) -> Result<Vec<crate::gpu::Readback>> {
    // The tapes hold the adapters' tensors, not the adapters: each layer's borrow ends
    // before its backward writes their gradients.
    let seed = pass.dropout_seed;
    fn opts(lora: &Lora, dropout_seed: Option<u64>) -> TrainOpts<'_> {
        TrainOpts {
            lora: Some(lora),
            dropout_seed,
        }
    }
    llama.train_check(ids, opts(lora, seed))?;
    let gpu = rec.gpu();
    let (n_layer, e) = (llama.cfg.n_layer, llama.cfg.n_embd);
    let mut xs: Vec<Tensor> = vec![llama.train_embed(rec, ids)?];
    for li in 0..n_layer {
        let mut tape = Tape::new();
        tape.set_grad_enabled(false);
        let x = tape.input(xs.last().expect("the embeddings at least").clone());
        let y = llama.train_layer(&mut tape, rec, li, x, opts(lora, seed))?;
        let y = tape.value(y)?.clone();
        // Saved for the backward, or (evaluation) only the newest kept.
        match pass.grad.is_some() {
            true => xs.push(y),
            false => xs[0] = y,
        }
    }
    let pool = |at: &str| {
        let s = gpu.pool.stats();
        tracing::debug!(
            "finetune {at}: pool live {} MB, free {} MB, in flight {}",
            s.live_bytes >> 20,
            s.pooled_bytes >> 20,
            s.in_flight
        );
    };
    pool("forward done");
    let last = xs.pop().expect("the embeddings at least");
    let mut head = Tape::new();
    head.set_grad_enabled(pass.grad.is_some());
    let xl = head.input_with_grad(last);
    let xn = llama.train_norm(&mut head, rec, xl)?;
    let normed = head.value(xn)?.clone(); // (R, E)
    let rows = normed.shape()[0];
    let learned = targets.iter().filter(|&&t| t != IGNORE).count();
    let dxn = match pass.grad {
        Some(_) => {
            let dxn = Tensor::empty(gpu, &[rows, e], crate::gpu::DType::F32, "dxn")?;
            rec.clear(&dxn);
            Some(dxn)
        }
        None => None,
    };
    let mut reads = Vec::new();
    for r0 in (0..rows).step_by(pass.chunk_rows) {
        let n = pass.chunk_rows.min(rows - r0);
        let part = &targets[r0..r0 + n];
        let count = part.iter().filter(|&&t| t != IGNORE).count();
        if count == 0 {
            continue;
        }
        let xc = match (r0, n) {
            (0, n) if n == rows => normed.clone(),
            _ => {
                let xc = Tensor::empty(gpu, &[n, e], crate::gpu::DType::F32, "rows")?;
                rec.copy_elements(&normed, r0 * e, &xc, 0, n * e)?;
                xc
            }
        };
        let tt = Tensor::from_u32(gpu, &[n], part, "targets")?;
        let mut tape = Tape::new();
        tape.set_grad_enabled(pass.grad.is_some());
        let xi = tape.input_with_grad(xc);
        let logits = llama.train_output(&mut tape, rec, xi)?;
        let loss = tape.cross_entropy(rec, logits, &tt, ce())?;
        reads.push(rec.read_later(tape.value(loss)?)?);
        if let (Some(g), Some(dxn)) = (pass.grad, dxn.as_ref()) {
            // The piece's mean times its share of the learned tokens: the micro-batch's mean.
            let share = match count == learned {
                true => g,
                false => g * (count as f32 / learned as f32),
            };
            let [dxc] = tape
                .backward_inputs(rec, loss, share, &mut lora.params, &[xi])?
                .try_into()
                .map_err(|_| Error::Invalid {
                    op: "finetune",
                    detail: "one gradient per input".into(),
                })?;
            match n == rows {
                true => rec.copy(&dxc, dxn)?,
                false => rec.copy_elements(&dxc, 0, dxn, r0 * e, n * e)?,
            }
        }
    }
    let Some(dxn) = dxn else {
        return Ok(reads);
    };
    let one = |v: Vec<Tensor>| v.into_iter().next().expect("one input asked");
    pool("loss done");
    let mut dx = one(head.backward_from(rec, xn, dxn, &mut lora.params, &[xl])?);
    for li in (0..n_layer).rev() {
        let mut tape = Tape::new();
        let saved = xs.pop().expect("a saved input a layer");
        // The embeddings get no gradient (the plain tape's input neither).
        let x = match li {
            0 => tape.input(saved),
            _ => tape.input_with_grad(saved),
        };
        let y = llama.train_layer(&mut tape, rec, li, x, opts(lora, seed))?;
        let inputs = if li == 0 { vec![] } else { vec![x] };
        let got = tape.backward_from(rec, y, dx.clone(), &mut lora.params, &inputs)?;
        if li > 0 {
            dx = one(got);
        }
        pool(&format!("layer {li} backward"));
    }
    Ok(reads)
}

/// (mean, learned tokens) of the loss from [`layered`]'s or one whole loss's readbacks of
/// (mean, count).
async fn mean_of(gpu: &Gpu, reads: &[crate::gpu::Readback]) -> Result<(f64, f64)> {
    let (mut sum, mut count) = (0.0f64, 0.0f64);
    for r in reads {
        let v = r.u32s(gpu).await?;
        let (m, c) = (f32::from_bits(v[0]) as f64, f32::from_bits(v[1]) as f64);
        sum += m * c;
        count += c;
    }
    Ok(match count > 0.0 {
        true => (sum / count, count),
        false => (0.0, 0.0),
    })
}

pub struct Finetuner<'g> {
    gpu: &'g Gpu,
    pub cfg: FinetuneConfig,
    pub model: Model,
    pub lora: Lora,
    opt: AdamW,
    pub train: Vec<Sample>,
    pub eval: Vec<Sample>,
    /// Samples longer than a row (truncated, or the run refused).
    pub truncated: usize,
    /// Rows of logits a piece of the loss when layers are recomputed (from
    /// LOSS_CHUNK_BYTES and the vocabulary).
    pub loss_rows: usize,
    pub step: u64,
    /// Learned tokens seen so far.
    pub tokens_seen: u64,
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    data_sha256: String,
    /// Continued from a checkpoint: metrics.jsonl is kept up to its step, and the run
    /// does not evaluate before its first step.
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    resumed: bool,
    history: Vec<(u64, f32, Option<f32>)>,
}

impl<'g> Finetuner<'g> {
    /// Opens the base and the data named by the config: a fresh run, or (`resume`) the
    /// latest checkpoint in the config's out_dir, continued.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new(gpu: &'g Gpu, cfg: &FinetuneConfig, resume: bool) -> Result<Finetuner<'g>> {
        let read = |p: &std::path::Path| {
            std::fs::read_to_string(p).map_err(|source| Error::Io {
                path: p.display().to_string(),
                source,
            })
        };
        let out = &cfg.out_dir;
        let has_ckpt = out.join("latest").is_file();
        let refuse = |detail: &str| Error::Checkpoint {
            path: out.display().to_string(),
            detail: detail.into(),
        };
        match (resume, has_ckpt) {
            (false, true) => return Err(refuse(
                "already holds checkpoints: pass --resume to continue, or choose another out_dir",
            )),
            (true, false) => return Err(refuse(
                "holds no checkpoint to resume (no `latest` file): run without --resume to start",
            )),
            _ => {}
        }
        // The checkpoint is read (and its hashes checked) before the base is opened.
        let ck = match resume {
            true => Some(checkpoint::load::<FtRun>(out)?),
            false => None,
        };
        let model = Model::open(gpu, &cfg.base, cfg.train.seq_len)?;
        let train = read(&cfg.data)?;
        let eval = cfg.eval_data.as_deref().map(read).transpose()?;
        let mut ft = Finetuner::from_parts(gpu, cfg, model, &train, eval.as_deref())?;
        if let Some(ck) = ck {
            ft.restore(ck)?;
        }
        Ok(ft)
    }

    /// Continues from a loaded checkpoint: the config must match this run's (paths
    /// aside), the data and the base must be the ones it was written with.
    #[cfg(not(target_arch = "wasm32"))]
    fn restore(&mut self, ck: checkpoint::Loaded<FtRun>) -> Result<()> {
        let bad = |detail: String| Error::Checkpoint {
            path: ck.dir.display().to_string(),
            detail,
        };
        let was = &ck.state.config;
        let diff = was.config.differences(&self.cfg);
        if !diff.is_empty() {
            return Err(bad(format!(
                "was written by another config: {}",
                diff.join("; ")
            )));
        }
        if was.data_sha256 != self.data_sha256 {
            return Err(bad(format!(
                "was written for other data: {} (or its held-out set) changed since",
                self.cfg.data.display()
            )));
        }
        let llama = &self.model.llama;
        if (was.base_bytes, was.base_layers) != (llama.weight_bytes, llama.cfg.n_layer) {
            return Err(bad(format!(
                "was written for another base: {} layers, {} weight bytes; {} has {} layers, {} bytes",
                was.base_layers,
                was.base_bytes,
                self.cfg.base.display(),
                llama.cfg.n_layer,
                llama.weight_bytes
            )));
        }
        let p = &mut self.lora.params;
        if ck.model.len() != p.names.len() {
            return Err(bad(format!(
                "holds {} adapter tensors, the run has {}",
                ck.model.len(),
                p.names.len()
            )));
        }
        for (name, shape, data) in &ck.model {
            let i = p.names.iter().position(|n| n == name);
            let i =
                i.ok_or_else(|| bad(format!("holds {name}, which this run has no place for")))?;
            if p.values[i].shape() != shape.as_slice() {
                return Err(bad(format!(
                    "{name} is {shape:?}, the run's is {:?}",
                    p.values[i].shape()
                )));
            }
            p.values[i] = Tensor::from_f32(self.gpu, shape, data, name)?;
        }
        let state = ck.optim_state(self.gpu, &p.names)?;
        self.opt.restore(ck.state.adamw_step, state)?;
        self.step = ck.state.step;
        self.tokens_seen = ck.state.tokens_seen;
        self.resumed = true;
        self.history = read_history(&self.cfg.out_dir.join(METRICS), self.step);
        Ok(())
    }

    /// A run over data given as JSONL text (`eval`: its own set, else the config's
    /// fraction of the training samples, the last ones).
    pub fn from_parts(
        gpu: &'g Gpu,
        cfg: &FinetuneConfig,
        model: Model,
        train_text: &str,
        eval_text: Option<&str>,
    ) -> Result<Finetuner<'g>> {
        let tmpl = model.template.as_ref();
        let data_sha256 = checkpoint::sha256(
            [train_text, "\n\0", eval_text.unwrap_or("")]
                .concat()
                .as_bytes(),
        );
        let shown = cfg.data.display().to_string();
        let mut train = data::parse_jsonl(train_text, &shown, &model.tokenizer, tmpl)?;
        let eval = match eval_text {
            Some(t) => {
                let shown = cfg
                    .eval_data
                    .as_ref()
                    .map_or(String::new(), |p| p.display().to_string());
                data::parse_jsonl(t, &shown, &model.tokenizer, tmpl)?
            }
            None => {
                let n = (train.len() as f64 * cfg.eval_fraction).round() as usize;
                if n >= train.len() {
                    return Err(Error::Invalid {
                        op: "finetune",
                        detail: format!(
                            "{shown}: {} samples leave none to train on after eval_fraction {}",
                            train.len(),
                            cfg.eval_fraction
                        ),
                    });
                }
                train.split_off(train.len() - n)
            }
        };
        let t = &cfg.train;
        let mut truncated = 0;
        for s in train.iter().chain(&eval) {
            let (_, targets, cut) = data::row(s, t.seq_len, 0, t.overflow, &shown)?;
            truncated += cut as usize;
            if targets.iter().all(|&x| x == IGNORE) {
                return Err(Error::Invalid {
                    op: "finetune data",
                    detail: format!(
                        "{shown} line {}: nothing left to learn once truncated to seq_len {} ({} tokens, the learned ones past the cut): raise seq_len",
                        s.line,
                        t.seq_len,
                        s.ids.len()
                    ),
                });
            }
        }
        let loss_rows = (LOSS_CHUNK_BYTES / (4 * model.llama.cfg.vocab_size).max(1)).max(1);
        let lora = Lora::new(
            gpu,
            &model.llama.cfg,
            cfg.spec(),
            mix(&[t.seed, 0x4C6F_5241]),
        )?;
        let params: Vec<&Tensor> = lora.params.values.iter().collect();
        let mut opt = AdamW::new(gpu, &params, t.lr)?;
        opt.betas = t.betas;
        opt.weight_decay = t.weight_decay;
        Ok(Finetuner {
            gpu,
            cfg: cfg.clone(),
            model,
            lora,
            opt,
            train,
            eval,
            truncated,
            loss_rows,
            step: 0,
            tokens_seen: 0,
            data_sha256,
            resumed: false,
            history: Vec::new(),
        })
    }

    /// The samples of micro-batch `micro` at step `step`: positions in a per-epoch
    /// permutation of the training samples.
    pub fn batch_samples(&self, step: u64, micro: usize) -> Vec<usize> {
        let t = &self.cfg.train;
        let n = self.train.len() as u64;
        let b = t.batch_size as u64;
        let first = (step * t.grad_accum as u64 + micro as u64) * b;
        let mut order: Option<(u64, Vec<usize>)> = None;
        (first..first + b)
            .map(|g| {
                let epoch = g / n;
                if order.as_ref().is_none_or(|o| o.0 != epoch) {
                    let mut idx: Vec<usize> = (0..n as usize).collect();
                    let mut rng = crate::check::Rng::new(mix(&[t.seed, epoch]));
                    for i in (1..idx.len()).rev() {
                        idx.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
                    }
                    order = Some((epoch, idx));
                }
                order.as_ref().expect("set").1[(g % n) as usize]
            })
            .collect()
    }

    /// (ids, targets) rows of `samples`, each (len, seq_len), and the learned tokens.
    fn rows(&self, samples: &[&Sample]) -> Result<(Vec<u32>, Vec<u32>, usize)> {
        let t = &self.cfg.train;
        let shown = self.cfg.data.display().to_string();
        let pad = self.model.tokenizer.eos.unwrap_or(0);
        let (mut ids, mut targets) = (Vec::new(), Vec::new());
        for s in samples {
            let (i, tg, _) = data::row(s, t.seq_len, pad, t.overflow, &shown)?;
            ids.extend(i);
            targets.extend(tg);
        }
        let learned = targets.iter().filter(|&&x| x != IGNORE).count();
        Ok((ids, targets, learned))
    }

    /// One optimizer step over `grad_accum` micro-batches.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn train_step(&mut self) -> Result<FtStep> {
        pollster::block_on(self.train_step_async())
    }

    pub async fn train_step_async(&mut self) -> Result<FtStep> {
        let t0 = Instant::now();
        let (gpu, tc) = (self.gpu, self.cfg.train.clone());
        let lr = warmup_cosine(self.step, tc.lr, tc.min_lr, tc.warmup, tc.steps);
        self.opt.lr = lr;
        let accum = tc.grad_accum;
        let (mut losses, mut tokens) = (Vec::new(), 0);
        for m in 0..accum {
            let picked = self.batch_samples(self.step, m);
            let samples: Vec<&Sample> = picked.iter().map(|&i| &self.train[i]).collect();
            let (ids, targets, learned) = self.rows(&samples)?;
            tokens += learned;
            let (b, s) = (samples.len(), tc.seq_len);
            let ti = Tensor::from_u32(gpu, &[b, s], &ids, "ids")?;
            let seed = mix(&[tc.seed, self.step, m as u64, 1]);
            let mut rec = gpu.recorder("finetune.step");
            // Submitted as it is recorded: the GPU starts sooner, and the temporaries of
            // finished parts go back to the pool for the rest of the step.
            rec.set_flush_every(crate::gpu::FLUSH_EVERY);
            rec.set_flush_bytes(FLUSH_BYTES, 2);
            // A micro-batch with no learned token (all truncated away) adds nothing.
            let g = if learned == 0 {
                0.0
            } else {
                1.0 / accum as f32
            };
            let llama = &self.model.llama;
            let reads = match tc.recompute {
                true => {
                    let pass = Pass {
                        grad: Some(g),
                        dropout_seed: Some(seed),
                        chunk_rows: self.loss_rows.max(1),
                    };
                    layered(llama, &mut rec, &ti, &targets, &mut self.lora, pass)?
                }
                false => {
                    let opts = TrainOpts {
                        lora: Some(&self.lora),
                        dropout_seed: Some(seed),
                    };
                    let tt = Tensor::from_u32(gpu, &[b * s], &targets, "targets")?;
                    let mut tape = Tape::new();
                    let logits = llama.train_logits(&mut tape, &mut rec, &ti, opts)?;
                    let loss = tape.cross_entropy(&mut rec, logits, &tt, ce())?;
                    let read = rec.read_later(tape.value(loss)?)?;
                    tape.backward(&mut rec, loss, g, &mut self.lora.params)?;
                    vec![read]
                }
            };
            losses.push(reads);
            rec.submit()?.settle(gpu).await?;
        }
        let mut rec = gpu.recorder("finetune.update");
        let grads = self.lora.params.all_grads("finetune")?;
        let grefs: Vec<&Tensor> = grads.iter().collect();
        let params: Vec<&Tensor> = self.lora.params.values.iter().collect();
        let scale = grad_scale(&mut rec, &grefs, tc.grad_clip, 1.0)?;
        self.opt.step(&mut rec, &params, &grefs, &scale)?;
        rec.submit()?.settle(gpu).await?;
        self.lora.params.zero_grad();
        let mut loss = 0.0f64;
        for reads in &losses {
            loss += mean_of(gpu, reads).await?.0;
        }
        let loss = (loss / accum as f64) as f32;
        self.step += 1;
        self.tokens_seen += tokens as u64;
        self.history.push((self.step, loss, None));
        Ok(FtStep {
            step: self.step,
            steps: tc.steps,
            loss,
            lr,
            tokens,
            tokens_per_s: (tc.batch_size * tc.seq_len * accum) as f64 / t0.elapsed().as_secs_f64(),
            gpu_peak_bytes: gpu.pool.stats().peak_bytes,
        })
    }

    /// Mean loss over every learned token of the evaluation samples (no dropout).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn evaluate(&mut self) -> Result<f32> {
        pollster::block_on(self.evaluate_async())
    }

    pub async fn evaluate_async(&mut self) -> Result<f32> {
        let gpu = self.gpu;
        let b = self.cfg.train.batch_size;
        let s = self.cfg.train.seq_len;
        let (mut sum, mut count) = (0.0f64, 0.0f64);
        let all: Vec<&Sample> = self.eval.iter().collect();
        for chunk in all.chunks(b) {
            let (ids, targets, learned) = self.rows(chunk)?;
            if learned == 0 {
                continue;
            }
            let ti = Tensor::from_u32(gpu, &[chunk.len(), s], &ids, "ids")?;
            let mut rec = gpu.recorder("finetune.eval");
            rec.set_flush_every(crate::gpu::FLUSH_EVERY);
            rec.set_flush_bytes(FLUSH_BYTES, 2);
            let llama = &self.model.llama;
            // A layer at a time (nothing kept for a backward), the loss in pieces.
            let pass = Pass {
                grad: None,
                dropout_seed: None,
                chunk_rows: self.loss_rows.max(1),
            };
            let reads = layered(llama, &mut rec, &ti, &targets, &mut self.lora, pass)?;
            rec.submit()?.settle(gpu).await?;
            let (m, c) = mean_of(gpu, &reads).await?;
            sum += m * c;
            count += c;
        }
        let loss = match count > 0.0 {
            true => (sum / count) as f32,
            false => f32::NAN,
        };
        match self.history.last_mut() {
            Some(last) if last.0 == self.step => last.2 = Some(loss),
            _ => self.history.push((self.step, f32::NAN, Some(loss))),
        }
        Ok(loss)
    }

    /// A checkpoint of this step (`out_dir/step-NNNNNNNN`, see `train::checkpoint`), the
    /// adapter as PEFT writes it to `out_dir/adapter` (replaced atomically), and the loss
    /// curve beside them. Returns the adapter's directory.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn save(&self) -> Result<PathBuf> {
        let gpu = self.gpu;
        let p = &self.lora.params;
        let named: Vec<(String, &Tensor)> = p.names.iter().cloned().zip(&p.values).collect();
        let model = checkpoint::safetensors_bytes(gpu, &named)?;
        let mut opt_named = Vec::new();
        for (n, (m, v)) in p.names.iter().zip(self.opt.state()) {
            opt_named.push((format!("m.{n}"), m));
            opt_named.push((format!("v.{n}"), v));
        }
        let optim = checkpoint::safetensors_bytes(gpu, &opt_named)?;
        let llama = &self.model.llama;
        let state = RunState {
            format: 1,
            config: FtRun {
                config: self.cfg.clone(),
                data_sha256: self.data_sha256.clone(),
                base_bytes: llama.weight_bytes,
                base_layers: llama.cfg.n_layer,
            },
            step: self.step,
            tokens_seen: self.tokens_seen,
            loss_scaler: crate::optim::LossScaler::fixed(),
            adamw_step: self.opt.steps(),
            hashes: Default::default(),
        };
        let files = CheckpointFiles {
            model,
            optim,
            tokenizer: None,
        };
        checkpoint::save(&self.cfg.out_dir, state, &files)?;
        let dir = self.cfg.out_dir.join("adapter");
        let base = self.cfg.base.display().to_string();
        let out = adapter::save(gpu, &self.lora, &llama.cfg, &base, &dir)?;
        let train: Vec<(u64, f32)> = self
            .history
            .iter()
            .filter(|h| h.1.is_finite())
            .map(|h| (h.0, h.1))
            .collect();
        let val: Vec<(u64, f32)> = self
            .history
            .iter()
            .filter_map(|h| h.2.map(|v| (h.0, v)))
            .collect();
        let svg = crate::train::curve::svg(&train, &val, "fine-tuning loss (learned tokens)");
        checkpoint::write_atomic(&self.cfg.out_dir.join("loss.svg"), svg.as_bytes())?;
        Ok(out)
    }

    /// metrics.jsonl opened for appending: a fresh run's starts empty, a resumed run's
    /// keeps the lines up to its checkpoint's step (later ones belong to steps redone).
    #[cfg(not(target_arch = "wasm32"))]
    fn open_metrics(&self) -> Result<std::fs::File> {
        let path = self.cfg.out_dir.join(METRICS);
        let kept: String = match self.resumed {
            true => std::fs::read_to_string(&path)
                .unwrap_or_default()
                .lines()
                .filter(|l| {
                    serde_json::from_str::<serde_json::Value>(l)
                        .ok()
                        .and_then(|v| v["step"].as_u64())
                        .is_some_and(|s| s <= self.step)
                })
                .map(|l| format!("{l}\n"))
                .collect(),
            false => String::new(),
        };
        checkpoint::write_atomic(&path, kept.as_bytes())?;
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|source| Error::Io {
                path: path.display().to_string(),
                source,
            })
    }

    /// Trains to the config's steps (or `stop`), evaluating and saving at their
    /// intervals and at the end; metrics.jsonl gets a line a step and an evaluation.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn run(
        &mut self,
        stop: u64,
        on_event: &mut dyn FnMut(FtEvent<'_>),
    ) -> Result<(f32, Option<f32>)> {
        use std::io::Write;
        let out = self.cfg.out_dir.clone();
        std::fs::create_dir_all(&out).map_err(|source| Error::Io {
            path: out.display().to_string(),
            source,
        })?;
        let mpath = out.join(METRICS);
        let mut metrics = self.open_metrics()?;
        let mut write = |v: serde_json::Value| -> Result<()> {
            writeln!(metrics, "{v}").map_err(|source| Error::Io {
                path: mpath.display().to_string(),
                source,
            })
        };
        let steps = self.cfg.train.steps.min(stop);
        on_event(FtEvent::Started {
            base_bytes: self.model.llama.weight_bytes,
            adapter_params: self.lora.params.numel(),
            train_samples: self.train.len(),
            eval_samples: self.eval.len(),
            truncated: self.truncated,
            steps,
        });
        let mut last = (f32::NAN, None);
        if !self.eval.is_empty() && !self.resumed {
            let v = self.evaluate()?;
            write(serde_json::json!({"step": self.step, "eval_loss": v}))?;
            on_event(FtEvent::Eval {
                step: self.step,
                eval_loss: v,
            });
        }
        while self.step < steps {
            let s = self.train_step()?;
            write(
                serde_json::json!({"step": s.step, "loss": s.loss, "lr": s.lr, "tokens": s.tokens}),
            )?;
            on_event(FtEvent::Step(&s));
            last.0 = s.loss;
            let at_end = self.step == steps;
            if !self.eval.is_empty() && (self.step % self.cfg.train.eval_interval == 0 || at_end) {
                let v = self.evaluate()?;
                write(serde_json::json!({"step": self.step, "eval_loss": v}))?;
                on_event(FtEvent::Eval {
                    step: self.step,
                    eval_loss: v,
                });
                last.1 = Some(v);
            }
            if self.step % self.cfg.train.save_interval == 0 || at_end {
                let dir = self.save()?;
                on_event(FtEvent::Saved {
                    step: self.step,
                    dir,
                });
            }
        }
        Ok(last)
    }
}
