//! What workers report ([`WorkerReport`]), carried unchanged by the agent's pipe and by the
//! control protocol.

use serde::{Deserialize, Serialize};

use crate::execution::StepTimes;
use crate::runtime::wire::protocol::ExitStatus;

/// What a worker tells the master about itself. The worker writes it on its stdout (after
/// [`REPORT_PREFIX`] and its generation); its agent wraps it, as it is, in a
/// [`crate::runtime::wire::Message::Worker`] with the node and the generation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "report", rename_all = "snake_case", deny_unknown_fields)]
pub enum WorkerReport {
    /// The worker bound its data-plane port (itself, so nothing can take it in between).
    Listening { rank: u32, addr: String, pid: u32 },
    /// The worker built its stage of its generation and holds its `layers` of committed
    /// `step`: from then on those are what it holds (before, it held what it held in the
    /// generation before). `connect_s`: forming the data plane; `copy_s` and `copy_bytes`:
    /// the layers it received from their holders (zero when none).
    Formed {
        rank: u32,
        step: u64,
        layers: Vec<usize>,
        connect_s: f64,
        copy_s: f64,
        copy_bytes: u64,
    },
    /// After the master aborted the generation: the worker is stopping its step at its next
    /// microbatch or data-plane operation, holding the committed step meanwhile. Sent by the
    /// worker itself, so only a living process says it.
    Stopping { rank: u32 },
    /// The worker holds its reduced gradients for `step` (1-based) and waits for the commit.
    /// `loss` and `grad_norm` are the step's global values, the same on every rank.
    Ready {
        rank: u32,
        step: u64,
        loss: f64,
        grad_norm: f64,
        /// The global microbatches of the step this rank read from the workload's data, if it
        /// is the lead of its pipeline's first stage (none otherwise): the master checks that
        /// every sample of the step is trained on exactly once.
        #[serde(default)]
        microbatches: Vec<u32>,
        /// The [`super::SampleHash`] of the samples of those microbatches (none if it read
        /// none, or the workload does not number its samples): the master adds the ranks'
        /// hashes into the step's.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        samples: Option<u64>,
        /// Where this rank's time of the step went (compute, p2p and collective waits): how
        /// the master names a straggler.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        times: Option<StepTimes>,
    },
    /// The master has this worker's part of the state after committed `step`, at `state`
    /// (a path on the master's machine). `stall_ms`: how long training waited for it (the
    /// copy to host memory; the upload runs beside the next steps).
    Saved {
        rank: u32,
        step: u64,
        state: String,
        #[serde(default)]
        stall_ms: f64,
    },
    /// The step after committed `step` failed (`error`); the worker holds the state of `step`
    /// and waits for `SaveState` or the end of its generation.
    /// The state after `step` (`bytes` long) did not reach the master: a periodic checkpoint
    /// is skipped; the final save is tried again while `retrying`, from the state the rank
    /// keeps in memory.
    SaveFailed {
        rank: u32,
        step: u64,
        bytes: u64,
        error: String,
        retrying: bool,
    },
    Broken {
        rank: u32,
        step: u64,
        error: String,
        /// The generation failed because a layer copy from rank `from` arrived corrupted.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        corrupt: Option<CorruptCopy>,
    },
    /// The worker applied every step; `state` is where it left its part of the final state.
    /// `commit_wait_ms`: the time it spent waiting for commits (control-plane overhead).
    Done {
        rank: u32,
        step: u64,
        state: Option<String>,
        commit_wait_ms: f64,
    },
    /// The worker made no progress for `for_s` seconds, past its watchdog's `limit_s`, in
    /// `what` (`all_reduce #3 (2 ranks, 0.52 MB) of step 4`); `stopped`: the process does not
    /// run at all (SIGSTOP, or no progress beat either). Reported by its agent, which fences
    /// the process (SIGTERM, then SIGKILL) so it cannot come back and write; its exit follows.
    Hung {
        rank: u32,
        what: String,
        for_s: f64,
        limit_s: f64,
        stopped: bool,
    },
    /// The worker has waited on its peers in a data-plane operation (`what`) of `step` for
    /// `for_s` seconds, past its watchdog's limit, while its process runs and beats: it is not
    /// what is stuck, but when every rank of a generation says this, the data plane itself
    /// hangs (a collective that never returns) and the master aborts the generation.
    /// Reported by its agent, once per stall.
    Waiting {
        rank: u32,
        step: u64,
        what: String,
        for_s: f64,
    },
    /// Connections to the worker's data-plane port were refused while its generation formed
    /// (already logged by the worker): `count` from `peer` (`None`: addresses beyond the ones
    /// counted one by one) for `reason`, aggregated as the control port's are.
    Refused {
        rank: u32,
        peer: Option<String>,
        reason: String,
        count: u64,
    },
    /// The worker process ended (reported by its agent). `error`: the end of what a failed
    /// worker printed, so the master can say why without access to its machine.
    Exited {
        rank: u32,
        status: ExitStatus,
        error: Option<String>,
    },
}

