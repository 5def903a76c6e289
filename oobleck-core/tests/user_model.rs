//! A user's own model on the job runtime: the residual MLP of `examples/residual_mlp` (not a
//! transformer) trained by `run_job` on a local cluster of 3 nodes with `f = 1`, node 2
//! killed after step 4, ends where the same training in one process ends (final parameters
//! within 1e-5), writes every step to `metrics.jsonl` exactly once, and leaves no process.
//!
//! `harness = false`: the runtime re-runs this binary as the job's agents and workers, so
//! `main` hands over to them first (`take_over`), as a user's binary does. It prints one
//! closing line, `1 passed, 0 failed` or `0 passed, 1 failed` (then exits 1).

#[path = "../examples/residual_mlp/model.rs"]
mod model;
#[path = "../examples/residual_mlp/run.rs"]
mod run;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use oobleck_core::runtime::job::Limits;
use oobleck_core::runtime::master::Observer;
use oobleck_core::runtime::{BoxError, Event};

use model::MlpWorkload;

const NAME: &str = "a_user_model_survives_a_node_failure_and_matches_one_process";
/// The whole test, job and reference; it takes a few seconds on 2 cores.
const LIMIT: Duration = Duration::from_secs(90);
/// How long the job's processes get to be gone once `run_job` returned.
const EXIT_WAIT: Duration = Duration::from_secs(10);

/// Keeps the job's notes for the failure message.
#[derive(Default)]
struct Notes(Vec<String>);

impl Observer for Notes {
    fn note(&mut self, line: &str) {
        self.0.push(line.to_string());
    }
}

fn ensure(ok: bool, what: impl FnOnce() -> String) -> Result<(), BoxError> {
    if ok {
        Ok(())
    } else {
        Err(what().into())
    }
}

fn main() -> ExitCode {
    oobleck_core::runtime::take_over(MlpWorkload::factory);
    std::thread::spawn(|| {
        std::thread::sleep(LIMIT);
        // Exiting closes the agents' stdin: they kill their workers and exit too.
        println!("test {NAME} ... FAILED: ran past {LIMIT:?}\n0 passed, 1 failed");
        std::process::exit(1);
    });
    let t0 = Instant::now();
    match user_model_trains_through_a_failure() {
        Ok(d) => {
            println!(
                "test {NAME} ... ok ({:.1} s; final parameters within {d:.2e} of one process)",
                t0.elapsed().as_secs_f64()
            );
            println!("1 passed, 0 failed");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("test {NAME} ... FAILED: {e}");
            println!("0 passed, 1 failed");
            ExitCode::FAILURE
        }
    }
}

/// Runs the job and the reference; the largest parameter difference.
fn user_model_trains_through_a_failure() -> Result<f64, BoxError> {
    let limits = Limits {
        loss_wait: Duration::from_secs(10),
        ranks_wait: Duration::from_secs(20),
        stall: Duration::from_secs(40),
        join: Duration::from_secs(30),
        ..Limits::default()
    };
    let mut notes = Notes::default();
    let job = run::run_the_job(limits, &mut notes)
        .map_err(|e| format!("the job failed: {e}; its notes: {:?}", notes.0))?;
    let (spec, summary) = (&job.spec, &job.summary);
    let events: Vec<Event> = run::jsonl(&job.dir.path().join("events.jsonl"))?;
    processes_are_gone(&events)?;

    let kinds: Vec<String> = events.iter().map(Event::kind).collect();
    for k in ["inject_failure", "lost", "reconfig", "finish"] {
        ensure(kinds.iter().any(|x| x == k), || {
            format!("no {k} event in {kinds:?}")
        })?;
    }
    ensure(summary.steps == spec.steps, || {
        format!("{} steps", summary.steps)
    })?;

    let one = run::train_in_one_process(job.workload.as_ref(), spec)?;
    let metrics = job.metrics()?;
    let steps: Vec<u64> = metrics.iter().map(|m| m.step).collect();
    let want: Vec<u64> = (1..=spec.steps).collect();
    ensure(steps == want, || {
        format!("metrics.jsonl has steps {steps:?}, want each of {want:?} once")
    })?;
    for (m, want) in metrics.iter().zip(&one.losses) {
        ensure((m.loss - want).abs() < run::TOL, || {
            format!("step {}: loss {} vs {want} in one process", m.step, m.loss)
        })?;
    }
    let last = metrics.last().expect("checked: 10 lines");
    ensure(last.generation == 1 && last.nodes == 2, || {
        format!(
            "the last step ran in generation {} on {} nodes, want 1 on 2",
            last.generation, last.nodes
        )
    })?;

    let ckpt = job.final_checkpoint()?;
    ensure(ckpt.trainer.step == spec.steps, || {
        format!("the final checkpoint is of step {}", ckpt.trainer.step)
    })?;
    let d = run::max_abs_diff(&ckpt.params, &one.params)?;
    ensure(d < run::TOL, || {
        format!("final parameters differ from one process's by {d:e}")
    })?;
    Ok(d)
}

/// Every agent and worker the job reported (3 agents, 3 workers, then 2 more workers of
/// generation 1) has ended.
fn processes_are_gone(events: &[Event]) -> Result<(), BoxError> {
    let mut pids = Vec::new();
    for e in events {
        if let Event::Process { pid, .. } = e {
            pids.push(pid.ok_or("a process event without a pid")?);
        }
    }
    ensure(pids.len() >= 6, || {
        format!("only {} processes reported: {pids:?}", pids.len())
    })?;
    let deadline = Instant::now() + EXIT_WAIT;
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    ensure(left.is_empty(), || {
        format!("processes left behind: {left:?}")
    })
}

/// True while `pid` runs (a zombie runs nothing).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}
