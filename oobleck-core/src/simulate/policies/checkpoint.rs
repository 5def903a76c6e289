//! The `checkpoint-restart` policy (Varuna-like): one pipeline set planned for the nodes
//! there are, with no replica to spare (`f = 0`, the fastest plan). A checkpoint after every
//! `checkpoint_every` steps; every loss of a node in use restarts every process from the last
//! checkpoint, re-planned for the nodes left. Joins wait for a step boundary, take a
//! checkpoint and restart on the larger cluster, losing nothing.

use std::collections::BTreeSet;

use super::planner::{node_state_bytes, Checkpoints, Planner};
use super::{Costs, SimWorkload};
use crate::planning::Plan;
use crate::simulate::engine::{run_loop, Loss, Reaction, Reactor};
use crate::simulate::outcome::{Outcome, TimeKind};
use crate::simulate::trace::Trace;
use crate::simulate::{Policy, SimError};

/// See the module docs.
#[derive(Debug, Clone)]
pub struct CheckpointRestart {
    pub work: SimWorkload,
    pub costs: Costs,
    pub end_ms: Option<u64>,
}

impl Policy for CheckpointRestart {
    fn name(&self) -> String {
        "checkpoint-restart".into()
    }

    fn run(&self, trace: &Trace) -> Result<Outcome, SimError> {
        self.costs.validate()?;
        let mut work = self.work.clone();
        work.job.fault_threshold = 0;
        let planner = Planner::new(&work, &self.costs, trace, Checkpoints::Blocking)?;
        let mut reactor = Restarts {
            planner,
            plan: None,
            started: false,
        };
        let opts = self.costs.loop_options(trace, self.end_ms);
        run_loop(trace, &mut reactor, opts, self.name())
    }
}

struct Restarts<'a> {
    planner: Planner<'a>,
    plan: Option<Plan>,
    started: bool,
}

impl Reactor for Restarts<'_> {
    fn react(
        &mut self,
        lost: &[u32],
        joined: &[u32],
        usable: &[u32],
    ) -> Result<Reaction, SimError> {
        let hit = match &self.plan {
            Some(plan) => {
                let used: BTreeSet<u32> = plan.nodes().into_iter().collect();
                lost.iter().any(|n| used.contains(n))
            }
            None => true,
        };
        if !hit && joined.is_empty() {
            return Ok(Reaction::Keep);
        }
        let saved = match (&self.plan, hit) {
            // A join: checkpoint first, so the restart loses nothing.
            (Some(plan), false) => Some(self.planner.costs.storage_ms(node_state_bytes(plan))),
            _ => None,
        };
        let (plan, mut reaction) = self.planner.restart(usable, !self.started);
        self.started |= plan.is_some();
        self.plan = plan;
        if let (Some(ms), Reaction::Stop { loss, pause, .. }) = (saved, &mut reaction) {
            *loss = Loss::CheckpointFirst;
            pause.insert(0, (TimeKind::Checkpointing, ms));
        }
        Ok(reaction)
    }
}
