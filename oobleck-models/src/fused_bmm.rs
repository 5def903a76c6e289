//! Batched matrix products (attention's `q kᵀ` and `p v`) on the sgemm the linear layers use,
//! with a hand-written backward.
//!
//! Candle's CPU matmul runs on the `gemm` crate, whose stable build has no AVX-512 kernel:
//! on the 2-core AVX-512 machines here its `x2x6` AVX2 kernel took ~4% of a training step of
//! `oobleck bench train` for ~3% of the FLOPs. Each batch item (a head of a sample) is one
//! single-threaded `sgemm`; the items run in parallel on rayon's pool.

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::fused::{f32s, msg, with_f32, CResult};
use crate::fused_linear::{sgemm_one, Mat};

/// `c[i] = a[i] · b[i]ᵀ` (`trans_b`, `b` stored `[.., n, k]`) or `c[i] = a[i] · b[i]` (`b` stored
/// `[.., k, n]`), for `a [.., m, k]`; every leading dimension is a batch dimension.
pub(crate) struct Bmm {
    pub trans_b: bool,
}

/// One operand of a batched product: `items` row-major matrices of `rows x cols` stored one
/// after the other, used as they are or transposed.
#[derive(Clone, Copy)]
struct Operand<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    transposed: bool,
}

impl<'a> Operand<'a> {
    fn item(&self, i: usize) -> Mat<'a> {
        let len = self.rows * self.cols;
        let data = &self.data[i * len..(i + 1) * len];
        if self.transposed {
            Mat::transposed(data, self.cols)
        } else {
            Mat::row_major(data, self.cols)
        }
    }

    /// `(rows, cols)` of the matrix as used.
    fn used(&self) -> (usize, usize) {
        if self.transposed {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        }
    }
}

/// `op(a[i]) · op(b[i])` for each of `items` batch items, row-major `[items, m, n]`.
fn batched(items: usize, a: Operand, b: Operand) -> CResult<Vec<f32>> {
    let ((m, k), (k2, n)) = (a.used(), b.used());
    if k != k2 || a.data.len() != items * m * k || b.data.len() != items * k * n {
        return Err(msg(format!(
            "batched matmul: {items} items of {m}x{k} ({} elements) and {k2}x{n} ({} elements)",
            a.data.len(),
            b.data.len()
        )));
    }
    let mut c = vec![0f32; items * m * n];
    if m * n == 0 {
        return Ok(c);
    }
    c.par_chunks_mut(m * n)
        .enumerate()
        .try_for_each(|(i, ci)| sgemm_one(m, k, n, a.item(i), b.item(i), ci))?;
    Ok(c)
}

impl Bmm {
    /// `(items, m, k, n)` of `a [.., m, k]` and `b`, checked.
    fn dims(&self, a: &[usize], b: &[usize]) -> CResult<(usize, usize, usize, usize)> {
        let bad = || {
            msg(format!(
                "batched matmul: a {a:?}, b {b:?} (trans_b {})",
                self.trans_b
            ))
        };
        let r = a.len();
        if r < 2 || b.len() != r || a[..r - 2] != b[..r - 2] {
            return Err(bad());
        }
        let (m, k) = (a[r - 2], a[r - 1]);
        let (kb, n) = if self.trans_b {
            (b[r - 1], b[r - 2])
        } else {
            (b[r - 2], b[r - 1])
        };
        if k != kb {
            return Err(bad());
        }
        Ok((a[..r - 2].iter().product(), m, k, n))
    }

    /// `b` as the operand of `a · op(b)`.
    fn b_operand<'a>(&self, b: &'a [f32], k: usize, n: usize) -> Operand<'a> {
        let (rows, cols) = if self.trans_b { (n, k) } else { (k, n) };
        Operand {
            data: b,
            rows,
            cols,
            transposed: self.trans_b,
        }
    }
}

