//! The standby run's table: the kill, the standby's take-over and the recovery in place after
//! it, what keeping the standby cost the steps before, with the targets of [`super::standby`]
//! and notes on the clocks.

use std::fmt::Write;

use super::master::{LEASE_S, POLL_MS};
use super::readoption_table;
use super::standby::{Takeover, COST_PCT};
use super::summary::RunKind;
use super::table::{num, opt, row};
use super::Report;

/// The table and its notes.
pub fn render(r: &Report, t: &Takeover) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| standby: train SIGKILLed, its standby takes over | measured | target | check \
         |\n|---|---|---|---|"
    );
    let o = &t.observed;
    let who = match (o.pid, o.killed_after) {
        (Some(pid), Some(after)) => format!(
            "pid {pid} after step {after} committed; the copy's committed.json: step {}; \
             agents running after: {} of {}; standby pid {} running: {}",
            o.recorded_step.map_or("-".into(), |s| s.to_string()),
            o.agents_alive,
            o.agents,
            o.standby_pid.map_or("-".into(), |p| p.to_string()),
            if o.standby_alive { "yes" } else { "no" }
        ),
        _ => "-".into(),
    };
    row(&mut out, r, "master killed", who, None);
    time_rows(&mut out, r, t);
    let metrics = "the copy's metrics.jsonl";
    readoption_table::loss_rows(&mut out, r, (&t.readoption, "standby"), metrics);
    cost_rows(&mut out, r, t);
    notes(&mut out, r, t);
    out
}

/// From the kill, on the bench's clock and the job's.
fn time_rows(out: &mut String, r: &Report, t: &Takeover) {
    let o = &t.observed;
    let by = match (t.reattach_pid, o.standby_pid) {
        (Some(a), Some(b)) if a == b => format!("{} (the standby, pid {a})", opt(o.reattach_s, 3)),
        (a, _) => format!(
            "{} (pid {}: not the standby's)",
            opt(o.reattach_s, 3),
            a.map_or("-".into(), |p| p.to_string())
        ),
    };
    row(out, r, "SIGKILL -> the copy's reattach event s", by, None);
    let away = opt(t.readoption.without_master_s, 3);
    row(out, r, "agents without a master s (max)", away, None);
    readoption_table::time_rows(
        out,
        r,
        (&t.readoption, "standby"),
        (o.next_commit_s, o.next_commit_step),
        "re-adoption -> next commit s (since_failure_s)",
    );
}

/// The standby's cost per step: the master's own time on it, and end to end.
fn cost_rows(out: &mut String, r: &Report, t: &Takeover) {
    let per_commit = t.cost.map_or("-".into(), |c| {
        format!(
            "{} / {} / {} ({} commits)",
            num(c.commit_mean_ms, 3),
            num(c.commit_median_ms, 3),
            num(c.commit_max_ms, 3),
            c.commits
        )
    });
    let label = "commit: records to the standby, acknowledged ms (mean / median / max)";
    row(out, r, label, per_commit, None);
    let mirror = opt(t.cost.map(|c| c.mirror_ms), 3);
    row(
        out,
        r,
        "files mirrored between commits ms per commit",
        mirror,
        None,
    );
    let e2e = format!(
        "{} with / {} without: {} %",
        opt(t.with_standby_s, 4),
        opt(t.without_s, 4),
        opt(t.end_to_end_pct, 2)
    );
    let label = format!(
        "median step s, steps 2..={} (end to end)",
        t.plan.after_step
    );
    row(out, r, &label, e2e, None);
    let (pct, what) = t.checked_pct();
    let label = format!("cost / fault-free median step % ({what})");
    row(
        out,
        r,
        &label,
        opt(pct, 4),
        Some("standby: its cost / step (%)"),
    );
}

fn notes(o: &mut String, r: &Report, t: &Takeover) {
    let _ = writeln!(
        o,
        "\nStandby run: `train --standby-masters 1` (--master-wait {} s), `train` (the master \
         only) SIGKILLed once step {} committed, nothing started by the bench: the standby \
         takes over from its copy. Target: SIGKILL -> next commit under the master's lease \
         ({LEASE_S} s: the new master's start and the agents' next try) + the fault-free \
         median step (the aborted step) = {} s; every agent back, no step replayed, no \
         checkpoint loaded, every step once in the copy's metrics.jsonl; the standby's cost \
         under {COST_PCT} % of a step.",
        t.plan.master_wait_s,
        t.plan.after_step,
        opt(t.readoption.takeover_limit_s, 3)
    );
    let _ = writeln!(
        o,
        "Clocks: SIGKILL -> ... on the bench's clock, to the line seen in the copy's \
         events.jsonl / metrics.jsonl (polled every {POLL_MS} ms: late by at most that and \
         the write, never early). Cost: the killed master's standby_cost events (each a window \
         of commits; the median is the windows' median of medians), its time on the standby \
         per commit over the fault-free median step; end to end: the same steps of two runs \
         at different times, which on a shared machine differ by more than the cost (the \
         standby process's own work shows only there)."
    );
    if t.observed.group_gone_s.is_none() && t.observed.pid.is_some() {
        let _ = writeln!(
            o,
            "**The job's agents or workers did not exit after the new master**: the bench \
             killed them."
        );
    }
    if r.runs.iter().any(|s| s.kind == RunKind::Standby && !s.ok) {
        let _ = writeln!(
            o,
            "(the standby run failed: its targets but the cost's are not checked)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::super::standby::{standby_checks, tests::takeover};
    use super::super::table;

    #[test]
    fn every_row_has_its_columns_and_the_checks_show() {
        let costs = "{\"event\":\"standby_cost\",\"standbys\":1,\"commits\":20,\
                     \"commit_mean_ms\":2.0,\"commit_median_ms\":1.5,\"commit_max_ms\":8.0,\
                     \"mirror_ms\":60.0}\n";
        let (ss, t) = takeover(4.5, "null", &[1, 2, 3, 4, 5, 6, 7, 8], costs);
        let mut report = table::report_with(vec![1, 1], ss.clone());
        report.checks = standby_checks(&ss, &t);
        report.standby = Some(t);
        let text = table::render(&report);
        let rows = table::section_rows(&text, "| standby: train SIGKILLed", 2, 5);
        let find = |p: &str| table::row_starting(&rows, p);
        // 4.5 s against 3 s + 1 s: a miss.
        assert!(find("| SIGKILL -> next commit s").ends_with("| 4.500 (step 5) | < 4.00 | MISS |"));
        assert!(find("| SIGKILL -> the copy's").contains("| 0.400 (the standby, pid 20) |"));
        assert!(find("| agents back").ends_with("| 2 of 2 | >= 2.00 | PASS |"));
        assert!(find("| steps replayed").ends_with("| 0 | 0 | PASS |"));
        assert!(find("| checkpoint loaded").ends_with("| none (in place) | none | PASS |"));
        let once = "| every step once | every step once | PASS |";
        assert!(find("| the copy's metrics.jsonl").ends_with(once));
        assert!(find("| commit: records").contains("| 2.000 / 1.500 / 8.000 (20 commits) |"));
        assert!(find("| files mirrored").contains("| 3.000 |"));
        assert!(find("| median step s, steps 2..=4").contains("| 1.0200 with / 1.0000 without"));
        let cost = find("| cost / fault-free median step % (the master's time on it)");
        assert!(cost.ends_with("| 0.5000 | < 1.00 | PASS |"), "{cost}");
        assert!(find("| master killed").contains("standby pid 20 running: yes"));
    }
}
