//! `train`: the main job. See `train --help`.

use anyhow::{bail, Context, Result};
use clap::Parser;
use oobleck_cli::cluster::hostfile::parse_hostfile;
use oobleck_cli::cluster::master::Launch;
use oobleck_cli::cluster::resolve;
use oobleck_cli::config::TrainArgs;
use oobleck_cli::generate::{sample, Sampling};
use oobleck_cli::progress::Progress;
use oobleck_cli::trainer::Trainer;
use oobleck_core::elastic::Token;
use oobleck_models::data::Split;

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = TrainArgs::parse();
    let mut cfg = args.resolve()?;
    let launch = match (&args.listen, &args.hostfile) {
        (Some(addr), hostfile) => {
            let addr = resolve(addr)?;
            let token = match (&args.token, hostfile) {
                (Some(secret), _) => Token::new(secret)?,
                // We hand the token to the agents ourselves.
                (None, Some(_)) => Token::random(),
                (None, None) => bail!(
                    "--listen needs the job's shared secret: set OOBLECK_TOKEN (or --token) here \
                     and give every `oobleck agent` the same one"
                ),
            };
            match hostfile {
                Some(path) => {
                    if addr.ip().is_unspecified() || addr.port() == 0 {
                        bail!(
                            "with --hostfile, --listen must be an IP:PORT the hosts can reach \
                             (not {addr}): the agents are told to connect to it"
                        );
                    }
                    let text = std::fs::read_to_string(path)
                        .with_context(|| format!("reading --hostfile {}", path.display()))?;
                    let hosts = parse_hostfile(&text, path)?;
                    cfg.nodes = hosts.len();
                    Some(Launch::Hostfile { addr, token, hosts })
                }
                None => {
                    if args.expect_nodes.is_none() {
                        bail!("--listen needs --expect-nodes N (or --hostfile FILE)");
                    }
                    Some(Launch::Listen { addr, token })
                }
            }
        }
        (None, _) if args.expect_nodes.is_some() => {
            bail!("--expect-nodes goes with --listen (agents started by hand); for a local cluster use --nodes")
        }
        (None, _) if cfg.nodes > 1 => Some(Launch::Local),
        (None, _) => None,
    };
    if let Some(launch) = launch {
        if args.resume.is_some() {
            bail!("--resume of a multi-node run is not built yet");
        }
        let summary = oobleck_cli::cluster::master::run(cfg, launch)?;
        eprintln!(
            "done: {} steps, loss {} -> {}, {:.0} tokens/s, {:.1}s",
            summary.steps,
            fmt(summary.first_loss),
            fmt(summary.final_loss),
            summary.tokens_per_s,
            summary.wall_s
        );
        if let Some(c) = &summary.checkpoint {
            eprintln!("checkpoint: {}", c.display());
        }
        if args.json {
            println!("{}", serde_json::to_string_pretty(&summary)?);
        }
        return Ok(());
    }
    if cfg.devices_per_node > 1 || cfg.pipeline_nodes.is_some() {
        bail!(
            "--devices-per-node > 1 and --pipeline-nodes need the local cluster: pass --nodes 2 \
             or more"
        );
    }
    if !cfg.inject_failure.is_empty() {
        bail!(
            "--inject-failure needs a multi-node local cluster, which this build does not run yet"
        );
    }
    let mut t = Trainer::start(cfg, args.resume.as_deref())?;
    eprintln!(
        "training {} ({:.2}M parameters, {} layers) on 1 CPU process: {} steps of {} samples x {} \
         tokens; run directory {}",
        t.cfg.model,
        t.model_cfg.num_params() as f64 / 1e6,
        t.model_cfg.num_layers(),
        t.cfg.steps,
        t.cfg.global_batch_size,
        t.cfg.seq_len,
        t.out.display()
    );
    let mut progress = Progress::new(t.cfg.steps, t.step);
    let summary = t.run(&mut progress)?;
    eprintln!(
        "done: {} steps, loss {} -> {}, validation loss {} -> {}, {:.0} tokens/s, {:.1}s",
        summary.steps,
        fmt(summary.first_loss),
        fmt(summary.final_loss),
        fmt(summary.first_val_loss),
        fmt(summary.final_val_loss),
        summary.tokens_per_s,
        summary.wall_s
    );
    if let Some(c) = &summary.checkpoint {
        eprintln!("checkpoint: {}", c.display());
    }
    if t.cfg.sample > 0 {
        let val = t.data.split(Split::Validation);
        for i in 0..t.cfg.sample {
            let b = val.sequential_batch(16, 1, i * 7)?;
            let prompt = t.data.tokenizer().decode(&b.inputs)?;
            let text = sample(
                &t.stage,
                t.data.tokenizer(),
                &prompt,
                t.model_cfg.max_seq_len(),
                Sampling {
                    max_new_tokens: 24,
                    temperature: 0.8,
                    top_k: 40,
                    seed: t.cfg.seed + i as u64,
                },
            )?;
            eprintln!("sample {}: {prompt:?} => {text:?}", i + 1);
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    }
    Ok(())
}

fn fmt(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.4}")).unwrap_or_else(|| "-".into())
}
