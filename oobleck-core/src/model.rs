//! The model-facing contract: a model is an ordered list of layers.
//!
//! The engine never looks inside a layer. It asks a [`LayeredModel`] to build the layers
//! `[a, b)` of one stage on one device, runs them forward, and runs them backward from the
//! gradient that the next stage sends back. Parameters are named (for GPT/OPT: the names of the
//! Hugging Face reference layout), which is how gradients are grouped for synchronisation, how
//! optimizer state is keyed, and how layers are copied between replicas.
//!
//! ```text
//!  token ids [b, t] ──► layer 0 ──► hidden [b, t, d] ──► layer 1 ... ──► layer L-1 ──► loss []
//!                       (stage 0: layers [0, k))          (stage 1: layers [k, L))
//!  backward:  loss.backward()  ◄── grad of hidden [b, t, d] ◄── (sum(output · upstream)).backward()
//! ```
//!
//! [`Stage::forward_layered`] cuts the graph at every layer boundary (each layer's input is a
//! fresh `Var`), so [`Stage::backward_layers`] can back-propagate one layer at a time, last to
//! first, handing out each layer's parameter gradients as soon as they are final (the engine
//! overlaps the gradient all-reduce of the upper layers with the backward of the lower ones).
//! A tied `Var` used by two layers of one stage then gets one share from each layer; the
//! caller sums them by name, as autograd does in the one-call [`Stage::backward`].
//!
//! [`Stage::forward_recompute`] (activation recomputation, `train --recompute`) keeps only each
//! layer's input and reruns the layer with its graph during the backward, one layer at a time;
//! see [`recompute`](self::recompute) for what it keeps and why the values are the same.
//!
//! # Contract for implementors
//! - `build_layers(range, ..)` must give every parameter the same value whatever `range` is
//!   (initialise from `(seed, parameter name)`, see [`seeded_normal`]), so a replica built from
//!   scratch on another process equals the one it replaces.
//! - A parameter used by several layers (a tied embedding) has one name. When both layers are
//!   built in one call they must share one `Var`, so its gradient is summed by autograd. When
//!   they live in different stages each stage holds its own copy under the same name, and the
//!   engine sums the two gradients (see [`LayeredModel::tied_params`]) before the optimizer
//!   step, which keeps the copies identical.
//! - The last layer returns the loss (a scalar, already multiplied by `ctx.loss_scale`) when
//!   `ctx.targets` is set, and the logits otherwise.
//! - Randomness inside a layer (dropout) is keyed by [`ForwardCtx::dropout_key`] and the layer
//!   index, never by the device or process that runs it. Row `i` (dim 0) of a mask is keyed by
//!   its row of the whole microbatch ([`ForwardCtx::rows`]), so a device holding rows
//!   `[o, o + n)` of a multi-device stage draws exactly those rows of the whole mask.
//!
//! # Thread safety
//! Layers are `Send` (a stage may be moved to its worker thread) but not `Sync`: one stage is
//! driven by one thread. `LayeredModel` is `Send + Sync`: it only describes the model.

use std::collections::HashMap;
use std::ops::Range;

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::{Error, Result};

mod recompute;
pub mod weight_grads;
use self::recompute::Replay;

/// Where parameter values come from when layers are built.
#[derive(Clone, Copy)]
pub enum ParamSource<'a> {
    /// Fresh initialisation, deterministic in `(seed, parameter name)`.
    Init { seed: u64 },
    /// Existing tensors by parameter name (a checkpoint, or HF weights).
    Tensors(&'a HashMap<String, Tensor>),
}

/// Keys all randomness of one forward pass: `(seed, iteration, microbatch)`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DropoutKey {
    pub seed: u64,
    pub iteration: u64,
    pub microbatch: u64,
}

