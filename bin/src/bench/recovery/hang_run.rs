//! The hang run, acting: one `train` with no failure, one of whose worker processes the bench
//! stops with SIGSTOP from outside once the plan's step committed ([`HangPlan`]), then times,
//! on its own clock, the `hang` event, the process's end and the next commit (`hang` says
//! which clock and how late each time can be).
//!
//! The stopped process is the worker whose `process` event names the plan's node, checked to
//! run in `train`'s process group (the `start` event's pid) before it is signalled: never the
//! master (`train`) nor an agent. Its agent is expected to SIGKILL it; whatever happens, the
//! bench SIGKILLs it itself if it is still there when the run ends (on drop too), and the whole
//! group is killed when `train` exits, times out or the bench is interrupted (`child`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::hang::{HangPlan, Observed, POLL_MS};
use super::membership_run::committed_step;
use super::records::{parse_events, parse_metrics, parse_rank_marks, Event};
use super::summary::{step_time, RunInput, RunKind};
use super::{Bench, FailurePlan, Out};
use crate::bench::child::alive_in_group;

/// How often the run's `metrics.jsonl` is looked at before the stop.
const LOOK: Duration = Duration::from_millis(20);
/// The stop lands this share of a median step after the step's commit was seen.
const INTO_STEP: f64 = 0.5;

/// What the hang run left: its records, what the bench saw, and the busiest rank's marks per
/// step (`(step, marks)`, from its `metrics.jsonl`).
pub(super) struct HangInput {
    pub run: RunInput,
    pub observed: Observed,
    pub marks: Vec<(u64, u64)>,
}

impl Bench<'_> {
    /// The hang run: the job of the other runs, one worker stopped mid-step.
    pub(super) fn hang(&self, plan: &FailurePlan, h: &HangPlan) -> HangInput {
        let slug = "hang";
        let dir = self.scratch.root.join(slug);
        let args = self.train_args(Out::Fresh(&dir), self.a.fault_threshold, &plan.pins, &[]);
        let mut stopper = Stopper {
            plan: h,
            dir: dir.clone(),
            next_look: Instant::now(),
            armed: None,
            done: false,
            observed: Observed::default(),
            stopped: None,
            watcher: None,
            problems: vec![],
        };
        let result = self.segment(&dir, &args, slug, 0.0, &mut || stopper.tick());
        let (observed, mut problems) = stopper.finish();
        let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap_or_default();
        let marks = parse_rank_marks(&metrics).unwrap_or_else(|e| {
            problems.push(format!("{e:#}"));
            vec![]
        });
        let (segments, train_error) = match result {
            Ok((seg, error)) => (vec![seg], error),
            Err(e) => (vec![], Some(format!("{e:#}"))),
        };
        let errors: Vec<String> = train_error.into_iter().chain(problems).collect();
        let run = RunInput {
            kind: RunKind::Hang,
            segments,
            error: (!errors.is_empty()).then(|| format!("{slug}: {}", errors.join("; "))),
        };
        HangInput {
            run,
            observed,
            marks,
        }
    }
}

/// Stops the worker when the plan says, then watches what follows.
struct Stopper<'a> {
    plan: &'a HangPlan,
    dir: PathBuf,
    next_look: Instant,
    /// When the SIGSTOP is due, once the plan's step committed.
    armed: Option<(Instant, Instant)>,
    /// The SIGSTOP went out, or could not.
    done: bool,
    observed: Observed,
    stopped: Option<Stopped>,
    watcher: Option<Watcher>,
    problems: Vec<String>,
}

