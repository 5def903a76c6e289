//! AdamW's update in one pass over each parameter, in place, on CPU `f32` tensors.
//!
//! The tensor path of [`super::adamw`] computes an update as eleven whole-tensor operations,
//! each reading and writing the parameter's size again and allocating a fresh result (44 M
//! parameters: some 2 GB of new pages per step). Here every element is read once and written
//! once, in parallel chunks on rayon's pool (the one candle's CPU backend uses), and the
//! parameter and both moments are updated where they are.
//!
//! The arithmetic is the tensor path's, operation by operation and in the same `f32` rounding
//! (each scalar is rounded to `f32` exactly as candle's `affine` rounds it), so both paths give
//! bit-identical results; `adamw_tests.rs` checks that.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Tensor};

use crate::Result;

/// Elements per parallel task: large enough to amortise scheduling, small enough to split
/// even a LayerNorm gain across both cores.
const CHUNK: usize = 1 << 15;

/// The per-step scalars of one parameter's update, already rounded as the tensor path rounds
/// them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Scalars {
    /// `1 - lr·λ`, `None` when the parameter does not decay.
    pub decay: Option<f32>,
    /// `1 - β1` (the lerp weight).
    pub w: f32,
    /// `1 - w`, the lerp's other weight (used when `w >= 0.5`).
    pub one_minus_w: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    /// `sqrt(1 - β2^t)`.
    pub bc2_sqrt: f32,
    pub eps: f32,
    /// `-lr / (1 - β1^t)`.
    pub neg_step_size: f32,
}

impl Scalars {
    pub fn new(beta1: f64, beta2: f64, eps: f64, lr: f64, weight_decay: f64, step: u64) -> Self {
        let t = step as f64;
        let w = (1.0 - beta1) as f32;
        Scalars {
            decay: (weight_decay != 0.0).then_some((1.0 - lr * weight_decay) as f32),
            w,
            one_minus_w: ((1.0f32 - w) as f64) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            bc2_sqrt: (1.0 - beta2.powf(t)).sqrt() as f32,
            eps: eps as f32,
            neg_step_size: (-(lr / (1.0 - beta1.powf(t)))) as f32,
        }
    }

    /// One element: returns the new `(θ, m, v)`. Every `+ 0.0` is candle's `affine(mul, 0)`.
    #[inline(always)]
    fn element(&self, theta: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
        let theta = match self.decay {
            Some(d) => theta * d + 0.0,
            None => theta,
        };
        let diff = g - m;
        let m = if self.w.abs() < 0.5 {
            m + (diff * self.w + 0.0)
        } else {
            g - (diff * self.one_minus_w + 0.0)
        };
        let v = (v * self.beta2 + 0.0) + ((g * self.one_minus_beta2 + 0.0) * g);
        let denom = v.sqrt() / self.bc2_sqrt * 1.0 + self.eps;
        let theta = theta + ((m * self.neg_step_size + 0.0) / denom);
        (theta, m, v)
    }

    fn apply(&self, theta: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        use rayon::prelude::*;
        theta
            .par_chunks_mut(CHUNK)
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .zip(g.par_chunks(CHUNK))
            .for_each(|(((theta, m), v), g)| {
                for i in 0..theta.len() {
                    (theta[i], m[i], v[i]) = self.element(theta[i], g[i], m[i], v[i]);
                }
            });
    }
}

/// `sum(g²)` accumulated in f64 of a contiguous CPU `f32` tensor, in one parallel pass
/// without the f64 copy and its square that the tensor path allocates; `None` for any other
/// tensor. Chunks are summed in index order, so the result does not depend on the number of
/// threads.
pub(super) fn sum_sq_f64(g: &Tensor) -> Result<Option<f64>> {
    use rayon::prelude::*;
    if !(g.device().is_cpu() && g.dtype() == DType::F32 && g.is_contiguous()) {
        return Ok(None);
    }
    let (storage, layout) = g.storage_and_layout();
    let candle_core::Storage::Cpu(c) = &*storage else {
        return Ok(None);
    };
    let data = f32_slice(c.as_slice::<f32>()?, layout)?;
    let partial: Vec<f64> = data
        .par_chunks(CHUNK)
        .map(|c| c.iter().map(|&x| f64::from(x) * f64::from(x)).sum())
        .collect();
    Ok(Some(partial.iter().sum()))
}

