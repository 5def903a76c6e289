//! The master's loop: feed the machine its inputs, carry out its actions.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;

mod replicate;
mod save;

use super::agents::AgentSet;
use super::assemble::{Assembled, Assembler};
use super::rundir::{refuse_checkpoint, RunFiles};
use super::{next_input, plan_for, JobSummary, Observer};
use oobleck_comm::SecretKey;

use super::server::Master;
use crate::planning::{ModelProfile, Plan};
use crate::runtime::error::{Context, Result, RuntimeError};
use crate::runtime::job::{Action, Input, JobMachine};
use crate::runtime::spec::{DataPlane, JobConfig, TrainingSpec};
use crate::runtime::wire::pipe::StateSource;
use crate::runtime::wire::protocol::{GenerationStart, Rendezvous};
use crate::runtime::wire::records::{Event, SampleHash, StepData, StepMetrics};
use crate::runtime::wire::Message;

pub(super) struct Parts<'a> {
    pub config: JobConfig,
    pub out: PathBuf,
    pub profile: ModelProfile,
    pub files: RunFiles,
    pub master: &'a mut Master,
    pub agents: &'a mut AgentSet,
    pub observer: &'a mut dyn Observer,
    pub assembler: Assembler,
    pub machine: JobMachine,
    pub t0: Instant,
    /// Where and how workers upload their state (the master's [`oobleck_comm::BlobSink`]).
    pub state_port: u16,
    pub state_key: SecretKey,
    /// SIGTERM and SIGINT to this process.
    pub signals: super::signals::Signals,
}

/// What the final step left: `(step, pipeline 0's states, each rank's commit wait)`.
type Finished = (u64, BTreeMap<u32, String>, BTreeMap<u32, f64>);

pub(super) struct Driver<'a> {
    p: Parts<'a>,
    /// Checkpoints and evaluations running on blocking threads.
    background: Vec<JoinHandle<Input>>,
    /// This job's first and last loss.
    first_loss: Option<f64>,
    last_loss: Option<f64>,
    /// The running generation's stepping: when it started, from which step, the last commit.
    stepping: Instant,
    gen_start_step: u64,
    last_step_at: Instant,
    commit_ns: u128,
    /// The last step's metrics, written once its validation loss is in.
    final_metrics: Option<StepMetrics>,
    finished: Option<Finished>,
    /// The standbys' copies of the run directory (`replicate.rs`).
    mirrors: replicate::Mirrors,
}

