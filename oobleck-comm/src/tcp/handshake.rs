//! Connection setup of the TCP backend: which rank a connection comes from and, in a keyed
//! group, proof that both ends hold the generation's [`SecretKey`] (payloads and the MAC's
//! inputs are drawn in [`crate::frame`]).
//!
//! ```text
//!   unkeyed   connector ── Hello{from,to,world} ───────────────────▶ acceptor
//!             connector ◀─────────────────── Hello{from,to,world} ── acceptor
//!
//!   keyed     connector ◀────────────────────── Challenge{nonce_a} ── acceptor, on accept
//!             connector ── Hello{from,to,world,nonce_c,mac_c} ─────▶ acceptor checks mac_c
//!             connector ◀───── Hello{from,to,world,nonce_a,mac_a} ── acceptor
//!             connector checks mac_a: it reached a rank, not a squatter on the port
//! ```
//!
//! The acceptor proves nothing before the connector has, so a stranger cannot use it to MAC
//! values of its choosing; fresh nonces on both sides make a recorded Hello worthless on
//! another connection. A peer of another generation learns ours (from the Challenge, or from
//! the Hello an unkeyed acceptor answers it with) and fails with `StaleGeneration`.
//!
//! The acceptor handshakes every accepted connection on its own thread, bounded by
//! [`HANDSHAKE_TIMEOUT`] and the connect deadline, so a stranger that connects and says nothing
//! holds only its own thread. Strangers are logged and dropped; they never fail the group.

use std::io::{ErrorKind, Read};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tracing::warn;

use super::TcpConfig;
use crate::comm::Rank;
use crate::error::{CommError, FrameError, Op, Result};
use crate::frame::{self, Header, KeyedHello, Kind, ReadOutcome};
use crate::key::{self, SecretKey, KEY_BYTES};

/// How long an accepted connection may take to prove who it is.
pub(super) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Handshakes in flight at once; more connections than this are dropped unread (a flood of
/// strangers costs them their connections, not us our threads).
const MAX_PENDING: usize = 64;
/// Largest handshake payload a peer may send (a keyed Hello is 76 bytes).
const HANDSHAKE_CAP: u32 = 128;
const ACCEPT_POLL: Duration = Duration::from_millis(5);
const LABEL: &[u8] = b"oobleck-data-hello";

type Nonce = [u8; KEY_BYTES];

/// The MAC of our keyed Hello to `to` (see [`crate::frame`] for what it covers).
fn hello_mac(cfg: &TcpConfig, key: &SecretKey, to: Rank, theirs: &Nonce, ours: &Nonce) -> Nonce {
    key.mac(&[&mac_input(cfg, cfg.rank, to, theirs, ours)])
}

/// What a Hello's MAC covers: purpose, generation, sender, receiver, world, the receiver's
/// nonce and the sender's.
fn mac_input(cfg: &TcpConfig, from: Rank, to: Rank, theirs: &Nonce, ours: &Nonce) -> Vec<u8> {
    let ranks = frame::encode_hello(from as u32, to as u32, cfg.peers.len() as u32);
    [LABEL, &cfg.generation.to_le_bytes(), &ranks, theirs, ours].concat()
}

/// A reader that never blocks past `deadline`, however slowly the peer drips bytes.
struct Bounded<'a> {
    s: &'a TcpStream,
    deadline: Instant,
}

impl Read for Bounded<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ErrorKind::TimedOut.into());
        }
        self.s.set_read_timeout(Some(left))?;
        let mut s = self.s;
        s.read(buf)
    }
}

fn read_handshake(
    s: &TcpStream,
    cfg: &TcpConfig,
    deadline: Instant,
) -> std::io::Result<ReadOutcome> {
    frame::read_frame(&mut Bounded { s, deadline }, cfg.generation, HANDSHAKE_CAP)
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

fn is_reset(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe
    )
}

fn send(s: &TcpStream, generation: u64, kind: Kind, payload: &[u8]) -> std::io::Result<()> {
    let h = Header {
        kind,
        generation,
        channel: 0,
        seq: 0,
        part: 0,
        len: payload.len() as u32,
    };
    let mut s = s;
    frame::write_frame(&mut s, &h, &[payload])
}

fn send_plain_hello(s: &TcpStream, cfg: &TcpConfig, to: u32) -> std::io::Result<()> {
    let p = frame::encode_hello(cfg.rank as u32, to, cfg.peers.len() as u32);
    send(s, cfg.generation, Kind::Hello, &p)
}

// ---------------------------------------------------------------------------------------------
// Connecting side.

