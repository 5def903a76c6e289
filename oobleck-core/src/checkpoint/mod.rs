//! Checkpoints: safetensors + JSON, written atomically, checksummed, verified on load.
//!
//! Layout under a run's output directory (DESIGN.md section 6):
//!
//! ```text
//! <out>/checkpoints/
//!     step-000120/                  complete checkpoints only, under their final name
//!         model.safetensors         parameters, named as the caller names them (HF layout)
//!         optimizer.safetensors     AdamW state: <param>.exp_avg, <param>.exp_avg_sq, <param>.step
//!         trainer.json              format_version, step, seed, data_cursor, config, and the
//!                                   byte size + sha256 of both safetensors files
//!         config.json, ...          optional files of the caller (e.g. the HF config, so
//!                                   `from_pretrained(dir)` works); not read back here
//!     .tmp-step-000140-<pid>-<n>/   a save in progress (or a crashed one): never read
//!     step-000100.invalid-<secs>/   a checkpoint that did not verify, moved aside by the save
//!                                   of its step (kept for a human to look at; never read)
//! ```
//!
//! Contract:
//! - **Atomic.** [`save_checkpoint`] writes every file into a temporary sibling directory,
//!   fsyncs each file and the directory, renames the directory to `step-NNNNNN` and fsyncs
//!   `checkpoints/`. A crash leaves either no checkpoint for that step or a complete one; a
//!   leftover temporary directory is ignored by every reader ([`remove_stale_temp_dirs`] clears
//!   them when no save is running).
//! - **No silent overwrite.** Saving a step that already has a valid checkpoint fails with
//!   [`Error::CheckpointExists`] and leaves the existing one untouched. (Linux `rename` could
//!   replace an *empty* directory created between our check and the rename; it cannot replace a
//!   non-empty one, so a complete checkpoint is never lost.) One that does not verify
//!   (incomplete or corrupt) is renamed to `step-NNNNNN.invalid-<unix seconds>` with a warning
//!   and the save goes on, so a bad checkpoint never blocks a run that replays its step
//!   ([`invalid`]).
//! - **Verified.** [`load_checkpoint`] checks the format version first, then each file's size
//!   (a short file is reported as truncated) and sha256 (a mismatch names the file with expected
//!   and actual digests) before parsing any tensor.
//! - **Deterministic.** Tensors are stored by name (safetensors orders its header itself), the
//!   optimizer state is returned sorted by name, so the same state gives the same bytes and
//!   checksums in every process.
//!
//! Step numbers are zero-padded to six digits for readability; readers parse the number, so
//! step 1000000 sorts after step 999999.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{Error, Result};

mod invalid;
pub mod space;

pub use invalid::{newest_valid, Fallback, Invalid};

/// Version of the on-disk layout written by this build; loads of any other version fail.
pub const FORMAT_VERSION: u32 = 1;
/// Directory under a run's output directory that holds the checkpoints.
pub const CHECKPOINTS_DIR: &str = "checkpoints";
pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const TRAINER_FILE: &str = "trainer.json";
const TEMP_PREFIX: &str = ".tmp-";

/// What the trainer needs besides tensors to continue exactly where it stopped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Number of committed optimizer steps the checkpointed parameters include.
    pub step: u64,
    /// Seed of the run (data order and dropout derive from it).
    pub seed: u64,
    /// Where the data stream continues; opaque to this module.
    pub data_cursor: serde_json::Value,
    /// Optional echo of the resolved run configuration, for humans and for resume checks.
    pub config: Option<serde_json::Value>,
}

/// Size and digest of one file of a checkpoint, as recorded in `trainer.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileDigest {
    pub bytes: u64,
    pub sha256: String,
}

/// `trainer.json` as stored.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct TrainerFile {
    format_version: u32,
    step: u64,
    seed: u64,
    data_cursor: serde_json::Value,
    #[serde(default)]
    config: Option<serde_json::Value>,
    /// File name -> digest; exactly [`MODEL_FILE`] and [`OPTIMIZER_FILE`].
    files: BTreeMap<String, FileDigest>,
}

