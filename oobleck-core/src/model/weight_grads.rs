//! The backward split in two for zero-bubble schedules: B, the gradient of a stage's input
//! (what the previous stage waits for), and W, the gradients of its weights (what nothing
//! waits for until the optimizer step).
//!
//! Candle's `backward()` computes every gradient of a graph at once, so the split lives in the
//! ops that own weights. While [`collecting`] runs a backward, an op that can split (a fused
//! linear layer, the LM head with its loss) computes only its input gradient, and hands
//! [`defer`] a [`Deferred`] closure that computes its weight gradients later from what it
//! captured (the op's input and output gradient: tensors the graph kept anyway, or `dy`).
//! An op that cannot split computes everything in B, as always: its weight gradients wait in
//! the [`PendingWeights`] until W. So B + W give the same gradients with any op, bit for bit
//! where the deferred closure runs the same arithmetic as the fused backward (it does for
//! every op here); only where the work happens differs.
//!
//! [`Stage::backward_inputs`] is B for a whole stage, layer by layer (it needs a
//! [`Stage::forward_layered`] or [`Stage::forward_recompute`] pass); [`Stage::backward_weights`]
//! is its W, reporting each layer's gradients like [`Stage::backward_layers`] does, so a
//! bucket's all-reduce can start once its layers' W are done. Layer 0 takes token ids, has no
//! input gradient, and so runs its whole backward in W.

use std::cell::RefCell;
use std::collections::HashMap;

use candle_core::Tensor;

use super::{backward_cut, chain_root, cut_layer, Layer, LayerCut, Stage, StageForward};
use crate::{Error, Result};

/// Weight gradients an op left for W: `(the parameter tensor the op was given, its gradient)`.
pub type Deferred = Box<dyn FnOnce() -> candle_core::Result<Vec<(Tensor, Tensor)>> + Send>;

thread_local! {
    /// The deferred work of the backward [`collecting`] runs on this thread, if one does.
    static COLLECTING: RefCell<Option<Vec<Deferred>>> = const { RefCell::new(None) };
}

/// Leaves `work`, the gradients of `params`, for W. Returns it back when no backward on this
/// thread collects, or when a parameter is no `Var` itself (a bf16 copy of one, say: its
/// gradient must flow on through the graph, in B), and the op then computes it at once.
pub fn defer(params: &[&Tensor], work: Deferred) -> Option<Deferred> {
    if !params.iter().all(|p| p.is_variable()) {
        return Some(work);
    }
    COLLECTING.with(|c| match c.borrow_mut().as_mut() {
        Some(list) => {
            list.push(work);
            None
        }
        None => Some(work),
    })
}

/// Runs `f` (a backward) with deferral on, and returns its result and the work the ops left.
pub fn collecting<T>(f: impl FnOnce() -> T) -> (T, Vec<Deferred>) {
    let outer = COLLECTING.with(|c| c.borrow_mut().replace(Vec::new()));
    // Put the outer list back even if `f` panics, so a caught panic leaves no deferral on.
    struct Restore(Option<Option<Vec<Deferred>>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(outer) = self.0.take() {
                COLLECTING.with(|c| *c.borrow_mut() = outer);
            }
        }
    }
    let mut restore = Restore(Some(outer));
    let out = f();
    let mine = COLLECTING
        .with(|c| c.borrow_mut().take())
        .unwrap_or_default();
    if let Some(outer) = restore.0.take() {
        COLLECTING.with(|c| *c.borrow_mut() = outer);
    }
    (out, mine)
}

/// One layer's weight gradients between its B and its W.
enum LayerWeights {
    /// B ran: the gradients B computed (ops that cannot split) and the work it left.
    Split {
        done: HashMap<String, Tensor>,
        deferred: Vec<Deferred>,
    },
    /// Layer 0: no input gradient, so all of its backward waits for W.
    Whole {
        cut: LayerCut,
        upstream: Option<Tensor>,
    },
}

/// What W of one microbatch on one stage still has to do, per layer, last layer first.
pub struct PendingWeights {
    layers: Vec<(usize, LayerWeights)>,
}

impl PendingWeights {
    /// How many closures the ops left (0 when no op could split: everything ran in B).
    pub fn deferred(&self) -> usize {
        self.layers
            .iter()
            .map(|(_, l)| match l {
                LayerWeights::Split { deferred, .. } => deferred.len(),
                LayerWeights::Whole { .. } => 1,
            })
            .sum()
    }
}

