//! The job runtime as a library: train any [`Workload`] on a cluster that loses and gains
//! nodes, from your own binary.
//!
//! ```text
//!  your main()
//!    ├─ take_over(factory)       first line: when this process was started as a node agent
//!    │                           or a worker of a job, it runs that role here and exits
//!    └─ run_job(..)              the master: plans, commits steps, recovers from failures
//!         ├─ node agent (1 per node)  re-runs your binary: registers, spawns one worker per
//!         │    │                      device, watches them
//!         │    └─ worker (1 per device)  re-runs your binary: builds its stage, trains
//!         └─ ...
//! ```
//!
//! One room per process, and the rooms they share below them:
//!
//! - [`master`]: carries out the job's actions: the control server ([`master::Master`]),
//!   plans, commits, checkpoints, recoveries, the run directory.
//! - [`node`]: the agent of one machine ([`node::run_agent`]): its link to the master, its
//!   workers' processes, their watchdog, drains on notice.
//! - [`worker`]: one device's process ([`worker::run_worker`]), alive across generations.
//! - [`job`]: PURE: the job's decisions as a state machine, `handle(now, input)` then
//!   `poll_action()`; the master feeds it and carries out what it says.
//! - [`wire`]: a leaf: the control protocol, the agent-worker pipe, the records (reports,
//!   `events.jsonl`, `metrics.jsonl`), the environment names.
//! - [`spec`]: the job's plain settings ([`TrainingSpec`], [`JobConfig`]) that every room and
//!   the wire carry; [`workload`]: the [`Workload`] trait a user implements.
//! - [`error`], [`timeouts`] (how the timeouts fit together), [`device`], [`net`],
//!   [`allocator`]: shared by the rooms.
//!
//! Imports point down: master, node and worker use job (master only), wire, spec and the
//! shared files; job uses wire and spec; wire uses spec; spec uses none of them.

pub mod allocator;
pub mod device;
mod entry;
pub mod error;
pub mod host_memory;
pub mod job;
pub mod master;
pub mod net;
pub mod node;
pub mod spec;
pub mod timeouts;
pub mod wire;
pub mod worker;
pub mod workload;

pub use allocator::{tune_allocator, TrainingAlloc};
pub use entry::{agent_command, role, take_over};
pub use error::{BoxError, Context, Result, RuntimeError};
pub use master::run_job;
pub use spec::{
    BatchShape, Compute, DataPlane, InjectedFailure, JobConfig, SpecError, TrainingSpec, WatchSpec,
    DEFAULT_SAVE_WAIT_S,
};
pub use wire::{Event, StateSource, StepMetrics, WorkerReport};
pub use workload::{Factory, Workload};
