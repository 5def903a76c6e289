//! Refused connections, counted and logged without flooding the log: one line per peer
//! address and reason per interval. The first refusal of a pair is said at once; the ones
//! after it in the same interval are counted and said together when the interval ends (or
//! when the caller flushes). Pure: the caller passes the time and logs what comes back, so a
//! stranger opening thousands of connections costs a few lines, not one each.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Distinct `(address, reason)` pairs tracked at once; refusals beyond them are counted
/// together (a flood from many addresses must not grow memory without bound).
const MAX_TRACKED: usize = 1024;

/// One line to log about refused connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// `None`: refusals from addresses beyond the tracked ones.
    pub peer: Option<IpAddr>,
    pub reason: String,
    pub count: u64,
    /// The first refusal of its pair in its interval (said at once), or a summary of the rest.
    pub first: bool,
    pub interval: Duration,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.interval.as_secs();
        match (&self.peer, self.first) {
            (Some(p), true) => write!(
                f,
                "refused a connection from {p}: {}; more refusals from it for this reason are \
                 counted and said once per {secs} s",
                self.reason
            ),
            (Some(p), false) => write!(
                f,
                "refused {} more connections from {p} within {secs} s: {}",
                self.count, self.reason
            ),
            (None, _) => write!(
                f,
                "refused {} connections from other addresses within {secs} s (too many \
                 addresses to name each)",
                self.count
            ),
        }
    }
}

/// Where a listener's refusal lines go besides its log: a worker reports them to the master,
/// which records them in `events.jsonl`.
#[derive(Clone)]
pub struct RefusalSink(Arc<dyn Fn(&Refused) + Send + Sync>);

impl RefusalSink {
    pub fn new(f: impl Fn(&Refused) + Send + Sync + 'static) -> RefusalSink {
        RefusalSink(Arc::new(f))
    }

    pub fn send(&self, line: &Refused) {
        (self.0)(line)
    }
}

impl fmt::Debug for RefusalSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RefusalSink")
    }
}

#[derive(Debug)]
struct Pair {
    since: Instant,
    /// Refusals after the first in this interval.
    more: u64,
}

/// The refusals of one listener (see the module docs).
#[derive(Debug)]
pub struct Refusals {
    interval: Duration,
    pairs: BTreeMap<(IpAddr, String), Pair>,
    /// Refusals from pairs beyond [`MAX_TRACKED`], since `overflow.0`.
    overflow: Option<(Instant, u64)>,
    total: u64,
}

impl Refusals {
    pub fn new(interval: Duration) -> Refusals {
        Refusals {
            interval,
            pairs: BTreeMap::new(),
            overflow: None,
            total: 0,
        }
    }

    /// Every refusal noted so far.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Counts one refusal of a connection from `peer` at `now`; returns the lines to log now.
    pub fn note(&mut self, now: Instant, peer: IpAddr, reason: &str) -> Vec<Refused> {
        self.total += 1;
        let mut out = self.flush(now);
        let key = (peer, reason.to_string());
        if let Some(p) = self.pairs.get_mut(&key) {
            p.more += 1;
            return out;
        }
        if self.pairs.len() >= MAX_TRACKED {
            let o = self.overflow.get_or_insert((now, 0));
            o.1 += 1;
            return out;
        }
        self.pairs.insert(
            key,
            Pair {
                since: now,
                more: 0,
            },
        );
        out.push(Refused {
            peer: Some(peer),
            reason: reason.to_string(),
            count: 1,
            first: true,
            interval: self.interval,
        });
        out
    }

    /// The summaries of the intervals that ended by `now`; their pairs start afresh.
    pub fn flush(&mut self, now: Instant) -> Vec<Refused> {
        let interval = self.interval;
        self.flush_if(|since| now >= since + interval)
    }

    /// Every summary still owed (the listener closes).
    pub fn flush_all(&mut self) -> Vec<Refused> {
        self.flush_if(|_| true)
    }

    fn flush_if(&mut self, due: impl Fn(Instant) -> bool) -> Vec<Refused> {
        let mut out = Vec::new();
        let interval = self.interval;
        self.pairs.retain(|(peer, reason), p| {
            if !due(p.since) {
                return true;
            }
            if p.more > 0 {
                out.push(Refused {
                    peer: Some(*peer),
                    reason: reason.clone(),
                    count: p.more,
                    first: false,
                    interval,
                });
            }
            false
        });
        if let Some((since, count)) = self.overflow {
            if due(since) {
                self.overflow = None;
                out.push(Refused {
                    peer: None,
                    reason: String::new(),
                    count,
                    first: false,
                    interval,
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn a_flood_from_one_address_is_one_line_then_one_summary_per_interval() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut r = Refusals::new(Duration::from_secs(10));
        let first = r.note(t0, ip(1), "silent");
        assert_eq!(first.len(), 1);
        assert!(first[0].first && first[0].count == 1);
        for i in 1..=6408u32 {
            assert!(r.note(t0 + s * (i % 9), ip(1), "silent").is_empty());
        }
        assert!(r.flush(t0 + s * 9).is_empty(), "the interval has not ended");
        let lines = r.flush(t0 + s * 10);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert_eq!((lines[0].count, lines[0].first), (6408, false));
        assert!(lines[0].to_string().contains("6408 more"), "{}", lines[0]);
        assert_eq!(r.total(), 6409);
        // The next interval starts with a line said at once again.
        assert!(r.note(t0 + s * 11, ip(1), "silent")[0].first);
    }

    #[test]
    fn each_address_and_reason_gets_its_own_line() {
        let t0 = Instant::now();
        let mut r = Refusals::new(Duration::from_secs(10));
        assert_eq!(r.note(t0, ip(1), "silent").len(), 1);
        assert_eq!(r.note(t0, ip(1), "bad key").len(), 1);
        assert_eq!(r.note(t0, ip(2), "silent").len(), 1);
        assert!(r.note(t0, ip(2), "silent").is_empty());
        let lines = r.flush_all();
        assert_eq!(
            lines.len(),
            1,
            "only the pair with more than one: {lines:?}"
        );
        assert_eq!(lines[0].peer, Some(ip(2)));
        assert!(r.flush_all().is_empty());
    }

    #[test]
    fn a_flood_from_many_addresses_stays_bounded() {
        let t0 = Instant::now();
        let mut r = Refusals::new(Duration::from_secs(10));
        let mut said = 0;
        for i in 0..(MAX_TRACKED as u32 + 500) {
            let peer = IpAddr::from(i.to_be_bytes());
            said += r.note(t0, peer, "silent").len();
        }
        assert_eq!(said, MAX_TRACKED);
        let lines = r.flush_all();
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert_eq!((lines[0].peer, lines[0].count), (None, 500));
    }
}
