//! One line of `events.jsonl` ([`Event`]), and how a line is read back ([`EventLine`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::checkpoint::space::SaveFailure;

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

/// Commits per `standby_cost` event: a line every 20 steps while a standby is kept.
pub const STANDBY_COST_COMMITS: u64 = 20;

/// One line of `events.jsonl`. Times are seconds (`_s`) or milliseconds (`_ms`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    Start(StartInfo),
    Resume(StartInfo),
    /// A master restarted on the run directory (`train --resume RUN --reattach`) that
    /// re-adopts the lost master's agents; `step` is the committed step it found recorded.
    Reattach(StartInfo),
    /// The job's master of `lost_epoch` was lost, and this master (of `epoch`) takes its
    /// place from committed `step`: `why` says who took over and what it saw (a standby whose
    /// master fell silent, or a restart with `--reattach`). Written first by the new master.
    MasterLost {
        lost_epoch: u64,
        epoch: u64,
        step: u64,
        why: String,
    },
    /// The master that took over committed its first step: the take-over's phases, s
    /// (`detect_s`: the longest a returning agent had been without a master when this master
    /// started; `quorum_s`: until a majority of the plan's nodes was back; `readopt_s`: until
    /// it re-adopted them, every node back or the wait after the first over; `first_commit_s`:
    /// until `step` committed) and their sum (`total_s`).
    MasterTookOver {
        epoch: u64,
        step: u64,
        nodes_back: Vec<u32>,
        nodes_lost: Vec<u32>,
        total_s: f64,
        phases: BTreeMap<String, f64>,
    },
    /// An agent of the lost master came back to the restarted one with its old id: its
    /// workers run `generation` and it last heard of committed step `step`.
    Returned {
        node: u32,
        addr: String,
        generation: u64,
        step: u64,
        /// Its workers that hold a committed step.
        ranks: Vec<u32>,
        /// How long it had been without a master.
        without_master_s: f64,
    },
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
    /// The active master's time on its standbys over its last `commits` commits (written
    /// every [`STANDBY_COST_COMMITS`] commits while it has a standby): at each commit, the logs
    /// and records sent to every standby and their acknowledgements awaited, before any agent
    /// hears of the step (on the step's path); between commits, the run directory's other
    /// files mirrored (on the master's loop, beside the step). Milliseconds.
    StandbyCost {
        standbys: usize,
        commits: u64,
        commit_mean_ms: f64,
        commit_median_ms: f64,
        commit_max_ms: f64,
        /// Mirroring between the commits, in all.
        mirror_ms: f64,
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
}
