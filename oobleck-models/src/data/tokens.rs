//! Where a [`super::Dataset`]'s token ids live: the text corpus's u16 cache ([`TokenCache`]),
//! or pre-tokenized shards ([`ShardSet`]) read in place, concatenated in the order given.
//!
//! A window of `seq_len + 1` tokens is a range of the concatenation, so it may cross from one
//! shard into the next: [`TokenStore::extend_into`] copies it from both. Splits, windows and
//! the epoch order (batches.rs) see only token positions, never files, so a microbatch is the
//! same function of `(seed, epoch, iteration, microbatch)` whichever store holds the ids.

use std::ops::Range;
use std::path::Path;

use sha2::{Digest, Sha256};

use super::corpus::TokenCache;
use super::shards::{ShardFormat, TokenShard, RELEASE_BYTES};
use super::{DataError, Result};

/// Shards whose token bytes total less than this are hashed whole (see [`shards_sha256`]).
pub const FULL_HASH_LIMIT: u64 = 1 << 30;
/// Bytes hashed at each sampled place of a larger shard.
const SAMPLE_BYTES: usize = 1 << 20;
/// Distance between sampled places inside a larger shard.
const SAMPLE_EVERY: usize = 256 << 20;

/// The token ids of a dataset, whatever their source.
#[derive(Debug)]
pub(crate) enum TokenStore {
    /// A UTF-8 text corpus, tokenized once into its cache.
    Text(TokenCache),
    /// Pre-tokenized files (llm.c, raw u16, Megatron), concatenated.
    Shards(ShardSet),
}

impl TokenStore {
    pub fn len(&self) -> usize {
        match self {
            TokenStore::Text(cache) => cache.len(),
            TokenStore::Shards(set) => set.len(),
        }
    }

    /// See [`super::Dataset::tokens_sha256`].
    pub fn tokens_sha256(&self) -> &str {
        match self {
            TokenStore::Text(cache) => cache.tokens_sha256(),
            TokenStore::Shards(set) => &set.sha256,
        }
    }

    /// The text corpus's cache file; `None` for shards (read in place) or an in-memory cache.
    pub fn cache_path(&self) -> Option<&Path> {
        match self {
            TokenStore::Text(cache) => cache.path(),
            TokenStore::Shards(_) => None,
        }
    }

    /// The shards, in order (none for a text corpus).
    pub fn shards(&self) -> &[TokenShard] {
        match self {
            TokenStore::Text(_) => &[],
            TokenStore::Shards(set) => &set.shards,
        }
    }

    /// Calls `f` with each document's token range, in stream order: a text corpus is one
    /// document; a shard's documents are its index's or the spans its `end_of_text` ids mark
    /// ([`TokenShard::documents`]), never crossing into the next shard. The ranges cover the
    /// stream exactly.
    pub fn for_each_document(&self, end_of_text: u32, mut f: impl FnMut(Range<usize>)) {
        match self {
            TokenStore::Text(cache) => f(0..cache.len()),
            TokenStore::Shards(set) => {
                for (shard, &start) in set.shards.iter().zip(&set.starts) {
                    for doc in shard.documents(end_of_text) {
                        f(start + doc.start..start + doc.end);
                    }
                }
            }
        }
    }

    /// Appends tokens `[start, start + n)` to `out`. An error only for a shard value that is no
    /// token id (a corrupt signed or 64-bit Megatron file). Panics if the range is out of
    /// bounds: callers index within checked splits.
    pub fn extend_into(&self, start: usize, n: usize, out: &mut Vec<u32>) -> Result<()> {
        match self {
            TokenStore::Text(cache) => {
                cache.extend_into(start, n, out);
                Ok(())
            }
            TokenStore::Shards(set) => set.extend_into(start, n, out),
        }
    }
}

/// Token shards read as one stream: shard `k` holds tokens `[starts[k], starts[k] + len_k)`.
#[derive(Debug)]
pub struct ShardSet {
    shards: Vec<TokenShard>,
    /// Position of each shard's first token in the concatenation (non-decreasing).
    starts: Vec<usize>,
    len: usize,
    sha256: String,
}

impl ShardSet {
    /// The concatenation of `shards` in the given order; hashes them (see [`shards_sha256`]).
    /// `label` names the source in the error for no tokens at all.
    pub fn new(label: &Path, shards: Vec<TokenShard>) -> Result<Self> {
        let mut starts = Vec::with_capacity(shards.len());
        let mut len = 0usize;
        for shard in &shards {
            starts.push(len);
            len += shard.len();
        }
        if len == 0 {
            return Err(DataError::EmptyCorpus {
                path: label.to_path_buf(),
            });
        }
        let sha256 = shards_sha256(&shards);
        Ok(Self {
            shards,
            starts,
            len,
            sha256,
        })
    }

