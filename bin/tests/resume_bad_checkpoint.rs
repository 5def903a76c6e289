//! A bad newest checkpoint (a flipped byte, a missing `trainer.json`) does not block a run:
//! `--resume RUN` names it, goes on from the newest checkpoint that verifies, and when the run
//! reaches the bad one's step again its save moves the bad one aside. Naming a bad checkpoint
//! itself is refused with what to do instead. (Issue 43.)

use std::path::Path;
use std::process::{Command, Output};

use oobleck_core::checkpoint::{checkpoint_path, verify_checkpoint};

/// A tiny one-process job (gpt-tiny, 4 samples of 16 tokens per step) with a checkpoint
/// every 2 steps, into `out`.
fn train(out: &Path, extra: &[&str]) -> (Output, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_train"))
        .args(["--nodes", "1", "--model", "gpt-tiny", "--seq-len", "16"])
        .args(["--microbatch-size", "2", "--global-batch-size", "4"])
        .args([
            "--eval-batches",
            "1",
            "--sample",
            "0",
            "--checkpoint-every",
            "2",
        ])
        .args(extra)
        .env("RUST_BACKTRACE", "0")
        .env_remove("RUST_LOG")
        .output()
        .expect("run train");
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(out.is_dir(), "{stderr}");
    (o, stderr)
}

fn metric_steps(run: &Path) -> Vec<u64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a metrics line");
            v["step"].as_u64().expect("step")
        })
        .collect()
}

/// The names under `<run>/checkpoints` that start with `prefix`.
fn named(run: &Path, prefix: &str) -> Vec<String> {
    std::fs::read_dir(run.join("checkpoints"))
        .expect("checkpoints/")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

#[test]
fn resume_skips_bad_checkpoints_and_the_run_moves_them_aside() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let run = tmp.path().join("run");
    let r = run.to_str().expect("utf-8 path");
    let (o, stderr) = train(&run, &["--steps", "6", "--out", r]);
    assert!(o.status.success(), "{stderr}");

    // Step 6: a flipped byte in the model; step 4: no trainer.json (a copy cut short).
    let six = checkpoint_path(&run, 6);
    let model = six.join("model.safetensors");
    let mut bytes = std::fs::read(&model).expect("model.safetensors");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x10;
    std::fs::write(&model, bytes).expect("write");
    let four = checkpoint_path(&run, 4);
    std::fs::remove_file(four.join("trainer.json")).expect("remove trainer.json");

    // `oobleck generate --checkpoint RUN` samples from the newest one that verifies, naming
    // the ones it passed over.
    let g = Command::new(env!("CARGO_BIN_EXE_oobleck"))
        .args([
            "generate",
            "--checkpoint",
            r,
            "--samples",
            "1",
            "--max-new-tokens",
            "4",
        ])
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run oobleck generate");
    let said = String::from_utf8_lossy(&g.stderr);
    assert!(g.status.success(), "{said}");
    assert!(
        said.contains(&format!("skipping {}, it cannot be used: ", six.display()))
            && said.contains(&format!("skipping {}, it cannot be used: ", four.display())),
        "{said}"
    );

    // Naming the bad checkpoint itself is refused, saying what to do.
    let s = six.to_str().expect("utf-8 path");
    let (o, stderr) = train(&run, &["--steps", "8", "--resume", s]);
    assert!(!o.status.success(), "{stderr}");
    assert!(
        stderr.contains("checksum mismatch") && stderr.contains(&format!("--resume {r} ")),
        "{stderr}"
    );

    // The run directory goes on from step 2, naming both, and passes steps 4 and 6.
    let (o, stderr) = train(&run, &["--steps", "8", "--resume", r]);
    assert!(o.status.success(), "{stderr}");
    for (bad, why) in [(&six, "checksum mismatch"), (&four, "trainer.json")] {
        let line = format!("skipping checkpoint {}, it cannot be used: ", bad.display());
        let said = stderr.lines().find(|l| l.contains(&line));
        assert!(said.is_some_and(|l| l.contains(why)), "{stderr}");
    }
    assert!(stderr.contains("going on from step 2"), "{stderr}");
    assert_eq!(metric_steps(&run), (1..=8).collect::<Vec<_>>());
    for step in [2, 4, 6, 8] {
        let path = checkpoint_path(&run, step);
        assert_eq!(verify_checkpoint(&path).expect("verifies").step, step);
    }
    for step in ["step-000004.invalid-", "step-000006.invalid-"] {
        assert_eq!(named(&run, step).len(), 1, "{:?}", named(&run, ""));
    }
    assert!(stderr.contains("moved it aside"), "{stderr}");
}
