//! The two bar charts (where each stage's step went, the recoveries' phases), the step time,
//! and the note on a partial run directory.

use serde_json::json;

use super::{chart, fill, lines_of, metric, tags, texts_of, two_generation_run, write_lines};
use crate::report::charts::bars::{stage_parts, SINCE_FAILURE, STAGE_PARTS};
use crate::report::charts::{CHECKPOINT, EVENT, JOIN, TRAIN};
use crate::report::*;

fn times(compute: f64, fwd: f64, bwd: f64, p2p: f64, sync: f64, step: f64) -> serde_json::Value {
    json!({"compute_ms": compute, "forward_ms": fwd, "backward_ms": bwd, "p2p_ms": p2p,
           "collective_ms": sync, "step_ms": step, "marks": 10})
}

/// The rectangles drawn in the colour of stage part `name`.
fn bars_of(svg: &str, name: &str) -> usize {
    let (_, color) = STAGE_PARTS.iter().find(|p| p.0 == name).expect("a part");
    tags(svg, "rect", &fill(*color)).len()
}

/// [`two_generation_run`] with per-rank times in generation 1 (ranks 0-2, steps 6-10):
/// rank 2's forward and backward exceed its compute (other compute clips to 0), and rank 1's
/// parts exceed its step (the bubble clips to 0).
fn run_with_times(dir: &std::path::Path) {
    two_generation_run(dir);
    let metrics: Vec<_> = (1..=10)
        .map(|s| {
            if s <= 5 {
                return metric(s, 0, 4, None);
            }
            let mut m = metric(s, 1, 3, None);
            m["times"] = json!({
                "0": times(100.0, 40.0, 55.0, 10.0, 5.0, 150.0 + s as f64),
                "1": times(100.0, 40.0, 55.0, 30.0, 20.0, 140.0),
                "2": times(100.0, 50.0, 60.0, 0.0, 5.0, 130.0),
            });
            m
        })
        .collect();
    write_lines(&dir.join("metrics.jsonl"), &metrics);
}

#[test]
fn a_ranks_parts_are_clipped_at_zero() {
    let t: RankTimes = serde_json::from_value(times(100.0, 50.0, 60.0, 30.0, 20.0, 140.0)).unwrap();
    // Other compute 100 - 110 and bubble 140 - 150 are both negative.
    assert_eq!(stage_parts(&t), vec![50.0, 60.0, 0.0, 30.0, 20.0, 0.0]);
    let t: RankTimes = serde_json::from_value(times(100.0, 40.0, 55.0, 10.0, 5.0, 150.0)).unwrap();
    assert_eq!(stage_parts(&t), vec![40.0, 55.0, 5.0, 10.0, 5.0, 35.0]);
}

#[test]
fn the_stage_chart_has_one_bar_per_rank_of_the_last_generation() {
    let tmp = tempfile::tempdir().unwrap();
    run_with_times(tmp.path());
    let html = render(&read_run(tmp.path()).unwrap());
    let svg = chart(&html, "stages");
    assert_eq!(bars_of(svg, "forward"), 3, "{svg}");
    assert_eq!(bars_of(svg, "backward"), 3);
    assert_eq!(bars_of(svg, "other compute"), 2, "rank 2's is clipped away");
    assert_eq!(bars_of(svg, "p2p wait"), 2, "rank 2 waited for none");
    assert_eq!(bars_of(svg, "gradient sync"), 3);
    assert_eq!(bars_of(svg, "bubble"), 2, "rank 1's is clipped away");
    // Named by the plan of generation 1: three one-node pipelines.
    for label in [
        "rank 0 · p0 stage 0 (node 0)",
        "rank 1 · p1 stage 0 (node 1)",
        "rank 2 · p2 stage 0 (node 2)",
    ] {
        assert!(
            svg.contains(&format!(">\n{label}\n</text>")),
            "{label}: {svg}"
        );
    }
    assert!(svg.contains("generation 1: mean ms per committed step"));
    // Without a plan the ranks are only numbered.
    std::fs::remove_file(tmp.path().join("plan.json")).unwrap();
    let svg = stage_chart(&read_run(tmp.path()).unwrap(), 800, 300);
    assert!(svg.contains(">\nrank 1\n</text>"), "{svg}");
}

#[test]
fn older_metrics_without_forward_and_backward_draw_compute_whole() {
    let tmp = tempfile::tempdir().unwrap();
    two_generation_run(tmp.path());
    let mut m = metric(1, 0, 4, None);
    m["times"] = json!({"0": {"compute_ms": 80.0, "p2p_ms": 5.0, "collective_ms": 5.0,
                              "step_ms": 100.0}});
    write_lines(&tmp.path().join("metrics.jsonl"), &[m]);
    let svg = stage_chart(&read_run(tmp.path()).unwrap(), 800, 300);
    assert_eq!(
        bars_of(&svg, "forward") + bars_of(&svg, "backward"),
        0,
        "{svg}"
    );
    assert_eq!(bars_of(&svg, "other compute"), 1);
    assert_eq!(bars_of(&svg, "bubble"), 1);
}

#[test]
fn the_step_time_is_the_slowest_ranks_per_committed_step() {
    let tmp = tempfile::tempdir().unwrap();
    run_with_times(tmp.path());
    let run = read_run(tmp.path()).unwrap();
    let steps: Vec<_> = run.metrics().iter().filter_map(Metric::step_ms).collect();
    assert_eq!(steps, vec![156.0, 157.0, 158.0, 159.0, 160.0]);
    // One point per step that has times (steps 1-5 have none).
    assert_eq!(lines_of(&step_time_chart(&run, 640, 300), TRAIN), vec![5]);
}

