//! [`JobMachine`]: membership, generations and the commit protocol (DESIGN.md section 4).
//! Recovery from failures is in `recovery.rs`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use super::membership::Membership;
use super::reattach::Returns;
use super::recovery::{Recoveries, Recovery};
use super::reports::Replicas;
use super::steps::Steps;
use super::stragglers::{StragglerRule, Stragglers};
use super::{Action, Input, JobStart, Limits, LossReason};
use crate::execution::StepTimes;
use crate::planning::Plan;
use crate::planning::{stage_leads, world_size};
use crate::runtime::error::RuntimeError;
use crate::runtime::spec::TrainingSpec;
use crate::runtime::wire::pipe::StateSource;
use crate::runtime::wire::records::{Event, PipelineLayout, SampleHash, WorkerReport};

/// Where the job is.
#[derive(Debug)]
pub(super) enum Phase {
    /// Waiting for the expected agents to register.
    Forming,
    /// Waiting for [`Input::Planned`]; `f` is the fault threshold asked for.
    Planning {
        f: u32,
    },
    /// The plan went out; waiting for every rank to listen.
    Rendezvous,
    /// Collecting the open step's `Ready` reports.
    Stepping,
    /// Every step committed; waiting for every worker's `Done`.
    Finishing,
    /// A failure is being handled (`recovery.rs`).
    Recovering(Recovery),
    Finished,
    Failed,
}

/// The running generation: its plan and what its ranks reported.
#[derive(Debug)]
pub(super) struct Generation {
    pub plan: Plan,
    /// Its nodes, sorted.
    pub nodes: Vec<u32>,
    pub world: usize,
    /// Device 0 of each stage of pipeline 0: the ranks that keep the state to assemble.
    pub savers: Vec<u32>,
    pub listening: BTreeMap<u32, String>,
    /// Ranks ready for the open step: `(loss, grad norm)`.
    pub ready: BTreeMap<u32, (f64, f64)>,
    /// The global microbatches the open step's first stages read.
    pub read: Vec<u32>,
    /// The hash of their samples, the sum of what the ranks that read them said (`None`: no
    /// rank said one; the workload does not number its samples).
    pub samples: Option<SampleHash>,
    /// Where each rank's time of the open step went, as it said.
    pub times: BTreeMap<u32, StepTimes>,
    /// Ranks whose watchdog says they wait on their peers: `(step, what, for how long)`.
    pub waiting: BTreeMap<u32, (u64, String, f64)>,
    /// Ranks whose step failed, holding the state of a committed step: `(node, step)`.
    pub broken: BTreeMap<u32, (u32, u64)>,
    pub exited: BTreeSet<u32>,
    /// Ranks done: `(their final state, ms waited for commits)`.
    pub done: BTreeMap<u32, (Option<String>, f64)>,
    /// Periodic states by step, until every saver's is in.
    pub states: BTreeMap<u64, BTreeMap<u32, String>>,
    /// The rendezvous went out: the data plane formed.
    pub formed: bool,
    /// A worker of it was killed from outside (SIGKILL, SIGTERM, SIGINT, SIGHUP: the kernel's
    /// out-of-memory killer, a person, a preemption), which is no reason to think it would
    /// fail again, also before the generation formed.
    pub killed: bool,
    /// Ranks that confirmed they are stopping their step after a failure (`Stopping`): they
    /// hold the committed step, whatever they are still computing.
    pub stopping: BTreeSet<u32>,
    /// Ranks that built their stage (`Formed`), and the slowest connect and copy among them.
    pub built: BTreeSet<u32>,
    pub connect_s: f64,
    pub copy_s: f64,
    pub copy_bytes: u64,
    /// Nodes lost and steps run when the generation started.
    pub lost_before: usize,
    pub steps_before: u64,
    /// Agent processes of the master dead when the generation started.
    pub agents_dead_before: usize,
    /// Devices of drained nodes that send their layers into this generation (ranks from
    /// `world` on), and those that have.
    pub donors: Vec<crate::reconfig::Donor>,
    pub donated: BTreeSet<u32>,
}

