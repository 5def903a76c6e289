//! How the example trains its model: as a job on a local cluster of 3 nodes that loses one
//! (the runtime does everything), and as the same training in one process (every layer in
//! one [`Stage`], written out here), which the job must reproduce to float rounding.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use oobleck_core::checkpoint::{load_checkpoint, Checkpoint};
use oobleck_core::model::{accumulate, DropoutKey, ForwardCtx, Stage};
use oobleck_core::optim::{clip_grad_norm, AdamWConfig, LrSchedule};
use oobleck_core::runtime::job::Limits;
use oobleck_core::runtime::master::{run_job, JobOptions, JobSummary, Launch, Observer};
use oobleck_core::runtime::wire::Token;
use oobleck_core::runtime::{
    BoxError, DataPlane, InjectedFailure, JobConfig, StepMetrics, TrainingSpec, Workload,
};
use serde::de::DeserializeOwned;

use crate::model::{MlpConfig, MlpWorkload};

/// Steps of the run.
const STEPS: u64 = 10;
/// Final parameters of the job and of the one process agree to within this.
pub const TOL: f64 = 1e-5;

/// The model: 16 features, 3 blocks of width 32 (13k parameters), 4 classes.
fn config() -> MlpConfig {
    MlpConfig {
        inputs: 16,
        width: 32,
        hidden: 64,
        blocks: 3,
        classes: 4,
        eval_samples: 256,
    }
}

/// 3 nodes of one device, `f = 1`; node 2 dies after step 4 is committed.
fn training_spec() -> Result<TrainingSpec, BoxError> {
    let peak = 3e-3;
    Ok(TrainingSpec {
        steps: STEPS,
        seed: 7,
        microbatch_size: 8,
        global_microbatches: 4,
        nodes: 3,
        devices_per_node: 1,
        fault_threshold: 1,
        device: "cpu".into(),
        // A pipeline of node 0 and one of nodes 1 and 2: the model is cut into stages, and
        // losing node 2 breaks one pipeline while node 0 still holds every layer.
        pipeline_nodes: Some(vec![1, 2]),
        optimizer: AdamWConfig {
            lr: peak,
            ..AdamWConfig::default()
        },
        lr: LrSchedule::new(peak, peak / 10.0, 2, STEPS)?,
        grad_clip: Some(1.0),
        checkpoint_every: 2,
        eval_every: 5,
        data_plane: DataPlane::Tcp,
        inject_failures: vec![InjectedFailure {
            node: 2,
            after_step: 4,
        }],
        compute: Default::default(),
        precision: Default::default(),
        recompute: false,
        schedule: Default::default(),
        device_memory_bytes: None,
    })
}

/// A finished job and its run directory (removed when this is dropped).
pub struct Job {
    pub spec: TrainingSpec,
    pub workload: Arc<dyn Workload>,
    pub dir: tempfile::TempDir,
    pub summary: JobSummary,
}

/// Runs the example's job to its end in a new temporary run directory.
pub fn run_the_job(limits: Limits, observer: &mut dyn Observer) -> Result<Job, BoxError> {
    let cfg = config();
    let spec = training_spec()?;
    let workload: Arc<dyn Workload> = Arc::new(MlpWorkload::new(cfg, spec.batch())?);
    let dir = tempfile::tempdir()?;
    let opts = job_options(&cfg, &spec, dir.path(), limits)?;
    let summary = run_job(workload.clone(), opts, observer)?;
    Ok(Job {
        spec,
        workload,
        dir,
        summary,
    })
}

impl Job {
    /// The checkpoint the job ended with, loaded (and so verified).
    pub fn final_checkpoint(&self) -> Result<Checkpoint, BoxError> {
        let path = self.summary.checkpoint.as_ref();
        let path = path.ok_or("the finished job names no final checkpoint")?;
        Ok(load_checkpoint(path, &Device::Cpu)?)
    }

    /// The lines of the run's `metrics.jsonl`, in file order.
    pub fn metrics(&self) -> Result<Vec<StepMetrics>, BoxError> {
        jsonl(&self.dir.path().join("metrics.jsonl"))
    }
}

