//! Elastic membership: nodes that register while the job runs (joins) and nodes that say they
//! will go away (drains). Both take effect at a step boundary, through the same
//! reconfiguration as a recovery (`recovery.rs`): the generation that just committed a step is
//! ended, every rank holds that step, and the next generation re-instantiates the existing
//! templates over the new node set, copying layers from their holders. No step is replayed.
//!
//! When to take a join is a policy ([`join_verdict`], pure): a reconfiguration costs about a
//! second plus a step (`oobleck bench recovery`), so a join is taken at once when it adds a
//! pipeline (which also restores fault tolerance a failure lowered), and otherwise waits up to
//! `--join-after` for more joins that would. Whether a drain can be taken is
//! [`drain_verdict`].

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::machine::{JobMachine, Phase};
use super::recovery::Failure;
use super::Action;
use crate::planning::PlanError;
use crate::reconfig::{Donor, Holdings};
use crate::runtime::wire::records::Event;

/// What [`join_verdict`] looks at.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JoinCase {
    /// Pipelines of the running plan.
    pub pipelines_now: usize,
    /// Pipelines of the plan with every waiting node admitted.
    pub pipelines_with: usize,
    /// The job's fault threshold `f`: `f + 1` pipelines is full fault tolerance.
    pub fault_threshold: u32,
    /// Since the first waiting node registered.
    pub waited: Duration,
    /// `--join-after`.
    pub join_after: Duration,
}

/// When to admit the nodes waiting to join.
#[derive(Debug, Clone, PartialEq)]
pub enum JoinVerdict {
    /// At the next step boundary, for this reason.
    Now(String),
    /// Not yet: at most `left` more, unless more joins add a pipeline first.
    Wait { left: Duration },
}

/// Takes a join at once when it adds a pipeline (saying so when that restores fault tolerance
/// a failure lowered), else once the first waiting node has waited `join_after`.
pub fn join_verdict(c: &JoinCase) -> JoinVerdict {
    let (now, with) = (c.pipelines_now, c.pipelines_with);
    let full = c.fault_threshold as usize + 1;
    if with > now && now < full {
        return JoinVerdict::Now(format!(
            "restores fault tolerance: {now} -> {with} pipelines (f = {} wants {full})",
            c.fault_threshold
        ));
    }
    if with > now {
        return JoinVerdict::Now(format!("adds a pipeline: {now} -> {with}"));
    }
    if c.waited >= c.join_after {
        return JoinVerdict::Now(format!(
            "waited {:.0} s (--join-after) for more joins; grows the pipelines",
            c.waited.as_secs_f64()
        ));
    }
    JoinVerdict::Wait {
        left: c.join_after - c.waited,
    }
}

/// What [`drain_verdict`] looks at.
#[derive(Debug, Clone, PartialEq)]
pub struct DrainCase {
    /// Live nodes of the running plan.
    pub nodes: usize,
    /// Nodes leaving at the next boundary, the one asked about included.
    pub leaving: usize,
    /// Nodes the smallest template needs.
    pub min_nodes: usize,
    /// Layers that only the leaving nodes hold.
    pub unique_layers: Vec<usize>,
    /// They can be copied off the leaving nodes (the TCP data plane takes donors).
    pub copy_off: bool,
    /// Take it even if it costs steps (the node goes away whatever we decide).
    pub force: bool,
}

/// `Ok(None)`: the drain loses nothing. `Ok(Some(warning))`: taken, at the cost the warning
/// names. `Err(refusal)`: not taken, with the numbers and what to do.
pub fn drain_verdict(c: &DrainCase) -> Result<Option<String>, String> {
    let left = c.nodes.saturating_sub(c.leaving);
    if left < c.min_nodes {
        let what = format!(
            "draining leaves {left} of {} nodes; the smallest pipeline needs {}",
            c.nodes, c.min_nodes
        );
        return if c.force {
            Ok(Some(format!(
                "{what}: the job goes on from its newest checkpoint if it can, else stops"
            )))
        } else {
            Err(format!(
                "{what}. Add a node first (`oobleck add-node`), or pass --force to drain \
                 anyway (the job then falls back to its newest checkpoint, or stops)"
            ))
        };
    }
    if c.unique_layers.is_empty() {
        return Ok(None);
    }
    let what = format!(
        "layers {:?} are held only by the leaving nodes",
        c.unique_layers
    );
    if c.copy_off {
        return Ok(Some(format!(
            "{what}: they are copied off before it leaves, no step is lost"
        )));
    }
    if c.force {
        Ok(Some(format!(
            "{what}: the job goes back to its newest checkpoint for them"
        )))
    } else {
        Err(format!(
            "{what}, and the NCCL data plane cannot copy them off; raise the fault threshold so \
             that every layer has a replica, or pass --force (the job then goes back to its \
             newest checkpoint)"
        ))
    }
}