    /// Tokens in all shards together.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no tokens (never true for a set that [`ShardSet::new`] returned).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn shards(&self) -> &[TokenShard] {
        &self.shards
    }

    /// The shard holding token `i` (`i < len`) and `i`'s index inside it. Empty shards start
    /// where the next one starts, so the last shard starting at or before `i` is never empty.
    fn locate(&self, i: usize) -> (usize, usize) {
        let k = self.starts.partition_point(|&s| s <= i) - 1;
        (k, i - self.starts[k])
    }

    /// The first token at or after `at` (`at <= len`) that starts a document (documents never
    /// cross shards, so every shard's first token starts one); `len` when none does. See
    /// [`TokenShard::first_document_start`].
    pub fn first_document_start(&self, end_of_text: u32, at: usize) -> usize {
        if at >= self.len {
            return self.len;
        }
        let (k, offset) = self.locate(at);
        self.starts[k] + self.shards[k].first_document_start(end_of_text, offset)
    }

    /// Appends tokens `[start, start + n)`, from as many shards as the range crosses.
    pub fn extend_into(&self, start: usize, n: usize, out: &mut Vec<u32>) -> Result<()> {
        assert!(
            start + n <= self.len,
            "token range {start}..{} outside the {} tokens of the shards",
            start + n,
            self.len
        );
        let (mut at, end) = (start, start + n);
        while at < end {
            let (k, offset) = self.locate(at);
            let shard = &self.shards[k];
            let take = (end - at).min(shard.len() - offset);
            shard.copy_range(offset, offset + take, out)?;
            at += take;
        }
        Ok(())
    }
}

/// The identity of a set of shards, SHA-256 in hex, computed without reading terabytes:
///
/// - a tag (`oobleck token shards v1`), then for each shard in order its file name (not its
///   folder: the same files elsewhere are the same data), format (`llmc`, `raw-u16`,
///   `megatron`), dtype name and token count, one per line;
/// - then its token bytes as stored (no header): **all of them** when the token bytes of all
///   shards together are under [`FULL_HASH_LIMIT`] (1 GiB); otherwise, per shard, the first
///   MiB, one MiB at every multiple of 256 MiB inside the shard, and the last MiB.
///
/// So any change to a small corpus, and any change of a large one's files, sizes, order,
/// beginnings or ends, changes the identity; an edit in the unsampled middle of a large shard
/// does not (reading every byte of a 300B-token corpus on every start is not affordable).
pub fn shards_sha256(shards: &[TokenShard]) -> String {
    let total: u64 = shards.iter().map(|s| s.token_bytes().len() as u64).sum();
    let mut hash = Sha256::new();
    hash.update(b"oobleck token shards v1\n");
    for shard in shards {
        let name = shard
            .path()
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let format = match shard.format() {
            ShardFormat::LlmC => "llmc",
            ShardFormat::RawU16 => "raw-u16",
            ShardFormat::Megatron => "megatron",
        };
        let header = format!(
            "{name}\n{format}\n{}\n{}\n",
            shard.dtype().name(),
            shard.len()
        );
        hash.update(header.as_bytes());
        let data = shard.token_bytes();
        let ranges = if total < FULL_HASH_LIMIT {
            (0..data.len())
                .step_by(RELEASE_BYTES)
                .map(|at| at..(at + RELEASE_BYTES).min(data.len()))
                .collect()
        } else {
            sampled_ranges(data.len())
        };
        for range in ranges {
            hash.update(&data[range.clone()]);
            // The folio around it too: the header's and the last page's folios would stay
            // mapped otherwise (1.6 MB a shard, 41 MB for a 5 GB corpus of 200 MB shards).
            shard.release_around(range);
        }
    }
    hex::encode(hash.finalize())
}

/// The byte ranges of a large shard that [`shards_sha256`] reads: the first MiB, a MiB at each
/// multiple of 256 MiB, the last MiB (ranges may overlap in a short shard; each is hashed).
fn sampled_ranges(len: usize) -> Vec<Range<usize>> {
    let mut ranges = Vec::with_capacity(2 + len / SAMPLE_EVERY);
    ranges.push(0..len.min(SAMPLE_BYTES));
    let mut at = SAMPLE_EVERY;
    while at < len {
        ranges.push(at..(at + SAMPLE_BYTES).min(len));
        at += SAMPLE_EVERY;
    }
    ranges.push(len.saturating_sub(SAMPLE_BYTES)..len);
    ranges
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_shard_is_sampled_at_its_ends_and_every_256_mib() {
        let mib = 1 << 20;
        assert_eq!(sampled_ranges(10), vec![0..10, 0..10]);
        assert_eq!(
            sampled_ranges(600 * mib),
            vec![
                0..mib,
                256 * mib..257 * mib,
                512 * mib..513 * mib,
                599 * mib..600 * mib
            ]
        );
    }
}
