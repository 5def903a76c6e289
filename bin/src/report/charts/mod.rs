//! The report's charts, drawn with plotters to SVG: functions of a [`Run`] and a size, no
//! I/O. Each returns one standalone `<svg>` element (with its `xmlns`, no XML prolog) whose
//! root carries `class="<name>"`, so a page can inline it and tests can find it. A chart with
//! nothing to draw says why in its picture; [`why_empty`] gives the same sentence so the
//! report can leave the chart out instead.

pub(super) mod bars;
mod lines;
pub(super) mod timeline;

use std::fmt::Write;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::Run;
use crate::plotting::{register_font, FONT};

pub(super) use bars::{bars_height, recovery_bars, stage_bars};
pub(crate) use bars::{recovery_chart, stage_chart};
pub(crate) use lines::{loss_chart, step_time_chart, throughput_chart};
pub(crate) use timeline::timeline_chart;

/// The report's charts in page order: hook (the svg's class), heading, drawing.
pub(super) type Draw = fn(&Run, u32, u32) -> String;
pub(super) const CHARTS: [(&str, &str, Draw, u32); 5] = [
    ("loss", "Loss", loss_chart, 320),
    ("throughput", "Throughput", throughput_chart, 320),
    ("timeline", "Plan timeline", timeline_chart, 260),
    ("stages", "Where each stage's step went", stage_chart, 0),
    ("recovery", "Recoveries", recovery_chart, 0),
];

pub(super) const TRAIN: RGBColor = RGBColor(31, 119, 180);
pub(super) const VALIDATION: RGBColor = RGBColor(255, 127, 14);
pub(super) const TPUT: RGBColor = RGBColor(44, 160, 44);
pub(super) const CHECKPOINT: RGBColor = RGBColor(170, 170, 170);
pub(super) const EVENT: RGBColor = RGBColor(204, 0, 0);
pub(super) const JOIN: RGBColor = RGBColor(106, 61, 154);
pub(super) const GRID: RGBColor = RGBColor(235, 235, 235);

/// Why `name`'s chart has nothing to draw for `run`, or `None` when it has.
pub(super) fn why_empty(name: &str, run: &Run) -> Option<&'static str> {
    match name {
        "loss" | "throughput" | "timeline" if run.metrics.is_empty() => {
            Some("No step was committed yet, so there is nothing to plot here.")
        }
        "stages" | "step_time" if !run.metrics.iter().any(|m| !m.times.is_empty()) => Some(
            "The metrics record no per-rank times (runs before they were recorded, or no \
             step committed).",
        ),
        "recovery" if !run.events.iter().any(|e| e.kind == "resumed") => {
            Some("No recovery: no generation resumed after a failure.")
        }
        _ => None,
    }
}

/// Draws into an SVG string of `width` x `height` with a white background and the root
/// tagged `class="{class}"`. A drawing error (only a font that cannot be read) or an empty
/// chart becomes a picture holding its sentence.
pub(super) fn svg<F>(class: &str, width: u32, height: u32, run: &Run, draw: F) -> String
where
    F: FnOnce(&DrawingArea<SVGBackend, Shift>) -> anyhow::Result<()>,
{
    let (width, height) = (width.max(120), height.max(60));
    let mut out = String::new();
    let result = register_font().and_then(|()| {
        let root = SVGBackend::with_string(&mut out, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        match why_empty(class, run) {
            Some(why) => note(&root, why)?,
            None => draw(&root)?,
        }
        root.present().map_err(plot_err)
    });
    if let Err(e) = result {
        out.clear();
        let _ = write!(
            out,
            r#"<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg"><text x="8" y="20" font-family="sans-serif">{}</text></svg>"#,
            super::svg::esc(&format!("{class} chart: {e:#}"))
        );
    }
    // Plotters opens with `<svg width=...`: the class goes first, where tests look.
    out.replacen("<svg ", &format!("<svg class=\"{class}\" "), 1)
}

pub(super) fn plot_err<E: std::error::Error + Send + Sync>(
    e: DrawingAreaErrorKind<E>,
) -> anyhow::Error {
    anyhow::anyhow!("drawing a chart: {e}")
}

/// One line of grey text in the middle of `area`.
pub(super) fn note(area: &DrawingArea<SVGBackend, Shift>, text: &str) -> anyhow::Result<()> {
    let (w, h) = area.dim_in_pixel();
    let style = TextStyle::from((FONT, 15).into_font())
        .color(&RGBColor(90, 90, 90))
        .pos(plotters::style::text_anchor::Pos::new(
            plotters::style::text_anchor::HPos::Center,
            plotters::style::text_anchor::VPos::Center,
        ));
    area.draw_text(text, &style, (w as i32 / 2, h as i32 / 2))
        .map_err(plot_err)
}

/// A tick value with no more decimals than it needs ("5", "10.5", "1500").
pub(super) fn tick(v: f64) -> String {
    let s = format!("{v:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".into()
    } else {
        s.into()
    }
}

/// How a key shows its colour.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Swatch {
    Square,
    Dot,
}

