//! Differentiable building blocks shared by the model families.
//!
//! Candle 0.11's fused LayerNorm, softmax and sdpa kernels have no backward pass (gradients are
//! silently missing). On the CPU with f32 the hot ones (LayerNorm, causal softmax, GELU, and the
//! LM head with its cross-entropy) are our own fused kernels with hand-written backward passes
//! (`fused.rs`); elsewhere they are written with primitive ops that autograd covers.
//!
//! Mixed precision (`ForwardCtx::dtype` BF16) follows the activations: every op computes in
//! the dtype of its input `x` and casts the f32 parameter `Var`s to it at use (the cast is in
//! the graph, so the gradient reaches the f32 master weight in f32). The numerically sensitive
//! parts run in f32 whatever `x` is, as PyTorch's autocast does: LayerNorm (statistics and
//! affine, with the f32 weights), the attention softmax, and the LM head's log-softmax and
//! cross-entropy, whose loss is f32. On the CPU those f32 parts take the fused kernels.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var, D};
use oobleck_core::model::{checked_param, seeded_normal, ParamSource};

use crate::Result;
use crate::{fused, fused_attention, fused_bmm, fused_linear};

/// Whether the fused CPU kernels apply to `x`.
fn fusable(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32
}

/// How a fresh parameter is initialised.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Init {
    Normal(f64),
    Zeros,
    Ones,
}

/// Creates the `Var`s of one `build_layers` call. A name asked for twice returns the same `Var`
/// (this is how a tied embedding is shared when both its layers are built together).
pub(crate) struct Params<'a> {
    source: ParamSource<'a>,
    device: Device,
    made: HashMap<String, Var>,
}

impl<'a> Params<'a> {
    pub fn new(source: ParamSource<'a>, device: &Device) -> Self {
        Self {
            source,
            device: device.clone(),
            made: HashMap::new(),
        }
    }

    pub fn get(&mut self, name: &str, shape: &[usize], init: Init) -> Result<Var> {
        if let Some(v) = self.made.get(name) {
            return Ok(v.clone());
        }
        let t = match self.source {
            ParamSource::Tensors(map) => checked_param(map, name, shape, &self.device)?,
            ParamSource::Init { seed } => match init {
                Init::Normal(std) => seeded_normal(seed, name, shape, std, &self.device)?,
                Init::Zeros => Tensor::zeros(shape, DType::F32, &self.device)?,
                Init::Ones => Tensor::ones(shape, DType::F32, &self.device)?,
            },
        };
        let v = Var::from_tensor(&t)?;
        self.made.insert(name.to_string(), v.clone());
        Ok(v)
    }
}

/// LayerNorm over the last dimension, from primitives (differentiable). A bf16 `x` is
/// normalised in f32 and the result cast back to bf16.
pub(crate) fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    if x.dtype() != DType::F32 {
        return layer_norm(&x.to_dtype(DType::F32)?, w, b, eps)?
            .to_dtype(x.dtype())
            .map_err(Into::into);
    }
    if fusable(x) {
        let op = fused::LayerNorm { eps: eps as f32 };
        return Ok(x.contiguous()?.apply_op3(w, b, op)?);
    }
    let mean = x.mean_keepdim(D::Minus1)?; // [.., 1]
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?; // [.., 1]
    let xn = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
    Ok(xn.broadcast_mul(w)?.broadcast_add(b)?)
}

/// `x @ w + b` with `w` stored `[in, out]` (GPT-2's Conv1D layout); `x` is `[.., in]`.
pub(crate) fn conv1d(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    if fusable(x) {
        let op = fused_linear::Linear { out_in: false };
        return Ok(x.contiguous()?.apply_op3(w, b, op)?);
    }
    let (w, b) = (w.to_dtype(x.dtype())?, b.to_dtype(x.dtype())?);
    let dims = x.dims().to_vec();
    let (inp, out) = w.dims2()?;
    let rows = x.elem_count() / inp;
    let y = x.reshape((rows, inp))?.matmul(&w)?.broadcast_add(&b)?; // [rows, out]
    let mut out_dims = dims;
    *out_dims.last_mut().expect("x has at least one dimension") = out;
    Ok(y.reshape(out_dims)?)
}

/// `x @ wᵀ (+ b)` with `w` stored `[out, in]` (torch.nn.Linear layout); `x` is `[.., in]`.
pub(crate) fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    if let (Some(b), true) = (b, fusable(x)) {
        let op = fused_linear::Linear { out_in: true };
        return Ok(x.contiguous()?.apply_op3(w, b, op)?);
    }
    let w = w.to_dtype(x.dtype())?;
    let dims = x.dims().to_vec();
    let (out, inp) = w.dims2()?;
    let rows = x.elem_count() / inp;
    let mut y = x.reshape((rows, inp))?.matmul(&w.t()?)?; // [rows, out]
    if let Some(b) = b {
        y = y.broadcast_add(&b.to_dtype(x.dtype())?)?;
    }
    let mut out_dims = dims;
    *out_dims.last_mut().expect("x has at least one dimension") = out;
    Ok(y.reshape(out_dims)?)
}

