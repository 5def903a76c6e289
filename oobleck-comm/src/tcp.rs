//! TCP backend: one connection per pair of ranks, framed messages (see [`crate::frame`] for
//! the layout), one reader thread per connection.
//!
//! ```text
//!   rendezvous list (rank -> SocketAddr, generation), given by the caller's control plane
//!   rank i listens; connects to every rank j < i, accepts every rank j > i
//!   handshake (tcp/handshake.rs): connector sends Hello{from,to,world}, acceptor answers with
//!              its Hello; with a key, the acceptor first sends a Challenge and both Hellos
//!              carry a nonce and a MAC. A peer of another generation, a stranger without the
//!              key or a silent one is logged and dropped; the group goes on forming
//!
//!   op thread ──write_frame (from the caller's buffer, write timeout = op deadline)──▶ socket
//!   socket ──reader thread: read_frame, validate──▶ Mailbox ──take(key, deadline)──▶ op thread
//!          (a p2p payload goes straight into the receiver's posted buffer when it already
//!          waits: tcp/recv.rs)
//! ```
//!
//! Ranks on one host (same boot id, machine id and tmpfs; `tcp/local.rs`) agree right after
//! the handshake on a shared-memory segment per pair and from then on send every message
//! through its rings (`crate::shm`), and all-reduce groups that lie wholly on this host through
//! shared scratch buffers. The TCP connection stays open as the failure detector.
//! `TcpConfig::shared_memory = false` or `OOBLECK_COMM_SHM=0` keeps everything on TCP.
//!
//! A reader that sees EOF, a reset, a mid-frame close or a bad frame marks its peer failed,
//! which wakes every operation waiting on that peer with `PeerLost` (or `StaleGeneration` /
//! `Frame`). A stalled peer (SIGSTOP) stops reading, our writes block until the op deadline
//! and fail with `Timeout`; operations waiting for its data time out. `abort` shuts down
//! every socket, which unblocks blocked writes and reader threads at once.

mod handshake;
mod local;
mod recv;

use std::io::ErrorKind;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use handshake::{accept_all, connect_one};

use crate::comm::Rank;
use crate::engine::{delegate_communicator, Ctx, Engine, Transport, Tuning};
use crate::error::{CommError, FrameError, Op, Result};
use crate::frame::{self, Header, Kind};
use crate::key::SecretKey;
use crate::mailbox::{Key, Mailbox};
use crate::refusals::RefusalSink;
use crate::shm::{Link, Pool, Scratch, SharedBytes, Wire};
use crate::tensor::TensorBuf;
use local::PairLink;

/// Everything a rank needs to join one generation of a TCP group.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    pub rank: Rank,
    /// Generation of the cluster plan; peers of any other generation are refused.
    pub generation: u64,
    /// Address of every rank, indexed by rank (including this one).
    pub peers: Vec<SocketAddr>,
    /// Bound on the whole connection setup.
    pub connect_timeout: Duration,
    /// Largest accepted frame payload, in bytes; must be the same on every rank.
    pub max_frame_bytes: u32,
    pub tuning: Tuning,
    /// The generation's secret, from the master over the control plane. With a key the
    /// handshake proves it both ways and refuses any process that cannot; `None` (the
    /// default: in-process tests and benches) accepts any peer that names the generation.
    pub key: Option<SecretKey>,
    /// Use shared memory with ranks on this host (default on: it is several times faster than
    /// loopback TCP). `false`, or `OOBLECK_COMM_SHM=0` in the environment, keeps every pair on
    /// TCP; both ends of a pair must agree, so a rank with it off makes its pairs TCP.
    pub shared_memory: bool,
    /// Test hooks that make shared-memory setup steps fail as a full `/dev/shm` would.
    #[doc(hidden)]
    pub shm_faults: ShmFaults,
    /// Set by the caller (from another thread) to give up forming the group: `connect` then
    /// returns `Aborted` within a few milliseconds instead of waiting for its deadline, as
    /// when the control plane learns that a peer died while the group formed.
    pub cancel: Option<Arc<AtomicBool>>,
    /// Also told every refusal line the listener logs (a stranger that could not prove
    /// itself, a handshake cut for a newer one), so the job can record them.
    pub on_refused: Option<RefusalSink>,
}

/// Shared-memory setup steps to fail on purpose (tests of the TCP fallback).
#[doc(hidden)]
#[derive(Debug, Clone, Default)]
pub struct ShmFaults {
    /// Creating the pair segment with these higher ranks fails (the pair stays on TCP).
    pub pair_with: Vec<Rank>,
    /// Mapping the all-reduce scratch of another member fails.
    pub map_scratch: bool,
    /// Mapping another member's shared tensor (`alloc`) fails.
    pub map_tensor: bool,
}

