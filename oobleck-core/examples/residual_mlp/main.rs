//! Your own model, trained by the oobleck runtime through a node failure: a residual MLP
//! (`model.rs`, not a transformer) on a local cluster of 3 nodes with `f = 1`, node 2 killed
//! after step 4; then the same training in one process, and how far the two end apart.
//!
//! ```text
//!  cargo run --release -p oobleck-core --example residual_mlp
//!  main ─ take_over(factory) ─ (agents and workers: this binary again, they stop here)
//!       ├─ run_job(workload, options) ─► 3 agents ─► 3 workers ─► node 2 dies ─► 2 nodes go on
//!       ├─ train_in_one_process(..)      the same steps, every layer in one stage
//!       └─ max |final parameters of the job - of the one process|, expected below 1e-5
//! ```

mod model;
mod run;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;
use oobleck_core::elastic::protocol::ClusterStatus;
use oobleck_core::runtime::driver::{run_job, Observer};
use oobleck_core::runtime::job::Limits;
use oobleck_core::runtime::{BoxError, StepMetrics, Workload};

use model::MlpWorkload;

/// Parameters of the job and of the one process agree to within this.
const TOL: f64 = 1e-5;

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
    let cfg = run::config();
    let spec = run::training_spec(&cfg)?;
    let workload: Arc<dyn Workload> = Arc::new(MlpWorkload::new(cfg)?);
    let dir = tempfile::tempdir()?;
    let t0 = Instant::now();
    let opts = run::job_options(&cfg, &spec, dir.path(), Limits::default())?;
    let summary = run_job(workload.clone(), opts, &mut Print)?;
    let job_s = t0.elapsed().as_secs_f64();
    let ckpt = run::final_checkpoint(dir.path(), summary.checkpoint)?;
    let job = oobleck_core::checkpoint::load_checkpoint(&ckpt, &Device::Cpu)?;

    let t1 = Instant::now();
    let one = run::train_in_one_process(workload.as_ref(), &spec)?;
    let one_s = t1.elapsed().as_secs_f64();

    println!("\nstep  loss (job)  loss (one process)");
    for m in run::metrics(dir.path())? {
        let want = one
            .losses
            .get(m.step as usize - 1)
            .copied()
            .unwrap_or(f64::NAN);
        println!("{:>4}  {:.7}   {want:.7}", m.step, m.loss);
    }
    let d = run::max_abs_diff(&job.params, &one.params)?;
    let ok = d < TOL;
    println!(
        "job {job_s:.1} s (validation loss {:.4}), one process {one_s:.2} s",
        summary.final_val_loss.unwrap_or(f64::NAN)
    );
    println!(
        "max |parameter difference| after {} steps: {d:.3e} ({} 1e-5)",
        spec.steps,
        if ok { "within" } else { "NOT within" }
    );
    Ok(ok)
}
