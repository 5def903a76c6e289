//! `oobleck simulate --plot FILE`: throughput over time of several policies on one chart, like
//! figures 9 and 10 of the Oobleck paper (SOSP '23).
//!
//! ```text
//!   title
//!   ── oobleck (avg 1,234 samples/s)   ── checkpoint-restart (avg 987 samples/s)   │ failure
//!   samples/s ┤ ▏   ▏        ▏                 one stepped line per policy;
//!             ┤─┐ ┌──────────┐ ┌────           failures: thin vertical lines (darker where
//!             ┤ └─┘          └─┘               several fall in one pixel column),
//!             └────────────────────── hours    joins: short ticks under the top edge
//! ```
//!
//! - The format follows the file's extension: `.svg` or `.png` (any case); anything else is an
//!   error naming both.
//! - Text is laid out (and, for PNG, drawn) with Roboto Regular compiled into the binary
//!   (`datasets/fonts/`), so no system font, fontconfig or freetype is needed; SVG text names
//!   the generic `sans-serif` family and is rendered by the viewer.
//! - Size stays bounded whatever the input: each timeline is reduced to at most four vertices
//!   per pixel column (the value entering the column, its minimum, its maximum and the value
//!   leaving it, so no dip or spike disappears), and the trace's marks are coalesced per pixel
//!   column and kind (all outcomes' marks together, the same event counted once).
//! - No outcomes is an error. Outcomes whose timelines are empty still give a valid chart: the
//!   policy is in the legend (marked "no data") with no line, the axes span the outcomes'
//!   `start_ms..end_ms` (at least one hour) and `0..1` samples/s.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use oobleck_core::simulate::{Change, Mark, Outcome, TimePoint};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::plotting::{register_font, FONT};

/// The picture in pixels (SVG user units): wide like a paper figure, readable at page width.
const WIDTH: u32 = 1280;
const HEIGHT: u32 = 640;
const MS_PER_HOUR: f64 = 3_600_000.0;

/// Okabe-Ito colours (distinguishable with the common colour-vision deficiencies), without
/// vermillion, which would read as the failure marks' red.
const PALETTE: [RGBColor; 7] = [
    RGBColor(0, 114, 178),
    RGBColor(230, 159, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
    RGBColor(150, 110, 40),
];
const FAILURE: RGBColor = RGBColor(214, 39, 40);
const JOIN: RGBColor = RGBColor(44, 120, 44);
const SERIES_WIDTH: u32 = 2;
/// Legend rows: height of one row, and the gap between entries of a row.
const LEGEND_ROW: u32 = 24;
const LEGEND_GAP: u32 = 28;
const SWATCH: u32 = 26;
/// Headroom above the highest throughput, so lines stay clear of the join ticks.
const Y_HEADROOM: f64 = 1.12;
/// Length of a mark's tick at the top edge (pixels).
const TICK: i32 = 10;
/// Failure lines run full height while they occupy at most one pixel column in this many.
const SPARSE_COLUMNS: u32 = 10;

/// Checks that `path` names a format [`draw`] writes (before a long simulation, not after).
pub fn check_path(path: &Path) -> Result<()> {
    Format::of(path).map(|_| ())
}

/// Writes the chart of `outcomes` to `path` (`.svg` or `.png`).
pub fn draw(outcomes: &[Outcome], title: &str, path: &Path) -> Result<()> {
    let format = Format::of(path)?;
    if outcomes.is_empty() {
        bail!("nothing to plot in {}: no policy outcomes", path.display());
    }
    for outcome in outcomes {
        check_timeline(outcome)?;
    }
    register_font()?;
    match format {
        Format::Svg => {
            let mut svg = String::new();
            {
                let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
                render(&root, outcomes, title)?;
                root.present().map_err(|e| anyhow!("{e}"))?;
            }
            std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))
        }
        Format::Png => {
            let root = BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
            render(&root, outcomes, title)?;
            root.present()
                .map_err(|e| anyhow!("writing {}: {e}", path.display()))
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Svg,
    Png,
}

impl Format {
    fn of(path: &Path) -> Result<Format> {
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("svg") => Ok(Format::Svg),
            Some("png") => Ok(Format::Png),
            other => bail!(
                "plot file {}: {}; the plot is written as .svg or .png",
                path.display(),
                match other {
                    Some(e) => format!("unknown extension `.{e}`"),
                    None => "no extension".to_string(),
                }
            ),
        }
    }
}

