//! Running one configuration: every rank a thread of this process with its own rayon pool, over
//! the TCP data plane; each times its iterations, gradient sync and optimizer step.

use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use candle_core::{Device, Tensor};
use oobleck_comm::{Communicator, TcpCommunicator};
use oobleck_core::execution::{
    buf_to_tensor, sync_gradients, tensor_to_buf, Layout, PipelineSpec, StageConfig, StageRunner,
    StageSpec, BUCKET_ELEMS,
};
use oobleck_core::model::{LayeredModel, ParamSource};
use oobleck_core::optim::{AdamW, AdamWConfig};
use oobleck_core::schedule::Schedule;

use super::comm::{connect_tcp, TimedComm};
use super::profile::{profile_stages, Data};
use super::summary::summarise;
use super::{BenchPipelineArgs, Config, Row};

/// Runs `f` inside a rayon pool of `threads` threads (0: the caller's pool).
pub(super) fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> Result<R> {
    if threads == 0 {
        return Ok(f());
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("building a rank's thread pool")?;
    Ok(pool.install(f))
}

/// What one rank recorded per iteration (instants relative to a common epoch).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct IterRecord {
    pub(super) start: Duration,
    pub(super) iter_end: Duration,
    pub(super) sync_end: Duration,
    pub(super) step_end: Duration,
    /// Time inside communicator calls of the main thread during `run_iteration`.
    pub(super) comm_in_iter: Duration,
    /// Gradient all-reduces run in the background during `run_iteration`, and the part of
    /// them that ran while the main thread was still busy.
    pub(super) bg_sync: Duration,
    pub(super) bg_hidden: Duration,
}

pub(super) struct RankResult {
    pub(super) records: Vec<IterRecord>,
    /// One-way p2p samples (rank 0 only).
    pub(super) p2p_ns: Vec<f64>,
    pub(super) loss: f64,
}

/// Everything fixed across the ranks of a run.
struct RunSetup<'a> {
    model: &'a dyn LayeredModel,
    layout: &'a Layout,
    data: Data,
    args: &'a BenchPipelineArgs,
    schedule: Schedule,
    act_dims: &'a [usize],
    epoch: Instant,
}

/// Runs one configuration under each of `args.schedules` on the same stages and measures it:
/// one row per schedule (without the control plane, added by the caller).
pub(super) fn run_config(
    args: &BenchPipelineArgs,
    model: &dyn LayeredModel,
    data: Data,
    c: Config,
) -> Result<Vec<Row>> {
    let s = c.stages;
    let m = args.microbatches;
    let world = s * c.pipelines;
    let copies = (world, args.threads_per_rank);
    let prof = profile_stages(model, &data, (s, m), copies, args.profile_reps, args.seed)?;
    let layout = layout_of(model.num_layers(), &prof.ranges, c, m)?;
    let timeout = Duration::from_secs(args.timeout_s);
    let mut rows = Vec::with_capacity(args.schedules.len());
    for &schedule in &args.schedules {
        let comms: Vec<TimedComm<TcpCommunicator>> = connect_tcp(world, timeout)?
            .into_iter()
            .map(TimedComm::new)
            .collect();
        let setup = RunSetup {
            model,
            layout: &layout,
            data,
            args,
            schedule,
            act_dims: &prof.act_dims,
            epoch: Instant::now(),
        };
        let results = run_ranks(&setup, comms).with_context(|| format!("under {schedule}"))?;
        rows.push(summarise(args, c, schedule, &prof, &results));
    }
    Ok(rows)
}

/// `c.pipelines` copies of the stages `ranges`, each with its own `m` microbatches; pipeline
/// `p`'s stage `i` is rank `p * S + i`.
fn layout_of(l: usize, ranges: &[std::ops::Range<usize>], c: Config, m: u32) -> Result<Layout> {
    let s = c.stages;
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
    Ok(Layout::new(l, m * c.pipelines as u32, pipelines)?)
}

/// Runs every rank on its own thread over `comms` (one per rank) and collects what each
/// recorded; the first failure is the error.
fn run_ranks(
    setup: &RunSetup<'_>,
    comms: Vec<TimedComm<TcpCommunicator>>,
) -> Result<Vec<RankResult>> {
    let threads = setup.args.threads_per_rank;
    let results: Vec<Result<RankResult>> = std::thread::scope(|sc| {
        let hs: Vec<_> = comms
            .iter()
            .map(|comm| {
                sc.spawn(move || {
                    let r = in_pool(threads, || run_rank(setup, comm)).and_then(|r| r);
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
    results.into_iter().collect()
}

/// One rank: its stage worker, the p2p measurement (ranks 0 and 1), then the warm-up and timed
/// iterations, each followed by the gradient sync and an AdamW step.
fn run_rank(setup: &RunSetup<'_>, comm: &TimedComm<TcpCommunicator>) -> Result<RankResult> {
    let args = setup.args;
    let rank = comm.rank();
    let timeout = Duration::from_secs(args.timeout_s);
    let cfg = StageConfig {
        seed: args.seed,
        microbatch_size: args.microbatch_size,
        timeout,
        bucket_elems: BUCKET_ELEMS,
        dtype: candle_core::DType::F32,
        recompute: false,
        schedule: setup.schedule,
    };
    let w = StageRunner::new(
        setup.model,
        setup.layout,
        rank,
        &Device::Cpu,
        ParamSource::Init { seed: args.seed },
        cfg,
    )?;
    let all = setup.layout.ranks();
    let mut opt = AdamW::new(AdamWConfig::default())?;
    let p2p_ns = if all.len() > 1 && rank <= 1 {
        p2p_ping_pong(comm, setup.act_dims, args.p2p_reps, timeout)?
    } else {
        Vec::new()
    };
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

/// One-way times of `reps` ping-pongs of one activation between ranks 0 and 1 (the samples on
/// rank 0; none on rank 1), each way as the worker does it (tensor -> host buffer -> wire ->
/// buffer -> tensor). One untimed round first.
fn p2p_ping_pong(
    comm: &TimedComm<TcpCommunicator>,
    act_dims: &[usize],
    reps: usize,
    timeout: Duration,
) -> Result<Vec<f64>> {
    let rank = comm.rank();
    let mut p2p_ns = Vec::new();
    let act = Tensor::ones(act_dims, candle_core::DType::F32, &Device::Cpu)?;
    let peer = 1 - rank;
    for i in 0..=reps as u64 {
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
    Ok(p2p_ns)
}
