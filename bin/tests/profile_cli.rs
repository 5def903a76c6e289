//! `oobleck profile` on the smallest preset writes a profile that `oobleck plan --profile`
//! plans from; the second run is a cache hit; a corrupt entry is measured again; a plan asked
//! for another microbatch names both fingerprints.

mod common;

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use common::{train_cmd, Guard};

const OOBLECK: &str = env!("CARGO_BIN_EXE_oobleck");

fn oobleck(cache: &Path, args: &[&str]) -> (Output, String, String) {
    let out = Command::new(OOBLECK)
        .args(args)
        .env("OOBLECK_CACHE_DIR", cache)
        .output()
        .expect("run oobleck");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stdout, stderr)
}

#[test]
fn a_measured_profile_is_cached_and_planned_from() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = dir.path().join("cache");
    let file = dir.path().join("tiny.json");
    let f = file.to_str().unwrap();
    let profile = [
        "profile",
        "--model",
        "gpt-tiny",
        "--microbatch-size",
        "2",
        "--seq-len",
        "16",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--out",
        f,
    ];
    let (out, stdout, stderr) = oobleck(&cache, &profile);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stderr.contains("measured in"), "{stderr}");
    assert!(stdout.contains("embedding"), "{stdout}");
    let text = std::fs::read_to_string(&file).expect("profile written");
    let p = oobleck_core::planning::ModelProfile::from_json(&text).expect("valid");
    assert_eq!(p.num_layers(), 4, "gpt-tiny: embedding, 2 blocks, head");
    assert!(
        p.fingerprint.device_kind.starts_with("cpu:"),
        "{:?}",
        p.fingerprint
    );

    let (out, _, stderr) = oobleck(&cache, &profile);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("profile from cache"), "{stderr}");

    // The cache directory also holds the corpus's token cache: pick the profile entry.
    let entry = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "json"))
        .expect("a profile entry in the cache");
    std::fs::write(&entry, "garbage").unwrap();
    let (out, _, stderr) = oobleck(&cache, &profile);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("was corrupt"), "{stderr}");

    let plan = |mb: &str| {
        oobleck(
            &cache,
            &[
                "plan",
                "--profile",
                f,
                "--device",
                "cpu",
                "--dtype",
                "f32",
                "--nodes",
                "2",
                "--fault-threshold",
                "0",
                "--microbatch-size",
                mb,
                "--global-batch-size",
                "8",
            ],
        )
    };
    let (out, stdout, stderr) = plan("2");
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("microbatch_size: 2"), "{stdout}");

    let (out, _, stderr) = plan("4");
    assert!(!out.status.success());
    assert!(stderr.contains("microbatch_size: 2"), "{stderr}");
    assert!(stderr.contains("microbatch_size: 4"), "{stderr}");
    assert!(stderr.contains("--microbatch-size 2"), "{stderr}");
}

/// `train --profile measured` times the layers before planning (saying so), caches the
/// profile, reuses it on the next run, and prints its measured step time beside the
/// planner's prediction; `--profile` with a missing file is refused before anything starts.
#[test]
fn train_plans_from_a_measured_profile_and_reports_predicted_against_measured() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = dir.path().join("cache");
    let run = |name: &str| {
        let args = [
            "--nodes",
            "2",
            "--pipeline-nodes",
            "2",
            "--status-addr",
            "off",
        ];
        let mut cmd = train_cmd(&dir.path().join(name), 4, &args);
        cmd.args(["--profile", "measured"])
            .env("OOBLECK_CACHE_DIR", &cache);
        let out = Guard(Some(cmd.spawn().expect("start train"))).finish(Duration::from_secs(240));
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "train failed:\n{text}");
        text
    };
    let first = run("a");
    assert!(first.contains("profiling gpt-tiny"), "{first}");
    // Measured as the job's two workers share this machine, and said once.
    assert!(first.contains("as 2 ranks of"), "{first}");
    assert_eq!(first.matches("profiling gpt-tiny").count(), 1, "{first}");
    assert!(first.contains("cached at"), "{first}");
    let line = first
        .lines()
        .find(|l| l.contains("step time: measured"))
        .unwrap_or_else(|| panic!("no step-time line:\n{first}"));
    assert!(line.contains("planner predicted"), "{line}");
    let second = run("b");
    assert_eq!(second.matches("profile from cache").count(), 1, "{second}");
    assert!(!second.contains("profiling gpt-tiny"), "{second}");

    let missing = dir.path().join("missing.json");
    let mut cmd = train_cmd(&dir.path().join("c"), 1, &[]);
    cmd.args(["--profile", missing.to_str().unwrap()]);
    let out = Guard(Some(cmd.spawn().expect("start train"))).finish(Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("not `measured`, `analytical` or a profile file"),
        "{err}"
    );
}