/// What a connector's handshake read produced, before the caller decides what it means.
enum Reply {
    Frame(Header, Vec<u8>),
    /// The peer closed (or reset) the connection.
    Closed,
    /// No answer before the connect deadline.
    Silent,
    Failed(CommError),
}

fn read_reply(s: &TcpStream, cfg: &TcpConfig, j: Rank, deadline: Instant) -> Reply {
    match read_handshake(s, cfg, deadline) {
        Ok(ReadOutcome::Frame(h, p)) => Reply::Frame(h, p),
        Ok(ReadOutcome::Closed) => Reply::Closed,
        Ok(ReadOutcome::Bad(FrameError::StaleGeneration { found, expected })) => {
            Reply::Failed(CommError::StaleGeneration {
                peer: j,
                ours: expected,
                theirs: found,
            })
        }
        Ok(ReadOutcome::Bad(source)) => Reply::Failed(CommError::Frame {
            peer: Some(j),
            source,
        }),
        Err(e) if is_reset(&e) => Reply::Closed,
        Err(e) if is_timeout(&e) => Reply::Silent,
        Err(e) => Reply::Failed(lost(cfg, j, format!("handshake: {e}"))),
    }
}

fn lost(cfg: &TcpConfig, j: Rank, reason: String) -> CommError {
    CommError::PeerLost {
        rank: j,
        generation: cfg.generation,
        reason,
    }
}

fn auth_failed(cfg: &TcpConfig, j: Rank, reason: impl Into<String>) -> CommError {
    CommError::AuthFailed {
        rank: cfg.rank,
        peer: j,
        addr: cfg.peers[j],
        generation: cfg.generation,
        reason: reason.into(),
    }
}

fn malformed(j: Rank, m: String) -> CommError {
    CommError::Frame {
        peer: Some(j),
        source: FrameError::Malformed(m),
    }
}

/// Checks that a Hello from the rank we dialled is addressed to us.
fn check_reply_addressing(
    cfg: &TcpConfig,
    j: Rank,
    (from, to, world): (u32, u32, u32),
) -> Result<()> {
    if to as usize != cfg.rank || world as usize != cfg.peers.len() {
        return Err(malformed(
            j,
            format!(
                "hello for rank {to} of world {world}, this is rank {} of {}",
                cfg.rank,
                cfg.peers.len()
            ),
        ));
    }
    if from as usize != j {
        return Err(malformed(
            j,
            format!(
                "{} answered as rank {from}, expected rank {j}",
                cfg.peers[j]
            ),
        ));
    }
    Ok(())
}