impl<'a> Driver<'a> {
    pub fn new(p: Parts<'a>) -> Driver<'a> {
        let now = Instant::now();
        Driver {
            p,
            background: Vec::new(),
            first_loss: None,
            last_loss: None,
            stepping: now,
            gen_start_step: 0,
            last_step_at: now,
            commit_ns: 0,
            final_metrics: None,
            finished: None,
            mirrors: Default::default(),
        }
    }

    pub fn into_files(self) -> RunFiles {
        self.p.files
    }

    fn now(&self) -> Duration {
        self.p.t0.elapsed()
    }

    fn feed(&mut self, input: Input) {
        // A stopped master decides nothing more (see `give_up_if_stopped`).
        if self.p.master.stopped_past_lease() {
            return;
        }
        let now = self.now();
        self.p.machine.handle(now, input);
    }

    fn spec(&self) -> &TrainingSpec {
        &self.p.config.training
    }

    /// A message to `node` did not go out.
    fn unreachable(&mut self, node: u32, what: String) {
        self.feed(Input::Unreachable { node, what });
    }

    fn tokens_per_step(&self) -> f64 {
        let samples = self.spec().global_batch_samples() as f64;
        samples * self.p.assembler.workload.tokens_per_sample() as f64
    }

    /// Runs until the machine finishes (then writes the final checkpoint) or fails.
    pub async fn run(&mut self) -> Result<JobSummary> {
        loop {
            self.take_signal()?;
            while let Some(a) = self.p.machine.poll_action() {
                self.give_up_if_stopped()?;
                self.carry(a).await?;
            }
            if let Some(done) = self.finished.take() {
                return self.finish(done).await;
            }
            self.replicate(false).await;
            for (which, node, status) in self.p.agents.exited()? {
                self.feed(Input::AgentExited {
                    which,
                    node,
                    status,
                });
            }
            let (done, running): (Vec<_>, Vec<_>) = std::mem::take(&mut self.background)
                .into_iter()
                .partition(|t| t.is_finished());
            self.background = running;
            for task in done {
                let input = task.await.ctx("a checkpoint or evaluation task")?;
                self.feed(input);
            }
            let input = next_input(self.p.master).await?;
            self.give_up_if_stopped()?;
            if let Input::Worker {
                node,
                report: crate::runtime::WorkerReport::Listening { pid, .. },
                ..
            } = &input
            {
                self.p.agents.worker_started(*node, *pid);
            }
            self.feed(input);
        }
    }

    /// A process stopped near or past its lease (`stopwatch.rs`: a lease without a heartbeat)
    /// was taken for lost by its agents, and the control port refuses them meanwhile
    /// (`conn.rs`). Going on would meet them as new nodes and replay from a checkpoint, so it
    /// gives up its place: with standbys, to the one that takes over once this process is
    /// gone (`RuntimeError::Replaced`); without, to itself started again with `--reattach`,
    /// leaving its agents to be taken back (`RuntimeError::StoppedTooLong`).
    fn give_up_if_stopped(&self) -> Result<()> {
        if !self.p.master.stopped_past_lease() {
            return Ok(());
        }
        let (lease, waited) = (self.p.master.lease(), self.p.master.stopped_for());
        if self.mirrors.had {
            return Err(RuntimeError::Replaced {
                epoch: self.p.master.epoch(),
                why: format!(
                    "it was stopped for {:.1} s, near or past its lease of {:.1} s: its agents \
                     took it for lost, and a standby takes over once it is gone",
                    waited.as_secs_f64(),
                    lease.as_secs_f64()
                ),
            });
        }
        Err(RuntimeError::StoppedTooLong {
            epoch: self.p.master.epoch(),
            waited_ms: waited.as_millis() as u64,
            lease_ms: lease.as_millis() as u64,
        })
    }

    /// The first signal asks the machine to stop after the next step; a second stops the job
    /// at once.
    fn take_signal(&mut self) -> Result<()> {
        let Some((signal, seen)) = self.p.signals.poll() else {
            return Ok(());
        };
        if seen == 1 {
            self.feed(Input::StopRequested {
                signal: signal.into(),
            });
            return Ok(());
        }
        Err(RuntimeError::Interrupted {
            signal: signal.into(),
            newest: save::newest_checkpoint(&self.p.out),
        })
    }

    async fn carry(&mut self, a: Action) -> Result<()> {
        match a {
            Action::Record(e) => self.p.files.event(&e)?,
            Action::Note(s) => self.p.observer.note(&s),
            Action::Plan {
                nodes,
                fault_threshold,
                pinned,
            } => self.plan(&nodes, fault_threshold, pinned.as_deref()),
            Action::Reconfigure {
                plan,
                holdings,
                lost,
                drained,
                joined,
            } => {
                // The machine left out of `holdings` what drained nodes cannot send.
                let r = crate::reconfig::decide_leaving(&plan, &holdings, &lost, &drained, &joined);
                self.feed(Input::Reconfigured(r));
            }
            Action::WeighJoins {
                plan,
                holdings,
                joined,
            } => {
                let r = crate::reconfig::decide_with(&plan, &holdings, &[], &joined);
                let pipelines = r.map(|r| r.plan.pipelines.len());
                self.feed(Input::JoinsWeighed { joined, pipelines });
            }
            Action::Release { node, reason } => self.release(node, reason).await,
            Action::Membership {
                joining,
                draining,
                spare,
            } => self.p.master.set_membership(joining, draining, spare),
            Action::RankTimes { step: _, ranks } => self.p.master.set_rank_times(ranks),
            Action::Deploy { plan, source } => self.deploy_checked(&plan, source).await?,
            Action::Rendezvous {
                generation,
                rendezvous,
            } => self.rendezvous(generation, rendezvous).await,
            Action::Commit {
                step,
                loss,
                grad_norm,
                generation,
                pipelines,
                nodes,
                eval_due,
                microbatches,
                samples,
                times,
                last,
            } => {
                let mut m = self.metrics(step, loss, grad_norm, generation, pipelines, nodes);
                m.microbatches = crate::runtime::wire::records::ranges(&microbatches);
                m.data = samples.map(|h| {
                    let cursor = self.p.assembler.workload.data_cursor(step - 1);
                    step_data(&cursor, h)
                });
                m.times = times;
                self.commit(m, eval_due, last).await?;
            }
            Action::Recommit {
                node,
                step,
                generation,
            } => {
                let commit = Message::StepCommitted {
                    step,
                    generation,
                    last: false,
                };
                if let Err(e) = self.p.master.send_to(node, commit).await {
                    self.unreachable(node, format!("the commit of step {step} again: {e}"));
                }
            }
            Action::EndReturns => self.p.master.end_returns(),
            Action::Abort { generation } => {
                let abort = Message::AbortGeneration { generation };
                // Nodes that do not hear it find out from their peers' aborted connections.
                let _ = self.p.master.broadcast(&abort).await;
            }
            Action::KillNode { node } => self.kill_node(node).await,
            Action::Fence { node } => {
                if let Some(pid) = self.p.agents.fence(node).await {
                    self.p.files.event(&Event::Fenced { node, pid })?;
                }
            }
            Action::Assemble {
                step,
                states,
                checkpoint,
                eval,
            } => self.assemble(step, states, checkpoint, eval, move |a| match a {
                Ok(a) => Input::Assembled {
                    step,
                    checkpoint: a.checkpoint.map(|p| p.display().to_string()),
                    val_loss: a.val_loss,
                    duration_s: a.duration_s,
                },
                Err(e) => Input::AssemblyFailed {
                    step,
                    error: e.to_string(),
                },
            }),
            Action::SaveFailed(f) => self.save_failed(f)?,
            Action::ValLoss { step, val_loss } => self.p.files.val_loss(step, val_loss)?,
            Action::ReleaseHeld => {
                self.p.files.release()?;
            }
            Action::TruncateMetrics { after } => self.p.files.truncate_after(after)?,
            Action::Finish {
                step,
                states,
                commit_wait_ms,
            } => self.finished = Some((step, states, commit_wait_ms)),
            Action::Fail(e) => return Err(e),
        }
        Ok(())
    }

    /// Plans for `nodes` as the machine asked and feeds the answer back. The planner is pure
    /// too, but runs here, not in the machine: the profile lives in the master, and the
    /// machine's table tests answer with whatever plan a case needs.
    fn plan(&mut self, nodes: &[u32], fault_threshold: u32, pinned: Option<&[u32]>) {
        let plan = plan_for(self.spec(), &self.p.profile, nodes, fault_threshold, pinned);
        self.feed(Input::Planned(plan));
    }

    /// Tells `node` to stop its workers and exit; its agent's exit is expected from now on.
    async fn release(&mut self, node: u32, reason: String) {
        self.p.agents.release(node);
        if let Err(e) = self.p.master.release(node, reason).await {
            tracing::warn!(node, error = %e, "could not tell a released node to go");
        }
    }

    async fn kill_node(&mut self, node: u32) {
        let kill = Message::KillNode { node };
        if let Err(e) = self.p.master.send_to(node, kill).await {
            tracing::warn!(node, error = %e, "could not tell the node to die");
        }
    }

    /// Deploys `plan`, unless the checkpoint it starts from does not read: then the machine
    /// hears why and which older one to use.
    async fn deploy_checked(&mut self, plan: &Plan, source: StateSource) -> Result<()> {
        match refuse_checkpoint(&self.p.out, &source) {
            Some(refused) => {
                self.feed(refused);
                Ok(())
            }
            None => self.deploy(plan, source).await,
        }
    }

    /// The metrics line of committed `step`, timed since the previous commit.
    fn metrics(
        &mut self,
        step: u64,
        loss: f64,
        grad_norm: f64,
        generation: u64,
        pipelines: usize,
        nodes: usize,
    ) -> StepMetrics {
        let dt = self.last_step_at.elapsed().as_secs_f64().max(1e-9);
        self.last_step_at = Instant::now();
        StepMetrics {
            step,
            loss,
            lr: self.spec().lr.lr_at(step - 1),
            grad_norm,
            samples_per_s: self.spec().global_batch_samples() as f64 / dt,
            tokens_per_s: self.tokens_per_step() / dt,
            generation,
            pipelines,
            nodes,
            wall_s: self.p.t0.elapsed().as_secs_f64(),
            val_loss: None,
            microbatches: String::new(),
            times: BTreeMap::new(),
            data: None,
        }
    }

    /// Tells every rank to apply the step, and records it.
    async fn commit(&mut self, m: StepMetrics, eval_due: bool, last: bool) -> Result<()> {
        let started = Instant::now();
        // On disk, here and at every standby, before any agent hears of it: a restarted
        // master knows every step applied.
        self.p.files.record_commit(&m)?;
        self.replicate(true).await;
        let missed = self
            .p
            .master
            .commit_step(m.step, m.samples_per_s, last)
            .await;
        self.commit_ns += started.elapsed().as_nanos();
        if let Some((node, e)) = missed.into_iter().next() {
            self.unreachable(node, format!("the commit of step {}: {e}", m.step));
        }
        self.first_loss.get_or_insert(m.loss);
        self.last_loss = Some(m.loss);
        let total = self.spec().steps;
        self.p.observer.step(&m, total);
        if last {
            self.final_metrics = Some(m);
            return Ok(());
        }
        self.p.files.metrics(m, eval_due)
    }

    /// Assembles `states` on a blocking thread; `answer` turns the result into the input the
    /// machine gets when it is done.
    fn assemble(
        &mut self,
        step: u64,
        states: BTreeMap<u32, String>,
        checkpoint: bool,
        eval: bool,
        answer: impl FnOnce(Result<Assembled>) -> Input + Send + 'static,
    ) {
        let a = self.p.assembler.clone();
        self.background.push(tokio::task::spawn_blocking(move || {
            answer(a.assemble(step, &states, checkpoint, eval))
        }));
    }

    /// Starts a generation: `plan.json`, then the job and the plan to every node of it, with
    /// a fresh data-plane key (sent over the authenticated control plane only).
    async fn deploy(&mut self, plan: &Plan, source: StateSource) -> Result<()> {
        self.p.files.plan(plan)?;
        let job = Message::Job {
            run_dir: self.p.out.display().to_string(),
            config: serde_json::to_value(&self.p.config).ctx("encoding the job")?,
        };
        let mut nodes: Vec<u32> = plan
            .pipelines
            .iter()
            .flat_map(|p| p.nodes.clone())
            .collect();
        nodes.sort_unstable();
        for node in nodes {
            if let Err(e) = self.p.master.send_to(node, job.clone()).await {
                self.unreachable(node, format!("the job: {e}"));
                return Ok(());
            }
        }
        let unreachable = self
            .p
            .master
            .assign_plan(
                plan,
                GenerationStart {
                    rendezvous: Vec::new(),
                    nccl_unique_id: nccl_unique_id(self.spec().data_plane)?,
                    key: SecretKey::random(),
                    source,
                    state_port: self.p.state_port,
                    state_key: self.p.state_key.clone(),
                },
            )
            .await
            .ctx("assigning the plan")?;
        if let Some((node, e)) = unreachable.into_iter().next() {
            self.unreachable(node, format!("the plan: {e}"));
            return Ok(());
        }
        let status = self.p.master.status();
        self.p.observer.plan(&status);
        Ok(())
    }

    async fn rendezvous(&mut self, generation: u64, rendezvous: Vec<Rendezvous>) {
        let missed = self
            .p
            .master
            .broadcast(&Message::RendezvousList {
                generation,
                rendezvous,
            })
            .await;
        if let Some((node, e)) = missed.into_iter().next() {
            self.unreachable(node, format!("the rendezvous: {e}"));
        }
        let now = Instant::now();
        self.stepping = now;
        self.last_step_at = now;
        self.gen_start_step = self.p.machine.committed();
    }

    /// The last step is committed and every worker done: the control plane's cost, the final
    /// checkpoint and evaluation, the summary.
    async fn finish(&mut self, (step, states, waits): Finished) -> Result<JobSummary> {
        for task in self.background.drain(..) {
            let _ = task.await;
        }
        let ran = (step - self.gen_start_step).max(1) as f64;
        let train_s = self
            .last_step_at
            .duration_since(self.stepping)
            .as_secs_f64();
        // The rank that waited least for its commits was the last to be ready in most steps:
        // its wait is the round trip the commit protocol adds (ready -> agent -> master ->
        // agent -> worker), an upper bound on the control plane's cost per step.
        let overhead_ms = waits.values().copied().fold(f64::INFINITY, f64::min) / ran;
        let step_ms = 1e3 * train_s / ran;
        self.p.files.event(&Event::ControlPlane {
            steps: step - self.gen_start_step,
            commit_wait_ms_per_step: overhead_ms,
            step_ms,
            master_commit_ms_per_step: self.commit_ns as f64 / 1e6 / ran,
        })?;
        self.p.observer.note(&format!(
            "control plane: {overhead_ms:.2} ms per step waiting for commits ({:.2}% of a \
             {step_ms:.0} ms step)",
            100.0 * overhead_ms / step_ms.max(1e-9)
        ));
        let done = self.final_assembly(step, states).await?;
        let ckpt = done
            .checkpoint
            .ctx("the final assembly wrote no checkpoint")?;
        let val = done.val_loss;
        self.p.files.event(&Event::Checkpoint {
            step,
            path: ckpt.display().to_string(),
            duration_s: done.duration_s,
            // The final state is uploaded after the last step: nothing waits for it.
            stall_ms: 0.0,
        })?;
        // A step's line waits for its validation loss, which never comes when a saver's
        // upload of that step failed: written without it rather than held (and lost, with
        // every step after it).
        let unmet = self.p.files.release()?;
        if !unmet.is_empty() {
            self.p.observer.note(&format!(
                "no validation loss came for step(s) {unmet:?} (a saver's state of that step \
                 never reached the master); metrics.jsonl has those steps without it"
            ));
        }
        if let Some(mut m) = self.final_metrics.take() {
            m.val_loss = val;
            self.p.files.metrics(m, false)?;
        }
        let wall_s = self.p.t0.elapsed().as_secs_f64();
        let steps_run = self.p.machine.steps_run() as f64;
        Ok(JobSummary {
            steps: step,
            first_loss: self.first_loss,
            final_loss: self.last_loss,
            final_val_loss: val,
            tokens_per_s: self.tokens_per_step() * steps_run / wall_s.max(1e-9),
            wall_s: wall_s.max(1e-9),
            checkpoint: Some(ckpt),
        })
    }
}

/// A fresh NCCL unique id for a generation, with the NCCL data plane.
fn nccl_unique_id(plane: DataPlane) -> Result<Option<Vec<u8>>> {
    if plane != DataPlane::Nccl {
        return Ok(None);
    }
    let id = oobleck_comm::NcclId::new().map_err(|e| {
        RuntimeError::Invalid(format!(
            "making the NCCL unique id (is NCCL installed on the master's machine?): {e}"
        ))
    })?;
    Ok(Some(id.0.to_vec()))
}

/// The `data` of a step's metrics line: the position of its data, read from the workload's
/// cursor before it (`epoch` and `iteration`, where the workload has them: see
/// [`crate::runtime::Workload::data_cursor`]), and the hash of its samples.
fn step_data(cursor: &serde_json::Value, samples: SampleHash) -> StepData {
    StepData {
        epoch: cursor.get("epoch").and_then(serde_json::Value::as_u64),
        iteration: cursor.get("iteration").and_then(serde_json::Value::as_u64),
        samples: samples.hex(),
    }
}
