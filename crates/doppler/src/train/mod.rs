//! Training runs: `doppler train --config FILE`. A run is a pure function of its config:
//! batches come from (seed, step, micro-batch), dropout masks from (seed, step), so a run
//! resumed from a checkpoint continues bit for bit.

pub mod bpe;
pub mod checkpoint;
pub mod config;
pub mod curve;
pub mod data;

use std::path::{Path, PathBuf};
use web_time::Instant;

use crate::autograd::Tape;
use crate::error::{Error, Result};
use crate::gpu::{Gpu, Recorder, Submission, Tensor, Trace, FLUSH_EVERY};
use crate::models::transformer::Transformer;
use crate::optim::{grad_scale, warmup_cosine, AdamW, LossScaler};
use checkpoint::{CheckpointFiles, RunState};
use config::TrainConfig;
use data::{batch, mix, Dataset, Tokenizer};

const METRICS: &str = "metrics.jsonl";
const CURVE: &str = "loss.svg";

/// One optimizer step, as the progress display shows it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StepInfo {
    /// Steps done (1 after the first).
    pub step: u64,
    pub steps: u64,
    pub loss: f32,
    pub lr: f64,
    pub tokens_per_s: f64,
    /// Global gradient norm before clipping (read only with dynamic loss scaling).
    pub grad_norm: Option<f32>,
    /// Overflowed under dynamic loss scaling: no update was applied.
    pub skipped: bool,
}

/// What a run's event handler asks for: go on, or end the run after this step (its
/// evaluation and checkpoint done, the model kept: the browser's Stop button).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
}

pub enum Event<'a> {
    Started {
        params: usize,
        vocab: usize,
        train_tokens: usize,
        val_tokens: usize,
        start_step: u64,
        steps: u64,
    },
    Step(&'a StepInfo),
    Eval {
        step: u64,
        val_loss: f32,
    },
    Checkpoint {
        step: u64,
        dir: &'a Path,
    },
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Summary {
    pub start_step: u64,
    pub steps: u64,
    /// Whether an event's [`Flow::Stop`] ended the run before its last step.
    pub stopped: bool,
    /// Validation loss before the first step of this process (None when resumed).
    pub first_val_loss: Option<f32>,
    pub final_val_loss: f32,
    pub final_train_loss: f32,
    pub tokens_per_s: f64,
    pub seconds: f64,
    pub checkpoint: PathBuf,
}

pub struct Trainer<'g> {
    gpu: &'g Gpu,
    pub cfg: TrainConfig,
    pub model: Transformer,
    pub tokenizer: Tokenizer,
    opt: AdamW,
    data: Dataset,
    scaler: LossScaler,
    pub step: u64,
    tokens_seen: u64,
    /// (step, loss, val_loss) so far, for metrics.jsonl and the curve.
    history: Vec<(u64, f32, Option<f32>)>,
    /// When set, training steps run with GPU timestamps and their dispatches land here.
    pub trace: Option<Trace>,
    /// Whether [`Trainer::run_async`] writes checkpoints, metrics and the curve to the
    /// config's out_dir (not in the browser, which has no files: see
    /// [`Trainer::model_safetensors`]).
    pub persist: bool,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.display().to_string(),
        source,
    }
}

