//! Recovery (DESIGN.md section 5): after a failure the machine settles (collects every loss
//! the failure caused, until every rank's state is known), asks for the pure decision
//! (`reconfig::decide_with` from what the devices hold), and goes on **in place** when every
//! layer still has a holder: the survivors keep running and receive the layers they lack from
//! replicas, so no step is lost. Beyond that, from the newest checkpoint.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::machine::{JobMachine, Phase};
use super::membership::{copy_sources, Change};
use super::{Action, Input};
use crate::planning::PlanError;
use crate::reconfig::ReconfigPlan;
use crate::runtime::error::RuntimeError;
use crate::runtime::wire::pipe::StateSource;
use crate::runtime::wire::records::{Event, WorkerReport};

/// The failure being recovered from.
#[derive(Debug, Clone)]
pub(super) struct Failure {
    pub reason: String,
    pub detected: Duration,
    /// The committed step when it happened.
    pub failed_at: u64,
    /// Not a failure: joins and drains taken at the boundary after `failed_at`...
    pub planned: bool,
    /// ...the first of them asked for (a drain) or registered (a join) then.
    pub asked: Duration,
    /// Not a failure of the job's nodes: its master was restarted (`reattach.rs`).
    pub master: bool,
}

impl Failure {
    pub fn new(reason: String, detected: Duration, failed_at: u64) -> Failure {
        Failure {
            reason,
            detected,
            failed_at,
            planned: false,
            asked: detected,
            master: false,
        }
    }

    /// The master was restarted at `now` and re-adopts the running generation at committed
    /// step `step`.
    pub fn master_restarted(now: Duration, step: u64) -> Failure {
        Failure {
            master: true,
            ..Failure::new("the master was restarted (--reattach)".into(), now, step)
        }
    }

    /// The reconfiguration at the boundary after committed step `step`.
    pub fn planned(reason: String, now: Duration, step: u64, asked: Duration) -> Failure {
        Failure {
            planned: true,
            asked,
            ..Failure::new(reason, now, step)
        }
    }
}

/// The machine's recovery group: the recovery being timed and the failures in a row that
/// committed nothing. Only this file changes it.
#[derive(Debug, Default)]
pub(super) struct Recoveries {
    /// The recovery under way, timed from the failure to the first commit after it.
    timer: Option<Timer>,
    /// Failures since the last generation that committed a step.
    fruitless: u32,
}

impl Recoveries {
    /// One more failure; `progressed`: the failed generation committed a step. Returns the
    /// failures in a row with no committed step in between, this one included.
    pub(super) fn count_failure(&mut self, progressed: bool) -> u32 {
        if progressed {
            self.fruitless = 0;
        }
        self.fruitless += 1;
        self.fruitless
    }
}

/// Times a recovery's phases, from the failure to the first commit after it.
#[derive(Debug)]
struct Timer {
    pub failed: Duration,
    pub mark: Duration,
    /// `"<phase>_s"` -> seconds.
    pub phases: BTreeMap<String, f64>,
    /// Bytes the layer copies moved.
    pub copy_bytes: u64,
    /// The reconfiguration in words, for the progress line of the first commit after it.
    pub summary: String,
    /// Joins and drains at a boundary, not a failure.
    pub planned: bool,
}

