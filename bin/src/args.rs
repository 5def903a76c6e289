//! The flags of `train` and how they resolve: defaults (or, with `--resume`, the resumed run's
//! own `config.json`), then a TOML job file, then the flags, into a [`TrainConfig`].

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::config::{load_resolved, read_job_file, TrainConfig};
use crate::run_dir::resumed_run;
use oobleck_models::data::WeightedSource;

/// Train a GPT/OPT model with Oobleck-rs.
///
/// With no flags: trains the small `gpt-mini` GPT on the shipped corpus and writes the run to
/// `runs/`. Flags override a `--config job.toml`, which overrides the defaults.
#[derive(Clone, Debug, Default, clap::Parser)]
#[command(name = "train", version)]
pub struct TrainArgs {
    /// TOML job file with any of the fields below (snake_case); flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Model preset (see `oobleck models`) [default: gpt-mini].
    #[arg(long)]
    pub model: Option<String>,
    /// Start from HF weights: a directory with config.json + model.safetensors, or `org/name`
    /// found in the local Hugging Face cache.
    #[arg(long)]
    pub init_from: Option<String>,
    /// Nodes of the cluster; 1 trains in this one process [default: 4]. Without --nodes,
    /// --listen and --hostfile, a `train` that a scheduler started on each node of a job
    /// (an srun task, a SkyPilot task, a LeaderWorkerSet pod, or OOBLECK_MASTER and
    /// OOBLECK_NODE_INDEX set) is one node of it: node 0 runs the master and its agent.
    #[arg(long)]
    pub nodes: Option<usize>,
    /// Devices (worker processes) per node [default: 1].
    #[arg(long)]
    pub devices_per_node: Option<usize>,
    /// Fault threshold f: survive f node failures without a checkpoint [default: 1].
    #[arg(long)]
    pub fault_threshold: Option<usize>,
    /// Samples per microbatch [default: 4].
    #[arg(long)]
    pub microbatch_size: Option<usize>,
    /// Samples per step, a multiple of the microbatch size [default: 16; a published preset
    /// such as gpt3-2.7b: its paper's batch, 512 sequences].
    #[arg(long)]
    pub global_batch_size: Option<usize>,
    /// Tokens per sample [default: 64; a published preset: its whole context, 2048 for GPT-3].
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Total optimizer steps [default: 150].
    #[arg(long)]
    pub steps: Option<u64>,
    /// Seed of initialisation, data order and dropout [default: 1234].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Peak learning rate [default: 2e-3; a published preset: its paper's, 1.6e-4 for gpt3-2.7b].
    #[arg(long, allow_negative_numbers = true)]
    pub lr: Option<f64>,
    /// Final learning rate of the cosine decay [default: lr/10].
    #[arg(long)]
    pub min_lr: Option<f64>,
    /// Linear warmup steps [default: 10% of steps].
    #[arg(long)]
    pub warmup_steps: Option<u64>,
    /// AdamW weight decay on weight matrices [default: 0.1].
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Clip the global gradient norm (0 = off) [default: 1.0].
    #[arg(long)]
    pub grad_clip: Option<f64>,
    /// Run directory [default: runs/<model>-<unix seconds>].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Checkpoint every K steps, and at the end (0 = only at the end) [default: 50].
    #[arg(long)]
    pub checkpoint_every: Option<u64>,
    /// Validation loss every K steps, and at the end [default: 25].
    #[arg(long)]
    pub eval_every: Option<u64>,
    /// Validation microbatches per evaluation [default: 4].
    #[arg(long)]
    pub eval_batches: Option<usize>,
    /// Continue a run: its directory (newest checkpoint) or one checkpoint directory. The run's
    /// saved config is the starting point; flags that would change the training are refused.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// With --resume RUN: the run's master was lost (killed, its machine restarted) while its
    /// agents still look for one (--master-wait, 60 s by default): this master listens where
    /// the lost one did (the run's master.json, or --listen) and takes them back with their
    /// workers, going on from the last committed step with no checkpoint loaded.
    #[arg(long, requires = "resume")]
    pub reattach: bool,
    /// Training data: a UTF-8 text file, or pre-tokenized shards (an llm.c .bin, a Megatron
    /// .bin/.idx or prefix, a raw u16 .bin with --data-format u16, a folder `oobleck data
    /// prepare` wrote), a folder of them, or a glob such as 'shards/train_*.bin' (files in
    /// name order). Raw documents (.jsonl, .json, .parquet, .txt.gz, ...; a file, folder or
    /// glob of them) are prepared once into the data cache (beside them, or
    /// $OOBLECK_CACHE_DIR) as `oobleck data prepare` would, and reused by later runs. Every
    /// node needs it at this path. --dataset is an alias [default: the shipped corpus in
    /// datasets/].
    ///
    /// Repeat it to blend sources, each with a weight: --data 0.7:web/ --data 0.3:code/
    /// (sample shares 70/30 in every prefix of the run; without weights each source weighs
    /// its tokens).
    #[arg(long = "data", visible_alias = "dataset", value_name = "[W:]PATH")]
    pub data: Vec<String>,
    /// Validation data read whole (a path like --data's); then no training document is held
    /// out [default: --val-fraction of each --data source's documents].
    #[arg(long, value_name = "PATH")]
    pub val_data: Option<PathBuf>,
    /// Share of each --data source's documents held out for validation (a source of fewer
    /// than 200 documents at 0.05, such as one text file, holds out its last tokens instead)
    /// [default: 0.05].
    #[arg(long, value_name = "F")]
    pub val_fraction: Option<f64>,
    /// How to read token files with no header: detect (llm.c magic, Megatron .idx), or u16
    /// (nanoGPT's raw train.bin) [default: detect].
    #[arg(long)]
    pub data_format: Option<crate::config::DataFormat>,
    /// Raw JSONL or Parquet --data: the JSON field or column holding the text, as `oobleck
    /// data prepare --text-field` [default: text].
    #[arg(long, value_name = "NAME")]
    pub text_field: Option<String>,
    /// Raw --data: skip (and count) JSONL records that are not JSON or lack the text field,
    /// and Parquet rows whose text is null, instead of stopping at the first.
    #[arg(long)]
    pub skip_bad_records: bool,
    /// GPT-2 tokenizer: tokenizer.json, or a directory with encoder.json + vocab.bpe.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Pin pipeline sizes in nodes, e.g. `2,3`.
    #[arg(long, value_delimiter = ',')]
    pub pipeline_nodes: Option<Vec<usize>>,
    /// Kill node NODE's processes with SIGKILL at step STEP (repeatable), e.g. `1@20`.
    #[arg(long)]
    pub inject_failure: Vec<String>,
    /// Sampled continuations to print at the end [default: 2].
    #[arg(long)]
    pub sample: Option<usize>,
    /// Print a machine-readable summary as JSON on stdout at the end.
    #[arg(long)]
    pub json: bool,
    /// The cluster's data plane: tcp, or nccl (builds with --features nccl) [default: tcp].
    #[arg(long)]
    pub data_plane: Option<oobleck_core::runtime::DataPlane>,
    /// Where the workers compute: auto, cpu, cuda, or a device kind the planner knows
    /// (`oobleck plan --help` lists them) [default: auto: the GPUs of a cuda build if any].
    #[arg(long)]
    pub device: Option<String>,
    /// fp32, or bf16 (fp32 master weights and optimizer state) [default: fp32].
    #[arg(long)]
    pub precision: Option<crate::config::Precision>,
    /// Recompute each layer's activations in backward instead of keeping them.
    #[arg(long)]
    pub recompute: bool,
    /// The pipeline schedule: 1f1b, or zb-h1 (zero-bubble H1: each backward split into the
    /// input gradient and a later weight gradient that fills the bubbles) [default: 1f1b].
    #[arg(long)]
    pub schedule: Option<oobleck_core::schedule::Schedule>,
    /// Seconds a final save that fails (a full disk) is tried again, from the trained state
    /// kept in memory, before the job gives up and exits with those steps lost: time to free
    /// space after the first warning [default: 600].
    #[arg(long, value_name = "SECS")]
    pub save_wait: Option<u64>,
    /// Silence (ms) after which a node is declared lost: catches a hung machine or agent;
    /// heartbeats go every 500 ms [default: 3000].
    #[arg(long)]
    pub lease_ms: Option<u64>,
    /// Seconds the agents this process starts (local, or over ssh with --hostfile) keep their
    /// workers (and their trained state, in memory) and look for a master if this process
    /// (the master) is lost, e.g. killed: no master at its address within the wait, and they
    /// stop their workers and exit, leaving nothing behind. At least 1. Agents started by hand
    /// (`train agent`) take their own --master-wait [default: 60].
    #[arg(long, value_name = "SECS", value_parser = parse_master_wait_s)]
    pub master_wait: Option<u64>,
    /// Standby masters of a local job (--nodes): each keeps a copy of the run directory (in
    /// <out>.standby-K), gets every commit before the agents do, and takes over from its copy
    /// when this process (the master) is lost, with no step lost. On several machines, run
    /// `train standby` on another machine instead [default: 0].
    #[arg(long, value_name = "K")]
    pub standby_masters: Option<usize>,
    /// Seconds a joining node that adds no pipeline waits for more joins before it is
    /// admitted; one that adds a pipeline is admitted at the next step [default: 30].
    #[arg(long)]
    pub join_after: Option<f64>,
    /// Seconds a worker inside a step may make no progress before its agent kills it as
    /// hung; raised to --hang-factor x its median step time when steps are slower (not for a
    /// worker whose progress beats stop) [default: 1.5].
    #[arg(long, value_name = "SECS")]
    pub hang_timeout: Option<f64>,
    /// See --hang-timeout [default: 3].
    #[arg(long)]
    pub hang_factor: Option<f64>,
    /// A rank this many times slower in compute than its peers, step after step, is reported
    /// as a straggler [default: 1.5].
    #[arg(long)]
    pub straggler_factor: Option<f64>,
    /// Drain a persistent straggler's node, as `oobleck drain` would.
    #[arg(long)]
    pub evict_stragglers: bool,
    /// The live status page of a cluster job: where to serve it (HOST:PORT), or `off`. Default:
    /// 127.0.0.1 and a free port, printed at the start. Off loopback, every request needs the
    /// job's token (a bearer header, or the one-time link `train` prints); kill and drain from
    /// the page always do.
    #[arg(long, value_name = "HOST:PORT|off")]
    pub status_addr: Option<String>,
    /// Where the planner's per-layer times come from: `measured` (the default on the CPU:
    /// every layer is timed on this machine before planning, a few seconds, and the profile
    /// is cached for the next run), `analytical` (estimated from the shape and device), or
    /// a profile JSON written by `oobleck profile --out`.
    #[arg(long, value_name = "measured|analytical|FILE", env = "OOBLECK_PROFILE")]
    pub profile: Option<String>,
    /// The memory this machine gives the job, e.g. `8GiB`, `512MiB` or bytes: a CPU job's
    /// devices are an equal share of it among the ranks that run here, and a measured profile
    /// is taken within it. Default: what this process may use, the smallest of MemAvailable
    /// (/proc/meminfo), its cgroup's memory limit and `ulimit -v`.
    #[arg(long, value_name = "SIZE", env = "OOBLECK_HOST_MEMORY", value_parser = parse_size)]
    pub host_memory: Option<u64>,
    /// Multi-machine: run the master on ADDR (IP:PORT) and wait for `--expect-nodes` agents
    /// started with `oobleck agent --master ADDR` instead of starting local ones.
    #[arg(long)]
    pub listen: Option<String>,
    /// With --listen: the number of nodes (agents) of the job.
    #[arg(long, conflicts_with_all = ["nodes", "hostfile"])]
    pub expect_nodes: Option<usize>,
    /// Multi-machine: start one agent per host of FILE over ssh (`$OOBLECK_SSH` replaces
    /// `ssh`); the master listens on --listen, which must be an address the hosts can reach.
    /// Format: one `[user@]host[:sshport] [data=IP] [oobleck=PATH]` per line.
    #[arg(long, requires = "listen", conflicts_with = "nodes")]
    pub hostfile: Option<PathBuf>,
    /// The job's shared secret for --listen / --hostfile (agents must present the same one).
    #[arg(long, env = "OOBLECK_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// The job's name for --listen (and a scheduler's job, over the name it gives): agents
    /// that name another job are refused, saying so, even with the token (two jobs started
    /// with one OOBLECK_TOKEN). Agents name theirs with `train agent --job` or OOBLECK_JOB.
    #[arg(long, env = "OOBLECK_JOB")]
    pub job: Option<String>,
}

