//! The master run, its pure part: when the bench kills the master (from the flags), what the
//! run and the bench saw of its restart (`train --resume RUN --reattach`), what the commit
//! record costs a step, and the targets.
//!
//! **The kill.** One job with no failure (`--master-wait` [`MASTER_WAIT_S`]); once step
//! `after_step` committed (seen in `metrics.jsonl`) the bench SIGKILLs the `train` process
//! itself, the master only: its agents and their workers, in its process group, live on and
//! look for a master. The bench starts `train --resume RUN --reattach` at once; it listens
//! where the lost master did, takes the agents back (`returned` events), aborts the step in
//! flight and goes on in place from the step `committed.json` holds (`reattach` event): no
//! checkpoint loaded, no step replayed, every step once in `metrics.jsonl`.
//!
//! **Clocks.** The bench's clock, from just before its `kill -KILL`: the restarted master
//! spawned (the bench's own gap: the dead master reaped, its files read), its `reattach` event
//! and the first `metrics.jsonl` line past the recorded step seen (polled every
//! [`POLL_MS`] ms: late by at most that and the write, never early). The job's own clocks beside
//! them: each agent's `without_master_s` (its master lost -> back), and the `resumed` event's
//! `since_failure_s` and phases, from the re-adoption of the agents (the restarted master's
//! clock).
//!
//! **Targets.** (1) SIGKILL -> next commit under `lease + median step + the bench's gap`, the
//! lease being the master's 3 s ([`LEASE_S`]): an agent of a master that fell silent (not
//! killed) notices after a lease, and the in-place recovery of a failure is bounded by 1.5 s +
//! a step (`checks`); a killed master costs its successor's start (process, run directory, a
//! listening socket), the agents' next try (their pauses grow 0.25 s, 0.5 s, 1 s, 2 s: within
//! about 1.75 s of the kill they try once more) and the aborted step; the lease covers the
//! first two, the step the third, and the gap is the bench's, not the job's. (2) Every agent
//! back, no step replayed, no checkpoint loaded, every step once. (3) Writing the commit record
//! (`CommitRecord::write`: serialise, write a new file, rename it over), which the master does
//! before every commit, under [`RECORD_PCT`] % of the fault-free run's median step: issue 36's
//! bound for the per-step cost of keeping a standby master current, of which this record is
//! the part that exists.

use anyhow::{bail, Result};
use serde::Serialize;

use super::readoption::Readoption;
use super::summary::{check, Check, RunInput, RunSummary};
use super::BenchRecoveryArgs;
use crate::bench::median;

/// How long the agents wait for a master, s (`--master-wait`, unless `--train-arg` sets it).
pub const MASTER_WAIT_S: u64 = 60;
/// The master's lease (`MasterConfig::lease`), s: the allowance for the restart and the
/// agents' return in the take-over target.
pub const LEASE_S: f64 = 3.0;
/// The commit record may cost this share of a step, %.
pub const RECORD_PCT: f64 = 1.0;
/// How often the bench looks at the run's files after the kill, ms (its child's poll).
pub const POLL_MS: u64 = 20;

/// When the bench kills the master (pure, from the flags).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MasterPlan {
    /// The SIGKILL goes out once this step committed.
    pub after_step: u64,
    /// The first `train`'s `--master-wait`, s.
    pub master_wait_s: u64,
}

impl MasterPlan {
    /// `None` with `--no-master`. By default after 5/8 of the steps (step 75 of the default
    /// 120): after the in-place run's first failure and the hang (both at 60), between two
    /// checkpoints (40 and 80), where a checkpoint restart would compute 35 steps again.
    pub fn new(a: &BenchRecoveryArgs) -> Result<Option<MasterPlan>> {
        let after_step = kill_step(a, (a.no_master, "--no-master"))?;
        Ok(after_step.map(|after_step| MasterPlan {
            after_step,
            master_wait_s: MASTER_WAIT_S,
        }))
    }
}

/// The step after which the master run (and the standby run) kills the master:
/// `--master-kill-after-step`, by default 5/8 of the steps; `None` when the run is `skipped`
/// (by its flag `skip`).
pub fn kill_step(a: &BenchRecoveryArgs, (skipped, skip): (bool, &str)) -> Result<Option<u64>> {
    if skipped {
        return Ok(None);
    }
    let after_step = a.master_kill_after_step.unwrap_or(a.steps * 5 / 8);
    // A median step before the kill; a commit after the take-over.
    if after_step < 3 || after_step + 2 > a.steps {
        bail!(
            "--master-kill-after-step {after_step}: between 3 and steps - 2 = {} (a median \
             step before the kill, a commit after the restart); pass --steps 5 or more, or \
             {skip}",
            a.steps.saturating_sub(2)
        );
    }
    Ok(Some(after_step))
}

