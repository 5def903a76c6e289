//! Tests of `config.rs`: flags over the job file over the defaults, derived values, and the
//! errors bad settings get.

use super::*;
use crate::args::TrainArgs;
use clap::Parser;

#[test]
fn flags_override_the_job_file_which_overrides_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job.toml");
    std::fs::write(&job, "steps = 7\nlr = 0.01\nseq_len = 32\n").unwrap();
    let args = TrainArgs::parse_from(["train", "--config", job.to_str().unwrap(), "--steps", "9"]);
    let c = args.resolve().unwrap();
    assert_eq!((c.steps, c.lr, c.seq_len), (9, 0.01, 32));
    assert_eq!(c.model, "gpt-mini");
}

#[test]
fn derived_values_are_stored_resolved_and_old_nulls_come_from_the_saved_steps() {
    let c = TrainArgs::parse_from(["train", "--steps", "200", "--lr", "0.01"])
        .resolve()
        .unwrap();
    assert_eq!((c.warmup_steps, c.min_lr), (Some(20), Some(0.001)));
    let dir = tempfile::tempdir().unwrap();
    save_resolved(&TrainConfig::default(), dir.path()).unwrap();
    let text = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    assert!(text.contains("\"warmup_steps\": 15"), "{text}");
    // A config.json of a run made before: nulls, 200 steps.
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["steps"] = 200.into();
    v["warmup_steps"] = serde_json::Value::Null;
    v["min_lr"] = serde_json::Value::Null;
    std::fs::write(dir.path().join("config.json"), v.to_string()).unwrap();
    let old = load_resolved(dir.path()).unwrap();
    assert_eq!((old.warmup_steps, old.min_lr), (Some(20), Some(2e-4)));
}

#[test]
fn unknown_job_fields_and_bad_batches_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job.toml");
    std::fs::write(&job, "stepz = 7\n").unwrap();
    let e = TrainArgs::parse_from(["train", "--config", job.to_str().unwrap()])
        .resolve()
        .unwrap_err();
    assert!(format!("{e:#}").contains("stepz"), "{e:#}");
    let e = TrainArgs::parse_from(["train", "--global-batch-size", "10"])
        .resolve()
        .unwrap_err();
    assert!(e.to_string().contains("multiple"), "{e}");
    let e = TrainArgs::parse_from(["train", "--inject-failure", "x@y"])
        .resolve()
        .unwrap_err();
    assert!(format!("{e:#}").contains("NODE"), "{e:#}");
}

#[test]
fn watchdog_flags_reach_the_job_and_bad_ones_say_why() {
    let c = TrainArgs::parse_from([
        "train",
        "--hang-timeout",
        "5",
        "--straggler-factor",
        "2",
        "--evict-stragglers",
    ])
    .resolve()
    .unwrap();
    let w = c.watch_spec();
    assert_eq!((w.hang_timeout_s, w.hang_factor), (5.0, 3.0));
    assert!(w.evict_stragglers && w.straggler_factor == 2.0);
    for (flag, value, says) in [
        ("--hang-timeout", "0.2", "at least 1 s"),
        ("--hang-timeout", "nan", "at least 1 s"),
        ("--hang-factor", "1", "at least 1.5"),
        ("--straggler-factor", "0.9", "above 1"),
    ] {
        let e = TrainArgs::parse_from(["train", flag, value])
            .resolve()
            .unwrap_err();
        assert!(format!("{e:#}").contains(says), "{flag} {value}: {e:#}");
    }
}

