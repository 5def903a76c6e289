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
        let tokens =
            u64::try_from(length).map_err(|_| negative(s, "length", length.into(), length_at))?;
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
            format!("is {previous}, but the last entry must be the sequence count, {sequences}"),
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

#[cfg(test)]
mod tests {
    use super::super::fixtures::{anon_map, megatron_idx, megatron_pair};
    use super::*;

    fn parse_pair(bin: &[u8], idx: &[u8]) -> Result<Layout, ShardError> {
        parse(
            Path::new("c.bin"),
            bin.len(),
            Path::new("c.idx"),
            anon_map(idx),
        )
    }

    fn err(bin: &[u8], idx: &[u8]) -> String {
        match parse_pair(bin, idx) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        }
    }

    fn docs(sizes: &[&[usize]]) -> Vec<Vec<Vec<i64>>> {
        let mut next = 0;
        let mut sequence = |n: usize| {
            next += n as i64;
            (next - n as i64..next).collect::<Vec<_>>()
        };
        sizes
            .iter()
            .map(|doc| doc.iter().map(|&n| sequence(n)).collect())
            .collect()
    }

    fn boundaries(layout: &Layout) -> Vec<Range<usize>> {
        match &layout.documents {
            DocumentLayout::Indexed(index) => (0..index.len()).map(|d| index.tokens(d)).collect(),
            DocumentLayout::Delimited(_) => panic!("Megatron shards are indexed"),
        }
    }

    #[test]
    fn every_integer_dtype_code_maps_to_its_width() {
        let want = [
            (1, TokenDtype::U8),
            (2, TokenDtype::I8),
            (3, TokenDtype::I16),
            (4, TokenDtype::I32),
            (5, TokenDtype::I64),
            (8, TokenDtype::U16),
        ];
        for (code, dtype) in want {
            let (bin, idx) = megatron_pair(code, &docs(&[&[3], &[2]]));
            let layout = parse_pair(&bin, &idx).unwrap();
            assert_eq!(
                (layout.dtype, layout.start, layout.len),
                (dtype, 0, 5),
                "code {code}"
            );
            assert_eq!(bin.len(), 5 * dtype.width());
        }
    }

    #[test]
    fn documents_of_several_sequences_get_their_token_ranges() {
        // Three documents: two sentences, none (empty), three sentences.
        let (bin, idx) = megatron_pair(8, &docs(&[&[4, 2], &[], &[1, 3, 5]]));
        let layout = parse_pair(&bin, &idx).unwrap();
        assert_eq!(layout.len, 15);
        assert_eq!(boundaries(&layout), vec![0..6, 6..6, 6..15]);
    }

    #[test]
    fn an_empty_dataset_has_no_documents() {
        let (bin, idx) = megatron_pair(4, &[]);
        let layout = parse_pair(&bin, &idx).unwrap();
        assert_eq!((layout.len, boundaries(&layout)), (0, vec![]));
    }

    #[test]
    fn a_wrong_magic_is_shown_with_escapes() {
        let (bin, mut idx) = megatron_pair(8, &docs(&[&[2]]));
        idx[..9].copy_from_slice(b"TNTIDX\x00\x00\x01");
        let msg = err(&bin, &idx);
        assert!(msg.starts_with("c.idx: not a Megatron index"), "{msg}");
        assert!(
            msg.contains("bytes 0..9 are TNTIDX\\x00\\x00\\x01"),
            "{msg}"
        );
        assert!(msg.contains("not MMIDIDX\\x00\\x00"), "{msg}");
    }

    #[test]
    fn a_version_other_than_1_is_refused() {
        let (bin, mut idx) = megatron_pair(8, &docs(&[&[2]]));
        idx[9..17].copy_from_slice(&2u64.to_le_bytes());
        let msg = err(&bin, &idx);
        assert!(msg.contains("version 2 (u64 at byte 9) is not 1"), "{msg}");
    }

    #[test]
    fn float_and_unknown_dtype_codes_are_refused_by_name() {
        for (code, name) in [(6, "float64"), (7, "float32")] {
            let (bin, idx) = megatron_pair(code, &docs(&[&[2]]));
            let msg = err(&bin, &idx);
            assert!(
                msg.contains(&format!("dtype code {code} (byte 17) is {name}")),
                "{msg}"
            );
            assert!(msg.contains("token ids must be integers"), "{msg}");
        }
        let (bin, idx) = megatron_pair(9, &docs(&[&[2]]));
        let msg = err(&bin, &idx);
        assert!(
            msg.contains("unknown Megatron dtype code 9 (byte 17)"),
            "{msg}"
        );
        assert!(msg.contains("8 uint16"), "{msg}");
    }

    #[test]
    fn a_truncated_index_names_the_size_its_header_needs() {
        let (bin, idx) = megatron_pair(8, &docs(&[&[2], &[3]]));
        let msg = err(&bin, &idx[..idx.len() - 8]);
        assert!(msg.contains("index is 74 bytes"), "{msg}");
        assert!(
            msg.contains("(2 sequences, 3 document-index entries)"),
            "{msg}"
        );
        assert!(
            msg.contains("needs 34 + 2 x 12 + 3 x 8 = 82 bytes"),
            "{msg}"
        );
        let msg = err(&bin, &idx[..20]);
        assert!(
            msg.contains("20 bytes is shorter than the 34-byte header"),
            "{msg}"
        );
    }

    #[test]
    fn mode_bytes_of_a_multimodal_index_are_refused() {
        let (bin, mut idx) = megatron_pair(8, &docs(&[&[2], &[3]]));
        let end = idx.len();
        idx.extend_from_slice(&[0, 1]);
        let msg = err(&bin, &idx);
        assert!(
            msg.contains(&format!("(bytes {end}..{})", end + 2)),
            "{msg}"
        );
        assert!(msg.contains("multimodal"), "{msg}");
    }

    #[test]
    fn negative_lengths_and_pointers_name_the_sequence_and_byte() {
        let bin = vec![0u8; 8];
        let msg = err(&bin, &megatron_idx(8, &[2, -2], &[0, 4], &[0, 2]));
        assert!(
            msg.contains("sequence 1 has length -2 (at byte 38"),
            "{msg}"
        );
        let msg = err(&bin, &megatron_idx(8, &[2, 2], &[0, -4], &[0, 2]));
        assert!(
            msg.contains("sequence 1 has pointer -4 (at byte 50"),
            "{msg}"
        );
    }

    #[test]
    fn a_sequence_past_the_end_of_the_bin_names_both_files() {
        let (bin, idx) = megatron_pair(4, &docs(&[&[2], &[3]]));
        let msg = err(&bin[..bin.len() - 4], &idx);
        assert!(
            msg.starts_with("c.idx: Megatron sequence 1 (3 tokens of 4 bytes"),
            "{msg}"
        );
        assert!(msg.contains("at byte 8) ends at byte 20"), "{msg}");
        assert!(msg.contains("past the end of c.bin (16 bytes)"), "{msg}");
    }

    #[test]
    fn sequences_out_of_order_are_refused() {
        let bin = vec![0u8; 8];
        let msg = err(&bin, &megatron_idx(8, &[2, 2], &[4, 0], &[0, 2]));
        assert!(msg.contains("sequence 0 starts at byte 4"), "{msg}");
        assert!(msg.contains("end at byte 0"), "{msg}");
        assert!(msg.contains("back to back"), "{msg}");
    }

    #[test]
    fn a_bin_longer_than_its_index_says_is_refused() {
        let (mut bin, idx) = megatron_pair(8, &docs(&[&[2], &[3]]));
        bin.extend_from_slice(&[0; 6]);
        let msg = err(&bin, &idx);
        assert!(
            msg.starts_with("c.bin: 16 bytes, but its index c.idx"),
            "{msg}"
        );
        assert!(
            msg.contains("describes 5 tokens of 2 bytes = 10 bytes"),
            "{msg}"
        );
        assert!(msg.contains("6 trailing bytes"), "{msg}");
    }

    #[test]
    fn a_broken_document_index_names_the_entry_and_the_rule() {
        let bin = vec![0u8; 6];
        let pair = |documents: &[i64]| megatron_idx(8, &[1, 1, 1], &[0, 2, 4], documents);
        let msg = err(&bin, &pair(&[1, 3]));
        assert!(
            msg.contains("entry 0 (byte 70) is 1, but the first entry must be 0"),
            "{msg}"
        );
        let msg = err(&bin, &pair(&[0, 2, 1, 3]));
        assert!(
            msg.contains("entry 2 (byte 86) is 1, below entry 1's 2"),
            "{msg}"
        );
        assert!(msg.contains("must not decrease"), "{msg}");
        let msg = err(&bin, &pair(&[0, 2]));
        assert!(
            msg.contains("entry 1 (byte 78) is 2, but the last entry must be"),
            "{msg}"
        );
        assert!(msg.contains("the sequence count, 3"), "{msg}");
        let msg = err(&bin, &pair(&[]));
        assert!(msg.contains("entry 0 (byte 70) is missing"), "{msg}");
    }
}