impl Stopper<'_> {
    /// Called between looks at the running `train`.
    fn tick(&mut self) {
        if self.done || Instant::now() < self.next_look {
            return;
        }
        self.next_look = Instant::now() + LOOK;
        match self.armed {
            None => {
                let text = std::fs::read_to_string(self.dir.join("metrics.jsonl"));
                let metrics = parse_metrics(&text.unwrap_or_default()).unwrap_or_default();
                if metrics.iter().any(|m| m.step >= self.plan.after_step) {
                    let step = step_time(&metrics).unwrap_or(0.5);
                    let now = Instant::now();
                    self.armed = Some((now, now + Duration::from_secs_f64(INTO_STEP * step)));
                }
            }
            Some((seen, due)) if Instant::now() >= due => {
                self.done = true;
                if let Err(e) = self.stop(seen) {
                    self.problems.push(format!("{e:#}"));
                }
            }
            Some(_) => {}
        }
    }

    /// SIGSTOP to the plan's worker; starts the watcher.
    fn stop(&mut self, seen: Instant) -> Result<()> {
        let text = std::fs::read_to_string(self.dir.join("events.jsonl"))
            .context("reading events.jsonl")?;
        let events = parse_events(&text)?;
        let (pgid, pid, rank) = worker_of(&events, self.plan.node)?;
        if !alive_in_group(pid, pgid) {
            bail!(
                "the worker of node {} (pid {pid}) does not run in train's process group {pgid}",
                self.plan.node
            );
        }
        let after = committed_step(&self.dir);
        let t0 = Instant::now();
        let status = Command::new("kill")
            .args(["-STOP", &pid.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .context("running kill -STOP")?;
        let signal_ms = t0.elapsed().as_secs_f64() * 1e3;
        // Signalled or not, it is SIGKILLed at the end if it is still there.
        self.stopped = Some(Stopped { pid, pgid });
        if !status.success() {
            bail!("kill -STOP {pid} exited with {status}");
        }
        eprintln!(
            "bench recovery: SIGSTOP to the worker of node {} (pid {pid}) after step {after}",
            self.plan.node
        );
        self.observed = Observed {
            pid: Some(pid),
            rank,
            stopped_after: Some(after),
            into_step_s: Some((t0 - seen).as_secs_f64()),
            signal_ms: Some(signal_ms),
            ..Observed::default()
        };
        self.watcher = Some(Watcher::start(&self.dir, pid, pgid, after, t0)?);
        Ok(())
    }

    /// After `train` exited: what the watcher saw, the stopped process gone, and what failed.
    fn finish(mut self) -> (Observed, Vec<String>) {
        if let Some(w) = self.watcher.take() {
            let seen = w.stop();
            let o = &mut self.observed;
            o.detected_s = seen.hang;
            o.gone_s = seen.gone;
            o.next_commit_s = seen.commit.map(|c| c.0);
            o.next_commit_step = seen.commit.map(|c| c.1);
            if seen.hang.is_none() {
                self.problems
                    .push("no hang event after the SIGSTOP: the watchdog did not report it".into());
            }
        } else if !self.done {
            self.problems.push(format!(
                "train exited at step {} before the SIGSTOP (planned after step {})",
                committed_step(&self.dir),
                self.plan.after_step
            ));
        }
        if let Some(s) = self.stopped.take() {
            if let Some(p) = s.kill() {
                self.problems.push(p);
            }
        }
        (self.observed, self.problems)
    }
}

/// `(train's pid, the worker's pid, its first rank)` of the worker of `node`.
fn worker_of(events: &[Event], node: u32) -> Result<(u32, u32, Option<u32>)> {
    let pgid = events
        .iter()
        .find_map(|e| match e {
            Event::Start(start) => start.pid,
            _ => None,
        })
        .context("no pid in the run's start event")?;
    let (pid, rank) = events
        .iter()
        .rev()
        .find_map(|e| match e {
            Event::Process {
                role,
                pid: Some(pid),
                node: Some(n),
                rank,
                ..
            } if role == "worker" && *n == node && *pid != pgid => Some((*pid, *rank)),
            _ => None,
        })
        .with_context(|| format!("no worker process of node {node} in events.jsonl"))?;
    Ok((pgid, pid, rank))
}

/// The stopped worker: SIGKILLed by [`Stopped::kill`] (or on drop) if still there.
struct Stopped {
    pid: u32,
    pgid: u32,
}

impl Stopped {
    /// Kills the process if it still runs in its group; says so if it did.
    fn kill(self) -> Option<String> {
        let was = alive_in_group(self.pid, self.pgid);
        drop(self);
        was.then(|| "the stopped worker was still there after train; the bench killed it".into())
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        if alive_in_group(self.pid, self.pgid) {
            let _ = Command::new("kill")
                .args(["-KILL", &self.pid.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// Seconds from the SIGSTOP to each thing the watcher saw.
#[derive(Clone, Copy, Debug, Default)]
struct Seen {
    hang: Option<f64>,
    gone: Option<f64>,
    /// And the step committed.
    commit: Option<(f64, u64)>,
}

/// A thread that polls the run's files and the stopped process every [`POLL_MS`].
struct Watcher {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Seen>,
}

impl Watcher {
    fn start(dir: &Path, pid: u32, pgid: u32, after: u64, t0: Instant) -> Result<Watcher> {
        let stop = Arc::new(AtomicBool::new(false));
        let (events, metrics) = (dir.join("events.jsonl"), dir.join("metrics.jsonl"));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("bench-hang-watch".into())
            .spawn(move || {
                let mut seen = Seen::default();
                let mut sizes = (0, 0);
                let since = || t0.elapsed().as_secs_f64();
                while !flag.load(Ordering::Relaxed) {
                    if seen.hang.is_none() && grew(&events, &mut sizes.0) {
                        let text = std::fs::read_to_string(&events).unwrap_or_default();
                        let e = parse_events(&text).unwrap_or_default();
                        if e.iter().any(|e| matches!(e, Event::Hang { .. })) {
                            seen.hang = Some(since());
                        }
                    }
                    if seen.commit.is_none() && grew(&metrics, &mut sizes.1) {
                        let text = std::fs::read_to_string(&metrics).unwrap_or_default();
                        let m = parse_metrics(&text).unwrap_or_default();
                        if let Some(m) = m.iter().find(|m| m.step > after) {
                            seen.commit = Some((since(), m.step));
                        }
                    }
                    if seen.gone.is_none() && !alive_in_group(pid, pgid) {
                        seen.gone = Some(since());
                    }
                    if seen.hang.is_some() && seen.gone.is_some() && seen.commit.is_some() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(POLL_MS));
                }
                seen
            })
            .context("starting the hang watcher")?;
        Ok(Watcher { stop, thread })
    }

    fn stop(self) -> Seen {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// Whether the file at `path` grew past `size` (which it then becomes).
fn grew(path: &Path, size: &mut u64) -> bool {
    let now = std::fs::metadata(path).map_or(0, |m| m.len());
    let grew = now > *size;
    *size = now;
    grew
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stopped_process_left_behind_is_killed() {
        use std::os::unix::process::{CommandExt, ExitStatusExt};
        let mut child = Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .unwrap();
        let pid = child.id();
        let stop = Command::new("kill")
            .args(["-STOP", &pid.to_string()])
            .status();
        assert!(stop.unwrap().success());
        let said = Stopped { pid, pgid: pid }.kill();
        assert!(said.is_some_and(|s| s.contains("killed it")));
        assert_eq!(child.wait().unwrap().signal(), Some(9));
        // Gone already: nothing to say, nothing killed.
        assert_eq!(Stopped { pid, pgid: pid }.kill(), None);
    }

    #[test]
    fn the_worker_of_a_node_is_found_and_never_the_master() {
        let text = "{\"event\":\"start\",\"step\":0,\"pid\":7}\n\
                    {\"event\":\"process\",\"role\":\"agent\",\"pid\":8}\n\
                    {\"event\":\"process\",\"role\":\"worker\",\"pid\":9,\"node\":3,\"rank\":3}\n\
                    {\"event\":\"process\",\"role\":\"worker\",\"pid\":10,\"node\":2,\"rank\":2}\n";
        let e = parse_events(text).unwrap();
        assert_eq!(worker_of(&e, 3).unwrap(), (7, 9, Some(3)));
        assert!(worker_of(&e, 1).is_err());
        assert!(worker_of(&e[1..], 3).is_err());
    }
}
