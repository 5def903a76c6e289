//! The `oobleck` policy: this project's recovery. A loss within `f` re-instantiates the
//! pipelines in place from the same templates (`reconfig::decide`), copying the layers the
//! new plan lacks from surviving replicas; only the step in flight is lost. A loss past `f`
//! (some layer has no replica left) restarts from the last checkpoint. Joins are admitted at a
//! step boundary, losing nothing.

use std::collections::{BTreeSet, HashMap};

use super::planner::{Checkpoints, Planner};
use super::{Costs, SimWorkload};
use crate::planning::{Plan, PlanError};
use crate::reconfig::{decide_joins, decide_with, Holdings, ReconfigPlan};
use crate::simulate::engine::{run_loop, Counted, Loss, Reaction, Reactor};
use crate::simulate::outcome::{Outcome, TimeKind};
use crate::simulate::trace::Trace;
use crate::simulate::{Policy, SimError};

/// See the module docs.
#[derive(Debug, Clone)]
pub struct OobleckPolicy {
    pub work: SimWorkload,
    pub costs: Costs,
    /// Where the simulation stops; `None` = the trace's last event.
    pub end_ms: Option<u64>,
}

impl Policy for OobleckPolicy {
    fn name(&self) -> String {
        "oobleck".into()
    }

    fn run(&self, trace: &Trace) -> Result<Outcome, SimError> {
        self.costs.validate()?;
        let mut planner = Planner::new(&self.work, &self.costs, trace, Checkpoints::Background)?;
        // Only losses past f need the checkpoint: the Young–Daly interval assumes one in the
        // whole trace (a trace with many shows them as restarts and lost time; then pass
        // --checkpoint-every).
        let span = trace.end_ms() - trace.events()[0].at_ms;
        planner.gap_ms = Some(span.max(1) as f64);
        let mut reactor = InPlace {
            planner,
            plan: None,
            standby: BTreeSet::new(),
            started: false,
        };
        let opts = self.costs.loop_options(trace, self.end_ms);
        run_loop(trace, &mut reactor, opts, self.name())
    }
}

struct InPlace<'a> {
    planner: Planner<'a>,
    plan: Option<Plan>,
    /// Usable nodes the plan does not use (a node count no template mix covers).
    standby: BTreeSet<u32>,
    started: bool,
}

impl InPlace<'_> {
    fn restart(&mut self, usable: &[u32]) -> Reaction {
        let first = !self.started;
        let (plan, reaction) = self.planner.restart(usable, first);
        self.started |= plan.is_some();
        self.standby.clear();
        if let Some(p) = &plan {
            let used: BTreeSet<u32> = p.nodes().into_iter().collect();
            self.standby = usable
                .iter()
                .copied()
                .filter(|n| !used.contains(n))
                .collect();
        }
        self.plan = plan;
        reaction
    }

    /// The pause of an in-place reconfiguration: detection (after a loss), the new plan, new
    /// communicators, and the layer copies (nodes receive in parallel, so the node that
    /// receives the most, `copy` bytes, sets it).
    fn pause(&self, r: &ReconfigPlan, copy: u64) -> Vec<(TimeKind, f64)> {
        let detect = if r.lost.is_empty() {
            0.0
        } else {
            self.planner.costs.detect_ms
        };
        let ms = detect
            + self.planner.costs.replan_ms
            + self.planner.costs.rebuild_ms
            + self.planner.costs.copy_ms(copy, &self.planner.work.cluster);
        vec![(TimeKind::Reconfiguration, ms)]
    }
}

impl Reactor for InPlace<'_> {
    fn react(
        &mut self,
        lost: &[u32],
        joined: &[u32],
        usable: &[u32],
    ) -> Result<Reaction, SimError> {
        for n in lost {
            self.standby.remove(n);
        }
        let Some(plan) = &self.plan else {
            return Ok(self.restart(usable));
        };
        // Losses are few per event: a scan of the plan per lost node, not a set of all nodes.
        let in_plan: Vec<u32> = (lost.iter().copied())
            .filter(|n| plan.pipelines.iter().any(|p| p.nodes.contains(n)))
            .collect();
        if in_plan.is_empty() && joined.is_empty() {
            return Ok(Reaction::Keep);
        }
        let mut joining: Vec<u32> = std::mem::take(&mut self.standby).into_iter().collect();
        joining.extend_from_slice(joined);
        match decision(plan, &in_plan, &joining) {
            Ok((r, copy)) if r.missing_layers.is_empty() => {
                let pause = self.pause(&r, copy);
                let then = Some(self.planner.running(&r.plan));
                self.standby = r.spare_nodes.iter().copied().collect();
                self.plan = Some(r.plan);
                Ok(Reaction::Stop {
                    loss: if in_plan.is_empty() {
                        Loss::Nothing
                    } else {
                        Loss::InFlight
                    },
                    pause,
                    then,
                    counted: Counted::Reconfiguration,
                    note: None,
                })
            }
            // Every replica of some layer is gone, or the nodes left fit no f + 1 pipelines:
            // back to the last checkpoint, on every node there is.
            _ => {
                let mut reaction = self.restart(usable);
                if let Reaction::Stop { note, .. } = &mut reaction {
                    note.get_or_insert_with(|| {
                        "a loss past the fault threshold restarted from the last checkpoint".into()
                    });
                }
                Ok(reaction)
            }
        }
    }
}

/// The reconfiguration, and the bytes the node receiving the most copies receives. Joins
/// alone skip choosing a source for each copy: only their sizes matter here, and a join that
/// re-balances a 10,000-node plan may move 10^5 layers.
fn decision(plan: &Plan, lost: &[u32], joining: &[u32]) -> Result<(ReconfigPlan, u64), PlanError> {
    let old = Holdings::of(plan);
    if lost.is_empty() {
        return decide_joins(plan, &old, joining);
    }
    let r = decide_with(plan, &old, lost, joining)?;
    let mut into: HashMap<u32, u64> = HashMap::new();
    for c in &r.copies {
        *into.entry(c.to_node).or_default() += c.bytes;
    }
    let most = into.values().copied().max().unwrap_or(0);
    Ok((r, most))
}
