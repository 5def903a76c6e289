//! A cloud VM needs one file for the default job: the `train` binary alone, copied into an
//! empty directory, runs a 2-node local cluster (its agents and workers are itself, the corpus
//! and tokenizer are compiled in).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const TRAIN: &str = env!("CARGO_BIN_EXE_train");

#[test]
fn train_alone_in_an_empty_directory_runs_a_two_node_job() {
    let dir = tempfile::tempdir().expect("tempdir");
    let exe = dir.path().join("train");
    std::fs::copy(TRAIN, &exe).expect("copy train");
    let work = dir.path().join("work");
    std::fs::create_dir(&work).expect("work dir");
    let mut child = Command::new(&exe)
        .current_dir(&work)
        .args([
            "--nodes",
            "2",
            "--model",
            "gpt-tiny",
            "--microbatch-size",
            "2",
            "--global-batch-size",
            "4",
            "--seq-len",
            "32",
            "--eval-batches",
            "1",
            "--sample",
            "0",
            "--steps",
            "2",
            "--checkpoint-every",
            "0",
            "--eval-every",
            "0",
            "--out",
            "run",
        ])
        .env_remove("OOBLECK_BIN")
        .env("OOBLECK_CACHE_DIR", dir.path().join("cache"))
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the copied train");
    let start = Instant::now();
    while child.try_wait().expect("poll").is_none() {
        if start.elapsed() > Duration::from_secs(180) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the copied train ran past 180 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("output");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("done: 2 steps"), "{stderr}");
    let metrics = std::fs::read_to_string(work.join("run/metrics.jsonl")).expect("metrics");
    assert_eq!(metrics.lines().count(), 2, "{metrics}");
    // Every process the job started (agents, workers) is gone.
    let events = std::fs::read_to_string(work.join("run/events.jsonl")).expect("events");
    for line in events.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        if v["event"] == "process" {
            let pid = v["pid"].as_u64().expect("pid");
            assert!(
                !std::path::Path::new(&format!("/proc/{pid}")).exists()
                    || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                        .is_ok_and(|s| s.contains(") Z ")),
                "process {pid} outlived the job"
            );
        }
    }
}
