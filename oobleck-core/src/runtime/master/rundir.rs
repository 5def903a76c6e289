//! The files a job writes in its run directory as it goes: `events.jsonl`, `metrics.jsonl`
//! (in step order, a line waiting for its validation loss holding back the ones after it)
//! and `plan.json` (every plan of the run, one per generation).

use std::collections::VecDeque;
use std::io::Write;
use std::path::{Path, PathBuf};

use super::commits::CommitRecord;
use crate::checkpoint::{checkpoint_dirs, checkpoint_step, load_checkpoint, newest_valid};
use crate::planning::Plan;
use crate::runtime::error::{Context, Result};
use crate::runtime::job::Input;
use crate::runtime::wire::pipe::StateSource;
use crate::runtime::wire::records::{Event, StepMetrics};

/// Reads the checkpoint `source` starts from, if any, before any worker is told to: a partial
/// or corrupted one is refused, with the newest older checkpoint of `run_dir` that verifies
/// (the same choice as `--resume` of a run directory makes).
pub(super) fn refuse_checkpoint(run_dir: &Path, source: &StateSource) -> Option<Input> {
    let StateSource::Checkpoint { path } = source else {
        return None;
    };
    let reason = match load_checkpoint(path, &candle_core::Device::Cpu) {
        Ok(_) => return None,
        Err(e) => e.to_string(),
    };
    let bad_step = checkpoint_step(path);
    let mut candidates = checkpoint_dirs(run_dir).unwrap_or_default();
    candidates.retain(|(s, p)| p != path && bad_step.is_none_or(|b| *s < b));
    let fallback = newest_valid(candidates);
    for skipped in &fallback.skipped {
        tracing::warn!(
            path = %skipped.path.display(),
            reason = %skipped.reason,
            "checkpoint skipped on fallback: it does not verify"
        );
    }
    let instead = fallback.chosen.map(|(s, p)| (p.display().to_string(), s));
    Some(Input::CheckpointRefused {
        path: path.display().to_string(),
        reason,
        instead,
    })
}

pub(super) struct RunFiles {
    dir: PathBuf,
    events: std::fs::File,
    metrics: std::fs::File,
    /// Metrics lines not written yet, and whether each still waits for its validation loss.
    held: VecDeque<(StepMetrics, bool)>,
    /// Every plan of the run directory so far, earlier runs' included.
    plans: Vec<serde_json::Value>,
}

fn append(path: &Path) -> Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_ctx(|| format!("opening {}", path.display()))
}

impl RunFiles {
    pub fn open(dir: &Path, plans: Vec<serde_json::Value>) -> Result<RunFiles> {
        Ok(RunFiles {
            dir: dir.to_path_buf(),
            events: append(&dir.join("events.jsonl"))?,
            metrics: append(&dir.join("metrics.jsonl"))?,
            held: VecDeque::new(),
            plans,
        })
    }

