//! From flags to a trace and policies.

use anyhow::{bail, Context};

use oobleck_core::simulate::generate::{generate, Failures};
use oobleck_core::simulate::policies::{
    fault_free_samples_per_s, CheckpointRestart, Costs, OobleckPolicy, Redundancy, SimWorkload,
};
use oobleck_core::simulate::table::{Experiment, System, TableInputs, TablePolicy};
use oobleck_core::simulate::{parse_duration_ms, Policy, Trace};

use super::SimulateArgs;

/// A policy `--policy` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PolicyName {
    /// This project's in-place recovery from the same templates; checkpoint past f.
    Oobleck,
    /// Varuna-like: checkpoints, and a restart from the last one at every loss.
    CheckpointRestart,
    /// Bamboo-like: redundant computation of each node's successor's layers.
    Redundancy,
    /// The authors' simulators from their tables (--inputs, --system, --experiment).
    Table,
}

/// The cost model of our own policies. Unset flags take the defaults of
/// `oobleck_core::simulate::policies::Costs` (what `oobleck bench recovery` measured where
/// the runtime measures it).
#[derive(Debug, Clone, clap::Args)]
pub struct CostArgs {
    /// From a node's death until recovery starts [default: 6ms, bench recovery's median].
    #[arg(long)]
    pub detect: Option<String>,
    /// Computing the new plan [default: 10ms, the planner bench at 10,000 nodes].
    #[arg(long)]
    pub replan: Option<String>,
    /// Rebuilding the communicators of a new generation [default: 262ms, bench recovery].
    #[arg(long)]
    pub rebuild: Option<String>,
    /// Layer copies, GB/s into each node [default: the device's inter-node link].
    #[arg(long)]
    pub copy_gbps: Option<f64>,
    /// From a node's `add` until it can train [default: 45s, as the authors' simulators].
    #[arg(long)]
    pub startup: Option<String>,
    /// Restarting every process before reading the checkpoint [default: 30s].
    #[arg(long)]
    pub restart: Option<String>,
    /// Checkpoint storage, GB/s per node, writes and reads [default: 2].
    #[arg(long)]
    pub storage_gbps: Option<f64>,
    /// oobleck: GB/s of the in-memory snapshot a background checkpoint stalls training for
    /// [default: 4, bench recovery's checkpoint stall].
    #[arg(long)]
    pub snapshot_gbps: Option<f64>,
    /// A checkpoint every K steps, `never`, or `auto`: the Young–Daly interval
    /// sqrt(2 x checkpoint time x the trace's mean time between failures) [default: auto].
    #[arg(long, value_name = "K|auto|never")]
    pub checkpoint_every: Option<String>,
    /// Redundancy: extra computation as a share of a step [default: 0.333].
    #[arg(long)]
    pub redundant_overhead: Option<f64>,
    /// Redundancy: slowdown while a node covers for its dead successor [default: 1.5].
    #[arg(long)]
    pub fallback_slowdown: Option<f64>,
}

impl CostArgs {
    pub fn costs(&self) -> anyhow::Result<Costs> {
        let d = Costs::default();
        let ms = |flag: &str, v: &Option<String>, default: f64| -> anyhow::Result<f64> {
            match v {
                None => Ok(default),
                Some(text) => parse_duration_ms(text)
                    .map(|ms| ms as f64)
                    .map_err(|e| anyhow::anyhow!("--{flag}: {e}")),
            }
        };
        let costs = Costs {
            detect_ms: ms("detect", &self.detect, d.detect_ms)?,
            replan_ms: ms("replan", &self.replan, d.replan_ms)?,
            rebuild_ms: ms("rebuild", &self.rebuild, d.rebuild_ms)?,
            copy_gbps: self.copy_gbps.unwrap_or(d.copy_gbps),
            startup_ms: ms("startup", &self.startup, d.startup_ms)?,
            restart_ms: ms("restart", &self.restart, d.restart_ms)?,
            storage_gbps: self.storage_gbps.unwrap_or(d.storage_gbps),
            snapshot_gbps: self.snapshot_gbps.unwrap_or(d.snapshot_gbps),
            checkpoint_every: match self.checkpoint_every.as_deref() {
                None | Some("auto") => d.checkpoint_every,
                Some("never") => Some(0),
                Some(k) => Some(k.parse().map_err(|_| {
                    anyhow::anyhow!("--checkpoint-every {k}: expected a step count, auto or never")
                })?),
            },
            redundant_overhead: self.redundant_overhead.unwrap_or(d.redundant_overhead),
            fallback_slowdown: self.fallback_slowdown.unwrap_or(d.fallback_slowdown),
        };
        costs.validate().map_err(|e| anyhow::anyhow!("--{e}"))?;
        Ok(costs)
    }
}

/// The trace file, or the generated trace.
pub fn trace(args: &SimulateArgs) -> anyhow::Result<Trace> {
    match (&args.trace, &args.generate_failures) {
        (Some(path), None) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading trace {}", path.display()))?;
            Trace::parse(&text).with_context(|| format!("trace {}", path.display()))
        }
        (None, Some(mtbf)) => {
            let Some(nodes) = args.nodes else {
                bail!("--generate-failures needs --nodes N (the cluster's size)");
            };
            let flag = |name: &str, text: &str| {
                parse_duration_ms(text).map_err(|e| anyhow::anyhow!("--{name}: {e}"))
            };
            let replace_after_ms = match args.replace_after.as_str() {
                "never" => None,
                text => Some(flag("replace-after", text)?),
            };
            let failures = Failures {
                nodes,
                mtbf_ms: flag("generate-failures", mtbf)?,
                replace_after_ms,
                duration_ms: flag("duration", &args.duration)?,
                seed: args.seed,
            };
            generate(&failures).map_err(|e| anyhow::anyhow!("--{e}"))
        }
        _ => bail!(
            "give a trace: --trace FILE (e.g. datasets/simulator/traces/10m.csv) or \
             --generate-failures MTBF --nodes N [--duration 7d --seed 0]"
        ),
    }
}

