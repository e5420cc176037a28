#[test]
fn variants() {
    let s = doppler::shaders::ALL
        .iter()
        .find(|s| s.name == "quant_coop")
        .unwrap();
    for v in ["I", "R"] {
        let own =
            std::fs::read_to_string(format!("/work/main/.bench/{v}/quant_coop.wgsl")).unwrap();
        let shader = doppler::gpu::Shader {
            name: "x",
            prelude: s.prelude,
            source: Box::leak(own.into_boxed_str()),
        };
        let text = shader.text();
        let module = naga::front::wgsl::parse_str(&text)
            .unwrap_or_else(|e| panic!("{v}: {}", e.emit_to_string(&text)));
        naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{v}: {}", e.emit_to_string(&text)));
    }
}
