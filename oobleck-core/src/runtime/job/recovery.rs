//! Recovery (DESIGN.md section 5): after a failure the machine settles (collects every loss
//! the failure caused), then goes on from the survivors' committed state when one whole
//! pipeline of them still holds it (no step lost), else from the newest checkpoint.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::machine::{JobMachine, Phase};
use super::{Action, Input};
use crate::runtime::error::RuntimeError;
use crate::runtime::pipe::stage_leads;
use crate::runtime::records::{Event, WorkerReport};

/// The failure being recovered from.
#[derive(Debug, Clone)]
pub(super) struct Failure {
    pub reason: String,
    pub detected: Duration,
    /// The committed step when it happened.
    pub failed_at: u64,
}

impl Failure {
    pub fn new(reason: String, detected: Duration, failed_at: u64) -> Failure {
        Failure {
            reason,
            detected,
            failed_at,
        }
    }
}

/// Times a recovery's phases, from the failure to the first commit after it.
#[derive(Debug)]
pub(super) struct Timer {
    pub failed: Duration,
    pub mark: Duration,
    /// `"<phase>_s"` -> seconds.
    pub phases: BTreeMap<String, f64>,
}

/// Where a recovery stands.
#[derive(Debug)]
pub(super) enum Recovery {
    /// Collecting the losses a failure caused.
    Settling { failure: Failure },
    /// Waiting for the survivors (`savers`) to write their state of the committed step.
    Rescuing {
        rescue: Rescue,
        states: BTreeMap<u32, String>,
        deadline: Duration,
    },
    /// Waiting for the survivors' states to become a checkpoint.
    Writing { rescue: Rescue },
}

#[derive(Debug)]
pub(super) struct Rescue {
    failure: Failure,
    detect_s: f64,
    savers: Vec<u32>,
    /// The nodes the savers run on.
    nodes: BTreeSet<u32>,
    started: Duration,
}

impl JobMachine {
    /// Ends the running generation after `failure`.
    pub(super) fn begin_recovery(&mut self, now: Duration, failure: Failure) {
        self.record(Event::Failure {
            generation: self.generation,
            step: failure.failed_at,
            reason: failure.reason.clone(),
        });
        self.note(format!(
            "failure in step {}: {}; recovering",
            failure.failed_at + 1,
            failure.reason
        ));
        self.timer = Some(Timer {
            failed: now,
            mark: now,
            phases: BTreeMap::new(),
        });
        self.phase = Phase::Recovering(Recovery::Settling { failure });
    }

    /// Ends the current phase of a recovery under way (nothing otherwise).
    pub(super) fn phase_done(&mut self, now: Duration, name: &str) {
        if let Some(t) = self.timer.as_mut() {
            let s = now.saturating_sub(t.mark).as_secs_f64();
            t.phases.insert(format!("{name}_s"), s);
            t.mark = now;
        }
    }

    /// Any input while recovering: book-keeping, then whatever the recovery waits for.
    pub(super) fn recovering(&mut self, now: Duration, input: Input) {
        match input {
            Input::Tick | Input::Planned(_) => {}
            Input::Joined { node, addr } => {
                self.record(Event::Join { node, addr });
                return self.fail(RuntimeError::JoinRefused { node });
            }
            Input::Lost { node, reason } => {
                if self.lost.insert(node) {
                    self.record(Event::Lost { node, reason });
                }
                if self.rescue_nodes().is_some_and(|n| n.contains(&node)) {
                    return self.fall_back(now);
                }
            }
            Input::AgentExited { .. } => self.dead_agents += 1,
            Input::Worker {
                node,
                generation,
                report,
            } if generation == self.generation => self.survivor_report(now, node, report),
            Input::Worker { .. } => {}
            Input::KillRequested { node } => {
                self.record(Event::KillRequested { node });
                self.push(Action::KillNode { node });
            }
            Input::Unreachable { node, what } => {
                if self.rescue_nodes().is_some_and(|n| n.contains(&node)) {
                    self.note(format!("node {node} did not get {what}"));
                    return self.fall_back(now);
                }
            }
            Input::Assembled {
                step,
                checkpoint,
                val_loss,
                duration_s,
            } => self.on_assembled(step, checkpoint, val_loss, duration_s),
            Input::AssemblyFailed { step, error } => {
                self.assembling = self.assembling.saturating_sub(1);
                self.note(format!(
                    "the checkpoint or evaluation of step {step} failed: {error}"
                ));
            }
            Input::RescueWritten(result) => return self.on_rescue_written(now, result),
        }
        self.recovery_tick(now);
    }

    fn rescue_nodes(&self) -> Option<&BTreeSet<u32>> {
        match &self.phase {
            Phase::Recovering(Recovery::Rescuing { rescue, .. })
            | Phase::Recovering(Recovery::Writing { rescue }) => Some(&rescue.nodes),
            _ => None,
        }
    }

