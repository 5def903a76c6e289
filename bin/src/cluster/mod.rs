//! The cluster runtime of `train` (DESIGN.md section 2).
//!
//! ```text
//!  train (master: elastic::Master)
//!    ├─ oobleck agent --master ADDR   (one per node: a child process in local mode, started
//!    │    │                            by hand or over ssh with --listen / --hostfile)
//!    │    └─ oobleck worker --rank R   (one per device, always a child of its agent)
//!    └─ ...
//! ```
//!
//! Master <-> agent: the authenticated control protocol of `oobleck_core::elastic` carries
//! membership, the job, the plan, the data-plane rendezvous, every rank's `StepReady`, the
//! master's `StepCommitted` and shutdown. It works the same across machines.
//!
//! Agent <-> worker: pipes. The agent writes one [`WorkerAssignment`] line on the worker's
//! stdin, then [`ToWorker`] lines (the rendezvous, then one commit per step); the worker
//! writes [`Report`] lines (prefixed with [`REPORT_PREFIX`]) on its stdout, which the agent
//! turns into protocol messages.
//!
//! A step (DESIGN.md section 4): every worker runs its 1F1B iteration and the gradient sync,
//! reports `StepReady`, and waits; once every rank of the plan is ready the master declares the
//! step committed, and only then does each worker apply the optimizer. A worker that dies
//! mid-step therefore leaves every other replica at the last committed step.
//!
//! Data plane: each worker binds its own port (port 0 on its node's data-plane address) before
//! the master gathers the list, so no port is reserved and released in between.
//!
//! Outputs: workers of pipeline 0 leave the final parameters and optimizer state under the
//! run directory and the master merges them into the checkpoint, so across machines `--out`
//! must be a directory every node sees at the same path (a shared file system).
//!
//! Lifetimes: each child holds a pipe from its parent on stdin and exits when it closes, so
//! killing `train` (or an agent) takes every process below it down; the master also kills its
//! agents on any error. Every wait has a timeout.

pub mod agent;
pub mod hostfile;
pub mod master;
pub mod status;
pub mod worker;

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use oobleck_core::elastic::protocol::Rendezvous;
use oobleck_core::planning::Plan;
use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;

/// Lines of a worker's stdout that carry a [`Report`] start with this.
pub const REPORT_PREFIX: &str = "oobleck-report ";

/// How long a worker waits on any send, receive or collective of the data plane.
pub const DATA_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a worker waits for the commit of a step it is ready for (or for the rendezvous):
/// every other rank has to finish the step first, so this bounds the slowest rank's step.
pub const COMMIT_TIMEOUT: Duration = Duration::from_secs(180);

/// What an agent gives each of its workers (the first JSON line on the worker's stdin).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerAssignment {
    pub generation: u64,
    pub rank: u32,
    pub node: u32,
    pub plan: Plan,
    /// The IP the worker binds its data-plane port on.
    pub host: String,
    /// The job's run directory (outputs).
    pub run_dir: PathBuf,
    /// The job, as the master resolved it.
    pub config: TrainConfig,
    /// The NCCL unique id of this generation (`--data-plane nccl`), 128 bytes.
    pub nccl_id: Option<Vec<u8>>,
    /// A resumed job: the checkpoint this worker's layers, optimizer state and step come from.
    #[serde(default)]
    pub resume: Option<PathBuf>,
}

/// What an agent tells a worker after its assignment, one JSON object per stdin line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "to_worker", rename_all = "snake_case")]
pub enum ToWorker {
    /// Where every rank of the generation listens.
    Rendezvous { rendezvous: Vec<Rendezvous> },
    /// Every holder has its reduced gradient for `step` (1-based): apply it.
    Commit { step: u64 },
    /// After a failed step: write the state of committed `step` into `dir`.
    SaveState { step: u64, dir: PathBuf },
}

/// What a worker tells its agent, one JSON object per stdout line after [`REPORT_PREFIX`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "report", rename_all = "snake_case")]
pub enum Report {
    /// The worker bound its data-plane port.
    Listening { rank: u32, addr: String, pid: u32 },
    /// The worker holds its reduced gradients for `step` (1-based) and waits for the commit.
    Ready {
        rank: u32,
        step: u64,
        loss: f64,
        grad_norm: f64,
    },
    /// The worker wrote its part of the state after committed `step` (1-based) to `state`.
    Saved { rank: u32, step: u64, state: String },
    /// The step after committed `step` failed (`error`); the worker holds the state of `step`
    /// and waits for `SaveState` or the end of its generation.
    Broken { rank: u32, step: u64, error: String },
    /// The worker applied every step; `state` is where it left its part of the checkpoint.
    Done {
        rank: u32,
        step: u64,
        state: Option<String>,
        commit_wait_ms: f64,
    },
}

impl Report {
    /// The line a worker prints for this report.
    pub fn line(&self) -> String {
        format!(
            "{REPORT_PREFIX}{}",
            serde_json::to_string(self).unwrap_or_default()
        )
    }

    /// Parses a worker's line; `None` for lines that are not reports.
    pub fn parse(line: &str) -> Option<anyhow::Result<Report>> {
        let body = line.strip_prefix(REPORT_PREFIX)?;
        Some(
            serde_json::from_str(body)
                .map_err(|e| anyhow::anyhow!("malformed report line {body:?}: {e}")),
        )
    }
}

/// Resolves `HOST:PORT` (a name or an IP) to its first address.
pub fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .with_context(|| format!("resolving {addr:?} (expected HOST:PORT)"))?
        .next()
        .with_context(|| format!("{addr:?} resolves to no address"))
}

/// The ranks a node runs under `plan`: device `d` of node `j` of a pipeline is rank
/// `first_rank + j * G + d` (the numbering of `planning::Pipeline`).
pub fn ranks_of_node(plan: &Plan, node: u32) -> Vec<u32> {
    let g = plan.devices_per_node;
    plan.pipelines
        .iter()
        .flat_map(|p| {
            p.nodes
                .iter()
                .enumerate()
                .filter(move |(_, &n)| n == node)
                .flat_map(move |(j, _)| (0..g).map(move |d| p.first_rank + j as u32 * g + d))
        })
        .collect()
}

/// Number of ranks (devices) the plan uses.
pub fn world_size(plan: &Plan) -> u32 {
    plan.pipelines
        .iter()
        .map(|p| p.nodes.len() as u32 * plan.devices_per_node)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_round_trip_and_other_lines_are_ignored() {
        let r = Report::Ready {
            rank: 1,
            step: 3,
            loss: 1.5,
            grad_norm: 0.25,
        };
        let back = Report::parse(&r.line())
            .expect("a report line")
            .expect("valid");
        assert_eq!(back, r);
        assert!(Report::parse("some log line").is_none());
        assert!(
            Report::parse(&format!("{REPORT_PREFIX}{{\"report\":\"nope\"}}"))
                .expect("a report line")
                .is_err()
        );
    }
}
