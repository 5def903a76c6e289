//! `oobleck bench pipeline`: a real 1F1B pipeline measured against the `schedule/` simulator.
//!
//! For each configuration `S x P` (stages x pipeline replicas) it runs every rank as a thread of
//! this process over the real TCP data plane on 127.0.0.1, and reports:
//!
//! - the measured iteration time (`StageWorker::run_iteration`, the pipeline makespan) against
//!   `schedule::simulate` fed with stage times profiled in isolation and a measured p2p time;
//! - the bubble fraction per stage, `1 - busy / makespan`, where busy is the rank's time inside
//!   the iteration but outside communicator calls, against the simulation's and `(S-1)/(m+S-1)`;
//! - the gradient sync time of a rank (the bucket all-reduces the engine starts on a background
//!   thread during its last backward, plus what `execution::sync_gradients` does afterwards) and
//!   the part of it that ran while the rank's main thread was still busy with its iteration (the
//!   measured overlap); the part of `sync_gradients` spent waiting for peers still in their
//!   iteration is shown too;
//! - the control-plane cost of committing a step with the real `elastic::{Master, Agent}`.
//!
//! ```text
//!  profile: each stage alone, one microbatch, median of reps ─► StageTimes ─┐
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

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{Device, Tensor};
use oobleck_comm::{Communicator, Rank, TcpCommunicator, TcpConfig, TensorBuf};
use oobleck_core::elastic::{Agent, Master, MasterConfig, MasterEvent, Message, Token};
use oobleck_core::execution::{
    buf_to_tensor, sync_gradients, tensor_to_buf, Layout, PipelineSpec, StageSpec, StageWorker,
    WorkerConfig, BUCKET_ELEMS,
};
use oobleck_core::model::{accumulate, DropoutKey, ForwardCtx, LayeredModel, ParamSource, Stage};
use oobleck_core::optim::{AdamW, AdamWConfig};
use oobleck_core::runtime::WorkerReport;
use oobleck_core::schedule::{simulate, StageTimes};
use oobleck_models::ModelConfig;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

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

/// `(S-1)/(m+S-1)`: the idle fraction of a balanced 1F1B (or GPipe) pipeline.
pub fn theoretical_bubble(stages: usize, m: u32) -> f64 {
    let s = stages as f64;
    (s - 1.0) / (f64::from(m) + s - 1.0)
}

