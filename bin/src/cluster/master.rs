//! The master side of `train --nodes N`: validates the job, starts the agents, plans, hands out
//! the plan and the data-plane rendezvous, records every committed step, assembles the final
//! checkpoint and takes every process down at the end or at the first failure.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use oobleck_core::checkpoint::{self, TrainerState};
use oobleck_core::elastic::master::MasterEvent;
use oobleck_core::elastic::protocol::Rendezvous;
use oobleck_core::elastic::{ElasticError, Master, Message, Token};
use oobleck_core::model::ForwardCtx;
use oobleck_core::optim::LrSchedule;
use oobleck_core::planning::{
    analytical_profile, gradient_sync_ns, instantiate_with_sizes, plan_with_pipelines,
    template::generate_templates, DeviceSpec, Dtype, JobSpec, Plan, TemplateMicrobatches,
    TransformerShape,
};
use oobleck_models::data::{DataCursor, Split};
use oobleck_models::ModelConfig;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};

use super::hostfile::{self, HostEntry};
use super::{ranks_of_node, world_size};
use crate::config::{parse_failure, TrainConfig};
use crate::generate::whole_model;
use crate::progress::Progress;
use crate::trainer::{
    model_config, open_dataset, open_run, prepare_data, to_tensors, truncate_metrics_after,
    StepMetrics, Summary,
};

/// After a failure, how long further losses it caused are collected before replanning.
const SETTLE: Duration = Duration::from_secs(1);
/// ...and, where this master started the agents, the most it waits for each dead agent's
/// node to be reported lost.
const LOSS_WAIT: Duration = Duration::from_secs(15);
/// How long the survivors of a failure get to write their committed state.
const RESCUE_WAIT: Duration = Duration::from_secs(30);
/// ...and the most it waits for every rank on a surviving node to stop its step.
const RANKS_WAIT: Duration = Duration::from_secs(60);
/// Failures in a row with no committed step in between, after which the job gives up.
const MAX_FRUITLESS_RECOVERIES: u32 = 3;

/// How long the agents get to start and register.
const JOIN_TIMEOUT: Duration = Duration::from_secs(60);
/// Bound of starting each ssh and handing it the token.
const SSH_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `--listen` waits for agents started by hand.
const LISTEN_JOIN_TIMEOUT: Duration = Duration::from_secs(600);
/// The longest the job may go without any report or event before it is declared stuck
/// (covers model build and data-plane setup before step 1).
const STALL_TIMEOUT: Duration = Duration::from_secs(180);
/// How long agents get to exit after `Shutdown` before they are killed.
const EXIT_GRACE: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(50);

/// The `oobleck` binary the agents run: `$OOBLECK_BIN`, else the sibling of this executable.
fn oobleck_exe() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("OOBLECK_BIN") {
        return Ok(PathBuf::from(p));
    }
    let me = std::env::current_exe().context("locating the train binary")?;
    let p = me.with_file_name(format!("oobleck{}", std::env::consts::EXE_SUFFIX));
    if !p.is_file() {
        bail!(
            "the agent binary {} is missing (build it with `cargo build --bin oobleck`, or set \
             OOBLECK_BIN)",
            p.display()
        );
    }
    Ok(p)
}

/// The pipelines `--pipeline-nodes` pins, as node ids in stage order, after checking they use
/// exactly the nodes of the job.
pub fn pinned_pipelines(sizes: &[usize], nodes: &[u32]) -> Result<Vec<Vec<u32>>> {
    if sizes.contains(&0) {
        bail!("--pipeline-nodes {sizes:?}: every pipeline needs at least one node");
    }
    let total: usize = sizes.iter().sum();
    if total != nodes.len() {
        bail!(
            "--pipeline-nodes {} uses {total} nodes but the job has {} (--nodes {}): the \
             pipeline sizes must add up to the node count",
            sizes
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join(","),
            nodes.len(),
            nodes.len()
        );
    }
    let mut it = nodes.iter().copied();
    Ok(sizes
        .iter()
        .map(|&s| it.by_ref().take(s).collect())
        .collect())
}

/// The plan for `nodes` (sorted ids): pinned pipeline sizes, or the planner's choice, from the
/// model's analytical CPU profile.
pub fn plan_for(cfg: &TrainConfig, model_cfg: &ModelConfig, nodes: &[u32]) -> Result<Plan> {
    let (blocks, d, heads, _) = model_cfg.dims();
    let u = |v: usize, what: &str| u32::try_from(v).with_context(|| format!("{what} {v}"));
    let shape = TransformerShape::gpt(
        u(blocks, "blocks")?,
        u(d, "width")?,
        u(heads, "heads")?,
        u(model_cfg.vocab_size(), "vocabulary")?,
        u(cfg.seq_len, "--seq-len")?,
    );
    let device = DeviceSpec::named("cpu").context("the planner knows no `cpu` device")?;
    let b = u(cfg.microbatch_size, "--microbatch-size")?;
    let profile = analytical_profile(&cfg.model, &shape, device, b, Dtype::F32);
    if profile.layers.len() != model_cfg.num_layers() {
        bail!(
            "the analytical profile of {} has {} layers, the model {}",
            cfg.model,
            profile.layers.len(),
            model_cfg.num_layers()
        );
    }
    let g = u(cfg.devices_per_node, "--devices-per-node")?;
    let cluster = device.cluster(g);
    let job = JobSpec {
        fault_threshold: u(cfg.fault_threshold, "--fault-threshold")?,
        microbatch_size: b,
        global_microbatches: u(cfg.num_microbatches(), "microbatches")?,
        state_bytes_per_param_byte: 4,
        template_microbatches: TemplateMicrobatches::Auto,
    };
    let n = u(nodes.len(), "--nodes")?;
    let set = generate_templates(&profile, &cluster, &job, n)
        .with_context(|| format!("planning pipeline templates for {n} nodes"))?;
    let sync = gradient_sync_ns(&profile, &cluster);
    let plan = match &cfg.pipeline_nodes {
        Some(sizes) => {
            let pipes = pinned_pipelines(sizes, nodes)?;
            plan_with_pipelines(&set, &job, g, sync, pipes)
                .with_context(|| format!("--pipeline-nodes {sizes:?}"))?
        }
        None => instantiate_with_sizes(&set, &job, g, sync, nodes, 0)
            .with_context(|| format!("instantiating pipelines on {n} nodes"))?,
    };
    Ok(plan)
}

/// Everything checked before a process is started.
struct Prepared {
    cfg: TrainConfig,
    model_cfg: ModelConfig,
    iters_per_epoch: usize,
    out: PathBuf,
    /// `--resume`: the checkpoint the workers load, and its step.
    resume: Option<(PathBuf, u64)>,
    /// The plans of earlier runs in this directory (`plan.json`), kept and appended to.
    plans: Vec<serde_json::Value>,
    /// `--inject-failure NODE@STEP`s, checked against the job.
    injections: Vec<(u32, u64)>,
}

impl Prepared {
    /// The committed step the job starts from.
    fn start(&self) -> u64 {
        self.resume.as_ref().map_or(0, |r| r.1)
    }
}

