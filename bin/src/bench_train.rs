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

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::bench_pipeline::median;
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use oobleck_core::model::{DropoutKey, ForwardCtx, LayeredModel, ParamSource, Stage};
use oobleck_core::optim::{clip_grad_norm, AdamW, AdamWConfig};
use oobleck_models::gpt2::{Gpt, GptConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

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

pub fn run(args: &BenchTrainArgs) -> Result<()> {
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
    if let Some(t) = args.threads {
        if t == 0 {
            bail!("--threads must be at least 1");
        }
        // Candle (and the rayon pool it starts on first use) read this variable; nothing has
        // started a thread pool yet at this point of the command.
        std::env::set_var("RAYON_NUM_THREADS", t.to_string());
    }
    let threads = candle_core::utils::get_num_threads();
    // Alternate the frameworks round by round: on a shared machine the load drifts, and a
    // per-round ratio compares two runs that saw about the same load.
    let mut candles = Vec::with_capacity(args.rounds);
    let mut torches = Vec::with_capacity(args.rounds);
    for _ in 0..args.rounds {
        candles.push(
            bench_candle(&shape, args.warmup, args.steps, args.seed)
                .context("Candle side of the benchmark")?,
        );
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
    let torch = match torches
        .iter()
        .all(|t| matches!(t, TorchOutcome::Measured(_)))
    {
        true => TorchOutcome::Measured(median_by_tokens(
            torches
                .into_iter()
                .filter_map(|t| match t {
                    TorchOutcome::Measured(r) => Some(r),
                    TorchOutcome::Unavailable { .. } => None,
                })
                .collect(),
        )),
        false => torches
            .into_iter()
            .find(|t| matches!(t, TorchOutcome::Unavailable { .. }))
            .expect("not all rounds measured, so one is unavailable"),
    };
    let report = Report {
        shape,
        estimate: memory_estimate(&shape),
        candle,
        torch,
        ratio_candle_over_torch: ratio,
        rounds,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report, args);
    }
    Ok(())
}

/// Seeded random `(inputs, targets)` token ids, each `[b, t]`.
fn random_tokens(shape: &Shape, seed: u64, step: usize) -> Result<(Tensor, Tensor)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (step as u64).wrapping_mul(0x9e37_79b9));
    let n = shape.batch * shape.seq_len;
    let v = shape.vocab as u32;
    let inp: Vec<u32> = (0..n).map(|_| rng.random_range(0..v)).collect();
    let tgt: Vec<u32> = (0..n).map(|_| rng.random_range(0..v)).collect();
    let dims = (shape.batch, shape.seq_len);
    Ok((
        Tensor::from_vec(inp, dims, &Device::Cpu)?,
        Tensor::from_vec(tgt, dims, &Device::Cpu)?,
    ))
}

/// The optimizer settings of both sides (nanoGPT's GPT-2 recipe).
fn adamw_config() -> AdamWConfig {
    AdamWConfig {
        lr: 3e-4,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    }
}

/// Runs the Candle side in this process: what `train` does for one microbatch per step.
pub fn bench_candle(
    shape: &Shape,
    warmup: usize,
    steps: usize,
    seed: u64,
) -> Result<FrameworkResult> {
    let base_rss = proc_status_kib("VmRSS");
    let model = Gpt::new(shape.gpt_config())?;
    let layers = model.build_layers(
        0..model.num_layers(),
        &Device::Cpu,
        ParamSource::Init { seed },
    )?;
    let stage = Stage::new(layers)?;
    let params = stage.params();
    let mut opt = AdamW::new(adamw_config())?;
    let mut times = Vec::with_capacity(steps);
    let (mut first_loss, mut last_loss) = (f64::NAN, f64::NAN);
    let mut peak_reset = false;
    for step in 0..warmup + steps {
        if step == warmup {
            peak_reset = reset_peak_rss();
        }
        let (inp, tgt) = random_tokens(shape, seed, step)?;
        let ctx = ForwardCtx {
            targets: Some(&tgt),
            loss_scale: 1.0,
            train: true,
            dropout_key: DropoutKey {
                seed,
                iteration: step as u64,
                microbatch: 0,
            },
            rows: None,
            dtype: candle_core::DType::F32,
        };
        let t0 = Instant::now();
        let fwd = stage.forward(&inp, &ctx)?;
        let loss = f64::from(fwd.output.to_scalar::<f32>()?);
        let t1 = Instant::now();
        let mut grads = stage.backward(fwd, None)?.params;
        let t2 = Instant::now();
        clip_grad_norm(&mut grads, 1.0)?;
        opt.step(&params, &grads, adamw_config().lr)?;
        let t3 = Instant::now();
        if !loss.is_finite() {
            bail!("Candle loss is {loss} at step {step}");
        }
        if step == 0 {
            first_loss = loss;
        }
        last_loss = loss;
        if step >= warmup {
            times.push([t1 - t0, t2 - t1, t3 - t2]);
        }
    }
    let mean = |i: usize| times.iter().map(|t| t[i].as_secs_f64()).sum::<f64>() / steps as f64;
    let (f, b, o) = (mean(0), mean(1), mean(2));
    let step_s = f + b + o;
    Ok(FrameworkResult {
        framework: format!("candle {}", candle_version()),
        threads: candle_core::utils::get_num_threads(),
        tokens_per_s: shape.tokens_per_step() as f64 / step_s,
        step_s,
        forward_s: f,
        backward_s: b,
        optimizer_s: o,
        first_loss,
        last_loss,
        base_rss_bytes: base_rss.map(|k| k * 1024),
        peak_rss_bytes: proc_status_kib("VmHWM").map(|k| k * 1024),
        peak_covers_timed_steps_only: peak_reset,
    })
}

