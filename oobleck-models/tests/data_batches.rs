//! Token cache and batch order on a small real corpus (the first 40 kB of the shipped one).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use oobleck_models::data::{
    default_tokenizer_dir, BatchSpec, DataCursor, DataError, Dataset, Gpt2Tokenizer, Split,
    EMBEDDED_CORPUS, VALIDATION_PER_MILLE,
};

const SEED: u64 = 42;

fn tokenizer() -> Arc<Gpt2Tokenizer> {
    Arc::new(Gpt2Tokenizer::from_path(&default_tokenizer_dir()).unwrap())
}

/// A temp folder with `corpus.txt` (real English text) and a `cache/` folder.
fn small_corpus(bytes: usize) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let text = EMBEDDED_CORPUS;
    let end = text[..bytes].rfind('\n').unwrap() + 1;
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, &text[..end]).unwrap();
    let cache = dir.path().join("cache");
    (dir, corpus, cache)
}

fn open(corpus: &Path, cache: &Path) -> Dataset {
    Dataset::open_with(corpus, tokenizer(), Some(cache)).unwrap()
}

const SPEC: BatchSpec = BatchSpec {
    seq_len: 32,
    microbatch_size: 3,
    num_microbatches: 4,
};

#[test]
fn splits_are_a_contiguous_tail_and_windows_shift_by_one() {
    let (_dir, corpus, cache) = small_corpus(40_000);
    let ds = open(&corpus, &cache);
    let n = ds.num_tokens();
    let (train, val) = (ds.split(Split::Train), ds.split(Split::Validation));
    assert_eq!(val.num_tokens(), n * VALIDATION_PER_MILLE / 1000);
    assert_eq!(train.num_tokens() + val.num_tokens(), n);
    assert_eq!(
        train.num_samples(SPEC.seq_len),
        (train.num_tokens() - 1) / SPEC.seq_len
    );

    // Sequential sample 0 of train is the start of the corpus; targets are inputs shifted.
    let first = train.sequential_batch(SPEC.seq_len, 2, 0).unwrap();
    let ids = ds
        .tokenizer()
        .encode(&std::fs::read_to_string(&corpus).unwrap())
        .unwrap();
    assert_eq!(first.inputs[..32], ids[..32]);
    assert_eq!(first.targets[..32], ids[1..33]);
    assert_eq!(first.inputs[32..], ids[32..64]);
    // Validation starts right after train.
    let v = val.sequential_batch(SPEC.seq_len, 1, 0).unwrap();
    assert_eq!(
        v.inputs[..],
        ids[train.num_tokens()..train.num_tokens() + 32]
    );
    assert!(val
        .sequential_batch(SPEC.seq_len, 1, val.num_samples(32))
        .is_err());
}

#[test]
fn microbatches_are_deterministic_disjoint_and_cover_each_iteration_once() {
    let (_dir, corpus, cache) = small_corpus(40_000);
    let ds = open(&corpus, &cache);
    let train = ds.split(Split::Train);
    let iterations = train.iterations_per_epoch(&SPEC).unwrap();
    assert_eq!(iterations, train.num_samples(32) / 12);
    let order = train.epoch_order(SEED, 0, 32);

    let mut seen = HashSet::new();
    for t in 0..iterations as u64 {
        let mut in_iteration = Vec::new();
        for k in 0..SPEC.num_microbatches {
            let mb = train.microbatch(&SPEC, SEED, 0, t, k).unwrap();
            assert_eq!(mb.inputs.len(), 3 * 32);
            assert_eq!(mb.targets.len(), 3 * 32);
            for row in 0..3 {
                assert_eq!(
                    mb.inputs[row * 32 + 1..(row + 1) * 32],
                    mb.targets[row * 32..(row + 1) * 32 - 1]
                );
            }
            in_iteration.extend(mb.sample_ids);
        }
        // Iteration t is exactly positions [t*B*b, (t+1)*B*b) of the epoch order, in order.
        let start = t as usize * 12;
        let expected: Vec<usize> = (start..start + 12)
            .map(|p| order.at(p as u64) as usize)
            .collect();
        assert_eq!(in_iteration, expected);
        for s in in_iteration {
            assert!(seen.insert(s), "sample {s} served twice in one epoch");
        }
    }
    assert_eq!(seen.len(), iterations * 12);

    // Same request, fresh Dataset (cache hit): same data.
    let again = open(&corpus, &cache);
    assert_eq!(
        again
            .split(Split::Train)
            .microbatch(&SPEC, SEED, 0, 1, 2)
            .unwrap(),
        train.microbatch(&SPEC, SEED, 0, 1, 2).unwrap()
    );
}

