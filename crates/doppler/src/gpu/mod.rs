//! The GPU layer: adapter and device ([`Gpu`]), tensors, the buffer pool, the command
//! recorder, the pipeline cache and timing traces.

mod binds;
#[cfg(not(target_arch = "wasm32"))]
mod coop_emulate;
mod pipeline;
mod pool;
mod recorder;
#[cfg(not(target_arch = "wasm32"))]
pub mod spirv;
mod tensor;
pub mod trace;

pub use pipeline::{Binding, Kernel, PipelineCache, Shader};
pub use pool::{BufferPool, PoolStats};
pub use recorder::{Encoded, Grid, Readback, Recorder, Submission, FLUSH_EVERY};
pub use tensor::{DType, Tensor};
pub use trace::{Trace, TraceEvent};

use crate::error::{Error, Result};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

/// Runtime checks compiled into shaders (see [`GpuOptions::shader_checks`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ShaderChecks {
    All,
    #[default]
    Bounds,
    Off,
}

/// How to choose an adapter. Empty fields mean "the default": the first discrete GPU,
/// then integrated, virtual, CPU.
#[derive(Clone, Debug)]
pub struct GpuOptions {
    /// Case-insensitive substring of the adapter name (`DOPPLER_ADAPTER`).
    pub adapter: Option<String>,
    /// vulkan, metal, dx12, gl or webgpu (`DOPPLER_BACKEND`).
    pub backend: Option<String>,
    /// Which runtime checks wgpu compiles into every shader (`DOPPLER_SHADER_CHECKS`):
    /// `bounds` (default: bounds checks on every buffer access, no loop-iteration counters,
    /// as every loop of ours ends by its parameters; the counters cost ~40% of decode
    /// speed on the H200), `all` (`on`: both), or `off` (neither: a few % faster, safe
    /// only because our kernels check their own indices). Native only; the browser keeps
    /// its own.
    pub shader_checks: ShaderChecks,
    /// How f32 matrix products are computed (`DOPPLER_MATMUL`): see [`MatmulMode`].
    pub matmul: MatmulMode,
    /// Products of quantized weights with many rows of x (prompts, batches) on cooperative
    /// matrices where the adapter has them (`quant_coop.wgsl`: x and W's values rounded to
    /// f16, f32 sums, as llama.cpp's prompt products on tensor cores), and prompts'
    /// attention over the KV cache too (head dims to 128,
    /// [`crate::ops::kvcache::prompt_on_coop`]). Default on; `DOPPLER_QUANT_COOP=off`
    /// keeps both f32 (the f32 tiled kernels, ~4x slower on the H200).
    pub quant_coop: bool,
    /// Cooperative matrices emulated in plain WGSL where the adapter lacks them
    /// (`DOPPLER_EMULATE_COOP=on`; native only; see `gpu/coop_emulate.rs`): for testing
    /// the cooperative-matrix kernels on lavapipe, far slower than their f32 forms.
    pub emulate_coop: bool,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            adapter: None,
            backend: None,
            shader_checks: ShaderChecks::default(),
            matmul: MatmulMode::default(),
            quant_coop: true,
            emulate_coop: false,
        }
    }
}

/// How f32 matrix products are computed. The tensor-core modes need cooperative matrices,
/// f16 and subgroups of 32; without them products stay [`MatmulMode::F32`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MatmulMode {
    /// f32 arithmetic (`matmul.wgsl`).
    #[default]
    F32,
    /// f32 operands on cooperative matrices (tensor cores), each scaled by a power of two
    /// per tensor and split into two f16 halves (hi + lo), three products (hi hi, hi lo,
    /// lo hi) into f32 sums: 22 of f32's 24 significant bits per operand, f32's range (as
    /// cuBLAS emulates f32 on bf16 tensor cores).
    F16x3,
    /// Operands rounded to f16 on cooperative matrices, f32 sums (like PyTorch's TF32 or
    /// autocast: about 3 decimal digits per operand, f16's range: train with loss scaling).
    F16,
}

