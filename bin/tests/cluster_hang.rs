//! Hung workers on a local cluster: a worker that stops (SIGSTOP, by itself at an exact place of
//! a step) or whose forward never returns while its process runs on, and one whose pipe to its
//! agent closes. Its agent's watchdog finds it within its limit, not the data plane's 60 s,
//! fences it, and the job recovers in place: every step once, ending where an uninterrupted
//! single process ends, with no process left behind.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use oobleck_core::runtime::worker::TEST_HANG_ENV;

/// How long the hook stays inside its operation before it hangs (`worker/hooks.rs`).
const BEFORE_STOP_S: f64 = 0.2;
/// What the stop-to-commit time may exceed the limit plus the recovery by: the agent polls
/// every 20 ms, a beat is up to 50 ms old, and a loaded 2-core machine adds its own delays.
const SLACK_S: f64 = 1.5;

const STEPS: u64 = 14;

/// Runs a 3-node job with f = 1 (pipelines [0] and [1, 2]) and the hang hook `hangs` beside an
/// uninterrupted single process; it must succeed and train exactly as the single process.
fn hung_run(dir: &Path, hangs: &str) -> std::path::PathBuf {
    let (want, want_params) = single_process(dir, STEPS);
    let out = dir.join("run");
    let mut cmd = train_cmd(&out, STEPS, &["--nodes", "3", "--fault-threshold", "1"]);
    cmd.env(TEST_HANG_ENV, hangs);
    let o = run(cmd, Duration::from_secs(240));
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{stderr}");
    assert_same_training(&out, &want, &want_params);
    out
}

fn of_kind(run: &Path, kind: &str) -> Vec<serde_json::Value> {
    events(run)
        .into_iter()
        .filter(|e| e["event"] == kind)
        .collect()
}

/// Checks hang `h` (a `hang` event) against the run's commits: its limit is the watchdog's
/// (1.5 s for a stopped one; for one that beats, 3 median steps when those are longer), and
/// the time from the hang to the next commit is under the limit plus the recovery that
/// followed (`resumed`'s since_failure_s).
fn assert_found_in_time(run: &Path, h: &serde_json::Value, resumed: &serde_json::Value) {
    let commits = per_step(run, "wall_s");
    let what = h["what"].as_str().expect("what");
    let step: u64 = what
        .rsplit_once("of step ")
        .and_then(|(_, s)| s.parse().ok())
        .unwrap_or_else(|| panic!("no step in {what:?}"));
    // Stopped waiting for its commit, the step still commits (every rank was ready): the
    // next one is the step that waits on it.
    let step = step + u64::from(what.starts_with("waiting for the commit"));
    let at = |s: u64| commits.iter().find(|c| c.0 == s).expect("committed").1;
    let mut before: Vec<f64> = (2..step).map(|s| at(s) - at(s - 1)).collect();
    before.sort_by(f64::total_cmp);
    let median = before[before.len() / 2];
    let limit = h["limit_s"].as_f64().expect("limit_s");
    if h["stopped"] == true {
        // No beat either: the limit does not depend on the step time.
        assert_eq!(limit, 1.5, "{h}");
    } else {
        // The agent measures its own steps; allow for its clock against the master's.
        assert!(
            limit <= (3.0 * median).max(1.5) * 1.5 + 0.1 && limit >= 1.5,
            "limit {limit} s for a median step of {median} s"
        );
    }
    let stop_to_commit = at(step) - at(step - 1) - BEFORE_STOP_S;
    let recovery = resumed["since_failure_s"]
        .as_f64()
        .expect("since_failure_s");
    eprintln!(
        "{what}: stop to next commit {stop_to_commit:.2} s = limit {limit:.2} s + recovery \
         {recovery:.2} s + {:.2} s",
        stop_to_commit - limit - recovery
    );
    assert!(
        stop_to_commit < limit + recovery + SLACK_S,
        "{what}: {stop_to_commit:.2} s from the stop to the next commit (limit {limit}, \
         recovery {recovery})"
    );
}

