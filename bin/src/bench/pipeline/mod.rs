//! `oobleck bench pipeline`: a real 1F1B pipeline measured against the `schedule/` simulator.
//!
//! For each configuration `S x P` (stages x pipeline replicas) it runs every rank as a thread of
//! this process over the real TCP data plane on 127.0.0.1, and reports:
//!
//! - the stages the planner cuts from a measured per-layer profile (`oobleck_core::profiler`,
//!   in the rank's own thread pool), the planner's predicted iteration time for them, and how
//!   balanced they are, planned and in the running pipeline;
//! - the measured iteration time (`StageRunner::run_iteration`, the pipeline makespan) against
//!   that prediction and against `schedule::simulate` fed with stage times profiled in
//!   isolation and a measured p2p time;
//! - the bubble fraction per stage, `1 - busy / makespan`, where busy is the rank's time inside
//!   the iteration but outside communicator calls, against the simulation's and `(S-1)/(m+S-1)`;
//! - the gradient sync time of a rank (the bucket all-reduces the engine starts on a background
//!   thread during its last backward, plus what `execution::sync_gradients` does afterwards) and
//!   the part of it that ran while the rank's main thread was still busy with its iteration (the
//!   measured overlap); the part of `sync_gradients` spent waiting for peers still in their
//!   iteration is shown too;
//! - the control-plane cost of committing a step with the real `runtime::master::Master` and `runtime::node::Agent`.
//!
//! ```text
//!  profile: every layer (profiler) ─► planner ─► stages + predicted iteration
//!           each stage alone, one microbatch, median of reps ─► StageTimes ─┐
//!  p2p: ping-pong of one activation between ranks 0 and 1 ─► p2p_ns ───────┴► simulate ─► sim
//!  run:   S·P rank threads (1-thread rayon pool each) ── TCP ── run_iteration ─► measured
//!                                                        └─ sync_gradients + AdamW
//!  control plane: Master + one Agent per rank, in-process, 127.0.0.1 ─► per-step round trip
//! ```
//!
//! Threads: each rank (and the profiler) runs inside its own rayon pool of `--threads-per-rank`
//! threads, so the fused kernels and Candle's matmuls of one rank do not spill onto the cores
//! of another, as separate worker processes would not. With more ranks than cores the ranks
//! share cores and every measured time is inflated; the table says so.
//!
//! Files: `profile` (the model, its data, the stages profiled alone and cut to balance),
//! `comm` (the timed TCP data plane), `ranks` (one configuration's rank threads), `summary`
//! (their records to a row), `control` (the control-plane round trip), `table` (the human
//! output and the small statistics).

use std::time::Duration;

use anyhow::{bail, Context, Result};
use oobleck_core::schedule::Schedule;
use serde::Serialize;

mod comm;
mod control;
mod profile;
mod ranks;
mod summary;
mod table;

pub use control::control_plane;
pub use summary::theoretical_bubble;

use profile::{build_model, Data};
use ranks::run_config;
use table::table;

