//! The job's decisions, as a pure state machine.
//!
//! ```text
//!   master ──(now, Input)──► JobMachine::handle ──► queue of Actions ──► master carries out
//!      ▲        (a Tick at least every poll, so deadlines are seen)               │
//!      └──────── results of actions (Planned, Assembled, RescueWritten) ◄────────┘
//! ```
//!
//! [`JobMachine`] holds membership, the generation, the committed step and the state of a
//! recovery. It is told the time (`now`, as a `Duration` since any fixed origin) with every
//! [`Input`] and never reads a clock, touches a socket or a file, or starts a process: the
//! master does that for each [`Action`] it takes from [`JobMachine::poll_action`], the way
//! raft-rs' `Ready` or quinn-proto's `poll_transmit` work. Its tests are plain tables
//! (`tests/`, one file per concern: steps, recovery, membership, stragglers).
//!
//! A job runs through these phases:
//!
//! ```text
//!  Forming ─► Planning ─► Rendezvous ─► Stepping ─► Finishing ─► Finished
//!                             ▲  │ failure    │ failure    │ failure
//!                             │  ▼            ▼            ▼
//!                             └─ Settling ─► Deciding ─► next generation (in place, or
//!                                   │                    from the newest checkpoint)
//!                                   └──────────────────► Failed (beyond what can recover)
//! ```

mod hangs;
mod machine;
pub mod membership;
mod reattach;
mod recovery;
mod reports;
mod steps;
pub mod stragglers;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::time::Duration;

pub use machine::JobMachine;
pub use reattach::Reattach;
pub use stragglers::StragglerRule;

use super::error::RuntimeError;
use super::wire::pipe::StateSource;
use super::wire::records::{Event, SampleHash, WorkerReport};
use crate::execution::StepTimes;
use crate::planning::{Plan, PlanError};
use crate::reconfig::{Holdings, ReconfigPlan};
use crate::runtime::wire::protocol::{RankStatus, Rendezvous};

/// The bounds of every wait the job makes, so nothing hangs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// After a failure, the least time further losses it caused are collected before the
    /// decision (0: decide as soon as every rank's state is known).
    pub settle: Duration,
    /// ...and, where the master started the agents, the most it waits for each dead agent's
    /// node to be reported lost.
    pub loss_wait: Duration,
    /// ...and the most it waits for every rank on a surviving node to stop its step.
    pub ranks_wait: Duration,
    /// The longest the job may go without any report before it is declared stuck (covers
    /// model build and data-plane setup before step 1).
    pub stall: Duration,
    /// How long the agents get to register.
    pub join: Duration,
    /// A node silent for this long is lost (the control plane's lease; heartbeats go every
    /// 500 ms). This is what catches a hung machine or agent.
    pub lease: Duration,
    /// Failures in a row with no committed step in between, after which the job gives up.
    pub max_fruitless_recoveries: u32,
    /// The longest a join that adds no pipeline waits for more joins before it is taken
    /// (`membership::join_verdict`).
    pub join_after: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            settle: Duration::ZERO,
            loss_wait: Duration::from_secs(15),
            ranks_wait: super::timeouts::RANKS_WAIT,
            stall: super::timeouts::STALL,
            join: Duration::from_secs(60),
            lease: Duration::from_secs(3),
            max_fruitless_recoveries: 3,
            join_after: Duration::from_secs(30),
        }
    }
}

/// Where the job starts.
#[derive(Debug, Clone, PartialEq)]
pub struct JobStart {
    /// The committed step the job starts from (0, or a resumed checkpoint's).
    pub step: u64,
    /// The checkpoint of `step`, for a resumed job.
    pub checkpoint: Option<String>,
    /// The generation of the first plan (after the plans of earlier runs in the directory).
    pub generation: u64,
    /// The master started the agents itself (local processes or ssh): each agent process
    /// that dies is a node loss to wait for.
    pub starts_agents: bool,
    /// Say each join in a progress note (agents started by hand).
    pub announce_joins: bool,
    /// A master restarted on the run directory of a job whose agents wait for one: it
    /// re-adopts them and their workers instead of starting the job (`reattach.rs`).
    pub reattach: Option<Reattach>,
}

