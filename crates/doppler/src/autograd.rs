//! Autograd tape. Ops record as they run (the forward is real work on the GPU, not a
//! graph to compile); [`Tape::backward`] walks the records once in reverse. Every
//! derivative rule is one arm of the match in `backward`, with its formula in a comment;
//! the kernels behind the rules live in `ops/` next to their forwards.
//!
//! Parameters live in a [`ParamStore`]: their gradients accumulate there across backward
//! passes (micro-batches) until [`ParamStore::zero_grad`]. Activations are owned by the
//! tape and dropped as soon as the backward walk has passed every op that needs them.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::gpu::{DType, Recorder, Tensor};
use crate::ops::attention::{self, AttnOpts, AttnOut};
use crate::ops::conv2d::{self, Conv2dOpts};
use crate::ops::cross_entropy::{self as ce, CrossEntropyOpts, CrossEntropyOut, Upstream};
use crate::ops::gelu::{self, GeluMode};
use crate::ops::groupnorm::{self, GroupNormOut};
use crate::ops::matmul::{matmul, matmul_bias, matmul_into, MatmulOpts};
use crate::ops::norm::{self, NormOut};
use crate::ops::pool::{self, Pool};
use crate::ops::quant::RowSplit;
use crate::ops::rope::{self, Pairing, RopeTable};
use crate::ops::{bias, columns, dropout, elementwise, embedding, reduce, silu, upsample};

/// A value on the tape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Var(usize);

/// Named trainable tensors and their accumulated gradients.
#[derive(Default)]
pub struct ParamStore {
    pub names: Vec<String>,
    pub values: Vec<Tensor>,
    pub grads: Vec<Option<Tensor>>,
}

impl ParamStore {
    pub fn push(&mut self, name: impl Into<String>, value: Tensor) -> usize {
        self.names.push(name.into());
        self.values.push(value);
        self.grads.push(None);
        self.values.len() - 1
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    pub fn index(&self, name: &str) -> Option<usize> {
        self.names.iter().position(|n| n == name)
    }

    /// Every parameter's accumulated gradient, in order; an error naming the first one
    /// that got none (`op` names who asked).
    pub fn all_grads(&self, op: &'static str) -> Result<Vec<Tensor>> {
        self.grads
            .iter()
            .zip(&self.names)
            .map(|(g, n)| {
                g.clone().ok_or_else(|| Error::Invalid {
                    op,
                    detail: format!("parameter {n} got no gradient"),
                })
            })
            .collect()
    }

    /// Forgets accumulated gradients (the next backward writes fresh ones).
    pub fn zero_grad(&mut self) {
        self.grads.iter_mut().for_each(|g| *g = None);
    }

    /// Total number of scalars.
    pub fn numel(&self) -> usize {
        self.values.iter().map(Tensor::numel).sum()
    }
}

/// How a value was made; what its backward needs is saved here.
enum Op {
    /// An input, a parameter (its index in the store), or a value with no gradient.
    Leaf {
        param: Option<usize>,
    },
    Reshape {
        x: Var,
    },
    /// a + b, same shapes.
    Add {
        a: Var,
        b: Var,
    },
    Scale {
        x: Var,
        alpha: f32,
    },
    /// x (..., in) @ w^T (out, in) + b (out)
    Linear {
        x: Var,
        w: Var,
        b: Option<Var>,
    },
    /// x (..., in) @ w^T for a frozen weight kept in its file's encoding (fine-tuning's
    /// base model): no gradient for w.
    QLinear {
        x: Var,
        w: RowSplit,
    },
    /// x (..., C) + b (C) for a frozen b (a base model's bias).
    AddBias {
        x: Var,
    },
    /// Columns start .. start + width of x (..., C).
    Slice {
        x: Var,
        start: usize,
        cols: usize,
    },
    /// table (V, H) gathered at ids (...) u32.
    Embedding {
        table: Var,
        ids: Tensor,
    },
    LayerNorm {
        x: Var,
        w: Var,
        b: Var,
        out: NormOut,
    },
    RmsNorm {
        x: Var,
        w: Var,
        out: NormOut,
        one_plus: bool,
    },
    Gelu {
        x: Var,
        mode: GeluMode,
    },
    Silu {
        x: Var,
    },
    SwiGlu {
        a: Var,
        b: Var,
    },
    Rope {
        x: Var,
        table: Arc<RopeTable>,
        offset: usize,
        pairing: Pairing,
    },
    Attention {
        q: Var,
        k: Var,
        v: Var,
        out: AttnOut,
        opts: AttnOpts,
    },
    Dropout {
        x: Var,
        p: f64,
        seed: u64,
    },
    /// x (N, Cin, H, W) convolved with w (Cout, Cin/groups, KH, KW), plus b (Cout).
    Conv2d {
        x: Var,
        w: Var,
        b: Option<Var>,
        opts: Conv2dOpts,
    },
    /// x (N, C, ...) normalized over groups of C/groups channels, times w (C) plus b (C).
    GroupNorm {
        x: Var,
        w: Var,
        b: Var,
        groups: usize,
        out: GroupNormOut,
    },
    /// x (N, C, H, W) -> (N, C, H*sh, W*sw), nearest neighbour.
    Upsample {
        x: Var,
        scale: (usize, usize),
    },
    /// x (N, C*r*r, H, W) -> (N, C, H*r, W*r).
    PixelShuffle {
        x: Var,
        r: usize,
    },
    /// Window means of x (N, C, H, W).
    AvgPool {
        x: Var,
        pool: Pool,
    },
    /// Mean of (pred - target)^2 over every element, target a constant; `diff` is
    /// pred - target, `n` the element count.
    MseLoss {
        pred: Var,
        diff: Tensor,
        n: usize,
    },
    /// Mean cross-entropy of logits (..., V) against targets (...); the value is the
    /// (mean, count) pair the kernel writes.
    CrossEntropy {
        logits: Var,
        targets: Tensor,
        out: CrossEntropyOut,
        opts: CrossEntropyOpts,
    },
}

pub struct Tape {
    values: Vec<Option<Tensor>>,
    ops: Vec<Op>,
    needs_grad: Vec<bool>,
    grad_enabled: bool,
}

impl Default for Tape {
    fn default() -> Self {
        Tape::new()
    }
}

impl Tape {
    pub fn new() -> Tape {
        Tape {
            values: Vec::new(),
            ops: Vec::new(),
            needs_grad: Vec::new(),
            grad_enabled: true,
        }
    }

