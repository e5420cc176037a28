//! The `doppler` command as a user runs it.

use std::process::Command;

fn doppler(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_doppler")).args(args).output().expect("run doppler");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
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
    assert!(v["limits"]["max_compute_workgroups_per_dimension"].as_u64().unwrap() >= 65535);
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
    assert!(err.contains("no adapter matches \"no-such-gpu-xyz\"") && err.contains("available"), "{err}");
    let (ok, _, err) = doppler(&["--backend", "glide", "info"]);
    assert!(!ok);
    assert!(err.contains("unknown backend"), "{err}");
}

#[test]
fn bench_json_reports_medians() {
    let (ok, out, err) =
        doppler(&["bench", "--json", "--mib", "1", "--size", "64", "--repeat", "2", "--batch", "2"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.len(), 7, "{out}");
    for r in rows {
        assert!(r["wall_ms"].as_f64().unwrap() > 0.0 && r["value"].as_f64().unwrap() > 0.0, "{r}");
    }
}