fn candle_version() -> &'static str {
    "0.11"
}

/// A `kB` field of `/proc/self/status` (Linux only).
fn proc_status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|l| {
        let rest = l.strip_prefix(field)?.strip_prefix(':')?;
        rest.trim().strip_suffix("kB")?.trim().parse().ok()
    })
}

/// Resets `VmHWM` to the current RSS (Linux >= 4.0); false where that is not possible.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn torch_script(args: &BenchTrainArgs) -> PathBuf {
    args.torch_script
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/torch_train.py"))
}

/// Runs the PyTorch side in a child process. A missing interpreter or torch is `Unavailable`;
/// a script that fails otherwise is an error (a broken reference must not look like "n/a").
fn bench_torch(args: &BenchTrainArgs, shape: &Shape, threads: usize) -> Result<TorchOutcome> {
    let script = torch_script(args);
    if !script.is_file() {
        return Ok(TorchOutcome::Unavailable {
            unavailable: format!("script {} not found", script.display()),
        });
    }
    let mut cmd = Command::new(&args.python);
    cmd.arg(&script)
        .args(["--layers", &shape.layers.to_string()])
        .args(["--hidden", &shape.hidden.to_string()])
        .args(["--heads", &shape.heads.to_string()])
        .args(["--seq-len", &shape.seq_len.to_string()])
        .args(["--microbatch-size", &shape.batch.to_string()])
        .args(["--vocab", &shape.vocab.to_string()])
        .args(["--warmup", &args.warmup.to_string()])
        .args(["--steps", &args.steps.to_string()])
        .args(["--seed", &args.seed.to_string()])
        .args(["--threads", &threads.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(TorchOutcome::Unavailable {
                unavailable: format!("{} not found", args.python),
            })
        }
        Err(e) => return Err(e).with_context(|| format!("starting {}", args.python)),
    };
    // Drain both pipes on threads so a chatty child cannot block on a full pipe.
    let mut out = child.stdout.take().context("child stdout")?;
    let mut err = child.stderr.take().context("child stderr")?;
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + Duration::from_secs(args.torch_timeout_s);
    let status = loop {
        if let Some(st) = child.try_wait().context("waiting for the PyTorch child")? {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "the PyTorch side did not finish within {} s (--torch-timeout-s)",
                args.torch_timeout_s
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let stdout = out_t.join().unwrap_or_default();
    let stderr = err_t.join().unwrap_or_default();
    parse_torch_output(&stdout, &stderr, status.success(), &script)
}

/// The script's last stdout line is JSON: a [`FrameworkResult`] or `{"unavailable": why}`.
fn parse_torch_output(
    stdout: &str,
    stderr: &str,
    success: bool,
    script: &std::path::Path,
) -> Result<TorchOutcome> {
    let last = stdout.lines().rev().find(|l| !l.trim().is_empty());
    if !success {
        bail!(
            "{} failed:\n{}",
            script.display(),
            stderr.lines().rev().take(20).collect::<Vec<_>>().join("\n")
        );
    }
    let line = last.with_context(|| format!("{} printed nothing", script.display()))?;
    let v: serde_json::Value = serde_json::from_str(line)
        .with_context(|| format!("{} printed `{line}`, not JSON", script.display()))?;
    if let Some(why) = v.get("unavailable").and_then(|w| w.as_str()) {
        return Ok(TorchOutcome::Unavailable {
            unavailable: why.to_string(),
        });
    }
    let r: FrameworkResult = serde_json::from_value(v)
        .with_context(|| format!("{} printed an unexpected result `{line}`", script.display()))?;
    Ok(TorchOutcome::Measured(r))
}

fn mib(b: Option<u64>) -> String {
    b.map_or("n/a".into(), |b| {
        format!("{:.0} MiB", b as f64 / (1 << 20) as f64)
    })
}

fn print_table(r: &Report, args: &BenchTrainArgs) {
    let s = &r.shape;
    println!(
        "GPT {} layers, hidden {}, {} heads, seq {}, microbatch {}, vocab {} ({} params); \
         {} warm-up + {} timed steps, {} threads",
        s.layers,
        s.hidden,
        s.heads,
        s.seq_len,
        s.batch,
        s.vocab,
        s.gpt_config().num_params(),
        args.warmup,
        args.steps,
        r.candle.threads
    );
    println!(
        "{:<26} {:>10} {:>9} {:>9} {:>9} {:>9} {:>11} {:>11}",
        "framework", "tokens/s", "step s", "fwd s", "bwd s", "opt s", "peak RSS", "base RSS"
    );
    let row = |f: &FrameworkResult| {
        println!(
            "{:<26} {:>10.1} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>11} {:>11}",
            f.framework,
            f.tokens_per_s,
            f.step_s,
            f.forward_s,
            f.backward_s,
            f.optimizer_s,
            mib(f.peak_rss_bytes),
            mib(f.base_rss_bytes)
        )
    };
    row(&r.candle);
    match &r.torch {
        TorchOutcome::Measured(t) => row(t),
        TorchOutcome::Unavailable { unavailable } => {
            println!("{:<26} n/a ({unavailable})", "torch")
        }
    }
    match r.ratio_candle_over_torch {
        Some(x) => println!("ratio candle/torch (tokens/s): {x:.2}"),
        None => println!("ratio candle/torch (tokens/s): n/a"),
    }
    if r.rounds.len() > 1 {
        println!("(medians of {} alternated rounds)", r.rounds.len());
        for (i, x) in r.rounds.iter().enumerate() {
            let t = x
                .torch_tokens_per_s
                .map_or("n/a".into(), |t| format!("{t:.1}"));
            let q = x.ratio.map_or("n/a".into(), |q| format!("{q:.2}"));
            println!(
                "  round {}: candle {:.1} tokens/s, torch {t}, ratio {q}",
                i + 1,
                x.candle_tokens_per_s
            );
        }
    }
    let e = &r.estimate;
    println!(
        "memory estimate: {} = params {} + grads {} + Adam {} + activations {}",
        mib(Some(e.total)),
        mib(Some(e.params)),
        mib(Some(e.grads)),
        mib(Some(e.adam)),
        mib(Some(e.activations))
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Shape {
        Shape {
            layers: 2,
            hidden: 32,
            heads: 2,
            seq_len: 16,
            batch: 2,
            vocab: 96,
        }
    }

    #[test]
    fn candle_side_trains_one_tiny_step() {
        let r = bench_candle(&tiny(), 0, 1, 3).unwrap();
        assert!(r.tokens_per_s > 0.0 && r.tokens_per_s.is_finite());
        // Random init: the loss starts near ln(vocab).
        assert!(
            (r.first_loss - (96f64).ln()).abs() < 0.5,
            "{}",
            r.first_loss
        );
        assert!(r.step_s >= r.forward_s);
    }

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

    #[test]
    fn torch_output_unavailable_and_failures_are_told_apart() {
        let p = std::path::Path::new("torch_train.py");
        let na = parse_torch_output("{\"unavailable\": \"torch not installed\"}\n", "", true, p);
        assert!(matches!(na.unwrap(), TorchOutcome::Unavailable { .. }));
        assert!(parse_torch_output("", "Traceback", false, p).is_err());
        assert!(parse_torch_output("garbage", "", true, p).is_err());
    }
}
