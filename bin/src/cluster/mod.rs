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
//! The runtime itself (the master, the node agent, the worker, the pure job state machine)
//! lives in `oobleck_core::runtime`; `train` and `oobleck` hand over to it with
//! `oobleck_core::runtime::take_over` when started in a node role.
//!
//! - [`job`]: `train`'s cluster job: flags to the runtime, the run directory, the launch.
//! - [`memory`]: whether a job fits this machine's memory, decided before it is measured.
//! - [`node_cmd`]: `train agent` / `oobleck agent`, one node of a multi-machine job.
//! - [`hostfile`]: agents started over ssh from a host file.
//! - [`reattach`]: `train --resume RUN --reattach`, a master restarted on the run directory of
//!   a job whose agents wait for one.
//! - [`standby_cmd`]: `train standby`, a standby master that keeps a copy of the run directory
//!   and takes over from it (`--reattach`) when the master is lost.
//! - [`status`], [`membership_cmd`]: the tools that talk to a running job (`oobleck status`,
//!   `kill-node`, `drain`, `add-node`).
//!
//! Outputs: workers upload their state to the master over the network, and the master writes
//! the checkpoints under its own `--out`; no shared file system is needed.

pub mod discover;
pub mod hostfile;
pub mod job;
pub mod membership_cmd;
pub mod memory;
pub mod node_cmd;
pub mod reattach;
pub mod scheduled;
pub mod standby_cmd;
pub mod standbys;
pub mod status;

pub use oobleck_core::runtime::net::resolve;
