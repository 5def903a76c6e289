//! OPT (Zhang et al. 2022, "OPT: Open Pre-trained Transformer Language Models", Table 1) as a
//! list of layers.
//!
//! Reference: Hugging Face `transformers` `models/opt/modeling_opt.py` (`OPTForCausalLM`).
//! Learned positions with an offset of 2 (positions `0..t` read rows `2..t+2`), ReLU, feed-forward
//! width 4 x d_model, pre-LayerNorm except opt-350m, whose blocks are post-LayerNorm, which has no
//! final LayerNorm, and whose 512-wide word embeddings are projected in and out of the
//! 1024-wide blocks (`project_in`, `project_out`). The LM head is tied to `embed_tokens`.
//!
//! Layers (`L = num_hidden_layers + 2`):
//! - layer 0: `embed_tokens` (+ `project_in`) + `embed_positions`
//! - layer 1..=n: decoder layer `layers.{i}`
//! - layer L-1: `final_layer_norm` (pre-LN only), `project_out`, LM head (tied) and the loss
//!
//! The tied `model.decoder.embed_tokens.weight` is handled as for GPT (see `gpt2.rs`), and so
//! is mixed precision: hidden states in bf16, f32 weights cast at use, LayerNorm, softmax and
//! loss in f32.
//! Inputs are assumed unpadded (an all-ones attention mask), which is what training on packed
//! token windows gives.

use std::ops::Range;

use candle_core::{DType, Device, Tensor, Var};
use oobleck_core::model::{
    check_layer_range, dropout, drops, transformer_layer_name, ForwardCtx, Layer, LayeredModel,
    ParamSource, TiedParam,
};
use serde::{Deserialize, Serialize};

use crate::nn::{causal_attention, layer_norm, linear, lm_head_loss, Init, Params};
use crate::{Error, Result};

/// HF's learned positional embedding reserves two rows in front.
const POSITION_OFFSET: usize = 2;

/// The fields of a Hugging Face OPT `config.json` that shape the model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub ffn_dim: usize,
    pub max_position_embeddings: usize,
    /// Pre-LN (true) or post-LN (false, opt-350m).
    #[serde(default = "default_true")]
    pub do_layer_norm_before: bool,
    /// Width of the token embedding; differs from `hidden_size` only in opt-350m.
    #[serde(default)]
    pub word_embed_proj_dim: Option<usize>,
    #[serde(default)]
    pub dropout: f64,
    #[serde(default)]
    pub attention_dropout: f64,
    #[serde(default = "default_relu")]
    pub activation_function: String,
    #[serde(default = "default_true")]
    pub enable_bias: bool,
    #[serde(default = "default_true")]
    pub layer_norm_elementwise_affine: bool,
    #[serde(default)]
    pub _remove_final_layer_norm: bool,
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
}

fn default_true() -> bool {
    true
}
fn default_relu() -> String {
    "relu".into()
}

impl OptConfig {
    fn new(layers: usize, d: usize, heads: usize) -> Self {
        Self {
            vocab_size: 50272,
            hidden_size: d,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            ffn_dim: 4 * d,
            max_position_embeddings: 2048,
            do_layer_norm_before: true,
            word_embed_proj_dim: None,
            dropout: 0.0,
            attention_dropout: 0.0,
            activation_function: default_relu(),
            enable_bias: true,
            layer_norm_elementwise_affine: true,
            _remove_final_layer_norm: false,
            tie_word_embeddings: true,
        }
    }

    /// Looks a preset up by name (`opt-125m` ... `opt-175b`, `opt-tiny`).
    pub fn preset(name: &str) -> Option<Self> {
        let c = match name {
            "opt-tiny" => {
                let mut c = Self::new(2, 64, 4);
                c.max_position_embeddings = 64;
                c
            }
            "opt-125m" => Self::new(12, 768, 12),
            "opt-350m" => {
                let mut c = Self::new(24, 1024, 16);
                c.do_layer_norm_before = false;
                c.word_embed_proj_dim = Some(512);
                c
            }
            "opt-1.3b" => Self::new(24, 2048, 32),
            "opt-2.7b" => Self::new(32, 2560, 32),
            "opt-6.7b" => Self::new(32, 4096, 32),
            "opt-13b" => Self::new(40, 5120, 40),
            "opt-30b" => Self::new(48, 7168, 56),
            "opt-66b" => Self::new(64, 9216, 72),
            "opt-175b" => Self::new(96, 12288, 96),
            _ => return None,
        };
        Some(c)
    }

