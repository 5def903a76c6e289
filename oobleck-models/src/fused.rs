//! Fused CPU kernels with hand-written backward passes, for the hot spots of a training step.
//!
//! Candle's own fused kernels have no backward, and the primitive-op formulations in `nn.rs`
//! allocate a full-size temporary per op, forward and backward: on the `[b*t, 50257]` logits
//! that is a dozen 400 MB tensors per step (plus the zero tensor candle's backprop allocates
//! for every gradient it accumulates). These ops read and write each big tensor once or twice.
//!
//! | op | forward | backward |
//! |---|---|---|
//! | [`lm_head_loss`] | `logits = h wᵀ` (one sgemm), then in place `P = (softmax - onehot) / n`, mean NLL | `dh = g·P w`, `dw = g·Pᵀ h` (two sgemms) |
//! | [`CausalSoftmax`] | `softmax(scale·s + causal mask)`, masked half skipped | `ds = scale·y·(dy - Σ dy·y)` |
//! | [`GeluTanh`] | `0.5x(1 + tanh(√(2/π)(x + 0.044715x³)))` | closed form |
//! | [`LayerNorm`] | per row mean/var, `(x - μ)/σ · w + b` | `dx`, `dw`, `db` in one pass |
//!
//! All are CPU-only; the wrappers in `nn.rs` use the primitive formulations on other devices.
//! The linear layers are in `fused_linear.rs`.
//! Rows are processed in parallel on rayon's global pool (the pool candle's CPU backend uses,
//! sized by `RAYON_NUM_THREADS` or the core count).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use oobleck_core::model::weight_grads::{self, Deferred};

use crate::fused_linear::{gemm_new, Mat};
use crate::lanes::{dot_f32, exp_f32, max_f32, sum_f32, tanh_f32};

pub(crate) type CResult<T> = candle_core::Result<T>;

pub(crate) fn msg(s: impl Into<String>) -> candle_core::Error {
    candle_core::Error::Msg(s.into())
}

/// The contiguous f32 data of an op argument.
pub(crate) fn f32s<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> CResult<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        return Err(msg(format!("{what}: expected f32, got {:?}", s.dtype())));
    };
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| msg(format!("{what}: argument is not contiguous")))?;
    Ok(&v[a..b])
}

/// Runs `f` on the contiguous f32 data of a CPU tensor, without copying it.
pub(crate) fn with_f32<R>(
    t: &Tensor,
    what: &str,
    f: impl FnOnce(&[f32]) -> CResult<R>,
) -> CResult<R> {
    let (s, l) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*s else {
        return Err(msg(format!(
            "{what}: the fused CPU kernel got a tensor on {:?}",
            t.device()
        )));
    };
    f(f32s(cpu, l, what)?)
}

// ---------------------------------------------------------------------------------------------
// LM head + cross-entropy

/// Turns `[n, v]` logits in place into `(softmax - onehot(target)) / n` and returns the mean
/// negative log-likelihood.
fn xent_in_place(data: &mut [f32], targets: &[u32]) -> f64 {
    let n = targets.len();
    let v = data.len() / n;
    let inv_n = 1.0 / n as f32;
    let total: f64 = data
        .par_chunks_mut(v)
        .zip(targets.par_iter())
        .map(|(row, &t)| {
            let t = t as usize;
            let m = max_f32(row);
            let x_t = row[t];
            for x in row.iter_mut() {
                *x = exp_f32(*x - m);
            }
            let s = sum_f32(row);
            let k = inv_n / s;
            for x in row.iter_mut() {
                *x *= k;
            }
            row[t] -= inv_n;
            f64::from(m + s.ln() - x_t)
        })
        .sum();
    total / n as f64
}

/// Holds `P = (softmax - onehot) / n` from the forward pass; its backward is two matmuls.
struct LmHeadLoss {
    loss: f32,
    probs_grad: Tensor,
}

