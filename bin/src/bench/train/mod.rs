//! `oobleck bench train`: training throughput of Candle against PyTorch eager, side by side.
//!
//! One run measures the same GPT-2 (pre-LN, GELU-tanh, tied head, fp32, no dropout) in both
//! frameworks on the same CPU threads: forward + backward + global-norm clipping + AdamW, a few
//! warm-up steps, then timed steps on seeded random tokens. Candle runs in this process, PyTorch
//! in a child (`bin/benches/torch_train.py`); each reports its own peak resident memory
//! (`VmHWM`, reset after warm-up through `/proc/self/clear_refs`), so the peak is that of the
//! timed steps.
//!
//! ```text
//!  BenchTrainArgs ─► Candle in-process ──┐
//!                 └► python3 torch_train.py (child, JSON on stdout) ─► table: tokens/s, ratio,
//!                                                                       phases, peak vs estimate
//! ```
//!
//! The analytical memory estimate (fp32, bytes):
//! `16·P` (parameters, gradients, two Adam moments) `+ 4·L·(16·b·s·h + a·b·s²)` (activations a
//! block must keep for backward without dropout: LN inputs, QKV, the attention matrix, the
//! attention output, the MLP input and the 4h-wide GELU input and output; Korthikanti et al.
//! 2022, eq. 1, without the dropout masks, in fp32) `+ 4·b·s·h` (embedding output, final LN)
//! `+ 2·4·b·s·V` (the logits and their gradient, both alive at the start of backward).

mod candle;
mod table;
mod torch;

use std::path::PathBuf;

use crate::bench::median;
use anyhow::{bail, Context, Result};
use oobleck_models::gpt2::GptConfig;
use serde::{Deserialize, Serialize};

pub use candle::{bench_candle, Variant};
use table::print_table;
use torch::bench_torch;

/// Measure training tokens/s of Candle and PyTorch eager on the same GPT and CPU threads.
#[derive(clap::Args, Clone, Debug)]
pub struct BenchTrainArgs {
    /// Transformer blocks (the issue's benchmark: 6).
    #[arg(long, default_value_t = 6)]
    pub layers: usize,
    /// Model width `d_model`.
    #[arg(long, default_value_t = 512)]
    pub hidden: usize,
    /// Attention heads (must divide `--hidden`).
    #[arg(long, default_value_t = 8)]
    pub heads: usize,
    /// Tokens per sample.
    #[arg(long, default_value_t = 256)]
    pub seq_len: usize,
    /// Samples per step (one microbatch).
    #[arg(long, default_value_t = 8)]
    pub microbatch_size: usize,
    /// Vocabulary size (GPT-2: 50257).
    #[arg(long, default_value_t = 50257)]
    pub vocab: usize,
    /// Untimed steps first (allocator and thread-pool warm-up).
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Rounds of (Candle, PyTorch), alternated; the table shows the medians.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Seed of the parameters and of the random tokens.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// CPU threads for both frameworks [default: RAYON_NUM_THREADS, else all cores].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Python interpreter that runs the PyTorch side.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// The PyTorch script [default: bin/benches/torch_train.py of this source tree].
    #[arg(long)]
    pub torch_script: Option<PathBuf>,
    /// Skip the PyTorch side.
    #[arg(long)]
    pub no_torch: bool,
    /// Give up on the PyTorch child after this many seconds.
    #[arg(long, default_value_t = 1800)]
    pub torch_timeout_s: u64,
    /// Candle variants to measure besides fp32, which PyTorch is compared with: bf16, recompute,
    /// bf16+recompute (comma-separated); each gets a row with its cost against fp32.
    #[arg(long, value_delimiter = ',')]
    pub variants: Vec<String>,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The model and step shape both frameworks run.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Shape {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub seq_len: usize,
    pub batch: usize,
    pub vocab: usize,
}

impl Shape {
    fn gpt_config(&self) -> GptConfig {
        let mut c = GptConfig::new(self.layers, self.hidden, self.heads, self.seq_len);
        c.vocab_size = self.vocab;
        c
    }

