//! A run's directory and its checkpoints.
//!
//! ```text
//! runs/<id>/config.json                 the TrainConfig or VisionConfig (written once, read by --resume)
//! runs/<id>/events.jsonl                toy/v1 events
//! runs/<id>/model.gguf                  the latest model, a standard llama GGUF
//! runs/<id>/checkpoints/step-000150/    model.mpk, optim.mpk (burn records), state.json
//! runs/<id>/checkpoints/latest          the name of the newest complete checkpoint directory
//! ```
//!
//! Crash safety: a checkpoint directory is written under a temporary name, every file synced,
//! and renamed into place; only then is `latest` replaced (temporary file + rename) to point at
//! it, then `model.gguf` (atomic too), and only then are older checkpoint directories removed.
//! A SIGKILL at any instant leaves `latest` naming a complete checkpoint.
//!
//! The GGUF is what the run produces; the burn records are what `--resume` reads, because they
//! keep the parameter ids that the optimizer's moments are keyed by.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
use burn::tensor::backend::Backend;
use serde::{Deserialize, Serialize};

use crate::{TrainError, io_err};

/// Training progress saved with a checkpoint (`default()`: a run that has not started).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Optimizer steps completed.
    pub step: usize,
    /// Tokens predicted so far.
    pub total_tokens: usize,
    /// Training seconds so far.
    pub elapsed_s: f64,
    /// Length of `events.jsonl` when the checkpoint was taken.
    pub events_len: u64,
    /// Training loss of the last step done.
    pub last_loss: Option<f64>,
    /// Held-out loss of the last evaluation.
    pub last_eval_loss: Option<f64>,
}

impl TrainState {
    /// The `run_end` event of a run that finished here.
    pub fn run_end(&self) -> crate::events::Event {
        crate::events::Event::RunEnd {
            step: self.step,
            final_loss: self.last_loss,
            final_eval_loss: self.last_eval_loss,
            total_tokens: self.total_tokens,
            elapsed_s: self.elapsed_s,
        }
    }
}

/// A run directory.
#[derive(Debug, Clone)]
pub struct RunDir {
    /// The directory (`runs/<id>`).
    pub path: PathBuf,
    /// The run's id: the directory's name.
    pub id: String,
}

