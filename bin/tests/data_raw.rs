//! `train --data corpus.jsonl` prepares the raw corpus once into the data cache and trains on
//! it exactly as on `oobleck data prepare corpus.jsonl --out DIR` then `train --data DIR`, on
//! a 2-node local cluster; a second run reuses the cache without writing to it.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime};

use common::{losses, run, train_cmd, OOBLECK};

/// The shipped corpus cut into ~2 KB documents, as JSONL (about 550 records).
fn write_corpus(path: &Path) {
    let text = std::fs::read_to_string(oobleck_models::data::default_corpus_path()).unwrap();
    let mut out = String::new();
    for (i, piece) in text.as_bytes().chunks(2000).enumerate() {
        let piece = String::from_utf8_lossy(piece);
        let doc = serde_json::json!({ "id": i, "text": piece });
        out.push_str(&doc.to_string());
        out.push('\n');
    }
    std::fs::write(path, out).unwrap();
}

/// Trains 2 steps on 2 nodes on `data`, the data cache in `cache`; the per-step losses and
/// what the job printed.
fn two_steps(out: &Path, data: &Path, cache: &Path) -> (Vec<(u64, f64)>, String) {
    let mut cmd = train_cmd(out, 2, &["--nodes", "2", "--data", data.to_str().unwrap()]);
    cmd.env("OOBLECK_CACHE_DIR", cache);
    let o = run(cmd, Duration::from_secs(300));
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{}: {stderr}", data.display());
    let got = losses(out);
    assert_eq!(got.len(), 2, "{got:?}");
    (got, stderr)
}

/// The one `*.prepared` folder in `cache`.
fn prepared_folder(cache: &Path) -> PathBuf {
    let found: Vec<PathBuf> = std::fs::read_dir(cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".prepared"))
        .collect();
    assert_eq!(found.len(), 1, "{found:?}");
    found[0].clone()
}

/// Name, bytes, inode and modification time of each file of a prepared folder.
type Stamp = Vec<(String, Vec<u8>, u64, SystemTime)>;

fn stamp(dir: &Path) -> Stamp {
    let mut out: Stamp = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "bin" || e == "json"))
        .map(|p| {
            let m = std::fs::metadata(&p).unwrap();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (
                name,
                std::fs::read(&p).unwrap(),
                m.ino(),
                m.modified().unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

#[test]
fn raw_jsonl_trains_like_its_prepared_folder_and_a_second_run_reuses_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus.jsonl");
    write_corpus(&corpus);
    let prepared = dir.path().join("prepared");
    let o = Command::new(OOBLECK)
        .args(["data", "prepare"])
        .arg(&corpus)
        .arg("--out")
        .arg(&prepared)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let cache = dir.path().join("cache");

    let (from_dir, _) = two_steps(&dir.path().join("dir"), &prepared, &cache);
    let (first, log) = two_steps(&dir.path().join("raw1"), &corpus, &cache);
    assert!(
        log.contains("preparing the raw data once into the cache"),
        "{log}"
    );
    assert_eq!(
        log.matches("prepared the raw data").count(),
        1,
        "one process prepares: {log}"
    );
    assert_eq!(
        first, from_dir,
        "train --data corpus.jsonl vs its prepared folder"
    );
    let cached = prepared_folder(&cache);
    let before = stamp(&cached);
    let shards = |s: &Stamp| -> Vec<(String, Vec<u8>)> {
        s.iter()
            .filter(|f| f.0.ends_with(".bin"))
            .map(|f| (f.0.clone(), f.1.clone()))
            .collect()
    };
    assert_eq!(
        shards(&before),
        shards(&stamp(&prepared)),
        "the same shard bytes"
    );

    let (second, log) = two_steps(&dir.path().join("raw2"), &corpus, &cache);
    assert_eq!(second, first);
    assert_eq!(
        stamp(&cached),
        before,
        "the second run wrote nothing to the cache"
    );
    eprintln!("{log}");
}

/// `train --text-field` and `--skip-bad-records` read raw records as `oobleck data prepare`'s
/// flags do: a bad line stops the run (naming the file, the line and the flag) unless it is
/// skipped, and the text comes from the named field.
#[test]
fn train_reads_the_named_text_field_and_skips_bad_records_when_told() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(oobleck_models::data::default_corpus_path()).unwrap();
    let mut lines: Vec<String> = text
        .as_bytes()
        .chunks(2000)
        .map(|piece| serde_json::json!({ "body": String::from_utf8_lossy(piece) }).to_string())
        .collect();
    lines.insert(3, "{not json".into());
    let corpus = dir.path().join("bodies.jsonl");
    std::fs::write(&corpus, lines.join("\n") + "\n").unwrap();
    let cache = dir.path().join("cache");
    let train = |name: &str, extra: &[&str]| {
        let mut args = vec!["--nodes", "1", "--data", corpus.to_str().unwrap()];
        args.extend(extra);
        let mut cmd = train_cmd(&dir.path().join(name), 1, &args);
        cmd.env("OOBLECK_CACHE_DIR", &cache);
        run(cmd, Duration::from_secs(300))
    };
    let strict = train("strict", &["--text-field", "body"]);
    let err = String::from_utf8_lossy(&strict.stderr);
    assert!(!strict.status.success());
    assert!(
        err.contains("bodies.jsonl")
            && err.contains("line 4")
            && err.contains("--skip-bad-records"),
        "{err}"
    );
    let wrong_field = train("field", &["--skip-bad-records"]);
    assert!(!wrong_field.status.success(), "no record has `text`");
    let ok = train("ok", &["--text-field", "body", "--skip-bad-records"]);
    let log = String::from_utf8_lossy(&ok.stderr);
    assert!(ok.status.success(), "{log}");
    assert!(log.contains("skipped_records=1"), "{log}");
    assert_eq!(losses(&dir.path().join("ok")).len(), 1);
}

/// `oobleck data cache` says which preparations in the cache are stale (their source changed)
/// and `--prune` removes those, keeping the current one.
#[test]
fn the_cache_lists_a_stale_preparation_and_prune_removes_only_it() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let (old, kept) = (dir.path().join("old.jsonl"), dir.path().join("kept.jsonl"));
    for (i, src) in [&old, &kept].into_iter().enumerate() {
        write_corpus(src);
        let mut cmd = train_cmd(&dir.path().join(format!("r{i}")), 1, &["--nodes", "1"]);
        cmd.args(["--data", src.to_str().unwrap()])
            .env("OOBLECK_CACHE_DIR", &cache);
        let o = run(cmd, Duration::from_secs(300));
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    std::fs::write(&old, "{\"text\": \"edited\"}\n").unwrap();
    let cache_cmd = |extra: &[&str]| {
        let o = Command::new(OOBLECK)
            .args(["data", "cache"])
            .args(extra)
            .env("OOBLECK_CACHE_DIR", &cache)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let listed = cache_cmd(&[]);
    let line = |name: &str| {
        listed
            .lines()
            .find(|l| l.contains(name))
            .unwrap_or_default()
            .to_string()
    };
    assert!(
        line("old.jsonl-").contains("stale: ") && line("old.jsonl-").contains("changed"),
        "{listed}"
    );
    assert!(line("kept.jsonl-").ends_with("current"), "{listed}");
    assert!(listed.contains("--prune"), "{listed}");
    let pruned = cache_cmd(&["--prune"]);
    assert!(pruned.contains("freed"), "{pruned}");
    let after = cache_cmd(&[]);
    assert!(
        !after.contains("old.jsonl-") && after.contains("kept.jsonl-"),
        "{after}"
    );
}
