//! [`TokenShard`]: one memory-mapped token file, whatever its format, read as token ids.
//!
//! Nothing is read whole: every accessor touches only the bytes of the tokens it returns (the
//! kernel pages them in), so a shard of any size costs address space, not memory. The scans
//! that do read every token (the vocabulary check, the document scan, the identity hash) give
//! the pages they read back to the kernel every [`RELEASE_BYTES`] ([`TokenShard::release`]),
//! and so does every copy of a window, so neither opening a corpus of any size nor a long run
//! over it grows the process's resident memory.

use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::{Mmap, UncheckedAdvice};

use super::dtype::{first_outside, position_of, push_ids, with_word, TokenDtype, Word};
use super::error::ShardError;
use super::megatron::DocumentIndex;
use super::ShardFormat;
use crate::data::{DataError, Result};

/// Bytes a whole-shard scan reads between two [`TokenShard::release`]s.
pub const RELEASE_BYTES: usize = 16 << 20;

/// The largest page-cache folio a read maps at once (a PMD, 2 MiB on x86-64 and arm64).
const FOLIO_BYTES: usize = 2 << 20;

/// Where a shard without a document index puts the end-of-text delimiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DelimiterPlacement {
    /// Each document starts with the delimiter (llm.c, modded-nanoGPT).
    Before,
    /// Each document ends with the delimiter (nanoGPT's `prepare.py`).
    After,
}

/// How a shard's documents can be found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DocumentBoundaries {
    /// The format indexes them (Megatron): [`TokenShard::document`] is O(1).
    Indexed { documents: usize },
    /// Documents are separated by the tokenizer's end-of-text id in the stream; the shard does
    /// not know which id that is. [`TokenShard::documents`] finds them by scanning, lazily.
    Delimited(DelimiterPlacement),
}

/// Where the tokens of a shard are and how its documents are marked: what each format's
/// parser works out from the header.
pub(super) struct Layout {
    pub dtype: TokenDtype,
    /// Byte offset of token 0 in the mapped file.
    pub start: usize,
    /// Number of tokens.
    pub len: usize,
    pub documents: DocumentLayout,
}

pub(super) enum DocumentLayout {
    Delimited(DelimiterPlacement),
    Indexed(DocumentIndex),
}

/// The token ids of one shard file (llm.c, raw u16, or the `.bin` of a Megatron pair),
/// memory-mapped and validated when opened (see [`super::open_shard`]).
///
/// `Send + Sync`: any number of threads may read one shard. The mapping assumes nobody
/// truncates the file while it is open (a truncated mapping faults); shards are read-only
/// inputs, so that would be an outside mistake.
pub struct TokenShard {
    path: PathBuf,
    format: ShardFormat,
    map: Mmap,
    layout: Layout,
}

impl std::fmt::Debug for TokenShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenShard")
            .field("path", &self.path)
            .field("format", &self.format)
            .field("dtype", &self.layout.dtype)
            .field("len", &self.layout.len)
            .finish()
    }
}

impl TokenShard {
    /// A shard of the mapped file `map` at `path`, whose parser returned `layout`.
    pub(super) fn new(path: PathBuf, format: ShardFormat, map: Mmap, layout: Layout) -> Self {
        let end = layout.start + layout.len * layout.dtype.width();
        assert!(
            end <= map.len(),
            "parsers check that the tokens lie inside the file"
        );
        Self {
            path,
            format,
            map,
            layout,
        }
    }

    /// The token file (for Megatron, the `.bin`).
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn format(&self) -> ShardFormat {
        self.format
    }

    pub fn dtype(&self) -> TokenDtype {
        self.layout.dtype
    }

    /// Bytes per token on disk: 1, 2, 4 or 8.
    pub fn width(&self) -> usize {
        self.layout.dtype.width()
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.layout.len
    }

    pub fn is_empty(&self) -> bool {
        self.layout.len == 0
    }

    /// The token bytes (`len() x width()`), without any header.
    fn data(&self) -> &[u8] {
        let start = self.layout.start;
        &self.map[start..start + self.layout.len * self.width()]
    }

    /// The token bytes as stored (`len() x width()`, no header), for hashing a shard's identity.
    pub fn token_bytes(&self) -> &[u8] {
        self.data()
    }

    /// Byte offset of token `index` in the file, for messages.
    fn byte_of(&self, index: usize) -> u64 {
        (self.layout.start + index * self.width()) as u64
    }

    /// Token `i`. An error only for a value that is no token id (negative, or past u32, in a
    /// signed or 64-bit Megatron file). Panics if `i >= len()`, like slice indexing.
    pub fn token(&self, i: usize) -> Result<u32> {
        assert!(
            i < self.len(),
            "token {i} outside the {} tokens of {}",
            self.len(),
            self.path.display()
        );
        let width = self.width();
        let bytes = &self.data()[i * width..(i + 1) * width];
        let value = with_word!(self.layout.dtype, W => W::read_wide(bytes));
        u32::try_from(value).map_err(|_| self.not_an_id(i, value))
    }

