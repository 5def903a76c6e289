//! The job configuration of `train`: defaults, then a TOML job file, then flags.
//!
//! The resolved [`TrainConfig`] is written to `<out>/config.json`, so every run records exactly
//! what it did; `--resume` reads it back and refuses changes that would alter the training.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use oobleck_core::optim::{AdamW, AdamWConfig, LrSchedule};
use oobleck_core::planning::Dtype;
use oobleck_core::runtime::{device, BatchShape, DataPlane, InjectedFailure, TrainingSpec};
use oobleck_core::schedule::Schedule;
use oobleck_models::data::{DataSpec, FormatHint, WeightedSource, DEFAULT_VAL_FRACTION};
use oobleck_models::workload::GptWorkloadConfig;
use serde::{Deserialize, Serialize};

/// Everything a training job is. Units and the reason for each default are given per field.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Model preset name, or a directory / hub id holding an HF `config.json` (`--init-from`
    /// loads its weights). Default `gpt-mini`: 4 blocks of width 128, trains on a laptop CPU.
    pub model: String,
    /// Start from pretrained HF weights (directory or `org/name`) instead of a fresh init.
    pub init_from: Option<String>,
    /// Nodes of the cluster. Default 4 (a local cluster of 4 agents, room for `f + 1 = 2`
    /// pipelines); 1 = one process (the single-process trainer).
    pub nodes: usize,
    /// Devices (worker processes) per node.
    pub devices_per_node: usize,
    /// `f`: node failures the job must survive without a checkpoint. Default 1: the job runs
    /// at least 2 pipelines.
    pub fault_threshold: usize,
    /// `b`, samples per microbatch. 4 keeps a gpt-mini step near a second on 2 cores.
    pub microbatch_size: usize,
    /// Samples per step (a multiple of `b`). 16 = 4 microbatches, enough for a pipeline to fill.
    pub global_batch_size: usize,
    /// Tokens per sample. 64 for the default: long enough for sentences, cheap on CPU.
    pub seq_len: usize,
    /// Optimizer steps to run in total (a resumed run continues up to this count).
    pub steps: u64,
    /// Seeds initialisation, data order and dropout.
    pub seed: u64,
    /// Peak learning rate (after warmup). 2e-3 suits models of width 128; big presets use less.
    pub lr: f64,
    /// Floor of the cosine decay; default lr/10 (nanoGPT's choice). Resolved to a number when
    /// the job is resolved, so `config.json` records what the run used.
    pub min_lr: Option<f64>,
    /// Linear warmup steps; default 10% of the steps. Resolved to a number when the job is
    /// resolved, so a run extended with a larger `steps` keeps the warmup it started with.
    pub warmup_steps: Option<u64>,
    /// AdamW decoupled weight decay on matrices (0.1 as in GPT-3).
    pub weight_decay: f64,
    /// AdamW betas (0.9, 0.95 as in GPT-3).
    pub beta1: f64,
    pub beta2: f64,
    /// Clip the global gradient norm to this (1.0 as in GPT-3); 0 disables clipping.
    pub grad_clip: f64,
    /// Run directory. Default `runs/<model>-<unix seconds>`, never an existing run.
    pub out: Option<PathBuf>,
    /// Write a checkpoint every K steps (and at the end). 0 = only at the end.
    pub checkpoint_every: u64,
    /// Validation loss every K steps (and at the end). 0 = only at the end.
    pub eval_every: u64,
    /// Validation microbatches per evaluation (fixed, in corpus order, comparable across runs).
    pub eval_batches: usize,
    /// Training data (`--data`, repeatable): each a UTF-8 text file or pre-tokenized shards
    /// (a file, a Megatron pair or prefix, a folder, a glob), opened at this path on every
    /// node, with an optional blend weight (`0.7:web/`). Default: the shipped corpus in
    /// `datasets/`. In a file: a path, or a list of them (`"dataset"` is an older name).
    #[serde(alias = "dataset", deserialize_with = "one_or_many")]
    pub data: Vec<WeightedSource>,
    /// Validation data (`--val-data`): a source read whole for validation; then no training
    /// document is held out.
    pub val_data: Option<PathBuf>,
    /// Share of each training source's documents held out for validation (`--val-fraction`).
    pub val_fraction: f64,
    /// How token files with no header are read: `detect` (the default: llm.c magic, Megatron
    /// `.idx`; a raw file is then an error) or `u16` (nanoGPT's raw `train.bin`).
    pub data_format: DataFormat,
    /// Raw JSONL and Parquet sources: the field or column holding the text (`--text-field`).
    pub text_field: String,
    /// Raw sources: skip and count bad records instead of stopping (`--skip-bad-records`).
    pub skip_bad_records: bool,
    /// GPT-2 tokenizer (`tokenizer.json`, or a directory with `encoder.json` + `vocab.bpe`).
    pub tokenizer: Option<PathBuf>,
    /// Pin the pipeline sizes in nodes (e.g. `[2, 3]`) instead of letting the planner choose.
    pub pipeline_nodes: Option<Vec<usize>>,
    /// `NODE@STEP`: SIGKILL that node's processes when the job reaches that step.
    pub inject_failure: Vec<String>,
    /// Print this many sampled continuations of the validation text at the end (0 = none).
    pub sample: usize,
    /// The cluster's data plane: `tcp` (CPU workers, always built) or `nccl` (a build with
    /// `--features nccl`: the master makes the NCCL unique id of each generation and hands it
    /// out with the plan; device `d` of a node uses CUDA device `d`).
    pub data_plane: DataPlane,
    /// Where the workers compute and which device the planner models: `auto` (the GPUs of a
    /// `--features cuda` build when the machine has them, else the CPU), `cpu`, `cuda` (the
    /// GPUs, their kind detected), or a device kind the planner knows (`h100-80gb`: compute
    /// on the GPUs, plan for that kind).
    pub device: String,
    /// `fp32`, or `bf16`: parameters and activations in bf16 with fp32 master weights and
    /// optimizer state (halves activation memory and doubles GPU matrix throughput).
    pub precision: Precision,
    /// Drop each layer's forward activations and recompute them in backward: activation memory
    /// falls to one tensor per layer boundary, for about one more forward pass of compute.
    pub recompute: bool,
    /// The pipeline schedule: `1f1b`, or `zb-h1` (zero-bubble: each backward split into the
    /// input gradient and a later weight gradient that fills the pipeline's bubbles).
    pub schedule: Schedule,
    /// `--profile`: where the planner's layer times come from: `measured` (a CPU job times its
    /// layers on this machine, or reuses the cached measurement; other devices stay
    /// analytical), `analytical`, or a profile JSON. None: `measured`. Not saved in
    /// `config.json`: it changes the plan, never the training.
    #[serde(skip)]
    pub profile: Option<String>,
    /// `--host-memory`: this machine's memory for the job, bytes. None: what this process may
    /// use, read from the machine (`HostMemory::of_this_machine`). Not saved in `config.json`:
    /// it changes the plan and how the profile is measured, never the training.
    #[serde(skip)]
    pub host_memory: Option<u64>,
    /// How long (ms) a node may be silent before it is declared lost: a hung machine or agent
    /// (SIGSTOP) is caught after this. Agents send a heartbeat every 500 ms, so the default of
    /// 3000 lets 5 heartbeats in a row go missing (an agent on a saturated 2-core machine is
    /// late by tens of ms, never seconds) while a hang is still acted on within about 3 s.
    pub lease_ms: u64,
    /// How long (s) the agents of a local job look for a master after losing this one (its
    /// process killed) before they stop their workers and exit
    /// (`oobleck_core::runtime::node::DEFAULT_MASTER_WAIT`: a restarted master is back within
    /// a minute, and a minute of idle workers costs less than the steps since a checkpoint).
    pub master_wait_s: u64,
    /// Standby masters a local job keeps (`--standby-masters`): each keeps a copy of the run
    /// directory and takes over when the master is lost (`train standby`).
    pub standby_masters: usize,
    /// The longest (s) a node that joins the running job but adds no pipeline waits for more
    /// joins before it is admitted. A join that adds a pipeline (and so restores fault
    /// tolerance a failure lowered) is taken at the next step boundary whatever this says.
    /// Each admission costs a reconfiguration (about 1.5 s plus a step, `oobleck bench
    /// recovery`); 30 s lets the nodes of one scale-up arrive together (cloud instance groups
    /// bring their VMs up within tens of seconds of each other) while a lone node waits at
    /// most 30 s to contribute.
    pub join_after_s: f64,
    /// The least time (s) a worker inside a step may go without progress before its agent
    /// declares it hung, tells the master what it was doing and kills it. Two limits:
    /// a worker whose progress beats stop (a stopped or frozen process) is hung after
    /// `hang_timeout_s`, whatever its step time, since its beat thread reports every 500 ms
    /// at the latest; one that beats but does not move, after
    /// `max(hang_timeout_s, hang_factor x its median step time)` (30 s before its first step
    /// time is known). Progress moves at every microbatch's forward and backward and every
    /// data-plane operation (22 marks per step in `oobleck bench recovery`'s gpt-mini job),
    /// so a healthy worker would need one operation to take 3 whole median steps to be taken
    /// for hung. 1.5 s is three idle beats: the smallest silence that a beat thread on a loaded
    /// 2-core machine (late by tens of ms) cannot cause, and it keeps the detection of a
    /// stopped worker under the 2 s the watchdog is held to.
    pub hang_timeout_s: f64,
    /// See `hang_timeout_s`: 3 steps lets one step run 3x its usual time (a checkpoint's
    /// copy, a slow microbatch) without being taken for a hang.
    pub hang_factor: f64,
    /// A rank whose compute per step is this many times its peers' median, step after step,
    /// is reported as a straggler (1.5: in 1F1B a stage 50% slower holds every pipeline back
    /// by about as much).
    pub straggler_factor: f64,
    /// Drain a persistent straggler's node (as `oobleck drain` would), when the job can do
    /// without it.
    pub evict_stragglers: bool,
    /// How long (s) a final save that fails (a full disk) is tried again, from the state kept
    /// in memory, before the job exits with its trained steps lost
    /// (`oobleck_core::runtime::DEFAULT_SAVE_WAIT_S`).
    pub save_wait_s: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            model: "gpt-mini".into(),
            init_from: None,
            nodes: 4,
            devices_per_node: 1,
            fault_threshold: 1,
            microbatch_size: 4,
            global_batch_size: 16,
            seq_len: 64,
            steps: 150,
            seed: 1234,
            lr: 2e-3,
            min_lr: None,
            warmup_steps: None,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            grad_clip: 1.0,
            out: None,
            checkpoint_every: 50,
            eval_every: 25,
            eval_batches: 4,
            data: Vec::new(),
            val_data: None,
            val_fraction: DEFAULT_VAL_FRACTION,
            data_format: DataFormat::Detect,
            text_field: oobleck_models::data::prepare::DEFAULT_TEXT_FIELD.into(),
            skip_bad_records: false,
            tokenizer: None,
            pipeline_nodes: None,
            inject_failure: Vec::new(),
            sample: 2,
            data_plane: DataPlane::Tcp,
            device: "auto".into(),
            precision: Precision::Fp32,
            recompute: false,
            schedule: Schedule::OneFOneB,
            profile: None,
            host_memory: None,
            lease_ms: 3000,
            master_wait_s: oobleck_core::runtime::node::DEFAULT_MASTER_WAIT.as_secs(),
            standby_masters: 0,
            join_after_s: 30.0,
            hang_timeout_s: 1.5,
            hang_factor: 3.0,
            straggler_factor: 1.5,
            evict_stragglers: false,
            save_wait_s: oobleck_core::runtime::DEFAULT_SAVE_WAIT_S,
        }
    }
}

