//! Global-norm gradient clipping, as `torch.nn.utils.clip_grad_norm_` (L2 norm).
//!
//! The norm is accumulated in f64 over gradients in name order, so it is the same number in
//! every process whatever order a map yields (PyTorch accumulates per-tensor norms in the
//! gradients' dtype; the two agree to f32 rounding). The scaling then matches PyTorch:
//! `coef = max_norm / (norm + 1e-6)`, applied only when `coef < 1`.

use std::collections::HashMap;

use candle_core::{DType, Tensor};

use crate::{Error, Result};

/// The global L2 norm of all gradients: `sqrt(sum over names, in sorted order, of sum(g^2))`,
/// accumulated in f64.
pub fn global_grad_norm(grads: &HashMap<String, Tensor>) -> Result<f64> {
    let mut names: Vec<&String> = grads.keys().collect();
    names.sort();
    let mut sum_sq = 0.0f64;
    for name in names {
        let g = &grads[name];
        if !g.dtype().is_float() {
            return Err(Error::Optimizer {
                name: name.clone(),
                reason: format!("gradient has dtype {:?}; expected a float", g.dtype()),
            });
        }
        sum_sq += match super::fused::sum_sq_f64(g)? {
            Some(s) => s,
            None => g
                .to_dtype(DType::F64)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f64>()?,
        };
    }
    Ok(sum_sq.sqrt())
}

/// Scales all gradients so that their global L2 norm is at most `max_norm`, and returns the
/// norm before clipping. A non-finite norm (an overflowed or NaN gradient) is returned with the
/// gradients untouched: the caller decides whether to skip the step.
pub fn clip_grad_norm(grads: &mut HashMap<String, Tensor>, max_norm: f64) -> Result<f64> {
    if !(max_norm.is_finite() && max_norm > 0.0) {
        return Err(Error::InvalidArgument {
            op: "clip_grad_norm",
            name: "max_norm",
            value: max_norm,
            want: "finite and > 0",
        });
    }
    let norm = global_grad_norm(grads)?;
    if !norm.is_finite() {
        return Ok(norm);
    }
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        for g in grads.values_mut() {
            *g = g.affine(coef, 0.0)?;
        }
    }
    Ok(norm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn grads() -> HashMap<String, Tensor> {
        let dev = Device::Cpu;
        HashMap::from([
            ("a".to_string(), Tensor::new(&[3.0f32, 4.0], &dev).unwrap()),
            ("b".to_string(), Tensor::new(&[[12.0f32]], &dev).unwrap()),
        ])
    }

    fn vals(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// Expected values from PyTorch 2.15.0: `clip_grad_norm_` on grads [3, 4] and [[12]] with
    /// max_norm 6.5 returned 13.0 and left [1.4999998807907104, 1.9999998807907104] and
    /// [[5.999999523162842]].
    #[test]
    fn scales_gradients_down_to_max_norm_like_torch() {
        let mut g = grads();
        let norm = clip_grad_norm(&mut g, 6.5).unwrap();
        assert_eq!(norm, 13.0);
        let got_a = vals(&g["a"]);
        let got_b = vals(&g["b"]);
        for (got, want) in got_a.iter().chain(&got_b).zip([
            1.499_999_880_790_710_4f64,
            1.999_999_880_790_710_4,
            5.999_999_523_162_842,
        ]) {
            assert!((*got as f64 - want).abs() <= 1e-6, "{got} vs {want}");
        }
        assert!((global_grad_norm(&g).unwrap() - 6.5).abs() < 1e-5);
    }

    #[test]
    fn leaves_gradients_alone_below_max_norm_or_when_not_finite() {
        let mut g = grads();
        assert_eq!(clip_grad_norm(&mut g, 100.0).unwrap(), 13.0);
        assert_eq!(vals(&g["a"]), vec![3.0, 4.0]);

        g.insert(
            "c".to_string(),
            Tensor::new(&[f32::INFINITY], &Device::Cpu).unwrap(),
        );
        assert!(clip_grad_norm(&mut g, 1.0).unwrap().is_infinite());
        assert_eq!(vals(&g["a"]), vec![3.0, 4.0]);
        assert!(clip_grad_norm(&mut g, 0.0).is_err());
    }
}