#[test]
fn seeds_and_epochs_change_the_order() {
    let (_dir, corpus, cache) = small_corpus(40_000);
    let ds = open(&corpus, &cache);
    let train = ds.split(Split::Train);
    let ids = |seed, epoch| {
        train
            .microbatch(&SPEC, seed, epoch, 0, 0)
            .unwrap()
            .sample_ids
    };
    assert_ne!(ids(SEED, 0), ids(SEED + 1, 0));
    assert_ne!(ids(SEED, 0), ids(SEED, 1));
    assert_eq!(ids(SEED, 1), ids(SEED, 1));
    let cursor = DataCursor {
        epoch: 1,
        iteration: 0,
    };
    assert_eq!(
        train
            .microbatch_at(&SPEC, SEED, cursor, 0)
            .unwrap()
            .sample_ids,
        ids(SEED, 1)
    );
}

#[test]
fn too_small_datasets_and_bad_requests_give_the_numbers() {
    let (_dir, corpus, cache) = small_corpus(2_000);
    let ds = open(&corpus, &cache);
    let big = BatchSpec {
        seq_len: 64,
        microbatch_size: 8,
        num_microbatches: 8,
    };
    let err = ds
        .split(Split::Train)
        .iterations_per_epoch(&big)
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, DataError::TooSmall { needed: 64, .. }),
        "{msg}"
    );
    assert!(
        msg.contains("train") && msg.contains("corpus.txt") && msg.contains("64 samples"),
        "{msg}"
    );

    let train = ds.split(Split::Train);
    let small = BatchSpec {
        seq_len: 8,
        microbatch_size: 2,
        num_microbatches: 2,
    };
    let iterations = train.iterations_per_epoch(&small).unwrap() as u64;
    assert!(train.microbatch(&small, SEED, 0, 0, 2).is_err());
    assert!(train.microbatch(&small, SEED, 0, iterations, 0).is_err());
    let zero = BatchSpec {
        seq_len: 0,
        ..small
    };
    assert!(train.iterations_per_epoch(&zero).is_err());
}

