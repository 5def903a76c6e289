//! `oobleck bench simulate`: how long the simulator takes as clusters and traces grow, with
//! the oobleck policy re-planning in place at every failure and join (`reconfig::decide` on
//! the whole cluster each time). Target: 10,000 nodes and 1,000 events over a simulated week
//! in under 10 s.
//!
//! Each row generates a week-long trace whose node MTBF gives about `events / 2` failures,
//! each replaced 10 minutes later (about `events` trace events in all), and times
//! `Policy::run` alone (the trace is made first). GPT-3 6.7B on nodes of 8 H100s, f = 1, a
//! global batch of 4 samples per node.

use std::time::Instant;

use anyhow::Context;

use oobleck_core::simulate::generate::{generate, Failures};
use oobleck_core::simulate::policies::{Costs, OobleckPolicy};
use oobleck_core::simulate::Policy;

use crate::plan_cmd::{workload, WorkloadArgs};

/// Flags of `oobleck bench simulate`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchSimulateArgs {
    /// Cluster sizes to time.
    #[arg(long, value_delimiter = ',', default_value = "100,1000,10000")]
    pub nodes: Vec<u32>,
    /// Trace events (failures and joins) per simulated week.
    #[arg(long, value_delimiter = ',', default_value = "100,1000")]
    pub events: Vec<u32>,
    /// Seed of the generated traces.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

struct Row {
    nodes: u32,
    events: usize,
    decisions: u64,
    seconds: f64,
}

const WEEK_MS: u64 = 7 * 86_400_000;

fn time_one(nodes: u32, events: u32, seed: u64) -> anyhow::Result<Row> {
    let failures = u64::from(events / 2).max(1);
    let trace = generate(&Failures {
        nodes,
        mtbf_ms: u64::from(nodes) * WEEK_MS / failures,
        replace_after_ms: Some(600_000),
        duration_ms: WEEK_MS,
        seed,
    })?;
    let work_args = WorkloadArgs {
        model: "gpt3-6.7b".into(),
        profile: None,
        template_microbatches: oobleck_core::planning::TemplateMicrobatches::Auto,
        devices_per_node: 8,
        device: "h100-80gb".into(),
        fault_threshold: 1,
        microbatch_size: 1,
        global_batch_size: 4 * nodes,
        dtype: crate::config::Precision::Bf16,
        recompute: false,
    };
    let policy = OobleckPolicy {
        work: workload(&work_args)?,
        costs: Costs::default(),
        end_ms: None,
    };
    let started = Instant::now();
    let out = policy
        .run(&trace)
        .with_context(|| format!("{nodes} nodes"))?;
    let seconds = started.elapsed().as_secs_f64();
    // Events after the first instant (the cluster's creation).
    let changes = trace.events().iter().filter(|e| e.at_ms > 0).count();
    Ok(Row {
        nodes,
        events: changes,
        decisions: out.reconfigurations + out.restarts,
        seconds,
    })
}

/// Runs the benchmark and prints its table.
pub fn run(args: &BenchSimulateArgs) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for &n in &args.nodes {
        for &e in &args.events {
            eprintln!("bench simulate: {n} nodes, {e} events ...");
            let row = time_one(n, e, args.seed)?;
            eprintln!("bench simulate: {:.2} s", row.seconds);
            rows.push(row);
        }
    }
    println!(
        "| nodes | trace events | in-place decisions + restarts | wall s | ms per event | target |"
    );
    println!("|---:|---:|---:|---:|---:|---|");
    for r in &rows {
        let target = if r.nodes == 10_000 && r.events >= 900 {
            if r.seconds < 10.0 {
                "< 10 s: PASS"
            } else {
                "< 10 s: FAIL"
            }
        } else {
            ""
        };
        println!(
            "| {} | {} | {} | {:.3} | {:.2} | {target} |",
            r.nodes,
            r.events,
            r.decisions,
            r.seconds,
            r.seconds * 1e3 / r.events.max(1) as f64
        );
    }
    println!(
        "\nGPT-3 6.7B, nodes of 8 H100s, f = 1, 4 samples per node per step; one simulated \
         week; each failure replaced after 10 min; oobleck policy (a reconfig decision per \
         event)"
    );
    Ok(())
}
