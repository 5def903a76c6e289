//! The single-process trainer end to end: it learns on the shipped corpus, resume is exact,
//! and bad input is refused without touching what is on disk.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::{Device, Tensor};
use oobleck_cli::config::TrainConfig;
use oobleck_cli::progress::Progress;
use oobleck_cli::trainer::Trainer;
use oobleck_core::checkpoint::{checkpoint_path, load_checkpoint};

/// A small, fast job: gpt-tiny, 8 samples of 32 tokens per step.
fn tiny(out: &Path, steps: u64) -> TrainConfig {
    TrainConfig {
        model: "gpt-tiny".into(),
        nodes: 1,
        microbatch_size: 2,
        global_batch_size: 8,
        seq_len: 32,
        steps,
        lr: 3e-3,
        warmup_steps: Some(2),
        checkpoint_every: 3,
        eval_every: 0,
        eval_batches: 2,
        out: Some(out.to_path_buf()),
        sample: 0,
        ..TrainConfig::default()
    }
}

fn losses(run: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap())
        })
        .collect()
}

fn params(ckpt: &Path) -> BTreeMap<String, Tensor> {
    load_checkpoint(ckpt, &Device::Cpu).unwrap().params
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

#[test]
fn training_lowers_validation_loss_on_the_shipped_corpus() {
    let tmp = tempfile::tempdir().unwrap();
    let mut t = Trainer::start(tiny(tmp.path(), 24), None).unwrap();
    let before = t.validation_loss().unwrap();
    let summary = t.run(&mut Progress::new(24, 0)).unwrap();
    let after = summary.final_val_loss.unwrap();
    eprintln!("validation loss {before:.4} -> {after:.4}");
    assert!(after < before - 1.0, "validation loss {before} -> {after}");
    let l = losses(tmp.path());
    assert_eq!(l.len(), 24);
    assert!(l[23].1 < l[0].1, "training loss {} -> {}", l[0].1, l[23].1);
}

#[test]
fn resume_continues_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    let mut t = Trainer::start(tiny(&a, 6), None).unwrap();
    t.run(&mut Progress::new(6, 0)).unwrap();

    // Run b is run a stopped after its step-3 checkpoint (it had logged steps 4-5 too).
    let b = tmp.path().join("b");
    copy_dir(&a, &b);
    std::fs::remove_dir_all(checkpoint_path(&b, 6)).unwrap();
    let mut cfg = tiny(&b, 6);
    cfg.out = None;
    let mut t = Trainer::start(cfg, Some(&checkpoint_path(&b, 3))).unwrap();
    assert_eq!(t.step, 3);
    t.run(&mut Progress::new(6, 3)).unwrap();

    assert_eq!(
        losses(&a),
        losses(&b),
        "per-step losses differ after resume"
    );
    let (pa, pb) = (
        params(&checkpoint_path(&a, 6)),
        params(&checkpoint_path(&b, 6)),
    );
    assert_eq!(pa.len(), pb.len());
    for (name, ta) in &pa {
        let d: f32 = (ta - &pb[name])
            .and_then(|t| t.abs()?.max_all()?.to_scalar())
            .unwrap();
        assert_eq!(d, 0.0, "{name} differs by {d} after resume");
    }
}

#[test]
fn resume_refuses_a_changed_trajectory() {
    let tmp = tempfile::tempdir().unwrap();
    let mut t = Trainer::start(tiny(tmp.path(), 3), None).unwrap();
    t.run(&mut Progress::new(3, 0)).unwrap();
    let mut cfg = tiny(tmp.path(), 6);
    cfg.lr = 1e-2;
    let e = Trainer::start(cfg, Some(tmp.path()))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("lr"), "{e}");
}

/// `train` flags of a tiny one-process job: gpt-tiny, 4 samples of 16 tokens per step.
const TINY_FLAGS: [&str; 12] = [
    "--nodes",
    "1",
    "--model",
    "gpt-tiny",
    "--seq-len",
    "16",
    "--microbatch-size",
    "2",
    "--global-batch-size",
    "4",
    "--eval-batches",
    "1",
];

fn train_bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_train"))
}