fn prepare(cfg: TrainConfig, resume: Option<&Path>) -> Result<Prepared> {
    if cfg.nodes < 2 {
        bail!(
            "the local cluster needs --nodes 2 or more (got {})",
            cfg.nodes
        );
    }
    let mut injections = Vec::new();
    for spec in &cfg.inject_failure {
        let (node, step) = parse_failure(spec)?;
        if node >= cfg.nodes {
            bail!(
                "--inject-failure {spec}: node {node} does not exist; the nodes are 0..{}",
                cfg.nodes - 1
            );
        }
        if step == 0 || step >= cfg.steps {
            bail!(
                "--inject-failure {spec}: the step must be in 1..{} (the node dies after that \
                 step is committed)",
                cfg.steps - 1
            );
        }
        injections.push((u32::try_from(node).context("--inject-failure node")?, step));
    }
    let (model_cfg, _) = model_config(&cfg)?;
    let ids: Vec<u32> = (0..u32::try_from(cfg.nodes).context("--nodes")?).collect();
    // Validate the plan (pinned sizes included) before anything is spawned.
    plan_for(&cfg, &model_cfg, &ids)?;
    let (_, _, iters_per_epoch) = prepare_data(&cfg, &model_cfg)?;
    // A resumed run continues in its own directory, from its newest checkpoint (or the one
    // named), on whatever nodes this job has: any plan computes the same steps.
    let (out, ckpt) = open_run(&cfg, resume)?;
    let resume = match ckpt {
        Some(ckpt) => {
            let step = checkpoint::verify_checkpoint(&ckpt)?.step;
            if step >= cfg.steps {
                bail!(
                    "--resume {}: the checkpoint is at step {step}, and this job has --steps {}; \
                     pass a larger --steps to train further",
                    ckpt.display(),
                    cfg.steps
                );
            }
            truncate_metrics_after(&out, step)?;
            Some((ckpt, step))
        }
        None => None,
    };
    // Children get absolute paths whatever their working directory.
    let abs = |p: &Path| {
        p.canonicalize()
            .with_context(|| format!("resolving {}", p.display()))
    };
    let resume = match resume {
        Some((ckpt, step)) => Some((abs(&ckpt)?, step)),
        None => None,
    };
    let out = abs(&out)?;
    let plans = match std::fs::read_to_string(out.join("plan.json")) {
        Ok(text) if resume.is_some() => serde_json::from_str(&text).with_context(|| {
            format!(
                "{}: expected an array of plans, one per generation",
                out.join("plan.json").display()
            )
        })?,
        _ => Vec::new(),
    };
    Ok(Prepared {
        cfg,
        model_cfg,
        iters_per_epoch,
        out,
        resume,
        plans,
        injections,
    })
}

/// How a job's agents come to be.
pub enum Launch {
    /// `--nodes N`: N agent processes on this machine, the master on 127.0.0.1.
    Local,
    /// `--listen ADDR --expect-nodes N`: the master listens on `addr` and waits for agents
    /// started by hand (`oobleck agent --master ADDR`) with the same token.
    Listen { addr: SocketAddr, token: Token },
    /// `--hostfile FILE --listen ADDR`: like `Listen`, and the master starts one agent per host
    /// over ssh itself (`cluster::hostfile`), pointing them at `addr`.
    Hostfile {
        addr: SocketAddr,
        token: Token,
        hosts: Vec<HostEntry>,
    },
}

/// Runs the job on a local cluster of `cfg.nodes` agent processes. Returns when every process
/// has exited; on any failure every process is killed and the error says what failed.
pub fn run_local(cfg: TrainConfig) -> Result<Summary> {
    run(cfg, Launch::Local, None)
}

/// Runs the job with agents started as `launch` says.
/// With `resume` (a run or checkpoint directory, as `--resume` takes), the run continues from
/// that checkpoint in its own directory.
pub fn run(cfg: TrainConfig, launch: Launch, resume: Option<&Path>) -> Result<Summary> {
    let p = prepare(cfg, resume)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the master's runtime")?;
    let out = p.out.clone();
    let result = rt.block_on(drive(p, launch));
    crate::report::finish_run(&out, result)
}

struct Published<'a>(&'a std::path::Path);

impl Drop for Published<'_> {
    fn drop(&mut self) {
        super::status::unpublish(self.0);
    }
}

struct Files {
    metrics: std::fs::File,
    events: std::fs::File,
}

impl Files {
    fn event(&mut self, v: serde_json::Value) -> Result<()> {
        writeln!(self.events, "{v}").context("writing events.jsonl")
    }
}

struct AgentProc {
    /// The agent, or the ssh running it.
    child: Child,
    /// Held open: the agent exits when it closes.
    stdin: Option<ChildStdin>,
    /// It exited during the job (its node failed); the job went on without it.
    gone: bool,
}

async fn drive(p: Prepared, launch: Launch) -> Result<Summary> {
    let append = |name: &str| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p.out.join(name))
            .with_context(|| format!("opening {}", p.out.join(name).display()))
    };
    let mut files = Files {
        metrics: append("metrics.jsonl")?,
        events: append("events.jsonl")?,
    };
    let n = p.cfg.nodes;
    let local = matches!(launch, Launch::Local);
    let (bind, token, join_timeout, hosts) = match launch {
        Launch::Local => (
            "127.0.0.1:0".parse().context("master address")?,
            Token::random(),
            JOIN_TIMEOUT,
            None,
        ),
        Launch::Listen { addr, token } => (addr, token, LISTEN_JOIN_TIMEOUT, None),
        Launch::Hostfile { addr, token, hosts } => (addr, token, JOIN_TIMEOUT, Some(hosts)),
    };
    let mut master = Master::bind(bind, token.clone(), u32::try_from(n).context("--nodes")?)
        .await
        .with_context(|| format!("starting the master on {bind}"))?;
    files.event(serde_json::json!({
        "event": if p.resume.is_some() { "resume" } else { "start" },
        "step": p.start(),
        "checkpoint": p.resume.as_ref().map(|r| r.0.display().to_string()),
        "model": p.cfg.model,
        "params": p.model_cfg.num_params(),
        "nodes": n,
        "master": master.local_addr().to_string(),
        "pid": std::process::id(),
    }))?;
    super::status::publish(&p.out, master.local_addr(), &token)?;
    // The token file goes away however this function ends.
    let _published = Published(&p.out);
    eprintln!(
        "training {} ({:.2}M parameters, {} layers) on {} of {n} nodes x {} devices (f = {}): {} \
         steps of {} samples x {} tokens; run directory {}",
        p.cfg.model,
        p.model_cfg.num_params() as f64 / 1e6,
        p.model_cfg.num_layers(),
        if local {
            "a local cluster"
        } else {
            "a cluster"
        },
        p.cfg.devices_per_node,
        p.cfg.fault_threshold,
        p.cfg.steps,
        p.cfg.global_batch_size,
        p.cfg.seq_len,
        p.out.display()
    );
    let mut agents = Vec::with_capacity(n);
    if local {
        let exe = oobleck_exe()?;
        for i in 0..n {
            let spawned = Command::new(&exe)
                .arg("agent")
                .arg("--master")
                .arg(master.local_addr().to_string())
                .arg("--exit-with-parent")
                .args(["--wait", "10"])
                .env("OOBLECK_TOKEN", token.expose())
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .kill_on_drop(true)
                .spawn()
                .with_context(|| format!("starting agent {i} ({})", exe.display()));
            let mut child = match spawned {
                Ok(c) => c,
                Err(e) => {
                    kill_all(&mut agents).await;
                    return Err(e);
                }
            };
            files.event(serde_json::json!({
                "event": "process", "role": "agent", "pid": child.id(),
            }))?;
            let stdin = child.stdin.take();
            agents.push(AgentProc {
                child,
                stdin,
                gone: false,
            });
        }
    } else if let Some(hosts) = hosts {
        let addr = master.local_addr().to_string();
        eprintln!(
            "master listening on {addr}; starting {} agents over ssh",
            hosts.len()
        );
        let launched = hostfile::launch(&hosts, &addr, token.expose(), SSH_TIMEOUT).await?;
        for l in launched {
            files.event(serde_json::json!({
                "event": "process", "role": "ssh", "host": l.entry.to_string(),
                "pid": l.child.id(),
            }))?;
            // The agent prints nothing on stdout itself; pass on whatever comes so its pipe
            // never fills.
            let host = l.entry.to_string();
            let mut lines = BufReader::new(l.stdout).lines();
            tokio::spawn(async move {
                while let Ok(Some(line)) = lines.next_line().await {
                    eprintln!("[{host}] {line}");
                }
            });
            agents.push(AgentProc {
                child: l.child,
                stdin: Some(l.stdin),
                gone: false,
            });
        }
    } else {
        eprintln!(
            "master listening on {}: start `oobleck agent --master {}` (with OOBLECK_TOKEN set \
             to the job's token) on each of the {n} nodes",
            master.local_addr(),
            master.local_addr()
        );
    }
    let mut job = Job {
        p: &p,
        files: &mut files,
        master: &mut master,
        agents: &mut agents,
        join_timeout,
        progress: Progress::new(p.cfg.steps, p.start()),
        generation: p
            .plans
            .iter()
            .filter_map(|p| p["generation"].as_u64())
            .max()
            .map_or(0, |g| g + 1),
        plans: p.plans.clone(),
        lost: BTreeSet::new(),
        injections: p.injections.clone(),
        committed: p.start(),
        steps_run: 0,
        first_loss: None,
        started: Instant::now(),
        recovering: None,
        agent_of: BTreeMap::new(),
        local,
        broken: BTreeMap::new(),
        ready: BTreeSet::new(),
        exited: BTreeSet::new(),
        formed: false,
    };
    // Ctrl-C reaches every process of a local job (one process group); say so plainly rather
    // than reporting the workers it killed.
    let result = tokio::select! {
        biased;
        _ = tokio::signal::ctrl_c() => {
            let newest = checkpoint::latest_checkpoint(&p.out).ok().flatten();
            Err(anyhow::anyhow!(
                "interrupted (Ctrl-C); {}",
                match newest {
                    Some(c) => format!("the newest checkpoint is {}", c.display()),
                    None => "no checkpoint was written yet".into(),
                }
            ))
        }
        r = job.run() => r,
    };
    let progress = std::mem::replace(&mut job.progress, Progress::new(0, 0));
    progress.finish();
    match result {
        Ok(mut summary) => {
            let unheard = master.shutdown("training finished", EXIT_GRACE).await;
            for (node, e) in unheard {
                tracing::warn!(node, error = %e, "agent did not get the shutdown");
            }
            let clean = wait_all(&mut agents, EXIT_GRACE).await;
            if !clean.is_empty() {
                bail!(
                    "agents did not exit cleanly after the job: {}",
                    clean.join("; ")
                );
            }
            summary.wall_s = summary.wall_s.max(1e-9);
            files.event(serde_json::json!({
                "event": "finish", "step": summary.steps, "wall_s": summary.wall_s,
            }))?;
            Ok(summary)
        }
        Err(e) => {
            let reason = format!("{e:#}");
            let _ = files.event(serde_json::json!({"event": "abort", "reason": reason}));
            let _ = master
                .shutdown(&format!("job failed: {reason}"), Duration::from_secs(2))
                .await;
            kill_all(&mut agents).await;
            Err(e)
        }
    }
}

