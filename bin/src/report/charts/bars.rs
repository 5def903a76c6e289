//! The stacked horizontal bar charts: where each rank's step went in the last generation
//! (forward, backward, other compute, p2p wait, gradient sync, bubble), and the phases of
//! each recovery.

use std::collections::BTreeMap;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::lines::Chart;
use super::{key_row, plot_err, svg, tick, Swatch, GRID};
use crate::plotting::FONT;
use crate::report::{RankTimes, Run};

/// One bar: its label and its segments' lengths, in the chart's segment order.
pub(in crate::report) struct Bar {
    pub label: String,
    pub parts: Vec<f64>,
}

/// The stage chart's segments and colours.
pub(in crate::report) const STAGE_PARTS: [(&str, RGBColor); 6] = [
    ("forward", RGBColor(31, 119, 180)),
    ("backward", RGBColor(174, 199, 232)),
    ("other compute", RGBColor(150, 150, 150)),
    ("p2p wait", RGBColor(255, 127, 14)),
    ("gradient sync", RGBColor(148, 103, 189)),
    ("bubble", RGBColor(230, 230, 230)),
];

/// Recovery phases in the order they happen; any other is drawn after them. The `*_max_s`
/// entries are the slowest rank's part of `connect_copy_s`, not phases of their own.
const PHASE_ORDER: [&str; 7] = [
    "wait_boundary_s",
    "detect_s",
    "decide_s",
    "plan_s",
    "restart_s",
    "connect_copy_s",
    "first_step_s",
];
/// The tick of the time from the failure to the first commit after it.
pub(in crate::report) const SINCE_FAILURE: RGBColor = RGBColor(20, 20, 20);
const PHASE_COLORS: [RGBColor; 8] = [
    RGBColor(166, 206, 227),
    RGBColor(214, 39, 40),
    RGBColor(251, 154, 153),
    RGBColor(255, 127, 14),
    RGBColor(253, 191, 111),
    RGBColor(51, 160, 44),
    RGBColor(31, 120, 180),
    RGBColor(202, 178, 214),
];

/// A rank's segments: compute's forward, backward and the rest, then p2p, sync and the
/// bubble (what of the step none of those account for), each clipped at 0.
pub(in crate::report) fn stage_parts(t: &RankTimes) -> Vec<f64> {
    let other = t.compute_ms - t.forward_ms - t.backward_ms;
    let bubble = t.step_ms - t.compute_ms - t.p2p_ms - t.collective_ms;
    [
        t.forward_ms,
        t.backward_ms,
        other,
        t.p2p_ms,
        t.collective_ms,
        bubble,
    ]
    .map(|v| v.max(0.0))
    .to_vec()
}

/// One bar per rank of the last generation with times: the mean over its committed steps.
pub(in crate::report) fn stage_bars(run: &Run) -> (Option<u64>, Vec<Bar>) {
    let Some(generation) = run
        .metrics
        .iter()
        .filter(|m| !m.times.is_empty())
        .map(|m| m.generation)
        .max()
    else {
        return (None, Vec::new());
    };
    let mut sums: BTreeMap<u32, (Vec<f64>, usize)> = BTreeMap::new();
    for m in run.metrics.iter().filter(|m| m.generation == generation) {
        for (&rank, t) in &m.times {
            let (sum, n) = sums.entry(rank).or_insert((vec![0.0; 6], 0));
            for (s, v) in sum.iter_mut().zip(stage_parts(t)) {
                *s += v;
            }
            *n += 1;
        }
    }
    let plan = run.plans.get(&generation).filter(|p| p.counts.is_none());
    let bars = sums
        .into_iter()
        .map(|(rank, (sum, n))| {
            let label = match plan.and_then(|p| p.place_of(u64::from(rank))) {
                Some((pipe, stage, node)) => {
                    format!("rank {rank} · p{pipe} stage {stage} (node {node})")
                }
                None => format!("rank {rank}"),
            };
            Bar {
                label,
                parts: sum.iter().map(|s| s / n as f64).collect(),
            }
        })
        .collect();
    (Some(generation), bars)
}

/// One bar per `resumed` event: its phases in [`PHASE_ORDER`], and the phase names used.
pub(in crate::report) fn recovery_bars(run: &Run) -> (Vec<String>, Vec<Bar>, Vec<f64>) {
    let resumed: Vec<_> = run.events.iter().filter(|e| e.kind == "resumed").collect();
    let phases_of = |e: &&crate::report::EventRow| -> BTreeMap<String, f64> {
        let Some(serde_json::Value::Object(map)) = e.details.get("phases") else {
            return BTreeMap::new();
        };
        map.iter()
            .filter(|(k, _)| !k.ends_with("_max_s"))
            .filter_map(|(k, v)| Some((k.clone(), v.as_f64()?.max(0.0))))
            .collect()
    };
    let mut names: Vec<String> = Vec::new();
    for e in &resumed {
        for k in phases_of(e).into_keys() {
            if !names.contains(&k) {
                names.push(k);
            }
        }
    }
    let rank = |n: &String| {
        PHASE_ORDER
            .iter()
            .position(|p| p == n)
            .unwrap_or(usize::MAX)
    };
    names.sort_by(|a, b| rank(a).cmp(&rank(b)).then(a.cmp(b)));
    let mut totals = Vec::new();
    let bars = resumed
        .iter()
        .map(|e| {
            let phases = phases_of(e);
            let number = |k: &str| e.details.get(k).and_then(|v| v.as_f64());
            totals.push(number("since_failure_s").unwrap_or(f64::NAN));
            let generation = number("generation").map_or("?".into(), |g| g.to_string());
            let step = e.step.map_or("?".into(), |s| s.to_string());
            Bar {
                label: format!("gen {generation} · step {step}"),
                parts: names
                    .iter()
                    .map(|n| phases.get(n).copied().unwrap_or(0.0))
                    .collect(),
            }
        })
        .collect();
    (names, bars, totals)
}

