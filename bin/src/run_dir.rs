//! The run directory: where a run's outputs live (`--out`, or `runs/<model>-<time>`), how a
//! new run opens one and a resumed run finds its checkpoint, and what a finished run reports.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use oobleck_core::checkpoint;
use oobleck_models::data::Dataset;
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

/// Refuses to resume from `checkpoint` on data other than the data it was trained on: its
/// `trainer.json` records the tokens' identity (`data_cursor.tokens_sha256`; checkpoints from
/// before it was recorded are not checked) and, for a blend, each source's (`sources`), so the
/// error names the source that changed.
fn check_same_data(checkpoint: &Path, cfg: &TrainConfig, data: &Dataset) -> Result<()> {
    let path = checkpoint.join(checkpoint::TRAINER_FILE);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let doc: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    let Some(saved) = doc["data_cursor"]["tokens_sha256"].as_str() else {
        return Ok(());
    };
    let tokens_sha256 = data.tokens_sha256();
    if saved == tokens_sha256 {
        return Ok(());
    }
    let short = |s: &str| s[..s.len().min(12)].to_string();
    let (what, now, then) = match changed_source(&doc["data_cursor"]["sources"], data) {
        Some((path, now, then)) => (
            format!("source {}", path.display()),
            short(&now),
            short(&then),
        ),
        None if cfg.data.is_empty() => (
            "the shipped corpus".to_string(),
            short(tokens_sha256),
            short(saved),
        ),
        None => (
            cfg.data
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join(" + "),
            short(tokens_sha256),
            short(saved),
        ),
    };
    bail!(
        "--resume: the data changed since {} was written: {what} now holds tokens whose \
         identity is {now}..., the checkpoint was trained on {then}...; resume with the data it \
         was trained on, or start a new run (another --out) on this data",
        checkpoint.display(),
    )
}

/// The first source of a blend whose identity differs from the one `saved` (a checkpoint's
/// `data_cursor.sources`) records at the same place: its path, now and then.
fn changed_source(saved: &serde_json::Value, data: &Dataset) -> Option<(PathBuf, String, String)> {
    let saved = saved.as_array()?;
    let now = data.source_identities();
    if saved.len() != now.len() {
        return None;
    }
    now.into_iter().zip(saved).find_map(|((path, sha), old)| {
        let old = old["tokens_sha256"].as_str()?;
        (old != sha).then(|| (path, sha, old.to_string()))
    })
}

