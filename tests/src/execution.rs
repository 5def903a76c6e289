//! Drivers for the execution contract: the single-process reference step and a run of every
//! rank of a [`Layout`] as a thread over [`LocalNetwork`].

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use candle_core::{Device, Tensor, Var};
use oobleck_comm::{Communicator, LocalNetwork, TcpCommunicator, TcpConfig, Tuning};
use oobleck_core::execution::{Layout, StageConfig, StageRunner};
use oobleck_core::model::{accumulate, DropoutKey, ForwardCtx, LayeredModel, ParamSource, Stage};
use oobleck_core::optim::{clip_grad_norm, AdamW, AdamWConfig};

/// Hyper-parameters of one contract run.
#[derive(Debug, Clone, Copy)]
pub struct RunSpec {
    pub seed: u64,
    pub steps: u64,
    /// `B`: microbatches of the global batch.
    pub microbatches: u32,
    /// `b`: samples per microbatch (rows split across a multi-device stage).
    pub microbatch_size: u32,
    pub lr: f64,
    pub max_grad_norm: f64,
    /// Bound of every data-plane operation.
    pub timeout: Duration,
    /// `StageConfig::bucket_elems`: the most gradient elements one all-reduce carries.
    pub bucket_elems: usize,
}

/// Per-step mean losses and the final parameters by name (flattened).
#[derive(Debug, Clone, Default)]
pub struct RunResult {
    pub losses: Vec<f64>,
    pub params: BTreeMap<String, Vec<f32>>,
    /// Pre-clip global gradient norms per step.
    pub grad_norms: Vec<f64>,
}

/// Makes `(token ids, targets)` of a microbatch from `(iteration, global microbatch)`.
pub type DataFn = dyn Fn(u64, u64) -> oobleck_core::Result<(Tensor, Tensor)> + Sync;

fn flat(params: &[(String, Var)]) -> Result<BTreeMap<String, Vec<f32>>> {
    params
        .iter()
        .map(|(n, v)| Ok((n.clone(), v.flatten_all()?.to_vec1::<f32>()?)))
        .collect()
}

/// The single-process trainer's step (bin/src/trainer.rs `train_step`): one stage of every
/// layer, each microbatch's loss scaled by `1/B`, gradients summed, clipped, AdamW.
pub fn single_process(
    model: &dyn LayeredModel,
    spec: &RunSpec,
    data: &DataFn,
) -> Result<RunResult> {
    let stage = Stage::new(model.build_layers(
        0..model.num_layers(),
        &Device::Cpu,
        ParamSource::Init { seed: spec.seed },
    )?)?;
    let mut opt = AdamW::new(AdamWConfig::default())?;
    let mut out = RunResult::default();
    for it in 0..spec.steps {
        let mut grads = HashMap::new();
        let mut loss = 0.0;
        for k in 0..spec.microbatches {
            let (x, tg) = data(it, u64::from(k))?;
            let ctx = ForwardCtx {
                targets: Some(&tg),
                loss_scale: 1.0 / f64::from(spec.microbatches),
                train: true,
                dropout_key: DropoutKey {
                    seed: spec.seed,
                    iteration: it,
                    microbatch: u64::from(k),
                },
                rows: None,
                dtype: candle_core::DType::F32,
            };
            let fwd = stage.forward(&x, &ctx)?;
            loss += f64::from(fwd.output.to_scalar::<f32>()?);
            accumulate(&mut grads, stage.backward(fwd, None)?.params)?;
        }
        out.grad_norms
            .push(clip_grad_norm(&mut grads, spec.max_grad_norm)?);
        opt.step(&stage.params(), &grads, spec.lr)?;
        out.losses.push(loss);
    }
    out.params = flat(&stage.params())?;
    Ok(out)
}

/// The data plane of a [`pipelines`] run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// In-process mailboxes ([`LocalNetwork`]).
    Local,
    /// Real sockets on 127.0.0.1 ([`TcpCommunicator`]), one listener per rank on port 0.
    Tcp,
}

