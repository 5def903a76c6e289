//! The cluster job of `train --nodes N` (and `--listen`, `--hostfile`): turns the resolved
//! [`TrainConfig`] into the runtime's [`TrainingSpec`] and the GPT workload's settings, opens
//! the run directory, starts the agents as asked and hands over to
//! `oobleck_core::runtime::master::run_job`, which owns the job from there.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use oobleck_core::runtime::job::Limits;
use oobleck_core::runtime::master::{self, JobOptions, Observer, Started};
use oobleck_core::runtime::wire::protocol::ClusterStatus;
use oobleck_core::runtime::wire::Token;
use oobleck_core::runtime::{
    Compute, Context as _, JobConfig, StepMetrics, TrainingSpec, Workload,
};
use oobleck_models::workload::{GptWorkload, GptWorkloadConfig};
use tokio::io::{AsyncBufReadExt, BufReader};

use super::hostfile::{self, HostEntry};
use super::memory::{check_fits, host_memory, host_ranks, Sharing};
use super::standbys::LocalStandbys;
use crate::config::{training_spec, workload_config, TrainConfig};
use crate::progress::Progress;
use crate::run_dir::{open_run, truncate_metrics_after, Summary};
use crate::status_page::StatusPage;

/// Bound of starting each ssh and handing it the token.
const SSH_TIMEOUT: Duration = Duration::from_secs(30);

/// How a job's agents come to be.
pub enum LaunchMode {
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
    /// Node 0 of a job a scheduler started on every node (`cluster::scheduled`): the master
    /// listens on `addr` (all interfaces) and starts this node's own agent, which reaches it
    /// at `own` (node 0's address as the other nodes see it, so its workers bind there too);
    /// the other nodes' agents come by themselves.
    Scheduled {
        addr: SocketAddr,
        token: Token,
        own: SocketAddr,
    },
    /// `--resume RUN --reattach`: the master of a run whose master was lost listens on `addr`
    /// (where the lost one did) and takes back the agents that still wait for one
    /// (`cluster::reattach`).
    Reattach { addr: SocketAddr, token: Token },
}

/// [`workload_config`] for a cluster job started as `launch`: its measured profile is timed as
/// the ranks sharing a machine run (every rank of a local cluster; a node's devices otherwise).
pub fn cluster_workload_config(cfg: &TrainConfig, launch: &LaunchMode) -> GptWorkloadConfig {
    GptWorkloadConfig {
        host_ranks: host_ranks(cfg, launch),
        ..workload_config(cfg)
    }
}

