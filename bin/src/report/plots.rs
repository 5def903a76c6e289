//! The report's three plots: loss per step, throughput over wall time, and the plan timeline,
//! with the run's events as vertical markers. Functions of a [`Run`], no I/O.

use std::fmt::Write;

use super::page::pipeline_text;
use super::svg::{esc, Axis, Frame};
use super::{PlanInfo, Run};

const WIDTH: f64 = 900.0;
const HEIGHT: f64 = 300.0;

/// An event drawn on the plots, where the run's files place it.
pub(super) struct Marker {
    kind: String,
    step: Option<f64>,
    time: Option<f64>,
    /// Not a routine event: drawn bold and labelled with its kind. Checkpoints are drawn
    /// lightly; other routine events not at all.
    prominent: bool,
    title: String,
}

/// Wall time since the run began, per metrics line. A resumed run's clock restarts at 0, so
/// each restart continues from where the previous stretch ended (the pause is not known).
fn run_times(run: &Run) -> Vec<f64> {
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
/// read off the metrics.
pub(super) fn markers(run: &Run) -> Vec<Marker> {
    let by_step = step_times(run);
    let by_time: Vec<(f64, f64)> = by_step.iter().map(|&(s, t)| (t, s)).collect();
    let mut out = Vec::new();
    for e in &run.events {
        let prominent = !e.routine();
        if !prominent && e.kind != "checkpoint" {
            continue;
        }
        let step = e.step.or_else(|| interpolate(&by_time, e.wall_s?));
        let time = e.wall_s.or_else(|| interpolate(&by_step, e.step?));
        let mut title = e.kind.clone();
        if let Some(s) = e.step {
            let _ = write!(title, " at step {s}");
        }
        if let Some(t) = e.wall_s {
            let _ = write!(title, " at {t:.2} s");
        }
        for (k, v) in &e.details {
            let _ = write!(title, "; {k}={v}");
        }
        out.push(Marker {
            kind: e.kind.clone(),
            step,
            time,
            prominent,
            title,
        });
    }
    out
}

fn draw_markers(
    s: &mut String,
    f: &Frame,
    markers: &[Marker],
    at: impl Fn(&Marker) -> Option<f64>,
) {
    // Events at one spot (a failure and the reconfiguration it caused) share a label.
    let mut labels: Vec<(f64, String)> = Vec::new();
    for m in markers {
        let Some(x) = at(m) else { continue };
        if !m.prominent {
            s.push_str(&f.marker("ckpt", x, &m.title));
            continue;
        }
        s.push_str(&f.marker("ev", x, &m.title));
        match labels
            .iter_mut()
            .find(|(lx, _)| (f.px(*lx) - f.px(x)).abs() < 1.0)
        {
            Some((_, text)) if !text.split(" + ").any(|k| k == m.kind) => {
                text.push_str(" + ");
                text.push_str(&m.kind);
            }
            Some(_) => {}
            None => labels.push((x, m.kind.clone())),
        }
    }
    s.push_str(&f.marker_labels("ev", &labels));
}

/// The x axis of the per-step plots: from the step before the first committed one to the
/// last step anything happened at.
fn step_axis(run: &Run, markers: &[Marker]) -> Axis {
    let first = run.metrics.iter().map(|m| m.step).min().unwrap_or(1);
    let last = run
        .metrics
        .iter()
        .map(|m| m.step as f64)
        .chain(markers.iter().filter_map(|m| m.step))
        .fold(first as f64, f64::max);
    Axis::integer(first.saturating_sub(1) as f64, last, 8)
}

fn legend(items: &[(&str, &str)]) -> String {
    let mut s = String::from("<p class=\"note\">");
    for (color, text) in items {
        let _ = write!(
            s,
            "<span style=\"color:{color}\">&#9632;</span> {} &#160; ",
            esc(text)
        );
    }
    s.push_str("</p>");
    s
}

const MARKER_LEGEND: [(&str, &str); 2] = [
    ("#aaa", "checkpoint"),
    ("#d00", "other event (failure, leave, reconfiguration, ...)"),
];

/// Training loss per step as a line, validation losses as dots.
pub(super) fn loss(run: &Run, markers: &[Marker]) -> String {
    let train: Vec<(f64, f64)> = run
        .metrics
        .iter()
        .filter_map(|m| Some((m.step as f64, m.loss.filter(|l| l.is_finite())?)))
        .collect();
    let val: Vec<(f64, f64)> = run
        .metrics
        .iter()
        .filter_map(|m| Some((m.step as f64, m.val_loss.filter(|l| l.is_finite())?)))
        .collect();
    let ys = || train.iter().chain(&val).map(|p| p.1);
    let f = Frame {
        width: WIDTH,
        height: HEIGHT,
        x: step_axis(run, markers),
        y: Axis::covering(
            ys().fold(f64::INFINITY, f64::min),
            ys().fold(f64::NEG_INFINITY, f64::max),
            6,
        ),
    };
    let mut s = f.open("loss", "Loss per step", "step", Some("loss"));
    draw_markers(&mut s, &f, markers, |m| m.step);
    s.push_str(&f.path("train", &train));
    for &(step, v) in &val {
        s.push_str(&f.dot(
            "val",
            step,
            v,
            &format!("step {step}: validation loss {v:.4}"),
        ));
    }
    s.push_str("</svg>");
    let mut items = vec![("#1f77b4", "training loss"), ("#ff7f0e", "validation loss")];
    items.extend(MARKER_LEGEND);
    s + &legend(&items)
}

/// Tokens per second of each step against the run's wall time.
pub(super) fn throughput(run: &Run, markers: &[Marker]) -> String {
    let times = run_times(run);
    let points: Vec<(f64, f64)> = run
        .metrics
        .iter()
        .zip(&times)
        .filter_map(|(m, &t)| Some((t, m.tokens_per_s.filter(|v| v.is_finite())?)))
        .collect();
    let t_max = times
        .iter()
        .copied()
        .chain(markers.iter().filter_map(|m| m.time))
        .fold(0.0, f64::max);
    let y_max = points.iter().map(|p| p.1).fold(0.0, f64::max);
    let f = Frame {
        width: WIDTH,
        height: HEIGHT,
        x: Axis::covering(0.0, t_max, 8),
        y: Axis::covering(0.0, y_max, 6),
    };
    let mut s = f.open(
        "throughput",
        "Throughput over wall time",
        "wall time (s)",
        Some("tokens/s"),
    );
    draw_markers(&mut s, &f, markers, |m| m.time);
    s.push_str(&f.path("tput", &points));
    s.push_str("</svg>");
    let mut items = vec![("#2ca02c", "tokens/s of each step")];
    items.extend(MARKER_LEGEND);
    s + &legend(&items)
}

const FILLS: [&str; 6] = [
    "#c6dbef", "#c7e9c0", "#fdd0a2", "#dadaeb", "#fcbba1", "#e0e0e0",
];

/// Height in pixels of the band's title row.
const BAND_TITLE: f64 = 18.0;

/// One band per generation across the steps it committed, split into its pipelines, each as
/// tall as its share of the nodes.
pub(super) fn timeline(run: &Run, markers: &[Marker]) -> String {
    let f = Frame {
        width: WIDTH,
        height: 240.0,
        x: step_axis(run, markers),
        y: Axis::covering(0.0, 1.0, 1),
    };
    let mut s = f.open("timeline", "Plan timeline", "step", None);
    let (top, bottom) = (f.py(1.0), f.py(0.0));
    // A generation that committed nothing still shows, thinly, where the previous one ended.
    let mut prev_end = f.x.lo;
    for p in run.plans.values() {
        let steps = run.metrics.iter().filter(|m| m.generation == p.generation);
        let (lo, hi) = steps.fold((None::<u64>, None::<u64>), |(lo, hi), m| {
            (
                Some(lo.map_or(m.step, |l| l.min(m.step))),
                Some(hi.map_or(m.step, |h| h.max(m.step))),
            )
        });
        let (x0, x1) = match (lo, hi) {
            (Some(lo), Some(hi)) => (f.px(lo.saturating_sub(1) as f64), f.px(hi as f64)),
            _ => (f.px(prev_end), f.px(prev_end)),
        };
        let width = (x1 - x0).max(3.0);
        prev_end = hi.map_or(prev_end, |h| h as f64);
        band(&mut s, p, x0, width, top, bottom);
    }
    draw_markers(&mut s, &f, markers, |m| m.step.filter(|_| m.prominent));
    s.push_str("</svg>");
    s
}

fn band(s: &mut String, p: &PlanInfo, x: f64, width: f64, top: f64, bottom: f64) {
    // Text that does not fit is left to the hover title (about 6.5 px per character).
    let fits = |text: &str, h: f64| h >= 13.0 && width >= text.chars().count() as f64 * 6.5 + 6.0;
    let title = format!("generation {}", p.generation);
    let _ = write!(
        s,
        r##"<rect class="band" x="{x:.1}" y="{top:.1}" width="{width:.1}" height="{BAND_TITLE:.1}" fill="#f3f3f3"><title>{}</title></rect>"##,
        esc(&title)
    );
    let label = format!("gen {}", p.generation);
    if fits(&label, BAND_TITLE) {
        let _ = write!(
            s,
            r#"<text class="band" x="{:.1}" y="{:.1}">{}</text>"#,
            x + 4.0,
            top + 13.0,
            esc(&label)
        );
    }
    let rows: Vec<(String, f64)> = match p.counts {
        Some((n, nodes)) => vec![(
            format!("{n} pipeline(s) on {nodes} node(s); no plan recorded"),
            1.0,
        )],
        None => p
            .pipelines
            .iter()
            .map(|q| (pipeline_text(q), q.nodes.len().max(1) as f64))
            .collect(),
    };
    let total: f64 = rows.iter().map(|r| r.1).sum();
    let mut y = top + BAND_TITLE;
    let height = bottom - y;
    for (i, (text, share)) in rows.iter().enumerate() {
        let h = height * share / total;
        let _ = write!(
            s,
            r#"<rect class="pipe" x="{x:.1}" y="{y:.1}" width="{width:.1}" height="{h:.1}" fill="{}"><title>{}</title></rect>"#,
            FILLS[i % FILLS.len()],
            esc(&format!("{title}, {text}"))
        );
        if fits(text, h) {
            let _ = write!(
                s,
                r#"<text x="{:.1}" y="{:.1}">{}</text>"#,
                x + 4.0,
                y + h / 2.0 + 4.0,
                esc(text)
            );
        }
        y += h;
    }
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
