//! `oobleck worker`: one device's process. Reads its [`WorkerAssignment`] from stdin, binds its
//! data-plane port and reports it, connects to its peers once the rendezvous arrives, and runs
//! every step: iteration and gradient sync, `Ready`, wait for the master's commit, optimizer.
//! Exits when stdin closes (its agent is gone).

use std::collections::{BTreeSet, HashMap};
use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor, Var};
use oobleck_comm::{Communicator, NcclCommunicator, NcclId, Rank, TcpCommunicator, TcpConfig};
use oobleck_core::checkpoint::load_checkpoint;
use oobleck_core::elastic::protocol::Rendezvous;
use oobleck_core::execution::{sync_gradients, Layout, StageWorker, WorkerConfig, BUCKET_ELEMS};
use oobleck_core::model::ParamSource;
use oobleck_core::optim::{AdamW, LrSchedule};
use oobleck_models::data::{BatchSpec, DataCursor, Dataset, Split};

use super::{Report, ToWorker, WorkerAssignment, COMMIT_TIMEOUT, DATA_TIMEOUT};
use crate::config::TrainConfig;
use crate::trainer::{model_config, open_dataset, to_tensors};

/// How long a worker waits for its assignment on stdin.
const ASSIGNMENT_TIMEOUT: Duration = Duration::from_secs(30);

/// Hidden: run one worker of a cluster job (started by `oobleck agent`).
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// This worker's global rank.
    #[arg(long)]
    pub rank: u32,
}

/// Where rank `rank` leaves its final parameters and optimizer state.
pub fn state_path(run_dir: &Path, rank: u32) -> PathBuf {
    run_dir
        .join("cluster")
        .join(format!("rank-{rank}.safetensors"))
}

/// Where rank `rank` leaves its state after committed step `step` for a periodic checkpoint
/// or evaluation (the master removes it once assembled).
pub fn state_path_at(run_dir: &Path, step: u64, rank: u32) -> PathBuf {
    run_dir
        .join("cluster")
        .join(format!("step-{step:06}"))
        .join(format!("rank-{rank}.safetensors"))
}

/// Whether the state after `step` is wanted before the end: a checkpoint or an evaluation.
pub fn state_due(cfg: &TrainConfig, step: u64) -> bool {
    let due = |every: u64| every > 0 && step % every == 0;
    due(cfg.checkpoint_every) || due(cfg.eval_every)
}

fn save_state(params: &[(String, Var)], opt: &AdamW, path: &Path) -> Result<()> {
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for (name, var) in params {
        tensors.insert(format!("param/{name}"), var.as_tensor().clone());
    }
    for (name, t) in opt.export_state()? {
        tensors.insert(format!("opt/{name}"), t);
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    candle_core::safetensors::save(&tensors, path)
        .with_context(|| format!("writing {}", path.display()))
}

/// The worker's stdin: the assignment, then the agent's messages. A thread reads it and ends
/// the process when it closes: the agent that started us is gone, so nobody would ever
/// commit a step or collect our results.
struct Inbox {
    rx: mpsc::Receiver<Result<ToWorker>>,
}

impl Inbox {
    fn start() -> Result<(WorkerAssignment, Inbox)> {
        let (first_tx, first_rx) = mpsc::channel();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let stdin = std::io::stdin();
            let mut lock = stdin.lock();
            let mut line = String::new();
            let first = lock.read_line(&mut line).map(|_| line.clone());
            let _ = first_tx.send(first);
            loop {
                line.clear();
                match lock.read_line(&mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        let msg =
                            serde_json::from_str::<ToWorker>(line.trim()).with_context(|| {
                                format!("malformed message from the agent: {:?}", line.trim())
                            });
                        if tx.send(msg).is_err() {
                            break;
                        }
                    }
                }
            }
            eprintln!("oobleck worker: its agent closed stdin; exiting");
            std::process::exit(3);
        });
        let line = first_rx
            .recv_timeout(ASSIGNMENT_TIMEOUT)
            .map_err(|_| anyhow::anyhow!("no assignment on stdin within {ASSIGNMENT_TIMEOUT:?}"))?
            .context("reading the assignment from stdin")?;
        let a = serde_json::from_str(line.trim()).context("parsing the assignment from stdin")?;
        Ok((a, Inbox { rx }))
    }

    /// The next message from the agent, waiting at most `timeout`.
    fn next(&self, timeout: Duration, waiting_for: &str) -> Result<ToWorker> {
        match self.rx.recv_timeout(timeout) {
            Ok(m) => m,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                bail!("no {waiting_for} from the agent within {timeout:?}")
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the agent's stdin closed"),
        }
    }
}

