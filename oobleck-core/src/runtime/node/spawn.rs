//! An agent's worker processes: started by re-running this binary as `OOBLECK_ROLE=worker`,
//! fed through their stdin, heard through their stdout (reports) and stderr (their log, whose
//! last lines explain a failure), reaped, and stopped.
//!
//! The agent is a process role, like a binary's `main`: a worker's log goes on to the agent's
//! stderr, so this module prints.

use std::collections::VecDeque;
use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;

use super::{Local, CONTROL_TIMEOUT, GRACE};
use crate::profiler;
use crate::runtime::error::{Context, Result, RuntimeError};
use crate::runtime::wire::env::{
    AGENT_WAIT_ENV, EXIT_WITH_PARENT_ENV, HOST_AGENTS_ENV, HOST_ENV, MASTER_ENV, MASTER_WAIT_ENV,
    RANK_ENV, ROLE_ENV, TOKEN_ENV, WORKER,
};
use crate::runtime::wire::pipe::ERROR_TAG;
use crate::runtime::wire::pipe::{parse_progress, ToWorker, WorkerAssignment};
use crate::runtime::wire::protocol::ExitStatus;
use crate::runtime::wire::records::WorkerReport;

/// Lines of a worker's stderr kept to explain its failure to the master.
const ERROR_LINES: usize = 40;

/// One running worker of this node.
pub(super) struct Worker {
    /// Its device on this node: the same across generations, while its rank may change.
    pub(super) device: u32,
    /// Its rank in the running generation.
    pub(super) rank: u32,
    pub(super) child: Child,
    /// The worker's stdin: its messages, and it exits when this closes (`None`: closed).
    stdin: Option<ChildStdin>,
    /// Relays its stdout; done once the worker closed it.
    pub(super) relay: tokio::task::JoinHandle<()>,
    /// Relays its stderr and returns its last lines; done once the worker closed it.
    pub(super) errors: tokio::task::JoinHandle<Vec<String>>,
    /// Found hung and sent SIGTERM: SIGKILL at this time if it still runs.
    pub(super) kill_at: Option<tokio::time::Instant>,
    /// When its stdout was seen closed while it still ran.
    pub(super) pipe_eof: Option<tokio::time::Instant>,
    /// ...and it still ran [`super::watchdog::PIPE_GRACE`] later: killed as crashed (its
    /// reports cannot reach anyone).
    pub(super) pipe_broken: bool,
}

/// `v` as one line of a worker's stdin.
fn json_line(v: &impl serde::Serialize, what: &str) -> Result<String> {
    let mut line = serde_json::to_string(v).with_ctx(|| format!("encoding {what}"))?;
    line.push('\n');
    Ok(line)
}

/// Writes `line` (`what` it is) to the stdin of worker `rank` of node `node`.
async fn send_line(
    node: u32,
    rank: u32,
    stdin: Option<&mut ChildStdin>,
    line: &str,
    what: &str,
) -> Result<()> {
    let Some(stdin) = stdin else {
        return Err(RuntimeError::Protocol {
            who: format!("node {node}"),
            what: format!("worker rank {rank} is being stopped and takes no {what}"),
        });
    };
    tokio::time::timeout(CONTROL_TIMEOUT, stdin.write_all(line.as_bytes()))
        .await
        .map_err(|_| RuntimeError::Protocol {
            who: format!("node {node}"),
            what: format!("timed out handing worker rank {rank} {what}"),
        })?
        .with_ctx(|| format!("handing worker rank {rank} {what}"))
}

impl Worker {
    /// Writes `msg` to this worker's stdin.
    pub(super) async fn tell(&mut self, node: u32, msg: &ToWorker) -> Result<()> {
        let line = json_line(msg, "a message for a worker")?;
        send_line(node, self.rank, self.stdin.as_mut(), &line, "a message").await
    }
}

/// Writes `msg` to every worker's stdin, stopping at the first that cannot take it.
pub(super) async fn tell_all(node: u32, workers: &mut [Worker], msg: &ToWorker) -> Result<()> {
    let line = json_line(msg, "a message for the workers")?;
    for w in workers.iter_mut() {
        send_line(node, w.rank, w.stdin.as_mut(), &line, "a message").await?;
    }
    Ok(())
}

