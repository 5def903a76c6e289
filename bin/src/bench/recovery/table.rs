//! The bench's one markdown table: a row per quantity, a column per run, then the spec's target
//! and PASS/MISS; notes under it say what was injected and anything that went wrong.

use std::fmt::Write;

use super::summary::{Check, Recovery, RunKind, RunSummary, Stat};
use super::Report;

pub(super) fn num(x: f64, digits: usize) -> String {
    if x.is_finite() {
        format!("{x:.digits$}")
    } else {
        "-".into()
    }
}

pub(super) fn opt(x: Option<f64>, digits: usize) -> String {
    x.map_or_else(|| "-".into(), |x| num(x, digits))
}

pub(super) fn stat(s: Option<Stat>, digits: usize) -> String {
    s.map_or_else(
        || "-".into(),
        |s| format!("{} / {}", num(s.median, digits), num(s.max, digits)),
    )
}

/// Median / max over the in-place run's recoveries of one quantity.
pub(super) fn over(recoveries: &[Recovery], f: impl Fn(&Recovery) -> Option<f64>) -> Option<Stat> {
    Stat::of(&recoveries.iter().filter_map(f).collect::<Vec<_>>())
}

pub(super) fn verdict(c: &Check) -> &'static str {
    match c.pass {
        Some(true) => "PASS",
        Some(false) => "MISS",
        None => "n/a",
    }
}

pub(super) fn bound(c: &Check) -> String {
    format!(
        "{} {}",
        if c.at_least { ">=" } else { "<" },
        num(c.limit, 2)
    )
}

/// One row of a run's own table (the hang's, the master's): the quantity, its value, and the
/// check of that name if there is one (its bound as the target, unless `target` says it in
/// words).
pub(super) fn row(out: &mut String, r: &Report, label: &str, value: String, check: Option<&str>) {
    row_as(out, r, label, value, check, None);
}

pub(super) fn row_as(
    out: &mut String,
    r: &Report,
    label: &str,
    value: String,
    check: Option<&str>,
    target: Option<&str>,
) {
    let c = check.and_then(|name| r.checks.iter().find(|c| c.name == name));
    let (bound, v) = c.map_or((String::new(), ""), |c| (bound(c), verdict(c)));
    let target = target.map_or(bound, str::to_string);
    let _ = writeln!(out, "| {label} | {value} | {target} | {v} |");
}

struct Rows<'a> {
    out: String,
    runs: &'a [RunSummary],
}

impl Rows<'_> {
    /// Columns: the three runs, and the drain + join run when there was one.
    fn columns(&self) -> usize {
        self.runs.len().max(3)
    }

    fn row(&mut self, label: &str, cells: Vec<String>, check: Option<&Check>) {
        let (target, verdict) = check.map_or((String::new(), ""), |c| (bound(c), verdict(c)));
        let _ = writeln!(
            self.out,
            "| {label} | {} | {target} | {verdict} |",
            cells.join(" | ")
        );
    }

    /// A row with one cell per run from `f`.
    fn each(&mut self, label: &str, f: impl Fn(&RunSummary) -> String) {
        let cells = (0..self.columns())
            .map(|i| self.runs.get(i).map_or_else(|| "-".into(), &f))
            .collect();
        self.row(label, cells, None);
    }

    /// A row only the in-place run fills (the recovery phases).
    fn in_place(&mut self, label: &str, cell: String, check: Option<&Check>) {
        let mut cells = vec!["-".to_string(); self.columns()];
        cells[1] = cell;
        self.row(label, cells, check);
    }
}

