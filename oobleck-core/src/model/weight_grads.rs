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
//! [`Stage::backward_inputs`] is B for a whole stage: one backward of a one-graph
//! [`Stage::forward`] pass, or layer by layer after a [`Stage::forward_layered`] or
//! [`Stage::forward_recompute`] one (where layer 0, which takes token ids and has no input
//! gradient, runs its whole backward in W). [`Stage::backward_weights`] is its W, reporting each
//! layer's gradients like [`Stage::backward_layers`] does, so a bucket's all-reduce can start
//! once its layers' W are done.

use std::cell::RefCell;
use std::collections::HashMap;

use candle_core::{Tensor, TensorId};

use super::{
    backward_cut, chain_root, cut_layer, grad_or_zeros, Layer, LayerCut, Stage, StageForward,
};
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
    // Puts the outer list back when done, also if `f` panics, so a caught panic leaves no
    // deferral on.
    struct Restore(Option<Vec<Deferred>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let outer = self.0.take();
            COLLECTING.with(|c| *c.borrow_mut() = outer);
        }
    }
    let _restore = Restore(COLLECTING.with(|c| c.borrow_mut().replace(Vec::new())));
    let out = f();
    let mine = COLLECTING
        .with(|c| c.borrow_mut().take())
        .unwrap_or_default();
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

/// What W of one microbatch on one stage still has to do.
pub struct PendingWeights {
    work: Pending,
}

enum Pending {
    /// From a layered or recomputed pass: per layer, last layer first.
    Layers(Vec<(usize, LayerWeights)>),
    /// From a one-graph pass: the stage's gradients B computed, by name, and the work left.
    Stage {
        done: HashMap<String, Tensor>,
        deferred: Vec<Deferred>,
    },
}

impl PendingWeights {
    /// How many closures the ops left (0 when no op could split: everything ran in B).
    pub fn deferred(&self) -> usize {
        match &self.work {
            Pending::Layers(layers) => layers
                .iter()
                .map(|(_, l)| match l {
                    LayerWeights::Split { deferred, .. } => deferred.len(),
                    LayerWeights::Whole { .. } => 1,
                })
                .sum(),
            Pending::Stage { deferred, .. } => deferred.len(),
        }
    }
}

/// Runs `deferred` and sums its gradients by parameter.
fn run_deferred(deferred: Vec<Deferred>) -> Result<HashMap<TensorId, Tensor>> {
    let mut by_id: HashMap<TensorId, Tensor> = HashMap::new();
    for work in deferred {
        for (param, g) in work()? {
            let g = match by_id.remove(&param.id()) {
                Some(acc) => acc.add(&g)?,
                None => g,
            };
            by_id.insert(param.id(), g);
        }
    }
    Ok(by_id)
}

/// The gradient of parameter `name` (`var`): what B computed plus what W did, or zeros where
/// the loss reaches it neither way.
fn gradient_of(
    name: &str,
    var: &candle_core::Var,
    done: &mut HashMap<String, Tensor>,
    by_id: &mut HashMap<TensorId, Tensor>,
) -> Result<Tensor> {
    Ok(
        match (done.remove(name), by_id.remove(&var.as_tensor().id())) {
            (Some(a), Some(b)) => a.add(&b)?,
            (Some(g), None) | (None, Some(g)) => g,
            (None, None) => var.as_tensor().zeros_like()?,
        },
    )
}

impl Stage {
    /// B: back-propagates `upstream` (None: the stage outputs the loss) to the stage input,
    /// last layer first, leaving the weight gradients to [`Stage::backward_weights`]. Returns
    /// the stage input's gradient (None for the first stage) and what W has to do. `fwd` is a
    /// pass of any of the three forwards.
    pub fn backward_inputs(
        &self,
        fwd: StageForward,
        upstream: Option<&Tensor>,
    ) -> Result<(Option<Tensor>, PendingWeights)> {
        let n = self.layers.len();
        if fwd.cuts.is_empty() && fwd.replay.is_none() {
            return self.split_stage(fwd, upstream);
        }
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
        let work = Pending::Layers(layers);
        Ok((g, PendingWeights { work }))
    }

    /// B of a one-graph pass: one backward of the whole stage, the ops' weight work left.
    fn split_stage(
        &self,
        fwd: StageForward,
        upstream: Option<&Tensor>,
    ) -> Result<(Option<Tensor>, PendingWeights)> {
        let root = chain_root(&fwd.output, upstream)?;
        let (store, deferred) = collecting(|| root.backward());
        let store = store?;
        let input = fwd
            .input
            .as_ref()
            .map(|v| grad_or_zeros(&store, v))
            .transpose()?;
        let mut done = HashMap::new();
        for (name, var) in self.params() {
            if let Some(g) = store.get(var.as_tensor()) {
                done.insert(name, g.clone());
            }
        }
        let work = Pending::Stage { done, deferred };
        Ok((input, PendingWeights { work }))
    }

    /// W: the weight gradients `pending` left, layer by layer from the last one, each handed
    /// to `on_layer(layer, grads)` as [`Stage::backward_layers`] does (a parameter the layer
    /// lists gets zeros where the loss does not reach it; a tied one, that layer's share).
    pub fn backward_weights(
        &self,
        pending: PendingWeights,
        on_layer: &mut dyn FnMut(usize, HashMap<String, Tensor>) -> Result<()>,
    ) -> Result<()> {
        let layers = match pending.work {
            Pending::Layers(layers) => layers,
            Pending::Stage { done, deferred } => {
                return self.stage_weights(done, deferred, on_layer)
            }
        };
        for (index, work) in layers {
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
                    let mut by_id = run_deferred(deferred)?;
                    let mut grads = HashMap::new();
                    for (name, var) in layer.params() {
                        let g = gradient_of(&name, &var, &mut done, &mut by_id)?;
                        grads.insert(name, g);
                    }
                    grads
                }
            };
            on_layer(index, grads)?;
        }
        Ok(())
    }

    /// W of a one-graph pass, reported layer by layer from the last: a parameter listed by
    /// several layers of the stage (a tied one) goes whole with the lowest of them, where the
    /// layer-by-layer backward would have finished it.
    fn stage_weights(
        &self,
        mut done: HashMap<String, Tensor>,
        deferred: Vec<Deferred>,
        on_layer: &mut dyn FnMut(usize, HashMap<String, Tensor>) -> Result<()>,
    ) -> Result<()> {
        let mut by_id = run_deferred(deferred)?;
        for (k, layer) in self.layers.iter().enumerate().rev() {
            let lower: std::collections::HashSet<String> = self.layers[..k]
                .iter()
                .flat_map(|l| l.params().into_iter().map(|(n, _)| n))
                .collect();
            let mut grads = HashMap::new();
            for (name, var) in layer.params() {
                if !lower.contains(&name) {
                    let g = gradient_of(&name, &var, &mut done, &mut by_id)?;
                    grads.insert(name, g);
                }
            }
            on_layer(layer.index(), grads)?;
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
    *g = Some(grad_or_zeros(&store, &input)?);
    // Whatever the graph's ops computed for a parameter: its gradient, or B's part of it.
    let mut done = HashMap::new();
    for (name, var) in layer.params() {
        if let Some(gp) = store.get(var.as_tensor()) {
            done.insert(name, gp.clone());
        }
    }
    Ok((layer.index(), LayerWeights::Split { done, deferred }))
}
