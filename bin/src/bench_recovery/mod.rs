//! `oobleck bench recovery`: the same training job three ways, side by side in one run.
//!
//! 1. **fault-free**: no failure;
//! 2. **in place**: `--inject-failure` every `--fail-every` steps, a different node each time,
//!    with `f >= 1`: the survivors keep running and the layers a new pipeline lacks are copied
//!    from surviving replicas (Oobleck's recovery);
//! 3. **checkpoint restart** (the Varuna-style baseline): the same failures with `f = 0`, so
//!    each one ends the job, which is started again with `--resume` on the nodes left, from its
//!    newest checkpoint, computing again the steps since.
//!
//! ```text
//!  FailurePlan (pure) ─► train (fault-free) ─┐
//!                     ─► train (in place) ───┼─► records ─► summary (pure) ─► table / --json
//!                     ─► train ─► train --resume ─► ... (checkpoint restart)
//! ```
//!
//! Each run is the `train` binary beside this one, as child processes in a scratch directory
//! (`child`): its own process group, every wait bounded by `--timeout-s`, killed on drop and on
//! Ctrl-C. The numbers come from each run directory's `events.jsonl` and `metrics.jsonl`
//! (`records`), wall times from the bench's own clock around each process (so they include
//! process start, model build, checkpoint load and the final checkpoint).
//!
//! Failures land `--fail-offset` steps after a multiple of `--fail-every` (defaults: after steps
//! 60 and 100, half-way between the checkpoints of `--checkpoint-every 40`: the expected loss of
//! a failure at a random time). Nodes are killed from the highest id down and at most
//! `nodes - (f + 1)` of them, so that f + 1 pipelines always fit on the nodes left. The restart
//! run pins each restarted job's pipelines to the shapes the in-place run recovered to, so the
//! two compare the same pipelines.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

mod child;
mod records;
mod summary;
mod table;

use child::{tail, Reaper, Scratch, TrainProcess};
use records::{parse_events, parse_metrics, Event};
use summary::{checks, compare, summarize, Check, Job, RunInput, RunKind, RunSummary, Segment};

/// Compare recovery in place with a fault-free run and with checkpoint restart, same job.
#[derive(clap::Args, Clone, Debug)]
pub struct BenchRecoveryArgs {
    /// Model preset (see `oobleck models`); gpt-mini: 7.2M parameters, ~86 MB with AdamW state.
    #[arg(long, default_value = "gpt-mini")]
    pub model: String,
    /// Tokens per sample (short, so that a step takes about a second on 2 cores).
    #[arg(long, default_value_t = 32)]
    pub seq_len: usize,
    #[arg(long, default_value_t = 2)]
    pub microbatch_size: usize,
    /// Samples per step.
    #[arg(long, default_value_t = 8)]
    pub global_batch_size: usize,
    /// Steps of the job.
    #[arg(long, default_value_t = 120)]
    pub steps: u64,
    #[arg(long, default_value_t = 4)]
    pub nodes: usize,
    /// f of the fault-free and in-place runs (the restart run has 0).
    #[arg(long, default_value_t = 1)]
    pub fault_threshold: usize,
    /// Pipeline sizes in nodes [default: f + 1 pipelines as even as the nodes allow].
    #[arg(long, value_delimiter = ',')]
    pub pipeline_nodes: Option<Vec<usize>>,
    /// A failure every this many steps.
    #[arg(long, default_value_t = 40)]
    pub fail_every: u64,
    /// The first failure after step fail_every + fail_offset.
    #[arg(long, default_value_t = 20)]
    pub fail_offset: u64,
    /// At most this many failures [default: as many as fit, at most nodes - (f + 1)].
    #[arg(long)]
    pub failures: Option<usize>,
    #[arg(long, default_value_t = 40)]
    pub checkpoint_every: u64,
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// One more flag for every `train` (repeatable), e.g. `--train-arg=--lr=1e-3`.
    #[arg(long, allow_hyphen_values = true)]
    pub train_arg: Vec<String>,
    /// The `train` binary [default: the one beside this `oobleck`].
    #[arg(long)]
    pub train_bin: Option<PathBuf>,
    /// Bound of each `train` process, seconds.
    #[arg(long, default_value_t = 900)]
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

/// Who is killed when, and the pipelines each job starts with (pure, from the flags).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FailurePlan {
    /// `(node, step)`: `node` dies after `step` commits.
    pub failures: Vec<(usize, u64)>,
    /// Pipeline sizes in nodes of the first job.
    pub pins: Vec<usize>,
}

