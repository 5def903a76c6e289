//! The shipped corpus and tokenizer, built into the library, open without paths, tokenize, and
//! serve batches. Uses the default cache location (`$OOBLECK_CACHE_DIR`, else the user cache
//! folder), so the first run here writes `shakespeare.txt-<hash>.tokens` there and later runs,
//! and `train`, reuse it.

use oobleck_models::data::{open_dataset, BatchSpec, Split, EMBEDDED_CORPUS, GPT2_VOCAB_SIZE};

#[test]
fn shipped_corpus_opens_with_the_default_paths_and_decodes_back() {
    let ds = open_dataset(None, None).unwrap();
    ds.tokenizer().check_vocab(GPT2_VOCAB_SIZE).unwrap();
    // tiktoken's GPT-2 encoding of the same file gives these 1,562,739 ids (u16 LE, hashed);
    // see datasets/README.md for the command.
    assert_eq!(ds.num_tokens(), 1_562_739);
    assert_eq!(
        ds.tokens_sha256(),
        "1413959d6fb94ab7d408e11a8cbb5ddc96c609ec5d114b7fac8904efb92f6c9a"
    );

    let text = EMBEDDED_CORPUS;
    let train = ds.split(Split::Train);
    let first = train.sequential_batch(256, 1, 0).unwrap();
    let decoded = ds.tokenizer().decode(&first.inputs).unwrap();
    assert!(text.starts_with(&decoded), "{decoded:?}");
    let val = ds.split(Split::Validation);
    let last = val.sequential_batch(1, val.num_samples(1), 0).unwrap();
    let tail = ds.tokenizer().decode(&last.targets).unwrap();
    assert!(text.ends_with(&tail));

    let spec = BatchSpec {
        seq_len: 256,
        microbatch_size: 4,
        num_microbatches: 8,
    };
    assert!(train.iterations_per_epoch(&spec).unwrap() > 100);
    let mb = train.microbatch(&spec, 1, 0, 0, 0).unwrap();
    assert!(mb.inputs.iter().all(|&id| (id as usize) < GPT2_VOCAB_SIZE));
}
