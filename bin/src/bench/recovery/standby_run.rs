//! The standby run, acting: one `train --standby-masters 1` with no failure whose master the
//! bench SIGKILLs once the plan's step committed ([`StandbyPlan`]); the standby takes over by
//! itself, and the bench watches its copy of the run directory (`standby` says which clock and
//! how late each time can be) until the new master exits.
//!
//! Processes: the standby is `train`'s child, in its process group, and so are the agents and
//! workers; the SIGKILL goes to `train`'s pid only. The group is handed over ([`Group`], still
//! registered with the reaper: Ctrl-C kills it) and the bench waits, bounded by `--timeout-s`,
//! for the standby's pid (the new master after its exec; not the bench's child, so it is looked
//! at in `/proc`, and its exit status is not known: a `finish` event in the copy says it
//! ended well) to be gone, then for every process the lost master started; on a timeout, an
//! error or a panic the group is killed.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use oobleck_core::runtime::master::CommitRecord;

use super::master_run::{not_killed, pids_of, KilledRun, Watch, GROUP_EXIT};
use super::records::{parse_events, parse_metrics, Event};
use super::standby::{standby_pid, Observed, StandbyPlan};
use super::summary::{RunInput, RunKind, Segment};
use super::{Bench, FailurePlan};
use crate::bench::child::{alive_in_group, tail, Group};
use crate::cluster::standbys::LocalStandbys;

/// How often the new master and its copy are looked at.
const LOOK: Duration = Duration::from_millis(20);

/// What the standby run left: its records and what the bench saw.
pub(super) struct StandbyInput {
    pub run: RunInput,
    pub observed: Observed,
}

impl Bench<'_> {
    /// The standby run: the job of the other runs with one standby, its master killed.
    pub(super) fn standby(&self, plan: &FailurePlan, sp: &StandbyPlan) -> StandbyInput {
        let slug = "standby";
        let dir = self.scratch.root.join(slug);
        let extra = ["--standby-masters", "1"];
        let when = (sp.after_step, sp.master_wait_s);
        let KilledRun {
            first,
            killer,
            group,
        } = self.run_to_kill(plan, (&dir, slug), &extra, when);
        let mut observed = Observed {
            pid: killer.killed.and(killer.pid),
            killed_after: killer.killed_after,
            ..Observed::default()
        };
        let mut problems = vec![];
        let mut segments = vec![];
        match (first, killer.killed, group) {
            (Ok((seg, _)), Some(t0), Some(g)) => {
                let log = self.scratch.root.join(slug).with_extension("stderr");
                let taken = self.taken_over(&dir, &log, t0, &mut observed, &seg, g);
                segments.push(seg);
                match taken {
                    Ok(seg) => segments.push(seg),
                    Err(p) => problems.push(p),
                }
            }
            (Ok((seg, problem)), _, _) => {
                problems.push(not_killed(problem, &dir, sp.after_step));
                segments.push(seg);
            }
            (Err(e), _, _) => problems.push(format!("{e:#}")),
        }
        problems.extend(killer.problems);
        let run = RunInput {
            kind: RunKind::Standby,
            segments,
            error: (!problems.is_empty()).then(|| format!("{slug}: {}", problems.join("; "))),
        };
        StandbyInput { run, observed }
    }

    /// After the kill at `t0`: the standby and the agents still there, the standby's copy
    /// watched until the standby (the new master) is gone, then every process of the group.
    /// The new master's segment (its events in the copy, the copy's metrics), or what went
    /// wrong.
    fn taken_over(
        &self,
        dir: &Path,
        log: &Path,
        t0: Instant,
        o: &mut Observed,
        first: &Segment,
        mut group: Group,
    ) -> Result<Segment, String> {
        let copy = LocalStandbys::copy_of(dir, 0);
        o.recorded_step = CommitRecord::read(&copy).ok().flatten().map(|r| r.step);
        let pgid = o.pid.unwrap_or(0);
        let alive = |pid: &&u32| alive_in_group(**pid, pgid);
        let mut all = pids_of(&first.events, "agent");
        o.agents = all.len();
        o.agents_alive = all.iter().filter(alive).count();
        all.extend(pids_of(&first.events, "worker"));
        let Some(pid) = standby_pid(&std::fs::read_to_string(log).unwrap_or_default()) else {
            return Err(format!(
                "train said no `standby master 0: pid N` in {}",
                log.display()
            ));
        };
        (o.standby_pid, o.standby_alive) = (Some(pid), alive_in_group(pid, pgid));
        let mut watch = Watch::new(&copy, o.recorded_step.unwrap_or(0), t0);
        let deadline = t0 + Duration::from_secs(self.a.timeout_s);
        while alive_in_group(pid, pgid) && Instant::now() < deadline {
            watch.tick();
            std::thread::sleep(LOOK);
        }
        watch.tick();
        let wall_s = t0.elapsed().as_secs_f64();
        (o.reattach_s, o.next_commit_s) = (watch.reattach, watch.commit.map(|c| c.0));
        o.next_commit_step = watch.commit.map(|c| c.1);
        if alive_in_group(pid, pgid) {
            return Err(format!(
                "the standby (pid {pid}) still ran {} s after the kill; the bench killed the job",
                self.a.timeout_s
            ));
        }
        all.push(pid);
        o.group_gone_s = group.wait_gone(&all, GROUP_EXIT);
        let seg = copy_segment(&copy, wall_s).map_err(|e| format!("the standby's copy: {e:#}"))?;
        let finished = seg.events.iter().any(|e| matches!(e, Event::Finish { .. }));
        match (finished, o.group_gone_s) {
            (false, _) => Err(format!(
                "the standby's take-over ended with no `finish` event in {}: {}",
                copy.display(),
                tail(log, 3).replace('\n', " / ")
            )),
            (true, None) => Err(format!(
                "the job's agents or workers were still there {} s after the new master \
                 exited; the bench killed them",
                GROUP_EXIT.as_secs()
            )),
            (true, Some(_)) => Ok(seg),
        }
    }
}

