//! The hang run's table: the stop, its detection and recovery, and the watchdog's cost per
//! step, with the targets of [`super::hang`] and notes on the clocks.

use std::fmt::Write;

use super::hang::{Hang, COST_PCT, DETECT_FLOOR_S, DETECT_STEPS, POLL_MS, RECENT_STEPS};
use super::summary::RunKind;
use super::table::{num, opt, row, row_as};
use super::Report;

/// The table and its notes.
pub fn render(r: &Report, h: &Hang) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| hang: one worker SIGSTOPped mid-step | measured | target | check |\n|---|---|---|---|"
    );
    let o = &h.observed;
    let who = match (o.pid, o.stopped_after) {
        (Some(pid), Some(after)) => format!(
            "node {} (rank {}, pid {pid}), {} s after step {after} committed",
            h.plan.node,
            o.rank.map_or("?".into(), |r| r.to_string()),
            opt(o.into_step_s, 2)
        ),
        _ => "-".into(),
    };
    row(&mut out, r, "worker stopped", who, None);
    let found = h.event.as_ref().map_or("-".into(), |e| {
        format!(
            "rank {} {} in {}: no progress for {} s, limit {} s",
            e.rank,
            if e.stopped { "stopped" } else { "hung" },
            e.what,
            num(e.for_s, 3),
            num(e.limit_s, 3)
        )
    });
    row(&mut out, r, "watchdog's hang event", found, None);
    time_rows(&mut out, r, h);
    cost_rows(&mut out, r, h);
    notes(&mut out, r, h);
    out
}

/// The median step, the times from the stop, and the steps replayed.
fn time_rows(out: &mut String, r: &Report, h: &Hang) {
    let o = &h.observed;
    row(
        out,
        r,
        "median step before the stop s",
        opt(h.step_s, 3),
        None,
    );
    row(
        out,
        r,
        &format!("... of the last {RECENT_STEPS} (the watchdog's window) s"),
        opt(h.recent_step_s, 3),
        None,
    );
    row(
        out,
        r,
        "SIGSTOP -> hang event s",
        opt(o.detected_s, 3),
        Some("hang: SIGSTOP -> detected (s)"),
    );
    row(
        out,
        r,
        "SIGSTOP -> stopped process gone s",
        opt(o.gone_s, 3),
        None,
    );
    let since = h.recovery.as_ref().and_then(|x| x.since_failure_s);
    row(
        out,
        r,
        "hang at the master -> next commit s (job's since_failure_s)",
        opt(since, 3),
        None,
    );
    let next = match (o.next_commit_s, o.next_commit_step) {
        (Some(s), Some(step)) => format!("{} (step {step})", num(s, 3)),
        _ => "-".into(),
    };
    row(out, r, "SIGSTOP -> next commit s", next, None);
    let replayed = h
        .recovery
        .as_ref()
        .map_or("-".into(), |x| x.replayed_steps.to_string());
    row_as(
        out,
        r,
        "steps replayed",
        replayed,
        Some("hang: steps replayed"),
        Some("0"),
    );
}

/// The watchdog's cost per step and its parts.
fn cost_rows(out: &mut String, r: &Report, h: &Hang) {
    let c = &h.costs;
    row(
        out,
        r,
        "marks per step (busiest rank, median)",
        opt(h.marks_per_step, 0),
        None,
    );
    row(out, r, "one mark ns", num(c.mark_ns, 1), None);
    row(
        out,
        r,
        "beats per step (median step / beat period)",
        opt(h.beats_per_step, 1),
        None,
    );
    row(
        out,
        r,
        "one beat µs (snapshot + serialise + write)",
        num(c.beat_us, 2),
        None,
    );
    row(out, r, "watchdog cost per step ms", opt(h.cost_ms, 4), None);
    row(
        out,
        r,
        "watchdog cost / median step %",
        opt(h.cost_pct, 4),
        Some("hang: watchdog cost / step (%)"),
    );
}

