//! The commit protocol of a generation (DESIGN.md section 4): the rendezvous, every rank's
//! `Ready`, the commit, periodic states and the end of the run.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::machine::{JobMachine, Phase};
use super::{Action, FailedSave, JobStart};
use crate::execution::StepTimes;
use crate::runtime::error::RuntimeError;
use crate::runtime::spec::TrainingSpec;
use crate::runtime::wire::protocol::Rendezvous;
use crate::runtime::wire::records::Event;

/// The machine's step group: the committed step and what hangs on it (checkpoints, their
/// assembly, injected failures). Only this file changes it; the others go through its methods.
#[derive(Debug)]
pub(super) struct Steps {
    /// The newest committed step.
    committed: u64,
    /// Steps committed by this job (replays included).
    steps_run: u64,
    /// The checkpoint the next generation starts from.
    resume: Option<String>,
    /// The newest checkpoint known: `(path, step)`.
    newest: Option<(String, u64)>,
    /// Checkpoint and evaluation assemblies under way.
    assembling: usize,
    /// The longest a saver's training waited for its state of each step (ms), until the
    /// step's checkpoint is recorded.
    stalls: BTreeMap<u64, f64>,
    /// `--inject-failure`s still to fire.
    injections: Vec<(u32, u64)>,
    /// Worker processes seen (by pid).
    worker_pids: BTreeSet<u32>,
    /// Why the final state of a saver could not be saved, once it gave up.
    final_save_lost: Option<String>,
    /// A stop was asked for: the run ends with this step.
    stop_after: Option<u64>,
}

impl Steps {
    /// A job of `spec` that starts at `start`.
    pub(super) fn new(spec: &TrainingSpec, start: &JobStart) -> Steps {
        Steps {
            committed: start.step,
            steps_run: 0,
            resume: start.checkpoint.clone(),
            newest: start.checkpoint.clone().map(|c| (c, start.step)),
            assembling: 0,
            stalls: BTreeMap::new(),
            injections: spec
                .inject_failures
                .iter()
                .map(|i| (i.node, i.after_step))
                .collect(),
            worker_pids: BTreeSet::new(),
            final_save_lost: None,
            stop_after: None,
        }
    }

    /// The step the run ends with: its last, or the one a stop asked for.
    pub(super) fn last_step(&self, spec: &TrainingSpec) -> u64 {
        self.stop_after.map_or(spec.steps, |s| s.min(spec.steps))
    }

    /// The newest committed step.
    pub(super) fn committed(&self) -> u64 {
        self.committed
    }

    /// Steps committed by this job, replays included.
    pub(super) fn steps_run(&self) -> u64 {
        self.steps_run
    }

    /// The newest checkpoint known: `(path, step)`.
    pub(super) fn newest(&self) -> Option<(String, u64)> {
        self.newest.clone()
    }

    /// The newest checkpoint in the run directory, `(path, step)`, for a job that did not
    /// start from it (a restarted master re-adopting the workers at a later step).
    pub(super) fn knows_checkpoint(&mut self, newest: Option<(String, u64)>) {
        self.newest = newest;
    }

    /// A checkpoint or evaluation is being assembled.
    pub(super) fn assembling(&self) -> bool {
        self.assembling > 0
    }

    /// The checkpoint the generation being planned starts from (once).
    pub(super) fn take_resume(&mut self) -> Option<String> {
        self.resume.take()
    }

    /// The next generation starts from committed `step`: the steps after it are computed
    /// again.
    pub(super) fn rewind(&mut self, step: u64) {
        self.committed = step;
    }

    /// The next generation, planned afresh, starts from `checkpoint` (`None`: no checkpoint).
    pub(super) fn resume_from(&mut self, checkpoint: Option<String>) {
        self.resume = checkpoint;
    }

    /// The checkpoint a generation was to start from cannot be used: it starts from `instead`
    /// (path, step), the newest checkpoint from now on, or from step 0.
    pub(super) fn fall_back_to(&mut self, instead: Option<(String, u64)>) {
        self.committed = instead.as_ref().map_or(0, |i| i.1);
        self.newest = instead;
    }

