//! The job machine as tables: inputs in, actions out, no processes and no clock.

use std::time::Duration;

use super::*;
use crate::elastic::protocol::ExitStatus;
use crate::optim::{AdamWConfig, LrSchedule};
use crate::planning::{Pipeline, Plan};
use crate::runtime::spec::{DataPlane, InjectedFailure, TrainingSpec};

fn spec(nodes: u32, f: u32, steps: u64) -> TrainingSpec {
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
    }
}

/// A plan with one device per node: pipeline `i` runs on `pipes[i]`, ranks in order.
fn plan(pipes: &[&[u32]]) -> Plan {
    let mut first_rank = 0;
    let pipelines = pipes
        .iter()
        .enumerate()
        .map(|(i, nodes)| {
            let p = Pipeline {
                id: i as u32,
                template_nodes: nodes.len() as u32,
                nodes: nodes.to_vec(),
                first_rank,
                microbatches: 1,
                predicted_ns: 1,
            };
            first_rank += nodes.len() as u32;
            p
        })
        .collect();
    Plan {
        generation: 0,
        devices_per_node: 1,
        fault_threshold: 1,
        global_microbatches: 4,
        min_nodes: 1,
        templates: Vec::new(),
        pipelines,
        compute_ns: 1,
        sync_ns: 0,
        sync_model_ns: 0,
        layer_state_bytes: Vec::new(),
        iteration_ns: 1,
    }
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// Drives a machine: every call returns the actions the input caused.
struct H {
    m: JobMachine,
    now: Duration,
}

impl H {
    fn new(spec: TrainingSpec) -> H {
        let start = JobStart {
            step: 0,
            checkpoint: None,
            generation: 0,
            starts_agents: true,
            announce_joins: false,
        };
        H {
            m: JobMachine::new(spec, start, Limits::default(), Duration::ZERO),
            now: Duration::ZERO,
        }
    }

    fn at(&mut self, t: f64, input: Input) -> Vec<Action> {
        self.now = secs(t);
        self.m.handle(self.now, input);
        std::iter::from_fn(|| self.m.poll_action()).collect()
    }

    fn worker(&mut self, t: f64, node: u32, report: WorkerReport) -> Vec<Action> {
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
    fn running(spec: TrainingSpec, p: Plan) -> H {
        let n = spec.nodes;
        let mut h = H::new(spec);
        for node in 0..n {
            h.at(0.0, joined(node));
        }
        h.at(0.1, Input::Planned(Ok(p)));
        h.listen_all(0.2);
        h
    }

    fn listen_all(&mut self, t: f64) {
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

    fn world(&self) -> u32 {
        self.m.gen.as_ref().expect("a generation").world as u32
    }

    fn node_of(&self, rank: u32) -> u32 {
        let g = self.m.gen.as_ref().expect("a generation");
        g.node_of(rank).expect("a rank of the plan")
    }

    fn ready(&mut self, t: f64, rank: u32, step: u64) -> Vec<Action> {
        let node = self.node_of(rank);
        self.worker(
            t,
            node,
            WorkerReport::Ready {
                rank,
                step,
                loss: 2.5,
                grad_norm: 0.5,
            },
        )
    }

    /// Every rank reports `step` ready: returns the actions of the last report.
    fn step(&mut self, t: f64, step: u64) -> Vec<Action> {
        let mut last = Vec::new();
        for rank in 0..self.world() {
            last = self.ready(t, rank, step);
        }
        last
    }

    fn broken(&mut self, t: f64, rank: u32, step: u64) -> Vec<Action> {
        let node = self.node_of(rank);
        self.worker(
            t,
            node,
            WorkerReport::Broken {
                rank,
                step,
                error: "peer lost".into(),
            },
        )
    }

    /// Ticks every 0.1 s from `from` to `to`, collecting actions.
    fn ticks(&mut self, from: f64, to: f64) -> Vec<Action> {
        let mut out = Vec::new();
        let mut t = from;
        while t <= to + 1e-9 {
            out.extend(self.at(t, Input::Tick));
            t += 0.1;
        }
        out
    }
}

fn joined(node: u32) -> Input {
    Input::Joined {
        node,
        addr: format!("127.0.0.1:{}", 5000 + node),
    }
}

fn lost(node: u32) -> Input {
    Input::Lost {
        node,
        reason: "Closed".into(),
    }
}

fn kinds(actions: &[Action]) -> Vec<String> {
    actions
        .iter()
        .map(|a| match a {
            Action::Record(e) => format!("record:{}", e.kind()),
            Action::Note(_) => "note".into(),
            Action::Plan { .. } => "plan".into(),
            Action::Deploy { .. } => "deploy".into(),
            Action::Rendezvous { .. } => "rendezvous".into(),
            Action::Commit { step, .. } => format!("commit:{step}"),
            Action::KillNode { node } => format!("kill:{node}"),
            Action::Fence { node } => format!("fence:{node}"),
            Action::SaveState { nodes, step, .. } => format!("save:{nodes:?}@{step}"),
            Action::WriteRescue { step, .. } => format!("write_rescue:{step}"),
            Action::Assemble { step, .. } => format!("assemble:{step}"),
            Action::ValLoss { step, .. } => format!("val:{step}"),
            Action::ReleaseHeld => "release".into(),
            Action::TruncateMetrics { after } => format!("truncate:{after}"),
            Action::Finish { step, .. } => format!("finish:{step}"),
            Action::Fail(_) => "fail".into(),
        })
        .collect()
}

fn has(actions: &[Action], kind: &str) -> bool {
    kinds(actions).iter().any(|k| k == kind)
}

fn failure(actions: &[Action]) -> String {
    actions
        .iter()
        .find_map(|a| match a {
            Action::Fail(e) => Some(e.to_string()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no failure in {:?}", kinds(actions)))
}

fn plan_request(actions: &[Action]) -> (Vec<u32>, u32) {
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

fn reconfig(actions: &[Action]) -> Event {
    actions
        .iter()
        .find_map(|a| match a {
            Action::Record(e @ Event::Reconfig { .. }) => Some(e.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no reconfig in {:?}", kinds(actions)))
}

#[test]
fn plans_once_every_expected_node_joined() {
    let mut h = H::new(spec(3, 1, 4));
    assert!(!has(&h.at(0.0, joined(0)), "plan"));
    assert!(!has(&h.at(0.0, joined(1)), "plan"));
    let a = h.at(0.0, joined(2));
    assert_eq!(plan_request(&a), (vec![0, 1, 2], 1));
    let a = h.at(0.1, Input::Planned(Ok(plan(&[&[0], &[1, 2]]))));
    assert_eq!(kinds(&a), ["record:plan", "deploy"]);
}

#[test]
fn forming_gives_up_after_the_join_timeout() {
    let mut h = H::new(spec(3, 1, 4));
    h.at(0.0, joined(0));
    let a = h.at(61.0, Input::Tick);
    assert!(failure(&a).contains("only 1 of 3 agents registered"));
}

#[test]
fn the_rendezvous_goes_out_once_every_rank_listens() {
    let mut h = H::new(spec(2, 1, 4));
    h.at(0.0, joined(0));
    h.at(0.0, joined(1));
    h.at(0.1, Input::Planned(Ok(plan(&[&[0], &[1]]))));
    let a = h.worker(
        0.2,
        0,
        WorkerReport::Listening {
            rank: 0,
            addr: "127.0.0.1:9000".into(),
            pid: 1,
        },
    );
    assert!(!has(&a, "rendezvous"));
    let a = h.worker(
        0.2,
        1,
        WorkerReport::Listening {
            rank: 1,
            addr: "127.0.0.1:9001".into(),
            pid: 2,
        },
    );
    assert_eq!(
        kinds(&a),
        ["record:process", "record:rendezvous", "rendezvous"]
    );
}

#[test]
fn a_step_commits_once_every_rank_is_ready_and_not_before() {
    let mut h = H::running(spec(2, 1, 4), plan(&[&[0], &[1]]));
    assert!(h.ready(1.0, 0, 1).is_empty());
    let a = h.ready(1.0, 1, 1);
    assert_eq!(kinds(&a), ["commit:1"]);
    assert_eq!(h.m.committed(), 1);
}

#[test]
fn ranks_that_disagree_on_the_loss_end_the_job() {
    let mut h = H::running(spec(2, 1, 4), plan(&[&[0], &[1]]));
    h.ready(1.0, 0, 1);
    let a = h.worker(
        1.0,
        1,
        WorkerReport::Ready {
            rank: 1,
            step: 1,
            loss: 9.0,
            grad_norm: 0.5,
        },
    );
    assert!(failure(&a).contains("ranks disagree on step 1"));
}

#[test]
fn a_report_for_the_wrong_step_ends_the_job() {
    let mut h = H::running(spec(2, 1, 4), plan(&[&[0], &[1]]));
    let a = h.ready(1.0, 0, 2);
    assert!(failure(&a).contains("reported step 2 ready while step 1 is open"));
}

#[test]
fn the_job_finishes_with_pipeline_zeros_states_once_every_worker_is_done() {
    let mut h = H::running(spec(3, 1, 2), plan(&[&[0], &[1, 2]]));
    h.step(1.0, 1);
    h.step(2.0, 2);
    let mut last = Vec::new();
    for rank in 0..3 {
        let state = (rank == 0).then(|| "rank-0.safetensors".to_string());
        last = h.worker(
            3.0,
            h.node_of(rank),
            WorkerReport::Done {
                rank,
                step: 2,
                state,
                commit_wait_ms: 1.0,
            },
        );
    }
    let Some(Action::Finish { step, states, .. }) = last.first() else {
        panic!("{:?}", kinds(&last));
    };
    assert_eq!(*step, 2);
    assert_eq!(states.keys().copied().collect::<Vec<_>>(), [0]);
    assert!(h.m.is_over());
}

#[test]
fn periodic_states_are_assembled_and_checkpoints_remembered() {
    let mut s = spec(2, 1, 4);
    s.checkpoint_every = 2;
    let mut h = H::running(s, plan(&[&[0], &[1]]));
    h.step(1.0, 1);
    h.step(2.0, 2);
    let a = h.worker(
        2.1,
        0,
        WorkerReport::Saved {
            rank: 0,
            step: 2,
            state: "s".into(),
        },
    );
    assert_eq!(kinds(&a), ["assemble:2"]);
    let a = h.at(
        2.5,
        Input::Assembled {
            step: 2,
            checkpoint: Some("ckpt-2".into()),
            val_loss: None,
            duration_s: 0.1,
        },
    );
    assert_eq!(kinds(&a), ["record:checkpoint"]);
    assert_eq!(h.m.newest, Some(("ckpt-2".into(), 2)));
}

#[test]
fn a_loss_during_a_step_is_rescued_from_the_surviving_pipeline_with_no_step_lost() {
    let mut h = H::running(spec(3, 1, 10), plan(&[&[0], &[1, 2]]));
    h.step(1.0, 1);
    h.step(2.0, 2);
    let a = h.at(2.5, lost(2));
    assert!(has(&a, "record:failure"), "{:?}", kinds(&a));
    // Rank 0 (pipeline 0) and rank 1 fail their step at their next data-plane operation.
    h.broken(2.6, 0, 2);
    h.broken(2.6, 1, 2);
    let a = h.ticks(2.7, 3.6);
    assert!(has(&a, "fence:2"), "{:?}", kinds(&a));
    assert!(has(&a, "save:[0]@2"), "{:?}", kinds(&a));
    let a = h.worker(
        3.7,
        0,
        WorkerReport::Saved {
            rank: 0,
            step: 2,
            state: "rescue/rank-0".into(),
        },
    );
    assert_eq!(kinds(&a), ["write_rescue:2"]);
    let a = h.at(4.0, Input::RescueWritten(Ok("ckpt-2".into())));
    let Event::Reconfig {
        from_step,
        replayed_steps,
        rescued,
        nodes,
        lost_nodes,
        ..
    } = reconfig(&a)
    else {
        unreachable!()
    };
    assert_eq!((from_step, replayed_steps, rescued), (2, 0, true));
    assert_eq!((nodes, lost_nodes), (vec![0, 1], vec![2]));
    assert!(has(&a, "record:rescued") && has(&a, "truncate:2"));
    assert_eq!(plan_request(&a), (vec![0, 1], 1));
    assert_eq!(h.m.generation(), 1);
}

#[test]
fn a_loss_while_waiting_for_the_commit_rescues_from_the_ready_ranks() {
    let mut h = H::running(spec(3, 1, 10), plan(&[&[0], &[1, 2]]));
    h.step(1.0, 1);
    h.ready(1.5, 0, 2);
    h.ready(1.5, 1, 2);
    h.at(1.6, lost(2));
    let a = h.ticks(1.7, 2.7);
    assert!(has(&a, "save:[0]@1"), "{:?}", kinds(&a));
}

#[test]
fn two_losses_in_one_settle_window_make_one_reconfiguration() {
    let mut h = H::running(spec(4, 1, 10), plan(&[&[0, 1], &[2, 3]]));
    h.step(1.0, 1);
    let a = h.at(1.2, lost(3));
    assert!(has(&a, "record:failure"));
    let a = h.at(1.5, lost(1));
    assert!(has(&a, "record:lost") && !has(&a, "record:failure"));
    for r in [0, 2] {
        h.broken(1.6, r, 1);
    }
    // Both pipelines lost a node: no replica holds every layer.
    let a = h.ticks(1.7, 2.5);
    assert!(has(&a, "fence:1") && has(&a, "fence:3"), "{:?}", kinds(&a));
    let Event::Reconfig {
        lost_nodes,
        from_step,
        rescued,
        ..
    } = reconfig(&a)
    else {
        unreachable!()
    };
    assert_eq!((lost_nodes, from_step, rescued), (vec![1, 3], 0, false));
    assert_eq!(plan_request(&a).0, vec![0, 2]);
    let reconfigs = a
        .iter()
        .filter(|a| matches!(a, Action::Record(Event::Reconfig { .. })))
        .count();
    assert_eq!(reconfigs, 1);
}

#[test]
fn a_loss_beyond_f_falls_back_to_the_newest_checkpoint() {
    let mut s = spec(2, 1, 10);
    s.checkpoint_every = 2;
    let mut h = H::running(s, plan(&[&[0], &[1]]));
    for step in 1..=3 {
        h.step(f64::from(step as u32), step);
    }
    h.at(
        3.1,
        Input::Assembled {
            step: 2,
            checkpoint: Some("ckpt-2".into()),
            val_loss: None,
            duration_s: 0.1,
        },
    );
    h.at(3.5, lost(0));
    h.at(3.5, lost(1));
    let a = h.ticks(3.6, 4.6);
    // Every node is gone.
    assert!(
        failure(&a).contains("every node is lost"),
        "{:?}",
        kinds(&a)
    );
}

#[test]
fn falls_back_to_the_checkpoint_when_no_pipeline_survives_whole() {
    let mut s = spec(4, 1, 10);
    s.checkpoint_every = 2;
    let mut h = H::running(s, plan(&[&[0, 1], &[2, 3]]));
    for step in 1..=3 {
        h.step(f64::from(step as u32), step);
    }
    h.at(
        3.1,
        Input::Assembled {
            step: 2,
            checkpoint: Some("ckpt-2".into()),
            val_loss: None,
            duration_s: 0.1,
        },
    );
    h.at(3.5, lost(0));
    h.at(3.5, lost(2));
    h.broken(3.6, 1, 3);
    h.broken(3.6, 3, 3);
    let a = h.ticks(3.7, 4.6);
    let Event::Reconfig {
        from_step,
        replayed_steps,
        rescued,
        checkpoint,
        ..
    } = reconfig(&a)
    else {
        unreachable!()
    };
    assert_eq!((from_step, replayed_steps, rescued), (2, 1, false));
    assert_eq!(checkpoint.as_deref(), Some("ckpt-2"));
    assert!(has(&a, "truncate:2"));
}

#[test]
fn with_f_zero_a_loss_ends_the_job() {
    let mut h = H::running(spec(2, 0, 10), plan(&[&[0, 1]]));
    h.step(1.0, 1);
    let a = h.at(1.5, lost(1));
    assert!(failure(&a).contains("node 1 was lost"));
    assert!(h.m.is_over());
}

#[test]
fn a_hung_agent_found_by_its_lease_is_fenced() {
    let mut h = H::running(spec(3, 1, 10), plan(&[&[0], &[1, 2]]));
    h.step(1.0, 1);
    // The agent of node 2 is stopped (SIGSTOP): its process lives, its lease runs out.
    h.at(
        6.0,
        Input::Lost {
            node: 2,
            reason: "LeaseExpired { lease_ms: 5000 }".into(),
        },
    );
    h.broken(6.1, 0, 1);
    h.broken(6.1, 1, 1);
    let a = h.ticks(6.2, 7.2);
    assert!(has(&a, "fence:2"), "{:?}", kinds(&a));
}

#[test]
fn settling_waits_for_every_dead_agent_to_be_reported_lost() {
    let mut h = H::running(spec(3, 1, 10), plan(&[&[0], &[1, 2]]));
    h.step(1.0, 1);
    h.at(
        1.1,
        Input::AgentExited {
            which: 2,
            status: "signal 9".into(),
        },
    );
    h.broken(1.2, 0, 1);
    h.broken(1.2, 1, 1);
    // Node 2's loss is not known yet: no decision, however long the settle time passed.
    assert!(!has(&h.ticks(1.3, 5.0), "plan"));
    let a = h.at(5.1, lost(2));
    assert!(has(&a, "save:[0]@1"), "{:?}", kinds(&a));
}

#[test]
fn repeated_fruitless_recoveries_give_up() {
    let mut h = H::running(spec(4, 1, 10), plan(&[&[0], &[1], &[2], &[3]]));
    let mut t = 1.0;
    let mut nodes: Vec<u32> = vec![0, 1, 2, 3];
    let mut last = Vec::new();
    for victim in [3, 2, 1] {
        let a = h.at(t, lost(victim));
        nodes.retain(|&n| n != victim);
        last = a;
        if h.m.is_over() {
            break;
        }
        for (rank, _) in nodes.iter().enumerate() {
            h.broken(t + 0.05, rank as u32, 0);
        }
        let a = h.ticks(t + 0.1, t + 1.5);
        let p: Vec<Vec<u32>> = nodes.iter().map(|&n| vec![n]).collect();
        let refs: Vec<&[u32]> = p.iter().map(|v| v.as_slice()).collect();
        assert!(has(&a, "plan"), "{:?}", kinds(&a));
        h.at(t + 1.6, Input::Planned(Ok(plan(&refs))));
        h.listen_all(t + 1.7);
        t += 2.0;
    }
    // Three recoveries without a commit were allowed; the fourth failure gives up.
    let a = h.at(t, lost(0));
    last.extend(a);
    assert!(
        failure(&last).contains("recoveries in a row without a committed step"),
        "{:?}",
        kinds(&last)
    );
}

#[test]
fn a_worker_failing_while_its_generation_forms_ends_the_job() {
    let mut h = H::new(spec(2, 1, 10));
    h.at(0.0, joined(0));
    h.at(0.0, joined(1));
    h.at(0.1, Input::Planned(Ok(plan(&[&[0], &[1]]))));
    let a = h.worker(
        0.5,
        1,
        WorkerReport::Exited {
            rank: 1,
            status: ExitStatus {
                code: Some(1),
                signal: None,
            },
            error: Some("cannot bind a data-plane port on 203.0.113.7".into()),
        },
    );
    let e = failure(&a);
    assert!(
        e.contains("exited (exit code 1) while the data plane formed") && e.contains("203.0.113.7"),
        "{e}"
    );
}

#[test]
fn no_report_for_the_stall_timeout_ends_the_job() {
    let mut h = H::running(spec(2, 1, 10), plan(&[&[0], &[1]]));
    assert!(h.at(100.0, Input::Tick).is_empty());
    let a = h.at(181.0, Input::Tick);
    assert!(failure(&a).contains("no progress for 180 s"));
}

#[test]
fn a_node_joining_a_running_job_is_refused() {
    let mut h = H::running(spec(2, 1, 10), plan(&[&[0], &[1]]));
    let a = h.at(1.0, joined(5));
    assert!(failure(&a).contains("node 5 joined during the job"));
}

#[test]
fn no_plan_for_f_after_a_loss_lowers_f() {
    let mut h = H::running(spec(2, 1, 10), plan(&[&[0], &[1]]));
    h.step(1.0, 1);
    h.at(1.5, lost(1));
    h.broken(1.6, 0, 1);
    let a = h.ticks(1.7, 2.7);
    // One node left cannot hold f + 1 = 2 pipelines: plan for f = 0 instead.
    assert!(has(&a, "save:[0]@1"), "{:?}", kinds(&a));
    h.worker(
        2.8,
        0,
        WorkerReport::Saved {
            rank: 0,
            step: 1,
            state: "s".into(),
        },
    );
    let a = h.at(3.0, Input::RescueWritten(Ok("ckpt-1".into())));
    assert_eq!(plan_request(&a), (vec![0], 1));
    let a = h.at(3.1, Input::Planned(Err("needs 2 pipelines".into())));
    assert_eq!(plan_request(&a), (vec![0], 0));
    let a = h.at(3.2, Input::Planned(Ok(plan(&[&[0]]))));
    assert!(has(&a, "note") && has(&a, "deploy"), "{:?}", kinds(&a));
}

#[test]
fn no_plan_at_the_start_ends_the_job() {
    let mut h = H::new(spec(1, 1, 10));
    h.at(0.0, joined(0));
    let a = h.at(
        0.1,
        Input::Planned(Err("1 node cannot hold 2 pipelines".into())),
    );
    assert!(failure(&a).contains("1 node cannot hold 2 pipelines"));
}

#[test]
fn an_injected_failure_kills_its_node_after_its_step() {
    let mut s = spec(2, 1, 10);
    s.inject_failures = vec![InjectedFailure {
        node: 1,
        after_step: 2,
    }];
    let mut h = H::running(s, plan(&[&[0], &[1]]));
    assert!(!has(&h.step(1.0, 1), "kill:1"));
    let a = h.step(2.0, 2);
    assert_eq!(
        kinds(&a),
        ["commit:2", "record:inject_failure", "note", "kill:1"]
    );
}

#[test]
fn rescue_that_does_not_come_falls_back_to_the_checkpoint() {
    let mut h = H::running(spec(3, 1, 10), plan(&[&[0], &[1, 2]]));
    h.step(1.0, 1);
    h.at(1.5, lost(2));
    h.broken(1.6, 0, 1);
    h.broken(1.6, 1, 1);
    let a = h.ticks(1.7, 2.7);
    assert!(has(&a, "save:[0]@1"));
    let a = h.ticks(2.8, 33.0);
    let Event::Reconfig {
        from_step, rescued, ..
    } = reconfig(&a)
    else {
        unreachable!()
    };
    assert_eq!((from_step, rescued), (0, false));
}

#[test]
fn the_first_commit_after_a_recovery_records_its_phases() {
    let mut h = H::running(spec(3, 1, 10), plan(&[&[0], &[1, 2]]));
    h.step(1.0, 1);
    h.at(1.5, lost(2));
    h.broken(1.6, 0, 1);
    h.broken(1.6, 1, 1);
    h.ticks(1.7, 2.7);
    h.worker(
        2.8,
        0,
        WorkerReport::Saved {
            rank: 0,
            step: 1,
            state: "s".into(),
        },
    );
    h.at(3.0, Input::RescueWritten(Ok("ckpt-1".into())));
    h.at(3.1, Input::Planned(Ok(plan(&[&[0], &[1]]))));
    h.listen_all(3.5);
    let a = h.step(4.0, 2);
    let resumed = a
        .iter()
        .find_map(|a| match a {
            Action::Record(Event::Resumed {
                phases,
                since_failure_s,
                ..
            }) => Some((phases.clone(), *since_failure_s)),
            _ => None,
        })
        .expect("a resumed event");
    let names: Vec<&str> = resumed.0.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "detect_s",
            "load_connect_first_step_s",
            "plan_s",
            "rescue_s",
            "spawn_s"
        ]
    );
    assert!((resumed.1 - 2.5).abs() < 1e-9, "{}", resumed.1);
}