impl candle_core::CustomOp2 for LmHeadLoss {
    fn name(&self) -> &'static str {
        "lm-head-loss"
    }

    fn cpu_fwd(
        &self,
        _s1: &CpuStorage,
        _l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(vec![self.loss]), Shape::from(())))
    }

    fn bwd(
        &self,
        h: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        // The loss is a scalar, so its gradient scales the two (small) matmul results rather
        // than the [n, v] matrix.
        let g = grad.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let (n, v) = self.probs_grad.dims2()?;
        let d = w.dim(1)?;
        let dh = with_f32(&self.probs_grad, "lm head P", |p| {
            with_f32(w, "lm head w", |wv| {
                let pm = Mat::row_major(p, v);
                gemm_new(n, v, d, pm, Mat::row_major(wv, d), g) // g·P·w
            })
        })?;
        let dh = Tensor::from_vec(dh, (n, d), h.device())?;
        // dw = g·Pᵀ·h: now, or in a zero-bubble schedule's W (`weight_grads`), which keeps P
        // (held since the forward) until then.
        let params = [w];
        let (p, h, w) = (self.probs_grad.clone(), h.clone(), w.clone());
        let work: Deferred = Box::new(move || {
            let dw = with_f32(&p, "lm head P", |p| {
                with_f32(&h, "lm head h", |hv| {
                    let pt = Mat::transposed(p, v);
                    gemm_new(v, n, d, pt, Mat::row_major(hv, d), g)
                })
            })?;
            let dw = Tensor::from_vec(dw, (v, d), w.device())?;
            Ok(vec![(w, dw)])
        });
        match weight_grads::defer(&params, work) {
            None => Ok((Some(dh), None)),
            Some(now) => Ok((Some(dh), now()?.pop().map(|(_, dw)| dw))),
        }
    }
}

/// Mean next-token cross-entropy of `h @ wᵀ` (`h [n, d]`, `w [v, d]`) against `targets [n]`,
/// without keeping the logits: the forward pass overwrites them with their gradient.
pub(crate) fn lm_head_loss(h: &Tensor, w: &Tensor, targets: &[u32]) -> CResult<Tensor> {
    let (n, d) = h.dims2()?;
    let (v, d2) = w.dims2()?;
    if d != d2 || n != targets.len() {
        return Err(msg(format!(
            "lm_head_loss: h {:?}, w {:?}, {} targets",
            h.dims(),
            w.dims(),
            targets.len()
        )));
    }
    if let Some(&t) = targets.iter().find(|&&t| t as usize >= v) {
        return Err(msg(format!(
            "target token id {t} is outside the vocabulary of {v}"
        )));
    }
    let h = h.contiguous()?;
    // logits [n, v] = h · wᵀ, outside the graph; then overwritten by their gradient.
    let mut logits = with_f32(&h, "lm head h", |hv| {
        with_f32(w, "lm head w", |wv| {
            gemm_new(n, d, v, Mat::row_major(hv, d), Mat::transposed(wv, d), 1.0)
        })
    })?;
    let loss = xent_in_place(&mut logits, targets) as f32;
    let probs_grad = Tensor::from_vec(logits, (n, v), h.device())?;
    h.apply_op2(w, LmHeadLoss { loss, probs_grad })
}

// ---------------------------------------------------------------------------------------------
// Causal softmax

/// `softmax(scale · s + causal mask)` over the last dim of attention scores `[.., t, t]`.
pub(crate) struct CausalSoftmax {
    pub scale: f32,
}

