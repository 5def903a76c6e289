//! `train --resume RUN --reattach`: a master restarted on the run directory of a job whose
//! master was lost while its agents still wait for one (`--master-wait`). It listens where the
//! lost master did (the run's `master.json`, or `--listen`), with the job's token (the run's
//! `master.token` of a local job, or `OOBLECK_TOKEN`), takes the agents back with their
//! workers and goes on from the last committed step that the run's commit record
//! (`committed.json`) holds: no checkpoint is loaded and no committed step is computed again.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use oobleck_core::checkpoint::checkpoint_dirs;
use oobleck_core::planning::Plan;
use oobleck_core::runtime::job::Reattach;
use oobleck_core::runtime::master::CommitRecord;
use oobleck_core::runtime::wire::Token;

use super::job::LaunchMode;
use super::status::{MASTER_FILE, TOKEN_FILE};
use crate::config::TrainConfig;
use crate::run_dir::resumed_run;

/// Set by a standby that takes over (`standby_cmd.rs`): who it is and what it saw of the lost
/// master, for the run's `master_lost` event.
pub const TAKING_OVER: &str = "OOBLECK_TAKING_OVER";

/// Becomes the master of the run `run` in this process (exec): `train --resume RUN --reattach`
/// (`--listen LISTEN`, else where the run's master listened), with the job's `token`; `why`
/// goes to the run's `master_lost` event. Returns only if the exec failed.
pub fn become_master(run: &Path, listen: Option<&str>, token: &str, why: &str) -> Result<()> {
    use std::os::unix::process::CommandExt;
    // `train` itself, whatever this process runs as (`train standby`, or `train`).
    let exe = std::env::current_exe().context("locating the running binary")?;
    let mut cmd = std::process::Command::new(&exe);
    cmd.arg("--resume").arg(run).arg("--reattach");
    if let Some(l) = listen {
        cmd.args(["--listen", l]);
    }
    let e = cmd.env("OOBLECK_TOKEN", token).env(TAKING_OVER, why).exec();
    Err(e).with_context(|| format!("starting again as the master: {}", exe.display()))
}

/// Where the restarted master listens and the job's token: `listen` (`--listen`) or the
/// address in the run's `master.json`; `token` (`--token`, `OOBLECK_TOKEN`) or the run's
/// `master.token` (a local job's, left behind by the lost master).
pub fn launch(
    cfg: &TrainConfig,
    run: &Path,
    listen: Option<&str>,
    token: Option<&str>,
) -> Result<LaunchMode> {
    let run = resumed_run(run)?;
    check_unfinished(cfg, &run, CommitRecord::committed_step(&run)?)?;
    let addr = match listen {
        Some(a) => super::resolve(a)?,
        None => recorded_addr(&run)?,
    };
    check_free(addr, &run)?;
    let token = match token {
        Some(t) => Token::new(t)?,
        None => {
            let path = run.join(TOKEN_FILE);
            let text = std::fs::read_to_string(&path).with_context(|| {
                format!(
                    "--reattach: reading the job's token from {} (a local job's, left by its \
                     lost master); for a job started with --listen, set OOBLECK_TOKEN (or \
                     --token) to its token",
                    path.display()
                )
            })?;
            Token::new(text.trim())?
        }
    };
    Ok(LaunchMode::Reattach { addr, token })
}

/// Refuses an address something still listens on: most likely the run's master, alive (a
/// master that was only paused holds its port too).
fn check_free(addr: SocketAddr, run: &Path) -> Result<()> {
    match std::net::TcpListener::bind(addr) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => bail!(
            "--reattach: {addr} is in use: is the master of {} still running (or only stopped)? \
             --reattach is for a master that is gone; stop it first, or pass --listen ADDR",
            run.display()
        ),
        Err(e) => Err(e).with_context(|| format!("--reattach: binding {addr}")),
    }
}

/// The control address the lost master listened on, from `master.json`.
fn recorded_addr(run: &Path) -> Result<SocketAddr> {
    let path = run.join(MASTER_FILE);
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "--reattach: reading where the lost master listened ({}); pass --listen ADDR to \
             say it",
            path.display()
        )
    })?;
    let doc: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    let addr = doc["addr"]
        .as_str()
        .with_context(|| format!("{}: no \"addr\"", path.display()))?;
    addr.parse()
        .with_context(|| format!("{}: {addr:?} is not IP:PORT", path.display()))
}

/// The run directory (absolute), what the restarted master knows of the job from it, and the
/// plans of the run (kept and appended to). The metrics lines the lost master had not
/// written are written first, so `metrics.jsonl` holds every committed step once.
pub fn open(cfg: &TrainConfig, run: &Path) -> Result<(PathBuf, Reattach, Vec<serde_json::Value>)> {
    let run = resumed_run(run)?;
    let out = run
        .canonicalize()
        .with_context(|| format!("resolving {}", run.display()))?;
    let plan_file = out.join("plan.json");
    let text = std::fs::read_to_string(&plan_file).with_context(|| {
        format!(
            "--reattach: reading {} (the plans of the run's generations): the lost master \
             never sent a plan, so there is nothing to re-adopt; start the run again",
            plan_file.display()
        )
    })?;
    let json: Vec<serde_json::Value> = serde_json::from_str(&text)
        .with_context(|| format!("{}: expected an array of plans", plan_file.display()))?;
    let plans: Vec<Plan> = serde_json::from_str(&text)
        .with_context(|| format!("{}: expected an array of plans", plan_file.display()))?;
    if let Some(record) = CommitRecord::read(&out)? {
        record.complete_metrics(&out)?;
    }
    let committed = CommitRecord::committed_step(&out)?;
    check_unfinished(cfg, &out, committed)?;
    let newest = checkpoint_dirs(&out)
        .unwrap_or_default()
        .into_iter()
        .max()
        .map(|(step, path)| (path.display().to_string(), step));
    let why = std::env::var(TAKING_OVER)
        .unwrap_or_else(|_| "a master restarted with --reattach takes over".into());
    let reattach = Reattach {
        plans,
        committed,
        newest,
        epoch: 0, // the master's own, once it starts
        why,
    };
    Ok((out, reattach, json))
}

/// Refuses a run whose last step is committed: its agents have finished.
fn check_unfinished(cfg: &TrainConfig, run: &Path, committed: u64) -> Result<()> {
    if committed >= cfg.steps {
        bail!(
            "--reattach: the run's last step ({committed} of {}) is committed, so its agents \
             have finished; `train --resume {}` with a larger --steps trains further",
            cfg.steps,
            run.display()
        );
    }
    Ok(())
}
