//! A cache of measured profiles keyed by their [`Fingerprint`]: one JSON file per
//! fingerprint, `<dir>/<hash>.json`, written atomically (a temporary file renamed over it).
//!
//! The directory is `$OOBLECK_CACHE_DIR` when set, else `$XDG_CACHE_HOME/oobleck/profiles`,
//! else `~/.cache/oobleck/profiles`. An entry that does not parse, fails validation, or
//! whose fingerprint is not the one its name stands for is corrupt: it is measured again
//! (and rewritten), and the caller is told why.

use std::path::{Path, PathBuf};

use crate::planning::{Fingerprint, ModelProfile};
use crate::{Error, Result};

/// Where a profile came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A valid cache entry.
    Cached(PathBuf),
    /// Measured; stored at the path (no entry was there).
    Measured(PathBuf),
    /// Measured again because the entry at the path was corrupt, for the reason given.
    Remeasured { path: PathBuf, reason: String },
}

/// The default cache directory (see the module docs); `None` without any of the variables.
pub fn default_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("OOBLECK_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("oobleck").join("profiles"))
}

/// How profiles are measured; a change of method changes every key, so profiles measured
/// the old way are measured again (2: layers swept in windows, not timed alone).
const METHOD: u32 = 2;

/// The key of a fingerprint: 64-bit FNV-1a of the measuring method and the fingerprint's
/// JSON, in hex (stable across builds).
pub fn key(fp: &Fingerprint) -> String {
    let json = serde_json::to_string(fp).expect("a fingerprint always serialises");
    let text = format!("method {METHOD} {json}");
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// The entry's path for `fp` under `dir`.
pub fn entry_path(dir: &Path, fp: &Fingerprint) -> PathBuf {
    dir.join(format!("{}.json", key(fp)))
}

/// What the entry for `fp` holds: `Ok(Some)` a valid profile, `Ok(None)` no entry,
/// `Err(reason)` a corrupt one.
pub fn lookup(dir: &Path, fp: &Fingerprint) -> std::result::Result<Option<ModelProfile>, String> {
    let path = entry_path(dir, fp);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("unreadable: {e}")),
    };
    let p = ModelProfile::from_json(&text).map_err(|e| e.to_string())?;
    p.check_fingerprint(fp).map_err(|e| e.to_string())?;
    Ok(Some(p))
}

/// Writes `p` as the entry of its fingerprint, atomically; returns its path.
pub fn store(dir: &Path, p: &ModelProfile) -> Result<PathBuf> {
    let io = |path: &Path, e: std::io::Error| Error::Io {
        path: path.to_path_buf(),
        source: e,
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let path = entry_path(dir, &p.fingerprint);
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        key(&p.fingerprint),
        std::process::id()
    ));
    std::fs::write(&tmp, p.to_json()).map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io(&path, e)
    })?;
    Ok(path)
}

/// The cached profile of `fp`, or `measure()`'s (then stored). A corrupt entry is measured
/// again and reported as [`Source::Remeasured`]. A measured profile whose fingerprint is not
/// `fp` is an error (the caller computed `fp` differently from the measurement).
pub fn load_or_measure(
    dir: &Path,
    fp: &Fingerprint,
    measure: impl FnOnce() -> Result<ModelProfile>,
) -> Result<(ModelProfile, Source)> {
    let corrupt = match lookup(dir, fp) {
        Ok(Some(p)) => return Ok((p, Source::Cached(entry_path(dir, fp)))),
        Ok(None) => None,
        Err(reason) => Some(reason),
    };
    let p = measure()?;
    p.check_fingerprint(fp).map_err(|e| Error::Profile {
        model: fp.model.clone(),
        reason: format!("the measurement does not match its cache key: {e}"),
    })?;
    let path = store(dir, &p)?;
    let source = match corrupt {
        None => Source::Measured(path),
        Some(reason) => Source::Remeasured { path, reason },
    };
    Ok((p, source))
}
