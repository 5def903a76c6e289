//! Typed records: what workers report ([`WorkerReport`], carried unchanged by the agent's pipe
//! and by the control protocol), what a run writes to `events.jsonl` ([`Event`]) and
//! `metrics.jsonl` ([`StepMetrics`]). The report reads them back with the same types.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::checkpoint::space::SaveFailure;
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

/// One line of `metrics.jsonl`: a committed step, written and read back by this one type (the
/// report, the status page and the benches). A NaN (a diverged loss) is written as `null` by
/// serde_json and read back as NaN; the counts of runs from before they were recorded read as 0.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: u64,
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f64,
    #[serde(default = "nan", deserialize_with = "nan_if_null")]
    pub lr: f64,
    #[serde(default = "nan", deserialize_with = "nan_if_null")]
    pub grad_norm: f64,
    #[serde(default = "nan", deserialize_with = "nan_if_null")]
    pub samples_per_s: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub tokens_per_s: f64,
    pub generation: u64,
    #[serde(default)]
    pub pipelines: usize,
    #[serde(default)]
    pub nodes: usize,
    pub wall_s: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// The global microbatches the step trained, as ranges (`0-15`): the data cursor, so a
    /// run's log shows every sample trained once per step (a microbatch's samples are a
    /// function of the seed, the step and its index).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub microbatches: String,
    /// Where each rank's time of the step went (rank -> compute, p2p and collective ms): how
    /// a straggler shows. Empty in runs from before it was recorded.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub times: BTreeMap<u32, StepTimes>,
}

fn nan() -> f64 {
    f64::NAN
}

/// A float that serde_json wrote from a NaN (`null`) reads back as NaN.
fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// `[0, 1, 2, 5, 7, 8]` as `0-2,5,7-8` (sorted input).
pub fn ranges(ids: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ids.len() {
        let mut j = i;
        while j + 1 < ids.len() && ids[j + 1] == ids[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            ids[i].to_string()
        } else {
            format!("{}-{}", ids[i], ids[j])
        });
        i = j + 1;
    }
    out.join(",")
}

/// The start of a run (or of its resumption).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StartInfo {
    pub step: u64,
    #[serde(default)]
    pub checkpoint: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub params: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
}

/// One pipeline in a `plan` event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipelineLayout {
    pub id: u32,
    pub nodes: Vec<u32>,
    pub first_rank: u32,
    pub microbatches: u32,
}

