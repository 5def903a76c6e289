//! The master run, acting: one `train` with no failure whose master the bench SIGKILLs once
//! the plan's step committed ([`MasterPlan`]), then `train --resume RUN --reattach` started at
//! once, which must take the agents back and finish the job; the times on the bench's clock
//! (`master` says which clock and how late each time can be), and the commit record's cost.
//!
//! Processes: the SIGKILL goes to `train`'s pid only, never to its group, where its agents and
//! their workers live on. That group is not killed when `train` exits (as every other run's
//! is) but handed over ([`Group`]), still registered with the reaper (Ctrl-C kills it); after
//! the restarted master exits, the bench waits for every process the lost master started to
//! be gone (the restarted master shuts the agents down) and kills the group if one is not, on
//! an error or a panic too (on drop). The restarted master runs in a group of its own.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use oobleck_core::runtime::master::CommitRecord;

use super::master::{MasterPlan, Observed, RecordCost};
use super::membership_run::committed_step;
use super::records::{parse_events, parse_metrics, Event};
use super::summary::{RunInput, RunKind, Segment};
use super::{commit_cost, Bench, FailurePlan, Out};
use crate::bench::child::{alive_in_group, Group};

/// How often the run's `metrics.jsonl` is looked at before the kill.
const LOOK: Duration = Duration::from_millis(20);
/// How long the lost master's agents and workers may take to exit after the restarted master.
pub(super) const GROUP_EXIT: Duration = Duration::from_secs(30);

/// What the master run left: its records, what the bench saw, and the commit record's cost.
pub(super) struct MasterInput {
    pub run: RunInput,
    pub observed: Observed,
    pub record: Option<RecordCost>,
}

impl Bench<'_> {
    /// The master run: the job of the other runs, its master killed and restarted.
    pub(super) fn master(&self, plan: &FailurePlan, m: &MasterPlan) -> MasterInput {
        let slug = "master";
        let dir = self.scratch.root.join(slug);
        let when = (m.after_step, m.master_wait_s);
        let KilledRun {
            first,
            killer,
            mut group,
        } = self.run_to_kill(plan, (&dir, slug), &[], when);
        let mut problems = vec![];
        let mut segments = vec![];
        let mut observed = Observed {
            pid: killer.killed.and(killer.pid),
            killed_after: killer.killed_after,
            ..Observed::default()
        };
        match (first, killer.killed) {
            (Ok((seg, _)), Some(t0)) => {
                segments.push(seg);
                let rest = self.reattach(&dir, t0, &mut observed, group.take());
                segments.extend(rest.0);
                problems.extend(rest.1);
            }
            (Ok((seg, problem)), None) => {
                problems.push(not_killed(problem, &dir, m.after_step));
                segments.push(seg);
            }
            (Err(e), _) => problems.push(format!("{e:#}")),
        }
        problems.extend(killer.problems);
        let metrics = segments
            .last()
            .map_or(&[][..], |s: &Segment| &s.metrics[..]);
        let record = commit_cost::measure(&self.scratch.root.join("commit-record"), metrics)
            .map_err(|e| problems.push(format!("timing the commit record: {e:#}")))
            .ok();
        let run = RunInput {
            kind: RunKind::Master,
            segments,
            error: (!problems.is_empty()).then(|| format!("{slug}: {}", problems.join("; "))),
        };
        MasterInput {
            run,
            observed,
            record,
        }
    }

    /// After the kill at `t0`: the lost master's agents still there, the restarted master to
    /// its exit, and the lost master's group gone. Its segment, and what went wrong. The
    /// restarted master gets `--resume RUN --reattach` only: it reads the job's flags from
    /// the run (its `config.json`).
    fn reattach(
        &self,
        dir: &Path,
        t0: Instant,
        o: &mut Observed,
        group: Option<Group>,
    ) -> (Vec<Segment>, Vec<String>) {
        let mut problems = vec![];
        o.recorded_step = CommitRecord::read(dir).ok().flatten().map(|r| r.step);
        let text = std::fs::read_to_string(dir.join("events.jsonl")).unwrap_or_default();
        let events = parse_events(&text).unwrap_or_default();
        let pgid = o.pid.unwrap_or(0);
        let agents = pids_of(&events, "agent");
        o.agents = agents.len();
        o.agents_alive = agents.iter().filter(|&&p| alive_in_group(p, pgid)).count();
        let args: Vec<String> = vec![
            "--resume".into(),
            dir.display().to_string(),
            "--reattach".into(),
        ];
        let mut watch = Watch::new(dir, o.recorded_step.unwrap_or(0), t0);
        o.spawned_s = Some(t0.elapsed().as_secs_f64());
        let gap = o.spawned_s.unwrap_or(0.0);
        let result = self.segment(dir, &args, "master-reattach", gap, &mut || watch.tick());
        (o.reattach_s, o.next_commit_s) = (watch.reattach, watch.commit.map(|c| c.0));
        o.next_commit_step = watch.commit.map(|c| c.1);
        let mut segments = vec![];
        match result {
            Ok((seg, problem)) => {
                segments.push(seg);
                problems.extend(problem.map(|p| format!("restarted master: {p}")));
            }
            Err(e) => problems.push(format!("restarted master: {e:#}")),
        }
        let mut all = agents;
        all.extend(pids_of(&events, "worker"));
        if let Some(mut g) = group {
            o.group_gone_s = g.wait_gone(&all, GROUP_EXIT);
            if o.group_gone_s.is_none() {
                problems.push(format!(
                    "the lost master's agents or workers were still there {} s after the \
                     restarted master exited; the bench killed them",
                    GROUP_EXIT.as_secs()
                ));
            }
        }
        (segments, problems)
    }
}

