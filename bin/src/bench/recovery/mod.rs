//! `oobleck bench recovery`: the same training job three ways, side by side in one run, and
//! four more runs of it that each time one kind of disruption.
//!
//! 1. **fault-free**: no failure;
//! 2. **in place**: `--inject-failure` every `--fail-every` steps, a different node each time,
//!    with `f >= 1`: the survivors keep running and the layers a new pipeline lacks are copied
//!    from surviving replicas (Oobleck's recovery);
//! 3. **checkpoint restart** (the Varuna-style baseline): the same failures with `f = 0`, so
//!    each one ends the job, which is started again with `--resume` on the nodes left, from its
//!    newest checkpoint, computing again the steps since;
//! 4. **drain + join** (`membership`, skipped with `--no-membership`): no failure; the bench
//!    drains the highest node from outside (`oobleck drain`) after 3/8 of the steps and adds
//!    one (`oobleck add-node`) after 17/24, each taken at a step boundary with no step replayed.
//!    Its reconfigurations get a table of their own beside the failures' phases, with targets:
//!    a drain costs under 1 s, a join under 1.5 s (`membership` says precisely what a cost is).
//! 5. **hang** (skipped with `--no-hang`): no failure; the bench stops one worker process with
//!    SIGSTOP half-way through a step after `--hang-after-step` (default: half the steps) and
//!    times its detection by the watchdog and the next commit; beside it, the watchdog's cost
//!    per step (its marks and beats, timed in this process). Targets: detected within
//!    max(3 x the median step, 2 s), no step replayed, a cost under 0.5 % of a step (`hang`).
//! 6. **master restart** (skipped with `--no-master`): no failure; the bench SIGKILLs the
//!    master (`train` itself, not its agents) once `--master-kill-after-step` committed
//!    (default: 5/8 of the steps) and starts `train --resume RUN --reattach` at once, which
//!    takes the agents and their workers back and goes on in place; beside it, the commit
//!    record's write (`committed.json`, before every commit), timed in this process. Targets:
//!    next commit within the master's 3 s lease + a step + the bench's gap, every agent back,
//!    no step replayed, no checkpoint loaded, every step once, the record under 1 % of a step
//!    (`master`).
//! 7. **standby take-over** (skipped with `--no-standby`): no failure, one standby master
//!    (`--standby-masters 1`); the bench SIGKILLs the master once `--master-kill-after-step`
//!    committed and starts nothing: the standby takes over from its copy of the run directory.
//!    Beside it, what keeping the standby cost the steps before: the master's own time on it
//!    (its `standby_cost` events) and the median step against the fault-free run's. Targets:
//!    next commit within the 3 s lease + a step, every agent back, no step replayed, no
//!    checkpoint loaded, every step once in the copy, the cost under 1 % of a step (`standby`).
//!
//! ```text
//!  FailurePlan (pure) ─► train (fault-free) ─┐
//!                     ─► train (in place) ───┼─► records ─► summary (pure) ─► table / --json
//!                     ─► train ─► train --resume ─► ... (checkpoint restart)
//!  MembershipPlan ─────► train + oobleck drain + oobleck add-node ─┤ (drain + join)
//!  HangPlan ───────────► train + SIGSTOP of a worker ──────────────┤ (hang)
//!  watchdog_cost ──────► Progress marks and beats, timed here ─────┤
//!  MasterPlan ─────────► train, SIGKILL of it ─► train --reattach ─┤ (master restart)
//!  commit_cost ────────► CommitRecord::write, timed here ──────────┤
//!  StandbyPlan ────────► train --standby-masters 1, SIGKILL of it ─┘ (standby take-over)
//! ```
//!
//! Each run is the `train` binary beside this one, as child processes in a scratch directory
//! (`child`): its own process group, every wait bounded by `--timeout-s`, killed on drop and on
//! Ctrl-C (the master run's first `train` leaves its group, its agents, to the restarted
//! master, and the bench kills it once that exits, `master_run`; the standby run's, to the
//! standby, `standby_run`). The numbers come from each run directory's `events.jsonl` and
//! `metrics.jsonl` (`records`; the standby's copy for the standby run), wall times from the
//! bench's own clock around each process (so they include process start, model build,
//! checkpoint load and the final checkpoint).
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

