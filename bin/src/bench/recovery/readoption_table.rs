//! The rows the master run's table and the standby run's share: what both measure of a
//! re-adoption ([`Readoption`]), with their checks named `<prefix>: ...`.

use super::readoption::Readoption;
use super::records::Phases;
use super::table::{num, opt, row, row_as};
use super::Report;

/// The agents back, SIGKILL -> next commit (the bench's `next_commit_s` and its step), and the
/// recovery in place after the re-adoption (`since` labels the job's `since_failure_s`).
pub fn time_rows(
    out: &mut String,
    r: &Report,
    (ro, prefix): (&Readoption, &str),
    next_commit: (Option<f64>, Option<u64>),
    since: &str,
) {
    let back = format!("{} of {}", ro.returned, ro.nodes);
    let name = format!("{prefix}: agents back");
    row(out, r, "agents back", back, Some(&name));
    let next = match next_commit {
        (Some(x), Some(step)) => format!("{} (step {step})", num(x, 3)),
        _ => "-".into(),
    };
    let name = format!("{prefix}: SIGKILL -> next commit (s)");
    row(out, r, "SIGKILL -> next commit s", next, Some(&name));
    let rec = ro.recovery.as_ref();
    let phase = |f: fn(&Phases) -> f64| opt(rec.and_then(|x| x.phases).map(|p| f(&p)), 3);
    let since_s = opt(rec.and_then(|x| x.since_failure_s), 3);
    row(out, r, since, since_s, None);
    row(out, r, "... detect s", phase(|p| p.detect_s), None);
    row(out, r, "... decide s", phase(|p| p.decide_s), None);
    let copy = phase(|p| p.connect_copy_s);
    row(out, r, "... connect + copy s", copy, None);
    row(out, r, "... first step s", phase(|p| p.first_step_s), None);
}

/// What the take-over cost in steps and checkpoints; `metrics` labels the final
/// `metrics.jsonl`.
pub fn loss_rows(out: &mut String, r: &Report, (ro, prefix): (&Readoption, &str), metrics: &str) {
    let rec = ro.recovery.as_ref();
    let replayed = rec.map_or("-".into(), |x| x.replayed_steps.to_string());
    let name = format!("{prefix}: steps replayed");
    row_as(out, r, "steps replayed", replayed, Some(&name), Some("0"));
    let loaded = match (rec, ro.checkpoints_loaded.as_slice()) {
        (None, _) => "-".into(),
        (Some(x), []) if x.in_place => "none (in place)".into(),
        (Some(x), c) => format!("{} (in place: {})", c.join(", "), x.in_place),
    };
    let name = format!("{prefix}: checkpoints loaded");
    row_as(
        out,
        r,
        "checkpoint loaded",
        loaded,
        Some(&name),
        Some("none"),
    );
    let off = if ro.missing_steps.is_empty() && ro.repeated_steps.is_empty() {
        "every step once".to_string()
    } else {
        format!(
            "missing {:?}, twice {:?}",
            ro.missing_steps, ro.repeated_steps
        )
    };
    let name = format!("{prefix}: steps missing or twice");
    row_as(out, r, metrics, off, Some(&name), Some("every step once"));
}