impl<'g> Trainer<'g> {
    /// A fresh run, or (`resume`) the latest checkpoint in the config's out_dir.
    pub fn new(gpu: &'g Gpu, cfg: &TrainConfig, resume: bool) -> Result<Trainer<'g>> {
        let out = &cfg.train.out_dir;
        let has_ckpt = out.join("latest").is_file();
        let text = std::fs::read_to_string(&cfg.data.corpus).map_err(io(&cfg.data.corpus))?;
        // Errors about the text name the corpus.
        let corpus_err = |detail: String| Error::Config {
            path: cfg.data.corpus.display().to_string(),
            detail,
        };
        if text.trim().is_empty() {
            return Err(corpus_err(
                "the corpus is empty: training needs text".into(),
            ));
        }
        if resume && has_ckpt {
            let ck: checkpoint::Loaded = checkpoint::load(out)?;
            // The vocabulary size comes from the tokenizer, not the file.
            let mut asked = cfg.clone();
            asked.model.vocab_size = ck.state.config.model.vocab_size;
            let diff = ck.state.config.differences(&asked);
            if !diff.is_empty() {
                return Err(Error::Checkpoint {
                    path: ck.dir.display().to_string(),
                    detail: format!("was written by another config: {}", diff.join("; ")),
                });
            }
            let tokenizer = Tokenizer::from_json(ck.tokenizer()?)?;
            let mcfg = ck.state.config.model.clone();
            let model = Transformer::from_weights(gpu, &mcfg, ck.model.clone()).map_err(|e| {
                Error::Checkpoint {
                    path: ck.dir.display().to_string(),
                    detail: e.to_string(),
                }
            })?;
            let mut opt = Self::optimizer(gpu, cfg, &model)?;
            opt.restore(
                ck.state.adamw_step,
                ck.optim_state(gpu, &model.params.names)?,
            )?;
            let data = Dataset::new(
                tokenizer.encode(&text)?,
                cfg.data.val_fraction,
                mcfg.block_size,
            )?;
            let mut t = Trainer {
                gpu,
                cfg: ck.state.config.clone(),
                model,
                tokenizer,
                opt,
                data,
                scaler: ck.state.loss_scaler.clone(),
                step: ck.state.step,
                tokens_seen: ck.state.tokens_seen,
                history: Vec::new(),
                trace: None,
                persist: true,
            };
            t.cfg.train.out_dir = cfg.train.out_dir.clone();
            t.cfg.data.corpus = cfg.data.corpus.clone();
            t.history = read_history(&out.join(METRICS), t.step);
            return Ok(t);
        }
        if has_ckpt {
            return Err(Error::Checkpoint {
                path: out.display().to_string(),
                detail: "already holds checkpoints: pass --resume to continue, or choose another out_dir".into(),
            });
        }
        if resume {
            return Err(Error::Checkpoint {
                path: out.display().to_string(),
                detail: "holds no checkpoint to resume (no `latest` file): run without --resume to start".into(),
            });
        }
        let mut t = Self::fresh(gpu, cfg, &text).map_err(|e| match e {
            Error::Invalid {
                op: "dataset",
                detail,
            } => corpus_err(format!("too short for this config: {detail}")),
            e => e,
        })?;
        t.persist = true;
        Ok(t)
    }

    /// A fresh run over the corpus `text` (the config's corpus path is not read), writing
    /// nothing unless [`Trainer::persist`] is set.
    pub fn fresh(gpu: &'g Gpu, cfg: &TrainConfig, text: &str) -> Result<Trainer<'g>> {
        let tokenizer = Tokenizer::train(&cfg.data, text)?;
        let mut cfg = cfg.clone();
        cfg.model.vocab_size = tokenizer.vocab_size();
        let model = Transformer::new(gpu, &cfg.model, mix(&[cfg.train.seed, 0x1417]))?;
        let opt = Self::optimizer(gpu, &cfg, &model)?;
        let data = Dataset::new(
            tokenizer.encode(&text)?,
            cfg.data.val_fraction,
            cfg.model.block_size,
        )?;
        let scaler = cfg.loss_scaler().map_err(|d| Error::Config {
            path: "loss_scale".into(),
            detail: d,
        })?;
        if gpu.matmul == crate::gpu::MatmulMode::F16 && !scaler.dynamic && scaler.scale == 1.0 {
            tracing::warn!(
                "matrix products take f16 operands (DOPPLER_MATMUL=f16) but train.loss_scale is 1: gradients below 6e-8 flush to zero; set train.loss_scale = \"dynamic\""
            );
        }
        Ok(Trainer {
            gpu,
            cfg,
            model,
            tokenizer,
            opt,
            data,
            scaler,
            step: 0,
            tokens_seen: 0,
            history: Vec::new(),
            trace: None,
            persist: false,
        })
    }

    fn optimizer(gpu: &Gpu, cfg: &TrainConfig, model: &Transformer) -> Result<AdamW> {
        let params: Vec<&Tensor> = model.params.values.iter().collect();
        let mut opt = AdamW::new(gpu, &params, cfg.train.lr)?;
        opt.betas = cfg.train.betas;
        opt.weight_decay = cfg.train.weight_decay;
        opt.decay_mask = model.decayed();
        Ok(opt)
    }

    fn recorder(&self) -> Recorder<'g> {
        match self.trace {
            Some(_) => self.gpu.profiling_recorder("train.step"),
            None => {
                let mut rec = self.gpu.recorder("train.step");
                rec.set_flush_every(FLUSH_EVERY);
                rec
            }
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.tokenizer.vocab_size()
    }

    /// Blocking [`Trainer::train_step_async`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn train_step(&mut self) -> Result<StepInfo> {
        pollster::block_on(self.train_step_async())
    }

    /// Blocking [`Trainer::evaluate_async`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn evaluate(&mut self) -> Result<f32> {
        pollster::block_on(self.evaluate_async())
    }