impl Stage {
    /// B: back-propagates `upstream` (None: the stage outputs the loss) to the stage input,
    /// last layer first, leaving the weight gradients to [`Stage::backward_weights`]. Returns
    /// the stage input's gradient (None for the first stage) and what W has to do. `fwd` must
    /// be a [`Stage::forward_layered`] or [`Stage::forward_recompute`] pass.
    pub fn backward_inputs(
        &self,
        fwd: StageForward,
        upstream: Option<&Tensor>,
    ) -> Result<(Option<Tensor>, PendingWeights)> {
        let n = self.layers.len();
        let mut g: Option<Tensor> = upstream.cloned();
        let mut layers = Vec::with_capacity(n);
        if let Some(replay) = fwd.replay {
            if replay.inputs.len() != n {
                return Err(self.not_layered(replay.inputs.len()));
            }
            // Each layer reruns from its kept input just before its B, as in the fused
            // backward; W reuses what that B kept.
            let ctx = replay.ctx();
            for (layer, x) in self.layers.iter().zip(&replay.inputs).rev() {
                let cut = cut_layer(layer.as_ref(), x, &ctx)?;
                layers.push(split_layer(layer.as_ref(), cut, &mut g)?);
            }
        } else {
            if fwd.cuts.len() != n {
                return Err(self.not_layered(fwd.cuts.len()));
            }
            for (layer, cut) in self.layers.iter().zip(fwd.cuts).rev() {
                layers.push(split_layer(layer.as_ref(), cut, &mut g)?);
            }
        }
        Ok((g, PendingWeights { layers }))
    }

    /// W: the weight gradients `pending` left, layer by layer from the last one, each handed
    /// to `on_layer(layer, grads)` as [`Stage::backward_layers`] does (a parameter the layer
    /// lists gets zeros where the loss does not reach it; a tied one, that layer's share).
    pub fn backward_weights(
        &self,
        pending: PendingWeights,
        on_layer: &mut dyn FnMut(usize, HashMap<String, Tensor>) -> Result<()>,
    ) -> Result<()> {
        for (index, work) in pending.layers {
            let layer = self
                .layers
                .iter()
                .find(|l| l.index() == index)
                .ok_or_else(|| Error::Schedule {
                    layers: self.range(),
                    reason: format!("weight gradients of layer {index}, not of this stage"),
                })?;
            let grads = match work {
                LayerWeights::Whole { cut, upstream } => {
                    backward_cut(layer.as_ref(), cut, upstream.as_ref())?.0
                }
                LayerWeights::Split { mut done, deferred } => {
                    let mut by_id: HashMap<_, Tensor> = HashMap::new();
                    for work in deferred {
                        for (param, g) in work()? {
                            match by_id.remove(&param.id()) {
                                Some(acc) => by_id.insert(param.id(), acc.add(&g)?),
                                None => by_id.insert(param.id(), g),
                            };
                        }
                    }
                    let mut grads = HashMap::new();
                    for (name, var) in layer.params() {
                        let g = match (done.remove(&name), by_id.remove(&var.as_tensor().id())) {
                            (Some(a), Some(b)) => a.add(&b)?,
                            (Some(g), None) | (None, Some(g)) => g,
                            (None, None) => var.as_tensor().zeros_like()?,
                        };
                        grads.insert(name, g);
                    }
                    grads
                }
            };
            on_layer(index, grads)?;
        }
        Ok(())
    }

    fn not_layered(&self, found: usize) -> Error {
        Error::Schedule {
            layers: self.range(),
            reason: format!(
                "a split backward needs a forward_layered or forward_recompute pass of this \
                 stage's {} layers, got {found}",
                self.layers.len()
            ),
        }
    }
}

/// B of one layer from the gradient `g` of its output, which becomes that of its input:
/// the layer's index and its weight gradients, done or deferred.
fn split_layer(
    layer: &dyn Layer,
    cut: LayerCut,
    g: &mut Option<Tensor>,
) -> Result<(usize, LayerWeights)> {
    let Some(input) = cut.input.clone() else {
        let upstream = g.take();
        return Ok((layer.index(), LayerWeights::Whole { cut, upstream }));
    };
    let root = chain_root(&cut.output, g.as_ref())?;
    let (store, deferred) = collecting(|| root.backward());
    let store = store?;
    *g = Some(match store.get(input.as_tensor()) {
        Some(gi) => gi.clone(),
        None => input.as_tensor().zeros_like()?,
    });
    // Whatever the graph's ops computed for a parameter: its gradient, or B's part of it.
    let mut done = HashMap::new();
    for (name, var) in layer.params() {
        if let Some(gp) = store.get(var.as_tensor()) {
            done.insert(name, gp.clone());
        }
    }
    Ok((layer.index(), LayerWeights::Split { done, deferred }))
}
