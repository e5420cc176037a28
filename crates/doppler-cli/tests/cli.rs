//! The `doppler` command as a user runs it.

use std::process::Command;

fn doppler(args: &[&str]) -> (bool, String, String) {
    doppler_env(args, &[])
}

/// `doppler` with environment variables set.
fn doppler_env(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_doppler"))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("run doppler");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn help_lists_the_commands() {
    let (ok, out, _) = doppler(&["--help"]);
    assert!(ok);
    for cmd in ["info", "verify", "bench"] {
        assert!(out.contains(cmd), "{out}");
    }
}

#[test]
fn info_json_names_the_adapter() {
    let (ok, out, err) = doppler(&["info", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(!v["name"].as_str().unwrap().is_empty());
    assert!(
        v["limits"]["max_compute_workgroups_per_dimension"]
            .as_u64()
            .unwrap()
            >= 65535
    );
    assert!(v["features"].is_array());
}

#[test]
fn verify_passes_and_reports_json() {
    let (ok, out, err) = doppler(&["verify", "--filter", "recorder", "--json"]);
    assert!(ok, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["failed"], 0);
    assert_eq!(v["checks"].as_array().unwrap().len(), 1);
    assert_eq!(v["checks"][0]["pass"], true);
}

/// The cooperative-matrix kernels, which only GPUs with tensor cores run, checked here
/// with their matrices emulated (`DOPPLER_EMULATE_COOP`, gpu/coop_emulate.rs): the batch-
/// invariant products and their fused chains (serving's path), with the skinny kernel's
/// longest step the workgroup memory takes (128 k asked; lavapipe's 32 KiB take 64) and
/// gate/up split over k (non-default layouts, `SkinnyLayout`).
#[test]
fn cooperative_kernels_pass_verify_emulated() {
    let (ok, stdout, stderr) = doppler_env(
        &["verify", "--filter", "qmatmul invariant", "--json"],
        &[
            ("DOPPLER_EMULATE_COOP", "on"),
            ("DOPPLER_SKINNY_BK", "128"),
            ("DOPPLER_INVARIANT_SPLITS", "1024,16,glu"),
        ],
    );
    assert!(ok, "{stdout}{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["failed"], 0, "{stdout}");
    let checks = v["checks"].as_array().unwrap();
    assert!(checks.len() >= 18, "{stdout}");
    let coop = checks
        .iter()
        .filter(|c| c["shape"].as_str().unwrap().contains("cooperative (f16)"))
        .count();
    // The ten products (two of them a head's tall W, two long rows) ran on the (emulated)
    // cooperative kernels, not the f32 ones.
    assert_eq!(coop, 10, "{stdout}");
}

/// A small model's prompt products on an adapter with cooperative matrices (emulated):
/// more than 64 rows of x with a narrow W take `qmatvec_rows` (`prompt_rows_simt`), the
/// norm, SwiGLU and residual fused as in the tiled product; `verify`'s fused products (2 x
/// 67 rows of x among them) still pass against f64.
#[test]
fn prompt_products_pass_verify_emulated() {
    let (ok, stdout, stderr) = doppler_env(
        &["verify", "--filter", "qmatmul fused", "--json"],
        &[("DOPPLER_EMULATE_COOP", "on")],
    );
    assert!(ok, "{stdout}{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["failed"], 0, "{stdout}");
    let checks = v["checks"].as_array().unwrap();
    let prompts = checks
        .iter()
        .filter(|c| c["shape"].as_str().unwrap().starts_with("x [2, 67, "))
        .count();
    assert_eq!(prompts, 3, "{stdout}");
}

/// `qmatvec_rows`' layouts beside the default: two rows of W a thread
/// (`DOPPLER_ROWS_W=2`) with a smaller workgroup target (`DOPPLER_ROWS_GROUPS=66`, so more
/// rows of x a workgroup); every row of x a workgroup can take (`DOPPLER_ROWS_GROUPS=1`:
/// up to 16, a ninth set of threads beside them where the adapter takes one, x staged in
/// workgroup memory from 4 rows on); the same with 8 sets (`DOPPLER_ROWS_SETS=8`, adapters
/// that take 256 threads a workgroup) and with x never staged (`DOPPLER_ROWS_STAGE=32`);
/// and x staged at every count of rows (`DOPPLER_ROWS_STAGE=1`); and up to 32 sets for long
/// rows of W (`DOPPLER_ROWS_MAX_SETS=32`, fewer rows of x a workgroup where the workgroup
/// memory runs out). The invariant products and the paged q/k/v product with RoPE still
/// pass, rows alone the batch's bits.
#[test]
fn batched_product_layouts_pass_verify() {
    let layouts: [&[(&str, &str)]; 6] = [
        &[
            ("DOPPLER_ROWS_GROUPS", "1"),
            ("DOPPLER_ROWS_MAX_SETS", "32"),
        ],
        &[("DOPPLER_ROWS_W", "2"), ("DOPPLER_ROWS_GROUPS", "66")],
        &[("DOPPLER_ROWS_GROUPS", "1")],
        &[("DOPPLER_ROWS_GROUPS", "1"), ("DOPPLER_ROWS_SETS", "8")],
        &[("DOPPLER_ROWS_GROUPS", "1"), ("DOPPLER_ROWS_STAGE", "32")],
        &[("DOPPLER_ROWS_STAGE", "1")],
    ];
    for env in layouts {
        for filter in ["qmatmul invariant", "qmatmul_rows_rope"] {
            let (ok, stdout, stderr) = doppler_env(&["verify", "--filter", filter, "--json"], env);
            assert!(ok, "{env:?}: {stdout}{stderr}");
            let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
            assert_eq!(v["failed"], 0, "{env:?}: {stdout}");
            assert!(v["checks"].as_array().unwrap().len() >= 4, "{stdout}");
        }
    }
}

#[test]
fn verify_with_no_matching_check_fails() {
    let (ok, _, err) = doppler(&["verify", "--filter", "no-such-op"]);
    assert!(!ok);
    assert!(err.contains("no check"), "{err}");
}

#[test]
fn unknown_adapter_is_a_clear_error() {
    let (ok, _, err) = doppler(&["--adapter", "no-such-gpu-xyz", "info"]);
    assert!(!ok);
    assert!(
        err.contains("no adapter matches \"no-such-gpu-xyz\"") && err.contains("available"),
        "{err}"
    );
    let (ok, _, err) = doppler(&["--backend", "glide", "info"]);
    assert!(!ok);
    assert!(err.contains("unknown backend"), "{err}");
}

#[test]
fn matmul_precision_is_checked_and_reported() {
    let (ok, _, err) = doppler(&["--matmul", "f8", "info"]);
    assert!(!ok);
    assert!(
        err.contains("invalid value 'f8'") && err.contains("f16"),
        "{err}"
    );
    // f32 asked for: f32. f16x3 or f16 asked for: that where the adapter has cooperative
    // matrices (not lavapipe), else f32 with a warning.
    let (ok, out, err) = doppler(&["--matmul", "f32", "info", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["matmul"], "f32");
    for mode in ["f16x3", "f16"] {
        let (ok, out, err) = doppler(&["--matmul", mode, "info", "--json"]);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let coop = !v["cooperative_matrix"].as_array().unwrap().is_empty();
        assert_eq!(v["matmul"], if coop { mode } else { "f32" }, "{err}");
        if !coop {
            assert!(
                err.contains(&format!("{mode} matrix products asked for"))
                    && err.contains("products stay f32"),
                "{err}"
            );
        }
    }
}

#[test]
fn bench_json_reports_medians() {
    let (ok, out, err) = doppler(&[
        "bench", "--json", "--mib", "1", "--size", "64", "--repeat", "2", "--batch", "2",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v["results"].as_array().unwrap();
    // 2 launch rows (dependent, independent), 2 copies, 1 matmul, 4 seed kernels.
    assert_eq!(rows.len(), 9, "{out}");
    assert!(
        rows.iter()
            .any(|r| r["name"].as_str().unwrap().starts_with("dispatch") && r["unit"] == "µs"),
        "{out}"
    );
    for r in rows {
        assert!(
            r["wall_ms"].as_f64().unwrap() > 0.0 && r["value"].as_f64().unwrap() > 0.0,
            "{r}"
        );
    }
}

#[test]
fn bench_train_times_a_config() {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/browser/tiny.toml");
    let args = [
        "bench", "train", "--config", config, "--steps", "2", "--json",
    ];
    let (ok, out, err) = doppler(&args);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let row = &v["results"][0];
    assert_eq!(row["unit"], "K tok/s", "{out}");
    assert!(row["value"].as_f64().unwrap() > 0.0, "{out}");
    assert!(
        row["shape"].as_str().unwrap().starts_with("B4 T32 x1"),
        "{out}"
    );
    // The profiled step's kernels, the products and the optimizer among them.
    let kernels = v["kernels"].as_array().unwrap();
    let names: Vec<&str> = kernels
        .iter()
        .map(|k| k["name"].as_str().unwrap())
        .collect();
    assert!(names.iter().any(|n| n.starts_with("matmul.")), "{names:?}");
    assert!(
        names.iter().any(|n| n.starts_with("optim.adamw")),
        "{names:?}"
    );
    let (ok, _, err) = doppler(&["bench", "train", "--config", config, "--steps", "0"]);
    assert!(!ok && err.contains("--steps 0"), "{err}");
    for flag in ["--repeat", "--batch"] {
        let (ok, out, err) = doppler(&["bench", "copy", flag, "0", "--mib", "1"]);
        assert!(
            !ok && err.contains(&format!("{flag} 0")) && !out.contains("NaN"),
            "{err}"
        );
    }
    let (ok, _, err) = doppler(&["bench", "train", "--config", "no-such.toml"]);
    assert!(!ok && err.contains("no-such.toml"), "{err}");
}

#[test]
fn bench_matmul_shapes_and_their_errors() {
    let (ok, out, err) = doppler(&[
        "bench",
        "matmul",
        "--json",
        "--shape",
        "20x12x8:ta",
        "--shape",
        "9x16x4:tb",
        "--repeat",
        "1",
        "--batch",
        "1",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let shapes: Vec<&str> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["shape"].as_str().unwrap())
        .collect();
    assert!(
        shapes.contains(&"20x12x8:ta") && shapes.contains(&"9x16x4:tb"),
        "{out}"
    );
    for bad in ["12x8", "4x4x0", "4x4x4:tc", "axbxc"] {
        let (ok, _, err) = doppler(&["bench", "matmul", "--shape", bad]);
        assert!(
            !ok && err.contains(&format!("--shape {bad:?}")),
            "{bad}: {err}"
        );
    }
}

#[test]
fn bench_qmatmul_times_products_and_refuses_bad_shapes() {
    let (ok, out, err) = doppler(&[
        "bench",
        "qmatmul",
        "--json",
        "--qshape",
        "q4_k:3x64x256:glu",
        "--qshape",
        "Q8_0:1x40x64",
        "--repeat",
        "1",
        "--batch",
        "1",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v["results"].as_array().unwrap();
    // Each shape: the invariant product, the default path, W read alone.
    assert_eq!(rows.len(), 6, "{out}");
    assert_eq!(rows[0]["shape"], "Q4_K 3x64x256 glu", "{out}");
    assert_eq!(rows[4]["shape"], "Q8_0 1x40x64", "{out}");
    for r in rows {
        assert!(r["value"].as_f64().unwrap() > 0.0, "{out}");
        assert_eq!(r["unit"], "GB/s of W", "{out}");
    }
    assert!(rows[0]["tflop_s"].as_f64().unwrap() > 0.0, "{out}");
    assert!(rows[2].get("tflop_s").is_none(), "{out}");
    for bad in [
        "q4_k:3x64",
        "q3_k:3x64x256",
        "q4_k:3x64x100",
        "q4_k:3x63x256:glu",
        "q4_k:0x64x256",
        "q4_k:3x64x256:tb",
        "q4_k",
    ] {
        let (ok, _, err) = doppler(&["bench", "qmatmul", "--qshape", bad]);
        assert!(
            !ok && err.contains(&format!("--qshape {bad:?}")),
            "{bad}: {err}"
        );
    }
}

/// A tiny run in a fresh directory: corpus, config (char tokenizer, 1 layer, 8 steps).
fn tiny_run(dir: &std::path::Path, arch: &str) -> std::path::PathBuf {
    tiny_run_with(dir, arch, "")
}

fn tiny_run_with(dir: &std::path::Path, arch: &str, extra_train: &str) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let text = "the cat sat on the mat. the dog sat on the log. a cat and a dog met on a mat.\n"
        .repeat(40);
    std::fs::write(dir.join("corpus.txt"), text).unwrap();
    let cfg = format!(
        "[model]\narch = \"{arch}\"\nn_layer = 1\nn_embd = 32\nn_head = 2\nblock_size = 16\n\
         [data]\ncorpus = \"corpus.txt\"\ntokenizer = \"char\"\n\
         [train]\nbatch_size = 4\nsteps = 8\nlr = 1e-2\nwarmup = 2\neval_interval = 4\neval_batches = 2\n\
         checkpoint_interval = 4\nseed = 3\nout_dir = \"run\"\n{extra_train}"
    );
    let path = dir.join("tiny.toml");
    std::fs::write(&path, cfg).unwrap();
    path
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("doppler-cli-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn train_resume_and_generate() {
    let (a, b) = (tmp("a"), tmp("b"));
    let cfg_a = tiny_run(&a, "gpt2");
    let cfg_b = tiny_run(&b, "gpt2");
    // --resume with nothing to resume is an error, not a fresh start.
    let (ok, _, err) = doppler(&["train", "--config", cfg_b.to_str().unwrap(), "--resume"]);
    assert!(!ok && err.contains("no checkpoint to resume"), "{err}");
    assert!(!b.join("run/latest").exists());
    // Uninterrupted run.
    let (ok, out, err) = doppler(&["train", "--config", cfg_a.to_str().unwrap(), "--json"]);
    assert!(ok, "{out}{err}");
    let done: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    let s = &done["summary"];
    assert_eq!(s["steps"], 8);
    assert!(
        s["final_val_loss"].as_f64().unwrap() < s["first_val_loss"].as_f64().unwrap(),
        "{s}"
    );
    // Interrupted after 3 steps (checkpoint at the stop), then resumed: the same bits.
    let (ok, _, err) = doppler(&[
        "train",
        "--config",
        cfg_b.to_str().unwrap(),
        "--max-steps",
        "3",
    ]);
    assert!(ok, "{err}");
    assert_eq!(
        std::fs::read_to_string(b.join("run/latest")).unwrap(),
        "step-00000003"
    );
    // Without --resume the run refuses to overwrite.
    let (ok, _, err) = doppler(&["train", "--config", cfg_b.to_str().unwrap()]);
    assert!(!ok && err.contains("--resume"), "{err}");
    // A save cut short left a half-written folder: the next save clears it.
    let stale = b.join("run/step-00000004.tmp-99999");
    std::fs::create_dir_all(&stale).unwrap();
    let (ok, _, err) = doppler(&["train", "--config", cfg_b.to_str().unwrap(), "--resume"]);
    assert!(ok, "{err}");
    assert!(!stale.exists(), "the stale temporary folder is still there");
    for f in ["model.safetensors", "optim.safetensors"] {
        let x = std::fs::read(a.join("run/step-00000008").join(f)).unwrap();
        let y = std::fs::read(b.join("run/step-00000008").join(f)).unwrap();
        assert!(
            x == y,
            "{f} differs between the uninterrupted and the resumed run"
        );
    }
    assert!(std::fs::read_to_string(a.join("run/loss.svg"))
        .unwrap()
        .contains("<polyline"));
    // A different model cannot resume this run.
    let other = std::fs::read_to_string(&cfg_b)
        .unwrap()
        .replace("n_embd = 32", "n_embd = 64");
    std::fs::write(&cfg_b, other).unwrap();
    let (ok, _, err) = doppler(&["train", "--config", cfg_b.to_str().unwrap(), "--resume"]);
    assert!(
        !ok && err.contains("another config") && err.contains("model.n_embd: 32 vs 64"),
        "{err}"
    );
    // Sampling from the checkpoint.
    let (ok, out, err) = doppler(&[
        "generate",
        "--checkpoint",
        a.join("run").to_str().unwrap(),
        "the ",
        "-n",
        "10",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["text"].as_str().unwrap().chars().count(), 10);
    assert_eq!(
        (v["generated_tokens"].as_u64(), v["stop"].as_str()),
        (Some(10), Some("length"))
    );
    // A `latest` that is empty or names a missing folder is blamed by name.
    std::fs::write(b.join("run/latest"), "").unwrap();
    let (ok, _, err) = doppler(&["generate", "--checkpoint", b.join("run").to_str().unwrap()]);
    assert!(
        !ok && err.contains("latest") && err.contains("names \"\""),
        "{err}"
    );
    std::fs::write(b.join("run/latest"), "step-00000099").unwrap();
    let (ok, _, err) = doppler(&["generate", "--checkpoint", b.join("run").to_str().unwrap()]);
    assert!(
        !ok && err.contains("step-00000099, which holds no state.json"),
        "{err}"
    );
    // Options a checkpoint's model has no use for are refused, not ignored.
    let run = a.join("run");
    for extra in [
        &["--chat"][..],
        &["--stop", "x"],
        &["--special"],
        &["-c", "8"],
    ] {
        let args = [
            &["generate", "--checkpoint", run.to_str().unwrap(), "the "][..],
            extra,
        ];
        let (ok, _, err) = doppler(&args.concat());
        assert!(
            !ok && err.contains("cannot be used with"),
            "{extra:?}: {err}"
        );
    }
    // A corrupted checkpoint is refused by its hash.
    let model = a.join("run/step-00000008/model.safetensors");
    let mut bytes = std::fs::read(&model).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 1;
    std::fs::write(&model, bytes).unwrap();
    let (ok, _, err) = doppler(&[
        "generate",
        "--checkpoint",
        a.join("run").to_str().unwrap(),
        "x",
    ]);
    assert!(!ok && err.contains("SHA-256"), "{err}");
    let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
}

/// `train --dump-batches`: the batches each step trained on, with its loss and learning
/// rate, as SafeTensors (what bench/torch_parity.py replays in PyTorch).
#[test]
fn train_dumps_the_batches_of_its_steps() {
    let dir = tmp("dump");
    let cfg = tiny_run_with(&dir, "llama", "grad_accum = 2\n");
    let dump = dir.join("batches.safetensors");
    let (ok, out, err) = doppler(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--max-steps",
        "3",
        "--json",
        "--dump-batches",
        dump.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let events: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let steps: Vec<&serde_json::Value> = events
        .iter()
        .filter(|e| e["event"] == "step")
        .map(|e| &e["step"])
        .collect();
    assert_eq!(steps.len(), 3);
    let bytes = std::fs::read(&dump).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let tensor = |name: &str, dtype: &str, shape: serde_json::Value| -> &[u8] {
        let t = &header[name];
        assert_eq!(t["dtype"], dtype, "{name}: {t}");
        assert_eq!(t["shape"], shape, "{name}: {t}");
        let o = &t["data_offsets"];
        &data[o[0].as_u64().unwrap() as usize..o[1].as_u64().unwrap() as usize]
    };
    assert_eq!(header["__metadata__"]["matmul"], "f32");
    let words = |b: &[u8]| -> Vec<i32> {
        b.chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let ids = words(tensor("ids", "I32", serde_json::json!([3, 2, 4, 16])));
    let targets = words(tensor("targets", "I32", serde_json::json!([3, 2, 4, 16])));
    // Targets are the ids shifted by one within each window.
    for (row, (i, t)) in ids.chunks(16).zip(targets.chunks(16)).enumerate() {
        assert_eq!(i[1..], t[..15], "window {row}");
    }
    assert_ne!(
        ids[..64],
        ids[64..128],
        "micro-batches 0 and 1 of step 0 are the same"
    );
    let step: Vec<i64> = tensor("step", "I64", serde_json::json!([3]))
        .chunks(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(step, [0, 1, 2]);
    let loss: Vec<f32> = tensor("loss", "F32", serde_json::json!([3]))
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let lr: Vec<f64> = tensor("lr", "F64", serde_json::json!([3]))
        .chunks(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(loss[i], s["loss"].as_f64().unwrap() as f32, "step {i}");
        assert_eq!(lr[i], s["lr"].as_f64().unwrap(), "step {i}");
    }
    assert_eq!(tensor("skipped", "U8", serde_json::json!([3])), [0, 0, 0]);
    // A resumed run dumps the steps it took: the next ones.
    let (ok, _, err) = doppler(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--resume",
        "--max-steps",
        "1",
        "--dump-batches",
        dump.to_str().unwrap(),
    ]);
    assert!(ok && err.contains("batches of 1 steps written"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn two_identical_runs_give_identical_bits() {
    let (a, b) = (tmp("c"), tmp("d"));
    for d in [&a, &b] {
        // Also through gradient accumulation and dynamic loss scaling.
        let cfg = tiny_run_with(d, "llama", "grad_accum = 2\nloss_scale = \"dynamic\"\n");
        let (ok, _, err) = doppler(&[
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--max-steps",
            "4",
        ]);
        assert!(ok, "{err}");
    }
    for f in ["model.safetensors", "optim.safetensors"] {
        let x = std::fs::read(a.join("run/step-00000004").join(f)).unwrap();
        let y = std::fs::read(b.join("run/step-00000004").join(f)).unwrap();
        assert!(x == y, "{f} differs between two identical runs");
    }
    let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
}

#[test]
fn bad_train_configs_get_clear_errors() {
    let d = tmp("e");
    let cfg = tiny_run(&d, "llama");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, text.replace("n_head = 2", "n_head = 3")).unwrap();
    let (ok, _, err) = doppler(&["train", "--config", cfg.to_str().unwrap()]);
    assert!(
        !ok && err.contains("tiny.toml") && err.contains("n_head"),
        "{err}"
    );
    std::fs::write(&cfg, text.replace("corpus.txt", "missing.txt")).unwrap();
    let (ok, _, err) = doppler(&["train", "--config", cfg.to_str().unwrap()]);
    assert!(!ok && err.contains("missing.txt"), "{err}");
    let (ok, _, err) = doppler(&[
        "generate",
        "--checkpoint",
        d.join("nowhere").to_str().unwrap(),
        "x",
    ]);
    assert!(!ok && err.contains("nowhere"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn inspect_lists_gguf_metadata_and_tensors_and_rejects_truncated_files() {
    use doppler::formats::gguf::{write, GgmlType, Value};
    let d = tmp("gguf");
    std::fs::create_dir_all(&d).unwrap();
    let q4_1 = vec![0u8; 20 * 4];
    let bytes = write(
        &[
            ("general.architecture", Value::String("llama".into())),
            ("llama.block_count", Value::U32(1)),
        ],
        &[("blk.0.attn_q.weight", &[64, 2], GgmlType(3), &q4_1)],
        32,
    );
    let path = d.join("m.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let (ok, out, err) = doppler(&["inspect", path.to_str().unwrap(), "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["metadata"]["general.architecture"], "llama");
    assert_eq!(v["tensors"][0]["ty"], "Q4_1");
    assert_eq!(v["tensors"][0]["n_bytes"], 80);
    let (ok, out, _) = doppler(&["inspect", path.to_str().unwrap()]);
    assert!(
        ok && out.contains("blk.0.attn_q.weight") && out.contains("Q4_1"),
        "{out}"
    );
    std::fs::write(&path, &bytes[..bytes.len() - 7]).unwrap();
    let (ok, _, err) = doppler(&["inspect", path.to_str().unwrap()]);
    assert!(
        !ok && err.contains("m.gguf")
            && err.contains("truncated")
            && err.contains("blk.0.attn_q.weight"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// A tiny random Llama as GGUF (byte-level tokenizer, ChatML template) and as a Hugging
/// Face directory.
fn tiny_model(name: &str, arch: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    doppler::verify::llama::write_tiny(&tmp(name), arch, "F32", 5).expect("tiny model written")
}

fn doppler_stdin(args: &[&str], input: &str) -> (bool, String, String) {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_doppler"))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run doppler");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// `bench generate --rows`: forward passes of a few rows timed, as tokens/s and the
/// weights' read rate; a row count outside 1 ..= --prompt is refused by name.
#[test]
fn bench_generate_times_batches_of_rows() {
    let (gguf, _) = tiny_model("bench-rows-model", "llama");
    let m = gguf.to_str().unwrap();
    let args = [
        "bench", "generate", "-m", m, "--prompt", "16", "--gen", "2", "--json",
    ];
    let (ok, out, err) = doppler(&[&args[..], &["--rows", "2,8"]].concat());
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{v}");
    for (r, want) in rows.iter().zip([2, 8]) {
        assert_eq!(r["rows"], want);
        assert!(r["step_ms"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["tok_s"].as_f64().unwrap() > 0.0, "{r}");
    }
    let (ok, _, err) = doppler(&[&args[..], &["--rows", "17"]].concat());
    assert!(!ok && err.contains("--rows 17"), "{err}");
}

/// `bench generate --streams`: sequences decoded together as `serve` runs them, each
/// step's time split into recording, GPU + readback and sampling; the logits' checksum
/// the same in two runs, and the pipelined steps' tokens the same in two runs and with
/// every row sampled on the host (`--host-sampling`) instead of the GPU; a count of 0
/// refused by name.
#[test]
fn bench_generate_times_streams() {
    let (gguf, _) = tiny_model("bench-streams-model", "llama");
    let m = gguf.to_str().unwrap();
    let args = [
        "bench", "generate", "-m", m, "--prompt", "20", "--gen", "2", "--json",
    ];
    let run = |more: &[&str]| {
        let (ok, out, err) = doppler(&[&args[..], &["--streams", "1,3"], more].concat());
        assert!(ok, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let (a, b, host) = (run(&[]), run(&[]), run(&["--host-sampling"]));
    let streams = a["streams"].as_array().unwrap();
    assert_eq!(streams.len(), 2, "{a}");
    for (s, want) in streams.iter().zip([1, 3]) {
        assert_eq!(s["streams"], want);
        for k in [
            "tok_s",
            "step_ms_p50",
            "record_ms_p50",
            "submit_ms_p50",
            "gpu_and_readback_ms_p50",
        ] {
            assert!(s[k].as_f64().unwrap() > 0.0, "{k}: {s}");
        }
        assert!(s["sampling_ms_p50"].as_f64().unwrap() >= 0.0, "{s}");
        assert!(!s["kernels"].as_array().unwrap().is_empty(), "{s}");
        // The chained steps timed whole on the GPU where it has timestamps.
        if s["gpu_ms_p50"].is_f64() {
            assert!(s["chained_gpu_ms_p50"].as_f64().unwrap() > 0.0, "{s}");
            assert!(s["chained_gap_ms_p50"].is_f64(), "{s}");
        }
    }
    for s in host["streams"].as_array().unwrap() {
        assert!(s["chained_gpu_ms_p50"].is_null(), "{s}");
    }
    for i in 0..2 {
        for k in ["logits_check", "tokens_check_pipelined"] {
            for other in [&b, &host] {
                assert_eq!(
                    a["streams"][i][k], other["streams"][i][k],
                    "{k}: the same prompts and seeds, other logits or tokens"
                );
            }
        }
        assert_eq!(a["streams"][i]["sampling"], "gpu");
        assert_eq!(host["streams"][i]["sampling"], "host");
    }
    assert_ne!(
        a["streams"][0]["logits_check"],
        a["streams"][1]["logits_check"]
    );
    let (ok, _, err) = doppler(&[&args[..], &["--streams", "0"]].concat());
    assert!(!ok && err.contains("--streams 0"), "{err}");
}

#[test]
fn generate_from_a_model_file_is_seeded_and_reports_json() {
    let (gguf, _) = tiny_model("gen-model", "llama");
    let m = gguf.to_str().unwrap();
    let run = |seed: &str| {
        let (ok, out, err) = doppler(&[
            "generate",
            "-m",
            m,
            "hello",
            "-n",
            "6",
            "--seed",
            seed,
            "--temperature",
            "1.0",
            "--json",
        ]);
        assert!(ok, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let (a, b, c) = (run("1"), run("1"), run("2"));
    assert_eq!(a["tokens"], b["tokens"]);
    assert_eq!(
        a["generated_tokens"].as_u64().unwrap(),
        a["tokens"].as_array().unwrap().len() as u64
    );
    assert!(
        a["tokens"] != c["tokens"] || a["tokens"].as_array().unwrap().len() < 2,
        "seeds 1 and 2 gave the same tokens"
    );
    assert!(a["prefill_ms"].as_f64().unwrap() > 0.0 && a["load_ms"].as_f64().unwrap() > 0.0);
    // Streaming: the prompt, then the text.
    let (ok, out, err) = doppler(&[
        "generate",
        "-m",
        m,
        "hello",
        "-n",
        "4",
        "--temperature",
        "0",
    ]);
    assert!(ok && out.starts_with("hello"), "{out}{err}");
    // Bad sampling values and a missing model are clear errors.
    let (ok, _, err) = doppler(&["generate", "-m", m, "x", "--top-p", "1.5"]);
    assert!(!ok && err.contains("top-p 1.5"), "{err}");
    let (ok, _, err) = doppler(&["generate", "-m", "/nonexistent.gguf", "x"]);
    assert!(!ok && err.contains("/nonexistent.gguf"), "{err}");
}

/// `--json-schema` / `--json-object`: whatever a (random) model samples, the answer is
/// what the schema allows, then a stop; a schema the grammar cannot express is refused.
#[test]
fn generate_follows_a_json_schema() {
    let (gguf, _) = tiny_model("gen-json", "llama");
    let m = gguf.to_str().unwrap();
    for seed in ["1", "2", "3"] {
        let (ok, out, err) = doppler(&[
            "generate",
            "-m",
            m,
            "x",
            "-n",
            "12",
            "--seed",
            seed,
            "--temperature",
            "1.5",
            "--json-schema",
            r#"{"enum": ["yes", "no", {"k": [1, null]}]}"#,
            "--json",
        ]);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let text = v["text"].as_str().unwrap();
        assert!(
            ["\"yes\"", "\"no\"", r#"{"k":[1,null]}"#].contains(&text),
            "{text:?}"
        );
        assert_eq!(v["stop"], "token", "{v}");
    }
    let (ok, out, err) = doppler(&[
        "generate",
        "-m",
        m,
        "x",
        "-n",
        "8",
        "--json-object",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["text"].as_str().unwrap().starts_with('{'), "{v}");
    let (ok, _, err) = doppler(&[
        "generate",
        "-m",
        m,
        "x",
        "--json-schema",
        r#"{"type": "integer", "minimum": 1}"#,
    ]);
    assert!(!ok && err.contains("minimum"), "{err}");
}

#[test]
fn generate_from_safetensors_matches_gguf() {
    let (gguf, hf) = tiny_model("gen-st", "qwen2");
    // The Hugging Face directory needs a tokenizer.json: none here, so it is an error...
    let (ok, _, err) = doppler(&["generate", "-m", hf.to_str().unwrap(), "x", "-n", "2"]);
    assert!(!ok && err.contains("tokenizer.json"), "{err}");
    // ...while the GGUF of the same weights generates.
    let (ok, _, err) = doppler(&[
        "generate",
        "-m",
        gguf.to_str().unwrap(),
        "x",
        "-n",
        "2",
        "--json",
    ]);
    assert!(ok, "{err}");
    // A context that fills before -n tokens: said so (text and JSON); none left: an error.
    let m = gguf.to_str().unwrap();
    let greedy = ["--temperature", "0"];
    let args = ["generate", "-m", m, "abc", "-n", "50", "-c", "6"];
    let (ok, _, err) = doppler(&[&args[..], &greedy].concat());
    assert!(
        ok && err.contains("context full") && err.contains("50 asked for"),
        "{err}"
    );
    let (ok, out, err) = doppler(&[&args[..], &greedy, &["--json"]].concat());
    let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert!(ok && v["stop"] == "context", "{out}{err}");
    let (ok, _, err) = doppler(&["generate", "-m", m, "abc", "-n", "5", "-c", "1"]);
    assert!(!ok && err.contains("no room to generate"), "{err}");
}

#[test]
fn chat_keeps_the_conversation_and_handles_a_full_context() {
    let (gguf, _) = tiny_model("chat", "llama");
    let m = gguf.to_str().unwrap();
    let (ok, out, err) = doppler_stdin(
        &["chat", "-m", m, "-n", "3", "--temperature", "0"],
        "hi\nhow are you\n/reset\nagain\n/exit\n",
    );
    assert!(ok, "{err}");
    assert!(err.contains("conversation cleared"), "{err}");
    // Five prompts shown (three messages, /reset, /exit), replies on stdout.
    assert_eq!(err.matches("> ").count(), 5, "{err}");
    assert!(!out.trim().is_empty(), "no reply: {out:?}");
    // A 48-token context fills within a few turns: the user is told and the chat goes on.
    let (ok, _, err) = doppler_stdin(
        &["chat", "-m", m, "-n", "8", "-c", "48", "--temperature", "0"],
        "one two three\nfour five six\nseven eight nine\nten\n",
    );
    assert!(ok, "{err}");
    assert!(err.contains("context full"), "{err}");
}

#[test]
fn unsupported_architectures_and_truncated_models_are_refused() {
    let (gguf, _) = tiny_model("bad-models", "llama");
    // A folder without config.json, and a pipe (opening it would wait for a writer).
    let dir = gguf.parent().unwrap();
    let (ok, _, err) = doppler(&["generate", "-m", dir.to_str().unwrap(), "x"]);
    assert!(
        !ok && err.contains("a directory without config.json"),
        "{err}"
    );
    let fifo = dir.join("pipe.gguf");
    let made = Command::new("mkfifo").arg(&fifo).status();
    if made.is_ok_and(|s| s.success()) {
        for verb in [&["inspect"][..], &["generate", "-m"]] {
            let args = [verb, &[fifo.to_str().unwrap()]].concat();
            let (ok, _, err) = doppler(&args);
            assert!(
                !ok && err.contains("is not a regular file"),
                "{verb:?}: {err}"
            );
        }
    }
    let bytes = std::fs::read(&gguf).unwrap();
    let cut = gguf.with_file_name("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 100]).unwrap();
    let (ok, _, err) = doppler(&["generate", "-m", cut.to_str().unwrap(), "x"]);
    assert!(!ok && err.contains("cut.gguf"), "{err}");
    // Another architecture name in the metadata.
    let pos = bytes.windows(5).position(|w| w == b"llama").unwrap();
    let mut other = bytes.clone();
    other[pos..pos + 5].copy_from_slice(b"mamba");
    let odd = gguf.with_file_name("mamba.gguf");
    std::fs::write(&odd, &other).unwrap();
    let (ok, _, err) = doppler(&["generate", "-m", odd.to_str().unwrap(), "x"]);
    assert!(
        !ok && err.contains("unsupported architecture mamba"),
        "{err}"
    );
}

#[test]
fn logs_are_plain_text_off_a_terminal_and_a_missing_shader_dir_is_named() {
    let out = Command::new(env!("CARGO_BIN_EXE_doppler"))
        .args(["verify", "--filter", "scale"])
        .env("DOPPLER_SHADER_DIR", "/no/such/shader/dir")
        .output()
        .expect("run doppler");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("DOPPLER_SHADER_DIR=/no/such/shader/dir is not a folder"),
        "{err}"
    );
    assert!(
        !err.contains('\u{1b}'),
        "colour codes in piped stderr: {err:?}"
    );
}

/// The SPIR-V the GPU layer writes itself for cooperative-matrix kernels on Vulkan
/// (gpu/spirv.rs), run for every kernel of a few ops where lavapipe has no cooperative
/// matrices: bindings renumbered as wgpu's Vulkan backend numbers descriptors (softmax and
/// embedding read zeros before that), overrides and workgroup memory right. With
/// `DOPPLER_DUMP_SPIRV`, each such module is also written out as a SPIR-V file.
#[test]
fn kernels_through_the_passthrough_spirv_path_pass_verify() {
    for op in ["softmax", "embedding"] {
        let dump = tmp(&format!("spirv-dump-{op}"));
        let (ok, stdout, err) = doppler_env(
            &["verify", "--filter", op, "-vv"],
            &[
                ("DOPPLER_PASSTHROUGH", "all"),
                ("DOPPLER_DUMP_SPIRV", dump.to_str().unwrap()),
            ],
        );
        assert!(ok, "{op}: {stdout}\n{err}");
        assert!(stdout.contains(" 0 failed"), "{op}: {stdout}");
        assert!(
            err.contains("passthrough module"),
            "{op}: the path was not taken: {err}"
        );
        let files: Vec<_> = std::fs::read_dir(&dump)
            .unwrap_or_else(|e| panic!("{op}: no dump folder {}: {e}", dump.display()))
            .map(|f| f.unwrap().path())
            .collect();
        assert!(
            files
                .iter()
                .any(|f| f.file_name().unwrap().to_string_lossy().starts_with(op)),
            "{op}: {files:?}"
        );
        for f in &files {
            let bytes = std::fs::read(f).unwrap();
            assert!(f.extension().is_some_and(|e| e == "spv"), "{}", f.display());
            assert_eq!(bytes[..4], [0x03, 0x02, 0x23, 0x07], "{}", f.display());
            assert_eq!(bytes.len() % 4, 0, "{}", f.display());
        }
    }
}

/// Every verb over malformed inputs: a non-zero exit, one line of error naming the
/// problem (clap's usage hints aside), never a panic, and nothing from libwayland about
/// XDG_RUNTIME_DIR on a machine without one.
#[test]
fn every_verb_refuses_malformed_input_in_one_line() {
    let d = tmp("malformed");
    std::fs::create_dir_all(&d).unwrap();
    let p = |n: &str| d.join(n).to_str().unwrap().to_string();
    let (gguf, hf) = tiny_model("malformed-model", "llama");
    let bytes = std::fs::read(&gguf).unwrap();
    std::fs::write(p("empty.gguf"), b"").unwrap();
    let mut rng = doppler::check::Rng::new(9);
    let noise: Vec<u8> = (0..4096).map(|_| rng.next_u64() as u8).collect();
    std::fs::write(p("noise.gguf"), &noise).unwrap();
    std::fs::write(p("cut.gguf"), &bytes[..300]).unwrap();
    let mut bad_count = bytes.clone();
    bad_count[8..16].copy_from_slice(&u64::MAX.to_le_bytes()); // tensor count
    std::fs::write(p("count.gguf"), &bad_count).unwrap();
    std::fs::create_dir_all(p("nothing")).unwrap();
    // Hugging Face directories: a header size past the file, a tokenizer.json cut short.
    let copy_hf = |name: &str| {
        let dst = d.join(name);
        std::fs::create_dir_all(&dst).unwrap();
        for f in std::fs::read_dir(&hf).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, dst.join(f.file_name().unwrap())).unwrap();
        }
        dst
    };
    let h = copy_hf("hf-header");
    let mut st = std::fs::read(h.join("model.safetensors")).unwrap();
    st[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(h.join("model.safetensors"), st).unwrap();
    let h = copy_hf("hf-tokenizer");
    std::fs::write(
        h.join("tokenizer.json"),
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {",
    )
    .unwrap();
    // Training configs.
    std::fs::write(p("empty.toml"), "").unwrap();
    std::fs::write(p("noise.toml"), &noise).unwrap();
    let cfg = std::fs::read_to_string(tiny_run(&d.join("t"), "llama")).unwrap();
    std::fs::write(
        p("type.toml"),
        cfg.replace("n_layer = 1", "n_layer = \"one\""),
    )
    .unwrap();
    std::fs::write(
        p("huge.toml"),
        cfg.replace("n_layer = 1", "n_layer = 1000000000"),
    )
    .unwrap();
    std::fs::write(p("empty-corpus.txt"), "\n").unwrap();
    std::fs::write(
        p("empty-corpus.toml"),
        cfg.replace("corpus.txt", "empty-corpus.txt")
            .replace("\"run\"", "\"run-empty\""),
    )
    .unwrap();
    std::fs::create_dir_all(p("ckpt")).unwrap();
    std::fs::write(p("ckpt/latest"), "step-00000009").unwrap();
    let missing = p("missing");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["inspect".into(), missing.clone()], "missing"),
        (vec!["inspect".into(), p("empty.gguf")], "empty.gguf"),
        (vec!["inspect".into(), p("noise.gguf")], "noise.gguf"),
        (vec!["inspect".into(), p("cut.gguf")], "cut.gguf"),
        (vec!["inspect".into(), p("count.gguf")], "count.gguf"),
        (
            vec!["generate".into(), "-m".into(), missing.clone(), "hi".into()],
            "missing",
        ),
        (
            vec!["generate".into(), "-m".into(), p("empty.gguf"), "hi".into()],
            "empty.gguf",
        ),
        (
            vec!["generate".into(), "-m".into(), p("noise.gguf"), "hi".into()],
            "noise.gguf",
        ),
        (
            vec!["generate".into(), "-m".into(), p("cut.gguf"), "hi".into()],
            "cut.gguf",
        ),
        (
            vec!["generate".into(), "-m".into(), p("count.gguf"), "hi".into()],
            "count.gguf",
        ),
        (
            vec!["generate".into(), "-m".into(), p("nothing"), "hi".into()],
            "config.json",
        ),
        (
            vec!["generate".into(), "-m".into(), p("hf-header"), "hi".into()],
            "model.safetensors",
        ),
        (
            vec![
                "generate".into(),
                "-m".into(),
                p("hf-tokenizer"),
                "hi".into(),
            ],
            "tokenizer.json",
        ),
        (
            vec![
                "generate".into(),
                "-m".into(),
                gguf.to_str().unwrap().into(),
                "--stop".into(),
                "".into(),
                "hi".into(),
            ],
            "--stop",
        ),
        (
            vec![
                "generate".into(),
                "-m".into(),
                gguf.to_str().unwrap().into(),
                "-n".into(),
                "x".into(),
            ],
            "--max-tokens",
        ),
        (
            vec![
                "generate".into(),
                "--checkpoint".into(),
                missing.clone(),
                "hi".into(),
            ],
            "missing",
        ),
        (
            vec![
                "generate".into(),
                "--checkpoint".into(),
                p("ckpt"),
                "hi".into(),
            ],
            "step-00000009",
        ),
        (
            vec!["chat".into(), "-m".into(), p("noise.gguf")],
            "noise.gguf",
        ),
        (
            vec!["chat".into(), "-m".into(), p("hf-header")],
            "model.safetensors",
        ),
        (
            vec!["train".into(), "--config".into(), missing.clone()],
            "missing",
        ),
        (
            vec!["train".into(), "--config".into(), p("empty.toml")],
            "empty.toml",
        ),
        (
            vec!["train".into(), "--config".into(), p("noise.toml")],
            "noise.toml",
        ),
        (
            vec!["train".into(), "--config".into(), p("type.toml")],
            "n_layer",
        ),
        (
            vec!["train".into(), "--config".into(), p("huge.toml")],
            "n_layer",
        ),
        (
            vec!["train".into(), "--config".into(), p("empty-corpus.toml")],
            "empty-corpus.txt",
        ),
        (
            vec![
                "bench".into(),
                "train".into(),
                "--config".into(),
                p("noise.toml"),
            ],
            "noise.toml",
        ),
        (
            vec![
                "bench".into(),
                "generate".into(),
                "--model".into(),
                p("noise.gguf"),
            ],
            "noise.gguf",
        ),
        (
            vec!["embed".into(), "-m".into(), missing.clone(), "hi".into()],
            "missing",
        ),
        (
            vec!["embed".into(), "-m".into(), p("nothing"), "hi".into()],
            "config.json",
        ),
        (
            vec![
                "embed".into(),
                "-m".into(),
                hf.to_str().unwrap().into(),
                "hi".into(),
            ],
            "bert",
        ),
        (
            vec![
                "embed".into(),
                "-m".into(),
                p("nothing"),
                "--file".into(),
                missing.clone(),
            ],
            "missing",
        ),
        (
            vec!["verify".into(), "--filter".into(), "no-such-kernel".into()],
            "no-such-kernel",
        ),
        (
            vec!["info".into(), "--adapter".into(), "no-such-gpu".into()],
            "no-such-gpu",
        ),
    ];
    for (args, names) in &cases {
        let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let out = Command::new(env!("CARGO_BIN_EXE_doppler"))
            .args(&args)
            .env_remove("XDG_RUNTIME_DIR")
            .env_remove("WAYLAND_DISPLAY")
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run doppler");
        let err = String::from_utf8_lossy(&out.stderr);
        let shown = format!("doppler {}:\n{err}", args.join(" "));
        assert!(!out.status.success(), "succeeded: {shown}");
        assert!(
            out.status.code().is_some_and(|c| c != 101),
            "crashed: {shown}"
        );
        assert!(!err.contains("panicked"), "panicked: {shown}");
        assert!(
            !err.contains("XDG_RUNTIME_DIR"),
            "libwayland's complaint: {shown}"
        );
        let lines: Vec<&str> = err
            .lines()
            .filter(|l| {
                !l.trim().is_empty()
                    && !l.starts_with("For more information")
                    && !l.starts_with("Usage:")
                    && !l.trim_start().starts_with("tip:")
            })
            .collect();
        assert_eq!(lines.len(), 1, "not one line: {shown}");
        assert!(lines[0].starts_with("error:"), "{shown}");
        assert!(lines[0].contains(names), "does not name {names:?}: {shown}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// `doppler finetune` on the tiny GGUF model, then `generate --lora` with its adapter: the
/// run reports JSON events and writes a PEFT adapter; the adapted model answers in the
/// learned format ("ok ..."), scale 0 gives the base model's tokens, and a bad adapter
/// path or a bad data line are clear errors.
#[test]
fn finetune_then_generate_with_the_adapter() {
    let (gguf, _) = tiny_model("ft-model", "llama");
    let dir = tmp("ft-run");
    std::fs::create_dir_all(&dir).unwrap();
    let words = ["red", "sun", "cat", "map", "owl", "fig", "jam", "ink"];
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
    let toml = format!(
        "base = {:?}\ndata = \"d.jsonl\"\neval_fraction = 0.0\nout_dir = \"run\"\n\
         [lora]\nrank = 4\nalpha = 8\n\
         [train]\nseq_len = 32\nbatch_size = 4\nsteps = 60\nlr = 1e-2\nwarmup = 3\nseed = 2\n",
        gguf.display().to_string()
    );
    std::fs::write(dir.join("ft.toml"), toml).unwrap();
    let cfg = dir.join("ft.toml");
    let (ok, out, err) = doppler(&["finetune", "--config", cfg.to_str().unwrap(), "--json"]);
    assert!(ok, "{err}");
    let last: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(last["event"], "done", "{out}");
    let adapter = dir.join("run/adapter");
    assert!(
        adapter.join("adapter_config.json").exists()
            && adapter.join("adapter_model.safetensors").exists()
    );
    let m = gguf.to_str().unwrap();
    let a = adapter.to_str().unwrap();
    let gen = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "-m",
            m,
            "--chat",
            "say cat",
            "-n",
            "6",
            "--temperature",
            "0",
            "--json",
        ];
        args.extend_from_slice(extra);
        let (ok, out, err) = doppler(&args);
        assert!(ok, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let (base, tuned, zero) = (
        gen(&[]),
        gen(&["--lora", a]),
        gen(&["--lora", a, "--lora-scale", "0"]),
    );
    // The format is learned (the tiny random model does not learn to copy the word).
    assert!(
        tuned["text"].as_str().unwrap().starts_with("ok "),
        "adapted: {}",
        tuned["text"]
    );
    assert_ne!(base["tokens"], tuned["tokens"]);
    assert_eq!(base["tokens"], zero["tokens"]);
    let (ok, _, err) = doppler(&["generate", "-m", m, "--lora", "/nonexistent/adapter", "hi"]);
    assert!(!ok && err.contains("adapter_config.json"), "{err}");
    // Merged into a Hugging Face directory (the GGUF's q/k rows back in HF's order): the
    // same greedy tokens as the adapter applied unmerged; an existing -o is refused.
    let merged = dir.join("merged");
    let o = merged.to_str().unwrap();
    let (ok, out, err) = doppler(&[
        "export", "-m", m, "--lora", a, "-o", o, "--dtype", "f32", "--json",
    ]);
    assert!(ok, "{err}");
    let done: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(done["merged"].as_u64().unwrap() > 0, "{out}");
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(merged.join(f).is_file(), "{f}");
    }
    let mut args = vec!["generate", "-m", o, "--chat", "say cat", "-n", "6"];
    args.extend(["--temperature", "0", "--json"]);
    let (ok, out, err) = doppler(&args);
    assert!(ok, "{err}");
    let from_export: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(from_export["tokens"], tuned["tokens"], "{out}");
    let (ok, _, err) = doppler(&["export", "-m", m, "--lora", a, "-o", o]);
    assert!(!ok && err.contains("already exists"), "{err}");
    // The run's checkpoints are kept: starting over in their directory is refused;
    // --resume of the finished run trains no further step.
    let (ok, _, err) = doppler(&["finetune", "--config", cfg.to_str().unwrap()]);
    assert!(!ok && err.contains("--resume"), "{err}");
    let (ok, out, err) = doppler(&[
        "finetune",
        "--config",
        cfg.to_str().unwrap(),
        "--resume",
        "--json",
    ]);
    assert!(ok, "{err}");
    assert!(
        !out.contains("\"step\",") && out.contains("\"done\""),
        "{out}"
    );
    std::fs::remove_dir_all(dir.join("run")).unwrap();
    std::fs::write(dir.join("d.jsonl"), "{\"text\": \"fine\"}\n{oops\n").unwrap();
    let (ok, _, err) = doppler(&["finetune", "--config", cfg.to_str().unwrap()]);
    assert!(
        !ok && err.contains("d.jsonl line 2") && err.contains("not JSON"),
        "{err}"
    );
    // A completion wholly past seq_len (32) once truncated: refused by line, not trained
    // on as an empty row.
    let long = serde_json::json!({"prompt": "p".repeat(40), "completion": "done"}).to_string();
    std::fs::write(dir.join("d.jsonl"), format!("{}\n{long}\n", lines[0])).unwrap();
    let (ok, _, err) = doppler(&["finetune", "--config", cfg.to_str().unwrap()]);
    assert!(
        !ok && err.contains("d.jsonl line 2") && err.contains("nothing left to learn"),
        "{err}"
    );
}

/// The digits CSV (scripts/fetch_digits.sh; the README's test command runs it first, and
/// `DOPPLER_DIGITS` may name the file instead).
fn digits_path() -> std::path::PathBuf {
    let p = std::env::var("DOPPLER_DIGITS")
        .map(Into::into)
        .unwrap_or_else(|_| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/digits/digits.csv")
        });
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch_digits.sh (the README's test command does)",
        p.display()
    );
    p
}

/// configs/digits_cnn.toml, shortened to `steps`, on `images`, writing into `dir/run`.
fn digits_config(
    dir: &std::path::Path,
    images: &std::path::Path,
    steps: u64,
) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let shipped =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/digits_cnn.toml");
    let text = std::fs::read_to_string(shipped).unwrap();
    let text = text
        .replace(
            "\"../data/digits/digits.csv\"",
            &format!("{:?}", images.display().to_string()),
        )
        .replace("\"../runs/digits_cnn\"", "\"run\"")
        .replace("steps = 500", &format!("steps = {steps}"))
        .replace(
            "eval_interval = 100",
            &format!("eval_interval = {}", steps / 2),
        )
        .replace(
            "checkpoint_interval = 250",
            &format!("checkpoint_interval = {steps}"),
        );
    let path = dir.join("digits.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// The shipped digits classifier trains from its config: held-out accuracy well past
/// chance (10%) after 60 steps, in the summary, the events and metrics.jsonl.
#[test]
fn digits_classifier_trains_from_its_config() {
    let dir = tmp("digits");
    let cfg = digits_config(&dir, &digits_path(), 60);
    let (ok, out, err) = doppler(&["train", "--config", cfg.to_str().unwrap(), "--json"]);
    assert!(ok, "{out}{err}");
    let events: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(events[0]["event"], "start");
    assert_eq!(events[0]["classes"], 10);
    assert_eq!(events[0]["train_images"], 1617);
    assert_eq!(events[0]["val_images"], 180);
    let s = &events.last().unwrap()["summary"];
    let acc = s["final_val_accuracy"].as_f64().unwrap();
    eprintln!("digits after 60 steps: {s}");
    assert!(acc > 0.8, "held-out accuracy {acc} after 60 steps");
    assert!(s["final_val_loss"].as_f64().unwrap() < 0.7 * s["first_val_loss"].as_f64().unwrap());
    let metrics = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    assert!(metrics.contains("\"val_accuracy\""), "{metrics}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Images that do not fit the config, labels outside its classes and a resolution its
/// stages cannot halve: errors naming the file, the line and the shapes; nothing trained.
#[test]
fn bad_images_and_conv_configs_are_named() {
    let dir = tmp("digits-bad");
    std::fs::create_dir_all(&dir).unwrap();
    let row = |n: usize, label: &str| format!("{}{label}\n", "1,".repeat(n));
    for (csv, want) in [
        (
            row(64, "3") + &row(63, "3"),
            "line 2: 64 values; the config's images are 1x8x8 = 64 pixels, then a label",
        ),
        (
            row(64, "3") + &row(64, "10"),
            "line 2: label \"10\" is not a class in 0..10",
        ),
        (
            row(64, "3").repeat(3) + &row(192, "1"),
            "line 4: 193 values",
        ),
    ] {
        let images = dir.join("images.csv");
        std::fs::write(&images, csv).unwrap();
        let cfg = digits_config(&dir, &images, 10);
        let (ok, _, err) = doppler(&["train", "--config", cfg.to_str().unwrap()]);
        assert!(
            !ok && err.contains("images.csv") && err.contains(want),
            "{want}: {err}"
        );
        assert!(!dir.join("run").exists());
    }
    let images = dir.join("images.csv");
    std::fs::write(&images, row(64, "1").repeat(20)).unwrap();
    let cfg = digits_config(&dir, &images, 10);
    let text = std::fs::read_to_string(&cfg).unwrap();
    for (from, to, want) in [
        (
            "channels = [16, 32]",
            "channels = [16, 16, 16, 16, 16]",
            "image_size 8 is not divisible by 2^4 = 16",
        ),
        ("groups = 8", "groups = 5", "a multiple of groups 5"),
        (
            "classes = 10",
            "classes = 1",
            "classes 1 must be in 2..=1048576",
        ),
        ("in_channels = 1", "in_channel = 1", "in_channel"),
        (
            "channels = [16, 32]\nblocks = 1",
            "channels = [4096, 4096]\nblocks = 64",
            "parameters: at most 1073741824",
        ),
    ] {
        std::fs::write(&cfg, text.replace(from, to)).unwrap();
        let (ok, _, err) = doppler(&["train", "--config", cfg.to_str().unwrap()]);
        assert!(!ok && err.contains(want), "{to}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// configs/digits_unet.toml, made tiny (two levels of 8 and 16 channels, 10 diffusion
/// steps, batches of 16, 4 training steps), trains; `doppler sample` draws a PNG grid of
/// one class from it; a class outside the config's and a classifier checkpoint are
/// refused by name.
#[test]
fn unet_trains_and_samples_a_png_grid() {
    let dir = tmp("unet");
    std::fs::create_dir_all(&dir).unwrap();
    let shipped =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/digits_unet.toml");
    let text = std::fs::read_to_string(shipped).unwrap();
    let text = text
        .replace(
            "\"../data/digits/digits.csv\"",
            &format!("{:?}", digits_path().display().to_string()),
        )
        .replace("\"../runs/digits_unet\"", "\"run\"")
        .replace("channels = [32, 64]", "channels = [8, 16]")
        .replace("groups = 8", "groups = 4")
        .replace("timesteps = 200", "timesteps = 10")
        .replace("batch_size = 128", "batch_size = 16")
        .replace("steps = 4000", "steps = 4")
        .replace("eval_interval = 500", "eval_interval = 2")
        .replace("checkpoint_interval = 1000", "checkpoint_interval = 4");
    let cfg = dir.join("unet.toml");
    std::fs::write(&cfg, text).unwrap();
    let (ok, out, err) = doppler(&["train", "--config", cfg.to_str().unwrap(), "--json"]);
    assert!(ok, "{out}{err}");
    let done: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    let s = &done["summary"];
    assert_eq!(s["steps"], 4);
    assert!(
        s["final_val_loss"].as_f64().unwrap().is_finite() && s["final_val_accuracy"].is_null(),
        "{s}"
    );
    let png = dir.join("grid.png");
    let run = dir.join("run");
    let (ok, out, err) = doppler(&[
        "sample",
        "--checkpoint",
        run.to_str().unwrap(),
        "--class",
        "7",
        "-n",
        "5",
        "-o",
        png.to_str().unwrap(),
        "--json",
    ]);
    assert!(ok, "{out}{err}");
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    let be = |i: usize| u32::from_be_bytes(bytes[i..i + 4].try_into().unwrap());
    // 3 columns x 2 rows of 8x8 images at scale 4 with 2-pixel gaps.
    assert_eq!((be(16), be(20)), (3 * 34 + 2, 2 * 34 + 2));
    assert_eq!(bytes[25], 0, "greyscale");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["steps"], 10);
    let (ok, _, err) = doppler(&[
        "sample",
        "--checkpoint",
        run.to_str().unwrap(),
        "--class",
        "10",
    ]);
    assert!(!ok && err.contains("class 10 of 10"), "{err}");
    let cls = tmp("unet-classifier");
    let ccfg = digits_config(&cls, &digits_path(), 2);
    let (ok, _, err) = doppler(&[
        "train",
        "--config",
        ccfg.to_str().unwrap(),
        "--max-steps",
        "0",
    ]);
    assert!(ok, "{err}");
    let (ok, _, err) = doppler(&[
        "sample",
        "--checkpoint",
        cls.join("run").to_str().unwrap(),
        "--class",
        "1",
    ]);
    assert!(!ok && err.contains("not a Unet"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&cls);
}
