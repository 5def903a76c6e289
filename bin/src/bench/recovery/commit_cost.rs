//! What the commit record costs the master per step, timed in the bench process with the real
//! type: [`CommitRecord::write`] (serialise, write `committed.json.tmp`, rename it over
//! `committed.json`), which the master does once before every commit broadcast. The record
//! holds what it holds in a run: the committed step, its generation and the metrics lines not
//! yet in `metrics.jsonl` (here the master run's own last lines, with their per-rank times),
//! written into a scratch directory beside the run directories (the same file system).
//!
//! Timed after the runs, while no `train` runs beside it.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use oobleck_core::runtime::master::{CommitRecord, COMMIT_FILE};
use oobleck_core::runtime::wire::records::StepMetrics;

use super::master::RecordCost;

/// Writes timed.
pub const WRITES: usize = 200;
/// Writes before the timed ones (the directory entry and the page cache warm).
const WARM: usize = 5;
/// Metrics lines in the record, at most: a line waits for its validation loss, or the writer.
pub const LINES: usize = 2;

/// Times [`WRITES`] writes of a record holding the last [`LINES`] of `metrics` (a synthetic
/// line where there are none) in `dir`, which is created and removed.
pub fn measure(dir: &Path, metrics: &[StepMetrics]) -> Result<RecordCost> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let unwritten: Vec<StepMetrics> = match metrics {
        [] => vec![synthetic()],
        m => m[m.len().saturating_sub(LINES)..].to_vec(),
    };
    let mut record = CommitRecord {
        step: unwritten.last().map_or(1, |m| m.step),
        generation: unwritten.last().map_or(0, |m| m.generation),
        unwritten,
    };
    let mut us = Vec::with_capacity(WRITES);
    for i in 0..WARM + WRITES {
        record.step += 1;
        let t = Instant::now();
        record.write(dir).context("writing a commit record")?;
        if i >= WARM {
            us.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let bytes = std::fs::metadata(dir.join(COMMIT_FILE)).map_or(0, |m| m.len());
    let lines = record.unwritten.len();
    std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    Ok(RecordCost::of(&us, lines, bytes))
}

/// A metrics line of the bench's default job, for a run that left none.
fn synthetic() -> StepMetrics {
    serde_json::from_str(
        "{\"step\":1,\"loss\":10.8,\"lr\":0.0003,\"grad_norm\":1.5,\"samples_per_s\":8.0,\
         \"tokens_per_s\":256.0,\"generation\":0,\"pipelines\":2,\"nodes\":4,\"wall_s\":1.0}",
    )
    .expect("a metrics line")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_is_written_timed_and_its_directory_removed() {
        let dir = tempfile::tempdir().unwrap();
        let scratch = dir.path().join("record");
        let r = measure(&scratch, &[]).unwrap();
        assert_eq!((r.writes, r.lines), (WRITES, 1));
        assert!(
            r.bytes > 50 && r.median_us > 0.0 && r.p99_us >= r.median_us,
            "{r:?}"
        );
        assert!(!scratch.exists());
    }
}
