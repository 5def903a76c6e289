//! Linear layers (`x W + b`) on our own parallel sgemm, with hand-written backward.
//!
//! Candle's CPU matmul runs on the `gemm` crate, which reached ~40 GFLOP/s per core on the
//! AVX2 dev machine where `matrixmultiply` reaches ~70 and PyTorch's BLAS ~85; the matmuls
//! are ~95% of a GPT training step's FLOPs. Work is split by rows of the output over rayon's
//! pool, one single-threaded `sgemm` per task.

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};
use rayon::prelude::*;

use oobleck_core::model::weight_grads::{self, Deferred};

use crate::fused::{f32s, msg, with_f32, CResult};

/// A read-only strided matrix view: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl<'a> Mat<'a> {
    pub fn row_major(data: &'a [f32], cols: usize) -> Self {
        Self {
            data,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose of a row-major matrix with `cols` columns.
    pub fn transposed(data: &'a [f32], cols: usize) -> Self {
        Self {
            data,
            rs: 1,
            cs: cols,
        }
    }

    /// Whether every element of a `rows x cols` view lies inside `data`.
    pub(crate) fn fits(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len()
    }
}

/// `c[m, n] = a[m, k] · b[k, n] + beta · c` with `c` row-major, in parallel over row blocks.
pub(crate) fn gemm(
    m: usize,
    k: usize,
    n: usize,
    a: Mat,
    b: Mat,
    c: &mut [f32],
    beta: f32,
) -> CResult<()> {
    check(m, k, n, &a, &b, c.len())?;
    // SAFETY: `c` holds m x n initialised elements, borrowed mutably for the call.
    unsafe { gemm_raw(m, k, n, a, b, 1.0, SharedMut(c.as_mut_ptr()), beta) };
    Ok(())
}

/// A new row-major `alpha · a[m, k] · b[k, n]`, written once: no zero fill first (on the LM
/// head's `[2048, 50257]` logits a zero fill is a 412 MB pass of its own).
pub(crate) fn gemm_new(
    m: usize,
    k: usize,
    n: usize,
    a: Mat,
    b: Mat,
    alpha: f32,
) -> CResult<Vec<f32>> {
    check(m, k, n, &a, &b, m * n)?;
    let mut c: Vec<f32> = Vec::with_capacity(m * n);
    let out = SharedMut(c.spare_capacity_mut().as_mut_ptr().cast());
    // SAFETY: `c` has capacity for m x n elements; with beta = 0 sgemm writes every element of
    // C without reading it (matrixmultiply: "if β is zero, C does not need to be
    // initialized"), also when k = 0 (it writes zeros), so all m x n are set afterwards.
    unsafe {
        gemm_raw(m, k, n, a, b, alpha, out, 0.0);
        c.set_len(m * n);
    }
    Ok(c)
}

/// Whether `a [m, k]`, `b [k, n]` and an output of `c_len` elements fit a product.
fn check(m: usize, k: usize, n: usize, a: &Mat, b: &Mat, c_len: usize) -> CResult<()> {
    if !a.fits(m, k) || !b.fits(k, n) || c_len != m * n {
        return Err(msg(format!(
            "gemm {m}x{k}x{n}: operands of {}, {} and {c_len} elements do not fit",
            a.data.len(),
            b.data.len(),
        )));
    }
    Ok(())
}

/// The parallel product behind [`gemm`] and [`gemm_new`].
///
/// # Safety
/// `c` must be valid for writes of m x n elements (and reads, when `beta` is not 0), and
/// nothing else may touch them during the call; the operands must pass [`check`].
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_raw(
    m: usize,
    k: usize,
    n: usize,
    a: Mat,
    b: Mat,
    alpha: f32,
    c: SharedMut,
    beta: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    let threads = rayon::current_num_threads().max(1);
    // Wide outputs (the LM head: n = vocab) split the columns, so each task packs only its
    // slice of B and all tasks share the small A; others split rows, in blocks of a multiple
    // of 16 (the kernel's height), at least 64 rows each.
    let wide = n > m && n >= 128;
    let (block, blocks) = if wide {
        let cols = n.div_ceil(threads).next_multiple_of(16).min(n);
        (cols, n.div_ceil(cols))
    } else {
        let rows = m.div_ceil(threads).next_multiple_of(16).max(64).min(m);
        (rows, m.div_ceil(rows))
    };
    let c = &c;
    (0..blocks).into_par_iter().for_each(|t| {
        let j0 = t * block;
        // Task t computes columns j0.. (wide) or rows j0.. of C.
        let (mr, nc, a0, b0, c0) = if wide {
            (m, block.min(n - j0), 0, j0 * b.cs, j0)
        } else {
            (block.min(m - j0), n, j0 * a.rs, 0, j0 * n)
        };
        // SAFETY: `check` put every element (r, j) of A (r < m, j < k) and of B inside its
        // slice, and this task's rows or columns start at offsets a0 / b0 of them; it writes
        // only its own rows or columns of C (valid by the caller's contract), disjoint from
        // every other task's, and all tasks join before the caller goes on.
        unsafe {
            matrixmultiply::sgemm(
                mr,
                k,
                nc,
                alpha,
                a.data.as_ptr().add(a0),
                a.rs as isize,
                a.cs as isize,
                b.data.as_ptr().add(b0),
                b.rs as isize,
                b.cs as isize,
                beta,
                c.0.add(c0),
                n as isize,
                1,
            )
        }
    });
}

/// `c[m, n] = a[m, k] · b[k, n]` with `c` row-major, on the calling thread (a task of a
/// parallel caller, as the batched products of `fused_bmm.rs` are).
pub(crate) fn sgemm_one(
    m: usize,
    k: usize,
    n: usize,
    a: Mat,
    b: Mat,
    c: &mut [f32],
) -> CResult<()> {
    check(m, k, n, &a, &b, c.len())?;
    // SAFETY: `check` made C exactly m x n, row-major, borrowed mutably for the call.
    unsafe { sgemm_strided(m, k, n, a, b, c.as_mut_ptr(), n) };
    Ok(())
}

/// `c = a[m, k] · b[k, n]` on the calling thread, `c` an m x n view with row stride `rsc`
/// (attention writes one head's columns of a wider row this way).
///
/// # Safety
/// `a` and `b` must fit (`Mat::fits`), `c` must be valid for writes of
/// `(m - 1) · rsc + n` elements, and nothing else may touch the m x n written ones meanwhile.
pub(crate) unsafe fn sgemm_strided(
    m: usize,
    k: usize,
    n: usize,
    a: Mat,
    b: Mat,
    c: *mut f32,
    rsc: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: the caller's contract; beta is 0, so C is only written (all of it, also when
    // k = 0).
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.data.as_ptr(),
            a.rs as isize,
            a.cs as isize,
            b.data.as_ptr(),
            b.rs as isize,
            b.cs as isize,
            0.0,
            c,
            rsc as isize,
            1,
        )
    }
}

