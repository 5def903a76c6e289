//! Several `--data` sources: the blend's shares for every prefix of the run, sample ids and
//! windows that say which source they came from, validation from held-out documents that no
//! training window touches, `--val-data`, and the identity `--resume` compares.
//!
//! Each source is an llm.c shard of documents (an end-of-text id, then the document's ids)
//! whose ids tell the source and the document apart.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use common::{llmc, write};
use oobleck_models::data::{
    open_data, BatchSpec, DataSpec, Dataset, HeldOut, Split, WeightedSource,
};

const EOT: u32 = 50256;

/// `docs` documents, document `d` of `len(d)` ids, each id `id(d, i)`, as an llm.c shard.
fn shard(
    dir: &Path,
    name: &str,
    docs: u32,
    len: impl Fn(u32) -> u32,
    id: impl Fn(u32, u32) -> u32,
) -> PathBuf {
    let mut ids = Vec::new();
    for d in 0..docs {
        ids.push(EOT);
        ids.extend((0..len(d)).map(|i| id(d, i)));
    }
    write(dir, name, &llmc(&ids))
}

/// Web: 300 documents of 40 ids in 1..20000; code: 100 documents of 60 ids in 20000..40000.
fn two_sources(dir: &Path) -> (PathBuf, PathBuf) {
    let web = shard(
        dir,
        "web.bin",
        300,
        |_| 40,
        |d, i| 1 + (d * 131 + i * 17) % 19_999,
    );
    let code = shard(
        dir,
        "code.bin",
        100,
        |_| 60,
        |d, i| 20_000 + (d * 71 + i * 29) % 20_000,
    );
    (web, code)
}

fn weighted(sources: &[(f64, &Path)]) -> DataSpec {
    DataSpec {
        sources: sources
            .iter()
            .map(|&(w, p)| WeightedSource {
                weight: Some(w),
                path: p.to_path_buf(),
            })
            .collect(),
        ..DataSpec::default()
    }
}

fn is_web(row: &[u32]) -> bool {
    let words: Vec<u32> = row.iter().copied().filter(|&t| t != EOT).collect();
    assert!(!words.is_empty(), "a window of only end-of-text ids");
    let web = words.iter().all(|&t| t < 20_000);
    assert!(
        web || words.iter().all(|&t| t >= 20_000),
        "a window mixes sources: {row:?}"
    );
    web
}

#[test]
fn the_blend_holds_each_share_within_one_sample_for_every_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let (web, code) = two_sources(dir.path());
    let blend = open_data(&weighted(&[(0.7, &web), (0.3, &code)]), None).unwrap();
    let web_alone = open_data(&DataSpec::path(&web), None).unwrap();
    let code_alone = open_data(&DataSpec::path(&code), None).unwrap();
    let spec = BatchSpec {
        seq_len: 16,
        microbatch_size: 2,
        num_microbatches: 3,
    };
    let train = blend.split(Split::Train);
    let (web_train, code_train) = (
        web_alone.split(Split::Train),
        code_alone.split(Split::Train),
    );
    let web_windows = web_train.num_samples(spec.seq_len);
    let iterations = train.iterations_per_epoch(&spec).unwrap() as u64;
    let (mut samples, mut from_web) = (0u64, 0u64);
    for epoch in 0..2 {
        for iteration in 0..iterations {
            for k in 0..spec.num_microbatches {
                let batch = train.microbatch(&spec, 7, epoch, iteration, k).unwrap();
                let ids = train.microbatch_ids(&spec, 7, epoch, iteration, k).unwrap();
                assert_eq!(ids, batch.sample_ids, "the ids alone are the batch's");
                for (r, row) in batch.inputs.chunks(spec.seq_len).enumerate() {
                    let id = batch.sample_ids[r];
                    // The id says the source and the window; the window is that source's.
                    let (web_row, alone, window) = match id < web_windows {
                        true => (true, &web_train, id),
                        false => (false, &code_train, id - web_windows),
                    };
                    assert_eq!(is_web(row), web_row, "sample {id}");
                    let expect = alone.sequential_batch(spec.seq_len, 1, window).unwrap();
                    assert_eq!(row, &expect.inputs[..], "sample {id}");
                    samples += 1;
                    from_web += u64::from(web_row);
                    let behind = 0.7 * samples as f64 - from_web as f64;
                    assert!(
                        behind.abs() <= 1.0,
                        "after {samples} samples {from_web} from web"
                    );
                }
            }
        }
    }
    assert!(samples > 1000, "{samples}");
}

