//! `train`: the main job. See `train --help`.

use anyhow::{bail, Context, Result};
use clap::Parser;
use oobleck_cli::args::TrainArgs;
use oobleck_cli::cluster::hostfile::parse_hostfile;
use oobleck_cli::cluster::job::LaunchMode;
use oobleck_cli::cluster::resolve;
use oobleck_cli::cluster::scheduled;
use oobleck_cli::config::TrainConfig;
use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use oobleck_cli::cluster::job::cluster_workload_config;
use oobleck_cli::generate::{print_samples, whole_model};
use oobleck_cli::progress::Progress;
use oobleck_cli::trainer::Trainer;
use oobleck_core::checkpoint::load_checkpoint;
use oobleck_core::model::ParamSource;
use oobleck_core::runtime::wire::Token;
use oobleck_core::runtime::Workload;
use oobleck_models::workload::GptWorkload;

/// Freed large blocks (logits, the LM head's and the embedding's gradients) are reused, not
/// faulted in again every step; also in the agents and workers, which run this binary.
#[global_allocator]
static ALLOC: oobleck_core::runtime::TrainingAlloc = oobleck_core::runtime::TrainingAlloc;

fn main() -> ExitCode {
    oobleck_cli::exit::report(run())
}

fn run() -> Result<()> {
    oobleck_cli::logging::init();
    // Started as an agent or a worker of a job (by another `train`): that role runs here.
    oobleck_core::runtime::take_over(oobleck_models::workload::GptWorkload::factory);
    // `train agent --master HOST:PORT`: one node of a multi-machine job, from this binary.
    if std::env::args_os().nth(1).is_some_and(|a| a == "agent") {
        use oobleck_cli::cluster::node_cmd::{run, TrainAgentCli};
        let cli = TrainAgentCli::parse_from(std::env::args_os().skip(1));
        return run(&cli.args);
    }
    // `train standby --master HOST:PORT`: a standby master of a running job.
    if std::env::args_os().nth(1).is_some_and(|a| a == "standby") {
        use oobleck_cli::cluster::standby_cmd::{run, TrainStandbyCli};
        let cli = TrainStandbyCli::parse_from(std::env::args_os().skip(1));
        return run(&cli.args);
    }
    let args = TrainArgs::parse();
    let mut cfg = args.resolve()?;
    // Started by a scheduler on every node of an allocation: its environment says the role.
    let env = oobleck_cli::cluster::discover::Env::of_process();
    if let Some((placement, role)) = scheduled::from_env(&args, &cfg, &env)? {
        eprintln!("{}", scheduled::describe(&placement, &role));
        return match role {
            scheduled::Role::Agent(agent) => oobleck_cli::cluster::node_cmd::run(&agent),
            scheduled::Role::Master { launch, nodes } => {
                cfg.nodes = nodes;
                train_cluster(cfg, launch, &args)
            }
        };
    }
    if args.reattach {
        let run = args
            .resume
            .as_deref()
            .context("--reattach needs --resume RUN")?;
        let launch = oobleck_cli::cluster::reattach::launch(
            &cfg,
            run,
            args.listen.as_deref(),
            args.token.as_deref(),
        )?;
        return train_cluster(cfg, launch, &args);
    }
    let launch = match (&args.listen, &args.hostfile) {
        (Some(addr), hostfile) => {
            let addr = resolve(addr)?;
            let token = match (&args.token, hostfile) {
                (Some(secret), _) => Token::new(secret)?.for_job(args.job.as_deref()),
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
                    Some(LaunchMode::Hostfile { addr, token, hosts })
                }
                None => {
                    if args.expect_nodes.is_none() {
                        bail!("--listen needs --expect-nodes N (or --hostfile FILE)");
                    }
                    Some(LaunchMode::Listen { addr, token })
                }
            }
        }
        (None, _) if args.expect_nodes.is_some() => {
            bail!("--expect-nodes goes with --listen (agents started by hand); for a local cluster use --nodes")
        }
        (None, _) if cfg.nodes > 1 => Some(LaunchMode::Local),
        (None, _) => None,
    };
    match launch {
        Some(launch) => train_cluster(cfg, launch, &args),
        None => train_one_process(cfg, &args),
    }
}