    /// A checkpoint or evaluation ended without an answer to wait for (it failed).
    pub(super) fn assembly_ended(&mut self) {
        self.assembling = self.assembling.saturating_sub(1);
    }
}

impl JobMachine {
    pub(super) fn on_listening(
        &mut self,
        now: Duration,
        node: u32,
        rank: u32,
        addr: String,
        pid: u32,
    ) {
        // A worker kept across generations is one process: recorded once.
        if self.steps.worker_pids.insert(pid) {
            self.record(Event::Process {
                role: "worker".into(),
                pid: Some(pid),
                host: None,
                node: Some(node),
                rank: Some(rank),
                data_addr: Some(addr.clone()),
            });
        }
        let Some(g) = self.gen.as_mut() else { return };
        g.listening.insert(rank, addr);
        let ranks = g.world + g.donors.len();
        if !matches!(self.phase, Phase::Rendezvous) || g.listening.len() < ranks {
            return;
        }
        let rendezvous: Vec<Rendezvous> = g
            .listening
            .iter()
            .map(|(&rank, addr)| Rendezvous {
                rank,
                addr: addr.clone(),
            })
            .collect();
        g.formed = true;
        let generation = self.generation;
        self.record(Event::Rendezvous {
            generation,
            addrs: rendezvous.iter().map(|r| r.addr.clone()).collect(),
        });
        self.push(Action::Rendezvous {
            generation,
            rendezvous,
        });
        // Workers started or reassigned, and listening; next they connect and load or copy
        // their state.
        self.phase_done(now, "restart");
        self.phase = if self.steps.committed >= self.spec.steps {
            Phase::Finishing
        } else {
            Phase::Stepping
        };
    }

    /// A rank built its stage of the generation. Once all have, the copies are done.
    pub(super) fn on_built(
        &mut self,
        now: Duration,
        rank: u32,
        step: u64,
        connect_s: f64,
        copy_s: f64,
        copy_bytes: u64,
    ) {
        if step != self.steps.committed {
            let committed = self.steps.committed;
            return self.fail(RuntimeError::OutOfStep {
                rank,
                what: format!("built its stage at step {step}, the job is at step {committed}"),
            });
        }
        let Some(g) = self.gen.as_mut() else { return };
        if rank as usize >= g.world {
            return self.on_donated(rank);
        }
        g.built.insert(rank);
        g.connect_s = g.connect_s.max(connect_s);
        g.copy_s = g.copy_s.max(copy_s);
        g.copy_bytes += copy_bytes;
        if g.built.len() < g.world {
            return;
        }
        let (connect_s, copy_s, bytes) = (g.connect_s, g.copy_s, g.copy_bytes);
        self.copies_done(now, connect_s, copy_s, bytes);
    }

    /// Donor `rank` sent what it had to: once every donor of its node has, the node goes.
    fn on_donated(&mut self, rank: u32) {
        let Some(g) = self.gen.as_mut() else { return };
        let Some(node) = g.donors.iter().find(|d| d.rank == rank).map(|d| d.node) else {
            return;
        };
        g.donated.insert(rank);
        let done = g
            .donors
            .iter()
            .filter(|d| d.node == node)
            .all(|d| g.donated.contains(&d.rank));
        if done {
            self.release(node, "drained, its layers copied off".into());
        }
    }

    pub(super) fn on_step_ready(
        &mut self,
        now: Duration,
        rank: u32,
        step: u64,
        loss: f64,
        norm: f64,
    ) {
        let open = self.steps.committed + 1;
        if !matches!(self.phase, Phase::Stepping) || step != open {
            return self.fail(RuntimeError::OutOfStep {
                rank,
                what: format!("reported step {step} ready while step {open} is open"),
            });
        }
        let Some(g) = self.gen.as_mut() else { return };
        if g.ready.insert(rank, (loss, norm)).is_some() {
            return self.fail(RuntimeError::OutOfStep {
                rank,
                what: format!("reported step {step} ready twice"),
            });
        }
        if g.ready.len() < g.world {
            return;
        }
        let ready = std::mem::take(&mut g.ready);
        let times = std::mem::take(&mut g.times);
        let mut read = std::mem::take(&mut g.read);
        let samples = g.samples.take();
        read.sort_unstable();
        let every: Vec<u32> = (0..self.spec.global_microbatches).collect();
        if read != every {
            return self.fail(RuntimeError::OutOfStep {
                rank,
                what: format!(
                    "step {step} trained microbatches {read:?}, not each of 0..{} once",
                    self.spec.global_microbatches
                ),
            });
        }
        let (pipelines, nodes) = (g.plan.pipelines.len(), g.nodes.len());
        let (loss, grad_norm) = match agreed(&ready, step) {
            Ok(v) => v,
            Err(e) => return self.fail(e),
        };
        self.push(Action::Commit {
            step,
            loss,
            grad_norm,
            generation: self.generation,
            pipelines,
            nodes,
            eval_due: step < self.spec.steps && self.spec.eval_due(step),
            microbatches: read,
            samples,
            times: times.clone(),
            last: step >= self.steps.last_step(&self.spec),
        });
        self.commit(now, step, times);
    }