/// A layer copy that arrived different from what its sender sent: `layer` from `from` (a rank
/// of the same generation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CorruptCopy {
    pub layer: usize,
    pub from: u32,
}

/// Lines of a worker's stdout that carry a [`WorkerReport`] start with this.
pub const REPORT_PREFIX: &str = "oobleck-report ";

impl WorkerReport {
    /// The `report` tag, as written (`stopping`, `formed`...).
    pub fn kind(&self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v.get("report").and_then(|e| e.as_str()).map(str::to_string))
            .unwrap_or_default()
    }

    /// The rank the report is about.
    pub fn rank(&self) -> u32 {
        match self {
            WorkerReport::Listening { rank, .. }
            | WorkerReport::Formed { rank, .. }
            | WorkerReport::Stopping { rank, .. }
            | WorkerReport::Ready { rank, .. }
            | WorkerReport::Saved { rank, .. }
            | WorkerReport::SaveFailed { rank, .. }
            | WorkerReport::Broken { rank, .. }
            | WorkerReport::Done { rank, .. }
            | WorkerReport::Hung { rank, .. }
            | WorkerReport::Waiting { rank, .. }
            | WorkerReport::Refused { rank, .. }
            | WorkerReport::Exited { rank, .. } => *rank,
        }
    }

    /// The line a worker of `generation` prints for this report.
    pub fn line(&self, generation: u64) -> String {
        let body = serde_json::to_string(self).expect("a report always serialises");
        format!("{REPORT_PREFIX}{generation} {body}")
    }

    /// Parses a worker's line into its generation and report; `None` for lines that are not
    /// reports.
    pub fn parse(line: &str) -> Option<Result<(u64, WorkerReport), String>> {
        let rest = line.strip_prefix(REPORT_PREFIX)?;
        let bad = |e: String| format!("malformed report line {rest:?}: {e}");
        let Some((generation, body)) = rest.split_once(' ') else {
            return Some(Err(bad("no generation before the report".into())));
        };
        let generation = match generation.parse::<u64>() {
            Ok(g) => g,
            Err(e) => return Some(Err(bad(format!("generation {generation:?}: {e}")))),
        };
        Some(
            serde_json::from_str(body)
                .map(|r| (generation, r))
                .map_err(|e| bad(e.to_string())),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_round_trip_and_other_lines_are_ignored() {
        let r = WorkerReport::Ready {
            rank: 1,
            step: 3,
            loss: 1.5,
            grad_norm: 0.25,
            microbatches: vec![0, 1],
            samples: Some(u64::MAX),
            times: None,
        };
        let back = WorkerReport::parse(&r.line(4))
            .expect("a report line")
            .expect("valid");
        assert_eq!(back, (4, r));
        assert!(WorkerReport::parse("some log line").is_none());
        assert!(
            WorkerReport::parse(&format!("{REPORT_PREFIX}4 {{\"report\":\"nope\"}}"))
                .expect("a report line")
                .is_err()
        );
        assert!(
            WorkerReport::parse(&format!("{REPORT_PREFIX}{{\"report\":\"ready\"}}"))
                .expect("a report line")
                .is_err(),
            "a report without its generation"
        );
    }
}
