//! The master: binds the control plane ([`Master`], `server.rs`, with its connection tasks in
//! `conn.rs`), starts or waits for the node agents (`agents.rs`), and carries out what the
//! pure [`super::job::JobMachine`] decides (`carry.rs`): plans (`plan.rs`), commits,
//! checkpoints assembled from the workers' uploads (`assemble.rs`), recoveries, and the run
//! directory's files (`rundir.rs`). It owns every clock read, socket, file and process of
//! the master; it decides nothing the machine can.
//!
//! ```text
//!   Master events, agent exits, finished background work ──► Input ──► JobMachine
//!   JobMachine ──► Action ──► carry(): send, write, spawn_blocking, kill ──► (results as Input)
//! ```

mod admission;
mod agents;
mod assemble;
mod carry;
mod commits;
mod conn;
mod handshake;
pub mod mirror;
mod plan;
mod rundir;
pub mod server;
mod signals;
pub mod standby;
mod standbys;
mod stopwatch;

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use agents::Started;
pub use commits::{CommitRecord, COMMIT_FILE};
pub use plan::{pinned_pipelines, plan_for, planned_profile};
pub use rundir::{truncate_metrics_after, STANDBYS_FILE};
pub use server::{Master, MasterConfig, MasterEvent};
pub use standby::{run_standby, StandbyEnd, StandbyOptions};

use oobleck_comm::{BlobSink, SecretKey};

use self::agents::{AgentSet, EXIT_GRACE};
use self::assemble::Assembler;
use self::rundir::RunFiles;
use super::error::{Context, Result, RuntimeError};
use super::job::{Input, JobMachine, JobStart, Limits, Reattach, StragglerRule};
use super::spec::{JobConfig, TrainingSpec};
use super::wire::records::{Event, StartInfo, StepMetrics};
use super::workload::Workload;
use crate::checkpoint::space;
use crate::planning::ModelProfile;
use crate::runtime::wire::protocol::ClusterStatus;
use crate::runtime::wire::{Token, WireError};

/// The largest state file a worker may upload (one rank's parameters and optimizer state).
const MAX_STATE_BYTES: u64 = 64 << 30;

/// How often the master looks at its agents and background work between events.
const POLL: Duration = Duration::from_millis(50);

/// Starts agents over ssh (or any other way) once the master listens at the address given.
pub type LaunchFn = Box<
    dyn FnOnce(SocketAddr) -> Pin<Box<dyn Future<Output = Result<Vec<Started>>> + Send>> + Send,
>;

/// How a job's agents come to be.
pub enum Launch {
    /// `spec.nodes` agent processes of `exe` (this binary) on this machine, each of which
    /// looks for a master for `master_wait` if this one is lost.
    Local { exe: PathBuf, master_wait: Duration },
    /// Agents started by hand (`oobleck agent --master ADDR`) with the same token.
    Listen,
    /// Agents the caller starts, e.g. over ssh.
    Custom(LaunchFn),
}

/// What the master needs besides the workload.
pub struct JobOptions {
    pub config: JobConfig,
    /// The run directory (absolute: agents and workers get it as it is).
    pub run_dir: PathBuf,
    /// A resumed job: the checkpoint and its step.
    pub resume: Option<(PathBuf, u64)>,
    /// Plans of earlier runs in the directory (`plan.json`), kept and appended to.
    pub plans: Vec<serde_json::Value>,
    /// The run's configuration, echoed in every checkpoint's `trainer.json`.
    pub echo: serde_json::Value,
    /// The control plane's address (port 0: any).
    pub bind: SocketAddr,
    pub token: Token,
    pub launch: Launch,
    pub limits: Limits,
    /// A master restarted on `run_dir` (`--reattach`): it re-adopts the lost master's agents,
    /// which must come back to `bind`, instead of launching any.
    pub reattach: Option<Reattach>,
}

/// Whoever watches the job: progress lines, the plan, the status files of `oobleck status`.
pub trait Observer: Send {
    /// The master listens at `addr`.
    fn listening(&mut self, addr: SocketAddr, token: &Token) -> Result<()> {
        let _ = (addr, token);
        Ok(())
    }
    /// A generation's plan went out.
    fn plan(&mut self, status: &ClusterStatus) {
        let _ = status;
    }
    /// A step was committed (`total`: the job's steps).
    fn step(&mut self, m: &StepMetrics, total: u64) {
        let _ = (m, total);
    }
    /// A line for the person watching.
    fn note(&mut self, line: &str) {
        let _ = line;
    }
}

