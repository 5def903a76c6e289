//! Who gets a handshake on the control port, and how refusals are said. Handshakes in progress
//! are bounded; when they fill the bound, the oldest one that has had [`EVICT_AFTER`] is cut for
//! the newcomer, so strangers that connect and say nothing cannot keep out an agent or a tool
//! (`oobleck status`, the status page's poll) whose handshake takes milliseconds. Refusals are
//! counted and logged one line per address and reason per interval
//! ([`oobleck_comm::refusals::Refusals`]), not one line each.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use oobleck_comm::refusals::{Refusals, Refused};
use tokio::sync::oneshot;

/// A handshake younger than this is never cut: a real peer's takes a few round trips.
pub(super) const EVICT_AFTER: Duration = Duration::from_millis(250);
/// How often the refusals of one address and reason are summed up in the log.
pub(super) const REFUSAL_INTERVAL: Duration = Duration::from_secs(10);

/// The handshakes in progress, oldest first.
pub(super) struct Pending {
    limit: usize,
    next: AtomicU64,
    slots: Mutex<VecDeque<Slot>>,
}

struct Slot {
    id: u64,
    since: Instant,
    cut: oneshot::Sender<()>,
}

/// A handshake's place; it is given back on drop. `cut` fires if a newcomer took it.
pub(super) struct Entry<'a> {
    pending: &'a Pending,
    id: u64,
    pub cut: oneshot::Receiver<()>,
}

impl Drop for Entry<'_> {
    fn drop(&mut self) {
        self.pending.lock().retain(|s| s.id != self.id);
    }
}

impl Pending {
    pub fn new(limit: usize) -> Pending {
        Pending {
            limit,
            next: AtomicU64::new(0),
            slots: Mutex::new(VecDeque::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for a handshake starting at `now`, cutting the oldest one when the bound is
    /// reached; `None` when every one in progress is younger than [`EVICT_AFTER`].
    pub fn enter(&self, now: Instant) -> Option<Entry<'_>> {
        let mut slots = self.lock();
        if slots.len() >= self.limit {
            let oldest = slots.front().map(|s| s.since)?;
            if now.saturating_duration_since(oldest) < EVICT_AFTER {
                return None;
            }
            if let Some(s) = slots.pop_front() {
                let _ = s.cut.send(());
            }
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        slots.push_back(Slot {
            id,
            since: now,
            cut: tx,
        });
        Some(Entry {
            pending: self,
            id,
            cut: rx,
        })
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.lock().len()
    }
}

/// The control port's refusals, shared by its connections.
pub(super) struct RefusalLog {
    refusals: Mutex<Refusals>,
}

impl RefusalLog {
    pub fn new() -> RefusalLog {
        RefusalLog {
            refusals: Mutex::new(Refusals::new(REFUSAL_INTERVAL)),
        }
    }

    /// Counts a refusal of `peer` for `reason`; the lines to log and record now.
    pub fn note(&self, now: Instant, peer: SocketAddr, reason: &str) -> Vec<Refused> {
        let mut r = self.refusals.lock().unwrap_or_else(|p| p.into_inner());
        r.note(now, peer.ip(), reason)
    }

    /// The summaries of intervals that ended by `now`.
    pub fn flush(&self, now: Instant) -> Vec<Refused> {
        let mut r = self.refusals.lock().unwrap_or_else(|p| p.into_inner());
        r.flush(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_bound_cuts_the_oldest_handshake_once_it_had_its_time() {
        let p = Pending::new(2);
        let t0 = Instant::now();
        let mut a = p.enter(t0).expect("room");
        let _b = p.enter(t0 + Duration::from_millis(10)).expect("room");
        // Both are young: a third waits its turn (refused).
        assert!(p.enter(t0 + Duration::from_millis(100)).is_none());
        // The oldest has had its time: it is cut for the newcomer.
        let c = p.enter(t0 + EVICT_AFTER).expect("the oldest is cut");
        assert_eq!(a.cut.try_recv(), Ok(()));
        assert_eq!(p.len(), 2);
        drop(c);
        assert_eq!(p.len(), 1, "a finished handshake gives its place back");
        drop(a);
        assert_eq!(p.len(), 1, "a cut one was already out");
    }
}
