//! What the data cache holds and which of it is dead weight: `oobleck data cache [--prune]`.
//!
//! `train --data RAW` prepares raw sources into the shared cache folders under a name that
//! carries the sources' key (cache.rs), so a source that is edited, moved or deleted leaves its
//! old preparation behind, at the corpus's size. [`inventory`] looks at every `*.prepared`
//! folder of the shared cache folders (never at folders beside a source, which are the
//! user's) and says what each is:
//!
//! - **current**: complete, and every source it lists is where it was, at the size it was,
//!   last modified before the manifest was written;
//! - **stale**: complete, but a source is gone or changed since (the next `train` of it
//!   prepares a new folder; this one is never read again);
//! - **unfinished**: no complete manifest and nobody preparing it (an interrupted preparation of
//!   a source that was not trained on again);
//! - **in use**: a process holds its lock (a preparation running now): never touched.
//!
//! [`prune`] removes the stale and unfinished ones, each under its lock, so a preparation that
//! starts meanwhile is not cut from under it. A running job that maps shards of a folder it
//! removes keeps reading them (the files stay until unmapped).

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};

use super::cache::{LOCK_FILE, PREPARED_SUFFIX};
use super::manifest::{Manifest, MANIFEST_FILE};
use crate::data::cache_dirs::try_flock_exclusive;

/// What a cached preparation is (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheState {
    Current,
    /// Why: the first source that is gone or changed.
    Stale(String),
    Unfinished,
    InUse,
}

impl CacheState {
    /// Whether [`prune`] removes it.
    pub fn removable(&self) -> bool {
        matches!(self, CacheState::Stale(_) | CacheState::Unfinished)
    }
}

/// One cached preparation.
#[derive(Debug, Clone)]
pub struct CacheEntry {
    pub dir: PathBuf,
    pub bytes: u64,
    pub state: CacheState,
}

/// Every `*.prepared` folder directly inside `places`, sorted by path.
pub fn inventory(places: &[PathBuf]) -> Vec<CacheEntry> {
    let mut entries: Vec<CacheEntry> = places
        .iter()
        .filter_map(|place| std::fs::read_dir(place).ok())
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir() && p.to_string_lossy().ends_with(PREPARED_SUFFIX))
        .map(|dir| CacheEntry {
            bytes: folder_bytes(&dir),
            state: state_of(&dir),
            dir,
        })
        .collect();
    entries.sort_by(|a, b| a.dir.cmp(&b.dir));
    entries
}

/// Removes every removable entry, each under its lock (skipped if it was taken meanwhile);
/// returns the bytes freed. An error names the folder.
pub fn prune(entries: &[CacheEntry]) -> std::io::Result<u64> {
    let mut freed = 0;
    for e in entries.iter().filter(|e| e.state.removable()) {
        let Some(_lock) = lock_now(&e.dir)? else {
            continue; // a preparation started since the inventory
        };
        std::fs::remove_dir_all(&e.dir).map_err(|err| {
            std::io::Error::new(err.kind(), format!("removing {}: {err}", e.dir.display()))
        })?;
        freed += e.bytes;
    }
    Ok(freed)
}

fn state_of(dir: &Path) -> CacheState {
    match lock_now(dir) {
        Ok(None) => return CacheState::InUse,
        Ok(Some(_lock)) => {}
        Err(_) => return CacheState::InUse, // cannot tell: leave it alone
    }
    let manifest = match Manifest::load(dir) {
        Ok(Some(m)) if m.complete => m,
        _ => return CacheState::Unfinished,
    };
    let written = std::fs::metadata(dir.join(MANIFEST_FILE)).and_then(|m| m.modified());
    for source in &manifest.sources {
        let meta = match std::fs::metadata(&source.path) {
            Ok(m) => m,
            Err(_) => return CacheState::Stale(format!("{} is gone", source.path)),
        };
        if meta.len() != source.bytes {
            return CacheState::Stale(format!("{} changed size", source.path));
        }
        if let (Ok(changed), Ok(written)) = (meta.modified(), &written) {
            if changed > *written {
                return CacheState::Stale(format!("{} changed since", source.path));
            }
        }
    }
    CacheState::Current
}

