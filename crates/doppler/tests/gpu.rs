//! GPU tests on whatever adapter exists (lavapipe in CI). They fail, not skip, without one:
//! the README's test command installs the driver first.

use doppler::check::Rng;
use doppler::gpu::{DType, Gpu, GpuOptions, Grid, Tensor};
use doppler::ops::{elementwise, matmul, reduce};
use doppler::{verify, wgpu, Error};
use std::sync::OnceLock;

fn gpu() -> &'static Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| {
        Gpu::new_blocking(&GpuOptions::from_env())
            .expect("a GPU adapter (install mesa-vulkan-drivers)")
    })
}

/// Runs every check of the families `filter` names; at least `min` must have run.
fn assert_checks(filter: &str, min: usize) {
    let results = verify::run_families(gpu(), Some(filter));
    assert!(
        results.len() >= min,
        "{filter}: only {} checks ran",
        results.len()
    );
    let failed: Vec<String> = results
        .iter()
        .filter(|c| !c.pass)
        .map(|c| format!("{} {}: {}", c.op, c.shape, c.error.as_deref().unwrap_or("")))
        .collect();
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
}

#[test]
fn elementwise_matches_reference() {
    assert_checks("add", 4 * verify::ELEMENTWISE_SIZES.len());
}

#[test]
fn sum_rows_matches_reference_and_is_deterministic() {
    assert_checks("sum_rows", verify::SUM_SHAPES.len());
}

#[test]
fn sum_words_matches_each_groups_reference() {
    assert_checks("sum_words", verify::WORDS_CASES.len());
}

#[test]
fn argmax_rows_matches_the_greedy_sampler() {
    assert_checks("argmax_rows", verify::ARGMAX_SHAPES.len());
}

#[test]
fn matmul_matches_reference_and_is_deterministic() {
    assert_checks(
        "matmul",
        verify::ABSMAX_CASES.len() + 2 * verify::MATMUL_CASES.len(),
    );
}

#[test]
fn recorder_chains_dependent_ops_in_one_submit() {
    assert_checks("recorder", 1);
}

#[test]
fn sum_of_all_elements() {
    let gpu = gpu();
    let x: Vec<f32> = (0..10_000).map(|i| (i % 7) as f32).collect();
    let t = Tensor::from_f32(gpu, &[100, 100], &x, "x").unwrap();
    let s = gpu.run(|rec| reduce::sum(rec, &t)).unwrap();
    assert_eq!(s.shape(), &[] as &[usize]);
    assert_eq!(s.read_f32(gpu).unwrap(), vec![x.iter().sum::<f32>()]);
}

#[test]
fn tensors_round_trip_every_dtype() {
    let gpu = gpu();
    let f: Vec<f32> = Rng::new(1).vec(37);
    assert_eq!(
        Tensor::from_f32(gpu, &[37], &f, "f")
            .unwrap()
            .read_f32(gpu)
            .unwrap(),
        f
    );
    let u: Vec<u32> = (0..37).map(|i| i * 0x0101_0101).collect();
    assert_eq!(
        Tensor::from_u32(gpu, &[37], &u, "u")
            .unwrap()
            .read_u32(gpu)
            .unwrap(),
        u
    );
    // Odd f16 count: 74 bytes, padded to a 4-byte write and trimmed on the way back.
    let h: Vec<half::f16> = f.iter().map(|&v| half::f16::from_f32(v)).collect();
    let th = Tensor::from_f16(gpu, &[37], &h, "h").unwrap();
    assert_eq!(th.dtype(), DType::F16);
    assert_eq!(th.byte_size(), 74);
    assert_eq!(th.read_f16(gpu).unwrap(), h);
    let widened: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
    assert_eq!(th.read_f32(gpu).unwrap(), widened);
}

#[test]
fn bad_input_gets_clear_errors() {
    let gpu = gpu();
    let a = Tensor::from_f32(gpu, &[2, 3], &[0.0; 6], "a").unwrap();
    let b = Tensor::from_f32(gpu, &[4, 5], &[0.0; 20], "b").unwrap();
    let e = gpu
        .run(|rec| matmul::matmul(rec, &a, &b, Default::default()))
        .unwrap_err();
    assert!(matches!(e, Error::Shape { op: "matmul", .. }), "{e}");
    assert!(
        e.to_string().contains("[2, 3]") && e.to_string().contains("[4, 5]"),
        "{e}"
    );
    let e = gpu.run(|rec| elementwise::add(rec, &a, &b)).unwrap_err();
    assert!(
        e.to_string().contains("add") && e.to_string().contains("[2, 3]"),
        "{e}"
    );
    let u = Tensor::from_u32(gpu, &[2, 3], &[0; 6], "u").unwrap();
    let e = gpu.run(|rec| elementwise::add(rec, &a, &u)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::DType {
                op: "add",
                got: DType::U32,
                ..
            }
        ),
        "{e}"
    );
    let e = Tensor::from_f32(gpu, &[2, 3], &[0.0; 5], "short").unwrap_err();
    assert!(
        matches!(
            e,
            Error::UploadSize {
                got: 5,
                expected: 6,
                ..
            }
        ),
        "{e}"
    );
    let e = a.reshape(&[4]).unwrap_err();
    assert!(e.to_string().contains("reshape"), "{e}");
    let e = Tensor::empty(gpu, &[1 << 40], DType::F32, "huge").unwrap_err();
    assert!(matches!(e, Error::TooLarge { .. }), "{e}");
    let empty = Tensor::empty(gpu, &[3, 0], DType::F32, "empty").unwrap();
    let e = gpu.run(|rec| reduce::sum_rows(rec, &empty)).unwrap_err();
    assert!(
        e.to_string().contains("sum_rows") && e.to_string().contains("[3, 0]"),
        "{e}"
    );
}

#[test]
fn grid_goes_2d_past_the_dimension_limit() {
    assert_eq!(Grid::Linear(10).resolve(65535).unwrap(), [10, 1, 1]);
    assert_eq!(Grid::Linear(65535).resolve(65535).unwrap(), [65535, 1, 1]);
    assert_eq!(Grid::Linear(65536).resolve(65535).unwrap(), [65535, 2, 1]);
    assert_eq!(Grid::cover(1000, 256), Grid::Linear(4));
    assert!(Grid::Linear(65535 * 65535 + 1).resolve(65535).is_err());
    assert!(Grid::Xyz([1, 70_000, 1]).resolve(65535).is_err());
}

#[test]
fn pool_returns_buffers_only_after_the_gpu_is_done() {
    // A device of its own, so the counters see only this test.
    let gpu = Gpu::new_blocking(&GpuOptions::from_env()).unwrap();
    let x = Tensor::from_f32(&gpu, &[1000], &[1.0; 1000], "x").unwrap();
    let s0 = gpu.pool.stats();
    assert_eq!(s0.misses, 1);
    let mut rec = gpu.recorder("pool");
    let y = elementwise::scale(&mut rec, &x, 2.0).unwrap();
    drop(x); // the recorder still holds x's buffer
    assert_eq!(
        gpu.pool.stats().pooled_bytes,
        s0.pooled_bytes,
        "x returned while recorded"
    );
    rec.submit().unwrap();
    gpu.wait().unwrap();
    let s1 = gpu.pool.stats();
    assert_eq!(s1.in_flight, 0);
    assert!(
        s1.pooled_bytes >= 4096,
        "x and the uniform buffer back in the pool: {s1:?}"
    );
    // Same size class again: a hit, no new buffer.
    let z = Tensor::empty(&gpu, &[999], DType::F32, "z").unwrap();
    let s2 = gpu.pool.stats();
    assert_eq!(s2.hits, s1.hits + 1);
    assert_eq!(s2.misses, s1.misses);
    assert_eq!(y.read_f32(&gpu).unwrap(), vec![2.0; 1000]);
    drop((y, z));
    gpu.wait().unwrap();
    assert_eq!(gpu.pool.stats().live_bytes, 0);
}

#[test]
fn recorder_flushing_as_it_records_gives_the_same_results() {
    // 40 dependent scales submitted 8 commands at a time, with a readback recorded in the
    // middle (submitted with an early part) and intermediates dropped as they go.
    let gpu = gpu();
    let x = Tensor::from_f32(gpu, &[1000], &[1.0; 1000], "x").unwrap();
    let mut rec = gpu.recorder("flush");
    rec.set_flush_every(8);
    let (mut y, mut want, mut early) = (x.clone(), 1.0f32, None);
    let mut want_early = 0.0;
    for i in 0..40 {
        let f = if i % 2 == 0 { 2.0 } else { 0.75 };
        y = elementwise::scale(&mut rec, &y, f).unwrap();
        want *= f;
        if i == 9 {
            early = Some(rec.read_later(&y).unwrap());
            want_early = want;
        }
    }
    assert!(rec.len() < 8, "{} commands left unsubmitted", rec.len());
    rec.submit().unwrap().wait(gpu).unwrap();
    let e = early.unwrap().read_u32(gpu).unwrap();
    assert_eq!(f32::from_bits(e[0]), want_early);
    assert_eq!(y.read_f32(gpu).unwrap(), vec![want; 1000]);
}

#[test]
fn a_readback_whose_reader_panics_is_unmapped() {
    // The closure reading the mapped bytes panics: the staging buffer must still be
    // unmapped (a mapped buffer cannot be mapped again, nor used by a submission).
    let gpu = gpu();
    let x = Tensor::from_u32(gpu, &[4], &[7, 8, 9, 10], "x").unwrap();
    let mut rec = gpu.recorder("readback");
    let rb = rec.read_later(&x).unwrap();
    rec.submit().unwrap().wait(gpu).unwrap();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pollster::block_on(rb.map(gpu, |_| -> u32 { panic!("reader fails") }))
    }));
    assert!(panicked.is_err());
    assert_eq!(rb.read_u32(gpu).unwrap(), vec![7, 8, 9, 10]);
}

#[test]
fn pipelines_are_built_once_per_key() {
    let gpu = Gpu::new_blocking(&GpuOptions::from_env()).unwrap();
    let a = Tensor::from_f32(&gpu, &[8, 8], &[1.0; 64], "a").unwrap();
    for _ in 0..3 {
        gpu.run(|rec| matmul::matmul(rec, &a, &a, Default::default()))
            .unwrap();
    }
    assert_eq!(gpu.pipelines.len(), 1);
    let opts = matmul::MatmulOpts {
        trans_b: true,
        ..Default::default()
    };
    gpu.run(|rec| matmul::matmul(rec, &a, &a, opts)).unwrap();
    assert_eq!(
        gpu.pipelines.len(),
        2,
        "different override constants, different pipeline"
    );
}

#[test]
fn timed_recorder_times_the_whole_submission_in_one_event() {
    // Dispatches, a copy between them (so two passes: the first writes the first
    // timestamp, the last the second), more dispatches: one event named by the recorder.
    let gpu = gpu();
    let a = Tensor::from_f32(gpu, &[4096], &[1.0; 4096], "a").unwrap();
    let mut rec = gpu.timed_recorder("step");
    let b = elementwise::add(&mut rec, &a, &a).unwrap();
    let b2 = Tensor::empty(gpu, &[4096], DType::F32, "b2").unwrap();
    rec.copy(&b, &b2).unwrap();
    let c = elementwise::mul(&mut rec, &b2, &a).unwrap();
    let s = reduce::sum_rows(&mut rec, &c.reshape(&[1, 4096]).unwrap()).unwrap();
    let sub = rec.submit().unwrap();
    assert_eq!(sub.dispatches(), 3);
    let trace = sub.wait(gpu).unwrap();
    assert_eq!(s.read_f32(gpu).unwrap(), [8192.0]);
    if !gpu.features.contains(wgpu::Features::TIMESTAMP_QUERY) {
        assert!(trace.events.is_empty());
        return;
    }
    assert_eq!(trace.events.len(), 1);
    assert_eq!(trace.events[0].name, "step");
    assert!(trace.events[0].dur_ns > 0.0, "{:?}", trace.events[0].dur_ns);
}