/// What a decision that lets `drained` go may copy layers from: what every device holds, a
/// drained node's only where its layers can be copied off it (`copy_off`: its devices then
/// join the data plane as extra ranks, donors, which only the TCP data plane has).
pub(super) fn copy_sources(holdings: &Holdings, drained: &[u32], copy_off: bool) -> Holdings {
    let mut sources = holdings.clone();
    if !copy_off {
        for &n in drained {
            sources.drop_node(n);
        }
    }
    sources
}

/// The membership change a decision makes besides the losses.
#[derive(Debug, Clone, Default)]
pub(super) struct Change {
    pub drained: Vec<u32>,
    pub joined: Vec<u32>,
}

/// The machine's membership group: which nodes the job has and how each stands. Only this
/// file changes it; the others go through its methods.
#[derive(Debug, Default)]
pub(super) struct Membership {
    /// Nodes the next plan is for (sorted); registered nodes while forming.
    nodes: BTreeSet<u32>,
    /// Nodes lost during the job, for good.
    lost: BTreeSet<u32>,
    /// Agent processes of the master that died.
    dead_agents: usize,
    /// Nodes that registered while the job ran and wait to be admitted: since when.
    joining: BTreeMap<u32, Duration>,
    /// The pipelines the plan would have with these joiners admitted, and the joiners
    /// asked about last ([`Action::WeighJoins`]).
    join_candidate: Option<(Vec<u32>, usize)>,
    join_asked: Option<Vec<u32>>,
    /// Why the waiting nodes are admitted at the next boundary, once the policy says so.
    admit: Option<String>,
    /// The wait for more joins was said.
    join_waiting_told: bool,
    /// Nodes of the plan that leave at the next step boundary, and why.
    draining: BTreeMap<u32, String>,
    /// When each drain was asked for.
    drain_asked: BTreeMap<u32, Duration>,
    /// Nodes told to go: their exits and closed connections are expected.
    departed: BTreeSet<u32>,
    /// Joins, drains or spare nodes were shown to `oobleck status`.
    shown: bool,
}

impl Membership {
    /// Nodes the next plan is for (sorted); registered nodes while forming.
    pub(super) fn nodes(&self) -> &BTreeSet<u32> {
        &self.nodes
    }

    /// `node` was lost during the job.
    pub(super) fn is_lost(&self, node: u32) -> bool {
        self.lost.contains(&node)
    }

    /// Nodes lost during the job.
    pub(super) fn lost_count(&self) -> usize {
        self.lost.len()
    }

    /// Agent processes of the master that died.
    pub(super) fn dead_agents(&self) -> usize {
        self.dead_agents
    }

    /// `node` was told to go: what it still says or does is expected.
    pub(super) fn has_departed(&self, node: u32) -> bool {
        self.departed.contains(&node)
    }

    /// `node` leaves at the next step boundary.
    pub(super) fn is_draining(&self, node: u32) -> bool {
        self.draining.contains_key(&node)
    }

    /// Joins, drains or spare nodes were shown to `oobleck status`.
    pub(super) fn shown(&self) -> bool {
        self.shown
    }

    /// `node` registered while the job forms.
    pub(super) fn registered(&mut self, node: u32) {
        self.nodes.insert(node);
    }

    /// `node`, waiting to join or idle, is lost: it is no node of the job any more. True the
    /// first time it is lost.
    pub(super) fn lost_idle(&mut self, node: u32) -> bool {
        self.joining.remove(&node);
        self.nodes.remove(&node);
        self.lost.insert(node)
    }

