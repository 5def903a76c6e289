//! `train` started by a scheduler on every node of an allocation (`srun train ...`, a SkyPilot
//! task, a pod of a LeaderWorkerSet): the same command everywhere. Where this process is comes
//! from its environment (`discover`); node 0 runs the master and its own agent, every other
//! node one agent of that master, and node 1 also a standby master (`train agent --standby`)
//! that takes over, with no step lost, when node 0 is lost (`OOBLECK_STANDBY=0`: none). Flags
//! that say how to launch (`--nodes`, `--listen`, `--hostfile`) win: with any of them the
//! environment is not read.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;

use anyhow::{anyhow, bail, Result};
use clap::Parser;
use oobleck_core::runtime::wire::Token;

use super::discover::{self, Env, Placement};
use super::job::LaunchMode;
use super::node_cmd::{AgentArgs, TrainAgentCli};
use super::resolve;
use crate::args::TrainArgs;
use crate::config::TrainConfig;

/// How long an agent of a scheduled job waits for node 0's master to listen: node 0 may first
/// prepare data and measure the model's profile (the master's own join limit is as long).
const MASTER_START_WAIT_S: u64 = 600;

/// What this `train` process is in a scheduled job.
pub enum Role {
    /// Node 0: the master of a job of `nodes` nodes, with this node's agent.
    Master { launch: LaunchMode, nodes: usize },
    /// Any other node: one agent of node 0's master.
    Agent(Box<AgentArgs>),
}

/// This process's place and role when the environment places it in a job of several nodes
/// and no flag chose the launch; `None` otherwise (train as the flags say).
pub fn from_env(
    args: &TrainArgs,
    cfg: &TrainConfig,
    env: &Env,
) -> Result<Option<(Placement, Role)>> {
    if args.nodes.is_some() || args.listen.is_some() || args.hostfile.is_some() {
        return Ok(None);
    }
    let Some(p) = discover::discover(env).map_err(|e| anyhow!(e))? else {
        return Ok(None);
    };
    if p.node_index == discover::UNKNOWN_INDEX {
        bail!(
            "OOBLECK_MASTER is set but OOBLECK_NODE_INDEX is not: set it to this node's index \
             (0 runs the master), or run `train agent` on the nodes and `train --listen` on the master"
        );
    }
    if p.num_nodes == Some(1) {
        return Ok(None); // an allocation of one: train here as without a scheduler
    }
    discover::check(&p, args.expect_nodes, discover::lookup).map_err(|e| anyhow!(e))?;
    let nodes = p.num_nodes.or(args.expect_nodes).ok_or_else(|| {
        anyhow!(
            "{} does not say how many nodes the job has: set OOBLECK_NUM_NODES (or pass \
             --expect-nodes N) on every node",
            p.source.name()
        )
    })?;
    let secret = args.token.clone().ok_or_else(|| {
        anyhow!(
            "a job of {nodes} nodes ({}) needs its shared secret: export OOBLECK_TOKEN with the \
             same value on every node (e.g. `export OOBLECK_TOKEN=$(openssl rand -hex 16)` in \
             the job script)",
            p.source.name()
        )
    })?;
    let role = if p.is_master_node() {
        master_role(&p, nodes, Token::new(&secret)?.for_job(p.job.as_deref()))?
    } else {
        let mut agent = agent_args(&p, secret, cfg.master_wait_s)?;
        if p.node_index == 1 && env.get("OOBLECK_STANDBY") != Some("0") {
            agent.standby = true;
            agent.standby_copy = standby_copy(args, env);
        }
        Role::Agent(Box::new(agent))
    };
    Ok(Some((p, role)))
}

