//! `train --data RAW`'s cache: prepared once, reused, prepared anew when a source changes,
//! once for concurrent callers, in the next place when one is not writable.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};

use super::cache::{cache_key, Cached, Outcome};
use super::tests::{jsonl, shards_of, texts, tok};
use super::*;

/// Prepares `files` into the first usable of `places` with 2 threads.
fn cached(files: &[PathBuf], places: &[PathBuf]) -> (PathBuf, Outcome) {
    let files: Vec<PathBuf> = files
        .iter()
        .map(|f| std::fs::canonicalize(f).unwrap())
        .collect();
    let key = cache_key(&files, &tok(), &read()).unwrap();
    let c = Cached {
        label: Path::new("src"),
        files: &files,
        key: &key,
        workers: 2,
        read: &read(),
    };
    c.prepare_in(places, &tok()).unwrap()
}

/// `oobleck data prepare`'s defaults: the `text` field, bad records an error.
fn read() -> ReadOptions {
    super::tests::read_opts(false)
}

fn manifest_stamp(dir: &Path) -> (std::time::SystemTime, u64) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(dir.join(MANIFEST_FILE)).unwrap();
    (m.modified().unwrap(), m.ino())
}

#[test]
fn prepared_once_reused_after_and_prepared_anew_when_a_source_changes() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("a.jsonl");
    std::fs::write(&src, jsonl(&texts(40))).unwrap();
    let place = dir.path().join("a.jsonl.prepared");
    let (got, outcome) = cached(std::slice::from_ref(&src), std::slice::from_ref(&place));
    assert_eq!(
        (got.as_path(), outcome),
        (place.as_path(), Outcome::Prepared)
    );
    // The same shards as `oobleck data prepare a.jsonl --out DIR`.
    let direct = dir.path().join("direct");
    let opts = PrepareOptions {
        sources: vec![src.display().to_string()],
        out: direct.clone(),
        shard_tokens: DEFAULT_SHARD_TOKENS,
        workers: 1,
        read: super::tests::read_opts(false),
    };
    prepare(&opts, &tok(), &mut |_| {}).unwrap();
    assert_eq!(shards_of(&place), shards_of(&direct));
    let stamp = manifest_stamp(&place);
    assert_eq!(
        cached(std::slice::from_ref(&src), std::slice::from_ref(&place)).1,
        Outcome::Reused
    );
    assert_eq!(manifest_stamp(&place), stamp, "a reuse writes nothing");
    // A rewritten source (another size) is another key: the folder is prepared anew.
    std::fs::write(&src, jsonl(&texts(41))).unwrap();
    assert_eq!(
        cached(std::slice::from_ref(&src), std::slice::from_ref(&place)).1,
        Outcome::Prepared
    );
    std::fs::remove_dir_all(&direct).unwrap();
    prepare(&opts, &tok(), &mut |_| {}).unwrap();
    assert_eq!(shards_of(&place), shards_of(&direct));
}

#[test]
fn concurrent_callers_prepare_once_and_all_read_the_finished_folder() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("a.jsonl");
    std::fs::write(&src, jsonl(&texts(200))).unwrap();
    let place = dir.path().join("cache").join("a.prepared");
    let start = Arc::new(Barrier::new(4));
    let outcomes: Vec<(PathBuf, Outcome)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let (start, src, place) = (start.clone(), src.clone(), place.clone());
                s.spawn(move || {
                    start.wait();
                    cached(&[src], &[place])
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(outcomes.iter().all(|(d, _)| *d == place));
    let prepared = outcomes
        .iter()
        .filter(|(_, o)| *o == Outcome::Prepared)
        .count();
    assert_eq!(prepared, 1, "{outcomes:?}");
    let m = Manifest::load(&place).unwrap().unwrap();
    assert!(m.complete);
    assert_eq!(m.totals.documents, 200);
}

#[test]
fn a_place_that_cannot_be_created_gives_way_to_the_next() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("a.jsonl");
    std::fs::write(&src, jsonl(&texts(5))).unwrap();
    let blocked = src.join("under-a-file.prepared");
    let next = dir.path().join("next.prepared");
    let (got, outcome) = cached(std::slice::from_ref(&src), &[blocked.clone(), next.clone()]);
    assert_eq!((got, outcome), (next.clone(), Outcome::Prepared));
    // With no usable place the error names what was tried.
    let files = [std::fs::canonicalize(&src).unwrap()];
    let key = cache_key(&files, &tok(), &read()).unwrap();
    let c = Cached {
        label: Path::new("a.jsonl"),
        files: &files,
        key: &key,
        workers: 1,
        read: &read(),
    };
    let err = c.prepare_in(&[blocked], &tok()).unwrap_err().to_string();
    assert!(
        err.contains("no writable cache location") && err.contains("under-a-file.prepared"),
        "{err}"
    );
}

#[test]
fn the_text_field_and_skipping_are_part_of_the_key_and_reach_the_reader() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("b.jsonl");
    let lines = "{\"body\": \"one doc\"}\nnot json\n{\"body\": \"two docs\"}\n";
    std::fs::write(&src, lines).unwrap();
    let files = [std::fs::canonicalize(&src).unwrap()];
    let body = ReadOptions {
        text_field: "body".into(),
        skip_bad_records: true,
    };
    let key = cache_key(&files, &tok(), &body).unwrap();
    assert_ne!(key, cache_key(&files, &tok(), &read()).unwrap());
    let place = dir.path().join("b.prepared");
    let c = Cached {
        label: Path::new("b.jsonl"),
        files: &files,
        key: &key,
        workers: 1,
        read: &body,
    };
    assert_eq!(
        c.prepare_in(std::slice::from_ref(&place), &tok())
            .unwrap()
            .1,
        Outcome::Prepared
    );
    let totals = Manifest::load(&place).unwrap().unwrap().totals;
    assert_eq!((totals.documents, totals.skipped_records), (2, 1));
    // With the defaults the same file is an error naming the line.
    let key = cache_key(&files, &tok(), &read()).unwrap();
    let strict = Cached {
        key: &key,
        read: &read(),
        ..c
    };
    let err = strict
        .prepare_in(&[dir.path().join("c.prepared")], &tok())
        .unwrap_err();
    assert!(err.to_string().contains("line 1"), "{err}");
}
