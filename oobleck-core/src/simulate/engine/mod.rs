//! The event loop our own policies share: nodes appear (usable after a start-up delay) and
//! disappear as the trace says, and a [`Reactor`] decides what each change costs and how fast
//! the job trains afterwards. Between changes the job trains at a constant rate, so time is
//! accounted in closed form (whole steps, checkpoints every `k` steps), never step by step:
//! a week of 10 ms steps costs no more than a week of 10 s steps.
//!
//! - `book`: where the time goes (steps, checkpoints, rollbacks) and the throughput series.
//! - `changes`: trace lines and start-up completions, in time order, by instant.

mod book;
mod changes;
#[cfg(test)]
mod tests;

use std::collections::BTreeSet;

use book::Book;
use changes::Changes;

use super::outcome::{Mark, Outcome, TimeKind};
use super::trace::{Change, Trace};
use super::SimError;

/// How the job trains between changes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Running {
    pub step_ms: f64,
    pub samples_per_step: f64,
    /// Share of each step spent on redundant computation (counted as [`TimeKind::Redundant`]).
    pub redundant_share: f64,
    /// A checkpoint after every `every` steps, taking `cost_ms` each (0 = never).
    pub checkpoint_every: u64,
    pub checkpoint_ms: f64,
}

impl Running {
    /// Samples per second over a whole checkpoint cycle.
    fn samples_per_s(&self) -> f64 {
        let k = self.checkpoint_every as f64;
        let cycle = if self.checkpoint_every > 0 {
            (k * self.step_ms + self.checkpoint_ms) / k
        } else {
            self.step_ms
        };
        self.samples_per_step / cycle * 1e3
    }
}

/// What a change throws away of the work in progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Loss {
    /// Nothing (the change waits for a step boundary, or the job is not running).
    Nothing,
    /// The step in flight.
    InFlight,
    /// Every step since the last checkpoint, and the step in flight.
    SinceCheckpoint,
    /// Nothing: the pause starts with a checkpoint of everything so far.
    CheckpointFirst,
}

/// A policy's answer to a change.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Reaction {
    /// The job goes on as it was (e.g. a node it did not use went away).
    Keep,
    /// The job stops, loses `loss`, spends `pause` (in order), then trains as `then`, or
    /// waits idle for the next change when `then` is `None`.
    Stop {
        loss: Loss,
        pause: Vec<(TimeKind, f64)>,
        then: Option<Running>,
        /// What to count: an in-place reconfiguration, or a full restart.
        counted: Counted,
        note: Option<String>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counted {
    Nothing,
    Reconfiguration,
    Restart,
}

/// A policy in the shared loop.
pub(crate) trait Reactor {
    /// `lost`: usable nodes that just went away; `joined`: nodes that just became usable;
    /// `usable`: every usable node after the change, ascending. Losses are told at once;
    /// joins while the job trains wait for the next step boundary (as the runtime admits
    /// them).
    fn react(&mut self, lost: &[u32], joined: &[u32], usable: &[u32])
        -> Result<Reaction, SimError>;
}

/// Settings of the loop.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct LoopOptions {
    /// From a node's `add` until it is usable.
    pub startup_ms: u64,
    /// Where the simulation stops (events after it are ignored).
    pub end_ms: u64,
}

enum Phase {
    Idle,
    /// Spending `pause` (in order) from `began`, then `then`.
    Paused {
        began: f64,
        pause: Vec<(TimeKind, f64)>,
        then: Option<Running>,
    },
    Running {
        run: Running,
        since: f64,
    },
}

/// Replays `trace` under `reactor`.
pub(crate) fn run_loop(
    trace: &Trace,
    reactor: &mut dyn Reactor,
    opts: LoopOptions,
    policy: String,
) -> Result<Outcome, SimError> {
    let mut replay = Replay::new(trace, opts);
    while let Some(t) = replay.next_instant() {
        replay.step(t, reactor)?;
    }
    Ok(replay.outcome(policy))
}

/// The loop's state between instants.
struct Replay<'a> {
    changes: Changes<'a>,
    book: Book,
    usable: BTreeSet<u32>,
    marks: Vec<Mark>,
    failures: u64,
    phase: Phase,
    /// When the first nodes became usable: the averaged span starts there.
    start: Option<f64>,
    clock: f64,
    /// Nodes usable while the job trains, admitted at the next step boundary.
    pending_joins: Vec<u32>,
    end_ms: u64,
}

impl<'a> Replay<'a> {
    fn new(trace: &'a Trace, opts: LoopOptions) -> Self {
        Replay {
            changes: Changes::new(trace, opts.startup_ms),
            book: Book::new(),
            usable: BTreeSet::new(),
            marks: Vec::new(),
            failures: 0,
            phase: Phase::Idle,
            start: None,
            clock: 0.0,
            pending_joins: Vec::new(),
            end_ms: opts.end_ms,
        }
    }

    /// The end of the step in flight, when joins wait for it.
    fn boundary(&self) -> Option<f64> {
        match &self.phase {
            Phase::Running { run, since } if !self.pending_joins.is_empty() => {
                Some(boundary_after(&self.book, run, *since, self.clock))
            }
            _ => None,
        }
    }

    fn pause_end(&self) -> Option<f64> {
        match &self.phase {
            Phase::Paused { began, pause, .. } => {
                Some(began + pause.iter().map(|p| p.1).sum::<f64>())
            }
            _ => None,
        }
    }

    /// The next instant something happens; `None` once the end is reached (the books are
    /// closed then).
    fn next_instant(&mut self) -> Option<f64> {
        let change = self.changes.next_time().map(|t| t as f64);
        let t = [change, self.boundary(), self.pause_end()]
            .into_iter()
            .flatten()
            .fold(f64::INFINITY, f64::min);
        let end = self.end_ms as f64;
        if t > end || t.is_infinite() {
            let started = self.start.is_some();
            advance(&mut self.book, &mut self.phase, self.clock, end, started);
            finish(&mut self.book, &self.phase, end);
            return None;
        }
        Some(t)
    }

