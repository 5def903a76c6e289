//! `oobleck data prepare` killed with SIGKILL once its first shard exists, then run again,
//! gives byte for byte the folder of an uninterrupted run, keeping the finished shards.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const OOBLECK: &str = env!("CARGO_BIN_EXE_oobleck");
const SHARD_TOKENS: &str = "20000";

/// A few MB of JSONL: the shipped corpus cut into ~2 KB documents, four times over.
fn write_corpus(path: &Path) {
    let text = std::fs::read_to_string(oobleck_models::data::default_corpus_path()).unwrap();
    let mut out = String::new();
    for round in 0..4 {
        for (i, piece) in text.as_bytes().chunks(2000).enumerate() {
            let piece = String::from_utf8_lossy(piece);
            let doc = serde_json::json!({ "id": format!("{round}-{i}"), "text": piece });
            out.push_str(&doc.to_string());
            out.push('\n');
        }
    }
    std::fs::write(path, out).unwrap();
}

fn prepare(corpus: &Path, out: &Path, workers: &str) -> Command {
    let mut c = Command::new(OOBLECK);
    c.args(["data", "prepare"])
        .arg(corpus)
        .arg("--out")
        .arg(out)
        .args(["--shard-tokens", SHARD_TOKENS, "--workers", workers])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

fn run_ok(mut c: Command) {
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn files_of(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect();
    out.sort();
    out
}

#[test]
fn a_killed_preparation_resumes_to_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus.jsonl");
    write_corpus(&corpus);
    let (full, cut) = (dir.path().join("full"), dir.path().join("cut"));
    run_ok(prepare(&corpus, &full, "2"));

    let mut child = prepare(&corpus, &cut, "1").spawn().unwrap();
    let first = cut.join("shard-000000.bin");
    // The manifest is first written right after the first shard's rename, listing it: from
    // then on that shard is finished and kept (a shard renamed but not yet listed when the
    // kill comes is rewritten, with the same bytes).
    let listed = cut.join("manifest.json");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !listed.exists() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "prepare ended before its first shard"
        );
        assert!(Instant::now() < deadline, "no first shard after 120 s");
        std::thread::sleep(Duration::from_millis(2));
    }
    let still_running = child.try_wait().unwrap().is_none();
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    // SAFETY: kill with signal 0 only asks whether the pid exists.
    let alive = unsafe { libc::kill(child.id() as libc::pid_t, 0) } == 0;
    assert!(!alive, "the killed prepare is gone");
    assert!(
        still_running,
        "prepare finished before it could be killed: a larger corpus is needed"
    );
    let manifest = std::fs::read_to_string(cut.join("manifest.json")).unwrap_or_default();
    assert!(!manifest.contains("\"complete\": true"), "killed mid-way");
    let kept_inode = std::fs::metadata(&first).unwrap().ino();

    run_ok(prepare(&corpus, &cut, "2"));
    assert_eq!(
        std::fs::metadata(&first).unwrap().ino(),
        kept_inode,
        "the first shard was kept"
    );
    let (a, b) = (files_of(&full), files_of(&cut));
    assert!(a.len() > 10, "{} files: several shards", a.len());
    assert_eq!(
        a.iter().map(|f| &f.0).collect::<Vec<_>>(),
        b.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert!(x == y, "{name} differs after the resume");
    }
}

/// What `oobleck data prepare` writes is what `train --data DIR` reads: a JSONL corpus prepared
/// into several shards trains 2 steps on a 2-node local cluster (the manifest beside the
/// shards is not taken for one), from the first loss of an untrained model.
#[test]
fn a_prepared_folder_trains_on_a_local_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus.jsonl");
    write_corpus(&corpus);
    let prepared = dir.path().join("prepared");
    run_ok(prepare(&corpus, &prepared, "2"));
    assert!(prepared.join("manifest.json").is_file());
    let run = dir.path().join("run");
    let o = Command::new(env!("CARGO_BIN_EXE_train"))
        .args(["--model", "gpt-tiny", "--nodes", "2", "--steps", "2"])
        .args([
            "--microbatch-size",
            "2",
            "--global-batch-size",
            "4",
            "--seq-len",
            "32",
        ])
        .args([
            "--eval-batches",
            "1",
            "--sample",
            "0",
            "--fault-threshold",
            "0",
        ])
        .arg("--data")
        .arg(&prepared)
        .arg("--out")
        .arg(&run)
        .env("OOBLECK_BIN", OOBLECK)
        .env("OOBLECK_PROFILE", "analytical")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let losses: Vec<f64> = metrics
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect();
    assert_eq!(losses.len(), 2, "{metrics}");
    assert!((10.0..11.5).contains(&losses[0]), "{losses:?}");
}
