//! A standby master (`train standby`, design note `README.md`): it registers with the active
//! master as `PeerRole::Standby { listen }`, writes the run directory's records into its own
//! copy (acknowledging each, so the master commits a step only once the copy holds it), and
//! beats. It returns when the master is lost (its connection closed or silent for a lease), so
//! that its caller takes over at `listen` from the copy (`train --resume COPY --reattach`), or
//! when the master says the job is over.
//!
//! Taking over needs the agents: a restarted master re-adopts them only as they come back,
//! and an agent comes only once it lost the master too. So a standby cut off from a master
//! the agents still hear takes over nothing (its re-adoption waits in vain and ends).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use tokio::sync::mpsc;

use super::mirror;
use crate::runtime::error::{Context, Result, RuntimeError};
use crate::runtime::net::resolve;
use crate::runtime::node::link::write_loop;
use crate::runtime::wire::client::open;
use crate::runtime::wire::protocol::{self, PeerRole};
use crate::runtime::wire::{Message, Token, WireError};

/// Bound of the registration and of every write to the master.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(10);
/// Acknowledgements queued before the reader waits for the writer.
const ACKS: usize = 64;

/// How a standby finds its master and where it keeps its copy.
#[derive(Debug, Clone)]
pub struct StandbyOptions {
    /// The active master's control address, `HOST:PORT`.
    pub master: String,
    pub token: String,
    /// Its copy of the run directory.
    pub copy: PathBuf,
    /// Where it takes over (told to the agents).
    pub listen: SocketAddr,
    /// How long to keep trying while the master cannot be reached.
    pub wait: Duration,
}

/// How a standby's watch ended.
#[derive(Debug, Clone, PartialEq)]
pub enum StandbyEnd {
    /// The master was lost, and why: take over.
    MasterLost(String),
    /// The master said the job is over.
    Finished(String),
}

/// Keeps a copy of the master's run directory until the master is lost or the job is over.
/// Builds its own (single-threaded) tokio runtime.
pub fn run_standby(opts: &StandbyOptions) -> Result<StandbyEnd> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ctx("starting the standby's runtime")?;
    rt.block_on(watch(opts))
}

async fn watch(opts: &StandbyOptions) -> Result<StandbyEnd> {
    std::fs::create_dir_all(&opts.copy).map_err(|source| RuntimeError::Io {
        path: opts.copy.clone(),
        source,
    })?;
    let token = Token::new(&opts.token).ctx("the job token")?;
    let master = resolve(&opts.master)?;
    let role = PeerRole::Standby {
        listen: opts.listen.to_string(),
    };
    let deadline = tokio::time::Instant::now() + opts.wait;
    let (mut r, w, welcomed) = loop {
        match open(master, &token, role.clone(), CONTROL_TIMEOUT).await {
            Ok(c) => break c,
            Err(WireError::Io { .. } | WireError::Timeout { .. })
                if tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(500)).await
            }
            Err(e) => {
                return Err(e).with_ctx(|| format!("registering with the master at {master}"))
            }
        }
    };
    eprintln!(
        "oobleck standby: keeping a copy of the run in {} for the master at {master}; takes \
         over at {} if it is lost",
        opts.copy.display(),
        opts.listen
    );
    // Acknowledgements as they come, and a heartbeat every interval (a standby is no node: 0).
    let (acks, rx) = mpsc::channel(ACKS);
    let paused = Arc::new(AtomicBool::new(false));
    let beats = write_loop(w, rx, 0, welcomed.heartbeat, CONTROL_TIMEOUT, paused);
    let writer = tokio::spawn(beats);
    let end = loop {
        let msg = match protocol::read_frame(&mut r, welcomed.lease).await {
            Ok(Some(m)) => m,
            Ok(None) => break StandbyEnd::MasterLost("its connection closed".into()),
            Err(WireError::Timeout { ms, .. }) => {
                break StandbyEnd::MasterLost(format!("silent for its lease of {ms} ms"))
            }
            Err(e) => break StandbyEnd::MasterLost(e.to_string()),
        };
        match msg {
            Message::Mirror {
                seq,
                path,
                offset,
                truncate,
                hex,
            } => {
                let bytes = hex::decode(&hex).map_err(|e| RuntimeError::Protocol {
                    who: "the master".into(),
                    what: format!("a mirror record of {path} that is not hex: {e}"),
                })?;
                mirror::apply(&opts.copy, &path, offset, truncate, &bytes).map_err(|what| {
                    RuntimeError::Protocol {
                        who: "this standby".into(),
                        what: format!("cannot keep its copy: {what}"),
                    }
                })?;
                let ack = Message::Mirrored { seq };
                if acks.send(ack).await.is_err() {
                    break StandbyEnd::MasterLost("its connection failed".into());
                }
            }
            Message::Shutdown { reason } => break StandbyEnd::Finished(reason),
            Message::Refused { reason } => {
                return Err(RuntimeError::Protocol {
                    who: format!("the master at {master}"),
                    what: format!("refused this standby: {reason}"),
                })
            }
            _ => {}
        }
    };
    writer.abort();
    Ok(end)
}
