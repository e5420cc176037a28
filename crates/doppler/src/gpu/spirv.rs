//! SPIR-V for the cooperative-matrix kernels, written by naga here and given to Vulkan as
//! is (wgpu's passthrough shaders), with the memory operands naga leaves out.
//!
//! naga (30) declares the Vulkan memory model in every module that uses cooperative
//! matrices, but marks none of its loads and stores `NonPrivatePointer`. Under that model
//! a barrier orders only non-private accesses: a workgroup's stores to its staging tiles
//! need not be visible to the other subgroups' loads after `workgroupBarrier()`, and a
//! compiler may move those loads above it (gfx-rs/wgpu#8805). Here every load and store
//! through a Workgroup pointer (`OpLoad`, `OpStore`, `OpCooperativeMatrixLoadKHR`,
//! `OpCooperativeMatrixStoreKHR`) gets `NonPrivatePointer`, as GLSL compilers mark
//! `shared` memory under the same model; storage buffers are left as they are (no kernel
//! reads within a dispatch what another workgroup wrote).
//!
//! Also dropped: the `ArrayStride` naga puts on arrays that live only in workgroup or
//! function memory (explicit layouts there are invalid for Vulkan).
//!
//! Override constants are applied here (naga's `process_overrides`), so the pipeline is
//! created without constants; the runtime checks follow [`ShaderChecks`] as wgpu's own
//! translation would; bindings are renumbered as wgpu's Vulkan backend numbers descriptors
//! ([`words`]).

use super::{Gpu, Kernel, ShaderChecks};
use crate::error::{Error, Result};
use std::collections::{HashMap, HashSet};

/// Whether `kernel` is built here: a cooperative-matrix kernel on Vulkan, where the device
/// takes passthrough shaders. `DOPPLER_PASSTHROUGH` (diagnostics) changes which: `off`
/// none (wgpu's own translation), `all` every kernel.
pub(crate) fn wanted(gpu: &Gpu, kernel: &Kernel) -> bool {
    let coop = kernel
        .features
        .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX);
    let which = match std::env::var("DOPPLER_PASSTHROUGH").as_deref() {
        Ok("off") => false,
        Ok("all") => true,
        _ => coop,
    };
    which
        && gpu.info.backend == wgpu::Backend::Vulkan
        && gpu.features.contains(wgpu::Features::PASSTHROUGH_SHADERS)
}