impl Generation {
    /// A generation of `plan` that nothing has been heard from yet.
    pub fn of(plan: Plan, membership: &Membership, steps_run: u64) -> Generation {
        let nodes: Vec<u32> = plan
            .nodes()
            .into_iter()
            .collect::<BTreeSet<u32>>()
            .into_iter()
            .collect();
        let world = world_size(&plan) as usize;
        // Stage leads, not one rank per node: a node may run several stages.
        let savers = stage_leads(&plan, 0);
        Generation {
            plan,
            nodes,
            world,
            savers,
            listening: BTreeMap::new(),
            ready: BTreeMap::new(),
            read: Vec::new(),
            samples: None,
            times: BTreeMap::new(),
            waiting: BTreeMap::new(),
            broken: BTreeMap::new(),
            exited: BTreeSet::new(),
            done: BTreeMap::new(),
            states: BTreeMap::new(),
            formed: false,
            killed: false,
            stopping: BTreeSet::new(),
            built: BTreeSet::new(),
            connect_s: 0.0,
            copy_s: 0.0,
            copy_bytes: 0,
            lost_before: membership.lost_count(),
            steps_before: steps_run,
            agents_dead_before: membership.dead_agents(),
            donors: Vec::new(),
            donated: BTreeSet::new(),
        }
    }

    /// `rank` built its stage and confirmed it is stopping: it holds the committed step while
    /// it finishes the microbatch it is in.
    pub fn computing(&self, rank: u32) -> bool {
        self.built.contains(&rank) && self.stopping.contains(&rank)
    }

    /// The node running `rank`.
    pub fn node_of(&self, rank: u32) -> Option<u32> {
        let g = self.plan.devices_per_node;
        self.plan.pipelines.iter().find_map(|p| {
            let local = rank.checked_sub(p.first_rank)?;
            p.nodes.get((local / g) as usize).copied()
        })
    }
}

/// The job's decisions. See the module docs of [`super`].
///
/// Its core (the settings, the phase, the generation and what its ranks reported) is driven by
/// the handlers of every file; the rest is one group per concern, declared in the file that owns
/// it, and only that file changes it: the others go through its methods.
#[derive(Debug)]
pub struct JobMachine {
    /// The job's settings: never changed after [`JobMachine::new`].
    pub(super) spec: TrainingSpec,
    pub(super) limits: Limits,
    pub(super) start: JobStart,
    pub(super) phase: Phase,
    /// Generation of the plan running or being made.
    pub(super) generation: u64,
    pub(super) gen: Option<Generation>,
    /// The job's nodes: registered, lost, joining, draining, gone (`membership.rs`).
    pub(super) membership: Membership,
    /// The committed step, checkpoints and their assembly (`steps.rs`).
    pub(super) steps: Steps,
    /// What each device holds of the committed step, and the replicas not trusted
    /// (`reports.rs`).
    pub(super) replicas: Replicas,
    /// The recovery being timed and the failures in a row (`recovery.rs`).
    pub(super) recoveries: Recoveries,
    /// When a rank is a straggler, and the recent steps' computes (`stragglers.rs`).
    pub(super) stragglers: Stragglers,
    actions: VecDeque<Action>,
    /// The agents of a lost master that came back, while a restarted master waits for them
    /// (`reattach.rs`).
    pub(super) returns: Returns,
    /// When the job last heard from any process.
    last_progress: Duration,
    /// When the agents must have registered by.
    join_deadline: Duration,
    /// The failure that made planning lower `f`, while it does.
    planning_error: Option<RuntimeError>,
}

