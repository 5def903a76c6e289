//! What a run keeps from an earlier one in the same folder.
//!
//! The rule: a folder whose manifest was made from the same sources (paths, sizes, SHA-256),
//! the same tokenizer, shard size and text field keeps every listed shard whose file is still
//! there with the size its token count gives, in order up to the first that is not; reading
//! resumes at the last kept shard's `end` position. Shards are renamed into place only when
//! complete, and the manifest lists a shard only after its rename, so a kill at any point
//! leaves shards that are whole. Anything else in the folder (temporary files of a killed run,
//! a shard renamed just before the kill but not yet listed) is rewritten with the same bytes.
//! A folder prepared from anything else is refused, naming what differs.

use std::path::Path;

use super::error::{PrepareError, Result};
use super::manifest::{Manifest, Position};

/// What to do in the output folder.
#[derive(Debug, Clone, PartialEq)]
pub struct Resume {
    /// The manifest to continue: the new run's settings with the kept shards.
    pub manifest: Manifest,
    /// Where reading starts.
    pub start: Position,
    /// The earlier run finished: nothing to do.
    pub done: bool,
}

/// Compares `fresh` (this run's settings, no shards) with the manifest in `dir`, if any.
pub fn plan_resume(dir: &Path, fresh: Manifest) -> Result<Resume> {
    let Some(old) = Manifest::load(dir)? else {
        return Ok(Resume {
            manifest: fresh,
            start: Position::default(),
            done: false,
        });
    };
    check_same(dir, &old, &fresh)?;
    let mut manifest = fresh;
    // The same tokenizer (checked above), so the same token width.
    let kept = old.shards_on_disk(dir);
    manifest.shards.extend_from_slice(&old.shards[..kept]);
    let done = old.complete && manifest.shards.len() == old.shards.len();
    let start = manifest.shards.last().map(|s| s.end).unwrap_or_default();
    manifest.update_totals();
    if done {
        // The totals count bad records skipped after the last document too.
        manifest.totals = old.totals.clone();
    }
    manifest.complete = done;
    Ok(Resume {
        manifest,
        start,
        done,
    })
}

/// Removes the temporary files a killed run left (a half-written shard, a manifest being
/// saved): they are rewritten from the start.
pub fn remove_stale_temps(dir: &Path) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(super::error::read_err(dir))?;
    for entry in entries {
        let path = entry.map_err(super::error::read_err(dir))?.path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let ours = name.starts_with("shard-") || name.starts_with(super::manifest::MANIFEST_FILE);
        if ours && name.ends_with(super::writer::TMP_SUFFIX) {
            std::fs::remove_file(&path).map_err(super::error::write_err(&path))?;
        }
    }
    Ok(())
}

fn check_same(dir: &Path, old: &Manifest, new: &Manifest) -> Result<()> {
    let differ = |what: &str, was: String, now: String| PrepareError::Mismatch {
        dir: dir.to_path_buf(),
        what: what.to_string(),
        was,
        now,
    };
    if old.format_version != new.format_version {
        return Err(differ(
            "manifest version",
            old.format_version.to_string(),
            new.format_version.to_string(),
        ));
    }
    if old.tokenizer != new.tokenizer {
        return Err(differ(
            "tokenizer",
            format!("SHA-256 {}", old.tokenizer.sha256),
            format!("SHA-256 {}", new.tokenizer.sha256),
        ));
    }
    if old.shard_tokens != new.shard_tokens {
        return Err(differ(
            "--shard-tokens",
            old.shard_tokens.to_string(),
            new.shard_tokens.to_string(),
        ));
    }
    if old.text_field != new.text_field {
        return Err(differ(
            "--text-field",
            old.text_field.clone(),
            new.text_field.clone(),
        ));
    }
    let n = old.sources.len().max(new.sources.len());
    for i in 0..n {
        match (old.sources.get(i), new.sources.get(i)) {
            (Some(a), Some(b)) if a == b => {}
            (Some(a), Some(b)) if a.path != b.path => {
                return Err(differ(
                    &format!("source #{}", i + 1),
                    a.path.clone(),
                    b.path.clone(),
                ))
            }
            (Some(a), Some(b)) => {
                return Err(differ(
                    &format!("content of source {}", a.path),
                    format!("{} bytes, SHA-256 {}", a.bytes, a.sha256),
                    format!("{} bytes, SHA-256 {}", b.bytes, b.sha256),
                ))
            }
            (Some(a), None) => {
                return Err(differ(
                    &format!("source #{}", i + 1),
                    a.path.clone(),
                    "none".into(),
                ))
            }
            (None, Some(b)) => {
                return Err(differ(
                    &format!("source #{}", i + 1),
                    "none".into(),
                    b.path.clone(),
                ))
            }
            (None, None) => unreachable!("i < the longer list's length"),
        }
    }
    Ok(())
}