    pub const PRESETS: &'static [&'static str] = &[
        "opt-tiny", "opt-125m", "opt-350m", "opt-1.3b", "opt-2.7b", "opt-6.7b", "opt-13b",
        "opt-30b", "opt-66b", "opt-175b",
    ];

    /// Width of the token embedding.
    pub fn embed_dim(&self) -> usize {
        self.word_embed_proj_dim.unwrap_or(self.hidden_size)
    }

    fn projected(&self) -> bool {
        self.embed_dim() != self.hidden_size
    }

    fn has_final_norm(&self) -> bool {
        self.do_layer_norm_before && !self._remove_final_layer_norm
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Invalid(m));
        if self.vocab_size == 0 || self.num_hidden_layers == 0 || self.ffn_dim == 0 {
            return bad(format!(
                "vocab_size ({}), num_hidden_layers ({}) and ffn_dim ({}) must be positive",
                self.vocab_size, self.num_hidden_layers, self.ffn_dim
            ));
        }
        if self.num_attention_heads == 0 || self.hidden_size % self.num_attention_heads != 0 {
            return bad(format!(
                "hidden_size ({}) must be a positive multiple of num_attention_heads ({})",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if self.activation_function != "relu" {
            return bad(format!(
                "activation_function `{}` is not supported for OPT (relu)",
                self.activation_function
            ));
        }
        if !self.enable_bias || !self.layer_norm_elementwise_affine || !self.tie_word_embeddings {
            return bad(
                "OPT variants without biases, affine LayerNorms or tied embeddings are not supported"
                    .into(),
            );
        }
        for (n, p) in [
            ("dropout", self.dropout),
            ("attention_dropout", self.attention_dropout),
        ] {
            if !(0.0..1.0).contains(&p) {
                return bad(format!("{n} = {p} must be in [0, 1)"));
            }
        }
        Ok(())
    }

    /// Exact number of trainable parameters (tied embedding counted once).
    pub fn num_params(&self) -> usize {
        let (d, w, f) = (self.hidden_size, self.embed_dim(), self.ffn_dim);
        let proj = if self.projected() { 2 * d * w } else { 0 };
        let block = 4 * (d * d + d) + 2 * 2 * d + (d * f + f) + (f * d + d);
        let final_ln = if self.has_final_norm() { 2 * d } else { 0 };
        self.vocab_size * w
            + (self.max_position_embeddings + POSITION_OFFSET) * d
            + proj
            + self.num_hidden_layers * block
            + final_ln
    }
}

/// An OPT model description; builds its layers on demand.
#[derive(Clone, Debug)]
pub struct Opt {
    pub cfg: OptConfig,
}

impl Opt {
    pub fn new(cfg: OptConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Self { cfg })
    }
}

const EMBED: &str = "model.decoder.embed_tokens.weight";

impl LayeredModel for Opt {
    fn num_layers(&self) -> usize {
        self.cfg.num_hidden_layers + 2
    }

    fn layer_name(&self, i: usize) -> String {
        transformer_layer_name(i, self.cfg.num_hidden_layers)
    }