/// The config a `--resume` of `path` starts from: the run's own. Failures injected into that
/// run were its test's, at its steps: a resume injects only those it is given again.
fn resumed_config(path: &Path) -> Result<TrainConfig> {
    let mut saved = load_resolved(&resumed_run(path)?)?;
    saved.inject_failure.clear();
    Ok(saved)
}

impl TrainArgs {
    /// Defaults (or, with `--resume`, the resumed run's own `config.json`), then the job
    /// file, then the flags.
    pub fn resolve(&self) -> Result<TrainConfig> {
        let base = match &self.resume {
            Some(path) => resumed_config(path)?,
            None => TrainConfig::default(),
        };
        let (mut c, in_file) = match &self.config {
            Some(path) => read_job_file(path)?,
            None => (base, BTreeSet::new()),
        };
        if let Some(n) = self.expect_nodes {
            c.nodes = n;
        }
        macro_rules! set {
            ($($f:ident),*) => { $( if let Some(v) = &self.$f { c.$f = v.clone(); } )* };
        }
        set!(
            model,
            nodes,
            devices_per_node,
            fault_threshold,
            microbatch_size,
            global_batch_size,
            seq_len,
            steps,
            seed,
            lr,
            weight_decay,
            grad_clip,
            checkpoint_every,
            eval_every,
            eval_batches,
            sample,
            data_plane,
            device,
            precision,
            data_format,
            text_field,
            val_fraction,
            lease_ms
        );
        if let Some(s) = self.master_wait {
            c.master_wait_s = s;
        }
        if let Some(k) = self.standby_masters {
            c.standby_masters = k;
        }
        c.recompute |= self.recompute;
        if let Some(s) = self.schedule {
            c.schedule = s;
        }
        c.skip_bad_records |= self.skip_bad_records;
        if let Some(p) = &self.profile {
            c.profile = Some(p.clone());
        }
        if self.host_memory.is_some() {
            c.host_memory = self.host_memory;
        }
        if let Some(s) = self.join_after {
            c.join_after_s = s;
        }
        if let Some(s) = self.hang_timeout {
            c.hang_timeout_s = s;
        }
        if let Some(s) = self.save_wait {
            c.save_wait_s = s;
        }
        if let Some(f) = self.hang_factor {
            c.hang_factor = f;
        }
        if let Some(f) = self.straggler_factor {
            c.straggler_factor = f;
        }
        c.evict_stragglers |= self.evict_stragglers;
        macro_rules! set_opt {
            ($($f:ident),*) => { $( if self.$f.is_some() { c.$f = self.$f.clone(); } )* };
        }
        set_opt!(
            init_from,
            min_lr,
            warmup_steps,
            out,
            val_data,
            tokenizer,
            pipeline_nodes
        );
        if !self.inject_failure.is_empty() {
            c.inject_failure = self.inject_failure.clone();
        }
        if !self.data.is_empty() {
            c.data = self.data.iter().map(|s| WeightedSource::parse(s)).collect();
        }
        if self.resume.is_none() {
            c.apply_recipe(|key| in_file.contains(key) || self.sets(key));
        }
        let c = c.with_derived();
        c.validate()?;
        Ok(c)
    }
}