#[test]
fn profiling_recorder_writes_a_chrome_trace() {
    let gpu = gpu();
    let a = Tensor::from_f32(gpu, &[4096], &[1.0; 4096], "a").unwrap();
    let mut rec = gpu.profiling_recorder("trace");
    let b = elementwise::add(&mut rec, &a, &a).unwrap();
    let c = elementwise::mul(&mut rec, &b, &a).unwrap();
    let _ = reduce::sum_rows(&mut rec, &c).unwrap();
    let trace = rec.submit().unwrap().wait(gpu).unwrap();
    if !gpu.features.contains(wgpu::Features::TIMESTAMP_QUERY) {
        assert!(trace.events.is_empty());
        return;
    }
    let names: Vec<&str> = trace.events.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(
        names,
        ["elementwise.add4", "elementwise.mul4", "reduce.sum_rows"]
    );
    assert!(trace
        .events
        .iter()
        .all(|e| e.dur_ns >= 0.0 && e.start_ns >= 0.0));
    assert!(trace
        .events
        .windows(2)
        .all(|w| w[1].start_ns >= w[0].start_ns));
    let json: serde_json::Value = serde_json::from_str(&trace.to_chrome_json()).unwrap();
    assert_eq!(json["traceEvents"].as_array().unwrap().len(), 3);
    assert_eq!(json["traceEvents"][0]["ph"], "X");
    assert_eq!(trace.by_kernel().len(), 3);
}

#[test]
fn gelu_matches_reference_both_variants() {
    assert_checks("gelu", 12);
}

#[test]
fn cross_entropy_matches_reference() {
    assert_checks("cross_entropy", 13);
}

#[test]
fn embedding_matches_reference_and_is_deterministic() {
    assert_checks("embedding", 10);
}

#[test]
fn group_norm_matches_reference_and_is_deterministic() {
    assert_checks("group_norm", 12);
}

#[test]
fn conv2d_matches_reference_and_is_deterministic() {
    assert_checks("conv2d", 12);
}

#[test]
fn seed_ops_reject_bad_shapes_and_dtypes() {
    use doppler::ops::{conv2d, cross_entropy as ce, embedding, gelu, groupnorm};
    let gpu = gpu();
    let f = |shape: &[usize]| {
        Tensor::from_f32(gpu, shape, &vec![0.5; shape.iter().product()], "t").unwrap()
    };
    let msg = |r: doppler::Result<()>| r.unwrap_err().to_string();

    // conv2d: weight channels must be Cin / groups.
    let e = msg(gpu.run(|rec| {
        conv2d::conv2d(
            rec,
            &f(&[1, 4, 5, 5]),
            &f(&[6, 3, 3, 3]),
            None,
            Default::default(),
        )
        .map(|_| ())
    }));
    assert!(
        e.contains("conv2d") && e.contains("[1, 4, 5, 5]") && e.contains("[6, 3, 3, 3]"),
        "{e}"
    );
    let e = msg(gpu.run(|rec| {
        conv2d::conv2d_backward(
            rec,
            &f(&[1, 4, 5, 5]),
            &f(&[6, 4, 3, 3]),
            &f(&[1, 6, 5, 5]),
            Default::default(),
            false,
        )
        .map(|_| ())
    }));
    assert!(
        e.contains("conv2d_backward") && e.contains("dy [1, 6, 5, 5]"),
        "{e}"
    );
    // group_norm: channels must split into groups.
    let e = msg(gpu.run(|rec| {
        groupnorm::group_norm(rec, &f(&[2, 6, 4]), &f(&[6]), &f(&[6]), 4, 1e-5).map(|_| ())
    }));
    assert!(
        e.contains("group_norm") && e.contains("6 channels") && e.contains("4 groups"),
        "{e}"
    );
    // cross_entropy: one target per row, u32.
    let t = Tensor::from_u32(gpu, &[3], &[0, 1, 2], "targets").unwrap();
    let e = msg(
        gpu.run(|rec| ce::cross_entropy(rec, &f(&[4, 10]), &t, Default::default()).map(|_| ()))
    );
    assert!(
        e.contains("cross_entropy") && e.contains("[4, 10]") && e.contains("[3]"),
        "{e}"
    );
    let e = msg(gpu
        .run(|rec| ce::cross_entropy(rec, &f(&[3, 10]), &f(&[3]), Default::default()).map(|_| ())));
    assert!(e.contains("cross_entropy") && e.contains("u32"), "{e}");
    // embedding: ids must be u32, dout must be (ids..., H).
    let e = msg(gpu.run(|rec| embedding::embedding(rec, &f(&[10, 4]), &f(&[3])).map(|_| ())));
    assert!(e.contains("embedding") && e.contains("u32"), "{e}");
    let e = msg(gpu
        .run(|rec| embedding::embedding_backward_into(rec, &t, &f(&[3, 5]), &f(&[10, 4]), false)));
    assert!(
        e.contains("embedding_backward") && e.contains("[3, 5]"),
        "{e}"
    );
    // gelu backward: x and dy alike.
    let e = msg(gpu.run(|rec| {
        gelu::gelu_backward(rec, &f(&[4]), &f(&[5]), gelu::GeluMode::Exact).map(|_| ())
    }));
    assert!(
        e.contains("gelu_backward") && e.contains("[4]") && e.contains("[5]"),
        "{e}"
    );
}

#[test]
fn layer_and_rms_norm_match_reference() {
    assert_checks("rms_norm", 16);
}

#[test]
fn softmax_matches_reference() {
    assert_checks("softmax", 8);
}

#[test]
fn silu_and_swiglu_match_reference() {
    assert_checks("silu", 15);
}

#[test]
fn rope_matches_reference_both_pairings() {
    assert_checks("rope", 8);
}

#[test]
fn optimizers_match_torch_formulas() {
    assert_checks("adamw", 3);
}

#[test]
fn dropout_mask_is_seeded_and_bit_exact() {
    assert_checks("dropout", 3);
}

#[test]
fn flash_attention_matches_reference_with_grouped_heads() {
    // Ten cases (six plain, four with dropout on the probabilities) of five outputs each
    // on the row kernels, more on the tiled ones.
    assert_checks("attention", 10 * 5);
}

#[test]
fn bias_add_matches_reference() {
    assert_checks("bias_add", 8);
}

#[test]
fn pixel_shuffle_and_upsample_match_reference() {
    assert_checks("pixel_shuffle", 12);
}

#[test]
fn training_ops_reject_bad_shapes() {
    use doppler::ops::{attention, bias, upsample};
    let gpu = gpu();
    let f = |shape: &[usize]| {
        Tensor::from_f32(gpu, shape, &vec![0.5; shape.iter().product()], "t").unwrap()
    };
    let msg = |r: doppler::Result<()>| r.unwrap_err().to_string();
    let a = attention::AttnOpts::default();
    // 3 query heads cannot share 2 key/value heads.
    let e = msg(gpu.run(|rec| {
        attention::attention(
            rec,
            &f(&[1, 4, 3, 8]),
            &f(&[1, 4, 2, 8]),
            &f(&[1, 4, 2, 8]),
            a,
        )
        .map(|_| ())
    }));
    assert!(
        e.contains("attention")
            && e.contains("[1, 4, 3, 8]")
            && e.contains("multiple of key/value heads"),
        "{e}"
    );
    let e = msg(gpu.run(|rec| {
        attention::attention(
            rec,
            &f(&[1, 4, 2, 256]),
            &f(&[1, 4, 2, 256]),
            &f(&[1, 4, 2, 256]),
            a,
        )
        .map(|_| ())
    }));
    assert!(e.contains("head dimension"), "{e}");
    let e = msg(gpu.run(|rec| {
        attention::attention(
            rec,
            &f(&[1, 5, 2, 8]),
            &f(&[1, 4, 2, 8]),
            &f(&[1, 4, 2, 8]),
            a,
        )
        .map(|_| ())
    }));
    assert!(e.contains("causal"), "{e}");
    let e = msg(gpu.run(|rec| bias::bias_add(rec, &f(&[3, 4]), &f(&[5])).map(|_| ())));
    assert!(
        e.contains("bias_add") && e.contains("[3, 4]") && e.contains("5"),
        "{e}"
    );
    let e = msg(gpu.run(|rec| upsample::pixel_shuffle(rec, &f(&[1, 6, 2, 2]), 2).map(|_| ())));
    assert!(
        e.contains("pixel_shuffle") && e.contains("[1, 6, 2, 2]"),
        "{e}"
    );
}

#[test]
fn whole_model_gradients_match_finite_differences() {
    // Both flavours without and with dropout: loss and gradients each.
    assert_checks("transformer gradients", 8);
}

#[test]
fn weight_gradient_products_split_k() {
    use doppler::ops::matmul;
    let gpu = gpu();
    let a = Tensor::from_f32(gpu, &[2048, 36], &vec![0.5; 2048 * 36], "dy").unwrap();
    let b = Tensor::from_f32(gpu, &[2048, 44], &vec![0.25; 2048 * 44], "x").unwrap();
    let mut rec = gpu.recorder("splitk");
    let c = matmul::matmul(
        &mut rec,
        &a,
        &b,
        matmul::MatmulOpts {
            trans_a: true,
            ..Default::default()
        },
    )
    .unwrap();
    // Four chunks of 512 in one batched dispatch, then the ordered sum.
    assert_eq!(rec.dispatches(), 2);
    rec.submit().unwrap();
    assert!(c.read_f32(gpu).unwrap().iter().all(|&v| v == 256.0));
}

#[test]
fn gradient_accumulation_matches_one_big_batch() {
    use doppler::autograd::Tape;
    use doppler::models::transformer::{Arch, Transformer};
    let gpu = gpu();
    let cfg = doppler::verify::model::tiny(Arch::Llama);
    let (b, t) = (4, 5);
    let ids: Vec<u32> = (0..b * t).map(|i| (i * 7 % 11) as u32).collect();
    let targets: Vec<u32> = (0..b * t).map(|i| (i * 5 % 11) as u32).collect();
    let grads = |model: &mut Transformer, parts: usize| -> Vec<Vec<f32>> {
        let rows = b / parts;
        for p in 0..parts {
            let span = p * rows * t..(p + 1) * rows * t;
            let ti = Tensor::from_u32(gpu, &[rows, t], &ids[span.clone()], "ids").unwrap();
            let tt = Tensor::from_u32(gpu, &[rows, t], &targets[span], "targets").unwrap();
            let mut rec = gpu.recorder("accum");
            let mut tape = Tape::new();
            let loss = model.loss(&mut tape, &mut rec, &ti, &tt, None).unwrap();
            tape.backward(&mut rec, loss, 1.0 / parts as f32, &mut model.params)
                .unwrap();
            rec.submit().unwrap();
        }
        let out = model
            .params
            .grads
            .iter()
            .map(|g| g.as_ref().unwrap().read_f32(gpu).unwrap())
            .collect();
        model.params.zero_grad();
        out
    };
    let mut model = Transformer::new(gpu, &cfg, 5).unwrap();
    let whole = grads(&mut model, 1);
    let split = grads(&mut model, 2);
    for (name, (w, s)) in model.params.names.iter().zip(whole.iter().zip(&split)) {
        let big = w.iter().fold(1e-12f32, |m, v| m.max(v.abs()));
        for (i, (x, y)) in w.iter().zip(s).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * big,
                "{name}[{i}]: one batch {x}, two micro-batches {y}"
            );
        }
    }
}

