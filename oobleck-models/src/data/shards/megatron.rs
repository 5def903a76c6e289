//! Megatron-LM / NeMo indexed datasets: a `.bin` of token ids and an `.idx` describing it,
//! as written by `tools/preprocess_data.py` (layout learnt from Megatron-LM's
//! `megatron/core/datasets/indexed_dataset.py`, `_IndexWriter`).
//!
//! ```text
//! .idx   byte 0           9            17      18           26           34
//!        | "MMIDIDX\0\0" | version u64 | dtype | sequences S | entries D  |
//!        | S x int32 sequence lengths (tokens)                            |
//!        | S x int64 sequence pointers (byte offsets into the .bin)       |
//!        | D x int64 document index: sequence numbers, 0 first, S last    |
//!        [ S x int8 sequence modes: multimodal datasets only ]
//! .bin   the sequences' tokens back to back, little-endian, of the dtype
//! dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
//! ```
//!
//! Document `d` is sequences `entries[d]..entries[d + 1]`, so there are `D - 1` documents (a
//! document has several sequences when preprocessing split sentences). Megatron picks uint16
//! for vocabularies under 65,500 ids and int32 otherwise.
//!
//! Checked on open: the magic, version 1, the dtype (floats refused), the index's exact size,
//! every sequence's length and pointer (non-negative, inside the `.bin`, back to back in
//! order, the `.bin` exactly as long as the sequences), and the document index (starts at 0,
//! never decreases, ends at `S`). Not supported: multimodal indexes (the mode bytes), and
//! sequences stored out of order or with gaps, which Megatron's builder never writes; both are
//! refused with a message saying so.

use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::dtype::TokenDtype;
use super::error::ShardError;
use super::view::{DocumentLayout, Layout};

/// The first nine bytes of every index.
pub const INDEX_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// Bytes before the sequence lengths.
const HEADER_BYTES: usize = 34;

/// The `.idx` beside `bin` (Megatron's `prefix + ".idx"` for `prefix + ".bin"`).
pub fn index_path(bin: &Path) -> PathBuf {
    bin.with_extension("idx")
}

/// The `.bin` beside `idx`.
pub fn data_path(idx: &Path) -> PathBuf {
    idx.with_extension("bin")
}

/// The document index of an opened pair: the `.idx` map, read on demand.
pub(super) struct DocumentIndex {
    map: Mmap,
    /// Byte offset of the sequence pointers and of the document index in `map`.
    pointers_at: usize,
    entries_at: usize,
    sequences: usize,
    entries: usize,
    width: usize,
    /// Tokens in the `.bin`.
    total: usize,
}

impl DocumentIndex {
    /// Number of documents (one fewer than the index's entries).
    pub fn len(&self) -> usize {
        self.entries - 1
    }

    /// Token range of document `d < len()`.
    pub fn tokens(&self, d: usize) -> Range<usize> {
        let entry = |e: usize| int64_at(&self.map, self.entries_at + 8 * e) as usize;
        self.first_token(entry(d))..self.first_token(entry(d + 1))
    }

    /// The token where sequence `s` starts (`total` for `s == sequences`). Validation made
    /// the pointers contiguous and in range, so a pointer divided by the width is a token.
    fn first_token(&self, s: usize) -> usize {
        if s == self.sequences {
            return self.total;
        }
        int64_at(&self.map, self.pointers_at + 8 * s) as usize / self.width
    }
}

/// The header fields of an index.
struct Header {
    dtype: TokenDtype,
    sequences: u64,
    entries: u64,
}

/// The token layout of the pair `bin` (`bin_len` bytes) and `idx` (mapped as `map`), after
/// every check listed in the module docs.
pub(super) fn parse(
    bin: &Path,
    bin_len: usize,
    idx: &Path,
    map: Mmap,
) -> Result<Layout, ShardError> {
    let header = parse_header(idx, &map)?;
    // parse_header checked the file holds every array, so the counts fit in memory.
    let sequences = header.sequences as usize;
    let entries = header.entries as usize;
    let width = header.dtype.width();
    let pointers_at = HEADER_BYTES + 4 * sequences;
    let entries_at = pointers_at + 8 * sequences;
    let total = check_sequences(bin, bin_len, idx, &map, sequences, width)?;
    check_documents(idx, &map, entries_at, entries, sequences)?;
    Ok(Layout {
        dtype: header.dtype,
        start: 0,
        len: total,
        documents: DocumentLayout::Indexed(DocumentIndex {
            map,
            pointers_at,
            entries_at,
            sequences,
            entries,
            width,
            total,
        }),
    })
}

/// The header of the index `map`, checked against the index's size.
fn parse_header(idx: &Path, map: &[u8]) -> Result<Header, ShardError> {
    if map.len() < HEADER_BYTES {
        return Err(ShardError::ShorterThanHeader {
            path: idx.to_path_buf(),
            len: map.len() as u64,
            needed: HEADER_BYTES as u64,
            format: "a Megatron index",
        });
    }
    if &map[..9] != INDEX_MAGIC {
        return Err(ShardError::MegatronMagic {
            path: idx.to_path_buf(),
            found: escaped(&map[..9]),
        });
    }
    let version = u64_at(map, 9);
    if version != 1 {
        return Err(ShardError::MegatronVersion {
            path: idx.to_path_buf(),
            version,
        });
    }
    let dtype = dtype_of(idx, map[17])?;
    let (sequences, entries) = (u64_at(map, 18), u64_at(map, 26));
    let expected = HEADER_BYTES as u128 + 12 * sequences as u128 + 8 * entries as u128;
    let actual = map.len() as u64;
    if actual as u128 == expected + sequences as u128 && sequences > 0 {
        return Err(ShardError::MegatronMultimodal {
            path: idx.to_path_buf(),
            start: expected as u64,
            end: actual,
        });
    }
    if actual as u128 != expected {
        return Err(ShardError::MegatronIndexSize {
            path: idx.to_path_buf(),
            sequences,
            entries,
            expected,
            actual,
        });
    }
    Ok(Header {
        dtype,
        sequences,
        entries,
    })
}

