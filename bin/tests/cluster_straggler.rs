//! A worker slowed on purpose (`OOBLECK_TEST_SLOW`: it sleeps in the forward of every
//! microbatch it reads, still making progress) is named a straggler in `events.jsonl` with
//! its numbers, and is never killed for it; with `--evict-stragglers` its node is drained
//! as `oobleck drain` would drain it, and training goes on without a step lost.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use oobleck_core::runtime::worker::TEST_SLOW_ENV;

const STEPS: u64 = 16;

/// The slept-on node: with 3 nodes and f = 1 the plan is pipelines [0] and [1, 2], so node 0
/// runs every layer of its pipeline and reads every microbatch of it (2 of the 4).
const SLOW_NODE: u32 = 0;
/// Per microbatch read: a normal step computes about 300 ms there on the test machine, so
/// 2 x 300 ms more is about 3x what its peers take for the same work, far past 1.5x.
const SLEEP_MS: u64 = 300;

fn slowed_run(out: &Path, extra: &[&str]) -> String {
    let flags = [&["--nodes", "3", "--fault-threshold", "1"][..], extra].concat();
    let mut cmd = train_cmd(out, STEPS, &flags);
    cmd.env(TEST_SLOW_ENV, format!("{SLOW_NODE}:{SLEEP_MS}"));
    let o = run(cmd, Duration::from_secs(240));
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{stderr}");
    stderr
}

/// The run's one `straggler` event: on the slowed node, with numbers that say so.
fn the_straggler(out: &Path) -> serde_json::Value {
    let named: Vec<serde_json::Value> = events(out)
        .into_iter()
        .filter(|e| e["event"] == "straggler")
        .collect();
    assert_eq!(named.len(), 1, "one straggler, named once: {named:?}");
    let s = named[0].clone();
    eprintln!("straggler: {s}");
    assert_eq!(s["node"], SLOW_NODE, "{s}");
    assert_eq!(s["steps"], 5, "{s}");
    let (compute, peers, factor) = (
        s["compute_ms"].as_f64().expect("compute_ms"),
        s["peers_median_ms"].as_f64().expect("peers_median_ms"),
        s["factor"].as_f64().expect("factor"),
    );
    assert!(factor > 1.5 && compute > 1.5 * peers, "{s}");
    assert!((compute / peers - factor).abs() < 1e-6, "{s}");
    // At least the sleeps of its 2 microbatches: the compute it reports is its own.
    assert!(compute >= 2.0 * SLEEP_MS as f64, "{s}");
    s
}

/// No worker was killed, hung or failed; every step is in `metrics.jsonl` once, with each
/// of its `ranks` ranks' times.
fn nothing_killed_every_step_once(out: &Path, ranks: &[usize]) {
    let ev = events(out);
    for e in &ev {
        let kind = e["event"].as_str().unwrap_or_default();
        assert!(
            ![
                "hang",
                "failure",
                "lost",
                "fenced",
                "worker_broken",
                "abort"
            ]
            .contains(&kind),
            "{e}"
        );
        if kind == "worker_exit" {
            assert_eq!(
                (&e["code"], &e["signal"]),
                (&0.into(), &serde_json::Value::Null),
                "{e}"
            );
        }
    }
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let steps: Vec<u64> = lines
        .iter()
        .map(|m| m["step"].as_u64().expect("step"))
        .collect();
    assert_eq!(steps, (1..=STEPS).collect::<Vec<_>>(), "every step once");
    for (m, &want) in lines.iter().zip(ranks) {
        let times = m["times"].as_object().expect("per-rank times");
        assert_eq!(times.len(), want, "{m}");
        assert!(
            times.values().all(|t| t["compute_ms"].as_f64().is_some()),
            "{m}"
        );
    }
}

#[test]
fn a_slowed_worker_is_named_a_straggler_and_never_killed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("slow");
    let stderr = slowed_run(&out, &[]);
    let s = the_straggler(&out);
    assert!(
        s.get("evicted").is_none() && s.get("refusal").is_none(),
        "{s}"
    );
    let said = format!(
        "rank {} on node {SLOW_NODE} is a straggler: compute ",
        s["rank"]
    );
    assert!(stderr.contains(&said), "{stderr}");
    assert!(
        stderr.contains("in 1F1B it holds every pipeline back"),
        "{stderr}"
    );
    let kinds: Vec<String> = events(&out)
        .iter()
        .filter_map(|e| e["event"].as_str().map(str::to_string))
        .collect();
    for k in ["reconfig", "drain", "released"] {
        assert!(!kinds.iter().any(|x| x == k), "a {k} event: {kinds:?}");
    }
    nothing_killed_every_step_once(&out, &[3; STEPS as usize]);
    assert_all_gone(&out, 6);
}

#[test]
fn evict_stragglers_drains_the_slow_node_and_training_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("evict");
    let stderr = slowed_run(&out, &["--evict-stragglers"]);
    let s = the_straggler(&out);
    assert_eq!(s["evicted"], true, "{s}");
    assert!(
        stderr.contains(&format!(
            "--evict-stragglers: node {SLOW_NODE} drains at the next step boundary"
        )),
        "{stderr}"
    );
    let ev = events(&out);
    let drain = ev
        .iter()
        .find(|e| e["event"] == "drain")
        .expect("a drain event");
    assert_eq!(drain["node"], SLOW_NODE);
    assert!(
        drain["reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("straggler: rank ")),
        "{drain}"
    );
    let r = reconfig_events(&out);
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!(r[0]["drained_nodes"], serde_json::json!([SLOW_NODE]));
    assert_eq!(
        (&r[0]["replayed_steps"], &r[0]["in_place"]),
        (&0.into(), &true.into())
    );
    // Steps up to the straggler's have 3 ranks, the rest 2 (the pipeline over nodes 1, 2).
    let named_at = s["step"].as_u64().expect("step") as usize;
    let ranks: Vec<usize> = (1..=STEPS as usize)
        .map(|step| if step <= named_at { 3 } else { 2 })
        .collect();
    nothing_killed_every_step_once(&out, &ranks);
    assert_all_gone(&out, 6);
}