    /// The run directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn event(&mut self, e: &Event) -> Result<()> {
        let line = serde_json::to_string(e).ctx("encoding an event")?;
        writeln!(self.events, "{line}").ctx("writing events.jsonl")
    }

    /// Appends `plan` to `plan.json`.
    pub fn plan(&mut self, plan: &Plan) -> Result<()> {
        self.plans
            .push(serde_json::to_value(plan).ctx("encoding the plan")?);
        let text = serde_json::to_string_pretty(&self.plans).ctx("encoding plan.json")?;
        std::fs::write(self.dir.join("plan.json"), text).ctx("writing plan.json")
    }

    /// Records that `m.step` is committed, with every metrics line not yet written
    /// ([`CommitRecord`]): before any agent is told.
    pub fn record_commit(&mut self, m: &StepMetrics) -> Result<()> {
        let unwritten = self.held.iter().map(|(h, _)| h.clone());
        CommitRecord {
            step: m.step,
            generation: m.generation,
            unwritten: unwritten.chain(std::iter::once(m.clone())).collect(),
        }
        .write(&self.dir)
    }

    /// A committed step's metrics; with `wait`, held until its validation loss comes.
    pub fn metrics(&mut self, m: StepMetrics, wait: bool) -> Result<()> {
        self.held.push_back((m, wait));
        self.flush()
    }

    pub fn val_loss(&mut self, step: u64, v: f64) -> Result<()> {
        if let Some((m, waiting)) = self.held.iter_mut().find(|(m, _)| m.step == step) {
            m.val_loss = Some(v);
            *waiting = false;
        }
        self.flush()
    }

    /// `step`'s validation loss will not come (its state was not saved): its line is written
    /// without one.
    pub fn no_val_loss(&mut self, step: u64) -> Result<()> {
        if let Some((_, waiting)) = self.held.iter_mut().find(|(m, _)| m.step == step) {
            *waiting = false;
        }
        self.flush()
    }

    /// Writes every held line without waiting any more; the steps whose validation loss was
    /// still awaited.
    pub fn release(&mut self) -> Result<Vec<u64>> {
        let mut unmet = Vec::new();
        for (m, waiting) in self.held.iter_mut() {
            if *waiting {
                unmet.push(m.step);
            }
            *waiting = false;
        }
        self.flush()?;
        Ok(unmet)
    }

    /// Writes the lines that wait for nothing, in step order.
    fn flush(&mut self) -> Result<()> {
        while self.held.front().is_some_and(|(_, waiting)| !waiting) {
            let (m, _) = self.held.pop_front().expect("checked");
            let line = serde_json::to_string(&m).ctx("encoding metrics")?;
            writeln!(self.metrics, "{line}").ctx("writing metrics.jsonl")?;
        }
        Ok(())
    }

    /// Drops the metrics after `step` (those steps are computed again).
    pub fn truncate_after(&mut self, step: u64) -> Result<()> {
        self.held.retain(|(m, _)| m.step <= step);
        self.flush()?;
        truncate_metrics_after(&self.dir, step)?;
        CommitRecord::rewind(&self.dir, step)?;
        self.metrics = append(&self.dir.join("metrics.jsonl"))?;
        Ok(())
    }
}

/// The first node id a master restarted on `run` may give a new agent: past every id its
/// plans and `events.jsonl` name (ids are never reused within a run).
pub(super) fn next_node_id(run: &Path, plans: &[Plan]) -> u32 {
    let events = std::fs::read_to_string(run.join("events.jsonl")).unwrap_or_default();
    let in_events = events
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["node"].as_u64())
        .filter_map(|n| u32::try_from(n).ok());
    let in_plans = plans.iter().flat_map(|p| p.nodes());
    in_events.chain(in_plans).max().map_or(0, |n| n + 1)
}

/// The epoch of a master starting on `run`: one more than the last master's
/// (`master.epoch`, 0 when there was none), written before it listens, so that a master
/// restarted on the run (or a standby's copy of it) is always of a higher epoch than every
/// master before it.
pub(super) fn next_epoch(run: &Path) -> Result<u64> {
    let path = run.join("master.epoch");
    let last = match std::fs::read_to_string(&path) {
        Ok(t) => t.trim().parse::<u64>().map_err(|e| {
            crate::runtime::error::RuntimeError::Invalid(format!(
                "{}: {:?} is not an epoch ({e}); it is written by the master, so remove it only \
                 if no master of this run runs",
                path.display(),
                t.trim()
            ))
        })?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        Err(e) => return Err(e).with_ctx(|| format!("reading {}", path.display())),
    };
    let epoch = last + 1;
    std::fs::write(&path, format!("{epoch}\n"))
        .with_ctx(|| format!("writing {}", path.display()))?;
    Ok(epoch)
}

/// The file of the run directory that names where the master's standbys take over, so that
/// `oobleck status --run` (and `drain`, `kill-node`, ...) finds the master that took over when
/// the one in `master.json` is gone.
pub const STANDBYS_FILE: &str = "standbys.json";

