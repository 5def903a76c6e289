//! Recovery on a local cluster, with real failures (SIGKILL of a node's processes, of one
//! worker, at exact points of a step or of a reconfiguration's copies; SIGSTOP of an agent):
//! training goes on, every step once, ending where an uninterrupted single process ends, with
//! no process left behind.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use oobleck_core::runtime::worker::{TEST_CORRUPT_ENV, TEST_KILL_ENV};

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
    kill_worker_once_checkpointed(&out, 1);
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

/// The `reconfig` events of a run, in order.
/// Runs `train` for 8 steps with `flags` and the environment `env` (a test hook) beside an
/// uninterrupted single process: the run must succeed and end exactly where the single
/// process ends (every step once, same losses and parameters). Returns its run directory, to
/// be read before `dir` goes, and its stderr.
fn recovered_run(
    dir: &std::path::Path,
    flags: &[&str],
    env: &[(&str, &str)],
) -> (std::path::PathBuf, String) {
    const STEPS: u64 = 8;
    let (want, want_params) = single_process(dir, STEPS);
    let out = dir.join("run");
    let mut cmd = train_cmd(&out, STEPS, flags);
    cmd.envs(env.iter().copied());
    let o = run(cmd, Duration::from_secs(180));
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{stderr}");
    assert_same_training(&out, &want, &want_params);
    (out, stderr)
}

/// With f = 2 the plan has three pipelines over four nodes, so two nodes killed together
/// leave every layer with a holder: the job goes on in place from the step they died after,
/// with the same worker processes on the two nodes left.
#[test]
fn two_nodes_killed_at_once_with_f_2_are_recovered_in_place() {
    let dir = tempfile::tempdir().expect("tempdir");
    let flags = [
        "--nodes",
        "4",
        "--fault-threshold",
        "2",
        "--inject-failure",
        "1@4",
        "--inject-failure",
        "2@4",
    ];
    let (out, _) = recovered_run(dir.path(), &flags, &[]);
    let r = reconfig_events(&out);
    assert_eq!(r.len(), 1, "one reconfiguration for both losses: {r:?}");
    assert_eq!(r[0]["lost_nodes"], serde_json::json!([1, 2]), "{}", r[0]);
    assert_eq!(r[0]["in_place"], true, "{}", r[0]);
    assert_eq!(r[0]["replayed_steps"], 0, "{}", r[0]);
    // 4 agents and 4 workers: nothing was restarted.
    assert_all_gone(&out, 8);
}

/// A worker SIGKILLed inside a step, just before its gradient sync (its node stays up): its
/// peers fail their all-reduce, the step is not committed, and the job goes on in place from
/// the step before, with a fresh worker for the dead one.
#[test]
fn a_worker_killed_during_gradient_sync_is_recovered_in_place() {
    let dir = tempfile::tempdir().expect("tempdir");
    let flags = ["--nodes", "3", "--fault-threshold", "1"];
    let (out, _) = recovered_run(dir.path(), &flags, &[(TEST_KILL_ENV, "sync:0:1:5")]);
    let r = reconfig_events(&out);
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!(r[0]["lost_nodes"], serde_json::json!([]), "{}", r[0]);
    assert_eq!(r[0]["in_place"], true, "{}", r[0]);
    assert_eq!(r[0]["failed_in_step"], 5, "{}", r[0]);
    assert_eq!(r[0]["from_step"], 4, "{}", r[0]);
    // 3 agents, 3 workers and the fresh one on node 1.
    assert_all_gone(&out, 7);
}

/// A second failure during a reconfiguration's layer copies: node 1 dies after step 3, and
/// while the new generation copies layers the worker of node 2 is SIGKILLed after the first
/// copy. That starts another reconfiguration (never a hang) from what the devices still hold,
/// and training still ends where the single process ends.
#[test]
fn a_failure_during_the_copies_starts_another_reconfiguration() {
    let dir = tempfile::tempdir().expect("tempdir");
    let flags = [
        "--nodes",
        "3",
        "--fault-threshold",
        "1",
        "--inject-failure",
        "1@3",
    ];
    let (out, stderr) = recovered_run(dir.path(), &flags, &[(TEST_KILL_ENV, "copy:1:2:3")]);
    assert!(
        stderr.contains("SIGKILL"),
        "the copy kill did not fire: {stderr}"
    );
    let r = reconfig_events(&out);
    assert_eq!(r.len(), 2, "{r:?}");
    for (i, lost) in [(0, serde_json::json!([1])), (1, serde_json::json!([]))] {
        assert_eq!(r[i]["lost_nodes"], lost, "{}", r[i]);
        assert_eq!(r[i]["in_place"], true, "{}", r[i]);
        assert_eq!(r[i]["from_step"], 3, "{}", r[i]);
    }
    // 3 agents, 3 workers and the fresh one on node 2.
    assert_all_gone(&out, 7);
}

/// A layer copy that arrives corrupted (a bit flipped after the sender's checksum, by the
/// OOBLECK_TEST_CORRUPT hook): the receiver refuses it, the master stops offering that
/// replica, and since no other holder of the layer is left the job says so and falls back to
/// the newest checkpoint. Training still ends where the single process ends.
///
/// Which checkpoint is newest is a race the test must not depend on: savers upload a step's
/// state in the background while training goes on, so the node killed after step 5 may die
/// before its state of step 4 arrived (that checkpoint is then never written). Step 2's upload
/// had three steps to finish. So the fallback must start from the newest checkpoint the job
/// recorded before it, and that is a real one (step 2 or 4), never step 0.
#[test]
fn a_corrupted_layer_copy_is_refused_and_the_job_falls_back_to_the_checkpoint() {
    let dir = tempfile::tempdir().expect("tempdir");
    let flags = [
        "--nodes",
        "3",
        "--fault-threshold",
        "1",
        "--checkpoint-every",
        "2",
        "--inject-failure",
        "1@5",
    ];
    let (out, stderr) = recovered_run(dir.path(), &flags, &[(TEST_CORRUPT_ENV, "1:0")]);
    assert!(stderr.contains("arrived corrupted"), "{stderr}");
    assert!(
        stderr.contains("lost every replica; going back to the newest checkpoint"),
        "{stderr}"
    );
    let r = reconfig_events(&out);
    assert_eq!(r.len(), 2, "{r:?}");
    assert_eq!(r[0]["in_place"], true, "{}", r[0]);
    assert_eq!(r[1]["in_place"], false, "{}", r[1]);
    let newest = newest_checkpoint_before_fallback(&out);
    assert!(matches!(newest, Some(2 | 4)), "{newest:?}");
    assert_eq!(r[1]["from_step"].as_u64(), newest, "{}", r[1]);
}

/// The step of the newest `checkpoint` event recorded before the second reconfiguration.
fn newest_checkpoint_before_fallback(run: &std::path::Path) -> Option<u64> {
    let mut newest = None;
    let mut reconfigs = 0;
    for e in events(run) {
        match e["event"].as_str() {
            Some("checkpoint") => newest = newest.max(e["step"].as_u64()),
            Some("reconfig") => reconfigs += 1,
            _ => {}
        }
        if reconfigs == 2 {
            break;
        }
    }
    newest
}
