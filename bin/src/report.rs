//! `report.html`: a run directory drawn as one self-contained page (DESIGN.md section 6): a
//! header, the loss per step, the throughput over wall time (both with the run's events
//! marked: checkpoints lightly, failures and other unusual events prominently), the plan
//! timeline (one band per generation, split into its pipelines) and a table of the events.
//! The plots are inline SVG drawn here; the page loads no script and nothing from the network.
//!
//! ```text
//!  config.json ─┐
//!  metrics.jsonl├─ read_run (I/O, validation) ─► Run ─► render (pure) ─► report.html
//!  events.jsonl │
//!  plan.json ───┘  (optional: the `plan` events, then the metrics, stand in for it)
//! ```

mod page;
mod plots;
mod svg;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Deserializer};

use crate::trainer::Summary;
use page::render;

/// The report's file name inside the run directory.
pub const REPORT_FILE: &str = "report.html";

/// Event kinds every run logs. Any other kind (a failure, a leave, a reconfiguration, a
/// resume, an abort) is what a reader looks for, so it is marked on the plots.
const ROUTINE: [&str; 8] = [
    "start",
    "process",
    "join",
    "plan",
    "rendezvous",
    "checkpoint",
    "control_plane",
    "finish",
];

/// One line of `metrics.jsonl`, the fields the report uses. Losses and rates may be `null`
/// (serde_json writes a NaN as `null`, and a diverged run is worth a report) but not absent.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct Metric {
    step: u64,
    #[serde(deserialize_with = "nullable")]
    loss: Option<f64>,
    #[serde(default)]
    val_loss: Option<f64>,
    #[serde(deserialize_with = "nullable")]
    tokens_per_s: Option<f64>,
    generation: u64,
    #[serde(default)]
    pipelines: Option<u64>,
    #[serde(default)]
    nodes: Option<u64>,
    wall_s: f64,
}

fn nullable<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<f64>, D::Error> {
    Option::<f64>::deserialize(d)
}

/// One line of `events.jsonl`.
#[derive(Clone, Debug)]
pub(crate) struct Event {
    kind: String,
    step: Option<f64>,
    wall_s: Option<f64>,
    /// The other fields, as the table shows them.
    details: serde_json::Map<String, serde_json::Value>,
}

impl Event {
    fn routine(&self) -> bool {
        ROUTINE.contains(&self.kind.as_str())
    }
}

/// One pipeline of a plan.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct PipelineInfo {
    id: u64,
    nodes: Vec<u64>,
    #[serde(default)]
    microbatches: Option<u64>,
}

/// One generation's plan, from `plan.json`, a `plan` event, or (without either) the counts in
/// the metrics.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct PlanInfo {
    generation: u64,
    pipelines: Vec<PipelineInfo>,
    /// The planner's predicted time of one iteration.
    #[serde(default)]
    iteration_ns: Option<f64>,
    /// Only the counts are known (no plan was written): `(pipelines, nodes)`.
    #[serde(skip)]
    counts: Option<(u64, u64)>,
}

/// Everything the report draws, read and validated from a run directory.
#[derive(Clone, Debug, Default)]
pub(crate) struct Run {
    dir: String,
    config: serde_json::Map<String, serde_json::Value>,
    metrics: Vec<Metric>,
    events: Vec<Event>,
    /// By generation.
    plans: BTreeMap<u64, PlanInfo>,
}

/// Reads `run_dir` and writes `run_dir/report.html`; returns its path.
pub fn write_report(run_dir: &Path) -> Result<PathBuf> {
    let run = read_run(run_dir)?;
    let html = render(&run);
    let path = run_dir.join(REPORT_FILE);
    // Written aside and renamed: a reader never sees half a page.
    let tmp = run_dir.join(format!("{REPORT_FILE}.tmp"));
    std::fs::write(&tmp, html).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(path)
}