/// What the bench saw, on its own clock (seconds from just before `kill -KILL`).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Observed {
    /// The killed `train`'s pid.
    pub pid: Option<u32>,
    /// The newest step in `metrics.jsonl` when the SIGKILL went out.
    pub killed_after: Option<u64>,
    /// The step `committed.json` held after the kill (the restarted master goes on from it).
    pub recorded_step: Option<u64>,
    /// The lost master's agents, and how many of them still ran once it was reaped.
    pub agents: usize,
    pub agents_alive: usize,
    /// -> the restarted master spawned (the bench's gap).
    pub spawned_s: Option<f64>,
    /// -> its `reattach` event in `events.jsonl`.
    pub reattach_s: Option<f64>,
    /// -> the first line past `recorded_step` in `metrics.jsonl`, and its step.
    pub next_commit_s: Option<f64>,
    pub next_commit_step: Option<u64>,
    /// The restarted master's exit -> every process of the lost master's group gone, s
    /// (`None`: the bench had to kill them).
    pub group_gone_s: Option<f64>,
}

/// `CommitRecord::write` timed in the bench process.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct RecordCost {
    pub writes: usize,
    /// Metrics lines in the record, and its size.
    pub lines: usize,
    pub bytes: u64,
    pub median_us: f64,
    pub p99_us: f64,
}

impl RecordCost {
    /// From each write's µs.
    pub fn of(us: &[f64], lines: usize, bytes: u64) -> RecordCost {
        let mut sorted = us.to_vec();
        sorted.sort_by(f64::total_cmp);
        let p99 = (sorted.len() as f64 * 0.99).ceil() as usize;
        RecordCost {
            writes: us.len(),
            lines,
            bytes,
            median_us: median(us),
            p99_us: sorted
                .get(p99.saturating_sub(1))
                .copied()
                .unwrap_or(f64::NAN),
        }
    }
}

/// The master run's numbers, as the report carries them.
#[derive(Clone, Debug, Serialize)]
pub struct MasterRestart {
    pub plan: MasterPlan,
    pub observed: Observed,
    /// The restarted master's re-adoption of the agents, its limit with the bench's gap.
    #[serde(flatten)]
    pub readoption: Readoption,
    pub record: Option<RecordCost>,
    /// The record's median write over `step_s`, %.
    pub record_pct: Option<f64>,
}

impl MasterRestart {
    /// From the run's records (its two segments: the killed master's, the restarted one's),
    /// what the bench saw, the record's cost, the job's nodes and steps, and the fault-free
    /// median step `step_s`.
    pub fn new(
        plan: &MasterPlan,
        observed: Observed,
        record: Option<RecordCost>,
        run: &RunInput,
        summary: &RunSummary,
        shape: (usize, u64),
        step_s: Option<f64>,
    ) -> MasterRestart {
        MasterRestart {
            plan: plan.clone(),
            readoption: Readoption::new((run, summary), shape, step_s, observed.spawned_s),
            record_pct: record
                .zip(step_s)
                .map(|(r, s)| r.median_us / (s * 1e6) * 100.0),
            record,
            observed,
        }
    }
}