/// Closes the agents' stdin and waits up to `grace` for each; kills the ones still running.
/// Returns what went wrong with each that did not exit with status 0.
async fn wait_all(agents: &mut [AgentProc], grace: Duration) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + grace;
    let mut bad = Vec::new();
    for (i, a) in agents.iter_mut().enumerate() {
        if a.gone {
            continue;
        }
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match tokio::time::timeout(left, a.child.wait()).await {
            Ok(Ok(st)) if st.success() => {}
            Ok(Ok(st)) => bad.push(format!("agent {i} exited with {st}")),
            Ok(Err(e)) => bad.push(format!("agent {i}: {e}")),
            Err(_) => {
                let _ = a.child.start_kill();
                let _ = tokio::time::timeout(grace, a.child.wait()).await;
                bad.push(format!(
                    "agent {i} still ran after {grace:?} and was killed"
                ));
            }
        }
        a.stdin = None;
    }
    bad
}

/// Kills every agent (their workers follow: their stdin closes) and reaps them.
async fn kill_all(agents: &mut [AgentProc]) {
    for a in agents.iter_mut() {
        a.stdin = None;
        let _ = a.child.start_kill();
    }
    for a in agents.iter_mut() {
        let _ = tokio::time::timeout(EXIT_GRACE, a.child.wait()).await;
    }
}

struct Job<'a> {
    p: &'a Prepared,
    files: &'a mut Files,
    master: &'a mut Master,
    agents: &'a mut Vec<AgentProc>,
    join_timeout: Duration,
    progress: Progress,
    /// The generation running (or about to).
    generation: u64,
    /// Every plan of the run directory so far (`plan.json`), one per generation.
    plans: Vec<serde_json::Value>,
    /// Nodes lost during the job, for good.
    lost: BTreeSet<u32>,
    /// `--inject-failure`s still to fire: `(node, after step)`.
    injections: Vec<(u32, u64)>,
    /// The newest committed step.
    committed: u64,
    /// Steps committed by this job (replays included), for its throughput.
    steps_run: u64,
    first_loss: Option<f64>,
    started: Instant,
    /// The recovery under way, from the failure until the next commit.
    recovering: Option<Recovery>,
    /// Local clusters: the agent process of each node (its workers' parent), so that a node
    /// declared lost while its agent still lives (hung: SIGSTOP) can be fenced off.
    agent_of: BTreeMap<u32, u32>,
    local: bool,
    /// Workers of the running generation whose step failed and that wait, holding the state
    /// of a committed step: rank -> (node, step).
    broken: BTreeMap<u32, (u32, u64)>,
    /// Ranks of the running generation that reported the open step ready: they wait for its
    /// commit holding the state of the last committed step.
    ready: BTreeSet<u32>,
    /// Ranks of the running generation that exited.
    exited: BTreeSet<u32>,
    /// The running generation's data plane formed (its rendezvous went out).
    formed: bool,
}

/// A recovery's phases (DESIGN.md section 5), timed from the failure to the first commit after.
struct Recovery {
    failed: Instant,
    mark: Instant,
    phases: Vec<(&'static str, f64)>,
}

/// A node or worker of the running generation is gone: the job can go on without it,
/// from the newest checkpoint (DESIGN.md section 5).
#[derive(Debug)]
struct NodeFailure(String);

impl std::fmt::Display for NodeFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NodeFailure {}

fn node_failure(what: String) -> anyhow::Error {
    NodeFailure(what).into()
}

fn is_node_failure(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<NodeFailure>())
}

/// The ranks' reports of the step being assembled.
#[derive(Default)]
struct Pending {
    /// rank -> (loss, grad norm)
    ready: BTreeMap<u32, (f64, f64)>,
}

