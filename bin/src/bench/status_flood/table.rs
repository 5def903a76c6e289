//! The numbers of both phases (pure: from the runs' metrics lines) and the table printed.

use oobleck_core::runtime::wire::records::StepMetrics;
use serde::Serialize;

use super::flood::Answers;

/// The most a flood may cost the job, percent of its tokens/s.
pub const TARGET_PCT: f64 = 10.0;

/// The steps committed while a phase's window was open: `(first, last]`, timed by the run's
/// own clock (`wall_s` of each step's line), so process start and model build are not in it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Window {
    pub first: u64,
    pub last: u64,
    pub seconds: f64,
    pub tokens_per_s: f64,
}

/// The window of steps `(first, last]` in `metrics`, `None` if either step is missing or no
/// time passed.
pub fn window(
    metrics: &[StepMetrics],
    first: u64,
    last: u64,
    tokens_per_step: u64,
) -> Option<Window> {
    let wall = |step| {
        metrics
            .iter()
            .rev()
            .find(|m| m.step == step)
            .map(|m| m.wall_s)
    };
    let seconds = wall(last)? - wall(first)?;
    if last <= first || seconds <= 0.0 {
        return None;
    }
    Some(Window {
        first,
        last,
        seconds,
        tokens_per_s: (last - first) as f64 * tokens_per_step as f64 / seconds,
    })
}

/// One phase: the job alone, or with the flood.
#[derive(Clone, Debug, Serialize)]
pub struct Phase {
    pub name: &'static str,
    pub window: Option<Window>,
    /// Only the flood phase.
    pub answers: Option<Answers>,
    /// The 1-minute load average when the phase's window opened (other work on the machine).
    pub load_1m: Option<f64>,
    pub error: Option<String>,
}

/// Everything the bench measured; the `--json` output.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub model: String,
    pub nodes: usize,
    pub cores: usize,
    pub tokens_per_step: u64,
    pub clients: usize,
    pub flood_s: u64,
    pub after_step: u64,
    pub quiet: Phase,
    pub flood: Phase,
    /// The tokens/s the flood took, percent of the quiet phase's.
    pub cost_pct: Option<f64>,
    pub commands: Vec<String>,
}

/// The flood's cost in percent of the quiet tokens/s (negative: the flood phase was faster).
pub fn cost_pct(quiet: &Phase, flood: &Phase) -> Option<f64> {
    let (q, f) = (quiet.window.as_ref()?, flood.window.as_ref()?);
    Some((1.0 - f.tokens_per_s / q.tokens_per_s) * 100.0)
}

pub fn render(r: &Report) -> String {
    let mut out = format!(
        "bench status-flood: {}, {} nodes on {} cores, {} tokens a step\n\
         the flood: {} clients asking GET /api/status back to back for {} s, from step {}\n\n",
        r.model, r.nodes, r.cores, r.tokens_per_step, r.clients, r.flood_s, r.after_step
    );
    out.push_str(&format!(
        "{:<7} {:>9} {:>7} {:>10} {:>8} {:>8}\n",
        "phase", "steps", "s", "tokens/s", "cost", "load 1m"
    ));
    for p in [&r.quiet, &r.flood] {
        let load = p.load_1m.map_or("n/a".into(), |l| format!("{l:.1}"));
        let cost = match (p.name, r.cost_pct) {
            ("flood", Some(c)) => format!("{c:.1} %"),
            _ => "-".into(),
        };
        match &p.window {
            Some(w) => out.push_str(&format!(
                "{:<7} {:>9} {:>7.1} {:>10.1} {:>8} {:>8}\n",
                p.name,
                format!("{}-{}", w.first, w.last),
                w.seconds,
                w.tokens_per_s,
                cost,
                load
            )),
            None => out.push_str(&format!("{:<7} no window of steps\n", p.name)),
        }
    }
    out.push('\n');
    if let Some(a) = &r.flood.answers {
        let per_s = |n: u64| n as f64 / a.seconds.max(1e-9);
        out.push_str(&format!(
            "flood answers: {} x 200 ({:.1}/s), {} x 429 ({:.1}/s), {} other, {} without an answer\n",
            a.ok,
            per_s(a.ok),
            a.refused,
            per_s(a.refused),
            a.other,
            a.failed
        ));
    }
    for p in [&r.quiet, &r.flood] {
        if let Some(e) = &p.error {
            out.push_str(&format!("{}: {e}\n", p.name));
        }
    }
    out.push_str(&match r.cost_pct {
        Some(c) if c < TARGET_PCT => format!("target: a cost under {TARGET_PCT} %: met\n"),
        Some(c) => format!("target: a cost under {TARGET_PCT} %: NOT met ({c:.1} %)\n"),
        None => format!("target: a cost under {TARGET_PCT} %: not measured\n"),
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(step: u64, wall_s: f64) -> StepMetrics {
        serde_json::from_value(serde_json::json!({"step": step, "loss": 5.0,
            "tokens_per_s": 1.0, "generation": 0, "wall_s": wall_s}))
        .unwrap()
    }

    fn phase(name: &'static str, window: Option<Window>) -> Phase {
        Phase {
            name,
            window,
            answers: None,
            load_1m: None,
            error: None,
        }
    }

    #[test]
    fn a_window_is_timed_between_its_steps_commits_and_the_cost_compares_the_two() {
        let m: Vec<StepMetrics> = (1..=30).map(|s| line(s, s as f64 * 0.5)).collect();
        let quiet = window(&m, 10, 30, 100).unwrap();
        assert_eq!((quiet.seconds, quiet.tokens_per_s), (10.0, 200.0));
        assert_eq!(window(&m, 10, 31, 100), None, "step 31 never came");
        assert_eq!(window(&m, 10, 10, 100), None, "no steps");
        let slow: Vec<StepMetrics> = (1..=30).map(|s| line(s, s as f64 * 0.625)).collect();
        let flood = window(&slow, 10, 30, 100).unwrap();
        let cost = cost_pct(&phase("quiet", Some(quiet)), &phase("flood", Some(flood))).unwrap();
        assert!((cost - 20.0).abs() < 1e-9, "{cost}");
    }
}