impl JobMachine {
    /// A job that waits for `spec.nodes` agents, starting at `start`. `now`: the time now.
    pub fn new(spec: TrainingSpec, start: JobStart, limits: Limits, now: Duration) -> JobMachine {
        let steps = Steps::new(&spec, &start);
        let replicas = Replicas::new(spec.devices_per_node);
        JobMachine {
            generation: start.generation,
            spec,
            limits,
            start,
            phase: Phase::Forming,
            gen: None,
            membership: Membership::default(),
            steps,
            replicas,
            recoveries: Recoveries::default(),
            stragglers: Stragglers::default(),
            returns: Returns::default(),
            actions: VecDeque::new(),
            last_progress: now,
            join_deadline: now + limits.join,
            planning_error: None,
        }
    }

    /// When the agents must have registered by.
    pub(super) fn join_deadline(&self) -> Duration {
        self.join_deadline
    }

    /// Names stragglers (and drains their nodes, if asked) by `rule`, not the default.
    pub fn with_stragglers(mut self, rule: StragglerRule) -> JobMachine {
        self.stragglers.set_rule(rule);
        self
    }

    /// The next thing to do, in order; `None` when there is nothing until the next input.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// The job is over (finished or failed): no input changes anything any more.
    pub fn is_over(&self) -> bool {
        matches!(self.phase, Phase::Finished | Phase::Failed)
    }

    /// The newest committed step.
    pub fn committed(&self) -> u64 {
        self.steps.committed()
    }

    /// Steps committed by this job, replays included.
    pub fn steps_run(&self) -> u64 {
        self.steps.steps_run()
    }

    /// The generation running (or being planned).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Records refused connections, of the control port or of a worker's data-plane port (of
    /// any generation: the refusal happened either way); gives back every other input.
    fn take_refusal(&mut self, input: Input) -> Option<Input> {
        let (node, rank, peer, reason, count) = match input {
            Input::Refused {
                peer,
                reason,
                count,
            } => (None, None, peer, reason, count),
            Input::Worker {
                node,
                report:
                    WorkerReport::Refused {
                        rank,
                        peer,
                        reason,
                        count,
                    },
                ..
            } => (Some(node), Some(rank), peer, reason, count),
            other => return Some(other),
        };
        self.record(Event::Refused {
            node,
            rank,
            peer,
            reason,
            count,
        });
        None
    }

    /// Takes one input at time `now`.
    pub fn handle(&mut self, now: Duration, input: Input) {
        if self.is_over() {
            return;
        }
        let Some(input) = self.take_refusal(input) else {
            return; // not progress: a flood of strangers must not look like a live job
        };
        if !matches!(input, Input::Tick) {
            self.last_progress = now;
        }
        if let Phase::Recovering(_) = self.phase {
            self.recovering(now, input);
            return;
        }
        if self.reattaching() {
            return self.while_reattaching(now, input);
        }
        match input {
            Input::Tick => self.on_tick(now),
            Input::Joined { node, addr } => self.on_joined(now, node, addr),
            Input::Returned { node, addr, back } => self.on_returned(now, node, addr, back),
            Input::Lost { node, reason } => self.on_node_lost(now, node, reason),
            Input::AgentExited {
                which,
                node,
                status,
            } => self.on_agent_exited(now, which, node, status),
            Input::Worker {
                node,
                generation,
                report,
            } => self.on_worker(now, node, generation, report),
            Input::KillRequested { node } => self.on_kill_requested(node),
            Input::DrainRequested {
                node,
                reason,
                force,
            } => self.on_drain_requested(now, node, reason, force),
            Input::Planned(result) => self.on_planned(now, result),
            Input::StopRequested { signal } => self.on_stop_requested(signal),
            Input::Refused { .. } => {} // recorded by `handle`
            // Gone (node ids are never reused) or stuck: lost either way.
            Input::Unreachable { node, what } => {
                self.on_node_lost(now, node, LossReason::Unreachable { what })
            }
            Input::Assembled {
                step,
                checkpoint,
                val_loss,
                duration_s,
            } => {
                self.on_assembled(step, checkpoint, val_loss, duration_s);
                self.maybe_finish();
            }
            Input::AssemblyFailed { step, error } => self.on_assembly_failed(step, error),
            Input::Reconfigured(_) => {}
            Input::JoinsWeighed { joined, pipelines } => {
                self.on_joins_weighed(now, joined, pipelines)
            }
            Input::CheckpointRefused {
                path,
                reason,
                instead,
            } => self.on_checkpoint_refused(path, reason, instead),
        }
    }