/// The line `train` prints first: what the environment said.
pub fn describe(p: &Placement, role: &Role) -> String {
    let nodes = p.num_nodes.map_or("?".into(), |n| n.to_string());
    let what = match role {
        Role::Master { .. } => "the master (listening on port ".to_string(),
        Role::Agent(_) => "an agent of the master at".to_string(),
    };
    let at = match role {
        Role::Master { .. } => format!("{}) and its agent", p.master_port),
        Role::Agent(a) if a.standby => format!(
            " {}, and its standby master; the job's settings are the master's",
            p.master_addr()
        ),
        Role::Agent(_) => format!(" {}; the job's settings are the master's", p.master_addr()),
    };
    format!(
        "{}: node {} of {nodes}; this process is {what}{at} (--nodes, --listen or --hostfile \
         choose otherwise)",
        p.source.name(),
        p.node_index
    )
}

fn master_role(p: &Placement, nodes: usize, token: Token) -> Result<Role> {
    let own = resolve(&p.master_addr())?;
    let any: IpAddr = match own.ip() {
        IpAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        IpAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let addr = SocketAddr::new(any, p.master_port);
    Ok(Role::Master {
        launch: LaunchMode::Scheduled { addr, token, own },
        nodes,
    })
}

fn agent_args(p: &Placement, token: String, master_wait_s: u64) -> Result<AgentArgs> {
    let wait = MASTER_START_WAIT_S.to_string();
    let master_wait = master_wait_s.to_string();
    let argv = [
        "train agent",
        "--master",
        &p.master_addr(),
        "--wait",
        &wait,
        "--master-wait",
        &master_wait,
    ];
    let mut args = TrainAgentCli::try_parse_from(argv)?.args;
    args.token = Some(token);
    args.job = p.job.clone();
    Ok(args)
}

/// Where node 1's standby keeps its copy of the run: `OOBLECK_STANDBY_COPY`, else beside the
/// run directory the command names (`RUN.standby`; `RUN.standby-2`, ... where an earlier
/// attempt's copy is, a requeued job's), else `oobleck-standby` in the working directory.
fn standby_copy(args: &TrainArgs, env: &Env) -> PathBuf {
    if let Some(dir) = env.get("OOBLECK_STANDBY_COPY") {
        return PathBuf::from(dir);
    }
    let base = match args.out.as_ref().or(args.resume.as_ref()) {
        Some(run) => {
            let mut name = run.as_os_str().to_owned();
            name.push(".standby");
            PathBuf::from(name)
        }
        None => PathBuf::from("oobleck-standby"),
    };
    (1..)
        .map(|k| match k {
            1 => base.clone(),
            k => PathBuf::from(format!("{}-{k}", base.display())),
        })
        .find(|dir| super::standbys::is_empty_or_absent(dir))
        .expect("an unused name")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_1s_standby_copy_is_beside_the_run_and_fresh_at_every_start() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let args = TrainArgs {
            out: Some(run.clone()),
            ..TrainArgs::default()
        };
        let none = Env::from_pairs([]);
        let first = run.with_extension("standby");
        assert_eq!(standby_copy(&args, &none), first);
        // An empty one is taken again; one holding an earlier start's copy is not.
        std::fs::create_dir(&first).unwrap();
        assert_eq!(standby_copy(&args, &none), first);
        std::fs::write(first.join("metrics.jsonl"), "{}\n").unwrap();
        let second = dir.path().join("run.standby-2");
        assert_eq!(standby_copy(&args, &none), second);
        // A resumed run's copy goes beside the directory it resumes.
        let resumed = TrainArgs {
            resume: Some(run.clone()),
            ..TrainArgs::default()
        };
        assert_eq!(standby_copy(&resumed, &none), second);
        let chosen = Env::from_pairs([("OOBLECK_STANDBY_COPY", "/scratch/copy")]);
        assert_eq!(standby_copy(&args, &chosen), PathBuf::from("/scratch/copy"));
        let nowhere = TrainArgs::default();
        assert_eq!(
            standby_copy(&nowhere, &none),
            PathBuf::from("oobleck-standby")
        );
    }
}
