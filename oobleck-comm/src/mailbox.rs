//! Where received messages wait for the operation that asked for them.
//!
//! Transports deposit whole messages keyed by `(peer, channel, seq, part)`; operations take
//! them out with a deadline. Peer failures and `abort` wake every waiter at once.
//!
//! A receive into a caller's buffer ([`Mailbox::take_into`]) also *posts* the buffer: a
//! transport that streams a message (the shared-memory ring) may [`Mailbox::claim`] a posted
//! buffer of the message's exact length and copy straight into it, saving the copy through a
//! fresh `Vec`. The receiver does not return while its buffer is claimed: on an error it sets
//! the claim's cancel flag and waits for the transport to [`Mailbox::release`] it.
//!
//! A buffer may also be posted to *accumulate*: the message is added to it elementwise
//! (the ring all-reduce's reduce-scatter), so a transport that claims it reduces as it reads,
//! through a small cache-resident buffer, instead of handing over a whole message to be read
//! again.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::comm::Rank;
use crate::error::{CommError, Op, Result};
use crate::tensor::{add_into, DType};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    pub peer: Rank,
    pub channel: u64,
    pub seq: u64,
    pub part: u32,
}

/// Until when an operation waits, and what its timeout error names.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Due {
    pub deadline: Instant,
    pub op: Op,
    /// The operation's whole timeout, for the error.
    pub timeout: Duration,
}

/// A caller's buffer waiting for the message of its key.
struct Post {
    ptr: *mut u8,
    len: usize,
    /// Add the message to the buffer instead of overwriting it.
    add: Option<DType>,
    /// A transport is copying into it.
    claimed: bool,
    /// The message is in the buffer.
    filled: bool,
    cancel: Arc<AtomicBool>,
}

// SAFETY: `ptr` is only written by the thread holding the claim, between `claim` and
// `release`, while the posting thread waits (see `take_into`).
unsafe impl Send for Post {}

/// The right to fill a posted buffer: `len` bytes at `ptr`, until [`Mailbox::release`].
/// Stop copying and release as soon as `cancel` is set.
pub(crate) struct Claim {
    key: Key,
    pub ptr: *mut u8,
    /// `Some`: add the message to the `len` bytes at `ptr` elementwise instead of copying it
    /// there. After a cancel the buffer holds partial sums, so the message cannot be rebuilt
    /// from it: the transport drops it (its receiver has failed and no one else takes it).
    pub add: Option<DType>,
    pub cancel: Arc<AtomicBool>,
}

struct Inner {
    /// Message and the earliest instant it may be taken (fault injection: delay).
    msgs: HashMap<Key, (Option<Instant>, Vec<u8>)>,
    posts: HashMap<Key, Post>,
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
                posts: HashMap::new(),
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

    /// `op` waited `timeout` for a message from `peer` in vain.
    fn timed_out(&self, op: Op, timeout: Duration, peer: Rank) -> CommError {
        CommError::Timeout {
            op,
            after: timeout,
            rank: self.rank,
            generation: self.generation,
            waiting_on: Some(peer),
        }
    }

    pub fn aborted_error(&self) -> CommError {
        CommError::Aborted {
            rank: self.rank,
            generation: self.generation,
        }
    }

    /// Takes the posted buffer of `key` if its length is `len` and nobody gave up on it;
    /// one posted to accumulate only if the transport `can_add`.
    pub fn claim(&self, key: Key, len: usize, can_add: bool) -> Option<Claim> {
        let mut g = self.lock();
        if g.aborted {
            return None;
        }
        let p = g.posts.get_mut(&key)?;
        if p.claimed || p.filled || p.len != len || p.cancel.load(SeqCst) {
            return None;
        }
        if p.add.is_some() && !can_add {
            return None;
        }
        p.claimed = true;
        Some(Claim {
            key,
            ptr: p.ptr,
            add: p.add,
            cancel: p.cancel.clone(),
        })
    }

    /// Whether a receiver has posted a buffer for `key` (tests wait for it before sending).
    #[cfg(test)]
    pub fn is_posted(&self, key: Key) -> bool {
        self.lock().posts.contains_key(&key)
    }

    /// Gives a claimed buffer back: `filled` with the whole message, or not touched again.
    pub fn release(&self, c: Claim, filled: bool) {
        let mut g = self.lock();
        if let Some(p) = g.posts.get_mut(&c.key) {
            p.claimed = false;
            p.filled = filled;
        }
        drop(g);
        self.cv.notify_all();
    }

