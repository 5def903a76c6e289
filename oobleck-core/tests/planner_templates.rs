//! Templates: exact optimum vs brute force, coverage, devices, memory, determinism, bad input.

use oobleck_core::planning::template::{best_template, evaluate_layout};
use oobleck_core::planning::{
    generate_templates, ClusterSpec, Fingerprint, JobSpec, LayerProfile, LinkModel, ModelProfile,
    PlanError, TemplateMicrobatches,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

fn profile(times: &[(f64, f64)], param: &[u64], act: &[u64]) -> ModelProfile {
    ModelProfile {
        fingerprint: Fingerprint {
            model: "synthetic".into(),
            microbatch_size: 2,
            dtype: "f32".into(),
            device_kind: "test".into(),
        },
        layers: times
            .iter()
            .enumerate()
            .map(|(i, &(f, b))| LayerProfile {
                name: format!("l{i}"),
                forward_ms: f,
                backward_ms: b,
                param_bytes: param[i],
                activation_bytes: act[i],
                output_bytes: 1000,
            })
            .collect(),
    }
}

fn cluster(g: u32, mem: u64) -> ClusterSpec {
    ClusterSpec {
        device_kind: "test".into(),
        device_memory_bytes: mem,
        devices_per_node: g,
        intra_node: LinkModel {
            latency_us: 1.0,
            bandwidth_gbps: 100.0,
        },
        inter_node: LinkModel {
            latency_us: 5.0,
            bandwidth_gbps: 10.0,
        },
    }
}

fn job(f: u32, b: u32, tm: TemplateMicrobatches) -> JobSpec {
    JobSpec {
        fault_threshold: f,
        microbatch_size: 2,
        global_microbatches: b,
        state_bytes_per_param_byte: 4,
        template_microbatches: tm,
    }
}

/// All strictly increasing cut vectors of length `k` inside `(0, l)`.
fn cut_sets(l: usize, k: usize) -> Vec<Vec<usize>> {
    fn rec(start: usize, l: usize, k: usize, cur: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        if cur.len() == k {
            out.push(cur.clone());
            return;
        }
        for c in start..l {
            cur.push(c);
            rec(c + 1, l, k, cur, out);
            cur.pop();
        }
    }
    let mut out = Vec::new();
    rec(1, l, k, &mut Vec::new(), &mut out);
    out
}

fn brute_force(p: &ModelProfile, c: &ClusterSpec, j: &JobSpec, total: u32, n: u32) -> Option<u128> {
    let l = p.layers.len();
    let mut best: Option<u128> = None;
    for g in c.stage_device_counts() {
        let s = (n * c.devices_per_node / g) as usize;
        if s > l {
            continue;
        }
        for cuts in cut_sets(l, s - 1) {
            if let Some(v) = evaluate_layout(p, c, j, total, g, &cuts) {
                best = Some(best.map_or(v, |b: u128| b.min(v)));
            }
        }
    }
    best
}

/// (fwd/bwd ms per layer, param bytes, activation bytes, G, device memory, n, microbatch mode).
type Case = (Vec<(f64, f64)>, Vec<u64>, Vec<u64>, u32, u64, u32, u32);

fn arb_case() -> impl Strategy<Value = Case> {
    (2usize..=7).prop_flat_map(|l| {
        (
            prop::collection::vec((0u32..40, 0u32..80), l).prop_map(|v| {
                v.into_iter()
                    .map(|(f, b)| (f as f64 * 0.25, b as f64 * 0.25))
                    .collect()
            }),
            prop::collection::vec(1u64..50, l),
            prop::collection::vec(0u64..20, l),
            prop::sample::select(vec![1u32, 2, 4]),
            200u64..1200,
            1u32..=3,
            prop::sample::select(vec![0u32, 1, 3]),
        )
    })
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new_with_rng(
        Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]),
    )
}

