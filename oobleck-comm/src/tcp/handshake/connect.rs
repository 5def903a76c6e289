//! The connecting side of the handshake: dial a lower rank, prove ourselves, check its proof.

use std::io::ErrorKind;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use tracing::warn;

use super::*;
use crate::comm::Rank;
use crate::error::{CommError, FrameError, Op, Result};
use crate::frame::{self, Header, KeyedHello, Kind, ReadOutcome};
use crate::key::{self, SecretKey};
use crate::tcp::TcpConfig;

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
pub(in crate::tcp) fn connect_one(
    cfg: &TcpConfig,
    j: Rank,
    deadline: Instant,
) -> Result<TcpStream> {
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
    let hello = keyed_hello(cfg, key, j, &theirs, ours);
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