/// `data` in a config file: absent or null (the shipped corpus), one path, or a list.
fn one_or_many<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Vec<WeightedSource>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(WeightedSource),
        Many(Vec<WeightedSource>),
    }
    Ok(match Option::<OneOrMany>::deserialize(d)? {
        None => Vec::new(),
        Some(OneOrMany::One(source)) => vec![source],
        Some(OneOrMany::Many(sources)) => sources,
    })
}

/// How `--data` token files with no header are read (see [`TrainConfig::data_format`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum DataFormat {
    #[default]
    #[serde(rename = "detect")]
    #[value(name = "detect")]
    Detect,
    #[serde(rename = "u16")]
    #[value(name = "u16")]
    U16,
}

impl DataFormat {
    /// The data pipeline's name for it.
    pub fn hint(self) -> FormatHint {
        match self {
            DataFormat::Detect => FormatHint::Detect,
            DataFormat::U16 => FormatHint::RawU16,
        }
    }
}

/// The training precision, one closed choice whatever flag or file names it: `fp32` (also
/// spelled `f32`, as `oobleck plan` and `oobleck profile` once took it) or `bf16`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum Precision {
    #[default]
    #[serde(rename = "fp32", alias = "f32")]
    #[value(name = "fp32", alias = "f32")]
    Fp32,
    #[serde(rename = "bf16")]
    #[value(name = "bf16")]
    Bf16,
}