    fn build_layers(
        &self,
        range: Range<usize>,
        device: &Device,
        source: ParamSource<'_>,
    ) -> oobleck_core::Result<Vec<Box<dyn Layer>>> {
        let c = &self.cfg;
        check_layer_range(&range, self.num_layers())?;
        let (d, w, f, v) = (c.hidden_size, c.embed_dim(), c.ffn_dim, c.vocab_size);
        let mut p = Params::new(source, device);
        let mut layers: Vec<Box<dyn Layer>> = Vec::new();
        for idx in range {
            if idx == 0 {
                let project_in = if c.projected() {
                    Some(p.get(
                        "model.decoder.project_in.weight",
                        &[d, w],
                        Init::Normal(0.02),
                    )?)
                } else {
                    None
                };
                layers.push(Box::new(Embedding {
                    cfg: c.clone(),
                    embed: p.get(EMBED, &[v, w], Init::Normal(0.02))?,
                    positions: p.get(
                        "model.decoder.embed_positions.weight",
                        &[c.max_position_embeddings + POSITION_OFFSET, d],
                        Init::Normal(0.02),
                    )?,
                    project_in,
                }));
            } else if idx == c.num_hidden_layers + 1 {
                let norm = if c.has_final_norm() {
                    Some((
                        p.get("model.decoder.final_layer_norm.weight", &[d], Init::Ones)?,
                        p.get("model.decoder.final_layer_norm.bias", &[d], Init::Zeros)?,
                    ))
                } else {
                    None
                };
                let project_out = if c.projected() {
                    Some(p.get(
                        "model.decoder.project_out.weight",
                        &[w, d],
                        Init::Normal(0.02),
                    )?)
                } else {
                    None
                };
                layers.push(Box::new(Head {
                    idx,
                    norm,
                    project_out,
                    embed: p.get(EMBED, &[v, w], Init::Normal(0.02))?,
                }));
            } else {
                let pre = format!("model.decoder.layers.{}", idx - 1);
                let mut params = Vec::new();
                let mut get = |n: &str, shape: &[usize], init| -> Result<Var> {
                    let var = p.get(&format!("{pre}.{n}"), shape, init)?;
                    params.push((format!("{pre}.{n}"), var.clone()));
                    Ok(var)
                };
                let std = 0.02;
                let block = DecoderLayer {
                    idx,
                    cfg: c.clone(),
                    q: (
                        get("self_attn.q_proj.weight", &[d, d], Init::Normal(std))?,
                        get("self_attn.q_proj.bias", &[d], Init::Zeros)?,
                    ),
                    k: (
                        get("self_attn.k_proj.weight", &[d, d], Init::Normal(std))?,
                        get("self_attn.k_proj.bias", &[d], Init::Zeros)?,
                    ),
                    v: (
                        get("self_attn.v_proj.weight", &[d, d], Init::Normal(std))?,
                        get("self_attn.v_proj.bias", &[d], Init::Zeros)?,
                    ),
                    out: (
                        get("self_attn.out_proj.weight", &[d, d], Init::Normal(std))?,
                        get("self_attn.out_proj.bias", &[d], Init::Zeros)?,
                    ),
                    attn_ln: (
                        get("self_attn_layer_norm.weight", &[d], Init::Ones)?,
                        get("self_attn_layer_norm.bias", &[d], Init::Zeros)?,
                    ),
                    fc1: (
                        get("fc1.weight", &[f, d], Init::Normal(std))?,
                        get("fc1.bias", &[f], Init::Zeros)?,
                    ),
                    fc2: (
                        get("fc2.weight", &[d, f], Init::Normal(std))?,
                        get("fc2.bias", &[d], Init::Zeros)?,
                    ),
                    ffn_ln: (
                        get("final_layer_norm.weight", &[d], Init::Ones)?,
                        get("final_layer_norm.bias", &[d], Init::Zeros)?,
                    ),
                    params: Vec::new(),
                };
                let mut block = block;
                params.sort_by(|a, b| a.0.cmp(&b.0));
                block.params = params;
                layers.push(Box::new(block));
            }
        }
        Ok(layers)
    }

    fn tied_params(&self) -> Vec<TiedParam> {
        vec![TiedParam {
            name: EMBED.into(),
            layers: vec![0, self.cfg.num_hidden_layers + 1],
        }]
    }
}

struct Embedding {
    cfg: OptConfig,
    embed: Var,
    positions: Var,
    project_in: Option<Var>,
}

impl Layer for Embedding {
    fn index(&self) -> usize {
        0
    }

    fn params(&self) -> Vec<(String, Var)> {
        let mut v: Vec<(String, Var)> = vec![
            (
                "model.decoder.embed_positions.weight".into(),
                self.positions.clone(),
            ),
            (EMBED.into(), self.embed.clone()),
        ];
        if let Some(p) = &self.project_in {
            v.push(("model.decoder.project_in.weight".into(), p.clone()));
        }
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    fn forward(&self, ids: &Tensor, ctx: &ForwardCtx) -> oobleck_core::Result<Tensor> {
        let (b, t) = ids.dims2()?;
        if t > self.cfg.max_position_embeddings {
            return Err(oobleck_core::Error::Msg(format!(
                "sequence length {t} exceeds the model's context of {} positions",
                self.cfg.max_position_embeddings
            )));
        }
        let w = self.cfg.embed_dim();
        let mut h = self
            .embed
            .as_tensor()
            .embedding(&ids.flatten_all()?)?
            .reshape((b, t, w))?
            .to_dtype(ctx.dtype)?;
        if let Some(p) = &self.project_in {
            h = linear(&h, p, None)?; // [b, t, d]
        }
        let pos = self
            .positions
            .as_tensor()
            .narrow(0, POSITION_OFFSET, t)?
            .to_dtype(ctx.dtype)?; // [t, d]
        let h = h.broadcast_add(&pos)?;
        dropout(&h, self.cfg.dropout, ctx, 0, 0)
    }
}

struct DecoderLayer {
    idx: usize,
    cfg: OptConfig,
    q: (Var, Var),
    k: (Var, Var),
    v: (Var, Var),
    out: (Var, Var),
    attn_ln: (Var, Var),
    fc1: (Var, Var),
    fc2: (Var, Var),
    ffn_ln: (Var, Var),
    params: Vec<(String, Var)>,
}

impl Layer for DecoderLayer {
    fn index(&self) -> usize {
        self.idx
    }

