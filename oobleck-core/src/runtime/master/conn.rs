//! The master's connections: the shared membership state, the accept loop and the per-peer
//! reader/writer tasks (the handshake is `handshake.rs`). [`super::Master`] is the handle over all of this.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, info, warn};

use super::admission::{Pending, RefusalLog, EVICT_AFTER, REFUSAL_INTERVAL};
use super::handshake::handshake;
use super::server::{MasterConfig, MasterEvent};
use crate::runtime::job::LossReason;
use crate::runtime::wire::protocol::{
    self, ClusterStatus, Message, NodeStatus, PipelineStatus, RankStatus, Return,
};
use crate::runtime::wire::records::WorkerReport;
use crate::runtime::wire::{WireError, WireResult};

/// Messages queued per connection before [`super::Master::send_to`] waits.
pub(super) const OUTBOX: usize = 64;

/// A message queued for one peer, with an optional notice once it is on the wire (so shutdown
/// can wait for its last words to leave before closing the sockets).
pub(super) struct Outgoing {
    pub(super) msg: Message,
    /// Raw bytes written right after the frame (a `Mirror` record's); empty for the rest.
    pub(super) payload: Vec<u8>,
    pub(super) written: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Outgoing {
    /// A message on its own, nobody waiting for it to be written.
    pub(super) fn new(msg: Message) -> Outgoing {
        Outgoing {
            msg,
            payload: Vec::new(),
            written: None,
        }
    }

    /// A message whose writing `done` hears of.
    pub(super) fn told(msg: Message, done: tokio::sync::oneshot::Sender<()>) -> Outgoing {
        Outgoing {
            written: Some(done),
            ..Outgoing::new(msg)
        }
    }
}

pub(super) struct NodeEntry {
    pub(super) addr: SocketAddr,
    pub(super) devices: u32,
    pub(super) last_seen: Instant,
    pub(super) outbox: mpsc::Sender<Outgoing>,
}

#[derive(Default)]
pub(super) struct JobState {
    pub(super) generation: u64,
    pub(super) pipelines: Vec<PipelineStatus>,
    pub(super) committed_step: Option<u64>,
    pub(super) samples_per_s: f64,
    pub(super) joining: Vec<u32>,
    pub(super) draining: Vec<(u32, String)>,
    pub(super) spare: Vec<u32>,
    pub(super) ranks: Vec<RankStatus>,
    /// Nodes the smallest template of the current plan needs.
    pub(super) min_pipeline_nodes: u32,
}

pub(super) struct Shared {
    pub(super) config: MasterConfig,
    pub(super) nodes: Mutex<BTreeMap<u32, NodeEntry>>,
    pub(super) job: Mutex<JobState>,
    pub(super) next_node: AtomicU32,
    /// Old node ids still to give back to returning agents (`MasterConfig::returning`).
    pub(super) returning: Mutex<std::collections::BTreeSet<u32>>,
    pub(super) refused: AtomicU64,
    /// Set by `Master::shutdown`: nodes that leave from then on are expected to.
    pub(super) closing: AtomicBool,
    /// Nodes told to go during the job (`Master::release`): their leaving is expected.
    pub(super) released: Mutex<std::collections::BTreeSet<u32>>,
    pub(super) live: watch::Sender<usize>,
    pub(super) events: mpsc::UnboundedSender<MasterEvent>,
    /// The standby masters connected, by the id this master gave each (`standbys.rs`).
    pub(super) standbys: Mutex<BTreeMap<u64, super::standbys::StandbyEntry>>,
    pub(super) next_standby: AtomicU64,
    /// Handshakes in progress (the oldest is cut for a newcomer when they fill the bound).
    pub(super) pending: Pending,
    /// Refused peers, logged one line per address and reason per interval.
    pub(super) refusals: RefusalLog,
    /// How long this process was stopped, at most (SIGSTOP, a frozen VM).
    pub(super) stops: super::stopwatch::StopWatch,
}

impl Shared {
    pub(super) fn new(config: MasterConfig, events: mpsc::UnboundedSender<MasterEvent>) -> Shared {
        let pending = Pending::new(config.max_pending_handshakes);
        let returning = config.returning.clone();
        let first_node = config.first_node;
        Shared {
            config,
            nodes: Mutex::new(BTreeMap::new()),
            job: Mutex::new(JobState::default()),
            next_node: AtomicU32::new(first_node),
            returning: Mutex::new(returning),
            standbys: Mutex::new(BTreeMap::new()),
            next_standby: AtomicU64::new(1),
            refused: AtomicU64::new(0),
            closing: AtomicBool::new(false),
            released: Mutex::new(Default::default()),
            live: watch::Sender::new(0),
            pending,
            refusals: RefusalLog::new(),
            events,
            stops: super::stopwatch::StopWatch::start(),
        }
    }