impl std::str::FromStr for Precision {
    type Err = anyhow::Error;

    /// As `--precision` takes it.
    fn from_str(s: &str) -> Result<Precision> {
        <Precision as clap::ValueEnum>::from_str(s, false)
            .map_err(|_| anyhow::anyhow!("--precision must be fp32 or bf16, got {s:?}"))
    }
}

impl Precision {
    /// The planner's and the runtime's dtype.
    pub fn dtype(self) -> Dtype {
        match self {
            Precision::Fp32 => Dtype::F32,
            Precision::Bf16 => Dtype::Bf16,
        }
    }
}

/// A job file and the fields it sets (a preset's published recipe fills only the rest).
pub(crate) fn read_job_file(path: &Path) -> Result<(TrainConfig, BTreeSet<String>)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading job file {}", path.display()))?;
    let keys = (text.parse::<toml::Table>().ok().into_iter())
        .flat_map(|t| t.into_iter().map(|kv| kv.0))
        .collect();
    let cfg = toml::from_str::<TrainConfig>(&text)
        .with_context(|| format!("job file {} is not a valid job", path.display()))?;
    Ok((cfg, keys))
}

impl TrainConfig {
    /// The agents' watchdog settings.
    pub fn watch_spec(&self) -> oobleck_core::runtime::WatchSpec {
        oobleck_core::runtime::WatchSpec {
            hang_timeout_s: self.hang_timeout_s,
            hang_factor: self.hang_factor,
            straggler_factor: self.straggler_factor,
            evict_stragglers: self.evict_stragglers,
            ..Default::default()
        }
    }