    /// Everything at instant `t`: the time up to it, a pause ending, the trace's changes and
    /// the reactor's answer.
    fn step(&mut self, t: f64, reactor: &mut dyn Reactor) -> Result<(), SimError> {
        let (boundary, pause_end) = (self.boundary(), self.pause_end());
        let started = self.start.is_some();
        advance(&mut self.book, &mut self.phase, self.clock, t, started);
        self.clock = t;
        if pause_end == Some(t) {
            if let Phase::Paused { then, .. } = std::mem::replace(&mut self.phase, Phase::Idle) {
                self.phase = resume(&mut self.book, then, t);
            }
        }
        let (lost, mut joined) = self.take(t);
        let running = matches!(self.phase, Phase::Running { .. });
        if running && lost.is_empty() && boundary != Some(t) {
            self.pending_joins.extend(joined);
            return Ok(());
        }
        joined.append(&mut self.pending_joins);
        if lost.is_empty() && joined.is_empty() {
            return Ok(());
        }
        let usable: Vec<u32> = self.usable.iter().copied().collect();
        let reaction = reactor.react(&lost, &joined, &usable)?;
        let phase = std::mem::replace(&mut self.phase, Phase::Idle);
        self.phase = apply(&mut self.book, phase, reaction, t);
        Ok(())
    }

    /// The trace's changes at `t`, if any: `(lost, joined)`.
    fn take(&mut self, t: f64) -> (Vec<u32>, Vec<u32>) {
        if self.changes.next_time().map(|c| c as f64) != Some(t) {
            return (Vec::new(), Vec::new());
        }
        let now = self.changes.take(t as u64, &mut self.usable);
        self.failures += (now.marks.iter())
            .filter(|m| m.change == Change::Remove)
            .count() as u64;
        self.marks.extend(now.marks);
        if self.start.is_none() && !now.joined.is_empty() {
            self.start = Some(t);
        }
        (now.lost, now.joined)
    }

    fn outcome(self, policy: String) -> Outcome {
        let end = self.end_ms as f64;
        let start = self.start.unwrap_or(end);
        let book = self.book;
        Outcome {
            policy,
            average_samples_per_s: if end > start {
                book.samples / (end - start) * 1e3
            } else {
                0.0
            },
            time_fractions: book.ledger.fractions(),
            start_ms: start.round() as u64,
            end_ms: self.end_ms,
            samples: book.samples,
            steps: book.steps,
            failures: self.failures,
            reconfigurations: book.reconfigurations,
            restarts: book.restarts,
            timeline: book.timeline,
            marks: self.marks,
            notes: book.notes,
        }
    }
}

/// The end of the step (or checkpoint) in flight at `now`.
fn boundary_after(book: &Book, run: &Running, since: f64, now: f64) -> f64 {
    let in_checkpoint =
        run.checkpoint_every > 0 && book.steps_since_checkpoint >= run.checkpoint_every;
    let len = if in_checkpoint {
        run.checkpoint_ms
    } else {
        run.step_ms
    };
    (since + len).max(now)
}

/// Accounts the time from `from` to `to` in the current phase.
fn advance(book: &mut Book, phase: &mut Phase, from: f64, to: f64, started: bool) {
    match phase {
        Phase::Idle if started => book.ledger.add(TimeKind::Idle, to - from),
        Phase::Idle => {}
        Phase::Paused { began, pause, .. } => {
            // Each part of the pause counts as its kind for the time that overlaps.
            let mut at = *began;
            for &(kind, ms) in pause.iter() {
                let overlap = (to.min(at + ms) - from.max(at)).max(0.0);
                book.ledger.add(kind, overlap);
                at += ms;
            }
        }
        Phase::Running { run, since } => *since = book.train(run, *since, to),
    }
}

/// At the end, the work in flight counts pro rata (the run goes on past the end).
fn finish(book: &mut Book, phase: &Phase, end: f64) {
    if let Phase::Running { run, since } = phase {
        let partial = end - since;
        book.ledger.add(TimeKind::Useful, partial);
        book.samples += partial / run.step_ms * run.samples_per_step;
    }
}

fn resume(book: &mut Book, then: Option<Running>, t: f64) -> Phase {
    match then {
        Some(run) => {
            book.point(t, run.samples_per_s());
            Phase::Running { run, since: t }
        }
        None => Phase::Idle,
    }
}

/// Carries out a reaction at time `t`.
fn apply(book: &mut Book, phase: Phase, reaction: Reaction, t: f64) -> Phase {
    let Reaction::Stop {
        loss,
        pause,
        then,
        counted,
        note,
    } = reaction
    else {
        return phase;
    };
    match phase {
        Phase::Running { since, .. } => book.lose(loss, t - since),
        // A restart while paused or idle still rolls back to the last checkpoint.
        _ if loss == Loss::SinceCheckpoint => book.roll_back(),
        _ if loss == Loss::CheckpointFirst => book.lose(loss, 0.0),
        _ => {}
    }
    match counted {
        Counted::Nothing => {}
        Counted::Reconfiguration => book.reconfigurations += 1,
        Counted::Restart => book.restarts += 1,
    }
    if let Some(note) = note {
        if !book.notes.contains(&note) {
            book.notes.push(note);
        }
    }
    let total: f64 = pause.iter().map(|p| p.1).sum();
    if total <= 0.0 {
        return resume(book, then, t);
    }
    book.point(t, 0.0);
    Phase::Paused {
        began: t,
        pause,
        then,
    }
}