    /// `node`, of the running plan, is lost for good. True the first time.
    pub(super) fn lost_for_good(&mut self, node: u32) -> bool {
        self.lost.insert(node)
    }

    /// `node` is lost while a recovery is under way: it waits to join no more, and the
    /// decision leaves it out. True the first time it is lost.
    pub(super) fn lost_while_recovering(&mut self, node: u32) -> bool {
        self.joining.remove(&node);
        self.lost.insert(node)
    }

    /// An agent process the master started died.
    pub(super) fn agent_died(&mut self) {
        self.dead_agents += 1;
    }
}

impl JobMachine {
    /// A node registered while the job runs: it waits to be admitted at a step boundary.
    pub(super) fn on_join_running(&mut self, now: Duration, node: u32, addr: String) {
        self.record(Event::Join {
            node,
            addr: addr.clone(),
        });
        if matches!(self.phase, Phase::Finishing) {
            self.note(format!(
                "node {node} joined from {addr} as the job finishes; it is not needed"
            ));
            return self.release(node, "the job is finishing".into());
        }
        self.membership.joining.insert(node, now);
        self.membership.nodes.insert(node);
        self.note(format!(
            "node {node} joined from {addr}; it is admitted at a step boundary"
        ));
        self.consider_joins(now);
        self.publish_membership();
    }

    /// Whether the nodes waiting to join are taken at the next boundary
    /// ([`join_verdict`]). The plan they would make is asked for once per set of joiners
    /// ([`Action::WeighJoins`]).
    pub(super) fn consider_joins(&mut self, now: Duration) {
        let Some(first) = self.membership.joining.values().min().copied() else {
            return;
        };
        let Some(g) = self.gen.as_ref() else { return };
        if self.membership.admit.is_some() || !matches!(self.phase, Phase::Stepping) {
            return;
        }
        let pipelines_now = g.plan.pipelines.len();
        let joined: Vec<u32> = self.membership.joining.keys().copied().collect();
        let with = match &self.membership.join_candidate {
            Some((j, w)) if *j == joined => *w,
            _ => {
                if self.membership.join_asked.as_ref() != Some(&joined) {
                    let mut plan = g.plan.clone();
                    plan.fault_threshold = self.spec.fault_threshold;
                    self.push(Action::WeighJoins {
                        plan: Box::new(plan),
                        holdings: self.replicas.holdings().clone(),
                        joined: joined.clone(),
                    });
                    self.membership.join_asked = Some(joined);
                }
                return;
            }
        };
        let verdict = join_verdict(&JoinCase {
            pipelines_now,
            pipelines_with: with,
            fault_threshold: self.spec.fault_threshold,
            waited: now.saturating_sub(first),
            join_after: self.limits.join_after,
        });
        match verdict {
            JoinVerdict::Now(why) => {
                let nodes: Vec<u32> = self.membership.joining.keys().copied().collect();
                self.note(format!(
                    "admitting node(s) {nodes:?} at the next step boundary: {why}"
                ));
                self.membership.admit = Some(why);
            }
            JoinVerdict::Wait { left } if !self.membership.join_waiting_told => {
                self.membership.join_waiting_told = true;
                self.note(format!(
                    "the join adds no pipeline yet ({pipelines_now} pipelines either way): \
                     waiting up to {:.0} s more for other joins",
                    left.as_secs_f64()
                ));
            }
            JoinVerdict::Wait { .. } => {}
        }
    }

    /// The answer to [`Action::WeighJoins`]: the plan with `joined` admitted would have
    /// `pipelines` (an error: they cannot be admitted yet).
    pub(super) fn on_joins_weighed(
        &mut self,
        now: Duration,
        joined: Vec<u32>,
        pipelines: Result<usize, PlanError>,
    ) {
        let now_p = self.gen.as_ref().map_or(0, |g| g.plan.pipelines.len());
        let with = pipelines.unwrap_or_else(|e| {
            tracing::debug!(error = %e, "no plan with the joiners yet");
            now_p
        });
        self.membership.join_candidate = Some((joined, with));
        self.consider_joins(now);
    }