    /// Number of values recorded.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Values still held (the backward walk drops them as it goes).
    pub fn live_values(&self) -> usize {
        self.values.iter().filter(|v| v.is_some()).count()
    }

    /// Whether ops record what their backward needs. Off: a no-grad region (evaluation,
    /// generation); values still flow.
    pub fn set_grad_enabled(&mut self, on: bool) {
        self.grad_enabled = on;
    }

    pub fn grad_enabled(&self) -> bool {
        self.grad_enabled
    }

    /// The tensor behind `v`.
    pub fn value(&self, v: Var) -> Result<&Tensor> {
        self.values[v.0].as_ref().ok_or_else(|| Error::Invalid {
            op: "tape",
            detail: format!("value {} was freed by backward", v.0),
        })
    }

    fn push(&mut self, value: Tensor, op: Op, inputs: &[Var]) -> Var {
        let needs = self.grad_enabled && inputs.iter().any(|i| self.needs_grad[i.0]);
        let op = if needs { op } else { Op::Leaf { param: None } };
        self.values.push(Some(value));
        self.ops.push(op);
        self.needs_grad.push(needs);
        Var(self.values.len() - 1)
    }

    /// An input that gets no gradient.
    pub fn input(&mut self, t: Tensor) -> Var {
        self.values.push(Some(t));
        self.ops.push(Op::Leaf { param: None });
        self.needs_grad.push(false);
        Var(self.values.len() - 1)
    }

    /// An input whose gradient [`Tape::backward_from`] and [`Tape::backward_inputs`] return.
    pub fn input_with_grad(&mut self, t: Tensor) -> Var {
        self.values.push(Some(t));
        self.ops.push(Op::Leaf { param: None });
        self.needs_grad.push(self.grad_enabled);
        Var(self.values.len() - 1)
    }

    /// Parameter `i` of `store`; its gradient accumulates into `store.grads[i]`.
    pub fn param(&mut self, store: &ParamStore, i: usize) -> Var {
        self.values.push(Some(store.values[i].clone()));
        self.ops.push(Op::Leaf { param: Some(i) });
        self.needs_grad.push(self.grad_enabled);
        Var(self.values.len() - 1)
    }

    /// The same value, with no gradient flowing back through it.
    pub fn stop_gradient(&mut self, x: Var) -> Result<Var> {
        let t = self.value(x)?.clone();
        Ok(self.input(t))
    }

    fn vals<const N: usize>(&self, vs: [Var; N]) -> Result<[Tensor; N]> {
        let mut out: [Option<Tensor>; N] = std::array::from_fn(|_| None);
        for (o, v) in out.iter_mut().zip(vs) {
            *o = Some(self.value(v)?.clone());
        }
        Ok(out.map(|t| t.unwrap()))
    }

