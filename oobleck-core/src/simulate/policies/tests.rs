//! The three policies on small clusters and the authors' traces.

use super::*;
use crate::planning::{
    analytical_profile, DeviceSpec, Dtype, JobSpec, TemplateMicrobatches, TransformerShape,
};
use crate::simulate::outcome::{Outcome, TimeKind};
use crate::simulate::{Policy, Trace};

/// GPT-3 350M (24 blocks, 1024 wide) on A100 80 GB nodes of one device.
pub(crate) fn work(f: u32, global: u32) -> SimWorkload {
    work_of(
        TransformerShape::gpt(24, 1024, 16, 50257, 2048),
        "a100-80gb",
        f,
        global,
    )
}

/// GPT-3 6.7B on A100 40 GB nodes: a pipeline needs several nodes.
fn big(f: u32, global: u32) -> SimWorkload {
    work_of(
        TransformerShape::gpt(32, 4096, 32, 50257, 2048),
        "a100-40gb",
        f,
        global,
    )
}

fn work_of(shape: TransformerShape, device: &str, f: u32, global: u32) -> SimWorkload {
    let device = DeviceSpec::named(device).unwrap();
    SimWorkload {
        profile: analytical_profile("gpt", &shape, device, 1, Dtype::Bf16),
        cluster: device.cluster(1),
        job: JobSpec {
            fault_threshold: f,
            microbatch_size: 1,
            global_microbatches: global,
            state_bytes_per_param_byte: Dtype::Bf16.state_bytes_per_param_byte(),
            template_microbatches: TemplateMicrobatches::Auto,
        },
    }
}

fn shipped(name: &str) -> Trace {
    let path = format!(
        "{}/../datasets/simulator/traces/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    Trace::parse(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn all(w: &SimWorkload, costs: Costs, end_ms: Option<u64>) -> Vec<Box<dyn Policy>> {
    vec![
        Box::new(OobleckPolicy {
            work: w.clone(),
            costs,
            end_ms,
        }),
        Box::new(CheckpointRestart {
            work: w.clone(),
            costs,
            end_ms,
        }),
        Box::new(Redundancy {
            work: w.clone(),
            costs,
            end_ms,
        }),
    ]
}

fn sums_to_one(o: &Outcome) {
    let sum: f64 = TimeKind::ALL.iter().map(|&k| o.time_fractions.get(k)).sum();
    assert!((sum - 1.0).abs() < 1e-9, "{}: {sum}", o.policy);
}

#[test]
fn in_place_recovery_beats_restarts_on_the_ten_minute_trace() {
    let w = work(1, 512);
    let trace = shipped("10m.csv");
    let runs: Vec<Outcome> = all(&w, Costs::default(), None)
        .iter()
        .map(|p| p.run(&trace).unwrap())
        .collect();
    let [oobleck, restart, redundancy] = &runs[..] else {
        unreachable!()
    };
    for o in &runs {
        sums_to_one(o);
        assert_eq!(o.failures, 15, "{}", o.policy);
        assert_eq!(
            o.start_ms, 45_000,
            "{}: nodes are usable after 45 s",
            o.policy
        );
    }
    // Every loss is recovered in place; nothing is rolled back.
    assert_eq!((oobleck.reconfigurations, oobleck.restarts), (15, 0));
    assert!(
        oobleck.time_fractions.lost < 0.01,
        "{:?}",
        oobleck.time_fractions
    );
    // Every loss restarts from the last checkpoint.
    assert_eq!((restart.reconfigurations, restart.restarts), (0, 15));
    assert!(restart.time_fractions.lost > 5.0 * oobleck.time_fractions.lost);
    assert!(oobleck.average_samples_per_s > 1.1 * restart.average_samples_per_s);
    // Redundancy: a third of every step is the successor's layers; single losses are
    // taken over in place.
    let r = redundancy.time_fractions;
    assert!(
        (r.redundant / (r.useful + r.redundant) - 0.25).abs() < 0.01,
        "{r:?}"
    );
    assert!(redundancy.reconfigurations > 0, "{redundancy:?}");
    assert!(redundancy.average_samples_per_s < oobleck.average_samples_per_s);
    // Same input, same output.
    assert_eq!(
        &all(&w, Costs::default(), None)[0].run(&trace).unwrap(),
        oobleck
    );
}

/// Two 6-node pipelines (f = 1); losing the first node of both at once leaves layers no
/// replica holds: a restart from the last checkpoint on the 10 nodes left, with one pipeline
/// (f = 0: two need 12 nodes). Two joins bring back f = 1 in place.
#[test]
fn a_loss_past_f_restarts_from_the_checkpoint() {
    let w = big(1, 64);
    let trace = Trace::parse(&format!(
        "{}3600000,remove,n0\n3600000,remove,n6\n7200000,add,n12\n7200000,add,n13\n10800000,add,n14\n",
        (0..12).map(|i| format!("0,add,n{i}\n")).collect::<String>()
    ))
    .unwrap();
    let o = OobleckPolicy {
        work: w,
        costs: Costs::default(),
        end_ms: None,
    }
    .run(&trace)
    .unwrap();
    sums_to_one(&o);
    assert_eq!(o.restarts, 1, "{o:?}");
    assert!(
        o.notes
            .iter()
            .any(|n| n.contains("past the fault threshold")),
        "{:?}",
        o.notes
    );
    // The two joins are admitted in place: 8 nodes again, two pipelines.
    assert_eq!(o.reconfigurations, 1, "{o:?}");
    assert!(o.time_fractions.lost > 0.0);
    let rates: Vec<f64> = o
        .timeline
        .iter()
        .map(|p| p.samples_per_s)
        .filter(|&r| r > 0.0)
        .collect();
    assert!(rates.len() >= 3, "{:?}", o.timeline);
    assert!(rates[1] < rates[0] && rates[2] > rates[1], "{rates:?}");
}

#[test]
fn redundancy_runs_out_of_memory_where_twice_the_state_does_not_fit() {
    let w = big(0, 64);
    // Plain pipelines need 6 of these nodes, redundant ones 12.
    let csv: String = (0..8).map(|i| format!("0,add,n{i}\n")).collect();
    let trace = Trace::parse(&format!("{csv}3600000,add,n8\n")).unwrap();
    let o = Redundancy {
        work: w.clone(),
        costs: Costs::default(),
        end_ms: None,
    }
    .run(&trace)
    .unwrap();
    assert_eq!(o.average_samples_per_s, 0.0);
    assert_eq!(o.time_fractions.idle, 1.0);
    assert!(o.notes[0].contains("out of memory"), "{:?}", o.notes);
    // The same cluster trains without the redundant copies.
    let c = CheckpointRestart {
        work: w,
        costs: Costs::default(),
        end_ms: None,
    }
    .run(&trace)
    .unwrap();
    assert!(c.average_samples_per_s > 0.0, "{c:?}");
}

#[test]
fn bad_costs_are_errors() {
    let trace = shipped("10m.csv");
    let costs = Costs {
        storage_gbps: 0.0,
        ..Costs::default()
    };
    let e = OobleckPolicy {
        work: work(1, 512),
        costs,
        end_ms: None,
    }
    .run(&trace)
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("storage-gbps = 0: must be a finite number > 0"),
        "{e}"
    );
    let costs = Costs {
        detect_ms: f64::NAN,
        ..Costs::default()
    };
    let e = CheckpointRestart {
        work: work(1, 512),
        costs,
        end_ms: None,
    }
    .run(&trace)
    .unwrap_err();
    assert!(e.to_string().starts_with("detect = NaN"), "{e}");
}
