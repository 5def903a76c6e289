//! The local cluster of `train --nodes N` end to end: data-parallel and heterogeneous pipeline
//! plans reproduce the single-process trainer's losses and final parameters, every process of
//! the job is gone afterwards, a dying worker takes the job down with a clear error, and a plan
//! that does not fit the nodes is refused before anything starts.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use oobleck_core::checkpoint::{latest_checkpoint, load_checkpoint};

const TRAIN: &str = env!("CARGO_BIN_EXE_train");
const OOBLECK: &str = env!("CARGO_BIN_EXE_oobleck");
const TOL: f64 = 1e-5;

/// Kills the child if the test fails while it runs.
struct Guard(Option<Child>);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn train_cmd(out: &Path, steps: u64, extra: &[&str]) -> Command {
    let mut c = Command::new(TRAIN);
    c.args([
        "--model",
        "gpt-tiny",
        "--microbatch-size",
        "2",
        "--global-batch-size",
        "8",
        "--seq-len",
        "32",
        "--eval-batches",
        "1",
        "--sample",
        "0",
        "--seed",
        "7",
    ])
    // f = 0 (a failure ends the job) unless the test asks for more.
    .args(if extra.contains(&"--fault-threshold") {
        &[][..]
    } else {
        &["--fault-threshold", "0"][..]
    })
    .arg("--steps")
    .arg(steps.to_string())
    .arg("--out")
    .arg(out)
    .args(extra)
    .env("OOBLECK_BIN", OOBLECK)
    .env("RUST_BACKTRACE", "0")
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    c
}

impl Guard {
    /// Waits for the child to end within `limit` (killed otherwise) and returns its output.
    fn finish(&mut self, limit: Duration) -> Output {
        let start = Instant::now();
        while self
            .0
            .as_mut()
            .expect("child")
            .try_wait()
            .expect("poll train")
            .is_none()
        {
            assert!(start.elapsed() < limit, "train ran past {limit:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
        self.0
            .take()
            .expect("child")
            .wait_with_output()
            .expect("train output")
    }
}

/// Runs `train` to completion within `limit` (killed otherwise).
fn run(mut cmd: Command, limit: Duration) -> Output {
    Guard(Some(cmd.spawn().expect("start train"))).finish(limit)
}

/// The uninterrupted single-process run of `steps` the fault tests compare with: its
/// per-step losses and final parameters.
fn single_process(dir: &Path, steps: u64) -> (Vec<(u64, f64)>, BTreeMap<String, Tensor>) {
    let single = dir.join("single");
    let o = run(
        train_cmd(&single, steps, &["--nodes", "1"]),
        Duration::from_secs(120),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    (losses(&single), final_params(&single))
}

fn losses(run: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            (
                v["step"].as_u64().expect("step"),
                v["loss"].as_f64().expect("loss"),
            )
        })
        .collect()
}

fn events(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("events.jsonl"))
        .expect("events.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

/// The pids of every agent and worker the run reported.
fn child_pids(run: &Path) -> Vec<u32> {
    events(run)
        .iter()
        .filter(|e| e["event"] == "process")
        .map(|e| e["pid"].as_u64().expect("pid") as u32)
        .collect()
}

/// True while `pid` is a live process (a zombie counts as gone: it runs nothing).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
            .unwrap_or(false),
        Err(_) => false,
    }
}

fn assert_all_gone(run: &Path, want: usize) {
    let pids = child_pids(run);
    assert_eq!(pids.len(), want, "processes reported: {pids:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

/// `(step, val_loss)` of every metrics line that has one, in file order.
fn val_losses(run: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            Some((v["step"].as_u64()?, v["val_loss"].as_f64()?))
        })
        .collect()
}

fn params_at(run: &Path, step: u64) -> BTreeMap<String, Tensor> {
    let ck = oobleck_core::checkpoint::checkpoint_path(run, step);
    load_checkpoint(&ck, &Device::Cpu).expect("load").params
}

fn final_params(run: &Path) -> BTreeMap<String, Tensor> {
    let ck = latest_checkpoint(run).expect("list").expect("a checkpoint");
    load_checkpoint(&ck, &Device::Cpu).expect("load").params
}

