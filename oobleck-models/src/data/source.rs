//! What `--data PATH` names: a text corpus, raw documents to prepare, or pre-tokenized token
//! shards, found from the path.
//!
//! - A path with `*` or `?` in its file name is a glob over one folder (`shards/train_*.bin`):
//!   the matching files, sorted by name; matching nothing is an error naming the pattern.
//! - A folder: its files, sorted by name (hidden files skipped). A folder `oobleck data
//!   prepare` wrote (it holds `manifest.json`) is shards.
//! - A Megatron prefix (`data/corpus_text_document`, whose `.idx` exists): that pair.
//! - A file: token shards when it ends in `.bin` or `.idx`, starts with an llm.c magic, or the
//!   caller said `--data-format u16`; raw documents when `oobleck data prepare` reads its
//!   extension and it is not a plain `.txt`/`.md` (`.jsonl`, `.json`, `.parquet`, `.txt.gz`,
//!   ...); otherwise a UTF-8 text corpus.
//!
//! A glob whose files are all raw documents, or a folder whose files below it (recursively,
//! as `data prepare` reads a folder; `*.prepared` cache folders skipped) all are, is raw
//! documents: prepared once into the data cache ([`super::prepare::prepare_cached`]). Any
//! other folder or glob is shards, and a `.idx` is skipped: its pair is opened by its `.bin`.
//! The expansion is done here, not by a shell, so every node of a cluster expands the same
//! config string the same way.

use std::path::{Path, PathBuf};

use super::prepare::{expand_sources, format_of, Codec, Layout, MANIFEST_FILE};
use super::shards::{FormatHint, LLMC_MAGIC_U16, LLMC_MAGIC_U32};
use super::{io_err, DataError, Result};

/// A resolved `--data` path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataSource {
    /// A UTF-8 text corpus, tokenized into the token cache.
    Text(PathBuf),
    /// Token shards, concatenated in this order.
    Shards(Vec<PathBuf>),
    /// Raw documents (JSONL, Parquet, compressed or several text files) in reading order,
    /// prepared into the data cache before training reads them.
    Raw(Vec<PathBuf>),
}

/// Resolves `path` (see the module docs). `hint` is `--data-format`.
pub fn resolve_source(path: &Path, hint: FormatHint) -> Result<DataSource> {
    if is_glob(path) {
        let files = expand_glob(path)?;
        if files.iter().all(|f| raw_format(f)) {
            return Ok(DataSource::Raw(files));
        }
        return Ok(DataSource::Shards(files));
    }
    if !path.exists() {
        if with_suffix(path, ".idx").exists() {
            return Ok(DataSource::Shards(vec![path.to_path_buf()]));
        }
        return Err(DataError::NotFound {
            what: "data",
            path: path.to_path_buf(),
        });
    }
    if path.is_dir() {
        if let Some(files) = raw_folder_files(path)? {
            return Ok(DataSource::Raw(files));
        }
        return folder_files(path).map(DataSource::Shards);
    }
    let by_name = path.extension().is_some_and(|e| e == "bin" || e == "idx");
    if by_name || hint == FormatHint::RawU16 || starts_with_llmc_magic(path)? {
        Ok(DataSource::Shards(vec![path.to_path_buf()]))
    } else if raw_format(path) && !matches!(format_of(path), Ok((Layout::Text, Codec::Plain))) {
        Ok(DataSource::Raw(vec![path.to_path_buf()]))
    } else {
        Ok(DataSource::Text(path.to_path_buf()))
    }
}

/// Whether `oobleck data prepare` reads `path` (by its extension).
fn raw_format(path: &Path) -> bool {
    format_of(path).is_ok()
}

/// The files below `dir` in `data prepare`'s reading order, when it is not a prepared folder
/// and every one is a format `data prepare` reads; `None` otherwise (then it is shards).
fn raw_folder_files(dir: &Path) -> Result<Option<Vec<PathBuf>>> {
    if dir.join(MANIFEST_FILE).exists() {
        return Ok(None);
    }
    let Ok(mut files) = expand_sources(&[dir.display().to_string()]) else {
        return Ok(None); // an unknown extension: a shard folder
    };
    if files.is_empty() {
        return Ok(None);
    }
    Ok(Some(files.drain(..).map(|f| f.path).collect()))
}

fn is_glob(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|n| n.to_string_lossy().contains(['*', '?']))
}

/// The files of `pattern`'s folder whose names match its last component, sorted by name.
fn expand_glob(pattern: &Path) -> Result<Vec<PathBuf>> {
    let name = pattern
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let dir = match pattern.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if dir.to_string_lossy().contains(['*', '?']) {
        return Err(DataError::NoMatch {
            pattern: pattern.to_path_buf(),
            why: "wildcards are allowed in the file name only, not in folder names",
        });
    }
    let Ok(wanted) = glob::Pattern::new(&name) else {
        return Err(DataError::NoMatch {
            pattern: pattern.to_path_buf(),
            why: "it is not a valid pattern (`*` is any run of characters, `?` any one)",
        });
    };
    let files = list_files(&dir, |file| wanted.matches(file))?;
    if files.is_empty() {
        return Err(DataError::NoMatch {
            pattern: pattern.to_path_buf(),
            why: "no file matches it; check the folder and the pattern",
        });
    }
    Ok(files)
}