    pub(super) fn push(&mut self, a: Action) {
        self.actions.push_back(a);
    }

    pub(super) fn record(&mut self, e: Event) {
        self.push(Action::Record(e));
    }

    pub(super) fn note(&mut self, s: String) {
        self.push(Action::Note(s));
    }

    pub(super) fn fail(&mut self, e: RuntimeError) {
        self.phase = Phase::Failed;
        self.push(Action::Fail(e));
    }

    fn on_tick(&mut self, now: Duration) {
        match self.phase {
            Phase::Forming if now >= self.join_deadline => self.fail(RuntimeError::NodesMissing {
                joined: self.membership.nodes().len(),
                expected: self.spec.nodes as usize,
                secs: self.limits.join.as_secs(),
            }),
            Phase::Rendezvous | Phase::Stepping | Phase::Finishing
                if now >= self.last_progress + self.limits.stall =>
            {
                self.fail(RuntimeError::Stalled {
                    secs: self.limits.stall.as_secs(),
                })
            }
            Phase::Stepping => self.consider_joins(now),
            _ => {}
        }
    }

    fn on_joined(&mut self, now: Duration, node: u32, addr: String) {
        if !matches!(self.phase, Phase::Forming) {
            return self.on_join_running(now, node, addr);
        }
        self.membership.registered(node);
        self.record(Event::Join {
            node,
            addr: addr.clone(),
        });
        if self.start.announce_joins {
            let n = self.spec.nodes;
            self.note(format!(
                "node {node} joined from {addr} ({}/{n})",
                self.membership.nodes().len()
            ));
        }
        if self.membership.nodes().len() >= self.spec.nodes as usize {
            self.plan_next(self.spec.fault_threshold);
        }
    }

    /// Asks for the plan of the current generation on the job's nodes.
    pub(super) fn plan_next(&mut self, f: u32) {
        let pinned = if self.generation == self.start.generation {
            self.spec.pipeline_nodes.clone()
        } else {
            None
        };
        self.phase = Phase::Planning { f };
        self.push(Action::Plan {
            nodes: self.membership.nodes().iter().copied().collect(),
            fault_threshold: f,
            pinned,
        });
    }

    fn on_node_lost(&mut self, now: Duration, node: u32, reason: LossReason) {
        let reason = reason.to_string();
        if self.membership.has_departed(node) {
            return;
        }
        let in_plan = self.gen.as_ref().is_some_and(|g| g.nodes.contains(&node));
        if self.gen.is_some() && !in_plan && !matches!(self.phase, Phase::Forming) {
            // Waiting to join, or idle: the job loses nothing.
            if self.membership.lost_idle(node) {
                self.record(Event::Lost { node, reason });
            }
            return self.publish_membership();
        }
        self.replicas.drop_node(node);
        let first = self.membership.lost_for_good(node);
        if first {
            self.record(Event::Lost {
                node,
                reason: reason.clone(),
            });
        }
        match self.phase {
            Phase::Forming => self.fail(RuntimeError::LostWhileForming { node, reason }),
            _ => self.node_failure(now, format!("node {node} was lost ({reason})")),
        }
    }

    fn on_agent_exited(&mut self, now: Duration, which: usize, node: Option<u32>, status: String) {
        self.membership.agent_died();
        if node.is_some_and(|n| self.membership.is_lost(n) || self.membership.has_departed(n)) {
            // Its node's loss was handled already (the connection closes before the master
            // reaps the process, and it looks at exits only between inputs): no news.
            return;
        }
        let what = format!("agent {which} exited early ({status}); its error is above");
        match self.phase {
            Phase::Forming => self.fail(RuntimeError::NodeFailure { what }),
            _ => self.node_failure(now, what),
        }
    }