impl Job<'_> {
    /// Keeps track of lost nodes and of the running generation's broken and exited workers, and
    /// writes their events; the same wherever the event is read (stepping, recovery, rescue).
    fn record(&mut self, ev: &MasterEvent) -> Result<()> {
        match ev {
            // Once per node, whoever reads its loss first.
            MasterEvent::Lost { node, reason } if self.lost.insert(*node) => {
                self.files.event(serde_json::json!({
                    "event": "lost", "node": node, "reason": format!("{reason:?}"),
                }))?;
            }
            MasterEvent::WorkerBroken {
                node,
                rank,
                generation,
                step,
                error,
            } if *generation == self.generation => {
                self.broken.insert(*rank, (*node, *step));
                self.files.event(serde_json::json!({
                    "event": "worker_broken", "node": node, "rank": rank, "step": step,
                    "error": error,
                }))?;
            }
            MasterEvent::WorkerExited {
                node,
                rank,
                generation,
                status,
                error,
            } if *generation == self.generation => {
                self.broken.remove(rank);
                self.exited.insert(*rank);
                self.files.event(serde_json::json!({
                    "event": "worker_exit", "node": node, "rank": rank,
                    "generation": generation, "code": status.code,
                    "signal": status.signal, "error": error,
                }))?;
            }
            _ => {}
        }
        Ok(())
    }

    /// The next membership event; errors for the ones that end a job without recovery.
    async fn next(&mut self, last_progress: &mut Instant) -> Result<Option<MasterEvent>> {
        if last_progress.elapsed() > STALL_TIMEOUT {
            bail!("no progress for {STALL_TIMEOUT:?}; the job is stuck");
        }
        self.check_agents_alive()?;
        let ev = match self.master.next_event(POLL).await {
            Ok(ev) => ev,
            Err(ElasticError::Timeout { .. }) => return Ok(None),
            Err(e) => return Err(e).context("the master's event stream"),
        };
        *last_progress = Instant::now();
        self.record(&ev)?;
        match &ev {
            MasterEvent::Lost { node, reason } => {
                return Err(node_failure(format!("node {node} was lost ({reason:?})")));
            }
            MasterEvent::WorkerExited { generation: g, .. }
            | MasterEvent::WorkerBroken { generation: g, .. }
                if *g != self.generation =>
            {
                // A worker of an earlier generation, stopped by its agent.
                return Ok(None);
            }
            MasterEvent::WorkerBroken {
                node,
                rank,
                step,
                error,
                ..
            } => {
                return Err(node_failure(format!(
                    "worker rank {rank} on node {node} failed in step {} before finishing: \
                     {error}",
                    step + 1
                )));
            }
            MasterEvent::Joined { node, .. } => {
                bail!("node {node} joined during the job; elastic growth is not built yet")
            }
            MasterEvent::KillRequested { node } => {
                // `oobleck kill-node`: the node kills its own processes, as a crash would.
                self.files
                    .event(serde_json::json!({"event": "kill_requested", "node": node}))?;
                self.progress
                    .note(&format!("killing node {node}, as requested"));
                if let Err(e) = self
                    .master
                    .send_to(*node, Message::KillNode { node: *node })
                    .await
                {
                    tracing::warn!(node, error = %e, "could not tell the node to die");
                }
                return Ok(None);
            }
            _ => {}
        }
        Ok(Some(ev))
    }

    /// Runs the job: one generation, and after a recoverable failure (with `f >= 1`) the next
    /// one on the nodes left, from the newest checkpoint, until the last step is committed.
    async fn run(&mut self) -> Result<Summary> {
        let mut nodes = self.wait_for_nodes().await?;
        let mut resume = self.p.resume.clone();
        let mut cfg = self.p.cfg.clone();
        // Failures in a row with no step committed in between: a failure that repeats itself
        // (a worker that always crashes) must end the job, not loop.
        let mut fruitless = 0;
        loop {
            let plan = self.plan(&cfg, &nodes)?;
            self.phase("plan");
            let before = self.steps_run;
            let lost_before = self.lost.len();
            let failure = match self
                .run_generation(&nodes, plan.clone(), resume.as_ref())
                .await
            {
                Ok(summary) => return Ok(summary),
                // A worker that fails while its generation forms, on a node that is still up
                // (it cannot bind its port, cannot load its state), would fail the same way
                // again: that ends the job.
                Err(e)
                    if is_node_failure(&e)
                        && self.p.cfg.fault_threshold > 0
                        && (self.formed || self.lost.len() > lost_before) =>
                {
                    e
                }
                Err(e) => return Err(e),
            };
            if self.steps_run > before {
                fruitless = 0;
            }
            fruitless += 1;
            if fruitless > MAX_FRUITLESS_RECOVERIES {
                return Err(failure.context(format!(
                    "{MAX_FRUITLESS_RECOVERIES} recoveries in a row without a committed step; \
                     giving up"
                )));
            }
            let (left, from) = self.recover(&nodes, &plan, &failure).await?;
            nodes = left;
            resume = from;
            // Pinned pipeline sizes described the old node set; the planner chooses now.
            cfg.pipeline_nodes = None;
            self.generation += 1;
        }
    }

    /// The plan of the current generation on `nodes`, recorded in `plan.json` and the events.
    /// After a failure, with fewer nodes than `f + 1` pipelines need, it keeps as much fault
    /// tolerance as the nodes allow.
    fn plan(&mut self, cfg: &TrainConfig, nodes: &[u32]) -> Result<Plan> {
        let mut plan = match plan_for(cfg, &self.p.model_cfg, nodes) {
            Ok(p) => p,
            Err(e) if self.generation == 0 || cfg.fault_threshold == 0 => return Err(e),
            Err(e) => {
                let mut lower = cfg.clone();
                let mut found = None;
                for f in (0..cfg.fault_threshold).rev() {
                    lower.fault_threshold = f;
                    if let Ok(p) = plan_for(&lower, &self.p.model_cfg, nodes) {
                        self.progress.note(&format!(
                            "{} nodes are left: planning for f = {f} (was {})",
                            nodes.len(),
                            cfg.fault_threshold
                        ));
                        found = Some(p);
                        break;
                    }
                }
                found.ok_or(e)?
            }
        };
        plan.generation = self.generation;
        // Every plan of the run, one per generation (DESIGN.md section 6).
        self.plans.push(serde_json::to_value(&plan)?);
        std::fs::write(
            self.p.out.join("plan.json"),
            serde_json::to_string_pretty(&self.plans)?,
        )
        .context("writing plan.json")?;
        Ok(plan)
    }

    async fn run_generation(
        &mut self,
        nodes: &[u32],
        plan: Plan,
        resume: Option<&(PathBuf, u64)>,
    ) -> Result<Summary> {
        let started = self.started;
        self.broken.clear();
        self.ready.clear();
        self.exited.clear();
        self.formed = false;
        let job = Message::Job {
            run_dir: self.p.out.display().to_string(),
            config: serde_json::to_value(&self.p.cfg)?,
            resume: resume.map(|r| r.0.display().to_string()),
        };
        for &node in nodes {
            if let Err(e) = self.master.send_to(node, job.clone()).await {
                return Err(node_failure(format!(
                    "node {node} did not get the job: {e}"
                )));
            }
        }
        let world = world_size(&plan);
        let layout: Vec<serde_json::Value> = plan
            .pipelines
            .iter()
            .map(|pl| {
                serde_json::json!({
                    "id": pl.id, "nodes": pl.nodes, "first_rank": pl.first_rank,
                    "microbatches": pl.microbatches,
                })
            })
            .collect();
        self.files.event(serde_json::json!({
            "event": "plan", "generation": plan.generation, "pipelines": layout,
        }))?;
        let unreachable = self
            .master
            .assign_plan(&plan, Vec::new(), nccl_unique_id(&self.p.cfg)?)
            .await
            .context("assigning the plan")?;
        if let Some((node, e)) = unreachable.first() {
            return Err(node_failure(format!(
                "node {node} did not get the plan: {e}"
            )));
        }
        self.progress
            .note(&super::status::render_plan(&self.master.status()));
        let generation = plan.generation;
        let mut last_progress = Instant::now();

        // Rendezvous: every worker bound its own port.
        let mut listening: BTreeMap<u32, String> = BTreeMap::new();
        while listening.len() < world as usize {
            let Some(ev) = self.next(&mut last_progress).await? else {
                continue;
            };
            match ev {
                MasterEvent::WorkerListening {
                    node,
                    rank,
                    generation: g,
                    addr,
                    pid,
                } if g == generation => {
                    self.files.event(serde_json::json!({
                        "event": "process", "role": "worker", "node": node, "rank": rank,
                        "pid": pid, "data_addr": addr,
                    }))?;
                    if self.local {
                        if let Some(agent) = parent_pid(pid) {
                            self.agent_of.insert(node, agent);
                        }
                    }
                    listening.insert(rank, addr);
                }
                MasterEvent::WorkerExited {
                    node,
                    rank,
                    status,
                    error,
                    ..
                } => {
                    return Err(node_failure(format!(
                        "worker rank {rank} on node {node} exited ({}) while the data plane \
                         formed{}",
                        describe(status.code, status.signal),
                        because(error.as_deref())
                    )))
                }
                _ => {}
            }
        }
        let rendezvous: Vec<Rendezvous> = listening
            .into_iter()
            .map(|(rank, addr)| Rendezvous { rank, addr })
            .collect();
        self.files.event(serde_json::json!({
            "event": "rendezvous", "generation": generation,
            "addrs": rendezvous.iter().map(|r| &r.addr).collect::<Vec<_>>(),
        }))?;
        let missed = self
            .master
            .broadcast(&Message::RendezvousList {
                generation,
                rendezvous,
            })
            .await;
        if let Some((node, e)) = missed.first() {
            return Err(node_failure(format!(
                "node {node} did not get the rendezvous: {e}"
            )));
        }
        // Workers started and listening; next they load their state and connect.
        self.phase("spawn");
        self.formed = true;

        // Steps: commit each once every rank holds its reduced gradients.
        let tokens_per_step = (self.p.cfg.global_batch_size * self.p.cfg.seq_len) as f64;
        let mut done: BTreeMap<u32, f64> = BTreeMap::new();
        let mut last_metrics: Option<StepMetrics> = None;
        let mut saved: BTreeMap<u32, PathBuf> = BTreeMap::new();
        let start = resume.map_or(0, |r| r.1);
        let mut step = start;
        let mut pending = Pending::default();
        let mut last_loss = None;
        let stepping = Instant::now();
        let mut last_step_at = stepping;
        let mut commit_ns = 0u128;
        let assembler = Assembler::new(self.p, &plan)?;
        let lr = LrSchedule::new(
            self.p.cfg.lr,
            self.p.cfg.final_lr(),
            self.p.cfg.warmup(),
            self.p.cfg.steps,
        )?;
        // Periodic states by step, until every saver's is in.
        let mut states: BTreeMap<u64, BTreeMap<u32, PathBuf>> = BTreeMap::new();
        let mut background: Vec<tokio::task::JoinHandle<Result<Assembled>>> = Vec::new();
        // Metrics lines not written yet: one waiting for its validation loss holds back the
        // ones after it, so the file stays in step order.
        let mut held: VecDeque<(StepMetrics, bool)> = VecDeque::new();
        let stepped: Result<()> = async {
            while done.len() < world as usize || !background.is_empty() {
                self.collect(&mut background, &mut held, false).await?;
                self.flush_metrics(&mut held)?;
                let Some(ev) = self.next(&mut last_progress).await? else {
                    continue;
                };
                match ev {
                    MasterEvent::StateSaved {
                        rank,
                        generation: g,
                        step: s,
                        state,
                        ..
                    } if g == generation => {
                        if !assembler.savers.contains(&rank) {
                            bail!(
                                "rank {rank} saved state, but only ranks {:?} keep it",
                                assembler.savers
                            );
                        }
                        let got = states.entry(s).or_default();
                        got.insert(rank, PathBuf::from(state));
                        if got.len() == assembler.savers.len() {
                            let got = states.remove(&s).unwrap_or_default();
                            let a = assembler.clone();
                            background
                                .push(tokio::task::spawn_blocking(move || a.periodic(s, &got)));
                        }
                    }
                    MasterEvent::StepReady {
                        rank,
                        generation: g,
                        step: s,
                        loss,
                        grad_norm,
                        ..
                    } if g == generation => {
                        if s != step + 1 {
                            bail!(
                                "rank {rank} reported step {s} ready while step {} is open",
                                step + 1
                            );
                        }
                        self.ready.insert(rank);
                        if pending.ready.insert(rank, (loss, grad_norm)).is_some() {
                            bail!("rank {rank} reported step {s} ready twice");
                        }
                        if pending.ready.len() < world as usize {
                            continue;
                        }
                        let (loss, grad_norm) = agreed(&pending.ready, s)?;
                        pending = Pending::default();
                        self.ready.clear();
                        let commit_started = Instant::now();
                        let missed = self.master.commit_step(s, 0.0).await;
                        commit_ns += commit_started.elapsed().as_nanos();
                        if let Some((node, e)) = missed.first() {
                            return Err(node_failure(format!(
                                "node {node} did not get the commit of step {s}: {e}"
                            )));
                        }
                        step = s;
                        self.committed = s;
                        self.steps_run += 1;
                        self.phase("load_connect_first_step");
                        if let Some(r) = self.recovering.take() {
                            let phases: serde_json::Map<String, serde_json::Value> = r
                                .phases
                                .iter()
                                .map(|(k, v)| (format!("{k}_s"), serde_json::json!(v)))
                                .collect();
                            self.files.event(serde_json::json!({
                                "event": "resumed", "generation": generation, "step": s,
                                "since_failure_s": r.failed.elapsed().as_secs_f64(),
                                "phases": phases,
                            }))?;
                        }
                        let dt = last_step_at.elapsed().as_secs_f64().max(1e-9);
                        last_step_at = Instant::now();
                        self.first_loss.get_or_insert(loss);
                        last_loss = Some(loss);
                        let m = StepMetrics {
                            step,
                            loss,
                            lr: lr.lr_at(step - 1),
                            grad_norm,
                            samples_per_s: self.p.cfg.global_batch_size as f64 / dt,
                            tokens_per_s: tokens_per_step / dt,
                            generation,
                            pipelines: plan.pipelines.len(),
                            nodes: nodes.len(),
                            wall_s: started.elapsed().as_secs_f64(),
                            val_loss: None,
                        };
                        self.master.record_commit(step, m.samples_per_s);
                        self.progress.step(&m, self.p.cfg.steps);
                        if step == self.p.cfg.steps {
                            // Written with the validation loss once the final state is in.
                            last_metrics = Some(m.clone());
                        } else {
                            let eval =
                                self.p.cfg.eval_every > 0 && step % self.p.cfg.eval_every == 0;
                            held.push_back((m, eval));
                        }
                        self.inject(s).await?;
                    }
                    MasterEvent::WorkerDone {
                        rank,
                        generation: g,
                        step: s,
                        state,
                        commit_wait_ms,
                        ..
                    } if g == generation => {
                        if s != step {
                            bail!("rank {rank} finished at step {s}, the job committed {step}");
                        }
                        if let Some(path) = state {
                            saved.insert(rank, PathBuf::from(path));
                        }
                        done.insert(rank, commit_wait_ms);
                    }
                    MasterEvent::WorkerExited {
                        node,
                        rank,
                        status,
                        error,
                        ..
                    } => {
                        let ok = status.code == Some(0);
                        if !ok || !done.contains_key(&rank) {
                            return Err(node_failure(format!(
                                "worker rank {rank} on node {node} exited ({}) before finishing{}",
                                describe(status.code, status.signal),
                                because(error.as_deref())
                            )));
                        }
                    }
                    _ => {}
                }
            }
            Ok(())
        }
        .await;
        if let Err(e) = stepped {
            if is_node_failure(&e) {
                // Checkpoints of committed steps still being written are kept: the next
                // generation may start from one.
                self.settle_background(&mut background, &mut held).await;
            }
            return Err(e);
        }
        if step != self.p.cfg.steps {
            bail!(
                "the workers finished after {step} of {} steps",
                self.p.cfg.steps
            );
        }
        self.collect(&mut background, &mut held, true).await?;
        self.flush_metrics(&mut held)?;
        let train_s = last_step_at.duration_since(stepping).as_secs_f64();
        // The rank that waited least for its commits was the last to be ready in most steps:
        // its wait is the round trip the commit protocol adds (ready -> agent -> master ->
        // agent -> worker), an upper bound on the control plane's cost per step.
        let ran = (step - start).max(1) as f64;
        let overhead_ms = done.values().copied().fold(f64::INFINITY, f64::min) / ran;
        let step_ms = 1e3 * train_s / ran;
        self.files.event(serde_json::json!({
            "event": "control_plane", "steps": step - start,
            "commit_wait_ms_per_step": overhead_ms,
            "step_ms": step_ms,
            "master_commit_ms_per_step": commit_ns as f64 / 1e6 / ran,
        }))?;
        self.progress.note(&format!(
            "control plane: {overhead_ms:.2} ms per step waiting for commits ({:.2}% of a \
             {step_ms:.0} ms step)",
            100.0 * overhead_ms / step_ms.max(1e-9)
        ));
        let assembling = Instant::now();
        let (params, opt) = assembler.merge(&saved)?;
        let ckpt = assembler.save(&params, opt, step)?;
        let _ = std::fs::remove_dir_all(self.p.out.join("cluster"));
        self.files.event(serde_json::json!({
            "event": "checkpoint", "step": step, "path": ckpt,
            "duration_s": assembling.elapsed().as_secs_f64(),
        }))?;
        let val = assembler.validation_loss(&params)?;
        if let Some(mut m) = last_metrics {
            m.val_loss = Some(val);
            writeln!(self.files.metrics, "{}", serde_json::to_string(&m)?)
                .context("writing metrics.jsonl")?;
        }
        let wall_s = started.elapsed().as_secs_f64();
        Ok(Summary {
            out: self.p.out.clone(),
            model: self.p.cfg.model.clone(),
            params: self.p.model_cfg.num_params(),
            steps: step,
            first_loss: self.first_loss,
            final_loss: last_loss,
            first_val_loss: None,
            final_val_loss: Some(val),
            tokens_per_s: tokens_per_step * self.steps_run as f64 / wall_s.max(1e-9),
            wall_s,
            checkpoint: Some(ckpt),
            report: None,
        })
    }

    /// After a failure: waits a moment for every loss it caused to be known, then picks the
    /// nodes left and the newest checkpoint. Returns them; the caller starts the next
    /// generation there. Metrics past the checkpoint go: those steps are replayed.
    async fn recover(
        &mut self,
        nodes: &[u32],
        plan: &Plan,
        failure: &anyhow::Error,
    ) -> Result<(Vec<u32>, Option<(PathBuf, u64)>)> {
        let detected = Instant::now();
        self.recovering = Some(Recovery {
            failed: detected,
            mark: detected,
            phases: Vec::new(),
        });
        let failed_at = self.committed;
        self.files.event(serde_json::json!({
            "event": "failure", "generation": self.generation, "step": failed_at,
            "reason": format!("{failure:#}"),
        }))?;
        self.progress.note(&format!(
            "failure in step {}: {failure:#}; recovering",
            failed_at + 1
        ));
        // A node's death shows as several events (its workers' peers fail, its agent's
        // connection drops): collect them for SETTLE, and where this master started the
        // agents, until every dead agent's node is known lost (at most LOSS_WAIT).
        // And until every rank on a node still up has failed its step (holding the committed
        // state), waits for the commit, or exited: a rank still computing its part of the
        // step finds out only at its next data-plane operation (at most RANKS_WAIT).
        let settle = detected + SETTLE;
        let hard = detected + LOSS_WAIT;
        let ranks_hard = detected + RANKS_WAIT;
        loop {
            let _ = self.check_agents_alive();
            let dead = self.agents.iter().filter(|a| a.gone).count();
            let now = Instant::now();
            let undecided = self.formed
                && nodes
                    .iter()
                    .filter(|n| !self.lost.contains(n))
                    .flat_map(|&n| ranks_of_node(plan, n))
                    .any(|r| {
                        !self.broken.contains_key(&r)
                            && !self.ready.contains(&r)
                            && !self.exited.contains(&r)
                    });
            let losses_known = dead <= self.lost.len() || now >= hard;
            if now >= settle && losses_known && (!undecided || now >= ranks_hard) {
                break;
            }
            match self.master.next_event(POLL).await {
                Ok(ev) => self.record(&ev)?,
                Err(ElasticError::Timeout { .. }) => {}
                Err(e) => return Err(e).context("the master's event stream"),
            }
        }
        // A lost node may still run (a hang, or a network cut): fence it off, so it cannot
        // come back and the job leaves no process behind.
        for n in nodes.iter().filter(|n| self.lost.contains(n)) {
            let Some(&pid) = self.agent_of.get(n) else {
                continue;
            };
            if let Some(a) = self
                .agents
                .iter_mut()
                .find(|a| !a.gone && a.child.id() == Some(pid))
            {
                let _ = a.child.start_kill();
                let _ = tokio::time::timeout(EXIT_GRACE, a.child.wait()).await;
                a.gone = true;
                self.files.event(serde_json::json!({
                    "event": "fenced", "node": n, "pid": pid,
                }))?;
            }
        }
        let detect_s = detected.elapsed().as_secs_f64();
        self.phase("detect");
        let left: Vec<u32> = nodes
            .iter()
            .copied()
            .filter(|n| !self.lost.contains(n))
            .collect();
        // The survivors' committed state, when one whole pipeline of them still holds it: no
        // step is lost. Otherwise the newest checkpoint.
        let rescued = self.rescue(plan, &left).await;
        let newest = match &rescued {
            Some(c) => Some(c.clone()),
            None => checkpoint::latest_checkpoint(&self.p.out)?,
        };
        let say_newest = || match &newest {
            Some(c) => format!("the newest checkpoint is {}", c.display()),
            None => "no checkpoint was written".into(),
        };
        if left.is_empty() {
            bail!("every node is lost ({failure:#}); {}", say_newest());
        }
        let resume = match &newest {
            Some(c) => {
                let st = checkpoint::verify_checkpoint(c)
                    .with_context(|| format!("checking {} to recover from", c.display()))?;
                Some((c.clone(), st.step))
            }
            // No checkpoint yet: the initialisation is deterministic, so step 0 is one.
            None => None,
        };
        let from = resume.as_ref().map_or(0, |r| r.1);
        self.phase(if rescued.is_some() {
            "rescue"
        } else {
            "checkpoint"
        });
        truncate_metrics_after(&self.p.out, from)?;
        self.files.metrics = std::fs::OpenOptions::new()
            .append(true)
            .open(self.p.out.join("metrics.jsonl"))
            .context("reopening metrics.jsonl")?;
        self.committed = from;
        let lost: Vec<u32> = nodes
            .iter()
            .copied()
            .filter(|n| self.lost.contains(n))
            .collect();
        self.files.event(serde_json::json!({
            "event": "reconfig", "generation": self.generation + 1, "lost_nodes": lost,
            "nodes": left, "failed_in_step": failed_at + 1, "from_step": from,
            "replayed_steps": failed_at - from, "detect_s": detect_s,
            "rescued": rescued.is_some(),
            "checkpoint": newest.as_ref().map(|c| c.display().to_string()),
        }))?;
        self.progress.note(&format!(
            "generation {}: {} node(s) left{}, {}",
            self.generation + 1,
            left.len(),
            if lost.is_empty() {
                String::new()
            } else {
                format!(" (lost {lost:?})")
            },
            if rescued.is_some() {
                format!("resuming at step {from} from the surviving replicas (no step lost)")
            } else {
                format!(
                    "replaying from step {from} ({} step(s) lost)",
                    failed_at - from
                )
            }
        ));
        Ok((left, resume))
    }

    /// Ends the current phase of a recovery under way (nothing otherwise).
    fn phase(&mut self, name: &'static str) {
        if let Some(r) = self.recovering.as_mut() {
            let now = Instant::now();
            r.phases
                .push((name, now.duration_since(r.mark).as_secs_f64()));
            r.mark = now;
        }
    }

    /// Asks the survivors of the failed generation for their state of the last committed
    /// step and writes it as that step's checkpoint. Needs one pipeline of `plan` whose every
    /// stage reported broken (alive, holding that step) on a node in `left`. `None` (and a
    /// warning) when that is not so or anything fails: the caller falls back to a checkpoint.
    async fn rescue(&mut self, plan: &Plan, left: &[u32]) -> Option<PathBuf> {
        let step = self.committed;
        if step == 0 {
            return None;
        }
        let existing = checkpoint::checkpoint_path(&self.p.out, step);
        if checkpoint::verify_checkpoint(&existing).is_ok() {
            return Some(existing);
        }
        let g = plan.devices_per_node;
        // Node of each rank of the failed plan.
        let node_of: BTreeMap<u32, u32> = left
            .iter()
            .flat_map(|&n| ranks_of_node(plan, n).into_iter().map(move |r| (r, n)))
            .collect();
        let holds = |r: &u32| {
            let broken = self
                .broken
                .get(r)
                .is_some_and(|(node, s)| *s == step && left.contains(node));
            broken || (self.ready.contains(r) && node_of.contains_key(r))
        };
        let savers: Vec<u32> = plan.pipelines.iter().find_map(|pl| {
            let savers: Vec<u32> = (0..pl.nodes.len() as u32)
                .map(|j| pl.first_rank + j * g)
                .collect();
            savers.iter().all(holds).then_some(savers)
        })?;
        let started = Instant::now();
        let dir = self
            .p
            .out
            .join("cluster")
            .join(format!("rescue-g{}", self.generation));
        let nodes: BTreeSet<u32> = savers
            .iter()
            .filter_map(|r| node_of.get(r))
            .copied()
            .collect();
        for &n in &nodes {
            let ask = Message::SaveState {
                generation: self.generation,
                step,
                dir: dir.display().to_string(),
            };
            if let Err(e) = self.master.send_to(n, ask).await {
                tracing::warn!(node = n, error = %e, "could not ask for the survivors' state");
                return None;
            }
        }
        let mut states: BTreeMap<u32, PathBuf> = BTreeMap::new();
        let deadline = Instant::now() + RESCUE_WAIT;
        while states.len() < savers.len() {
            if Instant::now() > deadline {
                tracing::warn!(
                    ?savers,
                    "the survivors' state did not come in {RESCUE_WAIT:?}"
                );
                return None;
            }
            match self.master.next_event(POLL).await {
                Ok(MasterEvent::StateSaved {
                    rank,
                    generation,
                    step: s,
                    state,
                    ..
                }) if generation == self.generation && s == step && savers.contains(&rank) => {
                    states.insert(rank, PathBuf::from(state));
                }
                Ok(ev) => {
                    let _ = self.record(&ev);
                    if matches!(ev, MasterEvent::Lost { node, .. } if nodes.contains(&node)) {
                        return None;
                    }
                }
                Err(ElasticError::Timeout { .. }) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "the master's event stream");
                    return None;
                }
            }
        }
        let mut assembler = match Assembler::new(self.p, plan) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "assembling the survivors' state");
                return None;
            }
        };
        assembler.savers = savers.clone();
        let saved = tokio::task::spawn_blocking(move || -> Result<PathBuf> {
            let (params, opt) = assembler.merge(&states)?;
            assembler.save(&params, opt, step)
        })
        .await;
        match saved {
            Ok(Ok(path)) => {
                let _ = self.files.event(serde_json::json!({
                    "event": "rescued", "step": step, "ranks": savers, "path": path,
                    "duration_s": started.elapsed().as_secs_f64(),
                }));
                Some(path)
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %format!("{e:#}"), "writing the survivors' state");
                None
            }
            Err(e) => {
                tracing::warn!(error = %e, "writing the survivors' state");
                None
            }
        }
    }

    /// Waits for the checkpoint and evaluation tasks of a generation that failed: those that
    /// finish are recorded, the metrics they held are written, errors are only logged.
    async fn settle_background(
        &mut self,
        background: &mut Vec<tokio::task::JoinHandle<Result<Assembled>>>,
        held: &mut VecDeque<(StepMetrics, bool)>,
    ) {
        for task in background.drain(..) {
            match tokio::time::timeout(STALL_TIMEOUT, task).await {
                Ok(Ok(Ok(a))) => {
                    if let Some(path) = &a.checkpoint {
                        let _ = self.files.event(serde_json::json!({
                            "event": "checkpoint", "step": a.step, "path": path,
                            "duration_s": a.duration_s,
                        }));
                    }
                    if let Some((m, _)) = held.iter_mut().find(|(m, _)| m.step == a.step) {
                        m.val_loss = a.val_loss;
                    }
                }
                Ok(Ok(Err(e))) => {
                    tracing::warn!(error = %format!("{e:#}"), "periodic assembly failed")
                }
                Ok(Err(e)) => tracing::warn!(error = %e, "periodic assembly panicked"),
                Err(_) => tracing::warn!("periodic assembly took too long; left behind"),
            }
        }
        for (_, waiting) in held.iter_mut() {
            *waiting = false;
        }
        if let Err(e) = self.flush_metrics(held) {
            tracing::warn!(error = %format!("{e:#}"), "writing held metrics");
        }
    }

    /// `--inject-failure NODE@STEP`: once `step` is committed, that node kills its own
    /// processes with SIGKILL.
    async fn inject(&mut self, step: u64) -> Result<()> {
        while let Some(i) = self.injections.iter().position(|&(_, at)| at == step) {
            let (node, _) = self.injections.remove(i);
            self.files.event(serde_json::json!({
                "event": "inject_failure", "node": node, "step": step,
            }))?;
            self.progress.note(&format!(
                "injecting a failure: killing node {node} after step {step}"
            ));
            if let Err(e) = self.master.send_to(node, Message::KillNode { node }).await {
                tracing::warn!(node, error = %e, "could not tell the node to die");
            }
        }
        Ok(())
    }

    /// Takes the results of finished background assemblies (all of them, with `all`): records
    /// checkpoints, fills in validation losses.
    async fn collect(
        &mut self,
        background: &mut Vec<tokio::task::JoinHandle<Result<Assembled>>>,
        held: &mut VecDeque<(StepMetrics, bool)>,
        all: bool,
    ) -> Result<()> {
        let mut i = 0;
        while i < background.len() {
            if !all && !background[i].is_finished() {
                i += 1;
                continue;
            }
            let task = background.remove(i);
            let a = tokio::time::timeout(STALL_TIMEOUT, task)
                .await
                .context("a checkpoint or evaluation took too long")?
                .context("the checkpoint or evaluation task failed")??;
            if let Some(path) = &a.checkpoint {
                self.files.event(serde_json::json!({
                    "event": "checkpoint", "step": a.step, "path": path,
                    "duration_s": a.duration_s,
                }))?;
            }
            if let Some(v) = a.val_loss {
                self.progress
                    .note(&format!("step {}: validation loss {v:.4}", a.step));
                if let Some((m, waiting)) = held.iter_mut().find(|(m, _)| m.step == a.step) {
                    m.val_loss = Some(v);
                    *waiting = false;
                }
            }
        }
        Ok(())
    }

    /// Writes the metrics lines that wait for nothing, in step order.
    fn flush_metrics(&mut self, held: &mut VecDeque<(StepMetrics, bool)>) -> Result<()> {
        while held.front().is_some_and(|(_, waiting)| !waiting) {
            let (m, _) = held.pop_front().expect("checked");
            writeln!(self.files.metrics, "{}", serde_json::to_string(&m)?)
                .context("writing metrics.jsonl")?;
        }
        Ok(())
    }

    /// Waits until all agents registered; returns their node ids, sorted.
    async fn wait_for_nodes(&mut self) -> Result<Vec<u32>> {
        let n = self.p.cfg.nodes;
        let deadline = Instant::now() + self.join_timeout;
        let mut joined = BTreeSet::new();
        while joined.len() < n {
            if Instant::now() > deadline {
                bail!(
                    "only {} of {n} agents registered within {:?}",
                    joined.len(),
                    self.join_timeout
                );
            }
            match self.master.next_event(POLL).await {
                Ok(MasterEvent::Joined { node, addr, .. }) => {
                    joined.insert(node);
                    self.files.event(
                        serde_json::json!({"event": "join", "node": node, "addr": addr.to_string()}),
                    )?;
                    if self.agents.is_empty() {
                        self.progress.note(&format!(
                            "node {node} joined from {addr} ({}/{n})",
                            joined.len()
                        ));
                    }
                }
                Ok(MasterEvent::Lost { node, reason }) => {
                    bail!("node {node} was lost while the cluster formed ({reason:?})")
                }
                Ok(_) => {}
                Err(ElasticError::Timeout { .. }) => {}
                Err(e) => return Err(e).context("waiting for agents"),
            }
            self.check_agents_alive()?;
        }
        Ok(joined.into_iter().collect())
    }

    fn check_agents_alive(&mut self) -> Result<()> {
        for (i, a) in self.agents.iter_mut().enumerate() {
            if a.gone {
                continue;
            }
            if let Some(st) = a.child.try_wait().context("polling an agent")? {
                a.gone = true;
                return Err(node_failure(format!(
                    "agent {i} exited early ({st}); its error is above"
                )));
            }
        }
        Ok(())
    }
}

