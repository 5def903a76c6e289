//! A node that leaves on notice: SIGTERM to its agent, or a preemption notice it watches
//! (`notice.rs`). The agent asks the master to drain its node (`Message::Drain`), keeps
//! serving until the master releases it at the next step boundary (`Shutdown`), and goes on
//! its own only if that takes longer than its drain wait, or at a second SIGTERM.

use std::time::Duration;

use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::notice::{wait_for_notice, NoticeSource, NoticeWatch};
use super::Local;
use crate::runtime::error::{Context, Result};

/// How long one poll of a notice endpoint may take.
const NOTICE_TIMEOUT: Duration = Duration::from_secs(2);

/// Why SIGTERM's drains say they were asked for.
pub(super) const SIGTERM: &str = "SIGTERM";

/// A node that asked to leave.
pub(super) struct Leaving {
    pub reason: String,
    /// When it goes even if the master has not released it.
    pub deadline: Instant,
}

/// Turns every SIGTERM into a [`Local::Leave`].
pub(super) fn watch_sigterm(tx: mpsc::UnboundedSender<Local>) -> Result<()> {
    let mut term = signal(SignalKind::terminate()).ctx("watching for SIGTERM")?;
    tokio::spawn(async move {
        while term.recv().await.is_some() {
            if tx.send(Local::Leave(SIGTERM.into())).is_err() {
                break;
            }
        }
    });
    Ok(())
}

/// Watches `source` every `interval`; a notice becomes a [`Local::Leave`].
pub(super) fn watch_notice(
    source: &str,
    interval: Duration,
    tx: mpsc::UnboundedSender<Local>,
) -> Result<()> {
    let watch = NoticeWatch {
        source: NoticeSource::parse(source)?,
        interval,
        timeout: NOTICE_TIMEOUT.min(interval.max(Duration::from_millis(100))),
    };
    tokio::spawn(async move {
        let reason = wait_for_notice(&watch).await;
        let _ = tx.send(Local::Leave(reason));
    });
    Ok(())
}