    /// Blocking [`Trainer::run_async`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn run(&mut self, stop: u64, on_event: &mut dyn FnMut(Event<'_>)) -> Result<Summary> {
        pollster::block_on(self.run_async(stop, &mut |e| {
            on_event(e);
            Ok(Flow::Continue)
        }))
    }

    /// The training batch of micro-batch `micro` at step `step` (0 for the first step):
    /// (ids, targets), each (batch_size, block_size) row-major. A pure function of the
    /// config's seed, the step and the micro-batch, whichever process asks.
    pub fn batch(&self, step: u64, micro: usize) -> (Vec<u32>, Vec<u32>) {
        let key = mix(&[self.cfg.train.seed, step, micro as u64]);
        batch(
            &self.data.train,
            self.cfg.train.batch_size,
            self.cfg.model.block_size,
            key,
        )
    }

    /// The dropout seed of micro-batch `micro` at step `step` (the model derives each
    /// site's masks from it): like the batch, a pure function of the config's seed, the
    /// step and the micro-batch.
    pub fn dropout_seed(&self, step: u64, micro: usize) -> u64 {
        mix(&[mix(&[self.cfg.train.seed, step, micro as u64]), 1])
    }

    /// One optimizer step over `grad_accum` micro-batches.
    pub async fn train_step_async(&mut self) -> Result<StepInfo> {
        let t0 = Instant::now();
        let (gpu, tc) = (self.gpu, self.cfg.train.clone());
        let (b, t) = (tc.batch_size, self.cfg.model.block_size);
        let lr = warmup_cosine(self.step, tc.lr, tc.min_lr, tc.warmup, tc.steps);
        self.opt.lr = lr;
        let accum = tc.grad_accum;
        // Each micro-batch's loss is a mean: 1/accum makes the sum of gradients their mean.
        let seed_grad = self.scaler.scale / accum as f32;
        let mut losses = Vec::with_capacity(accum);
        let mut rec = self.recorder();
        for m in 0..accum {
            let (ids, targets) = self.batch(self.step, m);
            let drop_seed = self.dropout_seed(self.step, m);
            let ids = Tensor::from_u32(gpu, &[b, t], &ids, "ids")?;
            let targets = Tensor::from_u32(gpu, &[b, t], &targets, "targets")?;
            let mut tape = Tape::new();
            let loss = self
                .model
                .loss(&mut tape, &mut rec, &ids, &targets, Some(drop_seed))?;
            // Read back with the step's own submissions, not one more each.
            losses.push(rec.read_later(tape.value(loss)?)?);
            tape.backward(&mut rec, loss, seed_grad, &mut self.model.params)?;
            if m + 1 < accum {
                // Let the next micro-batch reuse this one's activation buffers.
                let next = self.recorder();
                finish(
                    gpu,
                    &mut self.trace,
                    std::mem::replace(&mut rec, next).submit()?,
                )
                .await?;
            }
        }
        let grads = self.model.params.all_grads("train")?;
        let grad_refs: Vec<&Tensor> = grads.iter().collect();
        let params: Vec<&Tensor> = self.model.params.values.iter().collect();
        let scale = grad_scale(&mut rec, &grad_refs, tc.grad_clip, self.scaler.scale)?;
        let (mut grad_norm, mut skipped) = (None, false);
        if self.scaler.dynamic {
            // Whether to step depends on the norm: one read before the update.
            finish(gpu, &mut self.trace, rec.submit()?).await?;
            let norm = scale.to_vec_f32(gpu).await?[0];
            grad_norm = Some(norm);
            skipped = !self.scaler.update(norm);
            rec = self.recorder();
        }
        if !skipped {
            self.opt.step(&mut rec, &params, &grad_refs, &scale)?;
        }
        finish(gpu, &mut self.trace, rec.submit()?).await?;
        self.model.params.zero_grad();
        let mut loss = 0.0f64;
        for l in &losses {
            loss += f32::from_bits(l.u32s(gpu).await?[0]) as f64;
        }
        let loss = (loss / accum as f64) as f32;
        self.step += 1;
        self.tokens_seen += (b * t * accum) as u64;
        self.history.push((self.step, loss, None));
        Ok(StepInfo {
            step: self.step,
            steps: tc.steps,
            loss,
            lr,
            tokens_per_s: (b * t * accum) as f64 / t0.elapsed().as_secs_f64(),
            grad_norm,
            skipped,
        })
    }

    /// The batches of the steps in `steps` (what each step trained on), with the loss,
    /// learning rate and skip flag of each, as SafeTensors bytes for a replay elsewhere
    /// (`bench/torch_parity.py`): `ids` and `targets` I32 (S, grad_accum, batch_size,
    /// block_size), `step` I64 (S, the step's index: 0 for the first), `loss` F32 (S),
    /// `lr` F64 (S), `skipped` U8 (S); metadata `matmul` (the products' mode).
    pub fn batches_safetensors(&self, steps: &[StepInfo]) -> Result<Vec<u8>> {
        let tc = &self.cfg.train;
        let (mut ids, mut targets) = (Vec::<u8>::new(), Vec::<u8>::new());
        let (mut index, mut loss, mut lr, mut skipped) = (vec![], vec![], vec![], vec![]);
        for s in steps {
            let step = s.step - 1;
            for m in 0..tc.grad_accum {
                let (i, t) = self.batch(step, m);
                ids.extend(i.iter().flat_map(|&v| (v as i32).to_le_bytes()));
                targets.extend(t.iter().flat_map(|&v| (v as i32).to_le_bytes()));
            }
            index.extend((step as i64).to_le_bytes());
            loss.extend(s.loss.to_le_bytes());
            lr.extend(s.lr.to_le_bytes());
            skipped.push(s.skipped as u8);
        }
        let n = steps.len();
        let shape = vec![n, tc.grad_accum, tc.batch_size, self.cfg.model.block_size];
        use safetensors::{tensor::TensorView, Dtype};
        let views = [
            ("ids", Dtype::I32, shape.clone(), &ids),
            ("targets", Dtype::I32, shape, &targets),
            ("step", Dtype::I64, vec![n], &index),
            ("loss", Dtype::F32, vec![n], &loss),
            ("lr", Dtype::F64, vec![n], &lr),
            ("skipped", Dtype::U8, vec![n], &skipped),
        ]
        .into_iter()
        .map(|(name, dt, shape, bytes)| TensorView::new(dt, shape, bytes).map(|v| (name, v)))
        .collect::<std::result::Result<Vec<_>, _>>();
        let meta = std::collections::HashMap::from([(
            "matmul".to_string(),
            format!("{:?}", self.gpu.matmul).to_lowercase(),
        )]);
        views
            .and_then(|v| safetensors::serialize(v, Some(meta)))
            .map_err(|e| Error::Invalid {
                op: "batches",
                detail: e.to_string(),
            })
    }

    /// Mean loss over the fixed validation batches (no gradients recorded).
    pub async fn evaluate_async(&mut self) -> Result<f32> {
        let (b, t) = (self.cfg.train.batch_size, self.cfg.model.block_size);
        let mut total = 0.0f64;
        let n = self.cfg.train.eval_batches;
        for i in 0..n {
            let (ids, targets) = batch(
                &self.data.val,
                b,
                t,
                mix(&[self.cfg.train.seed, u64::MAX, i as u64]),
            );
            let ids = Tensor::from_u32(self.gpu, &[b, t], &ids, "ids")?;
            let targets = Tensor::from_u32(self.gpu, &[b, t], &targets, "targets")?;
            let mut tape = Tape::new();
            tape.set_grad_enabled(false);
            let model = &self.model;
            let loss = self
                .gpu
                .run_async(|rec| {
                    let l = model.loss(&mut tape, rec, &ids, &targets, None)?;
                    Ok(tape.value(l)?.clone())
                })
                .await?;
            total += loss.to_vec_f32(self.gpu).await?[0] as f64;
        }
        let v = (total / n as f64) as f32;
        match self.history.last_mut() {
            Some(last) if last.0 == self.step => last.2 = Some(v),
            _ => self.history.push((self.step, f32::NAN, Some(v))),
        }
        Ok(v)
    }

    /// The model's weights as SafeTensors bytes, under the names checkpoints use.
    pub async fn model_safetensors(&self) -> Result<Vec<u8>> {
        let p = &self.model.params;
        let named: Vec<(String, &Tensor)> = p.names.iter().cloned().zip(p.values.iter()).collect();
        checkpoint::safetensors_bytes_async(self.gpu, &named).await
    }

    /// Blocking [`Trainer::save_async`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn save(&self) -> Result<PathBuf> {
        pollster::block_on(self.save_async())
    }

    /// Writes a checkpoint of the current step, the metrics and the loss curve.
    pub async fn save_async(&self) -> Result<PathBuf> {
        let gpu = self.gpu;
        let p = &self.model.params;
        let model = self.model_safetensors().await?;
        let mut opt_named = Vec::new();
        for (n, (m, v)) in p.names.iter().zip(self.opt.state()) {
            opt_named.push((format!("m.{n}"), m));
            opt_named.push((format!("v.{n}"), v));
        }
        let optim = checkpoint::safetensors_bytes_async(gpu, &opt_named).await?;
        let state = RunState {
            format: 1,
            config: self.cfg.clone(),
            step: self.step,
            tokens_seen: self.tokens_seen,
            loss_scaler: self.scaler.clone(),
            adamw_step: self.opt.steps(),
            hashes: Default::default(),
        };
        let out = &self.cfg.train.out_dir;
        std::fs::create_dir_all(out).map_err(io(out))?;
        // The metrics first: a process that dies between the two leaves rows past the
        // newest checkpoint (a resume drops them), never a checkpoint whose interval's
        // rows were not written (a resume would lose them for good).
        self.write_metrics()?;
        checkpoint::save(
            out,
            state,
            &CheckpointFiles {
                model,
                optim,
                tokenizer: Some(self.tokenizer.to_json()?),
            },
        )
    }

    fn write_metrics(&self) -> Result<()> {
        let out = &self.cfg.train.out_dir;
        let mut lines = String::new();
        for &(step, loss, val) in &self.history {
            let v = serde_json::json!({ "step": step, "loss": if loss.is_finite() { Some(loss) } else { None }, "val_loss": val });
            lines += &format!("{v}\n");
        }
        checkpoint::write_atomic(&out.join(METRICS), lines.as_bytes())?;
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
        let title = format!(
            "{:?} {}L {}d, {} params",
            self.cfg.model.arch,
            self.cfg.model.n_layer,
            self.cfg.model.n_embd,
            self.model.params.numel()
        );
        checkpoint::write_atomic(
            &out.join(CURVE),
            curve::svg(&train, &val, &title).as_bytes(),
        )
    }

    /// Trains until step `stop` (at most the configured step count; the schedule always
    /// spans the configured count), evaluating and checkpointing on the way and at `stop`.
    /// Checkpoints are written only when [`Trainer::persist`] is set.
    pub async fn run_async(
        &mut self,
        stop: u64,
        on_event: &mut dyn FnMut(Event<'_>) -> Result<Flow>,
    ) -> Result<Summary> {
        let mut stop = stop.min(self.cfg.train.steps);
        let t0 = Instant::now();
        let start_step = self.step;
        let tc = self.cfg.train.clone();
        let mut stopped = false;
        // A Flow::Stop ends the run after the step it came from (its checkpoint saved).
        let mut flow = |f: Flow, stop: &mut u64, step: u64| {
            if f == Flow::Stop && !stopped && step < *stop {
                stopped = true;
                *stop = step;
            }
        };
        let f = on_event(Event::Started {
            params: self.model.params.numel(),
            vocab: self.vocab_size(),
            train_tokens: self.data.train.len(),
            val_tokens: self.data.val.len(),
            start_step,
            steps: tc.steps,
        })?;
        flow(f, &mut stop, start_step);
        let mut first_val_loss = None;
        if start_step == 0 {
            let v = self.evaluate_async().await?;
            first_val_loss = Some(v);
            let f = on_event(Event::Eval {
                step: 0,
                val_loss: v,
            })?;
            flow(f, &mut stop, start_step);
        }
        let mut final_train_loss = f32::NAN;
        let mut final_val_loss = self
            .history
            .iter()
            .rev()
            .find_map(|h| h.2)
            .unwrap_or(f32::NAN);
        let mut checkpoint = PathBuf::new();
        while self.step < stop {
            let info = self.train_step_async().await?;
            final_train_loss = info.loss;
            if !info.loss.is_finite() && !self.scaler.dynamic {
                return Err(Error::Invalid {
                    op: "train",
                    detail: format!("loss became {} at step {}", info.loss, info.step),
                });
            }
            let f = on_event(Event::Step(&info))?;
            flow(f, &mut stop, self.step);
            if self.step % tc.eval_interval == 0 || self.step == stop {
                final_val_loss = self.evaluate_async().await?;
                let f = on_event(Event::Eval {
                    step: self.step,
                    val_loss: final_val_loss,
                })?;
                flow(f, &mut stop, self.step);
            }
            if self.persist && (self.step % tc.checkpoint_interval == 0 || self.step == stop) {
                checkpoint = self.save_async().await?;
                let f = on_event(Event::Checkpoint {
                    step: self.step,
                    dir: &checkpoint,
                })?;
                flow(f, &mut stop, self.step);
            }
        }
        let seconds = t0.elapsed().as_secs_f64();
        let tokens = (self.step - start_step) as f64
            * (tc.batch_size * self.cfg.model.block_size * tc.grad_accum) as f64;
        if self.persist && checkpoint.as_os_str().is_empty() {
            checkpoint = checkpoint::resolve(&tc.out_dir)?;
        }
        Ok(Summary {
            start_step,
            steps: self.step,
            stopped,
            first_val_loss,
            final_val_loss,
            final_train_loss,
            tokens_per_s: tokens / seconds,
            seconds,
            checkpoint,
        })
    }
}