/// `--master-wait` in whole seconds (the agents' own rule, `parse_master_wait`).
fn parse_master_wait_s(text: &str) -> std::result::Result<u64, String> {
    oobleck_core::runtime::node::parse_master_wait(text).map(|d| d.as_secs())
}

/// A size in bytes: a number with an optional binary unit, `K`, `M`, `G` or `T` (also `KiB`,
/// `KB`...; all powers of 1024), as `--host-memory` takes it.
pub fn parse_size(text: &str) -> std::result::Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => {
            return Err(format!(
                "{text:?}: expected a size such as 8GiB, 512MiB or bytes"
            ))
        }
    };
    match number.parse::<f64>() {
        Ok(n) if n.is_finite() && n >= 1.0 => Ok((n * (1u64 << shift) as f64) as u64),
        _ => Err(format!(
            "{text:?}: expected a size of at least 1 byte, such as 8GiB, 512MiB or bytes"
        )),
    }
}

impl TrainArgs {
    /// Whether a flag sets the recipe field `key` (see [`TrainConfig::apply_recipe`]).
    fn sets(&self, key: &str) -> bool {
        match key {
            "seq_len" => self.seq_len.is_some(),
            "global_batch_size" => self.global_batch_size.is_some(),
            "lr" => self.lr.is_some(),
            _ => false,
        }
    }
}
