//! One type for "which model": a preset name or a Hugging Face `config.json`.

use std::path::Path;
use std::sync::Arc;

use oobleck_core::model::LayeredModel;
use oobleck_core::planning::TransformerShape;
use serde::{Deserialize, Serialize};

use crate::gpt2::{Gpt, GptConfig};
use crate::opt::{Opt, OptConfig};
use crate::{Error, Result};

/// A model family with its shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "family", rename_all = "lowercase")]
pub enum ModelConfig {
    Gpt(GptConfig),
    Opt(OptConfig),
}

/// Every preset name, GPT family first.
pub fn preset_names() -> Vec<&'static str> {
    GptConfig::PRESETS
        .iter()
        .chain(OptConfig::PRESETS)
        .copied()
        .collect()
}

impl ModelConfig {
    /// A preset by name; an unknown name lists the presets.
    pub fn preset(name: &str) -> Result<Self> {
        if let Some(c) = GptConfig::preset(name) {
            return Ok(Self::Gpt(c));
        }
        if let Some(c) = OptConfig::preset(name) {
            return Ok(Self::Opt(c));
        }
        Err(Error::UnknownModel {
            name: name.into(),
            known: preset_names().join(", "),
        })
    }

    /// Parses a Hugging Face `config.json` (the `model_type` field picks the family).
    pub fn from_hf_json(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.into(),
            source,
        })?;
        let bad = |reason: String| Error::BadConfig {
            path: path.into(),
            reason,
        };
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let model_type = v
            .get("model_type")
            .and_then(|m| m.as_str())
            .ok_or_else(|| bad("no `model_type` field (expected \"gpt2\" or \"opt\")".into()))?;
        let cfg = match model_type {
            "gpt2" => Self::Gpt(
                serde_json::from_value(v.clone())
                    .map_err(|e| bad(format!("not a GPT-2 config: {e}")))?,
            ),
            "opt" => Self::Opt(
                serde_json::from_value(v.clone())
                    .map_err(|e| bad(format!("not an OPT config: {e}")))?,
            ),
            other => {
                return Err(bad(format!(
                    "model_type `{other}` is not supported (gpt2, opt)"
                )))
            }
        };
        cfg.validate().map_err(|e| bad(e.to_string()))?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<()> {
        match self {
            Self::Gpt(c) => c.validate(),
            Self::Opt(c) => c.validate(),
        }
    }

    /// The model as a layer list.
    pub fn build(&self) -> Result<Arc<dyn LayeredModel>> {
        Ok(match self {
            Self::Gpt(c) => Arc::new(Gpt::new(c.clone())?),
            Self::Opt(c) => Arc::new(Opt::new(c.clone())?),
        })
    }

    pub fn num_params(&self) -> usize {
        match self {
            Self::Gpt(c) => c.num_params(),
            Self::Opt(c) => c.num_params(),
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Gpt(c) => c.vocab_size,
            Self::Opt(c) => c.vocab_size,
        }
    }

    /// Longest sequence the model accepts.
    pub fn max_seq_len(&self) -> usize {
        match self {
            Self::Gpt(c) => c.n_positions,
            Self::Opt(c) => c.max_position_embeddings,
        }
    }

    /// `(blocks, d_model, heads, ffn)`.
    pub fn dims(&self) -> (usize, usize, usize, usize) {
        match self {
            Self::Gpt(c) => (c.n_layer, c.n_embd, c.n_head, c.ffn()),
            Self::Opt(c) => (
                c.num_hidden_layers,
                c.hidden_size,
                c.num_attention_heads,
                c.ffn_dim,
            ),
        }
    }

    /// `L = blocks + 2`.
    pub fn num_layers(&self) -> usize {
        self.dims().0 + 2
    }

    /// The shape the planner's analytical profile needs, for samples of `seq_len` tokens (pass
    /// [`Self::max_seq_len`] to plan at the model's full context).
    ///
    /// OPT-350m's 512-wide token embedding, projected into its 1024-wide blocks, is modelled at
    /// the block width: the blocks, which dominate time and memory, are exact, and the
    /// embedding and head layers are overestimated (by about 25M parameters, of 331M), which errs
    /// on the side of memory that fits.
    pub fn planner_shape(&self, seq_len: usize) -> Result<TransformerShape> {
        if seq_len == 0 || seq_len > self.max_seq_len() {
            return Err(Error::Invalid(format!(
                "sequence length {seq_len} must be between 1 and the model's context {}",
                self.max_seq_len()
            )));
        }
        let u = |v: usize, what: &str| {
            u32::try_from(v)
                .map_err(|_| Error::Invalid(format!("{what} {v} does not fit the planner (u32)")))
        };
        let (blocks, d, heads, ffn) = self.dims();
        let tied = match self {
            Self::Gpt(c) => c.tie_word_embeddings,
            Self::Opt(c) => c.tie_word_embeddings,
        };
        Ok(TransformerShape {
            n_blocks: u(blocks, "blocks")?,
            d_model: u(d, "width")?,
            n_heads: u(heads, "heads")?,
            ffn: u(ffn, "feed-forward width")?,
            vocab: u(self.vocab_size(), "vocabulary")?,
            seq_len: u(seq_len, "sequence length")?,
            tied_embedding: tied,
        })
    }

    /// The `config.json` HF would write for this model (enough for `from_hf_json` and for
    /// `transformers` to load it).
    pub fn to_hf_json(&self) -> serde_json::Value {
        let (mut v, ty, arch) = match self {
            Self::Gpt(c) => (
                serde_json::to_value(c).expect("config serialises"),
                "gpt2",
                "GPT2LMHeadModel",
            ),
            Self::Opt(c) => (
                serde_json::to_value(c).expect("config serialises"),
                "opt",
                "OPTForCausalLM",
            ),
        };
        v["model_type"] = ty.into();
        v["architectures"] = serde_json::json!([arch]);
        v
    }
}
