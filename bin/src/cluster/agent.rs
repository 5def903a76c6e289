//! `oobleck agent`: one node's process. Registers with the master, receives the job and the
//! plan, starts one worker per device of the plan on this node, relays between the workers'
//! pipes and the control protocol, tells the master when a worker exits, and kills its workers
//! on `Shutdown`, when the master goes away, or (with `--exit-with-parent`) when its stdin
//! closes.

use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use oobleck_core::elastic::protocol::ExitStatus;
use oobleck_core::elastic::{Agent, ElasticError, Message, Token};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;

use super::{ranks_of_node, resolve, Report, ToWorker, WorkerAssignment};
use crate::config::TrainConfig;

/// Bound of the registration and of every message to the master or a worker.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the agent looks at its workers between master messages.
const POLL: Duration = Duration::from_millis(20);
/// How long finished workers get to exit after `Shutdown` before they are killed.
const GRACE: Duration = Duration::from_secs(5);
/// Lines of a worker's stderr kept to explain its failure to the master.
const ERROR_LINES: usize = 40;

/// Run one node of a cluster job: `oobleck agent --master HOST:PORT` on each machine of a
/// multi-machine job (see `train --listen`).
#[derive(Debug, Clone, clap::Args)]
pub struct AgentArgs {
    /// The master's control address (`train --listen` prints it).
    #[arg(long)]
    pub master: String,
    /// The job's shared secret (never sent over the network; the master checks it by
    /// challenge-response).
    #[arg(long, env = "OOBLECK_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Read the token from the first line of stdin instead (how `train --hostfile` passes it,
    /// so it never shows in a process list).
    #[arg(long, conflicts_with = "token")]
    pub token_stdin: bool,
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
}

struct Worker {
    rank: u32,
    child: Child,
    /// The worker's stdin: its messages, and it exits when this closes.
    stdin: ChildStdin,
    /// Relays its stdout; done once the worker closed it.
    relay: tokio::task::JoinHandle<()>,
    /// Relays its stderr and returns its last lines; done once the worker closed it.
    errors: tokio::task::JoinHandle<Vec<String>>,
}

/// Things the agent's loop hears besides the master.
enum Local {
    /// `(generation, rank, report)`: reports of an earlier generation's workers are dropped.
    Report(u64, u32, Result<Report>),
    StdinClosed,
}

pub fn run(args: &AgentArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the agent's runtime")?;
    rt.block_on(drive(args))
}