fn notes(o: &mut String, r: &Report, h: &Hang) {
    let _ = writeln!(
        o,
        "\nHang run: SIGSTOP to the worker of node {} once step {} committed and half a median \
         step more passed (`kill -STOP` took {} ms). Target: detected within max({DETECT_STEPS} \
         x the median step before the stop, {DETECT_FLOOR_S} s) = {} s, no step replayed, the \
         watchdog's cost < {COST_PCT} % of that step.",
        h.plan.node,
        h.plan.after_step,
        opt(h.observed.signal_ms, 1),
        opt(h.detect_limit_s, 3)
    );
    let _ = writeln!(
        o,
        "Clocks: SIGSTOP -> ... on the bench's clock, from just before `kill -STOP` to the line \
         seen in events.jsonl / metrics.jsonl (polled every {POLL_MS} ms: late by at most that \
         and the write, never early); `no progress for` is the agent's clock, since the \
         worker's last mark; since_failure_s the master's, from its receipt of the hang."
    );
    let _ = writeln!(
        o,
        "Cost: marks per step from the job's metrics.jsonl (each mark's entry and exit count); \
         one mark and one beat timed here over many of each with the real Progress and \
         progress line; the beat thread runs beside the compute, so counting it is an upper \
         bound."
    );
    if let (Some(e), Some(target)) = (&h.event, h.detect_limit_s) {
        let over = if e.limit_s > target + 1e-3 {
            " over the target: a --hang-timeout above it (or, for a worker that beat but did not \
             move, 3 of the watchdog's own median steps above the bench's), and detection at its \
             limit misses"
        } else {
            ""
        };
        let _ = writeln!(
            o,
            "Detection by design: the agent declares a worker stopped once it has heard no beat \
             for --hang-timeout (1.5 s by default, whatever the step time); the last beat left \
             up to 50 ms (working) or 500 ms (waiting on a peer, no progress) before the stop, \
             so detection lands between the limit - 0.5 s and the limit + the agent's next \
             look. Its limit here: {} s, against the target's {} s{over}.",
            num(e.limit_s, 3),
            num(target, 3)
        );
    }
    let o2 = &h.observed;
    if let (Some(c), Some(d)) = (o2.next_commit_s, o2.detected_s) {
        if c < d {
            let _ = writeln!(
                o,
                "**A step committed before the hang was found**: the stop landed outside the \
                 step's work (waiting for its commit), which the watchdog does not watch."
            );
        }
    }
    if h.marks_per_step.is_none() {
        let _ = writeln!(
            o,
            "**No marks per step**: the job's metrics.jsonl carries no per-rank times, so the \
             cost is not checked."
        );
    }
    if r.runs.iter().any(|s| s.kind == RunKind::Hang && !s.ok) {
        let _ = writeln!(o, "(the hang run failed: its targets are not checked)");
    }
}

#[cfg(test)]
mod tests {
    use super::super::hang::{hang_checks, tests::hang};
    use super::super::table;

    #[test]
    fn every_row_has_its_columns_and_the_checks_show() {
        let (hs, h) = hang(3.4);
        let mut report = table::report_with(vec![2, 2], hs.clone());
        report.checks = hang_checks(&hs, &h);
        report.hang = Some(h);
        let text = table::render(&report);
        let rows = table::section_rows(&text, "| hang: one worker", 2, 5);
        let find = |p: &str| table::row_starting(&rows, p);
        // 3.4 s against max(3 x 1 s, 2 s): a miss.
        assert!(find("| SIGSTOP -> hang event s").ends_with("| 3.400 | < 3.00 | MISS |"));
        assert!(find("| steps replayed").ends_with("| 0 | 0 | PASS |"));
        assert!(find("| watchdog cost / median step %").ends_with("| 0.0105 | < 0.50 | PASS |"));
        assert!(find("| watchdog's hang event").contains("stopped in the forward"));
    }
}
