//! Instantiation: the knapsack search equals exhaustive enumeration of template multisets.

use oobleck_core::planning::{
    instantiate_with_sizes, split_batch, JobSpec, PlanError, Stage, Template, TemplateMicrobatches,
    TemplateSet,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};

/// A one-stage-per-node template with given alpha-ish shape.
fn tpl(nodes: u32, t1: u64, w: u64) -> Template {
    let mut stages = Vec::new();
    for i in 0..nodes {
        let time = if i + 1 == nodes {
            w
        } else {
            (t1 - w) / u64::from(nodes - 1).max(1)
        };
        stages.push(Stage {
            layer_start: i as usize,
            layer_end: i as usize + 1,
            node: i,
            first_device: 0,
            devices: 1,
            forward_ns: time / 2,
            backward_ns: time - time / 2,
            p2p_ns: 0,
            memory_bytes: 0,
        });
    }
    let t1: u64 = stages.iter().map(Stage::time_ns).sum();
    let wmax = stages.iter().map(Stage::time_ns).max().unwrap();
    let k = stages.iter().rposition(|s| s.time_ns() == wmax).unwrap();
    let t3 = stages[k..].iter().map(Stage::time_ns).sum();
    Template {
        nodes,
        devices_per_node: 1,
        stages,
        microbatches: 1,
        t1_ns: t1,
        t3_ns: t3,
        bottleneck_stage: k,
        bottleneck_ns: wmax,
        iteration_ns: 0,
        peak_memory_bytes: 0,
    }
}

fn job(f: u32, b: u32) -> JobSpec {
    JobSpec {
        fault_threshold: f,
        microbatch_size: 1,
        global_microbatches: b,
        state_bytes_per_param_byte: 4,
        template_microbatches: TemplateMicrobatches::Auto,
    }
}

/// Every multiset of templates summing to `n` nodes with >= f+1 pipelines; best total time.
fn exhaustive(set: &TemplateSet, f: u32, b: u32, n: u32, sync: u64) -> Option<u64> {
    fn rec(
        i: usize,
        left: u32,
        cur: &mut Vec<usize>,
        set: &TemplateSet,
        out: &mut Vec<Vec<usize>>,
    ) {
        if left == 0 {
            out.push(cur.clone());
            return;
        }
        if i == set.templates.len() {
            return;
        }
        let sz = set.templates[i].nodes;
        rec(i + 1, left, cur, set, out);
        if sz <= left {
            cur.push(i);
            rec(i, left - sz, cur, set, out);
            cur.pop();
        }
    }
    let mut all = Vec::new();
    rec(0, n, &mut Vec::new(), set, &mut all);
    all.into_iter()
        .filter(|m| m.len() as u32 > f && m.len() as u32 <= b)
        .map(|m| {
            let a: Vec<u64> = m.iter().map(|&t| set.templates[t].alpha_ns()).collect();
            let w: Vec<u64> = m.iter().map(|&t| set.templates[t].bottleneck_ns).collect();
            let nb = split_batch(&a, &w, b).unwrap();
            let compute = (0..m.len())
                .map(|i| a[i] + u64::from(nb[i]) * w[i])
                .max()
                .unwrap();
            compute + if m.len() > 1 { sync } else { 0 }
        })
        .min()
}

/// Templates of the given sizes (ascending), the `i`-th shaped by `shapes[i]` = (extra time
/// of one microbatch, bottleneck).
fn set_of(sizes: impl Iterator<Item = u32>, shapes: &[(u64, u64)]) -> TemplateSet {
    let templates: Vec<Template> = sizes
        .zip(shapes)
        .map(|(nodes, &(extra, w))| tpl(nodes, w * u64::from(nodes) + extra, w))
        .collect();
    TemplateSet {
        min_nodes: templates[0].nodes,
        templates,
        layer_state_bytes: vec![1; 8],
    }
}

