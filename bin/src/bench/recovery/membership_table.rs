//! The drain + join run's table: the phases of its drain and its join beside those of the
//! in-place run's failures, with the targets of [`super::membership`] and notes.

use std::fmt::Write;

use super::membership::{Membership, DRAIN_COST_S, JOIN_COST_S};
use super::records::Phases;
use super::summary::{Check, Recovery, RunKind};
use super::table::{bound, num, opt, over, stat, verdict};
use super::Report;

/// One row: the failures' cell, the drain's, the join's, and the checks it carries (their
/// bounds as the target, unless `target` says it in words).
fn row(
    out: &mut String,
    label: &str,
    cells: [String; 3],
    checks: &[Option<&Check>],
    target: Option<&str>,
) {
    let checks: Vec<&Check> = checks.iter().flatten().copied().collect();
    let short = |c: &Check| c.name.split(':').next().unwrap_or_default().to_string();
    let bounds: Vec<String> = checks
        .iter()
        .map(|c| format!("{} {}", short(c), bound(c)))
        .collect();
    let verdicts: Vec<&str> = checks.iter().map(|c| verdict(c)).collect();
    let _ = writeln!(
        out,
        "| {label} | {} | {} | {} | {} | {} |",
        cells[0],
        cells[1],
        cells[2],
        target.map_or_else(|| bounds.join(", "), str::to_string),
        verdicts.join(", ")
    );
}

/// The table and its notes.
pub fn render(r: &Report, m: &Membership) -> String {
    let failures: Vec<Recovery> = r
        .runs
        .iter()
        .find(|s| s.kind == RunKind::InPlace)
        .map(|s| s.recoveries.clone())
        .unwrap_or_default();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| planned reconfiguration | failures, in place (median / max) | drain | join | target | \
         check |\n|---|---|---|---|---|---|"
    );
    let (d, j) = (m.drain.as_ref(), m.join.as_ref());
    let each = |f: &dyn Fn(&Recovery) -> String| cells(&[d, j], f);
    let [dc, jc] = each(&|x| x.cause.clone());
    row(&mut out, "cause", ["node lost".into(), dc, jc], &[], None);
    let [dc, jc] = each(&|x| format!("after step {}", x.from_step));
    row(
        &mut out,
        "taken at the boundary",
        ["-".into(), dc, jc],
        &[],
        None,
    );
    phase_rows(&mut out, &failures, &[d, j]);
    time_rows(&mut out, r, m, &failures);
    tail_rows(&mut out, r, m, &failures);
    notes(&mut out, r, m);
    out
}

/// Boundary -> next commit, the cost, request -> next commit.
fn time_rows(out: &mut String, r: &Report, m: &Membership, failures: &[Recovery]) {
    let check = |name: &str| r.checks.iter().find(|c| c.name == name);
    let each = |f: &dyn Fn(&Recovery) -> String| cells(&[m.drain.as_ref(), m.join.as_ref()], f);
    let since = |x: &Recovery| x.since_failure_s;
    let [dc, jc] = each(&|x| opt(since(x), 3));
    row(
        out,
        "boundary -> next commit s",
        [stat(over(failures, since), 3), dc, jc],
        &[
            check("drain: boundary -> next commit (s)"),
            check("join: boundary -> next commit (s)"),
        ],
        None,
    );
    let cost = |x: &Recovery| Some(x.since_failure_s? - m.step_s?);
    let targets = format!("drain < {DRAIN_COST_S:.2}, join < {JOIN_COST_S:.2} (above)");
    row(
        out,
        "cost: the above - fault-free step s",
        [
            stat(over(failures, cost), 3),
            opt(m.drain_cost_s, 3),
            opt(m.join_cost_s, 3),
        ],
        &[],
        Some(&targets),
    );
    let [dc, jc] = each(&|x| opt(x.event_to_commit_s(), 3));
    row(
        out,
        "request -> next commit s",
        ["-".into(), dc, jc],
        &[],
        None,
    );
}

/// Steps replayed and bytes copied.
fn tail_rows(out: &mut String, r: &Report, m: &Membership, failures: &[Recovery]) {
    let check = |name: &str| r.checks.iter().find(|c| c.name == name);
    let each = |f: &dyn Fn(&Recovery) -> String| cells(&[m.drain.as_ref(), m.join.as_ref()], f);
    let [dc, jc] = each(&|x| x.replayed_steps.to_string());
    let replayed: u64 = failures.iter().map(|x| x.replayed_steps).sum();
    row(
        out,
        "steps replayed",
        [replayed.to_string(), dc, jc],
        &[
            check("drain: steps replayed"),
            check("join: steps replayed"),
        ],
        Some("0"),
    );
    let [dc, jc] = each(&|x| {
        format!(
            "{} / {}",
            num(x.copy_bytes as f64 / 1e6, 1),
            num(x.planned_bytes as f64 / 1e6, 1)
        )
    });
    let got: u64 = failures.iter().map(|x| x.copy_bytes).sum();
    let planned: u64 = failures.iter().map(|x| x.planned_bytes).sum();
    let all = format!(
        "{} / {} (all)",
        num(got as f64 / 1e6, 1),
        num(planned as f64 / 1e6, 1)
    );
    row(
        out,
        "MB copied (received / planned)",
        [all, dc, jc],
        &[],
        None,
    );
}

