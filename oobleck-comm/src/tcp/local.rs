//! Shared memory between ranks of one host, agreed on over the TCP connections right after
//! the handshake (every payload is a `Local` frame; the connection stays open afterwards for
//! failure detection: its EOF is how a dead peer is noticed).
//!
//! ```text
//!   every pair      Offer{enabled, host}  ◀────────▶  Offer{enabled, host}
//!   same host, both enabled (lower rank = creator):
//!     lower:  remove stale segments of dead pids; create oobleck-<pid>-g<gen>-pair-<lo>-<hi>-<nonce>
//!             (header: magic, generation, lo, hi, ring capacity) ── Segment{ok, name} ──▶ higher
//!     higher: open, check the header, map, unlink ── Ack{ok} ──▶ lower, which unlinks too
//!   a pair that agreed has two rings (lo→hi, hi→lo) and sends every message through them;
//!   any other pair keeps sending over TCP
//!   every pair on this host   Links{bit j: a ring with rank j}  ◀────────▶  Links{...}
//! ```
//!
//! The last step lets every rank on this host know every local pair's outcome, so all members
//! of a group agree on whether all of its pairs have shared memory (the condition for the
//! shared-scratch all-reduce; otherwise every member runs the ring), even where one pair's
//! setup failed (a full `/dev/shm`, a segment that would not map).
//!
//! Each step sends to every peer before it reads from any (small frames, never blocking on a
//! full socket), so the exchange cannot deadlock; every read is bounded by the connect
//! deadline. The host identity (boot id, machine id, the tmpfs' device) is known for every
//! rank after the offers, so all members of a group agree on whether it is all on one host.

use std::net::TcpStream;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::Instant;

use tracing::{debug, warn};

use super::TcpConfig;
use crate::comm::Rank;
use crate::error::{CommError, FrameError, Op, Result};
use crate::frame::{self, Header, Kind, ReadOutcome};
use crate::shm::{host_identity, remove_stale, Link, Ring, RingWriter, Segment, RING_HEADER};

/// Data bytes of each ring direction.
const RING_CAP: usize = 1 << 20;
const PAGE: usize = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"OBKSHMP1");
const OFFER: u8 = 1;
const SEGMENT: u8 = 2;
const ACK: u8 = 3;
const LINKS: u8 = 4;
/// Env switch: `OOBLECK_COMM_SHM=0` keeps every pair on TCP.
pub(crate) const SHM_ENV: &str = "OOBLECK_COMM_SHM";

/// The shared-memory link with one peer: our writer into its ring, our incoming ring.
pub(crate) struct PairLink {
    pub writer: RingWriter,
    pub link: Arc<Link>,
}

/// What the exchange agreed on, indexed by rank.
pub(crate) struct Negotiated {
    pub links: Vec<Option<PairLink>>,
    pub pairs: PairMap,
}

/// The shared-memory links of this rank and of every peer on this host, as each reported them.
pub(crate) struct PairMap {
    /// `rows[r][j]`: rank r has a ring with rank j (`rows[r][r]`: r has shared memory on);
    /// `None` for ranks on other hosts or with shared memory off.
    rows: Vec<Option<Vec<bool>>>,
}

impl PairMap {
    /// True when every pair of the sorted group `g` has shared memory, by both ends' reports.
    pub fn all_linked(&self, g: &[Rank]) -> bool {
        let has = |a: Rank, b: Rank| self.rows[a].as_ref().is_some_and(|row| row[b]);
        g.iter().all(|&a| g.iter().all(|&b| has(a, b) && has(b, a)))
    }
}

fn to_bits(v: &[bool]) -> Vec<u8> {
    let mut out = vec![0u8; v.len().div_ceil(8)];
    for (j, _) in v.iter().enumerate().filter(|(_, &b)| b) {
        out[j / 8] |= 1 << (j % 8);
    }
    out
}

fn from_bits(b: &[u8], world: usize) -> Vec<bool> {
    (0..world).map(|j| b[j / 8] & (1 << (j % 8)) != 0).collect()
}

/// True unless turned off by the config or `OOBLECK_COMM_SHM=0`.
pub(crate) fn shm_enabled(cfg: &TcpConfig) -> bool {
    cfg.shared_memory && std::env::var(SHM_ENV).map_or(true, |v| v.trim() != "0")
}

fn stride() -> usize {
    (RING_HEADER + RING_CAP).div_ceil(PAGE) * PAGE
}

fn seg_len() -> usize {
    PAGE + 2 * stride()
}

struct Chan<'a> {
    cfg: &'a TcpConfig,
    streams: &'a [Option<TcpStream>],
    deadline: Instant,
}

