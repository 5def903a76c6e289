//! The event loop our own policies share: nodes appear (usable after a start-up delay) and
//! disappear as the trace says, and a [`Reactor`] decides what each change costs and how fast
//! the job trains afterwards. Between changes the job trains at a constant rate, so time is
//! accounted in closed form (whole steps, checkpoints every `k` steps), never step by step:
//! a week of 10 ms steps costs no more than a week of 10 s steps.

use std::collections::{BTreeSet, HashMap, VecDeque};

use super::outcome::{Ledger, Mark, Outcome, TimeKind, TimePoint};
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

/// Useful and redundant milliseconds and samples of the steps since the last checkpoint.
#[derive(Default)]
struct Rolled {
    useful_ms: f64,
    redundant_ms: f64,
    samples: f64,
}

/// Accumulates the outcome while the loop runs.
struct Book {
    ledger: Ledger,
    samples: f64,
    steps: u64,
    steps_since_checkpoint: u64,
    /// What the steps since the last checkpoint added, to take back on a rollback.
    since_checkpoint: Rolled,
    timeline: Vec<TimePoint>,
    reconfigurations: u64,
    restarts: u64,
    notes: Vec<String>,
}

impl Book {
    fn point(&mut self, t: f64, samples_per_s: f64) {
        let t_ms = t.round() as u64;
        if let Some(last) = self.timeline.last_mut() {
            if last.t_ms == t_ms {
                last.samples_per_s = samples_per_s;
                return;
            }
            if last.samples_per_s == samples_per_s {
                return;
            }
        }
        self.timeline.push(TimePoint {
            t_ms,
            samples_per_s,
        });
    }

    fn commit(&mut self, run: &Running, steps: u64) {
        let ms = steps as f64 * run.step_ms;
        let (useful, redundant) = (ms * (1.0 - run.redundant_share), ms * run.redundant_share);
        let samples = steps as f64 * run.samples_per_step;
        self.ledger.add(TimeKind::Useful, useful);
        self.ledger.add(TimeKind::Redundant, redundant);
        self.samples += samples;
        self.steps += steps;
        self.steps_since_checkpoint += steps;
        self.since_checkpoint.useful_ms += useful;
        self.since_checkpoint.redundant_ms += redundant;
        self.since_checkpoint.samples += samples;
    }

    fn checkpointed(&mut self, ms: f64) {
        self.ledger.add(TimeKind::Checkpointing, ms);
        self.steps_since_checkpoint = 0;
        self.since_checkpoint = Rolled::default();
    }

    /// Takes back every step since the last checkpoint.
    fn roll_back(&mut self) {
        let r = std::mem::take(&mut self.since_checkpoint);
        self.ledger.add(TimeKind::Useful, -r.useful_ms);
        self.ledger.add(TimeKind::Redundant, -r.redundant_ms);
        self.ledger
            .add(TimeKind::Lost, r.useful_ms + r.redundant_ms);
        self.samples -= r.samples;
        self.steps -= self.steps_since_checkpoint;
        self.steps_since_checkpoint = 0;
    }

    /// Trains from `since` to `t`; returns where the step (or checkpoint) in flight began.
    fn train(&mut self, run: &Running, mut since: f64, t: f64) -> f64 {
        let k = run.checkpoint_every;
        loop {
            let elapsed = t - since;
            if k == 0 {
                let n = (elapsed / run.step_ms).floor().max(0.0) as u64;
                self.commit(run, n);
                return since + n as f64 * run.step_ms;
            }
            let to_go = k.saturating_sub(self.steps_since_checkpoint);
            let cycle_end = to_go as f64 * run.step_ms + run.checkpoint_ms;
            if elapsed < cycle_end {
                let n = ((elapsed / run.step_ms).floor().max(0.0) as u64).min(to_go);
                self.commit(run, n);
                return since + n as f64 * run.step_ms;
            }
            self.commit(run, to_go);
            self.checkpointed(run.checkpoint_ms);
            since += cycle_end;
            // Whole cycles at once.
            let full = k as f64 * run.step_ms + run.checkpoint_ms;
            let cycles = ((t - since) / full).floor().max(0.0) as u64;
            if cycles > 0 {
                self.commit(run, cycles * k);
                self.checkpointed(cycles as f64 * run.checkpoint_ms);
                since += cycles as f64 * full;
            }
        }
    }