fn report(r: &Report) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", r.line()).context("writing a report to stdout")?;
    out.flush().context("flushing stdout")
}

/// The data-plane address of every rank, indexed by rank.
fn peer_addrs(rendezvous: &[Rendezvous], world: usize) -> Result<Vec<SocketAddr>> {
    let mut addrs: Vec<Option<SocketAddr>> = vec![None; world];
    for r in rendezvous {
        let slot = addrs
            .get_mut(r.rank as usize)
            .with_context(|| format!("rendezvous names rank {} of {world}", r.rank))?;
        let addr: SocketAddr = r
            .addr
            .parse()
            .with_context(|| format!("rendezvous address {:?} of rank {}", r.addr, r.rank))?;
        if slot.replace(addr).is_some() {
            bail!("rendezvous lists rank {} twice", r.rank);
        }
    }
    addrs
        .into_iter()
        .enumerate()
        .map(|(r, a)| a.with_context(|| format!("rendezvous has no address for rank {r}")))
        .collect()
}

pub fn run(args: &WorkerArgs) -> Result<()> {
    let (a, inbox) = Inbox::start()?;
    if a.rank != args.rank {
        bail!(
            "assignment is for rank {}, this worker was started as rank {}",
            a.rank,
            args.rank
        );
    }
    let rank = a.rank as usize;
    let cfg = &a.config;
    let bind: SocketAddr = format!("{}:0", a.host)
        .parse()
        .or_else(|_| super::resolve(&format!("{}:0", a.host)))
        .with_context(|| format!("data-plane address {:?}", a.host))?;
    let listener = std::net::TcpListener::bind(bind).with_context(|| {
        format!(
            "rank {rank} cannot bind a data-plane port on {} (is that an address of this \
             machine? set the agent's --host)",
            a.host
        )
    })?;
    let addr = listener.local_addr().context("data-plane address")?;
    report(&Report::Listening {
        rank: a.rank,
        addr: addr.to_string(),
        pid: std::process::id(),
    })?;
    let (model_cfg, pretrained) = model_config(cfg)?;
    let model = model_cfg.build()?;
    let data = open_dataset(cfg)?;
    let layout = Layout::from_plan(&a.plan, model.num_layers())?;
    // A resumed job: every layer of this stage, its optimizer state and the step come from
    // the checkpoint (which the master checked before anything started).
    let resumed = match &a.resume {
        Some(dir) => {
            let ck = load_checkpoint(dir, &Device::Cpu)
                .with_context(|| format!("rank {rank}: loading {}", dir.display()))?;
            let params: HashMap<String, Tensor> = ck.params.into_iter().collect();
            Some((params, ck.optimizer, ck.trainer.step))
        }
        None => None,
    };
    let source = match (&resumed, &pretrained) {
        (Some((params, _, _)), _) => ParamSource::Tensors(params),
        (None, Some(w)) => ParamSource::Tensors(w),
        (None, None) => ParamSource::Init { seed: cfg.seed },
    };
    let microbatch_size = u32::try_from(cfg.microbatch_size).context("--microbatch-size")?;
    let worker = StageWorker::new(
        model.as_ref(),
        &layout,
        rank,
        &Device::Cpu,
        source,
        WorkerConfig {
            seed: cfg.seed,
            microbatch_size,
            timeout: DATA_TIMEOUT,
            bucket_elems: BUCKET_ELEMS,
        },
    )?;
    let rendezvous = match inbox.next(COMMIT_TIMEOUT, "rendezvous")? {
        ToWorker::Rendezvous { rendezvous } => rendezvous,
        other => bail!("expected the rendezvous from the agent, got {other:?}"),
    };
    let world = layout.ranks().len();
    let addrs = peer_addrs(&rendezvous, world)?;
    if addrs[rank] != addr {
        bail!(
            "the rendezvous puts rank {rank} at {}, but it listens at {addr}",
            addrs[rank]
        );
    }
    let comm: Box<dyn Communicator> = match &a.nccl_id {
        None => {
            let mut tcp = TcpConfig::new(rank, a.generation, addrs);
            tcp.connect_timeout = DATA_TIMEOUT;
            Box::new(
                TcpCommunicator::connect(tcp, Some(listener))
                    .with_context(|| format!("rank {rank}: connecting the data plane"))?,
            )
        }
        Some(id) => nccl_comm(&a, &layout, model.as_ref(), id)?,
    };
    let comm = comm.as_ref();
    let mut opt = cfg.optimizer()?;
    let start = match resumed {
        Some((_, state, step)) => {
            // Only this stage's entries: the state this rank saves must hold its own layers.
            let own: BTreeSet<String> = worker.stage().params().into_iter().map(|p| p.0).collect();
            opt.import_state_of(&state, &own)
                .with_context(|| format!("rank {rank}: optimizer state of the checkpoint"))?;
            step
        }
        None => 0,
    };
    let mut committed = start;
    let result = train_all(&a, &worker, comm, &inbox, &data, &mut opt, &mut committed);
    match result {
        Ok(()) => Ok(()),
        Err(e) => {
            // Fail the peers fast instead of letting them run into their timeouts.
            comm.abort();
            broken(&a, &worker, &inbox, &opt, committed, e)
        }
    }
}