impl MatmulMode {
    pub const ALL: [MatmulMode; 3] = [MatmulMode::F32, MatmulMode::F16x3, MatmulMode::F16];
    /// The names of [`MatmulMode::ALL`], in order (`--matmul`'s values).
    pub const NAMES: [&'static str; 3] = ["f32", "f16x3", "f16"];

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    /// From `f32`, `f16x3` or `f16`.
    pub fn parse(s: &str) -> Option<MatmulMode> {
        Self::ALL.into_iter().find(|m| m.name() == s)
    }
}

impl GpuOptions {
    /// Options from `DOPPLER_ADAPTER` and `DOPPLER_BACKEND`.
    pub fn from_env() -> Self {
        let get = |k| std::env::var(k).ok().filter(|v: &String| !v.is_empty());
        GpuOptions {
            adapter: get("DOPPLER_ADAPTER"),
            backend: get("DOPPLER_BACKEND"),
            shader_checks: match get("DOPPLER_SHADER_CHECKS").as_deref() {
                Some("off") => ShaderChecks::Off,
                None | Some("bounds") => ShaderChecks::Bounds,
                Some("on" | "all") => ShaderChecks::All,
                Some(other) => {
                    tracing::warn!(
                        "DOPPLER_SHADER_CHECKS={other:?} is not all, bounds or off: all checks on"
                    );
                    ShaderChecks::All
                }
            },
            matmul: match get("DOPPLER_MATMUL").as_deref() {
                None => MatmulMode::F32,
                Some(v) => MatmulMode::parse(v).unwrap_or_else(|| {
                    tracing::warn!(
                        "DOPPLER_MATMUL={v:?} is not f32, f16x3 or f16: products stay f32"
                    );
                    MatmulMode::F32
                }),
            },
            quant_coop: on_off("DOPPLER_QUANT_COOP", get("DOPPLER_QUANT_COOP"), true),
            emulate_coop: on_off("DOPPLER_EMULATE_COOP", get("DOPPLER_EMULATE_COOP"), false),
        }
    }
}

/// A variable's `on` / `off` (unset: `default`; anything else: a warning, `default`).
fn on_off(name: &str, value: Option<String>, default: bool) -> bool {
    match value.as_deref() {
        None => default,
        Some("on") => true,
        Some("off") => false,
        Some(other) => {
            let d = if default { "on" } else { "off" };
            tracing::warn!("{name}={other:?} is not on or off: {d}");
            default
        }
    }
}

/// Features we use when the adapter has them. Everything else stays off so that
/// validation matches what the kernels were written against.
fn wanted_features() -> wgpu::Features {
    wgpu::Features::SHADER_F16
        | wgpu::Features::SUBGROUP
        | wgpu::Features::SUBGROUP_BARRIER
        | wgpu::Features::TIMESTAMP_QUERY
        | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS
        | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES
        | wgpu::Features::SHADER_INT64
        | wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
        | passthrough()
}

/// Natively: the cooperative-matrix kernels' SPIR-V, written and patched by gpu/spirv.rs.
fn passthrough() -> wgpu::Features {
    if cfg!(target_arch = "wasm32") {
        wgpu::Features::empty()
    } else {
        wgpu::Features::PASSTHROUGH_SHADERS
    }
}

fn parse_backend(name: &str) -> Result<wgpu::Backends> {
    Ok(match name.to_ascii_lowercase().as_str() {
        "vulkan" | "vk" => wgpu::Backends::VULKAN,
        "metal" => wgpu::Backends::METAL,
        "dx12" | "d3d12" => wgpu::Backends::DX12,
        "gl" | "gles" | "opengl" => wgpu::Backends::GL,
        "webgpu" | "browser" => wgpu::Backends::BROWSER_WEBGPU,
        _ => return Err(Error::UnknownBackend(name.to_string())),
    })
}

#[cfg(not(target_arch = "wasm32"))]
fn type_rank(t: wgpu::DeviceType) -> u32 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    }
}

/// Whether `matmul_coop.wgsl` can run: cooperative matrices, f16, and subgroups of
/// exactly 32 invocations (its layout of subgroups in the workgroup); or, `emulated`,
/// f16 alone (see [`GpuOptions::emulate_coop`]).
fn coop_possible(features: wgpu::Features, info: &wgpu::AdapterInfo, emulated: bool) -> bool {
    if emulated {
        return features.contains(wgpu::Features::SHADER_F16);
    }
    features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX | wgpu::Features::SHADER_F16)
        && info.subgroup_min_size == 32
        && info.subgroup_max_size == 32
}

