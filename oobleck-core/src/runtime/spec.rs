//! How a job trains ([`TrainingSpec`], the runtime's own settings) and what every process of
//! it is told ([`JobConfig`]). Plain data below every room of the runtime: the wire carries
//! it, the job decides with it; it imports none of them.

use candle_core::DType;
use serde::{Deserialize, Serialize};

use crate::optim::{AdamW, AdamWConfig, LrSchedule};
use crate::planning::{DeviceSpec, Dtype, JobSpec};
use crate::schedule::Schedule;

/// A job setting that cannot work, or an optimizer that cannot be built from the settings.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("invalid job: {0}")]
    Invalid(String),
    /// Boxed: the engine's error is large, and this one travels inside the runtime's.
    #[error(transparent)]
    Core(Box<crate::Error>),
}

impl From<crate::Error> for SpecError {
    fn from(e: crate::Error) -> SpecError {
        SpecError::Core(Box::new(e))
    }
}

pub type Result<T> = std::result::Result<T, SpecError>;

/// The data plane between ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum DataPlane {
    /// TCP, everywhere (CPU workers, or GPUs without NCCL).
    #[default]
    Tcp,
    /// NCCL (feature `nccl`): device `d` of a node uses CUDA device `d`.
    Nccl,
}

impl std::str::FromStr for DataPlane {
    type Err = SpecError;

    /// `tcp` or `nccl`, as `--data-plane` and the job file name them.
    fn from_str(s: &str) -> Result<DataPlane> {
        match s {
            "tcp" => Ok(DataPlane::Tcp),
            "nccl" => Ok(DataPlane::Nccl),
            other => Err(SpecError::Invalid(format!(
                "--data-plane must be tcp or nccl, got {other:?}"
            ))),
        }
    }
}

/// Where a job's workers compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Compute {
    /// The host CPU, every worker.
    #[default]
    Cpu,
    /// One CUDA device per worker (feature `cuda`): device `d` of a node uses CUDA ordinal `d`
    /// of the devices the agent sees (`CUDA_VISIBLE_DEVICES` applies).
    Cuda,
}

/// `--inject-failure NODE@STEP`: `node` kills its processes with SIGKILL once `after_step`
/// is committed (demos and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InjectedFailure {
    pub node: u32,
    pub after_step: u64,
}

/// The global batch's shape: [`BatchShape::global_microbatches`] microbatches of
/// [`BatchShape::microbatch_size`] samples, named as the [`TrainingSpec`] names them. A
/// workload takes it from the job's spec ([`TrainingSpec::batch`]), never from its own
/// settings, so the batch is stated once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchShape {
    /// `b`: samples per microbatch.
    pub microbatch_size: u32,
    /// `B`: microbatches per step.
    pub global_microbatches: u32,
}

impl BatchShape {
    /// Samples per step, `B * b`.
    pub fn samples(&self) -> u64 {
        u64::from(self.microbatch_size) * u64::from(self.global_microbatches)
    }
}

/// How the runtime trains: the settings every process of a job shares. One name and one unit
/// per quantity: the global batch is [`TrainingSpec::global_microbatches`] microbatches of
/// [`TrainingSpec::microbatch_size`] samples, and everything else derives from those two.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainingSpec {
    /// Optimizer steps of the whole run (a resumed run continues to this step).
    pub steps: u64,
    /// Seeds the initialisation, the data order and dropout.
    pub seed: u64,
    /// `b`: samples per microbatch.
    pub microbatch_size: u32,
    /// `B`: microbatches per step; never changes during a run.
    pub global_microbatches: u32,
    /// Nodes the job waits for before its first plan.
    pub nodes: u32,
    /// `G`: devices (worker processes) per node.
    pub devices_per_node: u32,
    /// `f`: the job starts with at least `f + 1` pipelines.
    pub fault_threshold: u32,
    /// The device kind the planner models (`cpu`, `a100-80gb`, ...).
    pub device: String,
    /// Pin the pipeline sizes of the first generation (node counts in order) instead of
    /// letting the planner choose.
    pub pipeline_nodes: Option<Vec<u32>>,
    pub optimizer: AdamWConfig,
    pub lr: LrSchedule,
    /// Clip the global gradient norm to this; `None`: no clipping.
    pub grad_clip: Option<f64>,
    /// Write a checkpoint every this many steps (0: only at the end).
    pub checkpoint_every: u64,
    /// Evaluate every this many steps (0: only at the end).
    pub eval_every: u64,
    pub data_plane: DataPlane,
    pub inject_failures: Vec<InjectedFailure>,
    /// Where the workers compute.
    #[serde(default)]
    pub compute: Compute,
    /// Parameters and activations in bf16 (fp32 master weights and optimizer state), or fp32.
    #[serde(default)]
    pub precision: Dtype,
    /// Drop each layer's forward activations and recompute them in backward.
    #[serde(default)]
    pub recompute: bool,
    /// The pipeline schedule every pipeline runs (same values either way).
    #[serde(default)]
    pub schedule: Schedule,
    /// Usable memory of one device, bytes, where the planner's table does not know it: on the
    /// CPU, this machine's memory shared out among the ranks that run on it
    /// ([`super::host_memory::HostMemory::per_rank`]). `None`: the table's value.
    #[serde(default)]
    pub device_memory_bytes: Option<u64>,
}