/// A loaded, verified checkpoint.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub path: PathBuf,
    pub trainer: TrainerState,
    pub params: BTreeMap<String, Tensor>,
    /// Optimizer state sorted by entry name, ready for `optim::AdamW::import_state`.
    pub optimizer: Vec<(String, Tensor)>,
}

/// `<out_dir>/checkpoints/step-NNNNNN`.
pub fn checkpoint_path(out_dir: &Path, step: u64) -> PathBuf {
    out_dir
        .join(CHECKPOINTS_DIR)
        .join(format!("step-{step:06}"))
}

/// Writes a checkpoint of `trainer.step` atomically and returns its final path.
pub fn save_checkpoint(
    out_dir: &Path,
    params: &BTreeMap<String, Tensor>,
    optimizer_state: &[(String, Tensor)],
    trainer: &TrainerState,
) -> Result<PathBuf> {
    save_checkpoint_with(out_dir, params, optimizer_state, trainer, &[])
}

/// [`save_checkpoint`] with extra files `(name, bytes)` written into the checkpoint before it
/// is renamed into place, so they appear with it or not at all. Their names must be plain file
/// names other than the checkpoint's own; they are not checksummed (loading never reads them).
pub fn save_checkpoint_with(
    out_dir: &Path,
    params: &BTreeMap<String, Tensor>,
    optimizer_state: &[(String, Tensor)],
    trainer: &TrainerState,
    extra_files: &[(&str, Vec<u8>)],
) -> Result<PathBuf> {
    let final_path = checkpoint_path(out_dir, trainer.step);
    if final_path.exists() {
        invalid::move_aside_if_invalid(&final_path)?;
    }
    let model = named_map(params.iter(), MODEL_FILE)?;
    let optimizer = named_map(optimizer_state.iter().map(|(n, t)| (n, t)), OPTIMIZER_FILE)?;
    for (name, _) in extra_files {
        check_extra_name(&final_path, name)?;
    }

    let parent = out_dir.join(CHECKPOINTS_DIR);
    if !parent.is_dir() {
        fs::create_dir_all(&parent).map_err(|e| io_err(&parent, e))?;
        sync_dir(out_dir)?;
    }
    let temp = parent.join(temp_name("step", trainer.step));
    fs::create_dir(&temp).map_err(|e| io_err(&temp, e))?;
    let written = write_extra_files(&temp, extra_files)
        .and_then(|()| write_contents(&temp, &model, &optimizer, trainer))
        .and_then(|()| {
            if final_path.exists() {
                return Err(Error::CheckpointExists {
                    path: final_path.clone(),
                });
            }
            fs::rename(&temp, &final_path).map_err(|e| io_err(&final_path, e))?;
            sync_dir(&parent)
        });
    if let Err(e) = written {
        // Best effort: the directory is ignored by readers either way.
        if let Err(rm) = fs::remove_dir_all(&temp) {
            tracing::warn!(path = %temp.display(), error = %rm, "could not remove temporary checkpoint");
        }
        return Err(e);
    }
    tracing::info!(step = trainer.step, path = %final_path.display(), "checkpoint written");
    Ok(final_path)
}

/// A caller's extra file must be a plain name that does not shadow a checkpoint file.
fn check_extra_name(checkpoint: &Path, name: &str) -> Result<()> {
    let plain = Path::new(name).file_name().and_then(|n| n.to_str()) == Some(name);
    let reserved = [MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE].contains(&name);
    if plain && !reserved && !name.starts_with(TEMP_PREFIX) {
        return Ok(());
    }
    Err(Error::ExtraFileName {
        checkpoint: checkpoint.to_path_buf(),
        name: name.to_string(),
    })
}

/// Writes and fsyncs the caller's extra files (the directory is synced with the rest).
fn write_extra_files(dir: &Path, files: &[(&str, Vec<u8>)]) -> Result<()> {
    for (name, bytes) in files {
        write_synced(&dir.join(name), bytes)?;
    }
    Ok(())
}

