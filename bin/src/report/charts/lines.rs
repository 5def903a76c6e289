//! The line charts: training loss per step (validation losses as dots), throughput over wall
//! time, and the step time per committed step; the first two with the run's events as
//! vertical markers.

use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::{
    key_row, markers, merged_labels, plot_err, run_times, svg, tick, Kind, Marker, Swatch,
    CHECKPOINT, EVENT, GRID, JOIN, TPUT, TRAIN, VALIDATION,
};
use crate::plotting::FONT;
use crate::report::Run;

pub(super) type Chart<'a, 'b> =
    ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Room above the plot for two rows of marker labels.
pub(super) const LABEL_ROWS_PX: u32 = 40;

/// `lo..hi` padded by 5% (a flat series still gets a visible range).
fn padded(lo: f64, hi: f64, from_zero: bool) -> std::ops::Range<f64> {
    let (lo, hi) = if lo.is_finite() && hi.is_finite() {
        (if from_zero { lo.min(0.0) } else { lo }, hi)
    } else {
        (0.0, 1.0)
    };
    let pad = if hi - lo > 1e-12 {
        (hi - lo) * 0.05
    } else {
        lo.abs().max(1.0) * 0.1
    };
    let lo = if from_zero && lo >= 0.0 {
        0.0
    } else {
        lo - pad
    };
    lo..hi + pad
}

/// The x range of the per-step charts: from the step before the first committed one to the
/// last step anything happened at.
pub(super) fn step_range(run: &Run, markers: &[Marker]) -> std::ops::Range<f64> {
    let first = run.metrics.iter().map(|m| m.step).min().unwrap_or(1);
    let last = run
        .metrics
        .iter()
        .map(|m| m.step as f64)
        .chain(markers.iter().filter_map(|m| m.step))
        .fold(first as f64, f64::max);
    let lo = first.saturating_sub(1) as f64;
    lo..last.max(lo + 1.0)
}

pub(super) fn build<'a, 'b>(
    root: &'a DrawingArea<SVGBackend<'b>, Shift>,
    x: std::ops::Range<f64>,
    y: std::ops::Range<f64>,
    (x_desc, y_desc): (&str, &str),
    top: u32,
) -> anyhow::Result<Chart<'a, 'b>> {
    let mut chart = ChartBuilder::on(root)
        .margin(10)
        .margin_top(top)
        .margin_bottom(28)
        .x_label_area_size(44)
        .y_label_area_size(72)
        .build_cartesian_2d(x, y)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_labels(10)
        .y_labels(if y_desc.is_empty() { 0 } else { 6 })
        .x_label_formatter(&|v| tick(*v))
        .y_label_formatter(&|v| tick(*v))
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 16))
        .bold_line_style(GRID)
        .light_line_style(TRANSPARENT)
        .draw()
        .map_err(plot_err)?;
    Ok(chart)
}

/// A vertical line per marker at `at(marker)`, and the labels of the labelled ones above the
/// plot (overlapping labels go one row up; two rows, then they may overlap).
pub(super) fn draw_markers(
    root: &DrawingArea<SVGBackend, Shift>,
    chart: &mut Chart,
    markers: &[Marker],
    at: impl Fn(&Marker) -> Option<f64>,
) -> anyhow::Result<()> {
    let (y_lo, y_hi) = (chart.y_range().start, chart.y_range().end);
    let mut placed = Vec::new();
    for m in markers {
        let Some(x) = at(m) else { continue };
        let width = if m.kind == Kind::Checkpoint { 1 } else { 2 };
        let style = m.kind.color().stroke_width(width);
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(x, y_lo), (x, y_hi)],
                style,
            )))
            .map_err(plot_err)?;
        placed.push((chart.backend_coord(&(x, y_hi)).0, m));
    }
    let top = chart.backend_coord(&(0.0, y_hi)).1;
    let (width, _) = root.dim_in_pixel();
    let mut row_end = [i32::MIN; 2];
    for (px, text, kind) in merged_labels(&placed) {
        // About 8 px per bold character.
        let w = text.chars().count() as i32 * 8;
        let (h, left) = if px + w / 2 > width as i32 {
            (HPos::Right, px - w)
        } else if px - w / 2 < 0 {
            (HPos::Left, px)
        } else {
            (HPos::Center, px - w / 2)
        };
        let row = row_end.iter().position(|&e| left > e + 4).unwrap_or(0);
        row_end[row] = left + w;
        let color = kind.color();
        let style = TextStyle::from((FONT, 15).into_font().style(FontStyle::Bold))
            .color(&color)
            .pos(Pos::new(h, VPos::Bottom));
        root.draw_text(&text, &style, (px, top - 4 - 16 * row as i32))
            .map_err(plot_err)?;
    }
    Ok(())
}

