//! The command recorder: ops append dispatches, `submit` encodes them into one command
//! encoder and one queue submission. Parameter blocks of all dispatches share one uniform
//! buffer and bind groups are cached (binds.rs); every buffer the submission touches stays
//! alive until the GPU has finished it.

use super::pipeline::{CachedPipeline, Kernel};
use super::pool::PooledBuffer;
use super::tensor::Tensor;
use super::trace::{Trace, TraceEvent};
use super::Gpu;
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// The workgroup grid of a dispatch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grid {
    /// `n` workgroups numbered 0..n. Past the per-dimension limit (65535) the grid becomes
    /// 2-D; the shader recovers the number as `wid.x + wid.y * nwg.x` and returns when it
    /// is `>= n` (the last row may be partly empty).
    Linear(u64),
    /// An explicit 3-D grid.
    Xyz([u32; 3]),
}

impl Grid {
    /// Linear grid covering `items` items at `per_group` items a workgroup.
    pub fn cover(items: u64, per_group: u64) -> Grid {
        Grid::Linear(items.div_ceil(per_group))
    }

    pub fn resolve(self, max_per_dim: u32) -> Result<[u32; 3]> {
        let max = max_per_dim as u64;
        match self {
            Grid::Linear(n) if n <= max => Ok([n as u32, 1, 1]),
            Grid::Linear(n) => {
                let y = n.div_ceil(max);
                if y > max {
                    return Err(Error::Shape {
                        op: "dispatch",
                        detail: format!("{n} workgroups exceed {max}x{max}"),
                    });
                }
                Ok([max as u32, y as u32, 1])
            }
            Grid::Xyz(g) => {
                if g.iter().any(|&d| d as u64 > max) {
                    return Err(Error::Shape {
                        op: "dispatch",
                        detail: format!("grid {g:?} exceeds {max} per dimension"),
                    });
                }
                Ok(g)
            }
        }
    }
}

enum Cmd {
    Dispatch {
        pipe: Arc<CachedPipeline>,
        uniform_offset: u64,
        uniform_size: u64,
        tensors: Vec<Tensor>,
        grid: [u32; 3],
    },
    Copy {
        src: Tensor,
        src_offset: u64,
        dst: Tensor,
        dst_offset: u64,
        bytes: u64,
    },
    Clear(Tensor),
    /// A copy into a mappable buffer, read after the submission completes ([`Readback`]).
    Stage {
        src: Tensor,
        staging: Arc<PooledBuffer>,
    },
}

/// An index check done on the GPU: a kernel counts ids >= `limit` into `flag[0]` and
/// keeps the first bad position as `u32::MAX - flag[1]` (atomicMax). Read after completion.
struct IndexCheck {
    op: &'static str,
    flag: Tensor,
    ids: Tensor,
    limit: u32,
}

/// GPU timestamps a recorder takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Timing {
    Off,
    /// Around every dispatch (each in a pass of its own): a per-kernel trace.
    EachDispatch,
    /// At the start of the first pass and the end of the last: one event, the submission's
    /// GPU time with its dispatches encoded as usual.
    Whole,
}

pub struct Recorder<'g> {
    gpu: &'g Gpu,
    label: String,
    cmds: Vec<Cmd>,
    uniforms: Vec<u8>,
    timing: Timing,
    checks: Vec<IndexCheck>,
    /// Readbacks learn their submission's index at submit.
    readbacks: Vec<Arc<Mutex<Option<wgpu::SubmissionIndex>>>>,
    /// Submit every this many commands as they are recorded (0: never; see
    /// [`Recorder::set_flush_every`]), the first times sooner (`next_flush`).
    flush_every: usize,
    next_flush: usize,
    /// Submissions of flushed parts the GPU may not have finished, oldest first: past
    /// MAX_AHEAD the recorder waits for the oldest (native), so that a recording far
    /// faster than the GPU (lavapipe, a large model's backward) does not hold every
    /// buffer of the whole recording at once: the pool reuses those of finished parts.
    ahead: std::collections::VecDeque<wgpu::SubmissionIndex>,
    /// Also submit once the dispatches recorded since the last submission bind this many
    /// bytes (0: off; [`Recorder::set_flush_bytes`]), and wait past `max_ahead` parts.
    flush_bytes: u64,
    touched: u64,
    max_ahead: usize,
}