impl TcpConfig {
    pub fn new(rank: Rank, generation: u64, peers: Vec<SocketAddr>) -> Self {
        TcpConfig {
            rank,
            generation,
            peers,
            connect_timeout: Duration::from_secs(30),
            max_frame_bytes: frame::DEFAULT_MAX_FRAME,
            tuning: Tuning::default(),
            key: None,
            shared_memory: true,
            shm_faults: ShmFaults::default(),
            cancel: None,
            on_refused: None,
        }
    }

    /// Whether the caller gave up forming the group (see [`TcpConfig::cancel`]).
    fn cancelled(&self) -> bool {
        self.cancel
            .as_ref()
            .is_some_and(|c| c.load(Ordering::Relaxed))
    }

    fn aborted(&self) -> CommError {
        CommError::Aborted {
            rank: self.rank,
            generation: self.generation,
        }
    }

    /// The same config, authenticating every connection with `key`.
    pub fn with_key(mut self, key: SecretKey) -> Self {
        self.key = Some(key);
        self
    }
}

/// A rank's endpoint of a TCP group. Dropping it aborts it (peers see `PeerLost`).
pub struct TcpCommunicator {
    engine: Engine<TcpTransport>,
    readers: Vec<JoinHandle<()>>,
}

delegate_communicator!(TcpCommunicator, engine);

struct Conn {
    writer: Mutex<TcpStream>,
    /// A handle for `shutdown` that never waits for the writer lock.
    control: TcpStream,
}

struct TcpTransport {
    rank: Rank,
    generation: u64,
    conns: Vec<Option<Conn>>,
    /// Shared-memory links, for peers on this host that agreed to one.
    links: Vec<Option<PairLink>>,
    /// Which pairs of ranks agreed on shared memory, as every member of a pair reported it.
    pairs: local::PairMap,
    scratch: Scratch,
    /// Shared tensors (`alloc`) not in use; only where some peer shares memory with us.
    pool: Option<Arc<Pool>>,
    mailbox: Arc<Mailbox>,
}

impl TcpCommunicator {
    /// Connects to every peer of `cfg.peers`. `listener` is this rank's bound listener (so a
    /// caller can bind port 0 and publish the real port); `None` binds `cfg.peers[cfg.rank]`.
    pub fn connect(cfg: TcpConfig, listener: Option<TcpListener>) -> Result<Self> {
        let world = cfg.peers.len();
        let (rank, generation) = (cfg.rank, cfg.generation);
        if rank >= world {
            return Err(CommError::Invalid(format!(
                "rank {rank} outside a rendezvous list of {world}"
            )));
        }
        if u32::try_from(world).is_err() {
            return Err(CommError::Invalid(format!("world of {world} ranks")));
        }
        if cfg.max_frame_bytes == 0 {
            return Err(CommError::Invalid(
                "max_frame_bytes must be positive".into(),
            ));
        }
        let deadline = Instant::now() + cfg.connect_timeout;
        let streams = establish(&cfg, listener, deadline)?;
        let negotiated = local::negotiate(&cfg, &streams, deadline)?;
        let cap = cfg.max_frame_bytes;
        // No message may exceed the receivers' frame cap.
        let cap_bytes = cap as usize;
        let tuning = Tuning {
            max_message_bytes: cfg.tuning.max_message_bytes.min(cap_bytes),
            chunk_bytes: cfg.tuning.chunk_bytes.min(cap_bytes),
            direct_max_bytes: cfg.tuning.direct_max_bytes.min(cap_bytes),
        };
        let mailbox = Arc::new(Mailbox::new(rank, world, generation));
        let mut conns = Vec::with_capacity(world);
        let mut readers = Vec::new();
        for (peer, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                conns.push(None);
                continue;
            };
            let io =
                |e: std::io::Error| CommError::io(format!("set up connection to rank {peer}"), &e);
            s.set_nodelay(true).map_err(io)?;
            s.set_read_timeout(None).map_err(io)?;
            let reader = s.try_clone().map_err(io)?;
            let control = s.try_clone().map_err(io)?;
            let link = negotiated.links[peer].as_ref().map(|l| l.link.clone());
            if let Some(link) = &link {
                let (link, mb) = (link.clone(), mailbox.clone());
                readers.push(spawn(format!("comm-shm-{rank}<-{peer}"), move || {
                    crate::shm::read_loop(&link, peer, generation, cap, &mb)
                })?);
            }
            let mb = mailbox.clone();
            readers.push(spawn(format!("comm-read-{rank}<-{peer}"), move || {
                read_loop(reader, peer, generation, cap, &mb, link.as_deref())
            })?);
            conns.push(Some(Conn {
                writer: Mutex::new(s),
                control,
            }));
        }
        debug!(rank, generation, world, "tcp communicator connected");
        let any_link = negotiated.links.iter().any(Option::is_some);
        let transport = TcpTransport {
            rank,
            generation,
            conns,
            links: negotiated.links,
            pairs: negotiated.pairs,
            scratch: Scratch::new(rank, generation, cfg.shm_faults),
            pool: any_link.then(|| Pool::new(rank, generation)),
            mailbox: mailbox.clone(),
        };
        Ok(TcpCommunicator {
            engine: Engine::new(rank, world, generation, transport, mailbox, tuning),
            readers,
        })
    }

    /// The peers this rank talks to through shared memory (on this host, agreed at connect).
    pub fn shared_memory_peers(&self) -> Vec<Rank> {
        let links = &self.engine.transport.links;
        (0..links.len()).filter(|&r| links[r].is_some()).collect()
    }

    /// How many all-reduces so far ran through shared memory, through the scratch buffers or
    /// in place (the others took the ring or the direct exchange).
    pub fn shared_memory_all_reduces(&self) -> u64 {
        self.engine.transport.scratch.completed()
    }

    /// How many of those ran in place on the members' shared tensors (`alloc`).
    pub fn in_place_all_reduces(&self) -> u64 {
        self.engine.transport.scratch.completed_in_place()
    }
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name)
        .spawn(f)
        .map_err(|e| CommError::io("spawn reader thread", &e))
}

