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
use crate::runtime::wire::client::{open, Welcomed};
use crate::runtime::wire::protocol::{self, PeerRole};
use crate::runtime::wire::{Message, Token, WireError};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

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
    rt.block_on(keep(opts))
}

/// How long a standby that lost its master waits for a standby ahead of it (told earlier to
/// the agents) to take over, before it takes over itself. The senior noticed the loss within
/// a heartbeat of this one, and then starts as the master: a new process that reads its copy
/// and builds the workload, seconds on a loaded machine. The agents look for a master for
/// `--master-wait` (60 s by default), so waiting 15 s for the senior costs them nothing when
/// it comes, and delays the take-over by that when it died with the master.
const FOLLOW_WAIT: Duration = Duration::from_secs(15);

/// Watches the master; when it is lost, follows the first standby ahead of this one that
/// took over (becoming its standby, so the job keeps one less standby rather than two
/// masters re-adopting), or ends so that this one takes over.
async fn keep(opts: &StandbyOptions) -> Result<StandbyEnd> {
    std::fs::create_dir_all(&opts.copy).map_err(|source| RuntimeError::Io {
        path: opts.copy.clone(),
        source,
    })?;
    let token = Token::new(&opts.token).ctx("the job token")?;
    let first = resolve(&opts.master)?;
    let mut link = register(first, &token, opts, opts.wait)
        .await
        .with_ctx(|| format!("registering with the master at {first}"))?;
    loop {
        let (end, seniors) = watch(opts, link).await?;
        let StandbyEnd::MasterLost(why) = &end else {
            return Ok(end);
        };
        match follow(&seniors, &token, opts).await {
            Some(next) => {
                eprintln!(
                    "oobleck standby: the master is lost ({why}); the standby at {} took over, \
                     and this one keeps its copy for it",
                    next.0
                );
                link = next;
            }
            None => return Ok(end),
        }
    }
}

/// A standby's registered connection: the master's address, and the connection.
type Link = (SocketAddr, (OwnedReadHalf, OwnedWriteHalf, Welcomed));

/// Registers as a standby with `master`, trying again while it cannot be reached, for `wait`.
async fn register(
    master: SocketAddr,
    token: &Token,
    opts: &StandbyOptions,
    wait: Duration,
) -> std::result::Result<Link, WireError> {
    let role = PeerRole::Standby {
        listen: opts.listen.to_string(),
    };
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match open(master, token, role.clone(), CONTROL_TIMEOUT).await {
            Ok(c) => return Ok((master, c)),
            Err(WireError::Io { .. } | WireError::Timeout { .. })
                if tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(250)).await
            }
            Err(e) => return Err(e),
        }
    }
}

/// The first of `seniors` (the standbys ahead of this one) that answers as a master within
/// [`FOLLOW_WAIT`], registered with.
async fn follow(seniors: &[SocketAddr], token: &Token, opts: &StandbyOptions) -> Option<Link> {
    let deadline = tokio::time::Instant::now() + FOLLOW_WAIT;
    while !seniors.is_empty() && tokio::time::Instant::now() < deadline {
        for &senior in seniors {
            let once = Duration::ZERO;
            if let Ok(link) = register(senior, token, opts, once).await {
                return Some(link);
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    None
}

/// Keeps the copy for the master of `link` until it is lost or the job is over; with the
/// standbys the master named ahead of this one.
async fn watch(opts: &StandbyOptions, link: Link) -> Result<(StandbyEnd, Vec<SocketAddr>)> {
    let (master, (mut r, w, welcomed)) = link;
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
    let mut seniors = Vec::new();
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
                len,
            } => {
                let bytes = match protocol::read_payload(&mut r, len, welcomed.lease).await {
                    Ok(b) => b,
                    Err(e) => break StandbyEnd::MasterLost(format!("{path}'s bytes: {e}")),
                };
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
            Message::Standbys { addrs } => seniors = ahead_of(&addrs, opts.listen),
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
    Ok((end, seniors))
}

/// The standbys of `addrs` (in the master's order) ahead of the one at `me`: all of them if
/// `me` is not named yet.
fn ahead_of(addrs: &[String], me: SocketAddr) -> Vec<SocketAddr> {
    let all: Vec<SocketAddr> = addrs.iter().filter_map(|a| a.parse().ok()).collect();
    match all.iter().position(|&a| a == me) {
        Some(i) => all[..i].to_vec(),
        None => all,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_standby_follows_only_those_named_before_it() {
        let me: SocketAddr = "10.0.0.2:7002".parse().unwrap();
        let addrs = ["10.0.0.1:7001", "10.0.0.2:7002", "10.0.0.3:7003"].map(String::from);
        assert_eq!(ahead_of(&addrs, me), vec!["10.0.0.1:7001".parse().unwrap()]);
        assert!(ahead_of(&addrs[1..], me).is_empty());
        // Not named yet: it joined last, after every one of them.
        assert_eq!(ahead_of(&addrs[..1], me).len(), 1);
    }
}
