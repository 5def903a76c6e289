//! Where received messages wait for the operation that asked for them.
//!
//! Transports deposit whole messages keyed by `(peer, channel, seq, part)`; operations take
//! them out with a deadline. Peer failures and `abort` wake every waiter at once.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::comm::Rank;
use crate::error::{CommError, Op, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    pub peer: Rank,
    pub channel: u64,
    pub seq: u64,
    pub part: u32,
}

struct Inner {
    /// Message and the earliest instant it may be taken (fault injection: delay).
    msgs: HashMap<Key, (Option<Instant>, Vec<u8>)>,
    failed: Vec<Option<CommError>>,
    aborted: bool,
}

pub(crate) struct Mailbox {
    rank: Rank,
    generation: u64,
    inner: Mutex<Inner>,
    cv: Condvar,
}

impl Mailbox {
    pub fn new(rank: Rank, world: usize, generation: u64) -> Self {
        Mailbox {
            rank,
            generation,
            inner: Mutex::new(Inner {
                msgs: HashMap::new(),
                failed: vec![None; world],
                aborted: false,
            }),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding this lock cannot leave the maps half-updated (single inserts
        // and removes), so a poisoned lock is still consistent.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stores a message. A second message under the same key is a protocol violation by
    /// `key.peer`, which is then marked failed.
    pub fn deliver(&self, key: Key, ready_at: Option<Instant>, data: Vec<u8>) {
        let mut g = self.lock();
        if g.aborted {
            return;
        }
        let generation = self.generation;
        let inner = &mut *g;
        match inner.msgs.entry(key) {
            std::collections::hash_map::Entry::Occupied(_) => {
                let err = CommError::PeerLost {
                    rank: key.peer,
                    generation,
                    reason: format!(
                        "duplicate message channel {} seq {} part {}",
                        key.channel, key.seq, key.part
                    ),
                };
                inner.failed[key.peer].get_or_insert(err);
            }
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert((ready_at, data));
            }
        }
        drop(g);
        self.cv.notify_all();
    }

    /// Marks `peer` failed: operations waiting on it return `err` (the first error sticks).
    pub fn fail_peer(&self, peer: Rank, err: CommError) {
        let mut g = self.lock();
        if let Some(slot) = g.failed.get_mut(peer) {
            slot.get_or_insert(err);
        }
        drop(g);
        self.cv.notify_all();
    }

    pub fn peer_error(&self, peer: Rank) -> Option<CommError> {
        self.lock().failed.get(peer).cloned().flatten()
    }

    pub fn abort(&self) {
        let mut g = self.lock();
        g.aborted = true;
        g.msgs.clear();
        drop(g);
        self.cv.notify_all();
    }

    pub fn is_aborted(&self) -> bool {
        self.lock().aborted
    }

    pub fn aborted_error(&self) -> CommError {
        CommError::Aborted {
            rank: self.rank,
            generation: self.generation,
        }
    }

    /// Waits for the message `key` until `deadline`.
    pub fn take(&self, key: Key, deadline: Instant, op: Op, timeout: Duration) -> Result<Vec<u8>> {
        let mut g = self.lock();
        loop {
            if g.aborted {
                return Err(self.aborted_error());
            }
            let now = Instant::now();
            let mut wake = deadline;
            if let Some((ready_at, _)) = g.msgs.get(&key) {
                match ready_at {
                    Some(t) if *t > now => wake = wake.min(*t),
                    _ => {
                        let (_, data) = g.msgs.remove(&key).expect("present: checked above");
                        return Ok(data);
                    }
                }
            } else if let Some(err) = &g.failed[key.peer] {
                return Err(err.clone());
            }
            if now >= deadline {
                return Err(CommError::Timeout {
                    op,
                    after: timeout,
                    rank: self.rank,
                    generation: self.generation,
                    waiting_on: Some(key.peer),
                });
            }
            g = self
                .cv
                .wait_timeout(g, wake - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}
