//! `report.html`: a run directory drawn as one self-contained page (DESIGN.md section 6): a
//! header, the loss per step, the throughput over wall time (both with the run's events
//! marked: checkpoints lightly, failures and other unusual events prominently, joins apart),
//! the plan timeline (one band per generation, split into its pipelines), where each stage's
//! step went, the recoveries' phases, and a table of the events. The charts are drawn with
//! plotters as inline SVG; the page loads no script and nothing from the network. The same
//! chart functions (`fn(&Run, width, height) -> String`, one `<svg>`) serve the live status
//! page.
//!
//! ```text
//!  config.json ─┐
//!  metrics.jsonl├─ read_run (I/O, validation) ─► Run ─► charts::* (pure) ─► page::render
//!  events.jsonl │                                                          ─► report.html
//!  plan.json ───┘  (optional: the `plan` events, then the metrics, stand in for it)
//! ```

pub(crate) mod charts;
mod page;
mod svg;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use crate::run_dir::Summary;
#[allow(unused_imports)] // The status page draws these too.
pub(crate) use charts::{
    loss_chart, recovery_chart, stage_chart, step_time_chart, throughput_chart, timeline_chart,
};
use oobleck_core::runtime::wire::records::StepMetrics;
use oobleck_core::runtime::wire::EventLine;
use page::render;

/// The report's file name inside the run directory.
pub const REPORT_FILE: &str = "report.html";

/// The files of a run directory, and what the report lacks without each.
const FILES: [(&str, &str); 4] = [
    ("config.json", "the header shows no configuration"),
    (
        "metrics.jsonl",
        "no loss, throughput, stage time or plan timeline",
    ),
    ("events.jsonl", "no events are marked or listed"),
    (
        "plan.json",
        "the timeline falls back on the plan events or the metrics' counts, and stages are not named",
    ),
];

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

/// Where one rank's time of a step went, ms, as `metrics.jsonl` records it. Forward and
/// backward are 0 in runs from before they were recorded.
pub(crate) type RankTimes = oobleck_core::execution::StepTimes;

/// One line of `metrics.jsonl` as the report shows it, read through the runtime's own
/// [`StepMetrics`]. Losses and rates may be `null` (serde_json writes a NaN as `null`, and a
/// diverged run is worth a report) but not absent; here a NaN is `None`.
#[derive(Clone, Debug, Deserialize)]
#[serde(from = "StepMetrics")]
pub(crate) struct Metric {
    step: u64,
    loss: Option<f64>,
    val_loss: Option<f64>,
    tokens_per_s: Option<f64>,
    generation: u64,
    /// `None` in runs from before they were recorded.
    pipelines: Option<u64>,
    nodes: Option<u64>,
    wall_s: f64,
    /// Rank -> its times; empty in runs from before they were recorded.
    times: BTreeMap<u32, RankTimes>,
}

impl From<StepMetrics> for Metric {
    fn from(m: StepMetrics) -> Metric {
        let number = |x: f64| Some(x).filter(|x| !x.is_nan());
        let count = |n: usize| Some(n as u64).filter(|n| *n > 0);
        Metric {
            step: m.step,
            loss: number(m.loss),
            val_loss: m.val_loss,
            tokens_per_s: number(m.tokens_per_s),
            generation: m.generation,
            pipelines: count(m.pipelines),
            nodes: count(m.nodes),
            wall_s: m.wall_s,
            times: m.times,
        }
    }
}

#[allow(dead_code)] // Accessors for the status page.
impl Metric {
    pub(crate) fn step(&self) -> u64 {
        self.step
    }
    pub(crate) fn loss(&self) -> Option<f64> {
        self.loss
    }
    pub(crate) fn val_loss(&self) -> Option<f64> {
        self.val_loss
    }
    pub(crate) fn tokens_per_s(&self) -> Option<f64> {
        self.tokens_per_s
    }
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }
    pub(crate) fn wall_s(&self) -> f64 {
        self.wall_s
    }
    pub(crate) fn times(&self) -> &BTreeMap<u32, RankTimes> {
        &self.times
    }
    /// The step's time: its slowest rank's `step_ms`.
    pub(crate) fn step_ms(&self) -> Option<f64> {
        self.times.values().map(|t| t.step_ms).reduce(f64::max)
    }
}