/// The drain's cell and the join's, "-" for one that did not happen.
fn cells(planned: &[Option<&Recovery>; 2], f: &dyn Fn(&Recovery) -> String) -> [String; 2] {
    planned.map(|x| x.map_or_else(|| "-".into(), f))
}

/// One phase of a `resumed` event.
type PhaseOf = fn(&Phases) -> Option<f64>;

/// The phases, each a row.
fn phase_rows(out: &mut String, failures: &[Recovery], planned: &[Option<&Recovery>; 2]) {
    let rows: [(&str, PhaseOf, usize); 6] = [
        ("request -> boundary s (wait)", |p| p.wait_boundary_s, 3),
        ("detect s", |p| Some(p.detect_s), 3),
        ("decide s", |p| Some(p.decide_s), 4),
        ("restart s", |p| Some(p.restart_s), 3),
        ("connect + copy s", |p| Some(p.connect_copy_s), 3),
        ("first step s", |p| Some(p.first_step_s), 3),
    ];
    for (label, f, digits) in rows {
        let [dc, jc] = cells(planned, &|x| opt(x.phases.as_ref().and_then(f), digits));
        let fc = stat(over(failures, |x| x.phases.as_ref().and_then(f)), digits);
        row(out, label, [fc, dc, jc], &[], None);
    }
}

fn notes(o: &mut String, r: &Report, m: &Membership) {
    let p = &m.plan;
    let agent = match (m.outcome.agent_pid, m.outcome.agent_exit_s) {
        // Looked for right after train's exit: gone at once means gone before.
        (Some(pid), Some(s)) if s < 0.05 => format!("its agent (pid {pid}) exited with train"),
        (Some(pid), Some(s)) => format!("its agent (pid {pid}) exited {s:.1} s after train"),
        (Some(pid), None) => format!("its agent (pid {pid}) did NOT exit after train"),
        _ => "no agent started".into(),
    };
    let joined = m
        .joined_node
        .map_or("a node".into(), |n| format!("node {n}"));
    let _ = writeln!(
        o,
        "\nDrain + join run: `oobleck drain {}` once step {} committed, `oobleck add-node` once \
         step {} did ({joined} registered; {agent}); train --join-after 0, so that the join is \
         taken at the next boundary.",
        p.drain_node, p.drain_after, p.join_after
    );
    let _ = writeln!(
        o,
        "Cost = boundary -> next commit - the fault-free median step time ({} s): the training \
         time lost. Targets: a drain costs < {DRAIN_COST_S} s, a join < {JOIN_COST_S} s, i.e. \
         boundary -> next commit < {DRAIN_COST_S} s / {JOIN_COST_S} s + that step. Request -> \
         next commit adds the wait for the boundary (up to a step by design; the job trains \
         meanwhile; a join's from its registration) and is not checked.",
        opt(m.step_s, 3)
    );
    if [m.drain_cost_s, m.join_cost_s]
        .iter()
        .flatten()
        .any(|&c| c < 0.0)
    {
        let _ = writeln!(
            o,
            "A negative cost: the first step after the reconfiguration ran faster than a \
             fault-free one (fewer nodes, or smaller pipelines, sharing the cores)."
        );
    }
    for refusal in &m.refusals {
        let _ = writeln!(o, "**A drain was refused**: {refusal}");
    }
    if r.runs
        .iter()
        .any(|s| s.kind == RunKind::Membership && !s.ok)
    {
        let _ = writeln!(
            o,
            "(the drain + join run failed: its targets are not checked)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::super::membership::tests::membership;
    use super::super::table;

    #[test]
    fn every_row_has_its_columns_and_the_checks_show() {
        let (mb, m) = membership(1.8, 2.6);
        let mut report = table::report_with(vec![2, 2], mb.clone());
        report.checks = super::super::membership::membership_checks(&report.runs[0], &mb, &m);
        report.membership = Some(m);
        let text = table::render(&report);
        let rows = table::section_rows(&text, "| planned reconfiguration", 1, 7);
        let find = |p: &str| table::row_starting(&rows, p);
        // Over a fault-free step of 1 s: the drain costs 0.8 s, the join 1.6 s, a miss.
        assert!(find("| boundary -> next commit s").ends_with("| PASS, MISS |"));
        assert!(find("| cost: ").contains("| 0.800 | 1.600 |"));
        assert!(find("| steps replayed").ends_with("| 0 | PASS, PASS |"));
        assert!(find("| request -> next commit s").contains("| 2.400 | 3.000 |"));
        assert!(text.contains("`oobleck drain 3` once step 3 committed"));
    }
}