/// The shard files of a folder, sorted by name: not hidden files, and not the manifest or
/// the unfinished shards (`.tmp`) of a folder `oobleck data prepare` writes.
fn folder_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let files = list_files(dir, |name| {
        !name.starts_with('.') && name != "manifest.json" && !name.ends_with(".tmp")
    })?;
    if files.is_empty() {
        return Err(DataError::NoMatch {
            pattern: dir.to_path_buf(),
            why: "the folder holds no token shard files",
        });
    }
    Ok(files)
}

/// Regular files of `dir` (not `.idx`, which their `.bin` opens) whose names pass `keep`,
/// sorted by name.
fn list_files(dir: &Path, keep: impl Fn(&str) -> bool) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if keep(&name) && path.is_file() && !name.ends_with(".idx") {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

fn starts_with_llmc_magic(path: &Path) -> Result<bool> {
    use std::io::Read;
    let mut first = [0u8; 4];
    let mut file = std::fs::File::open(path).map_err(io_err(path))?;
    match file.read_exact(&mut first) {
        Ok(()) => Ok(matches!(
            i32::from_le_bytes(first),
            LLMC_MAGIC_U16 | LLMC_MAGIC_U32
        )),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(io_err(path)(e)),
    }
}

/// `path` with `suffix` appended to its last component (a Megatron prefix's `.idx`).
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_match_runs_and_single_bytes() {
        let m = |p: &str, n: &str| glob::Pattern::new(p).unwrap().matches(n);
        assert!(m("fineweb_train_*.bin", "fineweb_train_000001.bin"));
        assert!(!m("fineweb_train_*.bin", "fineweb_val_000000.bin"));
        assert!(m("a?c", "abc"));
        assert!(!m("a?c", "ac"));
        assert!(m("*", ""));
    }

    #[test]
    fn a_folder_and_a_glob_list_shards_by_name_without_indexes() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["b.bin", "a.bin", "a.idx", "notes.txt", ".hidden"] {
            std::fs::write(dir.path().join(name), b"x").unwrap();
        }
        let names = |s: DataSource| match s {
            DataSource::Shards(files) => files
                .iter()
                .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
                .collect::<Vec<_>>(),
            other => panic!("not shards: {other:?}"),
        };
        let folder = resolve_source(dir.path(), FormatHint::Detect).unwrap();
        assert_eq!(names(folder), ["a.bin", "b.bin", "notes.txt"]);
        let glob = resolve_source(&dir.path().join("*.bin"), FormatHint::Detect).unwrap();
        assert_eq!(names(glob), ["a.bin", "b.bin"]);
        let text = resolve_source(&dir.path().join("notes.txt"), FormatHint::Detect).unwrap();
        assert_eq!(text, DataSource::Text(dir.path().join("notes.txt")));
    }

    #[test]
    fn jsonl_parquet_and_compressed_text_are_raw_and_so_is_a_folder_or_glob_of_them() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir_all(d.join("web/sub")).unwrap();
        std::fs::create_dir_all(d.join("web/old.jsonl.prepared")).unwrap();
        for name in [
            "web/b.parquet",
            "web/a.jsonl.zst",
            "web/sub/c.txt",
            "web/.hidden",
            "web/old.jsonl.prepared/shard-000000.bin",
            "plain.txt",
            "book.txt.gz",
        ] {
            std::fs::write(d.join(name), b"x").unwrap();
        }
        let resolve = |p: &str| resolve_source(&d.join(p), FormatHint::Detect).unwrap();
        let raw = |names: &[&str]| DataSource::Raw(names.iter().map(|n| d.join(n)).collect());
        assert_eq!(resolve("plain.txt"), DataSource::Text(d.join("plain.txt")));
        assert_eq!(resolve("book.txt.gz"), raw(&["book.txt.gz"]));
        assert_eq!(resolve("web/b.parquet"), raw(&["web/b.parquet"]));
        assert_eq!(
            resolve("web"),
            raw(&["web/a.jsonl.zst", "web/b.parquet", "web/sub/c.txt"]),
            "recursive, sorted, hidden files and *.prepared caches skipped"
        );
        assert_eq!(
            resolve("web/?.*"),
            raw(&["web/a.jsonl.zst", "web/b.parquet"])
        );
        // A folder `data prepare` wrote is shards, whatever else it holds.
        let prepared = d.join("web/old.jsonl.prepared");
        std::fs::write(prepared.join("manifest.json"), b"{}").unwrap();
        assert_eq!(
            resolve_source(&prepared, FormatHint::Detect).unwrap(),
            DataSource::Shards(vec![prepared.join("shard-000000.bin")])
        );
    }
}
