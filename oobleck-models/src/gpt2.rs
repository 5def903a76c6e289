//! GPT-2 (Radford et al. 2019) and the GPT-3 family (Brown et al. 2020, Table 2.1) as a list of
//! layers.
//!
//! Reference: Hugging Face `transformers` `models/gpt2/modeling_gpt2.py` (`GPT2LMHeadModel`),
//! and nanoGPT `model.py`. Pre-LayerNorm blocks, learned positions, GELU (tanh approximation),
//! and an output head tied to the token embedding. GPT-3's sparse attention layers are not
//! modelled, as in most re-implementations.
//!
//! Layers as the planner sees them (`L = n_layer + 2`):
//! - layer 0: `wte` + `wpe` (+ dropout)
//! - layer 1..=n_layer: transformer block `h.{i}`
//! - layer L-1: `ln_f`, LM head (`wte` again, tied) and the loss
//!
//! The tied embedding: layers 0 and L-1 both use `transformer.wte.weight`. Built together they
//! share one `Var`, so autograd sums the two gradients; built in different stages each holds a
//! copy and the engine sums the two gradients before the optimizer step (see
//! `oobleck_core::model`), which keeps the copies equal.
//!
//! Mixed precision (`ForwardCtx::dtype` BF16): the embedding's rows and every block's input
//! are cast to bf16 and stay bf16 (the residual stream too, as in Megatron-LM's bf16 mode);
//! `nn.rs` casts the f32 weights at use and keeps LayerNorm, softmax and the loss in f32.
//!
//! Parameter names follow the HF reference layout (`transformer.h.0.attn.c_attn.weight`, ...),
//! including GPT-2's Conv1D orientation: weights are stored `[in, out]`.

use std::ops::Range;

use candle_core::{DType, Device, Tensor, Var};
use oobleck_core::model::{
    check_layer_range, dropout, drops, transformer_layer_name, ForwardCtx, Layer, LayeredModel,
    ParamSource, TiedParam,
};
use serde::{Deserialize, Serialize};

use crate::nn::{
    causal_attention_packed, conv1d, gelu_tanh, layer_norm, lm_head_loss, Init, Params,
};
use crate::{Error, Result};

/// The fields of a Hugging Face GPT-2 `config.json` that shape the model.
/// Other fields of HF configs (architectures, token ids, task params) are accepted and ignored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GptConfig {
    pub vocab_size: usize,
    /// Maximum sequence length (context).
    pub n_positions: usize,
    /// Model width `d_model`.
    pub n_embd: usize,
    /// Number of transformer blocks.
    pub n_layer: usize,
    pub n_head: usize,
    /// Feed-forward width; `None` means `4 * n_embd`.
    #[serde(default)]
    pub n_inner: Option<usize>,
    /// `gelu_new` (tanh approximation, GPT-2) or `gelu` (erf).
    #[serde(default = "default_gelu")]
    pub activation_function: String,
    #[serde(default)]
    pub resid_pdrop: f64,
    #[serde(default)]
    pub embd_pdrop: f64,
    #[serde(default)]
    pub attn_pdrop: f64,
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
}

fn default_gelu() -> String {
    "gelu_new".into()
}
fn default_eps() -> f64 {
    1e-5
}
fn default_true() -> bool {
    true
}

impl GptConfig {
    /// A GPT-2-architecture config. Dropout is 0: for pretraining from scratch on a small
    /// corpus it is not needed (nanoGPT's choice); HF configs loaded from disk keep theirs.
    pub fn new(n_layer: usize, n_embd: usize, n_head: usize, n_positions: usize) -> Self {
        Self {
            vocab_size: 50257,
            n_positions,
            n_embd,
            n_layer,
            n_head,
            n_inner: None,
            activation_function: default_gelu(),
            resid_pdrop: 0.0,
            embd_pdrop: 0.0,
            attn_pdrop: 0.0,
            layer_norm_epsilon: 1e-5,
            tie_word_embeddings: true,
        }
    }