/// The tape adds a linear's input gradient into the gradient already there only when that
/// buffer is the value's own: here d(a + b) hands one buffer to both inputs right before
/// each linear's backward, so an in-place add would change the linear's own upstream
/// gradient. Checked against central differences of the f32 forward.
#[test]
fn tape_accumulates_in_place_only_into_its_own_gradients() {
    use doppler::autograd::{ParamStore, Tape};
    let gpu = gpu();
    let (rows, c, v) = (6, 8, 5);
    let mut rng = Rng::new(77);
    let h0 = rng.vec(rows * c);
    let w1: Vec<f32> = rng.vec(c * c).iter().map(|x| 0.5 * x).collect();
    let w2 = rng.vec(v * c);
    let targets: Vec<u32> = (0..rows).map(|i| (i * 3 % v) as u32).collect();
    let tt = Tensor::from_u32(gpu, &[rows], &targets, "targets").unwrap();
    // loss = CE(s2 w2^T), s2 = s + s w1^T, s = h + h w1^T: h and s each feed an add and a
    // linear.
    let run = |h: &[f32]| -> (f32, Vec<f32>) {
        let mut store = ParamStore::default();
        let ih = store.push("h", Tensor::from_f32(gpu, &[rows, c], h, "h").unwrap());
        let iw1 = store.push("w1", Tensor::from_f32(gpu, &[c, c], &w1, "w1").unwrap());
        let iw2 = store.push("w2", Tensor::from_f32(gpu, &[v, c], &w2, "w2").unwrap());
        let mut rec = gpu.recorder("tape");
        let mut tape = Tape::new();
        let (h, w1, w2) = (
            tape.param(&store, ih),
            tape.param(&store, iw1),
            tape.param(&store, iw2),
        );
        let h2 = tape.linear(&mut rec, h, w1, None).unwrap();
        let s = tape.add(&mut rec, h, h2).unwrap();
        let s3 = tape.linear(&mut rec, s, w1, None).unwrap();
        let s2 = tape.add(&mut rec, s, s3).unwrap();
        let logits = tape.linear(&mut rec, s2, w2, None).unwrap();
        let loss = tape
            .cross_entropy(&mut rec, logits, &tt, Default::default())
            .unwrap();
        let lt = tape.value(loss).unwrap().clone();
        tape.backward(&mut rec, loss, 1.0, &mut store).unwrap();
        rec.submit().unwrap();
        let g = store.grads[ih].as_ref().unwrap().read_f32(gpu).unwrap();
        (lt.read_f32(gpu).unwrap()[0], g)
    };
    let (_, grad) = run(&h0);
    let eps = 1e-2;
    for i in 0..rows * c {
        let mut hp = h0.clone();
        hp[i] += eps;
        let mut hm = h0.clone();
        hm[i] -= eps;
        let fd = (run(&hp).0 - run(&hm).0) / (2.0 * eps);
        assert!(
            (grad[i] - fd).abs() <= 2e-3 + 1e-2 * fd.abs(),
            "dh[{i}]: tape {}, central difference {fd}",
            grad[i]
        );
    }
}

#[test]
fn dequantization_matches_the_cpu_dequantizer() {
    assert_checks("dequantize", doppler::ops::quant::SUPPORTED.len() + 2);
}

#[test]
fn quantized_products_read_blocks_directly() {
    // Per type: one gather, three products (matrix-vector and tiled) and two products with
    // W untransposed (qmatmul_t, the backward's).
    assert_checks("qmatmul", 6 * doppler::verify::quant::product_cases().len());
}

#[test]
fn decode_products_on_8_bit_x_keep_a_nan_or_infinity_non_finite() {
    use doppler::formats::gguf::GgmlType;
    use doppler::ops::quant::{decode_rounds_x, qmatmul, QMatrix, MATVEC1_MIN_ROWS, XQ8_MIN_COLS};
    let (rows, cols) = (MATVEC1_MIN_ROWS, XQ8_MIN_COLS);
    let ty = GgmlType::from_name("Q8_0").unwrap();
    assert!(decode_rounds_x(gpu(), 1, ty, rows, cols));
    let raw = verify::quant::random_blocks("Q8_0", rows * cols, &mut Rng::new(5));
    let w = QMatrix::new(gpu(), "w", &raw, ty, rows, cols).unwrap();
    for bad in [f32::NAN, f32::INFINITY] {
        let mut x = Rng::new(6).vec(cols);
        x[40] = bad;
        let xt = Tensor::from_f32(gpu(), &[1, cols], &x, "x").unwrap();
        let y = gpu().run(|rec| qmatmul(rec, &xt, &w)).unwrap();
        let y = y.read_f32(gpu()).unwrap();
        assert!(
            y.iter().all(|v| !v.is_finite()),
            "x[40] = {bad}: finite outputs"
        );
    }
}

#[test]
fn decode_products_round_their_outputs_for_the_next_product() {
    // The chain (bit-exact rounding, outputs) and a mismatched norm weight refused.
    assert_checks("qmatmul_chain", 2);
    let results = verify::run_families(gpu(), Some("qmatmul_chain"));
    let chain = results
        .iter()
        .find(|c| c.op == "qmatmul_chain")
        .expect("the chain check");
    assert!(
        chain.shape.ends_with("3 of 3 links chained"),
        "{}",
        chain.shape
    );
}

#[test]
fn decode_chain_falls_back_where_the_adapter_offers_256_threads() {
    // A browser's adapter offers 256 threads a workgroup: the o and down products' rounding
    // (512 threads: few rows of W, long rows) is left to the product after each, and the
    // checks still pass (before, the check demanded every link chain and failed in Chromium).
    let mut small = Gpu::new_blocking(&GpuOptions::from_env()).expect("a GPU adapter");
    small.limits.max_compute_invocations_per_workgroup = 256;
    small.limits.max_compute_workgroup_size_x = 256;
    let results = verify::run_families(&small, Some("qmatmul_chain"));
    let chain: Vec<_> = results
        .iter()
        .filter(|c| c.op.starts_with("qmatmul_chain"))
        .collect();
    assert_eq!(chain.len(), 2);
    for c in &chain {
        assert!(c.pass, "{} {}: {:?}", c.op, c.shape, c.error);
    }
    assert!(
        chain[0].shape.ends_with("1 of 3 links chained"),
        "{}",
        chain[0].shape
    );
}

#[test]
fn cached_attention_matches_full_attention() {
    assert_checks("kv_attend", doppler::verify::kv_attend_checks());
}

#[test]
fn paged_attention_matches_reference_alone_and_in_any_layout() {
    // Continuous batching's attention: rows of 5 sequences in scattered pages, 1 to 5
    // ranges of 64 keys, f32 and f16 pools, against f64; each row alone, and the batch
    // split or looped, the same bits.
    assert_checks("kv_paged", 2);
}

#[test]
fn paged_rope_product_matches_the_two_steps_and_is_batch_invariant() {
    // Serving's q/k/v product with RoPE and the paged store as its epilogue: adjacent and
    // half-head pairs, f32 and f16 pools; each row alone the batch's bits.
    assert_checks("qmatmul_rows_rope", 4);
}

#[test]
fn llama_from_gguf_and_safetensors_agree() {
    // llama and qwen2, each in f32, f16 and bf16.
    assert_checks("llama gguf vs safetensors", 6);
}

#[test]
fn fused_quantized_products_match_reference() {
    // Norm + SwiGLU and residual, three types, three shapes.
    assert_checks("qmatmul fused", 11);
}

#[test]
fn attention_merged_into_the_o_product_matches_the_two_step_path() {
    assert_checks("qmatvec_merged", 8);
}

#[test]
fn rope_store_matches_reference() {
    assert_checks("rope_store", 7);
}

#[test]
fn a_training_run_stops_after_the_step_its_handler_asks() {
    use doppler::train::{config::TrainConfig, Event, Flow, Trainer};
    let toml = r#"
[model]
arch = "llama"
n_layer = 1
n_embd = 16
n_head = 2
block_size = 8
[data]
corpus = "unused"
tokenizer = "char"
val_fraction = 0.1
[train]
batch_size = 2
steps = 10
lr = 1e-3
min_lr = 1e-4
warmup = 2
eval_interval = 5
eval_batches = 1
checkpoint_interval = 10
seed = 1
out_dir = "unused"
"#;
    let cfg = TrainConfig::parse(toml, "inline").expect("config");
    let text = "to be or not to be, that is the question. ".repeat(20);
    let mut t = Trainer::fresh(gpu(), &cfg, &text).expect("trainer");
    let mut seen = Vec::new();
    let summary = pollster::block_on(t.run_async(10, &mut |e| {
        Ok(match e {
            Event::Step(s) => {
                seen.push(("step", s.step));
                if s.step == 3 {
                    Flow::Stop
                } else {
                    Flow::Continue
                }
            }
            Event::Eval { step, .. } => {
                seen.push(("eval", step));
                Flow::Continue
            }
            _ => Flow::Continue,
        })
    }))
    .expect("run");
    assert!(summary.stopped);
    assert_eq!(summary.steps, 3);
    // Evaluated at 0 and at the stop; no step after it.
    let want = [
        ("eval", 0),
        ("step", 1),
        ("step", 2),
        ("step", 3),
        ("eval", 3),
    ];
    assert_eq!(seen, want);
    assert!(summary.final_val_loss.is_finite() && summary.final_train_loss.is_finite());
    // Asking to stop on the last step is no early stop.
    let last = |e: Event<'_>| match e {
        Event::Step(_) => Flow::Stop,
        _ => Flow::Continue,
    };
    let summary = pollster::block_on(t.run_async(4, &mut |e| Ok(last(e)))).expect("run");
    assert_eq!((summary.steps, summary.stopped), (4, false));
}

#[test]
fn a_gguf_whose_layer_count_contradicts_its_tensors_is_refused() {
    use doppler::formats::gguf::{self, GgufFile, Value};
    let files = doppler::verify::llama::tiny_files("llama", "F32", 7).expect("tiny model");
    let g = gguf::Gguf::parse(&files.gguf, "m.gguf").unwrap();
    // The same tensors, the metadata saying one layer fewer.
    let mut md: Vec<(&str, Value)> = g
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    let layers = g.metadata["llama.block_count"].as_u64().unwrap();
    for (k, v) in md.iter_mut() {
        if *k == "llama.block_count" {
            *v = Value::U32(layers as u32 - 1);
        }
    }
    let tensors: Vec<(&str, &[u64], gguf::GgmlType, &[u8])> = g
        .tensors
        .iter()
        .map(|t| {
            (
                t.name.as_str(),
                t.dims.as_slice(),
                t.ty,
                g.tensor_data(&files.gguf, t),
            )
        })
        .collect();
    let bytes = gguf::write(&md, &tensors, 32);
    let file = GgufFile::from_bytes(Box::new(bytes), "m.gguf").unwrap();
    let e = doppler::models::llama::from_gguf(gpu(), &file, 64)
        .err()
        .expect("refused")
        .to_string();
    let last = layers - 1;
    assert!(
        e.contains("m.gguf")
            && e.contains(&format!("a {last}-layer llama does not read: blk.{last}.")),
        "{e}"
    );
    // The file as written loads.
    let file = GgufFile::from_bytes(Box::new(files.gguf), "m.gguf").unwrap();
    doppler::models::llama::from_gguf(gpu(), &file, 64).expect("the tiny model loads");
}

