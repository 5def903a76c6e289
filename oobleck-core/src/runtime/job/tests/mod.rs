//! The job machine as tables: inputs in, actions out, no processes and no clock. This file is
//! the harness; `steps.rs` has the commit protocol's cases, `recovery.rs` the failures'.

mod membership;
mod reattach;
mod recovery;
mod steps;
mod stragglers;

use std::time::Duration;

use super::*;
use crate::optim::{AdamWConfig, LrSchedule};
use crate::planning::{Pipeline, Plan, Stage, Template};
use crate::runtime::spec::{DataPlane, InjectedFailure, TrainingSpec};
use crate::runtime::wire::protocol::ExitStatus;

pub(super) fn spec(nodes: u32, f: u32, steps: u64) -> TrainingSpec {
    TrainingSpec {
        steps,
        seed: 7,
        microbatch_size: 2,
        global_microbatches: 4,
        nodes,
        devices_per_node: 1,
        fault_threshold: f,
        device: "cpu".into(),
        pipeline_nodes: None,
        optimizer: AdamWConfig::default(),
        lr: LrSchedule::constant(1e-3).expect("lr"),
        grad_clip: None,
        checkpoint_every: 0,
        eval_every: 0,
        data_plane: DataPlane::Tcp,
        inject_failures: Vec::new(),
        compute: Default::default(),
        precision: Default::default(),
        recompute: false,
        schedule: Default::default(),
        device_memory_bytes: None,
    }
}

/// A plan with one device per node: pipeline `i` runs on `pipes[i]`, ranks in order, one
/// stage per node.
pub(super) fn plan(pipes: &[&[u32]]) -> Plan {
    let stages: Vec<Vec<Vec<u32>>> = pipes
        .iter()
        .map(|nodes| nodes.iter().map(|_| vec![0]).collect())
        .collect();
    plan_with(1, pipes, &stages)
}

/// A plan with `g` devices per node: pipeline `i` runs on `pipes[i]`, and node `j` of it runs
/// one stage per entry of `stages[i][j]` (each entry: the stage's first device; a stage's
/// devices run up to the next entry or the end of the node).
pub(super) fn plan_with(g: u32, pipes: &[&[u32]], stages: &[Vec<Vec<u32>>]) -> Plan {
    let mut first_rank = 0;
    let mut pipelines = Vec::new();
    let mut templates: Vec<Template> = Vec::new();
    for (i, nodes) in pipes.iter().enumerate() {
        let n = nodes.len() as u32;
        pipelines.push(Pipeline {
            id: i as u32,
            template_nodes: n,
            nodes: nodes.to_vec(),
            first_rank,
            microbatches: 1,
            predicted_ns: 1,
        });
        first_rank += n * g;
        if templates.iter().all(|t| t.nodes != n) {
            templates.push(template(g, &stages[i]));
        }
    }
    Plan {
        generation: 0,
        devices_per_node: g,
        fault_threshold: 1,
        global_microbatches: 4,
        min_nodes: 1,
        templates,
        pipelines,
        compute_ns: 1,
        sync_ns: 0,
        sync_model_ns: 0,
        layer_state_bytes: Vec::new(),
        iteration_ns: 1,
    }
}

/// A template whose node `j` runs stages starting on the devices `starts[j]`, one layer each.
fn template(g: u32, starts: &[Vec<u32>]) -> Template {
    let mut stages = Vec::new();
    for (j, firsts) in starts.iter().enumerate() {
        for (k, &d) in firsts.iter().enumerate() {
            let end = firsts.get(k + 1).copied().unwrap_or(g);
            let layer = stages.len();
            stages.push(Stage {
                layer_start: layer,
                layer_end: layer + 1,
                node: j as u32,
                first_device: d,
                devices: end - d,
                forward_ns: 1,
                backward_ns: 1,
                p2p_ns: 0,
                memory_bytes: 1,
            });
        }
    }
    Template {
        nodes: starts.len() as u32,
        devices_per_node: g,
        stages,
        microbatches: 1,
        t1_ns: 1,
        t3_ns: 1,
        bottleneck_stage: 0,
        bottleneck_ns: 1,
        iteration_ns: 1,
        peak_memory_bytes: 1,
    }
}

pub(super) fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// Drives a machine: every call returns the actions the input caused.
pub(super) struct H {
    pub m: JobMachine,
    pub now: Duration,
}

impl H {
    pub(super) fn new(spec: TrainingSpec) -> H {
        let start = JobStart {
            step: 0,
            checkpoint: None,
            generation: 0,
            starts_agents: true,
            announce_joins: false,
            reattach: None,
        };
        H {
            m: JobMachine::new(spec, start, Limits::default(), Duration::ZERO),
            now: Duration::ZERO,
        }
    }

    pub(super) fn at(&mut self, t: f64, input: Input) -> Vec<Action> {
        self.now = secs(t);
        self.m.handle(self.now, input);
        std::iter::from_fn(|| self.m.poll_action()).collect()
    }

