//! The pipe between a node's agent and each of its workers.
//!
//! ```text
//!  agent ──stdin──► worker     1 line: WorkerAssignment (JSON)
//!                              then ToWorker lines: Rendezvous, then Commit per step;
//!                              after a failure, Reassign: the next generation's assignment
//!                              (the same process goes on, with the state it holds)
//!  agent ◄─stdout── worker     WorkerReport lines, after records::REPORT_PREFIX and the
//!                              generation they belong to; progress beats (an
//!                              execution::Snapshot after PROGRESS_PREFIX, every 50 ms while
//!                              it moves, every 500 ms while it does not), which the agent's
//!                              watchdog reads and keeps to itself; any other line is the
//!                              worker's own output, passed on to the agent's stderr
//! ```
//!
//! The worker exits when its stdin closes: the agent that started it is gone, so nobody would
//! commit a step or collect its results. The agent wraps each report of the running
//! generation, as it is, in a [`crate::runtime::wire::Message::Worker`] with its node and the
//! generation, and drops those of earlier generations.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use oobleck_comm::SecretKey;

use crate::execution::Snapshot;
use crate::planning::Plan;
use crate::reconfig::{Donor, LayerCopy};
use crate::runtime::spec::JobConfig;
use crate::runtime::wire::protocol::Rendezvous;

/// The first word of the error a role prints on stderr when it fails; an agent explains a
/// failed worker to the master from the worker's last line that starts with it.
pub const ERROR_TAG: &str = "Error:";

/// How often a worker's beat thread looks at its progress: a beat goes out within this of any
/// progress.
pub const BEAT: Duration = Duration::from_millis(50);
/// The longest a worker's beats stay silent while nothing moves, so an agent tells a worker
/// that is stuck (beats, no progress) from one that does not run at all (no beats).
pub const IDLE_BEAT: Duration = Duration::from_millis(500);

/// What an agent gives each of its workers (the first JSON line on the worker's stdin).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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
    pub job: JobConfig,
    /// The NCCL unique id of this generation (`DataPlane::Nccl`), 128 bytes.
    pub nccl_id: Option<Vec<u8>>,
    /// The generation's data-plane key: the worker proves it to every peer and refuses a peer
    /// that cannot.
    pub key: SecretKey,
    /// Where this generation's parameters and optimizer state come from.
    pub source: StateSource,
    /// Where the worker uploads its state (`HOST:PORT` on the master's machine) and the key
    /// the uploads prove; files land under the run directory there.
    pub state_sink: String,
    pub state_key: SecretKey,
}

/// Where a generation's workers get their parameters, optimizer state and step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "from", rename_all = "snake_case", deny_unknown_fields)]
pub enum StateSource {
    /// Fresh, deterministic initialisation: step 0.
    Init,
    /// A checkpoint directory (a resumed job, or a recovery beyond what replicas cover).
    Checkpoint { path: PathBuf },
    /// In place, after a failure: every worker keeps what it holds of committed `step` and
    /// receives the layers its new stage lacks from their holders, as `copies` say (ranks of
    /// the new generation, in an order every rank follows).
    Peers {
        step: u64,
        copies: Vec<LayerCopy>,
        /// Devices of drained nodes that send the layers only they hold, as ranks after the
        /// plan's own (`reconfig::Donor`); every rank's data plane includes them.
        #[serde(default)]
        donors: Vec<Donor>,
    },
}

/// What an agent tells a worker after its assignment, one JSON object per stdin line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "to_worker", rename_all = "snake_case", deny_unknown_fields)]
pub enum ToWorker {
    /// Where every rank of the generation listens.
    Rendezvous { rendezvous: Vec<Rendezvous> },
    /// Every holder has its reduced gradient for `step` (1-based): apply it. `last`: the run
    /// ends with it (save the final state).
    Commit {
        step: u64,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        last: bool,
    },
    /// Generation `generation` failed: stop the step under way (its update is never applied)
    /// instead of finishing it. Read by the worker's stdin thread as soon as it arrives.
    Abort { generation: u64 },
    /// The next generation, for a worker that keeps running: leave the current one (its open
    /// step is not applied) and take this assignment with the state it holds.
    Reassign { assignment: Box<WorkerAssignment> },
}

impl std::fmt::Display for ToWorker {
    /// What a person reads of a line to a worker: its kind and step or generation.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ToWorker::Rendezvous { .. } => write!(f, "the rendezvous"),
            ToWorker::Commit { step, .. } => write!(f, "the commit of step {step}"),
            ToWorker::Abort { generation } => write!(f, "an abort of generation {generation}"),
            ToWorker::Reassign { assignment } => {
                write!(f, "the assignment of generation {}", assignment.generation)
            }
        }
    }
}

/// Lines of a worker's stdout that carry a progress beat start with this.
pub const PROGRESS_PREFIX: &str = "oobleck-progress ";

/// The line a worker prints for a progress beat.
pub fn progress_line(s: &Snapshot) -> String {
    let body = serde_json::to_string(s).expect("a snapshot always serialises");
    format!("{PROGRESS_PREFIX}{body}")
}

/// Parses a worker's line into a progress beat; `None` for lines that are not beats.
pub fn parse_progress(line: &str) -> Option<std::result::Result<Snapshot, String>> {
    let body = line.strip_prefix(PROGRESS_PREFIX)?;
    Some(serde_json::from_str(body).map_err(|e| format!("malformed progress beat {body:?}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipe_messages_round_trip_as_json_lines() {
        for msg in [
            ToWorker::Rendezvous {
                rendezvous: vec![Rendezvous {
                    rank: 0,
                    addr: "127.0.0.1:9".into(),
                }],
            },
            ToWorker::Commit {
                step: 3,
                last: false,
            },
        ] {
            let line = serde_json::to_string(&msg).expect("json");
            assert!(!line.contains('\n'));
            assert_eq!(serde_json::from_str::<ToWorker>(&line).expect("back"), msg);
        }
        assert!(serde_json::from_str::<ToWorker>(r#"{"to_worker":"explode"}"#).is_err());
    }

    #[test]
    fn progress_beats_round_trip_and_a_bad_one_says_what_it_was() {
        let s = Snapshot {
            seq: 9,
            step: 4,
            in_step: true,
            doing: vec![crate::execution::Doing::Backward { mb: 1 }],
        };
        let line = progress_line(&s);
        assert_eq!(parse_progress(&line), Some(Ok(s)));
        assert_eq!(parse_progress("loss 3.2"), None);
        let e = parse_progress("oobleck-progress {\"seq\":1}").expect("a beat line");
        assert!(e.expect_err("bad").contains("malformed progress beat"));
    }
}
