//! `oobleck worker`: one device's process. Reads its [`WorkerAssignment`] from stdin, connects
//! the data plane, trains every step of the run on its stage and reports to the master through
//! stdout (forwarded by its agent). Exits when stdin closes (its agent is gone).

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use oobleck_comm::{Communicator, TcpCommunicator, TcpConfig};
use oobleck_core::execution::{Layout, StageWorker, WorkerConfig};
use oobleck_core::model::ParamSource;
use oobleck_core::optim::{AdamW, AdamWConfig, LrSchedule};
use oobleck_models::data::{BatchSpec, DataCursor, Dataset, Split};

use super::{Report, WorkerAssignment, DATA_TIMEOUT};
use crate::config::{load_resolved, TrainConfig};
use crate::trainer::{model_config, open_dataset, to_tensors};

/// How long a worker waits for its assignment on stdin.
const ASSIGNMENT_TIMEOUT: Duration = Duration::from_secs(30);

/// Hidden: run one worker of a local cluster (started by `oobleck agent`).
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// The run directory (holds config.json; final parameters are written below it).
    #[arg(long)]
    pub run_dir: PathBuf,
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

/// Reads the assignment line, then keeps reading stdin on a thread and ends the process when
/// it closes: the agent that started us is gone, so nobody would ever collect our results.
fn read_assignment() -> Result<WorkerAssignment> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let stdin = std::io::stdin();
        let mut lock = stdin.lock();
        let mut line = String::new();
        let first = lock.read_line(&mut line).map(|_| line.clone());
        let _ = tx.send(first);
        let mut sink = String::new();
        loop {
            sink.clear();
            match lock.read_line(&mut sink) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        eprintln!("oobleck worker: its agent closed stdin; exiting");
        std::process::exit(3);
    });
    let line = rx
        .recv_timeout(ASSIGNMENT_TIMEOUT)
        .map_err(|_| anyhow::anyhow!("no assignment on stdin within {ASSIGNMENT_TIMEOUT:?}"))?
        .context("reading the assignment from stdin")?;
    serde_json::from_str(line.trim()).context("parsing the assignment from stdin")
}