/// One line of `events.jsonl`. Times are seconds (`_s`) or milliseconds (`_ms`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    Start(StartInfo),
    Resume(StartInfo),
    /// A process of the job started: `role` is `agent`, `ssh` or `worker`.
    Process {
        role: String,
        pid: Option<u32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        host: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        node: Option<u32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rank: Option<u32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data_addr: Option<String>,
    },
    Join {
        node: u32,
        addr: String,
    },
    /// `node` leaves at the next step boundary (`reason`: who asked).
    Drain {
        node: u32,
        reason: String,
    },
    /// A drain of `node` that was not taken, and why.
    DrainRefused {
        node: u32,
        reason: String,
        refusal: String,
    },
    /// `node` was told to go (drained, or no longer needed); its exit is expected.
    Released {
        node: u32,
        reason: String,
    },
    Plan {
        generation: u64,
        pipelines: Vec<PipelineLayout>,
    },
    Rendezvous {
        generation: u64,
        addrs: Vec<String>,
    },
    Lost {
        node: u32,
        reason: String,
    },
    WorkerBroken {
        node: u32,
        rank: u32,
        step: u64,
        error: String,
    },
    WorkerExit {
        node: u32,
        rank: u32,
        generation: u64,
        code: Option<i32>,
        signal: Option<i32>,
        error: Option<String>,
    },
    KillRequested {
        node: u32,
    },
    InjectFailure {
        node: u32,
        step: u64,
    },
    /// The running generation failed after committed `step`.
    Failure {
        generation: u64,
        step: u64,
        reason: String,
    },
    /// A worker's watchdog found it hung (`WorkerReport::Hung`) and fenced it.
    Hang {
        generation: u64,
        node: u32,
        rank: u32,
        what: String,
        for_s: f64,
        limit_s: f64,
        stopped: bool,
    },
    /// Rank `rank` on `node` computed `compute_ms` per step (the mean of the last `steps`
    /// committed steps, up to `step`), `factor` times what its peers took for the same work
    /// (`peers_median_ms`), every one of those steps. Once per episode. `evicted`: its node
    /// drains at the next boundary (`--evict-stragglers`); `refusal`: why it does not.
    Straggler {
        generation: u64,
        step: u64,
        node: u32,
        rank: u32,
        compute_ms: f64,
        peers_median_ms: f64,
        factor: f64,
        steps: u32,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        evicted: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        refusal: Option<String>,
    },
    /// Every rank of the generation waited on its peers in `step` and none moved: the data
    /// plane hangs; the generation is ended (`waiting`: each rank, where and how long).
    DataPlaneHang {
        generation: u64,
        step: u64,
        waiting: Vec<String>,
    },
    /// A lost node that still ran was killed, so it cannot come back.
    Fenced {
        node: u32,
        pid: u32,
    },
    /// The survivors' state of committed `step` became a checkpoint.
    Reconfig {
        generation: u64,
        lost_nodes: Vec<u32>,
        nodes: Vec<u32>,
        failed_in_step: u64,
        from_step: u64,
        replayed_steps: u64,
        detect_s: f64,
        /// The survivors kept running and received the layers they lacked from replicas.
        in_place: bool,
        checkpoint: Option<String>,
        /// The pipelines before and after (node lists) and the fault tolerance left.
        #[serde(default)]
        old_pipelines: Vec<Vec<u32>>,
        #[serde(default)]
        new_pipelines: Vec<Vec<u32>>,
        #[serde(default)]
        fault_tolerance: u32,
        /// Layer copies the new generation makes, and their bytes.
        #[serde(default)]
        copies: usize,
        #[serde(default)]
        copy_bytes: u64,
        /// What caused it in words: a failure, or the joins and drains taken at a step
        /// boundary; and the nodes that joined and left on notice.
        #[serde(default)]
        cause: String,
        #[serde(default)]
        joined_nodes: Vec<u32>,
        #[serde(default)]
        drained_nodes: Vec<u32>,
    },
    /// A checkpoint a generation was to start from could not be read: it started from
    /// `instead` (None: step 0) at `step`.
    CheckpointRefused {
        path: String,
        reason: String,
        instead: Option<String>,
        step: u64,
    },
    /// The first commit after a failure, with the recovery's phases (`detect_s`, `plan_s`, ...).
    Resumed {
        generation: u64,
        step: u64,
        since_failure_s: f64,
        phases: BTreeMap<String, f64>,
        /// Bytes the layer copies moved into the new generation's ranks.
        #[serde(default)]
        copy_bytes: u64,
    },
    Checkpoint {
        step: u64,
        path: String,
        duration_s: f64,
        /// How long training waited for the state (the copy to host memory), ms.
        #[serde(default)]
        stall_ms: f64,
    },
    /// Connections to the control port were refused: `count` from `peer` (`None`: from
    /// addresses beyond the ones counted one by one) for `reason`, since the last such record
    /// (one per address and reason per 10 s). On the control port, or (with `rank` and `node`)
    /// on the data-plane port of that worker while its generation formed.
    Refused {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        node: Option<u32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rank: Option<u32>,
        peer: Option<String>,
        reason: String,
        count: u64,
    },
    /// A signal (`SIGTERM`, `SIGINT`) asked the master to stop: the run ends after `step`,
    /// with its checkpoint.
    StopRequested {
        signal: String,
        step: u64,
    },
    /// A checkpoint of `step` could not be written to `path`: `needed_bytes` did not fit in the
    /// `free_bytes` of `filesystem` (the mount point and its type), or another error. Training
    /// goes on; the next save tries again, and the final save is retried while `retrying`.
    CheckpointFailed {
        step: u64,
        path: String,
        filesystem: String,
        needed_bytes: u64,
        free_bytes: Option<u64>,
        error: String,
        retrying: bool,
    },
    ControlPlane {
        steps: u64,
        commit_wait_ms_per_step: f64,
        step_ms: f64,
        master_commit_ms_per_step: f64,
    },
    Finish {
        step: u64,
        wall_s: f64,
    },
    Abort {
        reason: String,
    },
}