fn max_diff(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> f64 {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "checkpoints hold different tensors"
    );
    a.iter()
        .map(|(k, t)| {
            let d = (t - &b[k])
                .and_then(|d| d.abs())
                .and_then(|d| d.flatten_all())
                .and_then(|d| d.max(0))
                .and_then(|d| d.to_scalar::<f32>())
                .expect("diff");
            f64::from(d)
        })
        .fold(0.0, f64::max)
}

#[test]
fn cluster_plans_match_the_single_process_and_leave_no_process() {
    let dir = tempfile::tempdir().expect("tempdir");
    let single = dir.path().join("single");
    // Validation and checkpoints after every step: the cluster assembles them from its
    // workers' states in the background and must match the single process's.
    let periodic = ["--eval-every", "1", "--checkpoint-every", "1"];
    let mut flags = vec!["--nodes", "1"];
    flags.extend(periodic);
    let o = run(train_cmd(&single, 2, &flags), Duration::from_secs(60));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report = std::fs::read_to_string(single.join("report.html")).expect("report.html");
    assert!(
        report.contains("<svg"),
        "--nodes 1: report.html has no plot"
    );
    let want = losses(&single);
    let want_params = final_params(&single);
    let single_metrics = std::fs::read_to_string(single.join("metrics.jsonl")).expect("metrics");
    let want_last: serde_json::Value =
        serde_json::from_str(single_metrics.lines().last().expect("a line")).expect("JSON");
    let want_val = want_last["val_loss"].as_f64().expect("validation loss");
    let want_vals = val_losses(&single);
    assert_eq!(want_vals.len(), 2, "{want_vals:?}");
    let want_step1 = params_at(&single, 1);
    assert_eq!(want.len(), 2);
    // Pinned data parallel, pinned heterogeneous, and the planner's own choice on 4 nodes.
    // And one pipeline of 2 nodes x 2 devices: multi-device stages split each microbatch.
    for (nodes, pipes, g, procs, want_pipes) in [
        ("2", Some("1,1"), "1", 4, 2),
        ("3", Some("1,2"), "1", 6, 2),
        ("4", None, "1", 8, 4),
        ("2", Some("2"), "2", 6, 1),
    ] {
        let out = dir.path().join(format!("n{nodes}g{g}"));
        let mut flags = vec!["--nodes", nodes, "--devices-per-node", g];
        flags.extend(periodic);
        if let Some(p) = pipes {
            flags.extend(["--pipeline-nodes", p]);
        }
        let o = run(train_cmd(&out, 2, &flags), Duration::from_secs(60));
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "--nodes {nodes}: {stderr}");
        let got = losses(&out);
        assert_eq!(got.len(), want.len(), "--nodes {nodes}: {got:?}");
        for ((s, l), (ws, wl)) in got.iter().zip(&want) {
            assert_eq!(s, ws);
            assert!(
                (l - wl).abs() < TOL,
                "--nodes {nodes} step {s}: {l} vs {wl}"
            );
        }
        let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).expect("metrics");
        let first: serde_json::Value =
            serde_json::from_str(metrics.lines().next().expect("a line")).expect("JSON");
        assert_eq!(first["nodes"].as_u64(), Some(nodes.parse().expect("n")));
        assert_eq!(first["pipelines"].as_u64(), Some(want_pipes));
        assert_eq!(first["generation"].as_u64(), Some(0));
        assert!(out.join("config.json").is_file());
        let plans: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(out.join("plan.json")).unwrap())
                .expect("plan.json: an array of plans, one per generation");
        assert_eq!(plans.len(), 1, "--nodes {nodes}: one generation, one plan");
        assert_eq!(plans[0]["generation"], 0, "--nodes {nodes}");
        let report = std::fs::read_to_string(out.join("report.html")).expect("report.html");
        assert!(
            report.contains("<svg"),
            "--nodes {nodes}: report.html has no plot"
        );
        let last: serde_json::Value =
            serde_json::from_str(metrics.lines().last().expect("a line")).expect("JSON");
        let val = last["val_loss"].as_f64().expect("a final validation loss");
        assert!(
            (val - want_val).abs() < TOL,
            "--nodes {nodes}: validation loss {val} vs {want_val}"
        );
        let d = max_diff(&final_params(&out), &want_params);
        assert!(d < TOL, "--nodes {nodes}: max |param diff| {d}");
        let d = max_diff(&params_at(&out, 1), &want_step1);
        assert!(
            d < TOL,
            "--nodes {nodes}: step-1 checkpoint: max |param diff| {d}"
        );
        let vals = val_losses(&out);
        assert_eq!(vals.len(), want_vals.len(), "--nodes {nodes}: {vals:?}");
        for ((s, v), (_, w)) in vals.iter().zip(&want_vals) {
            assert!(
                (v - w).abs() < TOL,
                "--nodes {nodes} step {s}: val {v} vs {w}"
            );
        }
        assert!(
            !out.join("cluster").exists(),
            "--nodes {nodes}: the workers' states outlived the run"
        );
        assert_all_gone(&out, procs);
    }
}