    pub fn reshape(&mut self, x: Var, shape: &[usize]) -> Result<Var> {
        let y = self.value(x)?.reshape(shape)?;
        Ok(self.push(y, Op::Reshape { x }, &[x]))
    }

    pub fn add(&mut self, rec: &mut Recorder<'_>, a: Var, b: Var) -> Result<Var> {
        let [ta, tb] = self.vals([a, b])?;
        let y = elementwise::add(rec, &ta, &tb)?;
        Ok(self.push(y, Op::Add { a, b }, &[a, b]))
    }

    pub fn scale(&mut self, rec: &mut Recorder<'_>, x: Var, alpha: f32) -> Result<Var> {
        let [tx] = self.vals([x])?;
        let y = elementwise::scale(rec, &tx, alpha)?;
        Ok(self.push(y, Op::Scale { x, alpha }, &[x]))
    }

    /// x (..., in) @ w^T + b with w (out, in), as torch.nn.Linear.
    pub fn linear(
        &mut self,
        rec: &mut Recorder<'_>,
        x: Var,
        w: Var,
        b: Option<Var>,
    ) -> Result<Var> {
        let [tx, tw] = self.vals([x, w])?;
        let (x2, out) = flat_rows("linear", &tx, &tw)?;
        let opts = MatmulOpts {
            trans_b: true,
            ..Default::default()
        };
        let y = match b {
            Some(b) => matmul_bias(rec, &x2, &tw, self.value(b)?, opts)?,
            None => matmul(rec, &x2, &tw, opts)?,
        };
        let y = y.reshape(&out)?;
        let inputs: Vec<Var> = [x, w].into_iter().chain(b).collect();
        Ok(self.push(y, Op::Linear { x, w, b }, &inputs))
    }

    /// x (..., in) @ w^T with w (out, in) frozen in its file's encoding (read block by
    /// block in both directions: [`crate::ops::quant::qmatmul_t`] for dx).
    pub fn qlinear(&mut self, rec: &mut Recorder<'_>, x: Var, w: &RowSplit) -> Result<Var> {
        let [tx] = self.vals([x])?;
        let y = w.product(rec, &tx, crate::ops::quant::Fuse::default())?;
        Ok(self.push(y, Op::QLinear { x, w: w.clone() }, &[x]))
    }

    /// x (..., C) + b (C), b a constant.
    pub fn add_bias(&mut self, rec: &mut Recorder<'_>, x: Var, b: &Tensor) -> Result<Var> {
        let [tx] = self.vals([x])?;
        let y = bias::bias_add(rec, &tx, b)?;
        Ok(self.push(y, Op::AddBias { x }, &[x]))
    }

    /// Columns start .. start + width of x (..., C): (..., width).
    pub fn slice(
        &mut self,
        rec: &mut Recorder<'_>,
        x: Var,
        start: usize,
        width: usize,
    ) -> Result<Var> {
        let [tx] = self.vals([x])?;
        let cols = tx.shape().last().copied().unwrap_or(0);
        let y = columns::slice(rec, &tx, start, width)?;
        Ok(self.push(y, Op::Slice { x, start, cols }, &[x]))
    }

    /// Rows of `table` (V, H) at `ids` (...): (..., H).
    pub fn embedding(&mut self, rec: &mut Recorder<'_>, table: Var, ids: &Tensor) -> Result<Var> {
        let [tt] = self.vals([table])?;
        let y = embedding::embedding(rec, &tt, ids)?;
        Ok(self.push(
            y,
            Op::Embedding {
                table,
                ids: ids.clone(),
            },
            &[table],
        ))
    }

    pub fn layer_norm(
        &mut self,
        rec: &mut Recorder<'_>,
        x: Var,
        w: Var,
        b: Var,
        eps: f32,
    ) -> Result<Var> {
        let [tx, tw, tb] = self.vals([x, w, b])?;
        let out = norm::layer_norm(rec, &tx, &tw, &tb, eps)?;
        let y = out.y.clone();
        Ok(self.push(y, Op::LayerNorm { x, w, b, out }, &[x, w, b]))
    }

    pub fn rms_norm(
        &mut self,
        rec: &mut Recorder<'_>,
        x: Var,
        w: Var,
        eps: f32,
        one_plus: bool,
    ) -> Result<Var> {
        let [tx, tw] = self.vals([x, w])?;
        let out = norm::rms_norm(rec, &tx, &tw, eps, one_plus)?;
        let y = out.y.clone();
        Ok(self.push(
            y,
            Op::RmsNorm {
                x,
                w,
                out,
                one_plus,
            },
            &[x, w],
        ))
    }