/// The targets of the master run (none but the record's checked when it failed).
pub fn master_checks(run: &RunSummary, m: &MasterRestart) -> Vec<Check> {
    let mut checks = m.readoption.checks("master", run, m.observed.next_commit_s);
    checks.push(check(
        "master: commit record / step (%)",
        RECORD_PCT,
        false,
        m.record_pct,
    ));
    checks
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::plan::tests::args;
    use super::super::readoption::tests::killed_run;
    use super::super::records::tests::metric_line;
    use super::super::summary::RunKind;
    use super::*;

    #[test]
    fn defaults_kill_the_master_after_five_eighths_of_the_steps() {
        let p = MasterPlan::new(&args(&[])).unwrap().unwrap();
        assert_eq!((p.after_step, p.master_wait_s), (75, 60));
        let p = MasterPlan::new(&args(&["--steps", "40"])).unwrap().unwrap();
        assert_eq!(p.after_step, 25);
        assert!(MasterPlan::new(&args(&["--no-master"])).unwrap().is_none());
        let e = MasterPlan::new(&args(&["--master-kill-after-step", "2"])).unwrap_err();
        assert!(
            e.to_string().contains("between 3 and steps - 2 = 118"),
            "{e}"
        );
        assert!(MasterPlan::new(&args(&["--master-kill-after-step", "119"])).is_err());
    }

    /// The killed master's events, up to its kill after step 4.
    const FIRST: &str = "{\"event\":\"start\",\"step\":0,\"pid\":7}\n\
        {\"event\":\"process\",\"role\":\"agent\",\"pid\":8,\"node\":0}\n\
        {\"event\":\"process\",\"role\":\"agent\",\"pid\":9,\"node\":1}\n";

    /// The restarted master's events: two agents back, a recovery in place from step 4.
    pub(in super::super) fn restarted(checkpoint: &str) -> String {
        format!(
            "{{\"event\":\"reattach\",\"step\":4,\"pid\":20}}\n\
             {{\"event\":\"returned\",\"node\":0,\"addr\":\"a\",\"generation\":0,\"step\":4,\
             \"ranks\":[0],\"without_master_s\":1.2}}\n\
             {{\"event\":\"returned\",\"node\":1,\"addr\":\"b\",\"generation\":0,\"step\":3,\
             \"ranks\":[1],\"without_master_s\":1.6}}\n\
             {{\"event\":\"failure\",\"generation\":0,\"step\":4,\"reason\":\"the master was \
             restarted\"}}\n\
             {{\"event\":\"reconfig\",\"generation\":1,\"lost_nodes\":[],\"nodes\":[0,1],\
             \"failed_in_step\":5,\"from_step\":4,\"replayed_steps\":0,\"detect_s\":0.01,\
             \"checkpoint\":{checkpoint},\"in_place\":true,\"new_pipelines\":[[0,1]],\
             \"cause\":\"the master was restarted\"}}\n\
             {{\"event\":\"resumed\",\"generation\":1,\"step\":5,\"since_failure_s\":1.1,\
             \"copy_bytes\":0,\"phases\":{{\"detect_s\":0.02,\"decide_s\":0.001,\
             \"restart_s\":0.0,\"connect_copy_s\":0.1,\"connect_max_s\":0.05,\
             \"copy_max_s\":0.0,\"first_step_s\":0.9}}}}\n"
        )
    }

    fn metrics(steps: &[u64]) -> String {
        let lines: Vec<String> = steps
            .iter()
            .map(|&s| metric_line(s, s as f64, ""))
            .collect();
        lines.join("\n") + "\n"
    }

    /// A run of 8 steps killed after step 4; `steps` in its final `metrics.jsonl`.
    pub(in super::super) fn master(
        next_commit_s: f64,
        checkpoint: &str,
        steps: &[u64],
    ) -> (RunSummary, MasterRestart) {
        let (input, s) = killed_run(
            RunKind::Master,
            (FIRST, &metrics(&[1, 2, 3, 4])),
            (&restarted(checkpoint), &metrics(steps)),
            0.05,
        );
        let observed = Observed {
            pid: Some(7),
            killed_after: Some(4),
            recorded_step: Some(4),
            agents: 2,
            agents_alive: 2,
            spawned_s: Some(0.05),
            reattach_s: Some(0.3),
            next_commit_s: Some(next_commit_s),
            next_commit_step: Some(5),
            group_gone_s: Some(0.1),
        };
        let record = RecordCost::of(&[30.0, 20.0, 10.0, 500.0], 2, 900);
        let m = MasterRestart::new(
            &plan(),
            observed,
            Some(record),
            &input,
            &s,
            (2, 8),
            Some(1.0),
        );
        (s, m)
    }

    fn plan() -> MasterPlan {
        MasterPlan {
            after_step: 4,
            master_wait_s: 60,
        }
    }

    #[test]
    fn the_take_over_and_its_recovery_are_found_in_the_events() {
        let (s, m) = master(2.0, "null", &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(m.readoption.reattach_step, Some(4));
        assert_eq!(
            (m.readoption.returned, m.readoption.without_master_s),
            (2, Some(1.6))
        );
        let r = m.readoption.recovery.as_ref().unwrap();
        assert!(r.in_place && r.replayed_steps == 0, "{r:?}");
        assert_eq!(r.since_failure_s, Some(1.1));
        assert_eq!(r.phases.unwrap().first_step_s, 0.9);
        assert!(m.readoption.checkpoints_loaded.is_empty());
        // 3 s lease + a 1 s step + the bench's 0.05 s.
        assert!((m.readoption.takeover_limit_s.unwrap() - 4.05).abs() < 1e-9);
        // The median of 10, 20, 30 and 500 µs is 25 µs: 0.0025 % of a 1 s step.
        let rec = m.record.unwrap();
        assert_eq!((rec.median_us, rec.p99_us), (25.0, 500.0));
        assert!((m.record_pct.unwrap() - 0.0025).abs() < 1e-12);
        let pass: Vec<Option<bool>> = master_checks(&s, &m).iter().map(|c| c.pass).collect();
        assert_eq!(pass, vec![Some(true); 6]);
        let (s, late) = master(4.2, "null", &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(master_checks(&s, &late)[0].pass, Some(false));
    }

    #[test]
    fn a_checkpoint_loaded_or_a_step_lost_or_twice_is_a_miss() {
        let (s, m) = master(2.0, "\"ck/step-4\"", &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(
            m.readoption.checkpoints_loaded,
            vec!["ck/step-4".to_string()]
        );
        assert_eq!(master_checks(&s, &m)[3].pass, Some(false));
        let (s, m) = master(2.0, "null", &[1, 2, 3, 4, 4, 5, 7, 8]);
        assert_eq!(
            (
                m.readoption.missing_steps.clone(),
                m.readoption.repeated_steps.clone()
            ),
            (vec![6], vec![4])
        );
        let c = master_checks(&s, &m);
        assert_eq!((c[4].measured, c[4].pass), (Some(2.0), Some(false)));
    }

    #[test]
    fn p99_of_a_hundred_writes_is_the_ninety_ninth() {
        let us: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let r = RecordCost::of(&us, 1, 10);
        assert_eq!((r.writes, r.median_us, r.p99_us), (100, 50.5, 99.0));
    }
}
