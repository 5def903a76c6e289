//! A generation's steps: iteration and gradient sync, `Ready`, the master's commit, the
//! optimizer; and how a generation ends early (a failed step, or the next generation).

use std::time::{Duration, Instant};

use candle_core::{Tensor, Var};

use super::hooks;
use super::inbox::{report, Inbox};
use super::save::{save_final, save_in_background, snapshot};
use super::state::Held;
use super::{protocol, Flow, Generation, COMMIT_TIMEOUT};
use crate::execution::{sync_gradients, Doing};
use crate::planning::stage_leads;
use crate::runtime::error::error_chain;
use crate::runtime::error::{BoxError, Context, Result, RuntimeError};
use crate::runtime::wire::pipe::{ToWorker, WorkerAssignment};
use crate::runtime::wire::records::{SampleHash, WorkerReport};
use crate::runtime::workload::Workload;

pub(super) use crate::runtime::timeouts::BROKEN_WAIT;

/// Why a generation's training stopped early.
enum Stop {
    /// A step failed here or at a peer.
    Failed(RuntimeError),
    /// The next generation was assigned while this rank waited for a commit.
    Reassigned(Box<WorkerAssignment>),
}

impl From<RuntimeError> for Stop {
    fn from(e: RuntimeError) -> Stop {
        Stop::Failed(e)
    }
}

