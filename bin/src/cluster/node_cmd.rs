//! `oobleck agent` / `train agent`: run one node of a multi-machine job. The node supervisor
//! itself is `oobleck_core::runtime::node`; this is its command line.

use std::io::BufRead;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use oobleck_core::runtime::node::{parse_master_wait, run_agent, AgentOptions};

/// How long `--token-stdin` waits for the token line.
const TOKEN_TIMEOUT: Duration = Duration::from_secs(10);

/// Run one node of a cluster job: `oobleck agent --master HOST:PORT` on each machine of a
/// multi-machine job (see `train --listen`).
#[derive(Debug, Clone, clap::Args)]
pub struct AgentArgs {
    /// The master's control address (`train --listen` prints it). Default: from the
    /// environment, as `train` on a scheduler's nodes finds it (OOBLECK_MASTER, Slurm,
    /// LeaderWorkerSet, JobSet, SkyPilot; see README "On a cluster").
    #[arg(long)]
    pub master: Option<String>,
    /// The job's shared secret (never sent over the network; the master checks it by
    /// challenge-response).
    #[arg(long, env = "OOBLECK_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Read the token from the first line of stdin instead (how `train --hostfile` passes it,
    /// so it never shows in a process list).
    #[arg(long, conflicts_with = "token")]
    pub token_stdin: bool,
    /// The job this agent is of: a master that runs another named job refuses it, saying so
    /// (two jobs started with one OOBLECK_TOKEN). Default: with --master, none; without, the
    /// job the environment names (OOBLECK_JOB, Slurm's job id, ...; README "On a cluster").
    #[arg(long, env = "OOBLECK_JOB")]
    pub job: Option<String>,
    /// The IP this node's workers bind their data-plane ports on. Default: the address this
    /// machine reaches the master from.
    #[arg(long)]
    pub host: Option<String>,
    /// Exit (killing the workers) when stdin closes: for agents started by `train` or ssh.
    #[arg(long)]
    pub exit_with_parent: bool,
    /// Seconds to keep retrying while the master cannot be reached (it may start later).
    #[arg(long, default_value_t = 120)]
    pub wait: u64,
    /// Seconds to keep this node's workers (and their trained state, in memory) and look for
    /// a master after losing the one it serves (its process killed, its connection cut, or
    /// silent for a lease; with --exit-with-parent, stdin closing counts as the master lost):
    /// the master's address is tried again with growing pauses (0.25 s doubling to 4 s). No
    /// master within the wait: the workers are stopped and the agent exits (status 1). A
    /// master restarted on the run (`train --resume RUN --reattach`, or a standby taking over)
    /// takes it back with its workers; any other takes it as a new node. At least 1; above 180
    /// the workers stop waiting for their step's commit first, and exit with their state.
    #[arg(long, value_name = "SECS", default_value = "60", value_parser = parse_master_wait)]
    pub master_wait: Duration,
    /// Drain this node (leave at the next step boundary, no step lost) when FILE appears, or
    /// when the http:// URL answers with a notice, as cloud metadata services do: GCP
    /// `http://metadata.google.internal/computeMetadata/v1/instance/preempted`, AWS (IMDSv1)
    /// `http://169.254.169.254/latest/meta-data/spot/instance-action`. SIGTERM drains too.
    #[arg(long, value_name = "FILE|URL", env = "OOBLECK_PREEMPTION_NOTICE")]
    pub preemption_notice: Option<String>,
    /// Seconds between looks at the preemption notice (GCP gives about 30 s of notice).
    #[arg(long, default_value_t = 1.0)]
    pub notice_interval: f64,
    /// Seconds to wait, after asking to leave, for the master to release this node at a step
    /// boundary before leaving anyway.
    #[arg(long, default_value_t = 60)]
    pub drain_wait: u64,
    /// Also run a standby master beside this agent (`train standby`): it keeps a copy of the
    /// master's run directory on this machine and takes over, with no step lost, if the
    /// master is lost. One or two agents of a job on different machines are enough.
    #[arg(long)]
    pub standby: bool,
    /// With --standby: where its copy of the run directory goes (empty or absent).
    #[arg(long, requires = "standby", default_value = "oobleck-standby")]
    pub standby_copy: std::path::PathBuf,
    /// With --standby: the IP:PORT where it takes over, which every agent must reach
    /// [default: a free port of --host, or of the address this machine reaches the master
    /// from].
    #[arg(long, requires = "standby")]
    pub standby_listen: Option<String>,
}

/// `train agent ...`: the same command, from the `train` binary.
#[derive(Debug, clap::Parser)]
#[command(name = "train agent")]
pub struct TrainAgentCli {
    #[command(flatten)]
    pub args: AgentArgs,
}

pub fn run(args: &AgentArgs) -> Result<()> {
    let token = match (args.token_stdin, &args.token) {
        (true, _) => read_token_line()?,
        (false, Some(t)) => t.clone(),
        (false, None) => bail!(
            "the agent needs the job's token: --token, the OOBLECK_TOKEN environment variable, \
             or --token-stdin"
        ),
    };
    if !(args.notice_interval.is_finite() && args.notice_interval >= 0.01) {
        bail!(
            "--notice-interval {} must be at least 0.01 s (1 is the default)",
            args.notice_interval
        );
    }
    // A master given by hand is trusted as it is; one found in the environment comes with
    // the job the environment names.
    let (master, job) = match &args.master {
        Some(m) => (m.clone(), args.job.clone()),
        None => {
            let env = super::discover::Env::of_process();
            let p = super::discover::master_from_env(&env).map_err(|e| anyhow::anyhow!(e))?;
            (p.master_addr(), args.job.clone().or(p.job))
        }
    };
    let standby = match args.standby {
        true => Some(super::standbys::AgentStandby::start(
            &master,
            &oobleck_core::runtime::wire::Token::new(&token)?,
            &args.standby_copy,
            args.standby_listen.as_deref(),
            args.host.as_deref(),
        )?),
        false => None,
    };
    let opts = AgentOptions {
        host: args.host.clone(),
        exit_with_parent: args.exit_with_parent,
        wait: Duration::from_secs(args.wait),
        master_wait: args.master_wait,
        preemption_notice: args.preemption_notice.clone(),
        notice_interval: Duration::from_secs_f64(args.notice_interval),
        drain_wait: Duration::from_secs(args.drain_wait),
        job,
        ..AgentOptions::new(master, token)
    };
    let ran = run_agent(&opts);
    let master = standby.and_then(|s| s.finish());
    ran?;
    match master {
        // The job's result is the master's this node's standby became.
        Some(st) if !st.success() => bail!("the job's master (this node's standby) ended: {st}"),
        _ => Ok(()),
    }
}

/// The first line of stdin, read on a thread so a silent parent cannot hang the agent.
fn read_token_line() -> Result<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = tx.send(std::io::stdin().lock().read_line(&mut line).map(|_| line));
    });
    let line = rx
        .recv_timeout(TOKEN_TIMEOUT)
        .map_err(|_| anyhow::anyhow!("--token-stdin: no token on stdin within {TOKEN_TIMEOUT:?}"))?
        .context("--token-stdin: reading stdin")?;
    let token = line.trim().to_string();
    if token.is_empty() {
        bail!("--token-stdin: stdin closed before a token line");
    }
    Ok(token)
}