/// Creates `path` holding `bytes`, fsynced.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut file = File::create(path).map_err(|e| io_err(path, e))?;
    file.write_all(bytes).map_err(|e| io_err(path, e))?;
    file.sync_all().map_err(|e| io_err(path, e))
}

fn write_contents(
    dir: &Path,
    model: &HashMap<&str, Tensor>,
    optimizer: &HashMap<&str, Tensor>,
    trainer: &TrainerState,
) -> Result<()> {
    let mut files = BTreeMap::new();
    for (name, tensors) in [(MODEL_FILE, model), (OPTIMIZER_FILE, optimizer)] {
        let path = dir.join(name);
        candle_core::safetensors::save(tensors, &path).map_err(|e| match e {
            // A full disk names the file it could not write.
            candle_core::Error::Io(io) => io_err(&path, io),
            e => Error::from(e),
        })?;
        // Hash what was written and make it durable in the same pass.
        let file = File::open(&path).map_err(|e| io_err(&path, e))?;
        let digest = digest_reader(&path, &file)?;
        file.sync_all().map_err(|e| io_err(&path, e))?;
        files.insert(name.to_string(), digest);
    }
    let doc = TrainerFile {
        format_version: FORMAT_VERSION,
        step: trainer.step,
        seed: trainer.seed,
        data_cursor: trainer.data_cursor.clone(),
        config: trainer.config.clone(),
        files,
    };
    let path = dir.join(TRAINER_FILE);
    let json = serde_json::to_vec_pretty(&doc).map_err(|source| Error::Encode {
        path: path.clone(),
        source,
    })?;
    write_synced(&path, &json)?;
    sync_dir(dir)
}

/// Loads a checkpoint directory onto `device`, verifying format version, sizes and checksums
/// before any tensor is parsed.
pub fn load_checkpoint(path: &Path, device: &Device) -> Result<Checkpoint> {
    let doc = read_trainer_file(path)?;
    let mut loaded = Vec::with_capacity(2);
    for name in [MODEL_FILE, OPTIMIZER_FILE] {
        let file = path.join(name);
        let bytes = read_file(&file)?;
        check_digest(&file, &doc.files[name], bytes.len() as u64, || {
            Ok(hex::encode(Sha256::digest(&bytes)))
        })?;
        let tensors = candle_core::safetensors::load_buffer(&bytes, device).map_err(|e| {
            Error::CorruptCheckpoint {
                path: file.clone(),
                reason: format!("checksum matches but the safetensors data is unreadable: {e}"),
            }
        })?;
        loaded.push(tensors);
    }
    let optimizer = loaded.pop().unwrap_or_default();
    let params = loaded.pop().unwrap_or_default();
    let mut optimizer: Vec<(String, Tensor)> = optimizer.into_iter().collect();
    optimizer.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(Checkpoint {
        path: path.to_path_buf(),
        trainer: TrainerState {
            step: doc.step,
            seed: doc.seed,
            data_cursor: doc.data_cursor,
            config: doc.config,
        },
        params: params.into_iter().collect(),
        optimizer,
    })
}

/// Checks a checkpoint's format version, file sizes and checksums without loading tensors
/// (streaming the files), and returns its trainer state.
pub fn verify_checkpoint(path: &Path) -> Result<TrainerState> {
    let doc = read_trainer_file(path)?;
    for name in [MODEL_FILE, OPTIMIZER_FILE] {
        let file = path.join(name);
        let len = fs::metadata(&file)
            .map_err(|e| missing_or_io(&file, e))?
            .len();
        check_digest(&file, &doc.files[name], len, || sha256_file(&file))?;
    }
    Ok(TrainerState {
        step: doc.step,
        seed: doc.seed,
        data_cursor: doc.data_cursor,
        config: doc.config,
    })
}

/// Hex sha256 of a file's contents, streamed.
pub fn sha256_file(path: &Path) -> Result<String> {
    let file = File::open(path).map_err(|e| missing_or_io(path, e))?;
    Ok(digest_reader(path, &file)?.sha256)
}