    /// Throws away the work `loss` names; `partial` is the time spent on the work in flight.
    fn lose(&mut self, loss: Loss, partial: f64) {
        match loss {
            Loss::Nothing => self.ledger.add(TimeKind::Useful, partial),
            Loss::InFlight => self.ledger.add(TimeKind::Lost, partial),
            Loss::SinceCheckpoint => {
                self.ledger.add(TimeKind::Lost, partial);
                self.roll_back();
            }
            Loss::CheckpointFirst => {
                self.ledger.add(TimeKind::Useful, partial);
                self.steps_since_checkpoint = 0;
                self.since_checkpoint = Rolled::default();
            }
        }
    }
}

/// Trace events and start-up completions, in time order.
struct Changes<'a> {
    trace: &'a Trace,
    next: usize,
    ids: HashMap<&'a str, u32>,
    starting: VecDeque<(u64, u32)>,
    removed_early: BTreeSet<u32>,
    next_id: u32,
    startup_ms: u64,
}

/// The changes that happen at one instant.
#[derive(Default)]
struct Instant {
    lost: Vec<u32>,
    joined: Vec<u32>,
    marks: Vec<Mark>,
}

impl<'a> Changes<'a> {
    fn next_time(&self) -> Option<u64> {
        let a = self.trace.events().get(self.next).map(|e| e.at_ms);
        let b = self.starting.front().map(|s| s.0);
        match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Everything at time `t`: trace lines first, then nodes finishing their start-up.
    fn take(&mut self, t: u64, usable: &mut BTreeSet<u32>) -> Instant {
        let mut now = Instant::default();
        while let Some(e) = self.trace.events().get(self.next).filter(|e| e.at_ms == t) {
            self.next += 1;
            now.marks.push(Mark {
                t_ms: t,
                change: e.change,
                node: e.node.clone(),
            });
            match e.change {
                Change::Add => {
                    let id = self.next_id;
                    self.next_id += 1;
                    self.ids.insert(&e.node, id);
                    self.starting.push_back((t + self.startup_ms, id));
                }
                Change::Remove => {
                    let id = self.ids.remove(e.node.as_str()).expect("checked trace");
                    if usable.remove(&id) {
                        now.lost.push(id);
                    } else {
                        self.removed_early.insert(id);
                    }
                }
            }
        }
        while let Some(&(at, id)) = self.starting.front().filter(|s| s.0 == t) {
            let _ = at;
            self.starting.pop_front();
            if !self.removed_early.remove(&id) {
                usable.insert(id);
                now.joined.push(id);
            }
        }
        now
    }
}

/// Replays `trace` under `reactor`.
pub(crate) fn run_loop(
    trace: &Trace,
    reactor: &mut dyn Reactor,
    opts: LoopOptions,
    policy: String,
) -> Result<Outcome, SimError> {
    let mut changes = Changes {
        trace,
        next: 0,
        ids: HashMap::new(),
        starting: VecDeque::new(),
        removed_early: BTreeSet::new(),
        next_id: 0,
        startup_ms: opts.startup_ms,
    };
    let mut book = Book {
        ledger: Ledger::default(),
        samples: 0.0,
        steps: 0,
        steps_since_checkpoint: 0,
        since_checkpoint: Rolled::default(),
        timeline: Vec::new(),
        reconfigurations: 0,
        restarts: 0,
        notes: Vec::new(),
    };
    let mut usable = BTreeSet::new();
    let mut marks = Vec::new();
    let mut failures = 0u64;
    let mut phase = Phase::Idle;
    let mut start: Option<f64> = None;
    let mut clock = 0.0f64;
    let mut pending_joins: Vec<u32> = Vec::new();
    let end = opts.end_ms as f64;
    loop {
        let next_change = changes.next_time().map(|t| t as f64);
        let boundary = match &phase {
            Phase::Running { run, since } if !pending_joins.is_empty() => {
                Some(boundary_after(&book, run, *since, clock))
            }
            _ => None,
        };
        let pause_end = match &phase {
            Phase::Paused { began, pause, .. } => {
                Some(began + pause.iter().map(|p| p.1).sum::<f64>())
            }
            _ => None,
        };
        let t = [next_change, boundary, pause_end]
            .into_iter()
            .flatten()
            .fold(f64::INFINITY, f64::min);
        if t > end || t.is_infinite() {
            advance(&mut book, &mut phase, clock, end, start.is_some());
            finish(&mut book, &phase, end);
            break;
        }
        advance(&mut book, &mut phase, clock, t, start.is_some());
        clock = t;
        if pause_end == Some(t) {
            if let Phase::Paused { then, .. } = phase {
                phase = resume(&mut book, then, t);
            }
        }
        let mut lost = Vec::new();
        let mut joined = Vec::new();
        if next_change == Some(t) {
            let now = changes.take(t as u64, &mut usable);
            failures += now
                .marks
                .iter()
                .filter(|m| m.change == Change::Remove)
                .count() as u64;
            marks.extend(now.marks);
            lost = now.lost;
            joined = now.joined;
            if start.is_none() && !joined.is_empty() {
                start = Some(t);
            }
        }
        let at_boundary = boundary == Some(t);
        let running = matches!(phase, Phase::Running { .. });
        if running && lost.is_empty() && !at_boundary {
            pending_joins.extend(joined);
            continue;
        }
        joined.append(&mut pending_joins);
        if lost.is_empty() && joined.is_empty() {
            continue;
        }
        let usable_now: Vec<u32> = usable.iter().copied().collect();
        let reaction = reactor.react(&lost, &joined, &usable_now)?;
        phase = apply(&mut book, phase, reaction, t);
    }
    let start_ms = start.unwrap_or(end).round() as u64;
    Ok(Outcome {
        policy,
        average_samples_per_s: if end > start.unwrap_or(end) {
            book.samples / (end - start.unwrap_or(end)) * 1e3
        } else {
            0.0
        },
        time_fractions: book.ledger.fractions(),
        start_ms,
        end_ms: opts.end_ms,
        samples: book.samples,
        steps: book.steps,
        failures,
        reconfigurations: book.reconfigurations,
        restarts: book.restarts,
        timeline: book.timeline,
        marks,
        notes: book.notes,
    })
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

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;

    fn book() -> Book {
        Book {
            ledger: Ledger::default(),
            samples: 0.0,
            steps: 0,
            steps_since_checkpoint: 0,
            since_checkpoint: Rolled::default(),
            timeline: Vec::new(),
            reconfigurations: 0,
            restarts: 0,
            notes: Vec::new(),
        }
    }

    /// Steps and checkpoints one at a time, as the closed form must agree with.
    fn step_by_step(run: &Running, t: f64) -> (u64, f64) {
        let (mut now, mut steps, mut since_ckpt, mut ckpt_ms) = (0.0, 0u64, 0u64, 0.0);
        loop {
            if run.checkpoint_every > 0 && since_ckpt == run.checkpoint_every {
                if now + run.checkpoint_ms > t {
                    return (steps, ckpt_ms);
                }
                now += run.checkpoint_ms;
                ckpt_ms += run.checkpoint_ms;
                since_ckpt = 0;
            } else {
                if now + run.step_ms > t {
                    return (steps, ckpt_ms);
                }
                now += run.step_ms;
                steps += 1;
                since_ckpt += 1;
            }
        }
    }

    #[test]
    fn closed_form_matches_step_by_step() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        for _ in 0..2000 {
            let run = Running {
                step_ms: rng.random_range(1..50) as f64,
                samples_per_step: 8.0,
                redundant_share: 0.25,
                checkpoint_every: rng.random_range(0..6),
                checkpoint_ms: rng.random_range(0..40) as f64,
            };
            let t = rng.random_range(0..3000) as f64;
            // In two pieces, as the loop advances between events.
            let cut = rng.random_range(0..=t as u64) as f64;
            let mut b = book();
            let since = b.train(&run, 0.0, cut);
            b.train(&run, since, t);
            let (steps, ckpt) = step_by_step(&run, t);
            assert_eq!(b.steps, steps, "{run:?} t {t} cut {cut}");
            assert_eq!(b.ledger.get(TimeKind::Checkpointing), ckpt, "{run:?} t {t}");
            let work = steps as f64 * run.step_ms;
            assert!((b.ledger.get(TimeKind::Useful) - 0.75 * work).abs() < 1e-6);
            assert!((b.ledger.get(TimeKind::Redundant) - 0.25 * work).abs() < 1e-6);
            assert_eq!(b.samples, 8.0 * steps as f64);
        }
    }

