//! The published training settings of the large presets: the batch and learning rate their
//! papers trained with (`../shared/reference/models.md`: GPT-3 Table 2.1, OPT Table 1; GPT-2's
//! 512 sequences of 1,024 tokens from its paper). `train --model gpt3-2.7b` starts from these
//! instead of the tiny defaults meant for `gpt-mini`, unless flags or the job file say
//! otherwise.

use crate::{ModelConfig, Result};

/// How a preset was trained.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Recipe {
    /// Tokens per sample: the model's whole context.
    pub seq_len: usize,
    /// Samples per step: the published batch in tokens over the context.
    pub global_batch_size: usize,
    /// Peak learning rate.
    pub lr: f64,
}

/// `(preset, batch in millions of tokens (2^20, as the papers' 0.5M = 256 x 2048), learning
/// rate)`.
const PUBLISHED: &[(&str, f64, f64)] = &[
    ("gpt2", 0.5, 2.5e-4),
    ("gpt2-medium", 0.5, 2.5e-4),
    ("gpt2-large", 0.5, 2.5e-4),
    ("gpt2-xl", 0.5, 2.5e-4),
    ("gpt3-125m", 0.5, 6.0e-4),
    ("gpt3-350m", 0.5, 3.0e-4),
    ("gpt3-760m", 0.5, 2.5e-4),
    ("gpt3-1.3b", 1.0, 2.0e-4),
    ("gpt3-2.7b", 1.0, 1.6e-4),
    ("gpt3-6.7b", 2.0, 1.2e-4),
    ("gpt3-13b", 2.0, 1.0e-4),
    ("gpt3-175b", 3.2, 0.6e-4),
    ("opt-125m", 0.5, 6.0e-4),
    ("opt-350m", 0.5, 3.0e-4),
    ("opt-1.3b", 1.0, 2.0e-4),
    ("opt-2.7b", 1.0, 1.6e-4),
    ("opt-6.7b", 2.0, 1.2e-4),
    ("opt-13b", 4.0, 1.0e-4),
    ("opt-30b", 4.0, 1.0e-4),
    ("opt-66b", 2.0, 0.8e-4),
    ("opt-175b", 2.0, 1.2e-4),
];

/// The published recipe of preset `name`; `None` for the small presets made for this
/// project (`gpt-mini`, `opt-tiny`, ...) and for names that are not presets.
pub fn recipe(name: &str) -> Result<Option<Recipe>> {
    let Some(&(_, mtokens, lr)) = PUBLISHED.iter().find(|p| p.0 == name) else {
        return Ok(None);
    };
    let seq_len = ModelConfig::preset(name)?.max_seq_len();
    // Whole sequences, to the nearest 256 (GPT-3 175B's 3.2M tokens: 1,536 sequences).
    let samples = mtokens * f64::from(1u32 << 20) / seq_len as f64;
    let global_batch_size = ((samples / 256.0).round() as usize * 256).max(256);
    Ok(Some(Recipe {
        seq_len,
        global_batch_size,
        lr,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_batches_are_whole_contexts_near_the_papers_token_counts() {
        let r = recipe("gpt3-2.7b").expect("preset").expect("published");
        // 1M tokens of 2048: 512 sequences (GPT-3 Table 2.1).
        assert_eq!((r.seq_len, r.global_batch_size, r.lr), (2048, 512, 1.6e-4));
        let r = recipe("gpt2").expect("preset").expect("published");
        assert_eq!((r.seq_len, r.global_batch_size), (1024, 512));
        let r = recipe("gpt3-175b").expect("preset").expect("published");
        // 3.2M tokens = 1562.5 sequences: 1536 is nearer than 2048.
        assert_eq!(r.global_batch_size, 1024 + 512);
        for name in ["gpt-mini", "opt-tiny", "gpt-tiny"] {
            assert_eq!(recipe(name).expect("preset"), None, "{name}");
        }
    }
}
