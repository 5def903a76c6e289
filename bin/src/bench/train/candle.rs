//! The Candle side of `oobleck bench train`: what `train` does for one microbatch per step,
//! in this process.

use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use oobleck_core::model::{DropoutKey, ForwardCtx, LayeredModel, ParamSource, Stage};
use oobleck_core::optim::{clip_grad_norm, AdamW, AdamWConfig};
use oobleck_models::gpt2::Gpt;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{FrameworkResult, Shape};

/// Seeded random `(inputs, targets)` token ids, each `[b, t]`.
fn random_tokens(shape: &Shape, seed: u64, step: usize) -> Result<(Tensor, Tensor)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (step as u64).wrapping_mul(0x9e37_79b9));
    let n = shape.batch * shape.seq_len;
    let v = shape.vocab as u32;
    let inp: Vec<u32> = (0..n).map(|_| rng.random_range(0..v)).collect();
    let tgt: Vec<u32> = (0..n).map(|_| rng.random_range(0..v)).collect();
    let dims = (shape.batch, shape.seq_len);
    Ok((
        Tensor::from_vec(inp, dims, &Device::Cpu)?,
        Tensor::from_vec(tgt, dims, &Device::Cpu)?,
    ))
}

/// The optimizer settings of both sides (nanoGPT's GPT-2 recipe).
fn adamw_config() -> AdamWConfig {
    AdamWConfig {
        lr: 3e-4,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    }
}

/// How the Candle side computes: `fp32` (the comparison with PyTorch), `bf16` (mixed
/// precision, `train --precision bf16`), `recompute` (`train --recompute`) or both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Variant {
    pub dtype: DType,
    pub recompute: bool,
}

impl Variant {
    pub const FP32: Variant = Variant {
        dtype: DType::F32,
        recompute: false,
    };

    /// `fp32`, `bf16`, `recompute` or `bf16+recompute`.
    pub fn parse(name: &str) -> Result<Variant> {
        let (dtype, recompute) = match name {
            "fp32" => (DType::F32, false),
            "bf16" => (DType::BF16, false),
            "recompute" => (DType::F32, true),
            "bf16+recompute" => (DType::BF16, true),
            other => {
                bail!("--variants: `{other}` is not one of fp32, bf16, recompute, bf16+recompute")
            }
        };
        Ok(Variant { dtype, recompute })
    }

    pub fn name(&self) -> &'static str {
        match (self.dtype, self.recompute) {
            (DType::BF16, false) => "bf16",
            (DType::BF16, true) => "bf16+recompute",
            (_, true) => "recompute",
            _ => "fp32",
        }
    }
}

/// Runs the Candle side in this process: what `train` does for one microbatch per step.
pub fn bench_candle(
    shape: &Shape,
    warmup: usize,
    steps: usize,
    seed: u64,
    variant: Variant,
) -> Result<FrameworkResult> {
    let base_rss = proc_status_kib("VmRSS");
    let model = Gpt::new(shape.gpt_config())?;
    let layers = model.build_layers(
        0..model.num_layers(),
        &Device::Cpu,
        ParamSource::Init { seed },
    )?;
    let stage = Stage::new(layers)?;
    let params = stage.params();
    let mut opt = AdamW::new(adamw_config())?;
    let mut times = Vec::with_capacity(steps);
    let (mut first_loss, mut last_loss) = (f64::NAN, f64::NAN);
    let mut peak_reset = false;
    for step in 0..warmup + steps {
        if step == warmup {
            peak_reset = reset_peak_rss();
        }
        let (inp, tgt) = random_tokens(shape, seed, step)?;
        let ctx = ForwardCtx {
            targets: Some(&tgt),
            loss_scale: 1.0,
            train: true,
            dropout_key: DropoutKey {
                seed,
                iteration: step as u64,
                microbatch: 0,
            },
            rows: None,
            dtype: variant.dtype,
        };
        let t0 = Instant::now();
        let fwd = if variant.recompute {
            stage.forward_recompute(&inp, &ctx)?
        } else {
            stage.forward(&inp, &ctx)?
        };
        let loss = f64::from(fwd.output.to_dtype(DType::F32)?.to_scalar::<f32>()?);
        let t1 = Instant::now();
        let mut grads = stage.backward(fwd, None)?.params;
        let t2 = Instant::now();
        clip_grad_norm(&mut grads, 1.0)?;
        opt.step(&params, &grads, adamw_config().lr)?;
        let t3 = Instant::now();
        if !loss.is_finite() {
            bail!("Candle loss is {loss} at step {step}");
        }
        if step == 0 {
            first_loss = loss;
        }
        last_loss = loss;
        if step >= warmup {
            times.push([t1 - t0, t2 - t1, t3 - t2]);
        }
    }
    let mean = |i: usize| times.iter().map(|t| t[i].as_secs_f64()).sum::<f64>() / steps as f64;
    let (f, b, o) = (mean(0), mean(1), mean(2));
    let step_s = f + b + o;
    Ok(FrameworkResult {
        framework: match variant {
            Variant::FP32 => format!("candle {}", candle_version()),
            v => format!("candle {} {}", candle_version(), v.name()),
        },
        threads: candle_core::utils::get_num_threads(),
        tokens_per_s: shape.tokens_per_step() as f64 / step_s,
        step_s,
        forward_s: f,
        backward_s: b,
        optimizer_s: o,
        first_loss,
        last_loss,
        base_rss_bytes: base_rss.map(|k| k * 1024),
        peak_rss_bytes: proc_status_kib("VmHWM").map(|k| k * 1024),
        peak_covers_timed_steps_only: peak_reset,
    })
}

fn candle_version() -> &'static str {
    "0.11"
}

/// A `kB` field of `/proc/self/status` (Linux only).
fn proc_status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|l| {
        let rest = l.strip_prefix(field)?.strip_prefix(':')?;
        rest.trim().strip_suffix("kB")?.trim().parse().ok()
    })
}

/// Resets `VmHWM` to the current RSS (Linux >= 4.0); false where that is not possible.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(in crate::bench::train) fn tiny() -> Shape {
        Shape {
            layers: 2,
            hidden: 32,
            heads: 2,
            seq_len: 16,
            batch: 2,
            vocab: 96,
        }
    }

    #[test]
    fn candle_side_trains_one_tiny_step() {
        let r = bench_candle(&tiny(), 0, 1, 3, Variant::FP32).unwrap();
        assert!(r.tokens_per_s > 0.0 && r.tokens_per_s.is_finite());
        // Random init: the loss starts near ln(vocab).
        assert!(
            (r.first_loss - (96f64).ln()).abs() < 0.5,
            "{}",
            r.first_loss
        );
        assert!(r.step_s >= r.forward_s);
    }

    #[test]
    fn every_variant_trains_a_step_from_the_same_loss() {
        let fp32 = bench_candle(&tiny(), 0, 1, 3, Variant::FP32).unwrap();
        for name in ["bf16", "recompute", "bf16+recompute"] {
            let v = Variant::parse(name).unwrap();
            assert_eq!(v.name(), name);
            let r = bench_candle(&tiny(), 0, 1, 3, v).unwrap();
            assert!(r.framework.ends_with(name), "{}", r.framework);
            // The same model and tokens: bf16 rounds, recomputation changes nothing.
            let tol = if v.dtype == DType::BF16 { 0.05 } else { 1e-6 };
            assert!(
                (r.first_loss - fp32.first_loss).abs() < tol,
                "{name}: {}",
                r.first_loss
            );
        }
        assert!(Variant::parse("fp16").is_err());
    }
}
