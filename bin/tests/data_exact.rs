//! The data of every step is exact across what a cluster goes through: each metrics line's
//! `data` (the step's epoch and iteration, and a hash of the multiset of its sample ids) is the
//! same in an uninterrupted run, in one that loses a node and admits another mid-run, in one
//! resumed from a checkpoint on another number of nodes, and in the single process; and a run
//! across epoch boundaries trains every window of its corpus exactly once per epoch. Real
//! `train` processes; none is left behind.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use oobleck_core::runtime::wire::records::{SampleHash, StepData};
use oobleck_core::runtime::StepMetrics;

const LIMIT: Duration = Duration::from_secs(120);
const WAIT: Duration = Duration::from_secs(60);

/// `(step, data)` of every line of the run's `metrics.jsonl`, in file order, read with the type
/// that wrote them.
fn data(run: &Path) -> Vec<(u64, StepData)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| {
            let m: StepMetrics = serde_json::from_str(l).expect("a metrics line");
            (m.step, m.data.unwrap_or_else(|| panic!("no data in {l}")))
        })
        .collect()
}

/// Runs `cmd` to a successful end.
fn train_ok(cmd: std::process::Command) {
    let o = run(cmd, LIMIT);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Steps `1..=steps` once each, in order, each with a position and a hash of 16 hex digits,
/// no two steps with the same hash (each trains other samples).
fn assert_well_formed(got: &[(u64, StepData)], steps: u64) {
    let numbers: Vec<u64> = got.iter().map(|(s, _)| *s).collect();
    assert_eq!(numbers, (1..=steps).collect::<Vec<_>>(), "every step once");
    let mut hashes: Vec<&str> = got.iter().map(|(_, d)| d.samples.as_str()).collect();
    for (s, d) in got {
        assert!(
            d.epoch.is_some() && d.iteration.is_some(),
            "step {s}: {d:?}"
        );
        let hex = d.samples.len() == 16 && d.samples.bytes().all(|b| b.is_ascii_hexdigit());
        assert!(hex, "step {s}: {d:?}");
    }
    hashes.sort_unstable();
    hashes.dedup();
    assert_eq!(
        hashes.len(),
        got.len(),
        "two steps trained the same samples"
    );
}

/// An uninterrupted 3-node run (pipelines of one node and of two: a pipeline's second stage
/// loads microbatches too, but only its first counts them) trains the single process's samples
/// at every step. So does a 2-node run with f = 1 whose node 1 dies after step 3
/// (`--inject-failure 1@3`): node 0 goes on alone in place, then a node joins (it restores a
/// pipeline, so it is admitted at the next step boundary) and the job spreads over two nodes
/// again.
#[test]
fn a_node_killed_and_one_joined_mid_run_leave_every_steps_samples_unchanged() {
    const STEPS: u64 = 30;
    let dir = tempfile::tempdir().expect("tempdir");
    let single = dir.path().join("single");
    train_ok(train_cmd(&single, STEPS, &["--nodes", "1"]));
    let want = data(&single);
    assert_well_formed(&want, STEPS);
    let three = ["--nodes", "3", "--fault-threshold", "1"];
    let plain = dir.path().join("plain");
    train_ok(train_cmd(&plain, STEPS, &three));
    assert_eq!(data(&plain), want, "3 nodes vs the single process");
    let plans: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(plain.join("plan.json")).expect("plan.json"))
            .expect("plans");
    let widest = plans[0]["pipelines"].as_array().expect("pipelines").iter();
    let widest = widest
        .map(|p| p["nodes"].as_array().map_or(0, Vec::len))
        .max();
    assert_eq!(widest, Some(2), "a pipeline of two stages: {}", plans[0]);

    let out = dir.path().join("run");
    let mut strays = Strays::default();
    let flags = [
        "--nodes",
        "2",
        "--fault-threshold",
        "1",
        "--inject-failure",
        "1@3",
    ];
    let mut g = Guard(Some(train_cmd(&out, STEPS, &flags).spawn().expect("train")));
    wait_for_events(&out, 1, WAIT, "recovery", |e| e["event"] == "resumed");
    strays.add_node(&out, &[]);
    let o = g.finish(LIMIT);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r = reconfig_events(&out);
    assert_eq!(r.len(), 2, "a loss, then a join: {r:?}");
    assert_eq!(r[0]["lost_nodes"], serde_json::json!([1]), "{}", r[0]);
    assert!(
        r[1]["joined_nodes"]
            .as_array()
            .is_some_and(|j| j.len() == 1),
        "{}",
        r[1]
    );
    let nodes = per_step(&out, "nodes");
    assert!(nodes.iter().any(|&(_, n)| n == 1.0), "{nodes:?}");
    assert_eq!(nodes.last().map(|l| l.1), Some(2.0), "{nodes:?}");
    assert_eq!(data(&out), want, "killed and joined vs uninterrupted");
    // 2 agents, 3 workers (one per node, the joined one's too); the joined agent is a stray.
    assert_all_gone(&out, 5);
    strays.assert_gone();
}

