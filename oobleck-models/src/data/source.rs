//! What `--data PATH` names: a text corpus, or pre-tokenized token shards, found from the path.
//!
//! - A path with `*` or `?` in its file name is a glob over one folder (`shards/train_*.bin`):
//!   the matching files, sorted by name; matching nothing is an error naming the pattern.
//! - A folder: its files, sorted by name (hidden files skipped).
//! - A Megatron prefix (`data/corpus_text_document`, whose `.idx` exists): that pair.
//! - A file: token shards when it ends in `.bin` or `.idx`, starts with an llm.c magic, or the
//!   caller said `--data-format u16`; otherwise a UTF-8 text corpus.
//!
//! In a folder or glob every file is a shard (text corpora are one file for now), and a `.idx`
//! is skipped: its pair is opened by its `.bin`. The expansion is done here, not by a shell,
//! so every node of a cluster expands the same config string the same way.

use std::path::{Path, PathBuf};

use super::shards::{FormatHint, LLMC_MAGIC_U16, LLMC_MAGIC_U32};
use super::{io_err, DataError, Result};

/// A resolved `--data` path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataSource {
    /// A UTF-8 text corpus, tokenized into the token cache.
    Text(PathBuf),
    /// Token shards, concatenated in this order.
    Shards(Vec<PathBuf>),
}

/// Resolves `path` (see the module docs). `hint` is `--data-format`.
pub fn resolve_source(path: &Path, hint: FormatHint) -> Result<DataSource> {
    if is_glob(path) {
        return expand_glob(path).map(DataSource::Shards);
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
        return folder_files(path).map(DataSource::Shards);
    }
    let by_name = path.extension().is_some_and(|e| e == "bin" || e == "idx");
    if by_name || hint == FormatHint::RawU16 || starts_with_llmc_magic(path)? {
        Ok(DataSource::Shards(vec![path.to_path_buf()]))
    } else {
        Ok(DataSource::Text(path.to_path_buf()))
    }
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
            DataSource::Text(p) => panic!("text {}", p.display()),
        };
        let folder = resolve_source(dir.path(), FormatHint::Detect).unwrap();
        assert_eq!(names(folder), ["a.bin", "b.bin", "notes.txt"]);
        let glob = resolve_source(&dir.path().join("*.bin"), FormatHint::Detect).unwrap();
        assert_eq!(names(glob), ["a.bin", "b.bin"]);
        let text = resolve_source(&dir.path().join("notes.txt"), FormatHint::Detect).unwrap();
        assert_eq!(text, DataSource::Text(dir.path().join("notes.txt")));
    }
}