/// The adapter, device and queue, plus the objects every op shares: the buffer pool and
/// the pipeline cache. Create one per process and pass `&Gpu` around.
pub struct Gpu {
    pub adapter: wgpu::Adapter,
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub features: wgpu::Features,
    pub limits: wgpu::Limits,
    pub pool: BufferPool,
    pub pipelines: PipelineCache,
    /// See [`GpuOptions::shader_checks`].
    pub shader_checks: ShaderChecks,
    /// [`GpuOptions::matmul`] where possible here (the tensor-core modes need cooperative
    /// matrices, f16 and subgroups of exactly 32: the kernel's layout), else f32.
    pub matmul: MatmulMode,
    /// Whether quantized products of many rows of x run on cooperative matrices
    /// (`quant_coop.wgsl`): [`GpuOptions::quant_coop`] where possible
    /// ([`Gpu::coop_matmul_possible`]).
    pub quant_coop: bool,
    /// Whether the cooperative-matrix kernels run emulated ([`GpuOptions::emulate_coop`]
    /// asked for, and the adapter lacks cooperative matrices).
    pub coop_emulated: bool,
    /// Bind groups and the shared parameter buffer (see `binds.rs`); held while a
    /// recorder writes its parameters and submits.
    pub(crate) binds: Mutex<binds::Binds>,
    /// Errors the device reported outside any error scope; drained by [`Gpu::check_errors`].
    errors: Arc<Mutex<Vec<String>>>,
}

