//! `oobleck bench status-flood`: what a flood of `/api/status` requests costs a training job
//! on the same machine, side by side in one run.
//!
//! The same small job (`train`, a local cluster of `--nodes`) runs twice: **quiet**, with
//! nobody asking its status page, and **flood**, with `--clients` threads asking its
//! `/api/status` back to back for `--flood-s` seconds (a fresh connection each time, never
//! heeding `Retry-After`). Each phase's window opens once `--after-step` committed (past the
//! start) and closes `--flood-s` seconds later; its tokens/s are the steps committed in the
//! window, timed by the job's own clock. The cost is the flood phase's loss of tokens/s, in
//! percent of the quiet phase's. Target: under 10 %.
//!
//! ```text
//!  train (quiet) ──metrics.jsonl──► window ─┐
//!  train (flood) ──metrics.jsonl──► window ─┼─► table (pure) ─► stdout / --json
//!     ▲ status page ◄── flood (client threads) ─ answers ─┘
//! ```
//!
//! The flood's client threads run on the same cores as the job: they are a part of what a
//! flood costs, as they would be for a script looping on the machine.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use oobleck_core::runtime::wire::records::StepMetrics;

mod flood;
mod table;

use crate::bench::child::{binary, tail, Reaper, Scratch, TrainProcess};
use crate::status_page::feed::Tail;
use flood::{Answers, Flood};
use table::{cost_pct, render, window, Phase, Report};

/// Time a small job alone and beside a flood of `/api/status` requests to its status page.
#[derive(clap::Args, Clone, Debug)]
pub struct BenchStatusFloodArgs {
    /// Model preset (see `oobleck models`); gpt-tiny steps several times a second on 2 cores.
    #[arg(long, default_value = "gpt-tiny")]
    pub model: String,
    #[arg(long, default_value_t = 2)]
    pub nodes: usize,
    /// Steps of each job: enough to outlast --after-step and --flood-s (about 40 s of gpt-tiny
    /// on 2 cores).
    #[arg(long, default_value_t = 240)]
    pub steps: u64,
    /// The window opens once this step committed (past process start and the first plan).
    #[arg(long, default_value_t = 20)]
    pub after_step: u64,
    /// How long the window (and the flood) lasts, seconds.
    #[arg(long, default_value_t = 20)]
    pub flood_s: u64,
    /// Client threads of the flood.
    #[arg(long, default_value_t = 4)]
    pub clients: usize,
    /// One more flag for every `train` (repeatable), e.g. `--train-arg=--seq-len=32`.
    #[arg(long, allow_hyphen_values = true)]
    pub train_arg: Vec<String>,
    /// The `train` binary [default: the one beside this `oobleck`].
    #[arg(long)]
    pub train_bin: Option<PathBuf>,
    /// Bound of each `train` process, seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_s: u64,
    /// Where the scratch directory goes [default: the system temp directory].
    #[arg(long)]
    pub scratch: Option<PathBuf>,
    /// Keep the run directories (they are kept anyway when a run fails).
    #[arg(long)]
    pub keep: bool,
    /// Also write the numbers as JSON to FILE.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Runs both phases and prints the table.
pub fn run(a: &BenchStatusFloodArgs) -> Result<()> {
    if a.after_step >= a.steps {
        bail!(
            "--after-step {} must be below --steps {}",
            a.after_step,
            a.steps
        );
    }
    let bin = binary("train", a.train_bin.as_deref())?;
    let reaper = Reaper::install()?;
    let mut scratch = Scratch::create("status-flood", a.scratch.as_deref(), a.keep)?;
    let mut commands = Vec::new();
    let mut tokens_per_step = 0;
    let mut phases = Vec::new();
    for name in ["quiet", "flood"] {
        let dir = scratch.root.join(name);
        let args = train_args(a, &dir);
        let cmd = format!("{} {}", bin.display(), args.join(" "));
        eprintln!("bench status-flood: {cmd}");
        commands.push(cmd);
        let (phase, tps) = run_phase(a, name, &bin, &args, &dir, &reaper, &scratch.root);
        tokens_per_step = tokens_per_step.max(tps);
        phases.push(phase);
    }
    let flood = phases.pop().expect("two phases ran");
    let quiet = phases.pop().expect("two phases ran");
    let report = Report {
        model: a.model.clone(),
        nodes: a.nodes,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        tokens_per_step,
        clients: a.clients,
        flood_s: a.flood_s,
        after_step: a.after_step,
        cost_pct: cost_pct(&quiet, &flood),
        quiet,
        flood,
        commands,
    };
    print!("{}", render(&report));
    if let Some(path) = &a.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    let failed = report.quiet.error.is_some() || report.flood.error.is_some();
    if failed {
        scratch.keep();
    }
    if scratch.kept() {
        eprintln!("run directories kept in {}", scratch.root.display());
    }
    if failed {
        bail!("a phase failed (see the lines under the table)");
    }
    Ok(())
}

/// The flags of one `train`.
fn train_args(a: &BenchStatusFloodArgs, dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = vec![];
    let mut flag = |k: &str, val: String| v.extend([format!("--{k}"), val]);
    flag("model", a.model.clone());
    flag("nodes", a.nodes.to_string());
    flag("steps", a.steps.to_string());
    // Nothing but steps in the window: no checkpoint but the last, no evaluation, no samples.
    flag("checkpoint-every", "0".into());
    flag("eval-every", "0".into());
    flag("sample", "0".into());
    flag("status-addr", "127.0.0.1:0".into());
    flag("out", dir.display().to_string());
    v.extend(a.train_arg.iter().cloned());
    v
}

/// One phase to the job's exit: its numbers, and the tokens a step of its job.
fn run_phase(
    a: &BenchStatusFloodArgs,
    name: &'static str,
    bin: &Path,
    args: &[String],
    dir: &Path,
    reaper: &Reaper,
    logs: &Path,
) -> (Phase, u64) {
    let mut watch = Watch::new(a, name == "flood", dir);
    let log = logs.join(name);
    let exit = TrainProcess::spawn(reaper, bin, args, &log)
        .and_then(|child| child.wait_with(Duration::from_secs(a.timeout_s), || watch.tick()));
    watch.finish();
    let mut error = watch.error.take();
    match exit {
        Ok(e) if e.status.success() => {}
        Ok(e) => {
            let err = tail(&log.with_extension("stderr"), 3).replace('\n', " / ");
            error.get_or_insert(format!("train exited with {}: {err}", e.status));
        }
        Err(e) => {
            error.get_or_insert(format!("{e:#}"));
        }
    }
    let metrics = read_metrics(dir);
    let tokens_per_step = tokens_per_step(dir).unwrap_or(0);
    let window = watch
        .window
        .and_then(|(first, last)| window(&metrics, first, last, tokens_per_step));
    if window.is_none() && error.is_none() {
        error = Some(format!(
            "no window of steps: did step {} commit? (see {})",
            a.after_step,
            log.with_extension("stderr").display()
        ));
    }
    let phase = Phase {
        name,
        window,
        answers: watch.answers,
        load_1m: watch.load_1m,
        error,
    };
    (phase, tokens_per_step)
}

/// The phase as it goes, looked at between checks on the child: waits for `--after-step`,
/// opens the window (starting the flood), closes it `--flood-s` later.
struct Watch {
    after_step: u64,
    length: Duration,
    clients: usize,
    flooding: bool,
    dir: PathBuf,
    metrics: Tail,
    newest: u64,
    last_look: Option<Instant>,
    opened: Option<(Instant, u64)>,
    flood: Option<Flood>,
    /// `(first, last]` once closed.
    window: Option<(u64, u64)>,
    answers: Option<Answers>,
    load_1m: Option<f64>,
    error: Option<String>,
}

/// How often the watch reads the metrics file.
const LOOK_EVERY: Duration = Duration::from_millis(100);

impl Watch {
    fn new(a: &BenchStatusFloodArgs, flooding: bool, dir: &Path) -> Watch {
        Watch {
            after_step: a.after_step,
            length: Duration::from_secs(a.flood_s),
            clients: a.clients,
            flooding,
            dir: dir.to_path_buf(),
            metrics: Tail::new(dir.join("metrics.jsonl")),
            newest: 0,
            last_look: None,
            opened: None,
            flood: None,
            window: None,
            answers: None,
            load_1m: None,
            error: None,
        }
    }

