//! What can be wrong with a token shard. Every message names the file, the place in it (byte
//! offset, token index, sequence or document-index entry) and what to do about it; values are
//! printed as numbers and paths, never as Rust debug forms.

use std::path::PathBuf;

use super::llmc::{MAGIC_U16, MAGIC_U32};

/// A token shard that cannot be read as the format it claims (or is detected) to be. Converted
/// into [`super::super::DataError::Shard`].
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error("{path}: is a folder; name one token shard file (an llm.c or nanoGPT .bin, or a Megatron .bin/.idx pair)")]
    Folder { path: PathBuf },

    /// Neither a header, a sibling index nor the caller's hint says how to read the file.
    #[error(
        "{path}: not a recognised token shard: its first int32 (byte 0) is {first}, not an llm.c \
         magic ({MAGIC_U16} for u16 tokens, {MAGIC_U32} for u32 tokens), and there is no \
         Megatron index {idx} beside it. If it is nanoGPT's headerless train.bin of u16 tokens, \
         pass --data-format u16"
    )]
    Unrecognised {
        path: PathBuf,
        /// The first four bytes as a little-endian int32 (`None` for a shorter file).
        first: FirstWord,
        idx: PathBuf,
    },

    #[error(
        "{path}: {len} bytes is shorter than the {needed}-byte header of {format}; the file is \
         truncated or not in that format: copy it again or re-create it"
    )]
    ShorterThanHeader {
        path: PathBuf,
        len: u64,
        needed: u64,
        format: &'static str,
    },

    #[error(
        "{path}: unknown llm.c magic {magic} at byte 0 (known: {MAGIC_U16} for u16 tokens, \
         {MAGIC_U32} for u32 tokens){note}; re-create the shard with llm.c's or modded-nanoGPT's \
         writer, or name the right file"
    )]
    LlmcMagic {
        path: PathBuf,
        magic: i32,
        /// Extra words for magics known to be something else than training tokens.
        note: &'static str,
    },

    #[error(
        "{path}: llm.c shard version {version} at byte 4 is not one this reader knows for magic \
         {magic} (expected {expected}); re-create the shard with llm.c's or modded-nanoGPT's writer"
    )]
    LlmcVersion {
        path: PathBuf,
        magic: i32,
        version: i32,
        expected: &'static str,
    },

    #[error(
        "{path}: llm.c header says {count} tokens (int32 at byte 8), which is negative: the \
         header is corrupt; re-create the shard"
    )]
    LlmcNegativeCount { path: PathBuf, count: i32 },

    /// The file size disagrees with the header's token count.
    #[error(
        "{path}: llm.c header says {count} tokens of {width} bytes (int32 at byte 8), so the file \
         should be 1024 + {count} x {width} = {expected} bytes, but it is {actual} bytes ({}); \
         copy the shard again or re-create it",
        size_verdict(*expected, *actual, *width)
    )]
    LlmcSize {
        path: PathBuf,
        count: u64,
        width: u64,
        expected: u64,
        actual: u64,
    },

    #[error(
        "{path}: {len} bytes is an odd length for raw u16 tokens (2 bytes each); the last byte, \
         at offset {last}, is half a token: the file is truncated or not u16 tokens (pass the \
         right --data-format, or copy it again)",
        last = len - 1
    )]
    RawOddLength { path: PathBuf, len: u64 },

    #[error(
        "{bin}: Megatron data file without its index: expected {idx} beside it (Megatron's and \
         NeMo's preprocess_data.py write both files; copy the .idx too)"
    )]
    MissingIndex { bin: PathBuf, idx: PathBuf },

    #[error(
        "{idx}: Megatron index without its data file: expected {bin} beside it (copy the .bin \
         too)"
    )]
    MissingData { idx: PathBuf, bin: PathBuf },

    #[error(
        "{path}: not a Megatron index: bytes 0..9 are {found}, not MMIDIDX\\x00\\x00; name the \
         .idx written by Megatron's or NeMo's preprocess_data.py"
    )]
    MegatronMagic { path: PathBuf, found: String },

    #[error(
        "{path}: Megatron index version {version} (u64 at byte 9) is not 1, the only version \
         Megatron-LM writes; re-create the index with Megatron's preprocess_data.py"
    )]
    MegatronVersion { path: PathBuf, version: u64 },

    #[error(
        "{path}: Megatron dtype code {code} (byte 17) is {name}, a floating-point type: token ids \
         must be integers; this .bin/.idx pair holds something else than tokens"
    )]
    MegatronFloatDtype {
        path: PathBuf,
        code: u8,
        name: &'static str,
    },

    #[error(
        "{path}: unknown Megatron dtype code {code} (byte 17); Megatron-LM defines 1 uint8, \
         2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16: the index is \
         corrupt or from a newer Megatron"
    )]
    MegatronUnknownDtype { path: PathBuf, code: u8 },

    #[error(
        "{path}: Megatron index is {actual} bytes, but its header ({sequences} sequences, \
         {entries} document-index entries) needs 34 + {sequences} x 12 + {entries} x 8 = \
         {expected} bytes; the index is truncated or corrupt: copy it again or re-create it"
    )]
    MegatronIndexSize {
        path: PathBuf,
        sequences: u64,
        entries: u64,
        /// Wider than u64: a corrupt count can make the needed size overflow u64.
        expected: u128,
        actual: u64,
    },

    #[error(
        "{path}: Megatron index carries one mode byte per sequence after the document index \
         (bytes {start}..{end}): a multimodal dataset, which this reader does not support; \
         give a text-only dataset"
    )]
    MegatronMultimodal { path: PathBuf, start: u64, end: u64 },

    #[error(
        "{path}: Megatron sequence {sequence} has {field} {value} (at byte {byte} of the \
         index), which is negative: the index is corrupt; re-create it"
    )]
    MegatronNegative {
        path: PathBuf,
        sequence: u64,
        field: &'static str,
        value: i64,
        byte: u64,
    },

    #[error(
        "{idx}: Megatron sequence {sequence} ({tokens} tokens of {width} bytes at byte \
         {pointer}) ends at byte {end}, past the end of {bin} ({bin_len} bytes); the .bin is \
         truncated or belongs to another index: copy the pair again"
    )]
    MegatronOutsideData {
        idx: PathBuf,
        bin: PathBuf,
        sequence: u64,
        tokens: u64,
        width: u64,
        pointer: u64,
        end: u64,
        bin_len: u64,
    },

    #[error(
        "{idx}: Megatron sequence {sequence} starts at byte {pointer} of the .bin, but the \
         sequences before it end at byte {expected}; this reader needs the sequences stored back \
         to back in order, as Megatron's builder writes them: re-create the pair with \
         Megatron's preprocess_data.py"
    )]
    MegatronNotContiguous {
        idx: PathBuf,
        sequence: u64,
        pointer: u64,
        expected: u64,
    },

    #[error(
        "{bin}: {actual} bytes, but its index {idx} describes {tokens} tokens of {width} bytes = \
         {expected} bytes ({}); the two files do not belong together: copy the pair again",
        size_verdict(*expected, *actual, *width)
    )]
    MegatronDataSize {
        bin: PathBuf,
        idx: PathBuf,
        tokens: u64,
        width: u64,
        expected: u64,
        actual: u64,
    },

    #[error(
        "{path}: Megatron document index entry {entry} (byte {byte}) {problem}; the index is \
         corrupt: re-create it with Megatron's preprocess_data.py"
    )]
    MegatronDocumentIndex {
        path: PathBuf,
        entry: u64,
        byte: u64,
        /// What is wrong with the entry, with its value and the rule it breaks.
        problem: String,
    },

    #[error(
        "{path}: token id {id} at token {index} (byte {byte}) is at or above the vocabulary of \
         {vocab} ids; the shard was made with another tokenizer: use the model and tokenizer it \
         was made for, or re-tokenize it"
    )]
    OutOfVocabulary {
        path: PathBuf,
        index: u64,
        byte: u64,
        id: i64,
        vocab: u64,
    },

    #[error(
        "{path}: value {value} at token {index} (byte {byte}) is not a token id (ids are 0 to \
         4294967295); the file holds something else than tokens or is corrupt: re-create it"
    )]
    NotATokenId {
        path: PathBuf,
        index: u64,
        byte: u64,
        value: i64,
    },
}

/// The first four bytes of a file as a little-endian int32, if it has four.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FirstWord(pub Option<i32>);

impl std::fmt::Display for FirstWord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(word) => write!(f, "{word}"),
            None => f.write_str("missing (the file is shorter than 4 bytes)"),
        }
    }
}

/// "truncated: N tokens missing" or "N trailing bytes", for a file of `actual` bytes that
/// should have `expected`.
fn size_verdict(expected: u64, actual: u64, width: u64) -> String {
    if actual < expected {
        let missing = expected - actual;
        format!(
            "truncated: {missing} bytes, about {} tokens, missing",
            missing.div_ceil(width.max(1))
        )
    } else {
        format!("{} trailing bytes after the last token", actual - expected)
    }
}
