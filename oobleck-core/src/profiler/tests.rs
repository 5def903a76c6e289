//! The profiler on a tiny model (embedding, `tanh` layers, a loss head), and the cache's
//! hit, miss, corrupt and mismatched entries.

use std::ops::Range;

use candle_core::{DType, Device, Tensor, Var};

use super::cache::{self, Source};
use super::*;
use crate::model::{seeded_normal, Layer};

const V: usize = 11;
const D: usize = 16;

struct Tiny(usize);
struct Embed(Var);
struct Mid(usize, Var);
struct Head(usize, Var);

impl Layer for Embed {
    fn index(&self) -> usize {
        0
    }
    fn params(&self) -> Vec<(String, Var)> {
        vec![("wte".into(), self.0.clone())]
    }
    fn forward(&self, x: &Tensor, _: &ForwardCtx) -> Result<Tensor> {
        let (b, t) = x.dims2()?;
        let e = self.0.as_tensor().index_select(&x.flatten_all()?, 0)?;
        Ok(e.reshape((b, t, D))?)
    }
}

impl Layer for Mid {
    fn index(&self) -> usize {
        self.0
    }
    fn params(&self) -> Vec<(String, Var)> {
        vec![(format!("h{}", self.0), self.1.clone())]
    }
    fn forward(&self, x: &Tensor, _: &ForwardCtx) -> Result<Tensor> {
        Ok(x.broadcast_matmul(self.1.as_tensor())?.tanh()?)
    }
}

impl Layer for Head {
    fn index(&self) -> usize {
        self.0
    }
    fn params(&self) -> Vec<(String, Var)> {
        vec![("head".into(), self.1.clone())]
    }
    fn forward(&self, x: &Tensor, ctx: &ForwardCtx) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let logits = x.reshape((b * t, d))?.matmul(self.1.as_tensor())?;
        let tg = ctx.targets.expect("the profiler passes targets");
        Ok(candle_nn::loss::cross_entropy(&logits, &tg.flatten_all()?)?)
    }
}

impl LayeredModel for Tiny {
    fn num_layers(&self) -> usize {
        self.0
    }
    fn layer_name(&self, i: usize) -> String {
        format!("tiny {i}")
    }
    fn build_layers(
        &self,
        range: Range<usize>,
        device: &Device,
        _: ParamSource<'_>,
    ) -> Result<Vec<Box<dyn Layer>>> {
        let p = |name: &str, shape: &[usize]| -> Result<Var> {
            Ok(Var::from_tensor(&seeded_normal(
                1, name, shape, 0.3, device,
            )?)?)
        };
        let mut out: Vec<Box<dyn Layer>> = Vec::new();
        for i in range {
            if i == 0 {
                out.push(Box::new(Embed(p("wte", &[V, D])?)));
            } else if i + 1 == self.0 {
                out.push(Box::new(Head(i, p("head", &[D, V])?)));
            } else {
                out.push(Box::new(Mid(i, p(&format!("h{i}"), &[D, D])?)));
            }
        }
        Ok(out)
    }
}

fn sample(b: usize, t: usize) -> (Tensor, Tensor) {
    let ids: Vec<u32> = (0..b * t).map(|k| (k * 7 % V) as u32).collect();
    let tg: Vec<u32> = (0..b * t).map(|k| ((k * 7 + 1) % V) as u32).collect();
    (
        Tensor::from_vec(ids, (b, t), &Device::Cpu).unwrap(),
        Tensor::from_vec(tg, (b, t), &Device::Cpu).unwrap(),
    )
}

/// A request on the CPU in f32, one warm-up and three timed passes.
fn request<'a>(
    model: &'a Tiny,
    name: &str,
    inputs: &'a Tensor,
    targets: &'a Tensor,
) -> ProfileRequest<'a> {
    ProfileRequest {
        model,
        model_name: name.into(),
        inputs,
        targets,
        device: &Device::Cpu,
        dtype: DType::F32,
        warmup: 1,
        repeats: 3,
    }
}

fn measure_tiny(layers: usize, b: usize) -> Measured {
    let model = Tiny(layers);
    let (inputs, targets) = sample(b, 5);
    let req = request(&model, &format!("tiny-{layers}"), &inputs, &targets);
    measure(&req).expect("a tiny model profiles")
}

#[test]
fn a_tiny_model_gives_a_valid_profile_of_every_layer() {
    let m = measure_tiny(4, 3);
    let p = &m.profile;
    p.validate().expect("valid");
    assert_eq!(p.num_layers(), 4);
    assert_eq!(m.peak_bytes.len(), 4);
    assert_eq!(p.fingerprint.microbatch_size, 3);
    assert_eq!(p.fingerprint.dtype, "f32");
    assert!(p.fingerprint.device_kind.starts_with("cpu:"), "{p:?}");
    for (i, l) in p.layers.iter().enumerate() {
        assert_eq!(l.name, format!("tiny {i}"));
        assert!(
            l.forward_ms > 0.0 && l.backward_ms > 0.0,
            "layer {i}: {l:?}"
        );
        assert!(l.activation_bytes >= l.output_bytes, "layer {i}: {l:?}");
    }
    // Exact sizes: f32 parameters, hidden output [3, 5, 16], a scalar loss at the end.
    assert_eq!(p.layers[0].param_bytes, (V * D * 4) as u64);
    assert_eq!(p.layers[1].param_bytes, (D * D * 4) as u64);
    assert_eq!(p.layers[3].param_bytes, (D * V * 4) as u64);
    assert_eq!(p.layers[1].output_bytes, (3 * 5 * D * 4) as u64);
    assert_eq!(p.layers[3].output_bytes, 4);
    // A round trip through the JSON the planner reads.
    assert_eq!(&ModelProfile::from_json(&p.to_json()).expect("parses"), p);
}