    pub fn gelu(&mut self, rec: &mut Recorder<'_>, x: Var, mode: GeluMode) -> Result<Var> {
        let [tx] = self.vals([x])?;
        let y = gelu::gelu(rec, &tx, mode)?;
        Ok(self.push(y, Op::Gelu { x, mode }, &[x]))
    }

    pub fn silu(&mut self, rec: &mut Recorder<'_>, x: Var) -> Result<Var> {
        let [tx] = self.vals([x])?;
        let y = silu::silu(rec, &tx)?;
        Ok(self.push(y, Op::Silu { x }, &[x]))
    }

    /// silu(a) * b
    pub fn swiglu(&mut self, rec: &mut Recorder<'_>, a: Var, b: Var) -> Result<Var> {
        let [ta, tb] = self.vals([a, b])?;
        let y = silu::swiglu(rec, &ta, &tb)?;
        Ok(self.push(y, Op::SwiGlu { a, b }, &[a, b]))
    }

    /// x (..., T, H, Dh) turned by the angles of positions offset.. offset + T.
    pub fn rope(
        &mut self,
        rec: &mut Recorder<'_>,
        x: Var,
        table: &Arc<RopeTable>,
        offset: usize,
        pairing: Pairing,
    ) -> Result<Var> {
        let [tx] = self.vals([x])?;
        let y = rope::rope(rec, &tx, table, offset, pairing)?;
        Ok(self.push(
            y,
            Op::Rope {
                x,
                table: table.clone(),
                offset,
                pairing,
            },
            &[x],
        ))
    }

    /// q (B, Tq, Hq, D), k and v (B, Tk, Hkv, D) -> (B, Tq, Hq, D).
    pub fn attention(
        &mut self,
        rec: &mut Recorder<'_>,
        q: Var,
        k: Var,
        v: Var,
        opts: AttnOpts,
    ) -> Result<Var> {
        let [tq, tk, tv] = self.vals([q, k, v])?;
        let out = attention::attention(rec, &tq, &tk, &tv, opts)?;
        let y = out.o.clone();
        Ok(self.push(y, Op::Attention { q, k, v, out, opts }, &[q, k, v]))
    }

    /// Inverted dropout with a seeded mask; identity when p == 0.
    pub fn dropout(&mut self, rec: &mut Recorder<'_>, x: Var, p: f64, seed: u64) -> Result<Var> {
        if p == 0.0 {
            return Ok(x);
        }
        let [tx] = self.vals([x])?;
        let y = dropout::dropout(rec, &tx, p, seed)?;
        Ok(self.push(y, Op::Dropout { x, p, seed }, &[x]))
    }

    /// x (N, Cin, H, W) convolved with w (Cout, Cin/groups, KH, KW), plus b (Cout), as
    /// torch's `conv2d`: (N, Cout, OH, OW).
    pub fn conv2d(
        &mut self,
        rec: &mut Recorder<'_>,
        x: Var,
        w: Var,
        b: Option<Var>,
        opts: Conv2dOpts,
    ) -> Result<Var> {
        let [tx, tw] = self.vals([x, w])?;
        let tb = b.map(|b| self.value(b).cloned()).transpose()?;
        let y = conv2d::conv2d(rec, &tx, &tw, tb.as_ref(), opts)?;
        let inputs: Vec<Var> = [x, w].into_iter().chain(b).collect();
        Ok(self.push(y, Op::Conv2d { x, w, b, opts }, &inputs))
    }

    /// torch's `group_norm(x, groups, w, b, eps)` over x (N, C, ...).
    pub fn group_norm(
        &mut self,
        rec: &mut Recorder<'_>,
        x: Var,
        w: Var,
        b: Var,
        groups: usize,
        eps: f32,
    ) -> Result<Var> {
        let [tx, tw, tb] = self.vals([x, w, b])?;
        let out = groupnorm::group_norm(rec, &tx, &tw, &tb, groups, eps)?;
        let y = out.y.clone();
        Ok(self.push(
            y,
            Op::GroupNorm {
                x,
                w,
                b,
                groups,
                out,
            },
            &[x, w, b],
        ))
    }

    /// Nearest-neighbour upsampling of x (N, C, H, W) by integer factors.
    pub fn upsample_nearest(
        &mut self,
        rec: &mut Recorder<'_>,
        x: Var,
        scale: (usize, usize),
    ) -> Result<Var> {
        let [tx] = self.vals([x])?;
        let y = upsample::upsample_nearest2d(rec, &tx, scale.0, scale.1)?;
        Ok(self.push(y, Op::Upsample { x, scale }, &[x]))
    }

