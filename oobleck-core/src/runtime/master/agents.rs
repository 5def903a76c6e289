//! The agent processes the master started (local children, or ssh sessions running them): it
//! watches them, fences one whose node was declared lost, and takes them down at the end.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use tokio::process::{Child, ChildStdin};

use crate::runtime::error::{Context, Result};
use crate::runtime::wire::Token;

/// How long agents get to exit after `Shutdown` before they are killed.
pub(super) const EXIT_GRACE: Duration = Duration::from_secs(10);

/// An agent process the master started, or an ssh running one.
pub struct Started {
    pub child: Child,
    /// Held open: the agent exits when it closes.
    pub stdin: Option<ChildStdin>,
    /// The host it runs on, for ssh sessions.
    pub host: Option<String>,
}

struct AgentProc {
    child: Child,
    stdin: Option<ChildStdin>,
    /// It exited during the job (its node failed); the job went on without it.
    gone: bool,
    /// Its node was told to go (drained): its exit is not news.
    released: bool,
}

#[derive(Default)]
pub(super) struct AgentSet {
    procs: Vec<AgentProc>,
    /// Local clusters: the agent process of each node (its workers' parent), so that a node
    /// declared lost while its agent still lives (hung: SIGSTOP) can be fenced off.
    agent_of: BTreeMap<u32, u32>,
}

impl AgentSet {
    pub fn is_empty(&self) -> bool {
        self.procs.is_empty()
    }

    /// Starts `n` agents of this very binary on this machine, pointed at `master`; each looks
    /// for a master for `master_wait` if this one is lost.
    pub fn spawn_local(
        &mut self,
        n: usize,
        exe: &Path,
        master: std::net::SocketAddr,
        token: &Token,
        master_wait: Duration,
    ) -> Result<Vec<Option<u32>>> {
        let mut pids = Vec::with_capacity(n);
        for i in 0..n {
            let mut child = crate::runtime::agent_command(exe, master, token, 10, master_wait)
                .env(crate::runtime::wire::env::HOST_AGENTS_ENV, n.to_string())
                .spawn()
                .with_ctx(|| format!("starting agent {i} ({})", exe.display()))?;
            pids.push(child.id());
            let stdin = child.stdin.take();
            self.procs.push(AgentProc {
                child,
                stdin,
                gone: false,
                released: false,
            });
        }
        Ok(pids)
    }

    pub fn adopt(&mut self, s: Started) {
        self.procs.push(AgentProc {
            child: s.child,
            stdin: s.stdin,
            gone: false,
            released: false,
        });
    }

    /// A worker of `node` runs as `pid`: its parent is the node's agent (local clusters).
    pub fn worker_started(&mut self, node: u32, pid: u32) {
        if let Some(agent) = parent_pid(pid) {
            self.agent_of.insert(node, agent);
        }
    }

    /// Agents that exited since the last call: `(index, node, status)`, with the node it
    /// served where a worker of it told (`worker_started`).
    pub fn exited(&mut self) -> Result<Vec<(usize, Option<u32>, String)>> {
        let mut out = Vec::new();
        for (i, a) in self.procs.iter_mut().enumerate() {
            if a.gone {
                continue;
            }
            let pid = a.child.id();
            if let Some(st) = a.child.try_wait().ctx("polling an agent")? {
                a.gone = true;
                if !a.released {
                    let node = self
                        .agent_of
                        .iter()
                        .find(|(_, &agent)| Some(agent) == pid)
                        .map(|(&node, _)| node);
                    out.push((i, node, st.to_string()));
                }
            }
        }
        Ok(out)
    }

    /// `node` was told to go: its agent's exit, if it runs here, is expected.
    pub fn release(&mut self, node: u32) {
        let Some(&pid) = self.agent_of.get(&node) else {
            return;
        };
        if let Some(a) = self.procs.iter_mut().find(|a| a.child.id() == Some(pid)) {
            a.released = true;
        }
    }

    /// Kills the agent of lost `node` if it still runs here; returns its pid if it did.
    pub async fn fence(&mut self, node: u32) -> Option<u32> {
        let pid = *self.agent_of.get(&node)?;
        let a = self
            .procs
            .iter_mut()
            .find(|a| !a.gone && a.child.id() == Some(pid))?;
        let _ = a.child.start_kill();
        let _ = tokio::time::timeout(EXIT_GRACE, a.child.wait()).await;
        a.gone = true;
        Some(pid)
    }

    /// Closes the agents' stdin and waits up to `grace` for each; kills the ones still
    /// running. Returns what went wrong with each that did not exit with status 0.
    pub async fn wait_all(&mut self, grace: Duration) -> Vec<String> {
        let deadline = tokio::time::Instant::now() + grace;
        let mut bad = Vec::new();
        for (i, a) in self.procs.iter_mut().enumerate() {
            if a.gone {
                continue;
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match tokio::time::timeout(left, a.child.wait()).await {
                Ok(Ok(st)) if st.success() => {}
                Ok(Ok(st)) => bad.push(format!("agent {i} exited with {st}")),
                Ok(Err(e)) => bad.push(format!("agent {i}: {e}")),
                Err(_) => {
                    let _ = a.child.start_kill();
                    let _ = tokio::time::timeout(grace, a.child.wait()).await;
                    bad.push(format!(
                        "agent {i} still ran after {grace:?} and was killed"
                    ));
                }
            }
            a.stdin = None;
        }
        bad
    }

    /// Leaves every agent running: they serve the master that replaced this one. (Their
    /// handles kill on drop: they are forgotten instead.)
    pub fn leave(&mut self) {
        for a in self.procs.drain(..) {
            std::mem::forget(a.child);
        }
    }

    /// Kills every agent (their workers follow: their stdin closes) and reaps them.
    pub async fn kill_all(&mut self) {
        for a in self.procs.iter_mut() {
            a.stdin = None;
            let _ = a.child.start_kill();
        }
        for a in self.procs.iter_mut() {
            let _ = tokio::time::timeout(EXIT_GRACE, a.child.wait()).await;
        }
    }
}

/// The parent of process `pid` on this machine, from `/proc` (Linux); `None` elsewhere.
fn parent_pid(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}
