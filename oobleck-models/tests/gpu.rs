//! On an NVIDIA GPU (feature `cuda`; `scripts/device-check.sh` runs these with `--ignored`):
//! the models compute the same on the GPU as on the CPU, bf16 tracks fp32, and each layer's
//! measured time against the planner's analytical estimate.
//!
//! Ignored by default so `cargo test --features cuda` on a machine without a GPU stays green;
//! CI type-checks them (`scripts/build-cuda.sh check`).
#![cfg(feature = "cuda")]

use std::collections::HashMap;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use oobleck_core::model::{ForwardCtx, ParamSource, Stage};
use oobleck_core::planning::{analytical_profile, DeviceSpec, Dtype};
use oobleck_models::ModelConfig;

fn gpu() -> Device {
    Device::new_cuda(0).expect("CUDA device 0 (this test needs a GPU)")
}

/// Token ids `[b, t]` and their next tokens, the same on every device.
fn batch(b: usize, t: usize, vocab: usize, dev: &Device) -> (Tensor, Tensor) {
    let ids: Vec<u32> = (0..b * t + 1)
        .map(|i| ((i * 7919 + 13) % vocab) as u32)
        .collect();
    let x = Tensor::from_vec(ids[..b * t].to_vec(), (b, t), dev).unwrap();
    let y = Tensor::from_vec(ids[1..].to_vec(), (b, t), dev).unwrap();
    (x, y)
}

