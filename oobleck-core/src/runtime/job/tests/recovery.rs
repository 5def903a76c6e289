//! Failures: settling, rescue from the survivors, checkpoint fallback, fencing, giving up.

use super::*;

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
    let a = h.saved(3.7, 0, 2);
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
    h.steps_to(3);
    h.checkpointed(3.1, 2);
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
    h.steps_to(3);
    h.checkpointed(3.1, 2);
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
fn no_plan_for_f_after_a_loss_lowers_f() {
    let mut h = H::running(spec(2, 1, 10), plan(&[&[0], &[1]]));
    h.step(1.0, 1);
    h.at(1.5, lost(1));
    h.broken(1.6, 0, 1);
    let a = h.ticks(1.7, 2.7);
    // One node left cannot hold f + 1 = 2 pipelines: plan for f = 0 instead.
    assert!(has(&a, "save:[0]@1"), "{:?}", kinds(&a));
    h.saved(2.8, 0, 1);
    let a = h.at(3.0, Input::RescueWritten(Ok("ckpt-1".into())));
    assert_eq!(plan_request(&a), (vec![0], 1));
    let a = h.at(3.1, Input::Planned(Err("needs 2 pipelines".into())));
    assert_eq!(plan_request(&a), (vec![0], 0));
    let a = h.at(3.2, Input::Planned(Ok(plan(&[&[0]]))));
    assert!(has(&a, "note") && has(&a, "deploy"), "{:?}", kinds(&a));
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
    h.saved(2.8, 0, 1);
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