    /// Looks a preset up by name (`gpt2`, `gpt3-2.7b`, `gpt-mini`, ...).
    pub fn preset(name: &str) -> Option<Self> {
        let c = match name {
            // Tiny presets for tests and the default local run.
            "gpt-tiny" => Self::new(2, 64, 4, 64),
            "gpt-mini" => Self::new(4, 128, 4, 128),
            "gpt-small-bench" => Self::new(6, 512, 8, 256),
            // GPT-2 (HF gpt2* configs).
            "gpt2" => Self::new(12, 768, 12, 1024),
            "gpt2-medium" => Self::new(24, 1024, 16, 1024),
            "gpt2-large" => Self::new(36, 1280, 20, 1024),
            "gpt2-xl" => Self::new(48, 1600, 25, 1024),
            // GPT-3, Table 2.1, context 2048.
            "gpt3-125m" => Self::new(12, 768, 12, 2048),
            "gpt3-350m" => Self::new(24, 1024, 16, 2048),
            "gpt3-760m" => Self::new(24, 1536, 16, 2048),
            // The paper lists 24 heads of 128 (= 3072 != 2048); re-implementations use 16 x 128.
            "gpt3-1.3b" => Self::new(24, 2048, 16, 2048),
            "gpt3-2.7b" => Self::new(32, 2560, 32, 2048),
            "gpt3-6.7b" => Self::new(32, 4096, 32, 2048),
            // The paper lists d_model 5140; 40 heads x 128 = 5120 is what everyone uses.
            "gpt3-13b" => Self::new(40, 5120, 40, 2048),
            "gpt3-175b" => Self::new(96, 12288, 96, 2048),
            _ => return None,
        };
        Some(c)
    }

    pub const PRESETS: &'static [&'static str] = &[
        "gpt-tiny",
        "gpt-mini",
        "gpt-small-bench",
        "gpt2",
        "gpt2-medium",
        "gpt2-large",
        "gpt2-xl",
        "gpt3-125m",
        "gpt3-350m",
        "gpt3-760m",
        "gpt3-1.3b",
        "gpt3-2.7b",
        "gpt3-6.7b",
        "gpt3-13b",
        "gpt3-175b",
    ];

    pub fn ffn(&self) -> usize {
        self.n_inner.unwrap_or(4 * self.n_embd)
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Invalid(m));
        if self.vocab_size == 0 || self.n_positions == 0 || self.n_layer == 0 {
            return bad(format!(
                "vocab_size ({}), n_positions ({}) and n_layer ({}) must be positive",
                self.vocab_size, self.n_positions, self.n_layer
            ));
        }
        if self.n_head == 0 || self.n_embd % self.n_head != 0 {
            return bad(format!(
                "n_embd ({}) must be a positive multiple of n_head ({})",
                self.n_embd, self.n_head
            ));
        }
        if !matches!(
            self.activation_function.as_str(),
            "gelu_new" | "gelu" | "gelu_pytorch_tanh"
        ) {
            return bad(format!(
                "activation_function `{}` is not supported (gelu_new, gelu, gelu_pytorch_tanh)",
                self.activation_function
            ));
        }
        for (n, p) in [
            ("resid_pdrop", self.resid_pdrop),
            ("embd_pdrop", self.embd_pdrop),
            ("attn_pdrop", self.attn_pdrop),
        ] {
            if !(0.0..1.0).contains(&p) {
                return bad(format!("{n} = {p} must be in [0, 1)"));
            }
        }
        if !self.tie_word_embeddings {
            return bad("untied GPT-2 embeddings are not supported".into());
        }
        Ok(())
    }

    /// Exact number of trainable parameters (tied embedding counted once).
    pub fn num_params(&self) -> usize {
        let (d, f) = (self.n_embd, self.ffn());
        let block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d);
        self.vocab_size * d + self.n_positions * d + self.n_layer * block + 2 * d
    }
}

/// A GPT-2/GPT-3 model description; builds its layers on demand.
#[derive(Clone, Debug)]
pub struct Gpt {
    pub cfg: GptConfig,
}

impl Gpt {
    pub fn new(cfg: GptConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Self { cfg })
    }
}

const WTE: &str = "transformer.wte.weight";

impl LayeredModel for Gpt {
    fn num_layers(&self) -> usize {
        self.cfg.n_layer + 2
    }

    fn layer_name(&self, i: usize) -> String {
        transformer_layer_name(i, self.cfg.n_layer)
    }

