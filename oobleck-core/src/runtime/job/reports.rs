//! What the job does with each worker report: the commit protocol's reports go to
//! `steps.rs`; here the book-keeping of stages built, failed, corrupted copies and exits, and
//! the decision whether a failure can be recovered from.

use crate::execution::StepTimes;
use std::collections::BTreeSet;
use std::time::Duration;

use super::machine::{JobMachine, Phase};
use super::recovery::Failure;
use crate::reconfig::Holdings;
use crate::runtime::error::RuntimeError;
use crate::runtime::wire::protocol::ExitStatus;
use crate::runtime::wire::records::Event;
use crate::runtime::wire::records::{CorruptCopy, SampleHash, WorkerReport};

/// The machine's replica group: what each `(node, device)` holds of the committed step, as its
/// workers said (`Formed`) and lost since (what a recovery in place copies from), and the
/// replicas not to trust. Only this file changes it; the others go through its methods.
#[derive(Debug)]
pub(super) struct Replicas {
    holdings: Holdings,
    /// `(node, device, layer)` replicas whose copies arrived corrupted: not offered as
    /// sources again until a step commits.
    distrusted: BTreeSet<(u32, u32, usize)>,
}

impl Replicas {
    /// Nothing held yet, on nodes of `devices_per_node` devices.
    pub(super) fn new(devices_per_node: u32) -> Replicas {
        Replicas {
            holdings: Holdings::empty(devices_per_node),
            distrusted: BTreeSet::new(),
        }
    }

    /// What each `(node, device)` holds of the committed step.
    pub(super) fn holdings(&self) -> &Holdings {
        &self.holdings
    }

    /// Every worker was started afresh (not from its peers): none holds anything until it
    /// says `Formed`.
    pub(super) fn restarted(&mut self, devices_per_node: u32) {
        self.holdings = Holdings::empty(devices_per_node);
    }

    /// The devices hold `holdings` (a restarted master re-adopting the workers).
    pub(super) fn seed(&mut self, holdings: Holdings) {
        self.holdings = holdings;
    }

    /// `node` is lost or leaves: nothing on it can be copied from.
    pub(super) fn drop_node(&mut self, node: u32) {
        self.holdings.drop_node(node);
    }

    /// The worker on `(node, device)` is gone, or cannot be counted on: it holds nothing.
    pub(super) fn drop_device(&mut self, node: u32, device: u32) {
        self.holdings.set(node, device, BTreeSet::new());
    }

    /// A step committed: every replica is offered as a source again.
    pub(super) fn trust_all_again(&mut self) {
        self.distrusted.clear();
    }
}

impl JobMachine {
    pub(super) fn on_worker(
        &mut self,
        now: Duration,
        node: u32,
        generation: u64,
        report: WorkerReport,
    ) {
        if self.membership.has_departed(node) {
            // Told to go: what it still says is not the job's business.
            return;
        }
        if generation > self.generation {
            // No worker can be there yet: a confused or foreign process. Never acted on.
            let (rank, now_at) = (report.rank(), self.generation);
            return self.note(format!(
                "ignored a report of generation {generation} from node {node} (rank {rank}): \
                 the job is at generation {now_at}"
            ));
        }
        if generation != self.generation {
            // A worker of an earlier generation: history, except that a process that is gone
            // holds nothing any more (its device is the same in every generation).
            if let WorkerReport::Exited { rank, .. } = report {
                let device = rank % self.spec.devices_per_node;
                self.replicas.drop_device(node, device);
            }
            return;
        }
        self.on_current_report(now, node, report);
    }