/// The data-plane address of every rank, indexed by rank.
fn peer_addrs(a: &WorkerAssignment, world: usize) -> Result<Vec<SocketAddr>> {
    let mut addrs: Vec<Option<SocketAddr>> = vec![None; world];
    for r in &a.rendezvous {
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
    let a = read_assignment()?;
    if a.rank != args.rank {
        bail!(
            "assignment is for rank {}, this worker was started as rank {}",
            a.rank,
            args.rank
        );
    }
    let rank = a.rank as usize;
    let cfg = load_resolved(&args.run_dir)?;
    let (model_cfg, pretrained) = model_config(&cfg)?;
    let model = model_cfg.build()?;
    let data = open_dataset(&cfg)?;
    let spec = BatchSpec {
        seq_len: cfg.seq_len,
        microbatch_size: cfg.microbatch_size,
        num_microbatches: cfg.num_microbatches(),
    };
    let train = data.split(Split::Train);
    let ipe = train.iterations_per_epoch(&spec)?;
    let layout = Layout::from_plan(&a.plan, model.num_layers())?;
    let world = layout.ranks().len();
    let addrs = peer_addrs(&a, world)?;
    let listener = std::net::TcpListener::bind(addrs[rank]).with_context(|| {
        format!(
            "rank {rank} cannot bind its data-plane address {}",
            addrs[rank]
        )
    })?;
    let mut tcp = TcpConfig::new(rank, a.generation, addrs);
    tcp.connect_timeout = DATA_TIMEOUT;
    let comm = TcpCommunicator::connect(tcp, Some(listener))
        .with_context(|| format!("rank {rank}: connecting the data plane"))?;
    let result = train_all(
        &args.run_dir,
        &cfg,
        &a,
        &layout,
        &comm,
        model.as_ref(),
        pretrained,
        &data,
        ipe,
    );
    if result.is_err() {
        // Fail the peers fast instead of letting them run into their timeouts.
        comm.abort();
    }
    result
}

#[allow(clippy::too_many_arguments)]
fn train_all(
    run_dir: &Path,
    cfg: &TrainConfig,
    a: &WorkerAssignment,
    layout: &Layout,
    comm: &dyn Communicator,
    model: &dyn oobleck_core::model::LayeredModel,
    pretrained: Option<HashMap<String, Tensor>>,
    data: &Dataset,
    ipe: usize,
) -> Result<()> {
    let rank = a.rank as usize;
    let source = match &pretrained {
        Some(w) => ParamSource::Tensors(w),
        None => ParamSource::Init { seed: cfg.seed },
    };
    let microbatch_size = u32::try_from(cfg.microbatch_size).context("--microbatch-size")?;
    let worker = StageWorker::new(
        model,
        layout,
        rank,
        &Device::Cpu,
        source,
        WorkerConfig {
            seed: cfg.seed,
            microbatch_size,
            timeout: DATA_TIMEOUT,
        },
    )?;
    let spec = BatchSpec {
        seq_len: cfg.seq_len,
        microbatch_size: cfg.microbatch_size,
        num_microbatches: cfg.num_microbatches(),
    };
    let train = data.split(Split::Train);
    let sched = LrSchedule::new(cfg.lr, cfg.final_lr(), cfg.warmup(), cfg.steps)?;
    let mut opt = AdamW::new(AdamWConfig {
        lr: cfg.lr,
        beta1: cfg.beta1,
        beta2: cfg.beta2,
        eps: 1e-8,
        weight_decay: cfg.weight_decay,
    })?;
    let max_norm = (cfg.grad_clip > 0.0).then_some(cfg.grad_clip);
    let mut stdout = std::io::stdout();
    for step in 0..cfg.steps {
        let cursor = DataCursor::at_step(step, ipe);
        let mut batch = |_iteration: u64, mb: u64| -> oobleck_core::Result<(Tensor, Tensor)> {
            let b = train
                .microbatch_at(&spec, cfg.seed, cursor, mb as usize)
                .map_err(|e| oobleck_core::Error::Msg(format!("microbatch {mb}: {e}")))?;
            to_tensors(&b, &Device::Cpu)
                .map_err(|e| oobleck_core::Error::Msg(format!("microbatch {mb}: {e}")))
        };
        let lr = sched.lr_at(step);
        let report = worker
            .train_step(comm, step, &mut batch, &mut opt, lr, max_norm)
            .with_context(|| format!("rank {rank}: step {}", step + 1))?;
        if rank == 0 {
            let r = Report::Step {
                step: step + 1,
                loss: report.loss,
                grad_norm: report.grad_norm,
                lr,
            };
            writeln!(stdout, "{}", r.line()).context("writing a report to stdout")?;
        }
    }
    // Pipeline 0 holds every layer once: its ranks leave the final state for the checkpoint.
    let pos = worker.position();
    if pos.pipeline == 0 && pos.device == 0 {
        let mut tensors: HashMap<String, Tensor> = HashMap::new();
        for (name, var) in worker.params() {
            tensors.insert(format!("param/{name}"), var.as_tensor().clone());
        }
        for (name, t) in opt.export_state()? {
            tensors.insert(format!("opt/{name}"), t);
        }
        let path = state_path(run_dir, a.rank);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        candle_core::safetensors::save(&tensors, &path)
            .with_context(|| format!("writing {}", path.display()))?;
        let r = Report::Saved {
            rank: a.rank,
            path: path.display().to_string(),
        };
        writeln!(stdout, "{}", r.line()).context("writing a report to stdout")?;
    }
    writeln!(stdout, "{}", Report::Done { rank: a.rank }.line())
        .context("writing a report to stdout")?;
    stdout.flush().context("flushing stdout")?;
    Ok(())
}
