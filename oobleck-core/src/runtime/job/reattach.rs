//! A master restarted on the run directory of a job whose agents still wait for one
//! (`train --resume RUN --reattach`, design note `master/README.md`): instead of forming a job,
//! it waits for the lost master's agents to come back with their old ids, then takes over
//! the running generation as if its step had failed, and goes on **in place** from the last
//! committed step: no checkpoint is loaded and no committed step is computed again.
//!
//! ```text
//!  Forming: Returned(node, generation, committed, ranks) ... every node of the plan back,
//!           or BACK_WAIT after the first with a majority of them back
//!    ─► re-adopt: the plan the agents run, their holdings (the ranks that still run),
//!       a commit the lost master did not get to every node told again (Recommit),
//!       the nodes that did not come back lost
//!    ─► recovery (recovery.rs): abort the step in flight, settle, decide, next generation
//!       in place from the committed step
//! ```
//!
//! The lost master recorded each commit (`committed.json`) before it told any agent, so an
//! agent is at most one commit behind the run directory, and never ahead of it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::machine::{Generation, JobMachine, Phase};
use super::recovery::Failure;
use super::{Action, Input, LossReason};
use crate::planning::{ranks_of_node, Plan};
use crate::reconfig::Holdings;
use crate::runtime::error::RuntimeError;
use crate::runtime::wire::protocol::Return;
use crate::runtime::wire::records::{Event, WorkerReport};

/// After the first agent came back, how long the others get: an agent that lost its master
/// tries it again within `lookup::MAX_PAUSE` (4 s) all through its `--master-wait`, so twice
/// that finds every agent that is still waiting.
pub const BACK_WAIT: Duration = Duration::from_secs(8);

/// What a restarted master knows from the run directory.
#[derive(Debug, Clone, PartialEq)]
pub struct Reattach {
    /// Every generation's plan, oldest first (`plan.json`).
    pub plans: Vec<Plan>,
    /// The last step the lost master recorded as committed.
    pub committed: u64,
    /// The newest checkpoint in the run directory and its step: where the job goes back to
    /// if the agents that came back do not hold every layer.
    pub newest: Option<(String, u64)>,
    /// This master's epoch (`master.epoch`), one more than the lost master's.
    pub epoch: u64,
    /// Who takes over and what it saw of the lost master, for `master_lost`.
    pub why: String,
}

/// The machine's re-adoption group, while it waits for the agents. Only this file changes it.
#[derive(Debug, Default)]
pub(super) struct Returns {
    /// The agents that came back, by node.
    back: BTreeMap<u32, Return>,
    /// When the first came.
    first: Option<Duration>,
    /// The longest a returned agent had been without a master when this master started.
    lost_before: Duration,
    /// When more than half of the plan's nodes were back.
    quorum: Option<Duration>,
    /// The re-adoption, until the first commit after it ends the take-over.
    readopted: Option<TakeOver>,
}

/// A re-adoption under way, for the `master_took_over` event of its first commit.
#[derive(Debug)]
struct TakeOver {
    epoch: u64,
    detect: Duration,
    quorum: Duration,
    at: Duration,
    back: Vec<u32>,
    lost: Vec<u32>,
}

impl JobMachine {
    /// The machine waits for the lost master's agents instead of forming a job.
    pub(super) fn reattaching(&self) -> bool {
        matches!(self.phase, Phase::Forming) && self.start.reattach.is_some()
    }

    /// Any input while waiting for the agents.
    pub(super) fn while_reattaching(&mut self, now: Duration, input: Input) {
        match input {
            Input::Tick => self.reattach_tick(now),
            Input::Returned { node, addr, back } => self.on_returned(now, node, addr, back),
            // A new agent: it joins at a step boundary once the job runs again.
            Input::Joined { node, addr } => self.on_join_running(now, node, addr),
            Input::Lost { node, reason } => {
                let back = self.returns.back.remove(&node).is_some();
                if back || self.membership.lost_idle(node) {
                    self.record(Event::Lost {
                        node,
                        reason: reason.to_string(),
                    });
                }
            }
            Input::Worker {
                node,
                report: WorkerReport::Exited { rank, .. },
                ..
            } => {
                // It held its state no more.
                if let Some(b) = self.returns.back.get_mut(&node) {
                    b.ranks.retain(|&r| r != rank);
                }
            }
            Input::StopRequested { signal } => self.on_stop_requested(signal),
            Input::KillRequested { node } => self.on_kill_requested(node),
            Input::DrainRequested { node, reason, .. } => self.note(format!(
                "node {node} asked to leave ({reason}) while the restarted master re-adopts \
                 its agents: it leaves after that, when it asks again"
            )),
            // What the workers said before the step in flight is aborted counts for nothing:
            // every one of them says again once it is.
            _ => {}
        }
    }

