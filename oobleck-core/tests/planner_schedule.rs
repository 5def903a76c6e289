//! The 1F1B simulator against the closed-form cost model.

use oobleck_core::planning::template::objective_of;
use oobleck_core::schedule::{makespan_bounds, simulate, stage_stream, Instruction, StageTimes};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

fn runner(cases: u32) -> TestRunner {
    TestRunner::new_with_rng(
        Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::from_seed(RngAlgorithm::ChaCha, &[5; 32]),
    )
}

/// Closed form of DESIGN.md section 3 (Eq. 1-4, no floor).
fn closed(w: &[u64], m: u64) -> i128 {
    let wmax = *w.iter().max().unwrap();
    let k = w.iter().rposition(|&x| x == wmax).unwrap();
    let t1: u64 = w.iter().sum();
    let t3: u64 = w[k..].iter().sum();
    t1 as i128 + (m as i128 - w.len() as i128 + k as i128 - 1) * wmax as i128 + t3 as i128
}

#[test]
fn closed_form_is_exact_on_equal_stages() {
    runner(100)
        .run(
            &(1usize..8, 1u32..24, 1u64..50, 1u64..50),
            |(s, m, f, b)| {
                let st = vec![
                    StageTimes {
                        forward_ns: f,
                        backward_ns: b
                    };
                    s
                ];
                let sim = simulate(&st, &vec![0; s - 1], m);
                let w = vec![f + b; s];
                prop_assert_eq!(sim.makespan_ns as i128, closed(&w, u64::from(m)));
                prop_assert_eq!(u128::from(sim.makespan_ns), objective_of(&w, u64::from(m)));
                Ok(())
            },
        )
        .unwrap();
}

#[test]
fn cost_model_lower_bounds_the_simulator_and_is_exact_with_a_last_bottleneck() {
    let strat = (1usize..7, 1u32..20)
        .prop_flat_map(|(s, m)| (prop::collection::vec((0u64..40, 0u64..80), s), Just(m)));
    runner(200)
        .run(&strat, |(fb, m)| {
            let st: Vec<StageTimes> = fb
                .iter()
                .map(|&(f, b)| StageTimes {
                    forward_ns: f,
                    backward_ns: b,
                })
                .collect();
            let sim = simulate(&st, &vec![0; st.len() - 1], m).makespan_ns;
            let (lo, hi) = makespan_bounds(&st, m);
            prop_assert!(lo <= sim && sim <= hi, "{} <= {} <= {}", lo, sim, hi);
            // The planner's T(m) is floored by the bottleneck chain, itself a lower bound.
            let w: Vec<u64> = fb.iter().map(|&(f, b)| f + b).collect();
            let k = w
                .iter()
                .rposition(|&x| x == *w.iter().max().unwrap())
                .unwrap();
            let chain: u64 = w[..k].iter().sum::<u64>() + u64::from(m) * w[k];
            prop_assert!(u128::from(chain) <= objective_of(&w, u64::from(m)));
            prop_assert!(chain <= sim);
            prop_assert!(
                objective_of(&w, u64::from(m)) <= u128::from(sim),
                "T above sim: {:?} m={}",
                w,
                m
            );
            // With the bottleneck last, the closed form is exact whatever the other stages.
            if k == w.len() - 1 {
                prop_assert_eq!(sim as i128, closed(&w, u64::from(m)));
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn closed_form_underestimates_an_early_bottleneck() {
    // Why T(m) is floored: stage 0 of 10 ns then a 0 ns stage, m = 8: Eq. 1-4 gives 70, but
    // stage 0 alone must run 8 forwards and backwards (80).
    let st = [
        StageTimes {
            forward_ns: 4,
            backward_ns: 6,
        },
        StageTimes {
            forward_ns: 0,
            backward_ns: 0,
        },
    ];
    assert_eq!(closed(&[10, 0], 8), 70);
    assert_eq!(simulate(&st, &[0], 8).makespan_ns, 80);
    assert_eq!(objective_of(&[10, 0], 8), 80);
}

#[test]
fn p2p_costs_delay_the_pipeline() {
    let st = vec![
        StageTimes {
            forward_ns: 10,
            backward_ns: 20
        };
        3
    ];
    let free = simulate(&st, &[0, 0], 6).makespan_ns;
    let slow = simulate(&st, &[5, 5], 6).makespan_ns;
    assert_eq!(free, (6 + 3 - 1) * 30);
    assert!(slow > free);
    // Every stream has m forwards and m backwards.
    for i in 0..3 {
        let s = stage_stream(i, 3, 6);
        assert_eq!(
            s.iter()
                .filter(|x| matches!(x, Instruction::Forward { .. }))
                .count(),
            6
        );
        assert_eq!(
            s.iter()
                .filter(|x| matches!(x, Instruction::Backward { .. }))
                .count(),
            6
        );
    }
}