/// Turns the states pipeline 0's ranks leave into checkpoints and validation losses. Owns what
/// it needs, so it runs on a blocking thread while the job goes on.
#[derive(Clone)]
struct Assembler {
    cfg: TrainConfig,
    model_cfg: ModelConfig,
    out: PathBuf,
    iters_per_epoch: usize,
    /// The ranks that save state: device 0 of each stage of pipeline 0.
    savers: Vec<u32>,
}

/// What a periodic assembly produced.
struct Assembled {
    step: u64,
    checkpoint: Option<PathBuf>,
    val_loss: Option<f64>,
    duration_s: f64,
}

impl Assembler {
    fn new(p: &Prepared, plan: &Plan) -> Result<Assembler> {
        let p0 = plan.pipelines.first().context("the plan has no pipeline")?;
        let g = plan.devices_per_node;
        Ok(Assembler {
            cfg: p.cfg.clone(),
            model_cfg: p.model_cfg.clone(),
            out: p.out.clone(),
            iters_per_epoch: p.iters_per_epoch,
            savers: (0..p0.nodes.len() as u32)
                .map(|j| p0.first_rank + j * g)
                .collect(),
        })
    }

    /// Reads every saver's state: parameters and optimizer state, by name.
    #[allow(clippy::type_complexity)]
    fn merge(
        &self,
        states: &BTreeMap<u32, PathBuf>,
    ) -> Result<(BTreeMap<String, Tensor>, BTreeMap<String, Tensor>)> {
        let mut params: BTreeMap<String, Tensor> = BTreeMap::new();
        let mut opt: BTreeMap<String, Tensor> = BTreeMap::new();
        for rank in &self.savers {
            let path = states
                .get(rank)
                .with_context(|| format!("rank {rank} left no state"))?;
            let tensors =
                candle_core::safetensors::load(path, &Device::Cpu).with_context(|| {
                    format!("reading the state of rank {rank} from {}", path.display())
                })?;
            for (k, t) in tensors {
                if let Some(name) = k.strip_prefix("param/") {
                    params.insert(name.to_string(), t);
                } else if let Some(name) = k.strip_prefix("opt/") {
                    opt.insert(name.to_string(), t);
                } else {
                    bail!("{}: unexpected entry {k}", path.display());
                }
            }
        }
        Ok((params, opt))
    }

