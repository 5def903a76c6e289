//! A rank's state saved to the master: a snapshot in host memory, uploaded as a safetensors
//! file the master assembles into a checkpoint. A periodic save that fails is reported and
//! skipped; the final one is tried again from memory for `--save-wait`.

use std::path::Path;
use std::time::{Duration, Instant};

use candle_core::{Tensor, Var};
use oobleck_comm::send_blob;

use super::inbox::report;
use super::{protocol, state_path, state_path_at};
use crate::optim::AdamW;
use crate::runtime::error::{error_chain, Context, Result, RuntimeError};
use crate::runtime::wire::pipe::WorkerAssignment;
use crate::runtime::wire::records::WorkerReport;

/// The longest a state upload to the master may take.
const UPLOAD_TIMEOUT: Duration = Duration::from_secs(600);
/// The pause before the final save is tried again: doubling from the first, up to the last.
const RETRY_PAUSES: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(10));

/// A copy of a rank's parameters (`param/NAME`) and optimizer state (`opt/ENTRY`) in fresh
/// host memory, so training can go on while it is written: the only stall of a checkpoint.
pub(super) fn snapshot(params: &[(String, Var)], opt: &AdamW) -> Result<Vec<(String, Tensor)>> {
    let mut tensors = Vec::new();
    for (name, var) in params {
        tensors.push((
            format!("param/{name}"),
            var.as_tensor().copy().map_err(crate::Error::from)?,
        ));
    }
    // export_state's tensors are already copies.
    for (name, t) in opt.export_state()? {
        tensors.push((format!("opt/{name}"), t));
    }
    Ok(tensors)
}

/// `tensors` as the bytes of a safetensors file.
fn serialize(a: &WorkerAssignment, tensors: Vec<(String, Tensor)>) -> Result<Vec<u8>> {
    safetensors::tensor::serialize(tensors, None).map_err(|e| {
        RuntimeError::Invalid(format!("serialising the state of rank {}: {e}", a.rank))
    })
}

/// Uploads `bytes` as the file `path` (under the run directory) to the master.
fn upload(a: &WorkerAssignment, bytes: &[u8], path: &Path) -> Result<()> {
    let name = path
        .strip_prefix(&a.run_dir)
        .map_err(|_| {
            protocol(
                a.rank,
                format!("{} is outside the run directory", path.display()),
            )
        })?
        .to_str()
        .ok_or_else(|| protocol(a.rank, format!("{} is not UTF-8", path.display())))?
        .to_string();
    let sink = super::resolve(&a.state_sink)?;
    send_blob(sink, &a.state_key, &name, bytes, UPLOAD_TIMEOUT).with_ctx(|| {
        format!(
            "rank {}: uploading {name} ({:.1} MB) to the master at {sink}",
            a.rank,
            bytes.len() as f64 / 1e6
        )
    })?;
    Ok(())
}

/// Snapshots the state after committed `step` and uploads it on a thread of its own, so the
/// next step starts at once; reports `Saved` once the master has the file, or `SaveFailed`
/// (that checkpoint is skipped, training goes on).
pub(super) fn save_in_background(
    a: &WorkerAssignment,
    params: &[(String, Var)],
    opt: &AdamW,
    step: u64,
) -> Result<()> {
    let started = Instant::now();
    let tensors = snapshot(params, opt)?;
    let stall_ms = started.elapsed().as_secs_f64() * 1e3;
    let a = a.clone();
    std::thread::spawn(move || {
        let path = state_path_at(&a.run_dir, step, a.rank);
        let bytes = match serialize(&a, tensors) {
            Ok(b) => b,
            Err(e) => return failed(&a, step, 0, &e, false),
        };
        let saved = upload(&a, &bytes, &path).and_then(|()| {
            report(
                a.generation,
                &WorkerReport::Saved {
                    rank: a.rank,
                    step,
                    state: path.display().to_string(),
                    stall_ms,
                },
            )
        });
        if let Err(e) = saved {
            failed(&a, step, bytes.len() as u64, &e, false);
        }
    });
    Ok(())
}

/// Uploads the final state (after `step`), trying again from memory while `--save-wait`
/// lasts; every failure is reported. The state's path, or `None` once the job gave it up.
pub(super) fn save_final(
    a: &WorkerAssignment,
    tensors: Vec<(String, Tensor)>,
    step: u64,
) -> Result<Option<String>> {
    let path = state_path(&a.run_dir, a.rank);
    let bytes = serialize(a, tensors)?;
    let deadline = Instant::now() + Duration::from_secs(a.job.save_wait_s);
    let mut pause = RETRY_PAUSES.0;
    loop {
        let e = match upload(a, &bytes, &path) {
            Ok(()) => return Ok(Some(path.display().to_string())),
            Err(e) => e,
        };
        let retrying = Instant::now() + pause < deadline;
        failed(a, step, bytes.len() as u64, &e, retrying);
        if !retrying {
            return Ok(None);
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(RETRY_PAUSES.1);
    }
}

/// Tells the master that the state after `step` did not reach it (the agent's pipe is the
/// only way; if it is gone too, the worker's stderr is).
fn failed(a: &WorkerAssignment, step: u64, bytes: u64, e: &RuntimeError, retrying: bool) {
    let r = WorkerReport::SaveFailed {
        rank: a.rank,
        step,
        bytes,
        error: error_chain(e).join(": "),
        retrying,
    };
    if let Err(pipe) = report(a.generation, &r) {
        eprintln!("oobleck worker: the state of step {step} was not saved: {e} ({pipe})");
    }
}