    /// Fills every buffer of `bufs` with the message of its key by `due` (`add`: adds
    /// the message, read as elements of that type, to the buffer); a message of
    /// another length fails with `mismatch(key, its length)`. `filled(i, buffer)` is called as
    /// soon as buffer `i` holds its message, in the order of `bufs`; all of them stay posted
    /// until the last is filled, so a transport can copy later messages straight in meanwhile.
    pub fn take_into(
        &self,
        bufs: &mut [(Key, &mut [u8])],
        add: Option<DType>,
        due: Due,
        mismatch: impl Fn(Key, usize) -> CommError,
        mut filled: impl FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let keys: Vec<Key> = bufs.iter().map(|(k, _)| *k).collect();
        {
            let mut g = self.lock();
            for (i, (k, b)) in bufs.iter_mut().enumerate() {
                let post = Post {
                    ptr: b.as_mut_ptr(),
                    len: b.len(),
                    add,
                    claimed: false,
                    filled: false,
                    cancel: Arc::new(AtomicBool::new(false)),
                };
                match g.posts.entry(*k) {
                    std::collections::hash_map::Entry::Vacant(v) => {
                        v.insert(post);
                    }
                    std::collections::hash_map::Entry::Occupied(_) => {
                        drop(g);
                        self.unpost(&keys[..i]);
                        return Err(CommError::Invalid(format!(
                            "two receives of message {k:?} at once"
                        )));
                    }
                }
            }
        }
        // From here on every return goes through `unpost`, which waits out any claim.
        let out = (|| {
            for (i, (k, b)) in bufs.iter_mut().enumerate() {
                if let Some(data) = self.wait_post(*k, due)? {
                    if data.len() != b.len() {
                        return Err(mismatch(*k, data.len()));
                    }
                    match add {
                        None => b.copy_from_slice(&data),
                        Some(dtype) => add_into(dtype, b, &data),
                    }
                }
                filled(i, b)?;
            }
            Ok(())
        })();
        self.unpost(&keys);
        out
    }

    /// Waits until `key`'s posted buffer is filled (`None`) or its message arrived whole
    /// (`Some`, the post then unclaimable).
    fn wait_post(&self, key: Key, due: Due) -> Result<Option<Vec<u8>>> {
        let Due {
            deadline,
            op,
            timeout,
        } = due;
        let mut g = self.lock();
        loop {
            if g.aborted {
                return Err(self.aborted_error());
            }
            let now = Instant::now();
            let mut wake = deadline;
            let inner = &mut *g;
            let post = inner.posts.get_mut(&key).expect("posted by take_into");
            if post.filled {
                return Ok(None);
            }
            if !post.claimed {
                match inner.msgs.get(&key) {
                    Some((Some(t), _)) if *t > now => wake = wake.min(*t),
                    Some(_) => {
                        // Nobody may claim it any more: its message is here.
                        post.cancel.store(true, SeqCst);
                        let (_, data) = inner.msgs.remove(&key).expect("present: checked above");
                        return Ok(Some(data));
                    }
                    None => {
                        if let Some(err) = &inner.failed[key.peer] {
                            return Err(err.clone());
                        }
                    }
                }
            }
            if now >= deadline {
                return Err(self.timed_out(op, timeout, key.peer));
            }
            g = self
                .cv
                .wait_timeout(g, wake - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Withdraws the posts of `keys`, first waiting for every claim on them to be released.
    fn unpost(&self, keys: &[Key]) {
        let mut g = self.lock();
        for k in keys {
            if let Some(p) = g.posts.get(k) {
                p.cancel.store(true, SeqCst);
            }
        }
        // Bounded: a claim holder checks `cancel` between naps of a few milliseconds.
        while keys
            .iter()
            .any(|k| g.posts.get(k).is_some_and(|p| p.claimed))
        {
            g = self
                .cv
                .wait_timeout(g, Duration::from_millis(10))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        for k in keys {
            g.posts.remove(k);
        }
    }

    /// Waits for the message `key` until `due`.
    pub fn take(&self, key: Key, due: Due) -> Result<Vec<u8>> {
        let Due {
            deadline,
            op,
            timeout,
        } = due;
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
                return Err(self.timed_out(op, timeout, key.peer));
            }
            g = self
                .cv
                .wait_timeout(g, wake - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}
