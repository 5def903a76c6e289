//! A restarted master re-adopting the lost master's agents (`--reattach`): who comes back,
//! what each holds, the commit told again, and the recovery in place that follows.

use super::*;
use crate::runtime::wire::pipe::StateSource;
use crate::runtime::wire::protocol::Return;

/// A master restarted on a run whose last plan is `plans`' last, with step `committed`
/// recorded as committed and a checkpoint of step 2.
fn reattaching(spec: TrainingSpec, plans: Vec<Plan>, committed: u64) -> H {
    let generation = plans.last().map_or(0, |p| p.generation + 1);
    let start = JobStart {
        step: committed,
        checkpoint: None,
        generation,
        starts_agents: false,
        announce_joins: true,
        reattach: Some(Reattach {
            plans,
            committed,
            newest: Some(("ckpt-2".into(), 2)),
            epoch: 2,
            why: "a test takes over".into(),
        }),
    };
    H {
        m: JobMachine::new(spec, start, Limits::default(), Duration::ZERO),
        now: Duration::ZERO,
    }
}

/// Generation 3 of a 3-node job: pipelines [0] and [1, 2].
fn gen3() -> Plan {
    let mut p = plan(&[&[0], &[1, 2]]);
    p.generation = 3;
    p
}

fn back(node: u32, generation: u64, committed: u64, ranks: &[u32]) -> Input {
    Input::Returned {
        node,
        addr: format!("127.0.0.1:{}", 6000 + node),
        back: Return {
            node,
            devices: 1,
            generation,
            committed,
            ranks: ranks.to_vec(),
            without_master_ms: 1500,
            epoch: 1,
        },
    }
}

fn stopping(h: &mut H, t: f64, rank: u32) -> Vec<Action> {
    h.worker(t, h.node_of(rank), WorkerReport::Stopping { rank })
}

#[test]
fn every_agent_back_is_re_adopted_and_the_job_goes_on_in_place_from_the_committed_step() {
    let mut h = reattaching(spec(3, 1, 50), vec![plan(&[&[0, 1, 2]]), gen3()], 7);
    assert!(h
        .at(0.5, back(0, 3, 7, &[0]))
        .iter()
        .all(|a| !matches!(a, Action::Abort { .. })));
    h.at(0.6, back(1, 3, 7, &[1]));
    // The last one missed the commit of step 7: it is told again, before the abort.
    let a = h.at(0.7, back(2, 3, 6, &[2]));
    let k = kinds(&a);
    let recommit = k
        .iter()
        .position(|x| x == "recommit:2:7")
        .expect("recommit");
    let abort = k.iter().position(|x| x == "abort:3").expect("abort");
    assert!(recommit < abort && has(&a, "end_returns"), "{k:?}");
    assert_eq!(h.m.generation(), 3);
    assert_eq!(h.m.committed(), 7);
    stopping(&mut h, 0.8, 0);
    stopping(&mut h, 0.8, 1);
    let a = stopping(&mut h, 0.8, 2);
    let (held, lost) = reconfigure_request(&a);
    assert!(lost.is_empty(), "{lost:?}");
    for (node, layer) in [(0, 0), (1, 0), (2, 1)] {
        assert_eq!(held.layers(node, 0), Some([layer].into()), "node {node}");
    }
    let a = h.reconfigured(0.9, gen3(), 0, Vec::new());
    let StateSource::Peers { step, .. } = deployed(&a) else {
        panic!("not in place: {:?}", deployed(&a))
    };
    assert_eq!(step, 7);
    let Event::Reconfig {
        from_step,
        replayed_steps,
        in_place,
        generation,
        ..
    } = reconfig(&a)
    else {
        unreachable!()
    };
    assert_eq!(
        (from_step, replayed_steps, in_place, generation),
        (7, 0, true, 4)
    );
}

#[test]
fn the_first_commit_after_a_take_over_records_its_phases() {
    let mut h = reattaching(spec(3, 1, 50), vec![gen3()], 7);
    // Each agent was 1.5 s without a master when it came back: the first, at 0.5 s, had lost
    // it 1.0 s before this master started.
    h.at(0.5, back(0, 3, 7, &[0]));
    h.at(0.6, back(1, 3, 7, &[1])); // a majority of 3
    h.at(0.7, back(2, 3, 7, &[2])); // every node: re-adopted
    for rank in 0..3 {
        stopping(&mut h, 0.8, rank);
    }
    h.reconfigured(0.9, gen3(), 0, Vec::new());
    h.listen_all(1.0);
    h.form_all(1.1);
    let a = h.step(2.0, 8);
    let took = a
        .iter()
        .find_map(|a| match a {
            Action::Record(e @ Event::MasterTookOver { .. }) => Some(e.clone()),
            _ => None,
        })
        .expect("a master_took_over event");
    let Event::MasterTookOver {
        epoch,
        step,
        nodes_back,
        nodes_lost,
        total_s,
        phases,
    } = took
    else {
        unreachable!()
    };
    assert_eq!((epoch, step), (2, 8));
    assert_eq!((nodes_back, nodes_lost), (vec![0, 1, 2], vec![]));
    let near = |name: &str, want: f64| {
        let got = phases[name];
        assert!((got - want).abs() < 1e-6, "{name}: {got}, not {want}");
    };
    near("detect_s", 1.0);
    near("quorum_s", 0.6);
    near("readopt_s", 0.1);
    near("first_commit_s", 1.3);
    assert!((total_s - 3.0).abs() < 1e-6, "{total_s}");
    // Once: the next commit records no other.
    let a = h.step(2.5, 9);
    assert!(!has(&a, "record:master_took_over"), "{:?}", kinds(&a));
}