/// What a finished job reports.
#[derive(Debug, Clone)]
pub struct JobSummary {
    pub steps: u64,
    pub first_loss: Option<f64>,
    pub final_loss: Option<f64>,
    pub final_val_loss: Option<f64>,
    /// Over this job's wall time, replayed steps included.
    pub tokens_per_s: f64,
    pub wall_s: f64,
    pub checkpoint: Option<PathBuf>,
}

/// Runs the job to its last step, through failures within `f`. Blocks; builds its own tokio
/// runtime. On any error every process of the job is killed and the error says what failed.
pub fn run_job(
    workload: Arc<dyn Workload>,
    opts: JobOptions,
    observer: &mut dyn Observer,
) -> Result<JobSummary> {
    if let Some(role) = super::role() {
        return Err(RuntimeError::NotEntered { role });
    }
    opts.config.training.validate()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .ctx("starting the master's runtime")?;
    rt.block_on(drive(workload, opts, observer))
}

async fn drive(
    workload: Arc<dyn Workload>,
    mut opts: JobOptions,
    observer: &mut dyn Observer,
) -> Result<JobSummary> {
    let spec = opts.config.training.clone();
    let profile = checked_profile(workload.as_ref(), &spec)?;
    let mut files = RunFiles::open(&opts.run_dir, opts.plans.clone())?;
    // Workers upload their state here, into the run directory, which only this machine needs.
    let state_key = SecretKey::random();
    let sink = BlobSink::bind(
        SocketAddr::new(opts.bind.ip(), 0),
        state_key.clone(),
        opts.run_dir.clone(),
        MAX_STATE_BYTES,
    )
    .with_ctx(|| format!("starting the state upload port on {}", opts.bind.ip()))?;
    let mut control = MasterConfig::new(opts.token.clone(), spec.nodes);
    control.lease = opts.limits.lease;
    control.epoch = rundir::next_epoch(&opts.run_dir)?;
    if let Some(r) = &mut opts.reattach {
        r.epoch = control.epoch;
        control.recorded = Some(r.committed);
        control.returning = r.plans.iter().flat_map(|p| p.nodes()).collect();
        control.first_node = rundir::next_node_id(&opts.run_dir, &r.plans);
    }
    let mut master = Master::bind_with(opts.bind, control)
        .await
        .with_ctx(|| format!("starting the master on {}", opts.bind))?;
    announce(workload.as_ref(), &opts, &master, &mut files, observer)?;
    check_room(workload.as_ref(), &opts.run_dir, observer);
    let mut agents = AgentSet::default();
    let start = start_agents(&mut opts, &mut agents, &mut files, &master, observer).await?;
    let limits = opts.limits;
    let t0 = Instant::now();
    let stragglers = StragglerRule::of(&opts.config.watch);
    let machine =
        JobMachine::new(spec.clone(), start, limits, Duration::ZERO).with_stragglers(stragglers);
    let assembler = Assembler {
        workload: workload.clone(),
        out: opts.run_dir.clone(),
        seed: spec.seed,
        echo: opts.echo.clone(),
    };
    let mut d = carry::Driver::new(carry::Parts {
        config: opts.config,
        out: opts.run_dir.clone(),
        profile,
        files,
        master: &mut master,
        agents: &mut agents,
        observer,
        assembler,
        machine,
        t0,
        state_port: sink.addr().port(),
        state_key,
        signals: signals::Signals::listen()?,
    });
    let result = d.run().await;
    let files = d.into_files();
    conclude(result, master, agents, files).await
}

/// Starts the agents as `launch` says and records their processes.
async fn launch(
    launch: Launch,
    agents: &mut AgentSet,
    files: &mut RunFiles,
    master: &Master,
    token: &Token,
    nodes: u32,
    observer: &mut dyn Observer,
) -> Result<()> {
    let addr = master.local_addr();
    match launch {
        Launch::Local { exe, master_wait } => {
            for pid in agents.spawn_local(nodes as usize, &exe, addr, token, master_wait)? {
                files.event(&process("agent", pid, None))?;
            }
        }
        Launch::Listen => observer.note(&format!(
            "master listening on {addr}: start `oobleck agent --master {addr}` (with \
             OOBLECK_TOKEN set to the job's token) on each of the {nodes} nodes"
        )),
        Launch::Custom(start) => {
            for s in start(addr).await? {
                files.event(&process("ssh", s.child.id(), s.host.clone()))?;
                agents.adopt(s);
            }
        }
    }
    Ok(())
}

