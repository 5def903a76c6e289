//! The live status page `train` serves while a cluster job runs (`--status-addr`): the
//! cluster map, the plan as pipelines of stages, live charts, per-rank times, the event log,
//! kill and drain actions, `/api/status` (what `oobleck status` prints) and `/metrics`.
//!
//! ```text
//!   master (control plane) ──request_status──► MasterView ─┐  one Snapshot per 250 ms,
//!   run dir: metrics.jsonl, events.jsonl ──Feed (tails)──────┴─► taken on a request ─► view
//!                                       (/api/status) and metrics (/metrics), sent as bytes
//!                         └──report::read_run, on change──► charts ─► /charts/*.svg
//!   browser ──HTTP (axum)──► limit (per client) ──► auth::Gate ──► routes
//!                                                   └──► request_kill / request_drain
//! ```
//!
//! The page is a client of the master like `oobleck status`: it asks over the authenticated
//! control plane and reads the run directory, so the master knows nothing of HTTP. It runs
//! on its own thread and tokio runtime and stops when dropped.

pub mod auth;
mod charts;
pub mod client;
pub mod feed;
pub mod limit;
pub mod metrics;
mod routes;
pub mod snapshot;
#[cfg(test)]
mod tests;
pub mod view;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use oobleck_core::runtime::wire::client::request_status;
use oobleck_core::runtime::wire::protocol::ClusterStatus;
use oobleck_core::runtime::wire::Token;

use self::auth::Gate;
use self::limit::{Limiter, Rate, DEFAULT_RATE};
use self::snapshot::{Snapshot, REFRESH};

/// The longest one status request may take.
pub(crate) const ASK_TIMEOUT: Duration = Duration::from_secs(3);
/// After the stop signal, the longest open connections get to finish.
const STOP_GRACE: Duration = Duration::from_secs(2);

/// `--status-addr`: `None` (the default: 127.0.0.1 and a free port), `off`, or HOST:PORT.
pub fn parse_addr(flag: Option<&str>) -> Result<Option<SocketAddr>> {
    match flag.map(str::trim) {
        None => Ok(Some(SocketAddr::from(([127, 0, 0, 1], 0)))),
        Some("off" | "none") => Ok(None),
        Some(a) => oobleck_core::runtime::net::resolve(a)
            .map(Some)
            .with_context(|| format!("--status-addr {a}: expected HOST:PORT or `off`")),
    }
}

/// The master's newest answer.
#[derive(Debug, Default)]
pub struct MasterView {
    pub status: Option<ClusterStatus>,
    pub up: bool,
    pub error: Option<String>,
    /// When it last answered.
    answered: Option<Instant>,
}

/// How the page spares the machine it runs on; the tests shorten or stretch both.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tuning {
    /// How old a reading of the run and the master may be when a request comes.
    pub refresh: Duration,
    /// How often each client may ask.
    pub rate: Rate,
}

impl Default for Tuning {
    fn default() -> Tuning {
        Tuning {
            refresh: REFRESH,
            rate: DEFAULT_RATE,
        }
    }
}

/// What the handlers share.
pub(crate) struct Shared {
    pub gate: Gate,
    pub run: PathBuf,
    pub master: SocketAddr,
    pub token: Token,
    pub fault_threshold: u64,
    /// The header `/api/status` repeats: `config.json`, written before the job starts.
    pub job: serde_json::Value,
    pub tuning: Tuning,
    /// Locked across a refresh, so requests that come meanwhile wait for it instead of
    /// reading and asking again.
    snapshot: tokio::sync::Mutex<Snapshot>,
    /// Readings taken so far (the tests count them).
    pub refreshes: AtomicU64,
    pub limiter: Mutex<Limiter>,
    /// Refused requests whose answer is being held (see `routes::refuse`).
    pub held: AtomicUsize,
    pub charts: Mutex<charts::Cache>,
}

