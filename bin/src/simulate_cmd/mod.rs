//! `oobleck simulate`: replays a failure trace (a file, or one generated from a node MTBF)
//! under several recovery policies, and prints where each spent its time; `--json` for
//! machines, `--plot` for a chart of throughput over time.
//!
//! ```text
//!   --trace FILE | --generate-failures MTBF ──► Trace
//!   --policy oobleck|checkpoint-restart|redundancy  (this project's planner, Costs flags)
//!   --policy table --inputs sim_inputs.json --system S (the authors' simulators)
//!        ──► Policy::run ──► Outcome ──► render (table | JSON) + plot::draw
//! ```

pub mod plot;
mod render;
mod setup;

use std::path::PathBuf;

use anyhow::Context;

use oobleck_core::simulate::Outcome;

pub use setup::{CostArgs, PolicyName};

/// Replay failures under recovery policies.
#[derive(Debug, Clone, clap::Args)]
pub struct SimulateArgs {
    /// A failure trace: CSV lines `delta_ms,add|remove,node` (the format of
    /// datasets/simulator/traces).
    #[arg(long, conflicts_with = "generate_failures")]
    pub trace: Option<PathBuf>,
    /// Generate the trace instead: one node's mean time between failures (e.g. 30d), for
    /// --nodes nodes over --duration, seeded by --seed.
    #[arg(long, value_name = "MTBF")]
    pub generate_failures: Option<String>,
    /// Nodes of a generated trace.
    #[arg(long, requires = "generate_failures")]
    pub nodes: Option<u32>,
    /// Length of a generated trace (90s, 10m, 6h, 70d).
    #[arg(long, default_value = "7d")]
    pub duration: String,
    /// Seed of a generated trace.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// A generated trace's replacement for each failed node arrives this long after it
    /// (`never` for none).
    #[arg(long, default_value = "10m")]
    pub replace_after: String,
    /// Write the trace that was simulated as CSV (useful with --generate-failures).
    #[arg(long)]
    pub save_trace: Option<PathBuf>,
    /// Policies to compare (repeatable): oobleck, checkpoint-restart, redundancy, table.
    /// Default: the first three, or table alone with --inputs.
    #[arg(long = "policy", value_enum)]
    pub policies: Vec<PolicyName>,
    #[command(flatten)]
    pub work: crate::plan_cmd::WorkloadArgs,
    #[command(flatten)]
    pub costs: CostArgs,
    /// The table policy's inputs: the authors' sim_inputs.json
    /// (datasets/simulator/sim_inputs.json).
    #[arg(long)]
    pub inputs: Option<PathBuf>,
    /// Which of the authors' simulators the table policy reproduces (repeatable): oobleck,
    /// varuna, varuna_no_ckpt, bamboo. Default: oobleck, varuna and bamboo.
    #[arg(long = "system")]
    pub systems: Vec<String>,
    /// The driver parameters of one of the authors' evaluation scripts: tput_vs_freq
    /// (default), spot or no_ckpt.
    #[arg(long)]
    pub experiment: Option<String>,
    /// Stop the simulation here instead of at the trace's last event (e.g. 24h).
    #[arg(long)]
    pub end: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Draw throughput over time of every policy to this file (.svg or .png).
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// Everything one `oobleck simulate` computed; the JSON output.
#[derive(Debug, serde::Serialize)]
pub struct SimulateOutput {
    pub trace: render::TraceSummary,
    /// What the job would train at on the trace's average node count with no failure and no
    /// fault-tolerance cost (f = 0, no checkpoints): the first policy's yardstick.
    pub fault_free_samples_per_s: Option<f64>,
    pub policies: Vec<render::PolicyRow>,
    /// The first policy's average and fractions again, for one-policy scripts.
    pub average_samples_per_s: f64,
    pub time_fractions: oobleck_core::simulate::TimeFractions,
}

/// Runs every policy on the trace; writes the trace with `--save-trace`, and says on stderr
/// how long each policy took unless `--json`.
pub fn compute(args: &SimulateArgs) -> anyhow::Result<(SimulateOutput, Vec<Outcome>)> {
    if let Some(path) = &args.plot {
        plot::check_path(path)?;
    }
    let trace = setup::trace(args)?;
    if let Some(path) = &args.save_trace {
        std::fs::write(path, trace.to_csv())
            .with_context(|| format!("writing the trace to {}", path.display()))?;
    }
    let contenders = setup::policies(args, &trace)?;
    let mut outcomes = Vec::with_capacity(contenders.len());
    for c in &contenders {
        let p = &c.policy;
        let started = std::time::Instant::now();
        let out = p
            .run(&trace)
            .with_context(|| format!("simulating policy {}", p.name()))?;
        if !args.json {
            eprintln!(
                "simulate: {} in {:.2} s",
                p.name(),
                started.elapsed().as_secs_f64()
            );
        }
        outcomes.push(out);
    }
    let rows: Vec<render::PolicyRow> = outcomes
        .iter()
        .zip(&contenders)
        .map(|(o, c)| render::PolicyRow::of(o, c.fault_free))
        .collect();
    let first = &outcomes[0];
    let output = SimulateOutput {
        trace: render::TraceSummary::of(&trace, args),
        fault_free_samples_per_s: contenders.iter().find_map(|c| c.fault_free),
        average_samples_per_s: first.average_samples_per_s,
        time_fractions: first.time_fractions,
        policies: rows,
    };
    Ok((output, outcomes))
}

/// Runs `oobleck simulate`.
pub fn run(args: &SimulateArgs) -> anyhow::Result<()> {
    let (output, outcomes) = compute(args)?;
    if let Some(path) = &args.plot {
        let title = format!("Throughput under failures: {}", output.trace.name);
        plot::draw(&outcomes, &title, path)?;
        if !args.json {
            eprintln!("simulate: chart written to {}", path.display());
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&output)?);
    } else {
        print!("{}", render::table(&output, &setup::describe(args)));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