    /// The data flags: the held-out share, where validation comes from, the blend weights.
    fn validate_data(&self) -> Result<()> {
        oobleck_models::data::fraction_millionths(self.val_fraction)?;
        let both = self.val_fraction != DEFAULT_VAL_FRACTION;
        if let Some(val) = self.val_data.as_ref().filter(|_| both) {
            bail!(
                "--val-fraction {} and --val-data {} both say where validation comes from: \
                 with --val-data no training document is held out; drop one of them",
                self.val_fraction,
                val.display()
            );
        }
        let bad_weight = |s: &WeightedSource| s.weight.filter(|w| !(w.is_finite() && *w > 0.0));
        if let Some(bad) = self.data.iter().find_map(bad_weight) {
            bail!("--data weight {bad}: a blend weight must be a number above zero (0.7:web/)");
        }
        Ok(())
    }

    /// Rejects configurations that cannot run, saying what to change.
    pub fn validate(&self) -> Result<()> {
        if self.lease_ms <= 500 {
            bail!(
                "--lease-ms {} must exceed the agents' 500 ms heartbeat interval (3000 is the \
                 default; below about 1500 a busy machine may be declared lost)",
                self.lease_ms
            );
        }
        if self.master_wait_s == 0 {
            bail!(
                "master_wait_s 0 (--master-wait): must be at least 1 second, how long agents \
                 that lost their master look for one (60 is the default)"
            );
        }
        if !(self.join_after_s.is_finite() && self.join_after_s >= 0.0) {
            bail!(
                "--join-after {} must be a number of seconds, 0 or more (30 is the default)",
                self.join_after_s
            );
        }
        self.watch_spec()
            .validate()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        if self.microbatch_size == 0 {
            bail!("--microbatch-size must be at least 1");
        }
        self.validate_data()?;
        if self.global_batch_size == 0 || self.global_batch_size % self.microbatch_size != 0 {
            bail!(
                "--global-batch-size ({}) must be a positive multiple of --microbatch-size ({})",
                self.global_batch_size,
                self.microbatch_size
            );
        }
        if self.seq_len == 0 {
            bail!("--seq-len must be at least 1");
        }
        if self.steps == 0 {
            bail!("--steps must be at least 1");
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            bail!("--lr must be a positive number, got {}", self.lr);
        }
        if !(self.grad_clip.is_finite() && self.grad_clip >= 0.0) {
            bail!("--grad-clip must be >= 0, got {}", self.grad_clip);
        }
        if self.nodes == 0 || self.devices_per_node == 0 {
            bail!("--nodes and --devices-per-node must be at least 1");
        }
        if self.eval_batches == 0 {
            bail!("--eval-batches must be at least 1");
        }
        if self.data_plane == DataPlane::Nccl && !cfg!(feature = "nccl") {
            bail!(
                "--data-plane nccl needs a build with NCCL: cargo build --release --features nccl"
            );
        }
        crate::placement::resolve(&self.device)?;
        if let Some(choice) = &self.profile {
            if !matches!(choice.as_str(), "measured" | "analytical") && !Path::new(choice).is_file()
            {
                bail!(
                    "--profile {choice}: not `measured`, `analytical` or a profile file (write \
                     one with `oobleck profile --model M --out FILE`)"
                );
            }
        }
        for spec in &self.inject_failure {
            parse_failure(spec)?;
        }
        Ok(())
    }