impl Shared {
    /// The newest reading, taken anew first if it is older than [`Tuning::refresh`].
    pub async fn snapshot(&self) -> tokio::sync::MutexGuard<'_, Snapshot> {
        let mut snap = self.snapshot.lock().await;
        if snap.stale(Instant::now(), self.tuning.refresh) {
            let answer = request_status(self.master, &self.token, ASK_TIMEOUT).await;
            snap.take(answer, self.master, Instant::now());
            self.refreshes.fetch_add(1, Ordering::Relaxed);
        }
        snap
    }

    pub fn limiter(&self) -> std::sync::MutexGuard<'_, Limiter> {
        self.limiter.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A running status page; stops when dropped.
pub struct StatusPage {
    addr: SocketAddr,
    login_key: String,
    stop: Option<tokio::sync::watch::Sender<bool>>,
    thread: Option<std::thread::JoinHandle<()>>,
    shared: Arc<Shared>,
}

impl StatusPage {
    /// Binds `addr` (an error names it when taken) and serves the job whose master listens at
    /// `master` with `token`, reading `run`.
    pub fn start(
        addr: SocketAddr,
        run: PathBuf,
        master: SocketAddr,
        token: &Token,
        fault_threshold: u64,
    ) -> Result<StatusPage> {
        Self::start_tuned(addr, run, master, token, fault_threshold, Tuning::default())
    }

    /// [`start`](Self::start) with other intervals and rates than the defaults.
    pub(crate) fn start_tuned(
        addr: SocketAddr,
        run: PathBuf,
        master: SocketAddr,
        token: &Token,
        fault_threshold: u64,
        tuning: Tuning,
    ) -> Result<StatusPage> {
        let listener = std::net::TcpListener::bind(addr).with_context(|| {
            format!(
                "the status page cannot listen on {addr} (is the port in use?): pass another \
                 --status-addr, or leave it out for a free port on 127.0.0.1"
            )
        })?;
        listener.set_nonblocking(true)?;
        let bound = listener.local_addr()?;
        let gate = Gate::new(token.expose(), bound.ip().is_loopback());
        let login_key = gate.mint_key();
        let config = std::fs::read_to_string(run.join("config.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok());
        let job = view::job(config.as_ref(), &run.display().to_string());
        let shared = Arc::new(Shared {
            gate,
            job,
            tuning,
            snapshot: tokio::sync::Mutex::new(Snapshot::new(&run)),
            refreshes: AtomicU64::new(0),
            limiter: Mutex::new(Limiter::new(tuning.rate)),
            held: AtomicUsize::new(0),
            run,
            master,
            token: token.clone(),
            fault_threshold,
            charts: Mutex::default(),
        });
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let serving = shared.clone();
        let thread = std::thread::Builder::new()
            .name("status-page".into())
            .spawn(move || serve(listener, serving, stopped))
            .context("starting the status page's thread")?;
        Ok(StatusPage {
            addr: bound,
            login_key,
            stop: Some(stop),
            thread: Some(thread),
            shared,
        })
    }

    /// Readings of the run and the master taken so far.
    pub fn refreshes(&self) -> u64 {
        self.shared.refreshes.load(Ordering::Relaxed)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The page's address, `http://HOST:PORT/`.
    pub fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    /// The one-time link that logs a browser in (actions; every page off loopback).
    pub fn login_link(&self) -> String {
        format!("http://{}/login?key={}", self.addr, self.login_key)
    }
}

impl Drop for StatusPage {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(true);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The page's thread: the HTTP server, until told to stop.
fn serve(
    listener: std::net::TcpListener,
    shared: Arc<Shared>,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "status page: starting its runtime");
            return;
        }
    };
    rt.block_on(async move {
        let listener = match tokio::net::TcpListener::from_std(listener) {
            Ok(l) => l,
            Err(e) => return tracing::error!(error = %e, "status page: its listener"),
        };
        let mut graceful = stopped.clone();
        // The peer's address is what the rate limit counts by.
        let app = routes::router(shared).into_make_service_with_connect_info::<SocketAddr>();
        let server = axum::serve(listener, app).with_graceful_shutdown(async move {
            let _ = graceful.wait_for(|s| *s).await;
        });
        let hard_stop = async move {
            let _ = stopped.wait_for(|s| *s).await;
            tokio::time::sleep(STOP_GRACE).await;
        };
        tokio::select! {
            r = server => if let Err(e) = r {
                tracing::error!(error = %e, "status page: serving");
            },
            _ = hard_stop => {}
        }
    });
}
