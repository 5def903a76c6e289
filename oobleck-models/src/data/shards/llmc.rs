//! llm.c / modded-nanoGPT token shards (`fineweb_train_000001.bin`).
//!
//! ```text
//! byte 0      4        8       12         1024
//! | magic    | version | count | 0 ... 0 | count tokens, little-endian
//! | int32 LE | int32   | int32 | (253 x int32 of the 256-int32 header, unused)
//! magic 20240520: u16 tokens, version 1 (GPT-2)
//! magic 20240801: u32 tokens, version 7 as llm.c's dev/data/data_common.py writes it for
//!                 Llama 3 (version 1 accepted too: the layout is the same)
//! ```
//!
//! The file must be exactly `1024 + count x width` bytes, as llm.c's `dataloader.h` checks: a
//! shorter file was cut off in a copy, a longer one is not what the header describes.
//!
//! Documents are not indexed: llm.c's and modded-nanoGPT's `fineweb.py` put the tokenizer's
//! end-of-text token *before* every document (GPT-2's `<|endoftext|>`, id 50256; the Llama 3
//! writer uses `<|begin_of_text|>`, 128000), so a document runs from one delimiter to the next
//! ([`super::DelimiterPlacement::Before`]).

use std::path::Path;

use super::dtype::TokenDtype;
use super::error::ShardError;
use super::view::{DelimiterPlacement, DocumentLayout, Layout};

/// Magic of a shard of u16 tokens (GPT-2 vocabulary).
pub const MAGIC_U16: i32 = 20240520;
/// Magic of a shard of u32 tokens (vocabularies past 65,536 ids, e.g. Llama 3's).
pub const MAGIC_U32: i32 = 20240801;
/// llm.c's HellaSwag/MMLU evaluation files: a known magic, but not training tokens.
const MAGIC_EVAL: i32 = 20240522;
/// 256 int32s.
pub const HEADER_BYTES: usize = 1024;

/// Whether `bytes` start with one of the two training-shard magics (the format's signature).
pub(super) fn has_magic(bytes: &[u8]) -> bool {
    matches!(int32_at(bytes, 0), Some(MAGIC_U16 | MAGIC_U32))
}

/// The token layout of the llm.c shard `bytes` (the whole file at `path`), checked against
/// its header.
pub(super) fn parse(path: &Path, bytes: &[u8]) -> Result<Layout, ShardError> {
    if bytes.len() < HEADER_BYTES {
        return Err(ShardError::ShorterThanHeader {
            path: path.to_path_buf(),
            len: bytes.len() as u64,
            needed: HEADER_BYTES as u64,
            format: "an llm.c shard",
        });
    }
    let word = |i: usize| int32_at(bytes, 4 * i).expect("the header's 1024 bytes were checked");
    let (magic, version, count) = (word(0), word(1), word(2));
    let (dtype, versions, expected): (_, &[i32], _) = match magic {
        MAGIC_U16 => (TokenDtype::U16, &[1], "1"),
        MAGIC_U32 => (TokenDtype::U32, &[7, 1], "7, or 1"),
        _ => {
            let note = if magic == MAGIC_EVAL {
                ", and 20240522 is llm.c's evaluation file (HellaSwag/MMLU), not training tokens"
            } else {
                ""
            };
            return Err(ShardError::LlmcMagic {
                path: path.to_path_buf(),
                magic,
                note,
            });
        }
    };
    if !versions.contains(&version) {
        return Err(ShardError::LlmcVersion {
            path: path.to_path_buf(),
            magic,
            version,
            expected,
        });
    }
    let count = u64::try_from(count).map_err(|_| ShardError::LlmcNegativeCount {
        path: path.to_path_buf(),
        count,
    })?;
    let width = dtype.width() as u64;
    // count < 2^31 and width <= 4, so this cannot overflow.
    let expected = HEADER_BYTES as u64 + count * width;
    if bytes.len() as u64 != expected {
        return Err(ShardError::LlmcSize {
            path: path.to_path_buf(),
            count,
            width,
            expected,
            actual: bytes.len() as u64,
        });
    }
    Ok(Layout {
        dtype,
        start: HEADER_BYTES,
        len: count as usize,
        documents: DocumentLayout::Delimited(DelimiterPlacement::Before),
    })
}