/// Flushed parts of one recording the GPU may run behind by before the recorder waits.
const MAX_AHEAD: usize = 4;

/// A tensor's bytes as they were at a point of a submission, to read once the GPU has
/// reached it; waiting for it does not wait for later submissions (pipelined decoding
/// reads a step's token while the next step runs).
pub struct Readback {
    staging: Arc<PooledBuffer>,
    bytes: u64,
    label: Arc<str>,
    index: Arc<Mutex<Option<wgpu::SubmissionIndex>>>,
}

impl Readback {
    pub async fn bytes(&self, gpu: &Gpu) -> Result<Vec<u8>> {
        self.map(gpu, |b| b.to_vec()).await
    }

    /// `f` of the bytes where they lie, mapped (no copy of them first).
    pub async fn map<T>(&self, gpu: &Gpu, f: impl FnOnce(&[u8]) -> T) -> Result<T> {
        let err = |reason: String| Error::Readback {
            label: self.label.to_string(),
            reason,
        };
        let index = self
            .index
            .lock()
            .unwrap()
            .clone()
            .ok_or_else(|| err("read before its recorder was submitted".into()))?;
        let size = self.bytes.next_multiple_of(4);
        let mapped = super::map_read(gpu, &self.staging.buffer, size, Some(index))
            .await
            .map_err(err)?;
        let view = mapped
            .0
            .get_mapped_range(0..size)
            .map_err(|e| err(e.to_string()))?;
        Ok(f(&view[..self.bytes as usize]))
    }

    pub async fn u32s(&self, gpu: &Gpu) -> Result<Vec<u32>> {
        Ok(bytemuck::pod_collect_to_vec(&self.bytes(gpu).await?))
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_u32(&self, gpu: &Gpu) -> Result<Vec<u32>> {
        pollster::block_on(self.u32s(gpu))
    }
}

/// Commands in the first submission of a recorder that flushes as it goes.
const FIRST_FLUSH: usize = 16;

/// The flushing limit ([`Recorder::set_flush_every`]) of long recordings: a training step
/// (~690 dispatches for GPT-2-124M), a prompt's forward. On an H200 a GPT-2-124M step ran
/// 58.0-58.4 ms with 64, 57.7-58.0 with 128, 63.6-64.5 without flushing (GPU 55.7).
pub const FLUSH_EVERY: usize = 128;

/// Most timestamp queries in one query set (wgpu's `QUERY_SET_MAX_QUERIES`).
const QUERIES_PER_SET: u32 = 4096;

impl<'g> Recorder<'g> {
    pub(crate) fn new(gpu: &'g Gpu, label: &str, timing: Timing) -> Self {
        Recorder {
            gpu,
            label: label.to_string(),
            cmds: Vec::new(),
            uniforms: Vec::new(),
            timing,
            checks: Vec::new(),
            readbacks: Vec::new(),
            flush_every: 0,
            next_flush: 0,
            ahead: Default::default(),
            flush_bytes: 0,
            touched: 0,
            max_ahead: MAX_AHEAD,
        }
    }

    /// Submits what is recorded whenever `n` commands have gathered (0: only at
    /// [`Recorder::submit`]), so that the GPU starts on a long recording (a training step:
    /// hundreds of dispatches) while the CPU records the rest. The first submissions are
    /// shorter (16 commands, doubling up to `n`): the GPU starts sooner, and later ones
    /// cost fewer submissions. Recorders with timestamps (profiling, timed) keep one
    /// submission.
    pub fn set_flush_every(&mut self, n: usize) {
        self.flush_every = n;
        self.next_flush = n.min(FIRST_FLUSH);
    }

    /// Submits the commands recorded so far and goes on recording (no-op for recorders with
    /// timestamps). Index checks stay with the recorder until [`Recorder::encode`] stages
    /// their flags in the last submission, which reports them.
    pub fn flush(&mut self) -> Result<()> {
        if self.timing != Timing::Off || self.cmds.is_empty() {
            return Ok(());
        }
        let mut part = Recorder::new(self.gpu, &self.label, Timing::Off);
        part.cmds = std::mem::take(&mut self.cmds);
        part.uniforms = std::mem::take(&mut self.uniforms);
        part.readbacks = std::mem::take(&mut self.readbacks);
        self.touched = 0;
        let sub = part.submit()?;
        if let Some(index) = sub.index {
            self.ahead.push_back(index);
        }
        while self.ahead.len() > self.max_ahead {
            let oldest = self.ahead.pop_front().expect("longer than max_ahead");
            #[cfg(not(target_arch = "wasm32"))]
            {
                let wait = wgpu::PollType::Wait {
                    submission_index: Some(oldest),
                    timeout: None,
                };
                self.gpu
                    .device
                    .poll(wait)
                    .map_err(|e| Error::Device(e.to_string()))?;
                self.gpu.pool.collect();
            }
            #[cfg(target_arch = "wasm32")]
            drop(oldest);
        }
        Ok(())
    }

