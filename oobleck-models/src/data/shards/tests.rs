//! Through files on disk: detection, the common view over every format, and one text tokenized
//! by the shipped GPT-2 tokenizer read back identically from each format.

use std::ops::Range;
use std::path::Path;

use super::fixtures::{llmc_bytes, megatron_pair, raw_u16_bytes, write};
use super::*;
use crate::data::{open_tokenizer, END_OF_TEXT_ID, GPT2_VOCAB_SIZE};

/// Reference texts and their GPT-2 ids, from `datasets/gpt2-tokenizer/reference_ids.json`
/// (OpenAI's `encoder.py`, cross-checked with tiktoken).
const REFERENCE: &[(&str, &[u32])] = &[
    ("Hello, world!", &[15496, 11, 995, 0]),
    (
        "The quick brown fox jumps over the lazy dog.",
        &[464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13],
    ),
    (
        "To be, or not to be, that is the question:",
        &[
            2514, 307, 11, 393, 407, 284, 307, 11, 326, 318, 262, 1808, 25,
        ],
    ),
    (
        "café naïve résumé über",
        &[66, 1878, 2634, 41492, 40560, 16345, 2634, 6184, 120, 527],
    ),
];

fn all(shard: &TokenShard) -> Vec<u32> {
    let mut out = vec![];
    shard.copy_range(0, shard.len(), &mut out).unwrap();
    out
}

fn message(result: crate::data::Result<TokenShard>) -> String {
    match result {
        Ok(shard) => panic!("expected an error, opened {}", shard.path().display()),
        Err(e) => e.to_string(),
    }
}

fn tokens_of(shard: &TokenShard, docs: impl Iterator<Item = Range<usize>>) -> Vec<Vec<u32>> {
    docs.map(|r| {
        let mut out = vec![];
        shard.copy_range(r.start, r.end, &mut out).unwrap();
        out
    })
    .collect()
}

#[test]
fn one_text_reads_back_as_the_same_ids_from_every_format() {
    let tokenizer = open_tokenizer(None).unwrap();
    let docs: Vec<Vec<u32>> = REFERENCE
        .iter()
        .map(|(text, ids)| {
            let encoded = tokenizer.encode(text).unwrap();
            assert_eq!(&encoded, ids, "the shipped tokenizer on {text}");
            encoded
        })
        .collect();
    let eot = END_OF_TEXT_ID;
    // llm.c: the delimiter opens each document; nanoGPT and Megatron's --append-eod close it.
    let opened: Vec<Vec<u32>> = docs.iter().map(|d| [&[eot][..], d].concat()).collect();
    let closed: Vec<Vec<u32>> = docs.iter().map(|d| [d, &[eot][..]].concat()).collect();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let megatron = |code| {
        let as_docs: Vec<Vec<Vec<i64>>> = closed
            .iter()
            .map(|doc| vec![doc.iter().map(|&t| t as i64).collect()])
            .collect();
        megatron_pair(code, &as_docs)
    };
    let (bin16, idx16) = megatron(8);
    let (bin32, idx32) = megatron(4);
    write(d, "m16.idx", &idx16);
    write(d, "m32.idx", &idx32);
    let cases = [
        (
            write(d, "a.bin", &llmc_bytes(20240520, 1, &opened.concat())),
            &opened,
            2,
        ),
        (
            write(d, "b.bin", &llmc_bytes(20240801, 7, &opened.concat())),
            &opened,
            4,
        ),
        (
            write(d, "train.bin", &raw_u16_bytes(&closed.concat())),
            &closed,
            2,
        ),
        (write(d, "m16.bin", &bin16), &closed, 2),
        (write(d, "m32.bin", &bin32), &closed, 4),
    ];
    for (path, want, width) in cases {
        let shard = open_shard(&path, FormatHint::RawU16).unwrap();
        let name = path.display();
        assert_eq!(shard.width(), width, "{name}");
        assert_eq!(all(&shard), want.concat(), "{name}");
        assert_eq!(shard.token(1).unwrap(), want.concat()[1], "{name}");
        assert_eq!(&tokens_of(&shard, shard.documents(eot)), want, "{name}");
        shard.check_vocab(GPT2_VOCAB_SIZE).unwrap();
    }
}

