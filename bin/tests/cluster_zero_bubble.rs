//! `train --schedule zb-h1` end to end: heterogeneous pipelines (2 + 3 nodes, so the 3-stage
//! pipeline runs fewer microbatches than it has stages) split every backward into B and a
//! later W and still train exactly as the 1F1B run and the single process do, also when a node
//! dies mid-run and the survivors re-form their pipelines in place.

mod common;

use std::time::Duration;

use common::*;

const STEPS: u64 = 4;

#[test]
fn zb_h1_pipelines_train_as_1f1b_and_the_single_process_do() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (want, want_params) = single_process(dir.path(), STEPS);
    let hetero = ["--nodes", "5", "--pipeline-nodes", "2,3"];
    let mut finals = Vec::new();
    for schedule in ["1f1b", "zb-h1"] {
        let out = dir.path().join(schedule);
        let mut flags = hetero.to_vec();
        flags.extend(["--schedule", schedule]);
        let o = run(train_cmd(&out, STEPS, &flags), Duration::from_secs(180));
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{schedule}: {stderr}");
        // The first line names the schedule where it is not the default.
        assert_eq!(stderr.contains("zb-h1"), schedule == "zb-h1", "{stderr}");
        assert_same_training(&out, &want, &want_params);
        finals.push(final_params(&out));
    }
    let d = max_diff(&finals[0], &finals[1]);
    eprintln!("zb-h1 vs 1f1b: final parameters within {d:e}");
    assert!(d < TOL, "zb-h1 and 1f1b end {d} apart");
}

/// Node 3 (stage 1 of the 3-node pipeline) dies after step 2 with f = 1: the survivors re-form
/// pipelines in place and go on under ZB-H1, replaying nothing.
#[test]
fn zb_h1_training_survives_a_node_failure_unchanged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (want, want_params) = single_process(dir.path(), STEPS);
    let out = dir.path().join("run");
    let flags = [
        "--nodes",
        "5",
        "--pipeline-nodes",
        "2,3",
        "--fault-threshold",
        "1",
        "--inject-failure",
        "3@2",
        "--schedule",
        "zb-h1",
    ];
    let o = run(train_cmd(&out, STEPS, &flags), Duration::from_secs(180));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(stderr.contains("recovered: "), "{stderr}");
    assert_same_training(&out, &want, &want_params);
    let r = reconfig_events(&out);
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!(r[0]["replayed_steps"], 0, "{}", r[0]);
}