/// Complete checkpoints under `<out_dir>/checkpoints`, sorted by step. Temporary directories,
/// moved-aside ones, stray files and directories without `trainer.json` are ignored.
pub fn list_checkpoints(out_dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut found = checkpoint_dirs(out_dir)?;
    found.retain(|(_, path)| path.join(TRAINER_FILE).is_file());
    Ok(found)
}

/// Every directory under `<out_dir>/checkpoints` named `step-NNNNNN`, complete or not (one
/// without `trainer.json` is an incomplete checkpoint, not a stray), sorted by step.
pub fn checkpoint_dirs(out_dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let parent = out_dir.join(CHECKPOINTS_DIR);
    let entries = match fs::read_dir(&parent) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(&parent, e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| io_err(&parent, e))?;
        let path = entry.path();
        if let Some(step) = checkpoint_step(&path) {
            if path.is_dir() {
                found.push((step, path));
            }
        }
    }
    found.sort();
    Ok(found)
}

/// The step of a checkpoint directory by its name, `step-NNNNNN`; `None` for any other name
/// (a temporary or a moved-aside `step-NNNNNN.invalid-<secs>` one).
pub fn checkpoint_step(path: &Path) -> Option<u64> {
    path.file_name()?.to_str().and_then(parse_step_dir)
}

/// The newest complete checkpoint, if any. It is not verified here; [`load_checkpoint`] does
/// (and [`newest_valid`] picks the newest one that verifies).
pub fn latest_checkpoint(out_dir: &Path) -> Result<Option<PathBuf>> {
    Ok(list_checkpoints(out_dir)?.pop().map(|(_, p)| p))
}

/// Deletes all but the newest `keep_last` (>= 1) checkpoints and returns the deleted paths.
/// Each is first renamed to a temporary name, so a crash mid-delete never leaves a partial
/// directory under a checkpoint's name.
pub fn prune(out_dir: &Path, keep_last: usize) -> Result<Vec<PathBuf>> {
    if keep_last == 0 {
        return Err(Error::InvalidArgument {
            op: "prune",
            name: "keep_last",
            value: 0.0,
            want: "at least 1",
        });
    }
    let all = list_checkpoints(out_dir)?;
    let parent = out_dir.join(CHECKPOINTS_DIR);
    let doomed = &all[..all.len().saturating_sub(keep_last)];
    let mut removed = Vec::with_capacity(doomed.len());
    for (step, path) in doomed {
        let grave = parent.join(temp_name("deleting-step", *step));
        fs::rename(path, &grave).map_err(|e| io_err(path, e))?;
        sync_dir(&parent)?;
        fs::remove_dir_all(&grave).map_err(|e| io_err(&grave, e))?;
        removed.push(path.clone());
    }
    Ok(removed)
}

/// Removes leftover temporary directories of crashed saves or prunes. Call it only when no
/// save of this run is in progress (at startup), since an in-progress save looks the same.
pub fn remove_stale_temp_dirs(out_dir: &Path) -> Result<usize> {
    let parent = out_dir.join(CHECKPOINTS_DIR);
    let entries = match fs::read_dir(&parent) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(io_err(&parent, e)),
    };
    let mut n = 0;
    for entry in entries {
        let entry = entry.map_err(|e| io_err(&parent, e))?;
        let is_temp = entry
            .file_name()
            .to_str()
            .is_some_and(|s| s.starts_with(TEMP_PREFIX));
        if is_temp && entry.path().is_dir() {
            fs::remove_dir_all(entry.path()).map_err(|e| io_err(&entry.path(), e))?;
            n += 1;
        }
    }
    Ok(n)
}

/// A name no other save or prune (of this or another process) uses at the same time.
fn temp_name(kind: &str, step: u64) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{TEMP_PREFIX}{kind}-{step:06}-{}-{n}", std::process::id())
}

fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn named_map<'a>(
    entries: impl Iterator<Item = (&'a String, &'a Tensor)>,
    file: &'static str,
) -> Result<HashMap<&'a str, Tensor>> {
    let mut out = HashMap::new();
    for (name, tensor) in entries {
        let bad = |reason: String| Error::UnsavableTensor {
            file,
            name: name.clone(),
            reason,
        };
        if name.is_empty() {
            return Err(bad("empty name".to_string()));
        }
        // candle's safetensors writer panics on these placeholder dtypes.
        if matches!(
            tensor.dtype(),
            DType::F6E2M3 | DType::F6E3M2 | DType::F4 | DType::F8E8M0
        ) {
            return Err(bad(format!("dtype {:?} cannot be saved", tensor.dtype())));
        }
        if out.insert(name.as_str(), tensor.clone()).is_some() {
            return Err(bad("name appears twice".to_string()));
        }
    }
    Ok(out)
}

fn read_trainer_file(dir: &Path) -> Result<TrainerFile> {
    let path = dir.join(TRAINER_FILE);
    let bytes = read_file(&path)?;
    let corrupt = |reason: String| Error::CorruptCheckpoint {
        path: path.clone(),
        reason,
    };
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| corrupt(format!("not valid JSON: {e}")))?;
    // Check the version before the schema, so a newer layout gets a version error.
    match value.get("format_version").and_then(|v| v.as_u64()) {
        Some(v) if v == u64::from(FORMAT_VERSION) => {}
        Some(v) => {
            return Err(corrupt(format!(
                "format version {v} is not supported (this build reads version {FORMAT_VERSION})"
            )))
        }
        None => return Err(corrupt("no numeric `format_version` field".to_string())),
    }
    let doc: TrainerFile =
        serde_json::from_value(value).map_err(|e| corrupt(format!("bad contents: {e}")))?;
    for name in [MODEL_FILE, OPTIMIZER_FILE] {
        if !doc.files.contains_key(name) {
            return Err(corrupt(format!("`files` has no entry for {name}")));
        }
    }
    // A checkpoint under a `step-N` name must hold step N (catches a renamed or misplaced one).
    if let Some(named) = checkpoint_step(dir) {
        if named != doc.step {
            return Err(corrupt(format!(
                "records step {} but its directory says step {named}",
                doc.step
            )));
        }
    }
    if let Some(extra) = doc
        .files
        .keys()
        .find(|k| k.as_str() != MODEL_FILE && k.as_str() != OPTIMIZER_FILE)
    {
        return Err(corrupt(format!("`files` lists an unknown file {extra}")));
    }
    Ok(doc)
}

fn check_digest(
    path: &Path,
    want: &FileDigest,
    actual_len: u64,
    hash: impl FnOnce() -> Result<String>,
) -> Result<()> {
    if actual_len < want.bytes {
        return Err(Error::CorruptCheckpoint {
            path: path.to_path_buf(),
            reason: format!(
                "truncated: {actual_len} bytes on disk, {} recorded in {TRAINER_FILE}",
                want.bytes
            ),
        });
    }
    if actual_len > want.bytes {
        return Err(Error::CorruptCheckpoint {
            path: path.to_path_buf(),
            reason: format!(
                "{actual_len} bytes on disk, only {} recorded in {TRAINER_FILE}",
                want.bytes
            ),
        });
    }
    let actual = hash()?;
    if !actual.eq_ignore_ascii_case(&want.sha256) {
        return Err(Error::Checksum {
            path: path.to_path_buf(),
            expected: want.sha256.clone(),
            actual,
        });
    }
    Ok(())
}

fn digest_reader(path: &Path, mut file: &File) -> Result<FileDigest> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(|e| io_err(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok(FileDigest {
        bytes,
        sha256: hex::encode(hasher.finalize()),
    })
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    fs::read(path).map_err(|e| missing_or_io(path, e))
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err(dir, e))
}

fn missing_or_io(path: &Path, e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::NotFound {
        Error::CorruptCheckpoint {
            path: path.to_path_buf(),
            reason: "file is missing".to_string(),
        }
    } else {
        io_err(path, e)
    }
}

fn io_err(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

#[cfg(test)]
mod tests;