impl Gpu {
    /// Opens the adapter chosen by `opts` with every useful feature it offers and its own limits.
    pub async fn new(opts: &GpuOptions) -> Result<Gpu> {
        let backends = match &opts.backend {
            Some(b) => parse_backend(b)?,
            None => wgpu::Backends::all(),
        };
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = backends;
        let instance = wgpu::Instance::new(desc);
        let adapter = Self::pick_adapter(&instance, backends, opts).await?;
        let info = adapter.get_info();
        let features = adapter.features() & wanted_features();
        let limits = adapter.limits();
        let experimental = if features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
            // SAFETY: cooperative matrices are only used by kernels that check the feature,
            // and those kernels are validated by naga and tested against CPU references.
            unsafe { wgpu::ExperimentalFeatures::enabled() }
        } else {
            wgpu::ExperimentalFeatures::disabled()
        };
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("doppler"),
                required_features: features,
                required_limits: limits.clone(),
                experimental_features: experimental,
                memory_hints: wgpu::MemoryHints::Performance,
                trace: wgpu::Trace::Off,
            })
            .await
            .map_err(|e| Error::RequestDevice {
                adapter: info.name.clone(),
                reason: e.to_string(),
            })?;
        let errors = Arc::new(Mutex::new(Vec::new()));
        let sink = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            tracing::error!("wgpu: {e}");
            sink.lock().unwrap().push(e.to_string());
        }));
        tracing::info!(adapter = %info.name, backend = ?info.backend, "opened GPU");
        let coop_emulated = opts.emulate_coop
            && !cfg!(target_arch = "wasm32")
            && !features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
            && features.contains(wgpu::Features::SHADER_F16);
        if coop_emulated {
            tracing::warn!(adapter = %info.name, "cooperative matrices emulated (DOPPLER_EMULATE_COOP): for tests, slow");
        }
        let matmul = match opts.matmul {
            MatmulMode::F32 => MatmulMode::F32,
            m if coop_possible(features, &info, coop_emulated) => m,
            m => {
                tracing::warn!(adapter = %info.name, "{} matrix products asked for, but the adapter lacks cooperative matrices, f16 or subgroups of 32: products stay f32", m.name());
                MatmulMode::F32
            }
        };
        let quant_coop = opts.quant_coop && coop_possible(features, &info, coop_emulated);
        Ok(Gpu {
            pool: BufferPool::new(),
            pipelines: PipelineCache::new(),
            adapter,
            device,
            queue,
            info,
            features,
            limits,
            shader_checks: match cfg!(target_arch = "wasm32") {
                true => ShaderChecks::All,
                false => opts.shader_checks,
            },
            matmul,
            quant_coop,
            coop_emulated,
            binds: Mutex::new(binds::Binds::default()),
            errors,
        })
    }

    /// The adapter, its features and limits, and the kernel paths chosen from them (what
    /// `doppler info --json` prints and the browser's `init()` returns).
    pub fn report(&self) -> serde_json::Value {
        let (i, l) = (&self.info, &self.limits);
        let features: Vec<String> = self
            .features
            .iter_names()
            .map(|(n, _)| n.to_string())
            .collect();
        let coop: Vec<String> = self
            .adapter
            .cooperative_matrix_properties()
            .iter()
            .map(|p| {
                format!(
                    "{}x{}x{} {:?}->{:?}",
                    p.m_size, p.n_size, p.k_size, p.ab_type, p.cr_type
                )
            })
            .collect();
        let has = |f| self.features.contains(f);
        serde_json::json!({
            "name": i.name, "backend": format!("{:?}", i.backend),
            "device_type": format!("{:?}", i.device_type),
            "driver": i.driver, "driver_info": i.driver_info, "vendor": i.vendor, "device": i.device,
            "subgroup_min_size": i.subgroup_min_size, "subgroup_max_size": i.subgroup_max_size,
            "features": features, "cooperative_matrix": coop,
            "limits": {
                "max_buffer_size": l.max_buffer_size,
                "max_storage_buffer_binding_size": l.max_storage_buffer_binding_size,
                "max_compute_workgroup_storage_size": l.max_compute_workgroup_storage_size,
                "max_compute_invocations_per_workgroup": l.max_compute_invocations_per_workgroup,
                "max_compute_workgroups_per_dimension": l.max_compute_workgroups_per_dimension,
                "max_storage_buffers_per_shader_stage": l.max_storage_buffers_per_shader_stage,
                "min_uniform_buffer_offset_alignment": l.min_uniform_buffer_offset_alignment,
            },
            "matmul": self.matmul.name(),
            // Every kernel has an f32, subgroup-free form; f16, subgroups and cooperative
            // matrices only add the tensor-core products and attention.
            "paths": {
                "matmul": match self.matmul {
                    MatmulMode::F32 => "f32 tiled",
                    MatmulMode::F16x3 => "f16x3 cooperative matrices",
                    MatmulMode::F16 => "f16 cooperative matrices",
                },
                "quantized_prompts": match self.quant_coop {
                    true => "f16 cooperative matrices",
                    false => "f32 tiled",
                },
                "attention_d64": crate::ops::attention::auto_path(self, 64),
                // Prompts over a KV cache at Llama 3 8B's head dim: the cooperative forward,
                // or one workgroup a (query, head).
                "prompt_attention_d128": match crate::ops::kvcache::prompt_on_coop(self, 128) {
                    true => "coop",
                    false => "rows",
                },
                "shader_f16": has(wgpu::Features::SHADER_F16),
                "subgroups": has(wgpu::Features::SUBGROUP),
                "timestamps": has(wgpu::Features::TIMESTAMP_QUERY),
                "per_kernel_times": has(wgpu::Features::TIMESTAMP_QUERY),
            },
        })
    }

    /// Whether this adapter can run the cooperative-matrix products (see [`MatmulMode`]),
    /// asked for or not.
    pub fn coop_matmul_possible(&self) -> bool {
        coop_possible(self.features, &self.info, self.coop_emulated)
    }

    /// Blocking [`Gpu::new`] for native programs.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new_blocking(opts: &GpuOptions) -> Result<Gpu> {
        pollster::block_on(Self::new(opts))
    }

    #[cfg(not(target_arch = "wasm32"))]
    async fn pick_adapter(
        instance: &wgpu::Instance,
        backends: wgpu::Backends,
        opts: &GpuOptions,
    ) -> Result<wgpu::Adapter> {
        let mut adapters = instance.enumerate_adapters(backends).await;
        let names: Vec<String> = adapters
            .iter()
            .map(|a| {
                let i = a.get_info();
                format!("{} ({:?}, {:?})", i.name, i.backend, i.device_type)
            })
            .collect();
        if adapters.is_empty() {
            let detail = match &opts.backend {
                Some(b) => format!(" for backend {b}"),
                None => String::new(),
            };
            return Err(Error::NoAdapter { detail });
        }
        if let Some(want) = &opts.adapter {
            let w = want.to_ascii_lowercase();
            adapters.retain(|a| a.get_info().name.to_ascii_lowercase().contains(&w));
            if adapters.is_empty() {
                return Err(Error::AdapterNotFound {
                    wanted: want.clone(),
                    available: names.join(", "),
                });
            }
        }
        // Stable sort: among equal types keep the driver's order.
        adapters.sort_by_key(|a| type_rank(a.get_info().device_type));
        Ok(adapters.remove(0))
    }

    #[cfg(target_arch = "wasm32")]
    async fn pick_adapter(
        instance: &wgpu::Instance,
        _backends: wgpu::Backends,
        opts: &GpuOptions,
    ) -> Result<wgpu::Adapter> {
        let adapter = instance
            .request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                ..Default::default()
            })
            .await
            .map_err(|e| {
                // wgpu's text lists its backends: noise to a visitor.
                tracing::debug!("request_adapter: {e}");
                Error::NoWebGpu {
                    detail: ": it offers no GPU adapter (WebGPU turned off, or the GPU \
                             blocklisted: chrome://gpu tells)"
                        .into(),
                }
            })?;
        if let Some(want) = &opts.adapter {
            let name = adapter.get_info().name;
            if !name
                .to_ascii_lowercase()
                .contains(&want.to_ascii_lowercase())
            {
                return Err(Error::AdapterNotFound {
                    wanted: want.clone(),
                    available: name,
                });
            }
        }
        Ok(adapter)
    }

    /// A new command recorder: record many ops, then submit them at once.
    pub fn recorder(&self, label: &str) -> Recorder<'_> {
        Recorder::new(self, label, recorder::Timing::Off)
    }

    /// A recorder that writes a GPU timestamp around every dispatch (needs `TIMESTAMP_QUERY`;
    /// without it the trace stays empty).
    pub fn profiling_recorder(&self, label: &str) -> Recorder<'_> {
        self.timestamped(label, recorder::Timing::EachDispatch)
    }

    /// A recorder whose trace is one event, the GPU time from the start of its first pass
    /// to the end of its last, its dispatches encoded as usual (needs `TIMESTAMP_QUERY`;
    /// without it the trace stays empty).
    pub fn timed_recorder(&self, label: &str) -> Recorder<'_> {
        self.timestamped(label, recorder::Timing::Whole)
    }

    fn timestamped(&self, label: &str, timing: recorder::Timing) -> Recorder<'_> {
        let on = self.features.contains(wgpu::Features::TIMESTAMP_QUERY);
        let timing = if on { timing } else { recorder::Timing::Off };
        Recorder::new(self, label, timing)
    }

    /// Records `f` into a fresh recorder and submits it: the "run now" form of any op.
    /// Returns without waiting, unless a kernel validates its input on the GPU (token ids):
    /// then it waits, so that bad input comes back as an error here.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn run<T>(&self, f: impl FnOnce(&mut Recorder<'_>) -> Result<T>) -> Result<T> {
        let mut rec = self.recorder("run");
        let out = f(&mut rec)?;
        let sub = rec.submit()?;
        if sub.has_checks() {
            sub.wait(self)?;
        }
        Ok(out)
    }

    /// Records `f` into a fresh recorder, submits it and waits for its index checks.
    pub async fn run_async<T>(&self, f: impl FnOnce(&mut Recorder<'_>) -> Result<T>) -> Result<T> {
        let mut rec = self.recorder("run");
        let out = f(&mut rec)?;
        let sub = rec.submit()?;
        if sub.has_checks() {
            sub.finish(self).await?;
        }
        Ok(out)
    }

    /// Returns (and clears) the first error the device reported outside an error scope.
    pub fn check_errors(&self) -> Result<()> {
        let mut errs = self.errors.lock().unwrap();
        if errs.is_empty() {
            return Ok(());
        }
        let msg = errs.join("; ");
        errs.clear();
        Err(Error::Device(msg))
    }

    /// Blocks until all submitted work has finished and buffers it used are back in the pool.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| Error::Device(e.to_string()))?;
        self.pool.collect();
        self.check_errors()
    }

    /// Waits until all submitted work has finished, returns the buffers it used to the
    /// pool and reports device errors: [`Gpu::wait`] that does not block (the browser's
    /// `onSubmittedWorkDone`).
    pub async fn settle(&self) -> Result<()> {
        #[cfg(not(target_arch = "wasm32"))]
        {
            self.wait()
        }
        #[cfg(target_arch = "wasm32")]
        {
            let state = Arc::new(Mutex::new(MapState::default()));
            let s = state.clone();
            self.queue.on_submitted_work_done(move || {
                let mut st = s.lock().unwrap();
                st.result = Some(Ok(()));
                if let Some(w) = st.waker.take() {
                    w.wake();
                }
            });
            MapFuture {
                state,
                device: self.device.clone(),
                until: None,
            }
            .await
            .map_err(Error::Device)?;
            self.pool.collect();
            self.check_errors()
        }
    }

    /// Processes finished work without blocking (returns finished buffers to the pool).
    pub fn poll(&self) {
        let _ = self.device.poll(wgpu::PollType::Poll);
        self.pool.collect();
    }

    /// Bind groups built so far and dispatches that reused a cached one.
    pub fn bind_group_stats(&self) -> (u64, u64) {
        let b = self.binds.lock().unwrap();
        (b.built, b.reused)
    }

    /// Largest workgroup count per grid dimension (65535 on most devices).
    pub fn max_workgroups_per_dim(&self) -> u32 {
        self.limits.max_compute_workgroups_per_dimension
    }
}

