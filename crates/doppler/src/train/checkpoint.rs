//! Checkpoints: weights and optimizer state as SafeTensors, run state as JSON, the
//! tokenizer beside them. A checkpoint is a directory `step-NNNNNNNN/` written under a
//! temporary name, synced and renamed into place; `latest` (itself replaced atomically)
//! names the newest. A crash at any point leaves the previous checkpoint intact, and
//! `state.json` holds SHA-256 hashes that every load checks.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::config::TrainConfig;
use crate::error::{Error, Result};
use crate::gpu::{Gpu, Tensor};
use crate::optim::LossScaler;

pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIM_FILE: &str = "optim.safetensors";
pub const STATE_FILE: &str = "state.json";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
const LATEST: &str = "latest";
/// Checkpoints kept in a run directory (older ones are removed).
const KEEP: usize = 2;

/// Everything besides tensors that a resumed run needs to continue bit for bit. `C` is
/// the run's config: `train`'s, or what `finetune` keeps ([`crate::finetune::FtRun`]).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunState<C = TrainConfig> {
    pub format: u32,
    pub config: C,
    /// Optimizer steps taken.
    pub step: u64,
    /// Batches are drawn from (config seed, step, micro-batch): the data position is the
    /// step; this counts the tokens (or a conv net's images) consumed so far.
    pub tokens_seen: u64,
    pub loss_scaler: LossScaler,
    pub adamw_step: u32,
    /// SHA-256 of every other file in the checkpoint.
    pub hashes: BTreeMap<String, String>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.display().to_string(),
        source,
    }
}

fn ckpt_err(path: &Path, detail: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.display().to_string(),
        detail: detail.into(),
    }
}

pub fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Writes `bytes` to `path` through a synced temporary file and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let written = (|| {
        let mut f = fs::File::create(&tmp).map_err(io(&tmp))?;
        f.write_all(bytes).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
        drop(f);
        fs::rename(&tmp, path).map_err(io(path))
    })();
    if written.is_err() {
        // A full disk: what was written of the temporary file goes with it.
        let _ = fs::remove_file(&tmp);
    }
    written?;
    sync_dir(path.parent().unwrap_or(Path::new(".")));
    Ok(())
}

fn sync_dir(dir: &Path) {
    // Makes the rename durable where the platform allows opening a directory.
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Blocking [`safetensors_bytes_async`].
#[cfg(not(target_arch = "wasm32"))]
pub fn safetensors_bytes(gpu: &Gpu, tensors: &[(String, &Tensor)]) -> Result<Vec<u8>> {
    pollster::block_on(safetensors_bytes_async(gpu, tensors))
}

/// SafeTensors bytes of f32 tensors read back from the GPU, in the given order.
pub async fn safetensors_bytes_async(gpu: &Gpu, tensors: &[(String, &Tensor)]) -> Result<Vec<u8>> {
    let mut data = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let bytes: Vec<u8> = bytemuck::cast_slice(&t.to_vec_f32(gpu).await?).to_vec();
        data.push((name.clone(), t.shape().to_vec(), bytes));
    }
    let views = data
        .iter()
        .map(|(n, s, b)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .map(|v| (n.clone(), v))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Invalid {
            op: "safetensors",
            detail: e.to_string(),
        })?;
    safetensors::serialize(views, None).map_err(|e| Error::Invalid {
        op: "safetensors",
        detail: e.to_string(),
    })
}

/// (name, shape, f32 data) of every tensor in a SafeTensors file's bytes.
pub fn read_safetensors(path: &Path, bytes: &[u8]) -> Result<Vec<(String, Vec<usize>, Vec<f32>)>> {
    let st =
        safetensors::SafeTensors::deserialize(bytes).map_err(|e| ckpt_err(path, e.to_string()))?;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        if view.dtype() != safetensors::Dtype::F32 {
            return Err(ckpt_err(
                path,
                format!("tensor {name} is {:?}, expected F32", view.dtype()),
            ));
        }
        let data: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        out.push((name, view.shape().to_vec(), data));
    }
    Ok(out)
}

/// Files of one checkpoint, as bytes (a fine-tune's has no tokenizer: the base has it).
pub struct CheckpointFiles {
    pub model: Vec<u8>,
    pub optim: Vec<u8>,
    pub tokenizer: Option<Vec<u8>>,
}

/// Writes `step-NNNNNNNN/` under `run_dir` and points `latest` at it.
pub fn save<C: Serialize>(
    run_dir: &Path,
    state: RunState<C>,
    files: &CheckpointFiles,
) -> Result<PathBuf> {
    save_with(run_dir, state, files, &write_atomic)
}

