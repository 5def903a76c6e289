//! `train --data RAW`: raw documents (JSONL, Parquet, compressed or several text files)
//! prepared once into the data cache, exactly as `oobleck data prepare` would, then read like
//! `--data DIR` by every later run and every worker process of the machine.
//!
//! Where: the token cache's places ([`default_cache_dirs`]): `$OOBLECK_CACHE_DIR` alone if set,
//! else beside the source (`<name>.prepared/`), then `$XDG_CACHE_HOME/oobleck-rs` (or
//! `~/.cache/oobleck-rs`), then the temp folder, where the name carries the key
//! (`<name>-<key>.prepared/`). The first place holding a finished preparation with this key is
//! used; else the first writable place is prepared.
//!
//! The key: SHA-256 of the sources' absolute paths, sizes and modification times, the
//! tokenizer's hash and the preparation's settings. It costs a `stat` per source, not a pass
//! over the corpus, so a later run starts at once; a source that is rewritten (new size or
//! mtime) changes the key and is prepared anew (beside the source, over the old preparation).
//! A folder's `.key` file names what it is being prepared from; it is written before the first
//! shard, and a folder is finished when its `.key` matches and its manifest says complete
//! (the manifest is written last, atomically, so no reader sees a half-written folder).
//!
//! Several processes: the preparation runs under an exclusive `flock` on the folder's `.lock`
//! file (an advisory lock the OS drops when its process dies). Workers of a local cluster that
//! start together: one prepares, the others wait for the lock, then find the folder finished.
//! A process killed mid-way leaves whole shards and a manifest that the next one resumes
//! (resume.rs). Machines that do not share the cache folder each prepare their own copy; the
//! shards are a function of the sources and the tokenizer, so every copy is the same bytes.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, UNIX_EPOCH};

use sha2::{Digest, Sha256};

use super::error::{read_err, write_err, PrepareError, Result};
use super::manifest::{Manifest, MANIFEST_FILE, MANIFEST_VERSION};
use super::DEFAULT_SHARD_TOKENS;
use super::{prepare, PrepareOptions, Progress, ReadOptions};
use crate::data::cache_dirs::flock_exclusive;
use crate::data::{default_cache_dirs, DataError, Gpt2Tokenizer};

/// Ends the name of a folder that `train --data` prepares raw sources into; a folder source
/// skips such folders (they are a cache, not data).
pub const PREPARED_SUFFIX: &str = ".prepared";
/// Inside a prepared folder: the key of the sources it holds, and the lock file.
const KEY_FILE: &str = ".key";
pub(crate) const LOCK_FILE: &str = ".lock";
/// Hex digits of the key in a shared place's folder name (64 bits: no two sources meet).
const NAME_KEY_DIGITS: usize = 16;
/// How often a long preparation logs its progress.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// Whether a call found the folder finished or prepared it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Reused,
    Prepared,
}

/// Prepares `files` (the raw sources `label` names, in reading order) into the data cache
/// unless a finished preparation of them exists, and returns its folder (see the module docs).
pub fn prepare_cached(
    label: &Path,
    files: &[PathBuf],
    tokenizer: &Gpt2Tokenizer,
    read: &ReadOptions,
) -> crate::data::Result<PathBuf> {
    let wrap = |error: PrepareError| match error {
        PrepareError::Data(e) => e,
        e => DataError::prepare(label, e),
    };
    let files = files
        .iter()
        .map(|f| std::fs::canonicalize(f).map_err(read_err(f)))
        .collect::<Result<Vec<_>>>()
        .map_err(wrap)?;
    let key = cache_key(&files, tokenizer, read).map_err(wrap)?;
    let name = base_name(label);
    let places: Vec<PathBuf> = default_cache_dirs(label)
        .into_iter()
        .map(|(dir, hashed)| match hashed {
            true => dir.join(format!(
                "{name}-{}{PREPARED_SUFFIX}",
                &key[..NAME_KEY_DIGITS]
            )),
            false => dir.join(format!("{name}{PREPARED_SUFFIX}")),
        })
        .collect();
    let cached = Cached {
        label,
        files: &files,
        key: &key,
        workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
        read,
    };
    cached
        .prepare_in(&places, tokenizer)
        .map(|(dir, _)| dir)
        .map_err(wrap)
}

/// One preparation request: the source as the user named it, the absolute paths of its files
/// in order, their key, tokenizing threads, how records are read (`--text-field`,
/// `--skip-bad-records`).
pub(crate) struct Cached<'a> {
    pub label: &'a Path,
    pub files: &'a [PathBuf],
    pub key: &'a str,
    pub workers: usize,
    pub read: &'a ReadOptions,
}

