//! Readers of the pre-tokenized formats people bring: llm.c / modded-nanoGPT shards, nanoGPT's
//! raw `train.bin`, and Megatron-LM / NeMo `.bin` + `.idx` pairs. Each format's file draws its
//! layout and says what is checked; all of them open as one [`TokenShard`], a memory map read
//! as token ids.
//!
//! ```text
//!  path ──open_shard(path, hint)──> which format?          (detect, below)
//!            llmc.rs      256 x int32 header, u16/u32 tokens
//!            raw.rs       bare u16 tokens (only when the caller says so)
//!            megatron.rs  .idx (lengths, pointers, documents) + .bin tokens
//!                     └──> TokenShard: len, token(i), copy_range, check_vocab(vocab),
//!                          documents(end_of_text)            (view.rs; dtype.rs reads ids)
//! ```
//!
//! Detection, in order: a `.idx` path (or a Megatron prefix with no extension whose `.idx`
//! exists) opens the pair; a file starting with an llm.c magic is an llm.c shard; a file with
//! a sibling `.idx` is Megatron's `.bin`; otherwise the caller's [`FormatHint::RawU16`] reads
//! it as nanoGPT's raw u16 tokens, and without it the error says to pass `--data-format u16`.
//! A self-describing header (llm.c magic, sibling index) wins over the hint: a raw file cannot
//! carry a consistent llm.c header or a matching index by chance, while a hint given for a
//! whole folder of files may not fit every one.
//!
//! Every check happens on open, so a shard that opened reads without format errors; the only
//! later errors are values that are no token id ([`TokenShard::copy_range`]) and, where the
//! caller asks, ids at or above the model's vocabulary ([`TokenShard::check_vocab`]).

mod dtype;
mod error;
#[cfg(test)]
pub(crate) mod fixtures;
mod llmc;
mod megatron;
mod raw;
#[cfg(test)]
mod tests;
mod view;

pub use dtype::TokenDtype;
pub use error::{FirstWord, ShardError};
pub use llmc::{
    HEADER_BYTES as LLMC_HEADER_BYTES, MAGIC_U16 as LLMC_MAGIC_U16, MAGIC_U32 as LLMC_MAGIC_U32,
};
pub use megatron::INDEX_MAGIC as MEGATRON_INDEX_MAGIC;
pub use view::{DelimiterPlacement, DocumentBoundaries, Documents, TokenShard, RELEASE_BYTES};

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::{io_err, DataError, Result};

/// A token shard's on-disk format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShardFormat {
    /// llm.c / modded-nanoGPT: 1024-byte header, then u16 or u32 tokens.
    LlmC,
    /// nanoGPT's `train.bin`: u16 tokens, no header.
    RawU16,
    /// Megatron-LM / NeMo: a `.bin` of tokens and its `.idx`.
    Megatron,
}

impl std::fmt::Display for ShardFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ShardFormat::LlmC => "llm.c shard",
            ShardFormat::RawU16 => "raw u16 tokens",
            ShardFormat::Megatron => "Megatron .bin/.idx",
        })
    }
}

/// What the caller knows about a file's format (`--data-format`); in configs `"detect"` or
/// `"u16"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum FormatHint {
    /// Detect it from the header and the files beside it.
    #[default]
    #[serde(rename = "detect")]
    Detect,
    /// A file with no recognised header is nanoGPT's raw u16 tokens.
    #[serde(rename = "u16")]
    RawU16,
}