/// Writes [`STANDBYS_FILE`] (`{"standbys": [addr, ...]}`) whole, by a rename.
pub(super) fn write_standbys(run: &Path, addrs: &[String]) -> Result<()> {
    let path = run.join(STANDBYS_FILE);
    let tmp = run.join(format!("{STANDBYS_FILE}.tmp"));
    let body = serde_json::json!({ "standbys": addrs }).to_string();
    std::fs::write(&tmp, body).with_ctx(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_ctx(|| format!("writing {}", path.display()))
}

/// Keeps the lines of `<run>/metrics.jsonl` up to `step`.
pub fn truncate_metrics_after(run: &Path, step: u64) -> Result<()> {
    let path = run.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_some_and(|s| s <= step)
        })
        .collect();
    let mut body = kept.join("\n");
    if !body.is_empty() {
        body.push('\n');
    }
    std::fs::write(&path, body).with_ctx(|| format!("rewriting {}", path.display()))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use candle_core::{Device, Tensor};

    use super::*;
    use crate::checkpoint::{save_checkpoint, TrainerState};

    fn checkpoint(dir: &Path, step: u64) -> PathBuf {
        let mut params = BTreeMap::new();
        let w = Tensor::new(&[step as f32, 2.0], &Device::Cpu).expect("tensor");
        params.insert("w".to_string(), w);
        let trainer = TrainerState {
            step,
            seed: 7,
            data_cursor: serde_json::json!({ "step": step }),
            config: None,
        };
        save_checkpoint(dir, &params, &[], &trainer).expect("save")
    }

    fn written_steps(dir: &Path) -> Vec<(u64, Option<f64>)> {
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .expect("metrics.jsonl")
            .lines()
            .map(|l| {
                let m: StepMetrics = serde_json::from_str(l).expect("a metrics line");
                (m.step, m.val_loss)
            })
            .collect()
    }

    #[test]
    fn a_line_waiting_for_a_validation_loss_that_never_comes_is_written_at_release() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut files = RunFiles::open(dir.path(), Vec::new()).expect("open");
        files
            .metrics(super::super::commits::tests::line(1), false)
            .expect("1");
        files
            .metrics(super::super::commits::tests::line(2), true)
            .expect("2 waits");
        files
            .metrics(super::super::commits::tests::line(3), false)
            .expect("3");
        files
            .metrics(super::super::commits::tests::line(4), true)
            .expect("4 waits");
        assert_eq!(written_steps(dir.path()), vec![(1, None)], "held in order");
        files.val_loss(4, 2.5).expect("4's loss");
        assert_eq!(written_steps(dir.path()), vec![(1, None)], "2 still waits");
        assert_eq!(files.release().expect("release"), vec![2]);
        assert_eq!(
            written_steps(dir.path()),
            vec![(1, None), (2, None), (3, None), (4, Some(2.5))]
        );
        assert_eq!(files.release().expect("again"), Vec::<u64>::new());
    }

    #[test]
    fn a_corrupted_fallback_checkpoint_is_refused_for_the_newest_older_one_that_reads() {
        let dir = tempfile::tempdir().expect("tempdir");
        let two = checkpoint(dir.path(), 2);
        let four = checkpoint(dir.path(), 4);
        let six = checkpoint(dir.path(), 6);
        let fine = StateSource::Checkpoint { path: six.clone() };
        assert!(refuse_checkpoint(dir.path(), &fine).is_none());
        assert!(refuse_checkpoint(dir.path(), &StateSource::Init).is_none());
        // Step 6 cut short (a partial write), step 4 with a flipped byte: step 2 it is.
        let model = six.join("model.safetensors");
        let len = std::fs::metadata(&model).expect("model").len();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&model)
            .expect("open");
        f.set_len(len / 2).expect("truncate");
        let m4 = four.join("model.safetensors");
        let mut bytes = std::fs::read(&m4).expect("read");
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&m4, bytes).expect("write");
        let Some(Input::CheckpointRefused {
            path,
            reason,
            instead,
        }) = refuse_checkpoint(dir.path(), &StateSource::Checkpoint { path: six.clone() })
        else {
            panic!("a truncated checkpoint was accepted");
        };
        assert_eq!(path, six.display().to_string());
        assert!(!reason.is_empty());
        assert_eq!(instead, Some((two.display().to_string(), 2)));
    }
}
