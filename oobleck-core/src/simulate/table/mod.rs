//! The `table` policy: the Oobleck authors' three trace simulators (Oobleck, Varuna, Bamboo;
//! SOSP '23 artifact, `tools/simulator/` of github.com/SymbioticLab/Oobleck) replayed from
//! their own data, quirks included, so that our numbers can be checked against theirs.
//! How their simulators work, which quirks we keep on purpose, how their counters map to
//! [`TimeFractions`](crate::simulate::TimeFractions) and the validation table (ours vs
//! theirs, every model, trace and system) are in `simulate/table/README.md`.
//!
//! ```text
//!   sim_inputs.json ──TableInputs::parse(model, system)──┐
//!   Trace ───────────────────────────────────────────────┼─► TablePolicy::run ─► Outcome
//!   Experiment (driver parameters of one eval script) ───┘    (heapq-exact event loop)
//! ```

mod inputs;
mod machine;
mod pyheap;
#[cfg(test)]
mod tests;

pub use inputs::TableInputs;

use std::str::FromStr;

use machine::{Ending, Flavor, Machine, Params, Run};

use super::outcome::{Ledger, Mark, Outcome, TimeKind, TimePoint};
use super::trace::Trace;
use super::{Policy, SimError};

/// Which of the authors' simulators to replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum System {
    Oobleck,
    /// Checkpoint every 10 steps, roll back to the last checkpoint on each removal.
    Varuna,
    /// Varuna with free checkpoints every 2 steps (`eval_no_ckpt_overhead.py`).
    VarunaNoCkpt,
    /// Redundant computation: a lost node's stage is taken over by its predecessor.
    Bamboo,
}

impl System {
    pub const ALL: [System; 4] = [
        System::Oobleck,
        System::Varuna,
        System::VarunaNoCkpt,
        System::Bamboo,
    ];

    pub fn name(self) -> &'static str {
        match self {
            System::Oobleck => "oobleck",
            System::Varuna => "varuna",
            System::VarunaNoCkpt => "varuna_no_ckpt",
            System::Bamboo => "bamboo",
        }
    }

    /// The key of this system's tables and constants in `sim_inputs.json`.
    pub(crate) fn inputs_key(self) -> &'static str {
        match self {
            System::Oobleck => "oobleck",
            System::Varuna | System::VarunaNoCkpt => "varuna",
            System::Bamboo => "bamboo",
        }
    }

    fn flavor(self) -> Flavor {
        match self {
            System::Oobleck => Flavor::Oobleck,
            System::Varuna | System::VarunaNoCkpt => Flavor::Varuna,
            System::Bamboo => Flavor::Bamboo,
        }
    }
}

impl FromStr for System {
    type Err = SimError;
    fn from_str(s: &str) -> Result<System, SimError> {
        System::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| SimError::Setting {
                field: "system",
                value: s.to_string(),
                message: "expected oobleck, varuna, varuna_no_ckpt or bamboo".into(),
            })
    }
}

/// Which eval script's driver parameters to apply (`sim_inputs.json` `eval_driver_params`).
/// Without one, [`Experiment::TputVsFreq`] applies: it is the paper's main figure and the one
/// the authors' simulator README quotes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Experiment {
    /// `eval_tput_vs_freq.py`: 200 000 steps, hard stop, Varuna rolls back on every model.
    #[default]
    TputVsFreq,
    /// `eval_gcp_ec2.py`: Bamboo keeps its model's step budget; Varuna and Oobleck get 2e9
    /// steps; Varuna does not roll back for BERT-large, GPT-2 and GPT-3-medium.
    Spot,
    /// `eval_no_ckpt_overhead.py`: Varuna and Oobleck 200 000 steps, Varuna-no-ckpt 2e9.
    NoCkpt,
}

impl Experiment {
    pub const ALL: [Experiment; 3] = [Experiment::TputVsFreq, Experiment::Spot, Experiment::NoCkpt];