/// What a layer needs to know about the pass it is part of.
#[derive(Clone, Copy, Debug)]
pub struct ForwardCtx<'a> {
    /// Next-token targets `[b, t]` (u32). The last layer returns the loss when set.
    pub targets: Option<&'a Tensor>,
    /// Factor applied to the loss: `microbatch samples / global batch samples`, so summed
    /// gradients are those of the mean loss over the global batch.
    pub loss_scale: f64,
    /// Training mode (dropout active) or evaluation.
    pub train: bool,
    pub dropout_key: DropoutKey,
    /// The rows (dim 0) of the microbatch that this pass carries, when a multi-device stage
    /// gave this device only its slice; `None`: the whole microbatch.
    pub rows: Option<RowSlice>,
    /// Compute dtype: `F32`, or `BF16` for mixed precision. Parameters stay f32 `Var`s (the
    /// master weights); with `BF16` a layer casts them at use (autograd carries the gradient
    /// back to the f32 `Var`) and keeps its activations in bf16, except the numerically
    /// sensitive parts (LayerNorm statistics, softmax, the loss), which run in f32. The loss
    /// is f32 either way; a stage input may arrive in f32 and is cast by the layer.
    pub dtype: DType,
}

/// Rows `[offset, offset + n)` of a microbatch of `total` rows, `n` being dim 0 of the tensor
/// a pass carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowSlice {
    pub offset: usize,
    pub total: usize,
}

impl ForwardCtx<'_> {
    /// Evaluation pass without targets: the last layer returns logits.
    pub fn inference() -> ForwardCtx<'static> {
        ForwardCtx {
            targets: None,
            loss_scale: 1.0,
            train: false,
            dropout_key: DropoutKey::default(),
            rows: None,
            dtype: DType::F32,
        }
    }
}

/// One layer of a model: a piece that is never split across stages.
pub trait Layer: Send {
    /// Position of this layer in the model, `0..num_layers`.
    fn index(&self) -> usize;
    /// The trainable parameters, sorted by name.
    fn params(&self) -> Vec<(String, Var)>;
    /// Runs the layer. Layer 0 takes token ids `[b, t]` (u32); the others take hidden states.
    fn forward(&self, x: &Tensor, ctx: &ForwardCtx) -> Result<Tensor>;
}

/// A parameter that more than one layer uses under the same name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TiedParam {
    pub name: String,
    pub layers: Vec<usize>,
}

/// A model the engine can train: an ordered list of `num_layers()` layers.
pub trait LayeredModel: Send + Sync {
    /// `L`: for GPT, blocks + 2 (embedding, each block, final norm + head + loss).
    fn num_layers(&self) -> usize;
    /// A short human-readable name of layer `i` (`"embedding"`, `"block 3"`, `"head"`).
    fn layer_name(&self, i: usize) -> String;
    /// Builds layers `range` on `device`. See the module docs for the contract.
    fn build_layers(
        &self,
        range: Range<usize>,
        device: &Device,
        source: ParamSource<'_>,
    ) -> Result<Vec<Box<dyn Layer>>>;
    /// Parameters shared by several layers; empty if none.
    fn tied_params(&self) -> Vec<TiedParam> {
        Vec::new()
    }
}

/// Name of layer `i` of a transformer laid out as embedding, `n_blocks` blocks, head.
pub fn transformer_layer_name(i: usize, n_blocks: usize) -> String {
    match i {
        0 => "embedding".into(),
        i if i == n_blocks + 1 => "head".into(),
        i => format!("block {}", i - 1),
    }
}

/// Checks that `range` is a non-empty range of layers of a model with `num_layers` layers.
pub fn check_layer_range(range: &Range<usize>, num_layers: usize) -> Result<()> {
    if range.is_empty() || range.end > num_layers {
        return Err(Error::LayerRange {
            start: range.start,
            end: range.end,
            layers: num_layers,
        });
    }
    Ok(())
}

/// Normal(0, std) values for parameter `name`, identical on every process for the same seed.
pub fn seeded_normal(
    seed: u64,
    name: &str,
    shape: &[usize],
    std: f64,
    device: &Device,
) -> Result<Tensor> {
    let mut rng = ChaCha8Rng::seed_from_u64(mix(seed, name));
    let n: usize = shape.iter().product();
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        // Box-Muller: two normals per pair of uniforms in (0, 1].
        let u1: f64 = 1.0 - rng.random::<f64>();
        let u2: f64 = rng.random::<f64>();
        let r = (-2.0 * u1.ln()).sqrt() * std;
        let th = std::f64::consts::TAU * u2;
        v.push((r * th.cos()) as f32);
        if v.len() < n {
            v.push((r * th.sin()) as f32);
        }
    }
    Ok(Tensor::from_vec(v, shape, device)?)
}