    /// Who was lost and who joined, at each question.
    type Asked = Vec<(Vec<u32>, Vec<u32>)>;

    /// Trains at 100 ms steps; every change costs a 1 s pause, a loss also `loss`; records
    /// what it was asked.
    struct Fixed {
        asked: Asked,
        loss: Loss,
    }

    impl Reactor for Fixed {
        fn react(&mut self, lost: &[u32], joined: &[u32], _: &[u32]) -> Result<Reaction, SimError> {
            self.asked.push((lost.to_vec(), joined.to_vec()));
            Ok(Reaction::Stop {
                loss: if lost.is_empty() {
                    Loss::Nothing
                } else {
                    self.loss
                },
                pause: vec![(TimeKind::Reconfiguration, 1000.0)],
                then: Some(Running {
                    step_ms: 100.0,
                    samples_per_step: 10.0,
                    redundant_share: 0.0,
                    checkpoint_every: 10,
                    checkpoint_ms: 50.0,
                }),
                counted: Counted::Reconfiguration,
                note: None,
            })
        }
    }

    fn replay(csv: &str, loss: Loss, end_ms: u64) -> (Outcome, Asked) {
        let trace = Trace::parse(csv).unwrap();
        let mut r = Fixed {
            asked: Vec::new(),
            loss,
        };
        let opts = LoopOptions {
            startup_ms: 500,
            end_ms,
        };
        let out = run_loop(&trace, &mut r, opts, "fixed".into()).unwrap();
        (out, r.asked)
    }

