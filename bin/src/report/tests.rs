//! The report from run directories written here: what each chart draws (counted in the SVG
//! plotters writes), the tables, escaping, and bad or partial input.

mod charts;

use std::path::Path;

use serde_json::json;

use super::*;
use crate::report::charts::timeline::{BAND, FILLS};
use crate::report::charts::{CHECKPOINT, EVENT, TPUT, TRAIN, VALIDATION};

pub(super) fn write_lines(path: &Path, lines: &[serde_json::Value]) {
    let text: String = lines.iter().map(|v| format!("{v}\n")).collect();
    std::fs::write(path, text).unwrap();
}

pub(super) fn metric(
    step: u64,
    generation: u64,
    pipelines: u64,
    val: Option<f64>,
) -> serde_json::Value {
    let mut m = json!({
        "step": step, "loss": 11.0 - step as f64 * 0.3, "lr": 1e-3, "grad_norm": 1.0,
        "samples_per_s": 10.0, "tokens_per_s": 600.0 + step as f64, "generation": generation,
        "pipelines": pipelines, "nodes": 4, "wall_s": step as f64 * 1.5,
    });
    if let Some(v) = val {
        m["val_loss"] = json!(v);
    }
    m
}

/// A plan of one-device nodes, pipelines in rank order.
pub(super) fn plan(generation: u64, nodes: &[&[u64]]) -> serde_json::Value {
    let mut first_rank = 0;
    let pipelines: Vec<_> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let p = json!({"id": i, "nodes": n, "first_rank": first_rank, "microbatches": 2});
            first_rank += n.len();
            p
        })
        .collect();
    json!({"generation": generation, "devices_per_node": 1, "templates": [],
           "pipelines": pipelines, "iteration_ns": 120_000_000})
}

/// Ten steps over two generations: 4 one-node pipelines, then a failure at step 5 and a
/// reconfiguration into 3 pipelines; checkpoints at 5 and 10, validation at 5 and 10.
pub(super) fn two_generation_run(dir: &Path) {
    std::fs::write(
        dir.join("config.json"),
        json!({"model": "gpt-mini", "nodes": 4, "steps": 10, "global_batch_size": 16,
               "seq_len": 64})
        .to_string(),
    )
    .unwrap();
    let metrics: Vec<_> = (1..=10)
        .map(|s| {
            let val = (s % 5 == 0).then_some(9.0 - s as f64 * 0.05);
            if s <= 5 {
                metric(s, 0, 4, val)
            } else {
                metric(s, 1, 3, val)
            }
        })
        .collect();
    write_lines(&dir.join("metrics.jsonl"), &metrics);
    write_lines(
        &dir.join("events.jsonl"),
        &[
            json!({"event": "start", "step": 0, "model": "gpt-mini"}),
            json!({"event": "plan", "generation": 0, "pipelines": []}),
            json!({"event": "checkpoint", "step": 5, "path": "c/step-000005", "duration_s": 0.3}),
            json!({"event": "failure", "node": 3, "step": 5, "wall_s": 8.0}),
            json!({"event": "reconfig", "step": 5, "generation": 1,
                   "phases": {"plan_s": 0.01, "copy_s": 0.4}}),
            json!({"event": "mystery"}),
            json!({"event": "checkpoint", "step": 10, "path": "c/step-000010", "duration_s": 0.3}),
            json!({"event": "finish", "step": 10, "wall_s": 15.5}),
        ],
    );
    std::fs::write(
        dir.join("plan.json"),
        json!([
            plan(0, &[&[0], &[1], &[2], &[3]]),
            plan(1, &[&[0], &[1], &[2]])
        ])
        .to_string(),
    )
    .unwrap();
}

/// The chart whose root is `<svg class="{name}"`, through its `</svg>`.
pub(super) fn chart<'a>(html: &'a str, name: &str) -> &'a str {
    let open = format!("<svg class=\"{name}\"");
    let i = html
        .find(&open)
        .unwrap_or_else(|| panic!("no {name} chart in {html}"));
    let end = html[i..].find("</svg>").expect("a closed svg") + i + "</svg>".len();
    &html[i..end]
}