/// Runs `f` inside an error scope; returns its value and the error message, if any.
/// Natively the scope resolves at once; in the browser errors reach the uncaptured handler.
pub(crate) fn scoped<T>(
    device: &wgpu::Device,
    filter: wgpu::ErrorFilter,
    f: impl FnOnce() -> T,
) -> (T, Option<String>) {
    #[cfg(not(target_arch = "wasm32"))]
    {
        let scope = device.push_error_scope(filter);
        let value = f();
        // The validation error's description (its Display is just "Validation Error").
        let err = pollster::block_on(scope.pop()).map(|e| match e {
            wgpu::Error::Validation { description, .. } => description,
            other => other.to_string(),
        });
        (value, err)
    }
    #[cfg(target_arch = "wasm32")]
    {
        let _ = (device, filter);
        (f(), None)
    }
}

/// Maps `buffer[..size]` for reading. Resolves when `map_async`'s callback has run: the
/// browser runs it from its event loop; natively nothing does unless the device is polled,
/// so there the future waits on the device: for submission `until` when given (later
/// submissions keep running), else for everything submitted.
pub(crate) async fn map_read<'b>(
    gpu: &Gpu,
    buffer: &'b wgpu::Buffer,
    size: u64,
    until: Option<wgpu::SubmissionIndex>,
) -> std::result::Result<Unmap<'b>, String> {
    let state = Arc::new(Mutex::new(MapState::default()));
    let s = state.clone();
    buffer.map_async(wgpu::MapMode::Read, 0..size, move |r| {
        let mut st = s.lock().unwrap();
        st.result = Some(r.map_err(|e| e.to_string()));
        if let Some(w) = st.waker.take() {
            w.wake();
        }
    });
    MapFuture {
        state,
        device: gpu.device.clone(),
        until,
    }
    .await?;
    Ok(Unmap(buffer))
}

