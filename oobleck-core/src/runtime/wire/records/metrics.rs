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
    /// Which data the step trained: its position in the data and a hash of the multiset of
    /// its sample ids, so two runs can be compared step by step (a kill, a join, a resume on
    /// other nodes must not change it). `None` for workloads that do not number their samples
    /// and in runs from before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<StepData>,
}

/// The data of one step, as `metrics.jsonl` shows it:
/// `"data": {"epoch": 0, "iteration": 3, "samples": "9e3779b97f4a7c15"}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepData {
    /// Epoch and iteration within it of the step's data (absent for a workload without
    /// epochs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iteration: Option<u64>,
    /// [`SampleHash`] of every sample the step trained, as 16 hex digits.
    pub samples: String,
}

/// An order-independent hash of a multiset of sample ids: the wrapping sum of
/// [`splitmix64`] of each id. Workers hash the microbatches they load and the master adds
/// their hashes (wrapping), so the step's hash does not depend on how its microbatches were
/// spread over pipelines; a sample trained twice, or one left out, changes it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SampleHash(pub u64);

impl SampleHash {
    /// The hash of `ids`.
    pub fn of(ids: impl IntoIterator<Item = u64>) -> SampleHash {
        SampleHash(
            ids.into_iter()
                .fold(0, |h, id| h.wrapping_add(splitmix64(id))),
        )
    }

    /// 16 lower-case hex digits, as `metrics.jsonl` writes it.
    pub fn hex(self) -> String {
        format!("{:016x}", self.0)
    }
}

/// The hash of both multisets together.
impl std::ops::Add for SampleHash {
    type Output = SampleHash;

    fn add(self, other: SampleHash) -> SampleHash {
        SampleHash(self.0.wrapping_add(other.0))
    }
}

/// SplitMix64's output function (Steele, Lea and Flood 2014): a bijection of `u64` whose
/// outputs of consecutive inputs look independent, so sums of them rarely collide.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
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
            data: None,
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
    fn sample_hashes_are_splitmix64_sums_in_any_order_and_the_data_field_reads_back() {
        // SplitMix64 of the seed 0 stream: its first output is splitmix64(0).
        assert_eq!(splitmix64(0), 0xe220_a839_7b1d_cdaf);
        let h = SampleHash::of([3, 1, 2]);
        assert_eq!(h, SampleHash::of([1, 2]) + SampleHash::of([3]));
        assert_ne!(h, SampleHash::of([1, 2, 2]), "a repeated sample shows");
        assert_ne!(h, SampleHash::of([1, 2]), "a missing sample shows");
        assert_eq!(SampleHash::of([]).hex(), "0000000000000000");
        let data = StepData {
            epoch: Some(1),
            iteration: Some(0),
            samples: h.hex(),
        };
        let v = serde_json::to_value(&data).expect("json");
        assert_eq!(
            v,
            serde_json::json!({"epoch": 1, "iteration": 0, "samples": h.hex()})
        );
        assert_eq!(serde_json::from_value::<StepData>(v).expect("reads"), data);
        let old = r#"{"step":1,"loss":9.5,"tokens_per_s":10.0,"generation":0,"wall_s":0.5}"#;
        let old: StepMetrics = serde_json::from_str(old).expect("an older line");
        assert_eq!(old.data, None);
    }

    #[test]
    fn microbatch_ranges_are_compact_and_exact() {
        assert_eq!(ranges(&[]), "");
        assert_eq!(ranges(&[3]), "3");
        assert_eq!(ranges(&[0, 1, 2, 3]), "0-3");
        assert_eq!(ranges(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
    }
}
