//! Compute pipelines, built once per (shader, entry point, override constants) and reused.

use super::{Gpu, ShaderChecks};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A WGSL file embedded in the binary. `crate::shaders::ALL` lists every one.
pub struct Shader {
    pub name: &'static str,
    /// WGSL shared with other files, put before `source` (quant.wgsl's and
    /// quant_coop.wgsl's block decoding); "" for most.
    pub prelude: &'static str,
    pub source: &'static str,
}

impl Shader {
    /// The whole WGSL module: the prelude, then the file's own text.
    pub fn text(&self) -> std::borrow::Cow<'static, str> {
        match self.prelude {
            "" => self.source.into(),
            pre => with_prelude(pre, self.source).into(),
        }
    }
}

/// `prelude` before `own`, `own`'s `enable` directives first (WGSL wants them before any
/// declaration).
fn with_prelude(prelude: &str, own: &str) -> String {
    let (enables, rest): (Vec<&str>, Vec<&str>) =
        own.lines().partition(|l| l.starts_with("enable "));
    format!("{}\n{prelude}\n{}", enables.join("\n"), rest.join("\n"))
}

/// How an entry point uses a storage buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binding {
    Read,
    ReadWrite,
}

/// One entry point and its bind-group layout: binding 0 is always the uniform parameter
/// block (bound at a dynamic offset); `storage` lists the storage bindings (binding number, access) in the order the
/// recorder's `tensors` argument fills them. A file's entry points may use different
/// subsets of its bindings.
pub struct Kernel {
    pub shader: &'static Shader,
    pub entry: &'static str,
    pub storage: &'static [(u32, Binding)],
    /// Features the entry point needs (e.g. `SHADER_F16`); checked before building.
    pub features: wgpu::Features,
}

impl Kernel {
    /// An entry point that needs no optional GPU feature.
    pub const fn new(
        shader: &'static Shader,
        entry: &'static str,
        storage: &'static [(u32, Binding)],
    ) -> Kernel {
        Kernel {
            shader,
            entry,
            storage,
            features: wgpu::Features::empty(),
        }
    }

    pub fn name(&self) -> String {
        format!("{}.{}", self.shader.name, self.entry)
    }
}

pub(crate) struct CachedPipeline {
    pub pipeline: wgpu::ComputePipeline,
    pub layout: wgpu::BindGroupLayout,
    pub storage: &'static [(u32, Binding)],
    /// "shader.entry[constants]": pipeline label and trace name.
    pub name: Arc<str>,
}

/// Most override constants a pipeline takes.
const MAX_CONSTANTS: usize = 12;