/// Waits for a submission (surfacing GPU-side input errors) and keeps its timings.
async fn finish(gpu: &Gpu, trace: &mut Option<Trace>, sub: Submission) -> Result<()> {
    let t = sub.settle(gpu).await?;
    if let Some(trace) = trace {
        trace.extend(t);
    }
    Ok(())
}

/// Metrics of steps up to `upto` from an earlier run of this directory.
fn read_history(path: &Path, upto: u64) -> Vec<(u64, f32, Option<f32>)> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| {
            let step = v["step"].as_u64()?;
            let loss = v["loss"].as_f64().map_or(f32::NAN, |x| x as f32);
            (step <= upto).then_some((step, loss, v["val_loss"].as_f64().map(|x| x as f32)))
        })
        .collect()
}

/// A model and tokenizer loaded from a checkpoint (a run directory or a step directory).
pub fn load_for_generation(gpu: &Gpu, path: &Path) -> Result<(Transformer, Tokenizer)> {
    let ck: checkpoint::Loaded = checkpoint::load(path)?;
    let tokenizer = Tokenizer::from_json(ck.tokenizer()?)?;
    let model = Transformer::from_weights(gpu, &ck.state.config.model, ck.model).map_err(|e| {
        Error::Checkpoint {
            path: ck.dir.display().to_string(),
            detail: e.to_string(),
        }
    })?;
    Ok((model, tokenizer))
}

