//! The hang run, its pure part: when the bench stops which worker (from the flags), what the
//! run and the bench saw of it, the watchdog's cost per step, and the targets.
//!
//! **The hang.** One job with no failure; once step `after_step` committed and half a median
//! step more has passed (so the worker is inside the next step, not waiting for a commit), the
//! bench sends SIGSTOP to the worker process of the highest node: its agent, its master and its
//! peers run on, as when a GPU kernel or a collective never returns. The worker's progress
//! beats stop with it, so its agent's watchdog finds it `stopped`, fences it (SIGKILL), and the
//! master, told by a `hang` event, recovers in place.
//!
//! **Clocks.** `events.jsonl` lines carry no time, so the bench times the hang on its own
//! clock: from just before its `kill -STOP` (the signal lands inside that command, whose length
//! the table shows) to the moment it sees the `hang` event in `events.jsonl`, and the next line
//! in `metrics.jsonl`, polling both every [`POLL_MS`] ms: each time is late by at most that
//! poll plus the file write, never early. The job's own numbers come beside them: the
//! watchdog's `for_s` (no progress for, on the agent's clock) and `limit_s`, and the recovery's
//! `since_failure_s` (the master's receipt of the hang -> the next commit, the master's clock).
//!
//! **Targets** (issue 16): detection within `max(3 x the median step time, 2 s)`, the median
//! taken over the steps before the stop (the table also shows the median of the last 16, the
//! watchdog's own window: where the load on the machine drifts, the two differ); no step
//! replayed; and the watchdog's cost under 0.5 % of a step, where
//!
//! ```text
//! cost per step = marks per step x one mark + beats per step x one beat
//!   marks per step: the busiest rank's progress marks (metrics.jsonl), median over the steps
//!   one mark:       Progress::enter + drop, timed here over many marks, per mark
//!   beats per step: median step / the beat period (50 ms: one beat each while it moves)
//!   one beat:       Snapshot + serialise + write to a pipe, timed here likewise
//! ```
//!
//! The beat runs on its own thread, beside the compute: counting it is an upper bound, right
//! where the workers share the cores.

use anyhow::{bail, Result};
use serde::Serialize;

use super::records::Event;
use super::summary::{check, step_time, Check, Recovery, RunInput, RunSummary};
use super::BenchRecoveryArgs;
use crate::bench::median;
use oobleck_core::runtime::wire::records::StepMetrics;

/// The floor of the detection target, s: the issue's "or 2 s" (`--hang-timeout`'s default,
/// 1.5 s, is under it).
pub const DETECT_FLOOR_S: f64 = 2.0;
/// Detection within this many median steps (the issue's "3x the median step time").
pub const DETECT_STEPS: f64 = 3.0;
/// The watchdog may cost this share of a step, %.
pub const COST_PCT: f64 = 0.5;
/// Steps of the recent median the table also shows: the watchdog's own window
/// (`STEP_WINDOW` in `oobleck-core/src/runtime/node/watchdog.rs`).
pub const RECENT_STEPS: usize = 16;
/// How often the bench looks at the run's files once the worker is stopped, ms.
pub const POLL_MS: u64 = 5;

/// Which worker the bench stops, and when (pure, from the flags).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HangPlan {
    /// The node whose worker is stopped: the highest, as the failures take.
    pub node: u32,
    /// The SIGSTOP goes out half a median step after this step committed.
    pub after_step: u64,
}

impl HangPlan {
    /// `None` with `--no-hang`. By default the stop half-way through the job, after step 60 of
    /// the default 120 (between the checkpoints of `--checkpoint-every 40`).
    pub fn new(a: &BenchRecoveryArgs) -> Result<Option<HangPlan>> {
        if a.no_hang {
            return Ok(None);
        }
        let after_step = a.hang_after_step.unwrap_or(a.steps / 2);
        // Steps 1..=3 give the median two gaps (step 1 holds the start); a commit must follow.
        if after_step < 3 || after_step + 2 > a.steps {
            bail!(
                "--hang-after-step {after_step}: between 3 and steps - 2 = {} (a median step \
                 before the stop, a commit after the recovery); pass --steps 5 or more, or \
                 --no-hang",
                a.steps.saturating_sub(2)
            );
        }
        Ok(Some(HangPlan {
            node: (a.nodes - 1) as u32,
            after_step,
        }))
    }
}

/// What the bench saw of the stop, on its own clock (seconds from just before `kill -STOP`).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Observed {
    /// The worker process stopped, and the rank it first had.
    pub pid: Option<u32>,
    pub rank: Option<u32>,
    /// The newest committed step when the SIGSTOP went out.
    pub stopped_after: Option<u64>,
    /// That step's commit seen -> the SIGSTOP, s.
    pub into_step_s: Option<f64>,
    /// How long `kill -STOP` took, ms (the signal landed inside it).
    pub signal_ms: Option<f64>,
    /// -> the `hang` event in `events.jsonl`.
    pub detected_s: Option<f64>,
    /// -> the stopped process gone (fenced by its agent).
    pub gone_s: Option<f64>,
    /// -> the next line in `metrics.jsonl`, and its step.
    pub next_commit_s: Option<f64>,
    pub next_commit_step: Option<u64>,
}

