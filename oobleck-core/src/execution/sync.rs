//! Gradient sync across pipelines, global-norm clipping and the optimizer step.
//!
//! Collectives are issued in one global order so that no two ranks wait on each other in a
//! cycle: layer buckets by DESCENDING first layer, then tied parameters in the model's order,
//! then one all-reduce over every rank of the layout. Every member of a bucket holds all its
//! layers, so all members see the same buckets above it and issue them first; by induction
//! from the top layer down each call finds its peers.
//!
//! Overlap with the backward (`stage.rs`): the last backward of an iteration (the last
//! microbatch) runs layer by layer, and each bucket is handed, once its layers are done, to
//! one background thread that all-reduces the buckets one at a time in that same descending
//! order; `sync_gradients` joins nothing (`run_iteration` already did) and issues only the
//! buckets not yet reduced, then the tied parameters and the norm/loss slots. So a rank never
//! has two collectives in flight at once, and every rank issues them in the same order. The
//! main thread meanwhile finishes the backward and its last `SendGradient`; no collective can
//! hold that up in a cycle:
//! - the background thread starts after the rank's last receive of the iteration (the last
//!   backward follows every `Recv*` in 1F1B), so no receive of this rank waits behind it;
//! - p2p tags are below 2^63 and collectives use bit 63 (`tag()` in `stage.rs`), so their
//!   messages never match each other, and `Communicator` is `Send + Sync` with operations on
//!   different channels allowed concurrently from different threads. On the TCP and local
//!   backends a send only queues a frame (a peer's reader thread always drains it), so it
//!   never waits on the peer's progress;
//! - on a backend that serialises every operation on one thread (NCCL), a send may queue
//!   behind a bucket all-reduce of this rank; that all-reduce involves only layers at or above
//!   this stage's first layer, whose members reach it once their backward of those layers is
//!   done, which depends only on gradients coming from above (their own receives are all
//!   done). Nothing it waits for depends on the stage below, so the send follows.

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::time::Duration;

use candle_core::{Tensor, Var};
use oobleck_comm::{Communicator, Rank, TensorBuf};
use tracing::debug_span;

use super::buf_f32;
use super::layout::Layout;
use crate::model::{Layer, TiedParam};
use crate::{Error, Result};

/// The global results of one step, identical on every rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SyncReport {
    /// Mean loss over the global batch (the sum of every microbatch's loss scaled by `1/B`).
    pub loss: f64,
    /// Global L2 norm of the gradient before clipping (each parameter counted once).
    pub grad_norm: f64,
}

/// What one iteration of a stage produced.
pub struct IterationOutput {
    /// Parameter gradients summed over this pipeline's microbatches (not yet synchronised).
    pub grads: HashMap<String, Tensor>,
    /// Sum of this device's scaled losses (last stage only; 0 elsewhere).
    pub loss: f64,
    /// The gradient buckets already all-reduced during the last backward (their entries of
    /// `grads` are summed over the holders); `sync_gradients` does the rest.
    pub(super) reduced: Vec<Range<usize>>,
    /// Timing of those overlapped all-reduces.
    pub overlap: OverlapStats,
}

/// How the bucket all-reduces of one iteration overlapped this rank's own work.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OverlapStats {
    /// Wall time of the all-reduces run on the background thread.
    pub collective: Duration,
    /// The part of `collective` that ran while the main thread was still busy with the
    /// iteration (the rest of the backward, sending the input gradient).
    pub hidden: Duration,
    /// How many buckets were reduced in the background.
    pub buckets: usize,
}

/// Sums every gradient of `out` with the other holders of the same parameters, computes the
/// global norm and, with `max_grad_norm`, clips like `optim::clip_grad_norm` on the whole model.
/// Returns the synchronised gradients of this rank's parameters.
pub(super) fn sync_with(
    ctx: &SyncCtx<'_>,
    comm: &dyn Communicator,
    out: IterationOutput,
    max_grad_norm: Option<f64>,
) -> Result<(HashMap<String, Tensor>, SyncReport)> {
    let _span = debug_span!("grad_sync", rank = ctx.rank).entered();
    if let Some(m) = max_grad_norm {
        if !(m.is_finite() && m > 0.0) {
            return Err(Error::InvalidArgument {
                op: "gradient sync",
                name: "max_grad_norm",
                value: m,
                want: "finite and > 0",
            });
        }
    }
    let mut grads = out.grads;
    let owned = reduce_held(ctx, comm, &out.reduced, &mut grads)?;
    let (total_sq, loss) = global_sums(ctx, comm, &grads, &owned, out.loss)?;
    let grad_norm = total_sq.sqrt();
    if let Some(max_norm) = max_grad_norm {
        clip(&mut grads, grad_norm, max_norm)?;
    }
    Ok((grads, SyncReport { loss, grad_norm }))
}