    pub(super) fn on_kill_requested(&mut self, node: u32) {
        self.record(Event::KillRequested { node });
        self.note(format!("killing node {node}, as requested"));
        self.push(Action::KillNode { node });
    }

    fn on_planned(&mut self, now: Duration, result: Result<Plan, RuntimeError>) {
        let Phase::Planning { f } = self.phase else {
            return;
        };
        let mut plan = match result {
            Ok(plan) => plan,
            Err(e) => return self.on_plan_failed(f, e),
        };
        if let Some(_original) = self.planning_error.take() {
            self.note(format!(
                "{} nodes are left: planning for f = {f} (was {})",
                self.membership.nodes().len(),
                self.spec.fault_threshold
            ));
        }
        plan.generation = self.generation;
        self.phase_done(now, "plan");
        let source = match self.steps.take_resume() {
            Some(path) => StateSource::Checkpoint { path: path.into() },
            None if self.committed() == 0 => StateSource::Init,
            None => {
                return self.fail(RuntimeError::StepHeldNowhere {
                    step: self.committed(),
                })
            }
        };
        self.deploy(plan, source);
    }

    /// Starts `plan`'s generation with its state from `source`. Workers started afresh
    /// hold nothing until they say `Formed`.
    pub(super) fn deploy(&mut self, plan: Plan, source: StateSource) {
        if !matches!(source, StateSource::Peers { .. }) {
            self.replicas.restarted(plan.devices_per_node);
        }
        // Its ranks are numbered afresh.
        self.stragglers.new_generation();
        self.record(Event::Plan {
            generation: plan.generation,
            pipelines: plan
                .pipelines
                .iter()
                .map(|p| PipelineLayout {
                    id: p.id,
                    nodes: p.nodes.clone(),
                    first_rank: p.first_rank,
                    microbatches: p.microbatches,
                })
                .collect(),
        });
        self.push(Action::Deploy {
            plan: Box::new(plan.clone()),
            source: source.clone(),
        });
        let mut gen = Generation::of(plan, &self.membership, self.steps_run());
        if let StateSource::Peers { donors, .. } = &source {
            gen.donors = donors.clone();
        }
        self.gen = Some(gen);
        self.phase = Phase::Rendezvous;
        if self.membership.shown() {
            // What status showed of joins and drains is about the plan before this one.
            self.publish_membership();
        }
    }

    /// The generation just deployed cannot start from its checkpoint: start it from the
    /// newest older one (or from step 0), replaying the steps in between.
    fn on_checkpoint_refused(
        &mut self,
        path: String,
        reason: String,
        instead: Option<(String, u64)>,
    ) {
        let Some(plan) = self.gen.take().map(|g| g.plan) else {
            return;
        };
        let step = instead.as_ref().map_or(0, |i| i.1);
        self.note(format!(
            "checkpoint {path} cannot be used ({reason}); starting from {} instead",
            match &instead {
                Some((p, s)) => format!("{p} (step {s})"),
                None => "step 0".into(),
            }
        ));
        self.record(Event::CheckpointRefused {
            path,
            reason,
            instead: instead.as_ref().map(|i| i.0.clone()),
            step,
        });
        self.push(Action::TruncateMetrics { after: step });
        self.steps.fall_back_to(instead.clone());
        let source = match instead {
            Some((p, _)) => StateSource::Checkpoint { path: p.into() },
            None => StateSource::Init,
        };
        self.deploy(plan, source);
    }

    /// No plan for fault threshold `f`: after a failure, keep as much fault tolerance as the
    /// nodes allow; at the start, or with f = 0, the job cannot run.
    fn on_plan_failed(&mut self, f: u32, error: RuntimeError) {
        let first = self.generation == self.start.generation;
        if first || f == 0 || self.spec.fault_threshold == 0 {
            let error = self.planning_error.take().unwrap_or(error);
            return self.fail(error);
        }
        self.planning_error.get_or_insert(error);
        self.plan_next(f - 1);
    }
}
