//! The shipped corpus and tokenizer are found without flags, tokenize, and serve batches.
//! Uses the default cache location, so the first run here writes `datasets/shakespeare.txt.tokens`
//! (git-ignored) and later runs, and `train`, reuse it.

use oobleck_models::data::{
    default_corpus_path, default_tokenizer_dir, BatchSpec, Dataset, Split, GPT2_VOCAB_SIZE,
};

#[test]
fn shipped_corpus_opens_with_the_default_paths_and_decodes_back() {
    let corpus = default_corpus_path();
    let ds = Dataset::open(&corpus, &default_tokenizer_dir(), None).unwrap();
    ds.tokenizer().check_vocab(GPT2_VOCAB_SIZE).unwrap();
    // tiktoken's GPT-2 encoding of the same file gives these 1,562,739 ids (u16 LE, hashed);
    // see datasets/README.md for the command.
    assert_eq!(ds.num_tokens(), 1_562_739);
    assert_eq!(
        ds.tokens_sha256(),
        "1413959d6fb94ab7d408e11a8cbb5ddc96c609ec5d114b7fac8904efb92f6c9a"
    );

    let text = std::fs::read_to_string(&corpus).unwrap();
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
