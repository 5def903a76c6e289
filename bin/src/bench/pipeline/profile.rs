//! What the pipeline runs and what the simulator is fed: the model, its seeded data, and each
//! stage's forward/backward time profiled alone, with the stages cut by the planner from a
//! measured per-layer profile.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use oobleck_core::execution::tensor_to_buf;
use oobleck_core::model::{accumulate, DropoutKey, ForwardCtx, LayeredModel, ParamSource, Stage};
use oobleck_core::planning::template::best_template;
use oobleck_core::planning::{DeviceSpec, JobSpec, ModelProfile, Template, TemplateMicrobatches};
use oobleck_core::profiler::ProfileRequest;
use oobleck_core::schedule::zero_bubble::PassTimes;
use oobleck_core::schedule::StageTimes;
use oobleck_models::ModelConfig;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::ranks::in_pool;
use super::BenchPipelineArgs;
use crate::bench::median;

/// The model of the benchmark and its vocabulary.
pub(super) fn build_model(args: &BenchPipelineArgs) -> Result<(Arc<dyn LayeredModel>, usize)> {
    let mut cfg = ModelConfig::preset(&args.model)?;
    if let Some(v) = args.vocab {
        match &mut cfg {
            ModelConfig::Gpt(c) => c.vocab_size = v,
            ModelConfig::Opt(c) => c.vocab_size = v,
        }
    }
    cfg.validate()?;
    if args.seq_len == 0 || args.seq_len > cfg.max_seq_len() {
        bail!(
            "--seq-len {} must be in 1..={} (the model's context)",
            args.seq_len,
            cfg.max_seq_len()
        );
    }
    let vocab = cfg.vocab_size();
    Ok((cfg.build()?, vocab))
}

/// Seeded random `(token ids, targets)` of a microbatch, each `[b, t]`.
#[derive(Clone, Copy)]
pub(super) struct Data {
    pub(super) vocab: u32,
    pub(super) b: usize,
    pub(super) t: usize,
    pub(super) seed: u64,
}

impl Data {
    pub(super) fn get(&self, iteration: u64, mb: u64) -> oobleck_core::Result<(Tensor, Tensor)> {
        let mut rng = ChaCha8Rng::seed_from_u64(
            self.seed ^ iteration.wrapping_mul(0x9e37_79b9) ^ mb.wrapping_mul(0x85eb_ca6b),
        );
        let n = self.b * self.t;
        let ids: Vec<u32> = (0..n).map(|_| rng.random_range(0..self.vocab)).collect();
        let tg: Vec<u32> = (0..n).map(|_| rng.random_range(0..self.vocab)).collect();
        Ok((
            Tensor::from_vec(ids, (self.b, self.t), &Device::Cpu)?,
            Tensor::from_vec(tg, (self.b, self.t), &Device::Cpu)?,
        ))
    }
}

fn train_ctx(targets: Option<&Tensor>, seed: u64, mb: u64, loss_scale: f64) -> ForwardCtx<'_> {
    ForwardCtx {
        targets,
        loss_scale,
        train: true,
        dropout_key: DropoutKey {
            seed,
            iteration: 0,
            microbatch: mb,
        },
        rows: None,
        dtype: candle_core::DType::F32,
    }
}

