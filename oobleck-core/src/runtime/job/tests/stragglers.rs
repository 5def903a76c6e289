//! Stragglers in the machine: named once with the numbers, shown to status, and with
//! `--evict-stragglers` drained through the same path as `oobleck drain`, or said to stay
//! when the drain would cost the job.

use std::collections::BTreeMap;

use super::*;
use crate::execution::StepTimes;

/// Every rank reports `step` ready, rank `r` having computed `compute[r]` ms.
fn timed_step(h: &mut H, t: f64, step: u64, compute: &[f64]) -> Vec<Action> {
    let mut out = Vec::new();
    for rank in 0..h.world() {
        let node = h.node_of(rank);
        let times = StepTimes {
            compute_ms: compute[rank as usize],
            p2p_ms: 5.0,
            collective_ms: 7.0,
            step_ms: 400.0,
            marks: 30,
            ..Default::default()
        };
        let report = WorkerReport::Ready {
            rank,
            step,
            loss: 2.5,
            grad_norm: 0.5,
            microbatches: h.first_microbatch(rank),
            samples: None,
            times: Some(times),
        };
        out.extend(h.worker(t, node, report));
    }
    out
}

/// Steps `from..=to`, one a second; the actions of them all.
fn timed_steps(h: &mut H, from: u64, to: u64, compute: &[f64]) -> Vec<Action> {
    (from..=to)
        .flat_map(|s| timed_step(h, s as f64, s, compute))
        .collect()
}

fn stragglers(actions: &[Action]) -> Vec<Event> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Record(e @ Event::Straggler { .. }) => Some(e.clone()),
            _ => None,
        })
        .collect()
}

fn notes(actions: &[Action]) -> Vec<String> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Note(n) => Some(n.clone()),
            _ => None,
        })
        .collect()
}

/// The metrics' per-rank times of the commits, and the last status shown of the ranks:
/// `rank -> straggler`.
fn shown(actions: &[Action]) -> (Vec<BTreeMap<u32, StepTimes>>, BTreeMap<u32, bool>) {
    let commits = actions
        .iter()
        .filter_map(|a| match a {
            Action::Commit { times, .. } => Some(times.clone()),
            _ => None,
        })
        .collect();
    let status = actions
        .iter()
        .rev()
        .find_map(|a| match a {
            Action::RankTimes { ranks, .. } => {
                Some(ranks.iter().map(|r| (r.rank, r.straggler)).collect())
            }
            _ => None,
        })
        .unwrap_or_default();
    (commits, status)
}

#[test]
fn a_rank_slower_than_its_peers_for_five_steps_is_named_once_with_the_numbers() {
    let mut h = H::running(spec(3, 1, 20), plan(&[&[0], &[1], &[2]]));
    let slow = [100.0, 310.0, 120.0];
    let a = timed_steps(&mut h, 1, 4, &slow);
    assert!(stragglers(&a).is_empty(), "{:?}", kinds(&a));
    let (commits, status) = shown(&a);
    assert_eq!(commits.len(), 4);
    assert_eq!(
        commits[0][&1].compute_ms, 310.0,
        "metrics carry each rank's times"
    );
    assert_eq!(status, BTreeMap::from([(0, false), (1, false), (2, false)]));
    let a = timed_step(&mut h, 5.0, 5, &slow);
    let named = stragglers(&a);
    let [Event::Straggler {
        generation,
        step,
        node,
        rank,
        compute_ms,
        peers_median_ms,
        factor,
        steps,
        evicted,
        refusal,
    }] = &named[..]
    else {
        panic!("one straggler event: {named:?}");
    };
    assert_eq!((*generation, *step, *node, *rank, *steps), (0, 5, 1, 1, 5));
    assert_eq!((*compute_ms, *peers_median_ms), (310.0, 110.0));
    assert!((factor - 310.0 / 110.0).abs() < 1e-9);
    assert!(!evicted && refusal.is_none());
    let said = notes(&a).join("\n");
    assert!(
        said.contains(
            "rank 1 on node 1 is a straggler: compute 310 ms per step vs its peers' 110 ms \
             (2.8x) for 5 steps; in 1F1B it holds every pipeline back"
        ),
        "{said}"
    );
    assert_eq!(
        shown(&a).1,
        BTreeMap::from([(0, false), (1, true), (2, false)])
    );
    assert!(
        !has(&a, "record:drain") && !has(&a, "abort:0"),
        "{:?}",
        kinds(&a)
    );
    // Still slow: not named again, and never stopped for it.
    let a = timed_steps(&mut h, 6, 12, &slow);
    assert!(
        stragglers(&a).is_empty() && !has(&a, "abort:0"),
        "{:?}",
        kinds(&a)
    );
    assert_eq!(h.m.committed(), 12);
}