/// The `RAYON_NUM_THREADS` a worker gets, which sizes the pool Candle's CPU kernels and ours run
/// on: `None` when the user set it (theirs stands), else an equal share of the machine's `cores`
/// among the ranks on it (`agents` agents of `devices` workers each), at least one. Without it
/// every worker starts a thread per core: a local cluster of 4 nodes on 2 cores ran 8 busy
/// threads on 2 cores, and the measured profile (taken at the same share) would not hold.
fn worker_threads(user: Option<usize>, cores: usize, agents: usize, devices: u32) -> Option<usize> {
    let ranks = agents.max(1) * devices.max(1) as usize;
    match user {
        Some(_) => None,
        None => Some(profiler::threads_per_rank(cores, ranks)),
    }
}

/// [`HOST_AGENTS_ENV`] of this agent: how many agents of the job share this machine.
fn host_agents() -> usize {
    std::env::var(HOST_AGENTS_ENV)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1)
}

/// Starts the worker of assignment `a` on `device`, hands it the assignment, and relays its
/// reports to `reports` as [`Local::Report`].
pub(super) async fn spawn_worker(
    a: &WorkerAssignment,
    device: u32,
    reports: mpsc::UnboundedSender<Local>,
) -> Result<Worker> {
    let exe = std::env::current_exe().ctx("locating this program's binary")?;
    let mut cmd = Command::new(&exe);
    // The agent's own settings, the token first, are none of a worker's business.
    for var in [
        TOKEN_ENV,
        MASTER_ENV,
        HOST_ENV,
        AGENT_WAIT_ENV,
        EXIT_WITH_PARENT_ENV,
        MASTER_WAIT_ENV,
        HOST_AGENTS_ENV,
    ] {
        cmd.env_remove(var);
    }
    if let Some(threads) = worker_threads(
        profiler::user_threads(),
        profiler::host_cores(),
        host_agents(),
        a.plan.devices_per_node,
    ) {
        cmd.env("RAYON_NUM_THREADS", threads.to_string());
    }
    let mut child = cmd
        .env(ROLE_ENV, WORKER)
        .env(RANK_ENV, a.rank.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_ctx(|| format!("starting worker rank {} ({})", a.rank, exe.display()))?;
    let stderr = child.stderr.take().ctx("worker stderr")?;
    let mut stdin = child.stdin.take().ctx("worker stdin")?;
    let stdout = child.stdout.take().ctx("worker stdout")?;
    let line = json_line(a, "a worker's assignment")?;
    send_line(a.node, a.rank, Some(&mut stdin), &line, "its assignment").await?;
    let rank = a.rank;
    // Relay the worker's reports; anything else it prints goes to our stderr.
    let relay = tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        while let Ok(Some(l)) = lines.next_line().await {
            let local = match (WorkerReport::parse(&l), parse_progress(&l)) {
                (Some(r), _) => Local::Report(device, r),
                (None, Some(beat)) => Local::Beat(device, beat),
                (None, None) => {
                    eprintln!("[device {device}] {l}");
                    continue;
                }
            };
            if reports.send(local).is_err() {
                break;
            }
        }
    });
    let errors = tokio::spawn(pass_stderr(stderr));
    Ok(Worker {
        device,
        rank,
        child,
        stdin: Some(stdin),
        relay,
        errors,
        kill_at: None,
        pipe_eof: None,
        pipe_broken: false,
    })
}

/// Passes a worker's stderr on, keeping the last lines: the master is told them if it fails.
async fn pass_stderr(stderr: tokio::process::ChildStderr) -> Vec<String> {
    let mut tail: VecDeque<String> = VecDeque::new();
    let mut lines = BufReader::new(stderr).lines();
    while let Ok(Some(l)) = lines.next_line().await {
        eprintln!("{l}");
        if tail.len() == ERROR_LINES {
            tail.pop_front();
        }
        tail.push_back(l);
    }
    error_lines(tail.into_iter().collect())
}