/// Reads the token line (with `--token-stdin`), then watches stdin on a thread.
fn read_stdin(args: &AgentArgs, tx: mpsc::UnboundedSender<Local>) -> Result<Option<String>> {
    let (first_tx, first_rx) = std::sync::mpsc::channel();
    let want_token = args.token_stdin;
    let watch = args.exit_with_parent;
    if !want_token && !watch {
        return Ok(None);
    }
    std::thread::spawn(move || {
        use std::io::BufRead;
        let stdin = std::io::stdin();
        let mut lock = stdin.lock();
        if want_token {
            let mut line = String::new();
            let _ = first_tx.send(lock.read_line(&mut line).map(|_| line));
        }
        if watch {
            let mut sink = String::new();
            loop {
                sink.clear();
                match lock.read_line(&mut sink) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
            let _ = tx.send(Local::StdinClosed);
        }
    });
    if !want_token {
        return Ok(None);
    }
    let line = first_rx
        .recv_timeout(CONTROL_TIMEOUT)
        .map_err(|_| {
            anyhow::anyhow!("--token-stdin: no token on stdin within {CONTROL_TIMEOUT:?}")
        })?
        .context("--token-stdin: reading stdin")?;
    let token = line.trim().to_string();
    if token.is_empty() {
        bail!("--token-stdin: stdin closed before a token line");
    }
    Ok(Some(token))
}

async fn drive(args: &AgentArgs) -> Result<()> {
    let (local_tx, mut local_rx) = mpsc::unbounded_channel::<Local>();
    let secret = match read_stdin(args, local_tx.clone())? {
        Some(t) => t,
        None => args.token.clone().context(
            "the agent needs the job's token: --token, the OOBLECK_TOKEN environment variable, \
             or --token-stdin",
        )?,
    };
    let token = Token::new(&secret).context("the job token")?;
    let master = resolve(&args.master)?;
    // A master that is not up yet (agents and master started in any order) is waited for;
    // a refusal (wrong token, other version) is final.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.wait);
    let mut told = false;
    let mut agent = loop {
        match Agent::connect(master, &token, CONTROL_TIMEOUT).await {
            Ok(a) => break a,
            Err(e @ (ElasticError::Io { .. } | ElasticError::Timeout { .. }))
                if tokio::time::Instant::now() < deadline =>
            {
                if !told {
                    eprintln!(
                        "oobleck agent: no master at {master} yet ({e}); retrying for up to {} s",
                        args.wait
                    );
                    told = true;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => {
                return Err(e).with_context(|| format!("registering with the master at {master}"))
            }
        }
    };
    let node = agent.node();
    let host = match &args.host {
        Some(h) => h.clone(),
        None => agent.local_addr().ip().to_string(),
    };
    tracing::info!(node, %master, data_host = %host, "agent registered");
    let mut job: Option<(PathBuf, TrainConfig, Option<PathBuf>)> = None;
    let mut generation = 0u64;
    let mut workers: Vec<Worker> = Vec::new();
    // Exits seen but not yet told, so that a worker's last reports reach the master first.
    let mut exited: Vec<(u32, ExitStatus, Option<String>)> = Vec::new();
    let result = async {
        // A local event that woke the loop below, handled first on the next turn.
        let mut woke: Option<Local> = None;
        loop {
            while let Some(ev) = woke.take().or_else(|| local_rx.try_recv().ok()) {
                match ev {
                    Local::StdinClosed => {
                        bail!("node {node}: the process that started this agent is gone")
                    }
                    Local::Report(g, _, _) if g != generation => {}
                    Local::Report(_, rank, r) => {
                        let msg = match r.with_context(|| format!("worker rank {rank}"))? {
                            Report::Listening { rank, addr, pid } => Message::WorkerListening {
                                node,
                                rank,
                                generation,
                                addr,
                                pid,
                            },
                            Report::Ready {
                                rank,
                                step,
                                loss,
                                grad_norm,
                            } => Message::StepReady {
                                node,
                                rank,
                                generation,
                                step,
                                loss,
                                grad_norm,
                            },
                            Report::Saved { rank, step, state } => Message::StateSaved {
                                node,
                                rank,
                                generation,
                                step,
                                state,
                            },
                            Report::Broken { rank, step, error } => Message::WorkerBroken {
                                node,
                                rank,
                                generation,
                                step,
                                error,
                            },
                            Report::Done {
                                rank,
                                step,
                                state,
                                commit_wait_ms,
                            } => Message::WorkerDone {
                                node,
                                rank,
                                generation,
                                step,
                                state,
                                commit_wait_ms,
                            },
                        };
                        agent
                            .send(msg, CONTROL_TIMEOUT)
                            .await
                            .context("relaying a worker's report to the master")?;
                    }
                }
            }
            for (rank, status, error) in exited.drain(..) {
                agent
                    .report_worker_exit(rank, generation, status, error, CONTROL_TIMEOUT)
                    .await
                    .context("reporting a worker exit")?;
            }
            let mut i = 0;
            while i < workers.len() {
                if let Some(st) = workers[i].child.try_wait().context("polling a worker")? {
                    let w = workers.remove(i);
                    // Its relay ends at the EOF of its stdout; the reports it read are then
                    // queued, and are sent before the exit on the next turn.
                    let _ = tokio::time::timeout(GRACE, w.relay).await;
                    let tail = tokio::time::timeout(GRACE, w.errors)
                        .await
                        .ok()
                        .and_then(Result::ok)
                        .unwrap_or_default();
                    let error = (!st.success() && !tail.is_empty()).then(|| tail.join("\n"));
                    exited.push((
                        w.rank,
                        ExitStatus {
                            code: st.code(),
                            signal: st.signal(),
                        },
                        error,
                    ));
                } else {
                    i += 1;
                }
            }
            // Wake for the master or for a worker, whichever speaks first: a worker's `Ready`
            // goes out at once, since every rank's commit waits for the slowest report.
            let incoming = tokio::select! {
                ev = local_rx.recv() => {
                    woke = ev;
                    continue;
                }
                m = agent.recv(POLL) => m,
            };
            match incoming {
                Ok(Message::Job {
                    run_dir,
                    config,
                    resume,
                }) => {
                    let cfg: TrainConfig = serde_json::from_value(config)
                        .context("the master sent a job this agent cannot read")?;
                    job = Some((PathBuf::from(run_dir), cfg, resume.map(PathBuf::from)));
                }
                Ok(Message::PlanAssignment {
                    generation: g,
                    plan,
                    nccl_unique_id,
                    ..
                }) => {
                    if g <= generation && !workers.is_empty() {
                        bail!(
                            "node {node}: a plan of generation {g} arrived while generation \
                             {generation} runs"
                        );
                    }
                    // A reconfiguration: this node's workers of the old generation go at once
                    // (their step was not committed; the new generation replays it), and
                    // nothing of theirs is reported any more.
                    if !workers.is_empty() {
                        tracing::info!(node, from = generation, to = g, "stopping workers");
                        stop_workers(&mut workers, Duration::ZERO).await;
                    }
                    exited.clear();
                    let Some((run_dir, cfg, resume)) = &job else {
                        bail!("node {node}: the master sent a plan before the job");
                    };
                    generation = g;
                    for rank in ranks_of_node(&plan, node) {
                        let a = WorkerAssignment {
                            generation,
                            rank,
                            node,
                            plan: (*plan).clone(),
                            host: host.clone(),
                            run_dir: run_dir.clone(),
                            config: cfg.clone(),
                            nccl_id: nccl_unique_id.clone(),
                            resume: resume.clone(),
                        };
                        workers.push(spawn_worker(a, local_tx.clone()).await?);
                    }
                }
                Ok(Message::RendezvousList {
                    generation: g,
                    rendezvous,
                }) if g == generation => {
                    tell_all(&mut workers, &ToWorker::Rendezvous { rendezvous }).await?;
                }
                Ok(Message::StepCommitted {
                    step,
                    generation: g,
                }) if g == generation => {
                    tell_all(&mut workers, &ToWorker::Commit { step }).await?;
                }
                Ok(Message::SaveState {
                    generation: g,
                    step,
                    dir,
                }) if g == generation => {
                    // Workers that already exited cannot answer; the master falls back to a
                    // checkpoint when a state it asked for does not come.
                    let msg = ToWorker::SaveState {
                        step,
                        dir: PathBuf::from(dir),
                    };
                    for w in workers.iter_mut() {
                        if let Err(e) = tell_all(std::slice::from_mut(w), &msg).await {
                            tracing::warn!(node, error = %format!("{e:#}"), "asking for the state");
                        }
                    }
                }
                Ok(Message::KillNode { node: n }) if n == node => {
                    // A failure injected for a demo or test (`train --inject-failure`): this
                    // node dies as a machine would, its workers and this agent by SIGKILL,
                    // with no goodbye to anyone.
                    tracing::warn!(node, "killing this node's processes (injected failure)");
                    for w in workers.iter_mut() {
                        let _ = w.child.start_kill();
                    }
                    let _ = std::process::Command::new("kill")
                        .args(["-KILL", &std::process::id().to_string()])
                        .status();
                    bail!("node {node}: could not SIGKILL itself for the injected failure");
                }
                Ok(Message::Shutdown { reason }) => {
                    tracing::info!(node, %reason, "shutdown");
                    return Ok(());
                }
                Ok(other) => {
                    tracing::debug!(node, kind = other.kind(), "ignored a message");
                }
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

/// Writes `msg` to every worker's stdin.
async fn tell_all(workers: &mut [Worker], msg: &ToWorker) -> Result<()> {
    let mut line = serde_json::to_string(msg)?;
    line.push('\n');
    for w in workers.iter_mut() {
        tokio::time::timeout(CONTROL_TIMEOUT, w.stdin.write_all(line.as_bytes()))
            .await
            .with_context(|| format!("timed out writing to worker rank {}", w.rank))?
            .with_context(|| format!("writing to worker rank {}", w.rank))?;
    }
    Ok(())
}

async fn spawn_worker(
    a: WorkerAssignment,
    reports: mpsc::UnboundedSender<Local>,
) -> Result<Worker> {
    let exe = std::env::current_exe().context("locating the oobleck binary")?;
    let mut cmd = Command::new(&exe);
    // A worker's error (a lost peer, most often) is reported without anyhow's backtrace,
    // which RUST_BACKTRACE=1 would otherwise print by the screenful; panics keep theirs.
    if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
        cmd.env("RUST_LIB_BACKTRACE", "0");
    }
    let mut child = cmd
        .arg("worker")
        .arg("--rank")
        .arg(a.rank.to_string())
        .env_remove("OOBLECK_TOKEN")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting worker rank {} ({})", a.rank, exe.display()))?;
    let stderr = child.stderr.take().context("worker stderr")?;
    let mut stdin = child.stdin.take().context("worker stdin")?;
    let stdout = child.stdout.take().context("worker stdout")?;
    let mut line = serde_json::to_string(&a)?;
    line.push('\n');
    tokio::time::timeout(CONTROL_TIMEOUT, stdin.write_all(line.as_bytes()))
        .await
        .context("timed out handing a worker its assignment")?
        .context("handing a worker its assignment")?;
    let rank = a.rank;
    let generation = a.generation;
    // Relay the worker's reports; anything else it prints goes to our stderr.
    let relay = tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        while let Ok(Some(l)) = lines.next_line().await {
            match Report::parse(&l) {
                Some(r) => {
                    if reports.send(Local::Report(generation, rank, r)).is_err() {
                        break;
                    }
                }
                None => eprintln!("[rank {rank}] {l}"),
            }
        }
    });
    // Pass its stderr on, keeping the last lines: the master is told them if it fails.
    let errors = tokio::spawn(async move {
        let mut tail: std::collections::VecDeque<String> = Default::default();
        let mut in_backtrace = false;
        let mut lines = BufReader::new(stderr).lines();
        while let Ok(Some(l)) = lines.next_line().await {
            eprintln!("{l}");
            // A backtrace (RUST_BACKTRACE=1) would push the message itself out of the tail.
            if l.starts_with("Stack backtrace:") {
                in_backtrace = true;
            } else if l.starts_with("Error:") {
                in_backtrace = false;
            }
            if in_backtrace {
                continue;
            }
            if tail.len() == ERROR_LINES {
                tail.pop_front();
            }
            tail.push_back(l);
        }
        error_lines(tail.into_iter().collect())
    });
    Ok(Worker {
        rank,
        child,
        stdin,
        relay,
        errors,
    })
}

/// The part of a failed worker's last stderr lines (backtraces left out) that says why: from
/// its last `Error:` line (anyhow's report) on; else all of them. Blank lines are dropped.
fn error_lines(tail: Vec<String>) -> Vec<String> {
    let start = tail
        .iter()
        .rposition(|l| l.starts_with("Error:"))
        .unwrap_or(0);
    tail[start..]
        .iter()
        .filter(|l| !l.trim().is_empty())
        .cloned()
        .collect()
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