impl CustomOp2 for Bmm {
    fn name(&self) -> &'static str {
        "batched-matmul"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let (items, m, k, n) = self.dims(l1.dims(), l2.dims())?;
        let a = f32s(s1, l1, "batched matmul a")?;
        let b = f32s(s2, l2, "batched matmul b")?;
        let a = Operand {
            data: a,
            rows: m,
            cols: k,
            transposed: false,
        };
        let c = batched(items, a, self.b_operand(b, k, n))?;
        let mut dims = l1.dims().to_vec();
        *dims.last_mut().expect("rank checked above") = n;
        Ok((CpuStorage::F32(c), Shape::from(dims)))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _c: &Tensor,
        dc: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let (items, m, k, n) = self.dims(a.dims(), b.dims())?;
        let dc = dc.contiguous()?;
        let (da, db) = with_f32(a, "batched matmul a", |av| {
            with_f32(b, "batched matmul b", |bv| {
                with_f32(&dc, "batched matmul dc", |g| {
                    let op = |data, rows, cols, transposed| Operand {
                        data,
                        rows,
                        cols,
                        transposed,
                    };
                    let g_used = op(g, m, n, false); // dc [m, n]
                    let g_t = op(g, m, n, true); // dcᵀ [n, m]
                    let a_used = op(av, m, k, false); // a [m, k]
                    let a_t = op(av, m, k, true); // aᵀ [k, m]
                                                  // da [m, k] = dc · op(b)ᵀ; op(b)ᵀ is b as stored when trans_b.
                    let b_back = if self.trans_b {
                        op(bv, n, k, false)
                    } else {
                        op(bv, k, n, true)
                    };
                    let da = batched(items, g_used, b_back)?;
                    // db in b's stored layout: [n, k] = dcᵀ · a, or [k, n] = aᵀ · dc.
                    let db = if self.trans_b {
                        batched(items, g_t, a_used)?
                    } else {
                        batched(items, a_t, g_used)?
                    };
                    Ok((da, db))
                })
            })
        })?;
        let dev = a.device();
        Ok((
            Some(Tensor::from_vec(da, a.shape(), dev)?),
            Some(Tensor::from_vec(db, b.shape(), dev)?),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused_linear::tests::max_rel_diff;
    use candle_core::{Device, Var};

    #[test]
    fn batched_matmul_matches_candles_with_gradients_in_both_layouts() {
        let dev = Device::Cpu;
        // Two batch dimensions (samples, heads), sizes that fill no kernel tile evenly.
        let (s, h, m, k, n) = (2, 3, 19, 7, 23);
        let rand = |shape: &[usize]| {
            Var::from_tensor(&Tensor::randn(0f32, 1.0, shape, &dev).unwrap()).unwrap()
        };
        let a = rand(&[s, h, m, k]);
        let r = Tensor::randn(0f32, 1.0, (s, h, m, n), &dev).unwrap();
        for trans_b in [true, false] {
            let b = if trans_b {
                rand(&[s, h, n, k])
            } else {
                rand(&[s, h, k, n])
            };
            let c = a.apply_op2(&b, Bmm { trans_b }).unwrap();
            let bm = if trans_b {
                b.t().unwrap()
            } else {
                b.as_tensor().clone()
            };
            let c_ref = a.matmul(&bm).unwrap();
            assert_eq!(c.dims(), c_ref.dims());
            assert!(max_rel_diff(&c, &c_ref) < 1e-6, "trans_b {trans_b}");
            let g = (&c * &r).unwrap().sum_all().unwrap().backward().unwrap();
            let g_ref = (&c_ref * &r)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            for v in [&a, &b] {
                let diff = max_rel_diff(g.get(v).unwrap(), g_ref.get(v).unwrap());
                assert!(diff < 1e-6, "trans_b {trans_b}: gradient differs by {diff}");
            }
        }
    }

    #[test]
    fn mismatched_shapes_are_refused() {
        let dev = Device::Cpu;
        let a = Tensor::zeros((2, 3, 4), candle_core::DType::F32, &dev).unwrap();
        let b = Tensor::zeros((2, 5, 4), candle_core::DType::F32, &dev).unwrap();
        let e = a.apply_op2(&b, Bmm { trans_b: false }).unwrap_err();
        assert!(e.to_string().contains("batched matmul"), "{e}");
        let b3 = Tensor::zeros((3, 5, 4), candle_core::DType::F32, &dev).unwrap();
        assert!(a.apply_op2(&b3, Bmm { trans_b: true }).is_err());
    }
}
