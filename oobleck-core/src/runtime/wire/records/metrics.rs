//! One line of `metrics.jsonl` ([`StepMetrics`]), written and read back by the same type.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::execution::StepTimes;

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

#[cfg(test)]
mod tests {
    use super::*;

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