/// Runs the job of `cfg` on `workload` (built by the caller from [`workload_config`] and
/// [`crate::config::batch_shape`], which then uses it for samples) with agents started as `launch` says. With `resume` (a run or checkpoint
/// directory, as `--resume` takes), the run continues from that checkpoint in its own
/// directory, on whatever nodes this job has: any plan computes the same steps.
pub fn run(
    cfg: TrainConfig,
    workload: Arc<GptWorkload>,
    launch: LaunchMode,
    resume: Option<&Path>,
    page_addr: Option<SocketAddr>,
) -> Result<Summary> {
    if cfg.nodes < 2 {
        bail!(
            "the local cluster needs --nodes 2 or more (got {})",
            cfg.nodes
        );
    }
    // A master restarted with --reattach (a standby that took over, say) starts none.
    let restarted = matches!(launch, LaunchMode::Reattach { .. });
    if cfg.standby_masters > 0 && !matches!(launch, LaunchMode::Local) && !restarted {
        bail!(
            "--standby-masters starts standbys on this machine, for a local job (--nodes); on \
             several machines run `train standby --master ADDR --copy DIR --listen IP:PORT` on \
             another machine"
        );
    }
    let mut spec = training_spec(&cfg)?;
    // A CPU device is the share of this machine's memory of one of the ranks that run here.
    let sharing = match (spec.compute, host_memory(&cfg)) {
        (Compute::Cpu, Some(memory)) => Some(Sharing {
            memory,
            ranks: host_ranks(&cfg, &launch),
            local: matches!(launch, LaunchMode::Local),
        }),
        _ => None,
    };
    spec.device_memory_bytes = sharing.as_ref().map(|s| s.memory.per_rank(s.ranks));
    let predicted_ms = first_plan_ms(&spec, &workload, sharing.as_ref())?;
    let samples_per_step = spec.global_batch_samples() as f64;
    let (out, resume, plans, reattach) = match (&launch, resume) {
        (LaunchMode::Reattach { .. }, Some(run)) => {
            let (out, reattach, plans) = super::reattach::open(&cfg, run)?;
            (out, None, plans, Some(reattach))
        }
        (LaunchMode::Reattach { .. }, None) => bail!("--reattach needs --resume RUN"),
        _ => {
            let (out, resume, plans) = open_job_dir(&cfg, resume, workload.dataset())?;
            (out, resume, plans, None)
        }
    };
    let params = workload.num_params();
    let (bind, token, launch, limits) = launch_settings(&cfg, launch)?;
    let opts = JobOptions {
        config: JobConfig {
            training: spec.clone(),
            workload: serde_json::to_value(workload_config(&cfg))?,
            watch: cfg.watch_spec(),
            save_wait_s: cfg.save_wait_s,
        },
        run_dir: out.clone(),
        resume,
        plans,
        echo: serde_json::to_value(&cfg)?,
        bind,
        token,
        launch,
        limits,
        reattach,
    };
    let start = match &opts.reattach {
        Some(r) => r.committed,
        None => opts.resume.as_ref().map_or(0, |r| r.1),
    };
    let standbys = match &opts.launch {
        master::Launch::Local { .. } => cfg.standby_masters,
        _ => 0,
    };
    let mut watch = Watch {
        standbys: LocalStandbys::new(standbys, &out),
        progress: Progress::new(cfg.steps, start),
        run: out.clone(),
        page_addr,
        page: None,
        page_line: None,
        fault_threshold: cfg.fault_threshold as u64,
        predicted_ms,
        samples_per_step,
        step_ms: Vec::new(),
        first_generation: None,
    };
    let token = opts.token.expose().to_string();
    let result = master::run_job(workload, opts, &mut watch);
    match &result {
        // A standby took over: it is the job's master now, not this one's to stop.
        Err(oobleck_core::runtime::RuntimeError::Replaced { .. }) => watch.standbys.leave(),
        Err(e @ oobleck_core::runtime::RuntimeError::StoppedTooLong { .. }) => {
            // Its agents wait for a master where this one listened: it starts again there.
            watch.page = None;
            watch.progress.finish();
            eprintln!("{e}");
            let why = format!("{e} (--reattach)");
            return Err(super::reattach::become_master(&out, None, &token, &why).unwrap_err());
        }
        _ => watch.standbys.finish(),
    }
    watch.page = None;
    watch.progress.finish();
    super::status::unpublish(&out);
    let result = result
        .map(|s| Summary {
            out: out.clone(),
            model: cfg.model.clone(),
            params,
            steps: s.steps,
            first_loss: s.first_loss,
            final_loss: s.final_loss,
            first_val_loss: None,
            final_val_loss: s.final_val_loss,
            tokens_per_s: s.tokens_per_s,
            wall_s: s.wall_s,
            checkpoint: s.checkpoint,
            report: None,
        })
        .map_err(anyhow::Error::from);
    crate::report::finish_run(&out, result)
}

/// Validates the job and its first plan (pinned sizes included) before anything is spawned
/// or written; returns the plan's predicted step time in ms. A CPU job is first checked
/// against this machine's memory ([`check_fits`]), so that nothing is measured that cannot
/// fit.
fn first_plan_ms(
    spec: &TrainingSpec,
    workload: &GptWorkload,
    sharing: Option<&Sharing>,
) -> Result<f64> {
    spec.validate()?;
    let device = spec.device_spec()?;
    let estimated = matches!(
        workload.config().profile.as_str(),
        "measured" | "analytical"
    );
    if let Some(sharing) = sharing.filter(|_| estimated) {
        let estimate = workload
            .planner_profile(&device, spec.microbatch_size, spec.precision)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let estimate = master::planned_profile(estimate, spec, workload.tokens_per_sample());
        check_fits(spec, &estimate, sharing)?;
    }
    let profile = workload
        .profile(&device, spec.microbatch_size, spec.precision)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let profile = master::planned_profile(profile, spec, workload.tokens_per_sample());
    let ids: Vec<u32> = (0..spec.nodes).collect();
    let first_plan = master::plan_for(
        spec,
        &profile,
        &ids,
        spec.fault_threshold,
        spec.pipeline_nodes.as_deref(),
    )?;
    Ok(oobleck_core::planning::profile::ns_to_ms(
        first_plan.compute_ns + first_plan.sync_ns,
    ))
}

/// A resumed job's checkpoint (absolute) and its step.
type Resumed = Option<(PathBuf, u64)>;