mod commit_cost;
mod hang;
mod hang_run;
mod hang_table;
mod master;
mod master_run;
mod master_table;
mod membership;
mod membership_run;
mod membership_table;
mod plan;
mod readoption;
mod readoption_table;
mod records;
mod standby;
mod standby_run;
mod standby_table;
mod summary;
mod table;
mod watchdog_cost;

use crate::bench::child::{binary, tail, Exit, Reaper, Scratch, TrainProcess};
use hang::{hang_checks, Hang, HangPlan, MarkCosts};
use hang_run::HangInput;
use master::{master_checks, MasterPlan, MasterRestart};
use master_run::MasterInput;
use membership::{membership_checks, Membership, MembershipPlan};
use plan::restart_shapes;
pub use plan::FailurePlan;
use records::{parse_events, parse_metrics, Event};
use standby::{standby_checks, StandbyPlan, Takeover};
use standby_run::StandbyInput;
use summary::{checks, compare, summarize, Check, Job, RunInput, RunKind, RunSummary, Segment};

/// Compare recovery in place with a fault-free run and with checkpoint restart, same job; and
/// time a drain + join and a hung worker (SIGSTOP), with the watchdog's cost per step.
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
    /// Skip the drain + join run (a fourth run of the job: about a quarter of the bench's time).
    #[arg(long)]
    pub no_membership: bool,
    /// The drain + join run drains the highest node once this step committed [default: 3/8
    /// of --steps].
    #[arg(long)]
    pub drain_after_step: Option<u64>,
    /// ... and adds a node once this step committed [default: 17/24 of --steps].
    #[arg(long)]
    pub join_after_step: Option<u64>,
    /// Skip the hang run (another run of the job, and the watchdog's cost beside it).
    #[arg(long)]
    pub no_hang: bool,
    /// The hang run stops a worker half a median step after this step committed [default:
    /// half of --steps].
    #[arg(long)]
    pub hang_after_step: Option<u64>,
    /// Skip the master run (another run of the job: its master SIGKILLed and restarted with
    /// `--reattach`).
    #[arg(long)]
    pub no_master: bool,
    /// The master run SIGKILLs `train` (the master only) once this step committed [default:
    /// 5/8 of --steps, after the in-place run's first failure and the hang, between two
    /// checkpoints].
    #[arg(long)]
    pub master_kill_after_step: Option<u64>,
    /// Skip the standby run (another run of the job with one standby master, its master
    /// SIGKILLed after --master-kill-after-step; the standby takes over).
    #[arg(long)]
    pub no_standby: bool,
    /// The `train` binary [default: the one beside this `oobleck`].
    #[arg(long)]
    pub train_bin: Option<PathBuf>,
    /// The `oobleck` binary whose `drain` and `add-node` the drain + join run uses [default:
    /// the one beside `train`, normally this one].
    #[arg(long)]
    pub oobleck_bin: Option<PathBuf>,
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
    /// The drain + join run's drain and join (absent with `--no-membership`).
    pub membership: Option<Membership>,
    /// The hang run's stop, detection, recovery and the watchdog's cost (absent with
    /// `--no-hang`).
    pub hang: Option<Hang>,
    /// The master run's kill, take-over and the commit record's cost (absent with
    /// `--no-master`).
    pub master: Option<MasterRestart>,
    /// The standby run's kill, take-over and the standby's cost per step (absent with
    /// `--no-standby`).
    pub standby: Option<Takeover>,
    pub checks: Vec<Check>,
    /// The `train` command lines of each run, in order.
    pub commands: Vec<String>,
}