    pub(super) fn worker(&mut self, t: f64, node: u32, report: WorkerReport) -> Vec<Action> {
        let generation = self.m.generation();
        self.at(
            t,
            Input::Worker {
                node,
                generation,
                report,
            },
        )
    }

    /// Joins `n` nodes, answers the plan with `p`, and forms the data plane: the job steps.
    pub(super) fn running(spec: TrainingSpec, p: Plan) -> H {
        let n = spec.nodes;
        let mut h = H::new(spec);
        for node in 0..n {
            h.at(0.0, joined(node));
        }
        h.at(0.1, Input::Planned(Ok(p)));
        h.listen_all(0.2);
        h.form_all(0.2);
        h
    }

    /// Every rank built its stage: it holds its stage's layers of the committed step.
    pub(super) fn form_all(&mut self, t: f64) -> Vec<Action> {
        let plan = self.m.gen.as_ref().expect("a generation").plan.clone();
        let held = crate::reconfig::Holdings::of(&plan);
        let step = self.m.committed();
        let mut last = Vec::new();
        for rank in 0..self.world() {
            let node = self.node_of(rank);
            let layers = held
                .layers(node, rank % plan.devices_per_node)
                .map(|l| l.iter().copied().collect())
                .unwrap_or_default();
            last = self.worker(
                t,
                node,
                WorkerReport::Formed {
                    rank,
                    step,
                    layers,
                    connect_s: 0.01,
                    copy_s: 0.02,
                    copy_bytes: 100,
                },
            );
        }
        last
    }

    /// Answers the machine's [`Action::Reconfigure`]: the next plan is `plan`, with `copies`
    /// layer copies, and `missing` layers that nobody holds.
    pub(super) fn reconfigured(
        &mut self,
        t: f64,
        plan: Plan,
        copies: usize,
        missing: Vec<usize>,
    ) -> Vec<Action> {
        let copies = (0..copies)
            .map(|i| crate::reconfig::LayerCopy {
                layer: i,
                from_rank: 0,
                to_rank: 1,
                from_node: 0,
                to_node: 1,
                bytes: 10,
            })
            .collect();
        let r = crate::reconfig::ReconfigPlan {
            fault_tolerance: plan.pipelines.len() as u32 - 1,
            plan,
            copies,
            missing_layers: missing,
            spare_nodes: Vec::new(),
            actions: Vec::new(),
            lost: Vec::new(),
            joined: Vec::new(),
            donors: Vec::new(),
        };
        self.at(t, Input::Reconfigured(Ok(r)))
    }

    pub(super) fn listen_all(&mut self, t: f64) {
        let ranks = self.world();
        for rank in 0..ranks {
            let node = self.node_of(rank);
            self.worker(
                t,
                node,
                WorkerReport::Listening {
                    rank,
                    addr: format!("127.0.0.1:{}", 9000 + rank),
                    pid: 100 + rank,
                },
            );
        }
    }

    pub(super) fn world(&self) -> u32 {
        self.m.gen.as_ref().expect("a generation").world as u32
    }

    pub(super) fn node_of(&self, rank: u32) -> u32 {
        let g = self.m.gen.as_ref().expect("a generation");
        g.node_of(rank).expect("a rank of the plan")
    }

    pub(super) fn ready(&mut self, t: f64, rank: u32, step: u64) -> Vec<Action> {
        let node = self.node_of(rank);
        self.worker(
            t,
            node,
            WorkerReport::Ready {
                rank,
                step,
                loss: 2.5,
                grad_norm: 0.5,
                microbatches: self.first_microbatch(rank),
                samples: None,
                times: None,
            },
        )
    }

    /// The microbatches rank `rank` reads in the harness: its pipeline's first rank reads
    /// an even share of the job's batch, in pipeline order.
    pub(super) fn first_microbatch(&self, rank: u32) -> Vec<u32> {
        let plan = &self.m.gen.as_ref().expect("a generation").plan;
        let (b, n) = (self.m.spec.global_microbatches, plan.pipelines.len() as u32);
        match plan.pipelines.iter().position(|p| p.first_rank == rank) {
            Some(i) => (i as u32 * b / n..(i as u32 + 1) * b / n).collect(),
            None => Vec::new(),
        }
    }

    /// Every rank reports `step` ready: returns the actions of the last report.
    pub(super) fn step(&mut self, t: f64, step: u64) -> Vec<Action> {
        let mut last = Vec::new();
        for rank in 0..self.world() {
            last = self.ready(t, rank, step);
        }
        last
    }

    pub(super) fn broken(&mut self, t: f64, rank: u32, step: u64) -> Vec<Action> {
        let node = self.node_of(rank);
        self.worker(
            t,
            node,
            WorkerReport::Broken {
                rank,
                step,
                error: "peer lost".into(),
                corrupt: None,
            },
        )
    }

    /// Rank `rank` wrote its state of committed `step`.
    pub(super) fn saved(&mut self, t: f64, rank: u32, step: u64) -> Vec<Action> {
        let node = self.node_of(rank);
        let state = format!("state/rank-{rank}");
        self.worker(
            t,
            node,
            WorkerReport::Saved {
                rank,
                step,
                state,
                stall_ms: 2.0,
            },
        )
    }