#[test]
fn a_profile_measured_as_ranks_names_the_sharing_and_keeps_every_layer() {
    let model = Tiny(3);
    let (inputs, targets) = sample(2, 5);
    let req = request(&model, "tiny-3", &inputs, &targets);
    let alone = measure(&req).expect("alone");
    let shared =
        measure_as_ranks(&req, &RankShare::all_at_once(3, 1)).expect("as 3 ranks of 1 thread");
    let p = &shared.profile;
    p.validate().expect("valid");
    assert!(p.fingerprint.device_kind.ends_with("x1/3 ranks"), "{p:?}");
    assert_ne!(p.fingerprint, alone.profile.fingerprint, "cached apart");
    assert_eq!(p.num_layers(), 3);
    assert_eq!(shared.peak_bytes.len(), 3);
    for (a, s) in alone.profile.layers.iter().zip(&p.layers) {
        assert_eq!((&a.name, a.param_bytes), (&s.name, s.param_bytes));
        assert_eq!(a.output_bytes, s.output_bytes);
        assert!(s.forward_ms > 0.0 && s.backward_ms > 0.0, "{s:?}");
        assert!(s.activation_bytes >= s.output_bytes, "{s:?}");
    }
    assert_eq!(&ModelProfile::from_json(&p.to_json()).expect("parses"), p);
}

#[test]
fn a_share_of_the_cores_is_at_least_one_thread() {
    assert_eq!(threads_per_rank(2, 4), 1);
    assert_eq!(threads_per_rank(16, 4), 4);
    assert_eq!(threads_per_rank(16, 3), 5);
    assert_eq!(threads_per_rank(8, 0), 8);
}

#[test]
fn zero_repeats_is_refused() {
    let model = Tiny(3);
    let (inputs, targets) = sample(2, 4);
    let req = ProfileRequest {
        warmup: 0,
        repeats: 0,
        ..request(&model, "tiny", &inputs, &targets)
    };
    let e = measure(&req).expect_err("no repeats");
    assert!(e.to_string().contains("at least 1 repeat"), "{e}");
}

#[test]
fn the_median_of_an_even_count_is_the_middle_mean() {
    assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
    assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
}

fn temp_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("oobleck-prof-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn the_cache_measures_on_a_miss_and_reuses_on_a_hit() {
    let dir = temp_dir("hit");
    let p = measure_tiny(3, 2).profile;
    let fp = p.fingerprint.clone();
    let (got, src) = cache::load_or_measure(&dir, &fp, || Ok(p.clone())).expect("miss");
    assert_eq!(got, p);
    let path = cache::entry_path(&dir, &fp);
    assert_eq!(src, Source::Measured(path.clone()));
    let (again, src) =
        cache::load_or_measure(&dir, &fp, || panic!("a hit must not measure")).expect("hit");
    assert_eq!((again, src), (p.clone(), Source::Cached(path)));
    // Another microbatch is another key.
    let other = Fingerprint {
        microbatch_size: 9,
        ..fp.clone()
    };
    assert_ne!(cache::key(&other), cache::key(&fp));
    assert_eq!(cache::lookup(&dir, &other), Ok(None));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_corrupt_or_mismatched_entry_is_measured_again() {
    let dir = temp_dir("corrupt");
    let p = measure_tiny(3, 2).profile;
    let fp = p.fingerprint.clone();
    let path = cache::store(&dir, &p).expect("stored");
    std::fs::write(&path, "{ not json").unwrap();
    let (got, src) = cache::load_or_measure(&dir, &fp, || Ok(p.clone())).expect("re-measured");
    assert_eq!(got, p);
    assert!(
        matches!(&src, Source::Remeasured { path: q, .. } if *q == path),
        "{src:?}"
    );
    // The rewritten entry is valid again.
    assert_eq!(cache::lookup(&dir, &fp), Ok(Some(p.clone())));
    // An entry holding another fingerprint's profile under this key is corrupt too.
    let mut wrong = p.clone();
    wrong.fingerprint.model = "someone-else".into();
    std::fs::write(&path, wrong.to_json()).unwrap();
    let reason = cache::lookup(&dir, &fp).expect_err("mismatch");
    assert!(reason.contains("someone-else"), "{reason}");
    let (_, src) = cache::load_or_measure(&dir, &fp, || Ok(p.clone())).expect("re-measured");
    assert!(matches!(src, Source::Remeasured { .. }), "{src:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn windows_of_any_size_time_every_layer_and_agree_on_sizes() {
    let model = Tiny(5);
    let (inputs, targets) = sample(3, 5);
    let req = request(&model, "tiny-5", &inputs, &targets);
    let one = measure_in_windows(&req, u64::MAX).expect("one window");
    // Each layer alone, and windows of a few layers (a 16x16 f32 layer is 1 KiB).
    for bytes in [0, 2048] {
        let m = measure_in_windows(&req, bytes).expect("windows");
        m.profile.validate().expect("valid");
        assert_eq!(m.peak_bytes.len(), 5);
        for (a, b) in one.profile.layers.iter().zip(&m.profile.layers) {
            assert_eq!(a.name, b.name);
            assert_eq!(
                (a.param_bytes, a.output_bytes),
                (b.param_bytes, b.output_bytes)
            );
            assert!(b.forward_ms > 0.0 && b.backward_ms > 0.0, "{bytes}: {b:?}");
        }
    }
}