impl CausalSoftmax {
    fn dims(shape: &Shape) -> CResult<usize> {
        let d = shape.dims();
        let t = *d.last().ok_or_else(|| msg("causal softmax of a scalar"))?;
        if d.len() < 2 || d[d.len() - 2] != t {
            return Err(msg(format!("causal softmax expects [.., t, t], got {d:?}")));
        }
        Ok(t)
    }
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let t = Self::dims(l.shape())?;
        let x = f32s(s, l, "causal softmax")?;
        let mut y = vec![0f32; x.len()];
        let scale = self.scale;
        y.par_chunks_mut(t)
            .zip(x.par_chunks(t))
            .enumerate()
            .for_each(|(r, (yr, xr))| {
                let keep = r % t + 1; // query i sees keys 0..=i
                let (yk, xk) = (&mut yr[..keep], &xr[..keep]);
                let m = max_f32(xk) * scale;
                for (o, &v) in yk.iter_mut().zip(xk) {
                    *o = exp_f32(v * scale - m);
                }
                let k = 1.0 / sum_f32(yk);
                for o in yk.iter_mut() {
                    *o *= k;
                }
            });
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, dy: &Tensor) -> CResult<Option<Tensor>> {
        let t = Self::dims(y.shape())?;
        let dy = dy.contiguous()?;
        let scale = self.scale;
        let dx = with_f32(y, "causal softmax y", |yv| {
            with_f32(&dy, "causal softmax dy", |dyv| {
                let mut dx = vec![0f32; yv.len()];
                dx.par_chunks_mut(t)
                    .zip(yv.par_chunks(t).zip(dyv.par_chunks(t)))
                    .enumerate()
                    .for_each(|(r, (dxr, (yr, dyr)))| {
                        let keep = r % t + 1;
                        let (yk, dyk) = (&yr[..keep], &dyr[..keep]);
                        let dot = dot_f32(yk, dyk);
                        for ((o, &a), &b) in dxr[..keep].iter_mut().zip(yk).zip(dyk) {
                            *o = scale * a * (b - dot);
                        }
                    });
                Ok(dx)
            })
        })?;
        Ok(Some(Tensor::from_vec(dx, y.shape(), y.device())?))
    }
}

// ---------------------------------------------------------------------------------------------
// GELU (tanh approximation, HF `gelu_new`)

pub(crate) struct GeluTanh;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_C: f32 = 0.044_715;

impl CustomOp1 for GeluTanh {
    fn name(&self) -> &'static str {
        "gelu-tanh"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let x = f32s(s, l, "gelu")?;
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(1 << 14)
            .zip(x.par_chunks(1 << 14))
            .for_each(|(yc, xc)| {
                for (o, &v) in yc.iter_mut().zip(xc) {
                    let u = SQRT_2_OVER_PI * (v + GELU_C * v * v * v);
                    *o = 0.5 * v * (1.0 + tanh_f32(u));
                }
            });
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> CResult<Option<Tensor>> {
        let dy = dy.contiguous()?;
        let dx = with_f32(x, "gelu x", |xv| {
            with_f32(&dy, "gelu dy", |dyv| {
                let mut dx = vec![0f32; xv.len()];
                dx.par_chunks_mut(1 << 14)
                    .zip(xv.par_chunks(1 << 14).zip(dyv.par_chunks(1 << 14)))
                    .for_each(|(oc, (xc, gc))| {
                        for ((o, &v), &g) in oc.iter_mut().zip(xc).zip(gc) {
                            let u = SQRT_2_OVER_PI * (v + GELU_C * v * v * v);
                            let th = tanh_f32(u);
                            let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * v * v);
                            *o = g * (0.5 * (1.0 + th) + 0.5 * v * (1.0 - th * th) * du);
                        }
                    });
                Ok(dx)
            })
        })?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

// ---------------------------------------------------------------------------------------------
// LayerNorm

/// LayerNorm over the last dim of `x [.., d]` with weight and bias `[d]`.
pub(crate) struct LayerNorm {
    pub eps: f32,
}

/// Mean and `1/sqrt(var + eps)` of one row (two passes, as PyTorch).
#[inline]
fn row_stats(x: &[f32], eps: f32) -> (f32, f32) {
    let d = x.len() as f32;
    let mean = x.iter().sum::<f32>() / d;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d;
    (mean, 1.0 / (var + eps).sqrt())
}

/// Rows per parallel task: enough work per task to amortise scheduling.
fn rows_per_task(d: usize) -> usize {
    (8192 / d.max(1)).max(1)
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let x = f32s(s1, l1, "layer norm x")?;
        let w = f32s(s2, l2, "layer norm weight")?;
        let b = f32s(s3, l3, "layer norm bias")?;
        let d = w.len();
        if d == 0 || b.len() != d || x.len() % d != 0 {
            return Err(msg(format!(
                "layer norm: x {:?}, weight {:?}, bias {:?}",
                l1.dims(),
                l2.dims(),
                l3.dims()
            )));
        }
        let eps = self.eps;
        let mut y = vec![0f32; x.len()];
        let k = rows_per_task(d) * d;
        y.par_chunks_mut(k)
            .zip(x.par_chunks(k))
            .for_each(|(yc, xc)| {
                for (yr, xr) in yc.chunks_mut(d).zip(xc.chunks(d)) {
                    let (mean, rstd) = row_stats(xr, eps);
                    for (((o, &v), &wi), &bi) in yr.iter_mut().zip(xr).zip(w).zip(b) {
                        *o = (v - mean) * rstd * wi + bi;
                    }
                }
            });
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let wv = w.flatten_all()?.to_vec1::<f32>()?;
        let dy = dy.contiguous()?;
        let eps = self.eps;
        let (dx, dw, db) = with_f32(x, "layer norm x", |xv| {
            with_f32(&dy, "layer norm dy", |dyv| {
                Ok(layer_norm_bwd(xv, &wv, dyv, eps))
            })
        })?;
        let dev = x.device();
        Ok((
            Some(Tensor::from_vec(dx, x.shape(), dev)?),
            Some(Tensor::from_vec(dw, w.shape(), dev)?),
            Some(Tensor::from_vec(db, w.shape(), dev)?),
        ))
    }
}

