//! The run directory: where a run's outputs live (`--out`, or `runs/<model>-<time>`), how a
//! new run opens one and a resumed run finds its checkpoint, and what a finished run reports.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use oobleck_core::checkpoint;
use serde::Serialize;

use crate::config::{load_resolved, save_resolved, TrainConfig};

/// One line of `metrics.jsonl`: a committed step (the runtime's record).
pub use oobleck_core::runtime::StepMetrics;

/// What a finished run reports (`--json` prints it).
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub out: PathBuf,
    pub model: String,
    pub params: usize,
    pub steps: u64,
    pub first_loss: Option<f64>,
    pub final_loss: Option<f64>,
    pub first_val_loss: Option<f64>,
    pub final_val_loss: Option<f64>,
    pub tokens_per_s: f64,
    pub wall_s: f64,
    pub checkpoint: Option<PathBuf>,
    /// `report.html`, when it could be written.
    pub report: Option<PathBuf>,
}

/// `--out`, or `runs/<model>-<unix seconds>`.
pub fn out_dir(cfg: &TrainConfig) -> PathBuf {
    match &cfg.out {
        Some(o) => o.clone(),
        None => PathBuf::from("runs").join(format!(
            "{}-{}",
            cfg.model.replace('/', "_"),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0)
        )),
    }
}

/// The run directory of a job and, with `resume` (`--resume PATH`), the checkpoint it goes on
/// from, checked to continue the same training. A new run gets a fresh directory holding its
/// resolved config; one that already holds a run is refused.
pub fn open_run(cfg: &TrainConfig, resume: Option<&Path>) -> Result<(PathBuf, Option<PathBuf>)> {
    if let Some(path) = resume {
        let (run, ckpt) = find_checkpoint(path)?;
        let saved = load_resolved(&run)?;
        if let Some(changed) = cfg.trajectory_mismatch(&saved) {
            bail!(
                "--resume {}: this run was started with other values of {changed}; resuming \
                 with different values would not continue the same training (start a new run \
                 instead)",
                path.display()
            );
        }
        if cfg.steps != saved.steps {
            // An extended run: its config.json says how far it goes now, so a later plain
            // `--resume RUN` continues the same schedule.
            save_resolved(cfg, &run)?;
        }
        return Ok((run, Some(ckpt)));
    }
    let out = out_dir(cfg);
    if out.join("metrics.jsonl").exists() || out.join("checkpoints").exists() {
        bail!(
            "{} already holds a run; pass --resume {} to continue it, or choose another --out",
            out.display(),
            out.display()
        );
    }
    std::fs::create_dir_all(&out)
        .with_context(|| format!("creating run directory {}", out.display()))?;
    save_resolved(cfg, &out)?;
    Ok((out, None))
}

/// `path` is a run directory (newest checkpoint) or a checkpoint directory; returns
/// `(run directory, checkpoint directory)`.
pub fn find_checkpoint(path: &Path) -> Result<(PathBuf, PathBuf)> {
    if path.join(checkpoint::TRAINER_FILE).is_file() {
        let run = path
            .parent()
            .and_then(Path::parent)
            .with_context(|| format!("{} is not inside <run>/checkpoints/", path.display()))?;
        return Ok((run.to_path_buf(), path.to_path_buf()));
    }
    if !path.is_dir() {
        bail!(
            "--resume {}: no such run or checkpoint directory",
            path.display()
        );
    }
    match checkpoint::latest_checkpoint(path)? {
        Some(c) => Ok((path.to_path_buf(), c)),
        None => bail!(
            "--resume {}: the run has no complete checkpoint yet",
            path.display()
        ),
    }
}

pub use oobleck_core::runtime::master::truncate_metrics_after;