/// The authors' model names and the presets of ours that have their shapes (the digest's
/// table of the artifact's models; BERT-large and GPT-2-ours have no preset here).
const TABLE_MODELS: [(&str, &str); 3] = [
    ("GPT-3-medium", "gpt3-350m"),
    ("GPT-3-2_7b", "gpt3-2.7b"),
    ("GPT-3-6_7b", "gpt3-6.7b"),
];

/// `--model` as a preset of ours (an authors' name is translated when we have it).
fn preset_of(model: &str) -> anyhow::Result<&str> {
    match TABLE_MODELS.iter().find(|(theirs, _)| *theirs == model) {
        Some((_, ours)) => Ok(ours),
        None if model.chars().next().is_some_and(|c| c.is_ascii_uppercase()) => bail!(
            "--model {model} is a model of the authors' tables with no preset here; our own \
             policies need a preset (e.g. gpt3-2.7b) or --profile FILE"
        ),
        None => Ok(model),
    }
}

/// `--model` as a model of the authors' tables.
fn table_model(model: &str) -> &str {
    TABLE_MODELS
        .iter()
        .find(|(_, ours)| *ours == model)
        .map_or(model, |(theirs, _)| theirs)
}

/// A policy to run, and the fault-free throughput it is measured against.
pub struct Contender {
    pub policy: Box<dyn Policy>,
    pub fault_free: Option<f64>,
}

/// The policies `args` ask for.
pub fn policies(args: &SimulateArgs, trace: &Trace) -> anyhow::Result<Vec<Contender>> {
    let mut names = args.policies.clone();
    if names.is_empty() {
        names = match args.inputs {
            Some(_) => vec![PolicyName::Table],
            None => vec![
                PolicyName::Oobleck,
                PolicyName::CheckpointRestart,
                PolicyName::Redundancy,
            ],
        };
    }
    // The yardstick: the same node-hours with no failure to handle.
    let mean_nodes = (trace.mean_nodes().round() as u32).max(1);
    let end_ms = args
        .end
        .as_deref()
        .map(|t| parse_duration_ms(t).map_err(|e| anyhow::anyhow!("--end: {e}")))
        .transpose()?;
    let mut out = Vec::new();
    let own = names.iter().any(|n| *n != PolicyName::Table);
    let work = if own { Some(workload(args)?) } else { None };
    // One yardstick for all of our policies: they plan the same workload.
    let own_fault_free = (work.as_ref()).and_then(|w| fault_free_samples_per_s(w, mean_nodes).ok());
    let costs = args.costs.costs()?;
    for name in names {
        if name == PolicyName::Table {
            for p in table_policies(args)? {
                let inputs = p.inputs();
                let row = TableInputs::row(mean_nodes as usize);
                let step = inputs.step_delta_ms[row] as f64;
                out.push(Contender {
                    fault_free: Some(inputs.samples_per_step / step * 1e3),
                    policy: Box::new(p),
                });
            }
            continue;
        }
        let work = work.clone().expect("built for our own policies");
        let fault_free = own_fault_free;
        let policy: Box<dyn Policy> = match name {
            PolicyName::Oobleck => Box::new(OobleckPolicy {
                work,
                costs,
                end_ms,
            }),
            PolicyName::CheckpointRestart => Box::new(CheckpointRestart {
                work,
                costs,
                end_ms,
            }),
            PolicyName::Redundancy => Box::new(Redundancy {
                work,
                costs,
                end_ms,
            }),
            PolicyName::Table => unreachable!("handled above"),
        };
        out.push(Contender { policy, fault_free });
    }
    Ok(out)
}

fn workload(args: &SimulateArgs) -> anyhow::Result<SimWorkload> {
    let mut w = args.work.clone();
    if w.profile.is_none() {
        w.model = preset_of(&w.model)?.to_string();
    }
    crate::plan_cmd::workload(&w)
}

fn table_policies(args: &SimulateArgs) -> anyhow::Result<Vec<TablePolicy>> {
    let Some(path) = &args.inputs else {
        bail!(
            "--policy table needs --inputs FILE: the authors' tables, \
             datasets/simulator/sim_inputs.json"
        );
    };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading inputs {}", path.display()))?;
    let experiment: Experiment = match &args.experiment {
        Some(e) => e.parse()?,
        None => Experiment::default(),
    };
    let systems: Vec<System> = if args.systems.is_empty() {
        vec![System::Oobleck, System::Varuna, System::Bamboo]
    } else {
        args.systems
            .iter()
            .map(|s| s.parse())
            .collect::<Result<_, _>>()?
    };
    let model = table_model(&args.work.model);
    systems
        .into_iter()
        .map(|s| {
            let inputs = TableInputs::parse(&text, model, s)
                .with_context(|| format!("inputs {}", path.display()))?;
            Ok(TablePolicy::new(inputs, experiment))
        })
        .collect()
}

/// One line on what was simulated, for the table's header.
pub fn describe(args: &SimulateArgs) -> String {
    let w = &args.work;
    let model = match &w.profile {
        Some(p) => format!("profile {}", p.display()),
        None => w.model.clone(),
    };
    format!(
        "model {model} on {} x {} per node, f = {}, global batch {} samples of {}",
        w.device, w.devices_per_node, w.fault_threshold, w.global_batch_size, w.microbatch_size
    )
}
