//! The control-plane wire format: one versioned [`Message`] enum in length-prefixed frames.
//!
//! ```text
//!  byte 0         4         6         8                 12
//!       +---------+---------+---------+-----------------+------------------------------+
//!       |  magic  | version | reserved|   body length   |   body: `length` bytes of    |
//!       | "OOBK"  | u16 BE  | u16 = 0 |   u32 BE        |   JSON, one `Message`        |
//!       +---------+---------+---------+-----------------+------------------------------+
//!                                       length <= MAX_FRAME_BYTES (16 MiB)
//! ```
//!
//! - The **magic** rejects a stray client (an HTTP probe, a port scanner, a data-plane peer
//!   dialled by mistake) at its first four bytes, before any length is trusted.
//! - The **version** is checked before the body is parsed, so a peer built from another
//!   protocol gets [`WireError::UnsupportedVersion`] with both numbers, not a JSON error.
//! - The **length** is checked against [`MAX_FRAME_BYTES`] before anything is allocated.
//!
//! The body is `serde_json`. Control messages are few (a handshake, a heartbeat every few
//! hundred ms, one message per committed step and one plan per generation) and small (a plan for
//! a 96-layer model is tens of KiB), so a compact binary encoding would save microseconds per
//! step on a path that is nowhere near the step's critical path, and would cost a dependency and
//! readability. JSON keeps the traffic readable in a packet dump and in logs, and it is already
//! how plans are written to disk (`plan.json`). Messages are internally tagged (`"type"`), so an
//! unknown kind from a newer peer is a clean [`WireError::Malformed`].
//!
//! Reads take a timeout. A clean close between frames is `Ok(None)`; a close inside a frame is
//! [`WireError::Truncated`].

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::error::{WireError, WireResult};
use oobleck_comm::SecretKey;

use crate::execution::StepTimes;
use crate::planning::Plan;
use crate::runtime::wire::pipe::StateSource;
use crate::runtime::wire::records::WorkerReport;

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"OOBK";
/// Protocol version this binary speaks. Bump on any incompatible change of [`Message`].
pub const PROTOCOL_VERSION: u16 = 9;
/// The binary version peers must match.
pub const BINARY_VERSION: &str = env!("CARGO_PKG_VERSION");
/// Header size in bytes.
pub const HEADER_BYTES: usize = 12;
/// Largest body accepted: far above any plan, small enough that a corrupt length cannot make
/// the master allocate gigabytes.
pub const MAX_FRAME_BYTES: u32 = 16 << 20;

/// What a connecting peer is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum PeerRole {
    /// A node agent offering `devices` devices; it gets a node id.
    Agent { devices: u32 },
    /// A node agent that lost its master and comes back with its workers: a master
    /// restarted on the job's run directory (`--reattach`) gives it its old node id back
    /// and re-adopts its workers; any other master takes it as a new agent.
    Returning(Return),
    /// A tool (`oobleck status`, `oobleck kill-node`): authenticated, but not a member.
    Client,
    /// A standby master: it keeps a copy of the run directory, and takes over at `listen`
    /// (where the agents will look for it) when the master is lost.
    Standby { listen: String },
}

/// What a returning agent holds: who it was and what its workers have.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Return {
    /// The node id its lost master gave it.
    pub node: u32,
    pub devices: u32,
    /// The plan generation its workers run.
    pub generation: u64,
    /// The last step its master told it committed.
    pub committed: u64,
    /// The ranks of its workers that built their stage of that generation and still run:
    /// they hold the state of a committed step.
    pub ranks: Vec<u32>,
    /// How long it has been without a master.
    pub without_master_ms: u64,
    /// The highest master epoch it has seen: a master of a lower one learns that it was
    /// replaced.
    pub epoch: u64,
}

/// One data-plane endpoint: where global rank `rank` listens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rendezvous {
    pub rank: u32,
    /// `host:port`.
    pub addr: String,
}

/// How a worker process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExitStatus {
    /// Exit code, when it exited.
    pub code: Option<i32>,
    /// Signal number, when a signal killed it.
    pub signal: Option<i32>,
}