/// Throughputs must be finite and not negative, and points in time order: anything else is a
/// broken policy, named here rather than drawn as nonsense.
fn check_timeline(outcome: &Outcome) -> Result<()> {
    let mut last = 0;
    for (i, p) in outcome.timeline.iter().enumerate() {
        if !p.samples_per_s.is_finite() || p.samples_per_s < 0.0 {
            bail!(
                "policy {}: throughput {} samples/s at {} ms cannot be drawn",
                outcome.policy,
                p.samples_per_s,
                p.t_ms
            );
        }
        if i > 0 && p.t_ms < last {
            bail!(
                "policy {}: timeline point {i} at {} ms comes before the one at {last} ms",
                outcome.policy,
                p.t_ms
            );
        }
        last = p.t_ms;
    }
    Ok(())
}

/// The axes' upper ends: hours from the trace start to the last end, samples/s from 0.
fn ranges(outcomes: &[Outcome]) -> (f64, f64) {
    let end_ms = outcomes
        .iter()
        .flat_map(|o| std::iter::once(o.end_ms).chain(o.timeline.last().map(|p| p.t_ms)))
        .max()
        .unwrap_or(0);
    // An empty chart still gets an axis to draw.
    let x_max = if end_ms == 0 {
        1.0
    } else {
        end_ms as f64 / MS_PER_HOUR
    };
    let y_top = outcomes
        .iter()
        .flat_map(|o| o.timeline.iter().map(|p| p.samples_per_s))
        .fold(0.0, f64::max);
    let y_max = if y_top > 0.0 { y_top * Y_HEADROOM } else { 1.0 };
    (x_max, y_max)
}

fn render<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    outcomes: &[Outcome],
    title: &str,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("drawing the plot: {e}");
    root.fill(&WHITE).map_err(err)?;
    let body = root.titled(title, (FONT, 26)).map_err(err)?;
    let marks = coalesce_marks(outcomes);
    let entries = legend_entries(outcomes, &marks);
    let rows = layout_legend(&body, &entries)?;
    let (legend, plot) = body.split_vertically(rows.len() as u32 * LEGEND_ROW + 8);
    draw_legend(&legend, &rows).map_err(err)?;

    let (x_max, y_max) = ranges(outcomes);
    let mut chart = ChartBuilder::on(&plot)
        .margin_left(12)
        .margin_right(28)
        .margin_bottom(8)
        .x_label_area_size(56)
        .y_label_area_size(92)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("Time since trace start (hours)")
        .y_desc("Throughput (samples/s)")
        .x_labels(12)
        .y_labels(8)
        .y_label_formatter(&|v| thousands(*v))
        .x_label_formatter(&|v| hours_label(*v))
        .label_style((FONT, 17))
        .axis_desc_style((FONT, 19))
        .bold_line_style(BLACK.mix(0.12))
        .light_line_style(TRANSPARENT)
        .draw()
        .map_err(err)?;

    let area = chart.plotting_area().strip_coord_spec();
    let (cols, rows_px) = area.dim_in_pixel();
    draw_marks(&area, &marks, x_max, cols, rows_px).map_err(err)?;
    for (i, outcome) in outcomes.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let end_h = outcome.end_ms as f64 / MS_PER_HOUR;
        let vertices = step_vertices(&outcome.timeline, end_h, x_max, cols as usize);
        if vertices.is_empty() {
            continue;
        }
        chart
            .draw_series(LineSeries::new(vertices, color.stroke_width(SERIES_WIDTH)))
            .map_err(err)?;
    }
    Ok(())
}