#[test]
fn template_optimum_equals_brute_force() {
    let feasible = std::cell::Cell::new(0u32);
    runner(200)
        .run(&arb_case(), |(times, param, act, g, mem, n, mode)| {
            let p = profile(&times, &param, &act);
            let c = cluster(g, mem);
            let tm = match mode {
                0 => TemplateMicrobatches::Auto,
                1 => TemplateMicrobatches::Fixed(3),
                _ => TemplateMicrobatches::PerStage(4),
            };
            let j = job(1, 16, tm);
            let got = best_template(&p, &c, &j, 6, n).map(|x| x.1);
            let want = brute_force(&p, &c, &j, 6, n);
            feasible.set(feasible.get() + u32::from(want.is_some()));
            prop_assert_eq!(got, want);
            Ok(())
        })
        .unwrap();
    // Most generated cases must have a layout, or the comparison proves little.
    assert!(
        feasible.get() >= 100,
        "only {} feasible cases",
        feasible.get()
    );
}

#[test]
fn templates_cover_layers_use_all_devices_and_fit_memory() {
    runner(60)
        .run(&arb_case(), |(times, param, act, g, mem, _, _)| {
            let p = profile(&times, &param, &act);
            let c = cluster(g, mem);
            let j = job(1, 16, TemplateMicrobatches::Auto);
            let Ok(set) = generate_templates(&p, &c, &j, 8) else {
                return Ok(());
            };
            for t in &set.templates {
                let mut next = 0;
                for s in &t.stages {
                    prop_assert_eq!(s.layer_start, next);
                    prop_assert!(s.layer_end > s.layer_start);
                    prop_assert!(s.memory_bytes <= c.device_memory_bytes);
                    prop_assert!(s.first_device + s.devices <= g);
                    prop_assert!(s.node < t.nodes);
                    next = s.layer_end;
                }
                prop_assert_eq!(next, p.layers.len());
                prop_assert_eq!(t.devices(), t.nodes * g);
                prop_assert_eq!(t.iteration_ns, t.iteration_ns_for(t.microbatches));
            }
            let again = generate_templates(&p, &c, &j, 8).expect("same input");
            prop_assert_eq!(
                serde_json::to_string(&set).unwrap(),
                serde_json::to_string(&again).unwrap()
            );
            Ok(())
        })
        .unwrap();
}

#[test]
fn colossal_reference_partitions_are_reproduced() {
    // The digest's check: 6 layers of w = 2, 4, ..., 12 (fwd = bwd = w/2), one stage per node,
    // no communication, m = 4S.
    let times: Vec<(f64, f64)> = (1..=6).map(|i| (i as f64, i as f64)).collect();
    let mut p = profile(&times, &[1; 6], &[0; 6]);
    for l in &mut p.layers {
        l.output_bytes = 0;
    }
    let mut c = cluster(1, 1 << 30);
    c.inter_node.latency_us = 0.0;
    let j = job(0, 16, TemplateMicrobatches::PerStage(4));
    let cuts = |n| {
        let (t, _) = best_template(&p, &c, &j, 4, n).expect("feasible");
        t.stages
            .iter()
            .map(|s| (s.layer_start, s.layer_end))
            .collect::<Vec<_>>()
    };
    assert_eq!(cuts(2), vec![(0, 4), (4, 6)]);
    assert_eq!(cuts(3), vec![(0, 3), (3, 5), (5, 6)]);
    assert_eq!(cuts(4), vec![(0, 3), (3, 4), (4, 5), (5, 6)]);
}