/// One registered node, as the master sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeStatus {
    pub node: u32,
    /// The agent's address as the master saw it.
    pub addr: String,
    pub devices: u32,
    /// Time since the last message from this agent, ms.
    pub last_seen_ms: u64,
}

/// One pipeline in a status report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineStatus {
    pub id: u32,
    pub template_nodes: u32,
    pub nodes: Vec<u32>,
    pub microbatches: u32,
    /// The template's stages in order.
    pub stages: Vec<StageStatus>,
    /// The global rank of its first stage's first device; the stages' devices follow in order.
    #[serde(default)]
    pub first_rank: u32,
}

/// One stage of a pipeline in a status report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageStatus {
    /// First layer and one past the last.
    pub layers: (u32, u32),
    /// Devices the stage's microbatches are split over.
    pub devices: u32,
    /// The node running it.
    pub node: u32,
}

/// The master's view of the job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterStatus {
    /// Registered, live nodes, ascending id.
    pub nodes: Vec<NodeStatus>,
    /// Nodes the job waits for before planning.
    pub expected_nodes: u32,
    /// Pipelines of the current plan (empty before the first plan).
    pub pipelines: Vec<PipelineStatus>,
    /// Current plan generation (0 before the first plan).
    pub generation: u64,
    /// Last committed step, if any.
    pub committed_step: Option<u64>,
    /// Throughput of the last committed step, samples/s.
    pub samples_per_s: f64,
    /// Nodes that registered during the job and wait to be admitted at a step boundary.
    #[serde(default)]
    pub joining: Vec<u32>,
    /// Nodes that leave at the next step boundary: `(node, why)`.
    #[serde(default)]
    pub draining: Vec<(u32, String)>,
    /// Live nodes the current plan leaves idle (no template combination covers them).
    #[serde(default)]
    pub spare: Vec<u32>,
    /// Where each rank's time of the last committed step went, stragglers marked.
    #[serde(default)]
    pub ranks: Vec<RankStatus>,
    /// The answering master's epoch (`master.epoch`): 1 for the job's first master, one more
    /// for each that took over (a standby, or `--reattach`).
    #[serde(default)]
    pub epoch: u64,
    /// Where its standby masters take over, oldest first.
    #[serde(default)]
    pub standbys: Vec<String>,
}

/// One rank's times in the last committed step, in a status report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankStatus {
    pub rank: u32,
    pub node: u32,
    pub times: StepTimes,
    /// Named a straggler: slower than its peers, for the same work, step after step.
    #[serde(default)]
    pub straggler: bool,
}

/// What a generation's workers need besides the plan: where the data plane listens (filled
/// in by the `RendezvousList` that follows, when empty), its secret, and where their state
/// comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerationStart {
    pub rendezvous: Vec<Rendezvous>,
    /// The NCCL unique id of this generation (feature `nccl`), 128 bytes.
    pub nccl_unique_id: Option<Vec<u8>>,
    /// The generation's data-plane key: every connection between its ranks proves it.
    pub key: SecretKey,
    pub source: StateSource,
    /// The port on the master's host where workers upload their state (checkpoints,
    /// evaluation, the end), and the key the uploads prove: no node needs the master's disk.
    pub state_port: u16,
    pub state_key: SecretKey,
}

