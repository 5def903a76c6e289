//! The master run's table: the kill, the restarted master's take-over and the recovery in
//! place after it, the commit record's cost per step, with the targets of [`super::master`]
//! and notes on the clocks.

use std::fmt::Write;

use super::master::{MasterRestart, LEASE_S, POLL_MS, RECORD_PCT};
use super::readoption_table;
use super::summary::RunKind;
use super::table::{num, opt, row};
use super::Report;

/// The table and its notes.
pub fn render(r: &Report, m: &MasterRestart) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| master: train SIGKILLed, `train --resume --reattach` | measured | target | check \
         |\n|---|---|---|---|"
    );
    let o = &m.observed;
    let who = match (o.pid, o.killed_after) {
        (Some(pid), Some(after)) => format!(
            "pid {pid} after step {after} committed; committed.json: step {}; agents running \
             after: {} of {}",
            o.recorded_step.map_or("-".into(), |s| s.to_string()),
            o.agents_alive,
            o.agents
        ),
        _ => "-".into(),
    };
    row(&mut out, r, "master killed", who, None);
    time_rows(&mut out, r, m);
    readoption_table::loss_rows(&mut out, r, (&m.readoption, "master"), "metrics.jsonl");
    record_rows(&mut out, r, m);
    notes(&mut out, r, m);
    out
}

/// From the kill, on the bench's clock and the job's.
fn time_rows(out: &mut String, r: &Report, m: &MasterRestart) {
    let o = &m.observed;
    let s = |label: &str, x: Option<f64>| (label.to_string(), opt(x, 3));
    for (label, value) in [
        s(
            "SIGKILL -> restarted master spawned s (the bench's gap)",
            o.spawned_s,
        ),
        s("SIGKILL -> its reattach event s", o.reattach_s),
        s(
            "agents without a master s (max of the returned events)",
            m.readoption.without_master_s,
        ),
    ] {
        row(out, r, &label, value, None);
    }
    readoption_table::time_rows(
        out,
        r,
        (&m.readoption, "master"),
        (o.next_commit_s, o.next_commit_step),
        "re-adoption -> next commit s (job's since_failure_s)",
    );
}

/// The commit record's write and its share of a step.
fn record_rows(out: &mut String, r: &Report, m: &MasterRestart) {
    let what = m.record.map_or("-".into(), |c| {
        format!(
            "{} / {} ({} writes of {} B, {} metrics line(s))",
            num(c.median_us, 1),
            num(c.p99_us, 1),
            c.writes,
            c.bytes,
            c.lines
        )
    });
    row(out, r, "commit record write µs (median / p99)", what, None);
    row(
        out,
        r,
        "commit record / fault-free median step %",
        opt(m.record_pct, 4),
        Some("master: commit record / step (%)"),
    );
}

fn notes(o: &mut String, r: &Report, m: &MasterRestart) {
    let _ = writeln!(
        o,
        "\nMaster run: `train` (the master only; its agents and workers live on, --master-wait \
         {} s) SIGKILLed once step {} committed, `train --resume RUN --reattach` started at \
         once. Target: SIGKILL -> next commit under the master's lease ({LEASE_S} s: the \
         restart and the agents' next try) + the fault-free median step (the aborted step) + \
         the bench's gap = {} s; every agent back, no step replayed, no checkpoint loaded, \
         every step once in metrics.jsonl; the commit record under {RECORD_PCT} % of a step.",
        m.plan.master_wait_s,
        m.plan.after_step,
        opt(m.readoption.takeover_limit_s, 3)
    );
    let _ = writeln!(
        o,
        "Clocks: SIGKILL -> ... on the bench's clock, from just before `kill -KILL` to the \
         line seen in events.jsonl / metrics.jsonl (polled every {POLL_MS} ms: late by at most \
         that and the write, never early); `without a master` on each agent's clock; \
         since_failure_s and the phases on the restarted master's, from its re-adoption of \
         the agents. The record: CommitRecord::write (serialise, write, rename over) timed in \
         the bench over the run's last metrics lines, on the runs' file system, after the runs."
    );
    if m.observed.group_gone_s.is_none() && m.observed.pid.is_some() {
        let _ = writeln!(
            o,
            "**The lost master's agents or workers did not exit after the job**: the bench \
             killed them."
        );
    }
    if r.runs.iter().any(|s| s.kind == RunKind::Master && !s.ok) {
        let _ = writeln!(
            o,
            "(the master run failed: its targets but the record's are not checked)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::super::master::{master_checks, tests::master};
    use super::super::table;

    #[test]
    fn every_row_has_its_columns_and_the_checks_show() {
        let (ms, m) = master(4.5, "null", &[1, 2, 3, 4, 5, 6, 7, 8]);
        let mut report = table::report_with(vec![1, 1], ms.clone());
        report.checks = master_checks(&ms, &m);
        report.master = Some(m);
        let text = table::render(&report);
        let rows = table::section_rows(&text, "| master: train SIGKILLed", 2, 5);
        let find = |p: &str| table::row_starting(&rows, p);
        // 4.5 s against 3 s + 1 s + 0.05 s: a miss.
        assert!(find("| SIGKILL -> next commit s").ends_with("| 4.500 (step 5) | < 4.05 | MISS |"));
        assert!(find("| agents back").ends_with("| 2 of 2 | >= 2.00 | PASS |"));
        assert!(find("| steps replayed").ends_with("| 0 | 0 | PASS |"));
        assert!(find("| checkpoint loaded").ends_with("| none (in place) | none | PASS |"));
        assert!(find("| metrics.jsonl").ends_with("| every step once | every step once | PASS |"));
        assert!(find("| commit record / fault-free").ends_with("| 0.0025 | < 1.00 | PASS |"));
        assert!(find("| ... first step s").contains("| 0.900 |"));
        assert!(find("| master killed").contains("agents running after: 2 of 2"));
    }
}
