//! From the records of the three runs to their numbers and the spec's targets (pure: no files,
//! clocks or processes; the runs' wall times come in measured).

use serde::Serialize;

use super::records::{Event, Phases};
use crate::bench::median;
use oobleck_core::runtime::wire::records::StepMetrics;

/// The three ways of running the same job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RunKind {
    FaultFree,
    InPlace,
    CheckpointRestart,
    /// A drain and a join from outside (`oobleck drain`, `oobleck add-node`), no failure.
    Membership,
    /// One worker stopped with SIGSTOP mid-step, no other failure.
    Hang,
    /// The master SIGKILLed and restarted with `--reattach`, no other failure.
    Master,
    /// The master of a job with one standby master SIGKILLed; the standby takes over.
    Standby,
}

impl RunKind {
    pub fn label(self) -> &'static str {
        match self {
            RunKind::FaultFree => "fault-free",
            RunKind::InPlace => "in place",
            RunKind::CheckpointRestart => "checkpoint restart",
            RunKind::Membership => "drain + join",
            RunKind::Hang => "hang",
            RunKind::Master => "master restart",
            RunKind::Standby => "standby take-over",
        }
    }
}

/// One `train` process of a run, as measured by the bench.
#[derive(Clone, Debug, Default)]
pub struct Segment {
    /// Spawn to exit, seconds.
    pub wall_s: f64,
    /// The previous segment's exit to this one's spawn, seconds (0 for the first).
    pub gap_s: f64,
    /// The events this process added to `events.jsonl`.
    pub events: Vec<Event>,
    /// `metrics.jsonl` right after this process exited (a resume drops the lines after its
    /// checkpoint, so this is the run's history up to here).
    pub metrics: Vec<StepMetrics>,
    /// The 1-minute load average when it started (other work on the machine skews times).
    pub load_1m: Option<f64>,
}

/// What a run left: its processes, and what went wrong if something did.
#[derive(Clone, Debug)]
pub struct RunInput {
    pub kind: RunKind,
    pub segments: Vec<Segment>,
    pub error: Option<String>,
}

/// The job the three runs share.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Job {
    pub steps: u64,
    /// Global batch x sequence length.
    pub tokens_per_step: u64,
    /// Failures injected in the in-place and restart runs.
    pub failures: usize,
}

/// Median and maximum of a few samples.
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct Stat {
    pub median: f64,
    pub max: f64,
    pub n: usize,
}

impl Stat {
    pub fn of(xs: &[f64]) -> Option<Stat> {
        (!xs.is_empty()).then(|| Stat {
            median: median(xs),
            max: xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            n: xs.len(),
        })
    }
}

/// One recovery in place: its `reconfig` and the `resumed` at the first commit after it.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Recovery {
    /// What caused it, in words (the `reconfig` event's `cause`).
    pub cause: String,
    pub lost_nodes: Vec<u32>,
    pub joined_nodes: Vec<u32>,
    pub drained_nodes: Vec<u32>,
    pub from_step: u64,
    pub in_place: bool,
    pub replayed_steps: u64,
    pub copies: u64,
    /// Bytes the ranks received (the `resumed` event).
    pub copy_bytes: u64,
    /// Bytes the plan copies (the `reconfig` event).
    pub planned_bytes: u64,
    pub since_failure_s: Option<f64>,
    pub phases: Option<Phases>,
}

impl Recovery {
    /// decide + restart + connect_copy: the time the spec bounds to 1 s.
    pub fn reconfigure_s(&self) -> Option<f64> {
        self.phases
            .map(|p| p.decide_s + p.restart_s + p.connect_copy_s)
    }

    /// A join or drain: its request (or registration) -> the next commit, i.e. the wait for
    /// the step boundary plus boundary -> next commit.
    pub fn event_to_commit_s(&self) -> Option<f64> {
        Some(self.phases?.wait_boundary_s? + self.since_failure_s?)
    }

    pub fn copy_gb_per_s(&self) -> Option<f64> {
        let p = self.phases?;
        (self.copy_bytes > 0 && p.copy_max_s > 0.0)
            .then(|| self.copy_bytes as f64 / p.copy_max_s / 1e9)
    }
}

