//! A run directory's `events.jsonl` and `metrics.jsonl`, read through the runtime's own types
//! ([`Event`] by way of [`EventLine`], and [`StepMetrics`]). Events of kinds this binary does
//! not know are skipped; a line that does not parse is an error naming the file and line,
//! except an unterminated last line (a process killed mid-write).

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use oobleck_core::runtime::wire::records::StepMetrics;
use oobleck_core::runtime::wire::EventLine;
use serde::{Deserialize, Serialize};

pub use oobleck_core::runtime::wire::records::Event;

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

impl Phases {
    /// The named phases of a `resumed` event's `phases` map; `None` if one is missing.
    pub fn of(phases: &BTreeMap<String, f64>) -> Option<Phases> {
        serde_json::to_value(phases)
            .ok()
            .and_then(|v| serde_json::from_value(v).ok())
    }
}

/// Parses the JSON lines of `text` with `parse` (`what` names the file in errors).
fn parse_lines<T, E>(
    text: &str,
    what: &str,
    parse: impl Fn(&str) -> std::result::Result<T, E>,
) -> Result<Vec<T>>
where
    E: std::error::Error + Send + Sync + 'static,
{
    let terminated = text.ends_with('\n');
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match parse(line) {
            Ok(v) => out.push(v),
            Err(_) if i + 1 == lines.len() && !terminated => break,
            Err(e) => return Err(e).with_context(|| format!("{what} line {}", i + 1)),
        }
    }
    Ok(out)
}

/// The events of `text` this binary knows.
pub fn parse_events(text: &str) -> Result<Vec<Event>> {
    let lines = parse_lines(text, "events.jsonl", EventLine::parse)?;
    Ok(lines
        .into_iter()
        .filter_map(|l| match l {
            EventLine::Known(e) => Some(*e),
            EventLine::Unknown { .. } => None,
        })
        .collect())
}

pub fn parse_metrics(text: &str) -> Result<Vec<StepMetrics>> {
    parse_lines(text, "metrics.jsonl", |l| serde_json::from_str(l))
}

/// `(step, the most progress marks any rank took in it)` of each `metrics.jsonl` line that has
/// per-rank times.
pub fn parse_rank_marks(text: &str) -> Result<Vec<(u64, u64)>> {
    Ok(parse_metrics(text)?
        .iter()
        .filter_map(|l| Some((l.step, l.times.values().map(|t| t.marks).max()?)))
        .collect())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A `metrics.jsonl` line of `step` at `wall_s` (generation 0), `more` appended to its fields.
    pub(in super::super) fn metric_line(step: u64, wall_s: f64, more: &str) -> String {
        format!(
            "{{\"step\":{step},\"loss\":1.0,\"tokens_per_s\":1.0,\"generation\":0,\
             \"wall_s\":{wall_s}{more}}}"
        )
    }

    #[test]
    fn unknown_events_are_skipped_and_a_cut_last_line_is_dropped() {
        let text = "{\"event\":\"teleported\",\"generation\":0,\"addrs\":[]}\n\
                    {\"event\":\"checkpoint\",\"step\":2,\"path\":\"x\",\"duration_s\":0.5,\
                    \"stall_ms\":14.5}\n\
                    {\"event\":\"finish\",\"st";
        let e = parse_events(text).unwrap();
        assert_eq!(
            e,
            vec![Event::Checkpoint {
                step: 2,
                path: "x".into(),
                duration_s: 0.5,
                stall_ms: 14.5
            }]
        );
    }

    #[test]
    fn the_busiest_ranks_marks_are_read_where_metrics_have_them() {
        let times = |c: f64, m: u32| {
            format!(
                "{{\"compute_ms\":{c},\"p2p_ms\":0.0,\"collective_ms\":0.0,\"step_ms\":{c},\
                 \"marks\":{m}}}"
            )
        };
        let text = format!(
            "{}\n{}\n",
            metric_line(1, 0.5, ""),
            metric_line(
                2,
                1.5,
                &format!(
                    ",\"times\":{{\"0\":{},\"1\":{}}}",
                    times(3.0, 40),
                    times(2.0, 52)
                )
            )
        );
        let text = text.as_str();
        assert_eq!(parse_rank_marks(text).unwrap(), vec![(2, 52)]);
        let e = parse_events(
            "{\"event\":\"process\",\"role\":\"worker\",\"pid\":9,\"node\":3,\"rank\":1}\n",
        )
        .unwrap();
        assert!(
            matches!(&e[0], Event::Process { role, pid: Some(9), node: Some(3), rank: Some(1), .. } if role == "worker"),
            "{e:?}"
        );
    }

    #[test]
    fn a_bad_line_in_the_middle_names_its_line() {
        let err = parse_metrics(&format!("{}\nnot json\n", metric_line(1, 0.5, ""))).unwrap_err();
        assert!(
            format!("{err:#}").contains("metrics.jsonl line 2"),
            "{err:#}"
        );
    }
}
