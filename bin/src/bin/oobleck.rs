//! `oobleck`: tools around training jobs. See `oobleck --help`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use oobleck_cli::generate::{sample, whole_model, Sampling};
use oobleck_core::checkpoint;
use oobleck_core::model::ParamSource;
use oobleck_models::data::open_tokenizer;
use oobleck_models::{preset_names, ModelConfig};

/// Freed large blocks (logits, the LM head's and the embedding's gradients) are reused, not
/// faulted in again every step; also in the agents and workers, which run this binary.
#[global_allocator]
static ALLOC: oobleck_core::runtime::TrainingAlloc = oobleck_core::runtime::TrainingAlloc;

/// Tools for Oobleck-rs training jobs.
#[derive(Parser)]
#[command(name = "oobleck", version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// List the model presets with their shapes and parameter counts.
    Models {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Print sampled continuations of a prompt from a checkpoint.
    Generate(GenerateArgs),
    /// Plan pipeline templates and their instantiation for a model and cluster; show what a
    /// failure (`--lose`) or a join (`--join`) would change.
    Plan(oobleck_cli::plan_cmd::PlanArgs),
    /// Measure every layer's forward and backward time and sizes on a device, print them and
    /// write the profile JSON (`--out`) that `plan --profile` reads; cached by fingerprint.
    Profile(oobleck_cli::profile_cmd::ProfileArgs),
    /// Replay a failure trace (or a generated one) under recovery policies: oobleck,
    /// checkpoint-restart, redundancy, and the authors' simulators (table); throughput, where
    /// the time went, and a chart (`--plot`).
    Simulate(Box<oobleck_cli::simulate_cmd::SimulateArgs>),
    /// Prepare training data: `oobleck data prepare SOURCE... --out DIR` tokenizes raw text
    /// with every core into token shards that `train --data DIR` reads.
    #[command(subcommand)]
    Data(oobleck_cli::data_cmd::DataCmd),
    /// Benchmarks (side by side with PyTorch when it is installed).
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Show a running job: nodes, pipelines, generation, committed step, throughput.
    Status(oobleck_cli::cluster::status::StatusCmd),
    /// Kill one node of a running job (SIGKILL of its agent and workers), as a crash would:
    /// `oobleck kill-node 1 --run DIR`. With f >= 1 the job recovers on the nodes left.
    KillNode(oobleck_cli::cluster::status::KillNodeArgs),
    /// Stop a running job after its next step, with that step's checkpoint, as SIGTERM to its
    /// master does, from any machine: `oobleck stop --run DIR` (follows a standby that took
    /// over). `train --resume DIR` goes on from it.
    Stop(oobleck_cli::cluster::status::StopArgs),
    /// Drain one node of a running job: it leaves at the next step boundary with no step
    /// lost (`oobleck drain 2 --run DIR`); refused when it would cost steps, unless --force.
    Drain(oobleck_cli::cluster::membership_cmd::DrainArgs),
    /// Start one more local node agent for a running local job (`oobleck add-node --run
    /// DIR`): it joins and is admitted at a step boundary.
    AddNode(oobleck_cli::cluster::membership_cmd::AddNodeArgs),
    /// Run one node of a multi-machine job: `oobleck agent --master HOST:PORT` with the job's
    /// OOBLECK_TOKEN (the master is `train --listen`; `train --nodes N` starts its own agents).
    Agent(oobleck_cli::cluster::node_cmd::AgentArgs),
    /// (Re)write a run directory's report.html (loss, throughput, plan timeline, events) and
    /// print its path.
    Report {
        /// The run directory (the `--out` of `train`).
        dir: PathBuf,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Training tokens/s of Candle vs PyTorch eager on the same GPT (fwd + bwd + clip + AdamW).
    Train(oobleck_cli::bench::train::BenchTrainArgs),
    /// A real pipeline over TCP against the schedule simulator: iteration time, bubble,
    /// gradient sync and control-plane cost per step.
    Pipeline(oobleck_cli::bench::pipeline::BenchPipelineArgs),
    /// The same job fault-free, recovering in place from injected failures, and restarting
    /// from checkpoints after each (Varuna-style), side by side: throughput, recovery phases;
    /// then a drain + join, and a worker stopped mid-step (SIGSTOP) against the watchdog.
    Recovery(oobleck_cli::bench::recovery::BenchRecoveryArgs),
    /// How long `oobleck simulate` takes at 100 to 10,000 nodes and 100 to 1,000 events over
    /// a week, re-planning at every event (target: 10,000 nodes, 1,000 events under 10 s).
    Simulate(oobleck_cli::bench::simulate::BenchSimulateArgs),
    /// A small training job alone and beside a flood of `/api/status` requests to its status
    /// page, side by side: tokens/s of both and the cost (target: under 10 %).
    StatusFlood(oobleck_cli::bench::status_flood::BenchStatusFloodArgs),
    /// The data path: tokenization MB/s of ours against tiktoken and HF tokenizers on 1 and
    /// all cores, the loader's share of a step, and peak memory on a 100 MB and a 5 GB corpus.
    Data(oobleck_cli::bench::data::BenchDataArgs),
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// A checkpoint directory (`<run>/checkpoints/step-NNNNNN`) or a run directory (its newest
    /// checkpoint that verifies).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Text to continue.
    #[arg(long, default_value = "ROMEO:")]
    prompt: String,
    /// How many continuations.
    #[arg(long, default_value_t = 3)]
    samples: usize,
    /// Tokens to generate per continuation.
    #[arg(long, default_value_t = 40)]
    max_new_tokens: usize,
    /// Softmax temperature (0 = greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Sample among the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// GPT-2 tokenizer [default: the shipped one].
    #[arg(long)]
    tokenizer: Option<PathBuf>,
}

fn main() -> ExitCode {
    oobleck_cli::exit::report(run())
}

fn run() -> Result<()> {
    oobleck_cli::logging::init();
    // Started as a worker of a job (by `oobleck agent`): that role runs here.
    oobleck_core::runtime::take_over(oobleck_models::workload::GptWorkload::factory);
    match Cli::parse().cmd {
        Cmd::Models { json } => models(json),
        Cmd::Generate(a) => generate(&a),
        Cmd::Plan(a) => oobleck_cli::plan_cmd::run(&a),
        Cmd::Profile(a) => oobleck_cli::profile_cmd::run(&a),
        Cmd::Simulate(a) => oobleck_cli::simulate_cmd::run(&a),
        Cmd::Data(c) => oobleck_cli::data_cmd::run(&c),
        Cmd::Bench(BenchCmd::Train(a)) => oobleck_cli::bench::train::run(&a),
        Cmd::Bench(BenchCmd::Pipeline(a)) => oobleck_cli::bench::pipeline::run(&a),
        Cmd::Bench(BenchCmd::Recovery(a)) => oobleck_cli::bench::recovery::run(&a),
        Cmd::Bench(BenchCmd::Simulate(a)) => oobleck_cli::bench::simulate::run(&a),
        Cmd::Bench(BenchCmd::StatusFlood(a)) => oobleck_cli::bench::status_flood::run(&a),
        Cmd::Bench(BenchCmd::Data(a)) => oobleck_cli::bench::data::run(&a),
        Cmd::Status(a) => oobleck_cli::cluster::status::run(&a),
        Cmd::KillNode(a) => oobleck_cli::cluster::status::kill_node(&a),
        Cmd::Stop(a) => oobleck_cli::cluster::status::stop(&a),
        Cmd::Drain(a) => oobleck_cli::cluster::membership_cmd::drain(&a),
        Cmd::AddNode(a) => oobleck_cli::cluster::membership_cmd::add_node(&a),
        Cmd::Agent(a) => oobleck_cli::cluster::node_cmd::run(&a),
        Cmd::Report { dir } => {
            let (path, missing) = oobleck_cli::report::write_report_noting(&dir)?;
            println!("{}", path.display());
            if let Some(note) = missing {
                eprintln!("{note}");
            }
            Ok(())
        }
    }
}

fn models(json: bool) -> Result<()> {
    let mut rows = Vec::new();
    for name in preset_names() {
        let c = ModelConfig::preset(name)?;
        let (blocks, d, heads, ffn) = c.dims();
        rows.push(serde_json::json!({
            "name": name,
            "family": match c { ModelConfig::Gpt(_) => "gpt", ModelConfig::Opt(_) => "opt" },
            "params": c.num_params(),
            "blocks": blocks,
            "layers": c.num_layers(),
            "d_model": d,
            "heads": heads,
            "ffn": ffn,
            "context": c.max_seq_len(),
            "vocab": c.vocab_size(),
        }));
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "{:<16} {:>6} {:>10} {:>7} {:>7} {:>6} {:>6} {:>8} {:>7}",
        "preset", "family", "params", "blocks", "layers", "d", "heads", "context", "vocab"
    );
    for r in rows {
        let p = r["params"].as_u64().unwrap_or(0) as f64;
        let params = if p >= 1e9 {
            format!("{:.2}B", p / 1e9)
        } else {
            format!("{:.1}M", p / 1e6)
        };
        println!(
            "{:<16} {:>6} {:>10} {:>7} {:>7} {:>6} {:>6} {:>8} {:>7}",
            r["name"].as_str().unwrap_or(""),
            r["family"].as_str().unwrap_or(""),
            params,
            r["blocks"],
            r["layers"],
            r["d_model"],
            r["heads"],
            r["context"],
            r["vocab"]
        );
    }
    Ok(())
}

/// The newest checkpoint of the run `run` that verifies, saying which newer ones it passed
/// over and why (as `train --resume` does).
fn newest_valid_checkpoint(run: &std::path::Path) -> Result<std::path::PathBuf> {
    let found = checkpoint::newest_valid(checkpoint::checkpoint_dirs(run)?);
    for s in &found.skipped {
        eprintln!(
            "--checkpoint: skipping {}, it cannot be used: {}",
            s.path.display(),
            s.reason
        );
    }
    match found.chosen {
        Some((_, path)) => Ok(path),
        None if found.skipped.is_empty() => bail!("{} holds no checkpoint", run.display()),
        None => bail!(
            "{}: none of its checkpoints can be used (each one is named above)",
            run.display()
        ),
    }
}

fn generate(a: &GenerateArgs) -> Result<()> {
    let ckpt = if a.checkpoint.join(checkpoint::TRAINER_FILE).is_file() {
        a.checkpoint.clone()
    } else {
        newest_valid_checkpoint(&a.checkpoint)?
    };
    let ck = checkpoint::load_checkpoint(&ckpt, &candle_core::Device::Cpu)?;
    let cfg_json = ck
        .trainer
        .config
        .clone()
        .with_context(|| format!("{}: trainer.json has no run config", ckpt.display()))?;
    let cfg: oobleck_cli::config::TrainConfig =
        serde_json::from_value(cfg_json).with_context(|| {
            format!(
                "{}: trainer.json holds an unreadable run config",
                ckpt.display()
            )
        })?;
    // The model of the run without its starting weights (the checkpoint has the trained ones)
    // or its corpus (only the tokenizer is needed).
    let workload = oobleck_cli::config::workload_config(&cfg);
    let model_cfg = workload.model_config()?;
    let model = model_cfg.build()?;
    let params: HashMap<_, _> = ck.params.into_iter().collect();
    let stage = whole_model(
        model.as_ref(),
        &candle_core::Device::Cpu,
        ParamSource::Tensors(&params),
    )?;
    // The ids the model was trained with: --tokenizer, else the tokenizer files the checkpoint
    // carries, else the run's (its --tokenizer, or its --init-from directory's).
    let carried = oobleck_models::data::Gpt2Tokenizer::in_model_dir(&ckpt);
    let tokenizer = match (&a.tokenizer, carried) {
        (Some(path), _) => Some(path.clone()),
        (None, Some(path)) => Some(path),
        (None, None) => workload.tokenizer_path()?,
    };
    let tok = open_tokenizer(tokenizer.as_deref())?;
    tok.check_vocab(model_cfg.vocab_size())?;
    println!("checkpoint {} (step {})", ckpt.display(), ck.trainer.step);
    for i in 0..a.samples {
        let text = sample(
            &stage,
            &tok,
            &a.prompt,
            model_cfg.max_seq_len(),
            Sampling {
                max_new_tokens: a.max_new_tokens,
                temperature: a.temperature,
                top_k: a.top_k,
                seed: a.seed + i as u64,
            },
        )?;
        println!("--- sample {} ---\n{}{}", i + 1, a.prompt, text);
    }
    Ok(())
}
