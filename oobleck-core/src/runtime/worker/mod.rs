//! The worker: one device's process of a job (`OOBLECK_ROLE=worker`, always a child of its
//! node's agent). It trains its stage of the user's [`Workload`], generation after
//! generation, in the same process:
//!
//! ```text
//!  stdin: WorkerAssignment ──► bind the data-plane port ──► Listening
//!    ┌─────────────────────►  check the plan against the job; Rendezvous ──► connect the
//!    │                        data plane (proving the generation's key)
//!    │                        state: Init | Checkpoint | Peers (keep what it holds of the
//!    │                        committed step, receive the layers it lacks) ──► Formed
//!    │                        per step: 1F1B iteration + gradient sync ──► Ready
//!    │                                  wait for Commit ──► optimizer step
//!    │                                  (periodic state ──► Saved)
//!    │                        all steps ──► Done      a failed step ──► Broken, holding
//!    │                                                 the committed step's state
//!    └──── Reassign (the next generation's assignment), while Broken or waiting for a commit
//! ```
//!
//! A worker exits when its stdin closes (its agent is gone), after `Done`, or when no word
//! comes after a failure.

mod beat;
mod donate;
mod hooks;
mod inbox;
mod load;
mod save;
mod state;
mod steps;

use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Tensor};
use oobleck_comm::refusals::{RefusalSink, Refused};
use oobleck_comm::{Communicator, NcclCommunicator, NcclId, Rank, TcpCommunicator, TcpConfig};

pub use self::hooks::{TEST_HANG_ENV, TEST_SLOW_ENV};
use self::inbox::{report, Inbox};
use self::load::{load, Loaded};
pub use self::load::{TEST_CORRUPT_ENV, TEST_KILL_ENV};
use self::state::Held;
use super::device;
use super::error::{Context, Result, RuntimeError};
use super::net::resolve;
use super::wire::pipe::{ToWorker, WorkerAssignment};
use super::wire::records::{CorruptCopy, WorkerReport};
use super::workload::{Factory, Workload};
use crate::execution::{Layout, Progress, StageConfig, StageRunner, Watched, BUCKET_ELEMS};
use crate::model::{LayeredModel, ParamSource};
use crate::optim::AdamW;
use crate::runtime::wire::protocol::Rendezvous;

pub use super::timeouts::{COMMIT_TIMEOUT, DATA_TIMEOUT};

/// Where rank `rank` leaves its final parameters and optimizer state.
fn state_path(run_dir: &Path, rank: u32) -> PathBuf {
    run_dir
        .join("cluster")
        .join(format!("rank-{rank}.safetensors"))
}

/// Where rank `rank` leaves its state after committed step `step` for a periodic checkpoint
/// or evaluation (the master removes it once assembled).
fn state_path_at(run_dir: &Path, step: u64, rank: u32) -> PathBuf {
    run_dir
        .join("cluster")
        .join(format!("step-{step:06}"))
        .join(format!("rank-{rank}.safetensors"))
}

fn protocol(rank: u32, what: String) -> RuntimeError {
    RuntimeError::Protocol {
        who: format!("rank {rank}"),
        what,
    }
}

/// How a generation ended for this worker.
enum Flow {
    /// Every step is applied and reported: the job is over.
    Done,
    /// The next generation, with the state of the committed step this worker holds.
    Next(Box<WorkerAssignment>, Held),
}