    /// With flushing on ([`Recorder::set_flush_every`]), also submits once the dispatches
    /// recorded since the last submission bind `bytes` of buffers, and lets the GPU run at
    /// most `max_ahead` submitted parts behind: work whose dispatches are large (a model's
    /// layers over thousands of tokens) then holds a bounded amount of temporaries in
    /// flight rather than FLUSH_EVERY commands' worth of each part.
    pub fn set_flush_bytes(&mut self, bytes: u64, max_ahead: usize) {
        self.flush_bytes = bytes;
        self.max_ahead = max_ahead;
    }

    fn maybe_flush(&mut self) -> Result<()> {
        let heavy = self.flush_bytes > 0 && self.touched >= self.flush_bytes;
        if self.flush_every > 0 && (self.cmds.len() >= self.next_flush || heavy) {
            self.flush()?;
            self.next_flush = (2 * self.next_flush).min(self.flush_every);
        }
        Ok(())
    }

    pub fn gpu(&self) -> &'g Gpu {
        self.gpu
    }

    /// Number of recorded commands (dispatches, copies, clears).
    pub fn len(&self) -> usize {
        self.cmds.len()
    }

    /// Number of recorded dispatches (what a profiling trace has events for).
    pub fn dispatches(&self) -> usize {
        self.cmds
            .iter()
            .filter(|c| matches!(c, Cmd::Dispatch { .. }))
            .count()
    }

    pub fn is_empty(&self) -> bool {
        self.cmds.is_empty()
    }