/// Dials every lower rank and accepts every higher one (a thread); returns one handshaken
/// stream per peer, indexed by rank.
fn establish(
    cfg: &TcpConfig,
    listener: Option<TcpListener>,
    deadline: Instant,
) -> Result<Vec<Option<TcpStream>>> {
    let (rank, world) = (cfg.rank, cfg.peers.len());
    let listener = match listener {
        Some(l) => l,
        None => TcpListener::bind(cfg.peers[rank])
            .map_err(|e| CommError::io(format!("bind {}", cfg.peers[rank]), &e))?,
    };
    let expect_accepts = world - rank - 1;
    let stop = Arc::new(AtomicBool::new(false));
    let acceptor = {
        let (cfg, stop) = (cfg.clone(), stop.clone());
        std::thread::Builder::new()
            .name(format!("comm-accept-{rank}"))
            .spawn(move || accept_all(&listener, &cfg, expect_accepts, deadline, &stop))
            .map_err(|e| CommError::io("spawn acceptor thread", &e))?
    };
    let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut first_err = None;
    for (j, slot) in streams.iter_mut().enumerate().take(rank) {
        match connect_one(cfg, j, deadline) {
            Ok(s) => *slot = Some(s),
            Err(e) => {
                first_err = Some(e);
                break;
            }
        }
    }
    // A rank that failed to reach a peer (wrong key, stale generation) will not form this
    // group: stop accepting now, so its error surfaces at once rather than at the deadline.
    if first_err.is_some() {
        stop.store(true, Ordering::Relaxed);
    }
    // The acceptor stops at its deadline (or at once when told), so this join is bounded.
    let accepted = acceptor
        .join()
        .unwrap_or_else(|_| Err(CommError::Invalid("acceptor thread panicked".into())));
    if let Some(e) = first_err {
        return Err(e);
    }
    for (j, s) in accepted? {
        streams[j] = Some(s);
    }
    Ok(streams)
}

impl Drop for TcpCommunicator {
    fn drop(&mut self) {
        use crate::comm::Communicator;
        self.engine.abort();
        // Readers exit once their socket is shut down.
        for h in self.readers.drain(..) {
            let _ = h.join();
        }
    }
}

/// Reads `peer`'s frames until its connection ends. With a shared-memory `link`, the end is
/// handed to the link's reader, which delivers what is left in the ring before failing the peer.
fn read_loop(
    mut s: TcpStream,
    peer: Rank,
    generation: u64,
    cap: u32,
    mailbox: &Mailbox,
    link: Option<&Link>,
) {
    let lost = |reason: String| CommError::PeerLost {
        rank: peer,
        generation,
        reason,
    };
    let err = loop {
        let h = match frame::read_header(&mut s, generation, cap) {
            Ok(Ok(Some(h))) => h,
            Ok(Ok(None)) => break lost("connection closed".into()),
            Ok(Err(FrameError::StaleGeneration { found, expected })) => {
                break CommError::StaleGeneration {
                    peer,
                    ours: expected,
                    theirs: found,
                }
            }
            Ok(Err(e)) => {
                break CommError::Frame {
                    peer: Some(peer),
                    source: e,
                }
            }
            Err(e) => break lost(format!("read: {e}")),
        };
        if h.kind != Kind::Data {
            break CommError::Frame {
                peer: Some(peer),
                source: FrameError::Malformed(format!("unexpected {:?} frame", h.kind)),
            };
        }
        let key = Key {
            peer,
            channel: h.channel,
            seq: h.seq,
            part: h.part,
        };
        match recv::read_payload(&mut s, key, h.len as usize, mailbox) {
            Ok(Ok(Some(payload))) => mailbox.deliver(key, None, payload),
            Ok(Ok(None)) => {}
            Ok(Err(e)) => {
                break CommError::Frame {
                    peer: Some(peer),
                    source: e,
                }
            }
            Err(e) => break lost(format!("read: {e}")),
        }
    };
    let clean_close =
        matches!(&err, CommError::PeerLost { reason, .. } if reason == "connection closed");
    if clean_close {
        // Peers close at a frame boundary when they finish (or die between frames): any later
        // operation with that peer reports it, so this is no news at the end of a job.
        debug!(rank = ?peer, generation, "peer closed its connection");
    } else if !mailbox.is_aborted() {
        warn!(rank = ?peer, generation, error = %err, "peer connection failed");
    }
    match link {
        Some(link) => link.close(err),
        None => mailbox.fail_peer(peer, err),
    }
    let _ = s.shutdown(Shutdown::Both);
}

