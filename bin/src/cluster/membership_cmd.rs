//! `oobleck drain` and `oobleck add-node`: change a running job's nodes without a restart.
//! A drained node leaves at the next step boundary with no step lost; an added node is
//! admitted at a step boundary and gets its layers from the nodes that hold them.

use std::path::PathBuf;
use std::process::Stdio;

use anyhow::{bail, Context, Result};
use oobleck_core::runtime::wire::client::request_drain;

use super::status::{ask, leader, show, StatusArgs};

/// Drain one node of a running job: it leaves at the next step boundary, with no step lost.
#[derive(Debug, Clone, clap::Args)]
pub struct DrainArgs {
    /// The node id (`oobleck status` lists them).
    pub node: u32,
    /// Drain even if the nodes left cannot hold a pipeline, or hold no replica of its layers
    /// (the job then goes back to its newest checkpoint, or stops).
    #[arg(long)]
    pub force: bool,
    #[command(flatten)]
    pub target: StatusArgs,
}

pub fn drain(a: &DrainArgs) -> Result<()> {
    let (node, force) = (a.node, a.force);
    let status = ask(
        &a.target,
        &format!("to drain node {node}"),
        |addr, token, t| async move { request_drain(addr, &token, node, force, t).await },
    )?;
    let head = format!(
        "node {node} is asked to leave at the next step boundary (`oobleck status` shows it \
         draining until it goes; a drain that would cost steps is refused in the job's log):"
    );
    show(&a.target, &status, Some(&head))
}

/// Start one more node agent on this machine for a running local job (`train --nodes N`):
/// it registers with the job's master and is admitted at a step boundary.
#[derive(Debug, Clone, clap::Args)]
pub struct AddNodeArgs {
    /// The job's run directory (the master's address and token are read from it).
    #[arg(long)]
    pub run: PathBuf,
    /// The new node's preemption notice (a file or an http:// URL), as `oobleck agent`.
    #[arg(long, value_name = "FILE|URL")]
    pub preemption_notice: Option<String>,
    /// Seconds between looks at the notice.
    #[arg(long, default_value_t = 1.0)]
    pub notice_interval: f64,
}

pub fn add_node(a: &AddNodeArgs) -> Result<()> {
    let status_args = StatusArgs {
        master: None,
        token: None,
        run: Some(a.run.clone()),
        json: false,
        timeout: 5,
    };
    let (addr, token) = leader(&status_args)?;
    let exe = super::hostfile::agent_binary()?;
    let logs = a.run.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let log_path = logs.join(format!("added-agent-{stamp}.log"));
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    let mut cmd = std::process::Command::new(&exe);
    cmd.arg("agent")
        .args(["--master", &addr.to_string()])
        .args(["--notice-interval", &a.notice_interval.to_string()])
        .env("OOBLECK_TOKEN", token.expose())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    if let Some(n) = &a.preemption_notice {
        cmd.args(["--preemption-notice", n]);
    }
    let child = cmd
        .spawn()
        .with_context(|| format!("starting an agent ({})", exe.display()))?;
    if child.id() == 0 {
        bail!("the new agent has no pid");
    }
    println!(
        "started a node agent (pid {}) for the job at {addr}; it is admitted at a step \
         boundary. Its log: {}",
        child.id(),
        log_path.display()
    );
    Ok(())
}