/// The keys in a row under the chart (a legend inside would hide data).
fn legend(root: &DrawingArea<SVGBackend, Shift>, keys: &[(&str, RGBColor)]) -> anyhow::Result<()> {
    let (_, h) = root.dim_in_pixel();
    key_row(root, keys, h as i32 - 14, Swatch::Square)
}

/// The markers' legend entries that `markers` use.
fn marker_keys(markers: &[Marker]) -> Vec<(&'static str, RGBColor)> {
    [
        (Kind::Checkpoint, "checkpoint", CHECKPOINT),
        (Kind::Unusual, "failure or other event", EVENT),
        (Kind::Join, "node joined", JOIN),
    ]
    .into_iter()
    .filter(|(k, _, _)| markers.iter().any(|m| m.kind == *k))
    .map(|(_, l, c)| (l, c))
    .collect()
}

fn finite(v: Option<f64>) -> Option<f64> {
    v.filter(|v| v.is_finite())
}

/// Training loss per step as a line, validation losses as dots, events as markers.
pub(crate) fn loss_chart(run: &Run, width: u32, height: u32) -> String {
    svg("loss", width, height, run, |root| {
        let markers = markers(run);
        let train: Vec<(f64, f64)> = run
            .metrics
            .iter()
            .filter_map(|m| Some((m.step as f64, finite(m.loss)?)))
            .collect();
        let val: Vec<(f64, f64)> = run
            .metrics
            .iter()
            .filter_map(|m| Some((m.step as f64, finite(m.val_loss)?)))
            .collect();
        let ys = || train.iter().chain(&val).map(|p| p.1);
        let y = padded(
            ys().fold(f64::INFINITY, f64::min),
            ys().fold(f64::NEG_INFINITY, f64::max),
            false,
        );
        let x = step_range(run, &markers);
        let mut chart = build(root, x, y, ("step", "loss"), LABEL_ROWS_PX)?;
        draw_markers(root, &mut chart, &markers, |m| m.step)?;
        chart
            .draw_series(LineSeries::new(train, TRAIN.stroke_width(2)))
            .map_err(plot_err)?;
        chart
            .draw_series(val.iter().map(|&p| Circle::new(p, 4, VALIDATION.filled())))
            .map_err(plot_err)?;
        let mut keys = vec![("training loss", TRAIN)];
        if !val.is_empty() {
            keys.push(("validation loss", VALIDATION));
        }
        keys.extend(marker_keys(&markers));
        legend(root, &keys)
    })
}

/// Tokens per second of each step against the run's wall time, events as markers.
pub(crate) fn throughput_chart(run: &Run, width: u32, height: u32) -> String {
    svg("throughput", width, height, run, |root| {
        let markers = markers(run);
        let times = run_times(run);
        let points: Vec<(f64, f64)> = run
            .metrics
            .iter()
            .zip(&times)
            .filter_map(|(m, &t)| Some((t, finite(m.tokens_per_s)?)))
            .collect();
        let t_max = times
            .iter()
            .copied()
            .chain(markers.iter().filter_map(|m| m.time))
            .fold(0.0, f64::max);
        let y_max = points.iter().map(|p| p.1).fold(0.0, f64::max);
        let x = 0.0..t_max.max(1e-3) * 1.02;
        let y = padded(0.0, y_max, true);
        let mut chart = build(root, x, y, ("wall time (s)", "tokens/s"), LABEL_ROWS_PX)?;
        draw_markers(root, &mut chart, &markers, |m| m.time)?;
        chart
            .draw_series(LineSeries::new(points, TPUT.stroke_width(2)))
            .map_err(plot_err)?;
        let mut keys = vec![("tokens/s of each step", TPUT)];
        keys.extend(marker_keys(&markers));
        legend(root, &keys)
    })
}

/// The time of each committed step (its slowest rank's `step_ms`), for the live page.
pub(crate) fn step_time_chart(run: &Run, width: u32, height: u32) -> String {
    svg("step_time", width, height, run, |root| {
        let points: Vec<(f64, f64)> = run
            .metrics
            .iter()
            .filter_map(|m| Some((m.step as f64, finite(m.step_ms())?)))
            .collect();
        let (lo, hi) = points
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
                (a.min(p.0), b.max(p.0))
            });
        let x = (lo - 1.0).max(0.0)..hi.max(lo);
        let y_max = points.iter().map(|p| p.1).fold(0.0, f64::max);
        let mut chart = build(
            root,
            x,
            padded(0.0, y_max, true),
            ("step", "step time (ms)"),
            16,
        )?;
        chart
            .draw_series(LineSeries::new(points, TRAIN.stroke_width(2)))
            .map_err(plot_err)?;
        Ok(())
    })
}