/// Where a `train` writes: a new run directory, or one it resumes.
enum Out<'a> {
    Fresh(&'a Path),
    Resume(&'a Path),
}

/// Runs the jobs and prints the table.
pub fn run(a: &BenchRecoveryArgs) -> Result<()> {
    let plan = FailurePlan::new(a)?;
    let members = MembershipPlan::new(a)?;
    let hang = HangPlan::new(a)?;
    let master = MasterPlan::new(a)?;
    let standby = StandbyPlan::new(a)?;
    let bench = Bench {
        a,
        bin: binary("train", a.train_bin.as_deref())?,
        oobleck: match members {
            Some(_) => binary("oobleck", a.oobleck_bin.as_deref())?,
            None => PathBuf::new(),
        },
        reaper: Reaper::install()?,
        scratch: Scratch::create("recovery", a.scratch.as_deref(), a.keep)?,
        commands: Default::default(),
    };
    let t0 = Instant::now();
    let (report, shares) = bench.all(&plan, members, hang, (master, standby))?;
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
    let all_s = t0.elapsed().as_secs_f64();
    eprintln!("bench recovery: {all_s:.0} s in all");
    for (what, flag, s) in shares {
        eprintln!(
            "bench recovery: the {what} run took {:.0} % of it ({flag} skips it)",
            s / all_s * 100.0
        );
    }
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
    /// `oobleck`, for the drain + join run's tools.
    oobleck: PathBuf,
    reaper: Reaper,
    scratch: Scratch,
    commands: std::cell::RefCell<Vec<String>>,
}

/// The master run and the standby run, as they ran (each absent when skipped).
type MasterRuns = (
    Option<(MasterPlan, MasterInput)>,
    Option<(StandbyPlan, StandbyInput)>,
);

/// The optional runs' seconds: `(run, the flag that skips it, s)`.
type Shares = Vec<(&'static str, &'static str, f64)>;

impl Bench<'_> {
    /// Every run, in order, and the report.
    fn all(
        &self,
        plan: &FailurePlan,
        members: Option<MembershipPlan>,
        hang: Option<HangPlan>,
        (master, standby): (Option<MasterPlan>, Option<StandbyPlan>),
    ) -> Result<(Report, Shares)> {
        // Timed first, while no train runs beside it.
        let costs = hang
            .as_ref()
            .map(|_| watchdog_cost::measure())
            .transpose()?;
        let ff = self.single(RunKind::FaultFree, "fault-free", plan, &[]);
        let ip = self.single(RunKind::InPlace, "in-place", plan, &plan.failures);
        let rs = self.restart(plan, &restart_shapes(plan, &ip));
        let mut shares = Shares::new();
        let mb = members.map(|m| {
            let t = Instant::now();
            let (input, outcome) = self.membership(plan, &m);
            shares.push(("drain + join", "--no-membership", t.elapsed().as_secs_f64()));
            (m, input, outcome)
        });
        let hg = hang.zip(costs).map(|(h, costs)| {
            let t = Instant::now();
            let input = self.hang(plan, &h);
            shares.push(("hang", "--no-hang", t.elapsed().as_secs_f64()));
            (h, input, costs)
        });
        let ms = master.map(|m| {
            let t = Instant::now();
            let input = self.master(plan, &m);
            shares.push(("master", "--no-master", t.elapsed().as_secs_f64()));
            (m, input)
        });
        let sb = standby.map(|sp| {
            let t = Instant::now();
            let input = self.standby(plan, &sp);
            shares.push(("standby", "--no-standby", t.elapsed().as_secs_f64()));
            (sp, input)
        });
        let report = self.report(plan, [ff, ip, rs], mb, hg, (ms, sb));
        Ok((report, shares))
    }

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
        tick: &mut dyn FnMut(),
    ) -> Result<(Segment, Option<String>)> {
        self.segment_as(dir, args, log, gap_s, &mut |child, timeout| {
            child.wait_with(timeout, &mut *tick)
        })
    }

    /// [`segment`](Self::segment), `wait` waiting for the child's exit (within the timeout it
    /// is given) in its own way.
    fn segment_as(
        &self,
        dir: &Path,
        args: &[String],
        log: &str,
        gap_s: f64,
        wait: &mut dyn FnMut(TrainProcess, Duration) -> Result<Exit>,
    ) -> Result<(Segment, Option<String>)> {
        let events_path = dir.join("events.jsonl");
        let offset = std::fs::metadata(&events_path).map_or(0, |m| m.len() as usize);
        let cmd = format!("{} {}", self.bin.display(), args.join(" "));
        eprintln!("bench recovery: {cmd}");
        self.commands.borrow_mut().push(cmd);
        let log = self.scratch.root.join(log);
        let load_1m = load_average();
        let child = TrainProcess::spawn(&self.reaper, &self.bin, args, &log)?;
        let timeout = Duration::from_secs(self.a.timeout_s);
        let (wall_s, problem, how) = match wait(child, timeout) {
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
        match self.segment(&dir, &args, slug, 0.0, &mut || {}) {
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
            let result = self.segment(&dir, &args, &log, gap, &mut || {});
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

    /// The numbers of the three runs, and of the drain + join and hang runs if there were.
    fn report(
        &self,
        plan: &FailurePlan,
        inputs: [RunInput; 3],
        members: Option<(MembershipPlan, RunInput, membership::Outcome)>,
        hang: Option<(HangPlan, HangInput, MarkCosts)>,
        (master, standby): MasterRuns,
    ) -> Report {
        let a = self.a;
        let job = Job {
            steps: a.steps,
            tokens_per_step: (a.global_batch_size * a.seq_len) as u64,
            failures: plan.failures.len(),
        };
        let mut runs: Vec<RunSummary> = inputs.iter().map(|i| summarize(i, &job)).collect();
        let step_s = runs[0].step_s.filter(|_| runs[0].ok);
        let membership = members.map(|(m, input, outcome)| {
            let s = summarize(&input, &job);
            let m = Membership::new(&m, outcome, &input, &s, step_s);
            runs.push(s);
            m
        });
        let hang = hang.map(|(h, input, costs)| {
            let s = summarize(&input.run, &job);
            let x = Hang::new(&h, input.observed, costs, &input.run, &s, &input.marks);
            runs.push(s);
            x
        });
        let master = master.map(|(m, input)| {
            let s = summarize(&input.run, &job);
            let shape = (plan.pins.iter().sum(), a.steps);
            let (o, rec) = (input.observed, input.record);
            let x = MasterRestart::new(&m, o, rec, &input.run, &s, shape, step_s);
            runs.push(s);
            x
        });
        let fault_free = inputs[0]
            .segments
            .first()
            .map_or(&[][..], |s| &s.metrics[..]);
        let standby = standby.map(|(sp, input)| {
            let s = summarize(&input.run, &job);
            let shape = (plan.pins.iter().sum(), a.steps);
            let run = (&input.run, &s);
            let x = Takeover::new(&sp, input.observed, run, shape, fault_free, step_s);
            runs.push(s);
            x
        });
        compare(&mut runs);
        let mut checks = checks(&runs[0], &runs[1]);
        let run_of = |k: RunKind| runs.iter().find(|s| s.kind == k);
        if let (Some(m), Some(s)) = (&membership, run_of(RunKind::Membership)) {
            checks.extend(membership_checks(&runs[0], s, m));
        }
        if let (Some(h), Some(s)) = (&hang, run_of(RunKind::Hang)) {
            checks.extend(hang_checks(s, h));
        }
        if let (Some(m), Some(s)) = (&master, run_of(RunKind::Master)) {
            checks.extend(master_checks(s, m));
        }
        if let (Some(t), Some(s)) = (&standby, run_of(RunKind::Standby)) {
            checks.extend(standby_checks(s, t));
        }
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
            membership,
            hang,
            master,
            standby,
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