    /// A large preset trains at its whole context with its paper's batch and learning rate
    /// (`oobleck_models::recipe`), except for what `given(field)` says was set by hand.
    pub fn apply_recipe(&mut self, given: impl Fn(&str) -> bool) {
        if self.init_from.is_some() {
            return;
        }
        let Ok(Some(r)) = oobleck_models::recipe::recipe(&self.model) else {
            return;
        };
        if !given("seq_len") {
            self.seq_len = r.seq_len;
        }
        if !given("global_batch_size") {
            // Whole microbatches: the recipe's batch rounded down to a multiple of `b`.
            let b = self.microbatch_size.max(1);
            self.global_batch_size = (r.global_batch_size / b).max(1) * b;
        }
        if !given("lr") {
            self.lr = r.lr;
        }
    }

    /// `B`: microbatches per step.
    pub fn num_microbatches(&self) -> usize {
        self.global_batch_size / self.microbatch_size
    }

    /// The values other fields imply (warmup from `steps`, `min_lr` from `lr`) written in, so
    /// that changing `steps` later, to extend a run, changes nothing else.
    pub fn with_derived(mut self) -> Self {
        self.warmup_steps = Some(self.warmup());
        self.min_lr = Some(self.final_lr());
        self
    }

    pub fn warmup(&self) -> u64 {
        self.warmup_steps.unwrap_or(self.steps / 10)
    }

    /// A fresh AdamW with this job's hyper-parameters (the learning rate itself comes from the
    /// schedule at every step).
    pub fn optimizer(&self) -> Result<AdamW> {
        Ok(AdamW::new(AdamWConfig {
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: 1e-8,
            weight_decay: self.weight_decay,
        })?)
    }

    pub fn final_lr(&self) -> f64 {
        self.min_lr.unwrap_or(self.lr / 10.0)
    }

    /// Fields that change the training trajectory: a resumed run must keep them.
    pub fn trajectory_mismatch(&self, saved: &TrainConfig) -> Option<String> {
        let pairs = [
            ("model", self.model != saved.model),
            ("seed", self.seed != saved.seed),
            (
                "microbatch_size",
                self.microbatch_size != saved.microbatch_size,
            ),
            (
                "global_batch_size",
                self.global_batch_size != saved.global_batch_size,
            ),
            ("seq_len", self.seq_len != saved.seq_len),
            ("lr", self.lr != saved.lr),
            ("min_lr", self.final_lr() != saved.final_lr()),
            ("warmup_steps", self.warmup() != saved.warmup()),
            ("weight_decay", self.weight_decay != saved.weight_decay),
            ("grad_clip", self.grad_clip != saved.grad_clip),
            ("data", self.data != saved.data),
            ("val_data", self.val_data != saved.val_data),
            ("val_fraction", self.val_fraction != saved.val_fraction),
            ("data_format", self.data_format != saved.data_format),
            ("text_field", self.text_field != saved.text_field),
            (
                "skip_bad_records",
                self.skip_bad_records != saved.skip_bad_records,
            ),
            ("precision", self.precision != saved.precision),
        ];
        let changed: Vec<&str> = pairs.iter().filter(|p| p.1).map(|p| p.0).collect();
        (!changed.is_empty()).then(|| changed.join(", "))
    }
}

/// Parses `NODE@STEP`.
pub fn parse_failure(spec: &str) -> Result<(usize, u64)> {
    let (node, step) = spec
        .split_once('@')
        .with_context(|| format!("--inject-failure `{spec}`: expected NODE@STEP, e.g. 1@20"))?;
    let node = node
        .trim()
        .parse()
        .with_context(|| format!("--inject-failure `{spec}`: NODE must be a node index"))?;
    let step = step
        .trim()
        .parse()
        .with_context(|| format!("--inject-failure `{spec}`: STEP must be a step number"))?;
    Ok((node, step))
}