/// What the gradient sync needs of a rank's stage (built by `StageRunner::sync_ctx`).
pub(super) struct SyncCtx<'a> {
    pub rank: Rank,
    pub layout: &'a Layout,
    /// Indices of the stage's layers.
    pub range: Range<usize>,
    /// The stage's layers, for their parameters.
    pub layers: &'a [Box<dyn Layer>],
    /// The model's tied parameters (all of them, held here or not).
    pub tied: &'a [TiedParam],
    /// Bound of every collective.
    pub timeout: Duration,
    /// `StageConfig::bucket_elems`.
    pub bucket_elems: usize,
}

/// Sums this rank's buckets (except those in `reduced`, already summed during the last
/// backward) and tied parameters with their other holders, in the global order. Returns the
/// names whose square sum this rank contributes to the global norm.
fn reduce_held(
    ctx: &SyncCtx<'_>,
    comm: &dyn Communicator,
    reduced: &[Range<usize>],
    grads: &mut HashMap<String, Tensor>,
) -> Result<BTreeSet<String>> {
    let (rank, t) = (ctx.rank, ctx.timeout);
    let mut owned: BTreeSet<String> = BTreeSet::new();

    for bucket in sync_buckets(ctx) {
        if bucket.holders[0] == rank {
            owned.extend(bucket.names.iter().cloned());
        }
        // Buckets reduced during the last backward are not reduced twice.
        if bucket.needs_collective() && !reduced.contains(&bucket.layers) {
            all_reduce_named(comm, &bucket.holders, &bucket.names, grads, t)?;
        }
    }

    for tp in ctx.tied {
        if !tp.layers.iter().any(|l| ctx.range.contains(l)) {
            continue;
        }
        let (group, owner) = ctx.layout.tied_group(&tp.layers)?;
        if owner == rank {
            owned.insert(tp.name.clone());
        }
        if group.len() > 1 {
            all_reduce_named(comm, &group, std::slice::from_ref(&tp.name), grads, t)?;
        }
    }
    Ok(owned)
}

/// The global sum of squares of the gradients (each rank counting its `owned` names) and
/// the global loss (each rank's `loss`), identical on every rank.
fn global_sums(
    ctx: &SyncCtx<'_>,
    comm: &dyn Communicator,
    grads: &HashMap<String, Tensor>,
    owned: &BTreeSet<String>,
    loss: f64,
) -> Result<(f64, f64)> {
    // One slot of [sum_sq hi, lo, loss hi, lo] per rank: the all-reduce only adds zeros to
    // each value, so the f64 numbers survive the f32 data plane exactly (to ~48 bits), and
    // every rank then sums them in the same order.
    let mut sum_sq = 0.0f64;
    for name in owned {
        let g = grads.get(name).ok_or_else(|| missing(name))?;
        sum_sq += g
            .to_dtype(candle_core::DType::F64)?
            .sqr()?
            .sum_all()?
            .to_scalar::<f64>()?;
    }
    let ranks = ctx.layout.ranks();
    let slot = ranks
        .iter()
        .position(|&r| r == ctx.rank)
        .expect("a worker's rank is in its layout (checked when it was built)");
    let mut slots = vec![0f32; 4 * ranks.len()];
    slots[4 * slot..4 * slot + 4].copy_from_slice(&[hi(sum_sq), lo(sum_sq), hi(loss), lo(loss)]);
    let mut buf = TensorBuf::from_f32(vec![slots.len()], &slots)?;
    if ranks.len() > 1 {
        comm.all_reduce(&ranks, &mut buf, ctx.timeout)?;
    }
    let v = buf_f32(&buf)?;
    let (mut total_sq, mut total_loss) = (0.0f64, 0.0f64);
    for s in v.chunks_exact(4) {
        total_sq += f64::from(s[0]) + f64::from(s[1]);
        total_loss += f64::from(s[2]) + f64::from(s[3]);
    }
    Ok((total_sq, total_loss))
}

/// Exactly `optim::clip_grad_norm`'s rule, applied with the global norm.
fn clip(grads: &mut HashMap<String, Tensor>, grad_norm: f64, max_norm: f64) -> Result<()> {
    if grad_norm.is_finite() {
        let coef = max_norm / (grad_norm + 1e-6);
        if coef < 1.0 {
            for g in grads.values_mut() {
                *g = g.affine(coef, 0.0)?;
            }
        }
    }
    Ok(())
}

fn hi(x: f64) -> f32 {
    x as f32
}

fn lo(x: f64) -> f32 {
    (x - f64::from(x as f32)) as f32
}

fn missing(name: &str) -> Error {
    Error::MissingGradient {
        name: name.to_string(),
        when: "after the iteration",
    }
}

/// A gradient bucket of one rank: consecutive layers of its stage with the same holders,
/// and the names of their parameters that are not tied (tied ones are summed separately).
#[derive(Debug, Clone)]
pub(super) struct SyncBucket {
    pub layers: Range<usize>,
    pub holders: Vec<Rank>,
    pub names: Vec<String>,
}

