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

use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::TcpConfig;
use crate::comm::Rank;
use crate::frame::{self, Header, KeyedHello, Kind, ReadOutcome};
use crate::key::{SecretKey, KEY_BYTES};

mod accept;
mod connect;
#[cfg(test)]
mod tests;

pub(in crate::tcp) use accept::accept_all;
pub(in crate::tcp) use connect::connect_one;

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

/// This rank's keyed Hello to `to`: our nonce and the MAC over both nonces.
fn keyed_hello(
    cfg: &TcpConfig,
    key: &SecretKey,
    to: Rank,
    theirs: &Nonce,
    ours: Nonce,
) -> KeyedHello {
    KeyedHello {
        from: cfg.rank as u32,
        to: to as u32,
        world: cfg.peers.len() as u32,
        nonce: ours,
        mac: hello_mac(cfg, key, to, theirs, &ours),
    }
}

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