/// The state after `step` could not be saved (`bytes`: its size at a rank, 0 where the
/// checkpoint itself failed). A periodic save is skipped (nothing waits for its validation
/// loss); the final one is tried again while `retrying`.
#[derive(Debug, Clone, PartialEq)]
pub struct FailedSave {
    pub step: u64,
    pub bytes: u64,
    pub error: String,
    pub retrying: bool,
    pub periodic: bool,
}

/// Why a node was declared lost.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LossReason {
    /// The connection closed (process died, host rebooted, network reset).
    #[error("its connection closed")]
    Closed,
    /// Nothing arrived for a whole lease.
    #[error("nothing heard from it for its lease of {lease_ms} ms")]
    LeaseExpired { lease_ms: u64 },
    /// The peer broke the protocol or the connection failed; the text says how.
    #[error("{0}")]
    Protocol(String),
    /// A message to it could not be delivered (`what`: which one).
    #[error("it did not get {what}")]
    Unreachable { what: String },
}

/// What the master tells the machine.
#[derive(Debug)]
pub enum Input {
    /// Nothing happened; time passed.
    Tick,
    /// An agent registered.
    Joined {
        node: u32,
        addr: String,
    },
    /// An agent of the job's lost master came back to this restarted one with its old id
    /// (`--reattach`): what its workers hold.
    Returned {
        node: u32,
        addr: String,
        back: crate::runtime::wire::protocol::Return,
    },
    /// A node's connection closed or its lease ran out.
    Lost {
        node: u32,
        reason: LossReason,
    },
    /// An agent process the master started exited (`which` is the master's own index; `node`
    /// the node it served, where the master knows it: local clusters, once a worker started).
    AgentExited {
        which: usize,
        node: Option<u32>,
        status: String,
    },
    /// A worker's report, relayed by its node's agent.
    Worker {
        node: u32,
        generation: u64,
        report: WorkerReport,
    },
    /// Connections to the control port were refused (already logged): `count` from `peer`.
    Refused {
        peer: Option<String>,
        reason: String,
        count: u64,
    },
    /// A tool asked for `node`'s processes to be killed (`oobleck kill-node`).
    KillRequested {
        node: u32,
    },
    /// `node` will go away (`reason`: who said so); `force` takes a drain that leaves too
    /// few nodes for a pipeline.
    DrainRequested {
        node: u32,
        reason: String,
        force: bool,
    },
    /// The answer to [`Action::Plan`].
    Planned(Result<Plan, RuntimeError>),
    /// A message to `node` could not be delivered; `what` says which and why.
    Unreachable {
        node: u32,
        what: String,
    },
    /// The answer to [`Action::Assemble`].
    Assembled {
        step: u64,
        checkpoint: Option<String>,
        val_loss: Option<f64>,
        duration_s: f64,
    },
    AssemblyFailed {
        step: u64,
        error: String,
    },
    /// The answer to [`Action::Reconfigure`].
    Reconfigured(Result<ReconfigPlan, PlanError>),
    /// The answer to [`Action::WeighJoins`]: how many pipelines the plan with `joined`
    /// admitted would have.
    JoinsWeighed {
        joined: Vec<u32>,
        pipelines: Result<usize, PlanError>,
    },
    /// The master was asked to stop (`signal`: SIGTERM or SIGINT): the run ends after the next
    /// step, with its checkpoint, as if that were its last.
    StopRequested {
        signal: String,
    },
    /// The checkpoint a `Deploy` was to start from cannot be read (`reason`); `instead` is the
    /// newest older one that can (path, step), if any. Nothing was deployed.
    CheckpointRefused {
        path: String,
        reason: String,
        instead: Option<(String, u64)>,
    },
}