fn run_train(args: &[&str]) -> (bool, String, String) {
    let out = train_bin().args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn the_train_binary_runs_and_prints_a_json_summary() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let (ok, stdout, stderr) = run_train(
        &[
            &TINY_FLAGS[..],
            &["--steps", "2", "--sample", "1", "--json"],
            &["--out", out.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("stdout is the JSON summary");
    assert_eq!(v["steps"], 2);
    assert!(stderr.contains("sample 1"), "{stderr}");
    let report = std::fs::read_to_string(out.join("report.html")).expect("report.html");
    assert!(
        report.contains("<svg") && stderr.contains("report: "),
        "{stderr}"
    );
    for f in [
        "config.json",
        "metrics.jsonl",
        "events.jsonl",
        "checkpoints/step-000002/trainer.json",
    ] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    // Starting again into the same directory is refused and loses nothing.
    let before = std::fs::read(out.join("metrics.jsonl")).unwrap();
    let (ok, _, stderr) = run_train(&[
        "--nodes",
        "1",
        "--model",
        "gpt-tiny",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!ok && stderr.contains("--resume"), "{stderr}");
    assert_eq!(before, std::fs::read(out.join("metrics.jsonl")).unwrap());
}

#[test]
fn bad_input_gives_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let out = |n: &str| -> PathBuf { tmp.path().join(n) };
    // A corpus shorter than one global batch.
    let short = tmp.path().join("short.txt");
    let corpus = std::fs::read_to_string(oobleck_models::data::default_corpus_path()).unwrap();
    std::fs::write(&short, corpus.chars().take(3000).collect::<String>()).unwrap();
    let short = short.to_str().unwrap();
    // These run the default job (a local cluster): each is refused before any process starts.
    let cases: [(&[&str], &str); 7] = [
        (&["--model", "gpt-9000"], "gpt3-2.7b"),
        (
            &["--dataset", "/nonexistent/corpus.txt"],
            "/nonexistent/corpus.txt",
        ),
        (
            &["--global-batch-size", "6", "--microbatch-size", "4"],
            "multiple",
        ),
        (&["--model", "gpt-tiny", "--seq-len", "5000"], "context"),
        (
            &["--model", "gpt-tiny", "--dataset", short],
            "but one global batch needs 16 samples",
        ),
        (
            &["--data-plane", "infiniband"],
            "--data-plane must be tcp or nccl",
        ),
        (
            &["--data-plane", "nccl"],
            if cfg!(feature = "nccl") {
                "NCCL"
            } else {
                "--features nccl"
            },
        ),
    ];
    for (i, (args, needle)) in cases.iter().enumerate() {
        let o = out(&format!("r{i}"));
        let mut all = args.to_vec();
        all.extend(["--out", o.to_str().unwrap()]);
        let (ok, _, stderr) = run_train(&all);
        assert!(!ok, "{args:?} should fail");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!o.exists(), "{args:?}: created {}", o.display());
    }
    // A corrupted checkpoint is detected on resume, naming the file.
    let o = out("c");
    let mut t = Trainer::start(tiny(&o, 3), None).unwrap();
    t.run(&mut Progress::new(3, 0)).unwrap();
    let f = checkpoint_path(&o, 3).join("model.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x55;
    std::fs::write(&f, bytes).unwrap();
    let (ok, _, stderr) = run_train(&["--model", "gpt-tiny", "--resume", o.to_str().unwrap()]);
    assert!(!ok && stderr.contains("model.safetensors"), "{stderr}");
}

/// A negative number is a value, not a flag, and a directory that is no model says what one is.
#[test]
fn flags_with_wrong_values_say_what_they_expect() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("r");
    let out = out.to_str().unwrap();
    let (ok, _, stderr) = run_train(&["--lr", "-1", "--out", out]);
    assert!(
        !ok && stderr.contains("--lr must be a positive number, got -1"),
        "{stderr}"
    );
    let dir = tmp.path().to_str().unwrap();
    let (ok, _, stderr) = run_train(&["--init-from", dir, "--nodes", "1", "--out", out]);
    assert!(
        !ok && stderr.contains("expected a Hugging Face model directory (config.json"),
        "{stderr}"
    );
}

/// The README's `--resume runs/long --steps 400`: a run started without `--warmup-steps` can
/// be extended (its warmup was stored as a number), and the cosine decay then ends at the new
/// step count.
#[test]
fn a_run_can_be_extended_with_more_steps() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let out = out.to_str().unwrap();
    let tiny = [&TINY_FLAGS[..], &["--sample", "0"]].concat();
    let (ok, _, stderr) = run_train(&[&tiny[..], &["--steps", "10", "--out", out]].concat());
    assert!(ok, "{stderr}");
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(Path::new(out).join("config.json")).unwrap())
            .unwrap();
    assert_eq!(saved["warmup_steps"], 1, "{saved}");

    let (ok, _, stderr) = run_train(&[&tiny[..], &["--steps", "20", "--resume", out]].concat());
    assert!(ok, "{stderr}");
    let metrics: Vec<serde_json::Value> =
        std::fs::read_to_string(Path::new(out).join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
    let steps: Vec<u64> = metrics
        .iter()
        .map(|m| m["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (1..=20).collect::<Vec<_>>());
    // With the old horizon of 10 steps, step 11 would already be at the floor (lr / 10).
    let lr11 = metrics[10]["lr"].as_f64().unwrap();
    assert!(lr11 > 2.0 * 2e-4, "lr at step 11 is {lr11}");
}

/// SIGTERM (or SIGINT) to the single-process trainer stops it after the step it is in, with
/// that step's checkpoint and a `stop_requested` event, and exit 0; a second one stops it at
/// once (issue 43, as for a cluster job's master).
#[test]
fn a_signal_stops_the_single_process_after_its_step_with_a_checkpoint() {
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let signal = |pid: u32, sig: &str| {
        let sent = Command::new("kill").args([sig, &pid.to_string()]).status();
        assert!(sent.expect("kill").success());
    };
    let wait_for_a_step = |out: &Path| {
        let start = std::time::Instant::now();
        while !std::fs::read_to_string(out.join("metrics.jsonl")).is_ok_and(|m| !m.is_empty()) {
            assert!(start.elapsed().as_secs() < 60, "no step within 60 s");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    let finish = |mut k: Kill| {
        let start = std::time::Instant::now();
        while k.0.try_wait().unwrap().is_none() {
            assert!(start.elapsed().as_secs() < 60, "train did not stop");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let mut err = String::new();
        std::io::Read::read_to_string(k.0.stderr.as_mut().unwrap(), &mut err).unwrap();
        (k.0.try_wait().unwrap().unwrap(), err)
    };
    let start = |out: &Path| {
        let child = train_bin()
            .args(&TINY_FLAGS[..])
            .args([
                "--steps",
                "10000",
                "--checkpoint-every",
                "0",
                "--eval-every",
                "0",
            ])
            .arg("--out")
            .arg(out)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        Kill(child)
    };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let k = start(&out);
    wait_for_a_step(&out);
    signal(k.0.id(), "-TERM");
    let (status, stderr) = finish(k);
    assert!(status.success(), "{stderr}");
    assert!(
        stderr.contains("SIGTERM: stopping after this step"),
        "{stderr}"
    );
    assert!(stderr.contains("as a signal asked"), "{stderr}");
    let events = std::fs::read_to_string(out.join("events.jsonl")).unwrap();
    let stop: serde_json::Value = events
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|e| e["event"] == "stop_requested")
        .expect("a stop_requested event");
    let step = stop["step"].as_u64().unwrap();
    assert!(
        checkpoint_path(&out, step).is_dir(),
        "checkpoint of step {step}"
    );
    assert_eq!(losses(&out).last().map(|l| l.0), Some(step));

    let out2 = tmp.path().join("run2");
    let k = start(&out2);
    wait_for_a_step(&out2);
    // Two of the same signal sent at once may arrive as one (the kernel keeps one pending), so
    // the second is another; the two may be taken in either order.
    signal(k.0.id(), "-INT");
    signal(k.0.id(), "-TERM");
    let (status, stderr) = finish(k);
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("stopped at once by a second SIG"),
        "{stderr}"
    );
}
