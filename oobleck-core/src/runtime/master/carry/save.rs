//! Saves that fail: a periodic checkpoint is skipped (said, recorded, its leftovers removed)
//! and the job goes on; the final one is tried again for `--save-wait` before the job gives
//! up with the trained steps named as lost.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::Driver;
use crate::checkpoint::space::{checkpoint_bytes, SaveFailure};
use crate::runtime::error::{Context, Result, RuntimeError};
use crate::runtime::job::FailedSave;
use crate::runtime::master::assemble::Assembled;
use crate::runtime::wire::records::Event;

/// The pause before the final checkpoint is written again: doubling from the first, up to
/// the last.
const RETRY_PAUSES: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(10));

impl Driver<'_> {
    /// Says what failed and where, in numbers; records it; a periodic save's leftovers (the
    /// states of that step already uploaded) go, and its metrics line waits no more.
    pub(in crate::runtime::master) fn save_failed(&mut self, f: FailedSave) -> Result<()> {
        let out = self.p.out.clone();
        let needed = checkpoint_bytes(self.p.assembler.workload.num_params()).max(f.bytes);
        let failure = SaveFailure::measure(&out, f.step, needed, f.error, f.retrying);
        let next = match (f.periodic, f.retrying) {
            (true, _) => "training goes on; the next checkpoint tries again",
            (false, true) => "the trained state is kept in memory and saved again shortly",
            (false, false) => "no time is left (--save-wait)",
        };
        self.p.observer.note(&failure.warning(next));
        self.p.files.event(&Event::checkpoint_failed(&failure))?;
        if f.periodic {
            let staged = out.join("cluster").join(format!("step-{:06}", f.step));
            let _ = std::fs::remove_dir_all(staged);
            self.p.files.no_val_loss(f.step)?;
        }
        Ok(())
    }

    /// The final checkpoint and evaluation from pipeline 0's `states`, written again while
    /// `--save-wait` lasts. The uploaded states are removed either way: once the job gives up,
    /// nothing is left behind but the run's files.
    pub(in crate::runtime::master) async fn final_assembly(
        &mut self,
        step: u64,
        states: BTreeMap<u32, String>,
    ) -> Result<Assembled> {
        let deadline = Instant::now() + Duration::from_secs(self.p.config.save_wait_s);
        let mut pause = RETRY_PAUSES.0;
        let result = loop {
            let a = self.p.assembler.clone();
            let s = states.clone();
            let tried = tokio::task::spawn_blocking(move || a.assemble(step, &s, true, true))
                .await
                .ctx("the final checkpoint task")?;
            let e = match tried {
                Ok(done) => break Ok(done),
                Err(e) => e,
            };
            let retrying = Instant::now() + pause < deadline;
            self.save_failed(FailedSave {
                step,
                bytes: 0,
                error: e.to_string(),
                retrying,
                periodic: false,
            })?;
            if !retrying {
                break Err(RuntimeError::FinalSaveLost {
                    step,
                    error: e.to_string(),
                    newest: newest_checkpoint(&self.p.out),
                });
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(RETRY_PAUSES.1);
            // A signal while the final save waits for space stops it.
            if let Some((signal, _)) = self.p.signals.poll() {
                break Err(RuntimeError::Interrupted {
                    signal: signal.into(),
                    newest: newest_checkpoint(&self.p.out),
                });
            }
        };
        let _ = std::fs::remove_dir_all(self.p.out.join("cluster"));
        result
    }
}

/// The newest checkpoint of the run directory `out`, for a message.
pub(super) fn newest_checkpoint(out: &std::path::Path) -> Option<String> {
    crate::checkpoint::latest_checkpoint(out)
        .ok()
        .flatten()
        .map(|p| p.display().to_string())
}