/// The module for one pipeline of `kernel` (WGSL text `text`, override `constants`),
/// labelled `name`.
pub(crate) fn module(
    gpu: &Gpu,
    kernel: &Kernel,
    text: &str,
    constants: &[(&'static str, f64)],
    name: &str,
) -> Result<wgpu::ShaderModule> {
    let mut layout: Vec<u32> = kernel.storage.iter().map(|&(b, _)| b).collect();
    layout.push(0); // the parameters (pipeline.rs)
    tracing::debug!("{name}: SPIR-V written and patched here (passthrough module)");
    let words =
        words(text, kernel.entry, constants, &layout, gpu.shader_checks).map_err(|message| {
            Error::Shader {
                shader: name.to_string(),
                message,
            }
        })?;
    dump(name, &words);
    let desc = wgpu::ShaderModuleDescriptorPassthrough {
        label: Some(name),
        entry_points: vec![wgpu::PassthroughShaderEntryPoint {
            name: kernel.entry.into(),
            // Read by Metal only.
            workgroup_size: (1, 1, 1),
        }]
        .into(),
        spirv: Some(words.into()),
        ..Default::default()
    };
    let (module, err) = super::scoped(&gpu.device, wgpu::ErrorFilter::Validation, || {
        // SAFETY: the words are naga's translation of WGSL that naga validated (`words`),
        // with memory operands added that only strengthen ordering and bindings numbered
        // as wgpu's Vulkan backend lays out the pipeline's bind group (pipeline.rs builds
        // that layout from the same `kernel.storage`). No driver validates them: every
        // variant was checked with spirv-val (docs/benchmarks.md, session 21) and the
        // kernels by `doppler verify`.
        unsafe { gpu.device.create_shader_module_passthrough(desc) }
    });
    match err {
        Some(message) => Err(Error::Shader {
            shader: name.to_string(),
            message,
        }),
        None => Ok(module),
    }
}

/// `DOPPLER_DUMP_SPIRV=DIR` (diagnostics): each passthrough module is also written to
/// `DIR/<pipeline name>.spv` (characters other than ASCII letters, digits, `_`, `-` and `.`
/// replaced by `_`: `quant_coop.qmatmul_coop_TYPE_12_SPLITK_1_.spv`), through a temporary
/// file renamed into place, for spirv-val, spirv-dis or a driver's own statistics
/// (`bench/vkstats`). A failed write is logged and otherwise ignored.
fn dump(name: &str, words: &[u32]) {
    let Some(dir) = std::env::var_os("DOPPLER_DUMP_SPIRV") else {
        return;
    };
    let file: String = name
        .chars()
        .map(|c| match c.is_ascii_alphanumeric() || "_-.".contains(c) {
            true => c,
            false => '_',
        })
        .collect();
    let dir = std::path::Path::new(&dir);
    let path = dir.join(format!("{file}.spv"));
    let partial = dir.join(format!(".{file}.spv.{}", std::process::id()));
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let written = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&partial, bytes))
        .and_then(|()| std::fs::rename(&partial, &path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&partial);
        tracing::warn!("DOPPLER_DUMP_SPIRV: {}: {e}", path.display());
    }
}

/// `text` parsed and validated by naga as a driver with every capability (cooperative
/// matrices, f16, compute subgroups) takes it, or naga's message.
pub(crate) fn validated(
    text: &str,
) -> std::result::Result<(naga::Module, naga::valid::ModuleInfo), String> {
    let module = naga::front::wgsl::parse_str(text).map_err(|e| e.emit_to_string(text))?;
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .subgroup_stages(naga::valid::ShaderStages::COMPUTE)
    .subgroup_operations(naga::valid::SubgroupOperationSet::all())
    .validate(&module)
    .map_err(|e| e.emit_to_string(text))?;
    Ok((module, info))
}