impl Cached<'_> {
    /// The first of `places` finished with this key; else the first that can be locked,
    /// prepared under its lock.
    pub(crate) fn prepare_in(
        &self,
        places: &[PathBuf],
        tokenizer: &Gpt2Tokenizer,
    ) -> Result<(PathBuf, Outcome)> {
        for dir in places {
            if is_finished(dir, self.key) {
                tracing::debug!(dir = %dir.display(), "reusing the prepared data in the cache");
                return Ok((dir.clone(), Outcome::Reused));
            }
        }
        let mut tried = Vec::new();
        for dir in places {
            match lock(dir) {
                Ok(lock) => {
                    let outcome = self.prepare_locked(dir, tokenizer)?;
                    drop(lock);
                    return Ok((dir.clone(), outcome));
                }
                Err(e) => tried.push(format!("{} ({e})", dir.display())),
            }
        }
        Err(PrepareError::Data(DataError::NoWritableCache {
            corpus: self.label.to_path_buf(),
            tried: tried.join(", "),
        }))
    }

    /// Prepares (or resumes) `dir`, whose lock this process holds.
    fn prepare_locked(&self, dir: &Path, tokenizer: &Gpt2Tokenizer) -> Result<Outcome> {
        if is_finished(dir, self.key) {
            tracing::debug!(dir = %dir.display(), "another process prepared the data: reusing it");
            return Ok(Outcome::Reused);
        }
        let key_path = dir.join(KEY_FILE);
        match std::fs::read_to_string(&key_path) {
            Ok(k) if k == self.key => {} // an interrupted preparation of the same: resume it
            _ => clear(dir)?,
        }
        std::fs::write(&key_path, self.key).map_err(write_err(&key_path))?;
        tracing::info!(
            dir = %dir.display(),
            sources = self.files.len(),
            threads = self.workers,
            "preparing the raw data once into the cache (later runs and workers reuse it)"
        );
        let options = PrepareOptions {
            sources: self.files.iter().map(|f| f.display().to_string()).collect(),
            out: dir.to_path_buf(),
            shard_tokens: DEFAULT_SHARD_TOKENS,
            workers: self.workers,
            read: self.read.clone(),
        };
        let started = Instant::now();
        let mut last_log = started;
        let summary = prepare(&options, tokenizer, &mut |p: &Progress| {
            if last_log.elapsed() >= LOG_EVERY {
                last_log = Instant::now();
                tracing::info!(
                    mb_read = p.bytes_read / 1_000_000,
                    mb_total = p.bytes_total / 1_000_000,
                    tokens = p.tokens,
                    "preparing"
                );
            }
        })?;
        let t = &summary.manifest.totals;
        tracing::info!(
            dir = %dir.display(),
            tokens = t.tokens,
            documents = t.documents,
            shards = t.shards,
            skipped_records = t.skipped_records,
            seconds = format!("{:.1}", started.elapsed().as_secs_f64()),
            "prepared the raw data"
        );
        Ok(Outcome::Prepared)
    }
}

/// The key of a preparation of `files` (absolute paths) with `tokenizer` (see the module docs).
pub(crate) fn cache_key(
    files: &[PathBuf],
    tokenizer: &Gpt2Tokenizer,
    read: &ReadOptions,
) -> Result<String> {
    let mut h = Sha256::new();
    h.update(format!(
        "oobleck prepared data, manifest v{MANIFEST_VERSION}\n"
    ));
    h.update(format!(
        "tokenizer {} {}\nshard_tokens {DEFAULT_SHARD_TOKENS} text_field {:?} skip {}\n",
        tokenizer.hash(),
        tokenizer.vocab_size(),
        read.text_field,
        read.skip_bad_records
    ));
    for f in files {
        let meta = std::fs::metadata(f).map_err(read_err(f))?;
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        h.update(format!("{:?} {} {mtime}\n", f, meta.len()));
    }
    Ok(hex::encode(h.finalize()))
}

/// The start of the cache folder's name: the source's file or folder name, wildcards as `_`.
fn base_name(label: &Path) -> String {
    let name = label
        .file_name()
        .map(|n| n.to_string_lossy().replace(['*', '?', '[', ']'], "_"))
        .unwrap_or_default();
    if name.is_empty() {
        "data".to_string()
    } else {
        name
    }
}

/// Whether `dir` holds a complete preparation of `key`: its key, a complete manifest, and
/// every listed shard at the size its token count gives.
fn is_finished(dir: &Path, key: &str) -> bool {
    if std::fs::read_to_string(dir.join(KEY_FILE)).ok().as_deref() != Some(key) {
        return false;
    }
    let Ok(Some(m)) = Manifest::load(dir) else {
        return false;
    };
    m.complete && m.shards_on_disk(dir) == m.shards.len()
}

/// Creates `dir` and takes its lock, waiting while another process holds it.
fn lock(dir: &Path) -> std::io::Result<File> {
    std::fs::create_dir_all(dir)?;
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(LOCK_FILE))?;
    flock_exclusive(&file)?;
    Ok(file)
}

/// Removes a preparation of other sources from `dir` (its shards, manifest and key; nothing
/// else), so that the folder is prepared anew.
fn clear(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(read_err(dir))? {
        let path = entry.map_err(read_err(dir))?.path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if name.starts_with("shard-") || name.starts_with(MANIFEST_FILE) || name == KEY_FILE {
            std::fs::remove_file(&path).map_err(write_err(&path))?;
        }
    }
    Ok(())
}
