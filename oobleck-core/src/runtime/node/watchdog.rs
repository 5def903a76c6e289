//! The agent's watchdog over its workers: each worker's progress beats (`worker/beat.rs`)
//! say what it is doing; a worker inside a step that makes no progress for longer than its
//! limit is hung. The agent tells the master what it was doing and fences it (SIGTERM, then
//! SIGKILL), so it can never come back and write; the master recovers as from any worker
//! failure. The lease cannot see this: the agent itself is fine.
//!
//! ```text
//!  inside a step (its commit wait included):
//!    no beat for max(--hang-timeout, SILENT_FLOOR)  -> hung, "stopped" (SIGSTOP, a frozen
//!                                                      process: its beat thread is stopped too,
//!                                                      whatever the step's length)
//!  inside a step, but not waiting for the commit:
//!    limit = max(--hang-timeout, --hang-factor x median of its recent step times)
//!            (before any step time is known: WatchSpec::first_step_s)
//!    beats, no progress for limit, working          -> hung (a kernel that never returns)
//!    beats, no progress, waiting on peers           -> not this rank: its peer's watchdog
//!                                                      finds the cause; the master is told it
//!                                                      waits, and when every rank of the step
//!                                                      waits the data plane hangs (job/hangs.rs)
//!  waiting for the commit with beats, between steps, forming, broken
//!                                                   -> not watched (the master's business)
//! ```
//!
//! A slow worker still moves at every microbatch and data-plane operation, so it is never
//! taken for a hung one.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

use crate::execution::Snapshot;
use crate::runtime::error::Result;
use crate::runtime::spec::WatchSpec;
use crate::runtime::wire::pipe::IDLE_BEAT;
use crate::runtime::wire::records::WorkerReport;

/// Step times kept for the median.
const STEP_WINDOW: usize = 16;
/// The least silence taken for a stopped process: three idle beats missed in a row.
pub(super) const SILENT_FLOOR: Duration = IDLE_BEAT.saturating_mul(3);
/// After SIGTERM, how long a hung worker gets before SIGKILL.
pub(super) const FENCE_GRACE: Duration = Duration::from_secs(1);
/// A worker whose stdout closed while it runs is killed after this long.
pub(super) const PIPE_GRACE: Duration = Duration::from_secs(1);

/// What the agent knows of one worker's progress.
#[derive(Debug)]
pub(super) struct Watch {
    /// When this watch began (the worker started, or took the next generation).
    since: Instant,
    last_beat: Option<Instant>,
    /// When its progress last moved.
    last_move: Instant,
    snap: Option<Snapshot>,
    /// The step under way and when it was first seen.
    step_seen: Option<(u64, Instant)>,
    /// Recent step times (seconds), newest last.
    steps: VecDeque<f64>,
    /// It was found hung (told once).
    pub(super) hung: bool,
    /// The progress counter at which it was said to wait on its peers (once per stall).
    pub(super) waiting_told: Option<u64>,
}

/// A hung worker, in the words of its report.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Hang {
    pub step: u64,
    pub seq: u64,
    pub what: String,
    pub for_s: f64,
    pub limit_s: f64,
    pub stopped: bool,
}

impl Watch {
    pub(super) fn new(now: Instant) -> Watch {
        Watch {
            since: now,
            last_beat: None,
            last_move: now,
            snap: None,
            step_seen: None,
            steps: VecDeque::new(),
            hung: false,
            waiting_told: None,
        }
    }

    /// The worker took the next generation: its progress starts over, its step times hold.
    pub(super) fn restart(&mut self, now: Instant) {
        let steps = std::mem::take(&mut self.steps);
        *self = Watch {
            steps,
            ..Watch::new(now)
        };
    }

    /// When `--hang-timeout` is below the worker's measured step time, the sentence that says
    /// what its limits are instead (the flag is a floor, never a limit below what its steps
    /// need).
    pub(super) fn raised(&self, spec: &WatchSpec) -> Option<String> {
        let m = self.median_step_s()?;
        (m > spec.hang_timeout_s).then(|| {
            format!(
                "hang limits follow the step time (nothing is wrong): steps take {m:.2} s \
                 (median), above --hang-timeout {} s, so a worker that reports but does not \
                 move is taken for hung after {:.1} s ({} steps), one whose reports stop after \
                 {} s",
                spec.hang_timeout_s,
                spec.hang_factor * m,
                spec.hang_factor,
                spec.hang_timeout_s.max(SILENT_FLOOR.as_secs_f64())
            )
        })
    }

