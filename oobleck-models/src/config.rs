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

/// Every preset name, GPT family first; each variant right after the preset it derives from.
pub fn preset_names() -> Vec<&'static str> {
    let mut names = Vec::new();
    for &name in GptConfig::PRESETS.iter().chain(OptConfig::PRESETS) {
        names.push(name);
        names.extend(VARIANTS.iter().filter(|v| v.base == name).map(|v| v.name));
    }
    names
}

/// A preset made from another one with a change: a tiny model of an architecture that only a
/// large preset has, so it can be trained and tested in seconds.
struct Variant {
    name: &'static str,
    base: &'static str,
    change: fn(&mut ModelConfig),
}

/// `opt-tiny-postln`: opt-tiny built as opt-350m is, the only OPT preset of that kind
/// (post-LayerNorm blocks, no final LayerNorm, word embeddings half the block width and
/// projected in and out), so CI trains that architecture in seconds.
const VARIANTS: &[Variant] = &[Variant {
    name: "opt-tiny-postln",
    base: "opt-tiny",
    change: |c| {
        if let ModelConfig::Opt(c) = c {
            c.do_layer_norm_before = false;
            c.word_embed_proj_dim = Some(c.hidden_size / 2);
        }
    },
}];

/// The families `from_hf_json` reads, by `model_type`, for its messages.
const FAMILIES: &str = "gpt2 (GPT-2 and GPT-3) and opt (OPT)";

impl ModelConfig {
    /// A preset by name; an unknown name lists the presets.
    pub fn preset(name: &str) -> Result<Self> {
        if let Some(c) = GptConfig::preset(name) {
            return Ok(Self::Gpt(c));
        }
        if let Some(c) = OptConfig::preset(name) {
            return Ok(Self::Opt(c));
        }
        if let Some(v) = VARIANTS.iter().find(|v| v.name == name) {
            let mut c = Self::preset(v.base)?;
            (v.change)(&mut c);
            return Ok(c);
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
            .ok_or_else(|| {
                bad(format!(
                    "no `model_type` field; the families built are {FAMILIES}"
                ))
            })?;
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
                    "model_type `{other}` is not a family this project builds; the families \
                     built are {FAMILIES}"
                )))
            }
        };
        cfg.validate().map_err(|e| bad(e.to_string()))?;
        Ok(cfg)
    }

    /// The family's `model_type` (`gpt2`, `opt`), as in a Hugging Face `config.json`.
    pub fn model_type(&self) -> &'static str {
        match self {
            Self::Gpt(_) => "gpt2",
            Self::Opt(_) => "opt",
        }
    }

    /// The shape in words: `opt: 2 blocks, hidden 64, 4 heads, vocabulary 50272 ids`.
    pub fn shape_summary(&self) -> String {
        let (blocks, d, heads, _) = self.dims();
        format!(
            "{}: {blocks} blocks, hidden {d}, {heads} heads, vocabulary {} ids",
            self.model_type(),
            self.vocab_size()
        )
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
        let (mut v, arch) = match self {
            Self::Gpt(c) => (
                serde_json::to_value(c).expect("config serialises"),
                "GPT2LMHeadModel",
            ),
            Self::Opt(c) => (
                serde_json::to_value(c).expect("config serialises"),
                "OPTForCausalLM",
            ),
        };
        v["model_type"] = self.model_type().into();
        v["architectures"] = serde_json::json!([arch]);
        v
    }
}
