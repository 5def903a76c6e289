//! The table policy against the authors' simulators (`reference.json`, see its `provenance`),
//! and its errors on bad inputs.

use serde_json::Value;

use super::machine::Accumulators;
use super::*;
use crate::simulate::TimeFractions;

const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../datasets/simulator");
const REFERENCE: &str = include_str!("reference.json");

fn read(path: &str) -> String {
    std::fs::read_to_string(format!("{DATA}/{path}")).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn sim_inputs() -> String {
    read("sim_inputs.json")
}

/// One run of the reference: what the authors' simulator printed.
struct Expected {
    experiment: Experiment,
    trace: String,
    model: String,
    system: System,
    average: f64,
    acc: Accumulators,
    span_ms: f64,
    steps: i64,
    preemptions: u64,
    fatal: u64,
}

fn num(v: &Value, path: &str) -> f64 {
    v.pointer(path)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("reference.json: {path} missing in {v}"))
}

fn text(v: &Value, key: &str) -> String {
    v[key]
        .as_str()
        .expect("reference.json: string field")
        .to_string()
}

fn expected_runs() -> Vec<Expected> {
    let root: Value = serde_json::from_str(REFERENCE).expect("reference.json is JSON");
    let acc = |r: &Value, k: &str| {
        r.pointer(&format!("/accumulators_ms/{k}"))
            .and_then(Value::as_f64)
            .unwrap_or(0.0)
    };
    let runs = root["runs"].as_array().expect("runs");
    runs.iter()
        .map(|r| Expected {
            experiment: text(r, "experiment").parse().expect("experiment"),
            trace: text(r, "trace"),
            model: text(r, "model"),
            system: text(r, "system").parse().expect("system"),
            average: num(r, "/average_performance"),
            acc: Accumulators {
                effective: acc(r, "effective_time"),
                rebalance: acc(r, "rebalance_time"),
                restart: acc(r, "restart_time"),
                checkpoint: acc(r, "checkpoint_time"),
                redundant: acc(r, "redundant_time"),
                fallback_loss: acc(r, "fallback_loss_time"),
                idle_gpu: acc(r, "sum_gpu_overhead"),
            },
            span_ms: num(r, "/averaged_span_ms"),
            steps: num(r, "/num_steps_complete") as i64,
            preemptions: num(r, "/num_preemptions") as u64,
            fatal: num(r, "/num_fatal_failures") as u64,
        })
        .collect()
}

/// The authors' counters mapped the way [`ledger`] maps ours.
fn expected_fractions(e: &Expected) -> TimeFractions {
    super::ledger_of(&e.acc, e.span_ms).fractions()
}

fn rel(ours: f64, theirs: f64) -> f64 {
    if theirs == 0.0 {
        ours.abs()
    } else {
        (ours - theirs).abs() / theirs.abs()
    }
}

/// Largest fraction difference, allowed when under 0.01 absolute or 1% relative.
fn worst_fraction(ours: &TimeFractions, theirs: &TimeFractions) -> (f64, bool) {
    let mut worst = 0.0f64;
    let mut ok = true;
    for k in TimeKind::ALL {
        let (o, t) = (ours.get(k), theirs.get(k));
        worst = worst.max((o - t).abs());
        ok &= (o - t).abs() <= 0.01 || rel(o, t) <= 0.01;
    }
    (worst, ok)
}

struct Compared {
    e: Expected,
    ours: Outcome,
    acc: Accumulators,
}

fn compare_all() -> Vec<Compared> {
    let json = sim_inputs();
    expected_runs()
        .into_iter()
        .map(|e| {
            let inputs = TableInputs::parse(&json, &e.model, e.system).expect("inputs");
            let policy = TablePolicy::new(inputs, e.experiment);
            let trace = Trace::parse(&read(&format!("traces/{}", e.trace))).expect("trace");
            let acc = policy.replay(&trace).acc;
            let ours = policy.run(&trace).expect("run");
            Compared { e, ours, acc }
        })
        .collect()
}