    pub(super) fn on_beat(&mut self, now: Instant, s: Snapshot) {
        self.last_beat = Some(now);
        if self.snap.as_ref().map(|p| p.seq) != Some(s.seq) {
            self.last_move = now;
        }
        if s.in_step {
            match self.step_seen {
                Some((step, at)) if step + 1 == s.step => {
                    self.steps.push_back((now - at).as_secs_f64());
                    if self.steps.len() > STEP_WINDOW {
                        self.steps.pop_front();
                    }
                    self.step_seen = Some((s.step, now));
                }
                Some((step, _)) if step == s.step => {}
                _ => self.step_seen = Some((s.step, now)),
            }
        }
        self.snap = Some(s);
    }

    /// The median of the recent step times, once one is known.
    pub(super) fn median_step_s(&self) -> Option<f64> {
        let mut v: Vec<f64> = self.steps.iter().copied().collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(v[v.len() / 2])
    }

    /// How long this worker may go without progress inside a step.
    pub(super) fn limit(&self, spec: &WatchSpec) -> Duration {
        let s = match self.median_step_s() {
            Some(m) => spec.hang_timeout_s.max(spec.hang_factor * m),
            None => spec.first_step_s,
        };
        Duration::from_secs_f64(s)
    }
}

/// Whether the worker watched by `w` is hung at `now`.
pub(super) fn verdict(w: &Watch, now: Instant, spec: &WatchSpec) -> Option<Hang> {
    let snap = w.snap.as_ref()?;
    if w.hung || !snap.in_step {
        return None;
    }
    let still = now.saturating_duration_since(w.last_move);
    let silent = now.saturating_duration_since(w.last_beat.unwrap_or(w.since));
    let hang = |stopped, limit: Duration| Hang {
        step: snap.step,
        seq: snap.seq,
        what: snap.describe(),
        for_s: still.as_secs_f64(),
        limit_s: limit.as_secs_f64(),
        stopped,
    };
    let silent_limit = Duration::from_secs_f64(spec.hang_timeout_s).max(SILENT_FLOOR);
    if silent > silent_limit {
        return Some(hang(true, silent_limit));
    }
    let limit = w.limit(spec);
    (still > limit && !snap.waits_for_control() && !snap.waits_on_peers())
        .then(|| hang(false, limit))
}

/// Whether the worker watched by `w` has waited on its peers, without moving, past its limit
/// (and not said so yet for this stall): not hung itself, but the master is told.
pub(super) fn waits_too_long(w: &Watch, now: Instant, spec: &WatchSpec) -> Option<Hang> {
    let snap = w.snap.as_ref()?;
    let limit = w.limit(spec);
    let still = now.saturating_duration_since(w.last_move);
    let fresh = w.waiting_told != Some(snap.seq);
    (!w.hung && snap.in_step && snap.waits_on_peers() && still > limit && fresh).then(|| Hang {
        step: snap.step,
        seq: snap.seq,
        what: snap.describe(),
        for_s: still.as_secs_f64(),
        limit_s: limit.as_secs_f64(),
        stopped: false,
    })
}

/// What the agent does about hung workers and broken pipes.
impl super::NodeAgent {
    pub(super) fn on_beat(&mut self, device: u32, s: Snapshot) {
        if let Some(w) = self.watch.get_mut(&device) {
            w.on_beat(Instant::now(), s);
        }
    }

    /// The next generation runs on `devices`: their watches start over.
    pub(super) fn rewatch(&mut self, devices: impl Iterator<Item = u32>) {
        let now = Instant::now();
        let mut next = BTreeMap::new();
        for d in devices {
            let mut w = self.watch.remove(&d).unwrap_or_else(|| Watch::new(now));
            w.restart(now);
            next.insert(d, w);
        }
        self.watch = next;
    }

    /// A worker whose stdout closed but that still runs after [`PIPE_GRACE`] is killed: it is
    /// reported as crashed when it is reaped.
    pub(super) fn check_pipe(&mut self, i: usize) {
        let w = &mut self.workers[i];
        if !w.relay.is_finished() || w.pipe_broken {
            return;
        }
        let now = Instant::now();
        match w.pipe_eof {
            None => w.pipe_eof = Some(now),
            Some(t) if now - t >= PIPE_GRACE => {
                eprintln!(
                    "oobleck agent: node {}: the worker of rank {} closed its report pipe but \
                     still runs; killing it (a crash)",
                    self.node, w.rank
                );
                w.pipe_broken = true;
                let _ = w.child.start_kill();
            }
            Some(_) => {}
        }
    }

