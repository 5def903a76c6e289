//! The flood: client threads asking a status page for `/api/status` back to back, each on a
//! fresh connection (a `curl` loop), never waiting between requests nor heeding `Retry-After`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

/// How long one request may take before it counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// What the flood got.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Answers {
    pub clients: usize,
    pub seconds: f64,
    /// 200: answered.
    pub ok: u64,
    /// 429: refused by the rate limit.
    pub refused: u64,
    /// Any other status.
    pub other: u64,
    /// No answer (refused connection, timeout, cut).
    pub failed: u64,
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    refused: AtomicU64,
    other: AtomicU64,
    failed: AtomicU64,
}

/// A running flood; [`Flood::stop`] ends it.
pub struct Flood {
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
    threads: Vec<std::thread::JoinHandle<()>>,
    started: Instant,
}

impl Flood {
    /// `clients` threads asking the page at `addr`.
    pub fn start(addr: SocketAddr, clients: usize) -> std::io::Result<Flood> {
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Tally::default());
        let mut threads = Vec::with_capacity(clients);
        for i in 0..clients {
            let (stop, tally) = (stop.clone(), tally.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("flood-{i}"))
                    .spawn(move || {
                        while !stop.load(Ordering::Relaxed) {
                            let counter = match ask(addr) {
                                Some(200) => &tally.ok,
                                Some(429) => &tally.refused,
                                Some(_) => &tally.other,
                                None => &tally.failed,
                            };
                            counter.fetch_add(1, Ordering::Relaxed);
                        }
                    })?,
            );
        }
        Ok(Flood {
            stop,
            tally,
            threads,
            started: Instant::now(),
        })
    }

    /// Stops every client (each after its request in flight) and counts the answers.
    pub fn stop(mut self) -> Answers {
        self.stop.store(true, Ordering::Relaxed);
        let seconds = self.started.elapsed().as_secs_f64();
        let clients = self.threads.len();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Answers {
            clients,
            seconds,
            ok: n(&self.tally.ok),
            refused: n(&self.tally.refused),
            other: n(&self.tally.other),
            failed: n(&self.tally.failed),
        }
    }
}

impl Drop for Flood {
    /// A flood not stopped (an error on the way) stops with its owner.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// One `GET /api/status`: its status code, or `None` without an answer.
fn ask(addr: SocketAddr) -> Option<u16> {
    let mut s = TcpStream::connect_timeout(&addr, REQUEST_TIMEOUT).ok()?;
    s.set_read_timeout(Some(REQUEST_TIMEOUT)).ok()?;
    let req = format!("GET /api/status HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).ok()?;
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).ok()?;
    // "HTTP/1.1 200 OK"
    let line = answer.split(|&b| b == b'\r').next()?;
    std::str::from_utf8(line)
        .ok()?
        .split(' ')
        .nth(1)?
        .parse()
        .ok()
}