/// Forward and backward times of layers `range` on one microbatch, medians of `reps`, as the
/// worker runs them: the last stage reads its loss, backward accumulates into a gradient sum;
/// and the backward's B and W as ZB-H1 runs them.
fn profile_range(
    model: &dyn LayeredModel,
    range: std::ops::Range<usize>,
    data: &Data,
    reps: usize,
    seed: u64,
) -> Result<(StageTimes, PassTimes, Vec<usize>)> {
    let l = model.num_layers();
    let (ids, tg) = data.get(0, 0)?;
    let x = if range.start == 0 {
        ids
    } else {
        let prefix = Stage::new(model.build_layers(
            0..range.start,
            &Device::Cpu,
            ParamSource::Init { seed },
        )?)?;
        prefix
            .forward(&ids, &train_ctx(None, seed, 0, 1.0))?
            .output
            .detach()
    };
    let last = range.end == l;
    let stage =
        Stage::new(model.build_layers(range.clone(), &Device::Cpu, ParamSource::Init { seed })?)?;
    let targets = last.then_some(&tg);
    let mut upstream = None;
    let mut out_dims = Vec::new();
    let (mut f, mut b) = (Vec::new(), Vec::new());
    let mut acc = HashMap::new();
    // One untimed repetition warms the allocator and the kernels' buffers.
    for rep in 0..=reps {
        let t0 = Instant::now();
        let fwd = stage.forward(&x, &train_ctx(targets, seed, rep as u64, 1.0))?;
        if last {
            fwd.output.to_scalar::<f32>()?;
        }
        let t1 = Instant::now();
        if !last && upstream.is_none() {
            out_dims = fwd.output.dims().to_vec();
            upstream = Some((fwd.output.ones_like()? * 1e-3)?);
        }
        let g = stage.backward(fwd, upstream.as_ref())?;
        accumulate(&mut acc, g.params)?;
        if let Some(gi) = &g.input {
            // Materialised like the worker's send does (a host copy).
            tensor_to_buf(gi)?;
        }
        let t2 = Instant::now();
        if rep > 0 {
            f.push((t1 - t0).as_nanos() as f64);
            b.push((t2 - t1).as_nanos() as f64);
        }
    }
    let (split_b, split_w) = profile_split(&stage, &x, targets, upstream.as_ref(), reps, seed)?;
    let forward_ns = median(&f) as u64;
    Ok((
        StageTimes {
            forward_ns,
            backward_ns: median(&b) as u64,
        },
        PassTimes {
            f: forward_ns,
            b: split_b,
            w: split_w,
        },
        out_dims,
    ))
}

/// The backward of `stage` split as ZB-H1 runs it (`model::weight_grads`): B, the input
/// gradient with its host copy for the send, then W; medians of `reps` after an untimed one.
fn profile_split(
    stage: &Stage,
    x: &Tensor,
    targets: Option<&Tensor>,
    upstream: Option<&Tensor>,
    reps: usize,
    seed: u64,
) -> Result<(u64, u64)> {
    let (mut b, mut w) = (Vec::new(), Vec::new());
    let mut acc = HashMap::new();
    for rep in 0..=reps {
        let fwd = stage.forward(x, &train_ctx(targets, seed, rep as u64, 1.0))?;
        let t0 = Instant::now();
        let (gi, pending) = stage.backward_inputs(fwd, upstream)?;
        if let Some(gi) = &gi {
            tensor_to_buf(gi)?;
        }
        let t1 = Instant::now();
        stage.backward_weights(pending, &mut |_, g| accumulate(&mut acc, g))?;
        let t2 = Instant::now();
        if rep > 0 {
            b.push((t1 - t0).as_nanos() as f64);
            w.push((t2 - t1).as_nanos() as f64);
        }
    }
    Ok((median(&b) as u64, median(&w) as u64))
}

/// The stages of one run: the planner's template for them (cut from the measured per-layer
/// profile), each stage's time when profiled whole, and the shape of the activation the first
/// stage sends.
pub(super) struct ProfiledStages {
    pub(super) ranges: Vec<std::ops::Range<usize>>,
    pub(super) times: Vec<StageTimes>,
    /// The same stages' F, B and W (`profile_split`), for ZB-H1's simulation.
    pub(super) passes: Vec<PassTimes>,
    pub(super) act_dims: Vec<usize>,
    pub(super) template: Template,
}

/// Measures every layer with [`oobleck_core::profiler`] (as `oobleck profile` and `train`
/// do) in `copies` threads at once, each in its own pool of `threads` threads, so the layers
/// are timed while the other cores are as busy as they are in the run (alone, a stage ran
/// 10-20% faster than beside its neighbour: the cores share their caches and memory); each
/// layer's time is the median over the copies. The planner then cuts the model into `s`
/// single-device stages for `m` microbatches, and each chosen stage is profiled whole, alone,
/// for the simulator.
pub(super) fn profile_stages(
    model: &dyn LayeredModel,
    data: &Data,
    (s, m): (usize, u32),
    (copies, threads): (usize, usize),
    reps: usize,
    seed: u64,
) -> Result<ProfiledStages> {
    let profile = measure_concurrently(model, data, reps, copies.max(1), threads)?;
    let template = plan_stages(&profile, s, m)?;
    let ranges: Vec<_> = template.stages.iter().map(|st| st.layers()).collect();
    let mut times = Vec::with_capacity(s);
    let mut passes = Vec::with_capacity(s);
    let mut act_dims = Vec::new();
    for r in &ranges {
        let (t, p, dims) = in_pool(threads, || {
            profile_range(model, r.clone(), data, reps, seed)
        })??;
        if act_dims.is_empty() {
            act_dims = dims;
        }
        times.push(t);
        passes.push(p);
    }
    Ok(ProfiledStages {
        ranges,
        times,
        passes,
        act_dims,
        template,
    })
}