#[test]
fn reproduces_every_reference_run() {
    let all = compare_all();
    assert_eq!(
        all.len(),
        120,
        "75 tput_vs_freq + 30 spot + 15 no_ckpt runs"
    );
    let mut failures = Vec::new();
    for c in &all {
        let e = &c.e;
        let label = format!(
            "{} {} {} {}",
            e.experiment.name(),
            e.trace,
            e.model,
            e.system.name()
        );
        if rel(c.ours.average_samples_per_s, e.average) > 0.01 {
            failures.push(format!(
                "{label}: average {} vs theirs {}",
                c.ours.average_samples_per_s, e.average
            ));
        }
        let (worst, ok) = worst_fraction(&c.ours.time_fractions, &expected_fractions(e));
        if !ok {
            failures.push(format!("{label}: a time fraction is off by {worst}"));
        }
        if (c.ours.steps as i64, c.ours.failures) != (e.steps.max(0), e.preemptions) {
            failures.push(format!(
                "{label}: {} steps / {} removals vs theirs {} / {}",
                c.ours.steps, c.ours.failures, e.steps, e.preemptions
            ));
        }
        let fatal = c.ours.restarts
            + if e.system == System::Oobleck {
                c.ours.reconfigurations
            } else {
                0
            };
        if fatal != e.fatal {
            failures.push(format!(
                "{label}: {fatal} fatal failures vs theirs {}",
                e.fatal
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} runs differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Not only within 1%: the counters are the same numbers (floating-point sums aside).
#[test]
fn counters_match_exactly() {
    for c in compare_all() {
        let (o, t) = (c.acc, c.e.acc);
        let pairs = [
            (o.effective, t.effective),
            (o.rebalance, t.rebalance),
            (o.restart, t.restart),
            (o.checkpoint, t.checkpoint),
            (o.redundant, t.redundant),
            (o.fallback_loss, t.fallback_loss),
            (o.idle_gpu, t.idle_gpu),
        ];
        for (ours, theirs) in pairs {
            assert!(
                (ours - theirs).abs() <= 1e-9 * theirs.abs().max(1.0),
                "{} {} {} {}: {ours} vs {theirs}",
                c.e.experiment.name(),
                c.e.trace,
                c.e.model,
                c.e.system.name()
            );
        }
        assert!(rel(c.ours.average_samples_per_s, c.e.average) < 1e-9);
    }
}

#[test]
fn the_readme_numbers_bert_large_on_the_10_minute_trace() {
    let json = sim_inputs();
    let trace = Trace::parse(&read("traces/10m.csv")).unwrap();
    let avg = |system| {
        let inputs = TableInputs::parse(&json, "BERT-large", system).unwrap();
        TablePolicy::new(inputs, Experiment::default())
            .run(&trace)
            .unwrap()
            .average_samples_per_s
    };
    assert_eq!(avg(System::Oobleck).round(), 282.0);
    assert_eq!(avg(System::Varuna).round(), 174.0);
    assert_eq!(avg(System::Bamboo).round(), 70.0);
}

#[test]
fn outcome_shape() {
    let json = sim_inputs();
    let trace = Trace::parse(&read("traces/1h.csv")).unwrap();
    let inputs = TableInputs::parse(&json, "GPT-3-2_7b", System::Varuna).unwrap();
    let policy = TablePolicy::new(inputs, Experiment::TputVsFreq);
    assert_eq!(policy.name(), "table/varuna");
    let o = policy.run(&trace).unwrap();
    let sum: f64 = TimeKind::ALL.iter().map(|&k| o.time_fractions.get(k)).sum();
    assert!((sum - 1.0).abs() < 1e-9);
    // Varuna's first rendezvous, too, costs its restart time (515 s - the 50 s checkpoint).
    assert_eq!(o.start_ms, 45_000 + 515_000 - 50_000);
    assert!(o.end_ms > o.start_ms && o.end_ms <= trace.end_ms());
    assert!(
        o.timeline.len() < o.steps as usize,
        "one point per change, not per step"
    );
    assert!(o.timeline.windows(2).all(|w| w[0].t_ms < w[1].t_ms));
    assert!(o.marks.iter().all(|m| m.t_ms < trace.end_ms()));
    assert_eq!(o.failures, 14, "the 15th removal is the hard stop");
    assert!(o.notes.iter().any(|n| n.contains("hard stop")));
}

#[test]
fn bamboo_gpt3_is_out_of_memory() {
    let json = sim_inputs();
    let trace = Trace::parse(&read("traces/6h.csv")).unwrap();
    let inputs = TableInputs::parse(&json, "GPT-3-6_7b", System::Bamboo).unwrap();
    let o = TablePolicy::new(inputs, Experiment::TputVsFreq)
        .run(&trace)
        .unwrap();
    assert_eq!(o.average_samples_per_s, 0.0);
    assert!(
        o.notes.iter().any(|n| n.contains("does not fit in memory")),
        "{:?}",
        o.notes
    );
}

fn small_trace(second_removal_ms: u64) -> Trace {
    let mut csv: String = (1..=14).map(|i| format!("0,add,node{i}\n")).collect();
    csv.push_str(&format!(
        "200000,remove,node1\n{second_removal_ms},remove,node2\n"
    ));
    csv.push_str("1000000,add,node99\n");
    Trace::parse(&csv).unwrap()
}

/// Quirk 2 of the README, checked against the authors' code on the same two traces
/// (3 steps ending at 174 797 ms, vs 21 ending at 983 584 ms).
#[test]
fn two_removals_in_the_same_millisecond_stop_oobleck() {
    let json = sim_inputs();
    let inputs = TableInputs::parse(&json, "BERT-large", System::Oobleck).unwrap();
    let policy = TablePolicy::new(inputs, Experiment::TputVsFreq);
    let same = policy.run(&small_trace(200_000)).unwrap();
    let apart = policy.run(&small_trace(300_000)).unwrap();
    assert_eq!((same.steps, same.end_ms), (3, 174_797));
    assert_eq!((apart.steps, apart.end_ms), (21, 983_584));
    assert!(
        same.time_fractions.idle == 0.0,
        "the span ends at the last step"
    );
}

/// The timeline is the series the average is taken over: its area is the samples.
#[test]
fn timeline_area_is_the_average_times_the_span() {
    let json = sim_inputs();
    let trace = Trace::parse(&read("traces/scaled/scale_p3-trace.csv")).unwrap();
    for system in [System::Oobleck, System::Varuna, System::Bamboo] {
        let inputs = TableInputs::parse(&json, "GPT-2-ours", system).unwrap();
        let o = TablePolicy::new(inputs, Experiment::Spot)
            .run(&trace)
            .unwrap();
        let area: f64 = o
            .timeline
            .windows(2)
            .map(|w| (w[1].t_ms - w[0].t_ms) as f64 / 1000.0 * w[0].samples_per_s)
            .sum();
        assert!(
            rel(area, o.samples) < 1e-6,
            "{}: {area} vs {}",
            system.name(),
            o.samples
        );
        assert_eq!(o.timeline.last().map(|p| p.samples_per_s), Some(0.0));
        assert_eq!(o.timeline.first().map(|p| p.t_ms), Some(o.start_ms));
    }
}

/// `Experiment` hard-codes the eval scripts' arguments; they must be those in the inputs.
#[test]
fn experiments_match_the_eval_driver_params() {
    let root: Value = serde_json::from_str(&sim_inputs()).unwrap();
    let p = &root["eval_driver_params"];
    let steps = |path: &str| p.pointer(path).and_then(Value::as_i64);
    let json = sim_inputs();
    let inp = |s| TableInputs::parse(&json, "BERT-large", s).unwrap();
    let ours = |e: Experiment, s| e.params(s, &inp(s)).steps_per_run;
    let freq = "/tput_vs_freq (eval_tput_vs_freq.py)/all systems/steps_per_run";
    assert_eq!(
        steps(freq),
        Some(ours(Experiment::TputVsFreq, System::Varuna))
    );
    assert_eq!(
        steps("/spot (eval_gcp_ec2.py)/varuna/steps_per_run"),
        Some(ours(Experiment::Spot, System::Varuna))
    );
    assert_eq!(
        steps("/spot (eval_gcp_ec2.py)/oobleck/steps_per_run"),
        Some(ours(Experiment::Spot, System::Oobleck))
    );
    assert_eq!(
        ours(Experiment::Spot, System::Bamboo),
        30_000,
        "the model's own budget"
    );
    let nockpt = "/no_ckpt_overhead (eval_no_ckpt_overhead.py -m GPT-3-6_7b)";
    for (key, s) in [
        ("varuna_no_ckpt", System::VarunaNoCkpt),
        ("varuna", System::Varuna),
        ("oobleck", System::Oobleck),
    ] {
        let path = format!("{nockpt}/{key}/steps_per_run");
        assert_eq!(steps(&path), Some(ours(Experiment::NoCkpt, s)), "{key}");
    }
    let no_ckpt = Experiment::NoCkpt.params(System::VarunaNoCkpt, &inp(System::VarunaNoCkpt));
    assert!(no_ckpt.no_ckpt_overhead && no_ckpt.checkpoint_per_iter == 2);
    assert!(
        Experiment::Spot
            .params(System::Varuna, &inp(System::Varuna))
            .no_fallback
    );
}

#[test]
fn names_parse() {
    for s in System::ALL {
        assert_eq!(s.name().parse::<System>().unwrap(), s);
    }
    for e in Experiment::ALL {
        assert_eq!(e.name().parse::<Experiment>().unwrap(), e);
    }
    assert!("pytorch".parse::<System>().is_err());
    assert!("spot2"
        .parse::<Experiment>()
        .unwrap_err()
        .to_string()
        .contains("tput_vs_freq"));
}

fn inputs_err(json: &str, model: &str) -> (String, String) {
    match TableInputs::parse(json, model, System::Varuna) {
        Err(SimError::Inputs { field, message }) => (field, message),
        other => panic!("expected an inputs error, got {other:?}"),
    }
}

#[test]
fn bad_inputs_are_errors_that_name_the_field() {
    let json = sim_inputs();
    let (field, msg) = inputs_err(&json, "GPT-5");
    assert_eq!(field, "model");
    assert!(
        msg.contains("`GPT-5`") && msg.contains("BERT-large, GPT-2-ours"),
        "{msg}"
    );

    let (field, msg) = inputs_err("", "BERT-large");
    assert_eq!(field, "(file)");
    assert!(msg.contains("not a JSON document"), "{msg}");
    let (field, _) = inputs_err("tputs: [1, 2]", "BERT-large");
    assert_eq!(field, "(file)");

    let mut v: Value = serde_json::from_str(&json).unwrap();
    v["throughput_tables"]["varuna"]["BERT-large"]
        .as_object_mut()
        .unwrap()
        .remove("step_delta_ms_by_nodes");
    let (field, msg) = inputs_err(&v.to_string(), "BERT-large");
    assert_eq!(
        field,
        "throughput_tables.varuna.BERT-large.step_delta_ms_by_nodes"
    );
    assert_eq!(msg, "missing");

    let mut v: Value = serde_json::from_str(&json).unwrap();
    v["throughput_tables"]["varuna"]["BERT-large"]["step_delta_ms_by_nodes"]["17"] =
        Value::String("fast".into());
    let (field, msg) = inputs_err(&v.to_string(), "BERT-large");
    assert_eq!(
        field,
        "throughput_tables.varuna.BERT-large.step_delta_ms_by_nodes.17"
    );
    assert!(
        msg.contains("expected a number") && msg.contains("fast"),
        "{msg}"
    );

    let mut v: Value = serde_json::from_str(&json).unwrap();
    v["constants"]["varuna"]["BERT-large"]["checkpointing_overhead"] = Value::Bool(true);
    let (field, _) = inputs_err(&v.to_string(), "BERT-large");
    assert_eq!(field, "constants.varuna.BERT-large.checkpointing_overhead");

    let mut v: Value = serde_json::from_str(&json).unwrap();
    v.as_object_mut().unwrap().remove("throughput_tables");
    let (field, _) = inputs_err(&v.to_string(), "BERT-large");
    assert_eq!(field, "throughput_tables");
}

/// Prints the README's validation table:
/// `cargo test -p oobleck-core --lib simulate::table -- --ignored --nocapture`
#[test]
#[ignore = "prints the README's validation table; the check itself is reproduces_every_reference_run"]
fn print_validation_table() {
    let all = compare_all();
    println!("| experiment | trace | model | system | ours (samples/s) | theirs | rel. error | max fraction diff |");
    println!("|---|---|---|---|---:|---:|---:|---:|");
    let mut worst: Vec<(System, f64, f64)> = Vec::new();
    for c in &all {
        let e = &c.e;
        let err = rel(c.ours.average_samples_per_s, e.average);
        let (fd, _) = worst_fraction(&c.ours.time_fractions, &expected_fractions(e));
        println!(
            "| {} | {} | {} | {} | {:.3} | {:.3} | {:.1e} | {:.1e} |",
            e.experiment.name(),
            e.trace,
            e.model,
            e.system.name(),
            c.ours.average_samples_per_s,
            e.average,
            err,
            fd
        );
        match worst.iter_mut().find(|w| w.0 == e.system) {
            Some(w) => {
                w.1 = w.1.max(err);
                w.2 = w.2.max(fd);
            }
            None => worst.push((e.system, err, fd)),
        }
    }
    println!();
    for (s, err, fd) in worst {
        println!(
            "worst {}: average {err:.1e} relative, fraction {fd:.1e} absolute",
            s.name()
        );
    }
}