    fn params(&self) -> Vec<(String, Var)> {
        self.params.clone()
    }

    fn forward(&self, x: &Tensor, ctx: &ForwardCtx) -> oobleck_core::Result<Tensor> {
        let c = &self.cfg;
        let eps = 1e-5;
        let pre = c.do_layer_norm_before;
        // A stage's input arrives in f32; a no-op when it already is ctx.dtype.
        let x = &x.to_dtype(ctx.dtype)?;
        let lin = |x: &Tensor, p: &(Var, Var)| linear(x, &p.0, Some(&p.1));
        // Self-attention with residual; LayerNorm before (pre-LN) or after (post-LN).
        let h = if pre {
            layer_norm(x, &self.attn_ln.0, &self.attn_ln.1, eps)?
        } else {
            x.clone()
        };
        let a = causal_attention(
            &lin(&h, &self.q)?,
            &lin(&h, &self.k)?,
            &lin(&h, &self.v)?,
            c.num_attention_heads,
            drops(c.attention_dropout, ctx),
            |p| dropout(p, c.attention_dropout, ctx, self.idx, 2),
        )?;
        let a = lin(&a, &self.out)?;
        let mut x = (x + dropout(&a, c.dropout, ctx, self.idx, 0)?)?;
        if !pre {
            x = layer_norm(&x, &self.attn_ln.0, &self.attn_ln.1, eps)?;
        }
        // Feed-forward with residual.
        let h = if pre {
            layer_norm(&x, &self.ffn_ln.0, &self.ffn_ln.1, eps)?
        } else {
            x.clone()
        };
        let h = lin(&lin(&h, &self.fc1)?.relu()?, &self.fc2)?; // [b, t, d]
        let mut x = (x + dropout(&h, c.dropout, ctx, self.idx, 1)?)?;
        if !pre {
            x = layer_norm(&x, &self.ffn_ln.0, &self.ffn_ln.1, eps)?;
        }
        Ok(x)
    }
}

struct Head {
    idx: usize,
    norm: Option<(Var, Var)>,
    project_out: Option<Var>,
    embed: Var,
}

impl Layer for Head {
    fn index(&self) -> usize {
        self.idx
    }

    fn params(&self) -> Vec<(String, Var)> {
        let mut v: Vec<(String, Var)> = vec![(EMBED.to_string(), self.embed.clone())];
        if let Some((w, b)) = &self.norm {
            v.push(("model.decoder.final_layer_norm.bias".into(), b.clone()));
            v.push(("model.decoder.final_layer_norm.weight".into(), w.clone()));
        }
        if let Some(p) = &self.project_out {
            v.push(("model.decoder.project_out.weight".into(), p.clone()));
        }
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    fn forward(&self, x: &Tensor, ctx: &ForwardCtx) -> oobleck_core::Result<Tensor> {
        let mut h = x.to_dtype(ctx.dtype)?;
        if let Some((w, b)) = &self.norm {
            h = layer_norm(&h, w, b, 1e-5)?;
        }
        if let Some(p) = &self.project_out {
            h = linear(&h, p, None)?; // [b, t, w]
        }
        match ctx.targets {
            // Fused: the [b*t, v] logits are not kept for backward.
            Some(targets) => Ok((lm_head_loss(&h, &self.embed, targets)? * ctx.loss_scale)?),
            None => Ok(linear(&h, &self.embed, None)?.to_dtype(DType::F32)?), // [b, t, v]
        }
    }
}