/// The planner's plan for `n` nodes against [`exhaustive`]: the same time, every node used,
/// more than `f` pipelines, `b` split with at least one each; or both infeasible. Returns
/// whether both had a plan.
fn planner_equals_exhaustive(
    set: &TemplateSet,
    f: u32,
    b: u32,
    n: u32,
    sync: u64,
) -> Result<bool, TestCaseError> {
    let nodes: Vec<u32> = (0..n).collect();
    let want = exhaustive(set, f, b, n, sync);
    let got = instantiate_with_sizes(set, &job(f, b), 1, sync, &nodes, 0);
    match (want, got) {
        (Some(w), Ok(plan)) => {
            prop_assert_eq!(plan.iteration_ns, w);
            prop_assert_eq!(plan.num_nodes(), n);
            prop_assert!(plan.pipelines.len() as u32 > f);
            prop_assert_eq!(plan.batch_split().iter().sum::<u32>(), b);
            prop_assert!(plan.batch_split().iter().all(|&x| x >= 1));
            Ok(true)
        }
        (None, Err(_)) => Ok(false),
        (w, g) => {
            prop_assert!(
                false,
                "exhaustive {:?} vs planner {:?}",
                w,
                g.map(|p| p.iteration_ns)
            );
            Ok(false)
        }
    }
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new_with_rng(
        Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::from_seed(RngAlgorithm::ChaCha, &[11; 32]),
    )
}

#[test]
fn knapsack_instantiation_equals_exhaustive_enumeration() {
    let strat = (
        1u32..=3,                                         // n0
        1u32..=5,                                         // number of templates
        prop::collection::vec((10u64..200, 1u64..40), 5), // (t1 extra, w)
        0u32..=3,                                         // f
        1u32..=40,                                        // B
        4u32..=16,                                        // N
        0u64..50,                                         // sync
    );
    let compared = std::cell::Cell::new(0);
    runner(300)
        .run(&strat, |(n0, count, shapes, f, b, n, sync)| {
            let set = set_of((0..count).map(|i| n0 + i), &shapes);
            if planner_equals_exhaustive(&set, f, b, n, sync)? {
                compared.set(compared.get() + 1);
            }
            Ok(())
        })
        .unwrap();
    assert!(
        compared.get() >= 150,
        "only {} comparable cases",
        compared.get()
    );
}

/// Where pipelines could outnumber microbatches (`B < N / n0`), with template sizes that skip
/// node counts and shapes that make bigger templates slower as often as faster: the search
/// that keeps microbatch totals per node count, not only capacity, against every multiset.
#[test]
fn instantiation_with_more_possible_pipelines_than_microbatches_equals_exhaustive() {
    let strat = (
        prop::collection::btree_set(1u32..=7, 1..=4), // template sizes, gaps allowed
        prop::collection::vec((10u64..400, 1u64..60), 4), // (t1 extra, w)
        0u32..=3,                                     // f
        8u32..=28,                                    // N
        0u64..50,                                     // sync
        1u32..=100,                                   // B as a percentage of N / n0
    );
    let compared = std::cell::Cell::new(0);
    let bound = std::cell::Cell::new(0);
    runner(600)
        .run(&strat, |(sizes, shapes, f, n, sync, pct)| {
            let set = set_of(sizes.iter().copied(), &shapes);
            let n0 = set.min_nodes;
            let b = (n / n0 * pct / 100).max(f + 1);
            if planner_equals_exhaustive(&set, f, b, n, sync)? {
                compared.set(compared.get() + 1);
                if b < n / n0 {
                    bound.set(bound.get() + 1);
                }
            }
            Ok(())
        })
        .unwrap();
    assert!(
        compared.get() >= 150 && bound.get() >= 100,
        "only {} comparable cases, {} with B < N / n0",
        compared.get(),
        bound.get()
    );
}

#[test]
fn batch_smaller_than_pipelines_is_an_error_with_numbers() {
    let set = TemplateSet {
        min_nodes: 2,
        templates: vec![tpl(2, 100, 20), tpl(3, 120, 20)],
        layer_state_bytes: vec![1; 3],
    };
    let nodes: Vec<u32> = (0..12).collect();
    let e = instantiate_with_sizes(&set, &job(4, 3), 1, 0, &nodes, 0).unwrap_err();
    assert_eq!(
        e,
        PlanError::BatchTooSmall {
            global_microbatches: 3,
            pipelines: 5
        }
    );
}

#[test]
fn split_is_balanced_and_deterministic() {
    let nb = split_batch(&[10, 10, 30], &[5, 5, 10], 20).unwrap();
    assert_eq!(nb.iter().sum::<u32>(), 20);
    assert_eq!(nb, split_batch(&[10, 10, 30], &[5, 5, 10], 20).unwrap());
    assert_eq!(split_batch(&[1, 1], &[1, 1], 1), None);
}