/// Runs worker `rank` of a job: reads its assignment from stdin, builds the workload with
/// `factory` from the job's training spec and workload settings, and trains its generations.
/// Returns once its last step is applied and reported.
pub fn run_worker(rank: u32, factory: &Factory) -> Result<()> {
    let (first, inbox) = Inbox::start(rank)?;
    if first.rank != rank {
        return Err(protocol(
            rank,
            format!(
                "assignment is for rank {}, this worker was started as rank {rank}",
                first.rank
            ),
        ));
    }
    let mut a = first;
    let mut held = Held::nothing(0);
    let progress = Progress::new();
    beat::start(progress.clone());
    let mut workload: Option<Box<dyn Workload>> = None;
    loop {
        load::test_kill_point("deploy", &a, 0);
        let listening = Listening::bind(&a)?;
        // Built after the port is reported: the master gathers the generation's addresses
        // while its workers build their workloads.
        let w = match &workload {
            Some(w) => w,
            None => {
                let w =
                    factory(&a.job.training, &a.job.workload).map_err(RuntimeError::Workload)?;
                w.check(&a.job.training).map_err(RuntimeError::Workload)?;
                workload.insert(w)
            }
        };
        if donate::is_donor(&a) {
            match donate::donate(&a, listening, &inbox, held)? {
                Flow::Done => return Ok(()),
                Flow::Next(next, kept) => {
                    (a, held) = (*next, kept);
                    continue;
                }
            }
        }
        let flow = match Generation::form(&a, w.as_ref(), listening, &inbox, held, &progress) {
            Ok(mut generation) => generation.run(w.as_ref(), &inbox)?,
            Err(failed) => {
                let (error, kept) = *failed;
                broken(&a, &inbox, error, kept)?
            }
        };
        match flow {
            Flow::Done => return Ok(()),
            Flow::Next(next, kept) => {
                tracing::info!(
                    rank = next.rank,
                    generation = next.generation,
                    layers = ?kept.layer_list(),
                    "next generation, in place"
                );
                a = *next;
                held = kept;
            }
        }
    }
}

/// The data-plane port a worker bound itself (so nothing can take it before the rendezvous),
/// already reported to the master.
struct Listening {
    listener: TcpListener,
    addr: SocketAddr,
}

impl Listening {
    fn bind(a: &WorkerAssignment) -> Result<Listening> {
        let rank = a.rank;
        // An IP is taken as it is; a name is looked up.
        let bind = resolve(&format!("{}:0", a.host))
            .with_ctx(|| format!("data-plane address {:?}", a.host))?;
        let listener = TcpListener::bind(bind).with_ctx(|| {
            format!(
                "rank {rank} cannot bind a data-plane port on {} (is that an address of this \
                 machine? set the agent's host: OOBLECK_HOST, or --host)",
                a.host
            )
        })?;
        let addr = listener.local_addr().ctx("data-plane address")?;
        report(
            a.generation,
            &WorkerReport::Listening {
                rank,
                addr: addr.to_string(),
                pid: std::process::id(),
            },
        )?;
        Ok(Listening { listener, addr })
    }
}

/// One generation of this worker: its stage of the plan, its communicators, its optimizer.
struct Generation<'a> {
    a: &'a WorkerAssignment,
    runner: StageRunner,
    /// The data plane, every operation marked in `progress`.
    comm: Arc<dyn Communicator>,
    /// What the rank is doing, for the agent's watchdog (`beat.rs`) and its step times.
    progress: Arc<Progress>,
    opt: AdamW,
    /// The last step whose update this rank applied: the state it holds.
    committed: u64,
}

/// A generation that did not form, and the state the worker still holds.
type FormError = Box<(RuntimeError, Held)>;

fn not_formed(error: RuntimeError, held: Held) -> FormError {
    Box::new((error, held))
}

