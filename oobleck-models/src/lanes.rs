//! Element-wise math and reductions of the fused CPU kernels, written so that their loops
//! vectorise: no calls, no branches, and reductions in several independent lanes.

/// `exp` by range reduction and the Cephes degree-6 polynomial (relative error ~2e-7, like
/// libm's `expf`), written without branches or calls so that loops over it vectorise.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Below -87.3 the result would be subnormal: flush to (nearly) zero as 2^-126 · exp(r).
    let x = x.clamp(-87.3, 88.7);
    // Round to nearest by the 1.5·2^23 trick (no `round` call, which SSE2 cannot vectorise).
    let n = (x * LOG2E + 12_582_912.0) - 12_582_912.0;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Lanes of the reductions below: independent partial results that the compiler keeps in one
/// AVX-512 (or two AVX2) registers. A float reduction in one accumulator cannot be reordered,
/// so it runs one element at a time, and a loop that also computes `exp` into it does too:
/// the LM head's softmax over `[2048, 50257]` logits took ~400 ms of a ~1 s forward that way.
const LANES: usize = 16;

/// The largest element of `x` (`-inf` for none), in [`LANES`] lanes so the loop vectorises.
#[inline]
pub(crate) fn max_f32(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = if v > *a { v } else { *a };
        }
    }
    rest.iter()
        .chain(acc.iter())
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

/// The sum of `x`, in [`LANES`] partial sums so the loop vectorises.
#[inline]
pub(crate) fn sum_f32(x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + rest.iter().sum::<f32>()
}

/// `Σ a·b`, in [`LANES`] partial sums so the loop vectorises.
#[inline]
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let rest: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for ((s, &p), &q) in acc.iter_mut().zip(x).zip(y) {
            *s += p * q;
        }
    }
    acc.iter().sum::<f32>() + rest
}

/// `tanh(x) = 1 - 2 / (exp(2x) + 1)`, exact at the saturated ends.
#[inline(always)]
pub(crate) fn tanh_f32(x: f32) -> f32 {
    1.0 - 2.0 / (exp_f32(2.0 * x) + 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_matches_libm() {
        let mut worst = 0f32;
        for i in -8000..=8000 {
            let x = i as f32 * 0.01;
            let rel = ((exp_f32(x) - x.exp()) / x.exp()).abs();
            worst = worst.max(rel);
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert!(exp_f32(f32::NEG_INFINITY) < 1e-37);
        assert!((tanh_f32(30.0) - 1.0).abs() < 1e-7 && (tanh_f32(-30.0) + 1.0).abs() < 1e-7);
    }

    #[test]
    fn lane_reductions_equal_the_plain_ones_at_every_length() {
        for len in [0, 1, 15, 16, 17, 40, 50257] {
            let x: Vec<f32> = (0..len)
                .map(|i| ((i * 37) % 101) as f32 * 0.25 - 9.0)
                .collect();
            let y: Vec<f32> = (0..len).map(|i| ((i * 11) % 7) as f32 - 3.0).collect();
            let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            assert_eq!(max_f32(&x), max, "max of {len}");
            // Exact: every partial sum here is a multiple of 0.25 well inside f32's integers.
            assert_eq!(
                sum_f32(&x),
                x.iter().map(|&v| f64::from(v)).sum::<f64>() as f32
            );
            let dot: f64 = x.iter().zip(&y).map(|(a, b)| f64::from(a * b)).sum();
            assert_eq!(dot_f32(&x, &y), dot as f32, "dot of {len}");
        }
        assert_eq!(max_f32(&[f32::NEG_INFINITY, -3.0]), -3.0);
    }
}
