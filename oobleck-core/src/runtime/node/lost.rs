//! An agent that lost its master: the master's process died (SIGKILL, a machine gone), its
//! connection was cut, it fell silent for a lease, or (a local agent) the process that started
//! it is gone. The master is a single machine's process while the workers' state is the job's
//! most expensive asset, so the agent does not stop its workers at once: they keep their
//! committed state in memory (the step in flight is computed, its `Ready` sent, and it waits
//! for a commit that only a master can give), and the agent looks for a master on the
//! schedule of `lookup.rs` for `--master-wait`. No master in that time: it stops its workers
//! and exits, so nothing outlives the wait.
//!
//! A master found in time takes the agent as a new node: the workers of the lost master are
//! stopped first (adopting them, with what they hold, is a later step: `--reattach`).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::lookup::{Lookup, Next};
use super::spawn::stop_workers;
use super::{Agent, Local, NodeAgent, GRACE, POLL};
use crate::runtime::wire::protocol::Return;
use crate::runtime::wire::{Token, WireError};

/// Bound of one try at an address while looking for a master: a live master answers in
/// milliseconds, and a stopped one (SIGSTOP) still accepts connections but never answers, so
/// each try at it must end soon for the standbys after it to be tried.
const TRY_TIMEOUT: Duration = Duration::from_secs(3);

/// How a search for a master ended.
pub(super) enum Search {
    /// A master at this address (as resolved, and as the agent knew it) registered this agent:
    /// as a new node, or ([`Agent::adopted`]) as its old one.
    Found(Agent, SocketAddr, String),
    /// The node was told to leave (SIGTERM, a preemption notice) while it had no master:
    /// there is no one to release it, so it goes at once.
    Left(String),
    /// No master took it within the wait: why.
    GaveUp(String),
}

/// What one try at an address found.
enum Reach {
    Found(Agent, SocketAddr),
    /// Nothing that answers as a master there (yet): try again later.
    Absent,
    /// A master that is not this job's to serve (why): of an epoch below one this agent has
    /// seen (replaced), or one that refuses it (another job's token, another version, now at
    /// the lost master's address). The addresses after it, and later tries, may still find
    /// the job's master.
    PassedOver(String),
}

impl NodeAgent {
    /// The master is lost (`why`): keeps the workers and looks for a master until
    /// `--master-wait` runs out.
    pub(super) async fn outlive_master(
        &mut self,
        why: &str,
        local_rx: &mut mpsc::UnboundedReceiver<Local>,
    ) -> Search {
        let mut lookup = Lookup::new(self.masters.clone(), self.master_wait);
        eprintln!("{}", self.loss_line(why, lookup.addrs()));
        if let Some(l) = &self.leaving {
            return Search::Left(l.reason.clone());
        }
        let start = Instant::now();
        loop {
            match lookup.next(start.elapsed()) {
                Next::GiveUp => return Search::GaveUp(self.gave_up_line()),
                Next::Pause(d) => {
                    if let Some(reason) = self.idle(d, local_rx).await {
                        return Search::Left(reason);
                    }
                }
                Next::Try { addr, .. } => {
                    let limit = lookup.try_limit(start.elapsed(), TRY_TIMEOUT);
                    let back = self.holding(start.elapsed());
                    match reach(&addr, &self.token, back, limit).await {
                        Reach::Found(conn, at) => return Search::Found(conn, at, addr),
                        Reach::Absent => {}
                        Reach::PassedOver(why) => self.pass_over(&addr, &why),
                    }
                }
            }
        }
    }

    /// Says (once per address) why the master at `addr` is passed over.
    fn pass_over(&mut self, addr: &str, why: &str) {
        if self.passed_over.insert(addr.to_string()) {
            eprintln!(
                "oobleck agent: node {}: passing over the master at {addr} ({why}); looking on",
                self.node
            );
        }
    }

    /// The line that tells the user what the agent does now.
    fn loss_line(&self, why: &str, addrs: &[String]) -> String {
        format!(
            "oobleck agent: node {}: master lost at step {} ({why}); looking for a master at \
             {} for {} s (--master-wait); its {} worker(s) keep their state meanwhile",
            self.node,
            self.committed,
            addrs.join(", "),
            self.master_wait.as_secs(),
            self.workers.len()
        )
    }

    fn gave_up_line(&self) -> String {
        format!(
            "no master within --master-wait {} s",
            self.master_wait.as_secs()
        )
    }