/// The opening tags `<{tag} ...>` of `svg` that contain `needle`.
pub(super) fn tags<'a>(svg: &'a str, tag: &str, needle: &str) -> Vec<&'a str> {
    let open = format!("<{tag} ");
    svg.match_indices(&open)
        .map(|(i, _)| &svg[i..i + svg[i..].find('>').expect("a closed tag")])
        .filter(|t| t.contains(needle))
        .collect()
}

pub(super) fn stroke(c: plotters::style::RGBColor) -> String {
    format!("stroke=\"#{:02X}{:02X}{:02X}\"", c.0, c.1, c.2)
}

pub(super) fn fill(c: plotters::style::RGBColor) -> String {
    format!("fill=\"#{:02X}{:02X}{:02X}\"", c.0, c.1, c.2)
}

/// The point count of each `<polyline>` drawn in `color`, longest first.
pub(super) fn lines_of(svg: &str, color: plotters::style::RGBColor) -> Vec<usize> {
    let mut counts: Vec<usize> = tags(svg, "polyline", &stroke(color))
        .iter()
        .map(|t| {
            let points = t.split("points=\"").nth(1).expect("points");
            points[..points.find('"').unwrap()]
                .split_whitespace()
                .count()
        })
        .collect();
    counts.sort_unstable_by(|a, b| b.cmp(a));
    counts
}

/// The text of each `<text>` element drawn in `color`.
pub(super) fn texts_of(svg: &str, color: plotters::style::RGBColor) -> Vec<String> {
    let needle = fill(color);
    svg.match_indices("<text ")
        .filter_map(|(i, _)| {
            let rest = &svg[i..];
            let close = rest.find('>')?;
            if !rest[..close].contains(&needle) {
                return None;
            }
            let end = rest.find("</text>")?;
            Some(rest[close + 1..end].trim().to_string())
        })
        .collect()
}

#[test]
fn draws_each_plot_with_a_point_per_step_and_a_marker_per_event() {
    let tmp = tempfile::tempdir().unwrap();
    two_generation_run(tmp.path());
    let path = write_report(tmp.path()).unwrap();
    assert_eq!(path, tmp.path().join(REPORT_FILE));
    let html = std::fs::read_to_string(&path).unwrap();
    assert_eq!(
        html.matches("<svg").count(),
        3,
        "loss, throughput, timeline"
    );
    let (loss, tput, timeline) = (
        chart(&html, "loss"),
        chart(&html, "throughput"),
        chart(&html, "timeline"),
    );
    // Ten points in one line; two validation dots.
    assert_eq!(lines_of(loss, TRAIN), vec![10]);
    assert_eq!(tags(loss, "circle", &fill(VALIDATION)).len(), 2);
    assert_eq!(lines_of(tput, TPUT), vec![10]);
    // Two checkpoints drawn lightly; the failure and the reconfiguration prominently and
    // labelled; "mystery" has neither a step nor a time, so it is only in the table.
    for svg in [loss, tput] {
        assert_eq!(lines_of(svg, CHECKPOINT), vec![2, 2], "{svg}");
        assert_eq!(lines_of(svg, EVENT), vec![2, 2], "{svg}");
    }
    // Both at step 5 share a label; in time, the failure (8 s) is after the step (7.5 s).
    assert_eq!(texts_of(loss, EVENT), vec!["failure + reconfig"], "{loss}");
    assert_eq!(texts_of(tput, EVENT), vec!["reconfig", "failure"], "{tput}");
    // One band per generation, one stripe per pipeline, the unusual events on top.
    assert_eq!(tags(timeline, "rect", &fill(BAND)).len(), 2);
    let pipes: usize = FILLS
        .iter()
        .map(|c| tags(timeline, "rect", &fill(*c)).len())
        .sum();
    assert_eq!(pipes, 7);
    assert!(
        timeline.contains(">\np2: node 2 · 2 mb\n</text>"),
        "{timeline}"
    );
    assert_eq!(lines_of(timeline, EVENT), vec![2, 2]);
    assert!(lines_of(timeline, CHECKPOINT).is_empty());
    // Charts without data are left out with a sentence.
    assert!(html.contains("record no per-rank times") && html.contains("No recovery"));
    // Every event is a table row; the unusual ones are highlighted.
    assert_eq!(html.matches("<tr class=\"unusual\">").count(), 3);
    assert!(html.contains("<td>mystery</td>"));
    assert!(html.contains("<td>finished</td>"), "status");
    assert!(html.contains("<td>8.0000</td>"), "final loss 11 - 10 * 0.3");
    assert!(
        html.contains("<td>8.5000</td>"),
        "final validation loss 9 - 10 * 0.05"
    );
    // Self-contained: nothing to run, nothing to fetch.
    assert!(!html.contains("<script") && !html.contains("src=") && !html.contains("href="));
}