impl Chan<'_> {
    fn lost(&self, j: Rank, e: impl std::fmt::Display) -> CommError {
        CommError::PeerLost {
            rank: j,
            generation: self.cfg.generation,
            reason: format!("shared-memory setup: {e}"),
        }
    }

    fn send(&self, j: Rank, payload: &[u8]) -> Result<()> {
        let h = Header {
            kind: Kind::Local,
            generation: self.cfg.generation,
            channel: 0,
            seq: 0,
            part: 0,
            len: payload.len() as u32,
        };
        let mut s = self.streams[j].as_ref().expect("a stream per peer");
        frame::write_frame(&mut s, &h, &[payload]).map_err(|e| self.lost(j, e))
    }

    /// Reads `j`'s next setup frame (at most `cap` bytes), which must be of `subtype`.
    fn recv(&self, j: Rank, subtype: u8, cap: u32) -> Result<Vec<u8>> {
        let s = self.streams[j].as_ref().expect("a stream per peer");
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(CommError::Timeout {
                op: Op::Connect,
                after: self.cfg.connect_timeout,
                rank: self.cfg.rank,
                generation: self.cfg.generation,
                waiting_on: Some(j),
            });
        }
        s.set_read_timeout(Some(left))
            .map_err(|e| self.lost(j, e))?;
        let mut r = s;
        let bad = |m: String| CommError::Frame {
            peer: Some(j),
            source: FrameError::Malformed(m),
        };
        match frame::read_frame(&mut r, self.cfg.generation, cap) {
            Ok(ReadOutcome::Frame(h, p))
                if h.kind == Kind::Local && p.first() == Some(&subtype) =>
            {
                Ok(p[1..].to_vec())
            }
            Ok(ReadOutcome::Frame(h, _)) => Err(bad(format!(
                "expected shared-memory setup step {subtype}, got a {:?} frame",
                h.kind
            ))),
            Ok(ReadOutcome::Closed) => Err(self.lost(j, "connection closed")),
            Ok(ReadOutcome::Bad(source)) => Err(CommError::Frame {
                peer: Some(j),
                source,
            }),
            Err(e) => Err(self.lost(j, e)),
        }
    }
}

/// Runs the exchange on the handshaken `streams` (one per peer, indexed by rank).
pub(crate) fn negotiate(
    cfg: &TcpConfig,
    streams: &[Option<TcpStream>],
    deadline: Instant,
) -> Result<Negotiated> {
    let me = cfg.rank;
    let world = cfg.peers.len();
    let ch = Chan {
        cfg,
        streams,
        deadline,
    };
    let host = shm_enabled(cfg).then(host_identity).flatten();
    let mut offer = vec![OFFER, u8::from(host.is_some())];
    offer.extend_from_slice(host.as_deref().unwrap_or("").as_bytes());
    let peers: Vec<Rank> = (0..world).filter(|&j| j != me).collect();
    for &j in &peers {
        ch.send(j, &offer)?;
    }
    let mut local = vec![false; world];
    local[me] = host.is_some();
    for &j in &peers {
        let p = ch.recv(j, OFFER, 1024)?;
        local[j] = host.is_some()
            && p.first() == Some(&1)
            && Some(&p[1..]) == host.as_deref().map(str::as_bytes);
    }
    let mut links: Vec<Option<PairLink>> = (0..world).map(|_| None).collect();
    let higher: Vec<Rank> = peers
        .iter()
        .copied()
        .filter(|&j| j > me && local[j])
        .collect();
    let lower: Vec<Rank> = peers
        .iter()
        .copied()
        .filter(|&j| j < me && local[j])
        .collect();
    if !higher.is_empty() {
        remove_stale(std::path::Path::new(crate::shm::SHM_DIR));
    }
    let mut created: Vec<(Rank, Option<Arc<Segment>>)> = Vec::new();
    for &j in &higher {
        let seg = create_pair(cfg, j);
        let mut msg = vec![SEGMENT, u8::from(seg.is_some())];
        if let Some(s) = &seg {
            msg.extend_from_slice(s.name().as_bytes());
        }
        ch.send(j, &msg)?;
        created.push((j, seg));
    }
    for &j in &lower {
        let p = ch.recv(j, SEGMENT, 1024)?;
        let seg = (p.first() == Some(&1))
            .then(|| open_pair(cfg, j, &p[1..]))
            .flatten();
        ch.send(j, &[ACK, u8::from(seg.is_some())])?;
        links[j] = seg.map(|s| pair_link(s, false));
    }
    for (j, seg) in created {
        let ack = ch.recv(j, ACK, 1024);
        if let Some(s) = &seg {
            s.unlink();
        }
        if ack?.first() == Some(&1) {
            links[j] = seg.map(|s| pair_link(s, true));
        } else if seg.is_some() {
            warn!(
                rank = me,
                peer = j,
                "peer on this host could not map our segment; using TCP"
            );
        }
    }
    let pairs = exchange_links(&ch, &local, &links)?;
    debug!(rank = me, local = ?local, links = links.iter().filter(|l| l.is_some()).count(), "shared memory agreed");
    Ok(Negotiated { links, pairs })
}