    /// An agent of the lost master came back with its old id.
    pub(super) fn on_returned(&mut self, now: Duration, node: u32, addr: String, back: Return) {
        if !self.reattaching() {
            // Re-adopting is over (`EndReturns` is on its way): it cannot rejoin as itself.
            return self.release(
                node,
                "it came back after the restarted master re-adopted the others; start it \
                 again to join as a new node"
                    .into(),
            );
        }
        self.record(Event::Returned {
            node,
            addr: addr.clone(),
            generation: back.generation,
            step: back.committed,
            ranks: back.ranks.clone(),
            without_master_s: back.without_master_ms as f64 / 1e3,
        });
        self.note(format!(
            "node {node} came back from {addr} after {:.1} s without a master: generation {}, \
             committed step {}, {} worker(s) holding their state",
            back.without_master_ms as f64 / 1e3,
            back.generation,
            back.committed,
            back.ranks.len()
        ));
        self.returns.first.get_or_insert(now);
        let lost_before = Duration::from_millis(back.without_master_ms).saturating_sub(now);
        self.returns.lost_before = self.returns.lost_before.max(lost_before);
        self.returns.back.insert(node, back);
        if self.returns.quorum.is_none() && self.majority_back() {
            self.returns.quorum = Some(now);
        }
        if self.everyone_back() {
            self.readopt(now);
        }
    }

    /// While waiting: re-adopt once the wait after the first return is over; fail when no
    /// agent came back within the join limit.
    pub(super) fn reattach_tick(&mut self, now: Duration) {
        let waited = self.returns.first.is_some_and(|t| now >= t + BACK_WAIT);
        if waited && self.majority_back() {
            return self.readopt(now);
        }
        if now < self.join_deadline() {
            return;
        }
        let (back, of) = (self.returns.back.len(), self.plan_nodes());
        let what = match back {
            0 => "no agent of the lost master came back".to_string(),
            _ => format!(
                "only {back} of the {of} nodes came back, no majority: the others may still \
                 hear a master, and one job has one master"
            ),
        };
        self.fail(RuntimeError::Invalid(format!(
            "--reattach: {what} within {} s (agents stop looking after their --master-wait, 60 \
             s by default); `train --resume RUN` without --reattach goes on from the newest \
             checkpoint",
            self.limits.join.as_secs()
        )));
    }

    /// The nodes of the plan the returned agents run.
    fn plan_nodes(&self) -> usize {
        self.plan_back().map_or(0, |p| p.nodes().len())
    }

    /// More than half of the plan's nodes came back. An agent comes back only once it lost
    /// the master itself, so a majority of them means the master is lost to the job, not only
    /// to this process: no two masters re-adopt the same job.
    fn majority_back(&self) -> bool {
        2 * self.returns.back.len() > self.plan_nodes()
    }

    /// The plan the returned agents run: the newest generation any of them runs that the
    /// run directory has a plan of (the lost master may have written a plan it never sent).
    fn plan_back(&self) -> Option<&Plan> {
        let plans = &self.start.reattach.as_ref()?.plans;
        let newest = self
            .returns
            .back
            .values()
            .map(|b| b.generation)
            .filter(|g| plans.iter().any(|p| p.generation == *g))
            .max();
        match newest {
            Some(g) => plans.iter().find(|p| p.generation == g),
            None => plans.last(),
        }
    }

    /// Every node of the plan they run came back.
    fn everyone_back(&self) -> bool {
        self.plan_back()
            .is_some_and(|p| p.nodes().iter().all(|n| self.returns.back.contains_key(n)))
    }

