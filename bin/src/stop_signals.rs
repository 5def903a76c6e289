//! SIGTERM and SIGINT to the single-process trainer, as to a cluster job's master: the first
//! asks it to stop after the step it is in, with that step's checkpoint, and exit 0; a second
//! stops it at once (exit 1), its newest checkpoint being where `--resume` goes on.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use tokio::signal::unix::{signal, SignalKind};

/// The first signal received, if any; a thread listens for them.
#[derive(Clone, Default)]
pub struct StopSignals {
    first: Arc<Mutex<Option<&'static str>>>,
}

impl StopSignals {
    /// Starts listening; from now on SIGTERM and SIGINT no longer end the process by
    /// themselves. `out`: the run directory a second signal names.
    pub fn listen(out: &std::path::Path) -> Result<StopSignals> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .context("starting the signal listener")?;
        let (mut term, mut int) = rt.block_on(async {
            Ok::<_, std::io::Error>((
                signal(SignalKind::terminate())?,
                signal(SignalKind::interrupt())?,
            ))
        })?;
        let stop = StopSignals::default();
        let first = stop.first.clone();
        let out = out.to_path_buf();
        let seen = AtomicU32::new(0);
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                rt.block_on(async move {
                    loop {
                        let name = tokio::select! {
                            Some(()) = term.recv() => "SIGTERM",
                            Some(()) = int.recv() => "SIGINT",
                            else => return,
                        };
                        if seen.fetch_add(1, Ordering::SeqCst) == 0 {
                            eprintln!(
                                "{name}: stopping after this step, with its checkpoint (send it \
                                 again to stop at once)"
                            );
                            *first.lock().unwrap_or_else(|p| p.into_inner()) = Some(name);
                        } else {
                            eprintln!(
                                "stopped at once by a second {name}: `train --resume {}` goes on \
                                 from its newest checkpoint",
                                out.display()
                            );
                            std::process::exit(1);
                        }
                    }
                })
            })
            .context("starting the signal listener")?;
        Ok(stop)
    }

    /// The signal that asked to stop, if one did.
    pub fn requested(&self) -> Option<&'static str> {
        *self.first.lock().unwrap_or_else(|p| p.into_inner())
    }
}