/// The output pointer shared by the tasks of one product, each of which writes its own rows
/// or columns.
struct SharedMut(*mut f32);
// SAFETY: only used by `gemm_raw`, whose tasks write disjoint parts of one output.
unsafe impl Sync for SharedMut {}

/// `y = x · W + b` for `x [rows, in]`, bias `[out]`, and the weight stored `[in, out]`
/// (GPT-2 Conv1D) or `[out, in]` (`torch.nn.Linear`, `out_in = true`).
pub(crate) struct Linear {
    pub out_in: bool,
}

impl Linear {
    /// `(in, out)` from the weight's dims.
    fn dims(&self, w: &[usize]) -> CResult<(usize, usize)> {
        match (w, self.out_in) {
            ([o, i], true) => Ok((*i, *o)),
            ([i, o], false) => Ok((*i, *o)),
            _ => Err(msg(format!("linear: weight must be 2-d, got {w:?}"))),
        }
    }

    /// `W` as a `[in, out]` view of the stored weight.
    fn w_view<'a>(&self, w: &'a [f32], inp: usize, out: usize) -> Mat<'a> {
        if self.out_in {
            Mat::transposed(w, inp)
        } else {
            Mat::row_major(w, out)
        }
    }
}

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "linear"
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
        let (inp, out) = self.dims(l2.dims())?;
        let x = f32s(s1, l1, "linear x")?;
        let w = f32s(s2, l2, "linear weight")?;
        let b = f32s(s3, l3, "linear bias")?;
        if b.len() != out || inp == 0 || x.len() % inp != 0 || l1.dims().last() != Some(&inp) {
            return Err(msg(format!(
                "linear: x {:?}, weight {:?}, bias {:?}",
                l1.dims(),
                l2.dims(),
                l3.dims()
            )));
        }
        let rows = x.len() / inp;
        let mut y = Vec::with_capacity(rows * out);
        for _ in 0..rows {
            y.extend_from_slice(b);
        }
        gemm(
            rows,
            inp,
            out,
            Mat::row_major(x, inp),
            self.w_view(w, inp, out),
            &mut y,
            1.0,
        )?;
        let mut dims = l1.dims().to_vec();
        *dims.last_mut().expect("x has a last dim, checked above") = out;
        Ok((CpuStorage::F32(y), Shape::from(dims)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (inp, out) = self.dims(w.dims())?;
        let rows = x.elem_count() / inp;
        let dy = dy.contiguous()?;
        let dx = with_f32(w, "linear weight", |wv| {
            with_f32(&dy, "linear dy", |g| {
                // dx [rows, in] = dy [rows, out] · Wᵀ [out, in].
                let wt = if self.out_in {
                    Mat::row_major(wv, inp)
                } else {
                    Mat::transposed(wv, out)
                };
                gemm_new(rows, out, inp, Mat::row_major(g, out), wt, 1.0)
            })
        })?;
        let dx = Tensor::from_vec(dx, x.shape(), x.device())?;
        // The weight gradients: now, or in a zero-bubble schedule's W (`weight_grads`).
        let out_in = self.out_in;
        let params = [w, b];
        let (x, w, b) = (x.clone(), w.clone(), b.clone());
        let work: Deferred = Box::new(move || {
            let (dw, db) = linear_weight_grads(&x, &dy, out_in, inp, out)?;
            let dev = x.device();
            let dw = Tensor::from_vec(dw, w.shape(), dev)?;
            let db = Tensor::from_vec(db, out, dev)?;
            Ok(vec![(w, dw), (b, db)])
        });
        match weight_grads::defer(&params, work) {
            None => Ok((Some(dx), None, None)),
            Some(now) => {
                let mut grads = now()?.into_iter().map(|(_, g)| g);
                Ok((Some(dx), grads.next(), grads.next()))
            }
        }
    }
}