/// Runs every rank of `layout` as a thread, `spec.steps` steps each, over `transport`.
/// Returns one result per rank (index = rank). A failing rank aborts its communicator so the
/// others fail fast instead of waiting for their timeouts.
pub fn pipelines(
    model: &dyn LayeredModel,
    layout: &Layout,
    spec: &RunSpec,
    data: &DataFn,
    transport: Transport,
) -> Result<Vec<RunResult>> {
    let ranks = layout.ranks();
    let world = ranks.len();
    if ranks != (0..world).collect::<Vec<_>>() {
        return Err(anyhow!("layout ranks {ranks:?} are not 0..{world}"));
    }
    match transport {
        Transport::Local => {
            let comms = LocalNetwork::new(world, 0).communicators(Tuning::default());
            run_all(
                comms.into_iter().map(Ok).collect(),
                model,
                layout,
                spec,
                data,
            )
        }
        Transport::Tcp => {
            let listeners = (0..world)
                .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
                .collect::<std::io::Result<Vec<_>>>()
                .context("binding 127.0.0.1:0")?;
            let addrs = listeners
                .iter()
                .map(|l| l.local_addr())
                .collect::<std::io::Result<Vec<_>>>()?;
            // Every rank connects at once (each waits for the others), bounded by the timeout.
            let comms: Vec<Result<TcpCommunicator>> = std::thread::scope(|s| {
                let handles: Vec<_> = listeners
                    .into_iter()
                    .enumerate()
                    .map(|(rank, l)| {
                        let mut cfg = TcpConfig::new(rank, 0, addrs.clone());
                        cfg.connect_timeout = spec.timeout;
                        s.spawn(move || {
                            TcpCommunicator::connect(cfg, Some(l))
                                .with_context(|| format!("rank {rank}: connecting"))
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| Err(anyhow!("connect panicked")))
                    })
                    .collect()
            });
            run_all(comms, model, layout, spec, data)
        }
    }
}

fn run_all<C: Communicator>(
    comms: Vec<Result<C>>,
    model: &dyn LayeredModel,
    layout: &Layout,
    spec: &RunSpec,
    data: &DataFn,
) -> Result<Vec<RunResult>> {
    let comms = comms.into_iter().collect::<Result<Vec<C>>>()?;
    let results: Vec<Result<RunResult>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                s.spawn(move || {
                    let r = run_rank(model, layout, spec, data, rank, &comm);
                    if r.is_err() {
                        comm.abort();
                    }
                    r.with_context(|| format!("rank {rank}"))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("a rank panicked"))))
            .collect()
    });
    results.into_iter().collect()
}

fn run_rank(
    model: &dyn LayeredModel,
    layout: &Layout,
    spec: &RunSpec,
    data: &DataFn,
    rank: usize,
    comm: &dyn Communicator,
) -> Result<RunResult> {
    let cfg = StageConfig {
        seed: spec.seed,
        microbatch_size: spec.microbatch_size,
        timeout: spec.timeout,
        bucket_elems: spec.bucket_elems,
        dtype: candle_core::DType::F32,
        recompute: false,
        schedule: Default::default(),
    };
    let w = StageRunner::new(
        model,
        layout,
        rank,
        &Device::Cpu,
        ParamSource::Init { seed: spec.seed },
        cfg,
    )?;
    let mut opt = AdamW::new(AdamWConfig::default())?;
    let mut out = RunResult::default();
    let mut data = |it, mb| data(it, mb);
    for it in 0..spec.steps {
        let r = w.train_step(
            comm,
            it,
            &mut data,
            &mut opt,
            spec.lr,
            Some(spec.max_grad_norm),
        )?;
        out.losses.push(r.loss);
        out.grad_norms.push(r.grad_norm);
    }
    out.params = flat(&w.params())?;
    Ok(out)
}

/// Largest absolute difference between a rank's parameters and the reference, with the name
/// and flat index where it occurs; fails if a parameter is missing from the reference or has another size.
pub fn max_param_diff(
    got: &BTreeMap<String, Vec<f32>>,
    want: &BTreeMap<String, Vec<f32>>,
) -> Result<(f32, String, usize)> {
    let mut worst = (0.0f32, String::new(), 0);
    for (name, v) in got {
        let w = want
            .get(name)
            .ok_or_else(|| anyhow!("`{name}` is not a parameter of the reference"))?;
        if w.len() != v.len() {
            return Err(anyhow!("`{name}`: {} values vs {}", v.len(), w.len()));
        }
        for (i, (a, b)) in v.iter().zip(w).enumerate() {
            let d = (a - b).abs();
            if d.is_nan() || d > worst.0 {
                worst = (d, name.clone(), i);
            }
        }
    }
    Ok(worst)
}