/// Where a recovery stands.
#[derive(Debug)]
pub(super) enum Recovery {
    /// Collecting the losses a failure caused, until every rank's state is known.
    Settling { failure: Failure },
    /// Waiting for [`Input::Reconfigured`]: the pure decision of the next generation, which
    /// lets `drained` go and admits `joined`.
    Deciding {
        failure: Failure,
        detect_s: f64,
        change: Change,
    },
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
        self.open_recovery(now, failure);
    }

    /// Stops the running generation's step and waits until every rank's state is known.
    pub(super) fn open_recovery(&mut self, now: Duration, failure: Failure) {
        self.push(Action::Abort {
            generation: self.generation,
        });
        self.recoveries.timer = Some(Timer {
            failed: now,
            mark: now,
            phases: BTreeMap::new(),
            copy_bytes: 0,
            summary: String::new(),
            planned: failure.planned,
        });
        if let (true, Some(t)) = (failure.planned, self.recoveries.timer.as_mut()) {
            // From the first request taken to the boundary that takes it.
            let waited = now.saturating_sub(failure.asked);
            t.phases
                .insert("wait_boundary_s".into(), waited.as_secs_f64());
        }
        self.phase = Phase::Recovering(Recovery::Settling { failure });
        self.recovery_tick(now);
    }

    /// Ends the current phase of a recovery under way (nothing otherwise).
    pub(super) fn phase_done(&mut self, now: Duration, name: &str) {
        if let Some(t) = self.recoveries.timer.as_mut() {
            let s = now.saturating_sub(t.mark).as_secs_f64();
            t.phases.insert(format!("{name}_s"), s);
            t.mark = now;
        }
    }

    /// Every rank of the generation built its stage: the slowest connect and copy among them,
    /// and the bytes the copies moved, for the recovery under way (nothing otherwise).
    pub(super) fn copies_done(&mut self, now: Duration, connect_s: f64, copy_s: f64, bytes: u64) {
        self.phase_done(now, "connect_copy");
        if let Some(t) = self.recoveries.timer.as_mut() {
            t.phases.insert("connect_max_s".into(), connect_s);
            t.phases.insert("copy_max_s".into(), copy_s);
            t.copy_bytes = bytes;
            if bytes > 0 {
                t.summary = format!(
                    "{} (copied {:.1} MB in {copy_s:.2} s, {:.2} GB/s)",
                    t.summary,
                    bytes as f64 / 1e6,
                    bytes as f64 / 1e9 / copy_s.max(1e-9)
                );
            }
        }
    }

    /// `step` committed: a recovery under way ends with it, said and recorded with its
    /// phases (nothing otherwise).
    pub(super) fn recovery_committed(&mut self, now: Duration, step: u64) {
        self.took_over_committed(now, step);
        self.phase_done(now, "first_step");
        if let Some(t) = self.recoveries.timer.take() {
            let since = now.saturating_sub(t.failed).as_secs_f64();
            let (done, event) = if t.planned {
                ("reconfigured", "it began")
            } else {
                ("recovered", "the failure")
            };
            self.note(format!(
                "{done}: {} step {step} committed {since:.2} s after {event}",
                t.summary
            ));
            self.record(Event::Resumed {
                generation: self.generation,
                step,
                since_failure_s: since,
                phases: t.phases,
                copy_bytes: t.copy_bytes,
            });
        }
    }

    /// Any input while recovering: book-keeping, then whatever the recovery waits for.
    pub(super) fn recovering(&mut self, now: Duration, input: Input) {
        match input {
            Input::Tick | Input::Planned(_) => {}
            Input::StopRequested { signal } => self.on_stop_requested(signal),
            Input::Refused { .. } => {} // recorded by `handle`
            Input::Joined { node, addr } => self.on_join_running(now, node, addr),
            Input::Returned { node, addr, back } => self.on_returned(now, node, addr, back),
            Input::DrainRequested {
                node,
                reason,
                force,
            } => self.on_drain_requested(now, node, reason, force),
            Input::Lost { node, .. } if self.membership.has_departed(node) => {}
            Input::Lost { node, reason } => {
                if self.membership.lost_while_recovering(node) {
                    self.record(Event::Lost {
                        node,
                        reason: reason.to_string(),
                    });
                }
                self.replicas.drop_node(node);
            }
            Input::AgentExited { .. } => self.membership.agent_died(),
            Input::Worker {
                node,
                generation,
                report,
            } if generation == self.generation => self.survivor_report(node, report),
            Input::Worker { .. } => {}
            Input::KillRequested { node } => {
                self.record(Event::KillRequested { node });
                self.push(Action::KillNode { node });
            }
            Input::Unreachable { .. } => {}
            Input::Assembled {
                step,
                checkpoint,
                val_loss,
                duration_s,
            } => self.on_assembled(step, checkpoint, val_loss, duration_s),
            Input::AssemblyFailed { step, error } => {
                self.steps.assembly_ended();
                self.skip_checkpoint(step, error);
            }
            Input::Reconfigured(result) => return self.on_reconfigured(now, result),
            Input::JoinsWeighed { .. } => {}
            Input::CheckpointRefused { .. } => {}
        }
        self.recovery_tick(now);
    }

    /// A report of the failed generation's workers while recovering.
    fn survivor_report(&mut self, node: u32, report: WorkerReport) {
        match report {
            WorkerReport::Broken {
                rank,
                step,
                error,
                corrupt,
            } => self.on_worker_broken(node, rank, step, error, corrupt),
            WorkerReport::Exited {
                rank,
                status,
                error,
            } => self.on_worker_exited(node, rank, status, error),
            WorkerReport::Formed { rank, layers, .. } => self.on_formed(node, rank, layers),
            WorkerReport::Stopping { rank } => {
                if let Some(g) = self.gen.as_mut() {
                    g.stopping.insert(rank);
                }
            }
            // Ready for the open step: it holds the last committed state and waits.
            WorkerReport::Ready {
                rank,
                step,
                loss,
                grad_norm,
                ..
            } if step == self.committed() + 1 => {
                if let Some(g) = self.gen.as_mut() {
                    g.ready.insert(rank, (loss, grad_norm));
                }
            }
            WorkerReport::SaveFailed {
                step,
                bytes,
                error,
                retrying,
                ..
            } => self.on_save_failed(step, bytes, error, retrying),
            _ => {}
        }
    }

    /// Moves the recovery on once every loss the failure caused is known.
    fn recovery_tick(&mut self, now: Duration) {
        if let Phase::Recovering(Recovery::Settling { failure }) = &self.phase {
            if self.settled(now, failure) {
                let failure = failure.clone();
                self.end_settle(now, failure);
            }
        }
    }

    /// Every loss the failure caused is known: every agent the master saw die is a lost node
    /// (or the wait for that ran out), and every rank on a node still up stopped its step, or
    /// is computing one and confirmed it is stopping it (or that wait ran out); no
    /// checkpoint is still being written. No fixed sleep: a crash is acted on as soon as the
    /// reports are in. A rank still forming (copying layers) is waited for: its report may
    /// name a corrupted copy.
    fn settled(&self, now: Duration, failure: &Failure) -> bool {
        let l = &self.limits;
        let t0 = failure.detected;
        let losses_known = !self.start.starts_agents
            || self.membership.dead_agents() <= self.membership.lost_count()
            || now >= t0 + l.loss_wait;
        let undecided = self.gen.as_ref().is_some_and(|g| {
            g.formed
                && (0..g.world as u32).any(|r| {
                    g.node_of(r).is_some_and(|n| !self.membership.is_lost(n))
                        && !g.computing(r)
                        && !g.broken.contains_key(&r)
                        && !g.ready.contains_key(&r)
                        && !g.exited.contains(&r)
                })
        });
        let assembled = !self.steps.assembling() || now >= t0 + l.stall;
        now >= t0 + l.settle
            && losses_known
            && (!undecided || now >= t0 + l.ranks_wait)
            && assembled
    }

    /// The failure settled: fence the lost nodes and ask for the decision.
    fn end_settle(&mut self, now: Duration, failure: Failure) {
        let Some(g) = self.gen.as_ref() else {
            return self.fail(RuntimeError::NodeFailure {
                what: failure.reason,
            });
        };
        let plan = g.plan.clone();
        let lost: Vec<u32> = g
            .nodes
            .iter()
            .copied()
            .filter(|n| self.membership.is_lost(*n))
            .collect();
        // A rank of a surviving node that never said it stopped, nor did its agent (it hangs),
        // holds nothing anyone can count on. Before the rendezvous nobody can have said so:
        // no rank has copied anything yet, so each still holds what it held before.
        let silent: Vec<(u32, u32)> = (0..g.world as u32)
            .filter(|_| g.formed)
            .filter(|r| {
                !g.broken.contains_key(r) && !g.ready.contains_key(r) && !g.exited.contains(r)
            })
            .filter(|&r| !g.computing(r))
            .filter_map(|r| Some((g.node_of(r)?, r % plan.devices_per_node)))
            .collect();
        for &node in &lost {
            self.push(Action::Fence { node });
        }
        for (node, device) in silent {
            self.replicas.drop_device(node, device);
        }
        self.push(Action::ReleaseHeld);
        let detect_s = now.saturating_sub(failure.detected).as_secs_f64();
        self.phase_done(now, "detect");
        let change = self.change_of(&plan, &lost);
        let mut plan = plan;
        if !change.joined.is_empty() {
            // A fresh instantiation: back to the job's own f, which a failure may have lowered.
            plan.fault_threshold = self.spec.fault_threshold;
        }
        self.push(Action::Reconfigure {
            plan: Box::new(plan),
            holdings: copy_sources(
                self.replicas.holdings(),
                &change.drained,
                self.drains_copy_off(),
            ),
            lost,
            drained: change.drained.clone(),
            joined: change.joined.clone(),
        });
        self.phase = Phase::Recovering(Recovery::Deciding {
            failure,
            detect_s,
            change,
        });
    }

    /// The decision is in: go on in place when every layer still has a holder, else from the
    /// newest checkpoint (or from step 0, which initialisation makes deterministic).
    fn on_reconfigured(&mut self, now: Duration, result: Result<ReconfigPlan, PlanError>) {
        let Phase::Recovering(Recovery::Deciding {
            failure,
            detect_s,
            change,
        }) = std::mem::replace(&mut self.phase, Phase::Failed)
        else {
            self.phase = Phase::Failed;
            return self.fail(RuntimeError::Unasked {
                what: "a reconfiguration decision",
            });
        };
        self.phase_done(now, "decide");
        let r = match result {
            Ok(r) => r,
            Err(e) => {
                self.note(format!("no reconfiguration fits the nodes left: {e}"));
                let newest = self.steps.newest();
                return self.go_on_planned(&failure, detect_s, newest, change);
            }
        };
        let in_place = r.missing_layers.is_empty() && self.committed() > 0;
        let from = if in_place {
            None
        } else {
            if !r.missing_layers.is_empty() {
                self.note(format!(
                    "layers {:?} lost every replica; going back to the newest checkpoint",
                    r.missing_layers
                ));
            }
            self.steps.newest()
        };
        self.start_next(&failure, detect_s, r, from, in_place, change);
    }

    /// Starts the next generation on `r.plan`: in place from the survivors, or from `from` (a
    /// checkpoint and its step; `None` and not in place: step 0).
    fn start_next(
        &mut self,
        failure: &Failure,
        detect_s: f64,
        r: ReconfigPlan,
        from: Option<(String, u64)>,
        in_place: bool,
        change: Change,
    ) {
        let old_plan = self.gen.take().map(|g| g.plan);
        let lost: Vec<u32> = old_plan
            .iter()
            .flat_map(|p| p.nodes())
            .filter(|n| self.membership.is_lost(*n))
            .collect::<BTreeSet<u32>>()
            .into_iter()
            .collect();
        let old: Vec<Vec<u32>> = old_plan
            .iter()
            .flat_map(|p| p.pipelines.iter().map(|q| q.nodes.clone()))
            .collect();
        let from_step = if in_place {
            self.committed()
        } else {
            from.as_ref().map_or(0, |f| f.1)
        };
        let source = match (&from, in_place) {
            (_, true) => StateSource::Peers {
                step: from_step,
                copies: r.copies.clone(),
                donors: r.donors.clone(),
            },
            (Some((path, _)), false) => StateSource::Checkpoint { path: path.into() },
            (None, false) => StateSource::Init,
        };
        let replayed = failure.failed_at.saturating_sub(from_step);
        let donors = if in_place {
            r.donors.clone()
        } else {
            Vec::new()
        };
        let left = self.settle_membership(&change, &donors);
        let new: Vec<Vec<u32>> = r.plan.pipelines.iter().map(|p| p.nodes.clone()).collect();
        self.push(Action::TruncateMetrics { after: from_step });
        self.steps.rewind(from_step);
        self.record(Event::Reconfig {
            generation: self.generation + 1,
            lost_nodes: lost.clone(),
            nodes: left,
            failed_in_step: failure.failed_at + 1,
            from_step,
            replayed_steps: replayed,
            detect_s,
            in_place,
            checkpoint: from.as_ref().map(|f| f.0.clone()),
            old_pipelines: old.clone(),
            new_pipelines: new.clone(),
            fault_tolerance: r.fault_tolerance,
            copies: if in_place { r.copies.len() } else { 0 },
            copy_bytes: if in_place { r.copy_bytes() } else { 0 },
            cause: failure.reason.clone(),
            joined_nodes: change.joined.clone(),
            drained_nodes: change.drained.clone(),
        });
        let summary = summary(&r, &old, &lost, failure, in_place, from_step, replayed);
        self.note(format!("generation {}: {summary}", self.generation + 1));
        if let Some(t) = self.recoveries.timer.as_mut() {
            t.summary = summary;
        }
        self.generation += 1;
        let mut plan = r.plan;
        plan.generation = self.generation;
        self.deploy(plan, source);
    }

    /// No decision fits (the planner may still find a plan with a lower `f`): the next
    /// generation is planned from scratch on the nodes left, from `from`.
    fn go_on_planned(
        &mut self,
        failure: &Failure,
        detect_s: f64,
        from: Option<(String, u64)>,
        change: Change,
    ) {
        let gen_nodes = self.gen.take().map(|g| g.nodes).unwrap_or_default();
        let left = self.settle_membership(&change, &[]);
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
        self.push(Action::TruncateMetrics { after: from_step });
        self.steps.rewind(from_step);
        let lost: Vec<u32> = gen_nodes
            .into_iter()
            .filter(|n| self.membership.is_lost(*n))
            .collect();
        self.record(Event::Reconfig {
            generation: self.generation + 1,
            lost_nodes: lost,
            nodes: left,
            failed_in_step: failure.failed_at + 1,
            from_step,
            replayed_steps: failure.failed_at.saturating_sub(from_step),
            detect_s,
            in_place: false,
            checkpoint: from.as_ref().map(|f| f.0.clone()),
            old_pipelines: Vec::new(),
            new_pipelines: Vec::new(),
            fault_tolerance: 0,
            copies: 0,
            copy_bytes: 0,
            cause: failure.reason.clone(),
            joined_nodes: change.joined,
            drained_nodes: change.drained,
        });
        self.generation += 1;
        self.steps.resume_from(from.map(|f| f.0));
        self.plan_next(self.spec.fault_threshold);
    }
}

