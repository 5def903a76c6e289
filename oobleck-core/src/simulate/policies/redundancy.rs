//! The `redundancy` policy (Bamboo-like): every node also holds and computes the layers of
//! its successor in the pipeline (the last node those of the first), so each node carries
//! twice the training state and each step costs `redundant_overhead` more. When a node dies
//! its predecessor takes over at once, and that pipeline runs `fallback_slowdown` times
//! slower until the pipelines are rebuilt at the next join. Losing a node and its successor
//! (or a one-node pipeline) leaves layers nobody holds: a restart from the last checkpoint.
//! Where the doubled state does not fit, the policy cannot run at all (out of memory).

use std::collections::{BTreeMap, BTreeSet};

use super::planner::{templates, Checkpoints, Planner};
use super::{Costs, SimWorkload};
use crate::planning::{Plan, TemplateSet};
use crate::simulate::engine::{run_loop, Counted, LoopOptions, Loss, Reaction, Reactor, Running};
use crate::simulate::outcome::{Outcome, TimeKind};
use crate::simulate::trace::Trace;
use crate::simulate::{Policy, SimError};

/// See the module docs.
#[derive(Debug, Clone)]
pub struct Redundancy {
    pub work: SimWorkload,
    pub costs: Costs,
    pub end_ms: Option<u64>,
}

impl Policy for Redundancy {
    fn name(&self) -> String {
        "redundancy".into()
    }

    fn run(&self, trace: &Trace) -> Result<Outcome, SimError> {
        self.costs.validate()?;
        let mut work = self.work.clone();
        work.job.fault_threshold = 0;
        // Each node keeps its successor's parameters, gradients and optimizer state too.
        work.job.state_bytes_per_param_byte *= 2;
        let opts = self.costs.loop_options(trace, self.end_ms);
        let set = match redundant_templates(&work, trace) {
            Ok(set) => set,
            Err(why) => return Ok(out_of_memory(trace, opts, self.name(), &why)),
        };
        let planner = Planner::with_set(set, &work, &self.costs, trace, Checkpoints::Blocking);
        let mut reactor = Covered {
            planner,
            plan: None,
            dead: BTreeMap::new(),
            started: false,
        };
        run_loop(trace, &mut reactor, opts, self.name())
    }
}

/// Templates of at least two nodes (a node needs a successor to cover it) with the doubled
/// state, or why there are none.
fn redundant_templates(work: &SimWorkload, trace: &Trace) -> Result<TemplateSet, String> {
    let mut set = templates(work, trace).map_err(|e| e.to_string())?;
    set.templates.retain(|t| t.nodes >= 2);
    let Some(first) = set.templates.first() else {
        return Err("no pipeline of 2 or more nodes holds its layers twice over".into());
    };
    set.min_nodes = first.nodes;
    Ok(set)
}

/// The run of a policy that cannot train at all: idle throughout, with the reason.
fn out_of_memory(trace: &Trace, opts: LoopOptions, policy: String, why: &str) -> Outcome {
    struct Never;
    impl Reactor for Never {
        fn react(&mut self, _: &[u32], _: &[u32], _: &[u32]) -> Result<Reaction, SimError> {
            Ok(Reaction::Keep)
        }
    }
    let mut out = run_loop(trace, &mut Never, opts, policy).expect("an idle run cannot fail");
    out.notes
        .push(format!("out of memory with redundant layers: {why}"));
    out
}

struct Covered<'a> {
    planner: Planner<'a>,
    plan: Option<Plan>,
    /// Per pipeline (by id): positions of its nodes that died since it was built.
    dead: BTreeMap<u32, BTreeSet<usize>>,
    started: bool,
}

impl Covered<'_> {
    fn rebuild(&mut self, usable: &[u32]) -> Reaction {
        let (plan, reaction) = self.planner.restart(usable, !self.started);
        self.started |= plan.is_some();
        self.plan = plan;
        self.dead.clear();
        self.slowed(reaction)
    }

    /// Adds the redundant share (and the fallback slowdown while a pipeline is degraded).
    fn slowed(&self, mut reaction: Reaction) -> Reaction {
        if let Reaction::Stop {
            then: Some(run), ..
        } = &mut reaction
        {
            *run = self.run_of(run);
        }
        reaction
    }

    fn run_of(&self, base: &Running) -> Running {
        let o = self.planner.costs.redundant_overhead;
        let slow = if self.dead.values().any(|d| !d.is_empty()) {
            self.planner.costs.fallback_slowdown
        } else {
            1.0
        };
        Running {
            step_ms: base.step_ms * (1.0 + o) * slow,
            redundant_share: o / (1.0 + o),
            // A checkpoint writes each layer once, not its redundant copy.
            checkpoint_ms: base.checkpoint_ms / 2.0,
            ..*base
        }
    }

    /// Marks `lost` dead in their pipelines; false when some layers are now held by nobody.
    fn cover(&mut self, lost: &[u32]) -> bool {
        let Some(plan) = &self.plan else {
            return false;
        };
        let lost: BTreeSet<u32> = lost.iter().copied().collect();
        for p in &plan.pipelines {
            let dead = self.dead.entry(p.id).or_default();
            for (i, n) in p.nodes.iter().enumerate() {
                if lost.contains(n) {
                    dead.insert(i);
                }
            }
            let len = p.nodes.len();
            let orphaned = dead
                .iter()
                .any(|&i| len == 1 || dead.contains(&((i + 1) % len)));
            if orphaned {
                return false;
            }
        }
        true
    }
}

impl Reactor for Covered<'_> {
    fn react(
        &mut self,
        lost: &[u32],
        joined: &[u32],
        usable: &[u32],
    ) -> Result<Reaction, SimError> {
        let Some(plan) = &self.plan else {
            return Ok(self.rebuild(usable));
        };
        let used: BTreeSet<u32> = plan.nodes().into_iter().collect();
        let in_plan: Vec<u32> = lost.iter().copied().filter(|n| used.contains(n)).collect();
        if in_plan.is_empty() {
            if joined.is_empty() {
                return Ok(Reaction::Keep);
            }
            // Rebuild the pipelines on every node at the boundary; nothing is lost.
            let mut reaction = self.rebuild(usable);
            if let Reaction::Stop {
                loss,
                pause,
                counted,
                ..
            } = &mut reaction
            {
                *loss = Loss::Nothing;
                *counted = Counted::Reconfiguration;
                *pause = vec![(
                    TimeKind::Reconfiguration,
                    self.planner.costs.replan_ms + self.planner.costs.rebuild_ms,
                )];
            }
            return Ok(reaction);
        }
        if !self.cover(&in_plan) {
            return Ok(self.rebuild(usable));
        }
        let plan = self.plan.as_ref().expect("checked above");
        let base = self.planner.running(plan);
        Ok(Reaction::Stop {
            loss: Loss::InFlight,
            pause: vec![(
                TimeKind::Reconfiguration,
                self.planner.costs.detect_ms + self.planner.costs.rebuild_ms,
            )],
            then: Some(self.run_of(&base)),
            counted: Counted::Reconfiguration,
            note: None,
        })
    }
}