/// A row of coloured keys at pixel row `y` (their centre), from the left edge.
pub(super) fn key_row(
    root: &DrawingArea<SVGBackend, Shift>,
    keys: &[(&str, RGBColor)],
    y: i32,
    swatch: Swatch,
) -> anyhow::Result<()> {
    use plotters::style::text_anchor::{HPos, Pos, VPos};
    let style = TextStyle::from((FONT, 14).into_font())
        .color(&RGBColor(40, 40, 40))
        .pos(Pos::new(HPos::Left, VPos::Center));
    let mut x = 16;
    for (label, color) in keys {
        match swatch {
            Swatch::Square => root.draw(&Rectangle::new(
                [(x, y - 5), (x + 10, y + 5)],
                color.filled(),
            )),
            Swatch::Dot => root.draw(&Circle::new((x + 5, y), 5, color.filled())),
        }
        .map_err(plot_err)?;
        root.draw_text(label, &style, (x + 15, y))
            .map_err(plot_err)?;
        x += 15 + label.chars().count() as i32 * 7 + 22;
    }
    Ok(())
}

/// What a vertical marker of an event looks like.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// Drawn lightly, unlabelled.
    Checkpoint,
    /// A node joined (a late `join`, or a reconfiguration taking joins): its own colour.
    Join,
    /// Anything unusual (a failure, a leave, a reconfiguration, a resume): bold, labelled.
    Unusual,
}

impl Kind {
    pub(super) fn color(self) -> RGBColor {
        match self {
            Kind::Checkpoint => CHECKPOINT,
            Kind::Join => JOIN,
            Kind::Unusual => EVENT,
        }
    }
}

/// An event drawn on the plots, where the run's files place it.
pub(super) struct Marker {
    pub label: String,
    pub step: Option<f64>,
    pub time: Option<f64>,
    pub kind: Kind,
}

/// Wall time since the run began, per metrics line. A resumed run's clock restarts at 0, so
/// each restart continues from where the previous stretch ended (the pause is not known).
pub(super) fn run_times(run: &Run) -> Vec<f64> {
    let mut offset = 0.0;
    let mut prev: Option<f64> = None;
    let mut out = Vec::with_capacity(run.metrics.len());
    for m in &run.metrics {
        if let Some(p) = prev {
            if m.wall_s < p {
                offset += p;
            }
        }
        out.push(m.wall_s + offset);
        prev = Some(m.wall_s);
    }
    out
}

/// `(step, time)` per metrics line, starting from the step before the first committed one
/// at time 0.
fn step_times(run: &Run) -> Vec<(f64, f64)> {
    let times = run_times(run);
    let mut pairs: Vec<(f64, f64)> = Vec::with_capacity(times.len() + 1);
    if let Some(first) = run.metrics.first() {
        pairs.push((first.step.saturating_sub(1) as f64, 0.0));
    }
    pairs.extend(
        run.metrics
            .iter()
            .zip(times)
            .map(|(m, t)| (m.step as f64, t)),
    );
    pairs
}