/// The end of a run, however it went: writes the report if the run directory exists and
/// records its path in the summary. Failing to write it is a warning; the run's own result
/// stands. A failed run's report path is printed here since no summary carries it.
pub fn finish_run(run_dir: &Path, result: Result<Summary>) -> Result<Summary> {
    if !run_dir.is_dir() {
        return result;
    }
    let report = match write_report(run_dir) {
        Ok(p) => Some(p),
        Err(e) => {
            let error = format!("{e:#}");
            tracing::warn!(run_dir = %run_dir.display(), %error, "could not write the run report");
            None
        }
    };
    match result {
        Ok(mut summary) => {
            summary.report = report;
            Ok(summary)
        }
        Err(e) => {
            if let Some(p) = report {
                eprintln!("report: {}", p.display());
            }
            Err(e)
        }
    }
}

/// Reads and validates a run directory. Only a directory holding at least one of the run's
/// files counts; a missing metrics or events file is an empty one (a run that stopped early).
pub(crate) fn read_run(dir: &Path) -> Result<Run> {
    const FILES: [&str; 3] = ["config.json", "metrics.jsonl", "events.jsonl"];
    if !dir.is_dir() || !FILES.iter().any(|f| dir.join(f).is_file()) {
        bail!(
            "{} is not a run directory: it holds none of {} (pass the --out directory of a \
             `train` run)",
            dir.display(),
            FILES.join(", ")
        );
    }
    let config = match read_optional(&dir.join("config.json"))? {
        None => serde_json::Map::new(),
        Some(text) => serde_json::from_str(&text)
            .with_context(|| format!("{}: not a JSON object", dir.join("config.json").display()))?,
    };
    let metrics_path = dir.join("metrics.jsonl");
    let metrics_text = read_optional(&metrics_path)?.unwrap_or_default();
    let mut metrics = Vec::new();
    for (line, text) in numbered_lines(&metrics_text) {
        let m: Metric = serde_json::from_str(text).with_context(|| {
            format!(
                "{} line {line}: not a metrics record (a JSON object with step, loss, \
                 tokens_per_s, generation, wall_s); fix or delete that line and run `oobleck \
                 report` again",
                metrics_path.display()
            )
        })?;
        metrics.push(m);
    }
    let events_path = dir.join("events.jsonl");
    let events_text = read_optional(&events_path)?.unwrap_or_default();
    let mut events = Vec::new();
    for (line, text) in numbered_lines(&events_text) {
        let bad = || format!("{} line {line}: not an event", events_path.display());
        let mut details: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(text).with_context(bad)?;
        let kind = match details.remove("event") {
            Some(serde_json::Value::String(k)) => k,
            _ => bail!("{}: it has no \"event\" kind", bad()),
        };
        let number = |v: Option<serde_json::Value>| v.as_ref().and_then(serde_json::Value::as_f64);
        events.push(Event {
            kind,
            step: number(details.remove("step")),
            wall_s: number(details.remove("wall_s")),
            details,
        });
    }
    let mut plans = BTreeMap::new();
    let plan_path = dir.join("plan.json");
    if let Some(text) = read_optional(&plan_path)? {
        let bad = || format!("{}: not a plan or a list of plans", plan_path.display());
        let v: serde_json::Value = serde_json::from_str(&text).with_context(bad)?;
        // Runs before plan.json became a list hold one plan object.
        let list = match v {
            serde_json::Value::Array(a) => a,
            one => vec![one],
        };
        for p in list {
            let p: PlanInfo = serde_json::from_value(p).with_context(bad)?;
            plans.insert(p.generation, p);
        }
    }
    for e in events.iter().filter(|e| e.kind == "plan") {
        let mut v = e.details.clone();
        v.entry("generation").or_insert(0.into());
        if let Ok(p) = serde_json::from_value::<PlanInfo>(v.into()) {
            plans.entry(p.generation).or_insert(p);
        }
    }
    for m in &metrics {
        plans.entry(m.generation).or_insert_with(|| PlanInfo {
            generation: m.generation,
            pipelines: Vec::new(),
            iteration_ns: None,
            counts: Some((m.pipelines.unwrap_or(1), m.nodes.unwrap_or(1))),
        });
    }
    Ok(Run {
        dir: dir.display().to_string(),
        config,
        metrics,
        events,
        plans,
    })
}

