//! Cluster-scale simulation: training throughput under node failures and joins, for several
//! recovery policies, from a failure trace. Pure and deterministic like [`crate::planning`]:
//! no clock, no I/O, no global RNG; the same trace and policy give the same [`Outcome`].
//!
//! ```text
//!   Trace (CSV `delta_ms,add|remove,node`, or generate::generate from a node MTBF)
//!      │
//!      ▼ Policy::run                  one strategy type per recovery policy
//!   Outcome { average samples/s, time fractions, throughput over time, failure marks }
//! ```
//!
//! `simulate/README.md` has the policies, the cost model and where its defaults come from,
//! and the validation against the authors' simulators.
//!
//! - [`trace`] reads and checks traces; [`generate`] makes seeded ones.
//! - [`outcome`] is what every policy returns, and the [`outcome::Ledger`] that adds up
//!   where the time went.
//! - [`policies`]: `oobleck` (in place, this project's planner and `reconfig`),
//!   `checkpoint-restart` (Varuna-like) and `redundancy` (Bamboo-like), on one event loop
//!   (`engine`) and one cost model ([`policies::Costs`]).
//! - [`table`] replays the Oobleck authors' trace simulators (Oobleck, Varuna, Bamboo) from
//!   their throughput tables, quirks included, to check our numbers against theirs.

mod engine;
pub mod generate;
pub mod outcome;
pub mod policies;
pub mod table;
pub mod trace;

pub use outcome::{Ledger, Mark, Outcome, TimeFractions, TimeKind, TimePoint};
pub use trace::{parse_duration_ms, Change, Trace, TraceEvent};

use crate::planning::PlanError;

/// One recovery policy: how a training job fares on a trace. Each policy is a small strategy
/// type; `oobleck simulate --policy NAME` picks them by [`Policy::name`].
pub trait Policy {
    /// The name the command line and the outputs use (`oobleck`, `checkpoint-restart`, ...).
    fn name(&self) -> String;
    /// Replays the whole trace.
    fn run(&self, trace: &Trace) -> Result<Outcome, SimError>;
}

/// Why a simulation cannot run. Every variant names the place to fix.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    /// A trace line that cannot be read, or an event that cannot happen.
    #[error("trace line {line}: {message}")]
    Trace { line: usize, message: String },
    /// A trace with no events at all.
    #[error("the trace has no events: it needs `delta_ms,add|remove,node` lines")]
    EmptyTrace,
    /// A field of an inputs file (`sim_inputs.json`) is missing or has the wrong type.
    #[error("inputs: {field}: {message}")]
    Inputs { field: String, message: String },
    /// A setting of the simulation itself (a cost, a rate, a duration).
    #[error("{field} = {value}: {message}")]
    Setting {
        field: &'static str,
        value: String,
        message: String,
    },
    /// The planner refused the cluster (e.g. too few nodes for f + 1 pipelines at start).
    #[error("planning: {0}")]
    Plan(#[from] PlanError),
}
