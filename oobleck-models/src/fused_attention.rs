//! Causal self-attention of every head as one op: `softmax(q kᵀ · scale + causal mask) v`,
//! reading q, k and v where the projections left them and writing `[b, t, d]` directly, with a
//! hand-written backward.
//!
//! Composed of Candle ops, attention is about fifteen graph nodes per block: three `narrow`s of
//! GPT-2's qkv projection, a reshape, transpose and copy per head split, two batched products,
//! the softmax, and the merge of the heads. Candle's backward gives the input of every node a
//! zero tensor and adds the node's gradient into it, and pads each `narrow`'s gradient to the
//! whole qkv width first: `oobleck bench train`'s backward spent ~9% of its time in those zero
//! fills and additions. Here each head is a strided view (no copies) and backward writes
//! dq, dk and dv in place. The probabilities `[b, h, t, t]` are kept for backward, as the
//! composed softmax kept them.
//!
//! | | per (sample, head), one single-threaded sgemm each, items in parallel |
//! |---|---|
//! | forward | `S = q kᵀ`; in place `P = softmax(scale·S + mask)` (masked part 0); `y = P v` |
//! | backward | `dP = dy vᵀ`; in place `dS = scale·P⊙(dP − Σ P⊙dP)`; `dq = dS k`, `dk = dSᵀ q`, `dv = Pᵀ dy` |

use candle_core::{CpuStorage, CustomOp1, CustomOp3, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::fused::{f32s, msg, with_f32, CResult};
use crate::fused_linear::{sgemm_one, sgemm_strided, Mat};
use crate::lanes::{dot_f32, exp_f32, max_f32, sum_f32};

/// Batch, sequence, heads and head width of one attention call.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    b: usize,
    t: usize,
    h: usize,
    hd: usize,
}

impl Geometry {
    fn d(&self) -> usize {
        self.h * self.hd
    }

    fn items(&self) -> usize {
        self.b * self.h
    }

    /// `(sample, head)` of a batch item.
    fn item(&self, i: usize) -> (usize, usize) {
        (i / self.h, i % self.h)
    }

    /// The softmax scale `1/√hd`.
    fn scale(&self) -> f32 {
        1.0 / (self.hd as f32).sqrt()
    }
}

/// Where one of q, k, v (or their gradients) lies in its buffer: element `c` of head `j` at
/// position `i` of sample `s` is at `off + s·bs + i·rs + j·hd + c`.
#[derive(Clone, Copy)]
struct Part {
    off: usize,
    bs: usize,
    rs: usize,
}

impl Part {
    /// A `[b, t, d]` tensor of its own.
    fn whole(g: &Geometry) -> Part {
        Part {
            off: 0,
            bs: g.t * g.d(),
            rs: g.d(),
        }
    }

    /// Third `which` (0: q, 1: k, 2: v) of GPT-2's `[b, t, 3d]` projection.
    fn packed(g: &Geometry, which: usize) -> Part {
        Part {
            off: which * g.d(),
            bs: 3 * g.t * g.d(),
            rs: 3 * g.d(),
        }
    }

    fn start(&self, g: &Geometry, item: usize) -> usize {
        let (s, j) = g.item(item);
        self.off + s * self.bs + j * g.hd
    }

    /// Head `item` as a `[t, hd]` matrix of `data`.
    fn mat<'a>(&self, data: &'a [f32], g: &Geometry, item: usize) -> Mat<'a> {
        Mat {
            data: &data[self.start(g, item).min(data.len())..],
            rs: self.rs,
            cs: 1,
        }
    }

    /// Head `item` transposed, a `[hd, t]` matrix of `data`.
    fn mat_t<'a>(&self, data: &'a [f32], g: &Geometry, item: usize) -> Mat<'a> {
        Mat {
            data: &data[self.start(g, item).min(data.len())..],
            rs: 1,
            cs: self.rs,
        }
    }
}