/// The watchdog's bookkeeping, timed in the bench process (`watchdog_cost`).
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct MarkCosts {
    /// One progress mark (half of an `enter` and its drop), ns.
    pub mark_ns: f64,
    /// One beat: snapshot, serialise, write and flush to a pipe, µs.
    pub beat_us: f64,
    /// The beat thread's period while the rank moves, s.
    pub beat_period_s: f64,
}

/// The job's `hang` event.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct HangEvent {
    pub node: u32,
    pub rank: u32,
    pub what: String,
    pub for_s: f64,
    pub limit_s: f64,
    pub stopped: bool,
}

/// The hang run's numbers, as the report carries them.
#[derive(Clone, Debug, Serialize)]
pub struct Hang {
    pub plan: HangPlan,
    pub observed: Observed,
    pub event: Option<HangEvent>,
    /// The recovery that followed it.
    pub recovery: Option<Recovery>,
    /// Median step time before the stop, s.
    pub step_s: Option<f64>,
    /// ... over the last [`RECENT_STEPS`] steps before it (the watchdog's window), s.
    pub recent_step_s: Option<f64>,
    /// `max(3 x step_s, 2 s)`.
    pub detect_limit_s: Option<f64>,
    /// The busiest rank's marks per step, median over the steps before the stop (`None`: the
    /// job's metrics do not carry them).
    pub marks_per_step: Option<f64>,
    pub costs: MarkCosts,
    pub beats_per_step: Option<f64>,
    /// The watchdog's cost per step, ms, and as a share of `step_s`, %.
    pub cost_ms: Option<f64>,
    pub cost_pct: Option<f64>,
}

impl Hang {
    /// From the run's records, what the bench saw, and the marks per step `marks` (step,
    /// the busiest rank's marks) read from its metrics.
    pub fn new(
        plan: &HangPlan,
        observed: Observed,
        costs: MarkCosts,
        run: &RunInput,
        summary: &RunSummary,
        marks: &[(u64, u64)],
    ) -> Hang {
        let events = || run.segments.iter().flat_map(|s| s.events.iter());
        let event = events().find_map(|e| match e {
            Event::Hang {
                node,
                rank,
                what,
                for_s,
                limit_s,
                stopped,
                ..
            } => Some(HangEvent {
                node: *node,
                rank: *rank,
                what: what.clone(),
                for_s: *for_s,
                limit_s: *limit_s,
                stopped: *stopped,
            }),
            _ => None,
        });
        let before = observed.stopped_after.unwrap_or(plan.after_step);
        let metrics: Vec<StepMetrics> = run
            .segments
            .first()
            .map(|s| s.metrics.iter().filter(|m| m.step <= before).cloned())
            .into_iter()
            .flatten()
            .collect();
        let step_s = step_time(&metrics);
        let recent = metrics.len().saturating_sub(RECENT_STEPS + 1);
        let recent_step_s = step_time(&metrics[recent..]);
        let before_marks: Vec<f64> = marks
            .iter()
            .filter(|(s, _)| *s >= 2 && *s <= before)
            .map(|&(_, m)| m as f64)
            .collect();
        let marks_per_step = (!before_marks.is_empty()).then(|| median(&before_marks));
        let beats_per_step = step_s.map(|s| s / costs.beat_period_s);
        let cost_ms = marks_per_step
            .zip(beats_per_step)
            .map(|(m, b)| m * costs.mark_ns * 1e-6 + b * costs.beat_us * 1e-3);
        Hang {
            plan: plan.clone(),
            observed,
            event,
            recovery: summary.recoveries.first().cloned(),
            step_s,
            recent_step_s,
            detect_limit_s: step_s.map(|s| (DETECT_STEPS * s).max(DETECT_FLOOR_S)),
            marks_per_step,
            costs,
            beats_per_step,
            cost_ms,
            cost_pct: cost_ms.zip(step_s).map(|(c, s)| c / (s * 1e3) * 100.0),
        }
    }
}