#[test]
fn stale_and_corrupt_caches_are_rebuilt() {
    let (_dir, corpus, cache) = small_corpus(20_000);
    let ds = open(&corpus, &cache);
    let path = ds.cache_path().unwrap().to_path_buf();
    assert_eq!(path, cache.join("corpus.txt.tokens"));
    let before = ds.num_tokens();
    drop(ds);

    // Corpus changed: the cache is stale and rebuilt from the new text.
    let mut text = std::fs::read_to_string(&corpus).unwrap();
    text.push_str("Exeunt omnes, pursued by a bear.\n");
    std::fs::write(&corpus, &text).unwrap();
    let ds = open(&corpus, &cache);
    assert!(ds.num_tokens() > before);
    let ids = ds.tokenizer().encode(&text).unwrap();
    let last = ds.split(Split::Validation);
    let tail = last.sequential_batch(1, last.num_samples(1), 0).unwrap();
    assert_eq!(tail.targets.last(), ids.last());
    let tokens = ds.num_tokens();
    drop(ds);

    // Token bytes flipped on disk: detected by the data hash, rebuilt.
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() - 2;
    bytes[at] ^= 0x5a;
    std::fs::write(&path, &bytes).unwrap();
    let ds = open(&corpus, &cache);
    assert_eq!(ds.num_tokens(), tokens);
    assert_ne!(std::fs::read(&path).unwrap(), bytes);
    let val = ds.split(Split::Validation);
    assert_eq!(
        val.sequential_batch(1, val.num_samples(1), 0)
            .unwrap()
            .targets
            .last(),
        ids.last()
    );

    // Truncated file: rebuilt too.
    std::fs::write(&path, &bytes[..100]).unwrap();
    assert_eq!(open(&corpus, &cache).num_tokens(), tokens);

    // Another tokenizer: stale, rebuilt with that tokenizer's ids.
    let other = tempfile::tempdir().unwrap();
    std::fs::write(
        other.path().join("vocab.json"),
        r#"{"a": 0, "b": 1, "Ġ": 2}"#,
    )
    .unwrap();
    std::fs::write(other.path().join("merges.txt"), "#version: 0.2\n").unwrap();
    std::fs::write(&corpus, "ab ba ").unwrap();
    let tok = Arc::new(Gpt2Tokenizer::from_path(other.path()).unwrap());
    let ds = Dataset::open_with(&corpus, tok, Some(&cache)).unwrap();
    assert_eq!(ds.num_tokens(), 6);
    assert_eq!(
        ds.split(Split::Train)
            .sequential_batch(5, 1, 0)
            .unwrap()
            .inputs,
        vec![0, 1, 2, 1, 0]
    );
}

#[test]
fn missing_unreadable_or_unwritable_inputs_are_clear_errors() {
    let (dir, corpus, _cache) = small_corpus(2_000);
    let missing = dir.path().join("no-such-corpus.txt");
    let err = Dataset::open(&missing, &default_tokenizer_dir(), None).unwrap_err();
    assert!(matches!(err, DataError::NotFound { what: "corpus", .. }));
    assert!(err.to_string().contains("no-such-corpus.txt"), "{err}");

    let err = Dataset::open(&corpus, &dir.path().join("no-tokenizer"), None).unwrap_err();
    assert!(err.to_string().contains("no-tokenizer"), "{err}");

    let err = Dataset::open_with(dir.path(), tokenizer(), None).unwrap_err();
    assert!(matches!(err, DataError::NotAFile { .. }), "{err}");

    let latin1 = dir.path().join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9 au lait").unwrap();
    let err = Dataset::open_with(&latin1, tokenizer(), Some(dir.path())).unwrap_err();
    assert!(matches!(err, DataError::NotUtf8 { offset: 3, .. }), "{err}");

    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, b"").unwrap();
    let err = Dataset::open_with(&empty, tokenizer(), Some(dir.path())).unwrap_err();
    assert!(matches!(err, DataError::EmptyCorpus { .. }), "{err}");

    // A cache folder that cannot be created (its parent is a file), even for root.
    let blocker = dir.path().join("a-file");
    std::fs::write(&blocker, b"x").unwrap();
    let err = Dataset::open_with(&corpus, tokenizer(), Some(&blocker.join("cache"))).unwrap_err();
    assert!(matches!(err, DataError::NoWritableCache { .. }), "{err}");
    assert!(err.to_string().contains("a-file"), "{err}");
}

#[test]
fn default_cache_lives_next_to_the_corpus_unless_overridden() {
    let (_dir, corpus, _cache) = small_corpus(2_000);
    let ds = Dataset::open_with(&corpus, tokenizer(), None).unwrap();
    let path = ds.cache_path().unwrap();
    match std::env::var_os("OOBLECK_CACHE_DIR").filter(|d| !d.is_empty()) {
        None => assert_eq!(path, corpus.with_file_name("corpus.txt.tokens")),
        Some(dir) => assert!(path.starts_with(dir)),
    }
    assert!(path.is_file());
}
