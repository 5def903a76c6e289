//! A job that cannot fit this machine's memory is refused in seconds, before anything is
//! measured, with the memory it needs and the memory a device has; never killed by the
//! out-of-memory killer while profiling (gpt3-2.7b's 4 profiling copies once grew to 24 GB).
//! The machine's memory is given (`--host-memory`) or limited (`ulimit -v`), so the outcome
//! does not depend on the machine that runs the test.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const TRAIN: &str = env!("CARGO_BIN_EXE_train");

/// Runs `cmd` in `dir` with an empty profile cache, killed after `limit`; returns its output
/// and how long it ran.
fn run_bounded(mut cmd: Command, dir: &Path, limit: Duration) -> (Output, Duration) {
    cmd.current_dir(dir)
        .env("OOBLECK_CACHE_DIR", dir.join("cache"))
        .env_remove("OOBLECK_HOST_MEMORY")
        .env_remove("OOBLECK_PROFILE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = cmd.spawn().expect("start train");
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "train ran past {limit:?} (profiling?): {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let elapsed = start.elapsed();
    (child.wait_with_output().expect("output"), elapsed)
}

/// The refusal's promises: an exit code (no signal), the memory needed and the device's, and
/// nothing profiled.
fn assert_refused_before_profiling(out: &Output, device_words: &str) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "exit 1, not a signal: {stderr}");
    assert!(
        stderr.starts_with("Error: the model does not fit: even one layer per stage needs "),
        "{stderr}"
    );
    assert!(
        stderr.contains("GiB per device, the device has "),
        "{stderr}"
    );
    assert!(stderr.contains("Checked before profiling"), "{stderr}");
    assert!(stderr.contains(device_words), "{stderr}");
    assert!(
        stderr.contains("--recompute") && stderr.contains("--host-memory"),
        "{stderr}"
    );
    assert!(!stderr.contains("profiling gpt3-2.7b"), "{stderr}");
    stderr
}

#[test]
fn a_model_larger_than_the_given_memory_is_refused_before_profiling() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new(TRAIN);
    cmd.args(["--model", "gpt3-2.7b", "--host-memory", "16GiB"]);
    let (out, took) = run_bounded(cmd, dir.path(), Duration::from_secs(20));
    let stderr = assert_refused_before_profiling(&out, "the device has 3.7 GiB");
    assert!(
        stderr.contains("3.7 GiB each of 4 processes: 16.0 GiB (--host-memory) less 8% slack"),
        "{stderr}"
    );
    assert!(took < Duration::from_secs(20), "{took:?}");
}

#[test]
fn ulimit_v_bounds_each_process() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new("sh");
    // 3 GiB of address space per process: below a quarter of any machine that builds this.
    cmd.args([
        "-c",
        "ulimit -v 3145728 && exec \"$0\" --model gpt3-2.7b",
        TRAIN,
    ]);
    let (out, _) = run_bounded(cmd, dir.path(), Duration::from_secs(20));
    assert_refused_before_profiling(&out, "2.8 GiB per process: 3.0 GiB (ulimit -v)");
}

/// The single-process trainer (`--nodes 1`) is checked the same way, before it builds the
/// model: all of gpt3-2.7b in one process of a 16 GiB machine does not fit.
#[test]
fn one_process_is_refused_before_it_builds_the_model() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new(TRAIN);
    cmd.args([
        "--model",
        "gpt3-2.7b",
        "--nodes",
        "1",
        "--host-memory",
        "16GiB",
    ]);
    let (out, took) = run_bounded(cmd, dir.path(), Duration::from_secs(20));
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "exit 1, not a signal: {stderr}");
    assert!(
        stderr.starts_with("Error: the model does not fit in one process: it needs "),
        "{stderr}"
    );
    assert!(stderr.contains("this process has 14.7 GiB."), "{stderr}");
    assert!(
        stderr.contains("16.0 GiB (--host-memory) less 8% slack"),
        "{stderr}"
    );
    assert!(
        stderr.contains("--recompute") && stderr.contains("--nodes 2"),
        "{stderr}"
    );
    assert!(!stderr.contains("training gpt3-2.7b"), "{stderr}");
    assert!(took < Duration::from_secs(20), "{took:?}");
}