/// Blocking [`generate_async`].
#[cfg(not(target_arch = "wasm32"))]
pub fn generate(
    gpu: &Gpu,
    model: &Transformer,
    tokenizer: &Tokenizer,
    prompt: &str,
    max_new: usize,
    sampler: &mut crate::infer::sample::Sampler,
    on_text: &mut dyn FnMut(&str),
) -> Result<String> {
    pollster::block_on(generate_async(
        gpu, model, tokenizer, prompt, max_new, sampler, on_text,
    ))
}

/// Continues `prompt` by `max_new` tokens, calling `on_text` with each new piece of text.
/// Recomputes the whole window each token (the training model has no KV cache).
pub async fn generate_async(
    gpu: &Gpu,
    model: &Transformer,
    tokenizer: &Tokenizer,
    prompt: &str,
    max_new: usize,
    sampler: &mut crate::infer::sample::Sampler,
    on_text: &mut dyn FnMut(&str),
) -> Result<String> {
    let mut ids = tokenizer.encode(prompt)?;
    if ids.is_empty() {
        ids = tokenizer
            .encode("\n")
            .or_else(|_| tokenizer.encode(" "))
            .unwrap_or_default();
        if ids.is_empty() {
            ids.push(0);
        }
    }
    let start = ids.len();
    let (v, block) = (model.cfg.vocab_size, model.cfg.block_size);
    let mut shown = tokenizer.decode(&ids)?;
    for _ in 0..max_new {
        let window = &ids[ids.len().saturating_sub(block)..];
        let t = window.len();
        let x = Tensor::from_u32(gpu, &[1, t], window, "ids")?;
        let mut tape = Tape::new();
        tape.set_grad_enabled(false);
        let logits = gpu
            .run_async(|rec| {
                let l = model.logits(&mut tape, rec, &x, None)?;
                Ok(tape.value(l)?.clone())
            })
            .await?;
        let all = logits.to_vec_f32(gpu).await?;
        let next = sampler.sample(&all[(t - 1) * v..t * v], &ids);
        ids.push(next);
        let text = tokenizer.decode(&ids)?;
        // Emit only whole characters: BPE pieces can end inside a UTF-8 sequence.
        if text.len() > shown.len() && text.starts_with(&shown) && !text.ends_with('\u{FFFD}') {
            on_text(&text[shown.len()..]);
            shown = text;
        }
    }
    tokenizer.decode(&ids[start..])
}
