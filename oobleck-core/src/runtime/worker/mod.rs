//! The worker: one device's process of a job (`OOBLECK_ROLE=worker`, always a child of its
//! node's agent). It trains its stage of the user's [`Workload`] in one generation:
//!
//! ```text
//!  stdin: WorkerAssignment ──► bind the data-plane port ──► Listening
//!                              check the plan against the job, build the stage
//!                              (initial parameters, or the resumed checkpoint)
//!                              Rendezvous ──► connect the communicators
//!                              per step: 1F1B iteration + gradient sync ──► Ready
//!                                        wait for Commit ──► optimizer step
//!                                        (periodic state ──► Saved)
//!                              all steps ──► Done    a failed step ──► Broken, then
//!                                                     answer SaveState until stopped
//! ```
//!
//! Today each generation starts fresh worker processes, so a worker runs exactly one
//! generation ([`run_worker`] says where keeping workers alive across reconfigurations would
//! plug in). A worker exits when its stdin closes (its agent is gone).

mod inbox;
mod steps;

use std::collections::{BTreeSet, HashMap};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::time::Duration;

use candle_core::{Device, Tensor};
use oobleck_comm::{Communicator, NcclCommunicator, NcclId, Rank, TcpCommunicator, TcpConfig};

use self::inbox::{report, Inbox};
use super::error::{Context, Result, RuntimeError};
use super::pipe::{resolve, ToWorker, WorkerAssignment};
use super::records::WorkerReport;
use super::spec::{Factory, Workload};
use crate::checkpoint::load_checkpoint;
use crate::elastic::protocol::Rendezvous;
use crate::execution::{Layout, StageWorker, WorkerConfig, BUCKET_ELEMS};
use crate::model::{LayeredModel, ParamSource};
use crate::optim::AdamW;

/// How long a worker waits on any send, receive or collective of the data plane.
pub const DATA_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a worker waits for the commit of a step it is ready for (or for the rendezvous):
/// every other rank has to finish the step first, so this bounds the slowest rank's step.
pub const COMMIT_TIMEOUT: Duration = Duration::from_secs(180);

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

/// Runs worker `rank` of a job: reads its assignment from stdin, builds the workload with
/// `factory` from the job's workload settings, and trains its generation. Returns once its
/// last step is applied and reported.
///
/// Every generation starts fresh worker processes today, so a worker runs exactly one. Workers
/// kept alive across reconfigurations would loop here: read the next generation's assignment,
/// bind, and `Generation::form` it from what this worker holds, with the same workload.
pub fn run_worker(rank: u32, factory: &Factory) -> Result<()> {
    let (a, inbox) = Inbox::start(rank)?;
    if a.rank != rank {
        return Err(protocol(
            rank,
            format!(
                "assignment is for rank {}, this worker was started as rank {rank}",
                a.rank
            ),
        ));
    }
    let listening = Listening::bind(&a)?;
    // Built after the port is reported: the master gathers the generation's addresses while
    // its workers build their workloads.
    let workload = factory(&a.job.workload).map_err(RuntimeError::Workload)?;
    workload
        .check(&a.job.training)
        .map_err(RuntimeError::Workload)?;
    let mut generation = Generation::form(&a, workload.as_ref(), listening, &inbox)?;
    generation.run(workload.as_ref(), &inbox)
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
        report(&WorkerReport::Listening {
            rank,
            addr: addr.to_string(),
            pid: std::process::id(),
        })?;
        Ok(Listening { listener, addr })
    }
}

/// A resumed job's state of this stage's checkpoint.
struct Resumed {
    params: HashMap<String, Tensor>,
    optimizer: Vec<(String, Tensor)>,
    step: u64,
}

/// One generation of this worker: its stage of the plan, its communicators, its optimizer.
struct Generation<'a> {
    a: &'a WorkerAssignment,
    worker: StageWorker,
    comm: Box<dyn Communicator>,
    opt: AdamW,
    /// The last step whose update this rank applied: the state it holds.
    committed: u64,
}

impl<'a> Generation<'a> {
    /// Builds this rank's stage of `a.plan` and connects it to the generation's other ranks.
    fn form(
        a: &'a WorkerAssignment,
        workload: &dyn Workload,
        listening: Listening,
        inbox: &Inbox,
    ) -> Result<Generation<'a>> {
        let rank = a.rank;
        let training = &a.job.training;
        let model = workload.model();
        check_plan(a, model)?;
        let layout = Layout::from_plan(&a.plan, model.num_layers())?;
        // A resumed job: every layer of this stage, its optimizer state and the step come
        // from the checkpoint (which the master checked before anything started).
        let resumed = match &a.resume {
            Some(dir) => {
                let ck = load_checkpoint(dir, &Device::Cpu)
                    .with_ctx(|| format!("rank {rank}: loading {}", dir.display()))?;
                Some(Resumed {
                    params: ck.params.into_iter().collect(),
                    optimizer: ck.optimizer,
                    step: ck.trainer.step,
                })
            }
            None => None,
        };
        let source = match &resumed {
            Some(r) => ParamSource::Tensors(&r.params),
            None => workload.initial_params(training.seed),
        };
        let worker = StageWorker::new(
            model,
            &layout,
            rank as usize,
            &Device::Cpu,
            source,
            WorkerConfig {
                seed: training.seed,
                microbatch_size: training.microbatch_size,
                timeout: DATA_TIMEOUT,
                bucket_elems: BUCKET_ELEMS,
            },
        )?;
        let comm = connect(a, &layout, model, listening, inbox)?;
        let mut opt = training.optimizer()?;
        let committed = match resumed {
            Some(r) => {
                // Only this stage's entries: the state this rank saves must hold its own layers.
                let own: BTreeSet<String> = worker.params().into_iter().map(|p| p.0).collect();
                opt.import_state_of(&r.optimizer, &own)
                    .with_ctx(|| format!("rank {rank}: optimizer state of the checkpoint"))?;
                r.step
            }
            None => 0,
        };
        Ok(Generation {
            a,
            worker,
            comm,
            opt,
            committed,
        })
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
    let rank = a.rank;
    let rendezvous = match inbox.next(COMMIT_TIMEOUT, "rendezvous")? {
        ToWorker::Rendezvous { rendezvous } => rendezvous,
        other => {
            return Err(protocol(
                rank,
                format!("expected the rendezvous from the agent, got {other:?}"),
            ))
        }
    };
    let addrs = peer_addrs(rank, &rendezvous, layout.ranks().len())?;
    if addrs[rank as usize] != listening.addr {
        return Err(protocol(
            rank,
            format!(
                "the rendezvous puts rank {rank} at {}, but it listens at {}",
                addrs[rank as usize], listening.addr
            ),
        ));
    }
    match &a.nccl_id {
        None => {
            let mut tcp = TcpConfig::new(rank as usize, a.generation, addrs);
            tcp.connect_timeout = DATA_TIMEOUT;
            let comm = TcpCommunicator::connect(tcp, Some(listening.listener))
                .with_ctx(|| format!("rank {rank}: connecting the data plane"))?;
            Ok(Box::new(comm))
        }
        Some(id) => nccl_comm(a, layout, model, id),
    }
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

#[cfg(test)]
mod tests;