/// The run directory (absolute), the checkpoint a resumed job goes on from, and the plans of
/// its earlier runs (`plan.json`); metrics past the checkpoint are dropped.
fn open_job_dir(
    cfg: &TrainConfig,
    resume: Option<&Path>,
    data: &oobleck_models::data::Dataset,
) -> Result<(PathBuf, Resumed, Vec<serde_json::Value>)> {
    let (out, ckpt) = open_run(cfg, resume, data)?;
    let abs = |p: &Path| {
        p.canonicalize()
            .with_context(|| format!("resolving {}", p.display()))
    };
    let out = abs(&out)?;
    let resume = match ckpt {
        Some((ckpt, step)) => {
            if step >= cfg.steps {
                bail!(
                    "--resume {}: the checkpoint is at step {step}, and this job has --steps {}; \
                     pass a larger --steps to train further",
                    ckpt.display(),
                    cfg.steps
                );
            }
            truncate_metrics_after(&out, step)?;
            Some((abs(&ckpt)?, step))
        }
        None => None,
    };
    let plans = match std::fs::read_to_string(out.join("plan.json")) {
        Ok(text) if resume.is_some() => serde_json::from_str(&text).with_context(|| {
            format!(
                "{}: expected an array of plans, one per generation",
                out.join("plan.json").display()
            )
        })?,
        _ => Vec::new(),
    };
    Ok((out, resume, plans))
}

/// Where the master listens, its token, how its agents start, and its limits.
fn launch_settings(
    cfg: &TrainConfig,
    launch: LaunchMode,
) -> Result<(SocketAddr, Token, master::Launch, Limits)> {
    // Agents started by hand may take a while to come up.
    let ours = Limits {
        lease: Duration::from_millis(cfg.lease_ms),
        join_after: Duration::from_secs_f64(cfg.join_after_s),
        ..Limits::default()
    };
    let limits = match launch {
        LaunchMode::Listen { .. } | LaunchMode::Scheduled { .. } => Limits {
            join: Duration::from_secs(600),
            ..ours
        },
        // The agents look for a master for their --master-wait after they lost it.
        LaunchMode::Reattach { .. } => Limits {
            join: Duration::from_secs(cfg.master_wait_s + 10),
            ..ours
        },
        _ => ours,
    };
    let (bind, token, launch) = match launch {
        LaunchMode::Local => (
            "127.0.0.1:0".parse().context("master address")?,
            Token::random(),
            master::Launch::Local {
                exe: hostfile::agent_binary()?,
                master_wait: Duration::from_secs(cfg.master_wait_s),
            },
        ),
        LaunchMode::Listen { addr, token } | LaunchMode::Reattach { addr, token } => {
            (addr, token, master::Launch::Listen)
        }
        LaunchMode::Hostfile { addr, token, hosts } => {
            let secret = token.expose().to_string();
            (
                addr,
                token,
                master::Launch::Custom(ssh_launcher(hosts, secret, cfg.master_wait_s)),
            )
        }
        LaunchMode::Scheduled { addr, token, own } => {
            let own = own_agent(own, token.clone(), Duration::from_secs(cfg.master_wait_s));
            (addr, token, master::Launch::Custom(own))
        }
    };
    Ok((bind, token, launch, limits))
}

/// Starts this node's own agent (node 0 of a scheduled job) once the master listens: a child
/// of `train`, as a local cluster's agents are, pointed at `own`.
fn own_agent(own: SocketAddr, token: Token, master_wait: Duration) -> master::LaunchFn {
    Box::new(move |_listening: SocketAddr| {
        Box::pin(async move {
            let exe = hostfile::agent_binary()
                .map_err(|e| format!("{e:#}"))
                .ctx("locating this binary for node 0's agent")?;
            let mut child =
                oobleck_core::runtime::agent_command(&exe, own, &token, 120, master_wait)
                    .spawn()
                    .map_err(|e| format!("{e}"))
                    .ctx("starting node 0's agent")?;
            let stdin = child.stdin.take();
            Ok(vec![Started {
                child,
                stdin,
                host: None,
            }])
        })
    })
}

/// Starts one agent per host over ssh once the master listens, and passes on whatever each
/// prints on stdout so its pipe never fills.
fn ssh_launcher(hosts: Vec<HostEntry>, token: String, master_wait_s: u64) -> master::LaunchFn {
    Box::new(move |addr: SocketAddr| {
        Box::pin(async move {
            let addr = addr.to_string();
            eprintln!(
                "master listening on {addr}; starting {} agents over ssh",
                hosts.len()
            );
            let at = hostfile::MasterAt {
                addr: &addr,
                wait_s: master_wait_s,
            };
            let launched = hostfile::launch(&hosts, at, &token, SSH_TIMEOUT)
                .await
                .map_err(|e| format!("{e:#}"))
                .ctx("starting the agents over ssh")?;
            let mut started = Vec::with_capacity(launched.len());
            for l in launched {
                let host = l.entry.to_string();
                let mut lines = BufReader::new(l.stdout).lines();
                let tag = host.clone();
                tokio::spawn(async move {
                    while let Ok(Some(line)) = lines.next_line().await {
                        eprintln!("[{tag}] {line}");
                    }
                });
                started.push(Started {
                    child: l.child,
                    stdin: Some(l.stdin),
                    host: Some(host),
                });
            }
            Ok(started)
        })
    })
}