impl Event {
    /// The record of a save that failed.
    pub fn checkpoint_failed(f: &SaveFailure) -> Event {
        Event::CheckpointFailed {
            step: f.step,
            path: f.path.display().to_string(),
            filesystem: f
                .space
                .as_ref()
                .map_or_else(|| f.path.display().to_string(), |s| s.filesystem.clone()),
            needed_bytes: f.needed_bytes,
            free_bytes: f.space.as_ref().map(|s| s.free_bytes),
            error: f.error.clone(),
            retrying: f.retrying,
        }
    }

    /// The `event` tag, as written.
    pub fn kind(&self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v.get("event").and_then(|e| e.as_str()).map(str::to_string))
            .unwrap_or_default()
    }
}

/// One line of `events.jsonl` as read back: an [`Event`] this binary writes, or a line it
/// cannot type (a kind from a newer binary, or a shape from an older one), kept whole so a
/// report or a status page still shows it. Every reader of `events.jsonl` goes through here.
#[derive(Debug, Clone, PartialEq)]
pub enum EventLine {
    Known(Box<Event>),
    Unknown {
        kind: String,
        /// The line's fields other than `event`.
        fields: serde_json::Map<String, serde_json::Value>,
    },
}

/// A line of `events.jsonl` that is not an event at all.
#[derive(Debug, thiserror::Error)]
pub enum EventLineError {
    #[error("not a JSON object: {0}")]
    NotJson(#[from] serde_json::Error),
    #[error("it has no \"event\" kind")]
    NoKind,
}

impl EventLine {
    /// Reads one line: a JSON object with a string `event` is always an event, typed when
    /// this binary knows its shape.
    pub fn parse(text: &str) -> Result<EventLine, EventLineError> {
        let value: serde_json::Value = serde_json::from_str(text)?;
        Self::from_value(value)
    }

    /// [`EventLine::parse`] of a line already read as JSON.
    pub fn from_value(value: serde_json::Value) -> Result<EventLine, EventLineError> {
        let Some(kind) = value
            .get("event")
            .and_then(|k| k.as_str())
            .map(str::to_string)
        else {
            return Err(EventLineError::NoKind);
        };
        if let Ok(e) = Event::deserialize(&value) {
            return Ok(EventLine::Known(Box::new(e)));
        }
        let serde_json::Value::Object(mut fields) = value else {
            return Err(EventLineError::NoKind);
        };
        fields.remove("event");
        Ok(EventLine::Unknown { kind, fields })
    }

    /// The `event` tag, as written.
    pub fn kind(&self) -> String {
        match self {
            EventLine::Known(e) => e.kind(),
            EventLine::Unknown { kind, .. } => kind.clone(),
        }
    }

    /// The line's fields other than `event`, as written.
    pub fn fields(&self) -> serde_json::Map<String, serde_json::Value> {
        match self {
            EventLine::Known(e) => match serde_json::to_value(e) {
                Ok(serde_json::Value::Object(mut m)) => {
                    m.remove("event");
                    m
                }
                _ => serde_json::Map::new(),
            },
            EventLine::Unknown { fields, .. } => fields.clone(),
        }
    }