/// A buffer [`map_read`] mapped, unmapped when this is dropped: also where reading its bytes
/// fails or panics, so that no buffer goes back to the pool (and into a submission) mapped.
pub(crate) struct Unmap<'b>(pub(crate) &'b wgpu::Buffer);

impl Drop for Unmap<'_> {
    fn drop(&mut self) {
        self.0.unmap();
    }
}

#[derive(Default)]
struct MapState {
    result: Option<std::result::Result<(), String>>,
    waker: Option<Waker>,
}

struct MapFuture {
    state: Arc<Mutex<MapState>>,
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    device: wgpu::Device,
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    until: Option<wgpu::SubmissionIndex>,
}

impl Future for MapFuture {
    type Output = std::result::Result<(), String>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            {
                let mut st = self.state.lock().unwrap();
                if let Some(r) = st.result.take() {
                    return Poll::Ready(r);
                }
                st.waker = Some(cx.waker().clone());
            }
            #[cfg(target_arch = "wasm32")]
            return Poll::Pending;
            #[cfg(not(target_arch = "wasm32"))]
            {
                let wait = wgpu::PollType::Wait {
                    submission_index: self.until.clone(),
                    timeout: None,
                };
                if let Err(e) = self.device.poll(wait) {
                    return Poll::Ready(Err(e.to_string()));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::MatmulMode;

    #[test]
    fn matmul_modes_round_trip_their_names() {
        for (i, m) in MatmulMode::ALL.into_iter().enumerate() {
            assert_eq!(m as usize, i);
            assert_eq!(MatmulMode::parse(m.name()), Some(m));
        }
        assert_eq!(MatmulMode::parse("f16x3"), Some(MatmulMode::F16x3));
        assert_eq!(MatmulMode::parse("bf16"), None);
    }
}