    /// torch's `pixel_shuffle(x, r)`: (N, C*r*r, H, W) -> (N, C, H*r, W*r).
    pub fn pixel_shuffle(&mut self, rec: &mut Recorder<'_>, x: Var, r: usize) -> Result<Var> {
        let [tx] = self.vals([x])?;
        let y = upsample::pixel_shuffle(rec, &tx, r)?;
        Ok(self.push(y, Op::PixelShuffle { x, r }, &[x]))
    }

    /// torch's `avg_pool2d(x, kernel, stride)` (no padding).
    pub fn avg_pool(&mut self, rec: &mut Recorder<'_>, x: Var, pool: Pool) -> Result<Var> {
        let [tx] = self.vals([x])?;
        let y = pool::avg_pool2d(rec, &tx, pool)?;
        Ok(self.push(y, Op::AvgPool { x, pool }, &[x]))
    }

    /// Mean squared error of `pred` against a constant `target` of its shape, as torch's
    /// `mse_loss` (mean reduction): a one-element value (the sum in a fixed order).
    pub fn mse_loss(&mut self, rec: &mut Recorder<'_>, pred: Var, target: &Tensor) -> Result<Var> {
        let [tp] = self.vals([pred])?;
        if tp.shape() != target.shape() || tp.numel() == 0 {
            return Err(Error::Shape {
                op: "mse_loss",
                detail: format!("pred {:?} vs target {:?}", tp.shape(), target.shape()),
            });
        }
        let n = tp.numel();
        let neg = elementwise::scale(rec, target, -1.0)?;
        let diff = elementwise::add(rec, &tp, &neg)?;
        let sq = elementwise::mul(rec, &diff, &diff)?;
        let total = reduce::sum(rec, &sq)?.reshape(&[1])?;
        let mean = elementwise::scale(rec, &total, (1.0 / n as f64) as f32)?;
        Ok(self.push(mean, Op::MseLoss { pred, diff, n }, &[pred]))
    }

    /// Mean cross-entropy over non-ignored tokens; the value is (mean, count).
    pub fn cross_entropy(
        &mut self,
        rec: &mut Recorder<'_>,
        logits: Var,
        targets: &Tensor,
        opts: CrossEntropyOpts,
    ) -> Result<Var> {
        let [tl] = self.vals([logits])?;
        let out = ce::cross_entropy(rec, &tl, targets, opts)?;
        let y = out.stats.clone();
        Ok(self.push(
            y,
            Op::CrossEntropy {
                logits,
                targets: targets.clone(),
                out,
                opts,
            },
            &[logits],
        ))
    }

    /// Backpropagates from `loss` (a cross-entropy or MSE value) with upstream gradient `seed`
    /// (1, or the loss scale, or 1 / micro-batches), accumulating into `store`'s gradients.
    /// The tape is consumed: every activation is dropped once no later rule needs it.
    pub fn backward(
        self,
        rec: &mut Recorder<'_>,
        loss: Var,
        seed: f32,
        store: &mut ParamStore,
    ) -> Result<()> {
        self.backward_inputs(rec, loss, seed, store, &[]).map(drop)
    }

    /// [`Tape::backward`], also returning the gradients of `inputs` (values made by
    /// [`Tape::input_with_grad`]), in their order.
    pub fn backward_inputs(
        self,
        rec: &mut Recorder<'_>,
        loss: Var,
        seed: f32,
        store: &mut ParamStore,
        inputs: &[Var],
    ) -> Result<Vec<Tensor>> {
        match &self.ops[loss.0] {
            Op::CrossEntropy { .. } => {
                let g = Tensor::from_f32(rec.gpu(), &[1], &[seed], "backward.seed")?;
                self.walk(rec, loss, g, store, inputs)
            }
            // d mean((pred - target)^2) / d pred = 2 (pred - target) / n, times the seed:
            // the walk starts at pred with it.
            &Op::MseLoss { pred, ref diff, n } => {
                let g = elementwise::scale(rec, diff, (2.0 * seed as f64 / n as f64) as f32)?;
                self.walk(rec, pred, g, store, inputs)
            }
            _ => Err(Error::Invalid {
                op: "backward",
                detail: "the loss must be a cross-entropy or MSE value".into(),
            }),
        }
    }