/// The run directory of a job and, with `resume` (`--resume PATH`), the checkpoint it goes on
/// from and its step, checked to continue the same training. A new run gets a fresh directory
/// holding its resolved config; one that already holds a run is refused. Checkpoints passed
/// over because they do not verify are named on stderr, one line each.
pub fn open_run(
    cfg: &TrainConfig,
    resume: Option<&Path>,
    data: &Dataset,
) -> Result<(PathBuf, Option<(PathBuf, u64)>)> {
    if let Some(path) = resume {
        let found = find_checkpoint(path)?;
        check_same_data(&found.checkpoint, cfg, data)?;
        let run = found.run;
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
        for s in &found.skipped {
            eprintln!(
                "--resume: skipping checkpoint {}, it cannot be used: {}",
                s.path.display(),
                s.reason
            );
        }
        if !found.skipped.is_empty() {
            eprintln!(
                "--resume: going on from step {} ({}); a skipped checkpoint is moved aside (to \
                 <its name>.invalid-<unix seconds>) when this run saves its step again",
                found.step,
                found.checkpoint.display()
            );
        }
        return Ok((run, Some((found.checkpoint, found.step))));
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

/// Where `--resume PATH` goes on from.
#[derive(Debug)]
pub struct Resume {
    pub run: PathBuf,
    /// A checkpoint that verifies (format version, sizes, checksums).
    pub checkpoint: PathBuf,
    pub step: u64,
    /// Newer checkpoints of the run passed over because they do not verify, newest first.
    pub skipped: Vec<checkpoint::Invalid>,
}

/// The run directory of `--resume PATH`: PATH itself, or the run that the checkpoint
/// directory PATH (`<run>/checkpoints/step-NNNNNN`) belongs to. Nothing is verified here.
pub fn resumed_run(path: &Path) -> Result<PathBuf> {
    if !path.is_dir() {
        bail!(
            "--resume {}: no such run or checkpoint directory",
            path.display()
        );
    }
    if !is_checkpoint_dir(path) {
        return Ok(path.to_path_buf());
    }
    path.parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .with_context(|| format!("{} is not inside <run>/checkpoints/", path.display()))
}

/// `path` is a run directory (its newest checkpoint that verifies, passing over newer ones
/// that do not) or a checkpoint directory (which must verify: naming one says to use that one).
pub fn find_checkpoint(path: &Path) -> Result<Resume> {
    let run = resumed_run(path)?;
    if is_checkpoint_dir(path) {
        let step = checkpoint::verify_checkpoint(path)
            .map_err(|e| {
                anyhow::anyhow!(
                    "--resume {}: this checkpoint cannot be used: {e}; pass --resume {} to go on \
                     from the newest checkpoint of the run that verifies, or name an older \
                     checkpoint",
                    path.display(),
                    run.display()
                )
            })?
            .step;
        return Ok(Resume {
            run,
            checkpoint: path.to_path_buf(),
            step,
            skipped: Vec::new(),
        });
    }
    let fallback = checkpoint::newest_valid(checkpoint::checkpoint_dirs(&run)?);
    match fallback.chosen {
        Some((step, checkpoint)) => Ok(Resume {
            run,
            checkpoint,
            step,
            skipped: fallback.skipped,
        }),
        None if fallback.skipped.is_empty() => bail!(
            "--resume {}: the run has no complete checkpoint yet",
            path.display()
        ),
        None => bail!(
            "--resume {}: no checkpoint of this run can be used ({}); start a new run with \
             another --out",
            path.display(),
            fallback
                .skipped
                .iter()
                .map(|s| format!("{}: {}", s.path.display(), s.reason))
                .collect::<Vec<_>>()
                .join("; ")
        ),
    }
}

/// A checkpoint directory rather than a run directory: it has `trainer.json`, or it is named
/// `step-NNNNNN` (an incomplete checkpoint) and holds no `checkpoints/` of its own.
fn is_checkpoint_dir(path: &Path) -> bool {
    path.join(checkpoint::TRAINER_FILE).is_file()
        || (checkpoint::checkpoint_step(path).is_some()
            && !path.join(checkpoint::CHECKPOINTS_DIR).exists())
}

pub use oobleck_core::runtime::master::truncate_metrics_after;

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use candle_core::{Device, Tensor};
    use oobleck_core::checkpoint::{save_checkpoint, TrainerState};

    use super::*;

    fn save(run: &Path, step: u64) -> PathBuf {
        let w = Tensor::new(&[step as f32, 1.5], &Device::Cpu).expect("tensor");
        let params = BTreeMap::from([("w".to_string(), w)]);
        let trainer = TrainerState {
            step,
            seed: 7,
            data_cursor: serde_json::json!({ "step": step }),
            config: None,
        };
        save_checkpoint(run, &params, &[], &trainer).expect("save")
    }

    fn flip_a_byte(file: &Path) {
        let mut bytes = std::fs::read(file).expect("read");
        bytes[0] ^= 0x01;
        std::fs::write(file, bytes).expect("write");
    }

    #[test]
    fn a_run_resumes_from_its_newest_checkpoint_that_verifies_naming_those_skipped() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let run = tmp.path();
        let two = save(run, 2);
        let four = save(run, 4);
        let six = save(run, 6);
        flip_a_byte(&six.join(checkpoint::MODEL_FILE));
        std::fs::remove_file(four.join(checkpoint::TRAINER_FILE)).expect("remove");

        let found = find_checkpoint(run).expect("falls back");
        assert_eq!((found.run.as_path(), found.step), (run, 2));
        assert_eq!(found.checkpoint, two);
        let skipped: Vec<(&Path, String)> = found
            .skipped
            .iter()
            .map(|s| (s.path.as_path(), s.reason.to_string()))
            .collect();
        assert_eq!(skipped.len(), 2, "{skipped:?}");
        assert_eq!(skipped[0].0, six);
        assert!(
            skipped[0].1.contains("checksum mismatch"),
            "{}",
            skipped[0].1
        );
        assert_eq!(skipped[1].0, four);
        assert!(
            skipped[1].1.contains("trainer.json") && skipped[1].1.contains("missing"),
            "{}",
            skipped[1].1
        );

        // Nothing usable left: refused, naming each one and why.
        flip_a_byte(&two.join(checkpoint::OPTIMIZER_FILE));
        let err = find_checkpoint(run)
            .expect_err("nothing verifies")
            .to_string();
        for path in [&two, &four, &six] {
            assert!(err.contains(&path.display().to_string()), "{err}");
        }
        assert!(err.contains("start a new run"), "{err}");
    }

    #[test]
    fn a_bad_checkpoint_named_explicitly_is_refused_saying_what_to_do() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let run = tmp.path();
        save(run, 2);
        let four = save(run, 4);
        let found = find_checkpoint(&four).expect("a good one is used as named");
        assert_eq!((found.run.as_path(), found.step), (run, 4));

        flip_a_byte(&four.join(checkpoint::MODEL_FILE));
        let err = find_checkpoint(&four).expect_err("corrupt").to_string();
        let fix = format!("pass --resume {} to go on", run.display());
        assert!(
            err.contains("checksum mismatch") && err.contains(&fix),
            "{err}"
        );
        // Without trainer.json it is still a checkpoint directory, not a run directory.
        std::fs::remove_file(four.join(checkpoint::TRAINER_FILE)).expect("remove");
        assert_eq!(resumed_run(&four).expect("its run"), run);
        let err = find_checkpoint(&four).expect_err("incomplete").to_string();
        assert!(err.contains("trainer.json") && err.contains(&fix), "{err}");
    }
}