/// The stepped line of one timeline in (hours, samples/s), at most four vertices per pixel
/// column: the value entering the column, the column's minimum and maximum (a one-pixel
/// vertical stroke that keeps every dip and spike), and the value leaving it. A timeline with
/// no more points than columns is drawn exactly. The last value holds until `end_h` (or the
/// last point, if that is later).
fn step_vertices(timeline: &[TimePoint], end_h: f64, x_max: f64, cols: usize) -> Vec<(f64, f64)> {
    let Some(first) = timeline.first() else {
        return Vec::new();
    };
    let hours = |p: &TimePoint| p.t_ms as f64 / MS_PER_HOUR;
    // Exact below one point per column; otherwise every point of a column joins its group.
    let exact = timeline.len() <= cols;
    let column = |h: f64| ((h / x_max) * cols as f64).floor().max(0.0) as usize;
    let mut out = vec![(hours(first), first.samples_per_s)];
    let mut prev = first.samples_per_s;
    let mut i = 1;
    while i < timeline.len() {
        let t = hours(&timeline[i]);
        let mut j = i + 1;
        if !exact {
            let col = column(t);
            while j < timeline.len() && column(hours(&timeline[j])) == col {
                j += 1;
            }
        }
        let group = &timeline[i..j];
        let leaving = group[group.len() - 1].samples_per_s;
        out.push((t, prev));
        if group.len() > 1 {
            let lo = group.iter().map(|p| p.samples_per_s).fold(prev, f64::min);
            let hi = group.iter().map(|p| p.samples_per_s).fold(prev, f64::max);
            out.push((t, lo));
            out.push((t, hi));
        }
        out.push((t, leaving));
        prev = leaving;
        i = j;
    }
    let last_t = hours(&timeline[timeline.len() - 1]);
    out.push((end_h.max(last_t), prev));
    out
}

/// Trace events of all outcomes, each distinct `(time, change, node)` once.
struct Marks {
    removals: Vec<u64>,
    joins: Vec<u64>,
}

fn coalesce_marks(outcomes: &[Outcome]) -> Marks {
    let unique: BTreeSet<(u64, bool, &str)> = outcomes
        .iter()
        .flat_map(|o| o.marks.iter())
        .map(|m: &Mark| (m.t_ms, m.change == Change::Remove, m.node.as_str()))
        .collect();
    let (mut removals, mut joins) = (Vec::new(), Vec::new());
    for (t, removal, _) in unique {
        if removal {
            removals.push(t);
        } else {
            joins.push(t);
        }
    }
    Marks { removals, joins }
}

/// How many events fall in each pixel column.
fn per_column(times_ms: &[u64], x_max: f64, cols: u32) -> BTreeMap<i32, usize> {
    let mut counts = BTreeMap::new();
    let last = cols.saturating_sub(1) as f64;
    for &t in times_ms {
        let col = ((t as f64 / MS_PER_HOUR / x_max) * cols as f64).floor();
        *counts.entry(col.clamp(0.0, last) as i32).or_insert(0) += 1;
    }
    counts
}

/// Failures: full-height one-pixel lines, more opaque where several share a column; when they
/// would fill more than one column in [`SPARSE_COLUMNS`] (a red wall), ticks along the top
/// edge instead, with the joins' ticks under them. Joins: short ticks hanging from the top edge.
fn draw_marks<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    marks: &Marks,
    x_max: f64,
    cols: u32,
    rows: u32,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let alpha = |n: usize| (0.3 + 0.15 * (n as f64 - 1.0)).min(0.8);
    let removals = per_column(&marks.removals, x_max, cols);
    let dense = removals.len() as u32 * SPARSE_COLUMNS > cols;
    let (removal_end, join_rows) = if dense {
        (TICK, (TICK + 2, 2 * TICK + 2))
    } else {
        (rows as i32, (0, TICK))
    };
    for (col, n) in removals {
        let style = FAILURE.mix(alpha(n)).filled();
        area.draw(&Rectangle::new([(col, 0), (col + 1, removal_end)], style))?;
    }
    for (col, n) in per_column(&marks.joins, x_max, cols) {
        let style = JOIN.mix(alpha(n) + 0.2).filled();
        let (top, bottom) = join_rows;
        area.draw(&Rectangle::new([(col, top), (col + 2, bottom)], style))?;
    }
    Ok(())
}

enum Swatch {
    Line(RGBColor),
    Failure,
    Join,
}

