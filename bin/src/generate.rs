//! Sampling continuations from a trained model, so a person can see what it learned.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, D};
use oobleck_core::model::{ForwardCtx, LayeredModel, ParamSource, Stage};
use oobleck_models::data::{Gpt2Tokenizer, Split};
use oobleck_models::workload::GptWorkload;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// How to sample.
#[derive(Clone, Copy, Debug)]
pub struct Sampling {
    pub max_new_tokens: usize,
    /// Softmax temperature; 0 = greedy.
    pub temperature: f64,
    /// Keep the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    pub seed: u64,
}

/// Builds every layer of `model` into one stage on `device`, its parameters from `source`
/// (named tensors, such as a checkpoint's, or a seeded initialisation).
pub fn whole_model(
    model: &dyn LayeredModel,
    device: &Device,
    source: ParamSource<'_>,
) -> Result<Stage> {
    let layers = model.build_layers(0..model.num_layers(), device, source)?;
    Ok(Stage::new(layers)?)
}

/// Continues `prompt` token by token; the context is cropped to `max_context` positions.
pub fn sample(
    stage: &Stage,
    tok: &Gpt2Tokenizer,
    prompt: &str,
    max_context: usize,
    s: Sampling,
) -> Result<String> {
    let mut ids = tok.encode(prompt)?;
    if ids.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    let mut rng = ChaCha8Rng::seed_from_u64(s.seed);
    let start = ids.len();
    for _ in 0..s.max_new_tokens {
        let ctx_ids = &ids[ids.len().saturating_sub(max_context)..];
        let x = Tensor::from_slice(ctx_ids, (1, ctx_ids.len()), &Device::Cpu)?;
        let logits = stage.forward(&x, &ForwardCtx::inference())?.output; // [1, t, v]
        let last = logits.narrow(1, ctx_ids.len() - 1, 1)?.flatten_all()?; // [v]
        let next = pick(&last, s, &mut rng)?;
        ids.push(next);
    }
    Ok(tok.decode(&ids[start..])?)
}

fn pick(logits: &Tensor, s: Sampling, rng: &mut ChaCha8Rng) -> Result<u32> {
    if s.temperature <= 0.0 {
        return Ok(logits.argmax(D::Minus1)?.to_scalar::<u32>()?);
    }
    let v: Vec<f32> = (logits.to_dtype(DType::F32)? / s.temperature)?.to_vec1()?;
    let mut order: Vec<usize> = (0..v.len()).collect();
    order.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    if s.top_k > 0 {
        order.truncate(s.top_k);
    }
    let max = v[order[0]];
    let weights: Vec<f64> = order.iter().map(|&i| f64::from(v[i] - max).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut r = rng.random::<f64>() * total;
    for (w, &i) in weights.iter().zip(&order) {
        if r < *w {
            return Ok(i as u32);
        }
        r -= w;
    }
    Ok(order[order.len() - 1] as u32)
}

/// Prints `cfg.sample` continuations of fixed validation snippets of the workload's corpus,
/// its context the model's: what the end of every `train` run shows, in one process or on a
/// cluster.
pub fn print_samples(
    stage: &Stage,
    workload: &GptWorkload,
    cfg: &crate::config::TrainConfig,
) -> Result<()> {
    let data = workload.dataset();
    let max_context = workload.model_config().max_seq_len();
    let val = data.split(Split::Validation);
    for i in 0..cfg.sample {
        let b = val.sequential_batch(16, 1, i * 7)?;
        let prompt = data.tokenizer().decode(&b.inputs)?;
        let text = sample(
            stage,
            data.tokenizer(),
            &prompt,
            max_context,
            Sampling {
                max_new_tokens: 24,
                temperature: 0.8,
                top_k: 40,
                seed: cfg.seed + i as u64,
            },
        )?;
        eprintln!("sample {}: {prompt:?} => {text:?}", i + 1);
    }
    Ok(())
}
