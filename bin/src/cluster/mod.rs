//! The local cluster runtime of `train --nodes N` (DESIGN.md section 2).
//!
//! ```text
//!  train (master: elastic::Master on 127.0.0.1, random token)
//!    ├─ oobleck agent --master ADDR   (one per node; token in OOBLECK_TOKEN)
//!    │    └─ oobleck worker --rank R   (one per device; assignment as one JSON line on stdin)
//!    └─ ...
//! ```
//!
//! Control: membership, the plan, the rendezvous list and shutdown travel over the
//! authenticated control protocol of `oobleck_core::elastic`. The data plane is one
//! `TcpCommunicator` per worker on the address the master reserved for its rank.
//!
//! Reports: the control protocol has no message for a worker's per-step results, so in local
//! mode each worker prints [`Report`] lines on its stdout, its agent forwards them on its own
//! stdout (prefixed with [`REPORT_PREFIX`]) and the master reads them from the pipe. Final
//! parameters go through the run directory (shared in local mode).
//!
//! Lifetimes: each child holds a pipe from its parent on stdin and exits when it closes, so
//! killing `train` (or an agent) takes every process below it down; the master also kills its
//! agents on any error. Every wait has a timeout.

pub mod agent;
pub mod master;
pub mod status;
pub mod worker;

use std::time::Duration;

use oobleck_core::elastic::protocol::Rendezvous;
use oobleck_core::planning::Plan;
use serde::{Deserialize, Serialize};

/// Lines of an agent's stdout that carry a [`Report`] start with this.
pub const REPORT_PREFIX: &str = "oobleck-report ";

/// How long a worker waits on any send, receive or collective of the data plane.
pub const DATA_TIMEOUT: Duration = Duration::from_secs(60);

/// What an agent gives each of its workers (one JSON line on the worker's stdin).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerAssignment {
    pub generation: u64,
    pub rank: u32,
    pub node: u32,
    pub plan: Plan,
    pub rendezvous: Vec<Rendezvous>,
}

/// What processes report to the master, one JSON object per line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "report", rename_all = "snake_case")]
pub enum Report {
    /// An agent is up (before it registers).
    Agent { pid: u32 },
    /// A worker started for `rank`.
    WorkerStarted { node: u32, rank: u32, pid: u32 },
    /// The step's global results (sent by rank 0 only; every rank has the same numbers).
    Step {
        step: u64,
        loss: f64,
        grad_norm: f64,
        lr: f64,
    },
    /// A worker wrote its final parameters and optimizer state to `path`.
    Saved { rank: u32, path: String },
    /// A worker finished every step.
    Done { rank: u32 },
}

impl Report {
    /// The line an agent forwards for this report.
    pub fn line(&self) -> String {
        format!(
            "{REPORT_PREFIX}{}",
            serde_json::to_string(self).unwrap_or_default()
        )
    }

    /// Parses a forwarded line; `None` for lines that are not reports.
    pub fn parse(line: &str) -> Option<anyhow::Result<Report>> {
        let body = line.strip_prefix(REPORT_PREFIX)?;
        Some(
            serde_json::from_str(body)
                .map_err(|e| anyhow::anyhow!("malformed report line {body:?}: {e}")),
        )
    }
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
        let r = Report::Step {
            step: 3,
            loss: 1.5,
            grad_norm: 0.25,
            lr: 1e-3,
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
