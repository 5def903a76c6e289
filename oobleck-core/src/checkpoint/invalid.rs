//! Checkpoints that do not verify: a flipped byte, a truncated or missing file, a
//! `trainer.json` that is missing, garbled or of another format version.
//!
//! Such a directory must neither stop a resume (the newest one that verifies is used instead,
//! and the ones passed over are named with why: [`newest_valid`]) nor a run that reaches its
//! step again (the save renames it to `step-NNNNNN.invalid-<unix seconds>` and goes on). The
//! moved-aside name does not parse as a step, so no reader or prune sees it again; it is kept
//! for a human to look at, never deleted here.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::{io_err, sync_dir, verify_checkpoint};
use crate::{Error, Result};

/// A checkpoint directory that cannot be used, and why.
#[derive(Debug)]
pub struct Invalid {
    pub step: u64,
    pub path: PathBuf,
    /// What [`verify_checkpoint`] found wrong; it names the file.
    pub reason: Error,
}

/// Where to go on from: the checkpoint chosen, if any, and the newer ones passed over.
#[derive(Debug, Default)]
pub struct Fallback {
    pub chosen: Option<(u64, PathBuf)>,
    /// Newest first.
    pub skipped: Vec<Invalid>,
}

/// The newest of `candidates` (`(step, directory)`, in any order; e.g. [`super::checkpoint_dirs`])
/// that verifies: format version, sizes and checksums, streamed, without loading tensors. The
/// ones newer than it are returned as skipped, each with its reason. Any error counts against
/// a candidate (an unreadable file makes it as unusable as a corrupt one), so this never fails.
pub fn newest_valid(mut candidates: Vec<(u64, PathBuf)>) -> Fallback {
    candidates.sort();
    let mut fallback = Fallback::default();
    while let Some((step, path)) = candidates.pop() {
        match verify_checkpoint(&path) {
            Ok(_) => {
                fallback.chosen = Some((step, path));
                break;
            }
            Err(reason) => fallback.skipped.push(Invalid { step, path, reason }),
        }
    }
    fallback
}

/// Called before saving over `path`, which exists: a valid checkpoint stays and the save is
/// refused ([`Error::CheckpointExists`]); one that verifiably is not (incomplete or corrupt)
/// is renamed aside with a warning, so the save can go on. Anything else (a plain file there,
/// an I/O error while checking) refuses too, since it proves nothing about the checkpoint.
pub(super) fn move_aside_if_invalid(path: &Path) -> Result<()> {
    let exists = || Error::CheckpointExists {
        path: path.to_path_buf(),
    };
    if !path.is_dir() {
        return Err(exists());
    }
    let reason = match verify_checkpoint(path) {
        Ok(_) => return Err(exists()),
        Err(e @ (Error::CorruptCheckpoint { .. } | Error::Checksum { .. })) => e,
        Err(e) => return Err(e),
    };
    let aside = aside_path(path);
    fs::rename(path, &aside).map_err(|e| io_err(path, e))?;
    if let Some(parent) = path.parent() {
        sync_dir(parent)?;
    }
    tracing::warn!(
        path = %path.display(),
        moved_to = %aside.display(),
        reason = %reason,
        "an invalid checkpoint was in the way of a save: moved it aside (kept for inspection)"
    );
    Ok(())
}

/// `step-NNNNNN.invalid-<unix seconds>` beside `path`, with `-2`, `-3`... appended if a
/// checkpoint of the same step was already moved aside in the same second.
fn aside_path(path: &Path) -> PathBuf {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let name = path
        .file_name()
        .map_or_else(|| "checkpoint".into(), |n| n.to_string_lossy());
    let base = path.with_file_name(format!("{name}.invalid-{secs}"));
    let mut candidate = base.clone();
    let mut n = 1;
    while candidate.exists() {
        n += 1;
        candidate = base.with_file_name(format!("{name}.invalid-{secs}-{n}"));
    }
    candidate
}
