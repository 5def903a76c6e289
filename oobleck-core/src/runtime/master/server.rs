//! The master's side of membership: accept, authenticate, assign node ids, watch leases.
//!
//! One task accepts connections; each connection gets a task that runs the handshake and then
//! reads the peer's messages with the lease as the read timeout (silence for a lease = lost), and
//! a writer task that sends queued messages and the master's own heartbeats (so agents can tell a
//! dead master from a quiet one). Joins and losses come out of [`Master::next_event`]; the caller
//! (the master) decides what to do about them. Node ids are never reused within a job, so a
//! stale message from a lost node cannot be mistaken for its replacement.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::info;

use super::conn::{accept_loop, Outgoing, Shared};
use crate::planning::Plan;
use crate::runtime::job::LossReason;
use crate::runtime::wire::auth::Token;
use crate::runtime::wire::protocol::{
    ClusterStatus, GenerationStart, Message, NodeStatus, PipelineStatus, RankStatus, Return,
    StageStatus,
};
use crate::runtime::wire::records::WorkerReport;
use crate::runtime::wire::{WireError, WireResult};

/// Timing and identity of a master.
#[derive(Debug, Clone)]
pub struct MasterConfig {
    pub token: Token,
    /// Nodes to wait for before the first plan ([`Master::wait_for_nodes`]).
    pub expected_nodes: u32,
    /// How often agents (and the master) send a heartbeat. Default 500 ms.
    pub heartbeat_interval: Duration,
    /// Silence after which a peer is lost. Default 3 s: six missed heartbeats, so one slow
    /// scheduler tick never evicts a node, yet a failure is seen well before a step times out.
    pub lease: Duration,
    /// Bound on the whole handshake, and on a tool connection's idle time. Default 5 s.
    pub handshake_timeout: Duration,
    /// Bound on writing one frame. Default 5 s.
    pub write_timeout: Duration,
    /// Connections allowed in the handshake at once; more are refused at once. Default 256:
    /// far above any real burst of agents joining, low enough that a flood of silent
    /// connections cannot pin a task and a socket each for a handshake timeout.
    pub max_pending_handshakes: usize,
    /// Node ids a master restarted on the run directory (`--reattach`) gives back to
    /// returning agents (each once), until [`Master::end_returns`].
    pub returning: std::collections::BTreeSet<u32>,
    /// The first id given to a new agent: past every id the run has used (ids are never
    /// reused).
    pub first_node: u32,
    /// This master's epoch (`master.epoch` of the run directory, plus one).
    pub epoch: u64,
    /// A master re-adopting agents (`--reattach`): the committed step its run directory
    /// recorded. An agent that committed past it is refused: the directory is a stale copy.
    pub recorded: Option<u64>,
}

impl MasterConfig {
    pub fn new(token: Token, expected_nodes: u32) -> MasterConfig {
        MasterConfig {
            token,
            expected_nodes,
            heartbeat_interval: Duration::from_millis(500),
            lease: Duration::from_secs(3),
            handshake_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(5),
            max_pending_handshakes: 256,
            returning: Default::default(),
            first_node: 0,
            epoch: 1,
            recorded: None,
        }
    }
}

/// What the master hears from the membership layer.
#[derive(Debug, Clone, PartialEq)]
pub enum MasterEvent {
    Joined {
        node: u32,
        addr: SocketAddr,
        devices: u32,
        /// A returning agent given its old id back: what it holds.
        back: Option<Return>,
    },
    Lost {
        node: u32,
        reason: LossReason,
    },
    /// Connections to the control port were refused: `count` from `peer` (`None`: from
    /// addresses beyond the ones counted one by one) for `reason`, since the last such line.
    Refused {
        peer: Option<String>,
        reason: String,
        count: u64,
    },
    /// A tool asked for `node`'s processes to be killed.
    KillRequested {
        node: u32,
    },
    /// A tool asked the job to stop after its next step with a checkpoint (`reason`: who).
    StopRequested {
        reason: String,
    },
    /// An agent came back having seen a master of a higher epoch: this one was replaced.
    Replaced {
        epoch: u64,
    },
    /// `node` (a tool, or the node's own agent) asks to leave at the next step boundary.
    DrainRequested {
        node: u32,
        reason: String,
        force: bool,
    },
    /// What worker `report.rank()` of `node` said about itself, or that it ended
    /// ([`Message::Worker`]).
    Worker {
        node: u32,
        /// The plan generation the worker runs.
        generation: u64,
        report: WorkerReport,
    },
}