/// Several training steps of the GPU trainer (grad_accum 2, clipping, weight decay, warmup
/// then cosine) against the f64 reference trainer: the reference model's loss, its
/// gradients by central differences, clipping and torch.optim.AdamW's update in f64, on the
/// same batches. Both flavours (gpt2 with its tied head, llama with grouped-query attention
/// and an untied head). The losses of every step and the weights after the last must agree.
#[test]
fn training_steps_match_the_f64_reference_trainer() {
    use doppler::optim::warmup_cosine;
    use doppler::reference::{finite_diff, optim as ropt, transformer as rmodel};
    use doppler::train::{config::TrainConfig, Trainer};
    use std::collections::HashMap;
    let gpu = gpu();
    let text =
        "the quick brown fox jumps over the lazy dog; pack my box with five dozen jugs. ".repeat(3);
    // The third run trains with dropout (embeddings and branches 0.2, attention
    // probabilities 0.3): the reference applies the masks of the trainer's dropout seeds.
    for (arch, extra) in [
        ("gpt2", ""),
        ("llama", "n_kv_head = 1\n"),
        ("gpt2", "dropout = 0.2\nattn_dropout = 0.3\n"),
    ] {
        let toml = format!(
            "[model]\narch = \"{arch}\"\nn_layer = 2\nn_embd = 8\nn_head = 2\n{extra}block_size = 6\nffn_hidden = 12\n\
             [data]\ncorpus = \"-\"\ntokenizer = \"char\"\nval_fraction = 0.2\n\
             [train]\nbatch_size = 3\ngrad_accum = 2\nsteps = 8\nlr = 1e-2\nmin_lr = 1e-3\nwarmup = 2\n\
             weight_decay = 0.1\nbetas = [0.9, 0.95]\ngrad_clip = 0.3\neval_interval = 100\n\
             eval_batches = 1\ncheckpoint_interval = 100\nseed = 7\nout_dir = \"-\"\n"
        );
        let cfg = TrainConfig::parse(&toml, "test").unwrap();
        let mut trainer = Trainer::fresh(gpu, &cfg, &text).unwrap();
        let (mcfg, tc) = (
            trainer.cfg.transformer().unwrap().clone(),
            trainer.cfg.train.clone(),
        );
        let names = trainer.params().names.clone();
        let read = |p: &doppler::autograd::ParamStore| -> Vec<Vec<f64>> {
            p.values
                .iter()
                .map(|v| v.read_f32(gpu).unwrap().iter().map(|&x| x as f64).collect())
                .collect()
        };
        let mut w = read(trainer.params());
        let decayed = trainer.text_model().unwrap().0.decayed();
        let mut m: Vec<Vec<f64>> = w.iter().map(|x| vec![0.0; x.len()]).collect();
        let mut v = m.clone();
        let (steps, t) = (4u64, mcfg.block_size);
        let (mut clipped, mut max_lr) = (0, 0.0f64);
        for step in 0..steps {
            let micro: Vec<(Vec<u32>, Vec<u32>, u64)> = (0..tc.grad_accum)
                .map(|i| {
                    let (ids, tg) = trainer.batch(step, i).unwrap();
                    (ids, tg, trainer.dropout_seed(step, i))
                })
                .collect();
            let loss = |w: &[Vec<f64>]| -> f64 {
                let map: HashMap<String, Vec<f64>> =
                    names.iter().cloned().zip(w.iter().cloned()).collect();
                micro
                    .iter()
                    .map(|(ids, tg, ds)| rmodel::loss(&mcfg, &map, ids, tg, t, Some(*ds)))
                    .sum::<f64>()
                    / tc.grad_accum as f64
            };
            let want = loss(&w);
            let got = trainer.train_step().unwrap();
            assert!(
                ((got.loss as f64 - want) / want).abs() < 2e-5,
                "{arch} step {}: loss {} on the GPU, {want} in f64",
                step + 1,
                got.loss
            );
            let grads: Vec<Vec<f64>> = (0..w.len())
                .map(|i| {
                    finite_diff(
                        |x| {
                            let mut w2 = w.clone();
                            w2[i] = x.to_vec();
                            loss(&w2)
                        },
                        &w[i],
                    )
                })
                .collect();
            let refs: Vec<&[f64]> = grads.iter().map(|g| g.as_slice()).collect();
            let (norm, factor) = ropt::grad_scale(&refs, tc.grad_clip.map(|c| c as f64), 1.0);
            clipped += (factor < 1.0) as usize;
            let lr = warmup_cosine(step, tc.lr, tc.min_lr, tc.warmup, tc.steps);
            max_lr = max_lr.max(lr);
            assert!(norm.is_finite());
            for i in 0..w.len() {
                let g: Vec<f64> = grads[i].iter().map(|x| x * factor).collect();
                let wd = if decayed[i] { tc.weight_decay } else { 0.0 };
                ropt::adamw_step(
                    &mut w[i],
                    &g,
                    &mut m[i],
                    &mut v[i],
                    step as i32 + 1,
                    lr,
                    tc.betas,
                    1e-8,
                    wd,
                );
            }
        }
        assert!(
            clipped > 0,
            "{arch}: clipping never acted; the test would not check it"
        );
        let got = read(trainer.params());
        for (i, name) in names.iter().enumerate() {
            let big = w[i].iter().fold(0.0f64, |a, x| a.max(x.abs()));
            let diff = got[i]
                .iter()
                .zip(&w[i])
                .fold(0.0f64, |a, (x, y)| a.max((x - y).abs()));
            // The key bias's true gradient is zero: both sides step on rounding noise, by
            // at most lr a step.
            let bound = if name.ends_with("attn.k.bias") {
                max_lr * steps as f64
            } else {
                1e-3 * big
            };
            eprintln!("{arch} {name}: max |GPU - f64| {diff:.2e} (largest {big:.2e})");
            assert!(diff <= bound, "{arch} {name}: GPU and f64 weights differ by {diff:.2e} after {steps} steps (bound {bound:.2e})");
        }
    }
}

/// A tiny conv-net run's config (`arch` "convnet" or "unet": 2-channel 4x4 images in 3
/// classes, two stages) and its images file's text: 16 images of random pixels in 0..=16.
fn tiny_conv_run(arch: &str, out_dir: &str, images: &str) -> (String, String) {
    // The U-Net smaller (its finite differences cost the most): 2 and 4 channels in one
    // group (per-channel constants such as the embedding's must not cancel in the norm).
    let (extra, channels, groups) = match arch {
        "unet" => ("timesteps = 7\n", "[2, 4]", 1),
        _ => ("", "[4, 6]", 2),
    };
    let toml = format!(
        "[model]\narch = \"{arch}\"\n{extra}in_channels = 2\nimage_size = 4\nclasses = 3\n\
         channels = {channels}\nblocks = 1\ngroups = {groups}\n\
         [data]\nimages = \"{images}\"\npixel_max = 16\nval_fraction = 0.25\n\
         [train]\nbatch_size = 3\ngrad_accum = 2\nsteps = 8\nlr = 1e-2\nmin_lr = 1e-3\nwarmup = 2\n\
         weight_decay = 0.1\nbetas = [0.9, 0.95]\ngrad_clip = 0.5\neval_interval = 2\n\
         checkpoint_interval = 2\nseed = 11\nout_dir = \"{out_dir}\"\n"
    );
    let mut rng = Rng::new(77);
    let csv: String = (0..16)
        .map(|i| {
            let px: Vec<String> = (0..32).map(|_| (rng.next_u64() % 17).to_string()).collect();
            format!("{},{}\n", px.join(","), i % 3)
        })
        .collect();
    (toml, csv)
}

/// The conv nets' training steps (batches, loss, gradients of the whole classifier or
/// U-Net, clipping, AdamW with decay on the kernels only) against the f64 reference
/// model's loss, its finite-difference gradients and the f64 AdamW, step by step.
#[test]
fn conv_training_steps_match_the_f64_reference_trainer() {
    conv_steps_against_f64("convnet", 4);
}

#[test]
fn unet_training_steps_match_the_f64_reference_trainer() {
    conv_steps_against_f64("unet", 2);
}

fn conv_steps_against_f64(arch: &str, steps: u64) {
    use doppler::models::convnet::ConvNet;
    use doppler::optim::warmup_cosine;
    use doppler::reference::{convnet as rmodel, finite_diff, optim as ropt};
    use doppler::train::{config::TrainConfig, Trainer};
    use std::collections::HashMap;
    let gpu = gpu();
    let (toml, csv) = tiny_conv_run(arch, "-", "-");
    let cfg = TrainConfig::parse(&toml, "test").unwrap();
    let mut trainer = Trainer::fresh(gpu, &cfg, &csv).unwrap();
    let ccfg = match &trainer.cfg.model {
        doppler::train::config::NetConfig::Conv(c) => c.clone(),
        _ => unreachable!(),
    };
    let tc = trainer.cfg.train.clone();
    let names = trainer.params().names.clone();
    let read = |p: &doppler::autograd::ParamStore| -> Vec<Vec<f64>> {
        p.values
            .iter()
            .map(|v| v.read_f32(gpu).unwrap().iter().map(|&x| x as f64).collect())
            .collect()
    };
    let mut w = read(trainer.params());
    let expected: Vec<bool> = ConvNet::expected(&ccfg)
        .iter()
        .map(|(_, s)| s.len() >= 2)
        .collect();
    let mut m: Vec<Vec<f64>> = w.iter().map(|x| vec![0.0; x.len()]).collect();
    let mut v = m.clone();
    let wide = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    let (mut clipped, mut max_lr) = (0, 0.0f64);
    for step in 0..steps {
        // (images or noisy images, labels or classes, the U-Net's steps and noise)
        let micro: Vec<(Vec<f64>, Vec<u32>, Vec<u32>, Vec<f64>)> = (0..tc.grad_accum)
            .map(|i| match arch {
                "unet" => {
                    let d = trainer.diffusion_batch(step, i).unwrap();
                    (wide(&d.noisy), d.classes, d.t, wide(&d.noise))
                }
                _ => {
                    let (px, labels) = trainer.image_batch(step, i).unwrap();
                    (wide(&px), labels, vec![], vec![])
                }
            })
            .collect();
        let loss = |w: &[Vec<f64>]| -> f64 {
            let map: HashMap<String, Vec<f64>> =
                names.iter().cloned().zip(w.iter().cloned()).collect();
            micro
                .iter()
                .map(|(px, labels, t, noise)| match arch {
                    "unet" => rmodel::diffusion_loss(&ccfg, &map, px, t, labels, noise),
                    _ => rmodel::loss(&ccfg, &map, px, labels),
                })
                .sum::<f64>()
                / tc.grad_accum as f64
        };
        let want = loss(&w);
        let got = trainer.train_step().unwrap();
        assert!(
            ((got.loss as f64 - want) / want).abs() < 2e-5,
            "{arch} step {}: loss {} on the GPU, {want} in f64",
            step + 1,
            got.loss
        );
        let grads: Vec<Vec<f64>> = (0..w.len())
            .map(|i| {
                finite_diff(
                    |x| {
                        let mut w2 = w.clone();
                        w2[i] = x.to_vec();
                        loss(&w2)
                    },
                    &w[i],
                )
            })
            .collect();
        let refs: Vec<&[f64]> = grads.iter().map(|g| g.as_slice()).collect();
        let (norm, factor) = ropt::grad_scale(&refs, tc.grad_clip.map(|c| c as f64), 1.0);
        clipped += (factor < 1.0) as usize;
        let lr = warmup_cosine(step, tc.lr, tc.min_lr, tc.warmup, tc.steps);
        max_lr = max_lr.max(lr);
        assert!(norm.is_finite());
        for i in 0..w.len() {
            let g: Vec<f64> = grads[i].iter().map(|x| x * factor).collect();
            let wd = if expected[i] { tc.weight_decay } else { 0.0 };
            ropt::adamw_step(
                &mut w[i],
                &g,
                &mut m[i],
                &mut v[i],
                step as i32 + 1,
                lr,
                tc.betas,
                1e-8,
                wd,
            );
        }
    }
    assert!(
        clipped > 0,
        "{arch}: clipping never acted; the test would not check it"
    );
    let got = read(trainer.params());
    for (i, name) in names.iter().enumerate() {
        let big = w[i].iter().fold(0.0f64, |a, x| a.max(x.abs()));
        let diff = got[i]
            .iter()
            .zip(&w[i])
            .fold(0.0f64, |a, (x, y)| a.max((x - y).abs()));
        eprintln!("{arch} {name}: max |GPU - f64| {diff:.2e} (largest {big:.2e})");
        assert!(
            diff <= 1e-3 * big,
            "{arch} {name}: GPU and f64 weights differ by {diff:.2e} after {steps} steps (largest {big:.2e}, lr up to {max_lr})"
        );
    }
}