/// The median (the mean of the middle two for an even count); NaN for none.
fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn percentile(xs: &[f64], q: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The 1, 5 and 15 minute load averages (Linux).
fn loadavg() -> Option<String> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    Some(s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Runs `f` inside a rayon pool of `threads` threads (0: the caller's pool).
fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> Result<R> {
    if threads == 0 {
        return Ok(f());
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("building a rank's thread pool")?;
    Ok(pool.install(f))
}

/// The model of the benchmark and its vocabulary.
fn build_model(args: &BenchPipelineArgs) -> Result<(Arc<dyn LayeredModel>, usize)> {
    let mut cfg = ModelConfig::preset(&args.model)?;
    if let Some(v) = args.vocab {
        match &mut cfg {
            ModelConfig::Gpt(c) => c.vocab_size = v,
            ModelConfig::Opt(c) => c.vocab_size = v,
        }
    }
    cfg.validate()?;
    if args.seq_len == 0 || args.seq_len > cfg.max_seq_len() {
        bail!(
            "--seq-len {} must be in 1..={} (the model's context)",
            args.seq_len,
            cfg.max_seq_len()
        );
    }
    let vocab = cfg.vocab_size();
    Ok((cfg.build()?, vocab))
}

/// Seeded random `(token ids, targets)` of a microbatch, each `[b, t]`.
#[derive(Clone, Copy)]
struct Data {
    vocab: u32,
    b: usize,
    t: usize,
    seed: u64,
}

impl Data {
    fn get(&self, iteration: u64, mb: u64) -> oobleck_core::Result<(Tensor, Tensor)> {
        let mut rng = ChaCha8Rng::seed_from_u64(
            self.seed ^ iteration.wrapping_mul(0x9e37_79b9) ^ mb.wrapping_mul(0x85eb_ca6b),
        );
        let n = self.b * self.t;
        let ids: Vec<u32> = (0..n).map(|_| rng.random_range(0..self.vocab)).collect();
        let tg: Vec<u32> = (0..n).map(|_| rng.random_range(0..self.vocab)).collect();
        Ok((
            Tensor::from_vec(ids, (self.b, self.t), &Device::Cpu)?,
            Tensor::from_vec(tg, (self.b, self.t), &Device::Cpu)?,
        ))
    }
}

fn train_ctx(targets: Option<&Tensor>, seed: u64, mb: u64, loss_scale: f64) -> ForwardCtx<'_> {
    ForwardCtx {
        targets,
        loss_scale,
        train: true,
        dropout_key: DropoutKey {
            seed,
            iteration: 0,
            microbatch: mb,
        },
        rows: None,
    }
}

/// Forward and backward times of layers `range` on one microbatch, medians of `reps`, as the
/// worker runs them: the last stage reads its loss, backward accumulates into a gradient sum.
fn profile_range(
    model: &dyn LayeredModel,
    range: std::ops::Range<usize>,
    data: &Data,
    reps: usize,
    seed: u64,
) -> Result<(StageTimes, Vec<usize>)> {
    let l = model.num_layers();
    let (ids, tg) = data.get(0, 0)?;
    let x = if range.start == 0 {
        ids
    } else {
        let prefix = Stage::new(model.build_layers(
            0..range.start,
            &Device::Cpu,
            ParamSource::Init { seed },
        )?)?;
        prefix
            .forward(&ids, &train_ctx(None, seed, 0, 1.0))?
            .output
            .detach()
    };
    let last = range.end == l;
    let stage =
        Stage::new(model.build_layers(range.clone(), &Device::Cpu, ParamSource::Init { seed })?)?;
    let targets = last.then_some(&tg);
    let mut upstream = None;
    let mut out_dims = Vec::new();
    let (mut f, mut b) = (Vec::new(), Vec::new());
    let mut acc = HashMap::new();
    // One untimed repetition warms the allocator and the kernels' buffers.
    for rep in 0..=reps {
        let t0 = Instant::now();
        let fwd = stage.forward(&x, &train_ctx(targets, seed, rep as u64, 1.0))?;
        if last {
            fwd.output.to_scalar::<f32>()?;
        }
        let t1 = Instant::now();
        if !last && upstream.is_none() {
            out_dims = fwd.output.dims().to_vec();
            upstream = Some((fwd.output.ones_like()? * 1e-3)?);
        }
        let g = stage.backward(fwd, upstream.as_ref())?;
        accumulate(&mut acc, g.params)?;
        if let Some(gi) = &g.input {
            // Materialised like the worker's send does (a host copy).
            tensor_to_buf(gi)?;
        }
        let t2 = Instant::now();
        if rep > 0 {
            f.push((t1 - t0).as_nanos() as f64);
            b.push((t2 - t1).as_nanos() as f64);
        }
    }
    Ok((
        StageTimes {
            forward_ns: median(&f) as u64,
            backward_ns: median(&b) as u64,
        },
        out_dims,
    ))
}

/// Contiguous cut of `w` (per-layer costs) into `s` non-empty stages minimising the largest
/// stage sum. Returns the stage ranges.
pub fn balanced_cuts(w: &[f64], s: usize) -> Result<Vec<std::ops::Range<usize>>> {
    let l = w.len();
    if s == 0 || s > l {
        bail!("cannot cut {l} layers into {s} non-empty stages");
    }
    let pre: Vec<f64> = std::iter::once(0.0)
        .chain(w.iter().scan(0.0, |a, x| {
            *a += x;
            Some(*a)
        }))
        .collect();
    // best[k][j]: the smallest max over cuts of layers 0..j into k stages.
    let inf = f64::INFINITY;
    let mut best = vec![vec![inf; l + 1]; s + 1];
    let mut arg = vec![vec![0usize; l + 1]; s + 1];
    best[0][0] = 0.0;
    for k in 1..=s {
        for j in k..=l {
            for i in (k - 1)..j {
                let v = best[k - 1][i].max(pre[j] - pre[i]);
                if v < best[k][j] {
                    best[k][j] = v;
                    arg[k][j] = i;
                }
            }
        }
    }
    let mut cuts = Vec::with_capacity(s);
    let mut j = l;
    for k in (1..=s).rev() {
        let i = arg[k][j];
        cuts.push(i..j);
        j = i;
    }
    cuts.reverse();
    Ok(cuts)
}

/// A communicator that counts the wall time spent inside its calls.
struct TimedComm<C> {
    inner: C,
    busy_ns: AtomicU64,
}

impl<C: Communicator> TimedComm<C> {
    fn new(inner: C) -> Self {
        Self {
            inner,
            busy_ns: AtomicU64::new(0),
        }
    }

    fn in_comm(&self) -> Duration {
        Duration::from_nanos(self.busy_ns.load(Ordering::Relaxed))
    }

    fn timed<R>(&self, f: impl FnOnce() -> R) -> R {
        let t = Instant::now();
        let r = f();
        self.busy_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }
}

impl<C: Communicator> Communicator for TimedComm<C> {
    fn rank(&self) -> Rank {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn generation(&self) -> u64 {
        self.inner.generation()
    }
    fn send(
        &self,
        dst: Rank,
        tag: u64,
        tensor: &TensorBuf,
        timeout: Duration,
    ) -> oobleck_comm::Result<()> {
        self.timed(|| self.inner.send(dst, tag, tensor, timeout))
    }
    fn recv(&self, src: Rank, tag: u64, timeout: Duration) -> oobleck_comm::Result<TensorBuf> {
        self.timed(|| self.inner.recv(src, tag, timeout))
    }
    fn recv_into(
        &self,
        src: Rank,
        tag: u64,
        dst: &mut TensorBuf,
        timeout: Duration,
    ) -> oobleck_comm::Result<()> {
        self.timed(|| self.inner.recv_into(src, tag, dst, timeout))
    }
    fn all_reduce(
        &self,
        group: &[Rank],
        tensor: &mut TensorBuf,
        timeout: Duration,
    ) -> oobleck_comm::Result<()> {
        self.timed(|| self.inner.all_reduce(group, tensor, timeout))
    }
    fn broadcast(
        &self,
        group: &[Rank],
        root: Rank,
        tensor: &mut TensorBuf,
        timeout: Duration,
    ) -> oobleck_comm::Result<()> {
        self.timed(|| self.inner.broadcast(group, root, tensor, timeout))
    }
    fn barrier(&self, group: &[Rank], timeout: Duration) -> oobleck_comm::Result<()> {
        self.timed(|| self.inner.barrier(group, timeout))
    }
    fn abort(&self) {
        self.inner.abort()
    }
    fn is_aborted(&self) -> bool {
        self.inner.is_aborted()
    }
}

/// Connects `world` TCP ranks on 127.0.0.1 (each on its own port 0 listener).
fn connect_tcp(world: usize, timeout: Duration) -> Result<Vec<TcpCommunicator>> {
    let listeners = (0..world)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()
        .context("binding 127.0.0.1:0")?;
    let addrs: Vec<SocketAddr> = listeners
        .iter()
        .map(|l| l.local_addr())
        .collect::<std::io::Result<_>>()?;
    let comms: Vec<Result<TcpCommunicator>> = std::thread::scope(|s| {
        let hs: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                let mut cfg = TcpConfig::new(rank, 0, addrs.clone());
                cfg.connect_timeout = timeout;
                s.spawn(move || {
                    TcpCommunicator::connect(cfg, Some(l))
                        .with_context(|| format!("rank {rank}: connecting"))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("connect panicked")))
            })
            .collect()
    });
    comms.into_iter().collect()
}

/// What one rank recorded per iteration (instants relative to a common epoch).
#[derive(Clone, Copy, Debug, Default)]
struct IterRecord {
    start: Duration,
    iter_end: Duration,
    sync_end: Duration,
    step_end: Duration,
    /// Time inside communicator calls of the main thread during `run_iteration`.
    comm_in_iter: Duration,
    /// Gradient all-reduces run in the background during `run_iteration`, and the part of
    /// them that ran while the main thread was still busy.
    bg_sync: Duration,
    bg_hidden: Duration,
}

struct RankResult {
    records: Vec<IterRecord>,
    /// One-way p2p samples (rank 0 only).
    p2p_ns: Vec<f64>,
    loss: f64,
}

/// Everything fixed across the ranks of a run.
struct RunSetup<'a> {
    model: &'a dyn LayeredModel,
    layout: &'a Layout,
    data: Data,
    args: &'a BenchPipelineArgs,
    act_dims: &'a [usize],
    epoch: Instant,
}

fn run_rank(setup: &RunSetup<'_>, comm: &TimedComm<TcpCommunicator>) -> Result<RankResult> {
    let args = setup.args;
    let rank = comm.rank();
    let timeout = Duration::from_secs(args.timeout_s);
    let cfg = WorkerConfig {
        seed: args.seed,
        microbatch_size: args.microbatch_size,
        timeout,
        bucket_elems: BUCKET_ELEMS,
    };
    let w = StageWorker::new(
        setup.model,
        setup.layout,
        rank,
        &Device::Cpu,
        ParamSource::Init { seed: args.seed },
        cfg,
    )?;
    let all = setup.layout.ranks();
    let mut opt = AdamW::new(AdamWConfig::default())?;
    // p2p: ping-pong of one activation between ranks 0 and 1, each way as the worker does it
    // (tensor -> host buffer -> wire -> buffer -> tensor).
    let mut p2p_ns = Vec::new();
    if all.len() > 1 && rank <= 1 {
        let act = Tensor::ones(setup.act_dims, candle_core::DType::F32, &Device::Cpu)?;
        let peer = 1 - rank;
        for i in 0..=args.p2p_reps as u64 {
            let t0 = Instant::now();
            let tag = (1 << 62) | (i << 1);
            if rank == 0 {
                comm.send(peer, tag, &tensor_to_buf(&act)?, timeout)?;
                buf_to_tensor(&comm.recv(peer, tag | 1, timeout)?, &Device::Cpu)?;
                if i > 0 {
                    p2p_ns.push(t0.elapsed().as_nanos() as f64 / 2.0);
                }
            } else {
                let x = buf_to_tensor(&comm.recv(peer, tag, timeout)?, &Device::Cpu)?;
                comm.send(peer, tag | 1, &tensor_to_buf(&x)?, timeout)?;
            }
        }
    }
    let data = setup.data;
    let mut get = move |it: u64, mb: u64| data.get(it, mb);
    let mut records = Vec::new();
    let mut loss = f64::NAN;
    for it in 0..(args.warmup + args.iters) as u64 {
        comm.barrier(&all, timeout)?;
        let c0 = comm.in_comm();
        let start = setup.epoch.elapsed();
        let out = w.run_iteration(comm, it, &mut get)?;
        let iter_end = setup.epoch.elapsed();
        // The background all-reduces go through `comm` too: not the main thread's waiting.
        let (bg_sync, bg_hidden) = (out.overlap.collective, out.overlap.hidden);
        let comm_in_iter = (comm.in_comm() - c0).saturating_sub(bg_sync);
        let (grads, rep) = sync_gradients(&w, comm, out, Some(1.0))?;
        let sync_end = setup.epoch.elapsed();
        opt.step(&w.params(), &grads, 1e-3)?;
        let step_end = setup.epoch.elapsed();
        loss = rep.loss;
        if it as usize >= args.warmup {
            records.push(IterRecord {
                start,
                iter_end,
                sync_end,
                step_end,
                comm_in_iter,
                bg_sync,
                bg_hidden,
            });
        }
    }
    Ok(RankResult {
        records,
        p2p_ns,
        loss,
    })
}

/// Runs one configuration and measures it (without the control plane, added by the caller).
fn run_config(
    args: &BenchPipelineArgs,
    model: &dyn LayeredModel,
    data: Data,
    c: Config,
) -> Result<Row> {
    let l = model.num_layers();
    let s = c.stages;
    let m = args.microbatches;
    // Balanced cut from per-layer profiles, then each chosen stage profiled whole.
    let (stage_times, act_dims, ranges) = in_pool(args.threads_per_rank, || -> Result<_> {
        let mut per_layer = Vec::with_capacity(l);
        for i in 0..l {
            let (t, _) = profile_range(model, i..i + 1, &data, args.profile_reps, args.seed)?;
            per_layer.push((t.forward_ns + t.backward_ns) as f64);
        }
        let ranges = balanced_cuts(&per_layer, s)?;
        let mut times = Vec::with_capacity(s);
        let mut act_dims = Vec::new();
        for r in &ranges {
            let (t, dims) = profile_range(model, r.clone(), &data, args.profile_reps, args.seed)?;
            if act_dims.is_empty() {
                act_dims = dims;
            }
            times.push(t);
        }
        Ok((times, act_dims, ranges))
    })??;
    let pipelines: Vec<PipelineSpec> = (0..c.pipelines)
        .map(|p| PipelineSpec {
            stages: ranges
                .iter()
                .enumerate()
                .map(|(i, r)| StageSpec::single(r.clone(), p * s + i))
                .collect(),
            microbatches: p as u32 * m..(p as u32 + 1) * m,
        })
        .collect();
    let layout = Layout::new(l, m * c.pipelines as u32, pipelines)?;
    let world = s * c.pipelines;
    let timeout = Duration::from_secs(args.timeout_s);
    let comms: Vec<TimedComm<TcpCommunicator>> = connect_tcp(world, timeout)?
        .into_iter()
        .map(TimedComm::new)
        .collect();
    let setup = RunSetup {
        model,
        layout: &layout,
        data,
        args,
        act_dims: &act_dims,
        epoch: Instant::now(),
    };
    let results: Vec<Result<RankResult>> = std::thread::scope(|sc| {
        let hs: Vec<_> = comms
            .iter()
            .map(|comm| {
                let setup = &setup;
                sc.spawn(move || {
                    let r =
                        in_pool(args.threads_per_rank, || run_rank(setup, comm)).and_then(|r| r);
                    if r.is_err() {
                        comm.abort();
                    }
                    r.with_context(|| format!("rank {}", comm.rank()))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("a rank panicked"))))
            .collect()
    });
    // Abort every endpoint before any is dropped: a reader of an aborted endpoint takes its
    // peers' closing sockets as the end, not as a lost peer worth a warning.
    for c in &comms {
        c.abort();
    }
    drop(comms);
    let results = results.into_iter().collect::<Result<Vec<_>>>()?;

    // The simulator's prediction from the isolated profiles and the measured p2p time.
    let p2p_ns = if world > 1 {
        median(&results[0].p2p_ns)
    } else {
        0.0
    };
    let sim = simulate(&stage_times, &vec![p2p_ns as u64; s - 1], m);
    let sim_ms = sim.makespan_ns as f64 / 1e6;
    let sim_bubbles: Vec<f64> = stage_times
        .iter()
        .map(|t| {
            1.0 - f64::from(m) * (t.forward_ns + t.backward_ns) as f64 / sim.makespan_ns as f64
        })
        .collect();

    let (mut iter_ms, mut step_ms, mut sync_ms, mut wait_ms) = (vec![], vec![], vec![], vec![]);
    let mut overlap_ms = vec![];
    let (mut bub_mean, mut bub_worst) = (vec![], vec![]);
    let mut busy_per_mb: Vec<Vec<f64>> = vec![vec![]; s];
    for k in 0..args.iters {
        let rec: Vec<IterRecord> = results.iter().map(|r| r.records[k]).collect();
        let mut worst_makespan = Duration::ZERO;
        let mut bubbles = Vec::with_capacity(world);
        let mut busy_sum = vec![0.0; s];
        for p in 0..c.pipelines {
            let rs = &rec[p * s..(p + 1) * s];
            let start = rs.iter().map(|r| r.start).min().expect("stages");
            let end = rs.iter().map(|r| r.iter_end).max().expect("stages");
            let makespan = end - start;
            worst_makespan = worst_makespan.max(makespan);
            for (i, r) in rs.iter().enumerate() {
                let busy = (r.iter_end - r.start).saturating_sub(r.comm_in_iter);
                bubbles.push(1.0 - busy.as_secs_f64() / makespan.as_secs_f64());
                busy_sum[i] += ms(busy) / f64::from(m) / c.pipelines as f64;
            }
        }
        for (i, b) in busy_sum.into_iter().enumerate() {
            busy_per_mb[i].push(b);
        }
        iter_ms.push(ms(worst_makespan));
        bub_mean.push(bubbles.iter().sum::<f64>() / bubbles.len() as f64);
        bub_worst.push(bubbles.iter().copied().fold(f64::MIN, f64::max));
        let first = rec.iter().map(|r| r.start).min().expect("ranks");
        step_ms.push(ms(
            rec.iter().map(|r| r.step_end).max().expect("ranks") - first
        ));
        // Sync of the slowest rank: its background bucket all-reduces (during its last
        // backward) plus the rest in `sync_gradients`; overlap = the background part that ran
        // while its main thread was still computing or sending.
        let sync_of = |r: &IterRecord| r.bg_sync + (r.sync_end - r.iter_end);
        let slow = rec.iter().max_by_key(|r| sync_of(r)).expect("ranks");
        sync_ms.push(ms(sync_of(slow)));
        overlap_ms.push(ms(slow.bg_hidden));
        let last_iter_end = rec.iter().map(|r| r.iter_end).max().expect("ranks");
        wait_ms.push(ms(last_iter_end
            .min(slow.sync_end)
            .saturating_sub(slow.iter_end)));
    }
    let measured = median(&iter_ms);
    let ratio = measured / sim_ms;
    let busy_times: Vec<StageTimes> = stage_times
        .iter()
        .zip(&busy_per_mb)
        .map(|(t, busy)| {
            let total = (t.forward_ns + t.backward_ns).max(1) as f64;
            let busy_ns = median(busy) * 1e6;
            let f = busy_ns * t.forward_ns as f64 / total;
            StageTimes {
                forward_ns: f as u64,
                backward_ns: (busy_ns - f).max(0.0) as u64,
            }
        })
        .collect();
    let sim_busy_ms =
        simulate(&busy_times, &vec![p2p_ns as u64; s - 1], m).makespan_ns as f64 / 1e6;
    let sync = median(&sync_ms);
    let overlap = median(&overlap_ms);
    Ok(Row {
        stages: s,
        pipelines: c.pipelines,
        ranks: world,
        cores: cores(),
        oversubscribed: world * args.threads_per_rank.max(1) > cores(),
        m,
        stage_profile: ranges
            .iter()
            .zip(&stage_times)
            .zip(&busy_per_mb)
            .map(|((r, t), busy)| StageProfile {
                layers: (r.start, r.end),
                forward_ms: t.forward_ns as f64 / 1e6,
                backward_ms: t.backward_ns as f64 / 1e6,
                pipeline_busy_ms: median(busy),
            })
            .collect(),
        p2p_ms: p2p_ns / 1e6,
        measured_iter_ms: measured,
        simulated_iter_ms: sim_ms,
        ratio,
        within_15pct: (ratio - 1.0).abs() <= 0.15,
        simulated_from_busy_ms: sim_busy_ms,
        ratio_to_busy_sim: measured / sim_busy_ms,
        bubble_measured_mean: median(&bub_mean),
        bubble_measured_worst: median(&bub_worst),
        bubble_simulated_mean: sim_bubbles.iter().sum::<f64>() / s as f64,
        bubble_theory: theoretical_bubble(s, m),
        sync_ms: sync,
        sync_overlap_backward_ms: overlap,
        sync_overlap_pct: if sync > 0.0 {
            100.0 * overlap / sync
        } else {
            0.0
        },
        sync_wait_for_peers_ms: median(&wait_ms),
        step_ms: median(&step_ms),
        control_plane_ms: f64::NAN,
        control_plane_pct: f64::NAN,
        control_plane_within_2pct: false,
        loss: results.iter().map(|r| r.loss).fold(f64::NAN, f64::max),
    })
}

/// The commit round trip with the real control plane: `agents` agents register with a master on
/// 127.0.0.1; per step every agent sends a `Ready` report, the driver waits for all of their
/// `MasterEvent::Worker`s, calls `commit_step`, and every agent receives `StepCommitted`.
/// Timed from the first send to the last `StepCommitted` received.
pub fn control_plane(agents: usize, steps: usize, timeout: Duration) -> Result<ControlPlane> {
    if agents == 0 || steps == 0 {
        bail!("the control-plane measurement needs at least one agent and one step");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("tokio runtime")?;
    rt.block_on(async move {
        let token = Token::random();
        let mut master = Master::bind_with(
            "127.0.0.1:0".parse().expect("address"),
            MasterConfig::new(token.clone(), agents as u32),
        )
        .await?;
        let mut ags = Vec::with_capacity(agents);
        for _ in 0..agents {
            ags.push(Agent::connect(master.local_addr(), &token, timeout).await?);
        }
        master.wait_for_nodes(timeout).await?;
        let mut samples = Vec::with_capacity(steps);
        for step in 0..steps as u64 + 1 {
            let t0 = Instant::now();
            // Ready leg: every agent relays a `Ready` report (as the cluster's agents do for
            // their workers); the master's connection tasks turn each into a
            // `MasterEvent::Worker` for the driver, which commits once it has heard from all.
            for (rank, a) in ags.iter().enumerate() {
                let msg = Message::Worker {
                    node: a.node(),
                    generation: 0,
                    report: WorkerReport::Ready {
                        rank: rank as u32,
                        step,
                        loss: 0.0,
                        grad_norm: 0.0,
                    },
                };
                a.send(msg, timeout).await?;
            }
            let mut ready = 0;
            while ready < agents {
                match master.next_event(timeout).await? {
                    MasterEvent::Worker {
                        report: WorkerReport::Ready { step: s, .. },
                        ..
                    } if s == step => ready += 1,
                    MasterEvent::Joined { .. } => {}
                    other => bail!("expected StepReady({step}) events, got {other:?}"),
                }
            }
            let failed = master.commit_step(step, 0.0).await;
            if let Some((node, e)) = failed.into_iter().next() {
                bail!("commit_step could not reach node {node}: {e}");
            }
            for a in &mut ags {
                match a.recv(timeout).await? {
                    Message::StepCommitted { step: s, .. } if s == step => {}
                    other => bail!("expected StepCommitted({step}), got {other:?}"),
                }
            }
            if step > 0 {
                samples.push(ms(t0.elapsed()));
            }
        }
        drop(ags);
        master.shutdown("benchmark done", timeout).await;
        Ok(ControlPlane {
            agents,
            steps,
            ready_leg: "Worker(Ready) -> MasterEvent::Worker -> commit_step -> StepCommitted"
                .into(),
            round_trip_ms: median(&samples),
            p90_ms: percentile(&samples, 0.9),
        })
    })
}

/// Measures every configuration; the rows of the table.
pub fn measure(args: &BenchPipelineArgs) -> Result<(Vec<Row>, Vec<ControlPlane>, usize)> {
    if args.iters == 0 || args.profile_reps == 0 || args.microbatches == 0 {
        bail!("--iters, --profile-reps and --microbatches must be at least 1");
    }
    if args.microbatch_size == 0 {
        bail!("--microbatch-size must be at least 1");
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
        let mut row = run_config(args, model.as_ref(), data, c)
            .with_context(|| format!("configuration {}x{}", c.stages, c.pipelines))?;
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
    Ok((rows, cps, vocab))
}

pub fn run(args: &BenchPipelineArgs) -> Result<()> {
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

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

fn table(r: &Report) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "pipeline benchmark: {} (vocab {}), seq {}, microbatch {}, {} warm-up + {} timed \
         iterations, {} core(s), {} rayon thread(s) per rank, TCP on 127.0.0.1",
        r.model,
        r.vocab,
        r.seq_len,
        r.microbatch_size,
        r.warmup,
        r.iters,
        r.cores,
        r.threads_per_rank
    );
    let _ = writeln!(
        o,
        "load average before {}, after {} (other processes share these cores)",
        r.load_before.as_deref().unwrap_or("n/a"),
        r.load_after.as_deref().unwrap_or("n/a")
    );
    for row in &r.rows {
        let stages: Vec<String> = row
            .stage_profile
            .iter()
            .map(|p| {
                format!(
                    "L{}..{} f {:.1} + b {:.1} (in pipeline {:.1})",
                    p.layers.0, p.layers.1, p.forward_ms, p.backward_ms, p.pipeline_busy_ms
                )
            })
            .collect();
        let _ = writeln!(
            o,
            "  {}x{} stage alone, ms/microbatch (busy in the pipeline): {}; p2p {:.2} ms",
            row.stages,
            row.pipelines,
            stages.join(" | "),
            row.p2p_ms
        );
        let _ = writeln!(
            o,
            "      simulator fed the in-pipeline busy times (post hoc): {:.1} ms, measured/that {:.3}",
            row.simulated_from_busy_ms, row.ratio_to_busy_sim
        );
    }
    let _ = writeln!(
        o,
        "{:<5} {:>5} {:>3} {:>9} {:>9} {:>6} {:>5} {:>14} {:>7} {:>7} {:>8} {:>8} {:>9} {:>8} {:>8} {:>9} {:>4}",
        "SxP", "ranks", "m", "iter ms", "sim ms", "ratio", "<15%", "bubble m/worst", "sim", "theory",
        "sync ms", "overlap", "peer wait", "step ms", "ctl ms", "ctl %", "<2%"
    );
    for row in &r.rows {
        let _ = writeln!(
            o,
            "{:<5} {:>5} {:>3} {:>9.1} {:>9.1} {:>6.3} {:>5} {:>6.3}/{:<7.3} {:>7.3} {:>7.3} {:>8.2} {:>7.0}% {:>9.2} {:>8.1} {:>8.3} {:>8.3}% {:>4}",
            format!("{}x{}", row.stages, row.pipelines),
            format!("{}{}", row.ranks, if row.oversubscribed { "*" } else { "" }),
            row.m,
            row.measured_iter_ms,
            row.simulated_iter_ms,
            row.ratio,
            yes(row.within_15pct),
            row.bubble_measured_mean,
            row.bubble_measured_worst,
            row.bubble_simulated_mean,
            row.bubble_theory,
            row.sync_ms,
            row.sync_overlap_pct,
            row.sync_wait_for_peers_ms,
            row.step_ms,
            row.control_plane_ms,
            row.control_plane_pct,
            yes(row.control_plane_within_2pct),
        );
    }
    let _ = writeln!(
        o,
        "iter = makespan of run_iteration (slowest pipeline); sim = schedule::simulate from the \
         isolated stage profiles and p2p; bubble = 1 - busy/iter per rank (busy = time outside \
         communicator calls), mean/worst; theory = (S-1)/(m+S-1); sync = gradient sync of the \
         slowest rank (bucket all-reduces started during its last backward + sync_gradients), \
         overlap = its share run while its main thread was still in the iteration, peer wait = \
         time in sync_gradients while another rank was still in its iteration; step = iteration + sync + AdamW; ctl = control-plane commit round trip."
    );
    for cp in &r.control_plane {
        let _ = writeln!(
            o,
            "control plane, {} agent(s): median {:.3} ms, p90 {:.3} ms over {} steps; ready leg: {}",
            cp.agents, cp.round_trip_ms, cp.p90_ms, cp.steps, cp.ready_leg
        );
    }
    if r.rows.iter().any(|x| x.oversubscribed) {
        let _ = writeln!(
            o,
            "* more rank threads than the {} core(s): ranks share cores, so those rows' measured \
             times include waiting for a core and do not compare with the isolated profiles.",
            r.cores
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bubble_formula_and_balanced_cuts() {
        assert_eq!(theoretical_bubble(1, 8), 0.0);
        assert!((theoretical_bubble(2, 8) - 1.0 / 9.0).abs() < 1e-12);
        assert!((theoretical_bubble(4, 4) - 3.0 / 7.0).abs() < 1e-12);
        let cuts = balanced_cuts(&[1.0, 1.0, 1.0, 1.0, 4.0], 2).unwrap();
        assert_eq!(cuts, vec![0..4, 4..5]);
        let cuts = balanced_cuts(&[3.0, 1.0, 1.0, 1.0], 2).unwrap();
        assert_eq!(cuts, vec![0..1, 1..4]);
        let cuts = balanced_cuts(&[2.0, 2.0, 1.0, 1.0, 2.0], 3).unwrap();
        assert_eq!(cuts, vec![0..1, 1..3, 3..5]);
        assert!(balanced_cuts(&[1.0], 2).is_err());
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
        assert_eq!(rows.len(), 1);
        assert_eq!(cps.len(), 1);
        let r = &rows[0];
        assert_eq!((r.stages, r.pipelines, r.ranks), (2, 2, 4));
        for (name, v) in [
            ("iter", r.measured_iter_ms),
            ("sim", r.simulated_iter_ms),
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
        serde_json::to_string(&report).unwrap();
    }
}