    /// The periodic checkpoint of `step` is written.
    pub(super) fn checkpointed(&mut self, t: f64, step: u64) -> Vec<Action> {
        self.at(
            t,
            Input::Assembled {
                step,
                checkpoint: Some(format!("ckpt-{step}")),
                val_loss: None,
                duration_s: 0.1,
            },
        )
    }

    /// Commits steps `1..=last`, one a second.
    pub(super) fn steps_to(&mut self, last: u64) {
        for step in 1..=last {
            self.step(step as f64, step);
        }
    }

    /// Ticks every 0.1 s from `from` to `to`, collecting actions.
    pub(super) fn ticks(&mut self, from: f64, to: f64) -> Vec<Action> {
        let mut out = Vec::new();
        let mut t = from;
        while t <= to + 1e-9 {
            out.extend(self.at(t, Input::Tick));
            t += 0.1;
        }
        out
    }
}

pub(super) fn joined(node: u32) -> Input {
    Input::Joined {
        node,
        addr: format!("127.0.0.1:{}", 5000 + node),
    }
}

pub(super) fn lost(node: u32) -> Input {
    Input::Lost {
        node,
        reason: LossReason::Closed,
    }
}

pub(super) fn kinds(actions: &[Action]) -> Vec<String> {
    actions
        .iter()
        .map(|a| match a {
            Action::Record(e) => format!("record:{}", e.kind()),
            Action::Note(_) => "note".into(),
            Action::Plan { .. } => "plan".into(),
            Action::Deploy { .. } => "deploy".into(),
            Action::Rendezvous { .. } => "rendezvous".into(),
            Action::Commit { step, .. } => format!("commit:{step}"),
            Action::Abort { generation } => format!("abort:{generation}"),
            Action::Recommit { node, step, .. } => format!("recommit:{node}:{step}"),
            Action::EndReturns => "end_returns".into(),
            Action::KillNode { node } => format!("kill:{node}"),
            Action::Fence { node } => format!("fence:{node}"),
            Action::Reconfigure {
                lost,
                drained,
                joined,
                ..
            } => {
                let mut k = format!("reconfigure:{lost:?}");
                if !drained.is_empty() {
                    k.push_str(&format!("-{drained:?}"));
                }
                if !joined.is_empty() {
                    k.push_str(&format!("+{joined:?}"));
                }
                k
            }
            Action::WeighJoins { joined, .. } => format!("weigh:{joined:?}"),
            Action::Release { node, .. } => format!("release:{node}"),
            Action::Membership { .. } => "membership".into(),
            Action::RankTimes { .. } => "rank_times".into(),
            Action::Assemble { step, .. } => format!("assemble:{step}"),
            Action::SaveFailed(FailedSave {
                step,
                retrying,
                periodic,
                ..
            }) => match (periodic, retrying) {
                (true, _) => format!("save_failed:{step}"),
                (false, true) => format!("save_failed:{step}:retrying"),
                (false, false) => format!("save_failed:{step}:final"),
            },
            Action::ValLoss { step, .. } => format!("val:{step}"),
            Action::ReleaseHeld => "release".into(),
            Action::TruncateMetrics { after } => format!("truncate:{after}"),
            Action::Finish { step, .. } => format!("finish:{step}"),
            Action::Fail(_) => "fail".into(),
        })
        .collect()
}

pub(super) fn has(actions: &[Action], kind: &str) -> bool {
    kinds(actions).iter().any(|k| k == kind)
}

pub(super) fn failure(actions: &[Action]) -> String {
    actions
        .iter()
        .find_map(|a| match a {
            Action::Fail(e) => Some(e.to_string()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no failure in {:?}", kinds(actions)))
}

pub(super) fn plan_request(actions: &[Action]) -> (Vec<u32>, u32) {
    actions
        .iter()
        .find_map(|a| match a {
            Action::Plan {
                nodes,
                fault_threshold,
                ..
            } => Some((nodes.clone(), *fault_threshold)),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no plan request in {:?}", kinds(actions)))
}

/// The source of the generation a `Deploy` starts.
pub(super) fn deployed(actions: &[Action]) -> crate::runtime::wire::pipe::StateSource {
    actions
        .iter()
        .find_map(|a| match a {
            Action::Deploy { source, .. } => Some(source.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no deploy in {:?}", kinds(actions)))
}

/// The holdings and lost nodes of the machine's `Reconfigure` request.
pub(super) fn reconfigure_request(actions: &[Action]) -> (crate::reconfig::Holdings, Vec<u32>) {
    actions
        .iter()
        .find_map(|a| match a {
            Action::Reconfigure { holdings, lost, .. } => Some((holdings.clone(), lost.clone())),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no reconfigure in {:?}", kinds(actions)))
}

pub(super) fn reconfig(actions: &[Action]) -> Event {
    actions
        .iter()
        .find_map(|a| match a {
            Action::Record(e @ Event::Reconfig { .. }) => Some(e.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no reconfig in {:?}", kinds(actions)))
}
