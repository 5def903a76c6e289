//! How often each client may ask: a token bucket per client, a pure decision told the time
//! (no clock, no socket), so its tests are tables.
//!
//! A client is its IP address, and whether its request carries credentials the page knows:
//! on loopback every local client shares 127.0.0.1, and a logged-in page (or `oobleck status`
//! with the token) keeps working while an anonymous script on the same machine floods.
//! Credentials the page does not know count as none, so inventing cookies buys no new bucket.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// Requests a client may make at once, then how many a second.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rate {
    pub burst: f64,
    pub per_s: f64,
}

/// The page's own traffic is a poll of `/api/status` a second, three charts when they change
/// (at most each poll) and seven requests when it loads; two tabs and `oobleck status` fit in
/// a tenth of this. A flood is held to 20 cheap answers a second (each one served from the
/// snapshot), a few percent of one core.
pub const DEFAULT_RATE: Rate = Rate {
    burst: 60.0,
    per_s: 20.0,
};

/// Clients remembered at most; past it, the ones whose buckets refilled are forgotten (a
/// full bucket is what a new client gets anyway).
const CLIENTS_KEPT: usize = 4096;

/// Who a bucket belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Client {
    pub ip: IpAddr,
    /// The request carries the job's token or a session the page issued.
    pub known: bool,
}

#[derive(Clone, Copy, Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// The buckets of every client seen lately.
#[derive(Debug)]
pub struct Limiter {
    rate: Rate,
    buckets: HashMap<Client, Bucket>,
}

impl Limiter {
    pub fn new(rate: Rate) -> Limiter {
        Limiter {
            rate,
            buckets: HashMap::new(),
        }
    }

    /// Whether `client` may be answered at `now`; if not, how long until it may.
    pub fn admit(&mut self, client: Client, now: Instant) -> Result<(), Duration> {
        if self.buckets.len() >= CLIENTS_KEPT && !self.buckets.contains_key(&client) {
            self.forget_full(now);
        }
        let rate = self.rate;
        let b = self.buckets.entry(client).or_insert(Bucket {
            tokens: rate.burst,
            at: now,
        });
        b.tokens = refilled(b, rate, now);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            return Ok(());
        }
        Err(Duration::from_secs_f64((1.0 - b.tokens) / rate.per_s))
    }

    /// Drops the clients whose buckets are full again; if none is (many clients at once,
    /// off loopback), every one: each starts again with a full bucket, as a new one would.
    fn forget_full(&mut self, now: Instant) {
        let rate = self.rate;
        self.buckets
            .retain(|_, b| refilled(b, rate, now) < rate.burst);
        if self.buckets.len() >= CLIENTS_KEPT {
            self.buckets.clear();
        }
    }
}

/// `b`'s tokens at `now` (a `now` before its last look adds nothing).
fn refilled(b: &Bucket, rate: Rate, now: Instant) -> f64 {
    let dt = now.saturating_duration_since(b.at).as_secs_f64();
    (b.tokens + dt * rate.per_s).min(rate.burst)
}

/// `Retry-After` in whole seconds (the header has no fractions), at least 1.
pub fn retry_after_s(wait: Duration) -> u64 {
    wait.as_secs_f64().ceil().max(1.0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    const RATE: Rate = Rate {
        burst: 3.0,
        per_s: 2.0,
    };

    fn client(last: u8, known: bool) -> Client {
        Client {
            ip: IpAddr::from([10, 0, 0, last]),
            known,
        }
    }

    #[test]
    fn a_client_gets_its_burst_then_one_request_per_refill_while_others_are_served() {
        let mut l = Limiter::new(RATE);
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let (a, b) = (client(1, false), client(2, false));
        // (client, ms, admitted, wait in ms when not)
        let table: [(Client, u64, Option<u64>); 9] = [
            (a, 0, None),
            (a, 0, None),
            (a, 0, None),
            (a, 0, Some(500)),
            (b, 0, None),
            (a, 250, Some(250)),
            (a, 500, None),
            (a, 500, Some(500)),
            (b, 500, None),
        ];
        for (i, (c, at, refused)) in table.into_iter().enumerate() {
            let got = l.admit(c, ms(at)).err().map(|d| d.as_millis() as u64);
            assert_eq!(got, refused, "row {i}");
        }
    }

    #[test]
    fn known_credentials_have_a_bucket_apart_from_anonymous_requests_of_the_same_ip() {
        let mut l = Limiter::new(RATE);
        let now = Instant::now();
        for _ in 0..3 {
            l.admit(client(1, false), now).unwrap();
        }
        assert!(l.admit(client(1, false), now).is_err());
        assert_eq!(l.admit(client(1, true), now), Ok(()));
    }

    #[test]
    fn a_bucket_refills_to_its_burst_and_no_further() {
        let mut l = Limiter::new(RATE);
        let t0 = Instant::now();
        l.admit(client(1, false), t0).unwrap();
        let later = t0 + Duration::from_secs(3600);
        for _ in 0..3 {
            l.admit(client(1, false), later).unwrap();
        }
        assert!(l.admit(client(1, false), later).is_err());
    }

    #[test]
    fn many_clients_are_forgotten_not_kept_forever() {
        let mut l = Limiter::new(RATE);
        let now = Instant::now();
        for i in 0..(CLIENTS_KEPT as u32 + 10) {
            let ip = IpAddr::from(std::net::Ipv4Addr::from(i));
            l.admit(Client { ip, known: false }, now).unwrap();
        }
        assert!(l.buckets.len() <= CLIENTS_KEPT, "{}", l.buckets.len());
    }

    #[test]
    fn retry_after_is_whole_seconds_and_never_zero() {
        assert_eq!(retry_after_s(Duration::from_millis(50)), 1);
        assert_eq!(retry_after_s(Duration::from_millis(1500)), 2);
    }
}