/// The token type of Megatron's dtype `code` (its `DType` enum).
fn dtype_of(idx: &Path, code: u8) -> Result<TokenDtype, ShardError> {
    let float = |name| ShardError::MegatronFloatDtype {
        path: idx.to_path_buf(),
        code,
        name,
    };
    match code {
        1 => Ok(TokenDtype::U8),
        2 => Ok(TokenDtype::I8),
        3 => Ok(TokenDtype::I16),
        4 => Ok(TokenDtype::I32),
        5 => Ok(TokenDtype::I64),
        6 => Err(float("float64")),
        7 => Err(float("float32")),
        8 => Ok(TokenDtype::U16),
        _ => Err(ShardError::MegatronUnknownDtype {
            path: idx.to_path_buf(),
            code,
        }),
    }
}

/// Checks every sequence's length and pointer; returns the number of tokens in the `.bin`.
fn check_sequences(
    bin: &Path,
    bin_len: usize,
    idx: &Path,
    map: &[u8],
    sequences: usize,
    width: usize,
) -> Result<usize, ShardError> {
    let pointers_at = HEADER_BYTES + 4 * sequences;
    let negative = |sequence: usize, field, value: i64, byte: usize| ShardError::MegatronNegative {
        path: idx.to_path_buf(),
        sequence: sequence as u64,
        field,
        value,
        byte: byte as u64,
    };
    // Where the next sequence must start: right after the previous one.
    let mut expected = 0u64;
    for s in 0..sequences {
        let (length_at, pointer_at) = (HEADER_BYTES + 4 * s, pointers_at + 8 * s);
        let length = int32_at(map, length_at);
        let pointer = int64_at(map, pointer_at);
        let tokens = u64::try_from(length)
            .map_err(|_| negative(s, "length", length.into(), length_at))?;
        let pointer =
            u64::try_from(pointer).map_err(|_| negative(s, "pointer", pointer, pointer_at))?;
        // Cannot overflow: pointer < 2^63 and tokens x width < 2^34.
        let end = pointer + tokens * width as u64;
        if end > bin_len as u64 {
            return Err(ShardError::MegatronOutsideData {
                idx: idx.to_path_buf(),
                bin: bin.to_path_buf(),
                sequence: s as u64,
                tokens,
                width: width as u64,
                pointer,
                end,
                bin_len: bin_len as u64,
            });
        }
        if pointer != expected {
            return Err(ShardError::MegatronNotContiguous {
                idx: idx.to_path_buf(),
                sequence: s as u64,
                pointer,
                expected,
            });
        }
        expected = end;
    }
    if expected != bin_len as u64 {
        return Err(ShardError::MegatronDataSize {
            bin: bin.to_path_buf(),
            idx: idx.to_path_buf(),
            tokens: expected / width as u64,
            width: width as u64,
            expected,
            actual: bin_len as u64,
        });
    }
    Ok(bin_len / width)
}

/// Checks the document index: it starts at 0, never decreases and ends at `sequences`.
fn check_documents(
    idx: &Path,
    map: &[u8],
    entries_at: usize,
    entries: usize,
    sequences: usize,
) -> Result<(), ShardError> {
    let bad = |entry: usize, problem: String| ShardError::MegatronDocumentIndex {
        path: idx.to_path_buf(),
        entry: entry as u64,
        byte: (entries_at + 8 * entry) as u64,
        problem,
    };
    if entries == 0 {
        return Err(bad(
            0,
            "is missing: the index must hold at least its first entry, 0".into(),
        ));
    }
    let mut previous = 0i64;
    for e in 0..entries {
        let value = int64_at(map, entries_at + 8 * e);
        if e == 0 && value != 0 {
            return Err(bad(e, format!("is {value}, but the first entry must be 0")));
        }
        if value < previous {
            return Err(bad(
                e,
                format!(
                    "is {value}, below entry {}'s {previous}: entries must not decrease",
                    e - 1
                ),
            ));
        }
        previous = value;
    }
    if previous != sequences as i64 {
        return Err(bad(
            entries - 1,
            format!(
                "is {previous}, but the last entry must be the sequence count, {sequences}"
            ),
        ));
    }
    Ok(())
}

fn int32_at(bytes: &[u8], at: usize) -> i32 {
    i32::from_le_bytes(bytes[at..at + 4].try_into().expect("four bytes"))
}

fn int64_at(bytes: &[u8], at: usize) -> i64 {
    i64::from_le_bytes(bytes[at..at + 8].try_into().expect("eight bytes"))
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("eight bytes"))
}

/// `bytes` as printable ASCII with `\xNN` escapes, for naming a wrong magic.
fn escaped(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|&b| match b {
            0x20..=0x7e if b != b'\\' => (b as char).to_string(),
            _ => format!("\\x{b:02x}"),
        })
        .collect()
}