    /// A report of the failed generation's workers while recovering.
    fn survivor_report(&mut self, now: Duration, node: u32, report: WorkerReport) {
        match report {
            WorkerReport::Broken { rank, step, error } => {
                self.on_worker_broken(node, rank, step, error)
            }
            WorkerReport::Exited {
                rank,
                status,
                error,
            } => self.on_worker_exited(node, rank, status, error),
            // Ready for the open step: it holds the last committed state and waits.
            WorkerReport::Ready {
                rank,
                step,
                loss,
                grad_norm,
            } if step == self.committed + 1 => {
                if let Some(g) = self.gen.as_mut() {
                    g.ready.insert(rank, (loss, grad_norm));
                }
            }
            WorkerReport::Saved { rank, step, state } if step == self.committed => {
                if let Phase::Recovering(Recovery::Rescuing { rescue, states, .. }) =
                    &mut self.phase
                {
                    if rescue.savers.contains(&rank) {
                        states.insert(rank, state);
                    }
                }
                let _ = now;
            }
            _ => {}
        }
    }

    /// Moves the recovery on when what it waits for is in, or its time is up.
    fn recovery_tick(&mut self, now: Duration) {
        let Phase::Recovering(r) = &self.phase else {
            return;
        };
        match r {
            Recovery::Settling { failure } => {
                if self.settled(now, failure) {
                    let failure = failure.clone();
                    self.end_settle(now, failure);
                }
            }
            Recovery::Rescuing {
                rescue,
                states,
                deadline,
            } => {
                if states.len() == rescue.savers.len() {
                    let states = states.clone();
                    let step = self.committed;
                    let Phase::Recovering(Recovery::Rescuing { rescue, .. }) =
                        std::mem::replace(&mut self.phase, Phase::Failed)
                    else {
                        unreachable!("matched above")
                    };
                    self.phase = Phase::Recovering(Recovery::Writing { rescue });
                    self.push(Action::WriteRescue { step, states });
                } else if now >= *deadline {
                    let (savers, wait) = (rescue.savers.clone(), self.limits.rescue_wait);
                    self.note(format!(
                        "the survivors' state (ranks {savers:?}) did not come in {wait:?}"
                    ));
                    self.fall_back(now);
                }
            }
            Recovery::Writing { .. } => {}
        }
    }

    /// Every loss the failure caused is known: the settle time passed, every agent the
    /// driver saw die is a lost node (or the wait for that ran out), and every rank on a node
    /// still up stopped its step (or that wait ran out); no checkpoint is still being written.
    fn settled(&self, now: Duration, failure: &Failure) -> bool {
        let l = &self.limits;
        let t0 = failure.detected;
        let losses_known = !self.start.starts_agents
            || self.dead_agents <= self.lost.len()
            || now >= t0 + l.loss_wait;
        let undecided = self.gen.as_ref().is_some_and(|g| {
            g.formed
                && (0..g.world as u32).any(|r| {
                    g.node_of(r).is_some_and(|n| !self.lost.contains(&n))
                        && !g.broken.contains_key(&r)
                        && !g.ready.contains_key(&r)
                        && !g.exited.contains(&r)
                })
        });
        let assembled = self.assembling == 0 || now >= t0 + l.stall;
        now >= t0 + l.settle
            && losses_known
            && (!undecided || now >= t0 + l.ranks_wait)
            && assembled
    }

    /// The failure settled: fence the lost nodes, then rescue or fall back.
    fn end_settle(&mut self, now: Duration, failure: Failure) {
        let gen_nodes = self
            .gen
            .as_ref()
            .map(|g| g.nodes.clone())
            .unwrap_or_default();
        let fenced: Vec<u32> = gen_nodes
            .into_iter()
            .filter(|n| self.lost.contains(n))
            .collect();
        for node in fenced {
            self.push(Action::Fence { node });
        }
        self.push(Action::ReleaseHeld);
        let detect_s = now.saturating_sub(failure.detected).as_secs_f64();
        self.phase_done(now, "detect");
        let step = self.committed;
        if step > 0 {
            if let Some((path, _)) = self.newest.clone().filter(|n| n.1 == step) {
                return self.go_on(now, &failure, detect_s, Some((path, step)), true);
            }
            if let Some(savers) = self.holders(step) {
                let g = self.gen.as_ref().expect("a failed generation");
                let nodes: BTreeSet<u32> = savers.iter().filter_map(|&r| g.node_of(r)).collect();
                self.push(Action::SaveState {
                    nodes: nodes.iter().copied().collect(),
                    generation: self.generation,
                    step,
                });
                self.phase = Phase::Recovering(Recovery::Rescuing {
                    rescue: Rescue {
                        failure,
                        detect_s,
                        savers,
                        nodes,
                        started: now,
                    },
                    states: BTreeMap::new(),
                    deadline: now + self.limits.rescue_wait,
                });
                return;
            }
        }
        let newest = self.newest.clone();
        self.go_on(now, &failure, detect_s, newest, false);
    }

