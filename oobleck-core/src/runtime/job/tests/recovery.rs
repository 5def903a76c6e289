//! Failures: settling, the decision, recovery in place, checkpoint fallback, fencing, giving
//! up.

use super::*;
use crate::planning::PlanError;
use crate::runtime::wire::pipe::StateSource;

#[test]
fn a_loss_during_a_step_is_recovered_in_place_with_no_step_lost() {
    let mut h = H::running(spec(3, 1, 10), plan(&[&[0], &[1, 2]]));
    h.step(1.0, 1);
    h.step(2.0, 2);
    let a = h.at(2.5, lost(2));
    assert!(has(&a, "record:failure"), "{:?}", kinds(&a));
    // Rank 0 (pipeline 0) and rank 1 fail their step at their next data-plane operation:
    // every rank's state is known, so the decision is asked for at once (no settle sleep).
    h.broken(2.51, 0, 2);
    let a = h.broken(2.52, 1, 2);
    assert!(has(&a, "fence:2"), "{:?}", kinds(&a));
    assert!(has(&a, "reconfigure:[2]"), "{:?}", kinds(&a));
    let (held, _) = reconfigure_request(&a);
    assert_eq!(held.layers(0, 0).map(|l| l.len()), Some(1));
    assert_eq!(held.layers(2, 0), None, "a lost node holds nothing");
    let a = h.reconfigured(2.6, plan(&[&[0], &[1]]), 1, Vec::new());
    let Event::Reconfig {
        from_step,
        replayed_steps,
        in_place,
        nodes,
        lost_nodes,
        copies,
        ..
    } = reconfig(&a)
    else {
        unreachable!()
    };
    assert_eq!((from_step, replayed_steps, in_place), (2, 0, true));
    assert_eq!((nodes, lost_nodes, copies), (vec![0, 1], vec![2], 1));
    let StateSource::Peers { step, copies, .. } = deployed(&a) else {
        panic!("not in place: {:?}", deployed(&a))
    };
    assert_eq!((step, copies.len()), (2, 1));
    assert!(has(&a, "truncate:2") && !has(&a, "plan"), "{:?}", kinds(&a));
    assert_eq!(h.m.generation(), 1);
}

#[test]
fn a_loss_while_waiting_for_the_commit_counts_the_ready_ranks_as_holders() {
    let mut h = H::running(spec(3, 1, 10), plan(&[&[0], &[1, 2]]));
    h.step(1.0, 1);
    h.ready(1.5, 0, 2);
    h.ready(1.5, 1, 2);
    let a = h.at(1.6, lost(2));
    assert!(has(&a, "reconfigure:[2]"), "{:?}", kinds(&a));
}

#[test]
fn two_losses_before_the_ranks_settle_make_one_reconfiguration() {
    let mut h = H::running(spec(4, 1, 10), plan(&[&[0, 1], &[2, 3]]));
    h.step(1.0, 1);
    let a = h.at(1.2, lost(3));
    assert!(has(&a, "record:failure"));
    let a = h.at(1.5, lost(1));
    assert!(has(&a, "record:lost") && !has(&a, "record:failure"));
    h.broken(1.6, 0, 1);
    let a = h.broken(1.6, 2, 1);
    assert!(has(&a, "fence:1") && has(&a, "fence:3"), "{:?}", kinds(&a));
    assert_eq!(reconfigure_request(&a).1, vec![1, 3]);
    // Both pipelines lost a node: layer 1 has no replica left, and no checkpoint exists.
    let a = h.reconfigured(1.7, plan(&[&[0, 2]]), 0, vec![1]);
    let Event::Reconfig {
        lost_nodes,
        from_step,
        in_place,
        ..
    } = reconfig(&a)
    else {
        unreachable!()
    };
    assert_eq!((lost_nodes, from_step, in_place), (vec![1, 3], 0, false));
    assert_eq!(deployed(&a), StateSource::Init);
    let reconfigs = a
        .iter()
        .filter(|a| matches!(a, Action::Record(Event::Reconfig { .. })))
        .count();
    assert_eq!(reconfigs, 1);
}

#[test]
fn losing_every_node_ends_the_job_and_names_the_newest_checkpoint() {
    let mut s = spec(2, 1, 10);
    s.checkpoint_every = 2;
    let mut h = H::running(s, plan(&[&[0], &[1]]));
    h.steps_to(3);
    h.checkpointed(3.1, 2);
    h.at(3.5, lost(0));
    let a = h.at(3.5, lost(1));
    assert!(has(&a, "reconfigure:[0, 1]"), "{:?}", kinds(&a));
    let no_nodes = PlanError::NoComposition {
        nodes: 0,
        min_pipelines: 1,
        sizes: Vec::new(),
    };
    let a = h.at(3.6, Input::Reconfigured(Err(no_nodes)));
    let e = failure(&a);
    assert!(
        e.contains("every node is lost") && e.contains("ckpt-2"),
        "{e}"
    );
}

