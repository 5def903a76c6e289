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
//! holds only its own thread, and never for long. When [`MAX_PENDING`] handshakes are in
//! flight the oldest is cut to make room: a rank's handshake takes milliseconds, so a flood of
//! idle strangers keeps cutting itself while real peers get through (and a peer cut by
//! mistake dials again). Strangers are counted and logged, one line per address and reason
//! per interval ([`crate::refusals`]); they never fail the group.
//!
//! A connector whose peer closes before challenging it dials again until the deadline: the
//! acceptor may have cut it to make room, or the peer died. A peer that refuses connections
//! is gone (ranks listen before the rendezvous is sent); the caller's control plane learns of
//! the death and cancels the forming group through [`TcpConfig::cancel`].

use std::collections::VecDeque;
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
use crate::refusals::Refusals;

/// How long an accepted connection may take to prove who it is: a rank answers a Challenge in
/// a round trip, so this is generous for a real peer and short for a stranger that holds a slot.
pub(super) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// Handshakes in flight at once; at the limit the oldest is cut (a flood of strangers costs
/// them their connections, not us our threads, and never keeps a real peer out).
const MAX_PENDING: usize = 64;
/// How often the refusals of one address for one reason are said (with their count).
const REFUSALS_EVERY: Duration = Duration::from_secs(10);
/// How often a reading handshake looks at [`TcpConfig::cancel`].
const CANCEL_POLL: Duration = Duration::from_millis(20);
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

/// A reader that never blocks past `deadline`, however slowly the peer drips bytes, and
/// gives up (`Interrupted`) soon after the caller cancels the group.
struct Bounded<'a> {
    s: &'a TcpStream,
    deadline: Instant,
    cfg: &'a TcpConfig,
}

impl Read for Bounded<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            if self.cfg.cancelled() {
                return Err(ErrorKind::Interrupted.into());
            }
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ErrorKind::TimedOut.into());
            }
            let slice = match self.cfg.cancel {
                Some(_) => left.min(CANCEL_POLL),
                None => left,
            };
            self.s.set_read_timeout(Some(slice))?;
            let mut s = self.s;
            match s.read(buf) {
                Err(e) if is_timeout(&e) && slice < left => continue,
                r => return r,
            }
        }
    }
}

