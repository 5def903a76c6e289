//! `oobleck simulate` from its flags: the authors' numbers through the table policy, our
//! policies on generated traces, and the errors of bad input.

use clap::Parser;

use super::*;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    sim: SimulateArgs,
}

fn args(v: &[&str]) -> SimulateArgs {
    Cli::try_parse_from(std::iter::once("simulate").chain(v.iter().copied()))
        .expect("flags parse")
        .sim
}

const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../datasets/simulator");

fn data(rel: &str) -> String {
    format!("{DATA}/{rel}")
}

fn error_of(v: &[&str]) -> String {
    format!("{:#}", compute(&args(v)).expect_err("an error"))
}

#[test]
fn the_table_policy_gives_the_authors_numbers() {
    let (trace, inputs) = (data("traces/10m.csv"), data("sim_inputs.json"));
    let a = args(&[
        "--trace",
        &trace,
        "--policy",
        "table",
        "--inputs",
        &inputs,
        "--model",
        "BERT-large",
    ]);
    let (out, outcomes) = compute(&a).unwrap();
    let got: Vec<(String, f64)> = out
        .policies
        .iter()
        .map(|p| (p.policy.clone(), p.average_samples_per_s))
        .collect();
    // The authors' simulator README: about 282, 174 and 70 samples/s.
    for ((name, avg), (want_name, want)) in got.iter().zip([
        ("table/oobleck", 282.0),
        ("table/varuna", 174.0),
        ("table/bamboo", 70.0),
    ]) {
        assert_eq!(name, want_name);
        assert!((avg - want).abs() / want < 0.01, "{name}: {avg}");
    }
    assert_eq!(outcomes.len(), 3);
    // The JSON has the first policy's average and fractions at the top.
    let json: serde_json::Value = serde_json::to_value(&out).unwrap();
    assert_eq!(
        json["average_samples_per_s"],
        json["policies"][0]["average_samples_per_s"]
    );
    assert!(json["time_fractions"]["useful"].as_f64().unwrap() > 0.9);
    let text = render::table(&out, "");
    assert!(text.contains("| table/varuna | 173.52 |"), "{text}");
}

#[test]
fn our_policies_on_a_generated_trace_with_a_chart() {
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("trace.csv");
    let chart = dir.path().join("chart.svg");
    let flags = [
        "--generate-failures",
        "20d",
        "--nodes",
        "40",
        "--duration",
        "2d",
        "--seed",
        "3",
        "--model",
        "gpt3-350m",
        "--fault-threshold",
        "2",
        "--save-trace",
        saved.to_str().unwrap(),
        "--plot",
        chart.to_str().unwrap(),
    ];
    let a = args(&flags);
    let (out, outcomes) = compute(&a).unwrap();
    assert_eq!(out.policies.len(), 3);
    // 40 nodes x 2 days / 20 days: about 4 failures, each replaced.
    assert!((1..=12).contains(&out.trace.removals), "{:?}", out.trace);
    assert_eq!(out.trace.duration_ms, 2 * 86_400_000);
    for p in &out.policies {
        assert_eq!(p.failures as usize, out.trace.removals, "{}", p.policy);
        let kept = p.of_fault_free.unwrap();
        assert!(kept > 0.3 && kept <= 1.0, "{}: {kept}", p.policy);
    }
    let [oobleck, restart, _] = &out.policies[..] else {
        unreachable!()
    };
    assert_eq!(oobleck.restarts, 0);
    assert!(oobleck.average_samples_per_s > restart.average_samples_per_s);
    // The saved trace is the one simulated: replaying it gives the same numbers.
    let again = compute(&args(&[
        "--trace",
        saved.to_str().unwrap(),
        "--model",
        "gpt3-350m",
        "--fault-threshold",
        "2",
    ]))
    .unwrap();
    assert_eq!(again.1, outcomes);
    run(&a).unwrap();
    let svg = std::fs::read_to_string(&chart).unwrap();
    for name in ["oobleck", "checkpoint-restart", "redundancy"] {
        assert!(svg.contains(name), "{name} missing from the chart");
    }
}

#[test]
fn the_authors_model_names_work_for_every_policy() {
    let (trace, inputs) = (data("traces/1h.csv"), data("sim_inputs.json"));
    let a = args(&[
        "--trace",
        &trace,
        "--policy",
        "oobleck",
        "--policy",
        "table",
        "--inputs",
        &inputs,
        "--system",
        "varuna",
        "--model",
        "GPT-3-6_7b",
        "--experiment",
        "no_ckpt",
    ]);
    let (out, _) = compute(&a).unwrap();
    let names: Vec<&str> = out.policies.iter().map(|p| p.policy.as_str()).collect();
    assert_eq!(names, ["oobleck", "table/varuna"]);
}

#[test]
fn bad_input_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.csv");
    std::fs::write(&bad, "0,add,a\n10,remove,b\n").unwrap();
    let bad = bad.to_str().unwrap();
    let (trace, inputs) = (data("traces/10m.csv"), data("sim_inputs.json"));
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec![], "give a trace: --trace FILE"),
        (
            vec!["--trace", "/nonexistent.csv"],
            "reading trace /nonexistent.csv",
        ),
        (
            vec!["--trace", bad],
            "trace line 2: `b` is removed but no earlier line adds it",
        ),
        (vec!["--generate-failures", "30d"], "needs --nodes N"),
        (
            vec!["--generate-failures", "30x", "--nodes", "4"],
            "--generate-failures: duration `30x`",
        ),
        (
            vec!["--generate-failures", "0s", "--nodes", "4"],
            "mtbf = 0: must be longer than 0",
        ),
        (
            vec!["--trace", &trace, "--model", "BERT-large"],
            "no preset here",
        ),
        (
            vec!["--trace", &trace, "--policy", "table"],
            "--policy table needs --inputs FILE",
        ),
        (
            vec![
                "--trace", &trace, "--policy", "table", "--inputs", &inputs, "--model", "gpt5",
            ],
            "gpt5",
        ),
        (
            vec![
                "--trace", &trace, "--inputs", &inputs, "--system", "torchft",
            ],
            "expected oobleck, varuna, varuna_no_ckpt or bamboo",
        ),
        (
            vec![
                "--trace",
                &trace,
                "--inputs",
                &inputs,
                "--experiment",
                "fig99",
            ],
            "expected tput_vs_freq, spot or no_ckpt",
        ),
        (
            vec!["--trace", &trace, "--checkpoint-every", "often"],
            "expected a step count",
        ),
        (
            vec!["--trace", &trace, "--detect", "soon"],
            "--detect: duration `soon`",
        ),
        (
            vec!["--trace", &trace, "--storage-gbps=-1"],
            "storage-gbps = -1",
        ),
        (
            vec!["--trace", &trace, "--end", "1y"],
            "--end: duration `1y`",
        ),
    ];
    for (flags, want) in cases {
        let e = error_of(&flags);
        assert!(e.contains(want), "{flags:?}: {e}");
    }
    let e = error_of(&["--trace", &trace, "--inputs", "/nonexistent.json"]);
    assert!(e.contains("reading inputs /nonexistent.json"), "{e}");
    std::fs::write(dir.path().join("empty.json"), "{}").unwrap();
    let empty = dir.path().join("empty.json");
    let e = error_of(&["--trace", &trace, "--inputs", empty.to_str().unwrap()]);
    assert!(e.contains("inputs: "), "{e}");
}