    /// Writes `checkpoints/step-NNNNNN`, laid out as the single-process trainer's.
    fn save(
        &self,
        params: &BTreeMap<String, Tensor>,
        opt: BTreeMap<String, Tensor>,
        step: u64,
    ) -> Result<PathBuf> {
        let state = TrainerState {
            step,
            seed: self.cfg.seed,
            data_cursor: serde_json::to_value(DataCursor::at_step(step, self.iters_per_epoch))?,
            config: Some(serde_json::to_value(&self.cfg)?),
        };
        let opt: Vec<(String, Tensor)> = opt.into_iter().collect();
        Ok(checkpoint::save_checkpoint(
            &self.out, params, &opt, &state,
        )?)
    }

    /// Mean loss of the whole model on the first `--eval-batches` validation batches, as the
    /// single-process trainer computes it.
    fn validation_loss(&self, params: &BTreeMap<String, Tensor>) -> Result<f64> {
        let cfg = &self.cfg;
        let model = self.model_cfg.build()?;
        let params: HashMap<String, Tensor> =
            params.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let stage = whole_model(model.as_ref(), &params)?;
        let data = open_dataset(cfg)?;
        let val = data.split(Split::Validation);
        let mut total = 0.0;
        for i in 0..cfg.eval_batches {
            let batch = val.sequential_batch(cfg.seq_len, cfg.microbatch_size, i)?;
            let (inp, tgt) = to_tensors(&batch, &Device::Cpu)?;
            let ctx = ForwardCtx {
                targets: Some(&tgt),
                ..ForwardCtx::inference()
            };
            total += f64::from(stage.forward(&inp, &ctx)?.output.to_scalar::<f32>()?);
        }
        Ok(total / cfg.eval_batches as f64)
    }