/// Causal multi-head attention of already-projected `q`, `k`, `v`, each `[b, t, d]`.
/// `q` is scaled by `1/sqrt(d_head)` here. `drop` is applied to the attention probabilities
/// `[b, h, t, t]` (attention dropout; the identity when off), which `dropping` says it is not.
/// The softmax runs in f32; the rest in the dtype of `q`. On the CPU in f32 with nothing
/// dropped, all of it is one fused op (`fused_attention.rs`).
pub(crate) fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    n_head: usize,
    dropping: bool,
    drop: impl Fn(&Tensor) -> oobleck_core::Result<Tensor>,
) -> Result<Tensor> {
    if !dropping && fusable(q) && fusable(k) && fusable(v) {
        return Ok(fused_attention::separate_attention(q, k, v, n_head)?);
    }
    composed_attention(q, k, v, n_head, drop)
}

/// [`causal_attention`] of GPT-2's fused projection `qkv [b, t, 3d]` (q, k, v side by side).
pub(crate) fn causal_attention_packed(
    qkv: &Tensor,
    n_head: usize,
    dropping: bool,
    drop: impl Fn(&Tensor) -> oobleck_core::Result<Tensor>,
) -> Result<Tensor> {
    if !dropping && fusable(qkv) {
        return Ok(fused_attention::packed_attention(qkv, n_head)?);
    }
    let d = qkv.dim(2)? / 3;
    let (q, k, v) = (
        qkv.narrow(2, 0, d)?,
        qkv.narrow(2, d, d)?,
        qkv.narrow(2, 2 * d, d)?,
    );
    composed_attention(&q, &k, &v, n_head, drop)
}

/// Attention of Candle ops and the per-op fused kernels: the path when attention
/// probabilities are dropped out (`drop`), and off the CPU.
fn composed_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    n_head: usize,
    drop: impl Fn(&Tensor) -> oobleck_core::Result<Tensor>,
) -> Result<Tensor> {
    let (b, t, d) = q.dims3()?;
    let hd = d / n_head;
    let heads = |x: &Tensor| -> Result<Tensor> {
        Ok(x.reshape((b, t, n_head, hd))?
            .transpose(1, 2)?
            .contiguous()?) // [b, h, t, hd]
    };
    let (q, k, v) = (heads(q)?, heads(k)?, heads(v)?);
    let scale = 1.0 / (hd as f64).sqrt();
    let dtype = q.dtype();
    let scores = if fusable(&q) {
        q.apply_op2(&k, fused_bmm::Bmm { trans_b: true })?
    } else {
        q.matmul(&k.t()?)?.to_dtype(DType::F32)?
    }; // [b, h, t, t]
    let att = if fusable(&scores) {
        scores.apply_op1(fused::CausalSoftmax {
            scale: scale as f32,
        })?
    } else {
        let att = (scores * scale)?.broadcast_add(&causal_mask(t, q.device())?)?;
        candle_nn::ops::softmax(&att, D::Minus1)?
    };
    let att = drop(&att.to_dtype(dtype)?)?;
    let y = if fusable(&att) {
        att.contiguous()?
            .apply_op2(&v, fused_bmm::Bmm { trans_b: false })?
    } else {
        att.matmul(&v)?
    }; // [b, h, t, hd]
    Ok(y.transpose(1, 2)?.reshape((b, t, d))?)
}

/// `[t, t]` with 0 on and below the diagonal and -inf above it.
fn causal_mask(t: usize, device: &Device) -> Result<Tensor> {
    let m: Vec<f32> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Ok(Tensor::from_vec(m, (t, t), device)?)
}

/// GELU with the tanh approximation (HF `gelu_new`).
pub(crate) fn gelu_tanh(x: &Tensor) -> Result<Tensor> {
    if fusable(x) {
        return Ok(x.contiguous()?.apply_op1(fused::GeluTanh)?);
    }
    Ok(x.gelu()?)
}

/// Mean next-token cross-entropy of the logits `h @ wᵀ` against `targets [b, t]`, for `h` of
/// shape `[b, t, d]` and an LM head `w [v, d]`. On the CPU the `[b*t, v]` logits exist only
/// inside the forward pass (turned into their own gradient in place); elsewhere this is a
/// matmul and candle's cross-entropy. The loss is f32.
///
/// A bf16 `h` multiplies a bf16 copy of `w`, and the log-softmax and cross-entropy run in f32
/// (autocast's rule). On the CPU that product is the fused f32 kernel on the bf16-rounded
/// operands: a bf16 GEMM accumulating in f32 (what candle's CPU bf16 matmul does too) whose
/// f32 logits go straight into the f32 loss, without the `[b*t, v]` bf16 and f32 copies.
pub(crate) fn lm_head_loss(h: &Tensor, w: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (v, d) = w.dims2()?;
    let rows = h.elem_count() / d;
    let h = h.reshape((rows, d))?;
    let targets = targets.flatten_all()?;
    if targets.dim(0)? != rows {
        return Err(crate::Error::Invalid(format!(
            "{} targets for {rows} positions",
            targets.dim(0)?
        )));
    }
    let (h, w) = match h.dtype() {
        DType::F32 => (h, w.clone()),
        // The CPU: the fused f32 kernel on the bf16-rounded operands (see above).
        _ if h.device().is_cpu() => (
            h.to_dtype(DType::F32)?,
            w.to_dtype(h.dtype())?.to_dtype(DType::F32)?,
        ),
        dt => (h, w.to_dtype(dt)?),
    };
    if fusable(&h) {
        let ids = targets.to_dtype(DType::U32)?.to_vec1::<u32>()?;
        return Ok(fused::lm_head_loss(&h, &w, &ids)?);
    }
    let logits = h.matmul(&w.t()?)?.to_dtype(DType::F32)?; // [rows, v]
    debug_assert_eq!(logits.dim(1)?, v);
    Ok(candle_nn::loss::cross_entropy(&logits, &targets)?)
}
