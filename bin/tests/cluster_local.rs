//! The local cluster of `train --nodes N` end to end: data-parallel and heterogeneous pipeline
//! plans reproduce the single-process trainer's losses and final parameters, every process of
//! the job is gone afterwards, a dying worker takes the job down with a clear error, and a plan
//! that does not fit the nodes is refused before anything starts.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::Device;
use common::*;
use oobleck_core::checkpoint::{latest_checkpoint, load_checkpoint};

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

/// Starts a 2-node job of many steps that checkpoints every step and returns it, with its
/// `train` pid, once a step is committed.
fn long_job(out: &Path) -> (Guard, u32) {
    let mut cmd = train_cmd(
        out,
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
    let g = Guard(Some(cmd.spawn().expect("start train")));
    let pid = g.0.as_ref().expect("child").id();
    let start = Instant::now();
    while !std::fs::read_to_string(out.join("metrics.jsonl")).is_ok_and(|m| !m.is_empty()) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no step within 30 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (g, pid)
}

fn signal(pid: u32, sig: &str) {
    let sent = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("kill");
    assert!(sent.success());
}

/// Ctrl-C and SIGTERM to the master stop the job after the next step with its checkpoint,
/// record it, and exit 0 (issue 43; this test wanted a failure with no checkpoint before).
#[test]
fn ctrl_c_stops_the_job_says_so_and_leaves_no_process() {
    for sig in ["-INT", "-TERM"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("run");
        let (mut g, pid) = long_job(&out);
        // To train alone (a terminal would also signal its children, which ignore SIGINT).
        signal(pid, sig);
        let o = g.finish(Duration::from_secs(30));
        assert_stopped(&out, &o, &format!("SIG{}", &sig[1..]));
    }
}

/// `oobleck stop --run` (a scheduler's notice, from any machine) stops the job as SIGTERM to
/// its master does, and says who asked.
#[test]
fn oobleck_stop_stops_the_job_as_sigterm_does() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let (mut g, _pid) = long_job(&out);
    let asked = Command::new(common::OOBLECK)
        .args(["stop", "--reason", "a drill", "--run"])
        .arg(&out)
        .output()
        .expect("oobleck stop");
    let said = String::from_utf8_lossy(&asked.stdout);
    assert!(
        asked.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&asked.stderr)
    );
    assert!(said.contains("stops the job after its next step"), "{said}");
    let o = g.finish(Duration::from_secs(30));
    assert_stopped(&out, &o, "a drill");
}

/// The job of `out` ended as `o` after a stop asked by `name`: after the step it said, with
/// that step's checkpoint, recorded, exit 0, nothing left running.
fn assert_stopped(out: &Path, o: &std::process::Output, name: &str) {
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{name}: {stderr}");
    assert!(
        stderr.contains(&format!("{name}: stopping after step")),
        "{stderr}"
    );
    assert!(stderr.contains("--resume"), "{stderr}");
    let stop = events(out)
        .into_iter()
        .find(|e| e["event"] == "stop_requested")
        .expect("a stop_requested event");
    assert_eq!(stop["signal"], name);
    let step = stop["step"].as_u64().unwrap();
    let finish = events(out)
        .into_iter()
        .find(|e| e["event"] == "finish")
        .expect("a finish event");
    assert_eq!(finish["step"], step, "stopped after the step it said");
    let newest = latest_checkpoint(out).unwrap().expect("a checkpoint");
    assert!(newest.ends_with(format!("step-{step:06}")), "{newest:?}");
    assert!(!out.join("master.token").exists());
    assert_all_gone(out, 4);
    assert_no_segments(out);
}

/// A second signal stops the job at once, without waiting for a step.
#[test]
fn a_second_signal_stops_the_job_at_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let (mut g, pid) = long_job(&out);
    // Two of the same signal sent at once may arrive as one (the kernel keeps one pending), so
    // the first is another; the two may be taken in either order.
    signal(pid, "-INT");
    signal(pid, "-TERM");
    let o = g.finish(Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{stderr}");
    assert!(
        stderr.contains("stopped at once by a second SIG"),
        "{stderr}"
    );
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
    kill_worker_once_checkpointed(&out, 1);
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
