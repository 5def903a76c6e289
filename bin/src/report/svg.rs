//! The few SVG pieces the run report draws with: text escaping, linear axes with round tick
//! values, and a plot frame that maps data to pixels. Pure string building, no I/O.

use std::fmt::Write;

/// Escapes text for HTML and for SVG (XML) alike: the report's SVG must stay well-formed XML.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A linear axis over `[lo, hi]` with tick values at round numbers (1, 2 or 5 times a power of
/// ten). `lo` and `hi` are themselves ticks, so the plot ends on a labelled value.
#[derive(Clone, Debug)]
pub struct Axis {
    pub lo: f64,
    pub hi: f64,
    pub ticks: Vec<f64>,
    step: f64,
}

impl Axis {
    /// About `n` ticks covering `[lo, hi]`.
    pub fn covering(lo: f64, hi: f64, n: usize) -> Axis {
        Self::build(lo, hi, n, false)
    }

    /// Like [`Axis::covering`] with whole-number ticks (steps, generations).
    pub fn integer(lo: f64, hi: f64, n: usize) -> Axis {
        Self::build(lo, hi, n, true)
    }

    fn build(lo: f64, hi: f64, n: usize, integer: bool) -> Axis {
        let (mut lo, mut hi) = if lo.is_finite() && hi.is_finite() {
            (lo.min(hi), lo.max(hi))
        } else {
            (0.0, 1.0)
        };
        // A flat series still gets a visible range around its value.
        if hi - lo <= 1e-12 * hi.abs().max(1.0) {
            let pad = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
            lo -= pad;
            hi += pad;
        }
        let raw = (hi - lo) / n.max(1) as f64;
        let mag = 10f64.powf(raw.log10().floor());
        let mut step = [1.0, 2.0, 5.0, 10.0]
            .iter()
            .map(|m| m * mag)
            .find(|s| *s >= raw * (1.0 - 1e-9))
            .unwrap_or(10.0 * mag);
        if integer {
            step = step.max(1.0).round();
        }
        let lo = (lo / step + 1e-9).floor() * step;
        let hi = (hi / step - 1e-9).ceil() * step;
        let count = ((hi - lo) / step).round() as usize;
        let ticks = (0..=count).map(|k| lo + k as f64 * step).collect();
        Axis {
            lo,
            hi,
            ticks,
            step,
        }
    }

    /// A tick value with as many decimals as the tick spacing needs.
    pub fn label(&self, v: f64) -> String {
        let decimals = if self.step >= 1.0 {
            0
        } else {
            (-self.step.log10().floor()) as usize
        };
        let s = format!("{v:.decimals$}");
        // "-0" and "-0.0" read as a sign error.
        if s.trim_start_matches('-')
            .chars()
            .all(|c| c == '0' || c == '.')
        {
            s.trim_start_matches('-').to_string()
        } else {
            s
        }
    }
}

/// Margins in pixels: room for tick labels on the left and below, marker labels above.
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 34.0;
const BOTTOM: f64 = 44.0;

/// One plot: its pixel size and the two axes it maps.
#[derive(Clone, Debug)]
pub struct Frame {
    pub width: f64,
    pub height: f64,
    pub x: Axis,
    pub y: Axis,
}

impl Frame {
    /// The pixel column of data value `v` on the x axis.
    pub fn px(&self, v: f64) -> f64 {
        LEFT + (v - self.x.lo) / (self.x.hi - self.x.lo) * (self.width - LEFT - RIGHT)
    }

    /// The pixel row of data value `v` on the y axis (up is larger).
    pub fn py(&self, v: f64) -> f64 {
        self.height - BOTTOM - (v - self.y.lo) / (self.y.hi - self.y.lo) * self.plot_height()
    }

    pub fn plot_height(&self) -> f64 {
        self.height - TOP - BOTTOM
    }

    /// Opens the `<svg>` and draws the grid, the tick labels and the axis titles. Without a
    /// `y_label` the y axis is not numeric and gets no ticks. The caller closes with `</svg>`.
    pub fn open(&self, class: &str, title: &str, x_label: &str, y_label: Option<&str>) -> String {
        let (w, h) = (self.width, self.height);
        let mut s = String::new();
        let _ = write!(
            s,
            r#"<svg class="{}" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img"><title>{}</title>"#,
            esc(class),
            esc(title)
        );
        let (top, bottom) = (TOP, h - BOTTOM);
        let (left, right) = (LEFT, w - RIGHT);
        for &t in &self.x.ticks {
            let x = self.px(t);
            let _ = write!(
                s,
                r#"<line class="grid" x1="{x:.1}" y1="{top:.1}" x2="{x:.1}" y2="{bottom:.1}"/><text class="tick" x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                bottom + 16.0,
                esc(&self.x.label(t))
            );
        }
        if let Some(y_label) = y_label {
            for &t in &self.y.ticks {
                let y = self.py(t);
                let _ = write!(
                    s,
                    r#"<line class="grid" x1="{left:.1}" y1="{y:.1}" x2="{right:.1}" y2="{y:.1}"/><text class="tick" x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
                    left - 6.0,
                    y + 4.0,
                    esc(&self.y.label(t))
                );
            }
            let cy = (top + bottom) / 2.0;
            let _ = write!(
                s,
                r#"<text class="axis" transform="translate(16 {cy:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
                esc(y_label)
            );
        }
        let _ = write!(
            s,
            r#"<rect class="frame" x="{left:.1}" y="{top:.1}" width="{:.1}" height="{:.1}"/><text class="axis" x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            right - left,
            bottom - top,
            (left + right) / 2.0,
            h - 6.0,
            esc(x_label)
        );
        s
    }

