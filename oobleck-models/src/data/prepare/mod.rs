//! `oobleck data prepare`: raw text sources tokenized with every core into llm.c token shards
//! and a manifest, resumable after a kill, byte-identical whatever the number of workers.
//!
//! ```text
//!  SOURCE... ─ sources.rs: files, folders (recursive, sorted), globs; format by extension
//!      │        (.txt .md: a file is a document; .jsonl .json: field `text` of each line;
//!      │         either also .gz or .zst; .parquet: column `text` of each row); each
//!      │        source's size and SHA-256
//!      v
//!  resume.rs: same sources, tokenizer and settings as DIR/manifest.json? keep its shards
//!      │       and start after the last one; different? refuse, naming what differs
//!      v
//!  pipeline.rs: reader ─ batches ─> N tokenizing workers ─> writer, in order, M in flight
//!      v        (readers.rs streams each source's documents; parquet_reader.rs a row
//!               group's batch of rows at a time)
//!  writer.rs: DIR/shard-000000.bin ... (llm.c: 256 x int32 header, u16 or u32 tokens, the
//!             end-of-text id before every document), each renamed into place when full,
//!             then manifest.json (manifest.rs) rewritten to list it
//! ```
//!
//! The shards are a function of the sources' bytes, the tokenizer and `--shard-tokens`
//! only: documents keep their order, and a shard closes before the first document that
//! would overflow it (a document is never split; one longer than a shard gets a shard of its
//! own). Memory is bounded by the batches in flight, one text file (a text file is one
//! document), one JSONL line or one Parquet page and batch of rows, and a write buffer, never
//! by the corpus.

mod cache;
#[cfg(test)]
mod cache_tests;
mod error;
mod inventory;
mod manifest;
mod parquet_reader;
#[cfg(test)]
mod parquet_tests;
mod pipeline;
mod readers;
mod resume;
mod sources;
#[cfg(test)]
mod tests;
mod writer;

pub use cache::{prepare_cached, PREPARED_SUFFIX};
pub use error::{PrepareError, Result};
pub use inventory::{inventory, prune, CacheEntry, CacheState};
pub use manifest::{
    Manifest, Position, ShardEntry, SourceEntry, TokenizerEntry, Totals, MANIFEST_FILE,
    MANIFEST_VERSION,
};
pub use readers::{DocReader, ReadOptions};
pub use sources::{expand_sources, format_of, Codec, Layout, SourceFile};
pub use writer::shard_name;

use std::path::PathBuf;

use rayon::prelude::*;

use crate::data::{Gpt2Tokenizer, END_OF_TEXT_ID};

/// Default `--shard-tokens`: 100 million tokens, 200 MB of u16 (llm.c's FineWeb shards).
pub const DEFAULT_SHARD_TOKENS: u64 = 100_000_000;
/// Default JSONL text field and Parquet text column.
pub const DEFAULT_TEXT_FIELD: &str = "text";

/// What to prepare, and how.
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    /// Files, folders or globs, in reading order.
    pub sources: Vec<String>,
    /// Output folder (created if missing).
    pub out: PathBuf,
    /// Most tokens a shard holds (unless one document alone is longer).
    pub shard_tokens: u64,
    /// Tokenizing threads.
    pub workers: usize,
    pub read: ReadOptions,
}

/// Counters for a progress line; tokens and documents count this run only.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    /// Bytes of the sources read from disk (compressed) and their total.
    pub bytes_read: u64,
    pub bytes_total: u64,
    pub tokens: u64,
    pub documents: u64,
    /// Shards finished, kept ones included.
    pub shards: u64,
    pub skipped_records: u64,
}

/// What a preparation did.
#[derive(Debug, Clone)]
pub struct Summary {
    pub manifest: Manifest,
    /// Shards kept from an earlier, interrupted run.
    pub kept_shards: usize,
    /// The folder was already complete: nothing was tokenized.
    pub already_complete: bool,
}

/// Tokenizes `options.sources` into shards in `options.out` (see the module docs).
pub fn prepare(
    options: &PrepareOptions,
    tokenizer: &Gpt2Tokenizer,
    progress: &mut dyn FnMut(&Progress),
) -> Result<Summary> {
    if options.workers == 0 {
        return Err(PrepareError::Zero { what: "--workers" });
    }
    if options.shard_tokens == 0 {
        return Err(PrepareError::Zero {
            what: "--shard-tokens",
        });
    }
    let sources = expand_sources(&options.sources)?;
    let fresh = fresh_manifest(options, tokenizer, &sources)?;
    let out = &options.out;
    std::fs::create_dir_all(out).map_err(error::write_err(out))?;
    let resume = resume::plan_resume(out, fresh)?;
    resume::remove_stale_temps(out)?;
    let kept_shards = resume.manifest.shards.len();
    if resume.done {
        return Ok(Summary {
            manifest: resume.manifest,
            kept_shards,
            already_complete: true,
        });
    }
    let mut writer = writer::ShardWriter::new(out, resume.manifest);
    let plan = pipeline::Plan {
        sources: &sources,
        read: &options.read,
        start: resume.start,
        workers: options.workers,
    };
    pipeline::run(&plan, tokenizer, &mut writer, progress)?;
    let manifest = writer.finish()?;
    Ok(Summary {
        manifest,
        kept_shards,
        already_complete: false,
    })
}

/// This run's manifest before any shard: settings, tokenizer and sources (hashed in parallel).
fn fresh_manifest(
    options: &PrepareOptions,
    tokenizer: &Gpt2Tokenizer,
    sources: &[SourceFile],
) -> Result<Manifest> {
    let hashes = rayon::ThreadPoolBuilder::new()
        .num_threads(options.workers)
        .build()
        .map(|pool| {
            pool.install(|| {
                sources
                    .par_iter()
                    .map(|s| sources::sha256_file(&s.path))
                    .collect::<Result<Vec<_>>>()
            })
        })
        .unwrap_or_else(|_| {
            sources
                .iter()
                .map(|s| sources::sha256_file(&s.path))
                .collect()
        })?;
    let vocab = tokenizer.vocab_size() as u64;
    let mut manifest = Manifest {
        format_version: MANIFEST_VERSION,
        complete: false,
        tokenizer: TokenizerEntry {
            sha256: tokenizer.hash().to_string(),
            vocab_size: vocab,
            end_of_text_id: END_OF_TEXT_ID,
        },
        dtype: if vocab <= 1 << 16 { "u16" } else { "u32" }.to_string(),
        shard_tokens: options.shard_tokens,
        text_field: options.read.text_field.clone(),
        sources: sources
            .iter()
            .zip(hashes)
            .map(|(s, sha256)| SourceEntry {
                path: s.path.display().to_string(),
                bytes: s.bytes,
                sha256,
            })
            .collect(),
        shards: Vec::new(),
        totals: Totals::default(),
    };
    manifest.update_totals();
    Ok(manifest)
}