/// `(dx, dw, db)` of LayerNorm for rows of `x` and `dy`.
fn layer_norm_bwd(xv: &[f32], wv: &[f32], dyv: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let d = wv.len();
    let mut dx = vec![0f32; xv.len()];
    let k = rows_per_task(d) * d;
    let (dw, db) = dx
        .par_chunks_mut(k)
        .zip(xv.par_chunks(k).zip(dyv.par_chunks(k)))
        .map(|(dxc, (xc, dyc))| {
            let mut dw = vec![0f32; d];
            let mut db = vec![0f32; d];
            let mut xhat = vec![0f32; d];
            for ((dxr, xr), dyr) in dxc.chunks_mut(d).zip(xc.chunks(d)).zip(dyc.chunks(d)) {
                let (mean, rstd) = row_stats(xr, eps);
                let (mut m1, mut m2) = (0f32, 0f32);
                for i in 0..d {
                    xhat[i] = (xr[i] - mean) * rstd;
                    let g = dyr[i] * wv[i];
                    m1 += g;
                    m2 += g * xhat[i];
                    dw[i] += dyr[i] * xhat[i];
                    db[i] += dyr[i];
                }
                let (m1, m2) = (m1 / d as f32, m2 / d as f32);
                for i in 0..d {
                    dxr[i] = rstd * (dyr[i] * wv[i] - m1 - xhat[i] * m2);
                }
            }
            (dw, db)
        })
        .reduce(
            || (vec![0f32; d], vec![0f32; d]),
            |(mut aw, mut ab), (bw, bb)| {
                aw.iter_mut().zip(&bw).for_each(|(a, b)| *a += b);
                ab.iter_mut().zip(&bb).for_each(|(a, b)| *a += b);
                (aw, ab)
            },
        );
    (dx, dw, db)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .and_then(|d| d.abs()?.max_all()?.to_scalar())
            .unwrap()
    }

    /// Value and gradients of `sum(f(x, w, b) * r)` for a fixed random `r`.
    fn grads(
        f: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor,
        x: &Var,
        w: &Var,
        b: &Var,
        r: &Tensor,
    ) -> Vec<Tensor> {
        let y = f(x, w, b);
        let g = (&y * r).unwrap().sum_all().unwrap().backward().unwrap();
        let mut out = vec![y];
        for v in [x, w, b] {
            out.push(
                g.get(v)
                    .map_or_else(|| v.zeros_like().unwrap(), |t| t.clone()),
            );
        }
        out
    }

    use candle_core::{Device, Var, D};

    #[test]
    fn fused_ops_match_primitive_formulations_and_their_gradients() {
        let dev = Device::Cpu;
        let (n, t, d) = (3, 9, 16);
        let x = Var::from_tensor(&Tensor::randn(0f32, 2.0, (n, t, d), &dev).unwrap()).unwrap();
        let w = Var::from_tensor(&Tensor::randn(1f32, 0.3, d, &dev).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::randn(0f32, 0.3, d, &dev).unwrap()).unwrap();
        let r = Tensor::randn(0f32, 1.0, (n, t, d), &dev).unwrap();
        let eps = 1e-5;
        let ln_ref = |x: &Tensor, w: &Tensor, b: &Tensor| {
            let mean = x.mean_keepdim(D::Minus1).unwrap();
            let xc = x.broadcast_sub(&mean).unwrap();
            let var = xc.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
            let xn = xc
                .broadcast_div(&(var + eps).unwrap().sqrt().unwrap())
                .unwrap();
            xn.broadcast_mul(w).unwrap().broadcast_add(b).unwrap()
        };
        let ln = |x: &Tensor, w: &Tensor, b: &Tensor| {
            x.apply_op3(w, b, LayerNorm { eps: eps as f32 }).unwrap()
        };
        let gelu = |x: &Tensor, w: &Tensor, _: &Tensor| {
            x.broadcast_mul(w).unwrap().apply_op1(GeluTanh).unwrap()
        };
        let gelu_ref =
            |x: &Tensor, w: &Tensor, _: &Tensor| x.broadcast_mul(w).unwrap().gelu().unwrap();
        // Scores [n, t, t] from x: exercises the causal mask at every row length.
        let scale = 0.25;
        let sm = |x: &Tensor, _: &Tensor, _: &Tensor| {
            x.narrow(2, 0, t)
                .unwrap()
                .contiguous()
                .unwrap()
                .apply_op1(CausalSoftmax { scale })
                .unwrap()
        };
        let mask: Vec<f32> = (0..t * t)
            .map(|k| {
                if k % t > k / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), &dev).unwrap();
        let sm_ref = |x: &Tensor, _: &Tensor, _: &Tensor| {
            let s = (x.narrow(2, 0, t).unwrap() * f64::from(scale)).unwrap();
            candle_nn::ops::softmax(&s.broadcast_add(&mask).unwrap(), D::Minus1).unwrap()
        };
        let rt = r.narrow(2, 0, t).unwrap();
        for (name, a, b_, rr) in [
            (
                "layer norm",
                grads(ln, &x, &w, &b, &r),
                grads(ln_ref, &x, &w, &b, &r),
                1e-5,
            ),
            (
                "gelu",
                grads(gelu, &x, &w, &b, &r),
                grads(gelu_ref, &x, &w, &b, &r),
                1e-5,
            ),
            (
                "causal softmax",
                grads(sm, &x, &w, &b, &rt),
                grads(sm_ref, &x, &w, &b, &rt),
                1e-6,
            ),
        ] {
            for (i, (p, q)) in a.iter().zip(&b_).enumerate() {
                // Relative to the magnitude: candle's own GELU backward rounds its constants
                // to 6 digits, so it is itself only that exact.
                let scale = max_diff(q, &q.zeros_like().unwrap()).max(1.0);
                let diff = max_diff(p, q) / scale;
                assert!(diff < rr, "{name}: output {i} differs by {diff} (relative)");
            }
        }
    }

    #[test]
    fn lm_head_loss_matches_matmul_and_cross_entropy() {
        let dev = Device::Cpu;
        let (n, d, v) = (6, 8, 37);
        let h = Var::from_tensor(&Tensor::randn(0f32, 1.0, (n, d), &dev).unwrap()).unwrap();
        let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, (v, d), &dev).unwrap()).unwrap();
        let ids: Vec<u32> = (0..n as u32).map(|i| (i * 7) % v as u32).collect();
        let tgt = Tensor::new(ids.as_slice(), &dev).unwrap();
        let fused = (lm_head_loss(&h, &w, &ids).unwrap() * 0.5).unwrap();
        let logits = h.matmul(&w.t().unwrap()).unwrap();
        let reference = (candle_nn::loss::cross_entropy(&logits, &tgt).unwrap() * 0.5).unwrap();
        assert!(max_diff(&fused, &reference) < 1e-5);
        let gf = fused.backward().unwrap();
        let gr = reference.backward().unwrap();
        for p in [&h, &w] {
            let diff = max_diff(gf.get(p).unwrap(), gr.get(p).unwrap());
            assert!(diff < 1e-6, "gradient differs by {diff}");
        }
        assert!(lm_head_loss(&h, &w, &[v as u32; 6]).is_err());
    }
}