impl FailurePlan {
    pub fn new(a: &BenchRecoveryArgs) -> Result<FailurePlan> {
        let f = a.fault_threshold;
        if f == 0 {
            bail!("recovery in place needs --fault-threshold 1 or more");
        }
        if a.nodes < f + 2 {
            bail!(
                "--nodes {} leaves no node to lose with f = {f}: at least f + 1 pipelines must \
                 fit on the nodes left; pass --nodes {} or more",
                a.nodes,
                f + 2
            );
        }
        let pins = match &a.pipeline_nodes {
            Some(p) => p.clone(),
            None => even_split(a.nodes, f + 1),
        };
        if pins.iter().sum::<usize>() != a.nodes || pins.contains(&0) || pins.len() < f + 1 {
            bail!(
                "--pipeline-nodes {pins:?}: need at least f + 1 = {} pipelines of 1+ nodes \
                 adding up to --nodes {}",
                f + 1,
                a.nodes
            );
        }
        let most = a.nodes - (f + 1);
        if let Some(n) = a.failures.filter(|&n| n > most || n == 0) {
            bail!("--failures {n}: between 1 and nodes - (f + 1) = {most}");
        }
        if a.fail_every == 0 {
            bail!("--fail-every must be at least 1");
        }
        let failures: Vec<(usize, u64)> = (1..)
            .map(|k| k * a.fail_every + a.fail_offset)
            .take_while(|&s| s < a.steps)
            .take(a.failures.unwrap_or(most))
            .enumerate()
            .map(|(i, s)| (a.nodes - 1 - i, s))
            .collect();
        if failures.is_empty() {
            bail!(
                "no failure fits in --steps {}: the first would be after step {}",
                a.steps,
                a.fail_every + a.fail_offset
            );
        }
        Ok(FailurePlan { failures, pins })
    }
}

/// `nodes` into `parts` sizes as even as possible, larger first.
fn even_split(nodes: usize, parts: usize) -> Vec<usize> {
    (0..parts)
        .map(|i| nodes / parts + usize::from(i < nodes % parts))
        .collect()
}

/// One node fewer: taken from the last of the largest pipelines (dropped if it empties).
fn shrink(pins: &[usize]) -> Vec<usize> {
    let mut p = pins.to_vec();
    if let Some(max) = p.iter().copied().max() {
        if let Some(i) = p.iter().rposition(|&x| x == max) {
            p[i] -= 1;
        }
    }
    p.retain(|&x| x > 0);
    p
}

/// Pipeline sizes of each job of the restart run: those the in-place run recovered to after
/// each failure, where it did, else [`shrink`].
fn restart_shapes(plan: &FailurePlan, in_place: &RunInput) -> Vec<Vec<usize>> {
    let recovered: Vec<Vec<usize>> = in_place
        .segments
        .iter()
        .flat_map(|s| &s.events)
        .filter_map(|e| match e {
            Event::Reconfig { new_pipelines, .. } => {
                Some(new_pipelines.iter().map(Vec::len).collect())
            }
            _ => None,
        })
        .collect();
    let mut shapes = vec![plan.pins.clone()];
    for k in 0..plan.failures.len() {
        let want = shapes[k].iter().sum::<usize>() - 1;
        let next = match recovered.get(k) {
            Some(r) if r.iter().sum::<usize>() == want => r.clone(),
            _ => shrink(&shapes[k]),
        };
        shapes.push(next);
    }
    shapes
}