/// Over pipelines `[0, 1]` and `[2, 3]` at committed `step`: nodes 0 and 2 are lost at `t`,
/// the survivors fail their step, and the decision finds layer 0 held nowhere.
fn lose_a_node_of_each_pipeline(h: &mut H, t: f64, step: u64) -> Vec<Action> {
    h.at(t, lost(0));
    h.at(t, lost(2));
    h.broken(t + 0.1, 1, step);
    h.broken(t + 0.1, 3, step);
    h.reconfigured(t + 0.2, plan(&[&[1, 3]]), 0, vec![0])
}

#[test]
fn layers_without_a_replica_fall_back_to_the_newest_checkpoint() {
    let mut s = spec(4, 1, 10);
    s.checkpoint_every = 2;
    let mut h = H::running(s, plan(&[&[0, 1], &[2, 3]]));
    h.steps_to(3);
    h.checkpointed(3.1, 2);
    let a = lose_a_node_of_each_pipeline(&mut h, 3.5, 3);
    let Event::Reconfig {
        from_step,
        replayed_steps,
        in_place,
        checkpoint,
        ..
    } = reconfig(&a)
    else {
        unreachable!()
    };
    assert_eq!((from_step, replayed_steps, in_place), (2, 1, false));
    assert_eq!(checkpoint.as_deref(), Some("ckpt-2"));
    assert_eq!(
        deployed(&a),
        StateSource::Checkpoint {
            path: "ckpt-2".into()
        }
    );
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
            reason: LossReason::LeaseExpired { lease_ms: 5000 },
        },
    );
    h.broken(6.1, 0, 1);
    let a = h.broken(6.1, 1, 1);
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
            node: None,
            status: "signal 9".into(),
        },
    );
    h.broken(1.2, 0, 1);
    h.broken(1.2, 1, 1);
    // Node 2's loss is not known yet: no decision, however long that takes (up to the wait).
    assert!(!has(&h.ticks(1.3, 5.0), "reconfigure:[2]"));
    let a = h.at(5.1, lost(2));
    assert!(has(&a, "reconfigure:[2]"), "{:?}", kinds(&a));
}

#[test]
fn a_worker_that_died_on_a_live_node_holds_nothing() {
    let mut h = H::running(spec(2, 1, 10), plan(&[&[0], &[1]]));
    h.step(1.0, 1);
    let a = h.worker(
        1.5,
        1,
        WorkerReport::Exited {
            rank: 1,
            status: ExitStatus {
                code: None,
                signal: Some(9),
            },
            error: None,
        },
    );
    assert!(has(&a, "record:failure"), "{:?}", kinds(&a));
    let a = h.broken(1.6, 0, 1);
    let (held, lost) = reconfigure_request(&a);
    assert!(lost.is_empty());
    assert!(held.layers(0, 0).is_some() && held.layers(1, 0).is_none());
    // Node 1 stays in the job: its fresh worker gets its layers from node 0.
    let a = h.reconfigured(1.7, plan(&[&[0], &[1]]), 1, Vec::new());
    assert!(matches!(deployed(&a), StateSource::Peers { step: 1, .. }));
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
        let mut a = Vec::new();
        for (rank, _) in nodes.iter().enumerate() {
            a = h.broken(t + 0.05, rank as u32, 0);
        }
        assert!(
            has(&a, &format!("reconfigure:[{victim}]")),
            "{:?}",
            kinds(&a)
        );
        let p: Vec<Vec<u32>> = nodes.iter().map(|&n| vec![n]).collect();
        let refs: Vec<&[u32]> = p.iter().map(|v| v.as_slice()).collect();
        h.reconfigured(t + 0.1, plan(&refs), 0, vec![0]);
        h.listen_all(t + 0.2);
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
fn no_decision_after_a_loss_plans_afresh_and_lowers_f() {
    let mut h = H::running(spec(2, 1, 10), plan(&[&[0], &[1]]));
    h.step(1.0, 1);
    h.at(1.5, lost(1));
    let a = h.broken(1.6, 0, 1);
    assert!(has(&a, "reconfigure:[1]"), "{:?}", kinds(&a));
    let no_template = PlanError::NoComposition {
        nodes: 1,
        min_pipelines: 2,
        sizes: vec![1],
    };
    let a = h.at(1.7, Input::Reconfigured(Err(no_template)));
    assert_eq!(plan_request(&a), (vec![0], 1));
    // One node left cannot hold f + 1 = 2 pipelines: plan for f = 0 instead.
    let needs_two = RuntimeError::Plan {
        nodes: 1,
        reason: "needs 2 pipelines".into(),
    };
    let a = h.at(3.1, Input::Planned(Err(needs_two)));
    assert_eq!(plan_request(&a), (vec![0], 0));
    let a = h.at(3.2, Input::Planned(Ok(plan(&[&[0]]))));
    assert!(has(&a, "note") && has(&a, "deploy"), "{:?}", kinds(&a));
    assert_eq!(deployed(&a), StateSource::Init);
}

#[test]
fn the_first_commit_after_a_recovery_records_its_phases() {
    let mut h = H::running(spec(3, 1, 10), plan(&[&[0], &[1, 2]]));
    h.step(1.0, 1);
    h.at(1.5, lost(2));
    h.broken(1.6, 0, 1);
    h.broken(1.6, 1, 1);
    h.reconfigured(1.7, plan(&[&[0], &[1]]), 1, Vec::new());
    h.listen_all(2.0);
    h.form_all(2.5);
    let a = h.step(4.0, 2);
    let resumed = a
        .iter()
        .find_map(|a| match a {
            Action::Record(Event::Resumed {
                phases,
                since_failure_s,
                copy_bytes,
                ..
            }) => Some((phases.clone(), *since_failure_s, *copy_bytes)),
            _ => None,
        })
        .expect("a resumed event");
    let names: Vec<&str> = resumed.0.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "connect_copy_s",
            "connect_max_s",
            "copy_max_s",
            "decide_s",
            "detect_s",
            "first_step_s",
            "restart_s"
        ]
    );
    assert!(
        (resumed.0["detect_s"] - 0.1).abs() < 1e-9,
        "{:?}",
        resumed.0
    );
    assert!((resumed.1 - 2.5).abs() < 1e-9, "{}", resumed.1);
    assert_eq!(resumed.2, 200, "two ranks reported 100 bytes copied each");
    let said = a
        .iter()
        .find_map(|a| match a {
            Action::Note(n) if n.starts_with("recovered") => Some(n.clone()),
            _ => None,
        })
        .expect("a progress line");
    assert!(
        said.contains("node 2 lost at step 1: 2 pipelines -> 2 (templates 1+1 nodes)")
            && said.contains("tolerates 1 more failure"),
        "{said}"
    );
}