/// A conv-net run stopped at a checkpoint and resumed continues bit for bit: the same
/// losses and weights as the uninterrupted run; metrics.jsonl has held-out accuracy.
#[test]
fn conv_training_resumes_bit_exactly() {
    use doppler::train::{config::TrainConfig, Trainer};
    let gpu = gpu();
    let dir = std::env::temp_dir().join(format!("doppler-conv-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let run = |name: &str, stops: &[u64]| -> (Vec<f32>, Vec<u8>) {
        let (toml, csv) = tiny_conv_run("convnet", name, "images.csv");
        std::fs::write(dir.join("images.csv"), csv).unwrap();
        let path = dir.join(format!("{name}.toml"));
        std::fs::write(&path, toml).unwrap();
        let cfg = TrainConfig::load(&path).unwrap();
        let mut losses = Vec::new();
        for (k, &stop) in stops.iter().enumerate() {
            let mut t = Trainer::new(gpu, &cfg, k > 0).unwrap();
            t.run(stop, &mut |e| {
                if let doppler::train::Event::Step(s) = e {
                    losses.push(s.loss);
                }
            })
            .unwrap();
        }
        let t = Trainer::new(gpu, &cfg, true).unwrap();
        (losses, pollster::block_on(t.model_safetensors()).unwrap())
    };
    let (a, wa) = run("whole", &[8]);
    let (b, wb) = run("halves", &[4, 8]);
    assert_eq!(a.len(), 8);
    assert_eq!(a, b, "losses of the resumed run");
    assert!(wa == wb, "weights of the resumed run differ");
    let metrics = std::fs::read_to_string(dir.join("halves/metrics.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let evals: Vec<u64> = rows
        .iter()
        .filter(|r| r["val_accuracy"].is_number())
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evals, [0, 2, 4, 6, 8], "{metrics}");
    assert!(dir.join("halves/loss.svg").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A checkpoint's metrics are on disk before the checkpoint is committed (issue 22): here
/// the save fails after the step folder is in place (`latest` cannot be replaced), as a
/// process killed between the two would leave it, and metrics.jsonl already holds every
/// step's row.
#[test]
fn metrics_are_written_before_the_checkpoint_commits() {
    use doppler::train::{config::TrainConfig, Trainer};
    let gpu = gpu();
    let out = std::env::temp_dir().join(format!("doppler-metrics-order-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let toml = format!(
        "[model]\narch = \"llama\"\nn_layer = 1\nn_embd = 8\nn_head = 2\nblock_size = 4\n\
         [data]\ncorpus = \"-\"\ntokenizer = \"char\"\n\
         [train]\nbatch_size = 2\nsteps = 4\nlr = 1e-3\neval_interval = 100\neval_batches = 1\n\
         checkpoint_interval = 100\nseed = 1\nout_dir = {:?}\n",
        out.display().to_string()
    );
    let cfg = TrainConfig::parse(&toml, "t.toml").unwrap();
    let mut t = Trainer::fresh(gpu, &cfg, &"abcdefgh ".repeat(20)).unwrap();
    t.persist = true;
    for _ in 0..2 {
        t.train_step().unwrap();
    }
    std::fs::create_dir_all(out.join(format!("latest.tmp-{}", std::process::id()))).unwrap();
    assert!(t.save().is_err());
    assert!(out.join("step-00000002").is_dir());
    let metrics =
        std::fs::read_to_string(out.join("metrics.jsonl")).expect("metrics.jsonl written");
    let steps: Vec<u64> = metrics
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(steps, [1, 2]);
    let _ = std::fs::remove_dir_all(&out);
}

/// Tables split by rows (embeddings past one storage binding) match the whole table.
#[test]
fn row_split_tables_match_the_whole_table() {
    assert_checks("row_split", 3);
}

/// Tiny random models written by transformers with their logits (`python3
/// scripts/make_family_fixtures.py crates/doppler/tests/fixtures`: transformers 5.17, torch
/// 2.11, f32 on the CPU): Doppler loads each Hugging Face directory, and where given the
/// same weights as a GGUF file under llama.cpp's names, and must give transformers' logits
/// at every position, in one prompt and token by token through the cache.
fn family_matches_transformers(
    family: &str,
    ctx: usize,
    gguf: Option<(
        &str,
        Vec<(&str, doppler::formats::gguf::Value)>,
        Vec<String>,
    )>,
) -> doppler::models::llama::Llama {
    use doppler::formats::gguf::{self, GgmlType};
    use doppler::models::llama::{self, Llama, SafeTensorsDir};
    let gpu = gpu();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("tests/fixtures/{family}-tiny"));
    let fx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("logits.json")).unwrap()).unwrap();
    let ids: Vec<u32> = fx["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let want: Vec<f64> = fx["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r.as_array().unwrap().iter().map(|v| v.as_f64().unwrap()))
        .collect();
    let (hf, _) = llama::open(gpu, &dir, ctx).unwrap();
    let mut models: Vec<(&str, Llama)> = Vec::new();
    if let Some((arch, meta, names)) = gguf {
        // The same tensors (f32) under GGUF's names, with the metadata given.
        let st_bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let raw = safetensors::SafeTensors::deserialize(&st_bytes).unwrap();
        let tensors: Vec<(String, Vec<u64>, Vec<u8>)> = names
            .iter()
            .map(|n| {
                let hf_names = SafeTensorsDir::hf_names(n);
                let t = hf_names
                    .iter()
                    .find_map(|h| raw.tensor(h).ok())
                    .unwrap_or_else(|| panic!("{n}: none of {hf_names:?}"));
                let dims = t.shape().iter().rev().map(|&d| d as u64).collect();
                // llama.cpp's converter stores Gemma's norm weights as 1 + w.
                let data = match arch == "gemma3" && n.ends_with("norm.weight") {
                    true => t
                        .data()
                        .chunks_exact(4)
                        .flat_map(|b| {
                            (f32::from_le_bytes(b.try_into().unwrap()) + 1.0).to_le_bytes()
                        })
                        .collect(),
                    false => t.data().to_vec(),
                };
                (n.clone(), dims, data)
            })
            .collect();
        let mut md: Vec<(String, gguf::Value)> = vec![(
            "general.architecture".into(),
            gguf::Value::String(arch.into()),
        )];
        md.extend(meta.into_iter().map(|(k, v)| (format!("{arch}.{k}"), v)));
        let md_ref: Vec<(&str, gguf::Value)> =
            md.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        let mut t_ref: Vec<(&str, &[u64], GgmlType, &[u8])> = tensors
            .iter()
            .map(|(n, d, b)| (n.as_str(), d.as_slice(), GgmlType(0), b.as_slice()))
            .collect();
        // LongRoPE's factors as llama.cpp stores them: tensors.
        let cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
        let factors: Vec<(String, Vec<u8>)> = ["short", "long"]
            .iter()
            .filter_map(|k| {
                let a = cfg["rope_parameters"][format!("{k}_factor")].as_array()?;
                let b = a
                    .iter()
                    .flat_map(|v| (v.as_f64().unwrap() as f32).to_le_bytes())
                    .collect();
                Some((format!("rope_factors_{k}.weight"), b))
            })
            .collect();
        let dims: Vec<[u64; 1]> = factors.iter().map(|(_, b)| [b.len() as u64 / 4]).collect();
        for ((n, b), d) in factors.iter().zip(&dims) {
            t_ref.push((n.as_str(), d.as_slice(), GgmlType(0), b.as_slice()));
        }
        let path =
            std::env::temp_dir().join(format!("doppler-{family}-{}.gguf", std::process::id()));
        std::fs::write(&path, gguf::write(&md_ref, &t_ref, 32)).unwrap();
        let (gg, _) = llama::open(gpu, &path, ctx).unwrap();
        let _ = std::fs::remove_file(&path);
        models.push(("gguf", gg));
    }
    use doppler::ops::kvcache::{KvType, RING_STEP};
    // f32 caches within 1e-4 of transformers (f32 throughout); f16 caches (the default
    // where the adapter has shader-f16) within 5e-3: keys and values rounded to 11 bits
    // (the kernels themselves match the f16-rounded reference to f32 precision: `doppler
    // verify --filter kv_attend`), amplified through the layers (Gemma 3's six layers of
    // norms drawn around 2: 2.9e-3; the two-layer models 0.9-1.7e-4).
    // q8_0 caches (head sizes that are a multiple of 32) within 0.2: 8 bits a value,
    // about 30-40 times the f16 cache's error (qwen3 5.2e-3, Gemma 3's amplifying norms
    // 0.12 on logits up to 1.2; the kernels match the host-quantized reference to f32
    // precision, `doppler verify --filter kv_attend`).
    let mut types = vec![(KvType::F32, 1e-4), (KvType::F16, 5e-3)];
    if hf.cfg.head_dim % 32 == 0 {
        types.push((KvType::Q8_0, 0.2));
    }
    for (dtype, bound) in types {
        for (name, m) in
            std::iter::once(("safetensors", &hf)).chain(models.iter().map(|(n, m)| (*n, m)))
        {
            let mut cache = m.cache_with(gpu, 64, RING_STEP, dtype).unwrap();
            let all = gpu
                .run(|rec| m.forward(rec, &ids, &mut cache, true))
                .unwrap();
            let got = all.read_f32(gpu).unwrap();
            let mut cache = m.cache_with(gpu, 64, RING_STEP, dtype).unwrap();
            let mut steps = gpu
                .run(|rec| m.forward(rec, &ids[..10], &mut cache, true))
                .unwrap()
                .read_f32(gpu)
                .unwrap();
            for &id in &ids[10..] {
                steps.extend(
                    gpu.run(|rec| m.forward(rec, &[id], &mut cache, false))
                        .unwrap()
                        .read_f32(gpu)
                        .unwrap(),
                );
            }
            let mut runs = vec![("prompt", got), ("token by token", steps)];
            if m.cfg.sliding_window.is_some() {
                // Rings of window + 2 rows: the prompt in steps of 3 tokens, the keys
                // wrapping around.
                let mut cache = m.cache_with(gpu, 64, 3, dtype).unwrap();
                let ring = gpu
                    .run(|rec| m.forward(rec, &ids, &mut cache, true))
                    .unwrap()
                    .read_f32(gpu)
                    .unwrap();
                runs.push(("ring, steps of 3", ring));
            }
            for (how, got) in &runs {
                assert_eq!(got.len(), want.len());
                let worst = got
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| (*g as f64 - w).abs())
                    .fold(0.0f64, f64::max);
                eprintln!(
                    "{family} {name} {how}, {dtype:?} cache: largest |Doppler - transformers| {worst:.2e}"
                );
                assert!(
                    worst < bound,
                    "{family} {name} {how}, {dtype:?} cache: logits differ from transformers' by {worst:.2e}"
                );
            }
        }
    }
    hf
}

/// GGUF names of a tiny model's layers' tensors (`fused`: Phi-3's attn_qkv and ffn_up).
fn gguf_names(layers: usize, per_layer: &[&str], extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    for l in 0..layers {
        v.extend(per_layer.iter().map(|t| format!("blk.{l}.{t}.weight")));
    }
    v
}

/// Qwen3: q/k head norms, head size 32 on a width of 64, 2 key/value heads, tied
/// embeddings, RoPE base 10^6 (in transformers 5's `rope_parameters`).
#[test]
fn qwen3_matches_transformers() {
    use doppler::formats::gguf::Value;
    let meta = vec![
        ("block_count", Value::U32(2)),
        ("context_length", Value::U32(128)),
        ("embedding_length", Value::U32(64)),
        ("feed_forward_length", Value::U32(96)),
        ("attention.head_count", Value::U32(4)),
        ("attention.head_count_kv", Value::U32(2)),
        ("attention.key_length", Value::U32(32)),
        ("attention.value_length", Value::U32(32)),
        ("attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
        ("rope.freq_base", Value::F32(1e6)),
        ("vocab_size", Value::U32(300)),
    ];
    let names = gguf_names(
        2,
        &[
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_q_norm",
            "attn_k_norm",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ],
        &["token_embd.weight", "output_norm.weight"],
    );
    let m = family_matches_transformers("qwen3", 128, Some(("qwen3", meta, names)));
    assert_eq!(
        (m.cfg.arch.as_str(), m.cfg.head_dim, m.cfg.rope_theta),
        ("qwen3", 32, 1e6)
    );
}

/// Gemma 3: five sliding-window layers (window 6 over 17 tokens) then a global one, local
/// and (linearly scaled) global RoPE, q/k head norms, post-attention and post-feed-forward
/// norms, GeGLU, embeddings scaled by sqrt(width), query_pre_attn_scalar 24 with head size
/// 32, a final logit soft-cap of 5, tied embeddings; and the same weights as GGUF (norms
/// stored as 1 + w, llama.cpp's default of one global layer in six, the query scale as
/// `gemma3.attention.scale`).
#[test]
fn gemma3_matches_transformers() {
    use doppler::formats::gguf::Value;
    let meta = vec![
        ("block_count", Value::U32(6)),
        ("context_length", Value::U32(128)),
        ("embedding_length", Value::U32(64)),
        ("feed_forward_length", Value::U32(96)),
        ("attention.head_count", Value::U32(4)),
        ("attention.head_count_kv", Value::U32(2)),
        ("attention.key_length", Value::U32(32)),
        ("attention.value_length", Value::U32(32)),
        ("attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
        ("attention.sliding_window", Value::U32(6)),
        ("rope.freq_base", Value::F32(1e6)),
        ("rope.scaling.type", Value::String("linear".into())),
        ("rope.scaling.factor", Value::F32(2.0)),
        ("final_logit_softcapping", Value::F32(5.0)),
        // query_pre_attn_scalar 24, not the head size (llama.cpp's rule otherwise).
        ("attention.scale", Value::F32(24f32.powf(-0.5))),
        ("vocab_size", Value::U32(300)),
    ];
    let names = gguf_names(
        6,
        &[
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_q_norm",
            "attn_k_norm",
            "attn_output",
            "post_attention_norm",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
            "post_ffw_norm",
        ],
        &["token_embd.weight", "output_norm.weight"],
    );
    let m = family_matches_transformers("gemma3", 128, Some(("gemma3", meta, names)));
    let c = &m.cfg;
    assert_eq!(
        (c.arch.as_str(), c.sliding_window, c.window(4), c.window(5)),
        ("gemma3", Some(6), Some(6), None)
    );
}

/// Mistral with a sliding window of 5 over 17 tokens (keys 5 back hidden; a ring of 7
/// rows in steps of 3).
#[test]
fn mistral_sliding_window_matches_transformers() {
    let m = family_matches_transformers("mistralswa", 128, None);
    assert_eq!(
        (
            m.cfg.arch.as_str(),
            m.cfg.sliding_window,
            m.cfg.context_length
        ),
        ("mistral", Some(5), 128)
    );
}

/// Mistral: head size 24 set apart from the width, 1 key/value head, an untied head.
#[test]
fn mistral_matches_transformers() {
    let m = family_matches_transformers("mistral", 128, None);
    assert_eq!(
        (m.cfg.arch.as_str(), m.cfg.head_dim, m.cfg.rope_theta),
        ("mistral", 24, 1e5)
    );
}

/// Phi-3: fused q/k/v and gate/up tensors; LongRoPE with per-frequency short and long
/// factors (256 positions from an original 64: attention factor sqrt(1 + ln 4 / ln 64)).
#[test]
fn phi3_matches_transformers() {
    use doppler::formats::gguf::Value;
    let meta = vec![
        ("block_count", Value::U32(2)),
        ("context_length", Value::U32(256)),
        ("embedding_length", Value::U32(64)),
        ("feed_forward_length", Value::U32(96)),
        ("attention.head_count", Value::U32(4)),
        ("attention.head_count_kv", Value::U32(2)),
        ("attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("rope.freq_base", Value::F32(1e4)),
        ("rope.dimension_count", Value::U32(16)),
        ("rope.scaling.original_context_length", Value::U32(64)),
        ("vocab_size", Value::U32(300)),
    ];
    let names = gguf_names(
        2,
        &[
            "attn_norm",
            "attn_qkv",
            "attn_output",
            "ffn_norm",
            "ffn_up",
            "ffn_down",
        ],
        &["token_embd.weight", "output_norm.weight", "output.weight"],
    );
    // A context within the original 64 positions: the short factors, as transformers
    // uses for a sequence that short.
    let m = family_matches_transformers("phi3", 64, Some(("phi3", meta, names)));
    let lr = m.cfg.rope_long.as_ref().expect("LongRoPE");
    assert_eq!(lr.original_context, 64);
    assert!((lr.attn_factor - (1.0 + 4f64.ln() / 64f64.ln()).sqrt()).abs() < 1e-12);
    // Past the original 64 positions transformers turns to the long factors; so does a
    // model loaded for a context past them (80 tokens: the last 8 positions' logits).
    let gpu = gpu();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/phi3-tiny");
    let fx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("logits.json")).unwrap()).unwrap();
    let ids: Vec<u32> = fx["long_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let want: Vec<f64> = fx["long_logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r.as_array().unwrap().iter().map(|v| v.as_f64().unwrap()))
        .collect();
    let (long, _) = doppler::models::llama::open(gpu, &dir, 128).unwrap();
    let mut cache = long
        .cache_with(
            gpu,
            128,
            doppler::ops::kvcache::RING_STEP,
            doppler::ops::kvcache::KvType::F32,
        )
        .unwrap();
    let all = gpu
        .run(|rec| long.forward(rec, &ids, &mut cache, true))
        .unwrap()
        .read_f32(gpu)
        .unwrap();
    let got = &all[all.len() - want.len()..];
    let worst = got
        .iter()
        .zip(&want)
        .map(|(g, w)| (*g as f64 - w).abs())
        .fold(0.0f64, f64::max);
    eprintln!("phi3 long factors, 80 tokens: largest |Doppler - transformers| {worst:.2e}");
    assert!(
        worst < 1e-4,
        "phi3 with the long factors: logits differ by {worst:.2e}"
    );
}

/// LoRA fine-tuning (issue 24): a tiny Llama's masked loss and the gradients of adapters
/// on all seven projections, through the frozen f32 and f16 base read in its encoding,
/// against central differences of the f64 reference with the adapters merged.
#[test]
fn lora_gradients_match_finite_differences() {
    assert_checks("lora gradients", 4);
}

/// A LoRA adapter saved as PEFT writes it from a Hugging Face base and loaded onto the same
/// model as GGUF (q/k rows permuted per head there): both give the same logits, saving
/// from the GGUF base gives back the same tensors, and an adapter that does not fit the
/// base (another rank in its config, an extra tensor) is refused by name.
#[test]
fn lora_adapters_round_trip_between_gguf_and_safetensors_bases() {
    use doppler::autograd::Tape;
    use doppler::finetune::{
        adapter,
        lora::{Lora, LoraSpec, Target},
    };
    use doppler::formats::gguf::GgufFile;
    use doppler::models::llama::{self, TrainOpts};
    let gpu = gpu();
    let files = doppler::verify::llama::tiny_files("llama", "F32", 3).unwrap();
    let g = GgufFile::from_bytes(Box::new(files.gguf.clone()), "m.gguf").unwrap();
    let gm = llama::from_gguf(gpu, &g, 64).unwrap();
    let st = llama::SafeTensorsDir::from_bytes(
        vec![("m.safetensors".into(), Box::new(files.safetensors.clone()))],
        "hf",
    )
    .unwrap();
    let hm = llama::from_safetensors(gpu, &files.config, "config.json", &st, 64).unwrap();
    let spec = LoraSpec {
        rank: 3,
        alpha: 6.0,
        dropout: 0.0,
        targets: Target::ALL.to_vec(),
    };
    let mut rng = doppler::check::Rng::new(77);
    let lh = Lora::build(gpu, &hm.cfg, spec, |_, _, (r, c), _| {
        Ok(rng.vec(r * c).iter().map(|v| 0.2 * v).collect())
    })
    .unwrap();
    let dir = std::env::temp_dir().join(format!("doppler-lora-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    adapter::save(gpu, &lh, &hm.cfg, "tiny", &dir).unwrap();
    let lg = adapter::load(gpu, &dir, &gm.cfg).unwrap();
    let ids: Vec<u32> = vec![3, 250, 17, 99, 0, 257, 42, 8];
    let logits = |m: &llama::Llama, l: &Lora| -> Vec<f32> {
        let t = doppler::gpu::Tensor::from_u32(gpu, &[2, 4], &ids, "ids").unwrap();
        let mut tape = Tape::new();
        tape.set_grad_enabled(false);
        let opts = TrainOpts {
            lora: Some(l),
            dropout_seed: None,
        };
        let y = gpu
            .run(|rec| {
                let v = m.train_logits(&mut tape, rec, &t, opts)?;
                Ok(tape.value(v)?.clone())
            })
            .unwrap();
        y.read_f32(gpu).unwrap()
    };
    let (a, b) = (logits(&hm, &lh), logits(&gm, &lg));
    let plain = {
        let none = Lora::build(
            gpu,
            &hm.cfg,
            LoraSpec {
                rank: 1,
                alpha: 1.0,
                dropout: 0.0,
                targets: vec![Target::Q],
            },
            |_, _, (r, c), _| Ok(vec![0.0; r * c]),
        )
        .unwrap();
        logits(&hm, &none)
    };
    let diff = |x: &[f32], y: &[f32]| {
        x.iter()
            .zip(y)
            .fold(0.0f32, |m, (p, q)| m.max((p - q).abs()))
    };
    assert!(
        diff(&a, &b) < 1e-4,
        "GGUF and SafeTensors bases with one adapter differ by {}",
        diff(&a, &b)
    );
    assert!(
        diff(&a, &plain) > 1e-2,
        "the adapter changed nothing ({})",
        diff(&a, &plain)
    );
    // Saved again from the GGUF base: the same tensors as written from the HF base.
    let dir2 = dir.with_extension("again");
    adapter::save(gpu, &lg, &gm.cfg, "tiny", &dir2).unwrap();
    let (x, y) = (
        std::fs::read(dir.join(adapter::WEIGHTS_FILE)).unwrap(),
        std::fs::read(dir2.join(adapter::WEIGHTS_FILE)).unwrap(),
    );
    assert_eq!(
        x, y,
        "the round trip through the GGUF layout changed the adapter"
    );
    // Another rank in the config than in the tensors: refused, shapes named.
    let cfg = std::fs::read_to_string(dir.join(adapter::CONFIG_FILE)).unwrap();
    std::fs::write(
        dir2.join(adapter::CONFIG_FILE),
        cfg.replace("\"r\": 3", "\"r\": 2"),
    )
    .unwrap();
    let e = adapter::load(gpu, &dir2, &gm.cfg)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("needs [2, 32]") && e.contains("another model"),
        "{e}"
    );
    // Fewer target modules in the config than tensors in the file: refused.
    std::fs::write(
        dir2.join(adapter::CONFIG_FILE),
        cfg.replace("\"q_proj\",", ""),
    )
    .unwrap();
    let e = adapter::load(gpu, &dir2, &gm.cfg)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("no place for") && e.contains("q_proj"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&dir2);
}

/// A LoRA fine-tune of the tiny GGUF model end to end: chat samples whose answers follow a
/// fixed pattern; the training loss falls, the held-out loss falls, the adapter is written
/// as PEFT writes it and loads back, and a run stopped midway and resumed from its
/// checkpoint gives the same losses and adapter bit for bit.
#[test]
fn lora_finetune_learns_and_is_deterministic() {
    use doppler::finetune::{adapter, config::FinetuneConfig, Finetuner};
    let gpu = gpu();
    let dir = std::env::temp_dir().join(format!("doppler-ft-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let files = doppler::verify::llama::tiny_files("llama", "F32", 5).unwrap();
    std::fs::write(dir.join("m.gguf"), &files.gguf).unwrap();
    // Questions answered "ok <word>": the answer format is what is learned.
    let words = [
        "red", "sun", "cat", "map", "owl", "fig", "jam", "ink", "elm", "yak", "bee", "cod",
    ];
    let lines: Vec<String> = words
        .iter()
        .map(|w| {
            serde_json::json!({"messages": [
                {"role": "user", "content": format!("say {w}")},
                {"role": "assistant", "content": format!("ok {w}")},
            ]})
            .to_string()
        })
        .collect();
    std::fs::write(dir.join("d.jsonl"), lines.join("\n")).unwrap();
    let toml = "base = \"m.gguf\"\ndata = \"d.jsonl\"\neval_fraction = 0.25\nout_dir = \"run\"\n\
        [lora]\nrank = 4\nalpha = 8\n\
        [train]\nseq_len = 32\nbatch_size = 3\nsteps = 30\nlr = 1e-2\nwarmup = 3\n\
        grad_clip = 1.0\neval_interval = 15\nsave_interval = 30\nseed = 9\n";
    std::fs::write(dir.join("ft.toml"), toml).unwrap();
    let cfg = FinetuneConfig::load(&dir.join("ft.toml")).unwrap();
    let run = |cfg: &FinetuneConfig, resume: bool, stop: u64| {
        let mut ft = Finetuner::new(gpu, cfg, resume).unwrap();
        assert_eq!((ft.train.len(), ft.eval.len()), (9, 3));
        let mut losses = Vec::new();
        let mut evals = Vec::new();
        ft.run(stop, &mut |e| match e {
            doppler::finetune::FtEvent::Step(s) => losses.push(s.loss),
            doppler::finetune::FtEvent::Eval { eval_loss, .. } => evals.push(eval_loss),
            _ => {}
        })
        .unwrap();
        (losses, evals, ft)
    };
    let (losses, evals, ft) = run(&cfg, false, u64::MAX);
    eprintln!("losses {losses:?}\nevals {evals:?}");
    assert_eq!(losses.len(), 30);
    let head: f32 = losses[..3].iter().sum::<f32>() / 3.0;
    let tail: f32 = losses[27..].iter().sum::<f32>() / 3.0;
    assert!(tail < 0.5 * head, "training loss {head} -> {tail}");
    assert!(
        evals.last().unwrap() < &(0.7 * evals[0]),
        "held-out loss {evals:?}"
    );
    let saved = dir.join("run/adapter");
    let back = adapter::load(gpu, &saved, &ft.model.llama.cfg).unwrap();
    assert_eq!(back.params.names, ft.lora.params.names);
    assert!(dir.join("run/metrics.jsonl").exists() && dir.join("run/loss.svg").exists());
    // A directory with checkpoints is not started over.
    let e = Finetuner::new(gpu, &cfg, false).err().unwrap().to_string();
    assert!(e.contains("--resume"), "{e}");
    // The same config in another directory, stopped after step 12 (its checkpoint), then
    // resumed: the same losses bit for bit, the same adapter file byte for byte.
    let mut cfg2 = cfg.clone();
    cfg2.out_dir = dir.join("run2");
    let (first, _, _) = run(&cfg2, false, 12);
    let (rest, _, ft2) = run(&cfg2, true, u64::MAX);
    assert_eq!(ft2.step, 30);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&losses),
        bits(&[first, rest].concat()),
        "a run stopped at 12 and resumed differs from the straight run"
    );
    let file = |run: &str| {
        std::fs::read(dir.join(run).join("adapter").join(adapter::WEIGHTS_FILE)).unwrap()
    };
    assert!(file("run") == file("run2"), "resumed adapter differs");
    let lines = std::fs::read_to_string(dir.join("run2/metrics.jsonl")).unwrap();
    let steps = lines.lines().filter(|l| l.contains("\"loss\"")).count();
    assert_eq!(steps, 30, "{lines}");
    // Another config's checkpoint is refused, naming the setting.
    let mut cfg3 = cfg2.clone();
    cfg3.train.lr = 5e-3;
    let e = Finetuner::new(gpu, &cfg3, true).err().unwrap().to_string();
    assert!(e.contains("train.lr"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// LoRA against PyTorch + PEFT (`python3 scripts/make_lora_fixture.py
/// crates/doppler/tests/fixtures`: transformers 5.24, peft 0.21.2, torch 2.15, f32 CPU): a
/// tiny Llama written by transformers and a random adapter on all seven projections saved
/// by PEFT, loaded by Doppler's adapter reader. One batch with masked labels: the same
/// logits, the same masked mean loss and every adapter gradient (1e-4 of the tensor's
/// largest); then 5 AdamW steps on it: the same losses and the same adapter.
#[test]
fn lora_matches_peft() {
    use doppler::autograd::Tape;
    use doppler::finetune::{adapter, data::IGNORE};
    use doppler::models::llama::{self, TrainOpts};
    use doppler::ops::cross_entropy::CrossEntropyOpts;
    let gpu = gpu();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora-tiny");
    let fx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("lora.json")).unwrap()).unwrap();
    let rows = |v: &serde_json::Value| -> Vec<Vec<i64>> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|r| {
                r.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_i64().unwrap())
                    .collect()
            })
            .collect()
    };
    let floats = |v: &serde_json::Value| -> Vec<f64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    let (ids, labels) = (rows(&fx["ids"]), rows(&fx["labels"]));
    let (b, t) = (ids.len(), ids[0].len());
    let flat_ids: Vec<u32> = ids.iter().flatten().map(|&v| v as u32).collect();
    // transformers scores labels[:, 1:] against logits[:, :-1].
    let targets: Vec<u32> = labels
        .iter()
        .flat_map(|r| {
            (0..t).map(move |i| match r.get(i + 1) {
                Some(&l) if l >= 0 => l as u32,
                _ => IGNORE,
            })
        })
        .collect();
    let (model, _) = llama::open(gpu, &dir, 64).unwrap();
    let mut lora = adapter::load(gpu, &dir.join("adapter"), &model.cfg).unwrap();
    let ti = doppler::gpu::Tensor::from_u32(gpu, &[b, t], &flat_ids, "ids").unwrap();
    let tt = doppler::gpu::Tensor::from_u32(gpu, &[b * t], &targets, "targets").unwrap();
    let ce = CrossEntropyOpts {
        ignore_index: Some(IGNORE),
        ..Default::default()
    };
    // (loss, logits) of one forward and backward; gradients left in lora.params.
    let step = |lora: &mut doppler::finetune::lora::Lora| -> (f32, Vec<f32>) {
        let mut rec = gpu.recorder("peft");
        let mut tape = Tape::new();
        let opts = TrainOpts {
            lora: Some(lora),
            dropout_seed: None,
        };
        let logits = model.train_logits(&mut tape, &mut rec, &ti, opts).unwrap();
        let lv = tape.value(logits).unwrap().clone();
        let loss = tape.cross_entropy(&mut rec, logits, &tt, ce).unwrap();
        let l = tape.value(loss).unwrap().clone();
        tape.backward(&mut rec, loss, 1.0, &mut lora.params)
            .unwrap();
        rec.submit().unwrap();
        (l.read_f32(gpu).unwrap()[0], lv.read_f32(gpu).unwrap())
    };
    let close = |what: &str, got: &[f32], want: &[f64], rel: f64| {
        assert_eq!(got.len(), want.len(), "{what}: sizes");
        let big = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let diff = got
            .iter()
            .zip(want)
            .fold(0.0f64, |m, (g, w)| m.max((*g as f64 - w).abs()));
        assert!(
            diff <= rel * big,
            "{what}: max |Doppler - PEFT| {diff:.3e} vs largest {big:.3e}"
        );
        diff / big
    };
    let (loss, logits) = step(&mut lora);
    let want_loss = fx["loss"].as_f64().unwrap();
    assert!(
        ((loss as f64 - want_loss) / want_loss).abs() < 1e-5,
        "loss {loss} vs PEFT {want_loss}"
    );
    let worst = close("logits", &logits, &floats(&fx["logits"]), 1e-4);
    eprintln!("logits within {worst:.2e} of the largest");
    let grads = fx["grads"].as_object().unwrap();
    assert_eq!(grads.len(), lora.params.len());
    let mut worst = 0.0f64;
    for (name, g) in lora.params.names.iter().zip(&lora.params.grads) {
        let got = g.as_ref().unwrap().read_f32(gpu).unwrap();
        worst = worst.max(close(name, &got, &floats(&grads[name]), 1e-4));
    }
    eprintln!("gradients within {worst:.2e} of each tensor's largest");
    // 5 AdamW steps as torch.optim.AdamW (weight decay 0) on the same batch.
    lora.params.zero_grad();
    let params: Vec<doppler::gpu::Tensor> = lora.params.values.clone();
    let prefs: Vec<&doppler::gpu::Tensor> = params.iter().collect();
    let mut opt = doppler::optim::AdamW::new(gpu, &prefs, 1e-2).unwrap();
    opt.weight_decay = 0.0;
    let want_losses = floats(&fx["step_losses"]);
    for (i, want) in want_losses.iter().enumerate() {
        let (l, _) = step(&mut lora);
        assert!(
            ((l as f64 - want) / want).abs() < 1e-4,
            "AdamW step {}: loss {l} vs PEFT {want}",
            i + 1
        );
        let grads: Vec<doppler::gpu::Tensor> = lora
            .params
            .grads
            .iter()
            .map(|g| g.clone().unwrap())
            .collect();
        let grefs: Vec<&doppler::gpu::Tensor> = grads.iter().collect();
        gpu.run(|rec| {
            let one = doppler::optim::unit_scale(rec.gpu())?;
            opt.step(rec, &prefs, &grefs, &one)
        })
        .unwrap();
        lora.params.zero_grad();
    }
    // Elements whose first gradient is at AdamW's eps (1e-8) take an update that rounding
    // decides (g / (|g| + eps)): those are held to AdamW's bound, lr a step; the rest to
    // 1e-4 of the tensor's largest.
    let after = fx["after"].as_object().unwrap();
    let mut worst = 0.0f64;
    let mut eps_scale = 0;
    for (name, v) in lora.params.names.iter().zip(&lora.params.values) {
        let (got, want, g0) = (
            v.read_f32(gpu).unwrap(),
            floats(&after[name]),
            floats(&grads[name]),
        );
        let big = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let gbig = g0.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        for ((g, w), g0) in got.iter().zip(&want).zip(&g0) {
            let d = (*g as f64 - w).abs();
            let bound = match g0.abs() < 1e-4 * gbig {
                true => {
                    eps_scale += 1;
                    1e-2 * want_losses.len() as f64
                }
                false => {
                    worst = worst.max(d / big);
                    1e-4 * big
                }
            };
            assert!(
                d <= bound,
                "{name}: after 5 AdamW steps |Doppler - PEFT| {d:.3e} > {bound:.3e}"
            );
        }
    }
    eprintln!("({eps_scale} elements with a first gradient at eps scale held to lr a step)");
    eprintln!("adapter after 5 AdamW steps within {worst:.2e} of each tensor's largest");
}

/// `--lora` at inference: the PEFT adapter of tests/fixtures/lora-tiny applied inside the
/// decoder's steps (no merged weights) gives PEFT's logits, for a prompt in one step and
/// token by token through the KV cache (f32), within 1e-4 of the largest logit; a scale of
/// 0 gives the base model's.
#[test]
fn lora_inference_matches_peft() {
    use doppler::finetune::adapter;
    use doppler::models::llama;
    let gpu = gpu();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora-tiny");
    let fx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("lora.json")).unwrap()).unwrap();
    let ids: Vec<u32> = fx["ids"][0]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let want: Vec<f64> = fx["logits"].as_array().unwrap()[..ids.len() * 300]
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let (mut model, _) = llama::open(gpu, &dir, 64).unwrap();
    // An f32 cache: the comparison is of the adapter's arithmetic, not of f16 keys.
    let f32_cache = doppler::ops::kvcache::KvType::F32;
    let base: Vec<f32> = {
        let mut cache = model.cache_with(gpu, 64, 64, f32_cache).unwrap();
        gpu.run(|rec| model.forward(rec, &ids, &mut cache, true))
            .unwrap()
            .read_f32(gpu)
            .unwrap()
    };
    let lora = adapter::load(gpu, &dir.join("adapter"), &model.cfg).unwrap();
    model.set_lora(Some((lora, 1.0))).unwrap();
    let big = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let diff = |got: &[f32]| {
        got.iter()
            .zip(&want)
            .fold(0.0f64, |m, (g, w)| m.max((*g as f64 - w).abs()))
    };
    let mut cache = model.cache_with(gpu, 64, 64, f32_cache).unwrap();
    let whole = gpu
        .run(|rec| model.forward(rec, &ids, &mut cache, true))
        .unwrap()
        .read_f32(gpu)
        .unwrap();
    assert!(
        diff(&whole) < 1e-4 * big,
        "prompt: {:.3e} of {big:.3e}",
        diff(&whole)
    );
    let mut cache = model.cache_with(gpu, 64, 64, f32_cache).unwrap();
    let mut steps = Vec::new();
    for &id in &ids {
        let l = gpu
            .run(|rec| model.forward(rec, &[id], &mut cache, true))
            .unwrap();
        steps.extend(l.read_f32(gpu).unwrap());
    }
    assert!(
        diff(&steps) < 1e-4 * big,
        "token by token: {:.3e} of {big:.3e}",
        diff(&steps)
    );
    assert!(diff(&base) > 1e-2 * big, "the adapter moved nothing");
    // Scale 0: the base model's logits.
    let lora = adapter::load(gpu, &dir.join("adapter"), &model.cfg).unwrap();
    model.set_lora(Some((lora, 0.0))).unwrap();
    let mut cache = model.cache_with(gpu, 64, 64, f32_cache).unwrap();
    let zero = gpu
        .run(|rec| model.forward(rec, &ids, &mut cache, true))
        .unwrap()
        .read_f32(gpu)
        .unwrap();
    let d0 = zero
        .iter()
        .zip(&base)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(d0 < 1e-4, "scale 0 differs from the base by {d0}");
    // Adapters made for another width, or another depth: refused, shapes named.
    let spec = doppler::finetune::lora::LoraSpec {
        rank: 2,
        alpha: 4.0,
        dropout: 0.0,
        targets: vec![doppler::finetune::lora::Target::Q],
    };
    let mut narrow = model.cfg.clone();
    narrow.n_embd = 32;
    let other = doppler::finetune::lora::Lora::new(gpu, &narrow, spec.clone(), 1).unwrap();
    let e = model.set_lora(Some((other, 1.0))).unwrap_err().to_string();
    assert!(e.contains("q_proj") && e.contains("[2, 64]"), "{e}");
    let mut deep = model.cfg.clone();
    deep.n_layer = 3;
    let other = doppler::finetune::lora::Lora::new(gpu, &deep, spec, 1).unwrap();
    let e = model.set_lora(Some((other, 1.0))).unwrap_err().to_string();
    assert!(e.contains("3 layers on a model of 2"), "{e}");
}