/// The whole model of `preset` on `dev`: logits, loss and every parameter's gradient.
fn run(preset: &str, dev: &Device, dtype: DType) -> (Vec<f32>, f32, HashMap<String, Vec<f32>>) {
    let cfg = ModelConfig::preset(preset).unwrap();
    let model = cfg.build().unwrap();
    let layers = model
        .build_layers(0..model.num_layers(), dev, ParamSource::Init { seed: 7 })
        .unwrap();
    let stage = Stage::new(layers).unwrap();
    let (x, y) = batch(2, 16, cfg.vocab_size(), dev);
    let infer = ForwardCtx {
        dtype,
        ..ForwardCtx::inference()
    };
    let logits = stage.forward(&x, &infer).unwrap().output;
    let logits = flat(&logits);
    let ctx = ForwardCtx {
        targets: Some(&y),
        dtype,
        ..ForwardCtx::inference()
    };
    let fwd = stage.forward(&x, &ctx).unwrap();
    let loss = fwd
        .output
        .to_dtype(DType::F32)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let grads = stage.backward(fwd, None).unwrap().params;
    let grads = grads.into_iter().map(|(k, g)| (k, flat(&g))).collect();
    (logits, loss, grads)
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `max |a - b| / max |b|`.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb).max(1e-30)
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device-check.sh runs it"]
fn gpu_fp32_matches_the_cpu() {
    for preset in ["gpt-tiny", "opt-tiny"] {
        let (cl, closs, cg) = run(preset, &Device::Cpu, DType::F32);
        let (gl, gloss, gg) = run(preset, &gpu(), DType::F32);
        // TF32 is off in candle unless asked for, so fp32 GEMMs agree to rounding order.
        assert!(
            rel_err(&gl, &cl) < 1e-4,
            "{preset}: logits {}",
            rel_err(&gl, &cl)
        );
        assert!(
            (gloss - closs).abs() < 1e-4 * closs.abs(),
            "{preset}: {gloss} vs {closs}"
        );
        for (name, c) in &cg {
            let e = rel_err(&gg[name], c);
            assert!(e < 1e-3, "{preset}: gradient of {name} differs by {e}");
        }
        println!("parity {preset}: loss cpu {closs:.6} gpu {gloss:.6}");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device-check.sh runs it"]
fn gpu_bf16_tracks_fp32() {
    let (_, loss32, g32) = run("gpt-tiny", &Device::Cpu, DType::F32);
    let (_, loss16, g16) = run("gpt-tiny", &gpu(), DType::BF16);
    // bf16 keeps 8 bits of mantissa: a loss near ln(vocab) agrees to about 1%.
    assert!(
        (loss16 - loss32).abs() < 0.02 * loss32,
        "{loss16} vs {loss32}"
    );
    for (name, g) in &g32 {
        let c = cosine(&g16[name], g);
        assert!(c > 0.98, "gradient of {name}: cosine {c}");
    }
    println!("bf16 gpt-tiny: loss fp32 cpu {loss32:.5} bf16 gpu {loss16:.5}");
}

/// Median of `reps` timed runs of `f` after `warm` untimed ones, in ms, the GPU synchronised.
fn time_ms(dev: &Device, warm: usize, reps: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..warm {
        f();
    }
    dev.synchronize().unwrap();
    let mut ms: Vec<f64> = (0..reps)
        .map(|_| {
            let t0 = Instant::now();
            f();
            dev.synchronize().unwrap();
            t0.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    ms[reps / 2]
}

/// `gpt3-350m` at b = 4, 1,024 tokens, bf16: each layer's forward and forward + backward on
/// the GPU, against the planner's analytical estimate for this GPU. Prints one row per layer
/// kind and writes `layer_times.json` into `$OOBLECK_DEVICE_CHECK_OUT` when set.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/device-check.sh runs it"]
fn layer_times_against_the_analytical_profile() {
    let (b, t) = (4usize, 1024usize);
    let dev = gpu();
    let cfg = ModelConfig::preset("gpt3-350m").unwrap();
    let model = cfg.build().unwrap();
    let kind = std::env::var("OOBLECK_GPU_KIND").unwrap_or_else(|_| "h200-141gb".into());
    let spec = DeviceSpec::named(&kind).expect("a planner device kind");
    let shape = cfg.planner_shape(t).unwrap();
    let est = analytical_profile("gpt3-350m", &shape, spec, b as u32, Dtype::Bf16);
    let (ids, targets) = batch(b, t, cfg.vocab_size(), &dev);
    let d = cfg.dims().1;
    let hidden = Tensor::randn(0f32, 1.0, (b, t, d), &dev).unwrap();
    let last = model.num_layers() - 1;
    let mut rows = Vec::new();
    for i in [0, 1, last] {
        let stage = Stage::new(
            model
                .build_layers(i..i + 1, &dev, ParamSource::Init { seed: 1 })
                .unwrap(),
        )
        .unwrap();
        let x = if i == 0 { &ids } else { &hidden };
        let ctx = ForwardCtx {
            targets: (i == last).then_some(&targets),
            train: true,
            dtype: DType::BF16,
            ..ForwardCtx::inference()
        };
        let fwd_ms = time_ms(&dev, 2, 5, || {
            stage.forward(x, &ctx).unwrap();
        });
        let both_ms = time_ms(&dev, 2, 5, || {
            let f = stage.forward(x, &ctx).unwrap();
            let up = (i != last).then(|| f.output.ones_like().unwrap());
            stage.backward(f, up.as_ref()).unwrap();
        });
        let e = &est.layers[i];
        rows.push(serde_json::json!({
            "layer": e.name,
            "forward_ms": fwd_ms,
            "backward_ms": both_ms - fwd_ms,
            "est_forward_ms": e.forward_ms,
            "est_backward_ms": e.backward_ms,
        }));
        println!(
            "layer {:<12} forward {fwd_ms:8.3} ms (est {:8.3})  backward {:8.3} ms (est {:8.3})",
            e.name,
            e.forward_ms,
            both_ms - fwd_ms,
            e.backward_ms
        );
    }
    if let Ok(out) = std::env::var("OOBLECK_DEVICE_CHECK_OUT") {
        let path = std::path::Path::new(&out).join("layer_times.json");
        std::fs::write(path, serde_json::to_string_pretty(&rows).unwrap()).unwrap();
    }
}