/// The table and its notes.
pub fn render(r: &Report) -> String {
    let mut t = Rows {
        out: String::new(),
        runs: &r.runs,
    };
    let labels: Vec<&str> = r.runs.iter().map(|s| s.kind.label()).collect();
    let _ = writeln!(
        t.out,
        "| | {} | target | check |\n|{}",
        labels.join(" | "),
        "---|".repeat(labels.len() + 3)
    );
    t.each("status", |s| {
        if s.ok {
            "ok".into()
        } else {
            "**FAILED** (below)".into()
        }
    });
    t.each("wall time (s)", |s| num(s.wall_s, 1));
    t.each("unique steps committed", |s| s.unique_steps.to_string());
    t.each("steps replayed", |s| s.replayed_steps.to_string());
    t.each("effective steps/s", |s| num(s.steps_per_s, 3));
    t.each("effective tokens/s", |s| num(s.tokens_per_s, 0));
    let tput = r
        .checks
        .iter()
        .find(|c| c.name.starts_with("in-place throughput"));
    let cells = (0..t.columns())
        .map(|i| {
            r.runs
                .get(i)
                .map_or_else(|| "-".into(), |s| opt(s.vs_fault_free, 3))
        })
        .collect();
    t.row("throughput / fault-free", cells, tput);
    t.each("throughput / checkpoint restart", |s| opt(s.vs_restart, 3));
    t.each("median step time (s)", |s| opt(s.step_s, 3));
    t.each("failures recovered", |s| match s.kind {
        RunKind::FaultFree => "0".into(),
        RunKind::InPlace => {
            let inp = s.recoveries.iter().filter(|r| r.in_place).count();
            format!("{} ({inp} in place)", s.recoveries.len())
        }
        RunKind::CheckpointRestart => format!("{} restarts", s.restarts.len()),
        RunKind::Membership => {
            let d = s.recoveries.iter().filter(|r| !r.drained_nodes.is_empty());
            let j = s.recoveries.iter().filter(|r| !r.joined_nodes.is_empty());
            format!("0 ({} drain, {} join)", d.count(), j.count())
        }
        RunKind::Hang => format!("{} (a hung worker)", s.recoveries.len()),
        RunKind::Master => format!("{} (a restarted master)", s.recoveries.len()),
        RunKind::Standby => format!("{} (a standby took over)", s.recoveries.len()),
    });
    t.each("checkpoint stall ms (median / max)", |s| {
        stat(s.checkpoint_stall_ms, 1)
    });
    t.each("load average at start (1 min)", |s| opt(s.load_1m, 1));
    phase_rows(&mut t, r);
    t.each("restart: failure -> first commit s (median / max)", |s| {
        restart_stat(s, |x| x.to_first_commit_s)
    });
    t.each(
        "restart: failure -> failed step again s (median / max)",
        |s| restart_stat(s, |x| x.to_regained_s),
    );
    let mut out = t.out;
    if let Some(m) = &r.membership {
        out.push('\n');
        out.push_str(&super::membership_table::render(r, m));
    }
    if let Some(h) = &r.hang {
        out.push('\n');
        out.push_str(&super::hang_table::render(r, h));
    }
    if let Some(m) = &r.master {
        out.push('\n');
        out.push_str(&super::master_table::render(r, m));
    }
    if let Some(t) = &r.standby {
        out.push('\n');
        out.push_str(&super::standby_table::render(r, t));
    }
    notes(&mut out, r);
    out
}

fn restart_stat(s: &RunSummary, f: impl Fn(&super::summary::Restart) -> Option<f64>) -> String {
    if s.kind != RunKind::CheckpointRestart {
        return "-".into();
    }
    stat(
        Stat::of(&s.restarts.iter().filter_map(f).collect::<Vec<_>>()),
        2,
    )
}

/// The in-place run's recovery phases, median / max over its recoveries.
fn phase_rows(t: &mut Rows, r: &Report) {
    let Some(ip) = r.runs.iter().find(|s| s.kind == RunKind::InPlace) else {
        return;
    };
    let rec = ip.recoveries.clone();
    let check = |prefix: &str| r.checks.iter().find(|c| c.name.starts_with(prefix));
    let phase =
        |f: fn(&super::records::Phases) -> f64| over(&rec, move |x| x.phases.map(|p| f(&p)));
    t.in_place(
        "detect s (median / max)",
        stat(phase(|p| p.detect_s), 3),
        check("crash detected"),
    );
    t.in_place("decide s", stat(phase(|p| p.decide_s), 4), None);
    t.in_place("restart s", stat(phase(|p| p.restart_s), 4), None);
    t.in_place(
        "connect + copy s",
        stat(phase(|p| p.connect_copy_s), 3),
        None,
    );
    t.in_place(
        "decide + restart + connect_copy s",
        stat(over(&rec, Recovery::reconfigure_s), 3),
        check("decide + restart"),
    );
    t.in_place("first step s", stat(phase(|p| p.first_step_s), 3), None);
    t.in_place(
        "failure -> next commit s",
        stat(over(&rec, |x| x.since_failure_s), 3),
        check("next commit"),
    );
    let got: u64 = rec.iter().map(|x| x.copy_bytes).sum();
    let planned: u64 = rec.iter().map(|x| x.planned_bytes).sum();
    t.in_place(
        "MB copied, all recoveries (received / planned)",
        format!(
            "{} / {}",
            num(got as f64 / 1e6, 1),
            num(planned as f64 / 1e6, 1)
        ),
        None,
    );
    t.in_place(
        "copy GB/s (median / max)",
        stat(over(&rec, Recovery::copy_gb_per_s), 2),
        None,
    );
}