impl TrainingSpec {
    /// The global batch's shape, as the workload is given it.
    pub fn batch(&self) -> BatchShape {
        BatchShape {
            microbatch_size: self.microbatch_size,
            global_microbatches: self.global_microbatches,
        }
    }

    /// Samples per step.
    pub fn global_batch_samples(&self) -> u64 {
        self.batch().samples()
    }

    /// The planner's job spec, with fault threshold `f`.
    pub fn job_spec(&self, f: u32) -> JobSpec {
        JobSpec::training(
            f,
            self.microbatch_size,
            self.global_microbatches,
            self.precision,
        )
    }

    /// The Candle dtype the workers compute in ([`crate::model::ForwardCtx::dtype`]).
    pub fn compute_dtype(&self) -> DType {
        self.precision.candle()
    }

    /// Where and how the workers compute, for the first line: `CPU`, or `CUDA, planned as
    /// h200-141gb`, then `bf16` and `recompute` when set.
    pub fn compute_words(&self) -> String {
        let mut words = vec![match self.compute {
            Compute::Cpu => "CPU".to_string(),
            Compute::Cuda => format!("CUDA, planned as {}", self.device),
        }];
        if self.precision == Dtype::Bf16 {
            words.push("bf16".into());
        }
        if self.recompute {
            words.push("recompute".into());
        }
        if self.schedule != Schedule::OneFOneB {
            words.push(self.schedule.to_string());
        }
        words.join(", ")
    }

    /// A fresh optimizer.
    pub fn optimizer(&self) -> Result<AdamW> {
        Ok(AdamW::new(self.optimizer)?)
    }

    /// The planner's model of the device, with [`TrainingSpec::device_memory_bytes`] when set.
    pub fn device_spec(&self) -> Result<DeviceSpec> {
        let named = DeviceSpec::named(&self.device).ok_or_else(|| {
            SpecError::Invalid(format!("the planner knows no device {:?}", self.device))
        })?;
        Ok(match self.device_memory_bytes {
            Some(bytes) => named.with_memory(bytes),
            None => *named,
        })
    }

    /// Whether the state after `step` is wanted before the end: a checkpoint or an evaluation.
    pub fn state_due(&self, step: u64) -> bool {
        self.checkpoint_due(step) || self.eval_due(step)
    }

    pub fn checkpoint_due(&self, step: u64) -> bool {
        self.checkpoint_every > 0 && step % self.checkpoint_every == 0
    }

    pub fn eval_due(&self, step: u64) -> bool {
        self.eval_every > 0 && step % self.eval_every == 0
    }

    /// Refuses settings no job can run with.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(SpecError::Invalid(m));
        if self.steps == 0 {
            return bad("steps must be at least 1".into());
        }
        if self.microbatch_size == 0 || self.global_microbatches == 0 {
            return bad(format!(
                "the global batch is {} microbatches of {} samples: both must be at least 1",
                self.global_microbatches, self.microbatch_size
            ));
        }
        if self.nodes == 0 || self.devices_per_node == 0 {
            return bad("nodes and devices per node must be at least 1".into());
        }
        for i in &self.inject_failures {
            if i.node >= self.nodes {
                return bad(format!(
                    "--inject-failure {}@{}: node {} does not exist; the nodes are 0..{}",
                    i.node,
                    i.after_step,
                    i.node,
                    self.nodes - 1
                ));
            }
            if i.after_step == 0 || i.after_step >= self.steps {
                return bad(format!(
                    "--inject-failure {}@{}: the step must be in 1..{} (the node dies after \
                     that step is committed)",
                    i.node,
                    i.after_step,
                    self.steps - 1
                ));
            }
        }
        self.optimizer.validate()?;
        self.lr.validate()?;
        Ok(())
    }
}