#[test]
fn each_chart_is_a_standalone_svg() {
    let tmp = tempfile::tempdir().unwrap();
    two_generation_run(tmp.path());
    let run = read_run(tmp.path()).unwrap();
    for (name, draw) in [
        ("loss", loss_chart as fn(&Run, u32, u32) -> String),
        ("throughput", throughput_chart),
        ("timeline", timeline_chart),
        ("stages", stage_chart),
        ("recovery", recovery_chart),
        ("step_time", step_time_chart),
    ] {
        let svg = draw(&run, 640, 300);
        let open = format!("<svg class=\"{name}\" width=\"640\" height=\"300\"");
        assert!(svg.starts_with(&open), "{svg}");
        assert!(svg.contains("xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.trim_end().ends_with("</svg>") && !svg.contains("<?xml"));
    }
    // Without data the picture says why rather than drawing empty axes.
    assert!(stage_chart(&run, 640, 300).contains("no per-rank times"));
}

#[test]
fn hostile_text_is_escaped() {
    let tmp = tempfile::tempdir().unwrap();
    two_generation_run(tmp.path());
    std::fs::write(
        tmp.path().join("config.json"),
        json!({"model": "<script>alert('x')</script>&"}).to_string(),
    )
    .unwrap();
    let mut events = std::fs::read_to_string(tmp.path().join("events.jsonl")).unwrap();
    events.push_str(
        &json!({"event": "<img src=x onerror=alert(1)>", "step": 3, "why": "\"a\" < b"})
            .to_string(),
    );
    std::fs::write(tmp.path().join("events.jsonl"), events).unwrap();
    let html = render(&read_run(tmp.path()).unwrap());
    assert!(
        !html.contains("<script>") && !html.contains("<img"),
        "{html}"
    );
    assert!(html.contains("&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;&amp;"));
    // The marker's label, as plotters writes it.
    let loss = chart(&html, "loss");
    assert!(
        texts_of(loss, EVENT).contains(&"&lt;img src=x onerror=alert(1)&gt;".to_string()),
        "{loss}"
    );
    assert!(html.contains("why=&quot;a&quot; &lt; b"), "table details");
}

#[test]
fn a_broken_metrics_line_is_named_by_file_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    two_generation_run(tmp.path());
    let path = tmp.path().join("metrics.jsonl");
    let good = metric(1, 0, 4, None).to_string();
    std::fs::write(&path, format!("{good}\n\n{{\"step\": 3, \"loss\":\n")).unwrap();
    let e = format!("{:#}", write_report(tmp.path()).unwrap_err());
    assert!(e.contains("metrics.jsonl line 3"), "{e}");
    std::fs::write(&path, format!("{good}\n{{\"step\": 2}}\n")).unwrap();
    let e = format!("{:#}", write_report(tmp.path()).unwrap_err());
    assert!(
        e.contains("line 2") && e.contains("missing field `loss`"),
        "{e}"
    );
    assert!(!tmp.path().join(REPORT_FILE).exists());
}

#[test]
fn a_null_loss_is_left_out_of_the_plot_not_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    two_generation_run(tmp.path());
    let mut m: Vec<_> = (1..=3).map(|s| metric(s, 0, 4, None)).collect();
    m[2]["loss"] = serde_json::Value::Null;
    write_lines(&tmp.path().join("metrics.jsonl"), &m);
    let html = render(&read_run(tmp.path()).unwrap());
    assert_eq!(lines_of(chart(&html, "loss"), TRAIN), vec![2]);
    assert!(html.contains("<td>-</td>"), "no final loss");
}