#[test]
fn held_out_documents_are_whole_and_no_training_window_touches_them() {
    let dir = tempfile::tempdir().unwrap();
    // Document d: 5 to 11 ids, all d + 1, so an id names its document.
    let path = shard(dir.path(), "docs.bin", 400, |d| 5 + d % 7, |d, _| d + 1);
    let ds = open_data(&DataSpec::path(&path), None).unwrap();
    let [HeldOut::Documents { held, documents }] = ds.held_out()[..] else {
        panic!("{:?}", ds.held_out());
    };
    assert_eq!(documents, 400);
    assert!((8..=40).contains(&held), "{held} of 400 held out at 5%");
    let docs_of = |split: Split| -> BTreeSet<u32> {
        let data = ds.split(split);
        let mut seen = BTreeSet::new();
        for i in 0..data.num_sequential_batches(4, 1) {
            let b = data.sequential_batch(4, 1, i).unwrap();
            seen.extend(b.inputs.iter().chain(&b.targets).filter(|&&t| t != EOT));
        }
        seen
    };
    let (train, validation) = (docs_of(Split::Train), docs_of(Split::Validation));
    assert_eq!(validation.len() as u64, held);
    assert!(train.is_disjoint(&validation));
    assert_eq!(train.len() + validation.len(), 400);

    // The same documents at another fraction: more of them, the earlier ones kept (a document
    // is held out by its own draw); none at 0.
    let spec = |fraction| DataSpec {
        val_fraction: fraction,
        ..DataSpec::path(&path)
    };
    let wider = open_data(&spec(0.2), None).unwrap();
    let [HeldOut::Documents { held: more, .. }] = wider.held_out()[..] else {
        panic!("{:?}", wider.held_out());
    };
    assert!(more > held, "{more} at 20% vs {held} at 5%");
    let none = open_data(&spec(0.0), None).unwrap();
    assert_eq!(none.held_out(), vec![HeldOut::Nothing]);
    assert_eq!(none.split(Split::Validation).num_tokens(), 0);
    assert_eq!(none.split(Split::Train).num_tokens(), none.num_tokens());
}

#[test]
fn val_data_is_the_whole_validation_split_and_nothing_is_held_out_of_training() {
    let dir = tempfile::tempdir().unwrap();
    let (web, code) = two_sources(dir.path());
    let val = shard(
        dir.path(),
        "val.bin",
        20,
        |_| 30,
        |d, i| 45_000 + d * 30 + i,
    );
    let spec = DataSpec {
        val_data: Some(val),
        ..weighted(&[(0.7, &web), (0.3, &code)])
    };
    let ds = open_data(&spec, None).unwrap();
    assert_eq!(ds.held_out(), vec![HeldOut::Nothing, HeldOut::Nothing]);
    assert_eq!(ds.split(Split::Train).num_tokens(), ds.num_tokens());
    let validation = ds.split(Split::Validation);
    assert_eq!(validation.num_tokens(), 20 * 31);
    for i in 0..validation.num_sequential_batches(8, 2) {
        let b = validation.sequential_batch(8, 2, i).unwrap();
        assert!(b.inputs.iter().all(|&t| t == EOT || t >= 45_000), "{b:?}");
    }
}

#[test]
fn a_blend_s_identity_names_its_sources_and_weights() {
    let dir = tempfile::tempdir().unwrap();
    let (web, code) = two_sources(dir.path());
    let open = |w: f64| open_data(&weighted(&[(w, &web), (1.0 - w, &code)]), None).unwrap();
    let (a, again, other) = (open(0.7), open(0.7), open(0.6));
    assert_eq!(a.tokens_sha256(), again.tokens_sha256());
    assert_ne!(
        a.tokens_sha256(),
        other.tokens_sha256(),
        "the weights are part of it"
    );
    let ids: Vec<(PathBuf, String)> = a.source_identities();
    let alone = |p: &Path| open_data(&DataSpec::path(p), None).unwrap();
    assert_eq!(
        ids[0],
        (web.clone(), alone(&web).tokens_sha256().to_string())
    );
    assert_eq!(
        ids[1],
        (code.clone(), alone(&code).tokens_sha256().to_string())
    );
    assert!(a.corpus().display().to_string().contains("code.bin"));
}

#[test]
fn weights_are_given_for_every_source_or_none() {
    let dir = tempfile::tempdir().unwrap();
    let (web, code) = two_sources(dir.path());
    let mut spec = weighted(&[(0.7, &web), (0.3, &code)]);
    spec.sources[1].weight = None;
    let msg = open_data(&spec, None).unwrap_err().to_string();
    assert!(msg.contains("code.bin has no weight"), "{msg}");
    assert!(msg.contains("0.7:web"), "says how: {msg}");
    let msg = open_data(&weighted(&[(0.0, &web), (1.0, &code)]), None)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("above zero"), "{msg}");

    // No weights: each source weighs its tokens.
    spec.sources[0].weight = None;
    let by_tokens: Dataset = open_data(&spec, None).unwrap();
    assert_eq!(by_tokens.num_tokens(), 300 * 41 + 100 * 61);
}