#[test]
fn a_published_preset_trains_with_its_recipe_unless_told_otherwise() {
    let c = TrainArgs::parse_from(["train", "--model", "gpt3-2.7b"])
        .resolve()
        .unwrap();
    assert_eq!((c.seq_len, c.global_batch_size, c.lr), (2048, 512, 1.6e-4));
    // Flags win, and a job file's fields too; the rest still come from the recipe.
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job.toml");
    std::fs::write(&job, "global_batch_size = 64\n").unwrap();
    let c = TrainArgs::parse_from([
        "train",
        "--model",
        "gpt3-2.7b",
        "--seq-len",
        "256",
        "--config",
        job.to_str().unwrap(),
    ])
    .resolve()
    .unwrap();
    assert_eq!((c.seq_len, c.global_batch_size, c.lr), (256, 64, 1.6e-4));
    // The project's small presets keep the small defaults.
    let c = TrainArgs::parse_from(["train", "--model", "opt-tiny"])
        .resolve()
        .unwrap();
    assert_eq!((c.seq_len, c.global_batch_size, c.lr), (64, 16, 2e-3));
}

#[test]
fn data_flags_make_a_blend_and_bad_ones_say_why() {
    let c = TrainArgs::parse_from([
        "train",
        "--data",
        "0.7:web/",
        "--data",
        "0.3:code/",
        "--val-data",
        "val/",
    ])
    .resolve()
    .unwrap();
    let shown: Vec<String> = c.data.iter().map(|s| s.to_string()).collect();
    assert_eq!(shown, ["0.7:web/", "0.3:code/"]);
    assert_eq!(c.val_data.as_deref(), Some(std::path::Path::new("val/")));
    // A job file names one source as a string (or `dataset`, its old name) or several as a list.
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job.toml");
    for (text, want) in [
        ("dataset = \"a.txt\"\n", vec!["a.txt"]),
        ("data = [\"2:a/\", \"1:b/\"]\n", vec!["2:a/", "1:b/"]),
    ] {
        std::fs::write(&job, text).unwrap();
        let c = TrainArgs::parse_from(["train", "--config", job.to_str().unwrap()])
            .resolve()
            .unwrap();
        let shown: Vec<String> = c.data.iter().map(|s| s.to_string()).collect();
        assert_eq!(shown, want, "{text}");
    }
    let err = |flags: &[&str]| {
        let mut argv = vec!["train"];
        argv.extend(flags);
        format!("{:#}", TrainArgs::parse_from(argv).resolve().unwrap_err())
    };
    let e = err(&["--val-fraction", "1.5"]);
    assert!(
        e.contains("--val-fraction 1.5") && e.contains("below 1"),
        "{e}"
    );
    let e = err(&["--data", "a/", "--val-data", "v/", "--val-fraction", "0.1"]);
    assert!(e.contains("drop one of them"), "{e}");
    let e = err(&["--data=-1:a/"]);
    assert!(
        e.contains("--data weight -1") && e.contains("above zero"),
        "{e}"
    );
}

#[test]
fn a_resume_injects_only_the_failures_it_is_given_again() {
    let dir = tempfile::tempdir().unwrap();
    let first = TrainConfig {
        inject_failure: vec!["1@3".into()],
        ..TrainConfig::default()
    };
    save_resolved(&first, dir.path()).unwrap();
    let run = dir.path().to_str().unwrap();
    let c = TrainArgs::parse_from(["train", "--resume", run])
        .resolve()
        .unwrap();
    assert!(c.inject_failure.is_empty(), "{:?}", c.inject_failure);
    let c = TrainArgs::parse_from(["train", "--resume", run, "--inject-failure", "2@9"])
        .resolve()
        .unwrap();
    assert_eq!(c.inject_failure, ["2@9"]);
}

#[test]
fn the_master_wait_reaches_the_job_and_a_job_file_cannot_make_it_zero() {
    let c = TrainArgs::parse_from(["train"]).resolve().unwrap();
    assert_eq!(c.master_wait_s, 60);
    let c = TrainArgs::parse_from(["train", "--master-wait", "7"])
        .resolve()
        .unwrap();
    assert_eq!(c.master_wait_s, 7);
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job.toml");
    std::fs::write(&job, "master_wait_s = 0\n").unwrap();
    let e = TrainArgs::parse_from(["train", "--config", job.to_str().unwrap()])
        .resolve()
        .unwrap_err();
    assert!(format!("{e:#}").contains("at least 1 second"), "{e:#}");
}