/// Everything the bench measured; the `--json` output.
#[derive(Debug, Serialize)]
pub struct Report {
    pub model: String,
    pub nodes: usize,
    pub fault_threshold: usize,
    /// Cores of this machine (the workers of all nodes share them).
    pub cores: usize,
    pub job: Job,
    pub plan: FailurePlan,
    pub failure_note: String,
    pub runs: Vec<RunSummary>,
    pub checks: Vec<Check>,
    /// The `train` command lines of each run, in order.
    pub commands: Vec<String>,
}

/// The `train` beside the running binary, or `--train-bin`.
fn train_binary(given: Option<&Path>) -> Result<PathBuf> {
    let path = match given {
        Some(p) => p.to_path_buf(),
        None => std::env::current_exe()
            .context("locating the running binary")?
            .with_file_name("train"),
    };
    if !path.is_file() {
        bail!(
            "{} not found: build it with `cargo build --release -p oobleck-cli` or pass \
             --train-bin",
            path.display()
        );
    }
    Ok(path)
}

/// Where a `train` writes: a new run directory, or one it resumes.
enum Out<'a> {
    Fresh(&'a Path),
    Resume(&'a Path),
}

/// Runs the three jobs and prints the table.
pub fn run(a: &BenchRecoveryArgs) -> Result<()> {
    let plan = FailurePlan::new(a)?;
    let bench = Bench {
        a,
        bin: train_binary(a.train_bin.as_deref())?,
        reaper: Reaper::install()?,
        scratch: Scratch::create(a.scratch.as_deref(), a.keep)?,
        commands: Default::default(),
    };
    let t0 = Instant::now();
    let ff = bench.single(RunKind::FaultFree, "fault-free", &plan, &[]);
    let ip = bench.single(RunKind::InPlace, "in-place", &plan, &plan.failures);
    let rs = bench.restart(&plan, &restart_shapes(&plan, &ip));
    let report = bench.report(&plan, [ff, ip, rs]);
    println!("{}", table::render(&report));
    if let Some(path) = &a.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    let mut scratch = bench.scratch;
    let failed: Vec<&str> = report
        .runs
        .iter()
        .filter(|r| !r.ok)
        .map(|r| r.kind.label())
        .collect();
    if !failed.is_empty() {
        scratch.keep();
    }
    if scratch.kept() {
        eprintln!("run directories kept in {}", scratch.root.display());
    }
    eprintln!("bench recovery: {:.0} s in all", t0.elapsed().as_secs_f64());
    if !failed.is_empty() {
        bail!(
            "the {} run(s) failed (see the table's notes)",
            failed.join(", ")
        );
    }
    Ok(())
}

struct Bench<'a> {
    a: &'a BenchRecoveryArgs,
    bin: PathBuf,
    reaper: Reaper,
    scratch: Scratch,
    commands: std::cell::RefCell<Vec<String>>,
}