    /// Backpropagates `upstream` (the gradient of a loss with respect to `out`, its shape)
    /// through the tape: parameters' gradients accumulate into `store`, the gradients of
    /// `inputs` ([`Tape::input_with_grad`] values) are returned in their order. A piece of
    /// a longer backward: a layer recomputed from its saved input (fine-tuning's
    /// recomputation), `upstream` the gradient of its output from the layers above.
    pub fn backward_from(
        self,
        rec: &mut Recorder<'_>,
        out: Var,
        upstream: Tensor,
        store: &mut ParamStore,
        inputs: &[Var],
    ) -> Result<Vec<Tensor>> {
        let shape = self.value(out)?.shape().to_vec();
        if upstream.shape() != shape.as_slice() || upstream.dtype() != DType::F32 {
            return Err(Error::Shape {
                op: "backward_from",
                detail: format!(
                    "upstream {:?} {:?} for a value {shape:?} f32",
                    upstream.shape(),
                    upstream.dtype()
                ),
            });
        }
        self.walk(rec, out, upstream, store, inputs)
    }

    /// The backward walk from `root` (its gradient `root_grad`, never written in place).
    fn walk(
        mut self,
        rec: &mut Recorder<'_>,
        root: Var,
        root_grad: Tensor,
        store: &mut ParamStore,
        inputs: &[Var],
    ) -> Result<Vec<Tensor>> {
        let mut found: Vec<Option<Tensor>> = inputs.iter().map(|_| None).collect();
        let n = self.values.len();
        let mut grads: Vec<Option<Tensor>> = (0..n).map(|_| None).collect();
        // Whether grads[v]'s buffer belongs to v alone (a rule's fresh output, or a sum), so
        // that a later rule may add into it in place; false where it is shared with another
        // value's gradient (d(a + b) hands the same g to both).
        let mut owned = vec![false; n];
        grads[root.0] = Some(root_grad);
        for i in (0..=root.0).rev() {
            let op = std::mem::replace(&mut self.ops[i], Op::Leaf { param: None });
            let g = grads[i].take();
            let g_owned = owned[i];
            let value = self.values[i].take();
            let Some(g) = g else { continue };
            if !self.needs_grad[i] {
                continue;
            }
            // (input, its gradient contribution), summed into `grads` after the rule; the
            // contributions in `shared` are also some other input's.
            let mut contrib: Vec<(Var, Tensor)> = Vec::new();
            let mut shared: Vec<Var> = Vec::new();
            match op {
                Op::Leaf { param: Some(p) } => {
                    // Parameters: g accumulates across backward passes. A first gradient is
                    // copied, since g may share its buffer with another value's gradient and
                    // stored gradients are later accumulated into in place.
                    store.grads[p] = Some(match store.grads[p].take() {
                        None => {
                            let own = Tensor::empty(rec.gpu(), g.shape(), DType::F32, "grad")?;
                            rec.copy(&g, &own)?;
                            own
                        }
                        Some(prev) => elementwise::add(rec, &prev, &g)?,
                    });
                }
                Op::Leaf { param: None } => {
                    if let Some(at) = inputs.iter().position(|v| v.0 == i) {
                        found[at] = Some(g);
                    }
                }
                // d reshape(x) = reshape^-1(g)
                Op::Reshape { x } => {
                    let shape = self.value(x)?.shape().to_vec();
                    contrib.push((x, g.reshape(&shape)?));
                    if !g_owned {
                        shared.push(x);
                    }
                }
                // d(a + b) = (g, g)
                Op::Add { a, b } => {
                    contrib.push((a, g.clone()));
                    contrib.push((b, g));
                    shared.extend([a, b]);
                }
                // d(alpha x) = alpha g
                Op::Scale { x, alpha } => contrib.push((x, elementwise::scale(rec, &g, alpha)?)),
                // y = x w^T + b:  dx = g w,  dw = g^T x,  db = sum over rows of g
                Op::Linear { x, w, b } => {
                    let [tx, tw] = self.vals([x, w])?;
                    let (x2, _) = flat_rows("linear", &tx, &tw)?;
                    let g2 = g.reshape(&[x2.shape()[0], tw.shape()[0]])?;
                    if self.needs_grad[x.0] {
                        match grads[x.0].take() {
                            // x's gradient so far is its own: add g w into it (beta = 1),
                            // e.g. the q, k and v projections of one normed input.
                            Some(acc) if owned[x.0] => {
                                let acc2 = acc.reshape(x2.shape())?;
                                matmul_into(rec, &g2, &tw, &acc2, MatmulOpts::default(), 1.0)?;
                                grads[x.0] = Some(acc);
                            }
                            prev => {
                                grads[x.0] = prev;
                                let dx = matmul(rec, &g2, &tw, MatmulOpts::default())?;
                                contrib.push((x, dx.reshape(tx.shape())?));
                            }
                        }
                    }
                    let at = MatmulOpts {
                        trans_a: true,
                        ..Default::default()
                    };
                    match self.param_of(w) {
                        // Straight into the stored gradient (beta = 1 adds to it).
                        Some(p) => match &store.grads[p] {
                            Some(acc) => matmul_into(rec, &g2, &x2, acc, at, 1.0)?,
                            None => store.grads[p] = Some(matmul(rec, &g2, &x2, at)?),
                        },
                        None => contrib.push((w, matmul(rec, &g2, &x2, at)?)),
                    }
                    if let Some(b) = b {
                        contrib.push((b, bias::bias_add_backward(rec, &g2)?));
                    }
                }
                // y = x w^T, w frozen:  dx = g w (read from w's blocks)
                Op::QLinear { x, w } => {
                    let dx = w.product_t(rec, &g)?;
                    contrib.push((x, dx));
                }
                // y = x + b, b constant:  dx = g
                Op::AddBias { x } => {
                    contrib.push((x, g));
                    shared.push(x);
                }
                // y = x[.., start..start + w]:  dx = g in those columns, zeros elsewhere;
                // added in place into x's gradient when that is x's own (q, k and v of
                // one stacked product land in one buffer).
                Op::Slice { x, start, cols } => match grads[x.0].take() {
                    Some(acc) if owned[x.0] => {
                        grads[x.0] = Some(columns::place(rec, &g, start, cols, Some(&acc))?);
                    }
                    prev => {
                        grads[x.0] = prev;
                        contrib.push((x, columns::place(rec, &g, start, cols, None)?));
                    }
                },
                // y = table[ids]:  dtable[v] = sum of g over the positions holding id v
                Op::Embedding { table, ids } => {
                    let tt = self.value(table)?.clone();
                    match self.param_of(table) {
                        Some(p) => match &store.grads[p] {
                            Some(acc) => {
                                embedding::embedding_backward_into(rec, &ids, &g, acc, true)?
                            }
                            None => {
                                store.grads[p] = Some(embedding::embedding_backward(
                                    rec,
                                    &ids,
                                    &g,
                                    tt.shape()[0],
                                )?)
                            }
                        },
                        None => contrib.push((
                            table,
                            embedding::embedding_backward(rec, &ids, &g, tt.shape()[0])?,
                        )),
                    }
                }
                // Formulas in norm.wgsl.
                Op::LayerNorm { x, w, b, out } => {
                    let [tx, tw] = self.vals([x, w])?;
                    // x's gradient so far (a residual's) is added in the same pass.
                    let prev = grads[x.0].take();
                    let gr = norm::layer_norm_backward(rec, &tx, &tw, &out, &g, prev.as_ref())?;
                    contrib.push((x, gr.dx));
                    contrib.push((w, gr.dw));
                    if let Some(db) = gr.db {
                        contrib.push((b, db));
                    }
                }
                Op::RmsNorm {
                    x,
                    w,
                    out,
                    one_plus,
                } => {
                    let [tx, tw] = self.vals([x, w])?;
                    let prev = grads[x.0].take();
                    let gr =
                        norm::rms_norm_backward(rec, &tx, &tw, &out, &g, one_plus, prev.as_ref())?;
                    contrib.push((x, gr.dx));
                    contrib.push((w, gr.dw));
                }
                // dx = g * gelu'(x)   (gelu.wgsl)
                Op::Gelu { x, mode } => {
                    let [tx] = self.vals([x])?;
                    contrib.push((x, gelu::gelu_backward(rec, &tx, &g, mode)?));
                }
                // dx = g * silu'(x)   (silu.wgsl)
                Op::Silu { x } => {
                    let [tx] = self.vals([x])?;
                    contrib.push((x, silu::silu_backward(rec, &tx, &g)?));
                }
                // da = g * b * silu'(a),  db = g * silu(a)
                Op::SwiGlu { a, b } => {
                    let [ta, tb] = self.vals([a, b])?;
                    let (da, db) = silu::swiglu_backward(rec, &ta, &tb, &g)?;
                    contrib.push((a, da));
                    contrib.push((b, db));
                }
                // The rotation's transpose: turn g by the negative angles.
                Op::Rope {
                    x,
                    table,
                    offset,
                    pairing,
                } => {
                    contrib.push((x, rope::rope_backward(rec, &g, &table, offset, pairing)?));
                }
                // Formulas in attention.wgsl (recomputes the probabilities from lse).
                Op::Attention { q, k, v, out, opts } => {
                    let [tq, tk, tv] = self.vals([q, k, v])?;
                    let gr = attention::attention_backward(rec, &tq, &tk, &tv, &out, &g, opts)?;
                    contrib.push((q, gr.dq));
                    contrib.push((k, gr.dk));
                    contrib.push((v, gr.dv));
                }
                // dx = g * mask / (1 - p), the mask regenerated from the seed
                Op::Dropout { x, p, seed } => {
                    contrib.push((x, dropout::dropout_backward(rec, &g, p, seed)?))
                }
                // dx: the transposed convolution of g with w; dw: g correlated with x;
                // db: g summed over (N, OH, OW)   (conv2d.wgsl)
                Op::Conv2d { x, w, b, opts } => {
                    let [tx, tw] = self.vals([x, w])?;
                    let gr = conv2d::conv2d_backward(rec, &tx, &tw, &g, opts, b.is_some())?;
                    contrib.push((x, gr.dx));
                    contrib.push((w, gr.dw));
                    if let (Some(b), Some(db)) = (b, gr.db) {
                        contrib.push((b, db));
                    }
                }
                // Formulas in groupnorm.wgsl.
                Op::GroupNorm {
                    x,
                    w,
                    b,
                    groups,
                    out,
                } => {
                    let [tx, tw] = self.vals([x, w])?;
                    let gr = groupnorm::group_norm_backward(rec, &tx, &tw, &out, &g, groups)?;
                    contrib.push((x, gr.dx));
                    contrib.push((w, gr.dgamma));
                    contrib.push((b, gr.dbeta));
                }
                // dx = g summed over each sh x sw block
                Op::Upsample { x, scale } => contrib.push((
                    x,
                    upsample::upsample_nearest2d_backward(rec, &g, scale.0, scale.1)?,
                )),
                // dx = the inverse permutation of g
                Op::PixelShuffle { x, r } => {
                    contrib.push((x, upsample::pixel_shuffle_backward(rec, &g, r)?))
                }
                // dx = sum over the windows holding each pixel of g / window size
                Op::AvgPool { x, pool } => {
                    let shape = self.value(x)?.shape().to_vec();
                    contrib.push((x, pool::avg_pool2d_backward(rec, &g, &shape, pool)?));
                }
                // Only ever a root: backward_inputs starts the walk at its pred.
                Op::MseLoss { .. } => {
                    return Err(Error::Invalid {
                        op: "backward",
                        detail: "an MSE loss is only supported as the loss itself".into(),
                    })
                }
                // dlogits = (softmax(logits) - onehot) * g / count
                Op::CrossEntropy {
                    logits,
                    targets,
                    out,
                    opts,
                } => {
                    let [tl] = self.vals([logits])?;
                    let dl = ce::cross_entropy_backward(
                        rec,
                        &tl,
                        &targets,
                        &out,
                        Upstream::Mean(&g),
                        opts,
                    )?;
                    contrib.push((logits, dl));
                }
            }
            for (v, dv) in contrib {
                if !self.needs_grad[v.0] {
                    continue;
                }
                grads[v.0] = Some(match grads[v.0].take() {
                    None => {
                        owned[v.0] = !shared.contains(&v);
                        dv
                    }
                    Some(prev) => {
                        owned[v.0] = true;
                        elementwise::add(rec, &prev, &dv)?
                    }
                });
            }
            drop(value);
        }
        found
            .into_iter()
            .zip(inputs)
            .map(|(g, v)| {
                g.ok_or_else(|| Error::Invalid {
                    op: "backward",
                    detail: format!(
                        "no gradient reached value {} (not an input_with_grad the result depends on)",
                        v.0
                    ),
                })
            })
            .collect()
    }

    fn param_of(&self, v: Var) -> Option<usize> {
        match self.ops[v.0] {
            Op::Leaf { param } => param,
            _ => None,
        }
    }
}

/// x (..., in) as (rows, in) and the output shape (..., out) for w (out, in).
fn flat_rows(op: &'static str, x: &Tensor, w: &Tensor) -> Result<(Tensor, Vec<usize>)> {
    let (Some(&din), [dout, win]) = (x.shape().last(), w.shape()) else {
        return Err(Error::Shape {
            op,
            detail: format!(
                "x {:?}, w {:?}: expected x (..., in), w (out, in)",
                x.shape(),
                w.shape()
            ),
        });
    };
    if din != *win || x.dtype() != DType::F32 {
        return Err(Error::Shape {
            op,
            detail: format!("x {:?} vs w {:?} (out, in)", x.shape(), w.shape()),
        });
    }
    let mut out = x.shape().to_vec();
    *out.last_mut().unwrap() = *dout;
    Ok((x.reshape(&[x.numel() / din, din])?, out))
}