fn read_handshake(
    s: &TcpStream,
    cfg: &TcpConfig,
    deadline: Instant,
) -> std::io::Result<ReadOutcome> {
    frame::read_frame(
        &mut Bounded { s, deadline, cfg },
        cfg.generation,
        HANDSHAKE_CAP,
    )
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
        Err(_) if cfg.cancelled() => Reply::Failed(cfg.aborted()),
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

/// Why the last dial of a peer failed, for the error at the deadline.
enum Dial {
    None,
    Refused,
    ClosedEarly,
    Other(String),
}

/// Dials rank `j` until the deadline, then proves who we are and checks who answered.
pub(super) fn connect_one(cfg: &TcpConfig, j: Rank, deadline: Instant) -> Result<TcpStream> {
    let addr = cfg.peers[j];
    let mut last = Dial::None;
    loop {
        if cfg.cancelled() {
            return Err(cfg.aborted());
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(dial_failed(cfg, j, &last));
        }
        let s =
            match TcpStream::connect_timeout(&addr, (deadline - now).min(Duration::from_secs(2))) {
                Ok(s) => s,
                Err(e) => {
                    // The peer may not listen yet (outside a job: ranks bind before the rendezvous
                    // is sent): retry until the deadline.
                    last = match e.kind() {
                        ErrorKind::ConnectionRefused => Dial::Refused,
                        _ => Dial::Other(e.to_string()),
                    };
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
            };
        s.set_nodelay(true)
            .map_err(|e| lost(cfg, j, format!("handshake: {e}")))?;
        let shaken = match &cfg.key {
            None => connector_unkeyed(&s, cfg, j, deadline),
            Some(key) => connector_keyed(&s, cfg, key, j, deadline),
        };
        match shaken {
            Ok(()) => return Ok(s),
            Err(Shake::ClosedEarly) => {
                // Cut by a crowded acceptor, or the peer died with our connection in its
                // backlog: dial again, and if it is dead the next dial is refused.
                last = Dial::ClosedEarly;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(Shake::Failed(e)) => return Err(e),
        }
    }
}

/// The error of a peer never reached by the deadline, from how its last dial failed.
fn dial_failed(cfg: &TcpConfig, j: Rank, last: &Dial) -> CommError {
    let addr = cfg.peers[j];
    let gone = |how: &str| {
        lost(
            cfg,
            j,
            format!(
                "{how} until the deadline ({:?}): the rank is gone (its process exited or its \
                 node is down), not misconfigured; its agent reports the exit and the master \
                 forms the next generation without it",
                cfg.connect_timeout
            ),
        )
    };
    match last {
        Dial::Refused => gone(&format!("{addr} refused every connection")),
        Dial::ClosedEarly => gone(&format!(
            "{addr} closed every connection before its handshake began"
        )),
        Dial::None | Dial::Other(_) => {
            let why = match last {
                Dial::Other(e) => e.as_str(),
                _ => "no attempt",
            };
            warn!(rank = cfg.rank, peer = j, %addr, last = why, "connect timed out");
            connect_timeout(cfg, j)
        }
    }
}

/// How a connector's handshake on one connection failed.
enum Shake {
    /// The peer closed before its first frame: dial again.
    ClosedEarly,
    Failed(CommError),
}

impl From<CommError> for Shake {
    fn from(e: CommError) -> Shake {
        Shake::Failed(e)
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

fn connector_unkeyed(
    s: &TcpStream,
    cfg: &TcpConfig,
    j: Rank,
    deadline: Instant,
) -> std::result::Result<(), Shake> {
    if send_plain_hello(s, cfg, j as u32).is_err() {
        return Err(Shake::ClosedEarly);
    }
    let (h, p) = match read_reply(s, cfg, j, deadline) {
        Reply::Frame(h, p) => (h, p),
        Reply::Closed => return Err(Shake::ClosedEarly),
        Reply::Silent => {
            return Err(lost(cfg, j, "handshake: no answer before the deadline".into()).into())
        }
        Reply::Failed(e) => return Err(e.into()),
    };
    match h.kind {
        Kind::Hello => {
            let hello = frame::decode_hello(&p).map_err(|source| CommError::Frame {
                peer: Some(j),
                source,
            })?;
            Ok(check_reply_addressing(cfg, j, hello)?)
        }
        Kind::Challenge => Err(auth_failed(
            cfg,
            j,
            "it asks for the generation's key, and this rank was given none",
        )
        .into()),
        Kind::Data | Kind::Local => Err(malformed(j, "expected a Hello frame".into()).into()),
    }
}

fn connector_keyed(
    s: &TcpStream,
    cfg: &TcpConfig,
    key: &SecretKey,
    j: Rank,
    deadline: Instant,
) -> std::result::Result<(), Shake> {
    let io = |e: std::io::Error| lost(cfg, j, format!("handshake: {e}"));
    let theirs = match read_reply(s, cfg, j, deadline) {
        Reply::Frame(h, p) if h.kind == Kind::Challenge => {
            frame::decode_challenge(&p).map_err(|source| CommError::Frame {
                peer: Some(j),
                source,
            })?
        }
        Reply::Frame(h, _) => {
            return Err(malformed(j, format!("expected a Challenge, got {:?}", h.kind)).into())
        }
        // A keyed acceptor challenges at once; one that closes first cut us to make room or
        // died (an acceptor given no key would wait for our Hello and time out instead).
        Reply::Closed => return Err(Shake::ClosedEarly),
        Reply::Silent => return Err(connect_timeout(cfg, j).into()),
        Reply::Failed(e) => return Err(e.into()),
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
            return Err(malformed(j, format!("expected a Hello, got {:?}", h.kind)).into())
        }
        Reply::Closed => {
            return Err(auth_failed(
                cfg,
                j,
                "it refused our proof of the key, so the two ranks were given different keys",
            )
            .into())
        }
        Reply::Silent => return Err(connect_timeout(cfg, j).into()),
        Reply::Failed(e) => return Err(e.into()),
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
        )
        .into());
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Accepting side.

/// Why an incoming connection was refused (logged; the group goes on forming).
#[derive(Debug, thiserror::Error)]
enum Refusal {
    #[error("sent no Hello within the handshake timeout (or was cut to make room for others)")]
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

/// What a handshake thread sends back: its id and the proven claim, or why it refused.
type Outcome = (u64, std::result::Result<Claim, (SocketAddr, String)>);

/// The handshakes in flight: their ids, in the order they began, with a handle to cut each.
struct Pending {
    next_id: u64,
    open: VecDeque<(u64, TcpStream)>,
}

impl Pending {
    fn ended(&mut self, id: u64) {
        self.open.retain(|(i, _)| *i != id);
    }

    /// Cuts the oldest handshake to make room: its thread reads an error at once and says so.
    fn cut_oldest(&mut self) {
        if let Some((_, s)) = self.open.pop_front() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Accepts until every rank above ours has connected and proved itself, the deadline, or
/// `stop` (this rank failed to reach a peer; its error is the one reported) or the caller's
/// cancel. Refused connections are counted and logged, aggregated.
pub(super) fn accept_all(
    listener: &TcpListener,
    cfg: &TcpConfig,
    expect: usize,
    deadline: Instant,
    stop: &AtomicBool,
) -> Result<Vec<(Rank, TcpStream)>> {
    let mut refusals = Refusals::new(REFUSALS_EVERY);
    let got = accept_loop(listener, cfg, expect, deadline, stop, &mut refusals);
    say(cfg, refusals.flush_all());
    got
}

fn say(cfg: &TcpConfig, lines: Vec<crate::refusals::Refused>) {
    for line in lines {
        warn!(
            rank = cfg.rank,
            generation = cfg.generation,
            "data plane: {line}"
        );
        if let Some(sink) = &cfg.on_refused {
            sink.send(&line);
        }
    }
}

fn accept_loop(
    listener: &TcpListener,
    cfg: &TcpConfig,
    expect: usize,
    deadline: Instant,
    stop: &AtomicBool,
    refusals: &mut Refusals,
) -> Result<Vec<(Rank, TcpStream)>> {
    let mut got: Vec<(Rank, TcpStream)> = Vec::new();
    listener
        .set_nonblocking(true)
        .map_err(|e| CommError::io("listener nonblocking", &e))?;
    // Every handshake thread sends exactly one message; those still running when we return
    // find the channel closed and drop their connection.
    let (tx, rx) = mpsc::channel::<Outcome>();
    let mut pending = Pending {
        next_id: 0,
        open: VecDeque::new(),
    };
    let mut take = |outcome: Outcome, pending: &mut Pending, got: &mut Vec<(Rank, TcpStream)>| {
        pending.ended(outcome.0);
        match outcome.1 {
            Ok(claim) => admit(claim, cfg, deadline, got),
            Err((addr, why)) => say(cfg, refusals.note(Instant::now(), addr.ip(), &why)),
        }
    };
    while got.len() < expect {
        if stop.load(Ordering::Relaxed) || cfg.cancelled() {
            return Err(cfg.aborted());
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
            Ok((s, addr)) => {
                if pending.open.len() >= MAX_PENDING {
                    pending.cut_oldest();
                }
                spawn_handshake(s, addr, cfg, deadline, &tx, &mut pending);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                // Doubles as the poll interval of the nonblocking listener.
                if let Ok(outcome) = rx.recv_timeout(ACCEPT_POLL) {
                    take(outcome, &mut pending, &mut got);
                }
            }
            Err(e) => return Err(CommError::io("accept", &e)),
        }
        while let Ok(outcome) = rx.try_recv() {
            take(outcome, &mut pending, &mut got);
        }
    }
    Ok(got)
}

/// Starts the handshake of one accepted connection on its own thread (dropping the
/// connection if it cannot).
fn spawn_handshake(
    s: TcpStream,
    addr: SocketAddr,
    cfg: &TcpConfig,
    deadline: Instant,
    tx: &mpsc::Sender<Outcome>,
    pending: &mut Pending,
) {
    let Ok(handle) = s.try_clone() else {
        return;
    };
    let id = pending.next_id;
    pending.next_id += 1;
    let (cfg, tx, rank) = (cfg.clone(), tx.clone(), cfg.rank);
    let until = (Instant::now() + HANDSHAKE_TIMEOUT).min(deadline);
    let spawned = std::thread::Builder::new()
        .name(format!("comm-handshake-{rank}"))
        .spawn(move || {
            let outcome = match verify_connector(&s, &cfg, until) {
                Ok((from, nonces)) => Ok(Claim {
                    from,
                    stream: s,
                    addr,
                    nonces,
                }),
                Err(why) => {
                    // A FIN before the close, so a stale peer reads our answer before any reset.
                    let _ = s.shutdown(Shutdown::Both);
                    Err((addr, why.to_string()))
                }
            };
            let _ = tx.send((id, outcome));
        });
    match spawned {
        Ok(_) => pending.open.push_back((id, handle)),
        Err(e) => {
            warn!(rank, %addr, error = %e, "cannot spawn a handshake thread, dropping connection")
        }
    }
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
fn admit(claim: Claim, cfg: &TcpConfig, deadline: Instant, got: &mut Vec<(Rank, TcpStream)>) {
    let Claim {
        from,
        stream,
        addr,
        nonces,
    } = claim;
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