/// (shader, entry point, override constants and their values' bits), kept inline: every
/// dispatch looks its pipeline up, and the lookup allocates nothing.
#[derive(Clone, Copy)]
struct Key {
    shader: &'static str,
    entry: &'static str,
    constants: [(&'static str, u64); MAX_CONSTANTS],
    n: usize,
}

impl Key {
    fn constants(&self) -> &[(&'static str, u64)] {
        &self.constants[..self.n]
    }
}

impl PartialEq for Key {
    fn eq(&self, o: &Key) -> bool {
        self.shader == o.shader && self.entry == o.entry && self.constants() == o.constants()
    }
}
impl Eq for Key {}
impl std::hash::Hash for Key {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        (self.shader, self.entry, self.constants()).hash(h);
    }
}

/// FxHash (rustc's): a multiply and a rotate a word. The caches' keys are a few words and
/// names, looked up on every dispatch; SipHash's resistance to chosen keys is not needed.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

impl std::hash::Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.write_u64(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        for &b in chunks.remainder() {
            self.write_u64(b as u64);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

pub(crate) type FxMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<FxHasher>>;

#[derive(Default)]
pub struct PipelineCache {
    modules: Mutex<HashMap<&'static str, wgpu::ShaderModule>>,
    pipelines: Mutex<FxMap<Key, Arc<CachedPipeline>>>,
}

impl PipelineCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of pipelines built so far.
    pub fn len(&self) -> usize {
        self.pipelines.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn get(
        &self,
        gpu: &Gpu,
        kernel: &Kernel,
        constants: &[(&'static str, f64)],
    ) -> Result<Arc<CachedPipeline>> {
        if constants.len() > MAX_CONSTANTS {
            return Err(Error::Invalid {
                op: kernel.entry,
                detail: format!(
                    "{} override constants, at most {MAX_CONSTANTS}",
                    constants.len()
                ),
            });
        }
        let mut key = Key {
            shader: kernel.shader.name,
            entry: kernel.entry,
            constants: [("", 0); MAX_CONSTANTS],
            n: constants.len(),
        };
        for (slot, (k, v)) in key.constants.iter_mut().zip(constants) {
            *slot = (k, v.to_bits());
        }
        if let Some(p) = self.pipelines.lock().unwrap().get(&key) {
            return Ok(p.clone());
        }
        let emulated = gpu.coop_emulated
            && kernel
                .features
                .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX);
        let emulates = match emulated {
            true => wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
            false => wgpu::Features::empty(),
        };
        let missing = kernel.features - gpu.features - emulates;
        if !missing.is_empty() {
            return Err(Error::MissingFeature {
                op: kernel.entry,
                feature: feature_name(missing),
            });
        }
        let name: Arc<str> = if constants.is_empty() {
            kernel.name().into()
        } else {
            let c: Vec<String> = constants.iter().map(|(k, v)| format!("{k}={v}")).collect();
            format!("{}[{}]", kernel.name(), c.join(",")).into()
        };
        // Cooperative-matrix kernels on Vulkan: a module per pipeline, constants applied
        // (gpu/spirv.rs says why); others: the shader's module, shared.
        #[cfg(not(target_arch = "wasm32"))]
        let (module, constants) = if emulated {
            (self.emulated_module(gpu, kernel.shader)?, constants)
        } else if super::spirv::wanted(gpu, kernel) {
            let text = shader_source(kernel.shader)?;
            let m = super::spirv::module(gpu, kernel, &text, constants, &name)?;
            (m, &[][..])
        } else {
            (self.module(gpu, kernel.shader)?, constants)
        };
        #[cfg(target_arch = "wasm32")]
        let module = self.module(gpu, kernel.shader)?;
        let mut entries = vec![wgpu::BindGroupLayoutEntry {
            binding: 0,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Uniform,
                // Parameters of all dispatches share one buffer (gpu/binds.rs).
                has_dynamic_offset: true,
                min_binding_size: None,
            },
            count: None,
        }];
        for &(binding, b) in kernel.storage {
            entries.push(wgpu::BindGroupLayoutEntry {
                binding,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage {
                        read_only: b == Binding::Read,
                    },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            });
        }
        let (built, err) = super::scoped(&gpu.device, wgpu::ErrorFilter::Validation, || {
            let layout = gpu
                .device
                .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                    label: Some(&name),
                    entries: &entries,
                });
            let pl = gpu
                .device
                .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                    label: Some(&name),
                    bind_group_layouts: &[Some(&layout)],
                    immediate_size: 0,
                });
            let pipeline = gpu
                .device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(&name),
                    layout: Some(&pl),
                    module: &module,
                    entry_point: Some(kernel.entry),
                    compilation_options: wgpu::PipelineCompilationOptions {
                        constants,
                        // Every kernel writes its workgroup memory before reading it.
                        zero_initialize_workgroup_memory: false,
                    },
                    cache: None,
                });
            (pipeline, layout)
        });
        if let Some(message) = err {
            return Err(Error::Shader {
                shader: name.to_string(),
                message,
            });
        }
        let (pipeline, layout) = built;
        let cached = Arc::new(CachedPipeline {
            pipeline,
            layout,
            storage: kernel.storage,
            name,
        });
        self.pipelines.lock().unwrap().insert(key, cached.clone());
        Ok(cached)
    }

    fn module(&self, gpu: &Gpu, shader: &'static Shader) -> Result<wgpu::ShaderModule> {
        self.module_of(gpu, shader, shader_source(shader)?)
    }

    /// The module of a cooperative-matrix shader with its matrices emulated
    /// (`coop_emulate.rs`).
    #[cfg(not(target_arch = "wasm32"))]
    fn emulated_module(&self, gpu: &Gpu, shader: &'static Shader) -> Result<wgpu::ShaderModule> {
        if let Some(m) = self.modules.lock().unwrap().get(shader.name) {
            return Ok(m.clone());
        }
        let text = super::coop_emulate::rewrite(&shader_source(shader)?).map_err(|message| {
            Error::Shader {
                shader: shader.name.to_string(),
                message: format!("emulating cooperative matrices: {message}"),
            }
        })?;
        self.module_of(gpu, shader, text.into())
    }

    /// `shader`'s module from `text`, built once (cached by the shader's name).
    fn module_of(
        &self,
        gpu: &Gpu,
        shader: &'static Shader,
        text: std::borrow::Cow<'static, str>,
    ) -> Result<wgpu::ShaderModule> {
        if let Some(m) = self.modules.lock().unwrap().get(shader.name) {
            return Ok(m.clone());
        }
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(shader.name),
            source: wgpu::ShaderSource::Wgsl(text),
        };
        let (module, err) = super::scoped(&gpu.device, wgpu::ErrorFilter::Validation, || {
            let checks = match gpu.shader_checks {
                ShaderChecks::All => return gpu.device.create_shader_module(desc),
                ShaderChecks::Bounds => wgpu::ShaderRuntimeChecks {
                    force_loop_bounding: false,
                    ..wgpu::ShaderRuntimeChecks::checked()
                },
                ShaderChecks::Off => wgpu::ShaderRuntimeChecks::unchecked(),
            };
            // SAFETY: opted into by the user (GpuOptions::shader_checks). Every kernel's loops
            // are bounded by its parameters; with `Off`, every kernel also bounds-checks its
            // own indices against the shapes in its parameters.
            unsafe { gpu.device.create_shader_module_trusted(desc, checks) }
        });
        if let Some(message) = err {
            return Err(Error::Shader {
                shader: shader.name.to_string(),
                message,
            });
        }
        self.modules
            .lock()
            .unwrap()
            .insert(shader.name, module.clone());
        Ok(module)
    }
}

