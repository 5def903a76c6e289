//! Our own policies, planned with this project's planner: [`OobleckPolicy`] (re-instantiate
//! in place from the same templates, checkpoint fallback beyond `f`), [`CheckpointRestart`]
//! (Varuna-like: every loss is a restart from the last checkpoint) and [`Redundancy`]
//! (Bamboo-like: each node also computes its successor's layers and takes over when it dies).
//! They share the event loop of `simulate::engine` and the [`Costs`] of one event.

mod checkpoint;
mod oobleck;
mod planner;
mod redundancy;

pub use checkpoint::CheckpointRestart;
pub use oobleck::OobleckPolicy;
pub use planner::fault_free_samples_per_s;
pub use redundancy::Redundancy;

use serde::Serialize;

use super::engine::LoopOptions;
use super::trace::Trace;
use super::SimError;
use crate::planning::{ClusterSpec, JobSpec, ModelProfile};

/// What the simulator trains on what: the planner's inputs (not the runtime's
/// `Workload`, which is a model with its data).
#[derive(Debug, Clone, PartialEq)]
pub struct SimWorkload {
    pub profile: ModelProfile,
    pub cluster: ClusterSpec,
    pub job: JobSpec,
}

impl SimWorkload {
    /// Samples of one iteration (`B * b`).
    pub fn samples_per_step(&self) -> f64 {
        f64::from(self.job.global_microbatches) * f64::from(self.job.microbatch_size)
    }
}

/// The cost of each kind of event, in milliseconds unless named otherwise. Every field is a
/// flag of `oobleck simulate`; the defaults are what `oobleck bench recovery` measured where
/// the runtime measures it (see the simulator's README), and stated assumptions elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Costs {
    /// From a node's death until the master acts (bench recovery: 6 ms median, a dropped
    /// connection; a machine that vanishes silently costs the heartbeat timeout instead).
    pub detect_ms: f64,
    /// Computing the new plan (the planner bench: under 10 ms at 10,000 nodes).
    pub replan_ms: f64,
    /// Tearing down and rebuilding the communicators of the new generation (bench recovery:
    /// restart 122 ms + connect 140 ms).
    pub rebuild_ms: f64,
    /// Layer copies between nodes, GB/s per receiving node; 0 = the cluster's inter-node link.
    pub copy_gbps: f64,
    /// From a node's `add` until it can train (the authors' simulators: 45 s).
    pub startup_ms: f64,
    /// Restarting every process of the job, before the checkpoint is read (an assumption:
    /// CUDA and NCCL start-up and a rendezvous, 30 s).
    pub restart_ms: f64,
    /// Checkpoint storage bandwidth per node, GB/s (writes and reads).
    pub storage_gbps: f64,
    /// The oobleck policy checkpoints as the runtime does: training stalls only while each
    /// node copies its state in memory, at this many GB/s (bench recovery: 86 MB in 12–51
    /// ms), and the write to storage goes on in the background.
    pub snapshot_gbps: f64,
    /// A checkpoint after every this many steps (`Some(0)` = never: a restart then loses
    /// everything since the start). `None`: the Young–Daly interval `sqrt(2 * C * M)` for the
    /// plan's checkpoint time `C` and the trace's mean time between failures `M`, in whole
    /// steps (never when the trace has no failure).
    pub checkpoint_every: Option<u64>,
    /// Redundancy only: the extra computation of a node's successor's layers, as a share of
    /// the step (a forward pass is about a third of forward + backward).
    pub redundant_overhead: f64,
    /// Redundancy only: how much slower a pipeline runs after a node took over its dead
    /// successor's layers (Bamboo's simulator: 1.5).
    pub fallback_slowdown: f64,
}

impl Default for Costs {
    fn default() -> Self {
        Costs {
            detect_ms: 6.0,
            replan_ms: 10.0,
            rebuild_ms: 262.0,
            copy_gbps: 0.0,
            startup_ms: 45_000.0,
            restart_ms: 30_000.0,
            storage_gbps: 2.0,
            snapshot_gbps: 4.0,
            checkpoint_every: None,
            redundant_overhead: 1.0 / 3.0,
            fallback_slowdown: 1.5,
        }
    }
}

impl Costs {
    /// Checks every field is a usable number.
    pub fn validate(&self) -> Result<(), SimError> {
        let fields = [
            ("detect", self.detect_ms),
            ("replan", self.replan_ms),
            ("rebuild", self.rebuild_ms),
            ("copy-gbps", self.copy_gbps),
            ("startup", self.startup_ms),
            ("restart", self.restart_ms),
            ("redundant-overhead", self.redundant_overhead),
        ];
        for (field, value) in fields {
            if !value.is_finite() || value < 0.0 {
                return Err(SimError::Setting {
                    field,
                    value: value.to_string(),
                    message: "must be a finite number >= 0".into(),
                });
            }
        }
        for (field, value) in [
            ("storage-gbps", self.storage_gbps),
            ("snapshot-gbps", self.snapshot_gbps),
            ("fallback-slowdown", self.fallback_slowdown),
        ] {
            if !value.is_finite() || value <= 0.0 {
                return Err(SimError::Setting {
                    field,
                    value: value.to_string(),
                    message: "must be a finite number > 0".into(),
                });
            }
        }
        Ok(())
    }

    /// The event loop's settings for a trace: this start-up delay, and the end (`None`: the
    /// trace's last event).
    fn loop_options(&self, trace: &Trace, end_ms: Option<u64>) -> LoopOptions {
        LoopOptions {
            startup_ms: self.startup_ms.round() as u64,
            end_ms: end_ms.unwrap_or(trace.end_ms()),
        }
    }

    /// Copying `bytes` into one node.
    fn copy_ms(&self, bytes: u64, cluster: &ClusterSpec) -> f64 {
        let gbps = if self.copy_gbps > 0.0 {
            self.copy_gbps
        } else {
            cluster.inter_node.bandwidth_gbps
        };
        bytes as f64 / (gbps * 1e6)
    }

    /// Reading or writing `bytes` on one node.
    fn storage_ms(&self, bytes: u64) -> f64 {
        bytes as f64 / (self.storage_gbps * 1e6)
    }
}

#[cfg(test)]
mod tests;