    /// The typed event, when this binary knows it.
    pub fn known(&self) -> Option<&Event> {
        match self {
            EventLine::Known(e) => Some(e),
            EventLine::Unknown { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_lines_read_back_typed_and_newer_kinds_keep_their_fields() {
        let e = Event::Finish {
            step: 3,
            wall_s: 1.5,
        };
        let line = EventLine::parse(&serde_json::to_string(&e).expect("json")).expect("event");
        assert_eq!(line, EventLine::Known(Box::new(e)));
        assert_eq!(line.kind(), "finish");
        assert_eq!(line.fields()["step"], 3);
        let newer = EventLine::parse(r#"{"event":"teleported","node":4}"#).expect("event");
        assert_eq!(newer.kind(), "teleported");
        assert!(newer.known().is_none());
        assert_eq!(newer.fields()["node"], 4);
        assert!(matches!(
            EventLine::parse(r#"{"step":1}"#),
            Err(EventLineError::NoKind)
        ));
        assert!(matches!(
            EventLine::parse("not json"),
            Err(EventLineError::NotJson(_))
        ));
    }

    #[test]
    fn a_diverged_step_reads_back_as_nan_and_older_lines_read_with_defaults() {
        let m = StepMetrics {
            step: 4,
            loss: f64::NAN,
            lr: 1e-3,
            grad_norm: f64::NAN,
            samples_per_s: 2.0,
            tokens_per_s: 128.0,
            generation: 1,
            pipelines: 2,
            nodes: 3,
            wall_s: 9.5,
            val_loss: None,
            microbatches: "0-3".into(),
            times: BTreeMap::new(),
        };
        let line = serde_json::to_string(&m).expect("json");
        assert!(line.contains("\"loss\":null"), "{line}");
        let back: StepMetrics = serde_json::from_str(&line).expect("reads back");
        assert!(back.loss.is_nan() && back.grad_norm.is_nan());
        assert_eq!((back.step, back.nodes, back.lr), (4, 3, 1e-3));
        let old: StepMetrics = serde_json::from_str(
            r#"{"step":1,"loss":9.5,"tokens_per_s":10.0,"generation":0,"wall_s":0.5}"#,
        )
        .expect("an older line");
        assert_eq!((old.pipelines, old.nodes), (0, 0));
        assert!(old.lr.is_nan());
        let e = serde_json::from_str::<StepMetrics>(r#"{"step":2}"#).unwrap_err();
        assert!(e.to_string().contains("missing field `loss`"), "{e}");
    }

    #[test]
    fn reports_round_trip_and_other_lines_are_ignored() {
        let r = WorkerReport::Ready {
            rank: 1,
            step: 3,
            loss: 1.5,
            grad_norm: 0.25,
            microbatches: vec![0, 1],
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

    #[test]
    fn events_keep_the_fields_of_events_jsonl() {
        let e = Event::Checkpoint {
            step: 5,
            path: "c/step-000005".into(),
            duration_s: 0.25,
            stall_ms: 3.0,
        };
        let v = serde_json::to_value(&e).expect("json");
        assert_eq!(
            v,
            serde_json::json!({"event": "checkpoint", "step": 5, "path": "c/step-000005",
                               "duration_s": 0.25, "stall_ms": 3.0})
        );
        let start = Event::Start(StartInfo {
            step: 0,
            checkpoint: None,
            model: Some("gpt-mini".into()),
            params: Some(7),
            nodes: None,
            master: None,
            pid: None,
        });
        let v = serde_json::to_value(&start).expect("json");
        assert_eq!(v["event"], "start");
        assert_eq!(v["model"], "gpt-mini");
        let back: Event = serde_json::from_value(v).expect("typed");
        assert_eq!(back, start);
        assert_eq!(back.kind(), "start");
    }

    #[test]
    fn metrics_lines_from_before_per_rank_times_still_parse_and_new_ones_carry_them() {
        let old = r#"{"step":3,"loss":2.5,"lr":0.001,"grad_norm":0.5,"samples_per_s":8.0,
            "tokens_per_s":256.0,"generation":0,"pipelines":2,"nodes":3,"wall_s":1.5}"#;
        let mut m: StepMetrics = serde_json::from_str(old).expect("an old line");
        assert!(m.times.is_empty());
        assert!(serde_json::to_value(&m)
            .expect("json")
            .get("times")
            .is_none());
        let t = StepTimes {
            compute_ms: 310.0,
            p2p_ms: 4.0,
            collective_ms: 12.0,
            step_ms: 400.0,
            marks: 30,
            ..Default::default()
        };
        m.times.insert(2, t);
        let v = serde_json::to_value(&m).expect("json");
        assert_eq!(v["times"]["2"]["compute_ms"], 310.0);
        let back: StepMetrics = serde_json::from_value(v).expect("typed");
        assert_eq!(back.times[&2], t);
    }

    #[test]
    fn microbatch_ranges_are_compact_and_exact() {
        assert_eq!(ranges(&[]), "");
        assert_eq!(ranges(&[3]), "3");
        assert_eq!(ranges(&[0, 1, 2, 3]), "0-3");
        assert_eq!(ranges(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
    }
}
