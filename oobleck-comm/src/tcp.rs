//! TCP backend: one connection per pair of ranks, framed messages (see [`crate::frame`] for
//! the layout), one reader thread per connection.
//!
//! ```text
//!   rendezvous list (rank -> SocketAddr, generation), given by the caller's control plane
//!   rank i listens; connects to every rank j < i, accepts every rank j > i
//!   handshake: connector sends Hello{from,to,world}, acceptor answers with its Hello;
//!              a Hello of another generation is answered and the connection closed
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

use std::io::ErrorKind;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::comm::Rank;
use crate::engine::{delegate_communicator, Engine, Transport, Tuning};
use crate::error::{CommError, FrameError, Op, Result};
use crate::frame::{self, Header, Kind, ReadOutcome};
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
        }
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
        let listener = match listener {
            Some(l) => l,
            None => TcpListener::bind(cfg.peers[rank])
                .map_err(|e| CommError::io(format!("bind {}", cfg.peers[rank]), &e))?,
        };
        let deadline = Instant::now() + cfg.connect_timeout;
        let expect_accepts = world - rank - 1;
        let acceptor = {
            let cfg = cfg.clone();
            std::thread::Builder::new()
                .name(format!("comm-accept-{rank}"))
                .spawn(move || accept_all(&listener, &cfg, expect_accepts, deadline))
                .map_err(|e| CommError::io("spawn acceptor thread", &e))?
        };
        let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        let mut first_err = None;
        for (j, slot) in streams.iter_mut().enumerate().take(rank) {
            match connect_one(&cfg, j, deadline) {
                Ok(s) => *slot = Some(s),
                Err(e) => {
                    first_err = Some(e);
                    break;
                }
            }
        }
        // The acceptor stops at its deadline, so this join is bounded.
        let accepted = acceptor
            .join()
            .unwrap_or_else(|_| Err(CommError::Invalid("acceptor thread panicked".into())));
        if let Some(e) = first_err {
            return Err(e);
        }
        for (j, s) in accepted? {
            streams[j] = Some(s);
        }

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

fn hello(cfg: &TcpConfig, to: Rank) -> ([u8; frame::HEADER_LEN], [u8; 12]) {
    let payload = frame::encode_hello(cfg.rank as u32, to as u32, cfg.peers.len() as u32);
    let h = Header {
        kind: Kind::Hello,
        generation: cfg.generation,
        channel: 0,
        seq: 0,
        part: 0,
        len: 12,
    };
    (h.encode(), payload)
}

fn send_hello(s: &mut TcpStream, cfg: &TcpConfig, to: Rank) -> std::io::Result<()> {
    use std::io::Write;
    let (h, p) = hello(cfg, to);
    let mut b = h.to_vec();
    b.extend_from_slice(&p);
    s.write_all(&b)
}

/// Reads a peer's Hello and checks it is addressed to us; returns the sender's rank.
fn read_hello(s: &mut TcpStream, cfg: &TcpConfig, peer_hint: Option<Rank>) -> Result<Rank> {
    let lost = |reason: String| CommError::PeerLost {
        rank: peer_hint.unwrap_or(usize::MAX),
        generation: cfg.generation,
        reason,
    };
    let out =
        frame::read_frame(s, cfg.generation, 64).map_err(|e| lost(format!("handshake: {e}")))?;
    let (h, p) = match out {
        ReadOutcome::Frame(h, p) => (h, p),
        ReadOutcome::Closed => return Err(lost("closed during handshake".into())),
        ReadOutcome::Bad(FrameError::StaleGeneration { found, expected }) => {
            return Err(CommError::StaleGeneration {
                peer: peer_hint.unwrap_or(usize::MAX),
                ours: expected,
                theirs: found,
            })
        }
        ReadOutcome::Bad(e) => {
            return Err(CommError::Frame {
                peer: peer_hint,
                source: e,
            })
        }
    };
    let bad = |m: String| CommError::Frame {
        peer: peer_hint,
        source: FrameError::Malformed(m),
    };
    if h.kind != Kind::Hello {
        return Err(bad("expected a Hello frame".into()));
    }
    let (from, to, world) = frame::decode_hello(&p).map_err(|e| CommError::Frame {
        peer: peer_hint,
        source: e,
    })?;
    if to as usize != cfg.rank || world as usize != cfg.peers.len() {
        return Err(bad(format!(
            "hello for rank {to} of world {world}, this is rank {} of {}",
            cfg.rank,
            cfg.peers.len()
        )));
    }
    Ok(from as usize)
}

