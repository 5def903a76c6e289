//! Our own policies, planned with this project's planner: [`OobleckPolicy`] (re-instantiate
//! in place from the same templates, checkpoint fallback beyond `f`), [`CheckpointRestart`]
//! (Varuna-like: every loss is a restart from the last checkpoint) and [`Redundancy`]
//! (Bamboo-like: each node also computes its successor's layers and takes over when it dies).
//! They share the event loop of [`super::engine`] and the [`Costs`] of one event.

mod checkpoint;
mod oobleck;
mod redundancy;

pub use checkpoint::CheckpointRestart;
pub use oobleck::OobleckPolicy;
pub use redundancy::Redundancy;

use serde::Serialize;

use super::engine::{Counted, Loss, Reaction, Running};
use super::outcome::TimeKind;
use super::trace::{Change, Trace};
use super::SimError;
use crate::planning::{
    generate_templates, gradient_sync_ns, instantiate_with_sizes, ClusterSpec, JobSpec,
    ModelProfile, Plan, PlanError, TemplateSet,
};

/// What is trained on what: the planner's inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    pub profile: ModelProfile,
    pub cluster: ClusterSpec,
    pub job: JobSpec,
}

impl Workload {
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
    /// A checkpoint after every this many steps (0 = never; then a restart loses everything
    /// since the start).
    pub checkpoint_every: u64,
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
            checkpoint_every: 100,
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

/// The most nodes the trace ever has at once.
fn peak_nodes(trace: &Trace) -> u32 {
    let (mut now, mut peak) = (0i64, 0i64);
    for e in trace.events() {
        now += match e.change {
            Change::Add => 1,
            Change::Remove => -1,
        };
        peak = peak.max(now);
    }
    peak as u32
}

/// Templates for every node count from `n0` up to the most nodes the trace has at once,
/// whatever `f` is: after losses past `f` the job may run with fewer replicas, and joins may
/// bring it past its starting size.
pub(crate) fn templates(work: &Workload, trace: &Trace) -> Result<TemplateSet, PlanError> {
    let mut job = work.job;
    job.fault_threshold = 0;
    generate_templates(&work.profile, &work.cluster, &job, peak_nodes(trace))
}

/// State bytes of the fullest node of `plan`: what a restart reads and a checkpoint writes
/// per node (nodes read and write in parallel).
pub(crate) fn node_state_bytes(plan: &Plan) -> u64 {
    let mut most = 0u64;
    for p in &plan.pipelines {
        let t = plan.template_of(p);
        let mut per_node = vec![0u64; t.nodes as usize];
        for s in &t.stages {
            let bytes: u64 = plan.layer_state_bytes[s.layers()].iter().sum();
            per_node[s.node as usize] += bytes;
        }
        most = most.max(per_node.into_iter().max().unwrap_or(0));
    }
    most
}

/// How `plan` trains: its predicted iteration time, with checkpoints as `costs` says.
pub(crate) fn running(plan: &Plan, work: &Workload, costs: &Costs) -> Running {
    Running {
        step_ms: plan.iteration_ms(),
        samples_per_step: work.samples_per_step(),
        redundant_share: 0.0,
        checkpoint_every: costs.checkpoint_every,
        checkpoint_ms: costs.storage_ms(node_state_bytes(plan)),
    }
}

/// A fresh plan on as many usable nodes as the templates can cover, keeping `f` when the
/// nodes allow and lowering it when they do not (as `reconfig::decide` does), or the
/// planner's reason when no plan fits at all.
pub(crate) fn fresh_plan(
    set: &TemplateSet,
    work: &Workload,
    usable: &[u32],
) -> Result<Plan, String> {
    let sync = gradient_sync_ns(&work.profile, &work.cluster);
    let mut job = work.job;
    let mut why = String::from("no usable node");
    for f in (0..=work.job.fault_threshold).rev() {
        job.fault_threshold = f;
        // Consecutive template sizes cover every large enough count; a few tries suffice.
        for n in (1..=usable.len()).rev().take(64) {
            let g = work.cluster.devices_per_node;
            match instantiate_with_sizes(set, &job, g, sync, &usable[..n], 0) {
                Ok(plan) => return Ok(plan),
                Err(e) if n == usable.len() && f == work.job.fault_threshold => why = e.to_string(),
                Err(_) => {}
            }
        }
    }
    Err(why)
}

/// A restart from the last checkpoint on every usable node (or idle when they are too few).
/// `first` is the job's start: nothing to roll back and nothing counted.
pub(crate) fn restart(
    set: &TemplateSet,
    work: &Workload,
    costs: &Costs,
    usable: &[u32],
    first: bool,
) -> (Option<Plan>, Reaction) {
    let (loss, counted) = if first {
        (Loss::Nothing, Counted::Nothing)
    } else {
        (Loss::SinceCheckpoint, Counted::Restart)
    };
    let detect = if first { 0.0 } else { costs.detect_ms };
    match fresh_plan(set, work, usable) {
        Ok(plan) => {
            let load = costs.storage_ms(node_state_bytes(&plan));
            let reaction = Reaction::Stop {
                loss,
                pause: vec![(TimeKind::Restart, detect + costs.restart_ms + load)],
                then: Some(running(&plan, work, costs)),
                counted,
                note: None,
            };
            (Some(plan), reaction)
        }
        Err(why) => {
            let reaction = Reaction::Stop {
                loss,
                pause: Vec::new(),
                then: None,
                counted: Counted::Nothing,
                note: Some(format!(
                    "idle while {} nodes cannot train: {why}",
                    usable.len()
                )),
            };
            (None, reaction)
        }
    }
}

#[cfg(test)]
mod tests;