/// Answers the master's `SaveState` after a failure: this rank's state of committed `step`,
/// written under `dir` and reported.
fn save_for_rescue(
    rank: u32,
    params: &[(String, Var)],
    opt: &AdamW,
    step: u64,
    dir: &Path,
) -> Result<()> {
    let path = dir.join(format!("rank-{rank:05}.safetensors"));
    save_state(params, opt, &path)?;
    report(&Report::Saved {
        rank,
        step,
        state: path.display().to_string(),
    })
}

/// How long a worker whose step failed waits for the master's instructions.
const BROKEN_WAIT: Duration = Duration::from_secs(120);

/// After a failed step: this worker still holds the parameters and optimizer state of step
/// `committed` (the optimizer applies only on commit). It says so and waits: the master may
/// ask for that state (`SaveState`), so the next generation loses no committed step. Ends
/// with `error` when its agent stops it (stdin closes) or nothing comes.
fn broken(
    a: &WorkerAssignment,
    worker: &StageWorker,
    inbox: &Inbox,
    opt: &AdamW,
    committed: u64,
    error: anyhow::Error,
) -> Result<()> {
    let rank = a.rank;
    let said = report(&Report::Broken {
        rank,
        step: committed,
        error: format!("{error:#}"),
    });
    if said.is_err() {
        return Err(error);
    }
    let params: Vec<(String, Var)> = worker.stage().params();
    loop {
        match inbox.next(BROKEN_WAIT, "the master's word after a failed step") {
            Ok(ToWorker::SaveState { step, dir }) if step == committed => {
                save_for_rescue(rank, &params, opt, step, &dir)?;
            }
            Ok(other) => {
                tracing::debug!(rank, ?other, "ignored after a failed step");
            }
            Err(_) => return Err(error),
        }
    }
}