/// Linear interpolation of `y` at `x` over points sorted by `x`, clamped at both ends.
fn interpolate(points: &[(f64, f64)], x: f64) -> Option<f64> {
    let (first, last) = (points.first()?, points.last()?);
    if x <= first.0 {
        return Some(first.1);
    }
    if x >= last.0 {
        return Some(last.1);
    }
    let i = points.partition_point(|p| p.0 <= x);
    let (a, b) = (points[i - 1], points[i]);
    if b.0 == a.0 {
        return Some(b.1);
    }
    Some(a.1 + (b.1 - a.1) * (x - a.0) / (b.0 - a.0))
}

/// The events worth drawing, each placed by its own `step` / `wall_s`, the other coordinate
/// read off the metrics. A `join` carries neither: one logged after the first plan (a node
/// joining a running job) is placed at the step of the last event before it that has one.
pub(super) fn markers(run: &Run) -> Vec<Marker> {
    let by_step = step_times(run);
    let by_time: Vec<(f64, f64)> = by_step.iter().map(|&(s, t)| (t, s)).collect();
    let mut out = Vec::new();
    let (mut planned, mut last_step) = (false, None::<f64>);
    for e in &run.events {
        let joined = e
            .details
            .get("joined_nodes")
            .and_then(|v| v.as_array())
            .is_some_and(|a| !a.is_empty());
        let late_join = e.kind == "join" && planned;
        let kind = match () {
            _ if late_join || (e.kind == "reconfig" && joined) => Kind::Join,
            _ if e.kind == "checkpoint" => Kind::Checkpoint,
            _ if !e.routine() => Kind::Unusual,
            _ => {
                planned |= e.kind == "plan";
                last_step = e.step.or(last_step);
                continue;
            }
        };
        let own_step = if late_join { last_step } else { e.step };
        let step = own_step.or_else(|| interpolate(&by_time, e.wall_s?));
        let time = e.wall_s.or_else(|| interpolate(&by_step, own_step?));
        last_step = e.step.or(last_step);
        out.push(Marker {
            label: e.kind.clone(),
            step,
            time,
            kind,
        });
    }
    out
}

/// The labels of the labelled markers at pixel columns `px` (a failure and the
/// reconfiguration it caused share one: "failure + reconfig"), as `(px, text, kind)`.
pub(super) fn merged_labels(placed: &[(i32, &Marker)]) -> Vec<(i32, String, Kind)> {
    let mut labels: Vec<(i32, String, Kind)> = Vec::new();
    for &(px, m) in placed {
        if m.kind == Kind::Checkpoint {
            continue;
        }
        match labels.iter_mut().find(|(lx, _, _)| (*lx - px).abs() < 1) {
            Some((_, text, _)) if !text.split(" + ").any(|k| k == m.label) => {
                text.push_str(" + ");
                text.push_str(&m.label);
            }
            Some(_) => {}
            None => labels.push((px, m.label.clone(), m.kind)),
        }
    }
    labels.sort_by_key(|l| l.0);
    labels
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Metric;

    fn metric(step: u64, wall_s: f64) -> Metric {
        serde_json::from_value(serde_json::json!({
            "step": step, "loss": 1.0, "tokens_per_s": 1.0, "generation": 0, "wall_s": wall_s,
        }))
        .unwrap()
    }

    #[test]
    fn a_resumed_runs_clock_continues_where_it_stopped() {
        let run = Run {
            metrics: vec![
                metric(1, 1.0),
                metric(2, 2.0),
                metric(3, 0.5),
                metric(4, 1.5),
            ],
            ..Run::default()
        };
        assert_eq!(run_times(&run), vec![1.0, 2.0, 2.5, 3.5]);
        // Step 0 starts at time 0; events between steps land in between.
        let pairs = step_times(&run);
        assert_eq!(pairs[0], (0.0, 0.0));
        assert_eq!(interpolate(&pairs, 2.5), Some(2.25));
        assert_eq!(interpolate(&pairs, 9.0), Some(3.5));
    }
}