/// Every message of the control protocol.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Message {
    /// Peer -> master, first message. `binary_version` is the crate version: mixing binaries is
    /// refused even when the wire format matches, since plans and layers must agree.
    Hello {
        protocol: u16,
        binary_version: String,
        role: PeerRole,
        /// The job the peer is of, where its launcher named one (`Token::for_job`): a master
        /// of another named job refuses it, saying so.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        job: Option<String>,
    },
    /// Master -> peer: prove you know the token. `node` is the id the agent will get (`None`
    /// for a client); it is bound into the answer so a response cannot be replayed for another.
    Challenge { node: Option<u32>, nonce: Vec<u8> },
    /// Peer -> master: `HMAC-SHA256(token, nonce || node || protocol)`.
    AuthResponse { mac: Vec<u8> },
    /// Master -> peer: accepted. Agents must send something at least every `heartbeat_ms`; the
    /// master declares them lost after `lease_ms` of silence.
    Welcome {
        node: Option<u32>,
        heartbeat_ms: u64,
        lease_ms: u64,
        /// A returning agent got its old node id back: its workers are re-adopted.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        adopted: bool,
        /// The master's epoch: one more at every master of a run directory (a restart, a
        /// standby's take-over). An agent never registers with a master of an epoch lower
        /// than one it has seen.
        #[serde(default)]
        epoch: u64,
    },
    /// Master -> peer, then close.
    Refused { reason: String },
    /// Agent (and standby master, as node 0) -> master, every `heartbeat_ms`.
    Heartbeat { node: u32, seq: u64 },
    /// Master -> agent: the plan of a generation and where every rank's data plane listens.
    PlanAssignment {
        generation: u64,
        plan: Box<Plan>,
        start: GenerationStart,
    },
    /// Master -> agents: every holder has its reduced gradient for `step`; apply it. `last`:
    /// the run ends with it (its final step, or a stop asked for by a signal).
    StepCommitted {
        step: u64,
        generation: u64,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        last: bool,
    },
    /// Master -> agent, before its first plan: what the job runs, opaque to this layer (the
    /// trainer's resolved configuration) and where its outputs go. Agents hand it to workers.
    Job {
        run_dir: String,
        config: serde_json::Value,
    },
    /// Master -> agents, once every rank of `generation` listens: where each one is.
    RendezvousList {
        generation: u64,
        rendezvous: Vec<Rendezvous>,
    },
    /// Agent -> master: what worker `report.rank()` of this node, of plan generation
    /// `generation`, says about itself (listening, ready, saved, broken, done), or that it
    /// ended (`Exited`). The report travels as the worker wrote it on its pipe.
    Worker {
        node: u32,
        generation: u64,
        report: WorkerReport,
    },
    /// Client -> master.
    StatusRequest,
    /// Master -> client.
    StatusResponse { status: ClusterStatus },
    /// Client -> master: kill the processes of `node` (fault injection, demos).
    KillNode { node: u32 },
    /// Client -> master: stop after the next step with its checkpoint, as SIGTERM to the
    /// master does (`oobleck stop`: a scheduler's notice, to a master on another machine).
    Stop { reason: String },
    /// Master -> agents: generation `generation` failed; its workers stop their step at once
    /// (keeping the committed state) and wait for the next generation.
    AbortGeneration { generation: u64 },
    /// Master -> agent: kill your workers and exit. Master -> standby: the job is over.
    Shutdown { reason: String },
    /// Master -> standby: `len` bytes of a file of the run directory (`path`, relative), to
    /// write at `offset` (`truncate`: the file is rewritten from there: anything after goes).
    /// The bytes follow the frame on the connection, raw ([`read_payload`]): a checkpoint is
    /// not doubled by an encoding. `seq` numbers the records of one connection from 1.
    Mirror {
        seq: u64,
        path: String,
        offset: u64,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        truncate: bool,
        len: u64,
    },
    /// Standby -> master: every record up to `seq` is on its disk.
    Mirrored { seq: u64 },
    /// Master -> agents: where the standby masters take over, in the order to try them after
    /// the master's own address.
    Standbys { addrs: Vec<String> },
    /// Client or agent -> master: `node` will go away; it leaves at the next step boundary
    /// with no step lost (`reason`: who asked, e.g. "SIGTERM" or a preemption notice).
    /// `force` accepts a drain that leaves too few nodes for a pipeline (the job then goes
    /// back to its newest checkpoint or stops). A client gets its status back, or `Refused`.
    Drain {
        node: u32,
        reason: String,
        force: bool,
    },
}