/// What `train` shows of a running job: the progress line, the plan, the status files and
/// the live status page.
struct Watch {
    /// A local job's standby masters (`--standby-masters`).
    standbys: LocalStandbys,
    progress: Progress,
    run: PathBuf,
    /// Where to serve the page (`None`: `--status-addr off`).
    page_addr: Option<SocketAddr>,
    page: Option<StatusPage>,
    /// Where the page is, said after the next note.
    page_line: Option<String>,
    fault_threshold: u64,
    /// The planner's iteration time of the first plan (slowest pipeline + exposed sync).
    predicted_ms: f64,
    samples_per_step: f64,
    /// Measured step times of the first plan's generation, ms.
    step_ms: Vec<f64>,
    first_generation: Option<u64>,
}

impl Watch {
    fn say_page(&mut self) {
        if let Some(l) = self.page_line.take() {
            self.progress.note(&l);
        }
    }

    /// Starts the page for the master at `addr` and says where it is.
    fn serve_page(&mut self, at: SocketAddr, addr: SocketAddr, token: &Token) -> Result<String> {
        let page = StatusPage::start(at, self.run.clone(), addr, token, self.fault_threshold)?;
        let line = if page.addr().ip().is_loopback() {
            format!(
                "status page: {} (to kill or drain nodes from it, open {} once)",
                page.url(),
                page.login_link()
            )
        } else {
            format!(
                "status page: {} (a one-time link; or send the job token as `Authorization: \
                 Bearer`)",
                page.login_link()
            )
        };
        // Said after the job's first line (what it trains), which follows.
        self.page_line = Some(line);
        let url = page.url();
        self.page = Some(page);
        Ok(url)
    }
}

impl Observer for Watch {
    fn listening(&mut self, addr: SocketAddr, token: &Token) -> oobleck_core::runtime::Result<()> {
        let url = match self.page_addr {
            Some(at) => Some(
                self.serve_page(at, addr, token)
                    .map_err(|e| format!("{e:#}"))
                    .ctx("starting the status page")?,
            ),
            None => None,
        };
        super::status::publish(&self.run, addr, token, url.as_deref())
            .map_err(|e| format!("{e:#}"))
            .ctx("publishing the status files")?;
        let said = self
            .standbys
            .start(addr, token)
            .map_err(|e| format!("{e:#}"))
            .ctx("starting the standby masters")?;
        for line in said {
            self.progress.note(&line);
        }
        Ok(())
    }

    fn plan(&mut self, status: &ClusterStatus) {
        self.say_page();
        self.progress.note(&super::status::render_plan(status));
    }

    fn step(&mut self, m: &StepMetrics, total: u64) {
        self.progress.step(m, total);
        let first = *self.first_generation.get_or_insert(m.generation);
        if m.samples_per_s > 0.0 && m.generation == first {
            self.step_ms
                .push(1e3 * self.samples_per_step / m.samples_per_s);
        }
        if m.step == total && !self.step_ms.is_empty() {
            self.progress
                .note(&step_time_line(&self.step_ms, self.predicted_ms));
        }
    }

    fn note(&mut self, line: &str) {
        self.progress.note(line);
        self.say_page();
    }
}

/// `step time: measured 412 ms (median of 9 steps after the first), planner predicted 398 ms
/// (+3.5%)`. The first step (warm-up: allocations, first messages) is left out when there are
/// more.
fn step_time_line(step_ms: &[f64], predicted_ms: f64) -> String {
    let mut v: Vec<f64> = step_ms
        .iter()
        .skip(usize::from(step_ms.len() > 1))
        .copied()
        .collect();
    let measured = oobleck_core::profiler::median(&mut v);
    format!(
        "step time: measured {measured:.0} ms (median of {} steps of the first plan), planner \
         predicted {predicted_ms:.0} ms ({:+.1}%)",
        v.len(),
        100.0 * (measured - predicted_ms) / predicted_ms.max(1e-9)
    )
}