/// One line of `events.jsonl` as the report shows it: its kind, step and time, and the other
/// fields (read through `EventLine`, the runtime's own reader).
#[derive(Clone, Debug)]
pub(crate) struct EventRow {
    kind: String,
    step: Option<f64>,
    wall_s: Option<f64>,
    /// The other fields, as the table shows them.
    details: serde_json::Map<String, serde_json::Value>,
}

#[allow(dead_code)] // Accessors for the status page.
impl EventRow {
    fn routine(&self) -> bool {
        ROUTINE.contains(&self.kind.as_str())
    }
    pub(crate) fn kind(&self) -> &str {
        &self.kind
    }
    pub(crate) fn step(&self) -> Option<f64> {
        self.step
    }
    pub(crate) fn wall_s(&self) -> Option<f64> {
        self.wall_s
    }
    pub(crate) fn details(&self) -> &serde_json::Map<String, serde_json::Value> {
        &self.details
    }
}

/// One pipeline of a plan.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct PipelineInfo {
    id: u64,
    nodes: Vec<u64>,
    /// Its first global rank; node `j` of it holds ranks from `first_rank + j * G`.
    #[serde(default)]
    first_rank: Option<u64>,
    #[serde(default)]
    microbatches: Option<u64>,
}

impl PipelineInfo {
    /// A pipeline as the table and the timeline name it: `p1: nodes 2,3 · 2 mb`.
    pub(crate) fn text(&self) -> String {
        let nodes: Vec<String> = self.nodes.iter().map(u64::to_string).collect();
        let mb = self
            .microbatches
            .map(|m| format!(" · {m} mb"))
            .unwrap_or_default();
        format!(
            "p{}: node{} {}{mb}",
            self.id,
            if self.nodes.len() == 1 { "" } else { "s" },
            nodes.join(",")
        )
    }
}

/// One generation's plan, from `plan.json`, a `plan` event, or (without either) the counts in
/// the metrics.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct PlanInfo {
    generation: u64,
    pipelines: Vec<PipelineInfo>,
    /// `G`; absent from `plan` events (1 then).
    #[serde(default)]
    devices_per_node: Option<u64>,
    /// The planner's predicted time of one iteration.
    #[serde(default)]
    iteration_ns: Option<f64>,
    /// Only the counts are known (no plan was written): `(pipelines, nodes)`.
    #[serde(skip)]
    counts: Option<(u64, u64)>,
}

impl PlanInfo {
    /// Pipeline id, stage (its node's index in the pipeline) and node of global `rank`.
    fn place_of(&self, rank: u64) -> Option<(u64, usize, u64)> {
        let g = self.devices_per_node.unwrap_or(1).max(1);
        self.pipelines.iter().find_map(|p| {
            let first = p.first_rank?;
            let stage = usize::try_from(rank.checked_sub(first)? / g).ok()?;
            Some((p.id, stage, *p.nodes.get(stage)?))
        })
    }
}

/// Everything the report draws, read and validated from a run directory.
#[derive(Clone, Debug, Default)]
pub(crate) struct Run {
    dir: String,
    config: serde_json::Map<String, serde_json::Value>,
    metrics: Vec<Metric>,
    events: Vec<EventRow>,
    /// By generation.
    plans: BTreeMap<u64, PlanInfo>,
    /// The run's files that are not there.
    missing: Vec<&'static str>,
}

#[allow(dead_code)] // Accessors for the status page.
impl Run {
    pub(crate) fn dir(&self) -> &str {
        &self.dir
    }
    pub(crate) fn config(&self) -> &serde_json::Map<String, serde_json::Value> {
        &self.config
    }
    pub(crate) fn metrics(&self) -> &[Metric] {
        &self.metrics
    }
    pub(crate) fn events(&self) -> &[EventRow] {
        &self.events
    }
    pub(crate) fn missing(&self) -> &[&'static str] {
        &self.missing
    }

    /// One line naming the missing files and what that leaves out; `None` when all are there.
    pub(crate) fn missing_note(&self) -> Option<String> {
        if self.missing.is_empty() {
            return None;
        }
        let parts: Vec<String> = FILES
            .iter()
            .filter(|(f, _)| self.missing.contains(f))
            .map(|(f, what)| format!("{f} ({what})"))
            .collect();
        Some(format!("Missing: {}.", parts.join("; ")))
    }
}

