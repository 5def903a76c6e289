//! The accepting side of the handshake: every connection on its own thread, strangers refused
//! and counted, the oldest handshake cut when too many are in flight.

use std::collections::VecDeque;
use std::io::ErrorKind;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tracing::warn;

use super::*;
use crate::comm::Rank;
use crate::error::{CommError, FrameError, Op, Result};
use crate::frame::{self, KeyedHello, Kind, ReadOutcome};
use crate::key::{self};
use crate::refusals::Refusals;
use crate::tcp::TcpConfig;

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
pub(in crate::tcp) fn accept_all(
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
                let hello = keyed_hello(cfg, key, from, &theirs, ours);
                send(&stream, cfg.generation, Kind::Hello, &hello.encode())
            }
            _ => send_plain_hello(&stream, cfg, from as u32),
        });
    match sent {
        Ok(()) => got.push((from, stream)),
        Err(e) => warn!(rank = cfg.rank, from, %addr, error = %e, "handshake reply failed"),
    }
}
