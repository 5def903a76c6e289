//! A [`Dataset`] over pre-tokenized shards serves exactly the microbatches of a text corpus
//! with the same ids: the shipped corpus's 1,562,739 ids written as an llm.c u16 shard, a
//! Megatron `.bin`/`.idx` pair, and a raw u16 file cut in two (at a place no window boundary
//! falls on, so windows cross files). Also the checks made when shards are opened.
//!
//! The files are written here from their documented layouts (llm.c
//! `dev/data/data_common.py::write_datafile`, Megatron-LM `_IndexWriter`, nanoGPT
//! `prepare.py`), independently of the readers.

mod common;

use std::path::Path;

use common::{llmc, u16_bytes, write};
use oobleck_models::data::{
    open_data, open_dataset, BatchSpec, DataSpec, Dataset, FormatHint, Split, GPT2_VOCAB_SIZE,
};

/// `--data PATH --data-format HINT`.
fn spec(path: &Path, format: FormatHint) -> DataSpec {
    DataSpec {
        format,
        ..DataSpec::path(path)
    }
}

/// The shipped corpus (built in) and all of its ids.
fn text_corpus() -> (Dataset, Vec<u32>) {
    let ds = open_dataset(None, None).unwrap();
    let mut ids = Vec::new();
    ds.copy_tokens(0..ds.num_tokens(), &mut ids).unwrap();
    (ds, ids)
}

/// A Megatron pair of uint16 tokens (dtype code 8), one document per `doc` ids.
fn megatron(ids: &[u32], doc: usize) -> (Vec<u8>, Vec<u8>) {
    let lengths: Vec<i32> = ids.chunks(doc).map(|c| c.len() as i32).collect();
    let pointers: Vec<i64> = (0..lengths.len()).map(|i| (i * doc * 2) as i64).collect();
    let documents: Vec<i64> = (0..=lengths.len() as i64).collect();
    let mut idx = b"MMIDIDX\x00\x00".to_vec();
    idx.extend_from_slice(&1u64.to_le_bytes());
    idx.push(8);
    idx.extend_from_slice(&(lengths.len() as u64).to_le_bytes());
    idx.extend_from_slice(&(documents.len() as u64).to_le_bytes());
    lengths.iter().for_each(|l| idx.extend(l.to_le_bytes()));
    pointers.iter().for_each(|p| idx.extend(p.to_le_bytes()));
    documents.iter().for_each(|d| idx.extend(d.to_le_bytes()));
    (u16_bytes(ids), idx)
}

/// Every train microbatch of the first iterations of two epochs, and every sequential batch
/// of both splits, are equal in `a` and `b`.
fn assert_same_batches(a: &Dataset, b: &Dataset, what: &str) {
    assert_eq!(a.num_tokens(), b.num_tokens(), "{what}");
    let spec = BatchSpec {
        seq_len: 64,
        microbatch_size: 2,
        num_microbatches: 3,
    };
    let (ta, tb) = (a.split(Split::Train), b.split(Split::Train));
    for epoch in 0..2 {
        for iteration in 0..20 {
            for k in 0..spec.num_microbatches {
                let x = ta.microbatch(&spec, 7, epoch, iteration, k).unwrap();
                let y = tb.microbatch(&spec, 7, epoch, iteration, k).unwrap();
                assert_eq!(x, y, "{what}: epoch {epoch} iteration {iteration} mb {k}");
            }
        }
    }
    for split in [Split::Train, Split::Validation] {
        let (sa, sb) = (a.split(split), b.split(split));
        for i in 0..sa.num_sequential_batches(64, 256) {
            let x = sa.sequential_batch(64, 256, i).unwrap();
            assert_eq!(
                x,
                sb.sequential_batch(64, 256, i).unwrap(),
                "{what}: {split} {i}"
            );
        }
    }
}

