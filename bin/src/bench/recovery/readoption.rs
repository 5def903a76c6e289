//! What the master run and the standby run both measure of a re-adoption: a new master (the
//! restarted one, or the standby that took over) found the committed step, took the lost
//! master's agents back and went on in place. Both runs read it the same way from the new
//! master's segment (its events, the final `metrics.jsonl`) and check it against the same
//! targets; [`super::master`] and [`super::standby`] add what only they measure.

use serde::Serialize;

use super::master::LEASE_S;
use super::records::Event;
use super::summary::{check, Check, Recovery, RunInput, RunSummary};

/// The re-adoption, as both runs' reports carry it (flattened into them).
#[derive(Clone, Debug, Serialize)]
pub struct Readoption {
    /// The `reattach` event's step: the committed step the new master found.
    pub reattach_step: Option<u64>,
    /// `returned` events, and the nodes of the job (each should come back).
    pub returned: usize,
    pub nodes: usize,
    /// The longest an agent was without a master (the `returned` events), s.
    pub without_master_s: Option<f64>,
    /// The recovery in place after the re-adoption (the last `reconfig` and its `resumed`).
    pub recovery: Option<Recovery>,
    /// Checkpoints the new master loaded: the last `reconfig`'s, and any `resume`.
    pub checkpoints_loaded: Vec<String>,
    /// Steps of 1..=steps missing from the final `metrics.jsonl`, and steps in it more than
    /// once.
    pub missing_steps: Vec<u64>,
    pub repeated_steps: Vec<u64>,
    /// The fault-free run's median step, s.
    pub step_s: Option<f64>,
    /// `LEASE_S + step_s + the bench's gap` (the standby run has none: 0).
    pub takeover_limit_s: Option<f64>,
}

impl Readoption {
    /// From the run's records (the new master's events are its second segment), its summary,
    /// the job's nodes and steps, the fault-free median step `step_s` and the bench's gap
    /// between the kill and the new master (`None`: unknown, no limit).
    pub fn new(
        (run, summary): (&RunInput, &RunSummary),
        (nodes, steps): (usize, u64),
        step_s: Option<f64>,
        gap_s: Option<f64>,
    ) -> Readoption {
        let events = new_master_events(run);
        let back: Vec<f64> = events
            .iter()
            .filter_map(|e| match e {
                Event::Returned {
                    without_master_s, ..
                } => Some(*without_master_s),
                _ => None,
            })
            .collect();
        let (missing_steps, repeated_steps) = step_counts(run, steps);
        Readoption {
            reattach_step: reattach(events).map(|r| r.0),
            returned: back.len(),
            nodes,
            without_master_s: back.iter().copied().reduce(f64::max),
            recovery: summary.recoveries.last().cloned(),
            checkpoints_loaded: checkpoints_loaded(events),
            missing_steps,
            repeated_steps,
            step_s,
            takeover_limit_s: step_s.zip(gap_s).map(|(s, gap)| LEASE_S + s + gap),
        }
    }

    /// The targets both runs check, each named `<prefix>: ...` (none checked when the run
    /// failed); `next_commit_s` is the bench's SIGKILL -> next commit.
    pub fn checks(&self, prefix: &str, run: &RunSummary, next_commit_s: Option<f64>) -> Vec<Check> {
        let ok = |x: Option<f64>| x.filter(|_| run.ok);
        let replayed = self.recovery.as_ref().map(|r| r.replayed_steps as f64);
        let not_in_place = self.recovery.as_ref().map(|r| !r.in_place);
        let loaded = not_in_place.map(|n| (self.checkpoints_loaded.len() + n as usize) as f64);
        let steps_off = (self.missing_steps.len() + self.repeated_steps.len()) as f64;
        let name = |what: &str| format!("{prefix}: {what}");
        vec![
            check(
                &name("SIGKILL -> next commit (s)"),
                self.takeover_limit_s.unwrap_or(f64::NAN),
                false,
                ok(next_commit_s).filter(|_| self.takeover_limit_s.is_some()),
            ),
            check(
                &name("agents back"),
                self.nodes as f64,
                true,
                ok(Some(self.returned as f64)),
            ),
            check(&name("steps replayed"), 1.0, false, ok(replayed)),
            check(&name("checkpoints loaded"), 1.0, false, ok(loaded)),
            check(
                &name("steps missing or twice"),
                1.0,
                false,
                ok(Some(steps_off)),
            ),
        ]
    }
}

/// The new master's events: the run's second segment's (none before it started).
pub(super) fn new_master_events(run: &RunInput) -> &[Event] {
    run.segments.get(1).map_or(&[][..], |s| &s.events[..])
}

/// The first `reattach` event's step and pid.
pub(super) fn reattach(events: &[Event]) -> Option<(u64, Option<u32>)> {
    events.iter().find_map(|e| match e {
        Event::Reattach(start) => Some((start.step, start.pid)),
        _ => None,
    })
}

/// The checkpoints the new master loaded: a `resume` event's, and the last `reconfig`'s
/// (in place, it names none).
fn checkpoints_loaded(events: &[Event]) -> Vec<String> {
    let resumed = events.iter().filter_map(|e| match e {
        Event::Resume(start) => Some(start.checkpoint.clone().unwrap_or_else(|| "?".into())),
        _ => None,
    });
    let reconfig = events.iter().rev().find_map(|e| match e {
        Event::Reconfig { checkpoint, .. } => Some(checkpoint.clone()),
        _ => None,
    });
    resumed.chain(reconfig.flatten()).collect()
}

/// The steps of 1..=steps missing from the run's final `metrics.jsonl`, and those in it twice.
fn step_counts(run: &RunInput, steps: u64) -> (Vec<u64>, Vec<u64>) {
    let mut seen = std::collections::BTreeMap::<u64, usize>::new();
    for m in run.segments.last().map_or(&[][..], |s| &s.metrics[..]) {
        *seen.entry(m.step).or_default() += 1;
    }
    let missing = (1..=steps).filter(|s| !seen.contains_key(s)).collect();
    let repeated = seen
        .iter()
        .filter(|(_, &n)| n > 1)
        .map(|(&s, _)| s)
        .collect();
    (missing, repeated)
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::records::{parse_events, parse_metrics};
    use super::super::summary::{summarize, Job, RunKind, Segment};
    use super::*;

    /// A run of 8 steps of the master run or the standby run from its two segments' events
    /// and metrics (the second starting `gap_s` after the kill), and its summary.
    pub(in super::super) fn killed_run(
        kind: RunKind,
        first: (&str, &str),
        second: (&str, &str),
        gap_s: f64,
    ) -> (RunInput, RunSummary) {
        let seg = |(events, m): (&str, &str), gap_s| Segment {
            wall_s: 5.0,
            gap_s,
            events: parse_events(events).unwrap(),
            metrics: parse_metrics(m).unwrap(),
            load_1m: None,
        };
        let input = RunInput {
            kind,
            segments: vec![seg(first, 0.0), seg(second, gap_s)],
            error: None,
        };
        let job = Job {
            steps: 8,
            tokens_per_step: 100,
            failures: 0,
        };
        let s = summarize(&input, &job);
        (input, s)
    }
}