impl<'a> Generation<'a> {
    /// Connects this rank to the generation's other ranks and builds its stage of `a.plan`
    /// from `a.source` (and, in place, from `held`). Reports `Formed`. On failure the worker
    /// still holds what it held before.
    fn form(
        a: &'a WorkerAssignment,
        workload: &dyn Workload,
        listening: Listening,
        inbox: &Inbox,
        held: Held,
        progress: &Arc<Progress>,
    ) -> std::result::Result<Generation<'a>, FormError> {
        let model = workload.model();
        let layout = match check_plan(a, model)
            .and_then(|()| Ok(Layout::from_plan(&a.plan, model.num_layers())?))
        {
            Ok(l) => l,
            Err(e) => return Err(not_formed(e, held)),
        };
        let connecting = Instant::now();
        let comm: Arc<dyn Communicator> = match connect(a, &layout, model, listening, inbox) {
            Ok(c) => Arc::from(c),
            Err(e) => return Err(not_formed(e, held)),
        };
        // The copies that follow wait on peers too: an abort must reach them.
        inbox.abort.arm(a.generation, a.rank, comm.clone());
        let connect_s = connecting.elapsed().as_secs_f64();
        let stage: BTreeSet<usize> = layout
            .stage(
                layout
                    .position(a.rank as usize)
                    .expect("checked by Layout::from_plan"),
            )
            .layers
            .clone()
            .collect();
        let (loaded, copied) = match load(a, comm.as_ref(), &stage, held) {
            Ok(v) => v,
            Err(e) => {
                comm.abort();
                return Err(e);
            }
        };
        let mut watched = Watched::new(comm, progress.clone());
        if let Some(hook) = hooks::hang_hook(a, progress, &inbox.abort) {
            watched = watched.with_hook(hook);
        }
        let comm: Arc<dyn Communicator> = Arc::new(watched);
        inbox.abort.arm(a.generation, a.rank, comm.clone());
        let generation = Generation::build(a, workload, &layout, comm, loaded, progress)
            .map_err(|e| not_formed(e, Held::nothing(0)))?;
        report(
            a.generation,
            &WorkerReport::Formed {
                rank: a.rank,
                step: generation.committed,
                layers: stage.into_iter().collect(),
                connect_s,
                copy_s: copied.seconds,
                copy_bytes: copied.bytes,
            },
        )
        .map_err(|e| not_formed(e, Held::nothing(0)))?;
        Ok(generation)
    }

    /// The stage, its optimizer state and the committed step, from `loaded` (at step 0 of a
    /// fresh job, from the workload's initial parameters: `--init-from`'s weights, say).
    fn build(
        a: &'a WorkerAssignment,
        workload: &dyn Workload,
        layout: &Layout,
        comm: Arc<dyn Communicator>,
        loaded: Loaded,
        progress: &Arc<Progress>,
    ) -> Result<Generation<'a>> {
        let training = &a.job.training;
        let source = match &loaded.params {
            Some(params) => ParamSource::Tensors(params),
            None => workload.initial_params(training.seed),
        };
        // Device `d` of a node (rank `first + j * G + d`) computes on CUDA ordinal `d`.
        let ordinal = a.rank % a.plan.devices_per_node.max(1);
        device::check_precision(training.compute, ordinal, training.precision)?;
        let device = device::open(training.compute, ordinal)
            .with_ctx(|| format!("rank {}: its device", a.rank))?;
        let mut runner = StageRunner::new(
            workload.model(),
            layout,
            a.rank as usize,
            &device,
            source,
            StageConfig {
                seed: training.seed,
                microbatch_size: training.microbatch_size,
                timeout: DATA_TIMEOUT,
                bucket_elems: BUCKET_ELEMS,
                dtype: training.compute_dtype(),
                recompute: training.recompute,
                schedule: training.schedule,
            },
        )?;
        runner.watch(progress.clone());
        let mut opt = training.optimizer()?;
        if !loaded.optimizer.is_empty() {
            // Only this stage's entries: the state this rank saves must hold its own layers.
            let own: BTreeSet<String> = runner.params().into_iter().map(|p| p.0).collect();
            // The state was read to the host; it lives beside the parameters.
            let state = on_device(&loaded.optimizer, &device)?;
            opt.import_state_of(&state, &own)
                .with_ctx(|| format!("rank {}: the optimizer state of its stage", a.rank))?;
        }
        Ok(Generation {
            a,
            runner,
            comm,
            progress: progress.clone(),
            opt,
            committed: loaded.step,
        })
    }
}

/// The corrupted layer copy behind `error`, however deep in its chain of causes.
fn corrupt_copy(error: &RuntimeError) -> Option<CorruptCopy> {
    let mut e: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(cause) = e {
        if let Some(RuntimeError::CopyCorrupt { layer, from, .. }) = cause.downcast_ref() {
            return Some(CorruptCopy {
                layer: *layer,
                from: *from,
            });
        }
        e = cause.source();
    }
    None
}

/// After a generation failed: this worker holds `held` of committed step `held.step` (the
/// optimizer applies only on commit). It says so and waits for the next generation's
/// assignment. Ends with `error` when its agent stops it (stdin closes) or nothing comes.
fn broken(a: &WorkerAssignment, inbox: &Inbox, error: RuntimeError, held: Held) -> Result<Flow> {
    let said = report(
        a.generation,
        &WorkerReport::Broken {
            rank: a.rank,
            step: held.step,
            error: super::error::error_chain(&error).join(": "),
            corrupt: corrupt_copy(&error),
        },
    );
    if said.is_err() {
        return Err(error);
    }
    loop {
        match inbox.next(steps::BROKEN_WAIT, "the master's word after a failure") {
            Ok(ToWorker::Reassign { assignment }) => return Ok(Flow::Next(assignment, held)),
            Ok(other) => {
                tracing::debug!(rank = a.rank, ?other, "ignored after a failure");
            }
            Err(_) => return Err(error),
        }
    }
}