#[test]
fn ranks_of_different_pipelines_computing_their_planned_work_are_not_stragglers() {
    // Pipeline 0 on node 0 runs both layers; pipeline 1 splits them over nodes 1 and 2, with
    // three times the microbatches: planned work 2 : 3 : 3.
    let mut p = plan_with(
        1,
        &[&[0], &[1, 2]],
        &[vec![vec![0]], vec![vec![0], vec![0]]],
    );
    p.templates[0].stages[0].forward_ns = 2;
    p.templates[0].stages[0].backward_ns = 2;
    p.pipelines[1].microbatches = 3;
    let mut h = H::running(spec(3, 1, 20), p);
    let a = timed_steps(&mut h, 1, 8, &[100.0, 150.0, 160.0]);
    assert!(stragglers(&a).is_empty(), "{:?}", kinds(&a));
    // Node 0 at twice its rate is one, against the 100 ms its peers would take.
    let a = timed_steps(&mut h, 9, 13, &[200.0, 150.0, 150.0]);
    let named = stragglers(&a);
    assert!(
        matches!(named[..], [Event::Straggler { rank: 0, peers_median_ms, .. }] if (peers_median_ms - 100.0).abs() < 1e-9),
        "{named:?}"
    );
}

#[test]
fn evict_stragglers_drains_the_node_through_the_drain_path() {
    let mut h = H::running(spec(3, 1, 20), plan(&[&[0], &[1], &[2]]));
    h.m.stragglers.rule_mut().evict = true;
    let slow = [100.0, 100.0, 400.0];
    timed_steps(&mut h, 1, 4, &slow);
    let a = timed_step(&mut h, 5.0, 5, &slow);
    let named = stragglers(&a);
    assert!(
        matches!(
            named[..],
            [Event::Straggler {
                node: 2,
                evicted: true,
                refusal: None,
                ..
            }]
        ),
        "{named:?}"
    );
    let k = kinds(&a);
    let at = |kind: &str| k.iter().position(|x| x == kind);
    assert!(
        at("record:straggler") < at("record:drain") && at("record:drain") < at("abort:0"),
        "recorded, drained as `oobleck drain` would, taken at this boundary: {k:?}"
    );
    assert!(!has(&a, "record:failure"), "{k:?}");
    let said = notes(&a).join("\n");
    assert!(
        said.contains("--evict-stragglers: node 2 drains at the next step boundary"),
        "{said}"
    );
    assert!(
        said.contains(
            "node 2 drains at the next step boundary (straggler: rank 2 computes 4.0x its peers)"
        ),
        "{said}"
    );
    let mut last = Vec::new();
    for rank in 0..h.world() {
        last = h.broken(5.1, rank, 5);
    }
    assert!(has(&last, "reconfigure:[]-[2]"), "{:?}", kinds(&last));
}

#[test]
fn a_straggler_whose_drain_is_refused_is_said_and_training_goes_on() {
    // One pipeline over both nodes: draining either leaves too few for it.
    let mut h = H::running(spec(2, 0, 20), plan(&[&[0, 1]]));
    h.m.stragglers.rule_mut().evict = true;
    let a = timed_steps(&mut h, 1, 5, &[100.0, 300.0]);
    let named = stragglers(&a);
    let [Event::Straggler {
        node: 1,
        evicted: false,
        refusal: Some(why),
        ..
    }] = &named[..]
    else {
        panic!("one straggler event, not drained: {named:?}");
    };
    assert!(
        why.starts_with("draining leaves 1 of 2 nodes; the smallest pipeline needs 2"),
        "{why}"
    );
    let said = notes(&a).join("\n");
    assert!(
        said.contains("--evict-stragglers: node 1 is not drained (draining leaves 1 of 2 nodes"),
        "{said}"
    );
    assert!(said.contains("training goes on"), "{said}");
    assert!(
        !has(&a, "record:drain") && !has(&a, "abort:0"),
        "{:?}",
        kinds(&a)
    );
    let a = timed_steps(&mut h, 6, 9, &[100.0, 300.0]);
    assert!(
        has(&a, "commit:9") && !has(&a, "abort:0"),
        "{:?}",
        kinds(&a)
    );
}

#[test]
fn a_straggler_named_at_the_last_step_is_not_drained() {
    let mut h = H::running(spec(3, 1, 5), plan(&[&[0], &[1], &[2]]));
    h.m.stragglers.rule_mut().evict = true;
    let a = timed_steps(&mut h, 1, 5, &[100.0, 100.0, 400.0]);
    assert!(
        matches!(
            stragglers(&a)[..],
            [Event::Straggler {
                evicted: false,
                refusal: None,
                ..
            }]
        ),
        "{:?}",
        kinds(&a)
    );
    assert!(
        !has(&a, "record:drain") && !has(&a, "abort:0"),
        "{:?}",
        kinds(&a)
    );
}

#[test]
fn steps_without_times_show_nothing_and_name_nobody() {
    let mut h = H::running(spec(3, 1, 20), plan(&[&[0], &[1], &[2]]));
    let a: Vec<Action> = (1..=6).flat_map(|s| h.step(s as f64, s)).collect();
    assert!(
        !has(&a, "rank_times") && stragglers(&a).is_empty(),
        "{:?}",
        kinds(&a)
    );
    let (commits, _) = shown(&a);
    assert!(commits.iter().all(BTreeMap::is_empty));
}