/// Writes `config.json` into the run directory, derived values resolved.
pub fn save_resolved(cfg: &TrainConfig, out: &Path) -> Result<()> {
    let path = out.join("config.json");
    let text = serde_json::to_string_pretty(&cfg.clone().with_derived())?;
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
}

/// Reads a run's `config.json`. Files written before derived values were stored hold `null`
/// for them: they are derived from the saved `steps` and `lr`, as that run derived them.
pub fn load_resolved(run: &Path) -> Result<TrainConfig> {
    let path = run.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let cfg: TrainConfig = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a run config", path.display()))?;
    Ok(cfg.with_derived())
}

/// The global batch of the job, as the runtime names it: [`training_spec`]'s, and the one the
/// workload is built with (the single-process trainer's too), so both read the same data.
pub fn batch_shape(cfg: &TrainConfig) -> Result<BatchShape> {
    let u = |v: usize, what: &str| u32::try_from(v).with_context(|| format!("{what} {v}"));
    Ok(BatchShape {
        microbatch_size: u(cfg.microbatch_size, "--microbatch-size")?,
        global_microbatches: u(cfg.num_microbatches(), "microbatches")?,
    })
}

/// The runtime's settings of the job: one name and one unit per quantity.
pub fn training_spec(cfg: &TrainConfig) -> Result<TrainingSpec> {
    let u = |v: usize, what: &str| u32::try_from(v).with_context(|| format!("{what} {v}"));
    let batch = batch_shape(cfg)?;
    let mut inject_failures = Vec::new();
    for spec in &cfg.inject_failure {
        let (node, after_step) = parse_failure(spec)?;
        let node = u(node, "--inject-failure node")?;
        inject_failures.push(InjectedFailure { node, after_step });
    }
    let pipeline_nodes = match &cfg.pipeline_nodes {
        Some(sizes) => Some(
            sizes
                .iter()
                .map(|&s| u(s, "--pipeline-nodes"))
                .collect::<Result<Vec<u32>>>()?,
        ),
        None => None,
    };
    let placement = crate::placement::resolve(&cfg.device)?;
    let precision = cfg.precision.dtype();
    // On this machine's first GPU, if it has one, before any agent starts (each worker checks
    // its own again: the GPUs of a multi-machine job are elsewhere).
    let here = device::detect_gpus().map_err(|e| anyhow::anyhow!("{e}"))?;
    if here.is_some() {
        device::check_precision(placement.compute, 0, precision)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    Ok(TrainingSpec {
        steps: cfg.steps,
        seed: cfg.seed,
        microbatch_size: batch.microbatch_size,
        global_microbatches: batch.global_microbatches,
        nodes: u(cfg.nodes, "--nodes")?,
        devices_per_node: u(cfg.devices_per_node, "--devices-per-node")?,
        fault_threshold: u(cfg.fault_threshold, "--fault-threshold")?,
        device: placement.kind,
        pipeline_nodes,
        optimizer: *cfg.optimizer()?.config(),
        lr: LrSchedule::new(cfg.lr, cfg.final_lr(), cfg.warmup(), cfg.steps)?,
        grad_clip: (cfg.grad_clip > 0.0).then_some(cfg.grad_clip),
        checkpoint_every: cfg.checkpoint_every,
        eval_every: cfg.eval_every,
        data_plane: cfg.data_plane,
        inject_failures,
        compute: placement.compute,
        precision,
        recompute: cfg.recompute,
        schedule: cfg.schedule,
        // The cluster job sets it: it knows how many ranks share this machine.
        device_memory_bytes: None,
    })
}

/// The GPT workload's settings of the job (its batch is [`batch_shape`]).
pub fn workload_config(cfg: &TrainConfig) -> GptWorkloadConfig {
    GptWorkloadConfig {
        model: cfg.model.clone(),
        init_from: cfg.init_from.clone(),
        seq_len: cfg.seq_len,
        eval_batches: cfg.eval_batches,
        data: DataSpec {
            sources: cfg.data.clone(),
            val_data: cfg.val_data.clone(),
            val_fraction: cfg.val_fraction,
            format: cfg.data_format.hint(),
            text_field: cfg.text_field.clone(),
            skip_bad_records: cfg.skip_bad_records,
        },
        tokenizer: cfg.tokenizer.clone(),
        profile: cfg.profile.clone().unwrap_or_else(|| "measured".into()),
        host_ranks: 1,
        host_memory_bytes: cfg.host_memory,
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