/// Refuses a plan made for another job than the one this worker was given.
fn check_plan(a: &WorkerAssignment, model: &dyn LayeredModel) -> Result<()> {
    let training = &a.job.training;
    let plan = &a.plan;
    let mismatch = |quantity, plan: u64, config: u64, hint| {
        Err(RuntimeError::PlanMismatch {
            rank: a.rank,
            quantity,
            plan,
            config,
            hint,
        })
    };
    const SAME_JOB: &str = "the master must plan with the job's own TrainingSpec \
                            (TrainingSpec::job_spec) and send that job to every node";
    if plan.global_microbatches != training.global_microbatches {
        return mismatch(
            "microbatches per step",
            plan.global_microbatches.into(),
            training.global_microbatches.into(),
            SAME_JOB,
        );
    }
    if plan.devices_per_node != training.devices_per_node {
        return mismatch(
            "devices per node",
            plan.devices_per_node.into(),
            training.devices_per_node.into(),
            SAME_JOB,
        );
    }
    for t in &plan.templates {
        let layers = t.stages.last().map_or(0, |s| s.layer_end);
        if layers != model.num_layers() {
            return mismatch(
                "layers",
                layers as u64,
                model.num_layers() as u64,
                "the workload the factory builds from the job's workload settings must be the \
                 model the master planned for (its profile has one entry per layer of \
                 LayeredModel::num_layers)",
            );
        }
    }
    Ok(())
}

/// Waits for the rendezvous and connects this rank's data plane.
fn connect(
    a: &WorkerAssignment,
    layout: &Layout,
    model: &dyn LayeredModel,
    listening: Listening,
    inbox: &Inbox,
) -> Result<Box<dyn Communicator>> {
    let world = layout.ranks().len() + donate::donors(a);
    match &a.nccl_id {
        None => connect_tcp(a, world, listening, inbox),
        Some(id) => {
            rendezvous_addrs(a, world, &listening, inbox)?;
            nccl_comm(a, layout, model, id)
        }
    }
}

/// Waits for the rendezvous and connects this rank's TCP data plane of `world` ranks.
fn connect_tcp(
    a: &WorkerAssignment,
    world: usize,
    listening: Listening,
    inbox: &Inbox,
) -> Result<Box<dyn Communicator>> {
    let rank = a.rank;
    // Before the rendezvous: the master may abort the generation while this rank waits for it.
    let cancel = inbox.abort.prepare(a.generation, rank);
    let addrs = rendezvous_addrs(a, world, &listening, inbox)?;
    load::test_kill_point("connect", a, 0);
    let mut tcp = TcpConfig::new(rank as usize, a.generation, addrs);
    tcp.connect_timeout = DATA_TIMEOUT;
    tcp.key = Some(a.key.clone());
    tcp.cancel = Some(cancel);
    tcp.on_refused = Some(refusals_to_master(a.generation, rank));
    let comm = TcpCommunicator::connect(tcp, Some(listening.listener))
        .with_ctx(|| format!("rank {rank}: connecting the data plane"))?;
    Ok(Box::new(comm))
}

/// Reports the data plane's refusals (already logged here) to the master, which records them.
fn refusals_to_master(generation: u64, rank: u32) -> RefusalSink {
    RefusalSink::new(move |line: &Refused| {
        let r = WorkerReport::Refused {
            rank,
            peer: line.peer.map(|p| p.to_string()),
            reason: line.reason.clone(),
            count: line.count,
        };
        // Best effort: a worker whose pipe is gone is about to be told so by its next report.
        let _ = report(generation, &r);
    })
}

