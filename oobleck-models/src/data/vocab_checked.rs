//! A shard's vocabulary check ([`TokenShard::check_vocab`], a pass over every token) done once
//! per machine, not by every worker process at every start: at 300B tokens the pass reads
//! 600 GB, and a local cluster starts one process per device.
//!
//! A clean check leaves a marker file in the shared cache folder ([`shared_cache_dirs`], under
//! `vocab-checked/`), named by SHA-256 of the shard's absolute path, size and modification
//! time and the vocabulary checked against: the rule the raw-data cache keys on (a `stat`,
//! not a read), so a rewritten shard is checked again. Processes that start together take the
//! folder's lock: one scans, the others find its marker. Without a writable cache folder every
//! process scans, as before. A failed check writes nothing: the error comes back every time.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use sha2::{Digest, Sha256};

use super::cache_dirs::{flock_exclusive, shared_cache_dirs};
use super::shards::TokenShard;
use super::Result;

/// The markers' folder inside a cache folder.
const FOLDER: &str = "vocab-checked";

/// [`TokenShard::check_vocab`] unless this machine already checked the same file (see the
/// module docs).
pub(crate) fn check_vocab_once(shard: &TokenShard, vocab: usize) -> Result<()> {
    let places: Vec<PathBuf> = shared_cache_dirs().iter().map(|d| d.join(FOLDER)).collect();
    check_vocab_once_in(shard, vocab, &places)
}

/// [`check_vocab_once`] with its marker folders named (tests use their own).
pub(crate) fn check_vocab_once_in(
    shard: &TokenShard,
    vocab: usize,
    places: &[PathBuf],
) -> Result<()> {
    let Some(name) = marker_name(shard.path(), vocab) else {
        return shard.check_vocab(vocab);
    };
    if places.iter().any(|dir| dir.join(&name).exists()) {
        return Ok(());
    }
    let Some((dir, _lock)) = places.iter().find_map(|dir| Some((dir, lock(dir).ok()?))) else {
        return shard.check_vocab(vocab);
    };
    if dir.join(&name).exists() {
        return Ok(()); // checked by the process that held the lock before us
    }
    shard.check_vocab(vocab)?;
    if let Err(e) = std::fs::write(dir.join(&name), b"") {
        tracing::debug!(dir = %dir.display(), "could not record the vocabulary check: {e}");
    }
    Ok(())
}

/// The marker's file name; `None` if the shard cannot be `stat`ed (then it is scanned).
fn marker_name(path: &Path, vocab: usize) -> Option<String> {
    let absolute = std::fs::canonicalize(path).ok()?;
    let meta = std::fs::metadata(&absolute).ok()?;
    let modified = meta.modified().ok()?.duration_since(UNIX_EPOCH).ok()?;
    let mut hash = Sha256::new();
    hash.update(b"oobleck vocabulary check v1\n");
    hash.update(absolute.as_os_str().as_encoded_bytes());
    let stat = format!("\n{}\n{}\n{vocab}\n", meta.len(), modified.as_nanos());
    hash.update(stat.as_bytes());
    Some(format!("{}.ok", &hex::encode(hash.finalize())[..32]))
}

/// Creates `dir` and takes its lock (released when the returned file closes).
fn lock(dir: &Path) -> std::io::Result<std::fs::File> {
    std::fs::create_dir_all(dir)?;
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(".lock"))?;
    flock_exclusive(&file)?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::shards::{fixtures, open_shard, FormatHint};

    fn shard(dir: &Path, name: &str, ids: &[u32]) -> TokenShard {
        let path = fixtures::write(dir, name, &fixtures::llmc_bytes(20240520, 1, ids));
        open_shard(&path, FormatHint::Detect).unwrap()
    }

    #[test]
    fn a_clean_check_is_recorded_and_a_failed_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let places = [dir.path().join("a"), dir.path().join("b")];
        let good = shard(dir.path(), "good.bin", &[1, 2, 3]);
        check_vocab_once_in(&good, 10, &places).unwrap();
        let marker = marker_name(good.path(), 10).unwrap();
        assert!(places[0].join(&marker).exists());
        // Another vocabulary is another check.
        assert_ne!(marker_name(good.path(), 11).unwrap(), marker);

        let bad = shard(dir.path(), "bad.bin", &[1, 20, 3]);
        for _ in 0..2 {
            let msg = check_vocab_once_in(&bad, 10, &places)
                .unwrap_err()
                .to_string();
            assert!(msg.contains("bad.bin") && msg.contains("20"), "{msg}");
        }
        let markers = std::fs::read_dir(&places[0]).unwrap().count();
        assert_eq!(markers, 2, "the good shard's marker and the lock only");
    }

    #[test]
    fn a_recorded_check_is_not_repeated_until_the_file_changes() {
        let dir = tempfile::tempdir().unwrap();
        let places = [dir.path().join("m")];
        let bad = shard(dir.path(), "s.bin", &[1, 20, 3]);
        // A marker for this very file (as if it had passed): no scan, no error.
        std::fs::create_dir_all(&places[0]).unwrap();
        let marker = marker_name(bad.path(), 10).unwrap();
        std::fs::write(places[0].join(&marker), b"").unwrap();
        check_vocab_once_in(&bad, 10, &places).unwrap();
        // The file rewritten (a new modification time): its key changes and it is scanned.
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
        let file = std::fs::File::options()
            .write(true)
            .open(bad.path())
            .unwrap();
        file.set_modified(later).unwrap();
        assert_ne!(marker_name(bad.path(), 10).unwrap(), marker);
        assert!(check_vocab_once_in(&bad, 10, &places).is_err());
    }
}