/// The pids of the `process` events of `role`.
pub(super) fn pids_of(events: &[Event], role: &str) -> Vec<u32> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Process { role: r, pid, .. } if r == role => *pid,
            _ => None,
        })
        .collect()
}

/// The first `train` of a run that kills its master: its segment (or what failed), the
/// killer (when the SIGKILL went out, its problems) and the group it left running.
pub(super) struct KilledRun {
    pub first: anyhow::Result<(Segment, Option<String>)>,
    pub killer: Killer,
    pub group: Option<Group>,
}

impl Bench<'_> {
    /// The master run's and the standby run's first `train` (in `dir`, logged as `slug`):
    /// the job of the other runs with `extra` flags and `--master-wait` (unless `--train-arg`
    /// sets it), its master SIGKILLed once `after_step` committed, its group handed over.
    pub(super) fn run_to_kill(
        &self,
        plan: &FailurePlan,
        (dir, slug): (&Path, &str),
        extra: &[&str],
        (after_step, master_wait_s): (u64, u64),
    ) -> KilledRun {
        let mut args = self.train_args(Out::Fresh(dir), self.a.fault_threshold, &plan.pins, &[]);
        args.extend(extra.iter().map(|x| x.to_string()));
        if !self
            .a
            .train_arg
            .iter()
            .any(|x| x.starts_with("--master-wait"))
        {
            args.extend(["--master-wait".into(), master_wait_s.to_string()]);
        }
        let mut killer = Killer::new(after_step, dir);
        let mut group: Option<Group> = None;
        let first = self.segment_as(dir, &args, slug, 0.0, &mut |child, timeout| {
            killer.pid = Some(child.pid());
            let (exit, g) = child.wait_leaving_with(timeout, || killer.tick())?;
            group = Some(g);
            Ok(exit)
        });
        KilledRun {
            first,
            killer,
            group,
        }
    }
}

/// What went wrong when the first `train` exited with no SIGKILL: its own problem, else that
/// it ended (at the step `dir` committed) before `after_step`.
pub(super) fn not_killed(problem: Option<String>, dir: &Path, after_step: u64) -> String {
    problem.unwrap_or_else(|| {
        format!(
            "train exited at step {} before the SIGKILL (planned after step {after_step})",
            committed_step(dir)
        )
    })
}

/// SIGKILLs the master (`train`, its pid only) once a step committed.
pub(super) struct Killer {
    after_step: u64,
    dir: PathBuf,
    /// `train`'s pid, once spawned.
    pub pid: Option<u32>,
    next_look: Instant,
    /// When the SIGKILL went out, and the newest step in `metrics.jsonl` then.
    pub killed: Option<Instant>,
    pub killed_after: Option<u64>,
    /// Tried (sent or not).
    done: bool,
    pub problems: Vec<String>,
}