/// A running master: owns the listener and every connection task; dropping it closes them all.
pub struct Master {
    addr: SocketAddr,
    shared: Arc<Shared>,
    events: mpsc::UnboundedReceiver<MasterEvent>,
    accept: JoinHandle<()>,
}

impl Drop for Master {
    fn drop(&mut self) {
        // Aborting the accept task drops its JoinSet, which aborts every connection task.
        self.accept.abort();
    }
}

impl Master {
    /// Listens on `addr` with the default timings.
    pub async fn bind(addr: SocketAddr, token: Token, expected_nodes: u32) -> WireResult<Master> {
        Master::bind_with(addr, MasterConfig::new(token, expected_nodes)).await
    }

    /// Listens on `addr` with explicit timings.
    pub async fn bind_with(addr: SocketAddr, config: MasterConfig) -> WireResult<Master> {
        if config.heartbeat_interval.is_zero() || config.lease <= config.heartbeat_interval {
            return Err(WireError::Unexpected {
                expected: "0 < heartbeat interval < lease",
                got: format!(
                    "heartbeat {:?}, lease {:?}",
                    config.heartbeat_interval, config.lease
                ),
            });
        }
        if !(1..=tokio::sync::Semaphore::MAX_PERMITS).contains(&config.max_pending_handshakes) {
            return Err(WireError::Unexpected {
                expected: "1 <= max_pending_handshakes <= Semaphore::MAX_PERMITS",
                got: config.max_pending_handshakes.to_string(),
            });
        }
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| WireError::Io {
                op: "bind master",
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| WireError::Io {
            op: "master address",
            source,
        })?;
        let (tx, events) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared::new(config, tx));
        info!(%addr, expected_nodes = shared.config.expected_nodes, "master listening");
        let accept = tokio::spawn(accept_loop(listener, Arc::clone(&shared)));
        Ok(Master {
            addr,
            shared,
            events,
            accept,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub(super) fn shared(&self) -> &Shared {
        &self.shared
    }

    /// This master's epoch.
    pub fn epoch(&self) -> u64 {
        self.shared.config.epoch
    }

    /// The longest this process was stopped since the master started (SIGSTOP, a frozen VM).
    pub fn stopped_for(&self) -> Duration {
        self.shared.stops.longest()
    }

    /// It was stopped long enough for its agents to take it for lost (a lease without a
    /// heartbeat).
    pub fn stopped_past_lease(&self) -> bool {
        self.shared.stopped_past_lease()
    }

    /// How long silence means a peer is gone.
    pub fn lease(&self) -> Duration {
        self.shared.config.lease
    }

    /// The nodes registered now.
    pub fn node_ids(&self) -> Vec<u32> {
        self.shared.nodes().keys().copied().collect()
    }

    /// The next membership event, waiting at most `timeout`.
    pub async fn next_event(&mut self, timeout: Duration) -> WireResult<MasterEvent> {
        match tokio::time::timeout(timeout, self.events.recv()).await {
            Ok(Some(e)) => Ok(e),
            Ok(None) => Err(WireError::Closed {
                peer: "master event channel".into(),
            }),
            Err(_) => Err(WireError::Timeout {
                op: "wait for a master event",
                ms: timeout.as_millis() as u64,
            }),
        }
    }

    /// Waits until `expected_nodes` nodes are registered; returns them. Does not consume events.
    pub async fn wait_for_nodes(&self, timeout: Duration) -> WireResult<Vec<NodeStatus>> {
        let want = self.shared.config.expected_nodes as usize;
        let mut live = self.shared.live.subscribe();
        let reached = tokio::time::timeout(timeout, async {
            live.wait_for(|&n| n >= want).await.map(|_| ())
        })
        .await;
        match reached {
            Ok(Ok(())) => Ok(self.status().nodes),
            Ok(Err(_)) => Err(WireError::Closed {
                peer: "master membership".into(),
            }),
            Err(_) => Err(WireError::Timeout {
                op: "wait for the expected nodes",
                ms: timeout.as_millis() as u64,
            }),
        }
    }

    /// What `oobleck status` shows.
    pub fn status(&self) -> ClusterStatus {
        self.shared.status()
    }

    /// Peers refused so far (bad token, version, garbage).
    pub fn refused_count(&self) -> u64 {
        self.shared.refused.load(Ordering::Relaxed)
    }

    /// Records the plan now in force, for status.
    pub fn set_plan(&self, plan: &Plan) {
        let mut job = self.shared.job();
        job.generation = plan.generation;
        // Ranks are renumbered by a new plan.
        job.ranks.clear();
        job.min_pipeline_nodes = plan.templates.iter().map(|t| t.nodes).min().unwrap_or(1);
        job.pipelines = plan
            .pipelines
            .iter()
            .map(|p| {
                let template = plan.templates.iter().find(|t| t.nodes == p.template_nodes);
                let stages = template
                    .map(|t| {
                        t.stages
                            .iter()
                            .map(|s| StageStatus {
                                layers: (s.layer_start as u32, s.layer_end as u32),
                                devices: s.devices,
                                node: p.nodes.get(s.node as usize).copied().unwrap_or(u32::MAX),
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                PipelineStatus {
                    id: p.id,
                    template_nodes: p.template_nodes,
                    nodes: p.nodes.clone(),
                    microbatches: p.microbatches,
                    stages,
                    first_rank: p.first_rank,
                }
            })
            .collect();
    }

    /// No more returning agents are re-adopted: one that comes from now on gets a new id.
    pub fn end_returns(&self) {
        self.shared.returns().clear();
    }

    /// Tells `node` to stop its workers and exit: it was drained or is not needed, so its
    /// closed connection is expected (still reported as [`MasterEvent::Lost`]).
    pub async fn release(&self, node: u32, reason: String) -> WireResult<()> {
        self.shared
            .released
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node);
        self.send_to(node, Message::Shutdown { reason }).await
    }

    /// Records the nodes waiting to join, leaving and idle, for status.
    pub fn set_membership(&self, joining: Vec<u32>, draining: Vec<(u32, String)>, spare: Vec<u32>) {
        let mut job = self.shared.job();
        job.joining = joining;
        job.draining = draining;
        job.spare = spare;
    }

    /// Records where each rank's time of the last committed step went, for status.
    pub fn set_rank_times(&self, ranks: Vec<RankStatus>) {
        self.shared.job().ranks = ranks;
    }

    /// Records a committed step and its throughput, for status.
    pub fn record_commit(&self, step: u64, samples_per_s: f64) {
        let mut job = self.shared.job();
        job.committed_step = Some(step);
        job.samples_per_s = samples_per_s;
    }

    /// Queues `msg` for `node`, waiting at most the write timeout for room.
    pub async fn send_to(&self, node: u32, msg: Message) -> WireResult<()> {
        let outbox = self
            .shared
            .nodes()
            .get(&node)
            .map(|e| e.outbox.clone())
            .ok_or(WireError::UnknownNode { node })?;
        let timeout = self.shared.config.write_timeout;
        let out = Outgoing::new(msg);
        match tokio::time::timeout(timeout, outbox.send(out)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(WireError::UnknownNode { node }),
            Err(_) => Err(WireError::Timeout {
                op: "queue a message for a node",
                ms: timeout.as_millis() as u64,
            }),
        }
    }

    /// Queues `msg` for every live node; returns the nodes it could not reach (they are being
    /// or will be reported lost).
    pub async fn broadcast(&self, msg: &Message) -> Vec<(u32, WireError)> {
        let nodes: Vec<u32> = self.shared.nodes().keys().copied().collect();
        let mut failed = Vec::new();
        for node in nodes {
            if let Err(e) = self.send_to(node, msg.clone()).await {
                failed.push((node, e));
            }
        }
        failed
    }

    /// Puts `plan` in force: checks that every node it uses is registered, records it for
    /// status, and sends every live node the plan and `start` (the data-plane rendezvous list,
    /// the generation's key and NCCL id, where the state comes from). Returns the nodes it
    /// could not reach.
    pub async fn assign_plan(
        &self,
        plan: &Plan,
        start: GenerationStart,
    ) -> WireResult<Vec<(u32, WireError)>> {
        {
            let nodes = self.shared.nodes();
            if let Some(&node) = plan
                .pipelines
                .iter()
                .flat_map(|p| p.nodes.iter())
                .find(|n| !nodes.contains_key(n))
            {
                return Err(WireError::UnknownNode { node });
            }
        }
        self.set_plan(plan);
        let msg = Message::PlanAssignment {
            generation: plan.generation,
            plan: Box::new(plan.clone()),
            start,
        };
        Ok(self.broadcast(&msg).await)
    }

    /// Ends the job's control plane: sends every live node `Shutdown{reason}`, waits (at most
    /// `timeout` in all) until each has been written to its socket, then closes everything.
    /// Returns the nodes that may not have heard it.
    pub async fn shutdown(self, reason: &str, timeout: Duration) -> Vec<(u32, WireError)> {
        let deadline = tokio::time::Instant::now() + timeout;
        let ms = timeout.as_millis() as u64;
        let targets: Vec<(u32, mpsc::Sender<Outgoing>)> = self
            .shared
            .nodes()
            .iter()
            .map(|(&n, e)| (n, e.outbox.clone()))
            .collect();
        info!(nodes = targets.len(), reason, "master shutting down");
        self.shared.closing.store(true, Ordering::Relaxed);
        super::standbys::dismiss(&self.shared, reason, deadline).await;
        let mut failed = Vec::new();
        let mut pending = Vec::new();
        for (node, outbox) in targets {
            let (done, written) = tokio::sync::oneshot::channel();
            let shutdown = Message::Shutdown {
                reason: reason.to_string(),
            };
            let out = Outgoing::told(shutdown, done);
            match tokio::time::timeout_at(deadline, outbox.send(out)).await {
                Ok(Ok(())) => pending.push((node, written)),
                Ok(Err(_)) => failed.push((node, WireError::UnknownNode { node })),
                Err(_) => failed.push((
                    node,
                    WireError::Timeout {
                        op: "queue shutdown",
                        ms,
                    },
                )),
            }
        }
        for (node, written) in pending {
            match tokio::time::timeout_at(deadline, written).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => failed.push((
                    node,
                    WireError::Closed {
                        peer: format!("node {node}"),
                    },
                )),
                Err(_) => failed.push((
                    node,
                    WireError::Timeout {
                        op: "send shutdown",
                        ms,
                    },
                )),
            }
        }
        // Dropping `self` aborts every task and closes every socket.
        failed
    }

    /// Declares `step` committed in the current generation: records it for status and tells
    /// every live node. Returns the nodes it could not reach.
    pub async fn commit_step(
        &self,
        step: u64,
        samples_per_s: f64,
        last: bool,
    ) -> Vec<(u32, WireError)> {
        self.record_commit(step, samples_per_s);
        let generation = self.shared.job().generation;
        let commit = Message::StepCommitted {
            step,
            generation,
            last,
        };
        self.broadcast(&commit).await
    }
}