/// Measure a real pipeline against the schedule simulator, its bubble, gradient sync and the
/// control-plane cost per step.
#[derive(clap::Args, Clone, Debug)]
pub struct BenchPipelineArgs {
    /// Model preset (see `oobleck models`).
    #[arg(long, default_value = "gpt-mini")]
    pub model: String,
    /// Override the preset's vocabulary size (a smaller head balances the stages).
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Tokens per sample.
    #[arg(long, default_value_t = 64)]
    pub seq_len: usize,
    /// Samples per microbatch (`b`).
    #[arg(long, default_value_t = 4)]
    pub microbatch_size: u32,
    /// Microbatches per pipeline per iteration (`m`).
    #[arg(long, default_value_t = 8)]
    pub microbatches: u32,
    /// Configurations `SxP`: S stages, P pipeline replicas (P >= 2 makes the gradient sync
    /// cross pipelines), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "2x1,2x2")]
    pub configs: Vec<String>,
    /// Pipeline schedules to run each configuration under, on the same stages, side by side:
    /// 1f1b, zb-h1, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1f1b")]
    pub schedules: Vec<Schedule>,
    /// Untimed iterations first.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Timed iterations (medians are reported).
    #[arg(long, default_value_t = 3)]
    pub iters: usize,
    /// Repetitions of each profiled forward/backward (median; other load on a shared machine
    /// makes single samples vary by 2x).
    #[arg(long, default_value_t = 10)]
    pub profile_reps: usize,
    /// Ping-pongs of one activation for the p2p time (median).
    #[arg(long, default_value_t = 20)]
    pub p2p_reps: usize,
    /// Committed steps of the control-plane measurement (median).
    #[arg(long, default_value_t = 200)]
    pub cp_steps: usize,
    /// Rayon threads of each rank's own pool (0 = all ranks share the global pool).
    #[arg(long, default_value_t = 1)]
    pub threads_per_rank: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Bound of every data-plane and control-plane operation, seconds.
    #[arg(long, default_value_t = 120)]
    pub timeout_s: u64,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One `S x P` configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Config {
    pub stages: usize,
    pub pipelines: usize,
}

impl std::str::FromStr for Config {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        let (a, b) = s
            .split_once('x')
            .with_context(|| format!("configuration `{s}`: expected SxP, e.g. 2x1"))?;
        let c = Config {
            stages: a
                .trim()
                .parse()
                .with_context(|| format!("stages in `{s}`"))?,
            pipelines: b
                .trim()
                .parse()
                .with_context(|| format!("pipelines in `{s}`"))?,
        };
        if c.stages == 0 || c.pipelines == 0 {
            bail!("configuration `{s}`: stages and pipelines must be at least 1");
        }
        Ok(c)
    }
}

/// Profiled time of one stage, one microbatch alone.
#[derive(Clone, Debug, Serialize)]
pub struct StageProfile {
    pub layers: (usize, usize),
    pub forward_ms: f64,
    pub backward_ms: f64,
    /// The backward split as ZB-H1 runs it: B (input gradient) and W (weight gradients).
    pub split_b_ms: f64,
    pub split_w_ms: f64,
    /// The planner's forward + backward + p2p of the stage per microbatch, from the per-layer
    /// profile.
    pub planned_ms: f64,
    /// In the real pipeline: the stage's busy time (outside communicator calls) per
    /// microbatch, median over iterations, mean over pipelines. Above `forward + backward`
    /// when the stage ran slower than alone (shared cores, memory bandwidth, data-plane copies).
    pub pipeline_busy_ms: f64,
}

/// The control-plane round trip per committed step.
#[derive(Clone, Debug, Serialize)]
pub struct ControlPlane {
    pub agents: usize,
    pub steps: usize,
    /// Which agent -> master message stands for "my gradients are reduced".
    pub ready_leg: String,
    /// Median of (first agent sends -> last agent holds `StepCommitted`), ms.
    pub round_trip_ms: f64,
    pub p90_ms: f64,
}

/// One row of the table: everything measured for one configuration.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub schedule: Schedule,
    pub stages: usize,
    pub pipelines: usize,
    pub ranks: usize,
    pub cores: usize,
    pub oversubscribed: bool,
    /// Microbatches per pipeline.
    pub m: u32,
    pub stage_profile: Vec<StageProfile>,
    /// One-way time of one activation between neighbouring ranks (tensor -> wire -> tensor).
    pub p2p_ms: f64,
    /// Median over the timed iterations of the slowest pipeline's makespan.
    pub measured_iter_ms: f64,
    /// The planner's `T(m)` of its template, from the measured per-layer profile.
    pub planner_iter_ms: f64,
    /// measured / planner.
    pub ratio_to_planner: f64,
    pub within_10pct_of_planner: bool,
    /// Slowest over fastest stage minus 1: the plan's (planned per-stage times) and the
    /// running pipeline's (busy time per microbatch).
    pub planned_imbalance: f64,
    pub measured_imbalance: f64,
    pub simulated_iter_ms: f64,
    /// measured / simulated.
    pub ratio: f64,
    pub within_15pct: bool,
    /// Post hoc, not a prediction: the simulator fed with each stage's busy time in the real
    /// pipeline (split into forward/backward as in its profile). measured / this isolates the
    /// schedule model from how fast the stages computed while running side by side.
    pub simulated_from_busy_ms: f64,
    pub ratio_to_busy_sim: f64,
    pub bubble_measured_mean: f64,
    pub bubble_measured_worst: f64,
    pub bubble_simulated_mean: f64,
    pub bubble_theory: f64,
    /// Gradient sync wall time (background bucket all-reduces + `sync_gradients`), median over
    /// iterations of the slowest rank.
    pub sync_ms: f64,
    /// Part of it run while the rank's main thread was still in its iteration (median).
    pub sync_overlap_backward_ms: f64,
    pub sync_overlap_pct: f64,
    /// Part of it spent while some other rank was still in its iteration (waiting for peers).
    pub sync_wait_for_peers_ms: f64,
    /// Whole step: iteration + sync + AdamW, median of the slowest rank.
    pub step_ms: f64,
    pub control_plane_ms: f64,
    /// Control-plane round trip as a percentage of the measured step.
    pub control_plane_pct: f64,
    pub control_plane_within_2pct: bool,
    /// Last loss seen (finite: the pipeline really trained).
    pub loss: f64,
}

