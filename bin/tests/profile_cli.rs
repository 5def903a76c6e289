//! `oobleck profile` on the smallest preset writes a profile that `oobleck plan --profile`
//! plans from; the second run is a cache hit; a corrupt entry is measured again; a plan asked
//! for another microbatch names both fingerprints.

use std::path::Path;
use std::process::{Command, Output};

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

    let entry = std::fs::read_dir(&cache)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
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
