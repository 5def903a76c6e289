//! Which files a preparation reads, in which order, and how each is decoded.
//!
//! A source argument is a file, a folder (every file below it, recursively, sorted by path) or
//! a glob (`data/*.jsonl.zst`, matches sorted by path). Arguments keep the order they were
//! given; a file named twice is read once, where it first appears. The format comes from the
//! extension: `.txt`/`.md` (one file is one document) or `.jsonl`/`.json` (one JSON object a
//! line), each optionally `.gz` or `.zst`, or `.parquet` (one string column; Parquet compresses
//! its own pages).

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::error::{read_err, PrepareError, Result};

/// How a source's records are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// The whole file is one document.
    Text,
    /// One JSON object a line; the document is one string field.
    JsonLines,
    /// A Parquet file; the document is one string column's value in each row.
    Parquet,
}

/// How a source's bytes are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    Plain,
    Gzip,
    Zstd,
}

impl Codec {
    pub fn name(self) -> &'static str {
        match self {
            Codec::Plain => "plain",
            Codec::Gzip => "gzip",
            Codec::Zstd => "zstd",
        }
    }
}

/// One file to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceFile {
    pub path: PathBuf,
    pub layout: Layout,
    pub codec: Codec,
    /// Size on disk (compressed), bytes: the progress counts these.
    pub bytes: u64,
}

/// The format of `path`, from its extension.
pub fn format_of(path: &Path) -> Result<(Layout, Codec)> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    let (stem, codec) = if let Some(s) = name.strip_suffix(".gz") {
        (s, Codec::Gzip)
    } else if let Some(s) = name.strip_suffix(".zst") {
        (s, Codec::Zstd)
    } else {
        (name.as_str(), Codec::Plain)
    };
    if name.ends_with(".parquet") {
        return Ok((Layout::Parquet, Codec::Plain));
    }
    let layout = if stem.ends_with(".txt") || stem.ends_with(".md") {
        Layout::Text
    } else if stem.ends_with(".jsonl") || stem.ends_with(".json") {
        Layout::JsonLines
    } else {
        return Err(PrepareError::UnknownFormat {
            path: path.to_path_buf(),
        });
    };
    Ok((layout, codec))
}

/// Expands the source arguments into the files to read, in reading order.
pub fn expand_sources(args: &[String]) -> Result<Vec<SourceFile>> {
    let mut paths: Vec<PathBuf> = Vec::new();
    for arg in args {
        let found = expand_one(arg)?;
        if found.is_empty() {
            return Err(PrepareError::NoMatch {
                pattern: arg.clone(),
            });
        }
        for p in found {
            if !paths.contains(&p) {
                paths.push(p);
            }
        }
    }
    paths
        .into_iter()
        .map(|path| {
            let (layout, codec) = format_of(&path)?;
            let bytes = std::fs::metadata(&path).map_err(read_err(&path))?.len();
            Ok(SourceFile {
                path,
                layout,
                codec,
                bytes,
            })
        })
        .collect()
}

fn expand_one(arg: &str) -> Result<Vec<PathBuf>> {
    let path = Path::new(arg);
    if path.is_dir() {
        let mut files = Vec::new();
        walk(path, &mut files)?;
        files.sort();
        return Ok(files);
    }
    if path.exists() || !arg.contains(['*', '?', '[']) {
        if !path.exists() {
            return Err(PrepareError::NotFound {
                path: path.to_path_buf(),
            });
        }
        return Ok(vec![path.to_path_buf()]);
    }
    let matches = glob::glob(arg).map_err(|e| PrepareError::BadPattern {
        pattern: arg.to_string(),
        problem: e.to_string(),
    })?;
    let mut files = Vec::new();
    for m in matches {
        let p = m.map_err(|e| PrepareError::Read {
            path: e.path().to_path_buf(),
            source: std::io::Error::new(e.error().kind(), e.error().to_string()),
        })?;
        if p.is_dir() {
            walk(&p, &mut files)?;
        } else {
            files.push(p);
        }
    }
    files.sort();
    Ok(files)
}

/// Every file below `dir`; hidden files (names starting with '.') are not data, nor are the
/// `*.prepared` folders `train --data` prepares raw sources into (beside them, by default).
fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(read_err(dir))? {
        let entry = entry.map_err(read_err(dir))?;
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        if path.is_dir() {
            if name.ends_with(super::cache::PREPARED_SUFFIX) {
                continue;
            }
            walk(&path, out)?;
        } else {
            out.push(path);
        }
    }
    Ok(())
}

/// SHA-256 (hex) of a file's bytes as they are on disk.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).map_err(read_err(path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(read_err(path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}