    /// `node` will go away: it leaves at the next step boundary, if [`drain_verdict`] takes it.
    pub(super) fn on_drain_requested(
        &mut self,
        now: Duration,
        node: u32,
        reason: String,
        force: bool,
    ) {
        let in_plan = self.gen.as_ref().is_some_and(|g| g.nodes.contains(&node));
        if self.membership.draining.contains_key(&node) || self.membership.departed.contains(&node)
        {
            return;
        }
        if !self.membership.nodes.contains(&node) || self.membership.lost.contains(&node) {
            return self.refuse_drain(node, reason, "it is not a live node of the job".into());
        }
        if !in_plan {
            // Waiting to join, or idle: nothing of the job's state is there.
            self.record(Event::Drain {
                node,
                reason: reason.clone(),
            });
            self.membership.joining.remove(&node);
            return self.release(node, format!("drained ({reason})"));
        }
        if matches!(self.phase, Phase::Finishing) {
            self.note(format!(
                "node {node} asks to leave ({reason}); the job is finishing and it leaves then"
            ));
            return;
        }
        let case = self.drain_case(node, force);
        match drain_verdict(&case) {
            Err(refusal) => self.refuse_drain(node, reason, refusal),
            Ok(warning) => {
                self.record(Event::Drain {
                    node,
                    reason: reason.clone(),
                });
                let cost = warning.unwrap_or_else(|| "no step is lost".into());
                self.note(format!(
                    "node {node} drains at the next step boundary ({reason}): {cost}"
                ));
                self.membership.draining.insert(node, reason);
                self.membership.drain_asked.insert(node, now);
                self.publish_membership();
            }
        }
    }

    fn refuse_drain(&mut self, node: u32, reason: String, refusal: String) {
        self.note(format!(
            "the drain of node {node} ({reason}) is refused: {refusal}"
        ));
        self.record(Event::DrainRefused {
            node,
            reason,
            refusal,
        });
    }

    /// A drained node's layers can be copied off it before it goes: its devices join the data
    /// plane as extra ranks (donors), which only TCP has.
    pub(super) fn drains_copy_off(&self) -> bool {
        self.spec.data_plane == crate::runtime::spec::DataPlane::Tcp
    }

    /// The drain of `node` next to the ones already asked for.
    pub(super) fn drain_case(&self, node: u32, force: bool) -> DrainCase {
        let g = self.gen.as_ref().expect("checked by the caller");
        let leaving: BTreeSet<u32> = self
            .membership
            .draining
            .keys()
            .copied()
            .chain([node])
            .filter(|n| g.nodes.contains(n))
            .collect();
        let live = g
            .nodes
            .iter()
            .filter(|n| !self.membership.lost.contains(n))
            .count();
        let layers = g
            .plan
            .templates
            .iter()
            .filter_map(|t| t.stages.last())
            .map(|s| s.layer_end)
            .max()
            .unwrap_or(0);
        let before: BTreeSet<usize> = self
            .replicas
            .holdings()
            .missing(layers)
            .into_iter()
            .collect();
        let mut after = self.replicas.holdings().clone();
        for &n in &leaving {
            after.drop_node(n);
        }
        let unique_layers = after
            .missing(layers)
            .into_iter()
            .filter(|l| !before.contains(l))
            .collect();
        DrainCase {
            nodes: live,
            leaving: leaving.len(),
            min_nodes: g.plan.templates.iter().map(|t| t.nodes).min().unwrap_or(1) as usize,
            unique_layers,
            copy_off: self.drains_copy_off(),
            force,
        }
    }