    /// `step` is committed (its [`Action::Commit`] is out).
    fn commit(&mut self, now: Duration, step: u64, times: BTreeMap<u32, StepTimes>) {
        self.steps.committed = step;
        self.steps.steps_run += 1;
        self.replicas.trust_all_again();
        self.recovery_committed(now, step);
        while let Some(i) = self.steps.injections.iter().position(|&(_, at)| at == step) {
            let (node, _) = self.steps.injections.remove(i);
            self.record(Event::InjectFailure { node, step });
            self.note(format!(
                "injecting a failure: killing node {node} after step {step}"
            ));
            self.push(Action::KillNode { node });
        }
        if step >= self.steps.last_step(&self.spec) {
            self.phase = Phase::Finishing;
        }
        self.on_step_times(now, step, &times);
        self.at_boundary(now, step);
    }

    pub(super) fn on_state_saved(&mut self, rank: u32, step: u64, state: String, stall_ms: f64) {
        let stall = self.steps.stalls.entry(step).or_insert(0.0);
        *stall = stall.max(stall_ms);
        let Some(g) = self.gen.as_mut() else { return };
        if !g.savers.contains(&rank) {
            let savers = g.savers.clone();
            return self.fail(RuntimeError::OutOfStep {
                rank,
                what: format!("saved state, but only ranks {savers:?} keep it"),
            });
        }
        let got = g.states.entry(step).or_default();
        got.insert(rank, state);
        if got.len() < g.savers.len() {
            return;
        }
        let states = g.states.remove(&step).unwrap_or_default();
        self.steps.assembling += 1;
        self.push(Action::Assemble {
            step,
            states,
            checkpoint: self.spec.checkpoint_due(step),
            eval: self.spec.eval_due(step),
        });
    }

    /// A saver's state after `step` did not reach the master. A periodic checkpoint is skipped
    /// (the other savers' states of that step are dropped); the final save is retried by the
    /// worker for `--save-wait`, each report of it progress, not a stall.
    pub(super) fn on_save_failed(&mut self, step: u64, bytes: u64, error: String, retrying: bool) {
        let periodic = step < self.steps.last_step(&self.spec);
        if periodic {
            if let Some(g) = self.gen.as_mut() {
                g.states.remove(&step);
            }
        } else if !retrying {
            self.steps.final_save_lost = Some(error.clone());
        }
        self.push(Action::SaveFailed(FailedSave {
            step,
            bytes,
            error,
            retrying,
            periodic,
        }));
    }

    /// The periodic assembly of `step` failed: a checkpoint that could not be written is
    /// skipped and training goes on; an evaluation that failed is the workload's error.
    pub(super) fn on_assembly_failed(&mut self, step: u64, error: String) {
        self.steps.assembly_ended();
        if !self.spec.checkpoint_due(step) {
            return self.fail(RuntimeError::Context {
                what: format!("the evaluation of step {step} failed"),
                source: error.into(),
            });
        }
        self.skip_checkpoint(step, error);
        self.maybe_finish();
    }

    /// The checkpoint of `step` could not be written (`error`): it is skipped.
    pub(super) fn skip_checkpoint(&mut self, step: u64, error: String) {
        self.push(Action::SaveFailed(FailedSave {
            step,
            bytes: 0,
            error,
            retrying: false,
            periodic: true,
        }));
    }