/// Whether the fused path applies: every tensor an `f32`, contiguous CPU tensor.
pub(super) fn applies(tensors: [&Tensor; 4]) -> bool {
    tensors
        .iter()
        .all(|t| t.device().is_cpu() && t.dtype() == DType::F32 && t.is_contiguous())
}

/// Updates `theta`, `exp_avg` and `exp_avg_sq` in place from `grad`. Each must pass
/// [`applies`], have the same element count, and not share storage with another.
pub(super) fn step_in_place(
    theta: &Tensor,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    s: Scalars,
) -> Result<()> {
    let (g_storage, g_layout) = grad.storage_and_layout();
    let g = match &*g_storage {
        candle_core::Storage::Cpu(c) => f32_slice(c.as_slice::<f32>()?, g_layout)?,
        _ => return Err(fused_err("a gradient is not on the CPU").into()),
    };
    // Nested in-place ops: each holds one tensor's storage for writing, the innermost
    // computes with all three (candle gives a custom op one mutable storage only).
    theta.inplace_op1(&Outer {
        g,
        exp_avg,
        exp_avg_sq,
        s,
    })?;
    Ok(())
}

fn f32_slice<'a>(all: &'a [f32], layout: &Layout) -> candle_core::Result<&'a [f32]> {
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| fused_err("a non-contiguous tensor"))?;
    Ok(&all[start..end])
}

fn f32_slice_mut<'a>(
    storage: &'a mut CpuStorage,
    layout: &Layout,
) -> candle_core::Result<&'a mut [f32]> {
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| fused_err("a non-contiguous tensor"))?;
    match storage {
        CpuStorage::F32(v) => Ok(&mut v[start..end]),
        other => Err(fused_err(&format!(
            "a {:?} tensor, expected f32",
            other.dtype()
        ))),
    }
}

/// A broken precondition of [`step_in_place`] (the caller checks [`applies`] first).
fn fused_err(what: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!("fused AdamW: {what}"))
}

struct Outer<'a> {
    g: &'a [f32],
    exp_avg: &'a Tensor,
    exp_avg_sq: &'a Tensor,
    s: Scalars,
}

impl InplaceOp1 for Outer<'_> {
    fn name(&self) -> &'static str {
        "fused-adamw-theta"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let theta = f32_slice_mut(storage, layout)?;
        let middle = Middle {
            g: self.g,
            theta: std::cell::RefCell::new(theta),
            exp_avg_sq: self.exp_avg_sq,
            s: self.s,
        };
        self.exp_avg.inplace_op1(&middle)
    }
}

struct Middle<'a, 'b> {
    g: &'a [f32],
    theta: std::cell::RefCell<&'b mut [f32]>,
    exp_avg_sq: &'a Tensor,
    s: Scalars,
}

impl InplaceOp1 for Middle<'_, '_> {
    fn name(&self) -> &'static str {
        "fused-adamw-exp-avg"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let m = f32_slice_mut(storage, layout)?;
        let mut theta = self.theta.borrow_mut();
        let inner = Inner {
            g: self.g,
            theta: std::cell::RefCell::new(&mut **theta),
            m: std::cell::RefCell::new(m),
            s: self.s,
        };
        self.exp_avg_sq.inplace_op1(&inner)
    }
}

struct Inner<'a, 'b> {
    g: &'a [f32],
    theta: std::cell::RefCell<&'b mut [f32]>,
    m: std::cell::RefCell<&'b mut [f32]>,
    s: Scalars,
}

impl InplaceOp1 for Inner<'_, '_> {
    fn name(&self) -> &'static str {
        "fused-adamw-exp-avg-sq"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let v = f32_slice_mut(storage, layout)?;
        let mut theta = self.theta.borrow_mut();
        let mut m = self.m.borrow_mut();
        let n = self.g.len();
        if theta.len() != n || m.len() != n || v.len() != n {
            return Err(fused_err(&format!(
                "sizes differ (param {}, grad {n}, exp_avg {}, exp_avg_sq {})",
                theta.len(),
                m.len(),
                v.len()
            )));
        }
        self.s.apply(&mut theta, self.g, &mut m, v);
        Ok(())
    }
}
