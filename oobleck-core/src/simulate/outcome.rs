//! What a simulated run produced: its average throughput, where its time went, and its
//! throughput over time with the trace's events marked.

use serde::Serialize;

use super::trace::Change;

/// Where a stretch of wall-clock time went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TimeKind {
    /// Training steps whose results are kept.
    Useful,
    /// Training steps that were computed and then thrown away (the step in flight at a
    /// failure; everything since the last checkpoint on a restart).
    Lost,
    /// Stopping, restarting processes and reloading a checkpoint.
    Restart,
    /// Writing checkpoints.
    Checkpointing,
    /// Re-planning in place: detection, new plan, communicators, layer copies.
    Reconfiguration,
    /// The share of each step spent on redundant computation (Bamboo).
    Redundant,
    /// Nothing can train: too few nodes, or waiting for nodes to start.
    Idle,
}

impl TimeKind {
    pub const ALL: [TimeKind; 7] = [
        TimeKind::Useful,
        TimeKind::Lost,
        TimeKind::Restart,
        TimeKind::Checkpointing,
        TimeKind::Reconfiguration,
        TimeKind::Redundant,
        TimeKind::Idle,
    ];

    /// The snake_case name used in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            TimeKind::Useful => "useful",
            TimeKind::Lost => "lost",
            TimeKind::Restart => "restart",
            TimeKind::Checkpointing => "checkpointing",
            TimeKind::Reconfiguration => "reconfiguration",
            TimeKind::Redundant => "redundant",
            TimeKind::Idle => "idle",
        }
    }
}

/// Adds up milliseconds by [`TimeKind`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Ledger {
    ms: [f64; 7],
}

impl Ledger {
    pub fn add(&mut self, kind: TimeKind, ms: f64) {
        self.ms[kind as usize] += ms;
    }

    pub fn get(&self, kind: TimeKind) -> f64 {
        self.ms[kind as usize]
    }

    pub fn total_ms(&self) -> f64 {
        self.ms.iter().sum()
    }

    /// Each kind's share of the total (all 0 when nothing was added).
    pub fn fractions(&self) -> TimeFractions {
        let total = self.total_ms();
        let f = |k: TimeKind| {
            if total > 0.0 {
                self.get(k) / total
            } else {
                0.0
            }
        };
        TimeFractions {
            useful: f(TimeKind::Useful),
            lost: f(TimeKind::Lost),
            restart: f(TimeKind::Restart),
            checkpointing: f(TimeKind::Checkpointing),
            reconfiguration: f(TimeKind::Reconfiguration),
            redundant: f(TimeKind::Redundant),
            idle: f(TimeKind::Idle),
        }
    }
}

/// Shares of the simulated time; they add up to 1 (or are all 0 for an empty run).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct TimeFractions {
    pub useful: f64,
    pub lost: f64,
    pub restart: f64,
    pub checkpointing: f64,
    pub reconfiguration: f64,
    pub redundant: f64,
    pub idle: f64,
}

impl TimeFractions {
    pub fn get(&self, kind: TimeKind) -> f64 {
        match kind {
            TimeKind::Useful => self.useful,
            TimeKind::Lost => self.lost,
            TimeKind::Restart => self.restart,
            TimeKind::Checkpointing => self.checkpointing,
            TimeKind::Reconfiguration => self.reconfiguration,
            TimeKind::Redundant => self.redundant,
            TimeKind::Idle => self.idle,
        }
    }
}

/// Throughput from `t_ms` until the next point (a step function).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TimePoint {
    pub t_ms: u64,
    pub samples_per_s: f64,
}

/// A trace event as it happened to the run, for marking it on a chart.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Mark {
    pub t_ms: u64,
    pub change: Change,
    pub node: String,
}

/// The result of one policy on one trace.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Outcome {
    pub policy: String,
    /// Samples trained and kept per second of the averaged span.
    pub average_samples_per_s: f64,
    pub time_fractions: TimeFractions,
    /// Start and end of the averaged span (ms since the trace's start).
    pub start_ms: u64,
    pub end_ms: u64,
    /// Samples trained and kept.
    pub samples: f64,
    /// Steps committed.
    pub steps: u64,
    /// Node removals the run saw, in-place reconfigurations, and full restarts.
    pub failures: u64,
    pub reconfigurations: u64,
    pub restarts: u64,
    /// Throughput over time: what the job trains at from each point to the next.
    pub timeline: Vec<TimePoint>,
    pub marks: Vec<Mark>,
    /// Things a reader should know (e.g. "ran out of memory at 15 nodes").
    pub notes: Vec<String>,
}