    /// Just after step `step` committed: take the drains asked for and the joins admitted.
    pub(super) fn at_boundary(&mut self, now: Duration, step: u64) {
        if step >= self.spec.steps || !matches!(self.phase, Phase::Stepping) {
            return;
        }
        let in_plan = |n: &u32| self.gen.as_ref().is_some_and(|g| g.nodes.contains(n));
        let drains: Vec<String> = self
            .membership
            .draining
            .iter()
            .filter(|(n, _)| in_plan(n))
            .map(|(n, why)| format!("node {n} drains ({why})"))
            .collect();
        let mut asked = self
            .membership
            .drain_asked
            .iter()
            .filter(|(n, _)| in_plan(n))
            .map(|(_, t)| *t)
            .min()
            .unwrap_or(now);
        let mut causes = drains;
        if let Some(why) = self
            .membership
            .admit
            .as_ref()
            .filter(|_| !self.membership.joining.is_empty())
        {
            asked = asked.min(
                self.membership
                    .joining
                    .values()
                    .min()
                    .copied()
                    .unwrap_or(now),
            );
            let nodes: Vec<u32> = self.membership.joining.keys().copied().collect();
            causes.push(format!("node(s) {nodes:?} join ({why})"));
        }
        if causes.is_empty() {
            return;
        }
        let reason = causes.join("; ");
        self.note(format!(
            "step {step} committed; reconfiguring at this boundary: {reason}"
        ));
        let failure = Failure::planned(reason, now, step, asked);
        self.open_recovery(now, failure);
    }

    /// Tells `node` to go; from now on its exit is expected.
    pub(super) fn release(&mut self, node: u32, reason: String) {
        self.membership.departed.insert(node);
        self.membership.nodes.remove(&node);
        self.replicas.drop_node(node);
        self.record(Event::Released {
            node,
            reason: reason.clone(),
        });
        self.push(Action::Release { node, reason });
        self.publish_membership();
    }

    /// The nodes waiting, leaving and idle, for `oobleck status`.
    pub(super) fn publish_membership(&mut self) {
        self.membership.shown = true;
        let in_plan: BTreeSet<u32> = self
            .gen
            .as_ref()
            .map(|g| g.nodes.iter().copied().collect())
            .unwrap_or_default();
        let spare = self
            .membership
            .nodes
            .iter()
            .copied()
            .filter(|n| !in_plan.contains(n) && !self.membership.joining.contains_key(n))
            .filter(|n| !self.membership.lost.contains(n))
            .collect();
        self.push(Action::Membership {
            joining: self.membership.joining.keys().copied().collect(),
            draining: self
                .membership
                .draining
                .iter()
                .map(|(n, r)| (*n, r.clone()))
                .collect(),
            spare,
        });
    }

    /// The drains and joins a decision now takes: every node draining from `plan`, and, when
    /// any node waits to join, those and the idle ones (a join re-instantiates anyway).
    pub(super) fn change_of(&self, plan: &crate::planning::Plan, lost: &[u32]) -> Change {
        let in_plan: BTreeSet<u32> = plan.nodes().into_iter().collect();
        let drained = self
            .membership
            .draining
            .keys()
            .copied()
            .filter(|n| in_plan.contains(n) && !lost.contains(n))
            .collect();
        let joined = if self.membership.joining.is_empty() {
            Vec::new()
        } else {
            self.membership
                .nodes
                .iter()
                .copied()
                .filter(|n| !in_plan.contains(n) && !self.membership.lost.contains(n))
                .collect()
        };
        Change { drained, joined }
    }

    /// The nodes of the next generation, the job's nodes from now on: its live nodes, less
    /// those lost and those drained; the drained ones are told to go.
    pub(super) fn settle_membership(&mut self, change: &Change, donors: &[Donor]) -> Vec<u32> {
        for &n in &change.drained {
            self.membership.draining.remove(&n);
            self.membership.drain_asked.remove(&n);
            if donors.iter().any(|d| d.node == n) {
                // Still needed: it sends what only it holds, then goes (`on_donated`).
                self.membership.nodes.remove(&n);
            } else {
                self.release(n, "drained".into());
            }
        }
        for n in &change.joined {
            self.membership.joining.remove(n);
        }
        if !change.joined.is_empty() {
            self.membership.admit = None;
            self.membership.join_candidate = None;
            self.membership.join_asked = None;
            self.membership.join_waiting_told = false;
        }
        let left: Vec<u32> = self
            .membership
            .nodes
            .iter()
            .copied()
            .filter(|n| !self.membership.lost.contains(n))
            .collect();
        self.membership.nodes = left.iter().copied().collect();
        left
    }
}