fn process(role: &str, pid: Option<u32>, host: Option<String>) -> Event {
    Event::Process {
        role: role.into(),
        pid,
        host,
        node: None,
        rank: None,
        data_addr: None,
    }
}

/// The machine's view of a membership event.
fn input_of(ev: MasterEvent) -> Input {
    match ev {
        MasterEvent::Joined {
            node,
            addr,
            back: Some(back),
            ..
        } => Input::Returned {
            node,
            addr: addr.to_string(),
            back,
        },
        MasterEvent::Joined { node, addr, .. } => Input::Joined {
            node,
            addr: addr.to_string(),
        },
        MasterEvent::Lost { node, reason } => Input::Lost { node, reason },
        MasterEvent::KillRequested { node } => Input::KillRequested { node },
        MasterEvent::StopRequested { reason } => Input::StopRequested { signal: reason },
        MasterEvent::Refused {
            peer,
            reason,
            count,
        } => Input::Refused {
            peer,
            reason,
            count,
        },
        MasterEvent::DrainRequested {
            node,
            reason,
            force,
        } => Input::DrainRequested {
            node,
            reason,
            force,
        },
        MasterEvent::Worker {
            node,
            generation,
            report,
        } => Input::Worker {
            node,
            generation,
            report,
        },
        // `next_input` ends the job at it: nothing for the machine.
        MasterEvent::Replaced { .. } => Input::Tick,
    }
}

/// The next membership event as an input, or a tick after `POLL`.
async fn next_input(master: &mut Master) -> Result<Input> {
    match master.next_event(POLL).await {
        Ok(MasterEvent::Replaced { epoch }) => Err(RuntimeError::Replaced {
            epoch: master.epoch(),
            why: format!("an agent came back from a master of epoch {epoch}"),
        }),
        Ok(ev) => Ok(input_of(ev)),
        Err(WireError::Timeout { .. }) => Ok(Input::Tick),
        Err(e) => Err(e).ctx("the master's event stream"),
    }
}

/// Starts (or waits for) the agents; where the job starts from.
async fn start_agents(
    opts: &mut JobOptions,
    agents: &mut AgentSet,
    files: &mut RunFiles,
    master: &Master,
    observer: &mut dyn Observer,
) -> Result<JobStart> {
    let nodes = opts.config.training.nodes;
    let announce_joins = matches!(opts.launch, Launch::Listen) || opts.reattach.is_some();
    let how = std::mem::replace(&mut opts.launch, Launch::Listen);
    if opts.reattach.is_some() {
        observer.note(&format!(
            "waiting at {} for the agents of the lost master to come back (`train agent` looks \
             for its master for --master-wait, 60 s by default)",
            master.local_addr()
        ));
    } else if let Err(e) = launch(how, agents, files, master, &opts.token, nodes, observer).await {
        agents.kill_all().await;
        return Err(e);
    }
    let reattach = opts.reattach.clone();
    Ok(JobStart {
        step: match &reattach {
            Some(r) => r.committed,
            None => opts.resume.as_ref().map_or(0, |r| r.1),
        },
        checkpoint: opts.resume.as_ref().map(|r| r.0.display().to_string()),
        generation: opts
            .plans
            .iter()
            .filter_map(|p| p["generation"].as_u64())
            .max()
            .map_or(0, |g| g + 1),
        starts_agents: !agents.is_empty(),
        announce_joins,
        reattach,
    })
}

/// The workload's profile, checked against its model, as the planner plans the job
/// ([`planned_profile`]: with `--recompute`, recomputation's memory and time).
fn checked_profile(workload: &dyn Workload, spec: &TrainingSpec) -> Result<ModelProfile> {
    workload.check(spec).map_err(RuntimeError::Workload)?;
    let profile = workload
        .profile(&spec.device_spec()?, spec.microbatch_size, spec.precision)
        .map_err(RuntimeError::Workload)?;
    let layers = workload.model().num_layers();
    if profile.layers.len() != layers {
        return Err(RuntimeError::Invalid(format!(
            "the profile of {} has {} layers, the model {layers}: the workload's profile() must \
             describe every layer of its model()",
            workload.name(),
            profile.layers.len()
        )));
    }
    Ok(planned_profile(profile, spec, workload.tokens_per_sample()))
}