/// The patched SPIR-V of `entry` in `text` with `constants` applied, or naga's message.
/// `layout`: the WGSL binding numbers of the pipeline's bind group (group 0). wgpu's
/// Vulkan backend numbers a bind group's descriptors 0, 1, 2 ... in the order of their
/// binding numbers (wgpu-hal's create_bind_group_layout), and renumbers the bindings
/// of the SPIR-V it writes to match; so does this.
pub fn words(
    text: &str,
    entry: &str,
    constants: &[(&'static str, f64)],
    layout: &[u32],
    checks: ShaderChecks,
) -> std::result::Result<Vec<u32>, String> {
    use naga::back::spv;
    let (module, info) = validated(text)?;
    let values: naga::back::PipelineConstants =
        constants.iter().map(|&(k, v)| (k.to_string(), v)).collect();
    let (module, info) = naga::back::pipeline_constants::process_overrides(
        &module,
        &info,
        Some((naga::ShaderStage::Compute, entry)),
        &values,
    )
    .map_err(|e| format!("override constants: {e}"))?;
    let mut numbers = layout.to_vec();
    numbers.sort_unstable();
    numbers.dedup();
    let binding_map = numbers
        .iter()
        .enumerate()
        .map(|(rank, &binding)| {
            let target = spv::BindingInfo {
                descriptor_set: 0,
                binding: rank as u32,
                binding_array_size: None,
            };
            (naga::ResourceBinding { group: 0, binding }, target)
        })
        .collect();
    let policy = match checks {
        ShaderChecks::All | ShaderChecks::Bounds => naga::proc::BoundsCheckPolicy::Restrict,
        ShaderChecks::Off => naga::proc::BoundsCheckPolicy::Unchecked,
    };
    let options = spv::Options {
        lang_version: (1, 5),
        flags: spv::WriterFlags::empty(),
        bounds_check_policies: naga::proc::BoundsCheckPolicies {
            index: policy,
            buffer: policy,
            image_load: policy,
            binding_array: naga::proc::BoundsCheckPolicy::Unchecked,
        },
        // Every kernel writes its workgroup memory before reading it (as the pipelines
        // wgpu builds: zero_initialize_workgroup_memory false).
        zero_initialize_workgroup_memory: spv::ZeroInitializeWorkgroupMemoryMode::None,
        force_loop_bounding: checks == ShaderChecks::All,
        emit_int_div_checks: checks != ShaderChecks::Off,
        binding_map,
        fake_missing_bindings: false,
        ..spv::Options::default()
    };
    let pipeline = spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: entry.to_string(),
    };
    let mut words = spv::write_vec(&module, &info, &options, Some(&pipeline))
        .map_err(|e| format!("SPIR-V: {e}"))?;
    patch_workgroup_memory(&mut words)?;
    Ok(words)
}

const OP_DECORATE: u32 = 71;
const OP_TYPE_ARRAY: u32 = 28;
const OP_TYPE_RUNTIME_ARRAY: u32 = 29;
const OP_TYPE_STRUCT: u32 = 30;
const OP_TYPE_POINTER: u32 = 32;
const OP_VARIABLE: u32 = 59;
const OP_LOAD: u32 = 61;
const OP_STORE: u32 = 62;
const OP_ACCESS_CHAIN: u32 = 65;
const OP_IN_BOUNDS_ACCESS_CHAIN: u32 = 66;
const OP_PTR_ACCESS_CHAIN: u32 = 67;
const OP_COPY_OBJECT: u32 = 83;
const OP_COOP_LOAD: u32 = 4457;
const OP_COOP_STORE: u32 = 4458;
const ARRAY_STRIDE: u32 = 6;
const WORKGROUP: u32 = 4;
const NON_PRIVATE_POINTER: u32 = 0x20;
/// Storage classes whose types carry explicit layouts (Uniform, PushConstant,
/// StorageBuffer, PhysicalStorageBuffer).
const EXPLICIT_LAYOUT: [u32; 4] = [2, 9, 12, 5349];

/// The module's instructions (opcode, words including the first), or what is malformed.
fn instructions(words: &[u32]) -> std::result::Result<Vec<(u32, Vec<u32>)>, String> {
    if words.len() < 5 || words[0] != 0x0723_0203 {
        return Err("not a SPIR-V module".into());
    }
    let mut all = Vec::new();
    let mut at = 5;
    while at < words.len() {
        let count = (words[at] >> 16) as usize;
        if count == 0 || at + count > words.len() {
            return Err(format!("malformed SPIR-V instruction at word {at}"));
        }
        all.push((words[at] & 0xffff, words[at..at + count].to_vec()));
        at += count;
    }
    Ok(all)
}

/// The storage class of every pointer type (first) and pointer value (second) of a
/// module's instructions: values from variables, access chains and copies, the only ways
/// naga forms pointers in compute kernels.
fn storage_classes(all: &[(u32, Vec<u32>)]) -> (HashMap<u32, u32>, HashMap<u32, u32>) {
    let mut types = HashMap::new();
    let mut values = HashMap::new();
    for (op, ins) in all {
        match (*op, ins.len()) {
            (OP_TYPE_POINTER, 4..) => {
                types.insert(ins[1], ins[2]);
            }
            (OP_VARIABLE, 4..) => {
                values.insert(ins[2], ins[3]);
            }
            (
                OP_ACCESS_CHAIN | OP_IN_BOUNDS_ACCESS_CHAIN | OP_PTR_ACCESS_CHAIN | OP_COPY_OBJECT,
                4..,
            ) => {
                if let Some(&class) = types.get(&ins[1]) {
                    values.insert(ins[2], class);
                }
            }
            _ => {}
        }
    }
    (types, values)
}

/// Adds `NonPrivatePointer` to every load and store through a Workgroup pointer in the
/// module `words` (a load or store whose pointer is not known is an error, not left
/// unmarked), and drops the `ArrayStride` naga puts on arrays that live only in
/// workgroup or function memory (Vulkan allows explicit layouts only where memory is
/// shared with the host: VUID-StandaloneSpirv-None-10684).
pub fn patch_workgroup_memory(words: &mut Vec<u32>) -> std::result::Result<(), String> {
    let mut all = instructions(words)?;
    let (_, pointers) = storage_classes(&all);
    // Aggregate type id -> the types it holds; the pointees of host-shared pointers.
    let mut parts: HashMap<u32, Vec<u32>> = HashMap::new();
    let mut roots = Vec::new();
    for (op, ins) in &all {
        match (*op, ins.len()) {
            (OP_TYPE_POINTER, 4..) if EXPLICIT_LAYOUT.contains(&ins[2]) => roots.push(ins[3]),
            (OP_TYPE_ARRAY | OP_TYPE_RUNTIME_ARRAY, 3..) => {
                parts.insert(ins[1], vec![ins[2]]);
            }
            (OP_TYPE_STRUCT, 2..) => {
                parts.insert(ins[1], ins[2..].to_vec());
            }
            _ => {}
        }
    }
    // Types inside a host-shared block keep their layout.
    let mut explicit: HashSet<u32> = HashSet::new();
    while let Some(t) = roots.pop() {
        if explicit.insert(t) {
            roots.extend(parts.get(&t).into_iter().flatten());
        }
    }
    all.retain(|(op, ins)| {
        !(*op == OP_DECORATE
            && ins.len() == 4
            && ins[2] == ARRAY_STRIDE
            && parts.contains_key(&ins[1])
            && !explicit.contains(&ins[1]))
    });
    for (op, ins) in &mut all {
        let count = ins.len();
        if let Some((ptr, mask)) = access_operands(*op) {
            mark(ins, ptr, mask, &pointers)?;
        }
        if ins.len() != count {
            ins[0] = ((ins.len() as u32) << 16) | *op;
        }
    }
    words.truncate(5);
    for (_, ins) in all {
        words.extend(ins);
    }
    Ok(())
}

/// For a load or store opcode, the words of its pointer operand and of its (optional)
/// memory operand mask.
fn access_operands(op: u32) -> Option<(usize, usize)> {
    match op {
        // OpLoad: type, result, pointer, [memory access ...].
        OP_LOAD => Some((3, 4)),
        // OpStore: pointer, object, [memory access ...].
        OP_STORE => Some((1, 3)),
        // Load: type, result, pointer, layout, stride, [memory operand ...].
        OP_COOP_LOAD => Some((3, 6)),
        // Store: pointer, object, layout, stride, [memory operand ...].
        OP_COOP_STORE => Some((1, 5)),
        _ => None,
    }
}

/// Marks instruction `ins` (its pointer operand at word `ptr`, its memory operand mask
/// at word `mask` if present) non-private when the pointer (storage classes in
/// `pointers`) is into Workgroup memory.
fn mark(
    ins: &mut Vec<u32>,
    ptr: usize,
    mask: usize,
    pointers: &HashMap<u32, u32>,
) -> std::result::Result<(), String> {
    if ins.len() < mask {
        return Err(format!(
            "SPIR-V opcode {} has {} words, fewer than its operands",
            ins[0] & 0xffff,
            ins.len()
        ));
    }
    let Some(&class) = pointers.get(&ins[ptr]) else {
        return Err(format!(
            "SPIR-V opcode {}: pointer %{} of unknown storage class",
            ins[0] & 0xffff,
            ins[ptr]
        ));
    };
    if class != WORKGROUP {
        return Ok(());
    }
    if ins.len() == mask {
        ins.push(NON_PRIVATE_POINTER);
    } else {
        ins[mask] |= NON_PRIVATE_POINTER;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const KERNEL: &str = "
var<workgroup> tile: array<f32, 64>;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
override SCALE: f32 = 1.0;
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) i: u32) {
    tile[i] = f32(i) * SCALE;
    workgroupBarrier();
    out[i] = tile[63u - i];
}";

    /// (opcode, memory operand mask or None, the pointer's storage class) of each load
    /// and store in `words`.
    fn accesses(words: &[u32]) -> Vec<(u32, Option<u32>, u32)> {
        let all = instructions(words).unwrap();
        let (_, pointers) = storage_classes(&all);
        all.iter()
            .filter_map(|(op, ins)| {
                let (ptr, mask) = access_operands(*op)?;
                Some((*op, ins.get(mask).copied(), pointers[&ins[ptr]]))
            })
            .collect()
    }

    /// Every workgroup access in `found` marked non-private.
    fn all_marked(found: &[(u32, Option<u32>, u32)]) {
        for a in found.iter().filter(|a| a.2 == WORKGROUP) {
            assert_eq!(
                a.1.map(|m| m & NON_PRIVATE_POINTER),
                Some(NON_PRIVATE_POINTER),
                "{a:?}"
            );
        }
    }

    #[test]
    fn workgroup_accesses_become_non_private_and_others_stay() {
        let words = words(
            KERNEL,
            "main",
            &[("SCALE", 2.0)],
            &[0, 1],
            ShaderChecks::Bounds,
        )
        .unwrap();
        let found = accesses(&words);
        let wg: Vec<_> = found.iter().filter(|a| a.2 == WORKGROUP).collect();
        assert!(
            wg.iter().any(|a| a.0 == OP_LOAD) && wg.iter().any(|a| a.0 == OP_STORE),
            "{found:?}"
        );
        all_marked(&found);
        // The storage buffer's store is untouched.
        assert!(found
            .iter()
            .any(|a| a.2 != WORKGROUP && a.0 == OP_STORE && a.1.is_none()));
    }

    /// The quantized product's cooperative loads and stores of its staged tiles and
    /// scratch are marked, and no workgroup array keeps an ArrayStride.
    #[test]
    fn the_cooperative_product_is_patched() {
        let text = crate::shaders::QUANT_COOP.text();
        let layout = [0, 1, 2, 3, 4, 5, 13];
        let c = [("TYPE", 12.0), ("RESIDUAL", 1.0)];
        let words = words(&text, "qmatmul_coop", &c, &layout, ShaderChecks::Bounds).unwrap();
        let found = accesses(&words);
        let coop = |op| {
            found
                .iter()
                .filter(|a| a.0 == op && a.2 == WORKGROUP)
                .count()
        };
        // 8 fragments a pass from sa and sb, the scratch's stores.
        assert!(
            coop(OP_COOP_LOAD) >= 8 && coop(OP_COOP_STORE) >= 1,
            "{found:?}"
        );
        all_marked(&found);
        let all = instructions(&words).unwrap();
        let (types, _) = storage_classes(&all);
        let workgroup_arrays: Vec<u32> = all
            .iter()
            .filter(|(op, ins)| *op == OP_TYPE_POINTER && types[&ins[1]] == WORKGROUP)
            .map(|(_, ins)| ins[3])
            .collect();
        assert!(!workgroup_arrays.is_empty());
        assert!(!all.iter().any(|(op, ins)| *op == OP_DECORATE
            && ins[2] == ARRAY_STRIDE
            && workgroup_arrays.contains(&ins[1])));
    }

    #[test]
    fn garbage_is_refused() {
        assert!(patch_workgroup_memory(&mut vec![1, 2, 3]).is_err());
        let mut truncated = vec![0x0723_0203, 0, 0, 10, 0, (9 << 16) | OP_LOAD, 1];
        assert!(patch_workgroup_memory(&mut truncated).is_err());
    }
}