/// Opens the token shard at `path`, detecting its format (see the module docs).
pub fn open_shard(path: &Path, hint: FormatHint) -> Result<TokenShard> {
    let idx = megatron_index_of(path);
    if path.extension().is_some_and(|e| e == "idx") || (!path.exists() && idx.exists()) {
        return open_megatron(path);
    }
    let map = map_file(path, "token shard")?;
    if llmc::has_magic(&map) {
        return from_map(path, ShardFormat::LlmC, map, llmc::parse);
    }
    if idx.exists() {
        return open_megatron(path);
    }
    match hint {
        FormatHint::RawU16 => from_map(path, ShardFormat::RawU16, map, raw::parse),
        FormatHint::Detect => Err(ShardError::Unrecognised {
            path: path.to_path_buf(),
            first: FirstWord(llmc::int32_at(&map, 0)),
            idx,
        }
        .into()),
    }
}

/// Opens `path` as an llm.c shard, whatever its name.
pub fn open_llmc(path: &Path) -> Result<TokenShard> {
    let map = map_file(path, "llm.c shard")?;
    from_map(path, ShardFormat::LlmC, map, llmc::parse)
}

/// Opens `path` as nanoGPT's raw u16 tokens (no header).
pub fn open_raw_u16(path: &Path) -> Result<TokenShard> {
    let map = map_file(path, "raw u16 token file")?;
    from_map(path, ShardFormat::RawU16, map, raw::parse)
}

/// Opens a Megatron pair named by its `.bin`, its `.idx`, or its prefix (`data/corpus_text_document`
/// for `data/corpus_text_document.bin` and `.idx`). A missing half is an error naming the path
/// it was expected at.
pub fn open_megatron(path: &Path) -> Result<TokenShard> {
    let (bin, idx) = if path.extension().is_some_and(|e| e == "idx") {
        (megatron::data_path(path), path.to_path_buf())
    } else if path.extension().is_some_and(|e| e == "bin") {
        (path.to_path_buf(), megatron::index_path(path))
    } else {
        (with_suffix(path, ".bin"), with_suffix(path, ".idx"))
    };
    if !idx.exists() && bin.exists() {
        return Err(ShardError::MissingIndex { bin, idx }.into());
    }
    if !bin.exists() && idx.exists() {
        return Err(ShardError::MissingData { idx, bin }.into());
    }
    let bin_map = map_file(&bin, "Megatron data file")?;
    let idx_map = map_file(&idx, "Megatron index")?;
    let layout = megatron::parse(&bin, bin_map.len(), &idx, idx_map)?;
    Ok(TokenShard::new(bin, ShardFormat::Megatron, bin_map, layout))
}

/// The `.idx` that would make `path` half of a Megatron pair: beside a `.bin`, or after a
/// prefix.
fn megatron_index_of(path: &Path) -> PathBuf {
    if path.extension().is_some_and(|e| e == "bin") {
        megatron::index_path(path)
    } else {
        with_suffix(path, ".idx")
    }
}

/// `path` with `suffix` appended to its last component (Megatron's `prefix + ".idx"`, which
/// keeps any dots in the prefix).
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// A shard of `format` from the mapped file at `path`, laid out by `parse`.
fn from_map(
    path: &Path,
    format: ShardFormat,
    map: Mmap,
    parse: fn(&Path, &[u8]) -> std::result::Result<view::Layout, ShardError>,
) -> Result<TokenShard> {
    let layout = parse(path, &map)?;
    Ok(TokenShard::new(path.to_path_buf(), format, map, layout))
}

/// Maps the file at `path` read-only; `what` names it in a not-found error.
fn map_file(path: &Path, what: &'static str) -> Result<Mmap> {
    let file = File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => DataError::NotFound {
            what,
            path: path.to_path_buf(),
        },
        _ => io_err(path)(e),
    })?;
    if file.metadata().map_err(io_err(path))?.is_dir() {
        return Err(ShardError::Folder {
            path: path.to_path_buf(),
        }
        .into());
    }
    // SAFETY: shards are read-only inputs; the map stays valid unless another process
    // truncates the file while it is open, which would be an outside mistake (reads past the
    // new end fault), the same contract as every mmap-based loader (numpy.memmap in Megatron).
    unsafe { Mmap::map(&file) }.map_err(io_err(path))
}