#[test]
fn shards_of_the_corpus_ids_give_the_text_corpus_s_microbatches() {
    let (text, ids) = text_corpus();
    let dir = tempfile::tempdir().unwrap();
    let llmc_path = write(dir.path(), "corpus.bin", &llmc(&ids));
    // One document, as the text file is: validation holds out whole documents, so the same ids
    // give the same batches only when they are the same documents.
    let (bin, idx) = megatron(&ids, ids.len());
    write(dir.path(), "mega_text_document.bin", &bin);
    write(dir.path(), "mega_text_document.idx", &idx);
    // 64 * 10_000 + 5: a train window starts every 64 tokens, so one crosses the cut.
    let raw = dir.path().join("raw");
    std::fs::create_dir(&raw).unwrap();
    let cut = 64 * 10_000 + 5;
    write(&raw, "train_000.bin", &u16_bytes(&ids[..cut]));
    write(&raw, "train_001.bin", &u16_bytes(&ids[cut..]));

    let sources = [
        (llmc_path, FormatHint::Detect),
        (dir.path().join("mega_text_document"), FormatHint::Detect),
        (raw.join("train_*.bin"), FormatHint::RawU16),
        (raw.clone(), FormatHint::RawU16),
    ];
    for (path, hint) in sources {
        let shards = open_data(&spec(&path, hint), None).unwrap();
        assert_eq!(shards.corpus(), path);
        assert_eq!(shards.cache_path(), None);
        shards.check_vocab(GPT2_VOCAB_SIZE).unwrap();
        assert_same_batches(&text, &shards, &path.display().to_string());
        assert_ne!(shards.tokens_sha256(), text.tokens_sha256());
    }
    // The identity is of the files' names and tokens, not of where they are.
    let moved = tempfile::tempdir().unwrap();
    std::fs::copy(
        dir.path().join("corpus.bin"),
        moved.path().join("corpus.bin"),
    )
    .unwrap();
    let here = open_data(
        &spec(&dir.path().join("corpus.bin"), FormatHint::Detect),
        None,
    );
    let there = open_data(
        &spec(&moved.path().join("corpus.bin"), FormatHint::Detect),
        None,
    );
    assert_eq!(
        here.unwrap().tokens_sha256(),
        there.unwrap().tokens_sha256()
    );
}

#[test]
fn the_identity_of_shards_changes_with_any_token() {
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<u32> = (0..5000).map(|i| i % 50000).collect();
    let path = write(dir.path(), "a.bin", &llmc(&ids));
    let before = open_data(&spec(&path, FormatHint::Detect), None).unwrap();
    let mut changed = ids.clone();
    changed[2500] += 1;
    write(dir.path(), "a.bin", &llmc(&changed));
    let after = open_data(&spec(&path, FormatHint::Detect), None).unwrap();
    assert_ne!(before.tokens_sha256(), after.tokens_sha256());
}

#[test]
fn opening_shards_names_the_file_and_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let mut ids: Vec<u32> = (0..5000).map(|i| i % 1000).collect();
    ids[1234] = GPT2_VOCAB_SIZE as u32;
    let bad = write(dir.path(), "bad.bin", &llmc(&ids));
    let ds = open_data(&spec(&bad, FormatHint::Detect), None).unwrap();
    let msg = ds.check_vocab(GPT2_VOCAB_SIZE).unwrap_err().to_string();
    assert!(msg.contains("bad.bin"), "{msg}");
    assert!(msg.contains("token id 50257 at token 1234"), "{msg}");
    assert!(msg.contains("vocabulary of 50257"), "{msg}");

    let nothing = dir.path().join("fineweb_train_*.bin");
    let msg = open_data(&spec(&nothing, FormatHint::Detect), None)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("fineweb_train_*.bin: no file matches"),
        "{msg}"
    );

    let raw = write(dir.path(), "train.bin", &u16_bytes(&ids[..100]));
    let msg = open_data(&spec(&raw, FormatHint::Detect), None)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("train.bin"), "{msg}");
    assert!(msg.contains("--data-format u16"), "{msg}");

    let empty = write(dir.path(), "empty.bin", &llmc(&[]));
    let msg = open_data(&spec(&empty, FormatHint::Detect), None)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("empty.bin"), "{msg}");
}
