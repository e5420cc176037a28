//! Training runs: `doppler train --config FILE`. A run is a pure function of its config:
//! batches come from (seed, step, micro-batch), dropout masks from (seed, step), so a run
//! resumed from a checkpoint continues bit for bit.

pub mod bpe;
pub mod checkpoint;
pub mod config;
pub mod curve;
pub mod data;
pub mod images;

use std::path::{Path, PathBuf};
use web_time::Instant;

use crate::autograd::{ParamStore, Tape};
use crate::error::{Error, Result};
use crate::gpu::{Gpu, Recorder, Submission, Tensor, Trace, FLUSH_EVERY};
use crate::models::convnet::{ConvArch, ConvNet, DiffusionBatch, Schedule};
use crate::models::transformer::Transformer;
use crate::optim::{grad_scale, warmup_cosine, AdamW, LossScaler};
use checkpoint::{CheckpointFiles, RunState};
use config::{DataSpec, NetConfig, TrainConfig};
use data::{batch, mix, Dataset, Tokenizer};
use images::ImageSet;

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
    /// Tokens (text) or images (conv nets) a second.
    pub items_per_s: f64,
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
        /// Vocabulary size (text) or class count (images).
        outputs: usize,
        /// Training and held-out items: tokens or images.
        train_items: usize,
        val_items: usize,
        /// "tokens" or "images".
        unit: &'static str,
        start_step: u64,
        steps: u64,
    },
    Step(&'a StepInfo),
    Eval {
        step: u64,
        val_loss: f32,
        /// Held-out accuracy (classifiers).
        val_accuracy: Option<f32>,
    },
    Checkpoint {
        step: u64,
        dir: &'a Path,
    },
}

/// A held-out evaluation.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Eval {
    pub loss: f32,
    /// The fraction of held-out images classified right (classifiers).
    pub accuracy: Option<f32>,
}

/// The first index of the largest value.
fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
            if v > best.1 {
                (i, v)
            } else {
                best
            }
        })
        .0
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
    /// The last held-out accuracy (classifiers).
    pub final_val_accuracy: Option<f32>,
    pub final_train_loss: f32,
    /// Tokens (text) or images (conv nets) a second.
    pub items_per_s: f64,
    pub seconds: f64,
    pub checkpoint: PathBuf,
}

/// What a run trains, and on what.
pub enum Task {
    Text {
        model: Transformer,
        tokenizer: Tokenizer,
        data: Dataset,
    },
    Images {
        model: ConvNet,
        data: ImageSet,
    },
}

impl Task {
    pub fn params(&self) -> &ParamStore {
        match self {
            Task::Text { model, .. } => &model.params,
            Task::Images { model, .. } => &model.params,
        }
    }

    fn params_mut(&mut self) -> &mut ParamStore {
        match self {
            Task::Text { model, .. } => &mut model.params,
            Task::Images { model, .. } => &mut model.params,
        }
    }

    fn decayed(&self) -> Vec<bool> {
        match self {
            Task::Text { model, .. } => model.decayed(),
            Task::Images { model, .. } => model.decayed(),
        }
    }
}

/// One row of metrics.jsonl: a step's training loss and, where it was evaluated, the
/// held-out loss and accuracy.
#[derive(Clone, Copy, Debug)]
struct Record {
    step: u64,
    loss: f32,
    val_loss: Option<f32>,
    val_accuracy: Option<f32>,
}

