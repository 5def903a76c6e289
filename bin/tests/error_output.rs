//! A user-facing error of `train` or `oobleck` is its message chain and a non-zero exit, with
//! no backtrace even under `RUST_BACKTRACE=1` (many users keep it set); bad flags keep clap's
//! status 2.

use std::process::{Command, Output};

const TRAIN: &str = env!("CARGO_BIN_EXE_train");
const OOBLECK: &str = env!("CARGO_BIN_EXE_oobleck");

/// Runs `exe args` in an empty directory with `RUST_BACKTRACE=1` (and no RUST_LIB_BACKTRACE,
/// the opt-in to error backtraces).
fn run(exe: &str, args: &[&str]) -> (Output, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(exe)
        .args(args)
        .current_dir(dir.path())
        .env("RUST_BACKTRACE", "1")
        .env_remove("RUST_LIB_BACKTRACE")
        .output()
        .expect("run the binary");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stderr)
}

fn assert_no_backtrace(stderr: &str) {
    let lower = stderr.to_lowercase();
    assert!(!lower.contains("stack backtrace"), "{stderr}");
    // Frame lines look like `   3: main` followed by `at ./src/...`.
    assert!(!stderr.contains("             at "), "{stderr}");
    assert!(!stderr.contains("lang_start"), "{stderr}");
}

#[test]
fn train_with_an_unknown_model_prints_the_message_only() {
    let (out, stderr) = run(TRAIN, &["--model", "no-such-model", "--steps", "1"]);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with("Error: unknown model `no-such-model`; presets: "),
        "{stderr}"
    );
    assert_no_backtrace(&stderr);
}

#[test]
fn oobleck_plan_of_a_model_too_large_prints_the_message_only() {
    let (out, stderr) = run(
        OOBLECK,
        &[
            "plan",
            "--model",
            "gpt3-175b",
            "--devices-per-node",
            "8",
            "--device",
            "h100-80gb",
        ],
    );
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with("Error: the model does not fit"),
        "{stderr}"
    );
    // It names what does not fit and the way out.
    assert!(
        stderr.contains("GiB of activations (97 microbatches in flight"),
        "{stderr}"
    );
    assert!(stderr.contains("activation recomputation"), "{stderr}");
    assert!(out.stdout.is_empty(), "nothing on stdout for an error");
    assert_no_backtrace(&stderr);
}

/// A context and its cause print as anyhow printed them without a backtrace.
#[test]
fn oobleck_error_with_a_cause_prints_the_chain() {
    let (out, stderr) = run(OOBLECK, &["plan", "--profile", "no-such-profile.json"]);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with("Error: reading profile no-such-profile.json\n\nCaused by:\n    "),
        "{stderr}"
    );
    assert!(stderr.contains("os error 2"), "{stderr}");
    assert_no_backtrace(&stderr);
}

#[test]
fn a_bad_flag_value_keeps_clap_status_2() {
    let (out, stderr) = run(OOBLECK, &["plan", "--nodes", "many"]);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("invalid value 'many'"), "{stderr}");
    assert_no_backtrace(&stderr);
}

#[test]
fn train_with_a_status_port_in_use_names_it_and_starts_nothing() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let at = taken.local_addr().unwrap().to_string();
    let args = [
        "--model",
        "gpt-tiny",
        "--nodes",
        "2",
        "--steps",
        "1",
        "--sample",
        "0",
        "--status-addr",
        &at,
    ];
    let (out, stderr) = run(TRAIN, &args);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot listen on {at}")) && stderr.contains("--status-addr"),
        "{stderr}"
    );
    assert!(!stderr.contains("step 1/1"), "no training: {stderr}");
    assert_no_backtrace(&stderr);
    // One process trains without a master, so there is no page to serve.
    let (out, stderr) = run(
        TRAIN,
        &["--nodes", "1", "--steps", "1", "--status-addr", &at],
    );
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--nodes 2 or more"), "{stderr}");
}
