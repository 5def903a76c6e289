//! `manifest.json`: what a prepared folder holds, what it was made from, and where each
//! finished shard ends in the sources (the resume point).
//!
//! It is rewritten (temporary name, fsync, rename) after every finished shard with
//! `complete: false`, and once more at the end with `complete: true` and the totals, so a
//! killed run leaves a manifest that lists exactly the shards that were renamed before it.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::error::{write_err, PrepareError, Result};
use crate::data::LLMC_HEADER_BYTES;

/// Version of the manifest's layout; a folder of another version is refused.
pub const MANIFEST_VERSION: u32 = 1;
/// The manifest's file name inside the output folder.
pub const MANIFEST_FILE: &str = "manifest.json";

/// The whole manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format_version: u32,
    /// Whether every source was read to its end and every shard written.
    pub complete: bool,
    pub tokenizer: TokenizerEntry,
    /// "u16" (llm.c magic 20240520) or "u32" (magic 20240801).
    pub dtype: String,
    /// Most tokens a shard holds, unless one document alone is longer.
    pub shard_tokens: u64,
    /// JSONL field (or Parquet column) read as the text.
    pub text_field: String,
    pub sources: Vec<SourceEntry>,
    pub shards: Vec<ShardEntry>,
    pub totals: Totals,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerEntry {
    /// SHA-256 of the tokenizer's files ([`crate::data::Gpt2Tokenizer::hash`]).
    pub sha256: String,
    pub vocab_size: u64,
    pub end_of_text_id: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceEntry {
    pub path: String,
    /// Size on disk.
    pub bytes: u64,
    /// SHA-256 of the bytes on disk (compressed, for a compressed source).
    pub sha256: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardEntry {
    pub name: String,
    /// Tokens in the shard, end-of-text ids included.
    pub tokens: u64,
    pub documents: u64,
    /// SHA-256 of the shard file.
    pub sha256: String,
    /// Where the reading stands after this shard's last document: the resume point.
    pub end: Position,
}

/// A place in the sources: the next document to read is document `document` (0-based, bad
/// records not counted) of source `source`; `skipped_records` bad records were skipped before.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Position {
    pub source: usize,
    pub document: u64,
    pub skipped_records: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Totals {
    pub tokens: u64,
    pub documents: u64,
    pub shards: u64,
    pub source_bytes: u64,
    pub skipped_records: u64,
}

impl Manifest {
    /// Recomputes the totals from the shards (and the sources' sizes).
    pub fn update_totals(&mut self) {
        let last = self.shards.last().map(|s| s.end).unwrap_or_default();
        self.totals = Totals {
            tokens: self.shards.iter().map(|s| s.tokens).sum(),
            documents: self.shards.iter().map(|s| s.documents).sum(),
            shards: self.shards.len() as u64,
            source_bytes: self.sources.iter().map(|s| s.bytes).sum(),
            skipped_records: last.skipped_records,
        };
    }

    /// How many of the listed shards, from the first, lie in `dir` at the size their token
    /// count gives (the llm.c header and the tokens): a missing shard, or one a kill cut
    /// short, ends the count.
    pub fn shards_on_disk(&self, dir: &Path) -> usize {
        let width = if self.dtype == "u32" { 4 } else { 2 };
        self.shards
            .iter()
            .take_while(|s| {
                let size = LLMC_HEADER_BYTES as u64 + s.tokens * width;
                std::fs::metadata(dir.join(&s.name)).is_ok_and(|m| m.len() == size)
            })
            .count()
    }

    /// Writes `dir/manifest.json` atomically (temporary name, fsync, rename).
    pub fn save(&self, dir: &Path) -> Result<()> {
        let path = dir.join(MANIFEST_FILE);
        let tmp = dir.join(format!("{MANIFEST_FILE}.tmp"));
        let mut text = serde_json::to_string_pretty(self).expect("a manifest always serialises");
        text.push('\n');
        write_synced(&tmp, text.as_bytes())?;
        std::fs::rename(&tmp, &path).map_err(write_err(&path))
    }

    /// Reads `dir/manifest.json`; `None` when there is none.
    pub fn load(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join(MANIFEST_FILE);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(super::error::read_err(&path)(e)),
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| PrepareError::BadManifest {
                path,
                problem: e.to_string(),
            })
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(write_err(path))?;
    f.write_all(bytes).map_err(write_err(path))?;
    f.sync_all().map_err(write_err(path))
}