    /// A line through `points` (data coordinates): one `M` and then one `L` per further point.
    pub fn path(&self, class: &str, points: &[(f64, f64)]) -> String {
        let mut d = String::new();
        for (i, &(x, y)) in points.iter().enumerate() {
            let _ = write!(
                d,
                "{}{:.1},{:.1}",
                if i == 0 { "M" } else { " L" },
                self.px(x),
                self.py(y)
            );
        }
        format!(r#"<path class="{}" d="{d}"/>"#, esc(class))
    }

    /// A dot at `(x, y)` with a hover text.
    pub fn dot(&self, class: &str, x: f64, y: f64, title: &str) -> String {
        format!(
            r#"<circle class="{}" cx="{:.1}" cy="{:.1}" r="3.5"><title>{}</title></circle>"#,
            esc(class),
            self.px(x),
            self.py(y),
            esc(title)
        )
    }

    /// A vertical marker across the plot at data `x`, with a hover text.
    pub fn marker(&self, class: &str, x: f64, title: &str) -> String {
        let px = self.px(x);
        format!(
            r#"<line class="{}" x1="{px:.1}" y1="{TOP:.1}" x2="{px:.1}" y2="{:.1}"><title>{}</title></line>"#,
            esc(class),
            self.height - BOTTOM,
            esc(title)
        )
    }

    /// Labels above the plot at data `x` positions; labels that would overlap go one row up
    /// (two rows, then they may overlap). Labels at the same pixel should be merged first.
    pub fn marker_labels(&self, class: &str, labels: &[(f64, String)]) -> String {
        let mut placed: Vec<(f64, &str)> = labels
            .iter()
            .map(|(x, text)| (self.px(*x), text.as_str()))
            .collect();
        placed.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut row_end = [f64::NEG_INFINITY; 2];
        let mut s = String::new();
        for (px, text) in placed {
            // About 7 px per bold character.
            let w = text.chars().count() as f64 * 7.0;
            let (anchor, left) = if px + w / 2.0 > self.width {
                ("end", px - w)
            } else if px - w / 2.0 < 0.0 {
                ("start", px)
            } else {
                ("middle", px - w / 2.0)
            };
            let row = row_end.iter().position(|&e| left > e + 4.0).unwrap_or(0);
            row_end[row] = left + w;
            let _ = write!(
                s,
                r#"<text class="{}" x="{px:.1}" y="{:.1}" text-anchor="{anchor}">{}</text>"#,
                esc(class),
                TOP - 6.0 - 13.0 * row as f64,
                esc(text)
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup_and_quotes() {
        assert_eq!(
            esc(r#"<a href="x">'&'</a>"#),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
    }

    #[test]
    fn axes_end_on_round_ticks_that_cover_the_data() {
        let a = Axis::covering(9.42, 10.82, 5);
        assert!(a.lo <= 9.42 && a.hi >= 10.82, "{a:?}");
        assert_eq!(a.ticks, vec![9.0, 9.5, 10.0, 10.5, 11.0]);
        assert_eq!(a.label(a.ticks[0]), "9.0");
        let a = Axis::integer(0.0, 2.0, 5);
        assert_eq!(a.ticks, vec![0.0, 1.0, 2.0]);
        assert_eq!(a.label(1.0), "1");
        // A flat series gets a range around it, and non-finite input a default one.
        let a = Axis::covering(5.0, 5.0, 5);
        assert!(a.lo < 5.0 && a.hi > 5.0, "{a:?}");
        let a = Axis::covering(f64::NAN, 1.0, 5);
        assert!(a.lo.is_finite() && a.hi > a.lo, "{a:?}");
    }

    #[test]
    fn a_path_has_one_segment_per_further_point() {
        let f = Frame {
            width: 400.0,
            height: 200.0,
            x: Axis::integer(0.0, 10.0, 5),
            y: Axis::covering(0.0, 1.0, 5),
        };
        let p = f.path("train", &[(0.0, 0.0), (1.0, 0.5), (2.0, 1.0)]);
        assert_eq!(p.matches(" L").count(), 2, "{p}");
        assert!(
            p.starts_with(r#"<path class="train" d="M70.0,156.0"#),
            "{p}"
        );
    }
}