#[test]
fn detection_follows_the_header_the_index_and_the_hint() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let llmc = write(
        d,
        "fineweb_train_000001.bin",
        &llmc_bytes(20240520, 1, &[7, 8]),
    );
    let raw = write(d, "train.bin", &raw_u16_bytes(&[7, 8, 9]));
    let (bin, idx) = megatron_pair(8, &[vec![vec![7, 8]], vec![vec![9]]]);
    let mbin = write(d, "corpus_text_document.bin", &bin);
    let midx = write(d, "corpus_text_document.idx", &idx);
    let format = |path: &Path, hint| open_shard(path, hint).unwrap().format();
    assert_eq!(format(&llmc, FormatHint::Detect), ShardFormat::LlmC);
    // A consistent header wins over a hint given for a whole folder.
    assert_eq!(format(&llmc, FormatHint::RawU16), ShardFormat::LlmC);
    assert_eq!(format(&raw, FormatHint::RawU16), ShardFormat::RawU16);
    for path in [&mbin, &midx, &d.join("corpus_text_document")] {
        let shard = open_shard(path, FormatHint::Detect).unwrap();
        assert_eq!(
            (shard.format(), shard.path()),
            (ShardFormat::Megatron, mbin.as_path())
        );
        assert_eq!(all(&shard), vec![7, 8, 9]);
    }
    let msg = message(open_shard(&raw, FormatHint::Detect));
    assert!(msg.starts_with(&format!("{}: not a recognised token shard", raw.display())));
    assert!(msg.contains("first int32 (byte 0) is 524295"), "{msg}");
    assert!(
        msg.contains(&d.join("train.idx").display().to_string()),
        "{msg}"
    );
    assert!(msg.contains("pass --data-format u16"), "{msg}");
    let tiny = write(d, "tiny.bin", &[1, 0]);
    let msg = message(open_shard(&tiny, FormatHint::Detect));
    assert!(
        msg.contains("is missing (the file is shorter than 4 bytes)"),
        "{msg}"
    );
}

#[test]
fn a_damaged_llmc_shard_is_an_error_not_raw_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = llmc_bytes(20240520, 1, &[1, 2, 3]);
    bytes.pop();
    let path = write(dir.path(), "cut.bin", &bytes);
    let msg = message(open_shard(&path, FormatHint::RawU16));
    assert!(
        msg.contains("should be 1024 + 3 x 2 = 1030 bytes, but it is 1029"),
        "{msg}"
    );
}

#[test]
fn a_missing_half_of_a_megatron_pair_names_the_expected_path() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (bin, idx) = megatron_pair(8, &[vec![vec![1]]]);
    let lone_bin = write(d, "lone.bin", &bin);
    let msg = message(open_megatron(&lone_bin));
    let expected = d.join("lone.idx").display().to_string();
    assert!(
        msg.contains("Megatron data file without its index"),
        "{msg}"
    );
    assert!(
        msg.contains(&format!("expected {expected} beside it")),
        "{msg}"
    );
    let lone_idx = write(d, "other.idx", &idx);
    for result in [
        open_megatron(&lone_idx),
        open_shard(&lone_idx, FormatHint::Detect),
    ] {
        let msg = message(result);
        let expected = d.join("other.bin").display().to_string();
        assert!(
            msg.contains(&format!("expected {expected} beside it")),
            "{msg}"
        );
    }
}

#[test]
fn missing_files_and_folders_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.bin");
    let msg = message(open_shard(&missing, FormatHint::Detect));
    assert_eq!(
        msg,
        format!("token shard {} does not exist", missing.display())
    );
    let msg = message(open_shard(dir.path(), FormatHint::RawU16));
    assert!(
        msg.contains("is a folder; name one token shard file"),
        "{msg}"
    );
}

#[test]
fn an_id_past_the_vocabulary_is_found_beyond_the_first_scan_piece() {
    let dir = tempfile::tempdir().unwrap();
    let mut tokens = vec![50256u32; 2_500_000];
    tokens[2_000_000] = 60_000;
    tokens[1_500_001] = 50_257;
    let path = write(dir.path(), "train.bin", &raw_u16_bytes(&tokens));
    let shard = open_raw_u16(&path).unwrap();
    let msg = shard.check_vocab(50_257).unwrap_err().to_string();
    let want = format!(
        "{}: token id 50257 at token 1500001 (byte 3000002) is at or above the vocabulary of \
         50257 ids",
        path.display()
    );
    assert!(msg.starts_with(&want), "{msg}");
    assert!(msg.contains("re-tokenize it"), "{msg}");
    shard.check_vocab(60_001).unwrap();
    // The byte offset counts llm.c's header.
    let path = write(dir.path(), "s.bin", &llmc_bytes(20240801, 7, &[1, 200_000]));
    let msg = open_llmc(&path).unwrap().check_vocab(128_256).unwrap_err();
    assert!(
        msg.to_string().contains("200000 at token 1 (byte 1028)"),
        "{msg}"
    );
}

