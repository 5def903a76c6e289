//! Where the time goes while the job trains: whole steps, checkpoints every `k` steps, the
//! steps since the last checkpoint (taken back on a rollback), and the throughput series.

use super::{Loss, Running};
use crate::simulate::outcome::{Ledger, TimeKind, TimePoint};

/// Useful and redundant milliseconds and samples of the steps since the last checkpoint.
#[derive(Default)]
pub(super) struct Rolled {
    pub(super) useful_ms: f64,
    pub(super) redundant_ms: f64,
    pub(super) samples: f64,
}

/// Accumulates the outcome while the loop runs.
pub(super) struct Book {
    pub(super) ledger: Ledger,
    pub(super) samples: f64,
    pub(super) steps: u64,
    pub(super) steps_since_checkpoint: u64,
    /// What the steps since the last checkpoint added, to take back on a rollback.
    pub(super) since_checkpoint: Rolled,
    pub(super) timeline: Vec<TimePoint>,
    pub(super) reconfigurations: u64,
    pub(super) restarts: u64,
    pub(super) notes: Vec<String>,
}

impl Book {
    pub(super) fn new() -> Book {
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

    pub(super) fn point(&mut self, t: f64, samples_per_s: f64) {
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

    pub(super) fn commit(&mut self, run: &Running, steps: u64) {
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

    pub(super) fn checkpointed(&mut self, ms: f64) {
        self.ledger.add(TimeKind::Checkpointing, ms);
        self.steps_since_checkpoint = 0;
        self.since_checkpoint = Rolled::default();
    }

    /// Takes back every step since the last checkpoint.
    pub(super) fn roll_back(&mut self) {
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
    pub(super) fn train(&mut self, run: &Running, mut since: f64, t: f64) -> f64 {
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
    pub(super) fn lose(&mut self, loss: Loss, partial: f64) {
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