/// The little-endian int32 at byte `at`, if the four bytes are there.
pub(super) fn int32_at(bytes: &[u8], at: usize) -> Option<i32> {
    let word = bytes.get(at..at + 4)?;
    Some(i32::from_le_bytes(word.try_into().expect("four bytes")))
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{llmc_bytes, llmc_header};
    use super::*;

    fn parse_err(bytes: &[u8]) -> String {
        match parse(Path::new("shard.bin"), bytes) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn u16_and_u32_headers_give_their_width_and_count() {
        let layout = parse(Path::new("a.bin"), &llmc_bytes(MAGIC_U16, 1, &[1, 2, 3])).unwrap();
        assert_eq!(
            (layout.dtype, layout.start, layout.len),
            (TokenDtype::U16, 1024, 3)
        );
        let layout = parse(Path::new("b.bin"), &llmc_bytes(MAGIC_U32, 7, &[70_000])).unwrap();
        assert_eq!((layout.dtype, layout.len), (TokenDtype::U32, 1));
        // Version 1 with the u32 magic has the same layout and is accepted.
        assert!(parse(Path::new("c.bin"), &llmc_bytes(MAGIC_U32, 1, &[5])).is_ok());
    }

    #[test]
    fn a_truncated_shard_names_both_sizes_and_the_missing_tokens() {
        let mut bytes = llmc_bytes(MAGIC_U16, 1, &[10, 11, 12, 13]);
        bytes.truncate(bytes.len() - 3);
        let msg = parse_err(&bytes);
        assert!(msg.starts_with("shard.bin: "), "{msg}");
        assert!(msg.contains("4 tokens of 2 bytes"), "{msg}");
        assert!(msg.contains("should be 1024 + 4 x 2 = 1032 bytes"), "{msg}");
        assert!(msg.contains("but it is 1029 bytes"), "{msg}");
        assert!(
            msg.contains("truncated: 3 bytes, about 2 tokens, missing"),
            "{msg}"
        );
        assert!(msg.contains("copy the shard again"), "{msg}");
    }

    #[test]
    fn trailing_bytes_after_the_counted_tokens_are_an_error() {
        let mut bytes = llmc_bytes(MAGIC_U32, 7, &[1, 2]);
        bytes.extend_from_slice(&[0; 5]);
        let msg = parse_err(&bytes);
        assert!(msg.contains("should be 1024 + 2 x 4 = 1032 bytes"), "{msg}");
        assert!(
            msg.contains("but it is 1037 bytes (5 trailing bytes"),
            "{msg}"
        );
    }

    #[test]
    fn an_unknown_magic_names_it_and_the_two_known_ones() {
        let msg = parse_err(&llmc_bytes(12345, 1, &[]));
        assert!(msg.contains("unknown llm.c magic 12345 at byte 0"), "{msg}");
        assert!(msg.contains("20240520 for u16 tokens"), "{msg}");
        assert!(msg.contains("20240801 for u32 tokens"), "{msg}");
        let msg = parse_err(&llmc_bytes(MAGIC_EVAL, 1, &[]));
        assert!(msg.contains("evaluation file"), "{msg}");
    }

    #[test]
    fn an_unknown_version_names_it_and_the_expected_one() {
        let msg = parse_err(&llmc_bytes(MAGIC_U16, 2, &[1]));
        assert!(msg.contains("version 2 at byte 4"), "{msg}");
        assert!(msg.contains("magic 20240520 (expected 1)"), "{msg}");
        let msg = parse_err(&llmc_bytes(MAGIC_U32, 3, &[1]));
        assert!(msg.contains("(expected 7, or 1)"), "{msg}");
    }

    #[test]
    fn a_negative_count_and_a_short_header_are_errors() {
        let mut bytes = llmc_header(MAGIC_U16, 1, 0);
        bytes[8..12].copy_from_slice(&(-5i32).to_le_bytes());
        let msg = parse_err(&bytes);
        assert!(msg.contains("-5 tokens (int32 at byte 8)"), "{msg}");
        let msg = parse_err(&llmc_header(MAGIC_U16, 1, 0)[..100]);
        assert!(
            msg.contains("100 bytes is shorter than the 1024-byte header"),
            "{msg}"
        );
    }
}