/// The run's `start` (or `resume`) event and the first lines the person watching reads.
fn announce(
    workload: &dyn Workload,
    opts: &JobOptions,
    master: &Master,
    files: &mut RunFiles,
    observer: &mut dyn Observer,
) -> Result<()> {
    let spec = &opts.config.training;
    let layers = workload.model().num_layers();
    let info = StartInfo {
        step: match &opts.reattach {
            Some(r) => r.committed,
            None => opts.resume.as_ref().map_or(0, |r| r.1),
        },
        checkpoint: opts.resume.as_ref().map(|r| r.0.display().to_string()),
        model: Some(workload.name()),
        params: Some(workload.num_params()),
        nodes: Some(spec.nodes as usize),
        master: Some(master.local_addr().to_string()),
        pid: Some(std::process::id()),
    };
    if let Some(r) = &opts.reattach {
        files.event(&Event::MasterLost {
            lost_epoch: r.epoch.saturating_sub(1),
            epoch: r.epoch,
            step: r.committed,
            why: r.why.clone(),
        })?;
    }
    files.event(&match (&opts.reattach, &opts.resume) {
        (Some(_), _) => Event::Reattach(info),
        (None, Some(_)) => Event::Resume(info),
        (None, None) => Event::Start(info),
    })?;
    observer.listening(master.local_addr(), &opts.token)?;
    let local = matches!(opts.launch, Launch::Local { .. });
    // The workload's name says what is trained (a preset, or an imported model and its shape).
    observer.note(&format!(
        "training {}: {:.2}M parameters, {layers} layers, on {} of {} nodes x {} devices ({}; f \
         = {}); {} steps of {} samples x {} tokens; run directory {}",
        workload.name(),
        workload.num_params() as f64 / 1e6,
        if local {
            "a local cluster"
        } else {
            "a cluster"
        },
        spec.nodes,
        spec.devices_per_node,
        spec.compute_words(),
        spec.fault_threshold,
        spec.steps,
        spec.global_batch_samples(),
        workload.tokens_per_sample(),
        opts.run_dir.display()
    ));
    Ok(())
}

/// Warns before the first step when the run directory's file system cannot hold a
/// checkpoint while it is written (the states it is made from, and the checkpoint itself).
fn check_room(workload: &dyn Workload, out: &Path, observer: &mut dyn Observer) {
    let needed = 2 * space::checkpoint_bytes(workload.num_params());
    let Some(room) = space::space(out) else {
        return;
    };
    if room.free_bytes < needed {
        observer.note(&format!(
            "warning: {} has {} free, and writing a checkpoint takes about {}: checkpoints \
             will fail (each one says so, and training goes on) until space is freed there",
            room.filesystem,
            space::human_bytes(room.free_bytes),
            space::human_bytes(needed)
        ));
    }
}

/// Ends the job: on success the agents are shut down and must exit cleanly; on failure
/// everything is stopped.
async fn conclude(
    result: Result<JobSummary>,
    master: Master,
    mut agents: AgentSet,
    mut files: RunFiles,
) -> Result<JobSummary> {
    let result = conclude_job(result, master, &mut agents, &mut files).await;
    // A local job's agents are gone by now: the shared memory their workers left goes too.
    oobleck_comm::remove_segments_of_exited_processes();
    result
}

async fn conclude_job(
    result: Result<JobSummary>,
    master: Master,
    agents: &mut AgentSet,
    files: &mut RunFiles,
) -> Result<JobSummary> {
    match result {
        Ok(summary) => {
            let unheard = master.shutdown("training finished", EXIT_GRACE).await;
            for (node, e) in unheard {
                tracing::warn!(node, error = %e, "agent did not get the shutdown");
            }
            let bad = agents.wait_all(EXIT_GRACE).await;
            if !bad.is_empty() {
                return Err(RuntimeError::Invalid(format!(
                    "agents did not exit cleanly after the job: {}",
                    bad.join("; ")
                )));
            }
            files.event(&Event::Finish {
                step: summary.steps,
                wall_s: summary.wall_s,
            })?;
            Ok(summary)
        }
        // Another master runs the job now (or this one, started again): nothing of it is this
        // one's to stop or remove.
        Err(e @ (RuntimeError::Replaced { .. } | RuntimeError::StoppedTooLong { .. })) => {
            agents.leave();
            Err(e)
        }
        Err(e) => {
            // The states uploaded for a checkpoint that will not be written.
            let _ = std::fs::remove_dir_all(files.dir().join("cluster"));
            let reason = e.to_string();
            let _ = files.event(&Event::Abort {
                reason: reason.clone(),
            });
            let _ = master
                .shutdown(&format!("job failed: {reason}"), Duration::from_secs(2))
                .await;
            agents.kill_all().await;
            Err(e)
        }
    }
}