    /// A report of the current generation, handed to its handler.
    fn on_current_report(&mut self, now: Duration, node: u32, report: WorkerReport) {
        match report {
            WorkerReport::Listening { rank, addr, pid } => {
                self.on_listening(now, node, rank, addr, pid)
            }
            WorkerReport::Ready {
                rank,
                step,
                loss,
                grad_norm,
                microbatches,
                samples,
                times,
            } => {
                self.note_step_reads(rank, microbatches, samples, times);
                self.on_step_ready(now, rank, step, loss, grad_norm)
            }
            WorkerReport::Saved {
                rank,
                step,
                state,
                stall_ms,
            } => self.on_state_saved(rank, step, state, stall_ms),
            WorkerReport::SaveFailed {
                step,
                bytes,
                error,
                retrying,
                ..
            } => self.on_save_failed(step, bytes, error, retrying),
            WorkerReport::Formed {
                rank,
                step,
                layers,
                connect_s,
                copy_s,
                copy_bytes,
            } => {
                self.on_formed(node, rank, layers);
                self.on_built(now, rank, step, connect_s, copy_s, copy_bytes);
            }
            WorkerReport::Broken {
                rank,
                step,
                error,
                corrupt,
            } => {
                self.on_worker_broken(node, rank, step, error.clone(), corrupt);
                self.node_failure(
                    now,
                    format!(
                        "worker rank {rank} on node {node} failed in step {} before finishing: \
                         {error}",
                        step + 1
                    ),
                );
            }
            WorkerReport::Done {
                rank,
                step,
                state,
                commit_wait_ms,
            } => self.on_worker_done(rank, step, state, commit_wait_ms),
            r @ (WorkerReport::Hung { .. } | WorkerReport::Waiting { .. }) => {
                self.on_watchdog(now, node, r)
            }
            WorkerReport::Refused { .. } => {} // recorded by `handle`
            WorkerReport::Exited {
                rank,
                status,
                error,
            } => self.on_exit_report(now, node, rank, status, error),
            // Only after an abort, which only a failure causes (handled in `recovery.rs`).
            WorkerReport::Stopping { .. } => {}
        }
    }

    /// A worker process ended: a failure unless it finished cleanly.
    fn on_exit_report(
        &mut self,
        now: Duration,
        node: u32,
        rank: u32,
        status: ExitStatus,
        error: Option<String>,
    ) {
        self.on_worker_exited(node, rank, status, error.clone());
        let clean = status.code == Some(0)
            && self
                .gen
                .as_ref()
                .is_some_and(|g| g.done.contains_key(&rank));
        if !clean {
            if let Some(g) = self.gen.as_mut() {
                g.killed |= killed_from_outside(status.signal);
            }
            let when = match self.phase {
                Phase::Rendezvous => "while the data plane formed",
                _ => "before finishing",
            };
            self.node_failure(
                now,
                format!(
                    "worker rank {rank} on node {node} exited ({}) {when}{}",
                    describe(status.code, status.signal),
                    because(error.as_deref())
                ),
            );
        }
    }

    /// Book-keeping of a broken worker, in any phase.
    /// What a rank's `Ready` says of the step besides its loss: the microbatches it read, the
    /// hash of their sample ids, its phase times.
    fn note_step_reads(
        &mut self,
        rank: u32,
        microbatches: Vec<u32>,
        samples: Option<u64>,
        times: Option<StepTimes>,
    ) {
        if let Some(g) = self.gen.as_mut() {
            g.read.extend(microbatches);
            if let Some(h) = samples {
                g.samples = Some(g.samples.unwrap_or_default() + SampleHash(h));
            }
            if let Some(t) = times {
                g.times.insert(rank, t);
            }
        }
    }

    pub(super) fn on_worker_broken(
        &mut self,
        node: u32,
        rank: u32,
        step: u64,
        error: String,
        corrupt: Option<CorruptCopy>,
    ) {
        if let Some(g) = self.gen.as_mut() {
            g.broken.insert(rank, (node, step));
        }
        if let Some(c) = corrupt {
            self.distrust(rank, c);
        }
        self.record(Event::WorkerBroken {
            node,
            rank,
            step,
            error,
        });
    }