/// Whether [`dropout`] with probability `p` changes anything in this pass (a training pass
/// with `p > 0`); otherwise it is the identity, which fused kernels may rely on.
pub fn drops(p: f64, ctx: &ForwardCtx) -> bool {
    ctx.train && p > 0.0
}

/// A dropout mask keyed by `(key, layer, site, row)`: which elements survive, scaled by
/// `1/(1-p)`. Dim 0 of `x` is the batch; row `i` of `x` is row `ctx.rows.offset + i` of the
/// microbatch and draws from its own ChaCha stream, so the mask of a slice of rows equals those
/// rows of the whole microbatch's mask however a multi-device stage cuts it.
pub fn dropout(x: &Tensor, p: f64, ctx: &ForwardCtx, layer: usize, site: u64) -> Result<Tensor> {
    if !drops(p, ctx) {
        return Ok(x.clone());
    }
    if p >= 1.0 {
        return Err(Error::InvalidArgument {
            op: "dropout",
            name: "probability",
            value: p,
            want: "below 1",
        });
    }
    let n = x.dims().first().copied().unwrap_or(1);
    let offset = match ctx.rows {
        None => 0,
        Some(r) if r.offset + n <= r.total => r.offset,
        Some(r) => {
            return Err(Error::Shape {
                what: format!(
                    "dropout input at row offset {} of a {}-row microbatch",
                    r.offset, r.total
                ),
                found: x.dims().to_vec(),
                expected: format!("at most {} rows", r.total.saturating_sub(r.offset)),
            })
        }
    };
    let per_row = x.elem_count().checked_div(n).unwrap_or(0);
    let k = ctx.dropout_key;
    let label = format!("dropout/{}/{}/{layer}/{site}", k.iteration, k.microbatch);
    let mut rng = ChaCha8Rng::seed_from_u64(mix(k.seed, &label));
    let scale = (1.0 / (1.0 - p)) as f32;
    let mut mask = Vec::with_capacity(x.elem_count());
    for row in offset..offset + n {
        rng.set_stream(row as u64);
        rng.set_word_pos(0);
        mask.extend((0..per_row).map(|_| if rng.random::<f64>() < p { 0.0 } else { scale }));
    }
    let mask = Tensor::from_vec(mask, x.shape(), x.device())?.to_dtype(x.dtype())?;
    Ok(x.mul(&mask)?)
}