    /// Records one dispatch of `kernel`. `params` is the uniform block at binding 0 (a
    /// `#[repr(C)]` struct padded to 16 bytes); `tensors` are bindings 1.. in the kernel's
    /// order. A grid with no workgroups records nothing.
    pub fn dispatch(
        &mut self,
        kernel: &Kernel,
        constants: &[(&'static str, f64)],
        params: &[u8],
        tensors: &[&Tensor],
        grid: Grid,
    ) -> Result<()> {
        if tensors.len() != kernel.storage.len() {
            return Err(Error::Shape {
                op: kernel.entry,
                detail: format!(
                    "{} buffers bound, kernel takes {}",
                    tensors.len(),
                    kernel.storage.len()
                ),
            });
        }
        let grid = grid.resolve(self.gpu.max_workgroups_per_dim())?;
        if grid.contains(&0) {
            return Ok(());
        }
        let pipe = self.gpu.pipelines.get(self.gpu, kernel, constants)?;
        let align = self.gpu.limits.min_uniform_buffer_offset_alignment as usize;
        let offset = self.uniforms.len().next_multiple_of(align);
        self.uniforms.resize(offset, 0);
        self.uniforms.extend_from_slice(params);
        let size = params.len().max(16).next_multiple_of(16);
        self.uniforms.resize(offset + size, 0);
        self.cmds.push(Cmd::Dispatch {
            pipe,
            uniform_offset: offset as u64,
            uniform_size: size as u64,
            tensors: tensors.iter().map(|t| (*t).clone()).collect(),
            grid,
        });
        self.touched += tensors.iter().map(|t| t.byte_size()).sum::<u64>();
        self.maybe_flush()
    }

    /// Copies all of `src` into `dst` (same byte size).
    pub fn copy(&mut self, src: &Tensor, dst: &Tensor) -> Result<()> {
        if src.byte_size() != dst.byte_size() {
            return Err(Error::Shape {
                op: "copy",
                detail: format!(
                    "{:?} {:?} into {:?} {:?}",
                    src.shape(),
                    src.dtype(),
                    dst.shape(),
                    dst.dtype()
                ),
            });
        }
        self.cmds.push(Cmd::Copy {
            src: src.clone(),
            src_offset: 0,
            dst: dst.clone(),
            dst_offset: 0,
            bytes: src.binding_size(),
        });
        Ok(())
    }

    /// Copies elements `src_at..src_at + n` of `src` to `dst_at..` of `dst` (same dtype;
    /// byte offsets and length must be multiples of 4, as WebGPU requires).
    pub fn copy_elements(
        &mut self,
        src: &Tensor,
        src_at: usize,
        dst: &Tensor,
        dst_at: usize,
        n: usize,
    ) -> Result<()> {
        let size = src.dtype().size() as u64;
        let (so, doff, bytes) = (src_at as u64 * size, dst_at as u64 * size, n as u64 * size);
        if src.dtype() != dst.dtype()
            || src_at + n > src.numel()
            || dst_at + n > dst.numel()
            || (so | doff | bytes) % 4 != 0
        {
            return Err(Error::Shape {
                op: "copy_elements",
                detail: format!(
                    "{n} elements from {:?} {:?} at {src_at} to {:?} {:?} at {dst_at}",
                    src.shape(),
                    src.dtype(),
                    dst.shape(),
                    dst.dtype()
                ),
            });
        }
        if n > 0 {
            self.cmds.push(Cmd::Copy {
                src: src.clone(),
                src_offset: so,
                dst: dst.clone(),
                dst_offset: doff,
                bytes,
            });
        }
        Ok(())
    }

    /// Copies `t` as it is at this point of the recording into a mappable buffer, to read
    /// after the submission (see [`Readback`]).
    pub fn read_later(&mut self, t: &Tensor) -> Result<Readback> {
        let gpu = self.gpu;
        let bytes = t.byte_size();
        let staging = gpu.pool.alloc(
            &gpu.device,
            &gpu.limits,
            t.binding_size(),
            wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            "readback",
        )?;
        let index = Arc::new(Mutex::new(None));
        self.readbacks.push(index.clone());
        self.cmds.push(Cmd::Stage {
            src: t.clone(),
            staging: staging.clone(),
        });
        Ok(Readback {
            staging,
            bytes,
            label: t.label().into(),
            index,
        })
    }

    /// Zero-fills `t`.
    pub fn clear(&mut self, t: &Tensor) {
        self.cmds.push(Cmd::Clear(t.clone()));
    }

    /// A zeroed 2-element u32 flag for a kernel that checks `ids < limit` on the GPU (see
    /// `IndexCheck`). After the submission completes, [`Submission::finish`] turns a
    /// non-zero flag into [`Error::IndexOutOfRange`] naming the op, position and id.
    pub fn index_check(&mut self, op: &'static str, ids: &Tensor, limit: u32) -> Result<Tensor> {
        let flag = Tensor::empty(self.gpu, &[2], super::DType::U32, "index_check")?;
        self.clear(&flag);
        self.checks.push(IndexCheck {
            op,
            flag: flag.clone(),
            ids: ids.clone(),
            limit,
        });
        Ok(flag)
    }

    /// Encodes everything recorded into one command buffer and submits it.
    pub fn submit(self) -> Result<Submission> {
        self.encode()?.submit()
    }

    /// Encodes everything recorded into one command buffer without submitting it: the
    /// CPU's part of a recording (bind groups, encoding) done ahead, while the GPU runs
    /// earlier work; [`Encoded::submit`] then writes its parameters and submits it. Buffers
    /// the recording writes with `queue.write_buffer` before that (token ids) reach its
    /// commands: queued writes precede the next submission.
    pub fn encode(mut self) -> Result<Encoded<'g>> {
        let gpu = self.gpu;
        // Index checks' flags are staged in the same command buffer: reading them back
        // takes no submission of its own.
        let flags: Vec<Tensor> = self.checks.iter().map(|c| c.flag.clone()).collect();
        let staged = flags
            .iter()
            .map(|f| self.read_later(f))
            .collect::<Result<Vec<_>>>()?;
        let mut binds = gpu.binds.lock().unwrap();
        let uniform = if self.uniforms.is_empty() {
            None
        } else {
            Some(binds.uniform(gpu, self.uniforms.len() as u64)?)
        };
        let n_dispatch = self.dispatches() as u32;
        let queries = match self.timing {
            _ if n_dispatch == 0 => None,
            Timing::Off => None,
            Timing::EachDispatch => Some(Queries::new(gpu, n_dispatch)?),
            Timing::Whole => Some(Queries::new(gpu, 1)?),
        };
        // Each dispatch's bind group (cached: built once for its pipeline and buffers).
        let groups: Vec<Option<wgpu::BindGroup>> = self
            .cmds
            .iter()
            .map(|c| match c {
                Cmd::Dispatch {
                    pipe,
                    uniform_size,
                    tensors,
                    ..
                } => {
                    let storage = tensors.iter().map(|t| (t.buffer(), t.binding_size()));
                    Some(binds.group(gpu, pipe, *uniform_size, storage))
                }
                _ => None,
            })
            .collect();
        drop(binds);
        let (cb, err) = super::scoped(&gpu.device, wgpu::ErrorFilter::Validation, || {
            encode_commands(
                gpu,
                &self.label,
                &self.cmds,
                &groups,
                queries.as_ref().map(|q| (q, self.timing)),
            )
        });
        if let Some(message) = err {
            return Err(Error::Device(format!("{}: {message}", self.label)));
        }
        Ok(Encoded {
            gpu,
            cb,
            uniform,
            queries,
            n_dispatch,
            staged,
            rec: self,
        })
    }
}

/// A recording encoded into a command buffer, not yet submitted ([`Recorder::encode`]).
/// Dropped unsubmitted, it runs nothing and its buffers go back to the pool.
pub struct Encoded<'g> {
    gpu: &'g Gpu,
    cb: wgpu::CommandBuffer,
    /// The parameter buffer its bind groups use (the shared one when it was encoded).
    uniform: Option<wgpu::Buffer>,
    queries: Option<Queries>,
    n_dispatch: u32,
    /// Each index check's flag, staged at the end of the command buffer.
    staged: Vec<Readback>,
    rec: Recorder<'g>,
}

