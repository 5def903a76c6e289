//! `oobleck agent`: one node's process. Registers with the master, starts one worker per
//! device of the plan it is assigned, forwards the workers' reports on stdout, tells the master
//! when a worker exits, and kills its workers on `Shutdown`, when the master goes away, or when
//! its own stdin closes (the `train` that started it is gone).

use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use oobleck_core::elastic::protocol::ExitStatus;
use oobleck_core::elastic::{Agent, ElasticError, Message, Token};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};

use super::{ranks_of_node, Report, WorkerAssignment};

/// Bound of the registration and of every message to the master.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the agent looks at its workers between master messages.
const POLL: Duration = Duration::from_millis(100);
/// How long finished workers get to exit after `Shutdown` before they are killed.
const GRACE: Duration = Duration::from_secs(5);

/// Hidden: run one node agent of a local cluster (started by `train --nodes N`).
#[derive(Debug, Clone, clap::Args)]
pub struct AgentArgs {
    /// The master's control address.
    #[arg(long)]
    pub master: SocketAddr,
    /// The job's shared secret.
    #[arg(long, env = "OOBLECK_TOKEN", hide_env_values = true)]
    pub token: String,
    /// The run directory (local mode: shared with the master and the workers).
    #[arg(long)]
    pub run_dir: PathBuf,
}

struct Worker {
    rank: u32,
    child: Child,
    /// Held open: the worker exits when it closes.
    _stdin: ChildStdin,
}

pub fn run(args: &AgentArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the agent's runtime")?;
    rt.block_on(drive(args))
}

async fn drive(args: &AgentArgs) -> Result<()> {
    let token = Token::new(&args.token).context("--token / OOBLECK_TOKEN")?;
    println!(
        "{}",
        Report::Agent {
            pid: std::process::id()
        }
        .line()
    );
    let mut agent = Agent::connect(args.master, &token, CONTROL_TIMEOUT)
        .await
        .with_context(|| format!("registering with the master at {}", args.master))?;
    let node = agent.node();
    let (stdin_closed_tx, mut stdin_closed) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin();
        let mut buf = [0u8; 256];
        while let Ok(n) = std::io::Read::read(&mut stdin, &mut buf) {
            if n == 0 {
                break;
            }
        }
        let _ = stdin_closed_tx.send(());
    });
    let mut workers: Vec<Worker> = Vec::new();
    let result = async {
        loop {
            if stdin_closed.try_recv().is_ok() {
                bail!("node {node}: the train process that started this agent is gone");
            }
            let mut i = 0;
            while i < workers.len() {
                if let Some(st) = workers[i].child.try_wait().context("polling a worker")? {
                    let w = workers.remove(i);
                    let status = ExitStatus {
                        code: st.code(),
                        signal: st.signal(),
                    };
                    agent
                        .report_worker_exit(w.rank, status, CONTROL_TIMEOUT)
                        .await
                        .context("reporting a worker exit")?;
                } else {
                    i += 1;
                }
            }
            match agent.recv(POLL).await {
                Ok(Message::PlanAssignment {
                    generation,
                    plan,
                    rendezvous,
                    ..
                }) => {
                    if !workers.is_empty() {
                        bail!(
                            "node {node}: a new plan (generation {generation}) arrived while \
                             workers run; reconfiguration is not supported yet"
                        );
                    }
                    for rank in ranks_of_node(&plan, node) {
                        let a = WorkerAssignment {
                            generation,
                            rank,
                            node,
                            plan: (*plan).clone(),
                            rendezvous: rendezvous.clone(),
                        };
                        workers.push(spawn_worker(args, a).await?);
                    }
                }
                Ok(Message::Shutdown { reason }) => {
                    tracing::info!(node, %reason, "shutdown");
                    return Ok(());
                }
                Ok(_) => {}
                Err(ElasticError::Timeout { .. }) => {}
                Err(e) => return Err(e).context(format!("node {node}: the master connection")),
            }
        }
    }
    .await;
    stop_workers(
        &mut workers,
        if result.is_ok() {
            GRACE
        } else {
            Duration::ZERO
        },
    )
    .await;
    result
}

async fn spawn_worker(args: &AgentArgs, a: WorkerAssignment) -> Result<Worker> {
    let exe = std::env::current_exe().context("locating the oobleck binary")?;
    let mut child = Command::new(&exe)
        .arg("worker")
        .arg("--run-dir")
        .arg(&args.run_dir)
        .arg("--rank")
        .arg(a.rank.to_string())
        .env_remove("OOBLECK_TOKEN")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting worker rank {} ({})", a.rank, exe.display()))?;
    let pid = child.id().unwrap_or(0);
    println!(
        "{}",
        Report::WorkerStarted {
            node: a.node,
            rank: a.rank,
            pid
        }
        .line()
    );
    let mut stdin = child.stdin.take().context("worker stdin")?;
    let stdout = child.stdout.take().context("worker stdout")?;
    let mut line = serde_json::to_string(&a)?;
    line.push('\n');
    tokio::time::timeout(CONTROL_TIMEOUT, stdin.write_all(line.as_bytes()))
        .await
        .context("timed out handing a worker its assignment")?
        .context("handing a worker its assignment")?;
    // Forward the worker's reports as they come.
    tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        while let Ok(Some(l)) = lines.next_line().await {
            println!("{l}");
        }
    });
    Ok(Worker {
        rank: a.rank,
        child,
        _stdin: stdin,
    })
}

/// Waits up to `grace` for the workers to exit by themselves, then kills the rest.
async fn stop_workers(workers: &mut Vec<Worker>, grace: Duration) {
    let deadline = tokio::time::Instant::now() + grace;
    for w in workers.iter_mut() {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if tokio::time::timeout(left, w.child.wait()).await.is_err() {
            let _ = w.child.start_kill();
            let _ = tokio::time::timeout(GRACE, w.child.wait()).await;
        }
    }
    workers.clear();
}
