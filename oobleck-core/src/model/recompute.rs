//! Activation recomputation (`train --recompute`): a forward that keeps only each layer's input,
//! and a backward that reruns each layer with its graph just before back-propagating through it.
//!
//! ```text
//!  forward:   x ─► layer a ─► h_a ─► layer a+1 ─► ... ─► out        kept: x, h_a, ..., out
//!             (each layer's graph is dropped as soon as its output is detached)
//!  backward:  for layer b-1 down to a:  rerun layer i from its kept input (graph built),
//!             back-propagate g through it, report its gradients, drop its graph
//! ```
//!
//! A stage holding `k` microbatches in flight (1F1B) then keeps `k` sets of layer inputs
//! instead of `k` sets of every layer's internal activations (attention probabilities, the MLP's
//! 4x-wide hidden states, dropout masks), plus one layer's graph at a time; each layer runs
//! forward twice. The values are those of [`Stage::forward_layered`] and
//! [`Stage::backward_layers`]: the rerun sees the same input, parameters and [`ForwardCtx`]
//! (dropout is keyed by `(seed, iteration, microbatch, layer, site, row)`, not drawn from a
//! global RNG, so it draws the same masks), and it back-propagates through the same graph.

use std::collections::HashMap;

use candle_core::{DType, Tensor};

use super::{backward_cut, cut_layer, DropoutKey, ForwardCtx, RowSlice, Stage, StageForward};
use crate::{Error, Result};

/// What a [`Stage::forward_recompute`] pass keeps to rerun its layers: an owned copy of the
/// pass's [`ForwardCtx`] and each layer's input.
pub(super) struct Replay {
    /// The input of each layer of the stage, in order, detached from any graph (for the
    /// model's layer 0: the token ids).
    pub(super) inputs: Vec<Tensor>,
    /// `ForwardCtx::targets`, owned (the caller's tensor may be gone by the backward).
    targets: Option<Tensor>,
    loss_scale: f64,
    train: bool,
    dropout_key: DropoutKey,
    rows: Option<RowSlice>,
    dtype: DType,
}

impl Replay {
    /// Keeps `ctx`. The destructuring names every field on purpose: a field added to
    /// `ForwardCtx` must be carried here too, or the rerun would differ from the first pass.
    fn keep(ctx: &ForwardCtx, layers: usize) -> Self {
        let ForwardCtx {
            targets,
            loss_scale,
            train,
            dropout_key,
            rows,
            dtype,
        } = *ctx;
        Replay {
            inputs: Vec::with_capacity(layers),
            targets: targets.cloned(),
            loss_scale,
            train,
            dropout_key,
            rows,
            dtype,
        }
    }

    /// The context of the first pass again.
    pub(super) fn ctx(&self) -> ForwardCtx<'_> {
        ForwardCtx {
            targets: self.targets.as_ref(),
            loss_scale: self.loss_scale,
            train: self.train,
            dropout_key: self.dropout_key,
            rows: self.rows,
            dtype: self.dtype,
        }
    }
}

impl Stage {
    /// Forward through every layer with the same values as [`Stage::forward`], keeping only
    /// each layer's input (detached) and the output; no graph is kept. Its backward
    /// ([`Stage::backward_layers`] or [`Stage::backward`]) reruns each layer from its input.
    pub fn forward_recompute(&self, x: &Tensor, ctx: &ForwardCtx) -> Result<StageForward> {
        let mut replay = Replay::keep(ctx, self.layers.len());
        let mut h = x.detach();
        for l in &self.layers {
            // The output's graph (the layer's internal activations) is freed with the
            // undetached tensor at the end of this statement; `h` shares only its storage.
            let out = l.forward(&h, ctx)?.detach();
            replay.inputs.push(std::mem::replace(&mut h, out));
        }
        Ok(StageForward {
            input: None,
            output: h,
            cuts: Vec::new(),
            replay: Some(replay),
        })
    }

    /// The backward of a [`Stage::forward_recompute`] pass, last layer first: rerun the layer
    /// from its kept input with its graph cut there, back-propagate `g` through it, and hand
    /// its gradients to `on_layer` as [`Stage::backward_layers`] does.
    pub(super) fn backward_replay(
        &self,
        replay: Replay,
        upstream: Option<&Tensor>,
        on_layer: &mut dyn FnMut(usize, HashMap<String, Tensor>) -> Result<()>,
    ) -> Result<Option<Tensor>> {
        if replay.inputs.len() != self.layers.len() {
            return Err(Error::Schedule {
                layers: self.range(),
                reason: format!(
                    "a forward_recompute pass of {} layers given to a stage of {}",
                    replay.inputs.len(),
                    self.layers.len()
                ),
            });
        }
        let ctx = replay.ctx();
        let mut g: Option<Tensor> = upstream.cloned();
        for (layer, x) in self.layers.iter().zip(&replay.inputs).rev() {
            let cut = cut_layer(layer.as_ref(), x, &ctx)?;
            let (grads, gi) = backward_cut(layer.as_ref(), cut, g.as_ref())?;
            g = gi;
            on_layer(layer.index(), grads)?;
        }
        Ok(g)
    }
}

#[cfg(test)]
mod tests;
