//! The node agent (`OOBLECK_ROLE=agent`): one node's supervisor, whatever the workload.
//! Registers with the master, receives the job and each generation's plan, starts one worker
//! per device of the plan on this node, relays between the workers' pipes and the control
//! protocol, and stops its workers on `Shutdown`. When the master goes away (or, with
//! `exit_with_parent`, its stdin closes) it keeps its workers and looks for a master for
//! `--master-wait` (`lost.rs`, on the schedule of `lookup.rs`) before it stops them.
//!
//! ```text
//!  master ──Job, PlanAssignment, RendezvousList, StepCommitted──► agent
//!  agent  ──WorkerAssignment, ToWorker lines──► worker stdin
//!           (after a failure, in place: Reassign to the workers that live, a fresh worker
//!            for a device whose worker died)
//!  worker stdout ──WorkerReport lines──► agent ──Message::Worker{node, generation, report}──► master
//!  worker exit ──► agent ──Message::Worker{.., report: Exited}──► master
//! ```

mod leave;
pub mod link;
mod lookup;
mod lost;
mod notice;
mod options;
mod spawn;
mod watchdog;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

pub use self::link::Agent;
pub use self::lookup::parse_master_wait;
pub use self::options::{AgentOptions, DEFAULT_MASTER_WAIT};

use self::leave::{watch_notice, watch_sigterm, Leaving, SIGTERM};
use self::lost::Search;
use self::spawn::{spawn_worker, stop_workers, tell_all, Worker};
use self::watchdog::Watch;
use super::error::{Context, Result, RuntimeError};
use super::net::resolve;
use super::spec::JobConfig;
use super::wire::pipe::{StateSource, ToWorker, WorkerAssignment};
use super::wire::records::WorkerReport;
use crate::execution::Snapshot;
use crate::planning::ranks_of_node;
use crate::planning::Plan;
use crate::runtime::wire::protocol::{GenerationStart, Rendezvous};
use crate::runtime::wire::{Message, Token, WireError};

/// Bound of the registration and of every message to the master or a worker.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the agent looks at its workers between master messages.
const POLL: Duration = Duration::from_millis(20);
/// How long finished workers get to exit after `Shutdown` before they are killed.
const GRACE: Duration = Duration::from_secs(5);
/// Things the agent's loop hears besides the master.
pub(super) enum Local {
    /// `(device, (generation, report))`: reports of an earlier generation are dropped.
    Report(u32, std::result::Result<(u64, WorkerReport), String>),
    /// A worker's progress beat, for the watchdog.
    Beat(u32, std::result::Result<Snapshot, String>),
    StdinClosed,
    /// This node was told it goes away (SIGTERM, a preemption notice): why.
    Leave(String),
}

/// Runs one node of a job until the master shuts it down (`Ok`) or something fails. Builds
/// its own (single-threaded) tokio runtime.
pub fn run_agent(opts: &AgentOptions) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ctx("starting the agent's runtime")?;
    rt.block_on(drive(opts))
}

async fn drive(opts: &AgentOptions) -> Result<()> {
    let (local_tx, mut local_rx) = mpsc::unbounded_channel::<Local>();
    if opts.exit_with_parent {
        watch_stdin(local_tx.clone());
    }
    watch_sigterm(local_tx.clone())?;
    if let Some(source) = &opts.preemption_notice {
        watch_notice(source, opts.notice_interval, local_tx.clone())?;
    }
    let token = Token::new(&opts.token)
        .ctx("the job token")?
        .for_job(opts.job.as_deref());
    let master = resolve(&opts.master)?;
    let conn = register(master, &token, opts.wait).await?;
    let node = conn.node();
    let epoch = conn.epoch();
    let host = match &opts.host {
        Some(h) => h.clone(),
        None => conn.local_addr().ip().to_string(),
    };
    tracing::info!(node, %master, data_host = %host, "agent registered");
    let mut agent = NodeAgent {
        master,
        masters: vec![opts.master.clone()],
        token,
        master_wait: opts.master_wait,
        committed: 0,
        lost: None,
        node,
        host,
        conn,
        local_tx,
        job: None,
        generation: 0,
        workers: Vec::new(),
        exited: Vec::new(),
        ranks: Default::default(),
        formed: Default::default(),
        leaving: None,
        drain_wait: opts.drain_wait,
        watch: Default::default(),
        limits_told: false,
        epoch,
        passed_over: Default::default(),
        parent_gone_ok: false,
    };
    let result = agent.run(&mut local_rx).await;
    let grace = if result.is_ok() {
        GRACE
    } else {
        Duration::ZERO
    };
    stop_workers(&mut agent.workers, grace).await;
    // What the workers mapped and did not unlink (they exit without dropping their
    // communicator, or were killed) goes with them.
    oobleck_comm::remove_segments_of_exited_processes();
    result
}

