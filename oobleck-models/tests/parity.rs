//! Numeric parity with the Hugging Face PyTorch reference, and stage-split backward.
//!
//! Expected values: `datasets/fixtures/parity/*/expected.safetensors`, made by
//! `datasets/fixtures/parity/make_fixtures.py` with torch + transformers on CPU in float32 (see
//! the README there for versions and seeds). Tolerances follow that README: float32 rounding in
//! the reference itself is up to ~3e-6 on logits and ~1.2e-6 on gradients.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use oobleck_core::model::{accumulate, ForwardCtx, LayeredModel, ParamSource, Stage};
use oobleck_models::hf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../datasets/fixtures/parity")
        .join(name)
}

struct Fixture {
    model: std::sync::Arc<dyn LayeredModel>,
    weights: HashMap<String, Tensor>,
    expected: HashMap<String, Tensor>,
}

fn load(name: &str) -> Fixture {
    let dir = fixture(name);
    let pre = hf::locate(dir.to_str().unwrap()).expect("fixture config loads");
    let weights = hf::load_weights(&pre.dir, &pre.config).expect("fixture weights load");
    let expected = candle_core::safetensors::load(dir.join("expected.safetensors"), &Device::Cpu)
        .expect("expected values load");
    Fixture {
        model: pre.config.build().unwrap(),
        weights,
        expected,
    }
}

fn ids(t: &Tensor) -> Tensor {
    t.to_dtype(DType::U32).unwrap()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    max_abs(&(f32s(a) - f32s(b)).unwrap())
}

fn max_abs(a: &Tensor) -> f32 {
    a.abs().and_then(|t| t.max_all()?.to_scalar()).unwrap()
}

fn whole_stage(f: &Fixture) -> Stage {
    let l = f.model.num_layers();
    let layers = f
        .model
        .build_layers(0..l, &Device::Cpu, ParamSource::Tensors(&f.weights))
        .unwrap();
    Stage::new(layers).unwrap()
}

fn check_parity(name: &str) {
    let f = load(name);
    let stage = whole_stage(&f);
    let e = &f.expected;

    // HF convention: logits of the full input.
    let out = stage
        .forward(&ids(&e["input_ids"]), &ForwardCtx::inference())
        .unwrap();
    let d = max_abs_diff(&out.output, &e["logits"]);
    eprintln!("{name}: logits max |diff| = {d:.3e}");
    assert!(d <= 1e-4, "{name}: logits differ by {d}");

    // Our trainer's convention: explicit next-token targets.
    let targets = ids(&e["nt_targets"]);
    let ctx = ForwardCtx {
        targets: Some(&targets),
        ..ForwardCtx::inference()
    };
    let fwd = stage.forward(&ids(&e["nt_input_ids"]), &ctx).unwrap();
    let d = max_abs_diff(&fwd.output, &e["nt_loss"]);
    eprintln!("{name}: loss max |diff| = {d:.3e}");
    assert!(d <= 1e-5, "{name}: loss differs by {d}");
    let grads = stage.backward(fwd, None).unwrap();
    let mut names: Vec<_> = grads.params.keys().cloned().collect();
    names.sort();
    assert_eq!(
        names.len(),
        f.weights.len(),
        "{name}: every weight gets a gradient"
    );
    let mut worst = 0f32;
    for n in &names {
        let want = &e[&format!("ntgrad.{n}")];
        let d = max_abs_diff(&grads.params[n], want);
        let tol = 1e-5 + 1e-4 * max_abs(want);
        worst = worst.max(d);
        eprintln!("{name}: grad {n:<55} max |diff| = {d:.3e} (tol {tol:.1e})");
        assert!(
            d <= tol,
            "{name}: gradient of {n} differs by {d} (tolerance {tol})"
        );
        // Key biases get an exactly-zero gradient (softmax ignores a constant shift); every
        // other parameter must be reached by backward (fused Candle ops silently drop grads).
        if !n.contains("k_proj.bias") {
            assert!(
                max_abs(&grads.params[n]) > 0.0,
                "{name}: {n} got a zero gradient"
            );
        }
    }
    eprintln!("{name}: worst gradient max |diff| = {worst:.3e}");
}

#[test]
fn gpt2_matches_transformers() {
    check_parity("gpt2-tiny");
}

#[test]
fn opt_matches_transformers() {
    check_parity("opt-tiny");
}

#[test]
fn opt_post_layernorm_with_projections_matches_transformers() {
    check_parity("opt-tiny-postln");
}

/// Runs the model split at `cuts` and returns (loss, summed gradients by name).
fn split_run(f: &Fixture, cuts: &[usize]) -> (f32, HashMap<String, Tensor>) {
    let e = &f.expected;
    let l = f.model.num_layers();
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(l);
    let stages: Vec<Stage> = bounds
        .windows(2)
        .map(|w| {
            let layers = f
                .model
                .build_layers(w[0]..w[1], &Device::Cpu, ParamSource::Tensors(&f.weights))
                .unwrap();
            Stage::new(layers).unwrap()
        })
        .collect();
    let targets = ids(&e["nt_targets"]);
    let ctx = ForwardCtx {
        targets: Some(&targets),
        ..ForwardCtx::inference()
    };
    let mut x = ids(&e["nt_input_ids"]);
    let mut fwds = Vec::new();
    for s in &stages {
        let fwd = s.forward(&x, &ctx).unwrap();
        x = fwd.output.clone();
        fwds.push(fwd);
    }
    let loss = x.to_scalar::<f32>().unwrap();
    let mut grads = HashMap::new();
    let mut upstream: Option<Tensor> = None;
    for (s, fwd) in stages.iter().zip(fwds).rev() {
        let g = s.backward(fwd, upstream.as_ref()).unwrap();
        upstream = g.input;
        // The tied embedding is held by the first and the last stage: its two gradients add up.
        accumulate(&mut grads, g.params).unwrap();
    }
    (loss, grads)
}

#[test]
fn stage_split_backward_equals_whole_model_backward() {
    for name in ["gpt2-tiny", "opt-tiny-postln"] {
        let f = load(name);
        let (loss, whole) = split_run(&f, &[]);
        for cuts in [vec![2], vec![1, 3], vec![1, 2]] {
            let (l, split) = split_run(&f, &cuts);
            assert!(
                (l - loss).abs() <= 1e-6,
                "{name} {cuts:?}: loss {l} vs {loss}"
            );
            assert_eq!(split.len(), whole.len());
            let worst = whole
                .iter()
                .map(|(n, g)| max_abs_diff(g, &split[n]))
                .fold(0f32, f32::max);
            eprintln!("{name}: split at {cuts:?}: worst gradient max |diff| = {worst:.3e}");
            assert!(
                worst <= 1e-6,
                "{name} {cuts:?}: gradients differ by {worst}"
            );
        }
    }
}