impl<'g> Encoded<'g> {
    /// Writes the parameters and submits the command buffer.
    pub fn submit(self) -> Result<Submission> {
        let Encoded {
            gpu,
            cb,
            uniform,
            queries,
            n_dispatch,
            staged,
            rec,
        } = self;
        // Held until the submit: the parameter buffer must carry this recording's
        // parameters when its commands run (queue order), not another recording's.
        let binds = gpu.binds.lock().unwrap();
        if let Some(u) = &uniform {
            gpu.queue.write_buffer(u, 0, &rec.uniforms);
        }
        let mut submitted = None;
        let ((), err) = super::scoped(&gpu.device, wgpu::ErrorFilter::Validation, || {
            let index = gpu.queue.submit([cb]);
            for r in &rec.readbacks {
                *r.lock().unwrap() = Some(index.clone());
            }
            submitted = Some(index);
        });
        drop(binds);
        if let Some(message) = err {
            return Err(Error::Device(format!("{}: {message}", rec.label)));
        }
        // Release buffers once the GPU is done with this submission.
        let mut keep: Vec<Arc<PooledBuffer>> = Vec::new();
        for c in &rec.cmds {
            match c {
                Cmd::Dispatch { tensors, .. } => {
                    keep.extend(tensors.iter().map(|t| t.pooled().clone()))
                }
                Cmd::Copy { src, dst, .. } => {
                    keep.extend([src.pooled().clone(), dst.pooled().clone()])
                }
                Cmd::Clear(t) => keep.push(t.pooled().clone()),
                Cmd::Stage { src, staging } => keep.extend([src.pooled().clone(), staging.clone()]),
            }
        }
        let done = Arc::new(AtomicBool::new(false));
        let flag = done.clone();
        gpu.queue
            .on_submitted_work_done(move || flag.store(true, Ordering::Release));
        gpu.pool.retire(done, keep);
        gpu.poll();
        gpu.check_errors()?;
        let names = if rec.timing == Timing::Whole {
            vec![(Arc::from(rec.label.as_str()), [0; 3])]
        } else {
            rec.cmds
                .iter()
                .filter_map(|c| match c {
                    Cmd::Dispatch { pipe, grid, .. } => Some((pipe.name.clone(), *grid)),
                    _ => None,
                })
                .collect()
        };
        Ok(Submission {
            queries,
            names,
            dispatches: n_dispatch as usize,
            checks: rec.checks.into_iter().zip(staged).collect(),
            index: submitted,
        })
    }
}