/// A 2-node run whose worker is SIGKILLed once it has a checkpoint ends; the steps it committed
/// trained the single process's samples. Resumed from its checkpoint on 3 nodes, every step of
/// the run (the replayed ones and those after) trains the single process's samples.
#[test]
fn a_run_resumed_on_another_node_count_trains_the_same_samples_at_every_step() {
    const STEPS: u64 = 16;
    let dir = tempfile::tempdir().expect("tempdir");
    let single = dir.path().join("single");
    train_ok(train_cmd(&single, STEPS, &["--nodes", "1"]));
    let want = data(&single);
    assert_well_formed(&want, STEPS);

    let out = dir.path().join("run");
    let flags = [
        "--nodes",
        "2",
        "--pipeline-nodes",
        "1,1",
        "--checkpoint-every",
        "2",
    ];
    let mut g = Guard(Some(train_cmd(&out, STEPS, &flags).spawn().expect("train")));
    kill_worker_once_checkpointed(&out, 1);
    let o = g.finish(LIMIT);
    assert!(!o.status.success(), "finished before its worker was killed");
    assert_all_gone(&out, 4);
    let before = data(&out);
    assert!(
        !before.is_empty() && before.len() < want.len(),
        "{before:?}"
    );
    assert_eq!(before, want[..before.len()], "the first part");

    let from = oobleck_core::checkpoint::latest_checkpoint(&out)
        .expect("list")
        .expect("a checkpoint");
    let from_step = oobleck_core::checkpoint::load_checkpoint(&from, &candle_core::Device::Cpu)
        .expect("load")
        .trainer
        .step;
    let out_s = out.to_str().expect("utf-8 path");
    let resume = ["--nodes", "3", "--pipeline-nodes", "1,2", "--resume", out_s];
    train_ok(train_cmd(&dir.path().join("unused"), STEPS, &resume));
    assert_eq!(data(&out), want, "resumed from step {from_step} on 3 nodes");
    let nodes = per_step(&out, "nodes");
    for &(s, n) in &nodes {
        assert_eq!(
            n,
            if s <= from_step { 2.0 } else { 3.0 },
            "step {s}: {nodes:?}"
        );
    }
    // 4 processes of the first part, 6 of the resumed one (3 agents, 3 workers).
    assert_all_gone(&out, 10);
}

/// Windows of 16 tokens in the training file of [`epoch_corpus`].
const WINDOWS: u64 = 12;

/// A training text of `16 * WINDOWS + 1` tokens (each word one GPT-2 token): 12 windows of 16,
/// so with 4 samples a step an epoch is 3 steps and skips no window; and a validation text.
fn epoch_corpus(dir: &Path) -> (String, String) {
    let words = ["the", "cat", "sat", "on", "a", "mat"];
    let text = |n: u64| {
        let w: Vec<&str> = (0..n as usize).map(|i| words[i % words.len()]).collect();
        w.join(" ") + "\n"
    };
    let (train, val) = (dir.join("train.txt"), dir.join("val.txt"));
    std::fs::write(&train, text(16 * WINDOWS + 1)).expect("write train.txt");
    std::fs::write(&val, text(100)).expect("write val.txt");
    let s = |p: &Path| p.to_str().expect("utf-8 path").to_string();
    (s(&train), s(&val))
}

/// 7 steps of 4 samples on 12 windows: epochs 0 and 1 whole, then the first step of epoch 2.
/// The positions step over each boundary; the samples of each whole epoch, added up from its
/// steps' hashes, are every window exactly once; the second epoch's order is another; a 2-node
/// run trains the single process's samples.
#[test]
fn steps_across_epoch_boundaries_train_every_window_once_per_epoch() {
    const STEPS: u64 = 7;
    let dir = tempfile::tempdir().expect("tempdir");
    let (train, val) = epoch_corpus(dir.path());
    let job = |out: &Path, nodes: &str| {
        let flags = ["--model", "gpt-tiny", "--steps", "7", "--nodes", nodes];
        let data = ["--data", &train, "--val-data", &val];
        train_ok(small_job_cmd(out, &[&flags[..], &data].concat()));
    };
    let single = dir.path().join("single");
    job(&single, "1");
    let got = data(&single);
    assert_well_formed(&got, STEPS);
    let positions: Vec<(u64, u64)> = got
        .iter()
        .map(|(_, d)| (d.epoch.expect("epoch"), d.iteration.expect("iteration")))
        .collect();
    assert_eq!(
        positions,
        [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)]
    );
    let hash = |d: &StepData| SampleHash(u64::from_str_radix(&d.samples, 16).expect("hex"));
    let every_window = SampleHash::of(0..WINDOWS);
    for epoch in [0, 1] {
        let steps = &got[epoch * 3..(epoch + 1) * 3];
        let sum = steps
            .iter()
            .fold(SampleHash::default(), |h, (_, d)| h + hash(d));
        assert_eq!(sum, every_window, "epoch {epoch}: {steps:?}");
    }
    assert_ne!(got[0].1.samples, got[3].1.samples, "epoch 1 is reshuffled");

    let cluster = dir.path().join("cluster");
    job(&cluster, "2");
    assert_eq!(data(&cluster), got, "2 nodes vs the single process");
    assert_all_gone(&cluster, 4);
}
