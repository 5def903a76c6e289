//! What the pipeline runs and what the simulator is fed: the model, its seeded data, and each
//! stage's forward/backward time profiled alone, with the stages cut to balance those times.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use oobleck_core::execution::tensor_to_buf;
use oobleck_core::model::{accumulate, DropoutKey, ForwardCtx, LayeredModel, ParamSource, Stage};
use oobleck_core::schedule::StageTimes;
use oobleck_models::ModelConfig;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::table::median;
use super::BenchPipelineArgs;

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
/// worker runs them: the last stage reads its loss, backward accumulates into a gradient sum.
fn profile_range(
    model: &dyn LayeredModel,
    range: std::ops::Range<usize>,
    data: &Data,
    reps: usize,
    seed: u64,
) -> Result<(StageTimes, Vec<usize>)> {
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
    Ok((
        StageTimes {
            forward_ns: median(&f) as u64,
            backward_ns: median(&b) as u64,
        },
        out_dims,
    ))
}

/// The stages of one run: their layer ranges, each one's time alone, and the shape of the
/// activation the first stage sends.
pub(super) struct ProfiledStages {
    pub(super) ranges: Vec<std::ops::Range<usize>>,
    pub(super) times: Vec<StageTimes>,
    pub(super) act_dims: Vec<usize>,
}

/// Balanced cut of `model` into `s` stages from per-layer profiles, then each chosen stage
/// profiled whole.
pub(super) fn profile_stages(
    model: &dyn LayeredModel,
    data: &Data,
    s: usize,
    reps: usize,
    seed: u64,
) -> Result<ProfiledStages> {
    let l = model.num_layers();
    let mut per_layer = Vec::with_capacity(l);
    for i in 0..l {
        let (t, _) = profile_range(model, i..i + 1, data, reps, seed)?;
        per_layer.push((t.forward_ns + t.backward_ns) as f64);
    }
    let ranges = balanced_cuts(&per_layer, s)?;
    let mut times = Vec::with_capacity(s);
    let mut act_dims = Vec::new();
    for r in &ranges {
        let (t, dims) = profile_range(model, r.clone(), data, reps, seed)?;
        if act_dims.is_empty() {
            act_dims = dims;
        }
        times.push(t);
    }
    Ok(ProfiledStages {
        ranges,
        times,
        act_dims,
    })
}

/// Contiguous cut of `w` (per-layer costs) into `s` non-empty stages minimising the largest
/// stage sum. Returns the stage ranges.
pub fn balanced_cuts(w: &[f64], s: usize) -> Result<Vec<std::ops::Range<usize>>> {
    let l = w.len();
    if s == 0 || s > l {
        bail!("cannot cut {l} layers into {s} non-empty stages");
    }
    let pre: Vec<f64> = std::iter::once(0.0)
        .chain(w.iter().scan(0.0, |a, x| {
            *a += x;
            Some(*a)
        }))
        .collect();
    // best[k][j]: the smallest max over cuts of layers 0..j into k stages.
    let inf = f64::INFINITY;
    let mut best = vec![vec![inf; l + 1]; s + 1];
    let mut arg = vec![vec![0usize; l + 1]; s + 1];
    best[0][0] = 0.0;
    for k in 1..=s {
        for j in k..=l {
            for i in (k - 1)..j {
                let v = best[k - 1][i].max(pre[j] - pre[i]);
                if v < best[k][j] {
                    best[k][j] = v;
                    arg[k][j] = i;
                }
            }
        }
    }
    let mut cuts = Vec::with_capacity(s);
    let mut j = l;
    for k in (1..=s).rev() {
        let i = arg[k][j];
        cuts.push(i..j);
        j = i;
    }
    cuts.reverse();
    Ok(cuts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_cuts_minimise_the_largest_stage() {
        let cuts = balanced_cuts(&[1.0, 1.0, 1.0, 1.0, 4.0], 2).unwrap();
        assert_eq!(cuts, vec![0..4, 4..5]);
        let cuts = balanced_cuts(&[3.0, 1.0, 1.0, 1.0], 2).unwrap();
        assert_eq!(cuts, vec![0..1, 1..4]);
        let cuts = balanced_cuts(&[2.0, 2.0, 1.0, 1.0, 2.0], 3).unwrap();
        assert_eq!(cuts, vec![0..1, 1..3, 3..5]);
        assert!(balanced_cuts(&[1.0], 2).is_err());
    }
}