/// One command buffer of `cmds` (whose bind groups are `groups`, None for non-dispatches).
/// A run of dispatches shares one pass (wgpu inserts the barriers between them), except
/// with `Timing::EachDispatch`: then each gets a pass with its own timestamps. With
/// `Timing::Whole` the first pass writes the first timestamp and the last pass the second.
/// The queries are resolved at the end.
fn encode_commands(
    gpu: &Gpu,
    label: &str,
    cmds: &[Cmd],
    groups: &[Option<wgpu::BindGroup>],
    queries: Option<(&Queries, Timing)>,
) -> wgpu::CommandBuffer {
    let each = matches!(queries, Some((_, Timing::EachDispatch)));
    let last_dispatch = cmds
        .iter()
        .rposition(|c| matches!(c, Cmd::Dispatch { .. }))
        .unwrap_or(0);
    let mut enc = gpu
        .device
        .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(label) });
    let mut dispatched = 0u32;
    let mut i = 0;
    while i < cmds.len() {
        match &cmds[i] {
            Cmd::Copy {
                src,
                src_offset,
                dst,
                dst_offset,
                bytes,
            } => {
                enc.copy_buffer_to_buffer(
                    src.buffer(),
                    *src_offset,
                    dst.buffer(),
                    *dst_offset,
                    *bytes,
                );
                i += 1;
            }
            Cmd::Clear(t) => {
                enc.clear_buffer(t.buffer(), 0, Some(t.binding_size()));
                i += 1;
            }
            Cmd::Stage { src, staging } => {
                enc.copy_buffer_to_buffer(src.buffer(), 0, &staging.buffer, 0, src.binding_size());
                i += 1;
            }
            Cmd::Dispatch { .. } => {
                let run_end = cmds[i..]
                    .iter()
                    .position(|c| !matches!(c, Cmd::Dispatch { .. }))
                    .map_or(cmds.len(), |n| i + n);
                let timestamp_writes = queries.and_then(|(qs, timing)| match timing {
                    Timing::EachDispatch => Some(qs.writes(dispatched)),
                    Timing::Whole => qs.bracket(dispatched == 0, run_end > last_dispatch),
                    Timing::Off => None,
                });
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some(label),
                    timestamp_writes,
                });
                while let (
                    Some(Cmd::Dispatch {
                        pipe,
                        uniform_offset,
                        grid,
                        ..
                    }),
                    Some(Some(bg)),
                ) = (cmds.get(i), groups.get(i))
                {
                    pass.set_pipeline(&pipe.pipeline);
                    pass.set_bind_group(0, bg, &[*uniform_offset as u32]);
                    pass.dispatch_workgroups(grid[0], grid[1], grid[2]);
                    dispatched += 1;
                    i += 1;
                    if each {
                        break;
                    }
                }
            }
        }
    }
    if let Some((qs, _)) = queries {
        qs.resolve(&mut enc);
    }
    enc.finish()
}

/// Timestamp query sets and their readback buffers for one profiled submission.
struct Queries {
    sets: Vec<(wgpu::QuerySet, u32)>,
    resolve: Vec<wgpu::Buffer>,
    readback: Vec<wgpu::Buffer>,
}

impl Queries {
    fn new(gpu: &Gpu, n_dispatch: u32) -> Result<Queries> {
        let total = n_dispatch * 2;
        let mut q = Queries {
            sets: Vec::new(),
            resolve: Vec::new(),
            readback: Vec::new(),
        };
        let mut left = total;
        while left > 0 {
            let count = left.min(QUERIES_PER_SET);
            left -= count;
            let set = gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("timestamps"),
                ty: wgpu::QueryType::Timestamp,
                count,
            });
            let bytes = count as u64 * 8;
            let mk = |usage| {
                gpu.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("timestamps"),
                    size: bytes,
                    usage,
                    mapped_at_creation: false,
                })
            };
            q.resolve.push(mk(
                wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC
            ));
            q.readback.push(mk(
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST
            ));
            q.sets.push((set, count));
        }
        Ok(q)
    }

    /// Begin/end writes for dispatch `i`.
    fn writes(&self, i: u32) -> wgpu::ComputePassTimestampWrites<'_> {
        let q = i * 2;
        let (set, _) = &self.sets[(q / QUERIES_PER_SET) as usize];
        let base = q % QUERIES_PER_SET;
        wgpu::ComputePassTimestampWrites {
            query_set: set,
            beginning_of_pass_write_index: Some(base),
            end_of_pass_write_index: Some(base + 1),
        }
    }

    /// `Timing::Whole`'s writes for a pass: the first timestamp if it is the first pass, the
    /// second if it is the last.
    fn bracket(&self, first: bool, last: bool) -> Option<wgpu::ComputePassTimestampWrites<'_>> {
        (first || last).then(|| wgpu::ComputePassTimestampWrites {
            query_set: &self.sets[0].0,
            beginning_of_pass_write_index: first.then_some(0),
            end_of_pass_write_index: last.then_some(1),
        })
    }

    fn resolve(&self, enc: &mut wgpu::CommandEncoder) {
        for (k, (set, count)) in self.sets.iter().enumerate() {
            enc.resolve_query_set(set, 0..*count, &self.resolve[k], 0);
            enc.copy_buffer_to_buffer(&self.resolve[k], 0, &self.readback[k], 0, *count as u64 * 8);
        }
    }
}