    /// Appends tokens `[start, end)` to `out`. On error (a value that is no token id) `out` is
    /// left as it was. Panics unless `start <= end <= len()`, like slice indexing.
    pub fn copy_range(&self, start: usize, end: usize, out: &mut Vec<u32>) -> Result<()> {
        assert!(
            start <= end && end <= self.len(),
            "token range {start}..{end} outside the {} tokens of {}",
            self.len(),
            self.path.display()
        );
        let width = self.width();
        let bytes = &self.data()[start * width..end * width];
        let before = out.len();
        out.reserve(end - start);
        let bad = with_word!(self.layout.dtype, W => push_ids::<W>(bytes, out));
        self.release_around(start * width..end * width);
        match bad {
            None => Ok(()),
            Some((offset, value)) => {
                out.truncate(before);
                Err(self.not_an_id(start + offset, value))
            }
        }
    }

    fn not_an_id(&self, index: usize, value: i64) -> DataError {
        ShardError::NotATokenId {
            path: self.path.clone(),
            index: index as u64,
            byte: self.byte_of(index),
            value,
        }
        .into()
    }

    /// Gives the pages of token bytes `range` (of [`Self::token_bytes`]) back to the kernel:
    /// they leave this process's resident set and stay in the page cache, and a later read
    /// maps them again. Whole-shard scans call it behind them.
    pub fn release(&self, range: Range<usize>) {
        let start = self.layout.start + range.start;
        let len = range.end.min(self.data().len()).saturating_sub(range.start);
        if len == 0 {
            return;
        }
        // SAFETY: the map is a read-only shared mapping of a file nobody writes while it is
        // open (see the type's docs): MADV_DONTNEED only drops this process's page-table
        // entries, and any later read, through a slice borrowed before or after, faults the
        // same bytes back in from the page cache. Nothing is zeroed (that happens to private
        // anonymous mappings only). A failure only leaves the pages resident.
        let _ = unsafe {
            self.map
                .unchecked_advise_range(UncheckedAdvice::DontNeed, start, len)
        };
    }

    /// [`Self::release`]s the [`FOLIO_BYTES`]-aligned span of the file around token bytes
    /// `range`: a read of a few tokens maps the whole large folio of the page cache they lie
    /// in (up to 2 MiB), so releasing only their own pages would leave the rest mapped, and a
    /// long run's random windows would map the whole corpus into the resident set.
    pub fn release_around(&self, range: Range<usize>) {
        let start = self.layout.start;
        let lo = (start + range.start) / FOLIO_BYTES * FOLIO_BYTES;
        let hi = (start + range.end).div_ceil(FOLIO_BYTES) * FOLIO_BYTES;
        self.release(lo.saturating_sub(start)..hi.saturating_sub(start));
    }

    /// Checks that every token is an id below `vocab`; the error names the first that is not,
    /// its index and byte offset. Scans the map in pieces of a million tokens on rayon's pool,
    /// so a multi-GB shard is checked at memory (or disk) speed, releasing what it read every
    /// [`RELEASE_BYTES`].
    pub fn check_vocab(&self, vocab: usize) -> Result<()> {
        let limit = i64::try_from(vocab).unwrap_or(i64::MAX);
        let data = self.data();
        let step = RELEASE_BYTES - RELEASE_BYTES % self.width();
        let mut found = None;
        for at in (0..data.len()).step_by(step) {
            let chunk = &data[at..(at + step).min(data.len())];
            let first = with_word!(self.layout.dtype, W => first_outside::<W>(chunk, limit));
            self.release(at..at + chunk.len());
            if let Some((index, id)) = first {
                found = Some((at / self.width() + index, id));
                break;
            }
        }
        match found {
            None => Ok(()),
            Some((index, id)) => Err(ShardError::OutOfVocabulary {
                path: self.path.clone(),
                index: index as u64,
                byte: self.byte_of(index),
                id,
                vocab: vocab as u64,
            }
            .into()),
        }
    }

    /// The first position in `range` holding token `id`, scanning only that range. Panics
    /// unless `range` lies inside `0..len()`.
    pub fn find_token(&self, id: u32, range: Range<usize>) -> Option<usize> {
        assert!(
            range.start <= range.end && range.end <= self.len(),
            "token range {}..{} outside the {} tokens of {}",
            range.start,
            range.end,
            self.len(),
            self.path.display()
        );
        let width = self.width();
        let bytes = &self.data()[range.start * width..range.end * width];
        let at = with_word!(self.layout.dtype, W => position_of::<W>(bytes, id.into()));
        at.map(|p| range.start + p)
    }

