//! What every policy asks of the planner: templates for the trace, a fresh plan on the
//! nodes there are, how a plan trains (its step time and checkpoints), and a restart.

use super::{Costs, SimWorkload};
use crate::planning::{
    generate_templates, gradient_sync_ns, instantiate_degraded, Plan, PlanError, TemplateSet,
};
use crate::simulate::engine::{Counted, Loss, Reaction, Running};
use crate::simulate::outcome::TimeKind;
use crate::simulate::trace::Trace;
use crate::simulate::SimError;

/// How a policy writes checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Checkpoints {
    /// Training waits while each node writes its state to storage.
    Blocking,
    /// Training waits only for an in-memory snapshot; the write goes on in the background
    /// (at most one at a time, so checkpoints are at least one write apart).
    Background,
}

/// A policy's planner: its templates and how its plans train and restart.
pub(crate) struct Planner<'a> {
    pub set: TemplateSet,
    pub work: &'a SimWorkload,
    pub costs: &'a Costs,
    /// The trace's mean time between failures (for the Young–Daly interval).
    pub gap_ms: Option<f64>,
    pub checkpoints: Checkpoints,
}

impl<'a> Planner<'a> {
    /// Templates for the trace; see [`templates`].
    pub fn new(
        work: &'a SimWorkload,
        costs: &'a Costs,
        trace: &Trace,
        checkpoints: Checkpoints,
    ) -> Result<Planner<'a>, PlanError> {
        Ok(Planner::with_set(
            templates(work, trace)?,
            work,
            costs,
            trace,
            checkpoints,
        ))
    }

    /// A planner with templates of the policy's own.
    pub fn with_set(
        set: TemplateSet,
        work: &'a SimWorkload,
        costs: &'a Costs,
        trace: &Trace,
        checkpoints: Checkpoints,
    ) -> Planner<'a> {
        Planner {
            set,
            work,
            costs,
            gap_ms: failure_gap_ms(trace),
            checkpoints,
        }
    }

    /// How `plan` trains: its predicted iteration time, with checkpoints every
    /// [`Costs::checkpoint_every`] steps (or at the Young–Daly interval), each stalling
    /// training for a blocking write or a background snapshot.
    pub fn running(&self, plan: &Plan) -> Running {
        let bytes = node_state_bytes(plan);
        let write_ms = self.costs.storage_ms(bytes);
        let stall_ms = match self.checkpoints {
            Checkpoints::Blocking => write_ms,
            Checkpoints::Background => bytes as f64 / (self.costs.snapshot_gbps * 1e6),
        };
        let step_ms = plan.iteration_ms();
        let every = match (self.costs.checkpoint_every, self.gap_ms) {
            (Some(k), _) => k,
            (None, None) => 0,
            (None, Some(m)) => {
                // Background writes cannot overlap: at least one write apart.
                let interval = (2.0 * stall_ms * m).sqrt().max(write_ms - stall_ms);
                (interval / step_ms).round().max(1.0) as u64
            }
        };
        Running {
            step_ms,
            samples_per_step: self.work.samples_per_step(),
            redundant_share: 0.0,
            checkpoint_every: every,
            checkpoint_ms: stall_ms,
        }
    }

    /// A fresh plan; see [`fresh_plan`].
    pub fn fresh(&self, usable: &[u32]) -> Result<Plan, PlanError> {
        fresh_plan(&self.set, self.work, usable)
    }

    /// A restart from the last checkpoint on every usable node (or idle when they are too
    /// few). `first` is the job's start: nothing to roll back and nothing counted.
    pub fn restart(&self, usable: &[u32], first: bool) -> (Option<Plan>, Reaction) {
        let (loss, counted) = if first {
            (Loss::Nothing, Counted::Nothing)
        } else {
            (Loss::SinceCheckpoint, Counted::Restart)
        };
        let costs = self.costs;
        let detect = if first { 0.0 } else { costs.detect_ms };
        match self.fresh(usable) {
            Ok(plan) => {
                let load = costs.storage_ms(node_state_bytes(&plan));
                let reaction = Reaction::Stop {
                    loss,
                    pause: vec![(TimeKind::Restart, detect + costs.restart_ms + load)],
                    then: Some(self.running(&plan)),
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
}

/// Templates for every node count from `n0` up to the most nodes the trace has at once,
/// whatever `f` is: after losses past `f` the job may run with fewer replicas, and joins may
/// bring it past its starting size.
pub(crate) fn templates(work: &SimWorkload, trace: &Trace) -> Result<TemplateSet, PlanError> {
    let mut job = work.job;
    job.fault_threshold = 0;
    generate_templates(
        &work.profile,
        &work.cluster,
        &job,
        trace.peak_nodes() as u32,
    )
}

/// State bytes of the fullest node of `plan`: what a restart reads and a checkpoint writes
/// per node (nodes read and write in parallel). Per template used, not per pipeline: a
/// 10,000-node plan has thousands of pipelines and a handful of templates.
pub(crate) fn node_state_bytes(plan: &Plan) -> u64 {
    let used: std::collections::BTreeSet<u32> =
        plan.pipelines.iter().map(|p| p.template_nodes).collect();
    let mut most = 0u64;
    for t in plan.templates.iter().filter(|t| used.contains(&t.nodes)) {
        let mut per_node = vec![0u64; t.nodes as usize];
        for s in &t.stages {
            let bytes: u64 = plan.layer_state_bytes[s.layers()].iter().sum();
            per_node[s.node as usize] += bytes;
        }
        most = most.max(per_node.into_iter().max().unwrap_or(0));
    }
    most
}

/// The trace's mean time between failures (its span over its removals), if it has any.
fn failure_gap_ms(trace: &Trace) -> Option<f64> {
    let removals = trace.removals();
    let span = trace.end_ms() - trace.events()[0].at_ms;
    (removals > 0).then(|| span as f64 / removals as f64)
}

/// A fresh plan on as many usable nodes as the templates can cover, keeping `f` when the
/// nodes allow and lowering it when they do not, as a reconfiguration does
/// (`planning::instantiate_degraded`); the plan's target stays `f`, so joins restore it.
fn fresh_plan(set: &TemplateSet, work: &SimWorkload, usable: &[u32]) -> Result<Plan, PlanError> {
    let sync = gradient_sync_ns(&work.profile, &work.cluster);
    let g = work.cluster.devices_per_node;
    instantiate_degraded(set, &work.job, g, sync, usable, 0)
}

/// What `work` trains at on `nodes` nodes with no failure and no fault-tolerance cost: the
/// fastest plan (f = 0) and no checkpoints. The yardstick of "what fraction each policy
/// keeps".
pub fn fault_free_samples_per_s(work: &SimWorkload, nodes: u32) -> Result<f64, SimError> {
    let mut free = work.clone();
    free.job.fault_threshold = 0;
    let set = generate_templates(&free.profile, &free.cluster, &free.job, nodes)?;
    let ids: Vec<u32> = (0..nodes).collect();
    let plan = fresh_plan(&set, &free, &ids)?;
    Ok(free.samples_per_step() / plan.iteration_ms() * 1e3)
}