/// One stop and restart of the checkpoint-restart run.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Restart {
    /// The step after which the node was killed.
    pub failed_after: u64,
    /// The checkpoint the next process resumed from (0: none, a fresh start).
    pub resumed_from: u64,
    /// Committed steps lost and computed again.
    pub lost_steps: u64,
    /// The failure to the first commit of the restarted job (approximate: the two processes'
    /// start-up before their clocks start is taken to be equal).
    pub to_first_commit_s: Option<f64>,
    /// The failure to the restarted job committing `failed_after` again.
    pub to_regained_s: Option<f64>,
}

/// A run's numbers.
#[derive(Clone, Debug, Serialize)]
pub struct RunSummary {
    pub kind: RunKind,
    pub ok: bool,
    /// `ok`, or what failed.
    pub status: String,
    /// All its processes, spawn to exit, and the gaps between them.
    pub wall_s: f64,
    /// Distinct steps committed (the run's last step).
    pub unique_steps: u64,
    pub replayed_steps: u64,
    pub steps_per_s: f64,
    pub tokens_per_s: f64,
    /// Effective throughput over that of the fault-free run / of the checkpoint restart.
    pub vs_fault_free: Option<f64>,
    pub vs_restart: Option<f64>,
    /// Median time between two consecutive commits of one generation.
    pub step_s: Option<f64>,
    pub checkpoint_stall_ms: Option<Stat>,
    /// Mean over its processes of the load average at their start.
    pub load_1m: Option<f64>,
    pub recoveries: Vec<Recovery>,
    pub restarts: Vec<Restart>,
}

/// The committed step of the newest metrics line (0 for none).
fn last_step(metrics: &[StepMetrics]) -> u64 {
    metrics.iter().map(|m| m.step).max().unwrap_or(0)
}

/// The run's numbers, the ratios to the other runs left for [`compare`].
pub fn summarize(run: &RunInput, job: &Job) -> RunSummary {
    let wall_s: f64 = run.segments.iter().map(|s| s.wall_s + s.gap_s).sum();
    let last = run.segments.last();
    let unique_steps = last.map_or(0, |s| last_step(&s.metrics));
    let ok = run.error.is_none() && unique_steps >= job.steps;
    let status = match &run.error {
        Some(e) => e.clone(),
        None if unique_steps < job.steps => {
            format!("stopped at step {unique_steps} of {}", job.steps)
        }
        None => "ok".to_string(),
    };
    let events = || run.segments.iter().flat_map(|s| s.events.iter());
    let stalls: Vec<f64> = events()
        .filter_map(|e| match e {
            Event::Checkpoint { stall_ms, .. } => Some(*stall_ms),
            _ => None,
        })
        .collect();
    let recoveries = recoveries(events());
    let restarts = restarts(&run.segments);
    let replayed_steps = recoveries.iter().map(|r| r.replayed_steps).sum::<u64>()
        + restarts.iter().map(|r| r.lost_steps).sum::<u64>();
    let loads: Vec<f64> = run.segments.iter().filter_map(|s| s.load_1m).collect();
    let per_s = |x: f64| if wall_s > 0.0 { x / wall_s } else { 0.0 };
    RunSummary {
        kind: run.kind,
        ok,
        status,
        wall_s,
        unique_steps,
        replayed_steps,
        steps_per_s: per_s(unique_steps as f64),
        tokens_per_s: per_s((unique_steps * job.tokens_per_step) as f64),
        vs_fault_free: None,
        vs_restart: None,
        step_s: last.and_then(|s| step_time(&s.metrics)),
        checkpoint_stall_ms: Stat::of(&stalls),
        load_1m: (!loads.is_empty()).then(|| loads.iter().sum::<f64>() / loads.len() as f64),
        recoveries,
        restarts,
    }
}

/// Median seconds between consecutive commits of one generation in one process (step 1,
/// which includes the start, left out).
pub fn step_time(metrics: &[StepMetrics]) -> Option<f64> {
    let gaps: Vec<f64> = metrics
        .windows(2)
        .filter(|w| {
            w[0].step >= 1
                && w[1].step == w[0].step + 1
                && w[1].generation == w[0].generation
                && w[1].wall_s > w[0].wall_s
        })
        .map(|w| w[1].wall_s - w[0].wall_s)
        .collect();
    (!gaps.is_empty()).then(|| median(&gaps))
}