/// Tells every peer on this host which rings we have, and learns theirs.
fn exchange_links(ch: &Chan, local: &[bool], links: &[Option<PairLink>]) -> Result<PairMap> {
    let (me, world) = (ch.cfg.rank, local.len());
    let mine: Vec<bool> = (0..world)
        .map(|j| {
            if j == me {
                local[me]
            } else {
                links[j].is_some()
            }
        })
        .collect();
    let mut rows: Vec<Option<Vec<bool>>> = vec![None; world];
    if !local[me] {
        return Ok(PairMap { rows });
    }
    let peers: Vec<Rank> = (0..world).filter(|&j| j != me && local[j]).collect();
    let mut msg = vec![LINKS];
    msg.extend_from_slice(&to_bits(&mine));
    for &j in &peers {
        ch.send(j, &msg)?;
    }
    let want = world.div_ceil(8);
    for &j in &peers {
        let p = ch.recv(j, LINKS, u32::try_from(want + 1).unwrap_or(u32::MAX))?;
        if p.len() != want {
            return Err(CommError::Frame {
                peer: Some(j),
                source: FrameError::Malformed(format!(
                    "shared-memory link report of {} bytes for a world of {world}",
                    p.len()
                )),
            });
        }
        rows[j] = Some(from_bits(&p, world));
    }
    rows[me] = Some(mine);
    Ok(PairMap { rows })
}

fn create_pair(cfg: &TcpConfig, hi: Rank) -> Option<Arc<Segment>> {
    let what = format!("pair-{}-{hi}", cfg.rank);
    let made = if cfg.shm_faults.pair_with.contains(&hi) {
        Err(std::io::Error::from_raw_os_error(libc::ENOSPC))
    } else {
        Segment::create(cfg.generation, &what, seg_len())
    };
    match made {
        Ok(s) => {
            s.atomic_u64(8).store(cfg.generation, SeqCst);
            s.atomic_u64(16)
                .store(((hi as u64) << 32) | cfg.rank as u64, SeqCst);
            s.atomic_u64(24).store(RING_CAP as u64, SeqCst);
            s.atomic_u64(0).store(MAGIC, SeqCst);
            Some(Arc::new(s))
        }
        Err(e) => {
            warn!(rank = cfg.rank, peer = hi, error = %e, "cannot create a shared-memory segment; using TCP");
            None
        }
    }
}

/// Maps the segment `lo` created for us, if it is what it claims to be.
fn open_pair(cfg: &TcpConfig, lo: Rank, name: &[u8]) -> Option<Arc<Segment>> {
    let name = std::str::from_utf8(name).ok()?;
    let seg = match Segment::open(name, seg_len()) {
        Ok(s) => s,
        Err(e) => {
            warn!(rank = cfg.rank, peer = lo, name, error = %e, "cannot map the peer's segment; using TCP");
            return None;
        }
    };
    seg.unlink();
    let ok = seg.atomic_u64(0).load(SeqCst) == MAGIC
        && seg.atomic_u64(8).load(SeqCst) == cfg.generation
        && seg.atomic_u64(16).load(SeqCst) == ((cfg.rank as u64) << 32) | lo as u64
        && seg.atomic_u64(24).load(SeqCst) == RING_CAP as u64;
    if !ok {
        warn!(
            rank = cfg.rank,
            peer = lo,
            name,
            "segment header does not match this pair; using TCP"
        );
        return None;
    }
    Some(Arc::new(seg))
}

/// Our ends of a pair's rings: the creator (`lo`) writes the first ring and reads the second.
fn pair_link(seg: Arc<Segment>, lo: bool) -> PairLink {
    let a = Ring::new(seg.clone(), PAGE, RING_CAP);
    let b = Ring::new(seg, PAGE + stride(), RING_CAP);
    let (out, inc) = if lo { (a, b) } else { (b, a) };
    PairLink {
        writer: RingWriter::new(out),
        link: Arc::new(Link::new(inc)),
    }
}