/// `(dW, db)` of a linear layer from its input `x [rows, in]` and output gradient
/// `dy [rows, out]`, `dW` in the stored layout: `[in, out] = xᵀ · dy`, or `[out, in] = dyᵀ · x`.
fn linear_weight_grads(
    x: &Tensor,
    dy: &Tensor,
    out_in: bool,
    inp: usize,
    out: usize,
) -> CResult<(Vec<f32>, Vec<f32>)> {
    let rows = x.elem_count() / inp;
    with_f32(x, "linear x", |xv| {
        with_f32(dy, "linear dy", |g| {
            let dw = if out_in {
                let (a, b) = (Mat::transposed(g, out), Mat::row_major(xv, inp));
                gemm_new(out, rows, inp, a, b, 1.0)?
            } else {
                let (a, b) = (Mat::transposed(xv, inp), Mat::row_major(g, out));
                gemm_new(inp, rows, out, a, b, 1.0)?
            };
            Ok((dw, column_sums(g, out)))
        })
    })
}

/// Sums of the columns of a row-major `[rows, cols]` matrix.
fn column_sums(g: &[f32], cols: usize) -> Vec<f32> {
    let rows_per_task = (16384 / cols.max(1)).max(1);
    g.par_chunks(rows_per_task * cols)
        .map(|chunk| {
            let mut s = vec![0f32; cols];
            for row in chunk.chunks(cols) {
                s.iter_mut().zip(row).for_each(|(a, b)| *a += b);
            }
            s
        })
        .reduce(
            || vec![0f32; cols],
            |mut a, b| {
                a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
                a
            },
        )
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Largest absolute difference over the largest magnitude of `b` (at least 1).
    pub(crate) fn max_rel_diff(a: &Tensor, b: &Tensor) -> f32 {
        let max_abs = |t: Tensor| t.abs()?.max_all()?.to_scalar::<f32>();
        let d = (a - b).and_then(max_abs).unwrap();
        d / max_abs(b.clone()).unwrap().max(1.0)
    }

    #[test]
    fn linear_matches_matmul_in_both_weight_layouts_with_gradients() {
        // 130 rows: several row blocks, the last one partial; then 6 rows x 200 columns: the
        // column split.
        for (rows, inp, out) in [(130, 24, 40), (6, 24, 200)] {
            check_linear(rows, inp, out);
        }
    }

    fn check_linear(rows: usize, inp: usize, out: usize) {
        let dev = Device::Cpu;
        let x =
            Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, rows / 2, inp), &dev).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::randn(0f32, 1.0, out, &dev).unwrap()).unwrap();
        let r = Tensor::randn(0f32, 1.0, (2, rows / 2, out), &dev).unwrap();
        for out_in in [false, true] {
            let wshape = if out_in { (out, inp) } else { (inp, out) };
            let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, wshape, &dev).unwrap()).unwrap();
            let y = x.apply_op3(&w, &b, Linear { out_in }).unwrap();
            let wm = if out_in {
                w.t().unwrap()
            } else {
                w.as_tensor().clone()
            };
            let y_ref = x.broadcast_matmul(&wm).unwrap().broadcast_add(&b).unwrap();
            assert!(max_rel_diff(&y, &y_ref) < 1e-6);
            let g = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
            let g_ref = (&y_ref * &r)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            for v in [&x, &w, &b] {
                let diff = max_rel_diff(g.get(v).unwrap(), g_ref.get(v).unwrap());
                assert!(diff < 1e-6, "out_in {out_in}: gradient differs by {diff}");
            }
        }
    }
}