    /// Waits `d` between tries: reaps workers that exit (their exits cannot be told to
    /// anyone) and drops their reports. Returns why the node leaves if it is told to.
    async fn idle(
        &mut self,
        d: Duration,
        local_rx: &mut mpsc::UnboundedReceiver<Local>,
    ) -> Option<String> {
        let until = Instant::now() + d;
        loop {
            let tick = (Instant::now() + POLL).min(until);
            tokio::select! {
                ev = local_rx.recv() => {
                    // Reports and beats reach no master; stdin closing says nothing new. A stage
                    // built is remembered: it is what a restarted master re-adopts.
                    // Beats keep the watchdog's view current, so that a re-adopting master
                    // does not find it stale.
                    match ev {
                        Some(Local::Leave(reason)) => return Some(reason),
                        Some(Local::Report(_, Ok((g, report)))) => self.note_formed(g, &report),
                        Some(Local::Beat(device, Ok(s))) => self.on_beat(device, s),
                        _ => {}
                    }
                }
                _ = tokio::time::sleep_until(tick) => {}
            }
            self.forget_exited().await;
            if Instant::now() >= until {
                return None;
            }
        }
    }

    /// Reaps workers that exited while there is no master; says so.
    async fn forget_exited(&mut self) {
        if let Err(e) = self.reap_workers().await {
            eprintln!("oobleck agent: node {}: {e}", self.node);
        }
        for gone in std::mem::take(&mut self.exited) {
            eprintln!(
                "oobleck agent: node {}: worker rank {} exited while the master is lost",
                self.node,
                gone.rank()
            );
        }
    }

    /// What this agent tells a master it comes back to: its id, and the workers of its
    /// generation that built their stage and still run.
    fn holding(&self, without_master: Duration) -> Return {
        Return {
            without_master_ms: without_master.as_millis() as u64,
            epoch: self.epoch,
            node: self.node,
            devices: 1,
            generation: self.generation,
            committed: self.committed,
            ranks: self
                .workers
                .iter()
                .map(|w| w.rank)
                .filter(|r| self.formed.contains(r))
                .collect(),
        }
    }

    /// A master restarted on the job's run directory gave this agent its old id back: it
    /// keeps its workers, which go on from the committed step they hold.
    pub(super) fn carry_on(&mut self, conn: Agent, at: SocketAddr, addr: String) {
        eprintln!(
            "oobleck agent: node {}: the master at {at} re-adopts this node and its {} \
             worker(s) at committed step {}",
            self.node,
            self.workers.len(),
            self.committed
        );
        self.epoch = self.epoch.max(conn.epoch());
        self.conn = conn;
        self.master = at;
        // Its master from now on; the standbys it names come next.
        self.masters = vec![addr];
        // Whatever started this agent, its master is the one it serves now.
        self.parent_gone_ok = true;
        // The time without a master is no worker's hang: the watches start over.
        let devices: Vec<u32> = self.watch.keys().copied().collect();
        self.rewatch(devices.into_iter());
    }

    /// A master found after a loss takes this agent as a new node: the lost master's workers
    /// go (a master that is not the lost one restarted on its run directory cannot adopt
    /// them), and the agent starts over with `conn`.
    pub(super) async fn start_over(&mut self, conn: Agent, at: SocketAddr, addr: String) {
        eprintln!(
            "oobleck agent: node {}: found a master at {at}; it takes this agent as node {} \
             (the lost master's workers are stopped: this master does not re-adopt them)",
            self.node,
            conn.node()
        );
        stop_workers(&mut self.workers, GRACE).await;
        self.node = conn.node();
        self.epoch = self.epoch.max(conn.epoch());
        self.conn = conn;
        self.master = at;
        self.masters = vec![addr];
        self.parent_gone_ok = true;
        self.job = None;
        self.generation = 0;
        self.committed = 0;
        self.exited.clear();
        self.ranks.clear();
        self.formed.clear();
        self.watch.clear();
        self.limits_told = false;
    }

    /// No master in time (`why`): stops the workers, gently (their stdin closes and they
    /// exit), and returns the error the agent exits with.
    pub(super) async fn give_up(&mut self, why: String) -> crate::runtime::error::RuntimeError {
        eprintln!("oobleck agent: node {}: {why}; stopping workers", self.node);
        stop_workers(&mut self.workers, GRACE).await;
        self.error(format!("{why}; its workers were stopped"))
    }
}

/// One try at `addr`, bounded by `limit`: resolved at each try, so that a name that moves to
/// another machine (a restarted VM, a Kubernetes Service) is followed.
async fn reach(addr: &str, token: &Token, back: Return, limit: Duration) -> Reach {
    let resolved = tokio::time::timeout(limit, tokio::net::lookup_host(addr)).await;
    let Some(at) = resolved
        .ok()
        .and_then(|r| r.ok())
        .and_then(|mut it| it.next())
    else {
        return Reach::Absent;
    };
    let seen = back.epoch;
    match Agent::reconnect(at, token, back, limit).await {
        Ok(conn) if conn.epoch() < seen => {
            Reach::PassedOver(format!("its epoch {} was replaced by {seen}", conn.epoch()))
        }
        Ok(conn) => Reach::Found(conn, at),
        Err(e @ (WireError::Refused { .. } | WireError::UnsupportedVersion { .. })) => {
            Reach::PassedOver(e.to_string())
        }
        Err(_) => Reach::Absent,
    }
}