/// The targets of the hang run (none checked when it failed).
pub fn hang_checks(run: &RunSummary, h: &Hang) -> Vec<Check> {
    let ok = |x: Option<f64>| x.filter(|_| run.ok);
    let replayed = h.recovery.as_ref().map(|r| r.replayed_steps as f64);
    vec![
        check(
            "hang: SIGSTOP -> detected (s)",
            h.detect_limit_s.unwrap_or(f64::NAN),
            false,
            ok(h.observed.detected_s).filter(|_| h.detect_limit_s.is_some()),
        ),
        check("hang: steps replayed", 1.0, false, ok(replayed)),
        check(
            "hang: watchdog cost / step (%)",
            COST_PCT,
            false,
            ok(h.cost_pct),
        ),
    ]
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::membership::tests::summary;
    use super::super::plan::tests::args;
    use super::super::summary::RunKind;
    use super::*;

    #[test]
    fn defaults_stop_the_highest_nodes_worker_half_way() {
        let p = HangPlan::new(&args(&[])).unwrap().unwrap();
        assert_eq!((p.node, p.after_step), (3, 60));
        assert!(HangPlan::new(&args(&["--no-hang"])).unwrap().is_none());
        let e = HangPlan::new(&args(&["--hang-after-step", "2"])).unwrap_err();
        assert!(
            e.to_string().contains("between 3 and steps - 2 = 118"),
            "{e}"
        );
        assert!(HangPlan::new(&args(&["--hang-after-step", "119"])).is_err());
    }

    /// A hang of node 3's worker in step 5, recovered in place from step 4.
    pub(in super::super) const EVENTS: &str = "{\"event\":\"start\",\"step\":0,\"pid\":7}\n\
        {\"event\":\"process\",\"role\":\"worker\",\"pid\":9,\"node\":3,\"rank\":3}\n\
        {\"event\":\"hang\",\"generation\":0,\"node\":3,\"rank\":3,\"what\":\"the forward of \
        microbatch 1 of step 5\",\"for_s\":2.04,\"limit_s\":2.0,\"stopped\":true}\n\
        {\"event\":\"reconfig\",\"generation\":1,\"lost_nodes\":[],\"nodes\":[0,1,2,3],\
        \"failed_in_step\":5,\"from_step\":4,\"replayed_steps\":0,\"detect_s\":0.01,\
        \"checkpoint\":null,\"in_place\":true,\"new_pipelines\":[[0,1],[2,3]],\"cause\":\"worker rank 3 on node 3 \
        stopped\"}\n\
        {\"event\":\"resumed\",\"generation\":1,\"step\":5,\"since_failure_s\":1.5,\"copy_bytes\":0,\"phases\":\
        {\"detect_s\":0.01,\"decide_s\":0.0001,\"restart_s\":0.5,\"connect_copy_s\":0.3,\
        \"connect_max_s\":0.1,\"copy_max_s\":0.2,\"first_step_s\":0.7}}\n";

    pub(in super::super) fn hang(detected_s: f64) -> (RunSummary, Hang) {
        let plan = HangPlan {
            node: 3,
            after_step: 4,
        };
        let observed = Observed {
            pid: Some(9),
            rank: Some(3),
            stopped_after: Some(4),
            detected_s: Some(detected_s),
            ..Observed::default()
        };
        let costs = MarkCosts {
            mark_ns: 50.0,
            beat_us: 5.0,
            beat_period_s: 0.05,
        };
        let (input, s) = summary(RunKind::Hang, EVENTS, 8);
        // 100 marks a step on the busiest rank; step 1 (the start) and those after the stop
        // are left out.
        let marks = [(1, 900), (2, 100), (3, 100), (4, 100), (6, 5000)];
        let h = Hang::new(&plan, observed, costs, &input, &s, &marks);
        (s, h)
    }

    #[test]
    fn the_hang_its_recovery_and_the_watchdogs_cost_are_found() {
        let (s, h) = hang(2.1);
        let e = h.event.as_ref().unwrap();
        assert!(e.stopped && e.what.contains("step 5"), "{e:?}");
        assert_eq!(h.recovery.as_ref().unwrap().replayed_steps, 0);
        // Steps 1 s apart: the floor of 2 s is under 3 x 1 s.
        assert_eq!(h.step_s, Some(1.0));
        assert_eq!(h.recent_step_s, Some(1.0));
        assert_eq!(h.detect_limit_s, Some(3.0));
        assert_eq!(h.marks_per_step, Some(100.0));
        // 100 x 50 ns + 20 beats x 5 µs = 0.105 ms of a 1 s step.
        assert!((h.cost_ms.unwrap() - 0.105).abs() < 1e-9, "{h:?}");
        assert!((h.cost_pct.unwrap() - 0.0105).abs() < 1e-9, "{h:?}");
        let c = hang_checks(&s, &h);
        let pass: Vec<Option<bool>> = c.iter().map(|c| c.pass).collect();
        assert_eq!(pass, vec![Some(true), Some(true), Some(true)]);
        let (_, late) = hang(3.2);
        assert_eq!(hang_checks(&s, &late)[0].pass, Some(false));
    }

    #[test]
    fn without_marks_in_the_metrics_the_cost_is_unchecked() {
        let (s, mut h) = hang(2.1);
        h.marks_per_step = None;
        h.cost_pct = None;
        assert_eq!(hang_checks(&s, &h)[2].pass, None);
    }
}