/// A worker SIGSTOPped in its forward, then (in the next generations) one in its gradient
/// all-reduce, one in a receive of activations from its pipeline's first stage and one
/// waiting for its step's commit (its peers go on and wait on it). Each is found stopped (no
/// progress beat either) within 1.5 s, fenced with SIGKILL, and replaced in place; the job
/// loses no step.
#[test]
fn workers_stopped_in_compute_all_reduce_and_p2p_are_found_fenced_and_replaced() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = hung_run(
        dir.path(),
        "0:1:4:compute,1:0:7:all_reduce,2:2:10:p2p,3:1:12:commit",
    );
    let hangs = of_kind(&out, "hang");
    let resumed = of_kind(&out, "resumed");
    assert_eq!(hangs.len(), 4, "{hangs:?}");
    assert_eq!(resumed.len(), 4, "{resumed:?}");
    let wants = [
        (1, "the forward of microbatch"),
        (0, "all_reduce #"),
        (2, "a receive of microbatch"),
        (1, "waiting for the commit"),
    ];
    for ((h, r), (node, what)) in hangs.iter().zip(&resumed).zip(wants) {
        assert_eq!(h["node"], node, "{h}");
        assert_eq!(h["stopped"], true, "{h}");
        assert!(h["what"].as_str().expect("what").contains(what), "{h}");
        assert_found_in_time(&out, h, r);
    }
    for r in reconfig_events(&out) {
        assert_eq!(r["in_place"], true, "{r}");
        assert_eq!(r["replayed_steps"], 0, "{r}");
        assert!(
            r["cause"].as_str().expect("cause").contains("fenced"),
            "{r}"
        );
    }
    let fenced: Vec<_> = of_kind(&out, "worker_exit")
        .into_iter()
        .filter(|e| e["signal"] == 9)
        .collect();
    assert_eq!(fenced.len(), 4, "each stopped worker SIGKILLed: {fenced:?}");
    // 3 agents, 3 workers and the 4 fresh ones that replaced the hung.
    assert_all_gone(&out, 10);
}

/// A collective that never returns on any member (node 1's first all-reduce of step 6 hangs
/// until its generation is aborted, as a hung NCCL call does until `ncclCommAbort`): every
/// rank only waits on its peers, so no watchdog blames one, but each agent says its worker
/// waits; once every rank of the step does, the master ends the generation. Nobody is
/// killed, every rank holds step 5, and training goes on in place within seconds, not after
/// the data plane's 60 s timeout.
#[test]
fn a_collective_that_hangs_on_every_member_ends_the_generation_in_seconds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = hung_run(dir.path(), "0:1:6:all_reduce_stuck");
    assert!(of_kind(&out, "hang").is_empty(), "nobody is blamed");
    let dp = of_kind(&out, "data_plane_hang");
    assert_eq!(dp.len(), 1, "{dp:?}");
    assert_eq!(dp[0]["step"], 6, "{}", dp[0]);
    assert_eq!(
        dp[0]["waiting"].as_array().map(Vec::len),
        Some(3),
        "{}",
        dp[0]
    );
    let r = reconfig_events(&out);
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!(r[0]["in_place"], true, "{}", r[0]);
    assert_eq!(r[0]["replayed_steps"], 0, "{}", r[0]);
    assert!(
        r[0]["cause"]
            .as_str()
            .expect("cause")
            .contains("every rank waits"),
        "{}",
        r[0]
    );
    let commits = per_step(&out, "wall_s");
    let at = |s: u64| commits.iter().find(|c| c.0 == s).expect("committed").1;
    let stall = at(6) - at(5);
    eprintln!("a hung collective: step 6 committed {stall:.2} s after step 5");
    assert!(
        stall < 15.0,
        "{stall:.2} s: found by a timeout, not the watchdogs"
    );
    let killed: Vec<_> = of_kind(&out, "worker_exit")
        .into_iter()
        .filter(|e| !e["signal"].is_null())
        .collect();
    assert!(killed.is_empty(), "nobody killed: {killed:?}");
    // 3 agents and 3 workers, none replaced.
    assert_all_gone(&out, 6);
}

/// A worker whose forward never returns while its process runs on (its progress beats go on,
/// nothing moves: a GPU kernel that hangs) is hung, SIGTERMed and replaced; then a worker
/// whose pipe to its agent closes is killed as crashed. No step is lost.
#[test]
fn a_worker_stuck_while_running_and_one_whose_pipe_closed_are_replaced() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = hung_run(dir.path(), "0:1:4:stuck,1:2:8:close_stdout");
    let hangs = of_kind(&out, "hang");
    let resumed = of_kind(&out, "resumed");
    assert_eq!(hangs.len(), 1, "{hangs:?}");
    assert_eq!(hangs[0]["stopped"], false, "{}", hangs[0]);
    assert_found_in_time(&out, &hangs[0], &resumed[0]);
    let exits = of_kind(&out, "worker_exit");
    assert!(
        exits.iter().any(|e| e["node"] == 1 && e["signal"] == 15),
        "the stuck worker ends at its SIGTERM: {exits:?}"
    );
    assert!(
        exits.iter().any(|e| e["node"] == 2
            && e["error"]
                .as_str()
                .is_some_and(|s| s.contains("report pipe (stdout) closed"))),
        "the worker without a pipe is killed as crashed: {exits:?}"
    );
    let r = reconfig_events(&out);
    assert_eq!(r.len(), 2, "{r:?}");
    assert!(r.iter().all(|r| r["replayed_steps"] == 0), "{r:?}");
    assert_all_gone(&out, 8);
}