impl Bench<'_> {
    /// The flags of one `train`.
    fn train_args(
        &self,
        out: Out,
        f: usize,
        pins: &[usize],
        kills: &[(usize, u64)],
    ) -> Vec<String> {
        let a = self.a;
        let mut v: Vec<String> = vec![];
        let mut flag = |k: &str, val: String| v.extend([format!("--{k}"), val]);
        flag("model", a.model.clone());
        flag("seq-len", a.seq_len.to_string());
        flag("microbatch-size", a.microbatch_size.to_string());
        flag("global-batch-size", a.global_batch_size.to_string());
        flag("steps", a.steps.to_string());
        flag("seed", a.seed.to_string());
        flag("checkpoint-every", a.checkpoint_every.to_string());
        flag("eval-every", "0".into());
        flag("sample", "0".into());
        flag("nodes", pins.iter().sum::<usize>().to_string());
        flag("fault-threshold", f.to_string());
        let pins: Vec<String> = pins.iter().map(usize::to_string).collect();
        flag("pipeline-nodes", pins.join(","));
        for (node, step) in kills {
            flag("inject-failure", format!("{node}@{step}"));
        }
        match out {
            Out::Fresh(d) => flag("out", d.display().to_string()),
            Out::Resume(d) => flag("resume", d.display().to_string()),
        }
        v.extend(a.train_arg.iter().cloned());
        v
    }

    /// One `train` to its exit: its records, and what went wrong if it did (a timeout, or a
    /// nonzero exit with the end of its stderr).
    fn segment(
        &self,
        dir: &Path,
        args: &[String],
        log: &str,
        gap_s: f64,
    ) -> Result<(Segment, Option<String>)> {
        let events_path = dir.join("events.jsonl");
        let offset = std::fs::metadata(&events_path).map_or(0, |m| m.len() as usize);
        let cmd = format!("{} {}", self.bin.display(), args.join(" "));
        eprintln!("bench recovery: {cmd}");
        self.commands.borrow_mut().push(cmd);
        let log = self.scratch.root.join(log);
        let load_1m = load_average();
        let child = TrainProcess::spawn(&self.reaper, &self.bin, args, &log)?;
        let (wall_s, problem, how) = match child.wait(Duration::from_secs(self.a.timeout_s)) {
            Ok(exit) if exit.status.success() => (exit.wall_s, None, "finished".to_string()),
            Ok(exit) => {
                let err = tail(&log.with_extension("stderr"), 3).replace('\n', " / ");
                let how = format!("exited with {}", exit.status);
                (exit.wall_s, Some(format!("train {how}: {err}")), how)
            }
            Err(e) => (
                self.a.timeout_s as f64,
                Some(format!("{e:#}")),
                "timed out".into(),
            ),
        };
        eprintln!("bench recovery: {wall_s:.1} s, {how}");
        let events = std::fs::read(&events_path).unwrap_or_default();
        let events = String::from_utf8_lossy(events.get(offset..).unwrap_or_default());
        let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap_or_default();
        let seg = Segment {
            wall_s,
            gap_s,
            events: parse_events(&events)?,
            metrics: parse_metrics(&metrics)?,
            load_1m,
        };
        Ok((seg, problem))
    }

    /// The fault-free or the in-place run: one job.
    fn single(
        &self,
        kind: RunKind,
        slug: &str,
        plan: &FailurePlan,
        kills: &[(usize, u64)],
    ) -> RunInput {
        let dir = self.scratch.root.join(slug);
        let args = self.train_args(Out::Fresh(&dir), self.a.fault_threshold, &plan.pins, kills);
        match self.segment(&dir, &args, slug, 0.0) {
            Ok((seg, error)) => RunInput {
                kind,
                segments: vec![seg],
                error: error.map(|e| format!("{slug}: {e}")),
            },
            Err(e) => RunInput {
                kind,
                segments: vec![],
                error: Some(format!("{slug}: {e:#}")),
            },
        }
    }

    /// The checkpoint-restart run: a job per failure plus the last, each from the newest
    /// checkpoint of the one before (or from scratch where it had none).
    fn restart(&self, plan: &FailurePlan, shapes: &[Vec<usize>]) -> RunInput {
        let mut segments = Vec::new();
        let mut error = None;
        let mut dir = self.scratch.root.join("restart");
        let mut fresh = true;
        let mut exited: Option<Instant> = None;
        for (k, pins) in shapes.iter().enumerate() {
            let expect = plan
                .failures
                .get(k)
                .map(|&(_, step)| (pins.iter().sum::<usize>() - 1, step));
            // A resumed job keeps its saved --inject-failure unless given one, and `train`
            // takes only steps inside the run: step 1, long committed, never fires again.
            let kills = match (expect, fresh) {
                (Some(kill), _) => vec![kill],
                (None, true) => vec![],
                (None, false) => vec![(0, 1)],
            };
            let out = if fresh {
                Out::Fresh(&dir)
            } else {
                Out::Resume(&dir)
            };
            let args = self.train_args(out, 0, pins, &kills);
            let gap = exited.map_or(0.0, |t| t.elapsed().as_secs_f64());
            let log = format!("restart-{k}");
            let result = self.segment(&dir, &args, &log, gap);
            exited = Some(Instant::now());
            let (seg, problem) = match result {
                Ok(r) => r,
                Err(e) => {
                    error = Some(format!("job {k}: {e:#}"));
                    break;
                }
            };
            let killed = seg.events.iter().any(|e| matches!(e, Event::InjectFailure { step, .. } if Some(*step) == expect.map(|x| x.1)));
            segments.push(seg);
            match (expect, problem) {
                (None, None) => {}
                (Some(_), Some(_)) if killed => {}
                (Some((_, step)), p) => {
                    error = Some(format!(
                        "job {k}: expected the failure after step {step} to stop the job; {}",
                        p.unwrap_or_else(|| "it finished".into())
                    ));
                    break;
                }
                (None, Some(p)) => {
                    error = Some(format!("job {k}: {p}"));
                    break;
                }
            }
            if expect.is_some() && !has_checkpoint(&dir) {
                dir = self
                    .scratch
                    .root
                    .join(format!("restart-from-scratch-{}", k + 1));
                fresh = true;
            } else {
                fresh = false;
            }
        }
        RunInput {
            kind: RunKind::CheckpointRestart,
            segments,
            error,
        }
    }

    /// The numbers of the three runs.
    fn report(&self, plan: &FailurePlan, inputs: [RunInput; 3]) -> Report {
        let a = self.a;
        let job = Job {
            steps: a.steps,
            tokens_per_step: (a.global_batch_size * a.seq_len) as u64,
            failures: plan.failures.len(),
        };
        let mut runs: Vec<RunSummary> = inputs.iter().map(|i| summarize(i, &job)).collect();
        compare(&mut runs);
        let checks = checks(&runs[0], &runs[1]);
        let kills: Vec<String> = plan
            .failures
            .iter()
            .map(|(n, s)| format!("node {n} after step {s}"))
            .collect();
        Report {
            model: a.model.clone(),
            nodes: a.nodes,
            fault_threshold: a.fault_threshold,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            job,
            plan: plan.clone(),
            failure_note: format!(
                "pipelines {:?}; failures: {} (in the restart run, the highest node of the nodes left each time); checkpoint every {} steps",
                plan.pins,
                kills.join(", "),
                a.checkpoint_every
            ),
            runs,
            checks,
            commands: self.commands.borrow().clone(),
        }
    }
}