impl Message {
    /// The message's tag, for logs and errors.
    pub fn kind(&self) -> &'static str {
        match self {
            Message::Hello { .. } => "hello",
            Message::Challenge { .. } => "challenge",
            Message::AuthResponse { .. } => "auth_response",
            Message::Welcome { .. } => "welcome",
            Message::Refused { .. } => "refused",
            Message::Heartbeat { .. } => "heartbeat",
            Message::PlanAssignment { .. } => "plan_assignment",
            Message::StepCommitted { .. } => "step_committed",
            Message::Job { .. } => "job",
            Message::RendezvousList { .. } => "rendezvous_list",
            Message::Worker { .. } => "worker",
            Message::StatusRequest => "status_request",
            Message::StatusResponse { .. } => "status_response",
            Message::KillNode { .. } => "kill_node",
            Message::Stop { .. } => "stop",
            Message::AbortGeneration { .. } => "abort_generation",
            Message::Shutdown { .. } => "shutdown",
            Message::Drain { .. } => "drain",
            Message::Mirror { .. } => "mirror",
            Message::Mirrored { .. } => "mirrored",
            Message::Standbys { .. } => "standbys",
        }
    }
}

/// Checks a header and returns the body length it announces.
pub fn decode_header(header: &[u8; HEADER_BYTES]) -> WireResult<usize> {
    let mut magic = [0u8; 4];
    magic.copy_from_slice(&header[0..4]);
    if magic != MAGIC {
        return Err(WireError::BadMagic {
            found: magic,
            expected: MAGIC,
        });
    }
    let version = u16::from_be_bytes([header[4], header[5]]);
    if version != PROTOCOL_VERSION {
        return Err(WireError::UnsupportedVersion {
            found: version,
            supported: PROTOCOL_VERSION,
        });
    }
    let reserved = u16::from_be_bytes([header[6], header[7]]);
    if reserved != 0 {
        return Err(WireError::ReservedBits { found: reserved });
    }
    let len = u32::from_be_bytes([header[8], header[9], header[10], header[11]]);
    if len > MAX_FRAME_BYTES {
        return Err(WireError::FrameTooLarge {
            len: u64::from(len),
            max: MAX_FRAME_BYTES,
        });
    }
    // u32 always fits usize on the 32/64-bit targets this crate builds for.
    Ok(len as usize)
}

/// Parses a frame body.
pub fn decode_body(body: &[u8]) -> WireResult<Message> {
    serde_json::from_slice(body).map_err(|e| WireError::Malformed {
        len: body.len(),
        reason: e.to_string(),
    })
}

/// Encodes `msg` as one complete frame (header + body).
pub fn encode_frame(msg: &Message) -> WireResult<Vec<u8>> {
    encode_frame_with_version(msg, PROTOCOL_VERSION)
}