    pub fn tokens_per_step(&self) -> usize {
        self.batch * self.seq_len
    }
}

/// The analytical peak of one training step, in bytes (see the module docs for the formula).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct MemoryEstimate {
    pub params: u64,
    pub grads: u64,
    pub adam: u64,
    pub activations: u64,
    pub total: u64,
}

pub fn memory_estimate(shape: &Shape) -> MemoryEstimate {
    let p = shape.gpt_config().num_params() as u64;
    let (l, b, s, h, a, v) = (
        shape.layers as u64,
        shape.batch as u64,
        shape.seq_len as u64,
        shape.hidden as u64,
        shape.heads as u64,
        shape.vocab as u64,
    );
    let activations = 4 * (l * (16 * b * s * h + a * b * s * s) + b * s * h + 2 * b * s * v);
    MemoryEstimate {
        params: 4 * p,
        grads: 4 * p,
        adam: 8 * p,
        activations,
        total: 16 * p + activations,
    }
}

/// What one framework measured. Times are means over the timed steps, in seconds.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FrameworkResult {
    pub framework: String,
    pub threads: usize,
    pub tokens_per_s: f64,
    pub step_s: f64,
    pub forward_s: f64,
    pub backward_s: f64,
    /// Gradient clipping + AdamW.
    pub optimizer_s: f64,
    pub first_loss: f64,
    pub last_loss: f64,
    /// Resident memory before the model was built.
    pub base_rss_bytes: Option<u64>,
    /// Peak resident memory over the timed steps (the whole run where it cannot be reset).
    pub peak_rss_bytes: Option<u64>,
    /// Whether the peak could be reset after warm-up (else it covers the whole run, which is
    /// still an upper bound of a step's peak).
    #[serde(default)]
    pub peak_covers_timed_steps_only: bool,
}

/// The PyTorch side: measured, or why not.
#[derive(Clone, Debug, Serialize)]
#[serde(untagged)]
pub enum TorchOutcome {
    Measured(FrameworkResult),
    Unavailable { unavailable: String },
}

#[derive(Serialize)]
struct Report {
    shape: Shape,
    estimate: MemoryEstimate,
    candle: FrameworkResult,
    torch: TorchOutcome,
    /// Median over the rounds of the per-round ratio.
    ratio_candle_over_torch: Option<f64>,
    /// The other Candle variants (`--variants`), medians over the rounds.
    variants: Vec<FrameworkResult>,
    rounds: Vec<Round>,
}

/// Tokens/s of one round (Candle, then PyTorch).
#[derive(Clone, Debug, Serialize)]
pub struct Round {
    pub candle_tokens_per_s: f64,
    pub torch_tokens_per_s: Option<f64>,
    pub ratio: Option<f64>,
}

/// The run with the median tokens/s (the lower median for an even count).
fn median_by_tokens(mut runs: Vec<FrameworkResult>) -> FrameworkResult {
    runs.sort_by(|a, b| a.tokens_per_s.total_cmp(&b.tokens_per_s));
    let mid = (runs.len() - 1) / 2;
    runs.swap_remove(mid)
}

/// The benchmark's shape, refused when it cannot run.
fn shape_of(args: &BenchTrainArgs) -> Result<Shape> {
    let shape = Shape {
        layers: args.layers,
        hidden: args.hidden,
        heads: args.heads,
        seq_len: args.seq_len,
        batch: args.microbatch_size,
        vocab: args.vocab,
    };
    if args.steps == 0 || args.rounds == 0 {
        bail!("--steps and --rounds must be at least 1");
    }
    if shape.vocab == 0 || shape.seq_len == 0 || shape.batch == 0 {
        bail!("--vocab, --seq-len and --microbatch-size must be at least 1");
    }
    Ok(shape)
}