/// The 1-minute load average (Linux), if readable.
fn load_average() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

fn has_checkpoint(dir: &Path) -> bool {
    matches!(
        oobleck_core::checkpoint::latest_checkpoint(dir),
        Ok(Some(_))
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: BenchRecoveryArgs,
    }

    fn args(extra: &[&str]) -> BenchRecoveryArgs {
        Cli::parse_from(std::iter::once("bench").chain(extra.iter().copied())).a
    }

    #[test]
    fn defaults_kill_two_nodes_between_checkpoints() {
        let p = FailurePlan::new(&args(&[])).unwrap();
        assert_eq!(p.pins, vec![2, 2]);
        assert_eq!(p.failures, vec![(3, 60), (2, 100)]);
    }

    #[test]
    fn more_failures_than_the_tolerance_allows_are_refused() {
        let e = FailurePlan::new(&args(&["--failures", "3"])).unwrap_err();
        assert!(e.to_string().contains("nodes - (f + 1) = 2"), "{e}");
        assert!(FailurePlan::new(&args(&["--fault-threshold", "0"])).is_err());
        assert!(FailurePlan::new(&args(&["--steps", "50"])).is_err());
    }

    #[test]
    fn shrinking_takes_from_the_last_largest_pipeline() {
        assert_eq!(shrink(&[2, 2]), vec![2, 1]);
        assert_eq!(shrink(&[2, 1]), vec![1, 1]);
        assert_eq!(shrink(&[1, 1]), vec![1]);
        assert_eq!(even_split(5, 2), vec![3, 2]);
    }
}