/// Like [`encode_frame`] with another version in the header: for talking to (and testing)
/// peers of other versions.
pub fn encode_frame_with_version(msg: &Message, version: u16) -> WireResult<Vec<u8>> {
    let body = serde_json::to_vec(msg).map_err(|e| WireError::Encode {
        kind: msg.kind(),
        reason: e.to_string(),
    })?;
    let len = u32::try_from(body.len())
        .ok()
        .filter(|&l| l <= MAX_FRAME_BYTES)
        .ok_or(WireError::FrameTooLarge {
            len: body.len() as u64,
            max: MAX_FRAME_BYTES,
        })?;
    let mut frame = Vec::with_capacity(HEADER_BYTES + body.len());
    frame.extend_from_slice(&MAGIC);
    frame.extend_from_slice(&version.to_be_bytes());
    frame.extend_from_slice(&0u16.to_be_bytes());
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// Reads exactly `buf.len()` bytes; returns how many arrived before EOF.
async fn read_full<R: AsyncRead + Unpin>(r: &mut R, buf: &mut [u8]) -> WireResult<usize> {
    let mut got = 0;
    while got < buf.len() {
        let n = r
            .read(&mut buf[got..])
            .await
            .map_err(|source| WireError::Io {
                op: "read frame",
                source,
            })?;
        if n == 0 {
            break;
        }
        got += n;
    }
    Ok(got)
}

async fn read_frame_inner<R: AsyncRead + Unpin>(r: &mut R) -> WireResult<Option<Message>> {
    let mut header = [0u8; HEADER_BYTES];
    let got = read_full(r, &mut header).await?;
    if got == 0 {
        return Ok(None);
    }
    if got < HEADER_BYTES {
        return Err(WireError::Truncated {
            part: "header",
            expected: HEADER_BYTES,
            got,
        });
    }
    let len = decode_header(&header)?;
    let mut body = vec![0u8; len];
    let got = read_full(r, &mut body).await?;
    if got < len {
        return Err(WireError::Truncated {
            part: "body",
            expected: len,
            got,
        });
    }
    decode_body(&body).map(Some)
}

/// Reads one message. `Ok(None)` when the peer closed cleanly between frames.
///
/// Not cancel-safe: a frame interrupted by the timeout (or by dropping the future) leaves the
/// stream mid-frame, so after an `Err` the connection must be dropped.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    timeout: Duration,
) -> WireResult<Option<Message>> {
    match tokio::time::timeout(timeout, read_frame_inner(r)).await {
        Ok(res) => res,
        Err(_) => Err(WireError::Timeout {
            op: "read frame",
            ms: timeout.as_millis() as u64,
        }),
    }
}

/// The most raw bytes that may follow a frame ([`Message::Mirror`]'s).
pub const MAX_PAYLOAD: u64 = 16 << 20;

/// Reads the `len` raw bytes that follow a frame, within `timeout`. Like [`read_frame`], not
/// cancel-safe: after an `Err` the connection must be dropped.
pub async fn read_payload<R: AsyncRead + Unpin>(
    r: &mut R,
    len: u64,
    timeout: Duration,
) -> WireResult<Vec<u8>> {
    if len > MAX_PAYLOAD {
        return Err(WireError::FrameTooLarge {
            len,
            max: MAX_PAYLOAD as u32,
        });
    }
    let mut bytes = vec![0u8; len as usize];
    let got = match tokio::time::timeout(timeout, read_full(r, &mut bytes)).await {
        Ok(got) => got?,
        Err(_) => {
            return Err(WireError::Timeout {
                op: "read payload",
                ms: timeout.as_millis() as u64,
            })
        }
    };
    if got < bytes.len() {
        return Err(WireError::Truncated {
            part: "payload",
            expected: bytes.len(),
            got,
        });
    }
    Ok(bytes)
}

/// Writes raw frame bytes and flushes, within `timeout`.
pub async fn write_raw<W: AsyncWrite + Unpin>(
    w: &mut W,
    bytes: &[u8],
    timeout: Duration,
) -> WireResult<()> {
    let io = async {
        w.write_all(bytes).await?;
        w.flush().await
    };
    match tokio::time::timeout(timeout, io).await {
        Ok(res) => res.map_err(|source| WireError::Io {
            op: "write frame",
            source,
        }),
        Err(_) => Err(WireError::Timeout {
            op: "write frame",
            ms: timeout.as_millis() as u64,
        }),
    }
}

/// Writes one message as a frame, within `timeout`.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    msg: &Message,
    timeout: Duration,
) -> WireResult<()> {
    let frame = encode_frame(msg)?;
    write_raw(w, &frame, timeout).await
}

/// Writes a frame and the raw bytes that follow it (`payload`, for [`read_payload`]) as one
/// write, within `timeout`.
pub async fn write_frame_with<W: AsyncWrite + Unpin>(
    w: &mut W,
    msg: &Message,
    payload: &[u8],
    timeout: Duration,
) -> WireResult<()> {
    if payload.is_empty() {
        return write_frame(w, msg, timeout).await;
    }
    let mut frame = encode_frame(msg)?;
    frame.extend_from_slice(payload);
    write_raw(w, &frame, timeout).await
}

#[cfg(test)]
#[path = "protocol_tests.rs"]
mod tests;