#[test]
fn the_recovery_chart_has_a_bar_per_resumed_event_with_its_phases() {
    let tmp = tempfile::tempdir().unwrap();
    two_generation_run(tmp.path());
    let mut events = std::fs::read_to_string(tmp.path().join("events.jsonl")).unwrap();
    for (generation, step, copy) in [(1, 6, 0.4), (2, 9, 0.0)] {
        let e = json!({"event": "resumed", "generation": generation, "step": step,
                       "since_failure_s": 2.5, "copy_bytes": 0,
                       "phases": {"detect_s": 1.0, "plan_s": 0.2, "connect_copy_s": copy,
                                  "copy_max_s": 0.3, "first_step_s": 0.5}});
        events.push_str(&format!("{e}\n"));
    }
    std::fs::write(tmp.path().join("events.jsonl"), events).unwrap();
    let html = render(&read_run(tmp.path()).unwrap());
    let svg = chart(&html, "recovery");
    for label in ["gen 1 · step 6", "gen 2 · step 9"] {
        assert!(
            svg.contains(&format!(">\n{label}\n</text>")),
            "{label}: {svg}"
        );
    }
    // Keys in the order the phases happen; the slowest rank's copy is no phase of its own.
    let keys: Vec<usize> = ["detect_s", "plan_s", "connect_copy_s", "first_step_s"]
        .iter()
        .map(|k| svg.find(&format!(">\n{k}\n</text>")).expect(k))
        .collect();
    assert!(keys.windows(2).all(|w| w[0] < w[1]), "{keys:?}");
    assert!(!svg.contains("copy_max_s"));
    // Two bars of three or four parts (the second copied nothing), and the time since the
    // failure ticked on each. The dots of the key are circles, not rectangles.
    let rects = tags(svg, "rect", "fill=\"#").len();
    assert_eq!(rects, 1 + 4 + 3, "the background and the parts: {svg}");
    assert_eq!(lines_of(svg, SINCE_FAILURE), vec![2, 2]);
}

#[test]
fn a_partial_directory_draws_what_it_can_and_names_what_is_missing() {
    let tmp = tempfile::tempdir().unwrap();
    two_generation_run(tmp.path());
    let (_, note) = write_report_noting(tmp.path()).unwrap();
    assert_eq!(note, None, "a full run directory");
    for f in ["config.json", "events.jsonl", "plan.json"] {
        std::fs::remove_file(tmp.path().join(f)).unwrap();
    }
    let (path, note) = write_report_noting(tmp.path()).unwrap();
    let note = note.expect("files are missing");
    assert!(
        note.starts_with("Missing: config.json (")
            && note.contains("; events.jsonl (no events are marked or listed)")
            && note.contains("; plan.json (")
            && !note.contains("metrics.jsonl"),
        "{note}"
    );
    let html = std::fs::read_to_string(path).unwrap();
    assert!(
        html.contains(&format!("<p class=\"warn\">{}</p>", html_esc(&note))),
        "{html}"
    );
    // The metrics alone still give the loss, the throughput and the timeline (from counts).
    assert_eq!(lines_of(chart(&html, "loss"), TRAIN), vec![10]);
    assert!(chart(&html, "timeline").contains("no plan recorded"));
}

fn html_esc(s: &str) -> String {
    crate::report::svg::esc(s)
}

#[test]
fn joins_are_marked_apart_from_failures() {
    let tmp = tempfile::tempdir().unwrap();
    two_generation_run(tmp.path());
    write_lines(
        &tmp.path().join("events.jsonl"),
        &[
            json!({"event": "start", "step": 0}),
            // The nodes the job starts with join before the first plan: not marked.
            json!({"event": "join", "node": 0, "addr": "a"}),
            json!({"event": "plan", "generation": 0, "pipelines": []}),
            json!({"event": "checkpoint", "step": 5, "path": "c", "duration_s": 0.1}),
            // A node joining the running job: no step of its own, placed after step 5.
            json!({"event": "join", "node": 4, "addr": "b"}),
            json!({"event": "reconfig", "step": 6, "generation": 1, "joined_nodes": [4],
                   "lost_nodes": []}),
            json!({"event": "reconfig", "step": 8, "generation": 2, "joined_nodes": [],
                   "lost_nodes": [3]}),
        ],
    );
    let html = render(&read_run(tmp.path()).unwrap());
    for name in ["loss", "throughput"] {
        let svg = chart(&html, name);
        assert_eq!(lines_of(svg, JOIN), vec![2, 2], "{name}: {svg}");
        assert_eq!(texts_of(svg, JOIN), vec!["join", "reconfig"], "{name}");
        assert_eq!(
            texts_of(svg, EVENT),
            vec!["reconfig"],
            "{name}: the one with a loss"
        );
        assert!(svg.contains(">\nnode joined\n</text>"), "the key");
    }
    // The join sits at step 5, in time where step 5 was committed (7.5 s).
    let loss = chart(&html, "loss");
    let join_x: Vec<&str> = tags(loss, "polyline", &super::stroke(JOIN))
        .iter()
        .map(|t| {
            t.split("points=\"")
                .nth(1)
                .unwrap()
                .split(',')
                .next()
                .unwrap()
        })
        .collect();
    let ckpt_x = tags(loss, "polyline", &super::stroke(CHECKPOINT))[0]
        .split("points=\"")
        .nth(1)
        .unwrap()
        .split(',')
        .next()
        .unwrap();
    assert_eq!(join_x[0], ckpt_x, "the late join at the checkpoint's step");
}