impl Transport for TcpTransport {
    fn send(
        &self,
        peer: Rank,
        (channel, seq, part): (u64, u64, u32),
        parts: &[&[u8]],
        deadline: Instant,
        op: Op,
        timeout: Duration,
    ) -> Result<()> {
        if self.mailbox.is_aborted() {
            return Err(self.mailbox.aborted_error());
        }
        if let Some(e) = self.mailbox.peer_error(peer) {
            return Err(e);
        }
        let timed_out = || CommError::Timeout {
            op,
            after: timeout,
            rank: self.rank,
            generation: self.generation,
            waiting_on: Some(peer),
        };
        if let Some(l) = &self.links[peer] {
            let check = || {
                if self.mailbox.is_aborted() {
                    Some(self.mailbox.aborted_error())
                } else {
                    self.mailbox.peer_error(peer)
                }
            };
            return l
                .writer
                .write((channel, seq, part), parts, deadline, check, timed_out);
        }
        let conn = self.conns[peer]
            .as_ref()
            .expect("every other rank has a connection: connect() fills them");
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let header = Header {
            kind: Kind::Data,
            generation: self.generation,
            channel,
            seq,
            part,
            len: u32::try_from(len)
                .map_err(|_| CommError::Invalid(format!("message of {len} bytes")))?,
        };
        let mut w = conn.writer.lock().unwrap_or_else(|p| p.into_inner());
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out());
        }
        let res = w
            .set_write_timeout(Some(left))
            .and_then(|_| frame::write_frame(&mut *w, &header, parts));
        match res {
            Ok(()) => Ok(()),
            Err(_) if self.mailbox.is_aborted() => Err(self.mailbox.aborted_error()),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                Err(timed_out())
            }
            Err(e) => Err(self
                .mailbox
                .peer_error(peer)
                .unwrap_or(CommError::PeerLost {
                    rank: peer,
                    generation: self.generation,
                    reason: format!("write: {e}"),
                })),
        }
    }

    fn shutdown(&self) {
        if let Some(p) = &self.pool {
            p.close();
        }
        for l in self.links.iter().flatten() {
            l.link.stop();
        }
        for c in self.conns.iter().flatten() {
            let _ = c.control.shutdown(Shutdown::Both);
        }
    }

    fn alloc_shared(&self, len: usize) -> Option<SharedBytes> {
        self.pool.as_ref()?.alloc(len)
    }

    fn all_reduce(&self, cx: &Ctx, g: &[Rank], tensor: &mut TensorBuf) -> Result<bool> {
        // Every member of a group on this host knows which of its pairs have shared memory
        // (their reports were exchanged at setup), so all of them take this branch or none.
        if !self.pairs.all_linked(g) {
            return Ok(false);
        }
        let (channel, seq) = (cx.channel, cx.seq);
        let send = |p: Rank, part: u32, parts: &[&[u8]]| {
            self.send(
                p,
                (channel, seq, part),
                parts,
                cx.deadline,
                cx.op,
                cx.timeout,
            )
        };
        let recv = |p: Rank, part: u32| {
            let key = Key {
                peer: p,
                channel,
                seq,
                part,
            };
            self.mailbox.take(key, cx.due())
        };
        let check = |p: Rank| {
            if self.mailbox.is_aborted() {
                return Err(self.mailbox.aborted_error());
            }
            if let Some(e) = self.mailbox.peer_error(p) {
                return Err(e);
            }
            if Instant::now() >= cx.deadline {
                return Err(CommError::Timeout {
                    op: cx.op,
                    after: cx.timeout,
                    rank: self.rank,
                    generation: self.generation,
                    waiting_on: Some(p),
                });
            }
            Ok(())
        };
        let wire = Wire {
            send: &send,
            recv: &recv,
            check: &check,
        };
        self.scratch.all_reduce(channel, g, tensor, &wire)
    }
}