    /// Finds hung workers, tells the master and fences them; SIGKILLs those whose SIGTERM
    /// grace ran out.
    pub(super) async fn watch_workers(&mut self) -> Result<()> {
        let Some(job) = &self.job else {
            return Ok(());
        };
        let spec = job.config.watch;
        let now = Instant::now();
        let mut hung = Vec::new();
        let mut waiting = Vec::new();
        for (i, w) in self.workers.iter_mut().enumerate() {
            if let Some(t) = w.kill_at {
                if now >= t {
                    let _ = w.child.start_kill();
                    w.kill_at = None;
                }
                continue;
            }
            let Some(watch) = self.watch.get_mut(&w.device) else {
                continue;
            };
            if let Some(why) = watch.raised(&spec).filter(|_| !self.limits_told) {
                eprintln!("oobleck agent: node {}: {why}", self.node);
                self.limits_told = true;
            }
            if let Some(h) = verdict(watch, now, &spec) {
                watch.hung = true;
                hung.push((i, h));
            } else if let Some(h) = waits_too_long(watch, now, &spec) {
                watch.waiting_told = Some(h.seq);
                waiting.push(WorkerReport::Waiting {
                    rank: w.rank,
                    step: h.step,
                    what: h.what,
                    for_s: h.for_s,
                });
            }
        }
        for report in waiting {
            self.send_report(report).await;
        }
        for (i, h) in hung {
            let rank = self.workers[i].rank;
            eprintln!(
                "oobleck agent: node {}: worker rank {rank} {} in {} for {:.1} s (limit {:.1} \
                 s); fencing it",
                self.node,
                if h.stopped { "is stopped" } else { "hung" },
                h.what,
                h.for_s,
                h.limit_s
            );
            fence(&mut self.workers[i], h.stopped).await;
            let report = WorkerReport::Hung {
                rank,
                what: h.what,
                for_s: h.for_s,
                limit_s: h.limit_s,
                stopped: h.stopped,
            };
            self.send_report(report).await;
        }
        Ok(())
    }
}