/// `doppler export` of the PEFT fixture (a transformers Llama directory and its adapter),
/// merged in f32: the exported directory, opened as any model, gives PEFT's logits (the
/// adapter applied unmerged by PEFT) to 1e-4 of the largest; an existing output
/// directory is refused and left as it was.
#[test]
fn lora_export_merges_as_peft_does() {
    use doppler::autograd::Tape;
    use doppler::finetune::export::{export, Dtype, Export};
    use doppler::models::llama::{self, TrainOpts};
    let gpu = gpu();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora-tiny");
    let fx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("lora.json")).unwrap()).unwrap();
    let out = std::env::temp_dir().join(format!("doppler-export-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let adapter = dir.join("adapter");
    let job = Export {
        base: &dir,
        lora: Some((&adapter, 1.0)),
        out: &out,
        dtype: Dtype::Auto,
    };
    let mut calls = 0;
    let done = export(gpu, &job, &mut |_, _| calls += 1).unwrap();
    assert_eq!((done.dtype, done.shards), ("float32", 1));
    assert_eq!(calls, done.tensors);
    assert_eq!(
        done.merged,
        7 * 2,
        "seven projections in each of two layers"
    );
    let ids: Vec<u32> = fx["ids"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
        })
        .collect();
    let b = fx["ids"].as_array().unwrap().len();
    let (model, _) = llama::open(gpu, &out, 64).unwrap();
    let ti = doppler::gpu::Tensor::from_u32(gpu, &[b, ids.len() / b], &ids, "ids").unwrap();
    let mut tape = Tape::new();
    tape.set_grad_enabled(false);
    let logits = gpu
        .run(|rec| {
            let opts = TrainOpts {
                lora: None,
                dropout_seed: None,
            };
            let l = model.train_logits(&mut tape, rec, &ti, opts)?;
            Ok(tape.value(l)?.clone())
        })
        .unwrap()
        .read_f32(gpu)
        .unwrap();
    let want: Vec<f64> = fx["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(logits.len(), want.len());
    let big = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let diff = logits
        .iter()
        .zip(&want)
        .fold(0.0f64, |m, (g, w)| m.max((*g as f64 - w).abs()));
    eprintln!("merged logits within {:.2e} of PEFT's largest", diff / big);
    assert!(diff <= 1e-4 * big, "{diff} vs {big}");
    // Written again to the same place: refused, the first export untouched.
    let before = std::fs::read(out.join("model.safetensors")).unwrap();
    let e = export(gpu, &job, &mut |_, _| {}).err().unwrap().to_string();
    assert!(e.contains("already exists"), "{e}");
    assert_eq!(
        std::fs::read(out.join("model.safetensors")).unwrap(),
        before
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// Fine-tuning with each layer recomputed in the backward (the default) against one tape
/// over the whole model: with the loss in one piece the same losses and adapters bit for
/// bit over four steps (dropout on: the masks are regenerated alike); with the loss in
/// pieces of 7 rows (some with no learned token, skipped) the same to float rounding.
#[test]
fn lora_recompute_matches_one_tape() {
    use doppler::finetune::{config::FinetuneConfig, Finetuner};
    let gpu = gpu();
    let dir = std::env::temp_dir().join(format!("doppler-ft-re-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let files = doppler::verify::llama::tiny_files("llama", "F16", 5).unwrap();
    std::fs::write(dir.join("m.gguf"), &files.gguf).unwrap();
    let lines: Vec<String> = ["red", "sun", "cat", "map", "owl", "fig"]
        .iter()
        .map(|w| {
            serde_json::json!({"messages": [
                {"role": "user", "content": format!("say {w} twice")},
                {"role": "assistant", "content": format!("{w} {w}")},
            ]})
            .to_string()
        })
        .collect();
    std::fs::write(dir.join("d.jsonl"), lines.join("\n")).unwrap();
    let toml = "base = \"m.gguf\"\ndata = \"d.jsonl\"\neval_fraction = 0.0\nout_dir = \"run\"\n\
        [lora]\nrank = 4\nalpha = 8\ndropout = 0.1\n\
        [train]\nseq_len = 48\nbatch_size = 3\ngrad_accum = 2\nsteps = 4\nlr = 1e-2\nseed = 3\n";
    std::fs::write(dir.join("ft.toml"), toml).unwrap();
    let base = FinetuneConfig::load(&dir.join("ft.toml")).unwrap();
    let run = |recompute: bool, rows: Option<usize>, name: &str| {
        let mut cfg = base.clone();
        cfg.train.recompute = recompute;
        cfg.out_dir = dir.join(name);
        let mut ft = Finetuner::new(gpu, &cfg, false).unwrap();
        if let Some(r) = rows {
            ft.loss_rows = r;
        }
        let losses: Vec<f32> = (0..4).map(|_| ft.train_step().unwrap().loss).collect();
        let eval = {
            ft.eval = ft.train.clone();
            ft.evaluate().unwrap()
        };
        let params: Vec<Vec<f32>> = ft
            .lora
            .params
            .values
            .iter()
            .map(|t| t.read_f32(gpu).unwrap())
            .collect();
        (losses, eval, params)
    };
    let (l0, e0, p0) = run(false, None, "plain");
    let (l1, e1, p1) = run(true, None, "re");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&l0), bits(&l1), "losses {l0:?} vs {l1:?}");
    assert_eq!(e0.to_bits(), e1.to_bits(), "eval {e0} vs {e1}");
    assert!(p0 == p1, "adapters differ");
    let (l2, e2, p2) = run(true, Some(7), "pieces");
    for (a, b) in l0.iter().zip(&l2).chain([(&e0, &e2)]) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "{a} vs {b}");
    }
    for (a, b) in p0.iter().zip(&p2) {
        let big = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(d <= 1e-4 * big, "adapter {d} vs {big}");
    }
    assert!(l0[3] < l0[0], "{l0:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