#[test]
fn an_empty_run_says_no_step_was_committed() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(
        tmp.path().join("config.json"),
        json!({"model": "gpt-tiny"}).to_string(),
    )
    .unwrap();
    write_lines(
        &tmp.path().join("events.jsonl"),
        &[json!({"event": "start", "step": 0})],
    );
    let html = std::fs::read_to_string(write_report(tmp.path()).unwrap()).unwrap();
    assert!(html.contains("No step was committed"), "{html}");
    assert!(!html.contains("<svg"));
    assert!(html.contains("ended without a finish event"));
    assert!(html.contains("<td>start</td>"));
}

#[test]
fn without_plan_json_the_plan_events_or_the_metrics_stand_in() {
    let tmp = tempfile::tempdir().unwrap();
    two_generation_run(tmp.path());
    std::fs::remove_file(tmp.path().join("plan.json")).unwrap();
    write_lines(
        &tmp.path().join("events.jsonl"),
        &[json!({"event": "plan", "generation": 0,
                 "pipelines": [{"id": 0, "nodes": [0, 1], "microbatches": 1},
                               {"id": 1, "nodes": [2, 3], "microbatches": 1}]})],
    );
    let html = render(&read_run(tmp.path()).unwrap());
    let timeline = chart(&html, "timeline");
    // Generation 0 from its plan event, generation 1 from the metrics' counts.
    let pipes: usize = FILLS
        .iter()
        .map(|c| tags(timeline, "rect", &fill(*c)).len())
        .sum();
    assert_eq!(pipes, 3);
    assert!(
        timeline.contains(">\np1: nodes 2,3 · 1 mb\n</text>"),
        "{timeline}"
    );
    assert!(timeline.contains("3 pipeline(s) on 4 node(s); no plan recorded"));
}

#[test]
fn a_single_plan_object_from_older_runs_is_read() {
    let tmp = tempfile::tempdir().unwrap();
    two_generation_run(tmp.path());
    std::fs::write(
        tmp.path().join("plan.json"),
        plan(0, &[&[0, 1, 2, 3]]).to_string(),
    )
    .unwrap();
    let run = read_run(tmp.path()).unwrap();
    assert_eq!(run.plans[&0].pipelines[0].nodes, vec![0, 1, 2, 3]);
    std::fs::write(tmp.path().join("plan.json"), "[{").unwrap();
    let e = format!("{:#}", read_run(tmp.path()).unwrap_err());
    assert!(e.contains("plan.json"), "{e}");
}

#[test]
fn a_directory_without_run_files_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let e = write_report(tmp.path()).unwrap_err().to_string();
    assert!(
        e.contains("not a run directory") && e.contains("--out"),
        "{e}"
    );
    let e = write_report(&tmp.path().join("nope"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a run directory"), "{e}");
}

#[test]
fn a_report_that_cannot_be_written_leaves_the_runs_result_alone() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("metrics.jsonl"), "not json\n").unwrap();
    let summary = Summary {
        out: tmp.path().to_path_buf(),
        model: "gpt-tiny".into(),
        params: 1,
        steps: 1,
        first_loss: None,
        final_loss: None,
        first_val_loss: None,
        final_val_loss: None,
        tokens_per_s: 1.0,
        wall_s: 1.0,
        checkpoint: None,
        report: None,
    };
    let s = finish_run(tmp.path(), Ok(summary.clone())).expect("still a success");
    assert_eq!(s.report, None);
    let e = finish_run(tmp.path(), Err(anyhow::anyhow!("worker lost"))).unwrap_err();
    assert_eq!(e.to_string(), "worker lost");
    // A failed run whose files are readable gets its report.
    std::fs::remove_file(tmp.path().join("metrics.jsonl")).unwrap();
    write_lines(
        &tmp.path().join("events.jsonl"),
        &[json!({"event": "abort", "reason": "worker lost"})],
    );
    assert!(finish_run(tmp.path(), Err(anyhow::anyhow!("worker lost"))).is_err());
    let html = std::fs::read_to_string(tmp.path().join(REPORT_FILE)).unwrap();
    assert!(html.contains("failed: worker lost"), "{html}");
    let s = finish_run(tmp.path(), Ok(summary)).unwrap();
    assert_eq!(s.report, Some(tmp.path().join(REPORT_FILE)));
}