/// The part of a failed worker's last stderr lines that says why: from its last line that
/// starts with [`ERROR_TAG`] (the runtime's report, the worker's last output) on; else all of
/// them. Blank lines are dropped.
pub(super) fn error_lines(tail: Vec<String>) -> Vec<String> {
    let start = tail
        .iter()
        .rposition(|l| l.starts_with(ERROR_TAG))
        .unwrap_or(0);
    tail[start..]
        .iter()
        .filter(|l| !l.trim().is_empty())
        .cloned()
        .collect()
}

/// Closes the workers' stdin (a worker exits when it closes: after `Done` it is on its way
/// already, otherwise it stops where it is), waits up to `grace` for them to exit, then kills
/// the rest.
pub(super) async fn stop_workers(workers: &mut Vec<Worker>, grace: Duration) {
    let deadline = tokio::time::Instant::now() + grace;
    for w in workers.iter_mut() {
        w.stdin = None;
    }
    for w in workers.iter_mut() {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if tokio::time::timeout(left, w.child.wait()).await.is_err() {
            let _ = w.child.start_kill();
            let _ = tokio::time::timeout(GRACE, w.child.wait()).await;
        }
    }
    workers.clear();
}

impl super::NodeAgent {
    /// Notes the workers that exited; their exits go out on the next turn, after the reports
    /// their relays read last.
    pub(super) async fn reap_workers(&mut self) -> Result<()> {
        let mut i = 0;
        while i < self.workers.len() {
            let Some(st) = self.workers[i].child.try_wait().ctx("polling a worker")? else {
                self.check_pipe(i);
                i += 1;
                continue;
            };
            let w = self.workers.remove(i);
            // Its relay ends at the EOF of its stdout; the reports it read are then queued.
            let _ = tokio::time::timeout(GRACE, w.relay).await;
            let tail = tokio::time::timeout(GRACE, w.errors)
                .await
                .ok()
                .and_then(std::result::Result::ok)
                .unwrap_or_default();
            let mut error = (!st.success() && !tail.is_empty()).then(|| tail.join("\n"));
            if w.pipe_broken {
                let why = "its report pipe (stdout) closed while it ran: treated as a crash";
                error = Some(match error {
                    Some(e) => format!("{why}\n{e}"),
                    None => why.into(),
                });
            }
            self.exited.push(WorkerReport::Exited {
                rank: w.rank,
                status: ExitStatus {
                    code: st.code(),
                    signal: st.signal(),
                },
                error,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(s: &[&str]) -> Vec<String> {
        s.iter().map(|l| l.to_string()).collect()
    }

    #[test]
    fn workers_share_the_machines_cores_unless_the_user_sized_their_pool() {
        // (user, cores, agents, devices) -> threads
        let table = [
            ((None, 2, 4, 1), Some(1)),  // README train: 4 local nodes on 2 cores
            ((None, 16, 4, 1), Some(4)), // a bigger machine
            ((None, 16, 2, 2), Some(4)), // 2 agents of 2 devices
            ((None, 16, 1, 4), Some(4)), // one node of a multi-machine job
            ((None, 16, 1, 1), Some(16)),
            ((None, 6, 4, 1), Some(1)), // shares round down, never to 0
            ((None, 16, 0, 0), Some(16)),
            ((Some(3), 16, 4, 1), None),
        ];
        for ((user, cores, agents, devices), want) in table {
            assert_eq!(
                worker_threads(user, cores, agents, devices),
                want,
                "{user:?} {cores} {agents} {devices}"
            );
        }
    }

    #[test]
    fn a_failed_workers_explanation_starts_at_its_last_error_line() {
        let tail = lines(&[
            "some progress",
            "Error: first try",
            "",
            "Error: rank 1: step 3: rank 2 lost",
            "",
            "Caused by:",
            "    0: peer closed",
        ]);
        assert_eq!(
            error_lines(tail),
            lines(&[
                "Error: rank 1: step 3: rank 2 lost",
                "Caused by:",
                "    0: peer closed"
            ])
        );
        // No error line (a panic, a signal): everything it said, blank lines dropped.
        assert_eq!(
            error_lines(lines(&["thread 'main' panicked", "", "at src/x.rs"])),
            lines(&["thread 'main' panicked", "at src/x.rs"])
        );
    }
}