fn notes(o: &mut String, r: &Report) {
    let _ = writeln!(
        o,
        "\n{} x {} steps of {} tokens; {} nodes, f = {}; {}",
        r.model, r.job.steps, r.job.tokens_per_step, r.nodes, r.fault_threshold, r.failure_note
    );
    let _ = writeln!(
        o,
        "Phases and targets: median / max over the in-place run's recoveries; each target is \
         checked on the worst one. Next-commit target: 1.5 s + the fault-free median step time."
    );
    if r.nodes > r.cores {
        let _ = writeln!(
            o,
            "The workers of all {} nodes share {} cores here: with fewer nodes after a failure \
             each step competes less for them, which flatters the runs with failures.",
            r.nodes, r.cores
        );
    }
    if let Some(ip) = r.runs.iter().find(|s| s.kind == RunKind::InPlace) {
        let _ = writeln!(o, "{}", in_place_note(ip, r.job.failures));
    }
    for s in r.runs.iter().filter(|s| !s.ok) {
        let _ = writeln!(o, "**The {} run failed**: {}", s.kind.label(), s.status);
    }
}

/// Says whether every injected failure was recovered in place, and which was not.
pub fn in_place_note(ip: &RunSummary, planned: usize) -> String {
    let not: Vec<String> = ip
        .recoveries
        .iter()
        .filter(|r| !r.in_place || r.replayed_steps > 0)
        .map(|r| format!("after step {} (lost {:?})", r.from_step, r.lost_nodes))
        .collect();
    if ip.recoveries.len() == planned && not.is_empty() {
        format!("In-place run: all {planned} failures recovered in place, no step replayed.")
    } else if !not.is_empty() {
        format!(
            "In-place run: NOT recovered in place (checkpoint or replay): {}.",
            not.join(", ")
        )
    } else {
        format!(
            "In-place run: {} recoveries recorded for {planned} injected failures.",
            ip.recoveries.len()
        )
    }
}

/// The rows of the rendered table's section that starts at `heading` (after its first
/// `skip` lines), each with `pipes` column bars; every row of the main table before it has the
/// main table's 8.
#[cfg(test)]
pub(super) fn section_rows<'a>(
    text: &'a str,
    heading: &str,
    skip: usize,
    pipes: usize,
) -> Vec<&'a str> {
    let (main, section) = text.split_once(heading).expect("the section is rendered");
    let bars = |l: &str| l.matches('|').count();
    assert!(main
        .lines()
        .filter(|l| l.starts_with('|'))
        .all(|l| bars(l) == 8));
    let rows: Vec<&str> = section
        .lines()
        .skip(skip)
        .take_while(|l| l.starts_with('|'))
        .collect();
    assert!(rows.iter().all(|l| bars(l) == pipes), "{rows:#?}");
    rows
}

/// The row of `rows` that starts with `start`.
#[cfg(test)]
pub(super) fn row_starting<'a>(rows: &[&'a str], start: &str) -> &'a str {
    rows.iter()
        .find(|l| l.starts_with(start))
        .expect("the row is rendered")
}

/// A report of 8 steps with the three main runs (fault-free, in place, checkpoint restart),
/// `pins` as its pipelines and `extra` (the run a section's test renders) after them; the
/// test sets that run's own part and the checks.
#[cfg(test)]
pub(super) fn report_with(pins: Vec<usize>, extra: super::summary::RunSummary) -> super::Report {
    use super::membership::tests::summary;
    use super::summary::RunKind;
    let (_, ff) = summary(RunKind::FaultFree, "{\"event\":\"start\",\"step\":0}\n", 8);
    let (_, ip) = summary(RunKind::InPlace, "", 8);
    let (_, rs) = summary(RunKind::CheckpointRestart, "", 8);
    super::Report {
        model: "gpt-mini".into(),
        nodes: pins.iter().sum(),
        fault_threshold: 1,
        cores: 2,
        job: super::Job {
            steps: 8,
            tokens_per_step: 100,
            failures: 0,
        },
        plan: super::FailurePlan {
            failures: vec![],
            pins,
        },
        failure_note: String::new(),
        checks: vec![],
        runs: vec![ff, ip, rs, extra],
        membership: None,
        hang: None,
        master: None,
        standby: None,
        commands: vec![],
    }
}