/// A submitted recorder. Holds what is needed to read its timestamps back.
pub struct Submission {
    queries: Option<Queries>,
    /// What the trace's events are: each dispatch's kernel and grid, or the recorder's
    /// label (`Timing::Whole`, grid zeros).
    names: Vec<(Arc<str>, [u32; 3])>,
    dispatches: usize,
    /// Each check with its staged flag.
    checks: Vec<(IndexCheck, Readback)>,
    /// The queue's index of it.
    index: Option<wgpu::SubmissionIndex>,
}

impl Submission {
    /// Number of dispatches in the submission.
    pub fn dispatches(&self) -> usize {
        self.dispatches
    }

    /// Whether kernels in this submission validate indices on the GPU (then
    /// [`Submission::finish`] must be awaited to learn about bad input).
    pub fn has_checks(&self) -> bool {
        !self.checks.is_empty()
    }

    /// Waits for the GPU, reports the first failed index check as an error, and returns the
    /// per-dispatch GPU times, or the whole submission's (empty unless the recorder was a
    /// profiling or timed one on an adapter with timestamp queries).
    pub async fn finish(self, gpu: &Gpu) -> Result<Trace> {
        for (c, staged) in &self.checks {
            let flag = staged.u32s(gpu).await?;
            if flag[0] > 0 {
                let position = (u32::MAX - flag[1]) as usize;
                let ids = c.ids.to_vec_u32(gpu).await?;
                return Err(Error::IndexOutOfRange {
                    op: c.op,
                    position,
                    id: ids.get(position).copied().unwrap_or(u32::MAX),
                    limit: c.limit,
                    count: flag[0] as usize,
                });
            }
        }
        let Some(q) = self.queries else {
            return Ok(Trace::default());
        };
        let mut ticks: Vec<u64> = Vec::new();
        for buf in &q.readback {
            // (Only this submission waited for: later ones keep running.)
            let mapped = super::map_read(gpu, buf, buf.size(), self.index.clone())
                .await
                .map_err(|reason| Error::Readback {
                    label: "timestamps".into(),
                    reason,
                })?;
            let view = mapped.0.get_mapped_range(..).map_err(|e| Error::Readback {
                label: "timestamps".into(),
                reason: e.to_string(),
            })?;
            ticks.extend_from_slice(bytemuck::cast_slice(&view));
        }
        let period = gpu.queue.get_timestamp_period() as f64;
        let t0 = ticks.first().copied().unwrap_or(0);
        let events = self
            .names
            .iter()
            .enumerate()
            .map(|(i, (name, grid))| {
                let (b, e) = (ticks[2 * i], ticks[2 * i + 1]);
                TraceEvent {
                    name: name.to_string(),
                    grid: *grid,
                    start_ns: b.wrapping_sub(t0) as f64 * period,
                    dur_ns: e.saturating_sub(b) as f64 * period,
                }
            })
            .collect();
        Ok(Trace {
            events,
            origin_ns: t0 as f64 * period,
        })
    }

    /// [`Submission::finish`] after all submitted work: the buffers it used are back in
    /// the pool and device errors reported.
    pub async fn settle(self, gpu: &Gpu) -> Result<Trace> {
        gpu.settle().await?;
        self.finish(gpu).await
    }

    /// Blocking [`Submission::settle`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn wait(self, gpu: &Gpu) -> Result<Trace> {
        pollster::block_on(self.settle(gpu))
    }
}