    /// A signal asked the master to stop: the run ends with the next step to commit, saved as
    /// its final one. Before training starts there is nothing to save: the job ends at once.
    pub(super) fn on_stop_requested(&mut self, signal: String) {
        if self.steps.stop_after.is_some() {
            return;
        }
        let step = self.steps.committed + 1;
        let deployed = self.gen.is_some();
        match self.phase {
            Phase::Finishing | Phase::Finished | Phase::Failed => return,
            Phase::Forming | Phase::Planning { .. } if !deployed => {
                return self.fail(RuntimeError::StoppedEarly { signal })
            }
            _ => {}
        }
        self.steps.stop_after = Some(step.min(self.spec.steps));
        self.record(Event::StopRequested {
            signal: signal.clone(),
            step,
        });
        self.note(format!(
            "{signal}: stopping after step {step}, with its checkpoint (send it again to stop at \
             once, without one)"
        ));
    }

    /// A periodic checkpoint or evaluation is in.
    pub(super) fn on_assembled(
        &mut self,
        step: u64,
        checkpoint: Option<String>,
        val_loss: Option<f64>,
        duration_s: f64,
    ) {
        self.steps.assembling = self.steps.assembling.saturating_sub(1);
        if let Some(path) = checkpoint {
            if self.steps.newest.as_ref().is_none_or(|n| n.1 <= step) {
                self.steps.newest = Some((path.clone(), step));
            }
            let stall_ms = self.steps.stalls.remove(&step).unwrap_or(0.0);
            self.record(Event::Checkpoint {
                step,
                path,
                duration_s,
                stall_ms,
            });
        }
        if let Some(v) = val_loss {
            self.note(format!("step {step}: validation loss {v:.4}"));
            self.push(Action::ValLoss { step, val_loss: v });
        }
    }

    pub(super) fn on_worker_done(
        &mut self,
        rank: u32,
        step: u64,
        state: Option<String>,
        waited: f64,
    ) {
        if step != self.steps.committed {
            let committed = self.steps.committed;
            return self.fail(RuntimeError::OutOfStep {
                rank,
                what: format!("finished at step {step}, the job committed {committed}"),
            });
        }
        if let Some(g) = self.gen.as_mut() {
            g.done.insert(rank, (state, waited));
        }
        self.maybe_finish();
    }

    pub(super) fn maybe_finish(&mut self) {
        let Some(g) = self.gen.as_ref() else { return };
        if !matches!(self.phase, Phase::Finishing)
            || g.done.len() < g.world
            || self.steps.assembling > 0
        {
            return;
        }
        if let Some(error) = self.steps.final_save_lost.clone() {
            return self.fail(RuntimeError::FinalSaveLost {
                step: self.steps.committed,
                error,
                newest: self.steps.newest.as_ref().map(|n| n.0.clone()),
            });
        }
        let states = g
            .savers
            .iter()
            .filter_map(|r| Some((*r, g.done.get(r)?.0.clone()?)))
            .collect();
        let commit_wait_ms = g.done.iter().map(|(r, d)| (*r, d.1)).collect();
        self.phase = Phase::Finished;
        self.push(Action::Finish {
            step: self.steps.committed,
            states,
            commit_wait_ms,
        });
    }
}

/// Every rank's loss and gradient norm of `step`: they are the same global values (computed by
/// the same all-reduce and summed in the same order on every rank), so any difference is a bug.
pub(super) fn agreed(
    ready: &BTreeMap<u32, (f64, f64)>,
    step: u64,
) -> Result<(f64, f64), RuntimeError> {
    let mut it = ready.iter();
    let Some((&r0, &(loss, norm))) = it.next() else {
        return Err(RuntimeError::NoReports { step });
    };
    for (&r, &(l, g)) in it {
        let same = |a: f64, b: f64| a == b || (a - b).abs() <= 1e-9 * a.abs().max(b.abs());
        if !same(l, loss) || !same(g, norm) {
            return Err(RuntimeError::RanksDisagree {
                step,
                rank_a: r0,
                loss_a: loss,
                norm_a: norm,
                rank_b: r,
                loss_b: l,
                norm_b: g,
            });
        }
    }
    Ok((loss, norm))
}
