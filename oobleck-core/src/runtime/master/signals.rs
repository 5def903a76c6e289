//! SIGTERM and SIGINT to the master. The first asks the job to stop after its next step, with
//! that step's checkpoint, and exit 0; a second stops it at once. Local agents and workers
//! ignore SIGINT (see `entry::agent_command`), so a Ctrl-C at the terminal, which signals the
//! whole process group, reaches the job through the master alone.

use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

use crate::runtime::error::{Context, Result};

/// The signals received, in order.
pub(super) struct Signals {
    rx: mpsc::UnboundedReceiver<&'static str>,
    seen: u32,
    task: tokio::task::JoinHandle<()>,
}

impl Signals {
    /// Starts listening; from now on SIGTERM and SIGINT no longer end the process by
    /// themselves.
    pub fn listen() -> Result<Signals> {
        let mut term = signal(SignalKind::terminate()).ctx("listening for SIGTERM")?;
        let mut int = signal(SignalKind::interrupt()).ctx("listening for SIGINT")?;
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            loop {
                let name = tokio::select! {
                    Some(()) = term.recv() => "SIGTERM",
                    Some(()) = int.recv() => "SIGINT",
                    else => return,
                };
                if tx.send(name).is_err() {
                    return;
                }
            }
        });
        Ok(Signals { rx, seen: 0, task })
    }

    /// A signal received since the last call, and how many have come so far.
    pub fn poll(&mut self) -> Option<(&'static str, u32)> {
        let name = self.rx.try_recv().ok()?;
        self.seen += 1;
        Some((name, self.seen))
    }
}

impl Drop for Signals {
    fn drop(&mut self) {
        self.task.abort();
    }
}
