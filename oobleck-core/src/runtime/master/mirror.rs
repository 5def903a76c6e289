//! What the active master sends a standby of its run directory (design note `README.md`): the
//! files as they change, as `Mirror` records a standby writes at their offset. Logs
//! (`*.jsonl`) and checkpoint files grow by appends and are sent as appends; a file rewritten
//! in place (`plan.json`, `committed.json`, `master.json`) is sent whole when its size or
//! modification time changed; a file that shrank is sent whole. The workers' uploads
//! (`cluster/`) and files being written (`*.tmp`, checkpoints before their rename) are not
//! mirrored.
//!
//! One [`Mirror`] per standby connection: what that standby has been sent. A call sends at
//! most a budget of bytes of the files that are not the run's logs and records, so a large
//! checkpoint streams over many calls without holding up the master's loop; the logs and
//! records always go in full, so a standby's copy holds every committed step's lines.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Component, Path, PathBuf};
use std::time::SystemTime;

use crate::runtime::wire::Message;

/// The most bytes of one record (within [`crate::runtime::wire::protocol::MAX_PAYLOAD`]).
const CHUNK: u64 = 4 << 20;

/// A file's size and modification time, as last seen or sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Seen {
    len: u64,
    modified: Option<SystemTime>,
}

/// What one standby has been sent.
#[derive(Debug, Default)]
pub(super) struct Mirror {
    sent: BTreeMap<String, Seen>,
    /// The last record's number (records are numbered from 1).
    pub seq: u64,
}

/// The files of `run` that are mirrored, by path relative to it, sorted (the logs and records
/// first: see [`is_record`]).
pub(super) fn files(run: &Path) -> Vec<(String, Seen)> {
    let mut out = Vec::new();
    walk(run, run, true, &mut out);
    out.sort_by_key(|(p, _)| (!is_record(p), p.clone()));
    out
}

/// Only the run's logs and records (its top-level files), sorted: what a commit must send,
/// without a walk through every checkpoint.
pub(super) fn records(run: &Path) -> Vec<(String, Seen)> {
    let mut out = Vec::new();
    walk(run, run, false, &mut out);
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn walk(run: &Path, dir: &Path, deep: bool, out: &mut Vec<(String, Seen)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let Ok(rel) = path.strip_prefix(run) else {
            continue;
        };
        let rel = rel.to_string_lossy().into_owned();
        let name = e.file_name().to_string_lossy().into_owned();
        if rel == "cluster" || name.contains(".tmp") || name.starts_with('.') {
            continue;
        }
        let Ok(meta) = e.metadata() else { continue };
        if meta.is_dir() {
            if deep {
                walk(run, &path, deep, out);
            }
        } else if meta.is_file() {
            let seen = Seen {
                len: meta.len(),
                modified: meta.modified().ok(),
            };
            out.push((rel, seen));
        }
    }
}

/// The run's logs and records, always sent in full: what a standby needs to go on from the
/// last committed step.
fn is_record(rel: &str) -> bool {
    !rel.starts_with("checkpoints") && !rel.contains('/')
}

/// Grows by appends: the logs, and a checkpoint's files (each written once).
fn appends(rel: &str) -> bool {
    rel.ends_with(".jsonl") || rel.starts_with("checkpoints/")
}

impl Mirror {
    /// The records that bring this standby's copy up to `files` (from [`files`]), sending at
    /// most `budget` bytes of files other than the logs and records.
    pub(super) fn records(
        &mut self,
        run: &Path,
        files: &[(String, Seen)],
        mut budget: u64,
    ) -> std::io::Result<Vec<(Message, Vec<u8>)>> {
        let mut out = Vec::new();
        for (rel, now) in files {
            let (from, truncate) = match self.sent.get(rel) {
                Some(s) if s == now => continue,
                Some(s) if appends(rel) && now.len >= s.len => (s.len, false),
                _ => (0, true),
            };
            let want = now.len - from;
            let take = if is_record(rel) {
                want
            } else {
                let take = want.min(budget);
                budget -= take;
                take
            };
            if take == 0 && !truncate {
                continue;
            }
            let bytes = read_range(&run.join(rel), from, take)?;
            self.push_chunks(rel, from, truncate, &bytes, &mut out);
            let seen = match take == want {
                true => *now,
                // The rest next time: what is sent so far, and no time yet.
                false => Seen {
                    len: from + take,
                    modified: None,
                },
            };
            self.sent.insert(rel.clone(), seen);
        }
        Ok(out)
    }

    fn push_chunks(
        &mut self,
        rel: &str,
        from: u64,
        truncate: bool,
        bytes: &[u8],
        out: &mut Vec<(Message, Vec<u8>)>,
    ) {
        let mut offset = from;
        let mut first = true;
        for chunk in bytes.chunks(CHUNK as usize).chain(
            // An empty file is still a file.
            std::iter::once(&[][..]).filter(|_| bytes.is_empty()),
        ) {
            self.seq += 1;
            let msg = Message::Mirror {
                seq: self.seq,
                path: rel.to_string(),
                offset,
                truncate: truncate && first,
                len: chunk.len() as u64,
            };
            out.push((msg, chunk.to_vec()));
            offset += chunk.len() as u64;
            first = false;
        }
    }
}

