//! The job runtime as a library: train any [`Workload`] on a cluster that loses and gains
//! nodes, from your own binary.
//!
//! ```text
//!  your main()
//!    ├─ take_over(factory)       first line: when this process was started as an agent or a
//!    │                           worker of a job, it runs that role here and exits
//!    └─ master::run_job(..)      the master: plans, commits steps, recovers from failures
//!         ├─ agent (1 per node)  re-runs your binary: registers, spawns one worker per device
//!         │    └─ worker         re-runs your binary: builds its stage of the workload, trains
//!         └─ ...
//! ```
//!
//! - [`spec`]: [`Workload`] (your model, its data, evaluation and planner input) and
//!   [`TrainingSpec`] (steps, batch, `f`, optimizer: what every process of a job shares).
//! - [`job`]: the job's decisions as a pure state machine, `(state, input, now) -> actions`.
//! - [`records`]: what workers report, and the typed lines of `events.jsonl` and
//!   `metrics.jsonl`.

pub mod allocator;
pub mod device;
mod entry;
pub mod error;
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
    Compute, DataPlane, InjectedFailure, JobConfig, SpecError, TrainingSpec, WatchSpec,
};
pub use wire::{Event, StateSource, StepMetrics, WorkerReport};
pub use workload::{Factory, Workload};
