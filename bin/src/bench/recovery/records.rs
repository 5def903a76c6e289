//! The lines of a run directory's `events.jsonl` and `metrics.jsonl` that the bench reads,
//! typed. Other events and fields are ignored; a line that does not parse is an error naming
//! the file and line, except an unterminated last line (a process killed mid-write).

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// Seconds of each phase of one recovery in place (the `phases` of a `resumed` event).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct Phases {
    /// Joins and drains only: the first request taken (a drain asked for, a join registered)
    /// -> the step boundary where the reconfiguration begins (at most a step, by design).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_boundary_s: Option<f64>,
    /// Failure (or that boundary) -> every rank's state known.
    pub detect_s: f64,
    /// The reconfiguration decision.
    pub decide_s: f64,
    /// Plan out -> every worker of the new generation listening.
    pub restart_s: f64,
    /// Data plane connected and layers copied, slowest rank.
    pub connect_copy_s: f64,
    pub connect_max_s: f64,
    pub copy_max_s: f64,
    /// The first step of the new generation.
    pub first_step_s: f64,
}

/// One event of `events.jsonl` the bench uses.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// A new run (not a resumed one) started; `pid`: the `train` process (the master), whose
    /// process group holds the whole local cluster.
    Start {
        #[serde(default)]
        pid: Option<u32>,
    },
    /// A process of the job started (`role`: `agent`, `ssh` or `worker`; a worker kept across
    /// generations is recorded once, with its first rank).
    Process {
        role: String,
        pid: Option<u32>,
        #[serde(default)]
        node: Option<u32>,
        #[serde(default)]
        rank: Option<u32>,
    },
    /// A run resumed from the checkpoint of `step`.
    Resume { step: u64 },
    /// `--inject-failure`: `node` is being killed after `step` committed.
    InjectFailure { node: u32, step: u64 },
    /// With f = 0 (or no way to recover): the job ends.
    Abort { reason: String },
    /// A generation's pipelines (the first one's before any join of a running job).
    Plan,
    /// `node` registered (at the start, or while the job runs: a join).
    Join { node: u32, addr: String },
    /// A drain of `node` was taken: it leaves at the next step boundary.
    Drain { node: u32, reason: String },
    /// A drain of `node` was refused, and why.
    DrainRefused { node: u32, refusal: String },
    /// `node` was told to go (drained, or not needed).
    Released { node: u32, reason: String },
    /// A worker's watchdog found it hung, and its agent fenced it: no progress for `for_s`
    /// seconds inside `what`, past the limit `limit_s`; `stopped`: no progress beat either.
    Hang {
        node: u32,
        rank: u32,
        what: String,
        for_s: f64,
        limit_s: f64,
        stopped: bool,
    },
    /// A recovery (or a join or drain at a step boundary) was decided.
    Reconfig {
        lost_nodes: Vec<u32>,
        from_step: u64,
        replayed_steps: u64,
        in_place: bool,
        #[serde(default)]
        copies: u64,
        /// The bytes the plan copies.
        #[serde(default)]
        copy_bytes: u64,
        new_pipelines: Vec<Vec<u32>>,
        /// What caused it, in words ("node 3 drains (oobleck drain)").
        #[serde(default)]
        cause: String,
        #[serde(default)]
        joined_nodes: Vec<u32>,
        #[serde(default)]
        drained_nodes: Vec<u32>,
    },
    /// The first commit after a recovery.
    Resumed {
        step: u64,
        since_failure_s: f64,
        /// The bytes the ranks received.
        copy_bytes: u64,
        phases: Phases,
    },
    /// A checkpoint was written; the training stalled `stall_ms` for it.
    Checkpoint { step: u64, stall_ms: f64 },
    /// The job finished after `step`.
    Finish { step: u64, wall_s: f64 },
    #[serde(other)]
    Other,
}

/// One line of `metrics.jsonl`: a committed step.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
pub struct Metric {
    pub step: u64,
    /// Seconds since the job's start in this process (a resumed run starts from 0 again).
    pub wall_s: f64,
    #[serde(default)]
    pub generation: u64,
}

/// The per-rank times of a `metrics.jsonl` line, of which the bench reads the progress marks.
#[derive(Clone, Debug, Default, Deserialize)]
struct RankTimes {
    #[serde(default)]
    marks: u64,
}

#[derive(Clone, Debug, Deserialize)]
struct StepTimes {
    step: u64,
    /// Rank -> its times; absent in runs from before they were recorded.
    #[serde(default)]
    times: BTreeMap<u32, RankTimes>,
}

/// Parses the JSON lines of `text` (`what` names the file in errors).
fn parse_lines<T: serde::de::DeserializeOwned>(text: &str, what: &str) -> Result<Vec<T>> {
    let terminated = text.ends_with('\n');
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(line) {
            Ok(v) => out.push(v),
            Err(_) if i + 1 == lines.len() && !terminated => break,
            Err(e) => return Err(e).with_context(|| format!("{what} line {}", i + 1)),
        }
    }
    Ok(out)
}

pub fn parse_events(text: &str) -> Result<Vec<Event>> {
    parse_lines(text, "events.jsonl")
}

pub fn parse_metrics(text: &str) -> Result<Vec<Metric>> {
    parse_lines(text, "metrics.jsonl")
}

/// `(step, the most progress marks any rank took in it)` of each `metrics.jsonl` line that has
/// per-rank times.
pub fn parse_rank_marks(text: &str) -> Result<Vec<(u64, u64)>> {
    let lines: Vec<StepTimes> = parse_lines(text, "metrics.jsonl")?;
    Ok(lines
        .iter()
        .filter_map(|l| Some((l.step, l.times.values().map(|t| t.marks).max()?)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_events_are_other_and_a_cut_last_line_is_dropped() {
        let text = "{\"event\":\"rendezvous\",\"generation\":0,\"addrs\":[]}\n\
                    {\"event\":\"checkpoint\",\"step\":2,\"path\":\"x\",\"stall_ms\":14.5}\n\
                    {\"event\":\"finish\",\"st";
        let e = parse_events(text).unwrap();
        assert_eq!(
            e,
            vec![
                Event::Other,
                Event::Checkpoint {
                    step: 2,
                    stall_ms: 14.5
                }
            ]
        );
    }

    #[test]
    fn the_busiest_ranks_marks_are_read_where_metrics_have_them() {
        let text = "{\"step\":1,\"wall_s\":0.5}\n\
                    {\"step\":2,\"wall_s\":1.5,\"times\":{\"0\":{\"compute_ms\":3.0,\
                    \"marks\":40},\"1\":{\"compute_ms\":2.0,\"marks\":52}}}\n";
        assert_eq!(parse_rank_marks(text).unwrap(), vec![(2, 52)]);
        let e = parse_events(
            "{\"event\":\"process\",\"role\":\"worker\",\"pid\":9,\"node\":3,\"rank\":1}\n",
        )
        .unwrap();
        assert!(
            matches!(&e[0], Event::Process { role, pid: Some(9), node: Some(3), rank: Some(1) } if role == "worker"),
            "{e:?}"
        );
    }

    #[test]
    fn a_bad_line_in_the_middle_names_its_line() {
        let err = parse_metrics("{\"step\":1,\"wall_s\":0.5}\nnot json\n").unwrap_err();
        assert!(
            format!("{err:#}").contains("metrics.jsonl line 2"),
            "{err:#}"
        );
    }
}