/// Reads `run_dir` and writes `run_dir/report.html`; returns its path.
pub fn write_report(run_dir: &Path) -> Result<PathBuf> {
    write_report_noting(run_dir).map(|(path, _)| path)
}

/// [`write_report`], also returning the line saying which of the run's files were missing
/// and what the report lacks for it (`None` when none were).
pub fn write_report_noting(run_dir: &Path) -> Result<(PathBuf, Option<String>)> {
    let run = read_run(run_dir)?;
    let html = render(&run);
    let path = run_dir.join(REPORT_FILE);
    // Written aside and renamed: a reader never sees half a page.
    let tmp = run_dir.join(format!("{REPORT_FILE}.tmp"));
    std::fs::write(&tmp, html).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok((path, run.missing_note()))
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
/// files counts; a missing file is an empty one (a run that stopped early), noted in
/// [`Run::missing`]. Cheap enough to call every few seconds on a running job: it reads the
/// four files once and keeps nothing between calls.
pub(crate) fn read_run(dir: &Path) -> Result<Run> {
    let names: Vec<&str> = FILES.iter().map(|f| f.0).collect();
    if !dir.is_dir() || !names[..3].iter().any(|f| dir.join(f).is_file()) {
        bail!(
            "{} is not a run directory: it holds none of {} (pass the --out directory of a \
             `train` run)",
            dir.display(),
            names[..3].join(", ")
        );
    }
    let missing = names
        .iter()
        .copied()
        .filter(|f| !dir.join(f).is_file())
        .collect();
    let config = match read_optional(&dir.join("config.json"))? {
        None => serde_json::Map::new(),
        Some(text) => serde_json::from_str(&text)
            .with_context(|| format!("{}: not a JSON object", dir.join("config.json").display()))?,
    };
    let metrics = read_metrics(&dir.join("metrics.jsonl"))?;
    let events = read_events(&dir.join("events.jsonl"))?;
    let plans = read_plans(&dir.join("plan.json"), &events, &metrics)?;
    Ok(Run {
        dir: dir.display().to_string(),
        config,
        metrics,
        events,
        plans,
        missing,
    })
}

fn read_metrics(path: &Path) -> Result<Vec<Metric>> {
    let text = read_optional(path)?.unwrap_or_default();
    let mut metrics = Vec::new();
    for (line, text) in numbered_lines(&text) {
        let m: Metric = serde_json::from_str(text).with_context(|| {
            format!(
                "{} line {line}: not a metrics record (a JSON object with step, loss, \
                 tokens_per_s, generation, wall_s); fix or delete that line and run `oobleck \
                 report` again",
                path.display()
            )
        })?;
        metrics.push(m);
    }
    Ok(metrics)
}

fn read_events(path: &Path) -> Result<Vec<EventRow>> {
    let text = read_optional(path)?.unwrap_or_default();
    let mut events = Vec::new();
    for (line, text) in numbered_lines(&text) {
        let bad = || format!("{} line {line}: not an event", path.display());
        let read = EventLine::parse(text).with_context(bad)?;
        let kind = read.kind();
        let mut details = read.fields();
        let number = |v: Option<serde_json::Value>| v.as_ref().and_then(serde_json::Value::as_f64);
        events.push(EventRow {
            kind,
            step: number(details.remove("step")),
            wall_s: number(details.remove("wall_s")),
            details,
        });
    }
    Ok(events)
}

fn read_plans(
    path: &Path,
    events: &[EventRow],
    metrics: &[Metric],
) -> Result<BTreeMap<u64, PlanInfo>> {
    let mut plans = BTreeMap::new();
    if let Some(text) = read_optional(path)? {
        let bad = || format!("{}: not a plan or a list of plans", path.display());
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
    for m in metrics {
        plans.entry(m.generation).or_insert_with(|| PlanInfo {
            generation: m.generation,
            pipelines: Vec::new(),
            devices_per_node: None,
            iteration_ns: None,
            counts: Some((m.pipelines.unwrap_or(1), m.nodes.unwrap_or(1))),
        });
    }
    Ok(plans)
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
