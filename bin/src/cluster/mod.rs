//! The cluster side of `train` (DESIGN.md section 2): flags to the runtime, agents started
//! locally or over ssh, and the tools that talk to a running job.
//!
//! ```text
//!  train (master: oobleck_core::runtime::master)
//!    ├─ train, as an agent        (one per node: a child process in local mode, started by
//!    │    │                        hand with `oobleck agent`/`train agent`, or over ssh)
//!    │    └─ train, as a worker   (one per device, always a child of its agent)
//!    └─ ...
//! ```
//!
//! The runtime itself (job driver, node supervisor, worker loop, the pure job state machine)
//! lives in `oobleck_core::runtime`; `train` and `oobleck` hand over to it with
//! `oobleck_core::runtime::take_over` when started in a node role.
//!
//! Outputs: workers of pipeline 0 leave their state under the run directory and the master
//! merges it into checkpoints, so across machines `--out` must be a directory every node sees
//! at the same path (a shared file system).

pub mod agent_cmd;
pub mod hostfile;
pub mod job;
pub mod membership_cmd;
pub mod status;

pub use oobleck_core::runtime::net::resolve;