/// [`save`] with the files written by `write` (tests give one that fails, as a full disk
/// does). Before writing, the run's stale temporary folders and every checkpoint but the
/// newest go: at most two checkpoints are on the disk while the new one is written. A
/// write that fails removes what it wrote, so the next save finds the space it had.
pub fn save_with<C: Serialize>(
    run_dir: &Path,
    mut state: RunState<C>,
    files: &CheckpointFiles,
    write: &dyn Fn(&Path, &[u8]) -> Result<()>,
) -> Result<PathBuf> {
    let name = format!("step-{:08}", state.step);
    let final_dir = run_dir.join(&name);
    let tmp = run_dir.join(format!("{name}.tmp-{}", std::process::id()));
    if let Ok(current) = resolve(run_dir) {
        let current = current.file_name().and_then(|n| n.to_str()).unwrap_or("");
        prune_keeping(run_dir, current, 1);
    }
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let written = (|| {
        let tokenizer = files.tokenizer.as_ref().map(|t| (TOKENIZER_FILE, t));
        for (file, bytes) in [(MODEL_FILE, &files.model), (OPTIM_FILE, &files.optim)]
            .into_iter()
            .chain(tokenizer)
        {
            state.hashes.insert(file.into(), sha256(bytes));
            write(&tmp.join(file), bytes)?;
        }
        let json = serde_json::to_vec_pretty(&state).map_err(|e| Error::Invalid {
            op: "checkpoint",
            detail: e.to_string(),
        })?;
        write(&tmp.join(STATE_FILE), &json)
    })();
    if let Err(e) = written {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if final_dir.exists() {
        fs::remove_dir_all(&final_dir).map_err(io(&final_dir))?;
    }
    fs::rename(&tmp, &final_dir).map_err(io(&final_dir))?;
    sync_dir(run_dir);
    write_atomic(&run_dir.join(LATEST), name.as_bytes())?;
    prune(run_dir, &name);
    Ok(final_dir)
}

/// Removes all but the newest KEEP checkpoints (never the one `latest` names), and the
/// half-written folders (`step-N.tmp-PID`) saves cut short left behind.
fn prune(run_dir: &Path, latest: &str) {
    prune_keeping(run_dir, latest, KEEP)
}

fn prune_keeping(run_dir: &Path, latest: &str, keep: usize) {
    let Ok(entries) = fs::read_dir(run_dir) else {
        return;
    };
    let names: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    for n in &names {
        if n.starts_with("step-") && n.contains(".tmp-") {
            let _ = fs::remove_dir_all(run_dir.join(n));
        }
    }
    let mut dirs: Vec<String> = names
        .into_iter()
        .filter(|n| n.starts_with("step-") && !n.contains(".tmp"))
        .collect();
    dirs.sort();
    let n = dirs.len();
    for d in dirs.into_iter().take(n.saturating_sub(keep)) {
        if d != latest {
            let _ = fs::remove_dir_all(run_dir.join(d));
        }
    }
}

/// The checkpoint directory `path` means: a checkpoint itself, or a run directory whose
/// `latest` names one.
pub fn resolve(path: &Path) -> Result<PathBuf> {
    if path.join(STATE_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join(LATEST);
    let name = match fs::read_to_string(&latest) {
        Ok(name) => name.trim().to_string(),
        Err(_) => {
            return Err(ckpt_err(
                path,
                "no state.json here and no `latest` file naming a checkpoint",
            ))
        }
    };
    // `latest` names a folder of this run: step-NNNNNNNN, nothing else.
    if name.is_empty() || !name.starts_with("step-") || name.contains(['/', '\\']) {
        return Err(ckpt_err(
            &latest,
            format!("names {name:?}, not a checkpoint folder (step-NNNNNNNN)"),
        ));
    }
    let dir = path.join(&name);
    if !dir.join(STATE_FILE).is_file() {
        return Err(ckpt_err(
            &latest,
            format!("names {name}, which holds no state.json"),
        ));
    }
    Ok(dir)
}

/// A loaded checkpoint, hashes checked.
pub struct Loaded<C = TrainConfig> {
    pub dir: PathBuf,
    pub state: RunState<C>,
    pub model: Vec<(String, Vec<usize>, Vec<f32>)>,
    tokenizer: Option<Vec<u8>>,
    optim_bytes: Vec<u8>,
}

impl<C> Loaded<C> {
    /// The tokenizer's JSON (a checkpoint of `train`; a fine-tune's has none).
    pub fn tokenizer(&self) -> Result<&[u8]> {
        self.tokenizer
            .as_deref()
            .ok_or_else(|| ckpt_err(&self.dir, format!("holds no {TOKENIZER_FILE}")))
    }

    /// AdamW's (m, v) per parameter, in `names` order.
    pub fn optim_state(&self, gpu: &Gpu, names: &[String]) -> Result<Vec<(Tensor, Tensor)>> {
        let path = self.dir.join(OPTIM_FILE);
        let mut all = read_safetensors(&path, &self.optim_bytes)?;
        let mut take = |key: String| -> Result<Tensor> {
            let i = all
                .iter()
                .position(|t| t.0 == key)
                .ok_or_else(|| ckpt_err(&path, format!("missing tensor {key}")))?;
            let (n, shape, data) = all.swap_remove(i);
            Tensor::from_f32(gpu, &shape, &data, &n)
        };
        names
            .iter()
            .map(|n| Ok((take(format!("m.{n}"))?, take(format!("v.{n}"))?)))
            .collect()
    }
}

pub fn load<C: serde::de::DeserializeOwned>(path: &Path) -> Result<Loaded<C>> {
    let dir = resolve(path)?;
    let state_path = dir.join(STATE_FILE);
    let text = fs::read(&state_path).map_err(io(&state_path))?;
    let state: RunState<C> =
        serde_json::from_slice(&text).map_err(|e| ckpt_err(&state_path, e.to_string()))?;
    if state.format != 1 {
        return Err(ckpt_err(
            &state_path,
            format!("format {} (this build reads 1)", state.format),
        ));
    }
    let read = |file: &str| -> Result<Vec<u8>> {
        let p = dir.join(file);
        let bytes = fs::read(&p).map_err(io(&p))?;
        let want = state
            .hashes
            .get(file)
            .ok_or_else(|| ckpt_err(&dir, format!("state.json has no hash for {file}")))?;
        if &sha256(&bytes) != want {
            return Err(ckpt_err(
                &p,
                "SHA-256 does not match state.json (corrupt or partly written)",
            ));
        }
        Ok(bytes)
    };
    let model_bytes = read(MODEL_FILE)?;
    let optim_bytes = read(OPTIM_FILE)?;
    let tokenizer = match state.hashes.contains_key(TOKENIZER_FILE) {
        true => Some(read(TOKENIZER_FILE)?),
        false => None,
    };
    let model = read_safetensors(&dir.join(MODEL_FILE), &model_bytes)?;
    Ok(Loaded {
        dir,
        state,
        model,
        tokenizer,
        optim_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(step: u64) -> RunState {
        let text = "[model]\narch = \"llama\"\nn_layer = 1\nn_embd = 8\nn_head = 2\nblock_size = 4\n\
                    [data]\ncorpus = \"c.txt\"\ntokenizer = \"char\"\n\
                    [train]\nbatch_size = 1\nsteps = 9\nlr = 1e-3\neval_interval = 4\ncheckpoint_interval = 4\nseed = 1\nout_dir = \"run\"\n";
        RunState {
            format: 1,
            config: TrainConfig::parse(text, "t.toml").unwrap(),
            step,
            tokens_seen: 0,
            loss_scaler: LossScaler::fixed(),
            adamw_step: step as u32,
            hashes: Default::default(),
        }
    }

    fn listing(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    /// A full disk during a save (issue 22): the save fails naming the file, what it wrote
    /// is gone, `latest` still names the previous checkpoint, only that one and the new
    /// one's folder were on the disk while it wrote, and the next save succeeds.
    #[test]
    fn a_save_that_fills_the_disk_leaves_the_run_as_it_was() {
        let run = std::env::temp_dir().join(format!("doppler-ckpt-full-{}", std::process::id()));
        let _ = fs::remove_dir_all(&run);
        fs::create_dir_all(&run).unwrap();
        let files = CheckpointFiles {
            model: vec![1; 64],
            optim: vec![2; 64],
            tokenizer: Some(b"{}".to_vec()),
        };
        for step in [1, 2] {
            save(&run, state(step), &files).unwrap();
        }
        assert_eq!(listing(&run), ["latest", "step-00000001", "step-00000002"]);
        // A half-written folder of a process killed earlier.
        fs::create_dir_all(run.join("step-00000003.tmp-99999999")).unwrap();
        let seen = std::cell::RefCell::new(Vec::new());
        let full = |path: &Path, bytes: &[u8]| -> Result<()> {
            if path.ends_with(OPTIM_FILE) {
                *seen.borrow_mut() = listing(&run);
                return Err(Error::Io {
                    path: path.display().to_string(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::StorageFull,
                        "No space left on device",
                    ),
                });
            }
            write_atomic(path, bytes)
        };
        let e = save_with(&run, state(3), &files, &full)
            .unwrap_err()
            .to_string();
        assert!(e.contains(OPTIM_FILE) && e.contains("No space left"), "{e}");
        let tmp = format!("step-00000003.tmp-{}", std::process::id());
        assert_eq!(*seen.borrow(), ["latest", "step-00000002", tmp.as_str()]);
        assert_eq!(listing(&run), ["latest", "step-00000002"]);
        assert_eq!(resolve(&run).unwrap(), run.join("step-00000002"));
        save(&run, state(3), &files).unwrap();
        assert_eq!(listing(&run), ["latest", "step-00000002", "step-00000003"]);
        let _ = fs::remove_dir_all(&run);
    }
}