/// The profile of `copies` ranks of `threads` threads each, measured at once
/// ([`oobleck_core::profiler::measure_as_ranks`], as `train` measures a local cluster's).
fn measure_concurrently(
    model: &dyn LayeredModel,
    data: &Data,
    reps: usize,
    copies: usize,
    threads: usize,
) -> Result<ModelProfile> {
    let (ids, tg) = data.get(0, 0)?;
    let req = ProfileRequest {
        model,
        model_name: "bench pipeline".into(),
        inputs: &ids,
        targets: &tg,
        device: &Device::Cpu,
        dtype: candle_core::DType::F32,
        warmup: 1,
        repeats: reps,
    };
    let share = oobleck_core::profiler::RankShare::all_at_once(copies, threads);
    Ok(oobleck_core::profiler::measure_as_ranks(&req, &share)?.profile)
}

/// The planner's template of `s` nodes of one CPU device each for `m` microbatches, from a
/// measured `profile` (the `cpu` device's links: 127.0.0.1 here is faster, and an
/// activation's transfer is a small part of a stage's time).
pub(super) fn plan_stages(profile: &ModelProfile, s: usize, m: u32) -> Result<Template> {
    let cpu = DeviceSpec::named("cpu").context("the planner's `cpu` device")?;
    let job = JobSpec {
        fault_threshold: 0,
        microbatch_size: profile.fingerprint.microbatch_size,
        global_microbatches: m,
        state_bytes_per_param_byte: 4,
        template_microbatches: TemplateMicrobatches::Fixed(m),
    };
    job.validate(profile)?;
    let n = u32::try_from(s)?;
    let (template, _) = best_template(profile, &cpu.cluster(1), &job, n, n).with_context(|| {
        format!(
            "the planner finds no {s}-stage layout of {} layers",
            profile.layers.len()
        )
    })?;
    if template.num_stages() != s {
        bail!(
            "the planner's {n}-node template has {} stages, not {s}",
            template.num_stages()
        );
    }
    Ok(template)
}

/// `max / min - 1` of the stages' compute (forward + backward) per microbatch: 0 is perfectly
/// balanced, 0.2 means the slowest stage takes 20% longer than the fastest.
pub(super) fn imbalance(stage_ms: &[f64]) -> f64 {
    let max = stage_ms.iter().copied().fold(f64::MIN, f64::max);
    let min = stage_ms.iter().copied().fold(f64::MAX, f64::min);
    if stage_ms.is_empty() || min <= 0.0 {
        return f64::NAN;
    }
    max / min - 1.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use oobleck_core::planning::{Fingerprint, LayerProfile};

    fn profile(ms: &[f64]) -> ModelProfile {
        ModelProfile {
            fingerprint: Fingerprint {
                model: "test".into(),
                microbatch_size: 2,
                dtype: "f32".into(),
                device_kind: "cpu".into(),
            },
            layers: ms
                .iter()
                .enumerate()
                .map(|(i, &t)| LayerProfile {
                    name: format!("l{i}"),
                    forward_ms: t / 3.0,
                    backward_ms: 2.0 * t / 3.0,
                    param_bytes: 1 << 20,
                    activation_bytes: 1 << 20,
                    output_bytes: 1 << 10,
                })
                .collect(),
        }
    }

    #[test]
    fn the_planner_cuts_the_measured_layers_into_balanced_stages() {
        let t = plan_stages(&profile(&[1.0, 1.0, 1.0, 1.0, 4.0]), 2, 8).unwrap();
        let cuts: Vec<_> = t.stages.iter().map(|s| s.layers()).collect();
        assert_eq!(cuts, vec![0..4, 4..5]);
        let t = plan_stages(&profile(&[3.0, 1.0, 1.0, 1.0]), 2, 8).unwrap();
        let cuts: Vec<_> = t.stages.iter().map(|s| s.layers()).collect();
        assert_eq!(cuts, vec![0..1, 1..4]);
        assert!(plan_stages(&profile(&[1.0]), 2, 8).is_err());
    }

    #[test]
    fn imbalance_is_the_slowest_over_the_fastest_stage() {
        assert_eq!(imbalance(&[10.0, 10.0]), 0.0);
        assert!((imbalance(&[10.0, 12.0]) - 0.2).abs() < 1e-12);
        assert!(imbalance(&[]).is_nan());
    }
}