/// `len` bytes of `path` from `from` (fewer if it is shorter now).
fn read_range(path: &Path, from: u64, len: u64) -> std::io::Result<Vec<u8>> {
    let mut f = std::fs::File::open(path)?;
    f.seek(SeekFrom::Start(from))?;
    let mut bytes = Vec::with_capacity(len as usize);
    f.take(len).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// Where a standby writes a record's `path` under its copy `root`: a relative path of plain
/// names only, so a record can never write outside the copy.
pub fn mirrored_path(root: &Path, path: &str) -> Result<PathBuf, String> {
    let rel = Path::new(path);
    let plain = rel.components().all(|c| matches!(c, Component::Normal(_)));
    if path.is_empty() || !plain {
        return Err(format!(
            "a mirror record names {path:?}: only a relative path of plain names is written"
        ));
    }
    Ok(root.join(rel))
}

/// Writes one record under `root`: `bytes` at `offset` of `path`, cut there first if
/// `truncate`.
pub fn apply(
    root: &Path,
    path: &str,
    offset: u64,
    truncate: bool,
    bytes: &[u8],
) -> Result<(), String> {
    use std::io::Write;
    let target = mirrored_path(root, path)?;
    if let Some(dir) = target.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(false)
        .open(&target)
        .map_err(|e| format!("{}: {e}", target.display()))?;
    if truncate {
        f.set_len(offset)
            .map_err(|e| format!("{}: {e}", target.display()))?;
    }
    f.seek(SeekFrom::Start(offset))
        .and_then(|_| f.write_all(bytes))
        .map_err(|e| format!("{}: {e}", target.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Applies every record of `m` to `copy`; `(offset, truncate)` of each.
    fn sync(m: &mut Mirror, run: &Path, copy: &Path, budget: u64) -> Vec<(u64, bool)> {
        let records = m.records(run, &files(run), budget).expect("records");
        records
            .iter()
            .map(|(r, bytes)| {
                let Message::Mirror {
                    path,
                    offset,
                    truncate,
                    len,
                    ..
                } = r
                else {
                    unreachable!()
                };
                assert_eq!(*len, bytes.len() as u64);
                apply(copy, path, *offset, *truncate, bytes).expect("apply");
                (*offset, *truncate)
            })
            .collect()
    }

    fn same(run: &Path, copy: &Path, rel: &str) {
        let a = std::fs::read(run.join(rel)).expect("original");
        let b = std::fs::read(copy.join(rel)).expect("copy");
        assert_eq!(a, b, "{rel}");
    }

    #[test]
    fn a_copy_follows_appends_rewrites_and_new_checkpoints() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (run, copy) = (dir.path().join("run"), dir.path().join("copy"));
        std::fs::create_dir_all(run.join("cluster")).unwrap();
        std::fs::write(run.join("events.jsonl"), "{\"event\":\"start\"}\n").unwrap();
        std::fs::write(run.join("plan.json"), "[1]").unwrap();
        std::fs::write(run.join("cluster/rank-0.safetensors"), "upload").unwrap();
        let mut m = Mirror::default();
        assert_eq!(sync(&mut m, &run, &copy, 1 << 20).len(), 2);
        same(&run, &copy, "events.jsonl");
        assert!(!copy.join("cluster").exists(), "uploads are not mirrored");
        // Nothing changed: nothing sent.
        assert!(sync(&mut m, &run, &copy, 1 << 20).is_empty());
        // An append goes as an append; a rewrite as the whole file, shorter or not.
        let mut ev = std::fs::OpenOptions::new()
            .append(true)
            .open(run.join("events.jsonl"))
            .unwrap();
        std::io::Write::write_all(&mut ev, b"{\"event\":\"plan\"}\n").unwrap();
        std::fs::write(run.join("plan.json"), "[]").unwrap();
        let sent = sync(&mut m, &run, &copy, 1 << 20);
        assert_eq!(sent, vec![(18, false), (0, true)]);
        same(&run, &copy, "events.jsonl");
        same(&run, &copy, "plan.json");
        // A checkpoint over the budget streams over several calls.
        let ck = run.join("checkpoints/step-000010");
        std::fs::create_dir_all(&ck).unwrap();
        std::fs::write(ck.join("model.safetensors"), vec![7u8; 3000]).unwrap();
        std::fs::write(run.join("metrics.jsonl"), "{\"step\":10}\n").unwrap();
        let mut calls = 0;
        while !sync(&mut m, &run, &copy, 1000).is_empty() {
            calls += 1;
            // The logs go at once, whatever the budget.
            same(&run, &copy, "metrics.jsonl");
        }
        assert_eq!(calls, 3);
        // What a commit sends: the top-level files alone.
        let top: Vec<String> = records(&run).into_iter().map(|f| f.0).collect();
        assert_eq!(top, ["events.jsonl", "metrics.jsonl", "plan.json"]);
        same(&run, &copy, "checkpoints/step-000010/model.safetensors");
    }

    #[test]
    fn a_record_cannot_write_outside_the_copy() {
        let dir = tempfile::tempdir().expect("tempdir");
        for bad in ["../x", "/etc/passwd", "", "a/../../b", "./x"] {
            let e = apply(dir.path(), bad, 0, true, b"x").expect_err(bad);
            assert!(e.contains("plain names"), "{bad}: {e}");
        }
        apply(dir.path(), "checkpoints/step-1/a", 0, true, b"ok").expect("a plain path");
    }
}