/// The shader's WGSL: the embedded text, or for kernel tuning without a rebuild,
/// `$DOPPLER_SHADER_DIR/<name>.wgsl` where that variable is set and the file exists (after
/// the embedded prelude).
fn shader_source(shader: &Shader) -> Result<std::borrow::Cow<'static, str>> {
    #[cfg(not(target_arch = "wasm32"))]
    if let Some(dir) = std::env::var_os("DOPPLER_SHADER_DIR") {
        let dir = std::path::Path::new(&dir);
        if !dir.is_dir() {
            // Once a process: the embedded shaders are used.
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(
                    "DOPPLER_SHADER_DIR={} is not a folder: the built-in shaders are used",
                    dir.display()
                )
            });
        }
        let path = dir.join(format!("{}.wgsl", shader.name));
        if path.exists() {
            tracing::warn!("shader {} from {}", shader.name, path.display());
            return std::fs::read_to_string(&path)
                .map(|own| with_prelude(shader.prelude, &own).into())
                .map_err(|source| Error::Io {
                    path: path.display().to_string(),
                    source,
                });
        }
    }
    Ok(shader.text())
}

fn feature_name(f: wgpu::Features) -> &'static str {
    if f.contains(wgpu::Features::SHADER_F16) {
        "SHADER_F16"
    } else if f.contains(wgpu::Features::SUBGROUP) {
        "SUBGROUP"
    } else if f.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
        "EXPERIMENTAL_COOPERATIVE_MATRIX"
    } else {
        "(other)"
    }
}