/// Each `reconfig` with the first `resumed` after it (none if the run ended first).
fn recoveries<'a>(events: impl Iterator<Item = &'a Event>) -> Vec<Recovery> {
    let mut out: Vec<Recovery> = Vec::new();
    for e in events {
        match e {
            Event::Reconfig {
                cause,
                lost_nodes,
                joined_nodes,
                drained_nodes,
                from_step,
                replayed_steps,
                in_place,
                copies,
                copy_bytes,
                ..
            } => out.push(Recovery {
                cause: cause.clone(),
                lost_nodes: lost_nodes.clone(),
                joined_nodes: joined_nodes.clone(),
                drained_nodes: drained_nodes.clone(),
                from_step: *from_step,
                in_place: *in_place,
                replayed_steps: *replayed_steps,
                copies: *copies as u64,
                copy_bytes: 0,
                planned_bytes: *copy_bytes,
                since_failure_s: None,
                phases: None,
            }),
            Event::Resumed {
                since_failure_s,
                copy_bytes,
                phases,
                ..
            } => {
                if let Some(r) = out.last_mut().filter(|r| r.phases.is_none()) {
                    r.since_failure_s = Some(*since_failure_s);
                    r.copy_bytes = *copy_bytes;
                    r.phases = Phases::of(phases);
                }
            }
            _ => {}
        }
    }
    out
}

/// `wall_s` of `step` among the metrics one process wrote (those after `from`).
fn wall_at(seg: &Segment, from: u64, step: u64) -> Option<f64> {
    seg.metrics
        .iter()
        .find(|m| m.step == step && m.step > from)
        .map(|m| m.wall_s)
}

/// Each segment that ended in an injected failure, with the one that took over.
fn restarts(segments: &[Segment]) -> Vec<Restart> {
    let mut out = Vec::new();
    let mut from = 0;
    for pair in segments.windows(2) {
        let (dead, next) = (&pair[0], &pair[1]);
        let Some(failed_after) = dead.events.iter().find_map(|e| match e {
            Event::InjectFailure { step, .. } => Some(*step),
            _ => None,
        }) else {
            continue;
        };
        let resumed_from = next
            .events
            .iter()
            .find_map(|e| match e {
                Event::Resume(start) => Some(start.step),
                _ => None,
            })
            .unwrap_or(0);
        // The failure, as seconds before the dead process exited.
        let after_failure = wall_at(dead, from, failed_after).map(|t| dead.wall_s - t);
        let since = |step| Some(after_failure? + next.gap_s + wall_at(next, resumed_from, step)?);
        out.push(Restart {
            failed_after,
            resumed_from,
            lost_steps: failed_after.saturating_sub(resumed_from),
            to_first_commit_s: since(resumed_from + 1),
            to_regained_s: since(failed_after),
        });
        from = resumed_from;
    }
    out
}

/// Fills in each run's throughput relative to the fault-free run and the checkpoint restart.
pub fn compare(runs: &mut [RunSummary]) {
    let rate = |runs: &[RunSummary], k| {
        runs.iter()
            .find(|r| r.kind == k && r.ok && r.steps_per_s > 0.0)
            .map(|r| r.steps_per_s)
    };
    let ff = rate(runs, RunKind::FaultFree);
    let rs = rate(runs, RunKind::CheckpointRestart);
    for r in runs.iter_mut().filter(|r| r.ok) {
        r.vs_fault_free = ff.map(|f| r.steps_per_s / f);
        r.vs_restart = rs.map(|f| r.steps_per_s / f);
    }
}

/// One target of the spec, checked on the worst recovery.
#[derive(Clone, Debug, Serialize)]
pub struct Check {
    pub name: String,
    /// The bound, in the unit of `measured`.
    pub limit: f64,
    /// True: `measured` must be at least `limit`; false: below it.
    pub at_least: bool,
    pub measured: Option<f64>,
    /// `None` when there is nothing to check (the run failed or had no recovery).
    pub pass: Option<bool>,
}