/// What the machine asks the master to do, in order.
#[derive(Debug)]
pub enum Action {
    /// Append to `events.jsonl`.
    Record(Event),
    /// A line for the person watching.
    Note(String),
    /// Plan `nodes` (sorted) with fault threshold `fault_threshold`, pinned pipeline sizes if
    /// given; answer with [`Input::Planned`].
    Plan {
        nodes: Vec<u32>,
        fault_threshold: u32,
        pinned: Option<Vec<u32>>,
    },
    /// Decide the next generation after losing `lost` from `plan`'s nodes, letting `drained`
    /// go and gaining `joined`, the devices holding `holdings`
    /// ([`crate::reconfig::decide_leaving`]); answer with [`Input::Reconfigured`]. A drained
    /// node is in `holdings` only where its layers can be copied off it (the TCP data plane:
    /// `membership::copy_sources`).
    Reconfigure {
        plan: Box<Plan>,
        holdings: Holdings,
        lost: Vec<u32>,
        drained: Vec<u32>,
        joined: Vec<u32>,
    },
    /// How many pipelines would `plan` have with `joined` admitted (the devices holding
    /// `holdings`, [`crate::reconfig::decide_with`])? Answer with [`Input::JoinsWeighed`].
    WeighJoins {
        plan: Box<Plan>,
        holdings: Holdings,
        joined: Vec<u32>,
    },
    /// Tell `node` to stop its workers and exit (it was drained, or is not needed): its
    /// agent's exit and its closed connection are expected, not failures.
    Release { node: u32, reason: String },
    /// The nodes waiting to join, leaving, and idle, for `oobleck status`.
    Membership {
        joining: Vec<u32>,
        draining: Vec<(u32, String)>,
        spare: Vec<u32>,
    },
    /// Where each rank's time of the last committed step went, stragglers marked, for
    /// `oobleck status`.
    RankTimes { step: u64, ranks: Vec<RankStatus> },
    /// Start the plan's generation: record it in `plan.json`, send the job and the plan (with
    /// a fresh data-plane key and where the state comes from) to its nodes.
    Deploy {
        plan: Box<Plan>,
        source: StateSource,
    },
    /// Tell every node where each rank of `generation` listens.
    Rendezvous {
        generation: u64,
        rendezvous: Vec<Rendezvous>,
    },
    /// Every rank holds its reduced gradients for `step`: tell them to apply it, and record
    /// the step (its metrics wait for a validation loss if `eval_due`).
    Commit {
        step: u64,
        loss: f64,
        grad_norm: f64,
        generation: u64,
        pipelines: usize,
        nodes: usize,
        eval_due: bool,
        /// The global microbatches it trained, sorted (each once).
        microbatches: Vec<u32>,
        /// The hash of their samples (`None`: the workload does not number them).
        samples: Option<SampleHash>,
        /// Where each rank's time of the step went (ranks that said).
        times: BTreeMap<u32, StepTimes>,
        /// The run ends with this step (its final one, or a stop asked for).
        last: bool,
    },
    /// Tell `node` again that `step` of `generation` is committed: the lost master's commit
    /// did not reach it (a restarted master re-adopting the workers).
    Recommit {
        node: u32,
        step: u64,
        generation: u64,
    },
    /// Re-adopting is over: an agent of the lost master that comes now is a new node.
    EndReturns,
    /// Generation `generation` failed: tell its workers to stop their step now.
    Abort { generation: u64 },
    /// Tell `node` to kill its processes, as a crash would.
    KillNode { node: u32 },
    /// `node` is lost for good; if its processes still run here, kill them.
    Fence { node: u32 },
    /// Turn pipeline 0's states after `step` into a checkpoint and/or an evaluation; answer
    /// with [`Input::Assembled`] or [`Input::AssemblyFailed`].
    Assemble {
        step: u64,
        states: BTreeMap<u32, String>,
        checkpoint: bool,
        eval: bool,
    },
    /// A save failed: say so, record it, and drop what it left.
    SaveFailed(FailedSave),
    /// The validation loss of `step`, for its metrics line.
    ValLoss { step: u64, val_loss: f64 },
    /// Write the metrics lines held for validation losses that will not come.
    ReleaseHeld,
    /// Drop metrics lines after `step`: those steps will be computed again.
    TruncateMetrics { after: u64 },
    /// Every step is committed and every worker done: `states` (rank -> file) hold the final
    /// state of pipeline 0; `commit_wait_ms` is each rank's time spent waiting for commits.
    Finish {
        step: u64,
        states: BTreeMap<u32, String>,
        commit_wait_ms: BTreeMap<u32, f64>,
    },
    /// The job cannot go on.
    Fail(RuntimeError),
}