#[test]
fn values_that_are_no_token_ids_are_errors_with_their_place() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (bin, idx) = megatron_pair(4, &[vec![vec![5, -1, 6]]]);
    write(d, "neg.idx", &idx);
    let shard = open_megatron(&write(d, "neg.bin", &bin)).unwrap();
    let msg = shard.check_vocab(50_257).unwrap_err().to_string();
    assert!(msg.contains("token id -1 at token 1 (byte 4)"), "{msg}");
    let mut out = vec![42];
    let msg = shard.copy_range(0, 3, &mut out).unwrap_err().to_string();
    assert!(
        msg.contains("value -1 at token 1 (byte 4) is not a token id"),
        "{msg}"
    );
    assert_eq!(out, vec![42], "a failed copy leaves the output as it was");
    assert_eq!(shard.token(2).unwrap(), 6);
    let (bin, idx) = megatron_pair(5, &[vec![vec![1 << 40]]]);
    write(d, "big.idx", &idx);
    let shard = open_megatron(&write(d, "big.bin", &bin)).unwrap();
    let msg = shard.token(0).unwrap_err().to_string();
    assert!(
        msg.contains("value 1099511627776 at token 0 (byte 0)"),
        "{msg}"
    );
}

#[test]
fn delimited_documents_cover_the_shard_whatever_its_edges() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    const E: u32 = 9;
    let llmc = |name, tokens: &[u32]| open_llmc(&write(d, name, &llmc_bytes(20240520, 1, tokens)));
    let raw = |name, tokens: &[u32]| open_raw_u16(&write(d, name, &raw_u16_bytes(tokens)));
    let ranges = |shard: TokenShard| shard.documents(E).collect::<Vec<_>>();
    // Before: text ahead of the first delimiter is a document of its own.
    assert_eq!(
        ranges(llmc("a", &[1, E, 2, 3, E, 4]).unwrap()),
        [0..1, 1..4, 4..6]
    );
    assert_eq!(
        ranges(llmc("b", &[E, 2, E, E]).unwrap()),
        [0..2, 2..3, 3..4]
    );
    // After: text past the last delimiter is a document of its own.
    assert_eq!(
        ranges(raw("c", &[1, E, 2, 3, E, 4]).unwrap()),
        [0..2, 2..5, 5..6]
    );
    let no_delimiter = ranges(raw("d", &[1, 2]).unwrap());
    assert_eq!(no_delimiter, std::iter::once(0..2).collect::<Vec<_>>());
    assert_eq!(ranges(raw("e", &[]).unwrap()), Vec::<Range<usize>>::new());
    let shard = raw("f", &[1, E, 2, E]).unwrap();
    assert_eq!(
        shard.document_boundaries(),
        DocumentBoundaries::Delimited(DelimiterPlacement::After)
    );
    assert_eq!(shard.document(0), None);
    assert_eq!(shard.find_token(E, 2..4), Some(3));
    assert_eq!(shard.find_token(E, 2..3), None);
    assert_eq!(shard.find_token(70_000, 0..4), None);
}

#[test]
fn a_megatron_shard_answers_documents_by_index() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let docs = [vec![vec![1, 2], vec![3]], vec![], vec![vec![4, 5, 6]]];
    let (bin, idx) = megatron_pair(3, &docs);
    write(d, "m.idx", &idx);
    let shard = open_megatron(&write(d, "m.bin", &bin)).unwrap();
    assert_eq!((shard.dtype(), shard.len()), (TokenDtype::I16, 6));
    assert_eq!(
        shard.document_boundaries(),
        DocumentBoundaries::Indexed { documents: 3 }
    );
    assert_eq!(shard.document(2), Some(3..6));
    assert_eq!(shard.document(3), None);
    // The index, not the delimiter, says where documents are.
    let got = tokens_of(&shard, shard.documents(2));
    assert_eq!(got, vec![vec![1, 2, 3], vec![], vec![4, 5, 6]]);
}

/// `first_document_start(at)` is the least document start at or after `at` (`len()` if none),
/// by the same documents the iterator gives, for every `at` and every way documents are marked.
#[test]
fn the_first_document_start_after_a_token_agrees_with_the_documents() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    const E: u32 = 9;
    let tokens: [&[u32]; 4] = [
        &[1, E, 2, 3, E, 4],
        &[E, 2, E, E],
        &[1, 2],
        &[E, 1, E, 2, 3],
    ];
    let mut shards = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        let llmc = write(d, &format!("l{i}"), &llmc_bytes(20240520, 1, t));
        shards.push(open_llmc(&llmc).unwrap());
        let raw = write(d, &format!("r{i}"), &raw_u16_bytes(t));
        shards.push(open_raw_u16(&raw).unwrap());
    }
    let docs = [
        vec![vec![1, 2], vec![3]],
        vec![],
        vec![vec![4, 5, 6]],
        vec![vec![7]],
    ];
    let (bin, idx) = megatron_pair(3, &docs);
    write(d, "m.idx", &idx);
    shards.push(open_megatron(&write(d, "m.bin", &bin)).unwrap());
    for shard in &shards {
        let starts: Vec<usize> = shard.documents(E).map(|r| r.start).collect();
        for at in 0..=shard.len() {
            let want = starts
                .iter()
                .copied()
                .find(|&s| s >= at)
                .unwrap_or(shard.len());
            let got = shard.first_document_start(E, at);
            assert_eq!(
                got,
                want,
                "{} at {at}: starts {starts:?}",
                shard.path().display()
            );
        }
    }
}