pub(super) fn check(name: &str, limit: f64, at_least: bool, measured: Option<f64>) -> Check {
    let pass = measured.map(|m| if at_least { m >= limit } else { m < limit });
    Check {
        name: name.to_string(),
        limit,
        at_least,
        measured,
        pass,
    }
}

/// The spec's targets for recovery in place, each on its worst recovery.
pub fn checks(fault_free: &RunSummary, in_place: &RunSummary) -> Vec<Check> {
    let usable = in_place.ok && !in_place.recoveries.is_empty();
    let worst = |f: &dyn Fn(&Recovery) -> Option<f64>| -> Option<f64> {
        let xs: Vec<f64> = in_place.recoveries.iter().filter_map(f).collect();
        (usable && xs.len() == in_place.recoveries.len()).then(|| Stat::of(&xs).map(|s| s.max))?
    };
    let step_s = fault_free.step_s.filter(|_| fault_free.ok);
    let next_commit = step_s.map(|s| 1.5 + s);
    vec![
        check(
            "crash detected (s)",
            0.1,
            false,
            worst(&|r| Some(r.phases?.detect_s)),
        ),
        check(
            "decide + restart + connect_copy (s)",
            1.0,
            false,
            worst(&|r| r.reconfigure_s()),
        ),
        check(
            "next commit after a failure (s)",
            next_commit.unwrap_or(f64::NAN),
            false,
            worst(&|r| r.since_failure_s).filter(|_| next_commit.is_some()),
        ),
        check(
            "in-place throughput / fault-free",
            0.9,
            true,
            in_place.vs_fault_free,
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::super::records::{parse_events, parse_metrics};
    use super::*;

    const JOB: Job = Job {
        steps: 6,
        tokens_per_step: 100,
        failures: 1,
    };

    fn metrics(walls: &[(u64, u64, f64)]) -> String {
        walls
            .iter()
            .map(|(s, g, w)| {
                format!(
                    "{{\"step\":{s},\"loss\":1.0,\"tokens_per_s\":1.0,\"generation\":{g},\
                     \"wall_s\":{w}}}\n"
                )
            })
            .collect()
    }

    fn resumed(detect: f64, since: f64) -> String {
        format!(
            "{{\"event\":\"reconfig\",\"generation\":1,\"lost_nodes\":[3],\"nodes\":[0,1,2],\
             \"failed_in_step\":3,\"detect_s\":0.01,\"checkpoint\":null,\"from_step\":2,\"replayed_steps\":0,\
             \"in_place\":true,\"copies\":1,\"copy_bytes\":100,\"new_pipelines\":[[0,1],[2]]}}\n\
             {{\"event\":\"resumed\",\"generation\":1,\"step\":3,\"since_failure_s\":{since},\"copy_bytes\":\
             200000000,\"phases\":{{\"detect_s\":{detect},\"decide_s\":0.01,\"restart_s\":0.02,\
             \"connect_copy_s\":0.2,\"connect_max_s\":0.01,\"copy_max_s\":0.1,\"first_step_s\":\
             0.5}}}}\n"
        )
    }

    fn segment(events: &str, metrics: &str, wall_s: f64, gap_s: f64) -> Segment {
        Segment {
            wall_s,
            gap_s,
            events: parse_events(events).unwrap(),
            metrics: parse_metrics(metrics).unwrap(),
            load_1m: None,
        }
    }

    fn run(kind: RunKind, segments: Vec<Segment>) -> RunSummary {
        summarize(
            &RunInput {
                kind,
                segments,
                error: None,
            },
            &JOB,
        )
    }

    #[test]
    fn medians_ratios_and_targets_from_canned_runs() {
        let ff_metrics = metrics(&[
            (1, 0, 2.0),
            (2, 0, 3.0),
            (3, 0, 4.0),
            (4, 0, 5.5),
            (5, 0, 6.5),
            (6, 0, 7.5),
        ]);
        let ff = run(
            RunKind::FaultFree,
            vec![segment(
                "{\"event\":\"start\",\"step\":0}\n",
                &ff_metrics,
                10.0,
                0.0,
            )],
        );
        assert_eq!(ff.step_s, Some(1.0));
        assert_eq!(ff.unique_steps, 6);
        let events = format!(
            "{}{}{{\"event\":\"checkpoint\",\"step\":4,\"path\":\"c4\",\"duration_s\":0.1,\
             \"stall_ms\":10.0}}\n\
             {{\"event\":\"checkpoint\",\"step\":6,\"path\":\"c6\",\"duration_s\":0.1,\
             \"stall_ms\":30.0}}\n",
            resumed(0.05, 1.2),
            resumed(0.15, 2.0)
        );
        let ip_metrics = metrics(&[
            (1, 0, 2.0),
            (2, 0, 3.0),
            (3, 1, 5.0),
            (4, 1, 6.0),
            (5, 2, 8.0),
            (6, 2, 9.0),
        ]);
        let ip = run(
            RunKind::InPlace,
            vec![segment(&events, &ip_metrics, 12.5, 0.0)],
        );
        let rs = restart_run();
        let mut runs = vec![ff, ip, rs];
        compare(&mut runs);
        let ip = &runs[1];
        assert_eq!(ip.recoveries.len(), 2);
        assert_eq!(ip.recoveries[0].copy_gb_per_s(), Some(2.0));
        assert_eq!(ip.checkpoint_stall_ms.unwrap().median, 20.0);
        assert_eq!(ip.vs_fault_free, Some(0.8));
        assert_eq!(ip.vs_restart, Some(20.0 / 12.5));
        let c = checks(&runs[0], ip);
        let pass: Vec<Option<bool>> = c.iter().map(|c| c.pass).collect();
        // Detect 0.15 s on the worst recovery: a miss; 0.23 s to reconfigure: a pass; next
        // commit 2.0 s against 1.5 + 1.0 s: a pass; 80% of fault-free: a miss.
        assert_eq!(pass, vec![Some(false), Some(true), Some(true), Some(false)]);
        assert_eq!(c[0].measured, Some(0.15));
        assert_eq!(c[2].limit, 2.5);
    }

    /// Killed after step 4 (checkpoint at 2), resumed, finished: 2 steps lost.
    fn restart_run() -> RunSummary {
        let first = segment(
            "{\"event\":\"start\",\"step\":0}\n{\"event\":\"inject_failure\",\"node\":3,\"step\":4}\n\
             {\"event\":\"abort\",\"reason\":\"node 3 was lost\"}\n",
            &metrics(&[(1, 0, 1.0), (2, 0, 2.0), (3, 0, 3.0), (4, 0, 4.0)]),
            4.5,
            0.0,
        );
        let second = segment(
            "{\"event\":\"resume\",\"step\":2}\n{\"event\":\"finish\",\"step\":6,\"wall_s\":6.0}\n",
            &metrics(&[
                (1, 0, 1.0),
                (2, 0, 2.0),
                (3, 1, 3.0),
                (4, 1, 4.0),
                (5, 1, 5.0),
                (6, 1, 6.0),
            ]),
            15.0,
            0.5,
        );
        let rs = run(RunKind::CheckpointRestart, vec![first, second]);
        assert_eq!(rs.wall_s, 20.0);
        assert_eq!(rs.replayed_steps, 2);
        let r = &rs.restarts[0];
        assert_eq!((r.failed_after, r.resumed_from, r.lost_steps), (4, 2, 2));
        // 0.5 s from the commit of step 4 to the exit, 0.5 s gap, 3.0 s to step 3.
        assert_eq!(r.to_first_commit_s, Some(4.0));
        assert_eq!(r.to_regained_s, Some(5.0));
        rs
    }

    #[test]
    fn a_run_that_stopped_early_is_failed_and_unchecked() {
        let ip = run(
            RunKind::InPlace,
            vec![segment(
                &resumed(0.05, 1.0),
                &metrics(&[(1, 0, 1.0), (2, 0, 2.0)]),
                3.0,
                0.0,
            )],
        );
        assert!(!ip.ok);
        assert_eq!(ip.status, "stopped at step 2 of 6");
        let ff = run(RunKind::FaultFree, vec![]);
        assert!(checks(&ff, &ip).iter().all(|c| c.pass.is_none()));
    }
}
