//! The agent's side of membership: register with the master, heartbeat, exchange messages.
//!
//! After the handshake two tasks own the connection: a writer that sends queued messages and a
//! heartbeat every interval, and a reader that hands the master's messages to [`Agent::recv`]
//! and treats a lease of silence from the master (which heartbeats too) as the master lost.
//! Dropping the [`Agent`] aborts both and closes the connection.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use super::auth::Token;
use super::error::{ElasticError, ElasticResult};
use super::master::BINARY_VERSION;
use super::protocol::{self, ClusterStatus, ExitStatus, Message, PeerRole, PROTOCOL_VERSION};
use crate::runtime::records::WorkerReport;

/// Messages queued before [`Agent::send`] waits.
const OUTBOX: usize = 64;
/// Master messages buffered before the reader waits for [`Agent::recv`].
const INBOX: usize = 64;

fn timeout_err(op: &'static str, t: Duration) -> ElasticError {
    ElasticError::Timeout {
        op,
        ms: t.as_millis() as u64,
    }
}

struct Welcomed {
    node: Option<u32>,
    heartbeat: Duration,
    lease: Duration,
}

/// Connects and authenticates as `role`; the whole exchange is bounded by `timeout`.
async fn open(
    master: SocketAddr,
    token: &Token,
    role: PeerRole,
    timeout: Duration,
) -> ElasticResult<(OwnedReadHalf, OwnedWriteHalf, Welcomed)> {
    let run = async {
        let stream = TcpStream::connect(master)
            .await
            .map_err(|source| ElasticError::Io {
                op: "connect to master",
                source,
            })?;
        let _ = stream.set_nodelay(true);
        let (mut r, mut w) = stream.into_split();
        let hello = Message::Hello {
            protocol: PROTOCOL_VERSION,
            binary_version: BINARY_VERSION.to_string(),
            role,
        };
        protocol::write_frame(&mut w, &hello, timeout).await?;
        let (node, nonce) = match expect(&mut r, timeout, "challenge").await? {
            Message::Challenge { node, nonce } => (node, nonce),
            other => return Err(unexpected("challenge", &other)),
        };
        let mac = token.respond(&nonce, node, PROTOCOL_VERSION);
        protocol::write_frame(&mut w, &Message::AuthResponse { mac }, timeout).await?;
        match expect(&mut r, timeout, "welcome").await? {
            Message::Welcome {
                node: n,
                heartbeat_ms,
                lease_ms,
            } if n == node && heartbeat_ms > 0 && lease_ms > heartbeat_ms => Ok((
                r,
                w,
                Welcomed {
                    node,
                    heartbeat: Duration::from_millis(heartbeat_ms),
                    lease: Duration::from_millis(lease_ms),
                },
            )),
            other => Err(unexpected(
                "welcome for our node with heartbeat < lease",
                &other,
            )),
        }
    };
    tokio::time::timeout(timeout, run)
        .await
        .map_err(|_| timeout_err("register with master", timeout))?
}

fn unexpected(expected: &'static str, got: &Message) -> ElasticError {
    ElasticError::Unexpected {
        expected,
        got: format!("{got:?}").chars().take(200).collect(),
    }
}

/// Reads one handshake message; a `Refused` becomes [`ElasticError::Refused`].
async fn expect(r: &mut OwnedReadHalf, t: Duration, what: &'static str) -> ElasticResult<Message> {
    match protocol::read_frame(r, t).await? {
        Some(Message::Refused { reason }) => Err(ElasticError::Refused { reason }),
        Some(m) => Ok(m),
        None => Err(ElasticError::Closed {
            peer: format!("master (while waiting for {what})"),
        }),
    }
}

/// A registered node agent. Dropping it closes the connection; the master reports the node lost.
pub struct Agent {
    node: u32,
    local: SocketAddr,
    heartbeat: Duration,
    lease: Duration,
    outbox: mpsc::Sender<Message>,
    inbox: mpsc::Receiver<ElasticResult<Message>>,
    paused: Arc<AtomicBool>,
    tasks: [JoinHandle<()>; 2],
}

impl Drop for Agent {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Agent {
    /// Registers a one-device agent with the master at `master`.
    pub async fn connect(
        master: SocketAddr,
        token: &Token,
        timeout: Duration,
    ) -> ElasticResult<Agent> {
        Agent::connect_with_devices(master, token, 1, timeout).await
    }

    /// Registers an agent offering `devices` devices.
    pub async fn connect_with_devices(
        master: SocketAddr,
        token: &Token,
        devices: u32,
        timeout: Duration,
    ) -> ElasticResult<Agent> {
        let (r, w, welcomed) = open(master, token, PeerRole::Agent { devices }, timeout).await?;
        let local = r.local_addr().map_err(|source| ElasticError::Io {
            op: "agent address",
            source,
        })?;
        let node = welcomed.node.ok_or(ElasticError::Unexpected {
            expected: "a node id in welcome",
            got: "none".into(),
        })?;
        let (outbox, out_rx) = mpsc::channel(OUTBOX);
        let (in_tx, inbox) = mpsc::channel(INBOX);
        let paused = Arc::new(AtomicBool::new(false));
        let writer = tokio::spawn(write_loop(
            w,
            out_rx,
            node,
            welcomed.heartbeat,
            timeout,
            Arc::clone(&paused),
        ));
        let reader = tokio::spawn(read_loop(r, in_tx, welcomed.lease));
        debug!(node, %master, "agent registered");
        Ok(Agent {
            node,
            local,
            heartbeat: welcomed.heartbeat,
            lease: welcomed.lease,
            outbox,
            inbox,
            paused,
            tasks: [writer, reader],
        })
    }