    pub fn name(self) -> &'static str {
        match self {
            Experiment::TputVsFreq => "tput_vs_freq",
            Experiment::Spot => "spot",
            Experiment::NoCkpt => "no_ckpt",
        }
    }

    /// The constructor arguments the eval script passes for `system`. Varuna-no-ckpt always
    /// gets the no-ckpt script's (it appears nowhere else); Bamboo, absent from the no-ckpt
    /// script, gets tput_vs_freq's.
    fn params(self, system: System, inp: &TableInputs) -> Params {
        let mut p = Params {
            steps_per_run: 200_000,
            hard_stop: true,
            no_fallback: false,
            no_ckpt_overhead: false,
            checkpoint_per_iter: inp.checkpoint_per_iter,
        };
        let small = matches!(
            inp.model.as_str(),
            "BERT-large" | "GPT-2-ours" | "GPT-3-medium"
        );
        match (self, system) {
            (_, System::VarunaNoCkpt) => {
                p.steps_per_run = 2_000_000_000;
                p.no_ckpt_overhead = true;
                p.checkpoint_per_iter = 2;
            }
            (Experiment::Spot, System::Bamboo) => p.steps_per_run = inp.default_steps_per_run,
            (Experiment::Spot, System::Varuna) => {
                p.steps_per_run = 2_000_000_000;
                // `no_small_model_fallback=True` only switches the three small models.
                p.no_fallback = small;
            }
            (Experiment::Spot, System::Oobleck) => p.steps_per_run = 2_000_000_000,
            _ => {}
        }
        p
    }
}

impl FromStr for Experiment {
    type Err = SimError;
    fn from_str(s: &str) -> Result<Experiment, SimError> {
        Experiment::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| SimError::Setting {
                field: "experiment",
                value: s.to_string(),
                message: "expected tput_vs_freq, spot or no_ckpt".into(),
            })
    }
}

/// The authors' simulator for one model and system under one experiment's parameters.
#[derive(Debug, Clone)]
pub struct TablePolicy {
    inputs: TableInputs,
    experiment: Experiment,
}

impl TablePolicy {
    pub fn new(inputs: TableInputs, experiment: Experiment) -> TablePolicy {
        TablePolicy { inputs, experiment }
    }

    pub fn inputs(&self) -> &TableInputs {
        &self.inputs
    }

    pub fn experiment(&self) -> Experiment {
        self.experiment
    }

    fn replay(&self, trace: &Trace) -> Run {
        let system = self.inputs.system;
        let params = self.experiment.params(system, &self.inputs);
        Machine::new(&self.inputs, system.flavor(), params).run(trace)
    }
}

impl Policy for TablePolicy {
    fn name(&self) -> String {
        format!("table/{}", self.inputs.system.name())
    }

    fn run(&self, trace: &Trace) -> Result<Outcome, SimError> {
        if trace.events().is_empty() {
            return Err(SimError::EmptyTrace);
        }
        let run = self.replay(trace);
        Ok(self.outcome(&run))
    }
}

impl TablePolicy {
    fn outcome(&self, run: &Run) -> Outcome {
        let system = self.inputs.system;
        let start_ms = run.start_delta.unwrap_or(0).max(0) as u64;
        let end_ms = (run.last_step_ms.round().max(0.0) as u64).max(start_ms);
        let (reconfigurations, restarts) = match system {
            // Every Oobleck removal is an in-place reconfiguration (2-10 s), not a restart.
            System::Oobleck => (run.fatal_failures, 0),
            System::Bamboo => (run.local_reconfigurations, run.fatal_failures),
            System::Varuna | System::VarunaNoCkpt => (0, run.fatal_failures),
        };
        let span_s = run.span_ms.max(0.0) / 1000.0;
        Outcome {
            policy: self.name(),
            average_samples_per_s: run.average,
            time_fractions: ledger(run).fractions(),
            start_ms,
            end_ms,
            samples: run.average * span_s,
            steps: run.steps.max(0) as u64,
            failures: run.removals,
            reconfigurations,
            restarts,
            timeline: timeline(run),
            marks: run
                .handled
                .iter()
                .map(|(t, change, node)| Mark {
                    t_ms: *t as u64,
                    change: *change,
                    node: node.clone(),
                })
                .collect(),
            notes: self.notes(run),
        }
    }

