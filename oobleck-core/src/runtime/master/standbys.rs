//! The active master's standbys (design note `README.md`): each standby master connects to the
//! control port as `PeerRole::Standby { listen }`; this file keeps them, serves each
//! connection (a writer with heartbeats, a reader of its acknowledgements and beats, its lease),
//! and sends them the run directory's records ([`super::mirror`]). The master tells the agents
//! where the standbys take over (`Message::Standbys`), so an agent that loses the master looks
//! there next.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::conn::{write_loop, AbortOnDrop, Outgoing, Shared, OUTBOX};
use super::server::Master;
use crate::runtime::wire::protocol;
use crate::runtime::wire::{Message, WireError};

/// One connected standby.
pub(super) struct StandbyEntry {
    /// Where it takes over.
    pub listen: String,
    pub outbox: mpsc::Sender<Outgoing>,
    /// The last record it has on its disk.
    pub acked: Arc<AtomicU64>,
}

/// Serves one standby's connection until it closes or is silent for a lease.
pub(super) async fn serve_standby(
    mut r: OwnedReadHalf,
    w: OwnedWriteHalf,
    peer: SocketAddr,
    listen: String,
    shared: Arc<Shared>,
) {
    let id = shared.next_standby.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = mpsc::channel(OUTBOX);
    let acked = Arc::new(AtomicU64::new(0));
    let entry = StandbyEntry {
        listen: listen.clone(),
        outbox: tx,
        acked: acked.clone(),
    };
    shared.standbys_mut().insert(id, entry);
    info!(id, %peer, %listen, "standby master joined");
    let cfg = &shared.config;
    let writer = tokio::spawn(write_loop(
        w,
        rx,
        0,
        cfg.heartbeat_interval,
        cfg.write_timeout,
    ));
    let mut writer = AbortOnDrop(writer);
    let why = loop {
        let msg = tokio::select! {
            m = protocol::read_frame(&mut r, cfg.lease) => m,
            _ = &mut writer.0 => break "its writer stopped".to_string(),
        };
        match msg {
            Ok(Some(Message::Mirrored { seq })) => {
                acked.fetch_max(seq, Ordering::SeqCst);
            }
            Ok(Some(Message::Heartbeat { .. })) => {}
            Ok(Some(other)) => break format!("it sent {}", other.kind()),
            Ok(None) => break "its connection closed".into(),
            Err(WireError::Timeout { ms, .. }) => break format!("silent for {ms} ms"),
            Err(e) => break e.to_string(),
        }
    };
    shared.standbys_mut().remove(&id);
    if !shared.closing.load(Ordering::Relaxed) {
        warn!(id, %listen, %why, "standby master lost");
    }
}

/// The job is over: every standby is told so (it exits), best effort until `deadline`.
pub(super) async fn dismiss(shared: &Shared, reason: &str, deadline: tokio::time::Instant) {
    let outboxes: Vec<mpsc::Sender<Outgoing>> = shared
        .standbys_mut()
        .values()
        .map(|e| e.outbox.clone())
        .collect();
    for outbox in outboxes {
        let (done, written) = tokio::sync::oneshot::channel();
        let shutdown = Message::Shutdown {
            reason: reason.to_string(),
        };
        let out = Outgoing::told(shutdown, done);
        if let Ok(Ok(())) = tokio::time::timeout_at(deadline, outbox.send(out)).await {
            let _ = tokio::time::timeout_at(deadline, written).await;
        }
    }
}

impl Shared {
    pub(super) fn standbys_mut(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<u64, StandbyEntry>> {
        self.standbys.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Master {
    /// The standbys connected: `(id, where it takes over)`, oldest first.
    pub fn standbys(&self) -> Vec<(u64, String)> {
        let s = self.shared().standbys_mut();
        s.iter().map(|(&id, e)| (id, e.listen.clone())).collect()
    }

    /// Queues `msgs` for standby `id` (each with the raw bytes that follow it), in order,
    /// waiting at most `timeout` for room. An error means the standby is gone or stuck: it is
    /// dropped.
    pub async fn send_standby(
        &self,
        id: u64,
        msgs: Vec<(Message, Vec<u8>)>,
        timeout: Duration,
    ) -> Result<(), String> {
        let outbox = match self.shared().standbys_mut().get(&id) {
            Some(e) => e.outbox.clone(),
            None => return Err("it is gone".into()),
        };
        for (msg, payload) in msgs {
            let out = Outgoing {
                payload,
                ..Outgoing::new(msg)
            };
            match tokio::time::timeout(timeout, outbox.send(out)).await {
                Ok(Ok(())) => {}
                _ => {
                    self.drop_standby(id);
                    return Err(format!("it took no record within {timeout:?}"));
                }
            }
        }
        Ok(())
    }

    /// The last record standby `id` has on its disk (`None`: it is gone).
    pub fn standby_acked(&self, id: u64) -> Option<u64> {
        let s = self.shared().standbys_mut();
        s.get(&id).map(|e| e.acked.load(Ordering::SeqCst))
    }

    /// Stops counting on standby `id` (it is behind, or gone): its connection closes.
    pub fn drop_standby(&self, id: u64) {
        self.shared().standbys_mut().remove(&id);
    }
}