pub struct Trainer<'g> {
    gpu: &'g Gpu,
    pub cfg: TrainConfig,
    pub task: Task,
    opt: AdamW,
    scaler: LossScaler,
    pub step: u64,
    /// Tokens or images consumed so far.
    items_seen: u64,
    /// Records so far, for metrics.jsonl and the curve.
    history: Vec<Record>,
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
        if has_ckpt && !resume {
            return Err(Error::Checkpoint {
                path: out.display().to_string(),
                detail: "already holds checkpoints: pass --resume to continue, or choose another out_dir".into(),
            });
        }
        if resume && !has_ckpt {
            return Err(Error::Checkpoint {
                path: out.display().to_string(),
                detail: "holds no checkpoint to resume (no `latest` file): run without --resume to start".into(),
            });
        }
        let data_path = cfg.data_path();
        // Errors about the data name its file.
        let data_err = |detail: String| Error::Config {
            path: data_path.display().to_string(),
            detail,
        };
        let text = std::fs::read_to_string(data_path).map_err(io(data_path))?;
        if text.trim().is_empty() {
            return Err(data_err(format!(
                "the {} is empty: training needs data",
                match cfg.data {
                    DataSpec::Text(_) => "corpus",
                    DataSpec::Images(_) => "images file",
                }
            )));
        }
        if !has_ckpt {
            let mut t = Self::fresh(gpu, cfg, &text).map_err(|e| match e {
                Error::Invalid {
                    op: "dataset",
                    detail,
                } => data_err(format!("too short for this config: {detail}")),
                e => e,
            })?;
            t.persist = true;
            return Ok(t);
        }
        let ck: checkpoint::Loaded = checkpoint::load(out)?;
        let ck_err = |e: Error| Error::Checkpoint {
            path: ck.dir.display().to_string(),
            detail: e.to_string(),
        };
        // A text model's vocabulary size comes from the tokenizer, not the file.
        let mut asked = cfg.clone();
        if let (NetConfig::Transformer(a), NetConfig::Transformer(c)) =
            (&mut asked.model, &ck.state.config.model)
        {
            a.vocab_size = c.vocab_size;
        }
        let diff = ck.state.config.differences(&asked);
        if !diff.is_empty() {
            return Err(Error::Checkpoint {
                path: ck.dir.display().to_string(),
                detail: format!("was written by another config: {}", diff.join("; ")),
            });
        }
        let mut saved = ck.state.config.clone();
        saved.train.out_dir = cfg.train.out_dir.clone();
        match (&mut saved.data, &cfg.data) {
            (DataSpec::Text(s), DataSpec::Text(c)) => s.corpus = c.corpus.clone(),
            (DataSpec::Images(s), DataSpec::Images(c)) => s.images = c.images.clone(),
            _ => {}
        }
        let task = match &saved.model {
            NetConfig::Transformer(mcfg) => {
                let tokenizer = Tokenizer::from_json(ck.tokenizer()?)?;
                let model =
                    Transformer::from_weights(gpu, mcfg, ck.model.clone()).map_err(ck_err)?;
                let DataSpec::Text(d) = &saved.data else {
                    return Err(Error::Checkpoint {
                        path: ck.dir.display().to_string(),
                        detail: "state.json pairs a transformer with image data".into(),
                    });
                };
                let data = Dataset::new(tokenizer.encode(&text)?, d.val_fraction, mcfg.block_size)?;
                Task::Text {
                    model,
                    tokenizer,
                    data,
                }
            }
            NetConfig::Conv(_) => Self::conv_task(gpu, &saved, &text, Some(ck.model.clone()))?,
        };
        let mut opt = Self::optimizer(gpu, cfg, &task)?;
        opt.restore(
            ck.state.adamw_step,
            ck.optim_state(gpu, &task.params().names)?,
        )?;
        let mut t = Trainer {
            gpu,
            cfg: saved,
            task,
            opt,
            scaler: ck.state.loss_scaler.clone(),
            step: ck.state.step,
            items_seen: ck.state.tokens_seen,
            history: Vec::new(),
            trace: None,
            persist: true,
        };
        t.history = read_history(&out.join(METRICS), t.step);
        Ok(t)
    }

    /// A conv net's task: its images parsed from `csv`, its weights `weights` or fresh
    /// from the seed.
    fn conv_task(
        gpu: &Gpu,
        cfg: &TrainConfig,
        csv: &str,
        weights: Option<Vec<(String, Vec<usize>, Vec<f32>)>>,
    ) -> Result<Task> {
        let (NetConfig::Conv(m), DataSpec::Images(d)) = (&cfg.model, &cfg.data) else {
            return Err(Error::Invalid {
                op: "train",
                detail: "a conv net trains on images".into(),
            });
        };
        let data = ImageSet::parse(csv, &d.images, d, m.image_shape(), m.classes)?;
        let model = match weights {
            Some(w) => ConvNet::from_weights(gpu, m, w).map_err(|e| Error::Checkpoint {
                path: cfg.train.out_dir.display().to_string(),
                detail: e.to_string(),
            })?,
            None => ConvNet::new(gpu, m, mix(&[cfg.train.seed, 0x1417]))?,
        };
        Ok(Task::Images { model, data })
    }

    /// A fresh run on the data `text` (a text run's corpus, an image run's CSV; the
    /// config's data path is not read), writing nothing unless [`Trainer::persist`] is
    /// set.
    pub fn fresh(gpu: &'g Gpu, cfg: &TrainConfig, text: &str) -> Result<Trainer<'g>> {
        let mut cfg = cfg.clone();
        let task = match (&mut cfg.model, &cfg.data) {
            (NetConfig::Transformer(m), DataSpec::Text(d)) => {
                let tokenizer = Tokenizer::train(d, text)?;
                m.vocab_size = tokenizer.vocab_size();
                let model = Transformer::new(gpu, m, mix(&[cfg.train.seed, 0x1417]))?;
                let data = Dataset::new(tokenizer.encode(text)?, d.val_fraction, m.block_size)?;
                Task::Text {
                    model,
                    tokenizer,
                    data,
                }
            }
            _ => Self::conv_task(gpu, &cfg, text, None)?,
        };
        let opt = Self::optimizer(gpu, &cfg, &task)?;
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
            task,
            opt,
            scaler,
            step: 0,
            items_seen: 0,
            history: Vec::new(),
            trace: None,
            persist: false,
        })
    }

    fn optimizer(gpu: &Gpu, cfg: &TrainConfig, task: &Task) -> Result<AdamW> {
        let params: Vec<&Tensor> = task.params().values.iter().collect();
        let mut opt = AdamW::new(gpu, &params, cfg.train.lr)?;
        opt.betas = cfg.train.betas;
        opt.weight_decay = cfg.train.weight_decay;
        opt.decay_mask = task.decayed();
        Ok(opt)
    }

    /// The model's parameters.
    pub fn params(&self) -> &ParamStore {
        self.task.params()
    }

    /// The transformer and its tokenizer, for a text run.
    pub fn text_model(&self) -> Option<(&Transformer, &Tokenizer)> {
        match &self.task {
            Task::Text {
                model, tokenizer, ..
            } => Some((model, tokenizer)),
            Task::Images { .. } => None,
        }
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

    /// Vocabulary size (text) or class count (images).
    pub fn outputs(&self) -> usize {
        match &self.task {
            Task::Text { tokenizer, .. } => tokenizer.vocab_size(),
            Task::Images { data, .. } => data.classes,
        }
    }

    /// Blocking [`Trainer::train_step_async`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn train_step(&mut self) -> Result<StepInfo> {
        pollster::block_on(self.train_step_async())
    }

    /// Blocking [`Trainer::evaluate_async`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn evaluate(&mut self) -> Result<Eval> {
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

    /// The training batch of micro-batch `micro` at step `step` (0 for the first step) of
    /// a text run: (ids, targets), each (batch_size, block_size) row-major. A pure
    /// function of the config's seed, the step and the micro-batch, whichever process asks.
    pub fn batch(&self, step: u64, micro: usize) -> Result<(Vec<u32>, Vec<u32>)> {
        let (Task::Text { data, .. }, Some(m)) = (&self.task, self.cfg.transformer()) else {
            return Err(self.not_text("batch"));
        };
        let key = mix(&[self.cfg.train.seed, step, micro as u64]);
        Ok(batch(
            &data.train,
            self.cfg.train.batch_size,
            m.block_size,
            key,
        ))
    }

    /// The images of micro-batch `micro` at step `step` of an image run: (pixels
    /// (batch_size, C, H, W), labels (batch_size)), epochs of seeded permutations walked
    /// in order (a pure function of the config's seed, the step and the micro-batch).
    pub fn image_batch(&self, step: u64, micro: usize) -> Result<(Vec<f32>, Vec<u32>)> {
        let Task::Images { data, .. } = &self.task else {
            return Err(Error::Invalid {
                op: "image_batch",
                detail: "this run trains on text".into(),
            });
        };
        let tc = &self.cfg.train;
        let index = step * tc.grad_accum as u64 + micro as u64;
        Ok(images::batch(
            &data.train,
            data.pixels(),
            tc.batch_size,
            mix(&[tc.seed, 0x1a6e5]),
            index,
        ))
    }

    /// A U-Net run's DDPM batch of micro-batch `micro` at step `step`: the images of
    /// [`Trainer::image_batch`] noised at steps and with noise drawn from (the config's
    /// seed, the step, the micro-batch).
    pub fn diffusion_batch(&self, step: u64, micro: usize) -> Result<DiffusionBatch> {
        let (model, data) = match &self.task {
            Task::Images { model, data } if model.cfg.arch == ConvArch::Unet => (model, data),
            _ => {
                return Err(Error::Invalid {
                    op: "diffusion_batch",
                    detail: "this run does not train a U-Net".into(),
                })
            }
        };
        let (x0, classes) = self.image_batch(step, micro)?;
        let key = mix(&[self.cfg.train.seed, step, micro as u64, 0xd1ff]);
        Ok(DiffusionBatch::new(
            &Schedule::new(model.cfg.steps()),
            &x0,
            classes,
            data.pixels(),
            key,
        ))
    }

    fn not_text(&self, op: &'static str) -> Error {
        Error::Invalid {
            op,
            detail: "this run trains a conv net on images, not a transformer on text".into(),
        }
    }

    /// The dropout seed of micro-batch `micro` at step `step` (the model derives each
    /// site's masks from it): like the batch, a pure function of the config's seed, the
    /// step and the micro-batch.
    pub fn dropout_seed(&self, step: u64, micro: usize) -> u64 {
        mix(&[mix(&[self.cfg.train.seed, step, micro as u64]), 1])
    }

    /// The loss of micro-batch `m` of the current step, recorded on `tape`.
    fn micro_loss(
        &self,
        tape: &mut Tape,
        rec: &mut Recorder<'_>,
        m: usize,
    ) -> Result<crate::autograd::Var> {
        let (gpu, b) = (self.gpu, self.cfg.train.batch_size);
        match &self.task {
            Task::Text { model, .. } => {
                let (ids, targets) = self.batch(self.step, m)?;
                let t = model.cfg.block_size;
                let drop_seed = self.dropout_seed(self.step, m);
                let ids = Tensor::from_u32(gpu, &[b, t], &ids, "ids")?;
                let targets = Tensor::from_u32(gpu, &[b, t], &targets, "targets")?;
                model.loss(tape, rec, &ids, &targets, Some(drop_seed))
            }
            Task::Images { model, data } if model.cfg.arch == ConvArch::Unet => {
                let batch = self.diffusion_batch(self.step, m)?;
                model.diffusion_loss(tape, rec, &batch.upload(gpu, data.shape)?)
            }
            Task::Images { model, data } => {
                let (pixels, labels) = self.image_batch(self.step, m)?;
                let [c, h, w] = data.shape;
                let x = Tensor::from_f32(gpu, &[b, c, h, w], &pixels, "images")?;
                let y = Tensor::from_u32(gpu, &[b], &labels, "labels")?;
                model.loss(tape, rec, &x, &y)
            }
        }
    }

    /// One optimizer step over `grad_accum` micro-batches.
    pub async fn train_step_async(&mut self) -> Result<StepInfo> {
        let t0 = Instant::now();
        let (gpu, tc) = (self.gpu, self.cfg.train.clone());
        let items = self.cfg.items_per_batch();
        let lr = warmup_cosine(self.step, tc.lr, tc.min_lr, tc.warmup, tc.steps);
        self.opt.lr = lr;
        let accum = tc.grad_accum;
        // Each micro-batch's loss is a mean: 1/accum makes the sum of gradients their mean.
        let seed_grad = self.scaler.scale / accum as f32;
        let mut losses = Vec::with_capacity(accum);
        let mut rec = self.recorder();
        for m in 0..accum {
            let mut tape = Tape::new();
            let loss = self.micro_loss(&mut tape, &mut rec, m)?;
            // Read back with the step's own submissions, not one more each.
            losses.push(rec.read_later(tape.value(loss)?)?);
            tape.backward(&mut rec, loss, seed_grad, self.task.params_mut())?;
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
        let grads = self.task.params().all_grads("train")?;
        let grad_refs: Vec<&Tensor> = grads.iter().collect();
        let params: Vec<&Tensor> = self.task.params().values.iter().collect();
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
        self.task.params_mut().zero_grad();
        let mut loss = 0.0f64;
        for l in &losses {
            loss += f32::from_bits(l.u32s(gpu).await?[0]) as f64;
        }
        let loss = (loss / accum as f64) as f32;
        self.step += 1;
        self.items_seen += (items * accum) as u64;
        self.history.push(Record {
            step: self.step,
            loss,
            val_loss: None,
            val_accuracy: None,
        });
        Ok(StepInfo {
            step: self.step,
            steps: tc.steps,
            loss,
            lr,
            items_per_s: (items * accum) as f64 / t0.elapsed().as_secs_f64(),
            grad_norm,
            skipped,
        })
    }

    /// The batches of the steps in `steps` (what each step trained on), with the loss,
    /// learning rate and skip flag of each, as SafeTensors bytes for a replay elsewhere
    /// (`bench/torch_parity.py`, `bench/torch_convnet.py`): a text run's `ids` and
    /// `targets` I32 (S, grad_accum, batch_size, block_size), an image run's `images` F32
    /// (S, grad_accum, batch_size, C, H, W) and `labels` I32 (S, grad_accum, batch_size)
    /// (a U-Net's: the noisy images and their classes, with `timesteps` I32 like labels
    /// and `noise` F32 like images);
    /// `step` I64 (S, the step's index: 0 for the first), `loss` F32 (S), `lr` F64 (S),
    /// `skipped` U8 (S); metadata `matmul` (the products' mode).
    pub fn batches_safetensors(&self, steps: &[StepInfo]) -> Result<Vec<u8>> {
        let tc = &self.cfg.train;
        let (mut a, mut b) = (Vec::<u8>::new(), Vec::<u8>::new());
        // A U-Net's steps t and noise.
        let mut extra = (Vec::<u8>::new(), Vec::<u8>::new());
        let (mut index, mut loss, mut lr, mut skipped) = (vec![], vec![], vec![], vec![]);
        let i32s = |v: &[u32]| {
            v.iter()
                .flat_map(|&v| (v as i32).to_le_bytes())
                .collect::<Vec<u8>>()
        };
        for s in steps {
            let step = s.step - 1;
            for m in 0..tc.grad_accum {
                match &self.task {
                    Task::Text { .. } => {
                        let (i, t) = self.batch(step, m)?;
                        a.extend(i32s(&i));
                        b.extend(i32s(&t));
                    }
                    Task::Images { model, .. } if model.cfg.arch == ConvArch::Unet => {
                        let d = self.diffusion_batch(step, m)?;
                        a.extend(d.noisy.iter().flat_map(|v| v.to_le_bytes()));
                        b.extend(i32s(&d.classes));
                        extra.0.extend(i32s(&d.t));
                        extra.1.extend(d.noise.iter().flat_map(|v| v.to_le_bytes()));
                    }
                    Task::Images { .. } => {
                        let (p, l) = self.image_batch(step, m)?;
                        a.extend(p.iter().flat_map(|v| v.to_le_bytes()));
                        b.extend(i32s(&l));
                    }
                }
            }
            index.extend((step as i64).to_le_bytes());
            loss.extend(s.loss.to_le_bytes());
            lr.extend(s.lr.to_le_bytes());
            skipped.push(s.skipped as u8);
        }
        let n = steps.len();
        let lead = vec![n, tc.grad_accum, tc.batch_size];
        use safetensors::{tensor::TensorView, Dtype};
        let (first, second) = match &self.task {
            Task::Text { model, .. } => {
                let shape = [lead.clone(), vec![model.cfg.block_size]].concat();
                (
                    ("ids", Dtype::I32, shape.clone()),
                    ("targets", Dtype::I32, shape),
                )
            }
            Task::Images { data, .. } => (
                (
                    "images",
                    Dtype::F32,
                    [lead.clone(), data.shape.to_vec()].concat(),
                ),
                ("labels", Dtype::I32, lead),
            ),
        };
        let mut views = vec![
            (first.0, first.1, first.2.clone(), &a),
            (second.0, second.1, second.2.clone(), &b),
            ("step", Dtype::I64, vec![n], &index),
            ("loss", Dtype::F32, vec![n], &loss),
            ("lr", Dtype::F64, vec![n], &lr),
            ("skipped", Dtype::U8, vec![n], &skipped),
        ];
        if !extra.0.is_empty() {
            views.push(("timesteps", Dtype::I32, second.2, &extra.0));
            views.push(("noise", Dtype::F32, first.2, &extra.1));
        }
        let views = views
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

    /// The held-out loss (no gradients recorded): a text run's mean over the fixed
    /// validation batches; an image run's over every held-out image, with its accuracy.
    pub async fn evaluate_async(&mut self) -> Result<Eval> {
        let (gpu, b) = (self.gpu, self.cfg.train.batch_size);
        let eval = match &self.task {
            Task::Text { model, data, .. } => {
                let t = model.cfg.block_size;
                let mut total = 0.0f64;
                let n = self.cfg.train.eval_batches;
                for i in 0..n {
                    let key = mix(&[self.cfg.train.seed, u64::MAX, i as u64]);
                    let (ids, targets) = batch(&data.val, b, t, key);
                    let ids = Tensor::from_u32(gpu, &[b, t], &ids, "ids")?;
                    let targets = Tensor::from_u32(gpu, &[b, t], &targets, "targets")?;
                    let mut tape = Tape::new();
                    tape.set_grad_enabled(false);
                    let loss = gpu
                        .run_async(|rec| {
                            let l = model.loss(&mut tape, rec, &ids, &targets, None)?;
                            Ok(tape.value(l)?.clone())
                        })
                        .await?;
                    total += loss.to_vec_f32(gpu).await?[0] as f64;
                }
                Eval {
                    loss: (total / n as f64) as f32,
                    accuracy: None,
                }
            }
            Task::Images { model, data } if model.cfg.arch == ConvArch::Unet => {
                // Held-out images noised at steps and with noise fixed by the seed.
                let sched = Schedule::new(model.cfg.steps());
                let (px, val) = (data.pixels(), &data.val);
                let mut total = 0.0f64;
                for (i, start) in (0..val.len()).step_by(b).enumerate() {
                    let n = b.min(val.len() - start);
                    let x0 = &val.pixels[start * px..(start + n) * px];
                    let classes = val.labels[start..start + n].to_vec();
                    let key = mix(&[self.cfg.train.seed, u64::MAX, i as u64, 0xd1ff]);
                    let batch = DiffusionBatch::new(&sched, x0, classes, px, key);
                    let batch = batch.upload(gpu, data.shape)?;
                    let mut tape = Tape::new();
                    tape.set_grad_enabled(false);
                    let loss = gpu
                        .run_async(|rec| {
                            let l = model.diffusion_loss(&mut tape, rec, &batch)?;
                            Ok(tape.value(l)?.clone())
                        })
                        .await?;
                    total += loss.to_vec_f32(gpu).await?[0] as f64 * n as f64;
                }
                Eval {
                    loss: (total / val.len() as f64) as f32,
                    accuracy: None,
                }
            }
            Task::Images { model, data } => {
                let (px, k) = (data.pixels(), data.classes);
                let [c, h, w] = data.shape;
                let (mut total, mut correct) = (0.0f64, 0usize);
                let val = &data.val;
                for start in (0..val.len()).step_by(b) {
                    let n = b.min(val.len() - start);
                    let pixels = &val.pixels[start * px..(start + n) * px];
                    let labels = &val.labels[start..start + n];
                    let x = Tensor::from_f32(gpu, &[n, c, h, w], pixels, "images")?;
                    let y = Tensor::from_u32(gpu, &[n], labels, "labels")?;
                    let mut tape = Tape::new();
                    tape.set_grad_enabled(false);
                    let (logits, stats) = gpu
                        .run_async(|rec| {
                            let logits = model.logits(&mut tape, rec, &x)?;
                            let opts = Default::default();
                            let l = tape.cross_entropy(rec, logits, &y, opts)?;
                            Ok((tape.value(logits)?.clone(), tape.value(l)?.clone()))
                        })
                        .await?;
                    total += stats.to_vec_f32(gpu).await?[0] as f64 * n as f64;
                    let scores = logits.to_vec_f32(gpu).await?;
                    correct += scores
                        .chunks(k)
                        .zip(labels)
                        .filter(|(row, &l)| argmax(row) == l as usize)
                        .count();
                }
                Eval {
                    loss: (total / val.len() as f64) as f32,
                    accuracy: Some(correct as f32 / val.len() as f32),
                }
            }
        };
        match self.history.last_mut() {
            Some(last) if last.step == self.step => {
                last.val_loss = Some(eval.loss);
                last.val_accuracy = eval.accuracy;
            }
            _ => self.history.push(Record {
                step: self.step,
                loss: f32::NAN,
                val_loss: Some(eval.loss),
                val_accuracy: eval.accuracy,
            }),
        }
        Ok(eval)
    }

    /// The model's weights as SafeTensors bytes, under the names checkpoints use.
    pub async fn model_safetensors(&self) -> Result<Vec<u8>> {
        let p = self.task.params();
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
        let p = self.task.params();
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
            tokens_seen: self.items_seen,
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
                tokenizer: match &self.task {
                    Task::Text { tokenizer, .. } => Some(tokenizer.to_json()?),
                    Task::Images { .. } => None,
                },
            },
        )
    }

    fn write_metrics(&self) -> Result<()> {
        let out = &self.cfg.train.out_dir;
        let mut lines = String::new();
        for r in &self.history {
            let mut v = serde_json::json!({ "step": r.step, "loss": if r.loss.is_finite() { Some(r.loss) } else { None }, "val_loss": r.val_loss });
            if let Some(a) = r.val_accuracy {
                v["val_accuracy"] = a.into();
            }
            lines += &format!("{v}\n");
        }
        checkpoint::write_atomic(&out.join(METRICS), lines.as_bytes())?;
        let train: Vec<(u64, f32)> = self
            .history
            .iter()
            .filter(|h| h.loss.is_finite())
            .map(|h| (h.step, h.loss))
            .collect();
        let val: Vec<(u64, f32)> = self
            .history
            .iter()
            .filter_map(|h| h.val_loss.map(|v| (h.step, v)))
            .collect();
        let params = self.task.params().numel();
        let title = match &self.cfg.model {
            NetConfig::Transformer(m) => {
                format!("{:?} {}L {}d, {params} params", m.arch, m.n_layer, m.n_embd)
            }
            NetConfig::Conv(c) => format!(
                "{} {:?} x{}, {params} params{}",
                match c.arch {
                    ConvArch::Convnet => "conv net",
                    ConvArch::Unet => "U-Net",
                },
                c.channels,
                c.blocks,
                self.history
                    .iter()
                    .rev()
                    .find_map(|h| h.val_accuracy)
                    .map_or(String::new(), |a| format!(", val acc {:.1}%", a * 100.0))
            ),
        };
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
            params: self.task.params().numel(),
            outputs: self.outputs(),
            train_items: match &self.task {
                Task::Text { data, .. } => data.train.len(),
                Task::Images { data, .. } => data.train.len(),
            },
            val_items: match &self.task {
                Task::Text { data, .. } => data.val.len(),
                Task::Images { data, .. } => data.val.len(),
            },
            unit: match &self.task {
                Task::Text { .. } => "tokens",
                Task::Images { .. } => "images",
            },
            start_step,
            steps: tc.steps,
        })?;
        flow(f, &mut stop, start_step);
        let mut first_val_loss = None;
        if start_step == 0 {
            let v = self.evaluate_async().await?;
            first_val_loss = Some(v.loss);
            let f = on_event(Event::Eval {
                step: 0,
                val_loss: v.loss,
                val_accuracy: v.accuracy,
            })?;
            flow(f, &mut stop, start_step);
        }
        let mut final_train_loss = f32::NAN;
        let last = self.history.iter().rev().find(|h| h.val_loss.is_some());
        let mut final_val = Eval {
            loss: last.and_then(|h| h.val_loss).unwrap_or(f32::NAN),
            accuracy: last.and_then(|h| h.val_accuracy),
        };
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
                final_val = self.evaluate_async().await?;
                let f = on_event(Event::Eval {
                    step: self.step,
                    val_loss: final_val.loss,
                    val_accuracy: final_val.accuracy,
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
        let items =
            (self.step - start_step) as f64 * (self.cfg.items_per_batch() * tc.grad_accum) as f64;
        if self.persist && checkpoint.as_os_str().is_empty() {
            // A fresh run stopped before its first step (`--max-steps 0`) keeps its
            // initial weights as the step-0 checkpoint (a replay's starting point).
            checkpoint = match tc.out_dir.join("latest").is_file() {
                true => checkpoint::resolve(&tc.out_dir)?,
                false => self.save_async().await?,
            };
        }
        Ok(Summary {
            start_step,
            steps: self.step,
            stopped,
            first_val_loss,
            final_val_loss: final_val.loss,
            final_val_accuracy: final_val.accuracy,
            final_train_loss,
            items_per_s: items / seconds,
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
fn read_history(path: &Path, upto: u64) -> Vec<Record> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    let f32_of = |v: &serde_json::Value| v.as_f64().map(|x| x as f32);
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| {
            let step = v["step"].as_u64()?;
            (step <= upto).then_some(Record {
                step,
                loss: f32_of(&v["loss"]).unwrap_or(f32::NAN),
                val_loss: f32_of(&v["val_loss"]),
                val_accuracy: f32_of(&v["val_accuracy"]),
            })
        })
        .collect()
}

/// A conv net loaded from a checkpoint (a run directory or a step directory).
pub fn load_conv(gpu: &Gpu, path: &Path) -> Result<ConvNet> {
    let ck: checkpoint::Loaded = checkpoint::load(path)?;
    let NetConfig::Conv(cfg) = &ck.state.config.model else {
        return Err(Error::Checkpoint {
            path: ck.dir.display().to_string(),
            detail: "holds a transformer, not a conv net".into(),
        });
    };
    ConvNet::from_weights(gpu, cfg, ck.model).map_err(|e| Error::Checkpoint {
        path: ck.dir.display().to_string(),
        detail: e.to_string(),
    })
}

/// A model and tokenizer loaded from a checkpoint (a run directory or a step directory).
pub fn load_for_generation(gpu: &Gpu, path: &Path) -> Result<(Transformer, Tokenizer)> {
    let ck: checkpoint::Loaded = checkpoint::load(path)?;
    let Some(mcfg) = ck.state.config.transformer() else {
        return Err(Error::Checkpoint {
            path: ck.dir.display().to_string(),
            detail: "holds a conv net, not a text model".into(),
        });
    };
    let tokenizer = Tokenizer::from_json(ck.tokenizer()?)?;
    let model = Transformer::from_weights(gpu, mcfg, ck.model).map_err(|e| Error::Checkpoint {
        path: ck.dir.display().to_string(),
        detail: e.to_string(),
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