#[test]
fn a_corrupted_copy_makes_the_next_decision_skip_that_replica() {
    let mut h = H::running(spec(3, 1, 10), plan(&[&[0], &[1, 2]]));
    h.step(1.0, 1);
    h.at(1.5, lost(2));
    h.broken(1.6, 0, 1);
    h.broken(1.6, 1, 1);
    h.reconfigured(1.7, plan(&[&[0], &[1]]), 1, Vec::new());
    h.listen_all(1.8);
    // Rank 1 finds layer 0 from rank 0 corrupted while the new generation copies.
    let a = h.worker(
        1.9,
        1,
        WorkerReport::Broken {
            rank: 1,
            step: 1,
            error: "layer 0 from rank 0: arrived corrupted".into(),
            corrupt: Some(crate::runtime::wire::records::CorruptCopy { layer: 0, from: 0 }),
        },
    );
    assert!(
        a.iter()
            .any(|a| matches!(a, Action::Note(n) if n.contains("arrived corrupted at rank 1"))),
        "{:?}",
        kinds(&a)
    );
    let a = h.broken(1.95, 0, 1);
    let (held, _) = reconfigure_request(&a);
    // Node 0's replica of layer 0 is not offered again.
    assert_eq!(held.layers(0, 0).map(|l| l.contains(&0)), None);
}

#[test]
fn an_unreadable_fallback_checkpoint_falls_back_further_and_says_so() {
    let mut s = spec(4, 1, 10);
    s.checkpoint_every = 2;
    let mut h = H::running(s, plan(&[&[0, 1], &[2, 3]]));
    h.steps_to(5);
    h.checkpointed(3.1, 2);
    h.checkpointed(5.1, 4);
    let a = lose_a_node_of_each_pipeline(&mut h, 5.5, 5);
    assert_eq!(
        deployed(&a),
        StateSource::Checkpoint {
            path: "ckpt-4".into()
        }
    );
    let a = h.at(
        5.8,
        Input::CheckpointRefused {
            path: "ckpt-4".into(),
            reason: "model.safetensors is 10 bytes short".into(),
            instead: Some(("ckpt-2".into(), 2)),
        },
    );
    assert!(has(&a, "record:checkpoint_refused") && has(&a, "truncate:2"));
    assert!(
        a.iter().any(|a| matches!(a, Action::Note(n)
            if n.contains("ckpt-4 cannot be used") && n.contains("ckpt-2 (step 2)"))),
        "{:?}",
        kinds(&a)
    );
    assert_eq!(
        deployed(&a),
        StateSource::Checkpoint {
            path: "ckpt-2".into()
        }
    );
    assert_eq!(h.m.committed(), 2);
}