    /// The periodic work after `step`: a checkpoint and/or a validation loss, as configured;
    /// removes the states it read.
    fn periodic(&self, step: u64, states: &BTreeMap<u32, PathBuf>) -> Result<Assembled> {
        let started = Instant::now();
        let due = |every: u64| every > 0 && step % every == 0;
        let (params, opt) = self.merge(states)?;
        let checkpoint = match due(self.cfg.checkpoint_every) {
            true => Some(self.save(&params, opt, step)?),
            false => None,
        };
        let val_loss = match due(self.cfg.eval_every) {
            true => Some(self.validation_loss(&params)?),
            false => None,
        };
        if let Some(dir) = states.values().next().and_then(|p| p.parent()) {
            let _ = std::fs::remove_dir_all(dir);
        }
        Ok(Assembled {
            step,
            checkpoint,
            val_loss,
            duration_s: started.elapsed().as_secs_f64(),
        })
    }
}

/// A fresh NCCL unique id for a generation, with `--data-plane nccl`.
fn nccl_unique_id(cfg: &TrainConfig) -> Result<Option<Vec<u8>>> {
    if cfg.data_plane != "nccl" {
        return Ok(None);
    }
    let id = oobleck_comm::NcclId::new()
        .context("making the NCCL unique id (is NCCL installed on the master's machine?)")?;
    Ok(Some(id.0.to_vec()))
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

/// Every rank's loss and gradient norm of `step`: they are the same global values (computed by
/// the same all-reduce and summed in the same order on every rank), so any difference is a bug.
fn agreed(ready: &BTreeMap<u32, (f64, f64)>, step: u64) -> Result<(f64, f64)> {
    let mut it = ready.iter();
    let (&r0, &(loss, norm)) = it.next().context("no rank reported")?;
    for (&r, &(l, g)) in it {
        let same = |a: f64, b: f64| a == b || (a - b).abs() <= 1e-9 * a.abs().max(b.abs());
        if !same(l, loss) || !same(g, norm) {
            bail!(
                "ranks disagree on step {step}: rank {r0} has loss {loss}, grad norm {norm}; \
                 rank {r} has {l}, {g}"
            );
        }
    }
    Ok((loss, norm))
}

/// The parent of process `pid` on this machine, from `/proc` (Linux); `None` elsewhere.
fn parent_pid(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_sizes_must_cover_the_nodes() {
        let nodes = [0, 1, 2];
        assert_eq!(
            pinned_pipelines(&[1, 2], &nodes).expect("valid"),
            vec![vec![0], vec![1, 2]]
        );
        let e = pinned_pipelines(&[2, 2], &nodes).expect_err("too many");
        assert!(
            format!("{e}").contains("uses 4 nodes but the job has 3"),
            "{e}"
        );
        assert!(pinned_pipelines(&[0, 3], &nodes).is_err());
    }
}
