//! `train standby`: a standby master of a running job. It keeps a copy
//! of the master's run directory on this machine (`oobleck_core::runtime::master::standby`)
//! and, when the master is lost, takes over from the copy: it becomes
//! `train --resume COPY --reattach --listen LISTEN`, which re-adopts the agents (they look at
//! LISTEN after the master's own address, as the master told them) and goes on from the last
//! committed step.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Result};
use oobleck_core::runtime::master::{run_standby, StandbyEnd, StandbyOptions};

/// Keep a copy of a running job's run directory and take over when its master is lost.
#[derive(Debug, Clone, clap::Args)]
pub struct StandbyArgs {
    /// The active master's control address.
    #[arg(long)]
    pub master: String,
    /// The job's shared secret.
    #[arg(long, env = "OOBLECK_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Where the copy of the run directory goes, on this machine.
    #[arg(long)]
    pub copy: PathBuf,
    /// IP:PORT where this standby takes over: an address of this machine the agents reach
    /// (the master tells them).
    #[arg(long)]
    pub listen: String,
    /// Seconds to keep retrying while the master cannot be reached.
    #[arg(long, default_value_t = 120)]
    pub wait: u64,
}

/// `train standby ...`: the same command, from the `train` binary.
#[derive(Debug, clap::Parser)]
#[command(name = "train standby")]
pub struct TrainStandbyCli {
    #[command(flatten)]
    pub args: StandbyArgs,
}

pub fn run(args: &StandbyArgs) -> Result<()> {
    let Some(token) = args.token.clone() else {
        bail!(
            "the standby needs the job's token: --token or the OOBLECK_TOKEN environment variable"
        );
    };
    let listen = super::resolve(&args.listen)?;
    if listen.ip().is_unspecified() || listen.port() == 0 {
        bail!(
            "--listen {listen}: the agents are told to look for this standby there, so it must \
             be an IP:PORT of this machine they reach"
        );
    }
    let opts = StandbyOptions {
        master: args.master.clone(),
        token: token.clone(),
        copy: args.copy.clone(),
        listen,
        wait: Duration::from_secs(args.wait),
    };
    match run_standby(&opts)? {
        StandbyEnd::Finished(reason) => {
            eprintln!("oobleck standby: the job is over ({reason})");
            Ok(())
        }
        StandbyEnd::MasterLost(why) => take_over(&args.copy, &args.listen, &token, &why),
    }
}

/// Becomes the master: `train --resume COPY --reattach --listen LISTEN`, in this process.
fn take_over(copy: &std::path::Path, listen: &str, token: &str, why: &str) -> Result<()> {
    eprintln!(
        "oobleck standby: the master is lost ({why}); taking over at {listen} from {}",
        copy.display()
    );
    let why = format!("the standby at {listen} takes over: the master is lost ({why})");
    super::reattach::become_master(copy, Some(listen), token, &why)
}