    /// The node id the master assigned.
    pub fn node(&self) -> u32 {
        self.node
    }

    /// This end of the control connection: its IP is the address the master's network reaches
    /// this machine at, a sound default for the data plane.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The heartbeat interval and lease the master set.
    pub fn timings(&self) -> (Duration, Duration) {
        (self.heartbeat, self.lease)
    }

    /// The next message from the master. [`ElasticError::Timeout`] when none came within
    /// `timeout`; [`ElasticError::Closed`] (or the reader's error) once the master is gone.
    pub async fn recv(&mut self, timeout: Duration) -> ElasticResult<Message> {
        match tokio::time::timeout(timeout, self.inbox.recv()).await {
            Ok(Some(res)) => res,
            Ok(None) => Err(ElasticError::Closed {
                peer: "master".into(),
            }),
            Err(_) => Err(timeout_err("wait for a master message", timeout)),
        }
    }

    /// Queues `msg` for the master.
    pub async fn send(&self, msg: Message, timeout: Duration) -> ElasticResult<()> {
        match tokio::time::timeout(timeout, self.outbox.send(msg)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(ElasticError::Closed {
                peer: "master".into(),
            }),
            Err(_) => Err(timeout_err("queue a message for the master", timeout)),
        }
    }

    /// Tells the master a worker of this node ended.
    pub async fn report_worker_exit(
        &self,
        rank: u32,
        generation: u64,
        status: ExitStatus,
        error: Option<String>,
        timeout: Duration,
    ) -> ElasticResult<()> {
        let msg = Message::Worker {
            node: self.node,
            generation,
            report: WorkerReport::Exited {
                rank,
                status,
                error,
            },
        };
        self.send(msg, timeout).await
    }

    /// Fault injection: stop (or resume) heartbeats while keeping the connection open, as a
    /// stalled agent would. The master reports the node lost once its lease runs out.
    pub fn pause_heartbeats(&self, paused: bool) {
        self.paused.store(paused, Ordering::Relaxed);
    }
}

async fn write_loop(
    mut w: OwnedWriteHalf,
    mut rx: mpsc::Receiver<Message>,
    node: u32,
    interval: Duration,
    write_timeout: Duration,
    paused: Arc<AtomicBool>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    loop {
        let msg = tokio::select! {
            m = rx.recv() => match m {
                Some(m) => m,
                None => return,
            },
            _ = tick.tick() => {
                if paused.load(Ordering::Relaxed) {
                    continue;
                }
                seq += 1;
                Message::Heartbeat { node, seq }
            }
        };
        if let Err(e) = protocol::write_frame(&mut w, &msg, write_timeout).await {
            // The reader sees the connection die (or the master's silence) and reports it.
            warn!(node, error = %e, "agent write failed");
            return;
        }
    }
}

async fn read_loop(
    mut r: OwnedReadHalf,
    tx: mpsc::Sender<ElasticResult<Message>>,
    lease: Duration,
) {
    loop {
        let item = match protocol::read_frame(&mut r, lease).await {
            Ok(Some(Message::Heartbeat { .. })) => continue,
            Ok(Some(m)) => Ok(m),
            Ok(None) => return,
            Err(e) => Err(e),
        };
        let fatal = item.is_err();
        if tx.send(item).await.is_err() || fatal {
            return;
        }
    }
}

/// Asks the master for its status as an authenticated client (what `oobleck status` does).
pub async fn request_status(
    master: SocketAddr,
    token: &Token,
    timeout: Duration,
) -> ElasticResult<ClusterStatus> {
    request(
        master,
        token,
        Message::StatusRequest,
        "request status",
        timeout,
    )
    .await
}

/// Asks the master to kill `node`'s processes (what `oobleck kill-node` does). The master
/// answers with its status; an unknown node comes back as [`ElasticError::Refused`].
pub async fn request_kill(
    master: SocketAddr,
    token: &Token,
    node: u32,
    timeout: Duration,
) -> ElasticResult<ClusterStatus> {
    request(
        master,
        token,
        Message::KillNode { node },
        "request a kill",
        timeout,
    )
    .await
}

/// Asks the master to drain `node` at the next step boundary (what `oobleck drain` does). The
/// master answers with its status; an unknown node comes back as [`ElasticError::Refused`].
pub async fn request_drain(
    master: SocketAddr,
    token: &Token,
    node: u32,
    force: bool,
    timeout: Duration,
) -> ElasticResult<ClusterStatus> {
    let reason = "oobleck drain".to_string();
    let msg = Message::Drain {
        node,
        reason,
        force,
    };
    request(master, token, msg, "request a drain", timeout).await
}

/// One request of an authenticated client, answered by the master's status.
async fn request(
    master: SocketAddr,
    token: &Token,
    msg: Message,
    what: &'static str,
    timeout: Duration,
) -> ElasticResult<ClusterStatus> {
    let run = async {
        let (mut r, mut w, _) = open(master, token, PeerRole::Client, timeout).await?;
        protocol::write_frame(&mut w, &msg, timeout).await?;
        match expect(&mut r, timeout, "the master's status").await? {
            Message::StatusResponse { status } => Ok(status),
            other => Err(unexpected("status_response", &other)),
        }
    };
    tokio::time::timeout(timeout, run)
        .await
        .map_err(|_| timeout_err(what, timeout))?
}