    fn notes(&self, run: &Run) -> Vec<String> {
        let inp = &self.inputs;
        let mut notes = Vec::new();
        match run.stop {
            Ending::HardStop => notes.push(format!(
                "stopped at {} ms: the hard stop (the trace's last heap entry)",
                run.ending_delta
            )),
            Ending::StepsPerRun => notes.push(format!(
                "stopped after the step budget ({} steps) at {} ms",
                run.steps, run.ending_delta
            )),
            Ending::EventsExhausted => notes.push("stopped when the events ran out".into()),
        }
        if inp.step_delta_ms.iter().all(|&s| s == 0) {
            notes.push(format!(
                "{} does not fit in memory on {} (the authors' table is all 0): throughput 0",
                inp.model,
                inp.system.name()
            ));
        }
        if let Some(n) = inp
            .step_delta_ms
            .iter()
            .position(|&s| s >= 1_000_000_000_000)
        {
            notes.push(format!(
                "at {} nodes the authors' throughput is 0: a step there never ends (1e12 ms \
                 counted as effective time)",
                n + inputs::MIN_NODES
            ));
        }
        if run.start_delta.is_none() {
            notes.push("the job never started (never 12 ready nodes)".into());
        } else if run.xs.is_empty() {
            notes.push("no step completed before the stop: throughput 0".into());
        }
        if run.removal_before_first_step {
            notes.push("a node left before the first step (the Python raises here)".into());
        }
        if run.step_with_no_active_node {
            notes.push("a step completed with no node left (the Python raises here)".into());
        }
        notes
    }
}

/// The authors' counters as a ledger: effective -> useful, fallback loss -> lost, restart ->
/// restart, rebalance -> reconfiguration, checkpoint -> checkpointing, Bamboo's redundant share
/// -> redundant, idle GPUs plus any of the averaged span no counter covers -> idle.
fn ledger(run: &Run) -> Ledger {
    ledger_of(&run.acc, run.span_ms)
}

/// [`ledger`] of any counters over a span of `span_ms` (the tests map the authors' own).
pub(super) fn ledger_of(a: &machine::Accumulators, span_ms: f64) -> Ledger {
    let mut l = Ledger::default();
    l.add(TimeKind::Useful, a.effective);
    l.add(TimeKind::Lost, a.fallback_loss);
    l.add(TimeKind::Restart, a.restart);
    l.add(TimeKind::Reconfiguration, a.rebalance);
    l.add(TimeKind::Checkpointing, a.checkpoint);
    l.add(TimeKind::Redundant, a.redundant);
    let uncovered = (span_ms.max(0.0) - a.sum()).max(0.0);
    l.add(TimeKind::Idle, a.idle_gpu + uncovered);
    l
}

/// The performance series as a step function, one point where the throughput changes; gaps
/// between steps (Varuna's checkpoint writes) read as 0.
fn timeline(run: &Run) -> Vec<TimePoint> {
    let n = run.xs.len().min(run.ys.len());
    let ms = |h: f64| (h * 3_600_000.0).round().max(0.0) as u64;
    let mut out: Vec<TimePoint> = Vec::new();
    let mut push = |t_ms: u64, v: f64| match out.last_mut() {
        Some(last) if last.samples_per_s == v => {}
        Some(last) if last.t_ms == t_ms => last.samples_per_s = v,
        _ => out.push(TimePoint {
            t_ms,
            samples_per_s: v,
        }),
    };
    let mut prev_end: Option<f64> = None;
    for i in (1..n).step_by(2) {
        if prev_end.is_some_and(|e| e < run.xs[i - 1]) {
            push(ms(prev_end.unwrap_or(0.0)), 0.0);
        }
        push(ms(run.xs[i - 1]), run.ys[i]);
        prev_end = Some(run.xs[i]);
    }
    if let Some(e) = prev_end {
        push(ms(e), 0.0);
    }
    out
}
