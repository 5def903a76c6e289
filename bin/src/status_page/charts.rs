//! The page's live charts: the report's, drawn from the run directory again only when a step
//! was committed or an event logged since the last drawing, and at most every
//! [`MIN_GAP`] (a week-long run's metrics take a moment to read).

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::report::{read_run, Run};

/// The least time between two readings of the run directory.
const MIN_GAP: Duration = Duration::from_secs(2);
const WIDTH: u32 = 640;
const HEIGHT: u32 = 300;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Chart {
    Loss,
    Throughput,
    StepTime,
}

impl Chart {
    pub fn named(file: &str) -> Option<Chart> {
        match file {
            "loss.svg" => Some(Chart::Loss),
            "throughput.svg" => Some(Chart::Throughput),
            "step_time.svg" => Some(Chart::StepTime),
            _ => None,
        }
    }

    fn draw(self, run: &Run) -> String {
        use crate::report::charts::{loss_chart, step_time_chart, throughput_chart};
        let draw = match self {
            Chart::Loss => loss_chart,
            Chart::Throughput => throughput_chart,
            Chart::StepTime => step_time_chart,
        };
        draw(run, WIDTH, HEIGHT)
    }
}

/// The drawings of one reading of the run.
#[derive(Default)]
pub struct Cache {
    version: Option<u64>,
    read_at: Option<Instant>,
    run: Option<Result<Run, String>>,
    svgs: HashMap<Chart, String>,
}

impl Cache {
    /// `chart` as of `version` of the feed (or a little older, within [`MIN_GAP`]).
    pub fn get(&mut self, dir: &Path, version: u64, chart: Chart) -> String {
        let stale = self.version != Some(version);
        let may_read = self.read_at.is_none_or(|t| t.elapsed() >= MIN_GAP);
        if self.run.is_none() || (stale && may_read) {
            self.run = Some(read_run(dir).map_err(|e| format!("{e:#}")));
            self.read_at = Some(Instant::now());
            self.version = Some(version);
            self.svgs.clear();
        }
        let run = self.run.as_ref().expect("read above");
        self.svgs
            .entry(chart)
            .or_insert_with(|| match run {
                Ok(run) => chart.draw(run),
                Err(e) => note_svg(e),
            })
            .clone()
    }
}

/// A chart-sized SVG holding one line of text (escaped).
pub fn note_svg(text: &str) -> String {
    let text = text
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{HEIGHT}\">\
         <text x=\"16\" y=\"{}\" font-family=\"sans-serif\" font-size=\"14\" fill=\"#555\">{text}</text></svg>",
        HEIGHT / 2
    )
}