/// FNV-1a of the name folded into the seed: a stable, platform-independent key.
fn mix(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The layers of one stage, run forward and backward as a unit.
pub struct Stage {
    layers: Vec<Box<dyn Layer>>,
}

/// What a forward pass keeps for its backward pass.
pub struct StageForward {
    /// The stage input as a `Var` (None for the first stage, whose input is token ids).
    input: Option<Var>,
    /// The stage output: hidden states, or the (scaled) loss for the last stage.
    pub output: Tensor,
    /// Per layer (a [`Stage::forward_layered`] pass only; empty otherwise): its input cut
    /// from the graph as a `Var` (None for layer 0) and its output.
    cuts: Vec<LayerCut>,
    /// A [`Stage::forward_recompute`] pass only: each layer's input, to rerun it in backward.
    replay: Option<Replay>,
}

/// One layer of a graph cut at every layer boundary.
struct LayerCut {
    input: Option<Var>,
    output: Tensor,
}

/// Gradients produced by one backward pass of a stage.
pub struct StageGrads {
    /// Gradient of each parameter by name (a tied parameter held twice here appears once).
    pub params: HashMap<String, Tensor>,
    /// Gradient of the stage input, to send to the previous stage (None for the first stage).
    pub input: Option<Tensor>,
}

impl Stage {
    pub fn new(layers: Vec<Box<dyn Layer>>) -> Result<Self> {
        if layers.is_empty() || layers.windows(2).any(|w| w[1].index() != w[0].index() + 1) {
            return Err(Error::StageLayers {
                indices: layers.iter().map(|l| l.index()).collect(),
            });
        }
        Ok(Self { layers })
    }

    /// Layer indices held by this stage.
    pub fn range(&self) -> Range<usize> {
        self.layers[0].index()..self.layers[self.layers.len() - 1].index() + 1
    }

    pub fn layers(&self) -> &[Box<dyn Layer>] {
        &self.layers
    }

    /// All parameters of the stage, deduplicated by name (a tied `Var` is listed once), sorted.
    pub fn params(&self) -> Vec<(String, Var)> {
        let mut seen = std::collections::BTreeMap::new();
        for l in &self.layers {
            for (name, var) in l.params() {
                seen.entry(name).or_insert(var);
            }
        }
        seen.into_iter().collect()
    }

    /// Forward through every layer. Keeps the graph for [`Stage::backward`].
    pub fn forward(&self, x: &Tensor, ctx: &ForwardCtx) -> Result<StageForward> {
        // A plain tensor as the stage input gives a wrong input gradient in Candle: use a Var.
        let (input, mut h) = if self.layers[0].index() == 0 {
            (None, x.clone())
        } else {
            let v = Var::from_tensor(&x.detach())?;
            let t = v.as_tensor().clone();
            (Some(v), t)
        };
        for l in &self.layers {
            h = l.forward(&h, ctx)?;
        }
        Ok(StageForward {
            input,
            output: h,
            cuts: Vec::new(),
            replay: None,
        })
    }

    /// Forward through every layer like [`Stage::forward`] (same values), but with the graph
    /// cut at every layer boundary: each layer's input is a fresh `Var` holding the previous
    /// layer's output, so [`Stage::backward_layers`] can back-propagate one layer at a time.
    /// [`Stage::backward`] accepts this pass too.
    pub fn forward_layered(&self, x: &Tensor, ctx: &ForwardCtx) -> Result<StageForward> {
        let mut cuts: Vec<LayerCut> = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let prev = cuts.last().map(|c| &c.output).unwrap_or(x);
            cuts.push(cut_layer(l.as_ref(), prev, ctx)?);
        }
        let last = cuts.last().expect("a stage has at least one layer");
        Ok(StageForward {
            input: cuts[0].input.clone(),
            output: last.output.clone(),
            cuts,
            replay: None,
        })
    }

    /// Backward of a [`Stage::forward_layered`] pass one layer at a time, from the last layer
    /// to the first: for each layer, d/dθ sum(out ⊙ g) with `g` the gradient flowing down
    /// (`upstream` for the last layer; None when the stage outputs the scalar loss). As soon
    /// as layer `i` is done, `on_layer(i, grads)` gets the gradients of the parameters that
    /// layer lists (`Layer::params`), final for this microbatch. A parameter used by several
    /// layers of the stage (a tied `Var`) is reported by each of them with that layer's
    /// share only: the caller sums them by name. Returns the gradient of the stage input
    /// (None for the first stage). A [`Stage::forward_recompute`] pass is accepted too: each
    /// layer is rerun from its kept input first, and reported the same way.
    pub fn backward_layers(
        &self,
        fwd: StageForward,
        upstream: Option<&Tensor>,
        on_layer: &mut dyn FnMut(usize, HashMap<String, Tensor>) -> Result<()>,
    ) -> Result<Option<Tensor>> {
        if let Some(replay) = fwd.replay {
            return self.backward_replay(replay, upstream, on_layer);
        }
        if fwd.cuts.len() != self.layers.len() {
            return Err(Error::Schedule {
                layers: self.range(),
                reason: format!(
                    "backward_layers needs a forward_layered pass of this stage's {} layers, got {} cuts",
                    self.layers.len(),
                    fwd.cuts.len()
                ),
            });
        }
        let mut g: Option<Tensor> = upstream.cloned();
        for (layer, cut) in self.layers.iter().zip(fwd.cuts).rev() {
            let (grads, gi) = backward_cut(layer.as_ref(), cut, g.as_ref())?;
            g = gi;
            on_layer(layer.index(), grads)?;
        }
        Ok(g)
    }

    /// Backward from `upstream` (the gradient of this stage's output; None for the last stage,
    /// whose output is the loss).
    pub fn backward(&self, fwd: StageForward, upstream: Option<&Tensor>) -> Result<StageGrads> {
        if !fwd.cuts.is_empty() || fwd.replay.is_some() {
            // A graph cut per layer (or rebuilt per layer): sum the layers' shares by name.
            let mut params = HashMap::new();
            let input =
                self.backward_layers(fwd, upstream, &mut |_, g| accumulate(&mut params, g))?;
            return Ok(StageGrads { params, input });
        }
        let root = chain_root(&fwd.output, upstream)?;
        let store = root.backward()?;
        let mut params = HashMap::new();
        for (name, var) in self.params() {
            params.insert(name, grad_or_zeros(&store, &var)?);
        }
        let input = fwd
            .input
            .as_ref()
            .map(|v| grad_or_zeros(&store, v))
            .transpose()?;
        Ok(StageGrads { params, input })
    }
}