/// Every group a step's collectives use: the holders of each gradient bucket, of each tied
/// parameter, and all ranks (the loss and norm). Every rank computes the same list.
pub fn collective_groups(
    layout: &Layout,
    model: &dyn oobleck_core::model::LayeredModel,
) -> Result<Vec<Vec<Rank>>> {
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

/// The NCCL data plane of `--data-plane nccl`: device `d` of a node uses CUDA device `d`.
/// (Without `--features nccl`, oobleck-comm's stand-in says NCCL is unavailable.)
fn nccl_comm(
    a: &WorkerAssignment,
    layout: &Layout,
    model: &dyn oobleck_core::model::LayeredModel,
    id: &[u8],
) -> Result<Box<dyn Communicator>> {
    let id: [u8; 128] = id
        .try_into()
        .map_err(|_| anyhow::anyhow!("the NCCL unique id has {} bytes, not 128", id.len()))?;
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
    .with_context(|| {
        format!(
            "rank {}: joining the NCCL clique on CUDA device {device}",
            a.rank
        )
    })?;
    Ok(Box::new(comm))
}

fn train_all(
    a: &WorkerAssignment,
    worker: &StageWorker,
    comm: &dyn Communicator,
    inbox: &Inbox,
    data: &Dataset,
    opt: &mut AdamW,
    committed: &mut u64,
) -> Result<()> {
    let start = *committed;
    let rank = a.rank;
    let cfg = &a.config;
    let spec = BatchSpec {
        seq_len: cfg.seq_len,
        microbatch_size: cfg.microbatch_size,
        num_microbatches: cfg.num_microbatches(),
    };
    let ipe = data.split(Split::Train).iterations_per_epoch(&spec)?;
    let train = data.split(Split::Train);
    let sched = LrSchedule::new(cfg.lr, cfg.final_lr(), cfg.warmup(), cfg.steps)?;
    let max_norm = (cfg.grad_clip > 0.0).then_some(cfg.grad_clip);
    let params: Vec<(String, Var)> = worker.stage().params();
    // Pipeline 0 holds every layer once: its ranks (device 0 of each stage) leave the state the
    // master assembles into checkpoints and evaluates.
    let pos = worker.position();
    let saves_state = pos.pipeline == 0 && pos.device == 0;
    let mut commit_wait = Duration::ZERO;
    for step in start..cfg.steps {
        let cursor = DataCursor::at_step(step, ipe);
        let mut batch = |_iteration: u64, mb: u64| -> oobleck_core::Result<(Tensor, Tensor)> {
            let b = train
                .microbatch_at(&spec, cfg.seed, cursor, mb as usize)
                .map_err(|e| oobleck_core::Error::Msg(format!("microbatch {mb}: {e}")))?;
            to_tensors(&b, &Device::Cpu)
                .map_err(|e| oobleck_core::Error::Msg(format!("microbatch {mb}: {e}")))
        };
        let out = worker
            .run_iteration(comm, step, &mut batch)
            .with_context(|| format!("rank {rank}: step {}", step + 1))?;
        let (grads, sync) = sync_gradients(worker, comm, out, max_norm)
            .with_context(|| format!("rank {rank}: gradient sync of step {}", step + 1))?;
        report(&Report::Ready {
            rank,
            step: step + 1,
            loss: sync.loss,
            grad_norm: sync.grad_norm,
        })?;
        let waited = Instant::now();
        loop {
            match inbox.next(COMMIT_TIMEOUT, &format!("commit of step {}", step + 1))? {
                ToWorker::Commit { step: s } if s == step + 1 => break,
                // The step failed elsewhere; this rank still holds the state of `step`.
                ToWorker::SaveState { step: s, dir } if s == step => {
                    save_for_rescue(rank, &params, opt, s, &dir)?;
                }
                other => bail!(
                    "rank {rank} waits for the commit of step {}, the agent sent {other:?}",
                    step + 1
                ),
            }
        }
        commit_wait += waited.elapsed();
        opt.step(&params, &grads, sched.lr_at(step))
            .with_context(|| format!("rank {rank}: optimizer step {}", step + 1))?;
        let s = step + 1;
        *committed = s;
        if saves_state && s < cfg.steps && state_due(cfg, s) {
            let path = state_path_at(&a.run_dir, s, rank);
            save_state(&params, opt, &path)?;
            report(&Report::Saved {
                rank,
                step: s,
                state: path.display().to_string(),
            })?;
        }
    }
    let mut state = None;
    if saves_state {
        let path = state_path(&a.run_dir, rank);
        save_state(&params, opt, &path)?;
        state = Some(path.display().to_string());
    }
    report(&Report::Done {
        rank,
        step: cfg.steps,
        state,
        commit_wait_ms: commit_wait.as_secs_f64() * 1e3,
    })
}

#[cfg(test)]
mod tests {
    use oobleck_core::execution::{PipelineSpec, StageSpec};

    use super::*;

    #[test]
    fn collective_groups_cover_buckets_tied_weights_and_everyone_once() {
        let model = oobleck_models::ModelConfig::preset("gpt-tiny")
            .expect("preset")
            .build()
            .expect("model");
        let n = model.num_layers();
        // Pipeline 0: one stage on rank 0; pipeline 1: two stages (ranks 1 and 2).
        let layout = Layout::new(
            n,
            4,
            vec![
                PipelineSpec {
                    stages: vec![StageSpec::single(0..n, 0)],
                    microbatches: 0..2,
                },
                PipelineSpec {
                    stages: vec![StageSpec::single(0..2, 1), StageSpec::single(2..n, 2)],
                    microbatches: 2..4,
                },
            ],
        )
        .expect("layout");
        let groups = collective_groups(&layout, model.as_ref()).expect("groups");
        // Layers 0-1 are held by ranks 0 and 1, the rest by 0 and 2; the tied embedding spans
        // ranks 0, 1 and 2, which is also everyone.
        assert_eq!(groups, vec![vec![0, 1], vec![0, 1, 2], vec![0, 2]]);
    }
}