#[test]
fn bad_inputs_are_clear_errors_with_numbers() {
    let ok = profile(&[(1.0, 2.0), (1.0, 2.0)], &[10, 10], &[1, 1]);
    let c = cluster(1, 1000);
    let j = job(1, 8, TemplateMicrobatches::Auto);

    let mut nan = ok.clone();
    nan.layers[1].backward_ms = f64::NAN;
    assert!(matches!(
        generate_templates(&nan, &c, &j, 4),
        Err(PlanError::InvalidProfile {
            layer: 1,
            field: "backward_ms",
            ..
        })
    ));
    let mut neg = ok.clone();
    neg.layers[0].forward_ms = -1.0;
    assert!(matches!(
        ModelProfile::from_json(&neg.to_json()),
        Err(PlanError::InvalidProfile {
            layer: 0,
            field: "forward_ms",
            ..
        })
    ));
    let zero_mem = cluster(1, 0);
    assert!(matches!(
        generate_templates(&ok, &zero_mem, &j, 4),
        Err(PlanError::InvalidCluster {
            field: "device_memory_bytes",
            ..
        })
    ));
    // 2 layers: a 3-node template would need more stages than layers; f = 5 needs 6 nodes.
    let e = generate_templates(&ok, &c, &job(5, 8, TemplateMicrobatches::Auto), 4).unwrap_err();
    assert!(
        matches!(
            e,
            PlanError::Infeasible {
                nodes: 4,
                min_nodes: 6,
                pipeline_nodes: 1,
                pipelines: 6,
                ..
            }
        ),
        "{e:?}"
    );
    let text = e.to_string();
    for part in [
        "4 nodes are too few",
        "at least 6 nodes",
        "--fault-threshold",
        "--recompute",
    ] {
        assert!(text.contains(part), "{part}: {text}");
    }
    // Too big for any split: 40 bytes of state per layer on a 30-byte device.
    let e = generate_templates(&ok, &cluster(1, 30), &j, 4).unwrap_err();
    assert!(
        matches!(e, PlanError::ModelTooLarge { needed_bytes, device_bytes: 30, .. } if needed_bytes > 30)
    );
    // Stale profile.
    let mut other = ok.fingerprint.clone();
    other.device_kind = "a100-80gb".into();
    assert!(matches!(
        ok.check_fingerprint(&other),
        Err(PlanError::StaleProfile { .. })
    ));
    assert!(matches!(
        ModelProfile::from_json("{\"layers\": 3}"),
        Err(PlanError::ProfileFormat(_))
    ));
}

/// The fields of a [`PlanError::ModelTooLarge`] in declaration order (needed, device, layer,
/// state, activations, in flight, samples per device), once checked that its state and
/// activations add up to the need.
fn too_large_parts(e: &PlanError) -> (u64, u64, usize, u64, u64, u64, u64) {
    let PlanError::ModelTooLarge {
        needed_bytes: need,
        device_bytes: device,
        layer,
        state_bytes: state,
        activation_bytes: act,
        in_flight: flight,
        samples_per_device: samples,
    } = *e
    else {
        panic!("expected ModelTooLarge, got {e}");
    };
    assert_eq!(state + act, need, "{e}");
    (need, device, layer, state, act, flight, samples)
}

/// A model that fits no split names its worst stage's parts, which add up to the need: 3 layers
/// of 5, 20, 5 parameter bytes (x4 of state) and 100, 60, 10 activation bytes per microbatch of
/// 2 samples. One layer per stage puts 3, 2, 1 microbatches in flight, so on 2 devices per
/// stage (1 sample each) layer 0 needs 20 + 3 * 50 = 170 bytes, layer 1 80 + 2 * 30 = 140.
#[test]
fn model_too_large_names_state_and_in_flight_activations() {
    let p = profile(
        &[(1.0, 2.0), (1.0, 2.0), (1.0, 2.0)],
        &[5, 20, 5],
        &[100, 60, 10],
    );
    let j = job(0, 8, TemplateMicrobatches::Auto);

    let e = generate_templates(&p, &cluster(2, 100), &j, 4).unwrap_err();
    assert_eq!(too_large_parts(&e), (170, 100, 0, 20, 150, 3, 1));
    let text = e.to_string();
    assert!(text.contains("Layer 0's stage"), "{text}");
    assert!(text.contains("3 microbatches in flight"), "{text}");
    assert!(text.contains("activation recomputation"), "{text}");
    // A device holds one sample of each microbatch: a smaller microbatch would not help.
    assert!(!text.contains("smaller microbatch"), "{text}");

    // One device per stage holds both samples: 20 + 3 * 100 = 320 bytes.
    let e = generate_templates(&p, &cluster(1, 100), &j, 4).unwrap_err();
    assert_eq!(too_large_parts(&e), (320, 100, 0, 20, 300, 3, 2));
    let text = e.to_string();
    assert!(
        text.contains("a smaller microbatch or more devices per node"),
        "{text}"
    );

    // Layer 1's state (80 bytes) alone is too large: it is named, though layer 0 needs more,
    // and only a larger device helps.
    let e = generate_templates(&p, &cluster(2, 79), &j, 4).unwrap_err();
    assert_eq!(too_large_parts(&e), (140, 79, 1, 80, 60, 2, 1));
    let text = e.to_string();
    assert!(text.contains("state alone exceeds the device"), "{text}");
    assert!(!text.contains("recomputation"), "{text}");
}
