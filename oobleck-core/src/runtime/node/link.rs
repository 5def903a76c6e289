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
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use crate::runtime::wire::auth::Token;
use crate::runtime::wire::client::{open, timeout_err};
use crate::runtime::wire::protocol::{self, ExitStatus, Message, PeerRole, Return};
use crate::runtime::wire::records::WorkerReport;
use crate::runtime::wire::{WireError, WireResult};

/// Messages queued before [`Agent::send`] waits.
const OUTBOX: usize = 64;
/// Master messages buffered before the reader waits for [`Agent::recv`].
const INBOX: usize = 64;

/// A registered node agent. Dropping it closes the connection; the master reports the node lost.
pub struct Agent {
    node: u32,
    /// It came back to a restarted master, which gave it its old node id and its workers.
    adopted: bool,
    /// The master's epoch.
    epoch: u64,
    local: SocketAddr,
    heartbeat: Duration,
    lease: Duration,
    outbox: mpsc::Sender<Message>,
    inbox: mpsc::Receiver<WireResult<Message>>,
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
    ) -> WireResult<Agent> {
        Agent::connect_with_devices(master, token, 1, timeout).await
    }

    /// Registers an agent offering `devices` devices.
    pub async fn connect_with_devices(
        master: SocketAddr,
        token: &Token,
        devices: u32,
        timeout: Duration,
    ) -> WireResult<Agent> {
        Agent::connect_as(master, token, PeerRole::Agent { devices }, timeout).await
    }

    /// Registers an agent that lost its master and comes back with what it holds: a master
    /// restarted on the job's run directory re-adopts it ([`Agent::adopted`]), any other
    /// takes it as a new node.
    pub async fn reconnect(
        master: SocketAddr,
        token: &Token,
        back: Return,
        timeout: Duration,
    ) -> WireResult<Agent> {
        Agent::connect_as(master, token, PeerRole::Returning(back), timeout).await
    }

    async fn connect_as(
        master: SocketAddr,
        token: &Token,
        role: PeerRole,
        timeout: Duration,
    ) -> WireResult<Agent> {
        let (r, w, welcomed) = open(master, token, role, timeout).await?;
        let local = r.local_addr().map_err(|source| WireError::Io {
            op: "agent address",
            source,
        })?;
        let node = welcomed.node.ok_or(WireError::Unexpected {
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
            adopted: welcomed.adopted,
            epoch: welcomed.epoch,
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

    /// A restarted master gave this returning agent its old node id back: its workers and
    /// their state go on in the job.
    pub fn adopted(&self) -> bool {
        self.adopted
    }

    /// The master's epoch (one more at every restart or take-over of the job's master).
    pub fn epoch(&self) -> u64 {
        self.epoch
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

    /// The next message from the master. [`WireError::Timeout`] when none came within
    /// `timeout`; [`WireError::Closed`] (or the reader's error) once the master is gone, or
    /// was silent for a lease.
    pub async fn recv(&mut self, timeout: Duration) -> WireResult<Message> {
        match tokio::time::timeout(timeout, self.inbox.recv()).await {
            Ok(Some(res)) => res,
            Ok(None) => Err(WireError::Closed {
                peer: "master".into(),
            }),
            Err(_) => Err(timeout_err("wait for a master message", timeout)),
        }
    }

    /// Queues `msg` for the master.
    pub async fn send(&self, msg: Message, timeout: Duration) -> WireResult<()> {
        match tokio::time::timeout(timeout, self.outbox.send(msg)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(WireError::Closed {
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
    ) -> WireResult<()> {
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

/// A peer's writer to the master: the messages queued on `rx`, and a heartbeat (`node`) every
/// `interval` unless `paused`. Agents and standby masters use it.
pub(crate) async fn write_loop(
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
            warn!(node, error = %e, "write to the master failed");
            return;
        }
    }
}

async fn read_loop(mut r: OwnedReadHalf, tx: mpsc::Sender<WireResult<Message>>, lease: Duration) {
    loop {
        let item = match protocol::read_frame(&mut r, lease).await {
            Ok(Some(Message::Heartbeat { .. })) => continue,
            Ok(Some(m)) => Ok(m),
            Ok(None) => return,
            // Said as what it means, and never taken for [`Agent::recv`]'s own timeout.
            Err(WireError::Timeout { .. }) => Err(WireError::Closed {
                peer: format!("master (silent for its lease of {} ms)", lease.as_millis()),
            }),
            Err(e) => Err(e),
        };
        let fatal = item.is_err();
        if tx.send(item).await.is_err() || fatal {
            return;
        }
    }
}