    fn build_layers(
        &self,
        range: Range<usize>,
        device: &Device,
        source: ParamSource<'_>,
    ) -> oobleck_core::Result<Vec<Box<dyn Layer>>> {
        let c = &self.cfg;
        check_layer_range(&range, self.num_layers())?;
        let (d, v, f) = (c.n_embd, c.vocab_size, c.ffn());
        // GPT-2's scaled init of residual projections: std 0.02 / sqrt(2 * n_layer).
        let proj_std = 0.02 / (2.0 * c.n_layer as f64).sqrt();
        let mut p = Params::new(source, device);
        let mut layers: Vec<Box<dyn Layer>> = Vec::new();
        for idx in range {
            if idx == 0 {
                layers.push(Box::new(Embedding {
                    cfg: c.clone(),
                    wte: p.get(WTE, &[v, d], Init::Normal(0.02))?,
                    wpe: p.get(
                        "transformer.wpe.weight",
                        &[c.n_positions, d],
                        Init::Normal(0.01),
                    )?,
                }));
            } else if idx == c.n_layer + 1 {
                layers.push(Box::new(Head {
                    idx,
                    eps: c.layer_norm_epsilon,
                    ln_w: p.get("transformer.ln_f.weight", &[d], Init::Ones)?,
                    ln_b: p.get("transformer.ln_f.bias", &[d], Init::Zeros)?,
                    wte: p.get(WTE, &[v, d], Init::Normal(0.02))?,
                }));
            } else {
                let pre = format!("transformer.h.{}", idx - 1);
                let mut w = |n: &str, shape: &[usize], init| -> Result<Var> {
                    p.get(&format!("{pre}.{n}"), shape, init)
                };
                let block = Block {
                    idx,
                    cfg: c.clone(),
                    ln1_w: w("ln_1.weight", &[d], Init::Ones)?,
                    ln1_b: w("ln_1.bias", &[d], Init::Zeros)?,
                    attn_w: w("attn.c_attn.weight", &[d, 3 * d], Init::Normal(0.02))?,
                    attn_b: w("attn.c_attn.bias", &[3 * d], Init::Zeros)?,
                    attn_proj_w: w("attn.c_proj.weight", &[d, d], Init::Normal(proj_std))?,
                    attn_proj_b: w("attn.c_proj.bias", &[d], Init::Zeros)?,
                    ln2_w: w("ln_2.weight", &[d], Init::Ones)?,
                    ln2_b: w("ln_2.bias", &[d], Init::Zeros)?,
                    fc_w: w("mlp.c_fc.weight", &[d, f], Init::Normal(0.02))?,
                    fc_b: w("mlp.c_fc.bias", &[f], Init::Zeros)?,
                    mlp_proj_w: w("mlp.c_proj.weight", &[f, d], Init::Normal(proj_std))?,
                    mlp_proj_b: w("mlp.c_proj.bias", &[d], Init::Zeros)?,
                    prefix: pre,
                };
                layers.push(Box::new(block));
            }
        }
        Ok(layers)
    }

    fn tied_params(&self) -> Vec<TiedParam> {
        vec![TiedParam {
            name: WTE.into(),
            layers: vec![0, self.cfg.n_layer + 1],
        }]
    }
}

struct Embedding {
    cfg: GptConfig,
    wte: Var,
    wpe: Var,
}

impl Layer for Embedding {
    fn index(&self) -> usize {
        0
    }

    fn params(&self) -> Vec<(String, Var)> {
        vec![
            (WTE.into(), self.wte.clone()),
            ("transformer.wpe.weight".into(), self.wpe.clone()),
        ]
    }

    fn forward(&self, ids: &Tensor, ctx: &ForwardCtx) -> oobleck_core::Result<Tensor> {
        let (b, t) = ids.dims2()?;
        if t > self.cfg.n_positions {
            return Err(oobleck_core::Error::Msg(format!(
                "sequence length {t} exceeds the model's context of {} positions",
                self.cfg.n_positions
            )));
        }
        let d = self.cfg.n_embd;
        let tok = self
            .wte
            .as_tensor()
            .embedding(&ids.flatten_all()?)?
            .reshape((b, t, d))?
            .to_dtype(ctx.dtype)?;
        let pos = self.wpe.as_tensor().narrow(0, 0, t)?.to_dtype(ctx.dtype)?; // [t, d]
        let h = tok.broadcast_add(&pos)?; // [b, t, d]
        dropout(&h, self.cfg.embd_pdrop, ctx, 0, 0)
    }
}

struct Block {
    idx: usize,
    cfg: GptConfig,
    prefix: String,
    ln1_w: Var,
    ln1_b: Var,
    attn_w: Var,
    attn_b: Var,
    attn_proj_w: Var,
    attn_proj_b: Var,
    ln2_w: Var,
    ln2_b: Var,
    fc_w: Var,
    fc_b: Var,
    mlp_proj_w: Var,
    mlp_proj_b: Var,
}