    /// The stage leads (device 0 of every stage) of the first pipeline whose every saver is alive
    /// and holds committed `step`: broken at that step, or ready for the next one.
    fn holders(&self, step: u64) -> Option<Vec<u32>> {
        let g = self.gen.as_ref()?;
        let alive = |r: u32| g.node_of(r).is_some_and(|n| !self.lost.contains(&n));
        let holds = |r: &u32| {
            alive(*r)
                && (g.broken.get(r).is_some_and(|(_, s)| *s == step) || g.ready.contains_key(r))
        };
        (0..g.plan.pipelines.len())
            .map(|i| stage_leads(&g.plan, i))
            .find(|leads| leads.iter().all(holds))
    }

    fn on_rescue_written(&mut self, now: Duration, result: Result<String, String>) {
        let Phase::Recovering(Recovery::Writing { rescue }) =
            std::mem::replace(&mut self.phase, Phase::Failed)
        else {
            return;
        };
        let step = self.committed;
        match result {
            Ok(path) => {
                self.record(Event::Rescued {
                    step,
                    ranks: rescue.savers.clone(),
                    path: path.clone(),
                    duration_s: now.saturating_sub(rescue.started).as_secs_f64(),
                });
                self.newest = Some((path.clone(), step));
                self.go_on(
                    now,
                    &rescue.failure,
                    rescue.detect_s,
                    Some((path, step)),
                    true,
                );
            }
            Err(e) => {
                self.note(format!("writing the survivors' state failed: {e}"));
                let newest = self.newest.clone();
                self.go_on(now, &rescue.failure, rescue.detect_s, newest, false);
            }
        }
    }

    /// The rescue cannot happen: go on from the newest checkpoint.
    fn fall_back(&mut self, now: Duration) {
        let (failure, detect_s) = match std::mem::replace(&mut self.phase, Phase::Failed) {
            Phase::Recovering(Recovery::Rescuing { rescue, .. })
            | Phase::Recovering(Recovery::Writing { rescue }) => (rescue.failure, rescue.detect_s),
            other => {
                self.phase = other;
                return;
            }
        };
        let newest = self.newest.clone();
        self.go_on(now, &failure, detect_s, newest, false);
    }

    /// Starts the next generation on the nodes left, from `from` (a checkpoint and its step;
    /// `None`: step 0, since initialisation is deterministic).
    fn go_on(
        &mut self,
        now: Duration,
        failure: &Failure,
        detect_s: f64,
        from: Option<(String, u64)>,
        rescued: bool,
    ) {
        let gen_nodes = self.gen.take().map(|g| g.nodes).unwrap_or_default();
        let left: Vec<u32> = gen_nodes
            .iter()
            .copied()
            .filter(|n| !self.lost.contains(n))
            .collect();
        let lost: Vec<u32> = gen_nodes
            .iter()
            .copied()
            .filter(|n| self.lost.contains(n))
            .collect();
        if left.is_empty() {
            let newest = match &from {
                Some((c, _)) => format!("the newest checkpoint is {c}"),
                None => "no checkpoint was written".into(),
            };
            return self.fail(RuntimeError::AllLost {
                failure: failure.reason.clone(),
                newest,
            });
        }
        let from_step = from.as_ref().map_or(0, |f| f.1);
        self.phase_done(now, if rescued { "rescue" } else { "checkpoint" });
        self.push(Action::TruncateMetrics { after: from_step });
        self.committed = from_step;
        let replayed = failure.failed_at.saturating_sub(from_step);
        self.record(Event::Reconfig {
            generation: self.generation + 1,
            lost_nodes: lost.clone(),
            nodes: left.clone(),
            failed_in_step: failure.failed_at + 1,
            from_step,
            replayed_steps: replayed,
            detect_s,
            rescued,
            checkpoint: from.as_ref().map(|f| f.0.clone()),
        });
        self.note(format!(
            "generation {}: {} node(s) left{}, {}",
            self.generation + 1,
            left.len(),
            if lost.is_empty() {
                String::new()
            } else {
                format!(" (lost {lost:?})")
            },
            if rescued {
                format!("resuming at step {from_step} from the surviving replicas (no step lost)")
            } else {
                format!("replaying from step {from_step} ({replayed} step(s) lost)")
            }
        ));
        self.generation += 1;
        self.resume = from.map(|f| f.0);
        self.nodes = left.into_iter().collect();
        self.plan_next(self.spec.fault_threshold);
    }
}
