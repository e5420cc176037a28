//! Every WGSL file parses and validates with naga (no GPU needed), and every uniform
//! parameter block has the size its Rust mirror has.

use doppler::gpu::{spirv, ShaderChecks};
use doppler::shaders::ALL;

fn parse(name: &str, src: &str) -> naga::Module {
    naga::front::wgsl::parse_str(src)
        .unwrap_or_else(|e| panic!("{name}.wgsl: {}", e.emit_to_string(src)))
}

#[test]
fn every_shader_validates() {
    assert!(ALL.len() >= 3);
    for s in ALL {
        let module = parse(s.name, &s.text());
        naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{}.wgsl: {}", s.name, e.emit_to_string(&s.text())));
        assert!(
            !module.entry_points.is_empty(),
            "{}.wgsl has no entry point",
            s.name
        );
    }
}

#[test]
fn uniform_blocks_match_rust_params() {
    for (shader, rust_size) in doppler::ops::param_sizes() {
        let s = ALL
            .iter()
            .find(|s| s.name == shader)
            .unwrap_or_else(|| panic!("no shader {shader}"));
        let module = parse(s.name, &s.text());
        let mut layouter = naga::proc::Layouter::default();
        layouter.update(module.to_ctx()).unwrap();
        let uniform = module
            .global_variables
            .iter()
            .find(|(_, v)| v.space == naga::AddressSpace::Uniform)
            .unwrap_or_else(|| panic!("{shader}.wgsl has no uniform block"));
        let wgsl_size = layouter[uniform.1.ty].size as usize;
        assert_eq!(
            wgsl_size, rust_size,
            "{shader}: WGSL Params is {wgsl_size} bytes, Rust {rust_size}"
        );
        assert_eq!(
            rust_size % 16,
            0,
            "{shader}: Params must be padded to 16 bytes"
        );
    }
}

/// Override values besides the defaults that select code of their own in shaders lavapipe
/// never builds (the cooperative product's starts from C and from the bias row, and its
/// split operands, f16x3; the cooperative quantized product's fusions and block types,
/// glu_rows' GeGLU, the skinny product's taller tiles and longer steps, W by rows for dX, x_half scaling
/// gradients up, the cooperative convolution's three GEMMs).
const SPIRV_VARIANTS: &[(&str, &[(&str, f64)])] = &[
    ("matmul_coop", &[("INIT", 1.0)]),
    ("matmul_coop", &[("INIT", 2.0), ("TRANS_B", 1.0)]),
    ("matmul_coop", &[("INIT", 1.0), ("TRANS_A", 1.0)]),
    ("matmul_coop", &[("SPLIT", 1.0)]),
    (
        "matmul_coop",
        &[("SPLIT", 1.0), ("INIT", 1.0), ("TRANS_A", 1.0)],
    ),
    (
        "matmul_coop",
        &[("SPLIT", 1.0), ("INIT", 2.0), ("TRANS_B", 1.0)],
    ),
    ("quant_coop", &[("TYPE", 7.0), ("RESIDUAL", 1.0)]),
    ("quant_coop", &[("RESIDUAL", 1.0), ("TYPE", 12.0)]),
    ("quant_coop", &[("TYPE", 14.0)]),
    ("quant_coop", &[("TYPE", 8.0)]),
    ("quant", &[("GEGLU", 1.0)]),
    ("quant_coop", &[("SPLITK", 1.0), ("TYPE", 13.0)]),
    ("quant_coop", &[("TYPE", 0.0)]),
    ("quant_coop", &[("TYPE", 1.0)]),
    ("quant_coop", &[("TYPE", 30.0)]),
    ("quant_coop", &[("TYPE", 3.0)]),
    ("quant_coop", &[("TYPE", 6.0)]),
    ("quant_coop", &[("TYPE", 7.0)]),
    // qmatmul_coop_skinny's tiles of 32 and 64 rows.
    (
        "quant_coop",
        &[("SK_R", 2.0), ("TYPE", 12.0), ("RESIDUAL", 1.0)],
    ),
    (
        "quant_coop",
        &[("SK_R", 4.0), ("SPLITK", 1.0), ("TYPE", 14.0)],
    ),
    ("quant_coop", &[("SK_R", 4.0), ("TYPE", 1.0)]),
    // ... and its longer steps of k (SkinnyLayout::bk), raw runs and decoded slots.
    (
        "quant_coop",
        &[("SK_R", 4.0), ("SK_BK", 128.0), ("TYPE", 12.0)],
    ),
    (
        "quant_coop",
        &[("SK_BK", 64.0), ("SPLITK", 1.0), ("TYPE", 8.0)],
    ),
    // Narrower skinny tiles: the workgroup's size is the SK_N override.
    (
        "quant_coop",
        &[("SK_N", 32.0), ("SK_R", 4.0), ("TYPE", 14.0)],
    ),
    (
        "quant_coop",
        &[("SK_N", 64.0), ("SPLITK", 1.0), ("TYPE", 12.0)],
    ),
    // qmatmul_t on cooperative matrices: W staged by rows (runs decoded, and 4 values).
    ("quant_coop", &[("TRANS_W", 1.0), ("TYPE", 12.0)]),
    (
        "quant_coop",
        &[("TRANS_W", 1.0), ("SPLITK", 1.0), ("TYPE", 2.0)],
    ),
    ("quant_coop", &[("TRANS_W", 1.0), ("TYPE", 30.0)]),
    ("quant", &[("SCALE_UP", 1.0)]),
    // conv2d on cooperative matrices: dx (B gathered from dy), dw (B staged by columns).
    ("conv2d_coop", &[("MODE", 0.0), ("HAS_BIAS", 1.0)]),
    ("conv2d_coop", &[("MODE", 1.0)]),
    ("conv2d_coop", &[("MODE", 2.0)]),
];