    /// This process was stopped long enough for its agents to take it for lost: a lease
    /// without a heartbeat, the last of which may have gone out a heartbeat before the stop.
    pub(super) fn stopped_past_lease(&self) -> bool {
        self.stops.longest() + self.config.heartbeat_interval >= self.config.lease
    }

    pub(super) fn nodes(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, NodeEntry>> {
        // A panic while holding this lock is a bug elsewhere; the map itself stays consistent
        // (every mutation is a single insert/remove), so keep serving.
        self.nodes.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn returns(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeSet<u32>> {
        self.returning.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn job(&self) -> std::sync::MutexGuard<'_, JobState> {
        self.job.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn emit(&self, event: MasterEvent) {
        // The receiver lives in `Master`; once it is dropped nobody is listening.
        let _ = self.events.send(event);
    }

    pub(super) fn status(&self) -> ClusterStatus {
        let now = Instant::now();
        let nodes = self
            .nodes()
            .iter()
            .map(|(&node, e)| NodeStatus {
                node,
                addr: e.addr.to_string(),
                devices: e.devices,
                last_seen_ms: now.duration_since(e.last_seen).as_millis() as u64,
            })
            .collect();
        let job = self.job();
        ClusterStatus {
            nodes,
            expected_nodes: self.config.expected_nodes,
            pipelines: job.pipelines.clone(),
            generation: job.generation,
            committed_step: job.committed_step,
            samples_per_s: job.samples_per_s,
            joining: job.joining.clone(),
            draining: job.draining.clone(),
            spare: job.spare.clone(),
            ranks: job.ranks.clone(),
            epoch: self.config.epoch,
            standbys: self
                .standbys_mut()
                .values()
                .map(|s| s.listen.clone())
                .collect(),
        }
    }

    /// A node id never given before.
    pub(super) fn new_node(&self) -> u32 {
        self.next_node.fetch_add(1, Ordering::Relaxed)
    }

    pub(super) fn touch(&self, node: u32) {
        if let Some(e) = self.nodes().get_mut(&node) {
            e.last_seen = Instant::now();
        }
    }

    pub(super) fn remove(&self, node: u32, reason: LossReason) {
        let removed = {
            let mut nodes = self.nodes();
            let removed = nodes.remove(&node).is_some();
            self.live.send_replace(nodes.len());
            removed
        };
        if removed {
            let released = self
                .released
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(&node);
            if self.closing.load(Ordering::Relaxed) || released {
                debug!(node, reason = ?reason, "node left after shutdown");
            } else {
                warn!(node, reason = ?reason, "node lost");
            }
            self.emit(MasterEvent::Lost { node, reason });
        }
    }
}

pub(super) async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut conns = JoinSet::new();
    let mut summaries = tokio::time::interval(REFUSAL_INTERVAL);
    loop {
        // Reap finished connection tasks so the set does not grow with every refused probe.
        while conns.try_join_next().is_some() {}
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = summaries.tick() => {
                say_refusals(&shared, shared.refusals.flush(Instant::now()));
                continue;
            }
        };
        match accepted {
            Ok((stream, peer)) => {
                conns.spawn(serve(stream, peer, Arc::clone(&shared)));
            }
            Err(e) => {
                // EMFILE and friends: keep serving the peers we have, retry shortly.
                warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Logs refusal lines and hands them to the job, which records them.
fn say_refusals(shared: &Shared, lines: Vec<oobleck_comm::refusals::Refused>) {
    for line in lines {
        warn!("control plane: {line}");
        shared.emit(MasterEvent::Refused {
            peer: line.peer.map(|p| p.to_string()),
            reason: line.reason,
            count: line.count,
        });
    }
}

/// Sends `Refused{reason}` (best effort) and counts why (logged once per address and reason
/// per interval).
async fn refuse(w: &mut OwnedWriteHalf, peer: SocketAddr, shared: &Shared, reason: String) {
    say_refusals(shared, shared.refusals.note(Instant::now(), peer, &reason));
    shared.refused.fetch_add(1, Ordering::Relaxed);
    let msg = Message::Refused { reason };
    if let Err(e) = protocol::write_frame(w, &msg, shared.config.write_timeout).await {
        debug!(%peer, error = %e, "could not deliver the refusal");
    }
}

async fn serve(stream: TcpStream, peer: SocketAddr, shared: Arc<Shared>) {
    // Control messages are small and latency-bound.
    let _ = stream.set_nodelay(true);
    let (mut r, mut w) = stream.into_split();
    let Some(mut slot) = shared.pending.enter(Instant::now()) else {
        let reason = format!(
            "too many connections in the handshake (limit {}), each younger than {} ms",
            shared.config.max_pending_handshakes,
            EVICT_AFTER.as_millis()
        );
        refuse(&mut w, peer, &shared, reason).await;
        return;
    };
    // Each read of the handshake has its own timeout; this bounds the whole exchange too, so a
    // peer trickling bytes cannot hold a connection open for long.
    let t = shared.config.handshake_timeout;
    let outcome = tokio::select! {
        _ = &mut slot.cut => Err(format!(
            "cut: the handshakes in progress filled the limit ({}) and this was the oldest",
            shared.config.max_pending_handshakes
        )),
        r = tokio::time::timeout(t, handshake(&mut r, &mut w, &shared)) => r.unwrap_or_else(|_| {
            Err(WireError::Timeout {
                op: "handshake",
                ms: t.as_millis() as u64,
            }
            .to_string())
        }),
    };
    let admitted = match outcome {
        Ok(Some(a)) => a,
        Ok(None) => {
            debug!(%peer, "peer closed before hello");
            return;
        }
        Err(reason) => {
            refuse(&mut w, peer, &shared, reason).await;
            return;
        }
    };
    drop(slot);
    let welcome = Message::Welcome {
        node: admitted.node,
        heartbeat_ms: shared.config.heartbeat_interval.as_millis() as u64,
        lease_ms: shared.config.lease.as_millis() as u64,
        adopted: admitted.back.is_some(),
        epoch: shared.config.epoch,
    };
    if let Err(e) = protocol::write_frame(&mut w, &welcome, shared.config.write_timeout).await {
        warn!(%peer, error = %e, "could not welcome peer");
        return;
    }
    match (admitted.node, admitted.standby) {
        (Some(node), _) => {
            serve_agent(r, w, peer, (node, admitted.devices, admitted.back), shared).await
        }
        (None, Some(listen)) => super::standbys::serve_standby(r, w, peer, listen, shared).await,
        (None, None) => serve_client(r, w, peer, shared).await,
    }
}

async fn serve_agent(
    mut r: OwnedReadHalf,
    w: OwnedWriteHalf,
    peer: SocketAddr,
    (node, devices, back): (u32, u32, Option<Return>),
    shared: Arc<Shared>,
) {
    let (tx, rx) = mpsc::channel(OUTBOX);
    {
        let mut nodes = shared.nodes();
        nodes.insert(
            node,
            NodeEntry {
                addr: peer,
                devices,
                last_seen: Instant::now(),
                outbox: tx,
            },
        );
        shared.live.send_replace(nodes.len());
    }
    info!(node, %peer, devices, "node joined");
    shared.emit(MasterEvent::Joined {
        node,
        addr: peer,
        devices,
        back,
    });
    let writer = tokio::spawn(write_loop(
        w,
        rx,
        node,
        shared.config.heartbeat_interval,
        shared.config.write_timeout,
    ));
    // When this task is aborted (the master dropped), the writer must go too, or it would keep
    // the socket open and heartbeating for a master that no longer exists.
    let mut writer = AbortOnDrop(writer);
    let lease = shared.config.lease;
    let reason = loop {
        let msg = tokio::select! {
            res = protocol::read_frame(&mut r, lease) => res,
            res = &mut writer.0 => break LossReason::Protocol(match res {
                Ok(Err(e)) => e.to_string(),
                _ => "writer stopped".into(),
            }),
        };
        let msg = match msg {
            Ok(Some(m)) => m,
            Ok(None) => break LossReason::Closed,
            Err(WireError::Timeout { ms, .. }) => break LossReason::LeaseExpired { lease_ms: ms },
            Err(e) => break LossReason::Protocol(e.to_string()),
        };
        shared.touch(node);
        match msg {
            Message::Heartbeat { node: n, .. } if n == node => {}
            Message::Worker {
                node: n,
                generation,
                report,
            } if n == node => {
                if let WorkerReport::Exited { rank, status, .. } = &report {
                    if status.code == Some(0) {
                        debug!(node, rank, "worker exited cleanly");
                    } else {
                        warn!(node, rank, ?status, "worker exited");
                    }
                }
                shared.emit(MasterEvent::Worker {
                    node,
                    generation,
                    report,
                });
            }
            Message::Drain {
                node: n,
                reason,
                force,
            } if n == node => {
                warn!(node, %reason, "node asks to leave");
                shared.emit(MasterEvent::DrainRequested {
                    node,
                    reason,
                    force,
                });
            }
            Message::StatusRequest => {
                let status = Message::StatusResponse {
                    status: shared.status(),
                };
                let outbox = shared.nodes().get(&node).map(|e| e.outbox.clone());
                if let Some(outbox) = outbox {
                    // Bounded by the outbox; a full outbox means the writer is stuck and the
                    // write timeout will end this connection.
                    let _ = outbox.try_send(Outgoing::new(status));
                }
            }
            other => {
                break LossReason::Protocol(format!("unexpected {} from node {node}", other.kind()))
            }
        }
    };
    drop(writer);
    shared.remove(node, reason);
}

async fn serve_client(
    mut r: OwnedReadHalf,
    mut w: OwnedWriteHalf,
    peer: SocketAddr,
    shared: Arc<Shared>,
) {
    let t = shared.config.handshake_timeout;
    loop {
        let reply = match protocol::read_frame(&mut r, t).await {
            Ok(Some(Message::StatusRequest)) => Message::StatusResponse {
                status: shared.status(),
            },
            Ok(Some(Message::Drain {
                node,
                reason,
                force,
            })) => {
                let refusal = drain_refusal(&shared, node, force);
                if let Some(reason) = refusal {
                    Message::Refused { reason }
                } else if shared.nodes().contains_key(&node) {
                    warn!(node, %peer, %reason, "drain requested");
                    shared.emit(MasterEvent::DrainRequested {
                        node,
                        reason,
                        force,
                    });
                    Message::StatusResponse {
                        status: shared.status(),
                    }
                } else {
                    Message::Refused {
                        reason: WireError::UnknownNode { node }.to_string(),
                    }
                }
            }
            Ok(Some(Message::Stop { reason })) => {
                warn!(%peer, %reason, "stop requested");
                shared.emit(MasterEvent::StopRequested { reason });
                Message::StatusResponse {
                    status: shared.status(),
                }
            }
            Ok(Some(Message::KillNode { node })) => {
                if shared.nodes().contains_key(&node) {
                    warn!(node, %peer, "kill requested");
                    shared.emit(MasterEvent::KillRequested { node });
                    Message::StatusResponse {
                        status: shared.status(),
                    }
                } else {
                    Message::Refused {
                        reason: WireError::UnknownNode { node }.to_string(),
                    }
                }
            }
            Ok(Some(other)) => {
                refuse(
                    &mut w,
                    peer,
                    &shared,
                    format!("unexpected {} from a client", other.kind()),
                )
                .await;
                return;
            }
            Ok(None) => return,
            Err(e) => {
                debug!(%peer, error = %e, "client connection ended");
                return;
            }
        };
        if let Err(e) = protocol::write_frame(&mut w, &reply, shared.config.write_timeout).await {
            debug!(%peer, error = %e, "could not answer client");
            return;
        }
    }
}

/// Why a tool's drain of `node` cannot be taken, where the current plan shows it already
/// (the job decides the rest: `runtime::job::membership::drain_verdict`).
fn drain_refusal(shared: &Shared, node: u32, force: bool) -> Option<String> {
    let job = shared.job();
    let in_plan: std::collections::BTreeSet<u32> =
        job.pipelines.iter().flat_map(|p| p.nodes.clone()).collect();
    if !in_plan.contains(&node) {
        return None;
    }
    let leaving = job
        .draining
        .iter()
        .map(|d| d.0)
        .chain([node])
        .filter(|n| in_plan.contains(n))
        .collect::<std::collections::BTreeSet<u32>>()
        .len();
    let case = crate::runtime::job::membership::DrainCase {
        nodes: in_plan.len(),
        leaving,
        min_nodes: job.min_pipeline_nodes as usize,
        unique_layers: Vec::new(),
        copy_off: true,
        force,
    };
    crate::runtime::job::membership::drain_verdict(&case).err()
}

/// Sends queued messages, and a heartbeat whenever the interval passes, so the agent can tell a
/// dead master from a quiet one.
pub(super) async fn write_loop(
    mut w: OwnedWriteHalf,
    mut rx: mpsc::Receiver<Outgoing>,
    node: u32,
    interval: Duration,
    write_timeout: Duration,
) -> WireResult<()> {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    loop {
        let out = tokio::select! {
            m = rx.recv() => match m {
                Some(m) => m,
                None => return Ok(()),
            },
            _ = tick.tick() => {
                seq += 1;
                Outgoing::new(Message::Heartbeat { node, seq })
            }
        };
        protocol::write_frame_with(&mut w, &out.msg, &out.payload, write_timeout).await?;
        if let Some(done) = out.written {
            // The waiter may have given up; nothing to do then.
            let _ = done.send(());
        }
    }
}

/// Aborts the task when dropped.
pub(super) struct AbortOnDrop<T>(pub(super) JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
