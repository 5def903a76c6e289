//! The report page around the plots: the header, the plans and events tables, the style.

use std::fmt::Write;

use super::charts::{bars_height, recovery_bars, stage_bars, why_empty, CHARTS};
use super::svg::esc;
use super::{PipelineInfo, Run};

/// Width of the page's charts, pixels.
const CHART_WIDTH: u32 = 960;

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1000px}\
h1{font-size:22px}h2{font-size:17px;margin-top:28px}\
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}\
th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}td.details{word-break:break-all}\
tr.unusual td{background:#fde8e8}p.note{color:#555}p.warn{color:#b00;font-weight:bold}\
figure{margin:8px 0}svg{display:block;max-width:100%;height:auto}";

/// The whole page.
pub(super) fn render(run: &Run) -> String {
    let model = run
        .config
        .get("model")
        .and_then(|v| v.as_str())
        .unwrap_or("unknown model");
    let mut s = String::new();
    let _ = write!(
        s,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Run report: {}</title><style>{STYLE}</style></head><body>\n<h1>Run report: {}</h1>\n",
        esc(model),
        esc(model)
    );
    s.push_str(&header(run, model));
    if let Some(note) = run.missing_note() {
        let _ = writeln!(s, "<p class=\"warn\">{}</p>", esc(&note));
    }
    if run.metrics.is_empty() {
        s.push_str("<p class=\"warn\">No step was committed: there is no loss or throughput to plot.</p>\n");
    }
    for (name, heading, draw, height) in CHARTS {
        let _ = writeln!(s, "<h2>{}</h2>", esc(heading));
        if let Some(why) = why_empty(name, run) {
            let _ = writeln!(s, "<p class=\"note\">{}</p>", esc(why));
            continue;
        }
        let height = match name {
            "stages" => bars_height(stage_bars(run).1.len()),
            "recovery" => bars_height(recovery_bars(run).1.len()),
            _ => height,
        };
        let _ = writeln!(
            s,
            "<figure class=\"{name}\">{}</figure>",
            draw(run, CHART_WIDTH, height)
        );
    }
    s.push_str(&plans_table(run));
    s.push_str(&events_table(run));
    s.push_str("</body></html>\n");
    s
}

fn fmt_opt(v: Option<f64>, decimals: usize) -> String {
    match v {
        Some(v) if v.is_finite() => format!("{v:.decimals$}"),
        Some(_) => "not finite".into(),
        None => "-".into(),
    }
}

fn header(run: &Run, model: &str) -> String {
    let cfg = |k: &str| run.config.get(k).and_then(|v| v.as_f64());
    let last = run.metrics.last();
    let last_val = run.metrics.iter().rev().find_map(|m| m.val_loss);
    let finish = run.events.iter().rev().find(|e| e.kind == "finish");
    let wall = finish
        .and_then(|e| e.wall_s)
        .or(last.map(|m| m.wall_s))
        .filter(|w| *w > 0.0);
    let committed = last.map_or(0, |m| m.step);
    // Tokens over the whole run (every committed step is one global batch).
    let mean_tput = match (cfg("global_batch_size"), cfg("seq_len"), wall) {
        (Some(b), Some(t), Some(w)) if !run.metrics.is_empty() => {
            Some(b * t * run.metrics.len() as f64 / w)
        }
        _ => None,
    };
    let status = if let Some(a) = run.events.iter().rev().find(|e| e.kind == "abort") {
        let reason = a.details.get("reason").and_then(|r| r.as_str());
        format!("failed: {}", reason.unwrap_or("see the events"))
    } else if finish.is_some() {
        "finished".into()
    } else {
        "ended without a finish event (failed or still running)".into()
    };
    let nodes = cfg("nodes")
        .or(last.and_then(|m| m.nodes.map(|n| n as f64)))
        .map(|n| format!("{n}"));
    let steps = match cfg("steps") {
        Some(total) => format!("{committed} of {total}"),
        None => committed.to_string(),
    };
    let rows = [
        ("run directory", run.dir.clone()),
        ("model", model.to_string()),
        ("status", status),
        ("nodes", nodes.unwrap_or_else(|| "-".into())),
        ("steps committed", steps),
        ("final loss", fmt_opt(last.and_then(|m| m.loss), 4)),
        ("final validation loss", fmt_opt(last_val, 4)),
        ("wall time (s)", fmt_opt(wall, 1)),
        (
            "tokens/s (last step)",
            fmt_opt(last.and_then(|m| m.tokens_per_s), 0),
        ),
        ("tokens/s (whole run)", fmt_opt(mean_tput, 0)),
    ];
    let mut s = String::from("<table class=\"summary\">");
    for (k, v) in rows {
        let _ = write!(s, "<tr><th>{}</th><td>{}</td></tr>", esc(k), esc(&v));
    }
    s.push_str("</table>\n");
    s
}

fn plans_table(run: &Run) -> String {
    if run.plans.is_empty() {
        return "<p class=\"note\">No plan was recorded.</p>\n".into();
    }
    let mut s = String::from(
        "<h2>Plans</h2>\n<table class=\"plans\"><tr><th>generation</th><th>steps</th><th>pipelines (nodes · microbatches)</th><th>predicted iteration (ms)</th></tr>",
    );
    for p in run.plans.values() {
        let steps: Vec<u64> = run
            .metrics
            .iter()
            .filter(|m| m.generation == p.generation)
            .map(|m| m.step)
            .collect();
        let span = match (steps.iter().min(), steps.iter().max()) {
            (Some(a), Some(b)) => format!("{a}-{b}"),
            _ => "none committed".into(),
        };
        let pipes = match p.counts {
            Some((n, nodes)) => format!("{n} pipeline(s) on {nodes} node(s); no plan recorded"),
            None => p
                .pipelines
                .iter()
                .map(PipelineInfo::text)
                .collect::<Vec<_>>()
                .join("; "),
        };
        let _ = write!(
            s,
            "<tr><td class=\"num\">{}</td><td>{}</td><td>{}</td><td class=\"num\">{}</td></tr>",
            p.generation,
            esc(&span),
            esc(&pipes),
            esc(&fmt_opt(p.iteration_ns.map(|n| n / 1e6), 1))
        );
    }
    s.push_str("</table>\n");
    s
}

fn events_table(run: &Run) -> String {
    if run.events.is_empty() {
        return "<h2>Events</h2>\n<p class=\"note\">No event was recorded.</p>\n".into();
    }
    let mut s = String::from(
        "<h2>Events</h2>\n<table class=\"events\"><tr><th>#</th><th>event</th><th>step</th><th>wall (s)</th><th>details</th></tr>",
    );
    for (i, e) in run.events.iter().enumerate() {
        let details: Vec<String> = e
            .details
            .iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => format!("{k}={s}"),
                v => format!("{k}={v}"),
            })
            .collect();
        let _ = write!(
            s,
            "<tr{}><td class=\"num\">{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"details\">{}</td></tr>",
            if e.routine() { "" } else { " class=\"unusual\"" },
            i + 1,
            esc(&e.kind),
            esc(&e.step.map(|v| v.to_string()).unwrap_or_default()),
            esc(&e.wall_s.map(|v| format!("{v:.2}")).unwrap_or_default()),
            esc(&details.join("  "))
        );
    }
    s.push_str("</table>\n");
    s
}
