//! The plan timeline: one band per generation across the steps it committed, split into its
//! pipelines (each as tall as its share of the nodes), the unusual events on top.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::lines::{build, draw_markers, step_range, LABEL_ROWS_PX};
use super::{markers, plot_err, svg, Kind};
use crate::plotting::FONT;
use crate::report::{PlanInfo, Run};

/// Pipeline fills, in turn; the band's title row is [`BAND`].
pub(in crate::report) const FILLS: [RGBColor; 6] = [
    RGBColor(198, 219, 239),
    RGBColor(199, 233, 192),
    RGBColor(253, 208, 162),
    RGBColor(218, 218, 235),
    RGBColor(252, 187, 161),
    RGBColor(224, 224, 224),
];
pub(in crate::report) const BAND: RGBColor = RGBColor(243, 243, 243);
/// Height in pixels of a band's title row.
const BAND_TITLE: i32 = 18;

/// Which nodes formed which pipelines in each generation.
pub(crate) fn timeline_chart(run: &Run, width: u32, height: u32) -> String {
    svg("timeline", width, height, run, |root| {
        let markers = markers(run);
        let mut chart = build(
            root,
            step_range(run, &markers),
            0.0..1.0,
            ("step", ""),
            LABEL_ROWS_PX,
        )?;
        let (top, bottom) = (
            chart.backend_coord(&(0.0, 1.0)).1,
            chart.backend_coord(&(0.0, 0.0)).1,
        );
        let px = |step: f64| chart.backend_coord(&(step, 0.0)).0;
        // A generation that committed nothing still shows, thinly, where the previous one
        // ended.
        let mut prev_end = chart.x_range().start;
        for p in run.plans.values() {
            let steps = run.metrics.iter().filter(|m| m.generation == p.generation);
            let span = steps.fold(None::<(u64, u64)>, |acc, m| {
                Some(acc.map_or((m.step, m.step), |(lo, hi)| {
                    (lo.min(m.step), hi.max(m.step))
                }))
            });
            let (x0, x1) = match span {
                Some((lo, hi)) => (px(lo.saturating_sub(1) as f64), px(hi as f64)),
                None => (px(prev_end), px(prev_end)),
            };
            prev_end = span.map_or(prev_end, |(_, hi)| hi as f64);
            band(root, p, (x0, x1.max(x0 + 3)), (top, bottom))?;
        }
        let prominent = |m: &super::Marker| m.step.filter(|_| m.kind != Kind::Checkpoint);
        draw_markers(root, &mut chart, &markers, prominent)
    })
}

fn band(
    root: &DrawingArea<SVGBackend, Shift>,
    p: &PlanInfo,
    (x0, x1): (i32, i32),
    (top, bottom): (i32, i32),
) -> anyhow::Result<()> {
    let width = x1 - x0;
    // Text that does not fit is left out (about 7 px per character).
    let fits =
        |text: &str, h: i32| h >= 13 && f64::from(width) >= text.chars().count() as f64 * 7.0 + 6.0;
    let text_at = |text: &str, (x, y): (i32, i32), bold: bool| {
        let font = (FONT, 14).into_font();
        let font = if bold {
            font.style(FontStyle::Bold)
        } else {
            font
        };
        let style = TextStyle::from(font)
            .color(&RGBColor(40, 40, 40))
            .pos(Pos::new(HPos::Left, VPos::Center));
        root.draw_text(text, &style, (x, y)).map_err(plot_err)
    };
    root.draw(&Rectangle::new(
        [(x0, top), (x1, top + BAND_TITLE)],
        BAND.filled(),
    ))
    .map_err(plot_err)?;
    let label = format!("gen {}", p.generation);
    if fits(&label, BAND_TITLE) {
        text_at(&label, (x0 + 4, top + BAND_TITLE / 2), true)?;
    }
    let rows: Vec<(String, usize)> = match p.counts {
        Some((n, nodes)) => vec![(
            format!("{n} pipeline(s) on {nodes} node(s); no plan recorded"),
            1,
        )],
        None => p
            .pipelines
            .iter()
            .map(|q| (q.text(), q.nodes.len().max(1)))
            .collect(),
    };
    let total: usize = rows.iter().map(|r| r.1).sum::<usize>().max(1);
    let (y_start, height) = (top + BAND_TITLE, bottom - top - BAND_TITLE);
    let mut y = y_start;
    let mut used = 0;
    for (i, (text, share)) in rows.iter().enumerate() {
        used += share;
        let y1 = y_start + (height as usize * used / total) as i32;
        // One pixel of white between stripes.
        root.draw(&Rectangle::new(
            [(x0, y + 1), (x1 - 1, y1)],
            FILLS[i % FILLS.len()].filled(),
        ))
        .map_err(plot_err)?;
        if fits(text, y1 - y) {
            text_at(text, (x0 + 4, (y + y1) / 2), false)?;
        }
        y = y1;
    }
    Ok(())
}