/// A height that gives each bar a readable row.
pub(in crate::report) fn bars_height(bars: usize) -> u32 {
    110 + 30 * bars.max(1) as u32
}

/// Where each stage's step went: one stacked bar per rank of the last generation.
pub(crate) fn stage_chart(run: &Run, width: u32, height: u32) -> String {
    svg("stages", width, height, run, |root| {
        let (generation, bars) = stage_bars(run);
        let title = format!(
            "generation {}: mean ms per committed step",
            generation.unwrap_or(0)
        );
        draw_bars(root, &title, "ms", &STAGE_PARTS, &bars, &[])
    })
}

/// Each recovery's phases, one stacked bar each, with the time from the failure to the first
/// commit after it marked.
pub(crate) fn recovery_chart(run: &Run, width: u32, height: u32) -> String {
    svg("recovery", width, height, run, |root| {
        let (names, bars, totals) = recovery_bars(run);
        let keys: Vec<(&str, RGBColor)> = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), PHASE_COLORS[i % PHASE_COLORS.len()]))
            .collect();
        let title =
            "seconds from the failure to the first commit after it (black tick: since the failure)";
        draw_bars(root, title, "s", &keys, &bars, &totals)
    })
}

/// Stacked horizontal bars, top to bottom, labelled on the left, with a key row on top.
/// `marks`: per bar, a value to tick across the bar (NaN: none).
/// One bar between `lo` and `hi` on the y axis: its parts left to right in their keys'
/// colours, its mark as a tick, its label left of the axis.
fn draw_bar(
    chart: &mut Chart,
    root: &DrawingArea<SVGBackend, Shift>,
    (lo, hi): (f64, f64),
    bar: &Bar,
    keys: &[(&str, RGBColor)],
    mark: Option<f64>,
) -> anyhow::Result<()> {
    let mut x = 0.0;
    for (j, &v) in bar.parts.iter().enumerate() {
        if v > 0.0 {
            let color = keys.get(j).map_or(GRID, |k| k.1);
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(x, lo), (x + v, hi)],
                    color.filled(),
                )))
                .map_err(plot_err)?;
        }
        x += v;
    }
    if let Some(m) = mark.filter(|m| m.is_finite()) {
        let style = SINCE_FAILURE.stroke_width(2);
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(m, lo - 0.08), (m, hi + 0.08)],
                style,
            )))
            .map_err(plot_err)?;
    }
    let (px, py) = chart.backend_coord(&(0.0, (lo + hi) / 2.0));
    let style = TextStyle::from((FONT, 14).into_font())
        .color(&RGBColor(40, 40, 40))
        .pos(Pos::new(HPos::Right, VPos::Center));
    root.draw_text(&bar.label, &style, (px - 6, py))
        .map_err(plot_err)
}

/// Only the keys of parts some bar has (older runs have no forward or backward).
fn used_keys<'k>(keys: &[(&'k str, RGBColor)], bars: &[Bar]) -> Vec<(&'k str, RGBColor)> {
    keys.iter()
        .enumerate()
        .filter(|(j, _)| {
            bars.iter()
                .any(|b| b.parts.get(*j).is_some_and(|v| *v > 0.0))
        })
        .map(|(_, k)| *k)
        .collect()
}

fn draw_bars(
    root: &DrawingArea<SVGBackend, Shift>,
    title: &str,
    unit: &str,
    keys: &[(&str, RGBColor)],
    bars: &[Bar],
    marks: &[f64],
) -> anyhow::Result<()> {
    let n = bars.len().max(1) as f64;
    let longest = bars
        .iter()
        .map(|b| b.label.chars().count())
        .max()
        .unwrap_or(4);
    let x_max = bars
        .iter()
        .map(|b| b.parts.iter().sum::<f64>())
        .chain(marks.iter().copied().filter(|v| v.is_finite()))
        .fold(0.0, f64::max);
    let mut chart = ChartBuilder::on(root)
        .margin(10)
        .margin_top(52)
        .x_label_area_size(36)
        .y_label_area_size((longest as u32 * 8 + 16).clamp(60, 360))
        .build_cartesian_2d(0.0..(x_max * 1.05).max(1e-6), 0.0..n)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc(unit)
        .y_labels(0)
        .disable_y_mesh()
        .x_labels(8)
        .x_label_formatter(&|v| tick(*v))
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .bold_line_style(GRID)
        .light_line_style(TRANSPARENT)
        .draw()
        .map_err(plot_err)?;
    for (i, bar) in bars.iter().enumerate() {
        let row = (n - i as f64 - 0.85, n - i as f64 - 0.15);
        draw_bar(&mut chart, root, row, bar, keys, marks.get(i).copied())?;
    }
    let used = used_keys(keys, bars);
    let style = TextStyle::from((FONT, 14).into_font()).color(&RGBColor(40, 40, 40));
    root.draw_text(title, &style, (12, 6)).map_err(plot_err)?;
    // Dots, not squares, so the bars' rectangles stay countable.
    key_row(root, &used, 34, Swatch::Dot)
}
