//! Your own model, trained by the oobleck runtime through a node failure: a residual MLP
//! (`model.rs`, not a transformer) on a local cluster of 3 nodes with `f = 1`, node 2 killed
//! after step 4; then the same training in one process, and how far the two end apart.
//!
//! ```text
//!  cargo run --release -p oobleck-core --example residual_mlp
//!  main ─ take_over(factory) ─ (agents and workers: this binary again, they stop here)
//!       ├─ run_the_job: run_job(workload, options) ─► 3 agents ─► 3 workers ─► node 2 dies
//!       │                                              ─► 2 nodes go on   (run.rs)
//!       ├─ train_in_one_process(..)      the same steps, every layer in one stage (run.rs)
//!       └─ max |final parameters of the job - of the one process|, expected below 1e-5
//! ```

mod model;
mod run;

use std::process::ExitCode;
use std::time::Instant;

use oobleck_core::runtime::job::Limits;
use oobleck_core::runtime::master::Observer;
use oobleck_core::runtime::wire::protocol::ClusterStatus;
use oobleck_core::runtime::{BoxError, StepMetrics};

use model::MlpWorkload;

/// Prints the job as it goes.
struct Print;

impl Observer for Print {
    fn plan(&mut self, status: &ClusterStatus) {
        println!("generation {}:", status.generation);
        for p in &status.pipelines {
            let stages: Vec<String> = p
                .stages
                .iter()
                .map(|s| format!("node {} layers {}..{}", s.node, s.layers.0, s.layers.1))
                .collect();
            println!(
                "  pipeline {} ({} microbatches): {}",
                p.id,
                p.microbatches,
                stages.join(", ")
            );
        }
    }

    fn step(&mut self, m: &StepMetrics, total: u64) {
        println!(
            "step {:>2}/{total}  loss {:.6}  lr {:.2e}  generation {}  {} node(s)",
            m.step, m.loss, m.lr, m.generation, m.nodes
        );
    }

    fn note(&mut self, line: &str) {
        println!("{line}");
    }
}

fn main() -> ExitCode {
    // First: when the runtime started this process as an agent or a worker, that role runs
    // here and the process ends.
    oobleck_core::runtime::take_over(MlpWorkload::factory);
    match compare() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("Error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Trains on the cluster and in one process; whether the two agree.
fn compare() -> Result<bool, BoxError> {
    let job = run::run_the_job(Limits::default(), &mut Print)?;
    let ckpt = job.final_checkpoint()?;

    let t1 = Instant::now();
    let one = run::train_in_one_process(job.workload.as_ref(), &job.spec)?;
    let one_s = t1.elapsed().as_secs_f64();

    println!("\nstep  loss (job)  loss (one process)");
    for m in job.metrics()? {
        let want = one
            .losses
            .get(m.step as usize - 1)
            .copied()
            .unwrap_or(f64::NAN);
        println!("{:>4}  {:.7}   {want:.7}", m.step, m.loss);
    }
    let d = run::max_abs_diff(&ckpt.params, &one.params)?;
    let ok = d < run::TOL;
    println!(
        "job {:.1} s (validation loss {:.4}), one process {one_s:.2} s",
        job.summary.wall_s,
        job.summary.final_val_loss.unwrap_or(f64::NAN)
    );
    println!(
        "max |parameter difference| after {} steps: {d:.3e} ({} {:e})",
        job.spec.steps,
        if ok { "within" } else { "NOT within" },
        run::TOL
    );
    Ok(ok)
}