impl Killer {
    /// Kills once `after_step` is in `dir`'s `metrics.jsonl`.
    pub fn new(after_step: u64, dir: &Path) -> Killer {
        Killer {
            after_step,
            dir: dir.to_path_buf(),
            pid: None,
            next_look: Instant::now(),
            killed: None,
            killed_after: None,
            done: false,
            problems: vec![],
        }
    }

    /// Called between looks at the running `train`.
    pub fn tick(&mut self) {
        if self.done || Instant::now() < self.next_look {
            return;
        }
        self.next_look = Instant::now() + LOOK;
        let (Some(pid), after) = (self.pid, committed_step(&self.dir)) else {
            return;
        };
        if after < self.after_step {
            return;
        }
        self.done = true;
        let t0 = Instant::now();
        let status = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .context("running kill -KILL");
        match status {
            Ok(s) if s.success() => {
                eprintln!(
                    "bench recovery: SIGKILL to the master (train, pid {pid}) after step {after}"
                );
                self.killed = Some(t0);
                self.killed_after = Some(after);
            }
            Ok(s) => self
                .problems
                .push(format!("kill -KILL {pid} exited with {s}")),
            Err(e) => self.problems.push(format!("{e:#}")),
        }
    }
}

/// Watches the restarted master's run directory (or a standby's copy) on the bench's clock.
pub(super) struct Watch {
    events: PathBuf,
    metrics: PathBuf,
    /// Commits past this step are new.
    recorded: u64,
    t0: Instant,
    /// Seconds from the kill to the `reattach` event, and to the next commit (and its step).
    pub reattach: Option<f64>,
    pub commit: Option<(f64, u64)>,
}

impl Watch {
    pub fn new(dir: &Path, recorded: u64, t0: Instant) -> Watch {
        Watch {
            events: dir.join("events.jsonl"),
            metrics: dir.join("metrics.jsonl"),
            recorded,
            t0,
            reattach: None,
            commit: None,
        }
    }

    /// Each time is taken after the file was read: late, never early.
    pub fn tick(&mut self) {
        let since = |t0: Instant| t0.elapsed().as_secs_f64();
        if self.reattach.is_none() {
            let text = std::fs::read_to_string(&self.events).unwrap_or_default();
            let e = parse_events(&text).unwrap_or_default();
            if e.iter().any(|e| matches!(e, Event::Reattach(_))) {
                self.reattach = Some(since(self.t0));
            }
        }
        if self.commit.is_none() {
            let text = std::fs::read_to_string(&self.metrics).unwrap_or_default();
            let m = parse_metrics(&text).unwrap_or_default();
            if let Some(m) = m.iter().find(|m| m.step > self.recorded) {
                self.commit = Some((since(self.t0), m.step));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::child::{Reaper, TrainProcess};

    /// Whether `pid` is gone from group `pgid` within 10 s.
    fn gone(pid: u32, pgid: u32) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while alive_in_group(pid, pgid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        !alive_in_group(pid, pgid)
    }

    /// As with `train` and its agents: the leader SIGKILLed alone leaves its child running in
    /// the group, which the bench then holds, and kills on drop.
    #[test]
    fn the_masters_kill_leaves_its_group_running_until_the_group_is_dropped() {
        use std::os::unix::process::ExitStatusExt;
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("child.pid");
        let script = format!("sleep 30 & echo $! > {}; wait", pidfile.display());
        let args = vec!["-c".to_string(), script];
        let log = dir.path().join("sh");
        let sh = TrainProcess::spawn(&Reaper::default(), Path::new("/bin/sh"), &args, &log);
        let sh = sh.unwrap();
        let leader = sh.pid();
        let mut child: Option<u32> = None;
        let (exit, group) = sh
            .wait_leaving_with(Duration::from_secs(20), || {
                let read = std::fs::read_to_string(&pidfile).unwrap_or_default();
                if child.is_none() && read.ends_with('\n') {
                    child = read.trim().parse().ok();
                    let kill = Command::new("kill")
                        .args(["-KILL", &leader.to_string()])
                        .status();
                    assert!(kill.unwrap().success());
                }
            })
            .unwrap();
        assert_eq!(exit.status.signal(), Some(9));
        let child = child.expect("the child's pid");
        assert!(
            alive_in_group(child, leader),
            "the leader's kill took its child"
        );
        drop(group);
        assert!(gone(child, leader), "the dropped group's child still runs");
    }
}