/// Tells the loop when stdin closes: the process that started this agent is gone.
fn watch_stdin(tx: mpsc::UnboundedSender<Local>) {
    std::thread::spawn(move || {
        use std::io::BufRead;
        let stdin = std::io::stdin();
        let mut lock = stdin.lock();
        let mut sink = String::new();
        loop {
            sink.clear();
            match lock.read_line(&mut sink) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        let _ = tx.send(Local::StdinClosed);
    });
}

/// Registers with the master. A master that is not up yet (agents and master started in any
/// order) is waited for, up to `wait`; a refusal (wrong token, other version) is final.
async fn register(master: std::net::SocketAddr, token: &Token, wait: Duration) -> Result<Agent> {
    let deadline = tokio::time::Instant::now() + wait;
    let mut told = false;
    loop {
        match Agent::connect(master, token, CONTROL_TIMEOUT).await {
            Ok(a) => return Ok(a),
            Err(e @ (WireError::Io { .. } | WireError::Timeout { .. }))
                if tokio::time::Instant::now() < deadline =>
            {
                if !told {
                    eprintln!(
                        "oobleck agent: no master at {master} yet ({e}); retrying for up to {} s",
                        wait.as_secs()
                    );
                    told = true;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e @ (WireError::Io { .. } | WireError::Timeout { .. })) => {
                return Err(e).with_ctx(|| {
                    format!(
                        "no master answered at {master} within the agent's wait of {} s: is the \
                         master started, and is {master} the address it listens on (`train \
                         --listen`)? `--wait SECS` waits longer",
                        wait.as_secs()
                    )
                })
            }
            Err(e) => {
                return Err(e).with_ctx(|| format!("registering with the master at {master}"))
            }
        }
    }
}

/// What the master said the job is: its run directory and settings.
struct Job {
    run_dir: PathBuf,
    config: JobConfig,
}

/// Whether the agent goes on after a master message.
enum Flow {
    Continue,
    Shutdown,
}

/// How serving one master ended.
enum Served {
    /// It shut this node down, or released it (or the node left without being released).
    Shutdown,
    /// It is gone, and why.
    MasterLost(String),
}

/// A registered agent and its workers.
struct NodeAgent {
    /// The master's control address: its host also takes the workers' state uploads.
    master: SocketAddr,
    /// Where to look for a master after losing one: the one it was given first, then the
    /// standby masters the master named (`Message::Standbys`).
    masters: Vec<String>,
    token: Token,
    /// How long to look for a master after losing one (`--master-wait`).
    master_wait: Duration,
    /// The last step the master committed.
    committed: u64,
    /// The master was found gone (a send failed, stdin closed), and why: the loop ends.
    lost: Option<String>,
    node: u32,
    /// The IP its workers bind their data-plane ports on.
    host: String,
    conn: Agent,
    local_tx: mpsc::UnboundedSender<Local>,
    job: Option<Job>,
    /// The generation whose workers run (0: none yet).
    generation: u64,
    workers: Vec<Worker>,
    /// Exits seen but not yet told, so that a worker's last reports reach the master first.
    exited: Vec<WorkerReport>,
    /// The rank of each device of this node in the running generation.
    ranks: std::collections::BTreeMap<u32, u32>,
    /// The ranks of the running generation whose workers built their stage (`Formed`): they
    /// hold a committed step, which a restarted master re-adopts.
    formed: std::collections::BTreeSet<u32>,
    /// It asked the master to let it go.
    leaving: Option<Leaving>,
    drain_wait: Duration,
    /// The watchdog's view of each device's worker (`watchdog.rs`).
    watch: std::collections::BTreeMap<u32, Watch>,
    /// It said that its workers' steps outlast `--hang-timeout` (once per node).
    limits_told: bool,
    /// The highest master epoch it has seen: it registers with no master of a lower one.
    epoch: u64,
    /// Addresses whose master it passed over while looking for its own, said once each.
    passed_over: std::collections::BTreeSet<String>,
    /// It serves a master found after losing the one that started it: stdin closing (that
    /// first master, or its ssh session, ending) says nothing about the master it serves.
    parent_gone_ok: bool,
}

impl NodeAgent {
    fn error(&self, what: String) -> RuntimeError {
        RuntimeError::Protocol {
            who: format!("node {}", self.node),
            what,
        }
    }

    /// Serves masters until one shuts this node down, or none is found within
    /// `--master-wait` after one was lost.
    async fn run(&mut self, local_rx: &mut mpsc::UnboundedReceiver<Local>) -> Result<()> {
        loop {
            let why = match self.serve(local_rx).await? {
                Served::Shutdown => return Ok(()),
                Served::MasterLost(why) => why,
            };
            match self.outlive_master(&why, local_rx).await {
                Search::Found(conn, at, addr) if conn.adopted() => self.carry_on(conn, at, addr),
                Search::Found(conn, at, addr) => self.start_over(conn, at, addr).await,
                Search::Left(reason) => {
                    eprintln!(
                        "oobleck agent: node {} leaves ({reason}) while it has no master: \
                         stopping workers now",
                        self.node
                    );
                    return Ok(());
                }
                Search::GaveUp(what) => return Err(self.give_up(what).await),
            }
        }
    }

    /// The agent's loop with one master: local events first, then exits, then the master or a
    /// worker, whichever speaks first.
    async fn serve(&mut self, local_rx: &mut mpsc::UnboundedReceiver<Local>) -> Result<Served> {
        // A local event that woke the loop below, handled first on the next turn.
        let mut woke: Option<Local> = None;
        loop {
            while let Some(ev) = woke.take().or_else(|| local_rx.try_recv().ok()) {
                self.on_local(ev).await?;
            }
            for report in std::mem::take(&mut self.exited) {
                self.send_report(report).await;
            }
            if let Some(why) = self.lost.take() {
                return Ok(Served::MasterLost(why));
            }
            self.reap_workers().await?;
            self.watch_workers().await?;
            if let Some(l) = self
                .leaving
                .as_ref()
                .filter(|l| Instant::now() >= l.deadline)
            {
                eprintln!(
                    "oobleck agent: node {} leaves without being released ({}): the master did \
                     not let it go within {} s",
                    self.node,
                    l.reason,
                    self.drain_wait.as_secs()
                );
                return Ok(Served::Shutdown);
            }
            // A worker's `Ready` goes out at once: every rank's commit waits for the slowest
            // report.
            let incoming = tokio::select! {
                ev = local_rx.recv() => {
                    woke = ev;
                    continue;
                }
                m = self.conn.recv(POLL) => m,
            };
            match incoming {
                Ok(msg) => {
                    if let Flow::Shutdown = self.on_message(msg).await? {
                        return Ok(Served::Shutdown);
                    }
                }
                Err(WireError::Timeout { .. }) => {}
                Err(e) => return Ok(Served::MasterLost(e.to_string())),
            }
        }
    }

    /// This node goes away: ask the master to drain it. A second SIGTERM leaves at once.
    async fn leave(&mut self, reason: String) -> Result<()> {
        if let Some(l) = &self.leaving {
            if reason == SIGTERM {
                return Err(self.error(format!(
                    "a second SIGTERM while leaving ({}): leaving now",
                    l.reason
                )));
            }
            return Ok(());
        }
        eprintln!(
            "oobleck agent: node {} leaves at the next step boundary ({reason}); waiting up to \
             {} s for the master to release it (SIGTERM again: leave now)",
            self.node,
            self.drain_wait.as_secs()
        );
        let drain = Message::Drain {
            node: self.node,
            reason: reason.clone(),
            force: true,
        };
        self.leaving = Some(Leaving {
            reason,
            deadline: Instant::now() + self.drain_wait,
        });
        self.tell_master(drain).await;
        Ok(())
    }

    async fn send_report(&mut self, report: WorkerReport) {
        let msg = Message::Worker {
            node: self.node,
            generation: self.generation,
            report,
        };
        self.tell_master(msg).await
    }

    /// Sends `msg` to the master. A send that fails means the master is gone (its
    /// connection's writer ended, or it stopped reading): noted, and the loop ends.
    async fn tell_master(&mut self, msg: Message) {
        if self.lost.is_some() {
            return;
        }
        if let Err(e) = self.conn.send(msg, CONTROL_TIMEOUT).await {
            self.lost = Some(e.to_string());
        }
    }

    async fn on_local(&mut self, ev: Local) -> Result<()> {
        match ev {
            Local::StdinClosed if self.parent_gone_ok => Ok(()),
            Local::StdinClosed => {
                // The master (or the ssh session to it) that started this agent is gone.
                self.lost
                    .get_or_insert_with(|| "the process that started this agent is gone".into());
                Ok(())
            }
            Local::Leave(reason) => self.leave(reason).await,
            Local::Beat(device, beat) => {
                match beat {
                    Ok(s) => self.on_beat(device, s),
                    // Progress is advisory: a garbled beat is said, never acted on.
                    Err(e) => eprintln!("oobleck agent: worker of device {device}: {e}"),
                }
                Ok(())
            }
            Local::Report(device, r) => {
                let (g, report) =
                    r.map_err(|e| self.error(format!("worker of device {device}: {e}")))?;
                if g != self.generation {
                    return Ok(());
                }
                self.note_formed(g, &report);
                // Not looked up in `workers`: a worker's last reports can arrive after it
                // was reaped.
                let rank = self.ranks.get(&device).copied();
                if rank != Some(report.rank())
                    || matches!(
                        report,
                        WorkerReport::Exited { .. }
                            | WorkerReport::Hung { .. }
                            | WorkerReport::Waiting { .. }
                    )
                {
                    // A worker's slip (or a report of a rank it no longer runs) must not take
                    // this node, and its healthy workers, out of the job: said and dropped.
                    let ours = rank.map_or("no rank".into(), |r| format!("rank {r}"));
                    tracing::warn!(
                        node = self.node,
                        device,
                        generation = g,
                        "dropped a report of kind {} naming rank {} from the worker of device \
                         {device} ({ours}): a worker reports only its own progress",
                        report.kind(),
                        report.rank()
                    );
                    return Ok(());
                }
                self.send_report(report).await;
                Ok(())
            }
        }
    }

    async fn on_message(&mut self, msg: Message) -> Result<Flow> {
        match msg {
            Message::Job { run_dir, config } => self.on_job(run_dir, config)?,
            Message::PlanAssignment {
                generation,
                plan,
                start,
            } => self.on_plan(generation, &plan, start).await?,
            Message::RendezvousList {
                generation,
                rendezvous,
            } if generation == self.generation => self.on_rendezvous(rendezvous).await?,
            Message::StepCommitted {
                step,
                generation,
                last,
            } if generation == self.generation => {
                self.committed = step;
                let commit = ToWorker::Commit { step, last };
                tell_all(self.node, &mut self.workers, &commit).await?;
            }
            Message::AbortGeneration { generation } if generation == self.generation => {
                self.on_abort(generation).await
            }
            Message::KillNode { node } if node == self.node => return Err(self.on_kill()),
            Message::Standbys { addrs } => {
                // Where to look after the master, in order, once it is lost.
                self.masters.truncate(1);
                self.masters.extend(addrs);
            }
            Message::Shutdown { reason } => {
                tracing::info!(node = self.node, %reason, "shutdown");
                return Ok(Flow::Shutdown);
            }
            other => {
                tracing::debug!(node = self.node, kind = other.kind(), "ignored a message");
            }
        }
        Ok(Flow::Continue)
    }

    fn on_job(&mut self, run_dir: String, config: serde_json::Value) -> Result<()> {
        let config: JobConfig = serde_json::from_value(config).ctx(
            "the master sent a job this agent cannot read (another version of the program?)",
        )?;
        self.job = Some(Job {
            run_dir: PathBuf::from(run_dir),
            config,
        });
        Ok(())
    }

    /// A new generation. In place (`StateSource::Peers`), each living worker of this node
    /// takes its device's new assignment and keeps its state; a device whose worker died gets
    /// a fresh one, and workers of devices the plan no longer uses stop. Otherwise every
    /// worker of the old generation goes at once (its step was not committed; the new
    /// generation replays it), and nothing of theirs is reported any more.
    async fn on_plan(&mut self, g: u64, plan: &Plan, start: GenerationStart) -> Result<()> {
        let (node, generation) = (self.node, self.generation);
        if g <= generation && !self.workers.is_empty() {
            return Err(self.error(format!(
                "a plan of generation {g} arrived while generation {generation} runs"
            )));
        }
        let g_dev = plan.devices_per_node;
        let mut ranks: Vec<(u32, u32)> = ranks_of_node(plan, node)
            .into_iter()
            .map(|r| (r % g_dev, r))
            .collect();
        if let StateSource::Peers { donors, .. } = &start.source {
            // Drained, with layers only this node holds: its workers send them first.
            ranks.extend(
                donors
                    .iter()
                    .filter(|d| d.node == node)
                    .map(|d| (d.device, d.rank)),
            );
        }
        if self.job.is_none() && ranks.is_empty() {
            // Waiting to join: the plan is for the others.
            return Ok(());
        }
        let Some(job) = &self.job else {
            return Err(self.error("the master sent a plan before the job".into()));
        };
        let in_place = matches!(start.source, StateSource::Peers { .. });
        let assignments: Vec<(u32, WorkerAssignment)> = ranks
            .into_iter()
            .map(|(device, rank)| {
                let a = WorkerAssignment {
                    generation: g,
                    rank,
                    node,
                    plan: plan.clone(),
                    host: self.host.clone(),
                    run_dir: job.run_dir.clone(),
                    job: job.config.clone(),
                    nccl_id: start.nccl_unique_id.clone(),
                    key: start.key.clone(),
                    source: start.source.clone(),
                    state_sink: SocketAddr::new(self.master.ip(), start.state_port).to_string(),
                    state_key: start.state_key.clone(),
                };
                (device, a)
            })
            .collect();
        let mut keep: Vec<Worker> = Vec::new();
        if in_place {
            let (kept, gone): (Vec<Worker>, Vec<Worker>) = std::mem::take(&mut self.workers)
                .into_iter()
                .partition(|w| assignments.iter().any(|(d, _)| *d == w.device));
            keep = kept;
            self.workers = gone;
        }
        if !self.workers.is_empty() {
            tracing::info!(node, from = generation, to = g, "stopping workers");
            stop_workers(&mut self.workers, Duration::ZERO).await;
        }
        self.exited.clear();
        self.generation = g;
        self.formed.clear();
        self.ranks = assignments.iter().map(|(d, a)| (*d, a.rank)).collect();
        self.rewatch(assignments.iter().map(|(d, _)| *d));
        for (device, a) in assignments {
            match keep.iter().position(|w| w.device == device) {
                Some(i) => {
                    let mut w = keep.swap_remove(i);
                    w.rank = a.rank;
                    let next = ToWorker::Reassign {
                        assignment: Box::new(a),
                    };
                    w.tell(node, &next).await?;
                    self.workers.push(w);
                }
                None => {
                    let w = spawn_worker(&a, device, self.local_tx.clone()).await?;
                    self.workers.push(w);
                }
            }
        }
        Ok(())
    }

    /// A worker of the running generation `g` that says it built its stage holds a
    /// committed step from now on (until the next generation).
    fn note_formed(&mut self, g: u64, report: &WorkerReport) {
        if let WorkerReport::Formed { rank, .. } = report {
            if g == self.generation {
                self.formed.insert(*rank);
            }
        }
    }

    async fn on_rendezvous(&mut self, rendezvous: Vec<Rendezvous>) -> Result<()> {
        tell_all(
            self.node,
            &mut self.workers,
            &ToWorker::Rendezvous { rendezvous },
        )
        .await
    }

    /// Tells every worker to stop its step; each confirms itself (`Stopping`), so a worker
    /// that died meanwhile is never taken for one that stops.
    async fn on_abort(&mut self, generation: u64) {
        let abort = ToWorker::Abort { generation };
        for w in self.workers.iter_mut() {
            // A worker that is gone cannot be stopped, nor needs to be: its exit is reported.
            let _ = w.tell(self.node, &abort).await;
        }
    }

    /// A failure injected for a demo or test: this node dies as a machine would, its workers
    /// and this agent by SIGKILL, with no goodbye to anyone. Returns only if that failed.
    fn on_kill(&mut self) -> RuntimeError {
        tracing::warn!(
            node = self.node,
            "killing this node's processes (injected failure)"
        );
        for w in self.workers.iter_mut() {
            let _ = w.child.start_kill();
        }
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &std::process::id().to_string()])
            .status();
        self.error("could not SIGKILL itself for the injected failure".into())
    }
}