/// Runs layer `l` on `prev` with the graph cut at its input: a fresh `Var` holding `prev`
/// (token ids stay a plain tensor for layer 0).
fn cut_layer(l: &dyn Layer, prev: &Tensor, ctx: &ForwardCtx) -> Result<LayerCut> {
    let (input, h) = if l.index() == 0 {
        (None, prev.clone())
    } else {
        // As for the stage input: a Var, or Candle gives a wrong input gradient.
        let v = Var::from_tensor(&prev.detach())?;
        let t = v.as_tensor().clone();
        (Some(v), t)
    };
    let output = l.forward(&h, ctx)?;
    Ok(LayerCut { input, output })
}

/// Back-propagates `g` (None: the output is the loss) through one layer's graph: the gradients
/// of the parameters the layer lists, and that of its input (None for layer 0). The layer's
/// graph is freed on return.
fn backward_cut(
    layer: &dyn Layer,
    cut: LayerCut,
    g: Option<&Tensor>,
) -> Result<(HashMap<String, Tensor>, Option<Tensor>)> {
    let store = chain_root(&cut.output, g)?.backward()?;
    let mut grads = HashMap::new();
    for (name, var) in layer.params() {
        grads.insert(name, grad_or_zeros(&store, &var)?);
    }
    let input = cut
        .input
        .as_ref()
        .map(|v| grad_or_zeros(&store, v))
        .transpose()?;
    Ok((grads, input))
}

/// The gradient `store` holds for `var`, or zeros where the loss does not reach it (a
/// parameter of unused positions, say).
fn grad_or_zeros(store: &candle_core::backprop::GradStore, var: &Var) -> Result<Tensor> {
    Ok(match store.get(var.as_tensor()) {
        Some(g) => g.clone(),
        None => var.as_tensor().zeros_like()?,
    })
}

/// The scalar whose backward gives the gradients of a (stage or layer) output `out`: `out`
/// itself when it is the scalar loss (`upstream` None), else sum(out ⊙ g), since
/// d/dθ sum(out ⊙ g) = (∂out/∂θ)ᵀ g is the chain rule with the received gradient `g`.
fn chain_root(out: &Tensor, upstream: Option<&Tensor>) -> Result<Tensor> {
    match upstream {
        None => {
            if out.rank() != 0 {
                return Err(Error::Shape {
                    what: "the last stage's output".into(),
                    found: out.dims().to_vec(),
                    expected: "a scalar loss".into(),
                });
            }
            Ok(out.clone())
        }
        Some(g) => {
            if g.dims() != out.dims() {
                return Err(Error::Shape {
                    what: "the upstream gradient".into(),
                    found: g.dims().to_vec(),
                    expected: format!("the stage output's shape {:?}", out.dims()),
                });
            }
            // The gradient arrives in f32 over the wire; a bf16 stage's output is bf16.
            Ok(out.mul(&g.detach().to_dtype(out.dtype())?)?.sum_all()?)
        }
    }
}

/// Adds `src` into `acc` by name (gradient accumulation over microbatches).
pub fn accumulate(acc: &mut HashMap<String, Tensor>, src: HashMap<String, Tensor>) -> Result<()> {
    for (name, g) in src {
        match acc.get_mut(&name) {
            Some(a) => *a = a.add(&g)?,
            None => {
                acc.insert(name, g);
            }
        }
    }
    Ok(())
}

/// Checks that a tensor given for parameter `name` has the expected shape, and casts it.
pub fn checked_param(
    tensors: &HashMap<String, Tensor>,
    name: &str,
    shape: &[usize],
    device: &Device,
) -> Result<Tensor> {
    let t = tensors.get(name).ok_or_else(|| Error::MissingParameter {
        name: name.to_string(),
        shape: shape.to_vec(),
    })?;
    if t.dims() != shape {
        return Err(Error::ParameterShape {
            name: name.to_string(),
            expected: shape.to_vec(),
            found: t.dims().to_vec(),
        });
    }
    Ok(t.to_dtype(DType::F32)?.to_device(device)?)
}

#[cfg(test)]
mod tests;