/// Every entry point goes through naga's SPIR-V writer (what wgpu runs on Vulkan) with its
/// overrides at their defaults, and the variants above: lavapipe never builds the
/// cooperative-matrix shaders, so this is where a writer error in them shows up before a
/// GPU that has them.
#[test]
fn every_entry_point_writes_spirv() {
    let defaults: &[(&str, f64)] = &[];
    let runs = ALL
        .iter()
        .map(|s| (*s, defaults))
        .chain(SPIRV_VARIANTS.iter().map(|(name, consts)| {
            let s = ALL.iter().find(|s| s.name == *name).expect("a shader name");
            (*s, *consts)
        }));
    for (s, consts) in runs {
        let constants: naga::back::PipelineConstants =
            consts.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        let module = parse(s.name, &s.text());
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap();
        for ep in &module.entry_points {
            let stage = ep.stage;
            let (m, i) = naga::back::pipeline_constants::process_overrides(
                &module,
                &info,
                Some((stage, &ep.name)),
                &constants,
            )
            .unwrap_or_else(|e| panic!("{}.{} {consts:?}: overrides: {e}", s.name, ep.name));
            let opts = naga::back::spv::Options::default();
            let pipeline = naga::back::spv::PipelineOptions {
                shader_stage: stage,
                entry_point: ep.name.clone(),
            };
            naga::back::spv::write_vec(&m, &i, &opts, Some(&pipeline))
                .unwrap_or_else(|e| panic!("{}.{} {consts:?}: SPIR-V: {e}", s.name, ep.name));
            // What the GPU layer builds for cooperative-matrix kernels on Vulkan: every
            // load and store of the workgroup memory found and marked.
            if s.text().contains("enable wgpu_cooperative_matrix") {
                let bindings: Vec<u32> = module
                    .global_variables
                    .iter()
                    .filter_map(|(_, v)| v.binding.as_ref().map(|b| b.binding))
                    .collect();
                for checks in [ShaderChecks::Bounds, ShaderChecks::Off] {
                    let words = spirv::words(&s.text(), &ep.name, consts, &bindings, checks)
                        .unwrap_or_else(|e| panic!("{}.{} {consts:?}: {e}", s.name, ep.name));
                    if let Some(dir) = std::env::var_os("DOPPLER_SPIRV_DUMP") {
                        let tag: Vec<String> =
                            consts.iter().map(|(k, v)| format!("{k}{v}")).collect();
                        let file =
                            format!("{}.{}.{}.{checks:?}.spv", s.name, ep.name, tag.join("_"));
                        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
                        std::fs::write(std::path::Path::new(&dir).join(file), bytes).unwrap();
                    }
                }
            }
        }
    }
}
