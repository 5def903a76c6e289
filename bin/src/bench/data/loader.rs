//! The loader's share of a step: the time to produce every microbatch of a step of the
//! default run (the workload's own `microbatch`, tensors included) against the step time of
//! that run measured by `train` itself.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use candle_core::Device;
use oobleck_core::runtime::wire::records::StepMetrics;
use oobleck_core::runtime::Workload;
use oobleck_models::data::WeightedSource;
use oobleck_models::workload::GptWorkload;
use serde::Serialize;

use super::super::child::{Reaper, TrainProcess};
use super::memory::Corpus;
use super::BenchDataArgs;
use crate::config::{batch_shape, workload_config, TrainConfig};

/// Steps whose microbatches are produced and timed per corpus.
const LOADER_STEPS: u64 = 50;

/// One corpus's loader time against the default run's step.
#[derive(Debug, Clone, Serialize)]
pub struct LoaderCost {
    /// `None`: the shipped corpus.
    pub megabytes: Option<u64>,
    pub microbatches_per_step: u32,
    pub loader_ms_per_step: f64,
    pub step_ms: f64,
    pub share_pct: f64,
}

/// The default run's step time (a real `train --nodes 1` of `a.steps` steps), then the
/// loader's time per step on the shipped corpus and on each of `corpora`.
pub fn run(
    a: &BenchDataArgs,
    train: &Path,
    reaper: &Reaper,
    scratch: &Path,
    corpora: &[Corpus],
) -> Result<Vec<LoaderCost>> {
    let step_ms = default_step_ms(a, train, reaper, scratch)?;
    let mut rows = vec![loader_cost(None, step_ms)?];
    for c in corpora {
        rows.push(loader_cost(Some(c), step_ms)?);
    }
    Ok(rows)
}

fn loader_cost(corpus: Option<&Corpus>, step_ms: f64) -> Result<LoaderCost> {
    let mut cfg = TrainConfig::default();
    if let Some(c) = corpus {
        cfg.data = vec![WeightedSource {
            weight: None,
            path: c.dir.clone(),
        }];
    }
    let batch = batch_shape(&cfg)?;
    let workload = GptWorkload::new(workload_config(&cfg), batch)?;
    let mut elapsed = Duration::ZERO;
    for step in 0..LOADER_STEPS {
        let t0 = Instant::now();
        for k in 0..batch.global_microbatches {
            workload
                .microbatch(cfg.seed, step, k, &Device::Cpu)
                .map_err(|e| anyhow::anyhow!("microbatch {k} of step {step}: {e}"))?;
        }
        elapsed += t0.elapsed();
    }
    let loader_ms = elapsed.as_secs_f64() * 1e3 / LOADER_STEPS as f64;
    Ok(LoaderCost {
        megabytes: corpus.map(|c| c.megabytes),
        microbatches_per_step: batch.global_microbatches,
        loader_ms_per_step: loader_ms,
        step_ms,
        share_pct: 100.0 * loader_ms / step_ms,
    })
}

/// The median step of `train --nodes 1` with the default settings, from its metrics (the
/// first step, which builds and warms up, left out).
fn default_step_ms(
    a: &BenchDataArgs,
    train: &Path,
    reaper: &Reaper,
    scratch: &Path,
) -> Result<f64> {
    let out = scratch.join("loader-run");
    let args: Vec<String> = [
        "--nodes",
        "1",
        "--steps",
        &a.steps.to_string(),
        "--out",
        &out.display().to_string(),
    ]
    .map(String::from)
    .to_vec();
    eprintln!("bench data: {} {}", train.display(), args.join(" "));
    let log = scratch.join("loader-run.log");
    let exit =
        TrainProcess::spawn(reaper, train, &args, &log)?.wait(Duration::from_secs(a.timeout_s))?;
    if !exit.status.success() {
        bail!(
            "the default run failed ({}); see {}",
            exit.status,
            log.display()
        );
    }
    let text = std::fs::read_to_string(out.join("metrics.jsonl"))?;
    let walls: Vec<f64> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<StepMetrics>(l).ok())
        .map(|m| m.wall_s)
        .collect();
    let steps: Vec<f64> = walls.windows(2).map(|w| (w[1] - w[0]) * 1e3).collect();
    if steps.is_empty() {
        bail!("the default run logged fewer than 2 steps; raise --steps");
    }
    Ok(super::super::median(&steps))
}
