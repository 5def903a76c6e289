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
//! ```
//!
//! A reader that sees EOF, a reset, a mid-frame close or a bad frame marks its peer failed,
//! which wakes every operation waiting on that peer with `PeerLost` (or `StaleGeneration` /
//! `Frame`). A stalled peer (SIGSTOP) stops reading, our writes block until the op deadline
//! and fail with `Timeout`; operations waiting for its data time out. `abort` shuts down
//! every socket, which unblocks blocked writes and reader threads at once.

mod handshake;

use std::io::ErrorKind;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use handshake::{accept_all, connect_one};

use crate::comm::Rank;
use crate::engine::{delegate_communicator, Engine, Transport, Tuning};
use crate::error::{CommError, FrameError, Op, Result};
use crate::frame::{self, Header, Kind, ReadOutcome};
use crate::key::SecretKey;
use crate::mailbox::{Key, Mailbox};

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
        let streams = establish(&cfg, listener)?;
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
            let mb = mailbox.clone();
            readers.push(
                std::thread::Builder::new()
                    .name(format!("comm-read-{rank}<-{peer}"))
                    .spawn(move || read_loop(reader, peer, generation, cap, &mb))
                    .map_err(|e| CommError::io("spawn reader thread", &e))?,
            );
            conns.push(Some(Conn {
                writer: Mutex::new(s),
                control,
            }));
        }
        debug!(rank, generation, world, "tcp communicator connected");
        let transport = TcpTransport {
            rank,
            generation,
            conns,
            mailbox: mailbox.clone(),
        };
        Ok(TcpCommunicator {
            engine: Engine::new(rank, world, generation, transport, mailbox, tuning),
            readers,
        })
    }
}

/// Dials every lower rank and accepts every higher one (a thread); returns one handshaken
/// stream per peer, indexed by rank.
fn establish(cfg: &TcpConfig, listener: Option<TcpListener>) -> Result<Vec<Option<TcpStream>>> {
    let (rank, world) = (cfg.rank, cfg.peers.len());
    let listener = match listener {
        Some(l) => l,
        None => TcpListener::bind(cfg.peers[rank])
            .map_err(|e| CommError::io(format!("bind {}", cfg.peers[rank]), &e))?,
    };
    let deadline = Instant::now() + cfg.connect_timeout;
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

fn read_loop(mut s: TcpStream, peer: Rank, generation: u64, cap: u32, mailbox: &Mailbox) {
    let lost = |reason: String| CommError::PeerLost {
        rank: peer,
        generation,
        reason,
    };
    let err = loop {
        match frame::read_frame(&mut s, generation, cap) {
            Ok(ReadOutcome::Frame(h, payload)) if h.kind == Kind::Data => {
                let key = Key {
                    peer,
                    channel: h.channel,
                    seq: h.seq,
                    part: h.part,
                };
                mailbox.deliver(key, None, payload);
            }
            Ok(ReadOutcome::Frame(h, _)) => {
                break CommError::Frame {
                    peer: Some(peer),
                    source: FrameError::Malformed(format!("unexpected {:?} frame", h.kind)),
                }
            }
            Ok(ReadOutcome::Closed) => break lost("connection closed".into()),
            Ok(ReadOutcome::Bad(FrameError::StaleGeneration { found, expected })) => {
                break CommError::StaleGeneration {
                    peer,
                    ours: expected,
                    theirs: found,
                }
            }
            Ok(ReadOutcome::Bad(e)) => {
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
    mailbox.fail_peer(peer, err);
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
        let timed_out = || CommError::Timeout {
            op,
            after: timeout,
            rank: self.rank,
            generation: self.generation,
            waiting_on: Some(peer),
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
        for c in self.conns.iter().flatten() {
            let _ = c.control.shutdown(Shutdown::Both);
        }
    }
}