/// The progress line of a reconfiguration: "node 3 lost at step 41: 3 pipelines -> 2
/// (templates 2+1 nodes), 5 layer copies (38.0 MB), tolerates 1 more failure".
fn summary(
    r: &ReconfigPlan,
    old: &[Vec<u32>],
    lost: &[u32],
    failure: &Failure,
    in_place: bool,
    from_step: u64,
    replayed: u64,
) -> String {
    let lost = match lost {
        _ if failure.planned || failure.master => failure.reason.clone(),
        [] => "a worker failed".to_string(),
        [n] => format!("node {n} lost"),
        many => format!("nodes {many:?} lost"),
    };
    let templates: Vec<String> = r
        .plan
        .pipelines
        .iter()
        .map(|p| p.nodes.len().to_string())
        .collect();
    let how = if in_place {
        format!(
            "in place at step {from_step}, {} layer copies ({:.1} MB), no step lost",
            r.copies.len(),
            r.copy_bytes() as f64 / 1e6
        )
    } else {
        format!("replaying from step {from_step} ({replayed} step(s) lost)")
    };
    let more = match r.fault_tolerance {
        1 => "tolerates 1 more failure".to_string(),
        n => format!("tolerates {n} more failures"),
    };
    format!(
        "{lost} at step {}: {} pipelines -> {} (templates {} nodes), {how}, {more}",
        failure.failed_at,
        old.len(),
        r.plan.pipelines.len(),
        templates.join("+"),
    )
}