impl SyncBucket {
    /// Whether the bucket has an all-reduce (others hold it too, and it has parameters).
    pub fn needs_collective(&self) -> bool {
        self.holders.len() > 1 && !self.names.is_empty()
    }
}

/// Default of `StageConfig::bucket_elems`: most gradient elements one all-reduce carries
/// (4 MiB of f32), unless a single layer has more. A layout bucket (consecutive layers with the
/// same holders, often a whole stage) is cut into runs of layers under this size, from the top
/// layer down, so the all-reduce of the top layers can run while the backward of the lower
/// ones still computes (`stage.rs`); the cut depends only on layer indices and parameter
/// shapes, so every holder cuts alike.
pub const BUCKET_ELEMS: usize = 1 << 20;

/// The buckets of `ctx`'s rank in the global order: descending first layer.
pub(super) fn sync_buckets(ctx: &SyncCtx<'_>) -> Vec<SyncBucket> {
    let tied_names: BTreeSet<&str> = ctx.tied.iter().map(|p| p.name.as_str()).collect();
    let mut out: Vec<SyncBucket> = Vec::new();
    for bucket in ctx.layout.buckets_of(ctx.rank) {
        // (layer, its untied parameter names, their elements), top layer first.
        let mut layers: Vec<(usize, Vec<String>, usize)> = ctx
            .layers
            .iter()
            .filter(|l| bucket.layers.contains(&l.index()))
            .map(|l| {
                let params: Vec<(String, Var)> = l
                    .params()
                    .into_iter()
                    .filter(|(n, _)| !tied_names.contains(n.as_str()))
                    .collect();
                let elems = params.iter().map(|(_, v)| v.elem_count()).sum();
                (
                    l.index(),
                    params.into_iter().map(|(n, _)| n).collect(),
                    elems,
                )
            })
            .collect();
        layers.sort_by_key(|(l, _, _)| std::cmp::Reverse(*l));
        let mut run: Vec<(usize, Vec<String>, usize)> = Vec::new();
        let mut run_elems = 0;
        let flush = |run: &mut Vec<(usize, Vec<String>, usize)>, out: &mut Vec<SyncBucket>| {
            if run.is_empty() {
                return;
            }
            run.reverse(); // ascending layers, so names keep the stage's order
            let lo = run[0].0;
            let hi = run[run.len() - 1].0 + 1;
            out.push(SyncBucket {
                layers: lo..hi,
                holders: bucket.holders.clone(),
                names: run.drain(..).flat_map(|(_, n, _)| n).collect(),
            });
        };
        for layer in layers {
            if !run.is_empty() && run_elems + layer.2 > ctx.bucket_elems {
                flush(&mut run, &mut out);
                run_elems = 0;
            }
            run_elems += layer.2;
            run.push(layer);
        }
        flush(&mut run, &mut out);
    }
    out.sort_by_key(|b| std::cmp::Reverse(b.layers.start));
    out
}

/// Sums the gradients `names` over `group` as one flat f32 buffer and writes them back. The
/// buffer comes from the communicator (shared memory on one host, reduced in place there) and
/// goes back to it when dropped, for the next step's bucket of the same size.
pub(super) fn all_reduce_named(
    comm: &dyn Communicator,
    group: &[Rank],
    names: &[String],
    grads: &mut HashMap<String, Tensor>,
    timeout: Duration,
) -> Result<()> {
    let mut parts = Vec::with_capacity(names.len());
    for name in names {
        let g = grads.get(name).ok_or_else(|| missing(name))?;
        parts.push(g.to_dtype(candle_core::DType::F32)?.flatten_all()?);
    }
    let total = parts.iter().map(Tensor::elem_count).sum();
    let mut buf = comm.alloc(oobleck_comm::DType::F32, vec![total])?;
    let mut off = 0;
    for p in &parts {
        let bytes = &mut buf.as_bytes_mut()[4 * off..4 * (off + p.elem_count())];
        bytes.copy_from_slice(bytemuck::cast_slice(&p.to_vec1::<f32>()?));
        off += p.elem_count();
    }
    drop(parts);
    comm.all_reduce(group, &mut buf, timeout)?;
    let owned;
    // Shared memory is page-aligned and heap bytes almost always 4-aligned; else a copy.
    let summed: &[f32] = match bytemuck::try_cast_slice(buf.as_bytes()) {
        Ok(s) => s,
        Err(_) => {
            owned = buf_f32(&buf)?;
            &owned
        }
    };
    let mut off = 0;
    for name in names {
        let g = grads.get(name).ok_or_else(|| missing(name))?;
        let (dims, n) = (g.dims().to_vec(), g.elem_count());
        let t = Tensor::from_slice(&summed[off..off + n], dims, g.device())?;
        off += n;
        grads.insert(name.clone(), t);
    }
    Ok(())
}