/// Dials rank `j` until the deadline, then proves who we are and checks who answered.
pub(super) fn connect_one(cfg: &TcpConfig, j: Rank, deadline: Instant) -> Result<TcpStream> {
    let addr = cfg.peers[j];
    let mut last = String::from("no attempt");
    loop {
        let now = Instant::now();
        if now >= deadline {
            warn!(rank = cfg.rank, peer = j, %addr, last, "connect timed out");
            return Err(connect_timeout(cfg, j));
        }
        match TcpStream::connect_timeout(&addr, (deadline - now).min(Duration::from_secs(2))) {
            Ok(s) => {
                s.set_nodelay(true)
                    .map_err(|e| lost(cfg, j, format!("handshake: {e}")))?;
                match &cfg.key {
                    None => connector_unkeyed(&s, cfg, j, deadline)?,
                    Some(key) => connector_keyed(&s, cfg, key, j, deadline)?,
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

fn connect_timeout(cfg: &TcpConfig, j: Rank) -> CommError {
    CommError::Timeout {
        op: Op::Connect,
        after: cfg.connect_timeout,
        rank: cfg.rank,
        generation: cfg.generation,
        waiting_on: Some(j),
    }
}

fn connector_unkeyed(s: &TcpStream, cfg: &TcpConfig, j: Rank, deadline: Instant) -> Result<()> {
    send_plain_hello(s, cfg, j as u32).map_err(|e| lost(cfg, j, format!("handshake: {e}")))?;
    let (h, p) = match read_reply(s, cfg, j, deadline) {
        Reply::Frame(h, p) => (h, p),
        Reply::Closed => return Err(lost(cfg, j, "closed during handshake".into())),
        Reply::Silent => {
            return Err(lost(
                cfg,
                j,
                "handshake: no answer before the deadline".into(),
            ))
        }
        Reply::Failed(e) => return Err(e),
    };
    match h.kind {
        Kind::Hello => {
            let hello = frame::decode_hello(&p).map_err(|source| CommError::Frame {
                peer: Some(j),
                source,
            })?;
            check_reply_addressing(cfg, j, hello)
        }
        Kind::Challenge => Err(auth_failed(
            cfg,
            j,
            "it asks for the generation's key, and this rank was given none",
        )),
        Kind::Data | Kind::Local => Err(malformed(j, "expected a Hello frame".into())),
    }
}

fn connector_keyed(
    s: &TcpStream,
    cfg: &TcpConfig,
    key: &SecretKey,
    j: Rank,
    deadline: Instant,
) -> Result<()> {
    let io = |e: std::io::Error| lost(cfg, j, format!("handshake: {e}"));
    let theirs = match read_reply(s, cfg, j, deadline) {
        Reply::Frame(h, p) if h.kind == Kind::Challenge => {
            frame::decode_challenge(&p).map_err(|source| CommError::Frame {
                peer: Some(j),
                source,
            })?
        }
        Reply::Frame(h, _) => {
            return Err(malformed(
                j,
                format!("expected a Challenge, got {:?}", h.kind),
            ))
        }
        Reply::Closed => {
            return Err(auth_failed(
                cfg,
                j,
                "it closed the connection without challenging us, so it was probably given no \
                 key while this rank was given one",
            ))
        }
        Reply::Silent => return Err(connect_timeout(cfg, j)),
        Reply::Failed(e) => return Err(e),
    };
    let ours = key::nonce();
    let hello = KeyedHello {
        from: cfg.rank as u32,
        to: j as u32,
        world: cfg.peers.len() as u32,
        nonce: ours,
        mac: hello_mac(cfg, key, j, &theirs, &ours),
    };
    send(s, cfg.generation, Kind::Hello, &hello.encode()).map_err(io)?;
    let p = match read_reply(s, cfg, j, deadline) {
        Reply::Frame(h, p) if h.kind == Kind::Hello => p,
        Reply::Frame(h, _) => {
            return Err(malformed(j, format!("expected a Hello, got {:?}", h.kind)))
        }
        Reply::Closed => {
            return Err(auth_failed(
                cfg,
                j,
                "it refused our proof of the key, so the two ranks were given different keys",
            ))
        }
        Reply::Silent => return Err(connect_timeout(cfg, j)),
        Reply::Failed(e) => return Err(e),
    };
    let answer = KeyedHello::decode(&p).map_err(|source| CommError::Frame {
        peer: Some(j),
        source,
    })?;
    check_reply_addressing(cfg, j, (answer.from, answer.to, answer.world))?;
    let input = mac_input(cfg, j, cfg.rank, &ours, &answer.nonce);
    if answer.nonce != theirs || !key.verify(&[&input], &answer.mac) {
        return Err(auth_failed(
            cfg,
            j,
            "its answer does not prove our key, so it was given a different key or is not a rank \
             of this group",
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Accepting side.

/// Why an incoming connection was refused (logged; the group goes on forming).
#[derive(Debug, thiserror::Error)]
enum Refusal {
    #[error("sent no Hello within the handshake timeout")]
    Silent,
    #[error("closed during the handshake")]
    Closed,
    #[error("handshake i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("it is at generation {found}, this group is generation {expected}")]
    StaleGeneration { found: u64, expected: u64 },
    #[error("not a valid frame: {0}")]
    Garbage(FrameError),
    #[error("expected a Hello, got a {0:?} frame")]
    NotAHello(Kind),
    #[error("its Hello carries no MAC, and this group is keyed")]
    NoMac,
    #[error(
        "its Hello, claiming rank {claimed}, carries a MAC that does not verify under our key"
    )]
    BadMac { claimed: u32 },
    #[error("hello from rank {from} to rank {to} of world {world}: not a peer this rank accepts")]
    Misaddressed { from: u32, to: u32, world: u32 },
}

/// A connection that proved it is rank `from`; the accept loop answers it or drops it.
struct Claim {
    from: Rank,
    stream: TcpStream,
    addr: SocketAddr,
    /// `(the connector's nonce, our Challenge's nonce)` in a keyed group.
    nonces: Option<(Nonce, Nonce)>,
}

/// Accepts until every rank above ours has connected and proved itself, the deadline, or
/// `stop` (this rank failed to reach a peer; its error is the one reported).
pub(super) fn accept_all(
    listener: &TcpListener,
    cfg: &TcpConfig,
    expect: usize,
    deadline: Instant,
    stop: &AtomicBool,
) -> Result<Vec<(Rank, TcpStream)>> {
    let mut got: Vec<(Rank, TcpStream)> = Vec::new();
    listener
        .set_nonblocking(true)
        .map_err(|e| CommError::io("listener nonblocking", &e))?;
    // Every handshake thread sends exactly one message; those still running when we return
    // find the channel closed and drop their connection.
    let (tx, rx) = mpsc::channel::<Option<Claim>>();
    let mut pending = 0usize;
    while got.len() < expect {
        if stop.load(Ordering::Relaxed) {
            return Err(CommError::Aborted {
                rank: cfg.rank,
                generation: cfg.generation,
            });
        }
        if Instant::now() >= deadline {
            let missing = (cfg.rank + 1..cfg.peers.len()).find(|r| got.iter().all(|(g, _)| g != r));
            return Err(CommError::Timeout {
                op: Op::Connect,
                after: cfg.connect_timeout,
                rank: cfg.rank,
                generation: cfg.generation,
                waiting_on: missing,
            });
        }
        match listener.accept() {
            Ok((s, addr)) if pending >= MAX_PENDING => {
                warn!(rank = cfg.rank, %addr, pending, "too many handshakes in flight, dropping connection");
                drop(s);
            }
            Ok((s, addr)) => pending += spawn_handshake(s, addr, cfg, deadline, &tx) as usize,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                // Doubles as the poll interval of the nonblocking listener.
                if let Ok(claim) = rx.recv_timeout(ACCEPT_POLL) {
                    pending -= 1;
                    admit(claim, cfg, deadline, &mut got);
                }
            }
            Err(e) => return Err(CommError::io("accept", &e)),
        }
        while let Ok(claim) = rx.try_recv() {
            pending -= 1;
            admit(claim, cfg, deadline, &mut got);
        }
    }
    Ok(got)
}

/// Starts the handshake of one accepted connection on its own thread; false if it could not.
fn spawn_handshake(
    s: TcpStream,
    addr: SocketAddr,
    cfg: &TcpConfig,
    deadline: Instant,
    tx: &mpsc::Sender<Option<Claim>>,
) -> bool {
    let (cfg, tx, rank) = (cfg.clone(), tx.clone(), cfg.rank);
    let until = (Instant::now() + HANDSHAKE_TIMEOUT).min(deadline);
    let spawned = std::thread::Builder::new()
        .name(format!("comm-handshake-{rank}"))
        .spawn(move || {
            let claim = match verify_connector(&s, &cfg, until) {
                Ok((from, nonces)) => Some(Claim {
                    from,
                    stream: s,
                    addr,
                    nonces,
                }),
                Err(why) => {
                    warn!(rank, generation = cfg.generation, %addr, why = %why, "refusing connection");
                    // A FIN before the close, so a stale peer reads our answer before any reset.
                    let _ = s.shutdown(Shutdown::Both);
                    None
                }
            };
            let _ = tx.send(claim);
        });
    if let Err(e) = &spawned {
        warn!(rank, %addr, error = %e, "cannot spawn a handshake thread, dropping connection");
    }
    spawned.is_ok()
}

/// Reads the connector's Hello (after our Challenge, in a keyed group) and checks it; returns
/// the connector's rank and, keyed, `(its nonce, ours)`.
fn verify_connector(
    s: &TcpStream,
    cfg: &TcpConfig,
    until: Instant,
) -> Result<(Rank, Option<(Nonce, Nonce)>), Refusal> {
    s.set_nonblocking(false)?;
    s.set_nodelay(true)?;
    let ours = match &cfg.key {
        Some(_) => {
            let n = key::nonce();
            send(s, cfg.generation, Kind::Challenge, &n)?;
            Some(n)
        }
        None => None,
    };
    let (h, p) = match read_handshake(s, cfg, until) {
        Ok(ReadOutcome::Frame(h, p)) => (h, p),
        Ok(ReadOutcome::Closed) => return Err(Refusal::Closed),
        Ok(ReadOutcome::Bad(FrameError::StaleGeneration { found, expected })) => {
            if cfg.key.is_none() {
                // Tell the stale peer our generation so it reports a clear error (a keyed
                // peer already read it from our Challenge).
                let _ = send_plain_hello(s, cfg, u32::MAX);
            }
            return Err(Refusal::StaleGeneration { found, expected });
        }
        Ok(ReadOutcome::Bad(e)) => return Err(Refusal::Garbage(e)),
        Err(e) if is_timeout(&e) => return Err(Refusal::Silent),
        Err(e) if is_reset(&e) => return Err(Refusal::Closed),
        Err(e) => return Err(Refusal::Io(e)),
    };
    if h.kind != Kind::Hello {
        return Err(Refusal::NotAHello(h.kind));
    }
    let (from, to, world, nonces) = match (&cfg.key, ours) {
        (Some(key), Some(ours)) => {
            if p.len() == frame::HELLO_LEN {
                return Err(Refusal::NoMac);
            }
            let kh = KeyedHello::decode(&p).map_err(Refusal::Garbage)?;
            let input = mac_input(cfg, kh.from as Rank, kh.to as Rank, &ours, &kh.nonce);
            if !key.verify(&[&input], &kh.mac) {
                return Err(Refusal::BadMac { claimed: kh.from });
            }
            (kh.from, kh.to, kh.world, Some((kh.nonce, ours)))
        }
        _ => {
            let (from, to, world) = frame::decode_hello(&p).map_err(Refusal::Garbage)?;
            (from, to, world, None)
        }
    };
    let expected = (from as usize) > cfg.rank && (from as usize) < cfg.peers.len();
    if !expected || to as usize != cfg.rank || world as usize != cfg.peers.len() {
        return Err(Refusal::Misaddressed { from, to, world });
    }
    Ok((from as Rank, nonces))
}

/// Answers a proven connector with our Hello, unless its rank is already connected.
fn admit(
    claim: Option<Claim>,
    cfg: &TcpConfig,
    deadline: Instant,
    got: &mut Vec<(Rank, TcpStream)>,
) {
    let Some(Claim {
        from,
        stream,
        addr,
        nonces,
    }) = claim
    else {
        return;
    };
    if got.iter().any(|(r, _)| *r == from) {
        warn!(rank = cfg.rank, from, %addr, "refusing a second connection from the same rank");
        let _ = stream.shutdown(Shutdown::Both);
        return;
    }
    let left = deadline
        .saturating_duration_since(Instant::now())
        .clamp(Duration::from_millis(1), HANDSHAKE_TIMEOUT);
    let sent = stream
        .set_write_timeout(Some(left))
        .and_then(|_| match (&cfg.key, nonces) {
            (Some(key), Some((theirs, ours))) => {
                let hello = KeyedHello {
                    from: cfg.rank as u32,
                    to: from as u32,
                    world: cfg.peers.len() as u32,
                    nonce: ours,
                    mac: hello_mac(cfg, key, from, &theirs, &ours),
                };
                send(&stream, cfg.generation, Kind::Hello, &hello.encode())
            }
            _ => send_plain_hello(&stream, cfg, from as u32),
        });
    match sent {
        Ok(()) => got.push((from, stream)),
        Err(e) => warn!(rank = cfg.rank, from, %addr, error = %e, "handshake reply failed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(rank: Rank, generation: u64, world: usize) -> TcpConfig {
        let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
        TcpConfig::new(rank, generation, vec![addr; world])
    }

    /// A MAC verifies only for the exact purpose, generation, ranks, world and nonces.
    #[test]
    fn a_hello_mac_binds_every_field() {
        let key = SecretKey::from_bytes([3; KEY_BYTES]);
        let (a, b) = ([1; KEY_BYTES], [2; KEY_BYTES]);
        let mac = hello_mac(&cfg(2, 7, 3), &key, 0, &a, &b);
        let ok = |c: &TcpConfig, from, to, theirs: &Nonce, ours: &Nonce| {
            key.verify(&[&mac_input(c, from, to, theirs, ours)], &mac)
        };
        assert!(ok(&cfg(0, 7, 3), 2, 0, &a, &b));
        assert!(!ok(&cfg(0, 8, 3), 2, 0, &a, &b), "generation");
        assert!(!ok(&cfg(0, 7, 4), 2, 0, &a, &b), "world");
        assert!(!ok(&cfg(0, 7, 3), 0, 2, &a, &b), "direction");
        assert!(!ok(&cfg(0, 7, 3), 1, 0, &a, &b), "sender");
        assert!(!ok(&cfg(0, 7, 3), 2, 0, &b, &a), "nonces");
        assert!(!SecretKey::from_bytes([4; KEY_BYTES])
            .verify(&[&mac_input(&cfg(0, 7, 3), 2, 0, &a, &b)], &mac));
        // The purpose label is part of it: the same fields without it do not verify.
        let input = mac_input(&cfg(0, 7, 3), 2, 0, &a, &b);
        assert!(!key.verify(&[&input[LABEL.len()..]], &mac));
    }
}