    /// How this shard's documents are marked.
    pub fn document_boundaries(&self) -> DocumentBoundaries {
        match &self.layout.documents {
            DocumentLayout::Indexed(index) => DocumentBoundaries::Indexed {
                documents: index.len(),
            },
            DocumentLayout::Delimited(placement) => DocumentBoundaries::Delimited(*placement),
        }
    }

    /// Token range of document `d` of an indexed shard (Megatron); `None` past the last
    /// document or for a shard without an index (use [`Self::documents`]).
    pub fn document(&self, d: usize) -> Option<Range<usize>> {
        match &self.layout.documents {
            DocumentLayout::Indexed(index) if d < index.len() => Some(index.tokens(d)),
            _ => None,
        }
    }

    /// The first token at or after `at` (`at <= len()`) that starts a document of
    /// [`Self::documents`], or `len()` when none does: a binary search of an index, a scan
    /// for the next `end_of_text` otherwise (reading only up to it). Token 0 always starts one.
    pub fn first_document_start(&self, end_of_text: u32, at: usize) -> usize {
        let len = self.len();
        assert!(
            at <= len,
            "token {at} past the {len} tokens of {}",
            self.path.display()
        );
        if at == 0 || at == len {
            return at;
        }
        match &self.layout.documents {
            DocumentLayout::Indexed(index) => {
                let (mut lo, mut hi) = (0, index.len());
                while lo < hi {
                    let mid = lo + (hi - lo) / 2;
                    if index.tokens(mid).start < at {
                        lo = mid + 1;
                    } else {
                        hi = mid;
                    }
                }
                if lo < index.len() {
                    index.tokens(lo).start
                } else {
                    len
                }
            }
            // A delimiter opens its document: the next one at or after `at` starts one.
            DocumentLayout::Delimited(DelimiterPlacement::Before) => self
                .find_token_released(end_of_text, at..len)
                .unwrap_or(len),
            // A delimiter closes its document: the token after it starts the next.
            DocumentLayout::Delimited(DelimiterPlacement::After) => self
                .find_token_released(end_of_text, at - 1..len)
                .map_or(len, |p| p + 1),
        }
    }

    /// [`Self::find_token`] in pieces of [`RELEASE_BYTES`], each [`Self::release_around`]d
    /// once read: a lookup at a random place leaves nothing mapped, not even the page cache's
    /// large folio around it (2 MiB per lookup otherwise; 240 MB for the block edges of a
    /// 5 GB corpus).
    fn find_token_released(&self, id: u32, range: Range<usize>) -> Option<usize> {
        let width = self.width();
        let piece = RELEASE_BYTES / width;
        let mut at = range.start;
        while at < range.end {
            let end = (at + piece).min(range.end);
            let found = self.find_token(id, at..end);
            self.release_around(at * width..found.map_or(end, |p| p + 1) * width);
            if found.is_some() {
                return found;
            }
            at = end;
        }
        None
    }

    /// The token ranges of the documents, in order, found lazily. An indexed shard reads its
    /// index and ignores `end_of_text`; any other shard splits at `end_of_text` (GPT-2's is
    /// [`crate::data::END_OF_TEXT_ID`], 50256) with its format's [`DelimiterPlacement`],
    /// scanning only as far as the documents asked for. The ranges cover the shard exactly.
    pub fn documents(&self, end_of_text: u32) -> Documents<'_> {
        Documents {
            shard: self,
            end_of_text,
            next: 0,
            released: 0,
        }
    }
}

/// Iterator of [`TokenShard::documents`]; a delimited shard's scan releases the tokens it has
/// read every [`RELEASE_BYTES`].
pub struct Documents<'a> {
    shard: &'a TokenShard,
    end_of_text: u32,
    /// The next document's number (indexed) or first token (delimited).
    next: usize,
    /// Tokens before this one were released.
    released: usize,
}

impl Iterator for Documents<'_> {
    type Item = Range<usize>;

    fn next(&mut self) -> Option<Range<usize>> {
        let len = self.shard.len();
        let start = self.next;
        let placement = match &self.shard.layout.documents {
            DocumentLayout::Indexed(_) => {
                let range = self.shard.document(start)?;
                self.next += 1;
                return Some(range);
            }
            DocumentLayout::Delimited(placement) => *placement,
        };
        if start >= len {
            self.release_to(len);
            return None;
        }
        let end = match placement {
            // The delimiter at `start` opens this document; the next one opens the next.
            DelimiterPlacement::Before => self.shard.find_token(self.end_of_text, start + 1..len),
            DelimiterPlacement::After => self
                .shard
                .find_token(self.end_of_text, start..len)
                .map(|p| p + 1),
        }
        .unwrap_or(len);
        self.next = end;
        if (end - self.released) * self.shard.width() >= RELEASE_BYTES {
            self.release_to(end);
        }
        Some(start..end)
    }
}

impl Documents<'_> {
    fn release_to(&mut self, token: usize) {
        let width = self.shard.width();
        self.shard.release(self.released * width..token * width);
        self.released = token;
    }
}