/// The PyTorch side over the rounds: the median run when every round measured, else why not.
fn median_torch(torches: Vec<TorchOutcome>) -> TorchOutcome {
    if let Some(na) = torches
        .iter()
        .find(|t| matches!(t, TorchOutcome::Unavailable { .. }))
    {
        return na.clone();
    }
    let runs = torches.into_iter().filter_map(|t| match t {
        TorchOutcome::Measured(r) => Some(r),
        TorchOutcome::Unavailable { .. } => None,
    });
    TorchOutcome::Measured(median_by_tokens(runs.collect()))
}

pub fn run(args: &BenchTrainArgs) -> Result<()> {
    let shape = shape_of(args)?;
    if let Some(t) = args.threads {
        if t == 0 {
            bail!("--threads must be at least 1");
        }
        // Candle (and the rayon pool it starts on first use) read this variable; nothing has
        // started a thread pool yet at this point of the command.
        std::env::set_var("RAYON_NUM_THREADS", t.to_string());
    }
    let threads = candle_core::utils::get_num_threads();
    let variants = (args.variants.iter())
        .map(|v| Variant::parse(v))
        .collect::<Result<Vec<_>>>()?;
    let mut by_variant: Vec<Vec<FrameworkResult>> = vec![Vec::new(); variants.len()];
    // Alternate the frameworks round by round: on a shared machine the load drifts, and a
    // per-round ratio compares two runs that saw about the same load.
    let mut candles = Vec::with_capacity(args.rounds);
    let mut torches = Vec::with_capacity(args.rounds);
    for _ in 0..args.rounds {
        candles.push(
            bench_candle(&shape, args.warmup, args.steps, args.seed, Variant::FP32)
                .context("Candle side of the benchmark")?,
        );
        for (v, runs) in variants.iter().zip(&mut by_variant) {
            let what = format!("Candle {} side of the benchmark", v.name());
            runs.push(bench_candle(&shape, args.warmup, args.steps, args.seed, *v).context(what)?);
        }
        torches.push(if args.no_torch {
            TorchOutcome::Unavailable {
                unavailable: "skipped (--no-torch)".into(),
            }
        } else {
            bench_torch(args, &shape, threads)?
        });
    }
    let rounds: Vec<Round> = candles
        .iter()
        .zip(&torches)
        .map(|(c, t)| {
            let torch_tokens_per_s = match t {
                TorchOutcome::Measured(t) if t.tokens_per_s > 0.0 => Some(t.tokens_per_s),
                _ => None,
            };
            Round {
                candle_tokens_per_s: c.tokens_per_s,
                torch_tokens_per_s,
                ratio: torch_tokens_per_s.map(|t| c.tokens_per_s / t),
            }
        })
        .collect();
    let ratios: Vec<f64> = rounds.iter().filter_map(|r| r.ratio).collect();
    let ratio = (!ratios.is_empty()).then(|| median(&ratios));
    let candle = median_by_tokens(candles);
    let torch = median_torch(torches);
    let report = Report {
        shape,
        estimate: memory_estimate(&shape),
        candle,
        torch,
        ratio_candle_over_torch: ratio,
        variants: by_variant.into_iter().map(median_by_tokens).collect(),
        rounds,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report, args);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::train::candle::tests::tiny;

    #[test]
    fn memory_estimate_counts_sixteen_bytes_per_parameter() {
        let s = tiny();
        let e = memory_estimate(&s);
        let p = s.gpt_config().num_params() as u64;
        assert_eq!(e.params + e.grads + e.adam, 16 * p);
        assert_eq!(e.total, 16 * p + e.activations);
        // Two [b*s, V] fp32 tensors are part of the activations.
        assert!(e.activations > 2 * 4 * 32 * 96);
    }

    #[test]
    fn median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[0.5, 0.9]), 0.7);
    }
}