/// An output buffer that parallel tasks write disjoint `[t, hd]` heads of.
struct Out {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: tasks write disjoint elements only (see `Out::product`), while the buffer stays
// mutably borrowed by the caller until they have all joined.
unsafe impl Sync for Out {}

impl Out {
    fn new(buf: &mut [f32]) -> Out {
        Out {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
        }
    }

    /// Head `item` of `part` = `a [t, k] · b [k, hd]`.
    ///
    /// # Safety
    /// No other task may write or read head `item` of `part` at the same time.
    unsafe fn product(
        &self,
        g: &Geometry,
        k: usize,
        a: Mat,
        b: Mat,
        part: Part,
        item: usize,
    ) -> CResult<()> {
        let (m, n) = (g.t, g.hd);
        let start = part.start(g, item);
        if m == 0 || n == 0 || k == 0 {
            return Ok(());
        }
        if !a.fits(m, k) || !b.fits(k, n) || start + (m - 1) * part.rs + n > self.len {
            return Err(msg(format!(
                "attention product {m}x{k}x{n} of head {item}: an operand or the output is too short"
            )));
        }
        // SAFETY: the checks above keep every element of A, B and of the written head inside
        // its buffer, and the caller keeps heads disjoint.
        unsafe { sgemm_strided(m, k, n, a, b, self.ptr.add(start), part.rs) };
        Ok(())
    }
}

/// Row `i` of the scores in place: `softmax(scale · row[..=i])`, then 0 for the masked keys.
fn softmax_row(row: &mut [f32], keep: usize, scale: f32) {
    let (live, masked) = row.split_at_mut(keep);
    let m = max_f32(live) * scale;
    for x in live.iter_mut() {
        *x = exp_f32(*x * scale - m);
    }
    let k = 1.0 / sum_f32(live);
    for x in live.iter_mut() {
        *x *= k;
    }
    masked.fill(0.0);
}

/// The probabilities `P [b, h, t, t]` of q and k.
fn probs(g: &Geometry, q: (&[f32], Part), k: (&[f32], Part)) -> CResult<Vec<f32>> {
    let tt = g.t * g.t;
    let mut p = vec![0f32; g.items() * tt];
    if tt == 0 || g.hd == 0 {
        return Ok(p);
    }
    let scale = g.scale();
    p.par_chunks_mut(tt)
        .enumerate()
        .try_for_each(|(item, pi)| {
            let (qm, km) = (q.1.mat(q.0, g, item), k.1.mat_t(k.0, g, item));
            sgemm_one(g.t, g.hd, g.t, qm, km, pi)?;
            for (i, row) in pi.chunks_mut(g.t).enumerate() {
                softmax_row(row, i + 1, scale);
            }
            CResult::Ok(())
        })?;
    Ok(p)
}

/// `y [b, t, d] = P v`, every head written in place.
fn attend(g: &Geometry, p: &[f32], v: (&[f32], Part)) -> CResult<Vec<f32>> {
    let mut y = vec![0f32; g.b * g.t * g.d()];
    let tt = g.t * g.t;
    if p.len() != g.items() * tt {
        return Err(msg(format!(
            "attention: {} probabilities for {g:?}",
            p.len()
        )));
    }
    if y.is_empty() {
        return Ok(y);
    }
    let out = Out::new(&mut y);
    (0..g.items()).into_par_iter().try_for_each(|item| {
        let pm = Mat::row_major(&p[item * tt..(item + 1) * tt], g.t);
        // SAFETY: each task writes its own head of y.
        unsafe { out.product(g, g.t, pm, v.1.mat(v.0, g, item), Part::whole(g), item) }
    })?;
    Ok(y)
}

/// The inputs of backward: q, k, v where they lie, `P`, and `dy [b, t, d]`.
struct Saved<'a> {
    q: (&'a [f32], Part),
    k: (&'a [f32], Part),
    v: (&'a [f32], Part),
    p: &'a [f32],
    dy: &'a [f32],
}

/// Writes dq, dk and dv (each to its part of `out`; the parts may share one buffer).
fn backward(g: &Geometry, s: &Saved, out: [(&Out, Part); 3]) -> CResult<()> {
    let tt = g.t * g.t;
    if tt == 0 || g.hd == 0 {
        return Ok(());
    }
    if s.p.len() != g.items() * tt || s.dy.len() != g.b * g.t * g.d() {
        return Err(msg(format!(
            "attention backward: {} probabilities and {} gradients for {g:?}",
            s.p.len(),
            s.dy.len()
        )));
    }
    let scale = g.scale();
    let dyp = Part::whole(g);
    (0..g.items()).into_par_iter().try_for_each_init(
        || vec![0f32; tt],
        |ds, item| {
            let p = &s.p[item * tt..(item + 1) * tt];
            let (dym, vt) = (dyp.mat(s.dy, g, item), s.v.1.mat_t(s.v.0, g, item));
            sgemm_one(g.t, g.hd, g.t, dym, vt, ds)?;
            for (i, (dr, pr)) in ds.chunks_mut(g.t).zip(p.chunks(g.t)).enumerate() {
                let keep = i + 1;
                let dot = dot_f32(&pr[..keep], &dr[..keep]);
                for (o, &a) in dr[..keep].iter_mut().zip(&pr[..keep]) {
                    *o = scale * a * (*o - dot);
                }
                dr[keep..].fill(0.0);
            }
            let (dsm, dst) = (Mat::row_major(ds, g.t), Mat::transposed(ds, g.t));
            let pt = Mat::transposed(p, g.t);
            let [(dq, qp), (dk, kp), (dv, vp)] = out;
            // SAFETY: each task writes its own head of dq, dk and dv, and the three parts
            // never overlap (distinct buffers, or distinct thirds of one).
            unsafe {
                dq.product(g, g.t, dsm, s.k.1.mat(s.k.0, g, item), qp, item)?;
                dk.product(g, g.t, dst, s.q.1.mat(s.q.0, g, item), kp, item)?;
                dv.product(g, g.t, pt, dyp.mat(s.dy, g, item), vp, item)
            }
        },
    )
}

/// GPT-2's attention from its fused projection `qkv [b, t, 3d]`: holds `P` for backward.
struct Packed {
    g: Geometry,
    p: Tensor,
}

impl CustomOp1 for Packed {
    fn name(&self) -> &'static str {
        "causal-attention-packed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let qkv = f32s(s, l, "attention qkv")?;
        let g = &self.g;
        let y = with_f32(&self.p, "attention probabilities", |p| {
            attend(g, p, (qkv, Part::packed(g, 2)))
        })?;
        Ok((CpuStorage::F32(y), Shape::from((g.b, g.t, g.d()))))
    }

    fn bwd(&self, qkv: &Tensor, _y: &Tensor, dy: &Tensor) -> CResult<Option<Tensor>> {
        let g = &self.g;
        let dy = dy.contiguous()?;
        let mut dqkv = vec![0f32; qkv.elem_count()];
        with_f32(qkv, "attention qkv", |x| {
            with_f32(&self.p, "attention probabilities", |p| {
                with_f32(&dy, "attention dy", |dy| {
                    let saved = Saved {
                        q: (x, Part::packed(g, 0)),
                        k: (x, Part::packed(g, 1)),
                        v: (x, Part::packed(g, 2)),
                        p,
                        dy,
                    };
                    let out = Out::new(&mut dqkv);
                    let parts = [0, 1, 2].map(|w| (&out, Part::packed(g, w)));
                    backward(g, &saved, parts)
                })
            })
        })?;
        Ok(Some(Tensor::from_vec(dqkv, qkv.shape(), qkv.device())?))
    }
}

/// Attention over separate `q`, `k`, `v [b, t, d]` (OPT's projections): holds `P`.
struct Separate {
    g: Geometry,
    p: Tensor,
}

impl CustomOp3 for Separate {
    fn name(&self) -> &'static str {
        "causal-attention"
    }

    fn cpu_fwd(
        &self,
        _s1: &CpuStorage,
        _l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let g = &self.g;
        let v = f32s(s3, l3, "attention v")?;
        let y = with_f32(&self.p, "attention probabilities", |p| {
            attend(g, p, (v, Part::whole(g)))
        })?;
        Ok((CpuStorage::F32(y), Shape::from((g.b, g.t, g.d()))))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = &self.g;
        let dy = dy.contiguous()?;
        let n = q.elem_count();
        let (mut dq, mut dk, mut dv) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        with_f32(q, "attention q", |qv| {
            with_f32(k, "attention k", |kv| {
                with_f32(v, "attention v", |vv| {
                    with_f32(&self.p, "attention probabilities", |p| {
                        with_f32(&dy, "attention dy", |dy| {
                            let w = Part::whole(g);
                            let saved = Saved {
                                q: (qv, w),
                                k: (kv, w),
                                v: (vv, w),
                                p,
                                dy,
                            };
                            let outs = [Out::new(&mut dq), Out::new(&mut dk), Out::new(&mut dv)];
                            backward(g, &saved, [(&outs[0], w), (&outs[1], w), (&outs[2], w)])
                        })
                    })
                })
            })
        })?;
        let dev = q.device();
        let t = |d: Vec<f32>| Tensor::from_vec(d, q.shape(), dev);
        Ok((Some(t(dq)?), Some(t(dk)?), Some(t(dv)?)))
    }
}

/// `[b, t, w]` of an attention input, checked against `n_head`: `w = parts · d`.
fn geometry(x: &Tensor, n_head: usize, parts: usize) -> CResult<Geometry> {
    let (b, t, w) = x.dims3()?;
    if n_head == 0 || w % (parts * n_head) != 0 {
        return Err(msg(format!(
            "attention: width {w} is not {parts} x {n_head} heads of equal width"
        )));
    }
    Ok(Geometry {
        b,
        t,
        h: n_head,
        hd: w / parts / n_head,
    })
}

/// Causal self-attention `[b, t, d]` of GPT-2's `qkv [b, t, 3d]` (q, k, v side by side).
pub(crate) fn packed_attention(qkv: &Tensor, n_head: usize) -> CResult<Tensor> {
    let g = geometry(qkv, n_head, 3)?;
    let qkv = qkv.contiguous()?;
    let p = with_f32(&qkv, "attention qkv", |x| {
        probs(&g, (x, Part::packed(&g, 0)), (x, Part::packed(&g, 1)))
    })?;
    let p = Tensor::from_vec(p, (g.b, g.h, g.t, g.t), qkv.device())?;
    qkv.apply_op1(Packed { g, p })
}

/// Causal self-attention `[b, t, d]` of separate `q`, `k`, `v [b, t, d]`.
pub(crate) fn separate_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    n_head: usize,
) -> CResult<Tensor> {
    let g = geometry(q, n_head, 1)?;
    if k.dims() != q.dims() || v.dims() != q.dims() {
        return Err(msg(format!(
            "attention: q {:?}, k {:?}, v {:?} differ",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let p = with_f32(&q, "attention q", |qv| {
        with_f32(&k, "attention k", |kv| {
            probs(&g, (qv, Part::whole(&g)), (kv, Part::whole(&g)))
        })
    })?;
    let p = Tensor::from_vec(p, (g.b, g.h, g.t, g.t), q.device())?;
    q.apply_op3(&k, &v, Separate { g, p })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused_linear::tests::max_rel_diff;
    use candle_core::{DType, Device, Var, D};

    /// Attention of Candle's primitive ops only (autograd's own backward).
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, n_head: usize) -> Tensor {
        let (b, t, d) = q.dims3().unwrap();
        let hd = d / n_head;
        let heads = |x: &Tensor| {
            x.reshape((b, t, n_head, hd))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let (q, k, v) = (heads(q), heads(k), heads(v));
        let s = (q.matmul(&k.t().unwrap().contiguous().unwrap()).unwrap()
            * (1.0 / (hd as f64).sqrt()))
        .unwrap();
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| (0..t).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), q.device()).unwrap();
        let p = candle_nn::ops::softmax(&s.broadcast_add(&mask).unwrap(), D::Minus1).unwrap();
        let y = p.matmul(&v).unwrap();
        y.transpose(1, 2).unwrap().reshape((b, t, d)).unwrap()
    }

    fn rand(shape: &[usize], seed: u64) -> Var {
        let dev = Device::Cpu;
        let n: usize = shape.iter().product();
        // A fixed pseudo-random pattern in [-2, 2): the test is the same on every run.
        let data: Vec<f32> = (0..n as u64)
            .map(|i| {
                let x = (i.wrapping_add(seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as f32;
                x / (1u64 << 24) as f32 * 4.0 - 2.0
            })
            .collect();
        Var::from_tensor(&Tensor::from_vec(data, shape, &dev).unwrap()).unwrap()
    }

    #[test]
    fn packed_attention_matches_candle_ops_with_gradients() {
        // Sizes that fill no kernel tile evenly; two samples, three heads of width 5.
        let (b, t, h, hd) = (2, 11, 3, 5);
        let d = h * hd;
        let qkv = rand(&[b, t, 3 * d], 1);
        let r = rand(&[b, t, d], 2).as_tensor().detach();
        let fused = packed_attention(qkv.as_tensor(), h).unwrap();
        let x = qkv.as_tensor();
        let (q, k, v) = (
            x.narrow(2, 0, d).unwrap(),
            x.narrow(2, d, d).unwrap(),
            x.narrow(2, 2 * d, d).unwrap(),
        );
        let want = reference(&q, &k, &v, h);
        assert_eq!(fused.dims(), &[b, t, d]);
        assert!(max_rel_diff(&fused, &want) < 1e-5);
        let grad = |y: &Tensor| {
            let g = (y * &r).unwrap().sum_all().unwrap().backward().unwrap();
            g.get(qkv.as_tensor()).unwrap().clone()
        };
        let (gf, gw) = (grad(&fused), grad(&want));
        assert!(max_rel_diff(&gf, &gw) < 1e-5, "dqkv differs");
    }

    #[test]
    fn separate_attention_matches_candle_ops_with_gradients() {
        let (b, t, h, hd) = (3, 9, 2, 6);
        let d = h * hd;
        let (q, k, v) = (
            rand(&[b, t, d], 3),
            rand(&[b, t, d], 4),
            rand(&[b, t, d], 5),
        );
        let r = rand(&[b, t, d], 6).as_tensor().detach();
        let (qt, kt, vt) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
        let fused = separate_attention(qt, kt, vt, h).unwrap();
        let want = reference(qt, kt, vt, h);
        assert!(max_rel_diff(&fused, &want) < 1e-5);
        let grads = |y: &Tensor| {
            let g = (y * &r).unwrap().sum_all().unwrap().backward().unwrap();
            [qt, kt, vt].map(|x| g.get(x).unwrap().clone())
        };
        for (name, (a, b)) in ["dq", "dk", "dv"]
            .iter()
            .zip(grads(&fused).iter().zip(&grads(&want)))
        {
            assert!(max_rel_diff(a, b) < 1e-5, "{name} differs");
        }
    }

    #[test]
    fn attention_refuses_a_width_the_heads_do_not_divide() {
        let x = Tensor::zeros((1, 4, 10), DType::F32, &Device::Cpu).unwrap();
        assert!(packed_attention(&x, 4).is_err());
        assert!(separate_attention(&x, &x, &x, 3).is_err());
        let y = Tensor::zeros((1, 4, 12), DType::F32, &Device::Cpu).unwrap();
        assert!(separate_attention(&x, &x, &y, 2).is_err());
    }
}
