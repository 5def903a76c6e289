//! The commit record, `committed.json` in the run directory: the last committed step and the
//! metrics lines not yet in `metrics.jsonl` (held for a validation loss, or not written yet).
//! The master rewrites it (a new file renamed over the old) **before** it tells any agent that
//! a step is committed, so a master restarted on the run directory (`--reattach`) knows every
//! step an agent may have applied: an agent is at most one commit behind the record, never
//! ahead of it, and `metrics.jsonl` gets every committed step once.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::runtime::error::{Context, Result, RuntimeError};
use crate::runtime::wire::records::StepMetrics;

/// The file's name in the run directory.
pub const COMMIT_FILE: &str = "committed.json";

/// What `committed.json` holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommitRecord {
    /// The last committed step.
    pub step: u64,
    /// The generation that committed it.
    pub generation: u64,
    /// Committed steps whose metrics lines were not written to `metrics.jsonl` yet, in step
    /// order.
    pub unwritten: Vec<StepMetrics>,
}

impl CommitRecord {
    /// Replaces the run directory's record with this one.
    pub fn write(&self, run: &Path) -> Result<()> {
        let path = run.join(COMMIT_FILE);
        let tmp = run.join(format!("{COMMIT_FILE}.tmp"));
        let text = serde_json::to_vec(self).ctx("encoding the commit record")?;
        std::fs::write(&tmp, text).with_ctx(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_ctx(|| format!("replacing {}", path.display()))
    }

    /// The run directory's record; `None` when there is none (a run that committed nothing,
    /// or one written before the record existed).
    pub fn read(run: &Path) -> Result<Option<CommitRecord>> {
        let path = run.join(COMMIT_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(RuntimeError::Io { path, source }),
        };
        serde_json::from_str(&text).map(Some).map_err(|e| {
            RuntimeError::Invalid(format!(
                "{}: not a commit record ({e}); it is rewritten at every commit, so a damaged \
                 one means the run directory was changed by hand",
                path.display()
            ))
        })
    }

    /// Steps after `step` are computed again: the record goes back to it.
    pub fn rewind(run: &Path, step: u64) -> Result<()> {
        let Some(mut r) = CommitRecord::read(run)? else {
            return Ok(());
        };
        if r.step <= step {
            return Ok(());
        }
        r.step = step;
        r.unwritten.retain(|m| m.step <= step);
        r.write(run)
    }

    /// The run's last committed step: its record's, else (a run written before the record
    /// existed) the last line of `metrics.jsonl`.
    pub fn committed_step(run: &Path) -> Result<u64> {
        Ok(match CommitRecord::read(run)? {
            Some(record) => record.step,
            None => last_step_in(&read_metrics(run)),
        })
    }

    /// Appends to `metrics.jsonl` the lines of this record past its last line: the steps the
    /// lost master committed and had not written. Returns how many.
    pub fn complete_metrics(&self, run: &Path) -> Result<usize> {
        use std::io::Write;
        let path = run.join("metrics.jsonl");
        let text = read_metrics(run);
        let last = last_step_in(&text);
        let missing: Vec<&StepMetrics> = self.unwritten.iter().filter(|m| m.step > last).collect();
        if missing.is_empty() {
            return Ok(0);
        }
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_ctx(|| format!("opening {}", path.display()))?;
        if !text.is_empty() && !text.ends_with('\n') {
            // A line the lost master was writing when it died: ended, so the next one is whole.
            writeln!(f).ctx("writing metrics.jsonl")?;
        }
        for m in &missing {
            let line = serde_json::to_string(m).ctx("encoding metrics")?;
            writeln!(f, "{line}").ctx("writing metrics.jsonl")?;
        }
        Ok(missing.len())
    }
}

/// `metrics.jsonl` of `run` (empty when there is none).
fn read_metrics(run: &Path) -> String {
    std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_default()
}

/// The highest step of the lines of a `metrics.jsonl` (0 for none).
fn last_step_in(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["step"].as_u64())
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A metrics line of `step` (also the run directory's tests').
    pub(in crate::runtime::master) fn line(step: u64) -> StepMetrics {
        StepMetrics {
            step,
            loss: 5.0 - step as f64 * 0.1,
            lr: 0.1,
            grad_norm: 0.5,
            samples_per_s: 1.0,
            tokens_per_s: 1.0,
            generation: 0,
            pipelines: 1,
            nodes: 2,
            wall_s: step as f64,
            val_loss: None,
            microbatches: String::new(),
            times: Default::default(),
            data: None,
        }
    }

    fn steps_in_metrics(run: &Path) -> Vec<u64> {
        std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|l| {
                serde_json::from_str::<StepMetrics>(l)
                    .expect("a metrics line")
                    .step
            })
            .collect()
    }

    #[test]
    fn the_lines_a_lost_master_had_not_written_are_written_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let run = dir.path();
        let mut text = String::new();
        for s in 1..=3 {
            text.push_str(&serde_json::to_string(&line(s)).expect("json"));
            text.push('\n');
        }
        std::fs::write(run.join("metrics.jsonl"), text).expect("metrics");
        // Step 3 was written, 4 and 5 were held (4 for its validation loss) when it died.
        let r = CommitRecord {
            step: 5,
            generation: 2,
            unwritten: vec![line(3), line(4), line(5)],
        };
        r.write(run).expect("write");
        let back = CommitRecord::read(run).expect("read").expect("a record");
        assert_eq!(back, r);
        assert_eq!(back.complete_metrics(run).expect("complete"), 2);
        assert_eq!(steps_in_metrics(run), vec![1, 2, 3, 4, 5]);
        // Done twice, nothing more is written.
        assert_eq!(back.complete_metrics(run).expect("complete"), 0);
        assert_eq!(steps_in_metrics(run), vec![1, 2, 3, 4, 5]);
    }

    #[test]
    fn a_line_cut_short_by_the_crash_does_not_swallow_the_next() {
        let dir = tempfile::tempdir().expect("tempdir");
        let run = dir.path();
        let whole = serde_json::to_string(&line(1)).expect("json");
        std::fs::write(
            run.join("metrics.jsonl"),
            format!("{whole}\n{{\"step\":2,\"lo"),
        )
        .unwrap();
        let r = CommitRecord {
            step: 2,
            generation: 0,
            unwritten: vec![line(2)],
        };
        assert_eq!(r.complete_metrics(run).expect("complete"), 1);
        let text = std::fs::read_to_string(run.join("metrics.jsonl")).expect("metrics");
        let last = text.lines().last().expect("a line");
        assert_eq!(
            serde_json::from_str::<StepMetrics>(last)
                .expect("whole")
                .step,
            2
        );
    }

    #[test]
    fn a_rewind_forgets_the_steps_computed_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let run = dir.path();
        CommitRecord::rewind(run, 3).expect("no record: nothing to do");
        assert!(CommitRecord::read(run).expect("read").is_none());
        let r = CommitRecord {
            step: 6,
            generation: 1,
            unwritten: vec![line(4), line(5), line(6)],
        };
        r.write(run).expect("write");
        CommitRecord::rewind(run, 4).expect("rewind");
        let back = CommitRecord::read(run).expect("read").expect("a record");
        assert_eq!(back.step, 4);
        assert_eq!(back.unwritten, vec![line(4)]);
    }

    #[test]
    fn a_damaged_record_is_an_error_that_says_so() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(COMMIT_FILE), "{\"step\": 3").expect("write");
        let e = CommitRecord::read(dir.path()).expect_err("damaged");
        assert!(e.to_string().contains("not a commit record"), "{e}");
    }
}