/// Makes sure a hung worker can never act again: SIGTERM, and SIGKILL after [`FENCE_GRACE`]
/// (at once for a stopped process, which cannot act on SIGTERM).
async fn fence(w: &mut super::spawn::Worker, stopped: bool) {
    if stopped {
        let _ = w.child.start_kill();
        return;
    }
    if let Some(pid) = w.child.id() {
        let term = tokio::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
        let _ = tokio::time::timeout(FENCE_GRACE, term).await;
    }
    w.kill_at = Some(Instant::now() + FENCE_GRACE);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::execution::Doing;

    fn spec() -> WatchSpec {
        WatchSpec::default()
    }

    fn snap(seq: u64, step: u64, doing: Vec<Doing>) -> Snapshot {
        Snapshot {
            seq,
            step,
            in_step: true,
            doing,
        }
    }

    fn fwd() -> Vec<Doing> {
        vec![Doing::Forward { mb: 0 }]
    }

    /// A watch that saw steps 1..=n, each `step_s` long, beating every 50 ms; returns the
    /// time of its last beat.
    fn steady(n: u64, step_s: f64) -> (Watch, Instant) {
        let t0 = Instant::now();
        let mut w = Watch::new(t0);
        let mut seq = 0;
        let mut t = t0;
        for step in 1..=n {
            let beats = (step_s / 0.05) as u64;
            for _ in 0..beats {
                seq += 1;
                w.on_beat(t, snap(seq, step, fwd()));
                t += Duration::from_millis(50);
            }
        }
        (w, t - Duration::from_millis(50))
    }

    #[test]
    fn the_limit_is_the_hang_timeout_or_k_median_steps_and_the_first_step_gets_longer() {
        let spec = spec();
        let (w, _) = steady(5, 0.4);
        let m = w.median_step_s().expect("steps seen");
        assert!((m - 0.4).abs() < 0.06, "{m}");
        // 3 x 0.4 s is under the 1.5 s floor.
        assert_eq!(w.limit(&spec), Duration::from_millis(1500));
        let (slow, _) = steady(4, 2.0);
        let l = slow.limit(&spec).as_secs_f64();
        assert!((l - 6.0).abs() < 0.2, "{l}");
        let said = slow.raised(&spec).expect("steps above the flag");
        assert!(
            said.contains("after 6.0 s (3 steps)") && said.contains("--hang-timeout 1.5 s"),
            "{said}"
        );
        // Steps shorter than the flag: nothing to say.
        assert_eq!(w.raised(&spec), None);
        // No step time yet: the first step's own limit.
        let w = Watch::new(Instant::now());
        assert_eq!(w.limit(&spec), Duration::from_secs(30));
    }

    #[test]
    fn a_worker_that_stops_beating_is_stopped_and_one_stuck_in_compute_is_hung() {
        let spec = spec();
        let (w, last) = steady(5, 0.5);
        assert_eq!(verdict(&w, last + Duration::from_millis(1400), &spec), None);
        let h = verdict(&w, last + Duration::from_millis(1600), &spec).expect("stopped");
        assert!(h.stopped, "{h:?}");
        assert_eq!(h.what, "the forward of microbatch 0 of step 5");
        assert!((h.limit_s - 1.5).abs() < 1e-9);

        // Stopped while it waited for the commit: its peers go on to the next step and wait
        // on it, so only its own silence can tell.
        let (mut w, last) = steady(5, 0.5);
        w.on_beat(last, snap(77_777, 5, vec![Doing::Commit]));
        let h = verdict(&w, last + Duration::from_millis(1600), &spec).expect("stopped");
        assert!(
            h.stopped && h.what == "waiting for the commit of step 5",
            "{h:?}"
        );
        // The silence limit does not grow with the step time: beats do not depend on it.
        let (w, last) = steady(4, 2.0);
        assert!(verdict(&w, last + Duration::from_millis(1600), &spec).is_some());

        // Beats go on (the process runs) but nothing moves, inside the forward.
        let (mut w, last) = steady(5, 0.5);
        let seq = w.snap.as_ref().expect("beats").seq;
        for i in 1..=50 {
            w.on_beat(last + Duration::from_millis(50 * i), snap(seq, 5, fwd()));
        }
        let h = verdict(&w, last + Duration::from_millis(2550), &spec).expect("hung");
        assert!(!h.stopped && h.for_s > 2.0, "{h:?}");
    }

    #[test]
    fn a_worker_waiting_on_its_peers_or_the_master_or_between_steps_is_not_hung() {
        let spec = spec();
        let later = |w: &mut Watch, last: Instant, s: Snapshot| {
            for i in 1..=100 {
                w.on_beat(last + Duration::from_millis(50 * i), s.clone());
            }
            last + Duration::from_millis(5000)
        };
        let recv = vec![Doing::Recv {
            peer: 2,
            mb: Some(1),
            gradient: false,
        }];
        for s in [
            snap(999, 5, recv),
            snap(999, 5, vec![Doing::Commit]),
            Snapshot {
                in_step: false,
                ..snap(999, 5, fwd())
            },
        ] {
            let (mut w, last) = steady(5, 0.5);
            let at = later(&mut w, last, s.clone());
            assert_eq!(verdict(&w, at, &spec), None, "{s:?}");
        }
    }

    #[test]
    fn a_worker_waiting_on_its_peers_too_long_is_said_once_per_stall() {
        let spec = spec();
        let (mut w, last) = steady(5, 0.5);
        let recv = |seq| {
            snap(
                seq,
                6,
                vec![Doing::AllReduce {
                    index: 1,
                    ranks: 3,
                    bytes: 4096,
                }],
            )
        };
        for i in 1..=40 {
            w.on_beat(last + Duration::from_millis(50 * i), recv(5000));
        }
        let at = last + Duration::from_millis(2000);
        let h = waits_too_long(&w, at, &spec).expect("waits past its limit");
        assert_eq!((h.step, h.seq), (6, 5000));
        assert!(
            h.what.starts_with("all_reduce #1 (3 ranks, 4.1 KB)"),
            "{h:?}"
        );
        assert_eq!(verdict(&w, at, &spec), None, "waiting is not hung");
        w.waiting_told = Some(h.seq);
        assert_eq!(waits_too_long(&w, at, &spec), None, "said once");
        // It moves, then stalls again: a new stall, said again.
        for i in 41..=80 {
            w.on_beat(last + Duration::from_millis(50 * i), recv(5001));
        }
        assert!(waits_too_long(&w, last + Duration::from_millis(4100), &spec).is_some());
    }

    #[test]
    fn a_slow_worker_that_moves_is_never_hung() {
        let spec = spec();
        // Steps of 0.5 s, then one microbatch takes 1.4 s at a time, for 14 s: it moves.
        let (mut w, mut t) = steady(5, 0.5);
        for seq in 10_000..10_010 {
            for _ in 0..28 {
                t += Duration::from_millis(50);
                w.on_beat(t, snap(seq, 6, fwd()));
                assert_eq!(verdict(&w, t, &spec), None);
            }
        }
    }
}