/// Everything a job's processes are told about it: the runtime's settings and the user's
/// workload settings (opaque here; the factory reads them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobConfig {
    pub training: TrainingSpec,
    pub workload: serde_json::Value,
    /// How the agents' watchdogs hold workers to their progress, and how stragglers are named.
    #[serde(default)]
    pub watch: WatchSpec,
    /// How long the final save is tried again (from the state kept in memory) before the job
    /// gives up and exits with the trained steps lost: [`DEFAULT_SAVE_WAIT_S`].
    #[serde(default = "default_save_wait_s")]
    pub save_wait_s: u64,
}

/// Ten minutes: long enough for a person to free space on a full disk after the first
/// warning, short enough that a job nobody watches does not hold its machines for long.
pub const DEFAULT_SAVE_WAIT_S: u64 = 600;

fn default_save_wait_s() -> u64 {
    DEFAULT_SAVE_WAIT_S
}

/// The watchdog's and the straggler report's settings (`runtime/timeouts.rs` has how they fit
/// with the other timeouts).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WatchSpec {
    /// A worker inside a step whose progress beats stop for `hang_timeout_s` is hung (stopped);
    /// one that beats but makes no progress for
    /// `max(hang_timeout_s, hang_factor x its recent median step time)` is hung too.
    pub hang_timeout_s: f64,
    pub hang_factor: f64,
    /// ...and, before a step time is known (the first step), this long.
    pub first_step_s: f64,
    /// A rank whose compute per step exceeds this factor times its peers' median, step after
    /// step, is a straggler.
    pub straggler_factor: f64,
    /// Drain a persistent straggler's node, as `oobleck drain` would.
    pub evict_stragglers: bool,
}

impl Default for WatchSpec {
    fn default() -> Self {
        WatchSpec {
            hang_timeout_s: 1.5,
            hang_factor: 3.0,
            first_step_s: super::timeouts::FIRST_STEP_HANG.as_secs_f64(),
            straggler_factor: 1.5,
            evict_stragglers: false,
        }
    }
}

impl WatchSpec {
    /// The smallest `--hang-timeout` taken: below it, scheduling noise on a loaded machine
    /// (a progress beat late by a few hundred ms) would pass for a hang.
    pub const MIN_HANG_TIMEOUT_S: f64 = 1.0;

    /// Refuses settings the watchdog cannot work with, saying which and why.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(SpecError::Invalid(m));
        if !(self.hang_timeout_s.is_finite() && self.hang_timeout_s >= Self::MIN_HANG_TIMEOUT_S) {
            return bad(format!(
                "--hang-timeout {} s: it must be at least {} s (a progress beat can be late by a few hundred ms on a loaded machine); it is raised to {} x the median step time by itself when steps are slower",
                self.hang_timeout_s,
                Self::MIN_HANG_TIMEOUT_S,
                self.hang_factor
            ));
        }
        if !(self.hang_factor.is_finite() && self.hang_factor >= 1.5) {
            return bad(format!(
                "--hang-factor {}: it must be at least 1.5 (a step varies; a rank is hung only when it stalls well past its usual step time)",
                self.hang_factor
            ));
        }
        if !(self.first_step_s.is_finite() && self.first_step_s >= self.hang_timeout_s) {
            return bad(format!(
                "the first step's hang limit ({} s) must be at least --hang-timeout ({} s)",
                self.first_step_s, self.hang_timeout_s
            ));
        }
        if !(self.straggler_factor.is_finite() && self.straggler_factor > 1.0) {
            return bad(format!(
                "--straggler-factor {}: it must be above 1 (a straggler is slower than its peers by that factor)",
                self.straggler_factor
            ));
        }
        Ok(())
    }
}
