//! In-process backend: ranks are threads of one process, links are mailboxes, and faults are
//! injected on purpose (in the spirit of raft-rs's test network).
//!
//! ```text
//!  LocalNetwork ── faults: dropped ranks, cut links, per-link delay, stalled ranks
//!    ├─ LocalCommunicator rank 0 ──send──▶ Mailbox of rank 1 ─take─▶ op on rank 1
//!    └─ LocalCommunicator rank 1 ...
//! ```
//!
//! Faults behave like their real counterparts on the TCP backend:
//! * [`LocalNetwork::drop_rank`]: the rank's process died. Peers see `PeerLost` at once; the
//!   dropped rank's own operations fail with `Aborted`.
//! * [`LocalNetwork::cut_link`]: the connection between two ranks broke; both ends see
//!   `PeerLost` for each other, other links are unaffected.
//! * [`LocalNetwork::set_delay`]: messages on a directed link arrive `delay` later.
//! * [`LocalNetwork::stall`]: the rank is frozen (SIGSTOP): nothing it sends or is sent
//!   arrives until [`LocalNetwork::resume`], so operations waiting on it time out.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::comm::Rank;
use crate::engine::{delegate_communicator, Engine, Transport, Tuning};
use crate::error::{CommError, Op, Result};
use crate::mailbox::{Key, Mailbox};

#[derive(Default)]
struct Faults {
    dropped: HashSet<Rank>,
    cut: HashSet<(Rank, Rank)>,
    delay: HashMap<(Rank, Rank), Duration>,
    stalled: HashSet<Rank>,
    /// Messages held back by a stall: (to, key, ready_at, data), in send order.
    held: Vec<(Rank, Key, Option<Instant>, Vec<u8>)>,
}

struct Net {
    world: usize,
    generation: u64,
    mailboxes: Vec<Arc<Mailbox>>,
    faults: Mutex<Faults>,
}

impl Net {
    fn faults(&self) -> MutexGuard<'_, Faults> {
        self.faults.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lost(&self, rank: Rank, reason: &str) -> CommError {
        CommError::PeerLost {
            rank,
            generation: self.generation,
            reason: reason.to_string(),
        }
    }
}

/// A simulated network of `world` ranks in this process.
#[derive(Clone)]
pub struct LocalNetwork {
    net: Arc<Net>,
}

/// One rank's endpoint of a [`LocalNetwork`].
pub struct LocalCommunicator {
    engine: Engine<LocalTransport>,
}

delegate_communicator!(LocalCommunicator, engine);

impl LocalNetwork {
    pub fn new(world: usize, generation: u64) -> Self {
        let mailboxes = (0..world)
            .map(|r| Arc::new(Mailbox::new(r, world, generation)))
            .collect();
        LocalNetwork {
            net: Arc::new(Net {
                world,
                generation,
                mailboxes,
                faults: Mutex::new(Faults::default()),
            }),
        }
    }

    /// The endpoints, one per rank (call once; a second set would share the mailboxes).
    pub fn communicators(&self, tuning: Tuning) -> Vec<LocalCommunicator> {
        (0..self.net.world)
            .map(|rank| LocalCommunicator {
                engine: Engine::new(
                    rank,
                    self.net.world,
                    self.net.generation,
                    LocalTransport {
                        net: self.net.clone(),
                        rank,
                    },
                    self.net.mailboxes[rank].clone(),
                    tuning,
                ),
            })
            .collect()
    }

    /// Kills `rank`: as if its process received SIGKILL.
    pub fn drop_rank(&self, rank: Rank) {
        tracing::info!(rank, "local network: dropping rank");
        self.net.faults().dropped.insert(rank);
        for (r, mb) in self.net.mailboxes.iter().enumerate() {
            if r == rank {
                mb.abort();
            } else {
                mb.fail_peer(rank, self.net.lost(rank, "process died (injected)"));
            }
        }
    }

    /// Breaks the connection between `a` and `b` in both directions.
    pub fn cut_link(&self, a: Rank, b: Rank) {
        tracing::info!(a, b, "local network: cutting link");
        self.net.faults().cut.insert((a.min(b), a.max(b)));
        if let Some(mb) = self.net.mailboxes.get(a) {
            mb.fail_peer(b, self.net.lost(b, "link cut (injected)"));
        }
        if let Some(mb) = self.net.mailboxes.get(b) {
            mb.fail_peer(a, self.net.lost(a, "link cut (injected)"));
        }
    }

    /// Delays every later message from `from` to `to` by `delay`.
    pub fn set_delay(&self, from: Rank, to: Rank, delay: Duration) {
        self.net.faults().delay.insert((from, to), delay);
    }

    /// Freezes `rank`: messages from and to it are held until [`LocalNetwork::resume`].
    pub fn stall(&self, rank: Rank) {
        tracing::info!(rank, "local network: stalling rank");
        self.net.faults().stalled.insert(rank);
    }

    /// Thaws `rank` and delivers what was held, in send order.
    pub fn resume(&self, rank: Rank) {
        let mut f = self.net.faults();
        f.stalled.remove(&rank);
        let held = std::mem::take(&mut f.held);
        let mut keep = Vec::new();
        for (to, key, ready, data) in held {
            if f.stalled.contains(&to) || f.stalled.contains(&key.peer) {
                keep.push((to, key, ready, data));
            } else {
                self.net.mailboxes[to].deliver(key, ready, data);
            }
        }
        f.held = keep;
    }
}

struct LocalTransport {
    net: Arc<Net>,
    rank: Rank,
}

impl Transport for LocalTransport {
    fn send(
        &self,
        peer: Rank,
        (channel, seq, part): (u64, u64, u32),
        parts: &[&[u8]],
        _deadline: Instant,
        _op: Op,
        _timeout: Duration,
    ) -> Result<()> {
        let net = &self.net;
        // Copy before taking the fault lock: large messages must not serialise the network.
        let data = parts.concat();
        let mut f = net.faults();
        if f.dropped.contains(&self.rank) {
            return Err(net.mailboxes[self.rank].aborted_error());
        }
        if let Some(err) = net.mailboxes[self.rank].peer_error(peer) {
            return Err(err);
        }
        if f.dropped.contains(&peer) || f.cut.contains(&(self.rank.min(peer), self.rank.max(peer)))
        {
            return Err(net.lost(peer, "link down (injected)"));
        }
        let key = Key {
            peer: self.rank,
            channel,
            seq,
            part,
        };
        let ready = f.delay.get(&(self.rank, peer)).map(|d| Instant::now() + *d);
        if f.stalled.contains(&self.rank) || f.stalled.contains(&peer) {
            f.held.push((peer, key, ready, data));
        } else {
            drop(f);
            net.mailboxes[peer].deliver(key, ready, data);
        }
        Ok(())
    }

    fn shutdown(&self) {
        // Like closing every socket: the peers see this rank go away.
        for (r, mb) in self.net.mailboxes.iter().enumerate() {
            if r != self.rank {
                mb.fail_peer(self.rank, self.net.lost(self.rank, "peer aborted"));
            }
        }
    }
}