    /// A copy of `c.layer` from rank `c.from` arrived corrupted at `rank`: that replica is not
    /// used again, so the next decision takes the layer from another holder or, with none
    /// left, from the newest checkpoint.
    fn distrust(&mut self, rank: u32, c: CorruptCopy) {
        let Some(g) = self.gen.as_ref() else { return };
        let Some(node) = g.node_of(c.from) else {
            return;
        };
        let device = c.from % g.plan.devices_per_node;
        let mut layers = self
            .replicas
            .holdings
            .layers(node, device)
            .unwrap_or_default();
        layers.remove(&c.layer);
        self.replicas.holdings.set(node, device, layers);
        self.note(format!(
            "layer {} from rank {} (node {node}) arrived corrupted at rank {rank}: that replica \
             is not used again",
            c.layer, c.from
        ));
    }

    /// Book-keeping of a worker that built its stage, in any phase: from now on its device
    /// holds `layers` of the committed step.
    pub(super) fn on_formed(&mut self, node: u32, rank: u32, layers: Vec<usize>) {
        let device = rank % self.spec.devices_per_node;
        let trusted = layers
            .into_iter()
            .filter(|&l| !self.replicas.distrusted.contains(&(node, device, l)))
            .collect();
        self.replicas.holdings.set(node, device, trusted);
    }

    /// Book-keeping of an exited worker, in any phase.
    pub(super) fn on_worker_exited(
        &mut self,
        node: u32,
        rank: u32,
        status: ExitStatus,
        error: Option<String>,
    ) {
        if let Some(g) = self.gen.as_mut() {
            g.broken.remove(&rank);
            g.exited.insert(rank);
            // Its state went with it.
            let device = rank % g.plan.devices_per_node;
            self.replicas.drop_device(node, device);
        }
        self.record(Event::WorkerExit {
            node,
            rank,
            generation: self.generation,
            code: status.code,
            signal: status.signal,
            error,
        });
    }

    /// A node or worker of the running generation is gone: recover within `f`, else end.
    pub(super) fn node_failure(&mut self, now: Duration, what: String) {
        let Some(g) = self.gen.as_ref() else {
            return self.fail(RuntimeError::NodeFailure { what });
        };
        // A worker that fails while its generation forms, on a node that is still up (it
        // cannot bind its port, cannot load its state), would fail the same way again; one
        // that was killed would not.
        let recoverable = self.spec.fault_threshold > 0
            && !matches!(self.phase, Phase::Planning { .. })
            && (g.formed
                || g.killed
                || self.membership.lost_count() > g.lost_before
                || self.membership.dead_agents() > g.agents_dead_before);
        if !recoverable {
            return self.fail(RuntimeError::NodeFailure { what });
        }
        let progressed = self.steps_run() > g.steps_before;
        let fruitless = self.recoveries.count_failure(progressed);
        if fruitless > self.limits.max_fruitless_recoveries {
            return self.fail(RuntimeError::GaveUp {
                recoveries: self.limits.max_fruitless_recoveries,
                failure: what,
            });
        }
        self.begin_recovery(now, Failure::new(what, now, self.committed()));
    }
}

/// The signals that end a process from outside it (not its own crash: SIGSEGV, SIGABRT,
/// SIGBUS, SIGILL, SIGFPE would come again).
fn killed_from_outside(signal: Option<i32>) -> bool {
    const SIGHUP: i32 = 1;
    const SIGINT: i32 = 2;
    const SIGKILL: i32 = 9;
    const SIGTERM: i32 = 15;
    matches!(signal, Some(SIGHUP | SIGINT | SIGKILL | SIGTERM))
}

/// `: <what the worker printed>`, or a pointer to the logs when it printed nothing.
fn because(error: Option<&str>) -> String {
    match error {
        Some(e) => format!(":\n{e}"),
        None => "; see its node's log".into(),
    }
}

fn describe(code: Option<i32>, signal: Option<i32>) -> String {
    match (code, signal) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("signal {s}"),
        (None, None) => "unknown status".into(),
    }
}
