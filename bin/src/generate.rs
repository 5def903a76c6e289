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
    let ids = tok.encode(prompt)?;
    if ids.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    let new = continuation(stage, &ids, tok.vocab_size(), max_context, s)?;
    Ok(tok.decode(&new)?)
}

/// The `s.max_new_tokens` ids that follow `prompt`, each one of the tokenizer's `vocab` ids.
/// A model with more output rows than that (OPT pads to 50272, GPT-2's tokenizer has 50257
/// ids) has padding rows with no text, so only the first `vocab` logits are sampled from.
fn continuation(
    stage: &Stage,
    prompt: &[u32],
    vocab: usize,
    max_context: usize,
    s: Sampling,
) -> Result<Vec<u32>> {
    let mut ids = prompt.to_vec();
    let mut rng = ChaCha8Rng::seed_from_u64(s.seed);
    for _ in 0..s.max_new_tokens {
        let ctx_ids = &ids[ids.len().saturating_sub(max_context)..];
        let x = Tensor::from_slice(ctx_ids, (1, ctx_ids.len()), &Device::Cpu)?;
        let logits = stage.forward(&x, &ForwardCtx::inference())?.output; // [1, t, rows]
        let last = logits.narrow(1, ctx_ids.len() - 1, 1)?.flatten_all()?; // [rows]
        let rows = last.dim(0)?;
        if rows < vocab {
            bail!("the model has {rows} output rows, fewer than the tokenizer's {vocab} ids");
        }
        let next = pick(&last.narrow(0, 0, vocab)?, s, &mut rng)?; // of [vocab]
        ids.push(next);
    }
    Ok(ids.split_off(prompt.len()))
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use oobleck_models::ModelConfig;

    use super::*;

    /// Padding id 50260 of opt-tiny's 50272 rows, past GPT-2's 50257 ids.
    const PADDING: usize = 50260;

    /// opt-tiny whose logits are column 0 of the embedding, and padding row `PADDING` has the
    /// highest by far: the final LayerNorm outputs its bias, the unit vector of dimension 0
    /// (the LM head is tied to the embedding).
    fn padding_wins() -> Stage {
        let model = ModelConfig::preset("opt-tiny").unwrap().build().unwrap();
        let init = whole_model(model.as_ref(), &Device::Cpu, ParamSource::Init { seed: 3 });
        let mut params: HashMap<String, Tensor> = init
            .unwrap()
            .params()
            .into_iter()
            .map(|(n, v)| (n, v.as_tensor().clone()))
            .collect();
        let norm = "model.decoder.final_layer_norm";
        let d = params[&format!("{norm}.weight")].dim(0).unwrap();
        let mut unit = vec![0f32; d];
        unit[0] = 1.0;
        params.insert(
            format!("{norm}.weight"),
            Tensor::zeros(d, DType::F32, &Device::Cpu).unwrap(),
        );
        params.insert(
            format!("{norm}.bias"),
            Tensor::new(unit, &Device::Cpu).unwrap(),
        );
        let embed = "model.decoder.embed_tokens.weight";
        let mut rows: Vec<Vec<f32>> = params[embed].to_vec2().unwrap();
        rows[PADDING][0] = 100.0;
        params.insert(embed.into(), Tensor::new(rows, &Device::Cpu).unwrap());
        whole_model(model.as_ref(), &Device::Cpu, ParamSource::Tensors(&params)).unwrap()
    }

    #[test]
    fn a_padding_row_with_the_highest_logit_is_never_picked() {
        let stage = padding_wins();
        let tok = Gpt2Tokenizer::embedded();
        let prompt = tok.encode("To be, or not").unwrap();
        let vocab = tok.vocab_size();
        // Without the narrowing, greedy picks the padding id.
        let x = Tensor::from_slice(&prompt, (1, prompt.len()), &Device::Cpu).unwrap();
        let all = stage.forward(&x, &ForwardCtx::inference()).unwrap().output;
        let best = all
            .narrow(1, prompt.len() - 1, 1)
            .unwrap()
            .flatten_all()
            .unwrap();
        assert_eq!(
            best.argmax(0).unwrap().to_scalar::<u32>().unwrap() as usize,
            PADDING
        );
        for (temperature, top_k) in [(0.0, 0), (0.8, 40), (1.0, 0)] {
            let s = Sampling {
                max_new_tokens: 4,
                temperature,
                top_k,
                seed: 11,
            };
            let ids = continuation(&stage, &prompt, vocab, 64, s).unwrap();
            assert_eq!(ids.len(), 4);
            assert!(
                ids.iter().all(|&id| (id as usize) < vocab),
                "temperature {temperature}, top_k {top_k}: {ids:?}"
            );
            sample(&stage, &tok, "To be, or not", 64, s).unwrap();
        }
    }

    #[test]
    fn a_model_with_fewer_rows_than_the_tokenizer_has_ids_is_refused() {
        let stage = padding_wins();
        let s = Sampling {
            max_new_tokens: 1,
            temperature: 0.0,
            top_k: 0,
            seed: 0,
        };
        let err = continuation(&stage, &[464], 60_000, 64, s).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("50272") && msg.contains("60000"), "{msg}");
    }
}