fn connect_one(cfg: &TcpConfig, j: Rank, deadline: Instant) -> Result<TcpStream> {
    let addr = cfg.peers[j];
    let mut last = String::from("no attempt");
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(CommError::Timeout {
                op: Op::Connect,
                after: cfg.connect_timeout,
                rank: cfg.rank,
                generation: cfg.generation,
                waiting_on: Some(j),
            })
            .inspect_err(|_| warn!(rank = cfg.rank, peer = j, %addr, last, "connect timed out"));
        }
        match TcpStream::connect_timeout(&addr, (deadline - now).min(Duration::from_secs(2))) {
            Ok(mut s) => {
                let io = |e: std::io::Error| CommError::PeerLost {
                    rank: j,
                    generation: cfg.generation,
                    reason: format!("handshake: {e}"),
                };
                s.set_nodelay(true).map_err(io)?;
                s.set_read_timeout(Some(
                    deadline
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(1)),
                ))
                .map_err(io)?;
                send_hello(&mut s, cfg, j).map_err(io)?;
                let from = read_hello(&mut s, cfg, Some(j))?;
                if from != j {
                    return Err(CommError::Frame {
                        peer: Some(j),
                        source: FrameError::Malformed(format!(
                            "{addr} answered as rank {from}, expected rank {j}"
                        )),
                    });
                }
                return Ok(s);
            }
            Err(e) => {
                // The peer may not listen yet: retry until the deadline.
                last = e.to_string();
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

fn accept_all(
    listener: &TcpListener,
    cfg: &TcpConfig,
    expect: usize,
    deadline: Instant,
) -> Result<Vec<(Rank, TcpStream)>> {
    let mut got: Vec<(Rank, TcpStream)> = Vec::new();
    listener
        .set_nonblocking(true)
        .map_err(|e| CommError::io("listener nonblocking", &e))?;
    while got.len() < expect {
        if Instant::now() >= deadline {
            let missing: Vec<Rank> = (cfg.rank + 1..cfg.peers.len())
                .filter(|r| got.iter().all(|(g, _)| g != r))
                .collect();
            return Err(CommError::Timeout {
                op: Op::Connect,
                after: cfg.connect_timeout,
                rank: cfg.rank,
                generation: cfg.generation,
                waiting_on: missing.first().copied(),
            });
        }
        let (mut s, addr) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => return Err(CommError::io("accept", &e)),
        };
        let setup = s.set_nonblocking(false).and_then(|_| {
            s.set_read_timeout(Some(
                Duration::from_secs(5).min(
                    deadline
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(1)),
                ),
            ))
        });
        if let Err(e) = setup {
            warn!(rank = cfg.rank, %addr, error = %e, "dropping incoming connection");
            continue;
        }
        // A bad or stale peer costs it its connection, never our process or the setup.
        match read_hello(&mut s, cfg, None) {
            Ok(from)
                if from > cfg.rank
                    && from < cfg.peers.len()
                    && got.iter().all(|(r, _)| *r != from) =>
            {
                if let Err(e) = send_hello(&mut s, cfg, from) {
                    warn!(rank = cfg.rank, from, error = %e, "handshake reply failed");
                    continue;
                }
                got.push((from, s));
            }
            Ok(from) => {
                warn!(rank = cfg.rank, from, %addr, "refusing unexpected or duplicate rank");
            }
            Err(e) => {
                if let CommError::StaleGeneration { .. } = e {
                    // Tell the stale peer our generation so it reports a clear error.
                    let _ = send_hello(&mut s, cfg, usize::MAX >> 1);
                }
                warn!(rank = cfg.rank, %addr, error = %e, "refusing connection");
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }
    Ok(got)
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