struct Entry {
    swatch: Swatch,
    label: String,
}

fn legend_entries(outcomes: &[Outcome], marks: &Marks) -> Vec<Entry> {
    let mut entries: Vec<Entry> = outcomes
        .iter()
        .enumerate()
        .map(|(i, o)| Entry {
            swatch: Swatch::Line(PALETTE[i % PALETTE.len()]),
            label: if o.timeline.is_empty() {
                format!("{} (no data)", o.policy)
            } else {
                format!(
                    "{} (avg {} samples/s)",
                    o.policy,
                    thousands(o.average_samples_per_s)
                )
            },
        })
        .collect();
    let plural = |n: usize, one: &str, many: &str| {
        format!(
            "{} {}",
            thousands(n as f64),
            if n == 1 { one } else { many }
        )
    };
    if !marks.removals.is_empty() {
        entries.push(Entry {
            swatch: Swatch::Failure,
            label: plural(marks.removals.len(), "node failure", "node failures"),
        });
    }
    if !marks.joins.is_empty() {
        entries.push(Entry {
            swatch: Swatch::Join,
            label: plural(marks.joins.len(), "node join", "node joins"),
        });
    }
    entries
}

/// Entries placed left to right, wrapping to a new row when the width runs out:
/// `(x, entry)` per row.
type Rows<'a> = Vec<Vec<(i32, &'a Entry)>>;

fn layout_legend<'a, DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    entries: &'a [Entry],
) -> Result<Rows<'a>>
where
    DB::ErrorType: 'static,
{
    let width = area.dim_in_pixel().0 as i32;
    let font: TextStyle = (FONT, 17).into();
    let mut rows: Rows = vec![Vec::new()];
    let mut x = LEGEND_GAP as i32;
    for entry in entries {
        let (w, _) = area
            .estimate_text_size(&entry.label, &font)
            .map_err(|e| anyhow!("laying out the legend: {e}"))?;
        let need = (SWATCH + 8 + w) as i32;
        if x + need > width && !rows.last().is_some_and(Vec::is_empty) {
            rows.push(Vec::new());
            x = LEGEND_GAP as i32;
        }
        rows.last_mut()
            .expect("rows starts with one row")
            .push((x, entry));
        x += need + LEGEND_GAP as i32;
    }
    Ok(rows)
}

fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    rows: &Rows,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let font = (FONT, 17).into_font().color(&BLACK);
    for (r, row) in rows.iter().enumerate() {
        let mid = (r as u32 * LEGEND_ROW + LEGEND_ROW / 2 + 2) as i32;
        for &(x, entry) in row {
            let sw = SWATCH as i32;
            // Filled rectangles, not paths: a series is the only polyline of its colour.
            let (upper, lower, color) = match entry.swatch {
                Swatch::Line(c) => ((x, mid - 1), (x + sw, mid + 2), c.to_rgba()),
                Swatch::Failure => (
                    (x + sw / 2, mid - 9),
                    (x + sw / 2 + 2, mid + 9),
                    FAILURE.mix(0.7),
                ),
                Swatch::Join => (
                    (x + sw / 2, mid - 9),
                    (x + sw / 2 + 2, mid - 1),
                    JOIN.to_rgba(),
                ),
            };
            area.draw(&Rectangle::new([upper, lower], color.filled()))?;
            let pos = Pos::new(HPos::Left, VPos::Center);
            area.draw_text(&entry.label, &font.pos(pos), (x + sw + 8, mid))?;
        }
    }
    Ok(())
}

/// `1234567.8` -> `1,234,568`; values under 100 keep their significant decimals.
fn thousands(v: f64) -> String {
    if v.abs() < 100.0 {
        let s = format!("{v:.2}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        return if s.is_empty() || s == "-" {
            "0".into()
        } else {
            s.into()
        };
    }
    let digits = format!("{:.0}", v.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if v < 0.0 {
        out.insert(0, '-');
    }
    out
}

fn hours_label(h: f64) -> String {
    if h >= 100.0 {
        thousands(h)
    } else {
        thousands((h * 100.0).round() / 100.0)
    }
}

#[cfg(test)]
#[path = "plot_tests.rs"]
mod tests;