#[test]
fn a_node_that_does_not_come_back_in_time_is_lost_and_recovered_from_its_replica() {
    let mut h = reattaching(spec(3, 1, 50), vec![gen3()], 5);
    h.at(1.0, back(0, 3, 5, &[0]));
    h.at(1.5, back(1, 3, 5, &[1]));
    let a = h.ticks(1.6, 1.0 + 7.9);
    assert!(
        !has(&a, "abort:3"),
        "re-adopted before the wait: {:?}",
        kinds(&a)
    );
    let a = h.ticks(9.0, 9.1);
    assert!(
        has(&a, "record:lost") && has(&a, "abort:3"),
        "{:?}",
        kinds(&a)
    );
    stopping(&mut h, 9.2, 0);
    let a = stopping(&mut h, 9.2, 1);
    let (held, lost) = reconfigure_request(&a);
    assert_eq!(lost, vec![2]);
    assert_eq!(held.layers(2, 0), None);
    assert_eq!(held.layers(0, 0), Some([0].into()));
}

#[test]
fn what_cannot_be_counted_on_is_held_by_nobody() {
    let mut h = reattaching(spec(3, 1, 50), vec![gen3()], 9);
    // Node 0 runs another generation; node 1's worker never built its stage (or died).
    h.at(0.1, back(0, 2, 9, &[0]));
    h.at(0.2, back(1, 3, 9, &[]));
    let a = h.at(0.3, back(2, 3, 9, &[2]));
    assert!(has(&a, "abort:3"), "{:?}", kinds(&a));
    // Only rank 2's word is waited for: the others hold nothing to stop.
    let a = stopping(&mut h, 0.4, 2);
    let (held, _) = reconfigure_request(&a);
    assert_eq!(held.layers(0, 0), None);
    assert_eq!(held.layers(1, 0), None);
    assert_eq!(held.layers(2, 0), Some([1].into()));
    // Layer 0 has no holder: back to the newest checkpoint.
    let a = h.reconfigured(0.5, gen3(), 0, vec![0]);
    let StateSource::Checkpoint { path } = deployed(&a) else {
        panic!("in place without layer 0: {:?}", deployed(&a))
    };
    assert_eq!(path.display().to_string(), "ckpt-2");
}

#[test]
fn an_agent_that_comes_back_after_the_re_adoption_is_released() {
    let mut h = reattaching(spec(3, 1, 50), vec![gen3()], 4);
    h.at(0.1, back(0, 3, 4, &[0]));
    h.at(0.2, back(1, 3, 4, &[1]));
    let a = h.ticks(0.3, 8.3);
    assert!(has(&a, "abort:3"), "{:?}", kinds(&a));
    let a = h.at(8.5, back(2, 3, 4, &[2]));
    assert!(has(&a, "release:2"), "{:?}", kinds(&a));
}

#[test]
fn no_agent_back_within_the_join_limit_fails_the_job_and_says_what_to_do() {
    let mut h = reattaching(spec(2, 0, 50), vec![plan(&[&[0, 1]])], 4);
    let a = h.ticks(0.0, 59.9);
    assert!(!a.iter().any(|a| matches!(a, Action::Fail(_))));
    let a = h.ticks(60.0, 60.1);
    let e = failure(&a);
    assert!(e.contains("--reattach") && e.contains("--resume"), "{e}");
}

#[test]
fn a_minority_back_re_adopts_nothing_however_long_it_waits() {
    let mut h = reattaching(spec(3, 1, 50), vec![gen3()], 5);
    h.at(1.0, back(0, 3, 5, &[0]));
    let a = h.ticks(1.1, 59.9);
    assert!(
        !has(&a, "abort:3"),
        "a minority re-adopted: {:?}",
        kinds(&a)
    );
    let a = h.ticks(60.0, 60.1);
    let e = failure(&a);
    assert!(
        e.contains("only 1 of the 3 nodes came back, no majority"),
        "{e}"
    );
}

#[test]
fn a_new_agent_while_re_adopting_joins_the_next_generation() {
    let mut h = reattaching(spec(2, 0, 50), vec![plan(&[&[0, 1]])], 4);
    h.at(0.1, joined(7));
    h.at(0.2, back(0, 0, 4, &[0]));
    h.at(0.3, back(1, 0, 4, &[1]));
    stopping(&mut h, 0.4, 0);
    let a = stopping(&mut h, 0.4, 1);
    assert!(has(&a, "reconfigure:[]+[7]"), "{:?}", kinds(&a));
}
