//! Gradient sync across pipelines, global-norm clipping and the optimizer step.
//!
//! Collectives are issued in one global order so that no two ranks wait on each other in a
//! cycle: layer buckets by ascending first layer, then tied parameters in the model's order,
//! then one all-reduce over every rank of the layout. A bucket's members all complete the
//! buckets of smaller layers first (induction on the layer index), so each call finds its peers.

use std::collections::{BTreeSet, HashMap};

use candle_core::{Tensor, Var};
use oobleck_comm::{Communicator, TensorBuf};
use tracing::debug_span;

use super::buf_f32;
use super::worker::{IterationOutput, StageWorker};
use crate::optim::AdamW;
use crate::{Error, Result};

/// The global results of one step, identical on every rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SyncReport {
    /// Mean loss over the global batch (the sum of every microbatch's loss scaled by `1/B`).
    pub loss: f64,
    /// Global L2 norm of the gradient before clipping (each parameter counted once).
    pub grad_norm: f64,
}

/// Sums every gradient of `out` with the other holders of the same parameters, computes the
/// global norm and, with `max_grad_norm`, clips like `optim::clip_grad_norm` on the whole model.
/// Returns the synchronised gradients of this rank's parameters.
pub fn sync_gradients(
    worker: &StageWorker,
    comm: &dyn Communicator,
    out: IterationOutput,
    max_grad_norm: Option<f64>,
) -> Result<(HashMap<String, Tensor>, SyncReport)> {
    let _span = debug_span!("grad_sync", rank = worker.rank).entered();
    if let Some(m) = max_grad_norm {
        if !(m.is_finite() && m > 0.0) {
            return Err(Error::Msg(format!(
                "max grad norm {m} must be finite and > 0"
            )));
        }
    }
    let t = worker.cfg.timeout;
    let layout = &worker.layout;
    let rank = worker.rank;
    let mut grads = out.grads;
    let range = worker.stage.range();
    let tied_names: BTreeSet<&str> = worker.tied.iter().map(|p| p.name.as_str()).collect();
    // Names whose square sum this rank contributes to the global norm.
    let mut owned: BTreeSet<String> = BTreeSet::new();

    for bucket in layout.buckets_of(rank) {
        let mut names = Vec::new();
        for layer in worker.stage.layers() {
            if !bucket.layers.contains(&layer.index()) {
                continue;
            }
            debug_assert!(range.contains(&layer.index()));
            for (name, _) in layer.params() {
                if !tied_names.contains(name.as_str()) {
                    names.push(name);
                }
            }
        }
        if bucket.holders[0] == rank {
            owned.extend(names.iter().cloned());
        }
        if bucket.holders.len() > 1 && !names.is_empty() {
            all_reduce_named(comm, &bucket.holders, &names, &mut grads, t)?;
        }
    }

    for tp in &worker.tied {
        if !tp.layers.iter().any(|l| range.contains(l)) {
            continue;
        }
        let (group, owner) = layout.tied_group(&tp.layers)?;
        if owner == rank {
            owned.insert(tp.name.clone());
        }
        if group.len() > 1 {
            all_reduce_named(comm, &group, std::slice::from_ref(&tp.name), &mut grads, t)?;
        }
    }

    // One slot of [sum_sq hi, lo, loss hi, lo] per rank: the all-reduce only adds zeros to
    // each value, so the f64 numbers survive the f32 data plane exactly (to ~48 bits), and
    // every rank then sums them in the same order.
    let mut sum_sq = 0.0f64;
    for name in &owned {
        let g = grads.get(name).ok_or_else(|| missing(name))?;
        sum_sq += g
            .to_dtype(candle_core::DType::F64)?
            .sqr()?
            .sum_all()?
            .to_scalar::<f64>()?;
    }
    let ranks = layout.ranks();
    let slot = ranks
        .iter()
        .position(|&r| r == rank)
        .expect("a worker's rank is in its layout (checked when it was built)");
    let mut slots = vec![0f32; 4 * ranks.len()];
    slots[4 * slot..4 * slot + 4].copy_from_slice(&[
        hi(sum_sq),
        lo(sum_sq),
        hi(out.loss),
        lo(out.loss),
    ]);
    let mut buf = TensorBuf::from_f32(vec![slots.len()], &slots)?;
    if ranks.len() > 1 {
        comm.all_reduce(&ranks, &mut buf, t)?;
    }
    let v = buf_f32(&buf)?;
    let (mut total_sq, mut loss) = (0.0f64, 0.0f64);
    for s in v.chunks_exact(4) {
        total_sq += f64::from(s[0]) + f64::from(s[1]);
        loss += f64::from(s[2]) + f64::from(s[3]);
    }
    let grad_norm = total_sq.sqrt();
    if let Some(max_norm) = max_grad_norm {
        // Exactly `optim::clip_grad_norm`'s rule, applied with the global norm.
        if grad_norm.is_finite() {
            let coef = max_norm / (grad_norm + 1e-6);
            if coef < 1.0 {
                for g in grads.values_mut() {
                    *g = g.affine(coef, 0.0)?;
                }
            }
        }
    }
    Ok((grads, SyncReport { loss, grad_norm }))
}

impl StageWorker {
    /// One full training step of this rank: the 1F1B iteration, gradient sync and clipping,
    /// then AdamW at learning rate `lr` on this rank's parameters. Every replica of a
    /// parameter receives the same summed gradient, so all replicas stay identical.
    pub fn train_step(
        &self,
        comm: &dyn Communicator,
        iteration: u64,
        data: &mut dyn FnMut(u64, u64) -> Result<(Tensor, Tensor)>,
        opt: &mut AdamW,
        lr: f64,
        max_grad_norm: Option<f64>,
    ) -> Result<SyncReport> {
        let out = self.run_iteration(comm, iteration, data)?;
        let (grads, report) = sync_gradients(self, comm, out, max_grad_norm)?;
        let params: Vec<(String, Var)> = self.stage.params();
        opt.step(&params, &grads, lr)?;
        Ok(report)
    }
}

fn hi(x: f64) -> f32 {
    x as f32
}

fn lo(x: f64) -> f32 {
    (x - f64::from(x as f32)) as f32
}

fn missing(name: &str) -> Error {
    Error::Msg(format!(
        "no gradient for parameter `{name}` after the iteration"
    ))
}

/// Sums the gradients `names` over `group` as one flat f32 buffer and writes them back.
fn all_reduce_named(
    comm: &dyn Communicator,
    group: &[oobleck_comm::Rank],
    names: &[String],
    grads: &mut HashMap<String, Tensor>,
    timeout: std::time::Duration,
) -> Result<()> {
    let mut flat: Vec<f32> = Vec::new();
    let mut shapes = Vec::with_capacity(names.len());
    for name in names {
        let g = grads.get(name).ok_or_else(|| missing(name))?;
        shapes.push((g.dims().to_vec(), g.elem_count(), g.device().clone()));
        flat.extend(
            g.to_dtype(candle_core::DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?,
        );
    }
    let mut buf = TensorBuf::from_f32(vec![flat.len()], &flat)?;
    comm.all_reduce(group, &mut buf, timeout)?;
    let summed = buf_f32(&buf)?;
    let mut off = 0;
    for (name, (dims, n, dev)) in names.iter().zip(shapes) {
        let t = Tensor::from_slice(&summed[off..off + n], dims, &dev)?;
        off += n;
        grads.insert(name.clone(), t);
    }
    Ok(())
}