    /// Takes over the returned agents' generation and recovers from it in place.
    fn readopt(&mut self, now: Duration) {
        let Some(plan) = self.plan_back().cloned() else {
            return self.fail(RuntimeError::Invalid(
                "--reattach: the run directory has no plan (plan.json) of the job's generations"
                    .into(),
            ));
        };
        let r = self
            .start
            .reattach
            .take()
            .expect("checked by reattaching()");
        let committed = r.committed;
        self.steps.knows_checkpoint(r.newest);
        self.push(Action::EndReturns);
        self.generation = plan.generation;
        let back = std::mem::take(&mut self.returns.back);
        let (holdings, held) = self.holdings_back(&plan, &back, committed);
        self.replicas.seed(holdings);
        for (&node, b) in &back {
            self.membership.registered(node);
            // At most one commit behind: the lost master recorded it before telling anyone.
            if b.generation == plan.generation && b.committed + 1 == committed {
                self.push(Action::Recommit {
                    node,
                    step: committed,
                    generation: plan.generation,
                });
            }
        }
        let mut gen = Generation::of(plan.clone(), &self.membership, self.steps_run());
        gen.formed = true;
        gen.built = held.iter().copied().collect();
        gen.exited = (0..gen.world as u32)
            .filter(|r| !held.contains(r))
            .collect();
        self.gen = Some(gen);
        for node in plan.nodes() {
            if !back.contains_key(&node) && self.membership.lost_for_good(node) {
                self.record(Event::Lost {
                    node,
                    reason: LossReason::Protocol(
                        "it did not come back to the restarted master".into(),
                    )
                    .to_string(),
                });
            }
        }
        self.note(format!(
            "re-adopting {} of {} nodes of generation {} at committed step {committed}",
            back.len(),
            plan.nodes().len(),
            plan.generation
        ));
        self.returns.readopted = Some(TakeOver {
            epoch: r.epoch,
            detect: self.returns.lost_before,
            quorum: self.returns.quorum.unwrap_or(now),
            at: now,
            back: back.keys().copied().collect(),
            lost: plan
                .nodes()
                .into_iter()
                .filter(|n| !back.contains_key(n))
                .collect(),
        });
        self.phase = Phase::Stepping;
        self.begin_recovery(now, Failure::master_restarted(now, committed));
    }

    /// `step` committed: the first commit after a re-adoption ends the take-over, recorded
    /// with its phases (nothing otherwise).
    pub(super) fn took_over_committed(&mut self, now: Duration, step: u64) {
        let Some(t) = self.returns.readopted.take() else {
            return;
        };
        let s = |d: Duration| d.as_secs_f64();
        let phases = BTreeMap::from([
            ("detect_s".to_string(), s(t.detect)),
            ("quorum_s".to_string(), s(t.quorum)),
            ("readopt_s".to_string(), s(t.at.saturating_sub(t.quorum))),
            ("first_commit_s".to_string(), s(now.saturating_sub(t.at))),
        ]);
        let total_s = s(t.detect + now);
        self.note(format!(
            "took over as the master (epoch {}): step {step} committed {total_s:.2} s after the \
             agents lost the old master (detect {:.2} s, quorum {:.2} s, re-adopt {:.2} s, \
             first commit {:.2} s)",
            t.epoch,
            phases["detect_s"],
            phases["quorum_s"],
            phases["readopt_s"],
            phases["first_commit_s"]
        ));
        self.record(Event::MasterTookOver {
            epoch: t.epoch,
            step,
            nodes_back: t.back,
            nodes_lost: t.lost,
            total_s,
            phases,
        });
    }

    /// What the returned devices hold of committed step `committed` under `plan`, and the
    /// ranks that hold it: a worker that still runs the plan's generation, of an agent at
    /// most one commit behind.
    fn holdings_back(
        &self,
        plan: &Plan,
        back: &BTreeMap<u32, Return>,
        committed: u64,
    ) -> (Holdings, BTreeSet<u32>) {
        let mut holdings = Holdings::of(plan);
        let mut held = BTreeSet::new();
        for node in plan.nodes() {
            let usable = back.get(&node).filter(|b| {
                b.generation == plan.generation
                    && b.committed <= committed
                    && b.committed + 1 >= committed
            });
            let Some(b) = usable else {
                holdings.drop_node(node);
                continue;
            };
            for rank in ranks_of_node(plan, node) {
                if b.ranks.contains(&rank) {
                    held.insert(rank);
                } else {
                    holdings.set(node, rank % plan.devices_per_node, BTreeSet::new());
                }
            }
        }
        (holdings, held)
    }
}