    fn tick(&mut self) {
        if self.window.is_some() || self.last_look.is_some_and(|t| t.elapsed() < LOOK_EVERY) {
            return;
        }
        self.last_look = Some(Instant::now());
        if let Ok((lines, _)) = self.metrics.read_new() {
            for l in lines {
                if let Ok(m) = serde_json::from_str::<StepMetrics>(&l) {
                    self.newest = self.newest.max(m.step);
                }
            }
        }
        match self.opened {
            None if self.newest >= self.after_step => self.open(),
            Some((at, first)) if at.elapsed() >= self.length => self.close(first),
            _ => {}
        }
    }

    fn open(&mut self) {
        self.load_1m = load_average();
        self.opened = Some((Instant::now(), self.newest));
        if !self.flooding {
            return;
        }
        match page_addr(&self.dir).and_then(|addr| {
            Flood::start(addr, self.clients).context("starting the flood's threads")
        }) {
            Ok(f) => self.flood = Some(f),
            Err(e) => self.error = Some(format!("{e:#}")),
        }
    }

    /// After the job's exit: a window still open closes on the last step, with a note.
    fn finish(&mut self) {
        self.last_look = None;
        self.tick();
        if let (None, Some((_, first))) = (self.window, self.opened) {
            self.close(first);
            self.error.get_or_insert(format!(
                "the job ended before {} s had passed since step {first}: raise --steps",
                self.length.as_secs()
            ));
        }
    }

    fn close(&mut self, first: u64) {
        self.window = Some((first, self.newest));
        self.answers = self.flood.take().map(Flood::stop);
    }
}

/// The status page's address, from the `status_url` the job writes in its `master.json`.
fn page_addr(dir: &Path) -> Result<std::net::SocketAddr> {
    let file = dir.join(crate::cluster::status::MASTER_FILE);
    let text =
        std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", file.display()))?;
    let Some(url) = v["status_url"].as_str() else {
        bail!("{} names no status page (status_url)", file.display());
    };
    crate::status_page::client::page_addr(url)
}

fn read_metrics(dir: &Path) -> Vec<StepMetrics> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// `seq_len x global_batch_size` of the job's resolved `config.json`.
fn tokens_per_step(dir: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    Some(v["seq_len"].as_u64()? * v["global_batch_size"].as_u64()?)
}

/// The 1-minute load average (Linux), if readable.
fn load_average() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    text.split_whitespace().next()?.parse().ok()
}