#[derive(Serialize)]
struct Report {
    model: String,
    vocab: usize,
    seq_len: usize,
    microbatch_size: u32,
    warmup: usize,
    iters: usize,
    threads_per_rank: usize,
    cores: usize,
    /// `/proc/loadavg` (1, 5, 15 min) before and after: other load on a shared machine
    /// inflates every time here.
    load_before: Option<String>,
    load_after: Option<String>,
    control_plane: Vec<ControlPlane>,
    rows: Vec<Row>,
}

/// The 1, 5 and 15 minute load averages (Linux).
fn loadavg() -> Option<String> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    Some(s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Measures every configuration; the rows of the table.
pub fn measure(args: &BenchPipelineArgs) -> Result<(Vec<Row>, Vec<ControlPlane>, usize)> {
    if args.iters == 0 || args.profile_reps == 0 || args.microbatches == 0 {
        bail!("--iters, --profile-reps and --microbatches must be at least 1");
    }
    if args.microbatch_size == 0 {
        bail!("--microbatch-size must be at least 1");
    }
    if args.schedules.is_empty() {
        bail!("--schedules names no schedule: give 1f1b, zb-h1 or both");
    }
    let configs = args
        .configs
        .iter()
        .map(|c| c.parse::<Config>())
        .collect::<Result<Vec<_>>>()?;
    let (model, vocab) = build_model(args)?;
    let data = Data {
        vocab: vocab as u32,
        b: args.microbatch_size as usize,
        t: args.seq_len,
        seed: args.seed,
    };
    let timeout = Duration::from_secs(args.timeout_s);
    let mut rows = Vec::with_capacity(configs.len());
    let mut cps: Vec<ControlPlane> = Vec::new();
    for c in configs {
        let measured = run_config(args, model.as_ref(), data, c)
            .with_context(|| format!("configuration {}x{}", c.stages, c.pipelines))?;
        for mut row in measured {
            let cp = match cps.iter().find(|cp| cp.agents == row.ranks) {
                Some(cp) => cp.clone(),
                None => {
                    let cp = control_plane(row.ranks, args.cp_steps, timeout)
                        .context("control-plane measurement")?;
                    cps.push(cp.clone());
                    cp
                }
            };
            row.control_plane_ms = cp.round_trip_ms;
            row.control_plane_pct = 100.0 * cp.round_trip_ms / row.step_ms;
            row.control_plane_within_2pct = row.control_plane_pct < 2.0;
            rows.push(row);
        }
    }
    Ok((rows, cps, vocab))
}

pub fn run(args: &BenchPipelineArgs) -> Result<()> {
    if args.threads_per_rank > 0 && std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        // Candle's elementwise ops run on one process-wide pool of spinning threads behind a
        // lock: rank threads sharing it wait for each other (in-pipeline stages measured 1.6x
        // their time alone on gpt2). Sized to one rank, it runs each op on the caller's
        // thread, as a rank's own process would. Nothing has used Candle yet at this point.
        std::env::set_var("CANDLE_NUM_THREADS", args.threads_per_rank.to_string());
    }
    let load_before = loadavg();
    let (rows, cps, vocab) = measure(args)?;
    let report = Report {
        load_before,
        load_after: loadavg(),
        model: args.model.clone(),
        vocab,
        seq_len: args.seq_len,
        microbatch_size: args.microbatch_size,
        warmup: args.warmup,
        iters: args.iters,
        threads_per_rank: args.threads_per_rank,
        cores: cores(),
        control_plane: cps,
        rows,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", table(&report));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configurations_parse_as_s_x_p_of_at_least_one() {
        assert!("2x0".parse::<Config>().is_err());
        assert_eq!(
            "3x2".parse::<Config>().unwrap(),
            Config {
                stages: 3,
                pipelines: 2
            }
        );
    }

    #[test]
    fn a_tiny_run_reports_finite_numbers() {
        let args = BenchPipelineArgs {
            model: "gpt-tiny".into(),
            vocab: Some(128),
            seq_len: 16,
            microbatch_size: 2,
            microbatches: 3,
            configs: vec!["2x2".into()],
            schedules: vec![Schedule::OneFOneB, Schedule::ZbH1],
            warmup: 0,
            iters: 1,
            profile_reps: 1,
            p2p_reps: 2,
            cp_steps: 3,
            threads_per_rank: 1,
            seed: 1,
            timeout_s: 30,
            json: false,
        };
        let (rows, cps, _) = measure(&args).unwrap();
        assert_eq!(rows.len(), 2, "one row per schedule");
        assert_eq!(cps.len(), 1);
        assert_eq!(
            (rows[0].schedule, rows[1].schedule),
            (Schedule::OneFOneB, Schedule::ZbH1)
        );
        for r in &rows[1].stage_profile {
            assert!(r.split_b_ms > 0.0 && r.split_w_ms > 0.0, "{r:?}");
        }
        assert!(rows[1].loss.is_finite() && rows[1].simulated_iter_ms > 0.0);
        let r = &rows[0];
        assert_eq!((r.stages, r.pipelines, r.ranks), (2, 2, 4));
        for (name, v) in [
            ("iter", r.measured_iter_ms),
            ("sim", r.simulated_iter_ms),
            ("planner", r.planner_iter_ms),
            ("planned imbalance", r.planned_imbalance),
            ("measured imbalance", r.measured_imbalance),
            ("ratio", r.ratio),
            ("busy sim", r.simulated_from_busy_ms),
            ("bubble", r.bubble_measured_mean),
            ("sync", r.sync_ms),
            ("step", r.step_ms),
            ("ctl", r.control_plane_ms),
            ("ctl %", r.control_plane_pct),
            ("loss", r.loss),
        ] {
            assert!(v.is_finite() && v >= 0.0, "{name} = {v}");
        }
        assert!(r.measured_iter_ms > 0.0 && r.simulated_iter_ms > 0.0);
        assert_eq!(r.stage_profile.len(), 2);
        for p in &r.stage_profile {
            assert!(p.forward_ms > 0.0 && p.backward_ms > 0.0, "{p:?}");
            assert!(
                p.pipeline_busy_ms.is_finite() && p.pipeline_busy_ms > 0.0,
                "{p:?}"
            );
        }
        assert_eq!(r.stage_profile[1].layers.1, 4, "the stages cover the model");
        assert!(r.step_ms >= r.measured_iter_ms);
        // A random-init model's loss is near ln(vocab).
        assert!((r.loss - (128f64).ln()).abs() < 1.0, "loss {}", r.loss);
        assert!(
            (0.0..=100.0).contains(&r.sync_overlap_pct),
            "overlap {}%",
            r.sync_overlap_pct
        );
        let report = Report {
            model: args.model.clone(),
            vocab: 128,
            seq_len: 16,
            microbatch_size: 2,
            warmup: 0,
            iters: 1,
            threads_per_rank: 1,
            cores: cores(),
            load_before: loadavg(),
            load_after: None,
            control_plane: cps,
            rows,
        };
        let t = table(&report);
        assert!(t.contains("2x2"), "{t}");
        assert!(t.contains("zb-h1/1f1b measured step ratio: "), "{t}");
        serde_json::to_string(&report).unwrap();
    }
}