/// The job: agents are this very binary, re-run (its `main` starts with `take_over`).
fn job_options(
    cfg: &MlpConfig,
    spec: &TrainingSpec,
    run_dir: &Path,
    limits: Limits,
) -> Result<JobOptions, BoxError> {
    let settings = serde_json::to_value(cfg)?;
    Ok(JobOptions {
        config: JobConfig {
            training: spec.clone(),
            workload: settings.clone(),
            watch: Default::default(),
            save_wait_s: oobleck_core::runtime::DEFAULT_SAVE_WAIT_S,
        },
        run_dir: run_dir.canonicalize()?,
        resume: None,
        plans: Vec::new(),
        echo: settings,
        bind: "127.0.0.1:0".parse()?,
        token: Token::random(),
        launch: Launch::Local {
            exe: std::env::current_exe()?,
            master_wait: oobleck_core::runtime::node::DEFAULT_MASTER_WAIT,
        },
        limits,
        reattach: None,
    })
}

/// What one process computes: the loss of every step and the final parameters.
pub struct Reference {
    pub losses: Vec<f64>,
    pub params: BTreeMap<String, Tensor>,
}

/// The job's training in one process, as the runtime defines it: step `s` sums the gradients
/// of microbatches `0..B` of `(seed, s)`, each loss scaled by its share of the global batch,
/// clips the global norm, and takes an AdamW step at the schedule's rate for `s`. It is
/// written with the model's own pieces (`Stage`, `accumulate`, `clip_grad_norm`), none of the
/// runtime's (no schedule, no gradient sync), so the comparison checks the runtime rather than
/// repeating it.
pub fn train_in_one_process(w: &dyn Workload, spec: &TrainingSpec) -> Result<Reference, BoxError> {
    let (cpu, layers) = (Device::Cpu, w.model().num_layers());
    let stage = Stage::new(w.model().build_layers(
        0..layers,
        &cpu,
        w.initial_params(spec.seed),
    )?)?;
    let params = stage.params();
    let mut opt = spec.optimizer()?;
    let loss_scale = f64::from(spec.microbatch_size) / spec.global_batch_samples() as f64;
    let mut losses = Vec::new();
    for step in 0..spec.steps {
        let mut grads = HashMap::new();
        let mut loss = 0.0;
        for mb in 0..spec.global_microbatches {
            let (x, y) = w.microbatch(spec.seed, step, mb, &cpu)?;
            let ctx = ForwardCtx {
                targets: Some(&y),
                loss_scale,
                train: true,
                dropout_key: DropoutKey {
                    seed: spec.seed,
                    iteration: step,
                    microbatch: u64::from(mb),
                },
                rows: None,
                dtype: candle_core::DType::F32,
            };
            let fwd = stage.forward(&x, &ctx)?;
            loss += f64::from(fwd.output.to_scalar::<f32>()?);
            accumulate(&mut grads, stage.backward(fwd, None)?.params)?;
        }
        if let Some(max_norm) = spec.grad_clip {
            clip_grad_norm(&mut grads, max_norm)?;
        }
        opt.step(&params, &grads, spec.lr.lr_at(step))?;
        losses.push(loss);
    }
    let params = params
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().clone()))
        .collect();
    Ok(Reference { losses, params })
}

/// The largest `|a - b|` over every parameter; an error when the names differ.
pub fn max_abs_diff(
    a: &BTreeMap<String, Tensor>,
    b: &BTreeMap<String, Tensor>,
) -> Result<f64, BoxError> {
    if !a.keys().eq(b.keys()) {
        return Err(format!(
            "different parameters: {:?} vs {:?}",
            a.keys().collect::<Vec<_>>(),
            b.keys().collect::<Vec<_>>()
        )
        .into());
    }
    let mut max = 0.0f64;
    for (name, t) in a {
        let d = (t - &b[name])?.abs()?.max_all()?;
        max = max.max(f64::from(d.to_scalar::<f32>()?));
    }
    Ok(max)
}

/// Every line of a JSON-lines file (`metrics.jsonl`, `events.jsonl`), in file order.
pub fn jsonl<T: DeserializeOwned>(path: &Path) -> Result<Vec<T>, BoxError> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let mut out = Vec::new();
    for line in text.lines() {
        out.push(serde_json::from_str(line)?);
    }
    Ok(out)
}