/// The new master's part of the copy: its events (from its `reattach` event on; those before
/// are the lost master's, mirrored) and the copy's whole `metrics.jsonl`.
fn copy_segment(copy: &Path, wall_s: f64) -> anyhow::Result<Segment> {
    let read = |name: &str| {
        let p: PathBuf = copy.join(name);
        std::fs::read_to_string(p).unwrap_or_default()
    };
    let mut events = parse_events(&read("events.jsonl"))?;
    let start = events
        .iter()
        .rposition(|e| matches!(e, Event::Reattach(_)))
        .unwrap_or(events.len());
    Ok(Segment {
        wall_s,
        gap_s: 0.0,
        events: events.split_off(start),
        metrics: parse_metrics(&read("metrics.jsonl"))?,
        load_1m: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_new_masters_segment_starts_at_its_reattach_event() {
        let dir = tempfile::tempdir().unwrap();
        let events = "{\"event\":\"start\",\"step\":0}\n\
                      {\"event\":\"checkpoint\",\"step\":2,\"path\":\"x\",\"duration_s\":0.5,\
                      \"stall_ms\":1.0}\n\
                      {\"event\":\"reattach\",\"step\":3,\"pid\":9}\n\
                      {\"event\":\"finish\",\"step\":4,\"wall_s\":2.0}\n";
        std::fs::write(dir.path().join("events.jsonl"), events).unwrap();
        let seg = copy_segment(dir.path(), 3.5).unwrap();
        assert_eq!(seg.events.len(), 2);
        assert!(matches!(seg.events[0], Event::Reattach(ref s) if s.pid == Some(9)));
        assert!(seg.metrics.is_empty() && seg.wall_s == 3.5);
        // No take-over: nothing of the lost master's is the new one's.
        std::fs::write(
            dir.path().join("events.jsonl"),
            "{\"event\":\"start\",\"step\":0}\n",
        )
        .unwrap();
        assert!(copy_segment(dir.path(), 1.0).unwrap().events.is_empty());
    }
}