fn read_optional(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// The non-blank lines of a JSONL text with their 1-based line numbers.
fn numbered_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| (i + 1, l))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn write_lines(path: &Path, lines: &[serde_json::Value]) {
        let text: String = lines.iter().map(|v| format!("{v}\n")).collect();
        std::fs::write(path, text).unwrap();
    }

    fn metric(step: u64, generation: u64, pipelines: u64, val: Option<f64>) -> serde_json::Value {
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

    fn plan(generation: u64, nodes: &[&[u64]]) -> serde_json::Value {
        let pipelines: Vec<_> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| json!({"id": i, "nodes": n, "first_rank": 0, "microbatches": 2}))
            .collect();
        json!({"generation": generation, "templates": [], "pipelines": pipelines,
               "iteration_ns": 120_000_000})
    }

    /// Ten steps over two generations: 4 one-node pipelines, then a failure at step 5 and a
    /// reconfiguration into 3 pipelines; checkpoints at 5 and 10, validation at 5 and 10.
    fn two_generation_run(dir: &Path) {
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

    /// The `<svg ...>...</svg>` elements of a page, in order.
    fn svgs(html: &str) -> Vec<&str> {
        html.match_indices("<svg")
            .map(|(i, _)| {
                let end = html[i..].find("</svg>").expect("a closed svg") + i + "</svg>".len();
                &html[i..end]
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
        let svgs = svgs(&html);
        assert_eq!(svgs.len(), 3, "loss, throughput, timeline");
        let [loss, tput, timeline] = [svgs[0], svgs[1], svgs[2]];
        assert!(loss.contains(r#"class="loss""#) && tput.contains(r#"class="throughput""#));
        // Ten points: a move and nine segments; two validation dots.
        assert_eq!(loss.matches(" L").count(), 9);
        assert_eq!(loss.matches("<circle").count(), 2);
        assert_eq!(tput.matches(" L").count(), 9);
        // Two checkpoints drawn lightly; the failure and the reconfiguration prominently and
        // labelled; "mystery" has neither a step nor a time, so it is only in the table.
        for svg in [loss, tput] {
            assert_eq!(svg.matches(r#"<line class="ckpt""#).count(), 2);
            assert_eq!(svg.matches(r#"<line class="ev""#).count(), 2);
        }
        // Both at step 5 share a label; in time, the failure (8 s) is after the step (7.5 s).
        assert_eq!(loss.matches(r#"<text class="ev""#).count(), 1);
        assert!(loss.contains(">failure + reconfig</text>"), "{loss}");
        assert!(tput.contains(">failure</text>") && tput.contains(">reconfig</text>"));
        // One band per generation, one stripe per pipeline, the unusual events on top.
        assert_eq!(timeline.matches(r#"<rect class="band""#).count(), 2);
        assert_eq!(timeline.matches(r#"<rect class="pipe""#).count(), 7);
        assert!(timeline.contains("p2: node 2 · 2 mb"), "{timeline}");
        assert_eq!(timeline.matches(r#"<line class="ev""#).count(), 2);
        // Every event is a table row; the unusual ones are highlighted.
        assert_eq!(html.matches("<tr class=\"unusual\">").count(), 3);
        assert!(html.contains("<td>mystery</td>"));
        assert!(html.contains("<td>finished</td>"), "status");
        assert!(html.contains("<td>8.0000</td>"), "final loss 11 - 10 * 0.3");
        assert!(
            html.contains("<td>8.5000</td>"),
            "final validation loss 9 - 10 * 0.05"
        );
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
        assert!(
            html.contains(">&lt;img src=x onerror=alert(1)&gt;</text>"),
            "marker label"
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
        assert_eq!(svgs(&html)[0].matches(" L").count(), 1);
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
        let timeline = svgs(&html)[2];
        // Generation 0 from its plan event, generation 1 from the metrics' counts.
        assert_eq!(timeline.matches(r#"<rect class="pipe""#).count(), 3);
        assert!(timeline.contains("p1: nodes 2,3 · 1 mb"), "{timeline}");
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
}