#[test]
fn a_dead_worker_stops_the_whole_job_with_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let mut cmd = train_cmd(&out, 10_000, &["--nodes", "2", "--pipeline-nodes", "2"]);
    let mut g = Guard(Some(cmd.spawn().expect("start train")));
    // Wait for the first committed step, then kill one worker.
    let start = Instant::now();
    let worker = loop {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no step within 30 s"
        );
        let stepped = std::fs::read_to_string(out.join("metrics.jsonl"))
            .map(|m| !m.is_empty())
            .unwrap_or(false);
        if stepped {
            let w = events(&out)
                .into_iter()
                .find(|e| e["event"] == "process" && e["role"] == "worker" && e["rank"] == 1);
            if let Some(w) = w {
                break w["pid"].as_u64().expect("pid") as u32;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // While it runs, `oobleck status` shows the plan and the committed step.
    let st = run(
        {
            let mut c = Command::new(OOBLECK);
            c.args(["status", "--json", "--run"])
                .arg(&out)
                .env_remove("OOBLECK_TOKEN")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            c
        },
        Duration::from_secs(15),
    );
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    let st: serde_json::Value = serde_json::from_slice(&st.stdout).expect("status JSON");
    assert_eq!(st["nodes"].as_array().map(Vec::len), Some(2), "{st}");
    assert_eq!(
        st["pipelines"][0]["nodes"].as_array().map(Vec::len),
        Some(2),
        "{st}"
    );
    assert!(
        st["committed_step"].as_u64().is_some_and(|s| s >= 1),
        "{st}"
    );
    // The stage layout: gpt-tiny's layers cut over the pipeline's two nodes.
    let stages = st["pipelines"][0]["stages"].as_array().expect("stages");
    assert_eq!(stages.len(), 2, "{st}");
    assert_eq!(stages[0]["layers"][0], 0, "{st}");
    assert_eq!(stages[0]["layers"][1], stages[1]["layers"][0], "{st}");
    assert_eq!(st["pipelines"][0]["microbatches"], 4, "{st}");
    let killed = Command::new("kill")
        .args(["-9", &worker.to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let o = g.finish(Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    // Either the master hears of the killed worker first, or its peer's failure (whose
    // error, printed above, names the lost rank).
    assert!(
        stderr.contains("before finishing")
            && (stderr.contains("worker rank 1 on node 1 exited (signal 9)")
                || stderr.contains("rank 1 lost")),
        "{stderr}"
    );
    assert!(events(&out).iter().any(|e| e["event"] == "abort"));
    assert!(
        !out.join("master.token").exists(),
        "the token file outlived the job"
    );
    assert_all_gone(&out, 4);
}

#[test]
fn pinned_pipelines_that_do_not_fit_the_nodes_are_refused_before_anything_starts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let o = run(
        train_cmd(&out, 2, &["--nodes", "3", "--pipeline-nodes", "2,2"]),
        Duration::from_secs(30),
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        stderr.contains("--pipeline-nodes 2,2 uses 4 nodes but the job has 3"),
        "{stderr}"
    );
    assert!(!out.exists(), "nothing may be created or started");
}

#[test]
fn ctrl_c_stops_the_job_says_so_and_leaves_no_process() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let mut cmd = train_cmd(
        &out,
        10_000,
        &[
            "--nodes",
            "2",
            "--checkpoint-every",
            "1",
            "--eval-every",
            "0",
        ],
    );
    let mut g = Guard(Some(cmd.spawn().expect("start train")));
    let pid = g.0.as_ref().expect("child").id();
    let start = Instant::now();
    while !std::fs::read_to_string(out.join("metrics.jsonl")).is_ok_and(|m| !m.is_empty()) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no step within 30 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // SIGINT to train alone (a terminal would also signal its children).
    let sent = Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(sent.success());
    let o = g.finish(Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(stderr.contains("interrupted (Ctrl-C)"), "{stderr}");
    assert!(!out.join("master.token").exists());
    assert_all_gone(&out, 4);
}

#[test]
fn a_hung_agent_is_detected_by_its_lease_and_the_job_ends_with_no_process_left() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let mut cmd = train_cmd(&out, 10_000, &["--nodes", "2"]);
    let mut g = Guard(Some(cmd.spawn().expect("start train")));
    let start = Instant::now();
    let agent = loop {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no step within 30 s"
        );
        if std::fs::read_to_string(out.join("metrics.jsonl")).is_ok_and(|m| !m.is_empty()) {
            let a = events(&out)
                .into_iter()
                .rfind(|e| e["event"] == "process" && e["role"] == "agent");
            if let Some(a) = a {
                break a["pid"].as_u64().expect("pid") as u32;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // SIGSTOP: a hang, not a crash. Its connection stays open; only the lease can tell.
    let stopped = Command::new("kill")
        .args(["-STOP", &agent.to_string()])
        .status()
        .expect("kill");
    assert!(stopped.success());
    let o = g.finish(Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        stderr.contains("LeaseExpired") || stderr.contains("before finishing"),
        "{stderr}"
    );
    assert_all_gone(&out, 4);
}

/// A cluster run whose worker is SIGKILLed resumes from its newest checkpoint on a different
/// set of nodes and plan (`--resume`), replays the steps after it, and ends where a single
/// process that never stopped ends: same per-step losses, same parameters.
#[test]
fn a_killed_cluster_run_resumes_on_other_nodes_and_matches_the_single_process() {
    const STEPS: u64 = 16;
    let dir = tempfile::tempdir().expect("tempdir");
    let (want, want_params) = single_process(dir.path(), STEPS);

    // Two one-node pipelines, a checkpoint every 2 steps; a worker dies once one exists.
    let out = dir.path().join("run");
    let mut cmd = train_cmd(
        &out,
        STEPS,
        &[
            "--nodes",
            "2",
            "--pipeline-nodes",
            "1,1",
            "--checkpoint-every",
            "2",
        ],
    );
    let mut g = Guard(Some(cmd.spawn().expect("start train")));
    let start = Instant::now();
    let worker = loop {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no checkpoint within 60 s"
        );
        if latest_checkpoint(&out).ok().flatten().is_some() {
            let w = events(&out)
                .into_iter()
                .find(|e| e["event"] == "process" && e["role"] == "worker" && e["rank"] == 1);
            break w.expect("worker 1 reported")["pid"].as_u64().expect("pid") as u32;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let killed = Command::new("kill")
        .args(["-9", &worker.to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let o = g.finish(Duration::from_secs(30));
    assert!(
        !o.status.success(),
        "the run finished before its worker was killed; nothing left to resume"
    );
    assert_all_gone(&out, 4);
    let from = latest_checkpoint(&out)
        .expect("list")
        .expect("a checkpoint");
    let from_step = load_checkpoint(&from, &Device::Cpu)
        .expect("load")
        .trainer
        .step;
    assert!((2..STEPS).contains(&from_step), "resuming from {from_step}");

    // Resume on three nodes, in pipelines of one and two nodes: another plan, same steps.
    let mut flags = vec!["--nodes", "3", "--pipeline-nodes", "1,2", "--resume"];
    let out_s = out.to_str().expect("utf-8 path");
    flags.push(out_s);
    let o = run(
        train_cmd(&dir.path().join("unused"), STEPS, &flags),
        Duration::from_secs(120),
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let got = losses(&out);
    assert_eq!(
        got.iter().map(|l| l.0).collect::<Vec<_>>(),
        (1..=STEPS).collect::<Vec<_>>(),
        "every step once in metrics.jsonl"
    );
    for ((s, l), (_, wl)) in got.iter().zip(&want) {
        assert!((l - wl).abs() < TOL, "step {s}: {l} vs {wl}");
    }
    let d = max_diff(&final_params(&out), &want_params);
    eprintln!("resumed from step {from_step}: final parameters within {d:e} of the single process");
    assert!(d < TOL, "final parameters differ by {d}");
    let ev = events(&out);
    let resumed = ev
        .iter()
        .find(|e| e["event"] == "resume")
        .expect("a resume event");
    assert_eq!(resumed["step"].as_u64(), Some(from_step), "{resumed}");
    let plans: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(out.join("plan.json")).expect("plan.json"))
            .expect("plans");
    assert_eq!(plans.len(), 2, "one plan per generation");
    assert_eq!(plans[1]["generation"], 1);
    assert_eq!(plans[1]["pipelines"].as_array().map(Vec::len), Some(2));
    // 4 processes of the first job, 6 of the resumed one (3 agents, 3 workers).
    assert_all_gone(&out, 10);
}

/// Every step of `run` once, in order, with the single process's loss; the final parameters
/// within `TOL` of the single process's.
fn assert_same_training(run: &Path, want: &[(u64, f64)], want_params: &BTreeMap<String, Tensor>) {
    let got = losses(run);
    assert_eq!(
        got.iter().map(|l| l.0).collect::<Vec<_>>(),
        want.iter().map(|l| l.0).collect::<Vec<_>>(),
        "every step once in metrics.jsonl"
    );
    for ((s, l), (_, wl)) in got.iter().zip(want) {
        assert!((l - wl).abs() < TOL, "step {s}: {l} vs {wl}");
    }
    let d = max_diff(&final_params(run), want_params);
    eprintln!("final parameters within {d:e} of the single process");
    assert!(d < TOL, "final parameters differ by {d}");
}

/// `--inject-failure 1@5` with f = 1: node 1 SIGKILLs its agent and worker after step 5. Every
/// layer still has a holder among the survivors, so they keep running (the same processes),
/// the new generation's ranks receive the layers they lack from them, and training goes on
/// from step 5: nothing is replayed. Then beyond f: nodes 0 and 1 die together, some layer has
/// no holder left, and the job falls back to the step-4 checkpoint on the one node left,
/// replaying step 5 with the same data. Both runs end exactly where an uninterrupted single
/// process ends.
#[test]
fn a_node_killed_mid_run_is_recovered_from_and_training_is_unchanged() {
    const STEPS: u64 = 10;
    let dir = tempfile::tempdir().expect("tempdir");
    let (want, want_params) = single_process(dir.path(), STEPS);

    for (case, kills, said, lost, from, in_place, left, procs) in [
        (
            "f = 1, one node",
            &["1@5"][..],
            "in place at step 5",
            serde_json::json!([1]),
            5,
            true,
            2,
            6,
        ),
        (
            "beyond f, two nodes",
            &["0@5", "1@5"][..],
            "replaying from step 4 (1 step(s) lost)",
            serde_json::json!([0, 1]),
            4,
            false,
            1,
            7,
        ),
    ] {
        let out = dir.path().join(format!("run-{from}"));
        let mut flags = vec![
            "--nodes",
            "3",
            "--fault-threshold",
            "1",
            "--checkpoint-every",
            "2",
        ];
        for k in kills {
            flags.extend(["--inject-failure", k]);
        }
        let o = run(train_cmd(&out, STEPS, &flags), Duration::from_secs(180));
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{case}: {stderr}");
        assert!(stderr.contains(said), "{case}: {stderr}");
        assert!(stderr.contains("recovered: "), "{case}: {stderr}");
        assert_same_training(&out, &want, &want_params);
        let ev = events(&out);
        let kinds: Vec<&str> = ev.iter().filter_map(|e| e["event"].as_str()).collect();
        for k in [
            "inject_failure",
            "lost",
            "failure",
            "reconfig",
            "resumed",
            "finish",
        ] {
            assert!(kinds.contains(&k), "{case}: no {k} event: {kinds:?}");
        }
        let resumed = ev
            .iter()
            .find(|e| e["event"] == "resumed")
            .expect("resumed");
        for phase in [
            "detect_s",
            "decide_s",
            "restart_s",
            "connect_copy_s",
            "first_step_s",
        ] {
            assert!(
                resumed["phases"][phase].as_f64().is_some_and(|t| t >= 0.0),
                "{case}: no {phase} in {resumed}"
            );
        }
        let reconfig = ev
            .iter()
            .find(|e| e["event"] == "reconfig")
            .expect("reconfig");
        assert_eq!(reconfig["lost_nodes"], lost, "{case}: {reconfig}");
        assert_eq!(reconfig["from_step"], from, "{case}: {reconfig}");
        assert_eq!(reconfig["in_place"], in_place, "{case}: {reconfig}");
        if in_place {
            // Layers moved between the survivors, and every surviving worker is the process
            // it was before the failure (one process event per node's worker).
            assert!(
                resumed["copy_bytes"].as_u64().is_some_and(|b| b > 0),
                "{resumed}"
            );
            for node in [0, 2] {
                let workers = ev
                    .iter()
                    .filter(|e| e["event"] == "process" && e["role"] == "worker")
                    .filter(|e| e["node"] == node)
                    .count();
                assert_eq!(workers, 1, "{case}: node {node}'s worker was restarted");
            }
        }
        let plans: Vec<serde_json::Value> = serde_json::from_str(
            &std::fs::read_to_string(out.join("plan.json")).expect("plan.json"),
        )
        .expect("plans");
        assert_eq!(plans.len(), 2, "{case}: one plan per generation");
        let last: serde_json::Value = serde_json::from_str(
            std::fs::read_to_string(out.join("metrics.jsonl"))
                .expect("metrics")
                .lines()
                .last()
                .expect("a line"),
        )
        .expect("JSON");
        assert_eq!(last["generation"], 1, "{case}");
        assert_eq!(last["nodes"], left, "{case}");
        // 3 agents, 3 workers of generation 0 and those started for generation 1: all gone.
        assert_all_gone(&out, procs);
    }
}

/// A worker SIGKILLed from outside (its node stays up): with f = 1 the job goes on in place on
/// the same nodes, a fresh worker for the dead one gets its layers from the survivor, and the
/// training is unchanged.
#[test]
fn a_worker_killed_from_outside_is_recovered_from_on_the_same_nodes() {
    const STEPS: u64 = 16;
    let dir = tempfile::tempdir().expect("tempdir");
    let (want, want_params) = single_process(dir.path(), STEPS);

    let out = dir.path().join("run");
    let flags = [
        "--nodes",
        "2",
        "--fault-threshold",
        "1",
        "--checkpoint-every",
        "2",
    ];
    let mut g = Guard(Some(train_cmd(&out, STEPS, &flags).spawn().expect("train")));
    let start = Instant::now();
    let worker = loop {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no checkpoint within 60 s"
        );
        if latest_checkpoint(&out).ok().flatten().is_some() {
            let w = events(&out)
                .into_iter()
                .find(|e| e["event"] == "process" && e["role"] == "worker" && e["rank"] == 1);
            break w.expect("worker 1 reported")["pid"].as_u64().expect("pid") as u32;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let killed = Command::new("kill")
        .args(["-9", &worker.to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let o = g.finish(Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let ev = events(&out);
    let Some(reconfig) = ev.iter().find(|e| e["event"] == "reconfig") else {
        panic!("the run finished before its worker was killed; nothing was recovered");
    };
    assert_eq!(reconfig["lost_nodes"], serde_json::json!([]), "{reconfig}");
    assert_eq!(reconfig["nodes"], serde_json::json!([0, 1]), "{reconfig}");
    assert_eq!(reconfig["in_place"], true, "{reconfig}");
    assert_same_training(&out, &want, &want_params);
    // 2 agents, 2 workers, and the fresh worker that replaced the killed one (it received
    // every layer from node 0's worker, which kept running).
    assert_all_gone(&out, 5);
}

/// `oobleck kill-node` on a running job: an unknown node is refused with a clear error, a
/// real one dies, and with f = 1 the job finishes on the nodes left.
#[test]
fn kill_node_kills_a_running_node_and_the_job_goes_on_without_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let flags = [
        "--nodes",
        "3",
        "--fault-threshold",
        "1",
        "--checkpoint-every",
        "2",
    ];
    let mut g = Guard(Some(train_cmd(&out, 40, &flags).spawn().expect("train")));
    let start = Instant::now();
    while !std::fs::read_to_string(out.join("metrics.jsonl")).is_ok_and(|m| !m.is_empty()) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no step within 60 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let kill = |node: &str| {
        let mut c = Command::new(OOBLECK);
        c.args(["kill-node", node, "--run"])
            .arg(&out)
            .env_remove("OOBLECK_TOKEN")
            .env("RUST_BACKTRACE", "0")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        run(c, Duration::from_secs(15))
    };
    let refused = kill("9");
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("node 9 is not registered"), "{err}");
    let killed = kill("2");
    assert!(
        killed.status.success(),
        "{}",
        String::from_utf8_lossy(&killed.stderr)
    );
    let o = g.finish(Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let ev = events(&out);
    let Some(reconfig) = ev.iter().find(|e| e["event"] == "reconfig") else {
        panic!("the job finished before node 2 died: {stderr}");
    };
    assert_eq!(reconfig["lost_nodes"], serde_json::json!([2]), "{reconfig}");
    assert_eq!(losses(&out).len(), 40, "every step once");
    // 3 agents and 3 workers: the 2 nodes left go on with the same workers.
    assert_all_gone(&out, 6);
}

/// With f = 1 a SIGSTOPped agent (a hang: its connection stays open) is found by its lease,
/// fenced off (killed, so it cannot come back), and the job finishes on the nodes left with
/// nothing left running.
#[test]
fn a_hung_node_is_fenced_off_and_the_job_finishes_without_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let flags = [
        "--nodes",
        "3",
        "--fault-threshold",
        "1",
        "--checkpoint-every",
        "2",
    ];
    let mut g = Guard(Some(train_cmd(&out, 40, &flags).spawn().expect("train")));
    let start = Instant::now();
    let (node, pid) = loop {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no step within 60 s"
        );
        if std::fs::read_to_string(out.join("metrics.jsonl")).is_ok_and(|m| !m.is_empty()) {
            // The agent of node 2: the parent of its worker.
            let w = events(&out)
                .into_iter()
                .find(|e| e["event"] == "process" && e["role"] == "worker" && e["node"] == 2)
                .expect("node 2 runs a worker");
            let worker = w["pid"].as_u64().expect("pid");
            let stat = std::fs::read_to_string(format!("/proc/{worker}/stat")).expect("stat");
            let ppid: u32 = stat
                .rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().nth(1))
                .and_then(|p| p.parse().ok())
                .expect("ppid");
            break (2, ppid);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stopped = Command::new("kill")
        .args(["-STOP", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(stopped.success());
    let o = g.finish(Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let ev = events(&out);
    let Some(reconfig) = ev.iter().find(|e| e["event"] == "reconfig") else {
        panic!("the job finished before node {node} hung: {stderr}");
    };
    assert_eq!(
        reconfig["lost_nodes"],
        serde_json::json!([node]),
        "{reconfig}"
    );
    assert!(
        ev.iter()
            .any(|e| e["event"] == "fenced" && e["pid"].as_u64() == Some(u64::from(pid))),
        "the hung agent was not fenced off"
    );
    assert_eq!(losses(&out).len(), 40, "every step once");
    // 3 agents and 3 workers: the survivors were not restarted.
    assert_all_gone(&out, 6);
}