impl Generation<'_> {
    /// Runs every step left and reports `Done`. When a step fails, the peers are failed fast
    /// (instead of into their timeouts) and this worker waits for the next generation with
    /// the state of its committed step.
    pub(super) fn run(&mut self, workload: &dyn Workload, inbox: &Inbox) -> Result<Flow> {
        let stop = match self.train(workload, inbox) {
            Ok(()) => return Ok(Flow::Done),
            Err(stop) => stop,
        };
        // Waiting for the master from now on: nothing for the watchdog to hold to a step.
        self.progress.end_step();
        self.comm.abort();
        let held = Held::of_stage(&self.runner, &mut self.opt, self.committed)?;
        match stop {
            Stop::Reassigned(next) => Ok(Flow::Next(next, held)),
            Stop::Failed(e) => super::broken(self.a, inbox, e, held),
        }
    }

    fn train(&mut self, workload: &dyn Workload, inbox: &Inbox) -> std::result::Result<(), Stop> {
        let (rank, training, g) = (self.a.rank, &self.a.job.training, self.a.generation);
        let params: Vec<(String, Var)> = self.runner.params();
        // The leads of pipeline 0's stages leave the state the master assembles into
        // checkpoints and evaluates; the master expects it from the same ranks.
        let saves_state = stage_leads(&self.a.plan, 0).contains(&rank);
        let mut commit_wait = Duration::ZERO;
        for step in self.committed..training.steps {
            let (waited, last) = self.step(workload, inbox, &params, step)?;
            commit_wait += waited;
            let s = step + 1;
            self.committed = s;
            if last {
                // The run ends here (a stop asked for by a signal, or its final step).
                break;
            }
            if saves_state && s < training.steps && training.state_due(s) {
                save_in_background(self.a, &params, &self.opt, s)?;
            }
        }
        let mut state = None;
        if saves_state {
            // Nothing is left to hold to a step: a save retried for minutes is no hang.
            self.progress.end_step();
            state = save_final(self.a, snapshot(&params, &self.opt)?, self.committed)?;
        }
        report(
            g,
            &WorkerReport::Done {
                rank,
                step: self.committed,
                state,
                commit_wait_ms: commit_wait.as_secs_f64() * 1e3,
            },
        )?;
        Ok(())
    }

    /// Step `step + 1` (0-based `step`): computes, reports `Ready`, waits for the commit and
    /// applies it. Returns the time spent waiting for the commit, and whether the run ends with
    /// this step.
    fn step(
        &mut self,
        workload: &dyn Workload,
        inbox: &Inbox,
        params: &[(String, Var)],
        step: u64,
    ) -> std::result::Result<(Duration, bool), Stop> {
        let (rank, training) = (self.a.rank, &self.a.job.training);
        let (seed, node, g) = (training.seed, self.a.node, self.a.generation);
        let abort = &inbox.abort;
        let pos = self.runner.position();
        let lead_of_first_stage = pos.stage == 0 && pos.device == 0;
        let mut read = std::collections::BTreeSet::new();
        // The hash of the samples of the microbatches this rank reads (see `read`).
        let mut samples: Option<SampleHash> = None;
        let slow = hooks::slowness(node);
        // Microbatches are made where the stage computes (a CUDA worker's on its GPU).
        let device = self.runner.device().clone();
        self.progress.begin_step(step + 1);
        let mut batch = |_iteration: u64, mb: u64| -> crate::Result<(Tensor, Tensor)> {
            if abort.is_set() {
                return Err(crate::Error::workload(
                    "stopped: the master ended this generation after a failure",
                ));
            }
            hooks::hang_point(g, node, step + 1, hooks::Place::Compute, abort);
            if let Some(d) = slow {
                std::thread::sleep(d);
            }
            let mb = u32::try_from(mb)
                .map_err(|_| crate::Error::workload(format!("microbatch {mb} is past u32")))?;
            let failed = |e: BoxError| {
                let why = error_chain(e.as_ref()).join(": ");
                crate::Error::workload(format!("microbatch {mb}: {why}"))
            };
            // Each microbatch counted once, by the one rank that reads it for its pipeline.
            if lead_of_first_stage && read.insert(mb) {
                if let Some(ids) = workload.sample_ids(seed, step, mb).map_err(failed)? {
                    samples = Some(samples.unwrap_or_default() + SampleHash::of(ids));
                }
            }
            workload.microbatch(seed, step, mb, &device).map_err(failed)
        };
        let out = self
            .runner
            .run_iteration(self.comm.as_ref(), step, &mut batch)
            .with_ctx(|| format!("rank {rank}: step {}", step + 1))?;
        super::load::test_kill_point("sync", self.a, step + 1);
        let (grads, sync) =
            sync_gradients(&self.runner, self.comm.as_ref(), out, training.grad_clip)
                .with_ctx(|| format!("rank {rank}: gradient sync of step {}", step + 1))?;
        report(
            self.a.generation,
            &WorkerReport::Ready {
                rank,
                step: step + 1,
                loss: sync.loss,
                grad_norm: sync.grad_norm,
                microbatches: read.into_iter().collect(),
                samples: samples.map(|h| h.0),
                times: Some(self.progress.step_times()),
            },
        )?;
        let waited = Instant::now();
        let last;
        {
            let _commit = self.progress.enter(Doing::Commit);
            hooks::hang_point(g, node, step + 1, hooks::Place::Commit, &inbox.abort);
            last = self.wait_commit(inbox, step)?;
        }
        let waited = waited.elapsed();
        {
            let _optimizer = self.progress.enter(Doing::Optimizer);
            self.opt
                .step(params, &grads, training.lr.lr_at(step))
                .with_ctx(|| format!("rank {rank}: optimizer step {}", step + 1))?;
        }
        self.progress.end_step();
        Ok((waited, last))
    }

    /// Waits for the commit of step `step + 1`, and whether the run ends with it. The next
    /// generation's assignment instead means the step failed elsewhere: this rank still holds
    /// the state of `step`.
    fn wait_commit(&self, inbox: &Inbox, step: u64) -> std::result::Result<bool, Stop> {
        let rank = self.a.rank;
        match inbox.next(COMMIT_TIMEOUT, &format!("commit of step {}", step + 1))? {
            ToWorker::Commit { step: s, last } if s == step + 1 => Ok(last),
            ToWorker::Reassign { assignment } => Err(Stop::Reassigned(assignment)),
            other => Err(Stop::Failed(protocol(
                rank,
                format!(
                    "waits for the commit of step {}, the agent sent {other}",
                    step + 1
                ),
            ))),
        }
    }
}