impl Layer for Block {
    fn index(&self) -> usize {
        self.idx
    }

    fn params(&self) -> Vec<(String, Var)> {
        let p = &self.prefix;
        let mut v = vec![
            (format!("{p}.attn.c_attn.bias"), self.attn_b.clone()),
            (format!("{p}.attn.c_attn.weight"), self.attn_w.clone()),
            (format!("{p}.attn.c_proj.bias"), self.attn_proj_b.clone()),
            (format!("{p}.attn.c_proj.weight"), self.attn_proj_w.clone()),
            (format!("{p}.ln_1.bias"), self.ln1_b.clone()),
            (format!("{p}.ln_1.weight"), self.ln1_w.clone()),
            (format!("{p}.ln_2.bias"), self.ln2_b.clone()),
            (format!("{p}.ln_2.weight"), self.ln2_w.clone()),
            (format!("{p}.mlp.c_fc.bias"), self.fc_b.clone()),
            (format!("{p}.mlp.c_fc.weight"), self.fc_w.clone()),
            (format!("{p}.mlp.c_proj.bias"), self.mlp_proj_b.clone()),
            (format!("{p}.mlp.c_proj.weight"), self.mlp_proj_w.clone()),
        ];
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    fn forward(&self, x: &Tensor, ctx: &ForwardCtx) -> oobleck_core::Result<Tensor> {
        let c = &self.cfg;
        let eps = c.layer_norm_epsilon;
        // A stage's input arrives in f32; a no-op when it already is ctx.dtype.
        let x = &x.to_dtype(ctx.dtype)?;
        // Attention: x + c_proj(attn(c_attn(ln_1(x)))).
        let h = layer_norm(x, &self.ln1_w, &self.ln1_b, eps)?;
        let qkv = conv1d(&h, &self.attn_w, &self.attn_b)?; // [b, t, 3d]
                                                           // Attention dropout on the probabilities, keyed per sample row like the others.
        let dropping = drops(c.attn_pdrop, ctx);
        let a = causal_attention_packed(&qkv, c.n_head, dropping, |p| {
            dropout(p, c.attn_pdrop, ctx, self.idx, 2)
        })?; // [b, t, d]
        let a = conv1d(&a, &self.attn_proj_w, &self.attn_proj_b)?;
        let x = (x + dropout(&a, c.resid_pdrop, ctx, self.idx, 0)?)?;
        // MLP: x + c_proj(gelu(c_fc(ln_2(x)))).
        let h = layer_norm(&x, &self.ln2_w, &self.ln2_b, eps)?;
        let h = conv1d(&h, &self.fc_w, &self.fc_b)?; // [b, t, f]
        let h = match c.activation_function.as_str() {
            "gelu" => h.gelu_erf()?,
            _ => gelu_tanh(&h)?, // tanh approximation = HF gelu_new
        };
        let h = conv1d(&h, &self.mlp_proj_w, &self.mlp_proj_b)?; // [b, t, d]
        Ok((x + dropout(&h, c.resid_pdrop, ctx, self.idx, 1)?)?)
    }
}

struct Head {
    idx: usize,
    eps: f64,
    ln_w: Var,
    ln_b: Var,
    wte: Var,
}

impl Layer for Head {
    fn index(&self) -> usize {
        self.idx
    }

    fn params(&self) -> Vec<(String, Var)> {
        vec![
            ("transformer.ln_f.bias".into(), self.ln_b.clone()),
            ("transformer.ln_f.weight".into(), self.ln_w.clone()),
            (WTE.into(), self.wte.clone()),
        ]
    }

    fn forward(&self, x: &Tensor, ctx: &ForwardCtx) -> oobleck_core::Result<Tensor> {
        let h = layer_norm(&x.to_dtype(ctx.dtype)?, &self.ln_w, &self.ln_b, self.eps)?;
        let (b, t, d) = h.dims3()?;
        let v = self.wte.dims()[0];
        if let Some(targets) = ctx.targets {
            // Fused: the [b*t, v] logits are not kept for backward.
            return Ok((lm_head_loss(&h, &self.wte, targets)? * ctx.loss_scale)?);
        }
        let wte = self.wte.as_tensor().to_dtype(h.dtype())?;
        let logits = h.reshape((b * t, d))?.matmul(&wte.t()?)?; // [b*t, v]
        Ok(logits.reshape((b, t, v))?.to_dtype(DType::F32)?)
    }
}