/// The folder's lock if nobody holds it (`None` if someone does).
fn lock_now(dir: &Path) -> std::io::Result<Option<std::fs::File>> {
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(LOCK_FILE))?;
    Ok(try_flock_exclusive(&file)?.then_some(file))
}

fn folder_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::super::cache::{cache_key, Cached};
    use super::super::tests::{jsonl, read_opts, texts, tok};
    use super::*;

    /// `src` prepared into `place` as `train --data src` would.
    fn prepared(src: &Path, place: &Path) {
        let files = [std::fs::canonicalize(src).unwrap()];
        let read = read_opts(false);
        let key = cache_key(&files, &tok(), &read).unwrap();
        let c = Cached {
            label: src,
            files: &files,
            key: &key,
            workers: 1,
            read: &read,
        };
        c.prepare_in(&[place.to_path_buf()], &tok()).unwrap();
    }

    #[test]
    fn stale_and_unfinished_preparations_are_pruned_and_current_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("cache");
        let [kept, edited, gone] =
            ["kept", "edited", "gone"].map(|n| dir.path().join(format!("{n}.jsonl")));
        for src in [&kept, &edited, &gone] {
            std::fs::write(src, jsonl(&texts(5))).unwrap();
            let name = src.file_name().unwrap().to_string_lossy().into_owned();
            prepared(
                src,
                &cache.join(format!("{name}-0123456789abcdef.prepared")),
            );
        }
        std::fs::write(&edited, jsonl(&texts(6))).unwrap();
        std::fs::remove_file(&gone).unwrap();
        let half = cache.join("half-0123456789abcdef.prepared");
        std::fs::create_dir_all(&half).unwrap();
        std::fs::write(half.join("shard_000000.bin"), b"partial").unwrap();
        std::fs::create_dir_all(cache.join("not-a-preparation")).unwrap();

        let found = inventory(std::slice::from_ref(&cache));
        let states: Vec<(String, CacheState)> = found
            .iter()
            .map(|e| {
                (
                    e.dir.file_name().unwrap().to_string_lossy()[..4].to_string(),
                    e.state.clone(),
                )
            })
            .collect();
        assert_eq!(states.len(), 4, "{states:?}");
        assert!(
            matches!(&states[0], (n, CacheState::Stale(why)) if n == "edit" && why.contains("changed")),
            "{states:?}"
        );
        assert!(
            matches!(&states[1], (n, CacheState::Stale(why)) if n == "gone" && why.contains("is gone")),
            "{states:?}"
        );
        assert_eq!(states[2], ("half".into(), CacheState::Unfinished));
        assert_eq!(states[3], ("kept".into(), CacheState::Current));
        assert!(found.iter().all(|e| e.bytes > 0));

        // A preparation in progress (its lock held) is in use and survives the prune.
        let busy = found
            .iter()
            .find(|e| e.state == CacheState::Unfinished)
            .unwrap();
        let held = lock_now(&busy.dir).unwrap().expect("the lock");
        assert_eq!(
            inventory(std::slice::from_ref(&cache))[2].state,
            CacheState::InUse
        );
        let freed = prune(&found).unwrap();
        assert!(busy.dir.exists(), "the locked folder was left alone");
        drop(held);
        let stale: u64 = found
            .iter()
            .filter(|e| matches!(e.state, CacheState::Stale(_)))
            .map(|e| e.bytes)
            .sum();
        assert_eq!(freed, stale);
        let left: Vec<CacheState> = inventory(std::slice::from_ref(&cache))
            .into_iter()
            .map(|e| e.state)
            .collect();
        assert_eq!(left, [CacheState::Unfinished, CacheState::Current]);
        prune(&inventory(std::slice::from_ref(&cache))).unwrap();
        assert_eq!(inventory(&[cache]).len(), 1);
    }
}