/// Waits for the rendezvous: every rank's address, checked against where this one listens.
fn rendezvous_addrs(
    a: &WorkerAssignment,
    world: usize,
    listening: &Listening,
    inbox: &Inbox,
) -> Result<Vec<SocketAddr>> {
    let rank = a.rank;
    let rendezvous = match inbox.next(COMMIT_TIMEOUT, "rendezvous")? {
        ToWorker::Rendezvous { rendezvous } => rendezvous,
        next @ ToWorker::Reassign { .. } => {
            // The generation failed before it formed; the next one is for later.
            inbox.unread(next);
            return Err(protocol(
                rank,
                format!("generation {} ended before its rendezvous", a.generation),
            ));
        }
        other => {
            return Err(protocol(
                rank,
                format!("expected the rendezvous from the agent, got {other}"),
            ))
        }
    };
    let addrs = peer_addrs(rank, &rendezvous, world)?;
    if addrs[rank as usize] != listening.addr {
        return Err(protocol(
            rank,
            format!(
                "the rendezvous puts rank {rank} at {}, but it listens at {}",
                addrs[rank as usize], listening.addr
            ),
        ));
    }
    Ok(addrs)
}

/// The data-plane address of every rank, indexed by rank.
fn peer_addrs(rank: u32, rendezvous: &[Rendezvous], world: usize) -> Result<Vec<SocketAddr>> {
    let bad = |what: String| Err(protocol(rank, what));
    let mut addrs: Vec<Option<SocketAddr>> = vec![None; world];
    for r in rendezvous {
        let Some(slot) = addrs.get_mut(r.rank as usize) else {
            return bad(format!("rendezvous names rank {} of {world}", r.rank));
        };
        let Ok(addr) = r.addr.parse::<SocketAddr>() else {
            return bad(format!(
                "rendezvous address {:?} of rank {} is not IP:PORT",
                r.addr, r.rank
            ));
        };
        if slot.replace(addr).is_some() {
            return bad(format!("rendezvous lists rank {} twice", r.rank));
        }
    }
    addrs
        .into_iter()
        .enumerate()
        .map(|(r, a)| {
            a.ok_or_else(|| protocol(rank, format!("rendezvous has no address for rank {r}")))
        })
        .collect()
}

/// Every group a step's collectives use: the holders of each gradient bucket, of each tied
/// parameter, and all ranks (the loss and norm). Every rank computes the same list.
fn collective_groups(layout: &Layout, model: &dyn LayeredModel) -> Result<Vec<Vec<Rank>>> {
    let mut groups: Vec<Vec<Rank>> = layout.buckets().into_iter().map(|b| b.holders).collect();
    for tp in model.tied_params() {
        groups.push(layout.tied_group(&tp.layers)?.0);
    }
    groups.push(layout.ranks());
    for g in &mut groups {
        g.sort_unstable();
    }
    groups.retain(|g| g.len() > 1);
    groups.sort();
    groups.dedup();
    Ok(groups)
}

/// The NCCL data plane of `DataPlane::Nccl`: device `d` of a node uses CUDA device `d`.
/// (Without the `nccl` feature, oobleck-comm's stand-in says NCCL is unavailable.)
fn nccl_comm(
    a: &WorkerAssignment,
    layout: &Layout,
    model: &dyn LayeredModel,
    id: &[u8],
) -> Result<Box<dyn Communicator>> {
    let id: [u8; 128] = id.try_into().map_err(|_| {
        protocol(
            a.rank,
            format!("the NCCL unique id has {} bytes, not 128", id.len()),
        )
    })?;
    let device = a.rank % a.plan.devices_per_node;
    let comm = NcclCommunicator::new(
        a.rank as usize,
        layout.ranks().len(),
        a.generation,
        device as usize,
        &NcclId(id),
        &collective_groups(layout, model)?,
        DATA_TIMEOUT,
    )
    .with_ctx(|| {
        format!(
            "rank {}: joining the NCCL clique on CUDA device {device}",
            a.rank
        )
    })?;
    Ok(Box::new(comm))
}

/// `entries` copied to `device` (nothing copied when they are there already).
fn on_device(entries: &[(String, Tensor)], device: &Device) -> Result<Vec<(String, Tensor)>> {
    entries
        .iter()
        .map(|(k, t)| {
            Ok((
                k.clone(),
                t.to_device(device).ctx("moving optimizer state")?,
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests;