/// The job on a cluster (the runtime's), then samples from its last checkpoint.
fn train_cluster(cfg: TrainConfig, launch: LaunchMode, args: &TrainArgs) -> Result<()> {
    let batch = oobleck_cli::config::batch_shape(&cfg)?;
    let workload = Arc::new(GptWorkload::new(
        cluster_workload_config(&cfg, &launch),
        batch,
    )?);
    let page = oobleck_cli::status_page::parse_addr(args.status_addr.as_deref())?;
    let summary = oobleck_cli::cluster::job::run(
        cfg.clone(),
        workload.clone(),
        launch,
        args.resume.as_deref(),
        page,
    )?;
    eprintln!(
        "done: {} steps, loss {} -> {}, validation loss {}, {:.0} tokens/s, {:.1}s",
        summary.steps,
        fmt(summary.first_loss),
        fmt(summary.final_loss),
        fmt(summary.final_val_loss),
        summary.tokens_per_s,
        summary.wall_s
    );
    if summary.steps < cfg.steps {
        eprintln!("{}", stopped_early(summary.steps, cfg.steps, &summary.out));
    }
    if let Some(c) = &summary.checkpoint {
        eprintln!("checkpoint: {}", c.display());
        if cfg.sample > 0 {
            let params: HashMap<String, Tensor> = load_checkpoint(c, &Device::Cpu)?
                .params
                .into_iter()
                .collect();
            let stage = whole_model(
                workload.model(),
                &Device::Cpu,
                ParamSource::Tensors(&params),
            )?;
            print_samples(&stage, &workload, &cfg)?;
        }
    }
    if let Some(r) = &summary.report {
        eprintln!("report: {}", r.display());
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    }
    Ok(())
}

/// What a run that a signal stopped before its last step says.
fn stopped_early(step: u64, steps: u64, out: &std::path::Path) -> String {
    format!(
        "stopped at step {step} of {steps}, as a signal asked: `train --resume {}` goes on from \
         its checkpoint",
        out.display()
    )
}

/// The job on this process alone (the single-process trainer), then samples from the model.
fn train_one_process(cfg: TrainConfig, args: &TrainArgs) -> Result<()> {
    if cfg.devices_per_node > 1 || cfg.pipeline_nodes.is_some() {
        bail!(
            "--devices-per-node > 1 and --pipeline-nodes need the local cluster: pass --nodes 2 \
             or more"
        );
    }
    if !cfg.inject_failure.is_empty() {
        bail!("--inject-failure needs the local cluster: pass --nodes 2 or more");
    }
    if args
        .status_addr
        .as_deref()
        .is_some_and(|a| !matches!(a, "off" | "none"))
    {
        bail!(
            "--status-addr: the status page is served by a cluster job's master; this trains in \
             one process: pass --nodes 2 or more"
        );
    }
    let mut t = Trainer::start(cfg, args.resume.as_deref())?;
    // The workload's name says what is trained (a preset, or an imported model and its shape).
    eprintln!(
        "training {}: {:.2}M parameters, {} layers, on 1 process ({}); {} steps of {} samples x {} \
         tokens; run directory {}",
        t.workload.name(),
        t.workload.num_params() as f64 / 1e6,
        t.workload.model_config().num_layers(),
        if t.device.is_cuda() { "CUDA device 0" } else { "CPU" },
        t.cfg.steps,
        t.cfg.global_batch_size,
        t.cfg.seq_len,
        t.out.display()
    );
    t.stop_on_signals()?;
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
    if summary.steps < t.cfg.steps {
        eprintln!(
            "{}",
            stopped_early(summary.steps, t.cfg.steps, &summary.out)
        );
    }
    if let Some(c) = &summary.checkpoint {
        eprintln!("checkpoint: {}", c.display());
    }
    if t.cfg.sample > 0 {
        print_samples(&t.stage, &t.workload, &t.cfg)?;
    }
    if let Some(r) = &summary.report {
        eprintln!("report: {}", r.display());
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    }
    Ok(())
}

fn fmt(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.4}")).unwrap_or_else(|| "-".into())
}