impl RunDir {
    /// Create `root/<id>`; refuses an existing directory (never overwrite a run).
    pub fn create(root: &Path, id: &str) -> Result<Self, TrainError> {
        fs::create_dir_all(root).map_err(io_err(format!("cannot create {}", root.display())))?;
        let path = root.join(id);
        fs::create_dir(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => TrainError::Config(format!(
                "run directory {} already exists; choose another --run-id or --resume it",
                path.display()
            )),
            _ => TrainError::Io {
                what: format!("cannot create {}", path.display()),
                source: e,
            },
        })?;
        fs::create_dir(path.join("checkpoints")).map_err(io_err(format!(
            "cannot create {}/checkpoints",
            path.display()
        )))?;
        Ok(RunDir {
            path,
            id: id.to_string(),
        })
    }

    /// An existing run directory (for `--resume`).
    pub fn open(path: &Path) -> Result<Self, TrainError> {
        if !path.join("config.json").is_file() {
            return Err(TrainError::Config(format!(
                "{} is not a run directory (no config.json)",
                path.display()
            )));
        }
        let id = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string());
        Ok(RunDir {
            path: path.to_path_buf(),
            id,
        })
    }

    /// `config.json`: the run's configuration.
    pub fn config_path(&self) -> PathBuf {
        self.path.join("config.json")
    }

    /// `events.jsonl`: the run's event log.
    pub fn events_path(&self) -> PathBuf {
        self.path.join("events.jsonl")
    }

    /// `model.gguf`: the latest model of the run.
    pub fn model_path(&self) -> PathBuf {
        self.path.join("model.gguf")
    }

    fn checkpoints(&self) -> PathBuf {
        self.path.join("checkpoints")
    }

    /// Write `config.json` (a language model's `TrainConfig`, or an image classifier's
    /// `VisionConfig`).
    pub fn write_config(&self, config: &impl Serialize) -> Result<(), TrainError> {
        let json = serde_json::to_vec_pretty(config).expect("a config always serializes");
        write_atomic(&self.config_path(), &json)
    }

    /// Read `config.json` as `T` (`TrainConfig`, `VisionConfig`, or any JSON value).
    pub fn read_config<T: serde::de::DeserializeOwned>(&self) -> Result<T, TrainError> {
        let path = self.config_path();
        let bytes = fs::read(&path).map_err(io_err(format!("cannot read {}", path.display())))?;
        serde_json::from_slice(&bytes).map_err(|e| {
            TrainError::Config(format!("{} is not a valid run config: {e}", path.display()))
        })
    }

    /// The newest complete checkpoint, if any.
    pub fn latest(&self) -> Result<Option<PathBuf>, TrainError> {
        let pointer = self.checkpoints().join("latest");
        match fs::read_to_string(&pointer) {
            Ok(name) => {
                let dir = self.checkpoints().join(name.trim());
                if !dir.join("state.json").is_file() {
                    return Err(TrainError::Config(format!(
                        "{} names {}, which is not a complete checkpoint",
                        pointer.display(),
                        dir.display()
                    )));
                }
                Ok(Some(dir))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err(format!("cannot read {}", pointer.display()))(e)),
        }
    }

    /// Write checkpoint `state.step` (see the module docs for the order of operations). The
    /// GGUF is written by `write_gguf(path)` once the resume state is safely in place.
    pub fn write_checkpoint<B: Backend, M: Module<B>, R: burn::record::Record<B>>(
        &self,
        state: &TrainState,
        model: &M,
        optim: R,
        write_gguf: impl FnOnce(&Path) -> Result<u64, TrainError>,
    ) -> Result<(PathBuf, u64), TrainError> {
        let name = format!("step-{:07}", state.step);
        let dir = self.checkpoints().join(&name);
        let tmp = self
            .checkpoints()
            .join(format!(".{name}.tmp-{}", std::process::id()));
        // A leftover from a run killed while writing this very checkpoint.
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir(&tmp).map_err(io_err(format!("cannot create {}", tmp.display())))?;

        let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
        let model_bytes = recorder
            .record(model.clone().into_record(), ())
            .map_err(|e| TrainError::Record(format!("cannot encode the model state: {e}")))?;
        let optim_bytes = recorder
            .record(optim, ())
            .map_err(|e| TrainError::Record(format!("cannot encode the optimizer state: {e}")))?;
        let state_bytes = serde_json::to_vec_pretty(state).expect("state always serializes");
        let written = write_synced(&tmp.join("model.mpk"), &model_bytes)
            .and_then(|()| write_synced(&tmp.join("optim.mpk"), &optim_bytes))
            .and_then(|()| write_synced(&tmp.join("state.json"), &state_bytes));
        if let Err(e) = written {
            // A full disk: give the space back; the previous checkpoint is untouched.
            let _ = fs::remove_dir_all(&tmp);
            return Err(e);
        }
        // Re-writing the checkpoint of a step (a resumed run redoing it) replaces the old one.
        if dir.exists() {
            fs::remove_dir_all(&dir)
                .map_err(io_err(format!("cannot replace {}", dir.display())))?;
        }
        fs::rename(&tmp, &dir).map_err(io_err(format!("cannot rename {}", tmp.display())))?;
        sync_dir(&self.checkpoints());
        write_atomic(&self.checkpoints().join("latest"), name.as_bytes())?;

        let gguf_bytes = write_gguf(&self.model_path())?;

        // Older checkpoints are redundant now.
        if let Ok(entries) = fs::read_dir(self.checkpoints()) {
            for entry in entries.flatten() {
                let n = entry.file_name().to_string_lossy().into_owned();
                if n.starts_with("step-") && n != name {
                    let _ = fs::remove_dir_all(entry.path());
                }
            }
        }
        let bytes = (model_bytes.len() + optim_bytes.len()) as u64 + gguf_bytes;
        Ok((dir, bytes))
    }

    /// Read a checkpoint directory: its state and the model and optimizer records.
    pub fn read_checkpoint<B: Backend, R: burn::record::Record<B>, O: burn::record::Record<B>>(
        dir: &Path,
        device: &B::Device,
    ) -> Result<(TrainState, R, O), TrainError> {
        let read = |name: &str| {
            let p = dir.join(name);
            fs::read(&p).map_err(io_err(format!("cannot read {}", p.display())))
        };
        let state: TrainState = serde_json::from_slice(&read("state.json")?)
            .map_err(|e| TrainError::Record(format!("{}/state.json: {e}", dir.display())))?;
        let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
        let model = recorder
            .load(read("model.mpk")?, device)
            .map_err(|e| TrainError::Record(format!("{}/model.mpk: {e}", dir.display())))?;
        let optim = recorder
            .load(read("optim.mpk")?, device)
            .map_err(|e| TrainError::Record(format!("{}/optim.mpk: {e}", dir.display())))?;
        Ok((state, model, optim))
    }
}

/// Write a file and flush it to disk.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    let mut f = File::create(path).map_err(io_err(format!("cannot create {}", path.display())))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(io_err(format!("cannot write {}", path.display())))
}

/// Best effort: make a rename durable. Some filesystems cannot sync a directory; the data is
/// already safe in the renamed file, so that is not an error.
fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Write `path` whole or not at all (`toy_core::atomic`).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    toy_core::atomic::write_atomic(path, bytes)
        .map_err(io_err(format!("cannot write {}", path.display())))
}