#[test]
fn ranks_still_computing_that_confirm_they_stop_do_not_hold_up_the_decision() {
    let mut h = H::running(spec(3, 1, 10), plan(&[&[0], &[1, 2]]));
    h.step(1.0, 1);
    let a = h.at(1.5, lost(2));
    assert!(has(&a, "abort:0"), "{:?}", kinds(&a));
    // Rank 1 failed at once; rank 0 (a whole pipeline on node 0) is still in its step.
    let a = h.broken(1.51, 1, 1);
    assert!(!has(&a, "reconfigure:[2]"), "{:?}", kinds(&a));
    let a = h.worker(1.52, 0, WorkerReport::Stopping { rank: 0 });
    assert!(has(&a, "reconfigure:[2]"), "{:?}", kinds(&a));
    // Node 0 still counts as holding its layers: it is at the committed step.
    let (held, _) = reconfigure_request(&a);
    assert!(held.layers(0, 0).is_some());
}

#[test]
fn a_worker_exit_reported_after_its_generation_ended_still_empties_its_device() {
    let mut h = H::running(spec(3, 1, 10), plan(&[&[0], &[1, 2]]));
    h.step(1.0, 1);
    h.at(1.5, lost(2));
    h.broken(1.51, 0, 1);
    h.worker(1.52, 1, WorkerReport::Stopping { rank: 1 });
    // The decision trusted rank 1 (it said it stops), and generation 1 starts...
    h.reconfigured(1.6, plan(&[&[0], &[1]]), 0, Vec::new());
    // ...when rank 1's death, from generation 0, arrives.
    let exited = WorkerReport::Exited {
        rank: 1,
        status: ExitStatus {
            code: None,
            signal: Some(9),
        },
        error: None,
    };
    h.at(
        1.7,
        Input::Worker {
            node: 1,
            generation: 0,
            report: exited,
        },
    );
    assert_eq!(
        h.m.replicas.holdings().layers(1, 0),
        None,
        "node 1's worker is gone"
    );
}

/// A worker SIGKILLed while the generation's data plane forms (the rendezvous went out, no
/// rank built its stage yet): its agent's report of the exit aborts the generation at once,
/// the survivors' confirmations settle it, and the decision is asked for in the same instant
/// (no timeout): no node is lost, the dead worker's node stays in the job.
#[test]
fn a_worker_killed_during_the_rendezvous_aborts_and_reforms_at_once() {
    let mut h = H::new(spec(3, 1, 10));
    for node in 0..3 {
        h.at(0.0, joined(node));
    }
    h.at(0.1, Input::Planned(Ok(plan(&[&[0], &[1, 2]]))));
    h.listen_all(0.2);
    let exited = WorkerReport::Exited {
        rank: 1,
        status: ExitStatus {
            code: None,
            signal: Some(9),
        },
        error: None,
    };
    let a = h.worker(0.3, 1, exited);
    assert!(has(&a, "abort:0"), "{:?}", kinds(&a));
    assert!(
        has(&a, "record:failure") && !has(&a, "fail"),
        "{:?}",
        kinds(&a)
    );
    // The survivors were connecting: each stops (the abort cancels its connect) and says so.
    for rank in [0, 2] {
        h.worker(0.31, h.node_of(rank), WorkerReport::Stopping { rank });
    }
    h.broken(0.32, 0, 0);
    let a = h.broken(0.32, 2, 0);
    assert!(has(&a, "reconfigure:[]"), "{:?}", kinds(&a));
    let a = h.reconfigured(0.4, plan(&[&[0], &[1, 2]]), 0, Vec::new());
    assert!(has(&a, "deploy") && !has(&a, "fail"), "{:?}", kinds(&a));
    assert_eq!(h.m.generation(), 1);
}

/// A report of an earlier generation, or of a generation the job has not reached, arriving
/// while a generation forms changes nothing: it is never taken for the running one.
#[test]
fn reports_of_other_generations_during_a_rendezvous_are_dropped() {
    let mut h = H::new(spec(3, 1, 10));
    for node in 0..3 {
        h.at(0.0, joined(node));
    }
    h.at(0.1, Input::Planned(Ok(plan(&[&[0], &[1, 2]]))));
    h.listen_all(0.2);
    let future = Input::Worker {
        node: 2,
        generation: 5,
        report: WorkerReport::Stopping { rank: 0 },
    };
    let a = h.at(0.3, future);
    assert!(!has(&a, "abort:0") && !has(&a, "fail"), "{:?}", kinds(&a));
    assert!(h.m.gen.as_ref().unwrap().stopping.is_empty());
}