    #[test]
    fn every_millisecond_is_accounted_once() {
        let csv = "0,add,a\n0,add,b\n3080,remove,a\n4000,add,c\n4100,remove,c\n9000,add,d\n";
        for loss in [Loss::InFlight, Loss::SinceCheckpoint] {
            let (out, asked) = replay(csv, loss, 20_000);
            // The span starts when the first nodes are usable (0 + 500 ms start-up).
            assert_eq!((out.start_ms, out.end_ms), (500, 20_000));
            let f = out.time_fractions;
            let sum: f64 = TimeKind::ALL.iter().map(|&k| f.get(k)).sum();
            assert!((sum - 1.0).abs() < 1e-12, "{f:?}");
            // c is removed before its start-up ends: it never joins. d joins at 9500.
            let joins: Vec<&Vec<u32>> = asked.iter().map(|a| &a.1).collect();
            assert_eq!(joins, [&vec![0, 1], &vec![], &vec![3]], "{asked:?}");
            assert_eq!(out.failures, 2);
            assert_eq!(out.reconfigurations, 3);
            let (useful, lost) = (f.useful * 19_500.0, f.lost * 19_500.0);
            assert!(
                lost > 0.0 && useful > 0.0,
                "{f:?} {asked:?} {:?}",
                out.timeline
            );
            // Samples kept are 10 per 100 ms of useful time (whole steps, plus the step in
            // flight at the end pro rata).
            assert!(
                (out.samples - useful / 10.0).abs() < 1e-6,
                "{} {useful}",
                out.samples
            );
            assert!((out.average_samples_per_s - out.samples / 19.5).abs() < 1e-9);
        }
        // A rollback loses what the steps since the checkpoint did: more than the in-flight
        // step alone.
        let (a, _) = replay(csv, Loss::InFlight, 20_000);
        let (b, _) = replay(csv, Loss::SinceCheckpoint, 20_000);
        assert!(b.time_fractions.lost > a.time_fractions.lost);
        assert!(b.steps < a.steps);
    }

    #[test]
    fn joins_wait_for_the_step_boundary() {
        // Training from 1500 (ready at 500, then a 1 s pause) in 100 ms steps; e is usable
        // at 2040 and admitted at the end of the step in flight, 2100.
        let (out, asked) = replay("0,add,a\n1540,add,e\n", Loss::InFlight, 5000);
        assert_eq!(asked.len(), 2, "{asked:?}");
        assert_eq!(out.timeline.first().map(|p| p.t_ms), Some(500));
        assert!(
            out.timeline
                .iter()
                .any(|p| p.t_ms == 2100 && p.samples_per_s == 0.0),
            "{:?}",
            out.timeline
        );
    }
}
