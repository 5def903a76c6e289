//! The single-process trainer: every layer in one stage, all microbatches of a step on this
//! process. It follows the training contract of DESIGN.md section 4 (data by
//! `(seed, epoch, iteration, microbatch)`, loss scaled by `b / (B*b)`, optimizer on the summed
//! gradient), so the distributed runtime can be checked against it step for step.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use oobleck_core::checkpoint::{self, TrainerState};
use oobleck_core::model::{accumulate, DropoutKey, ForwardCtx, LayeredModel, ParamSource, Stage};
use oobleck_core::optim::{clip_grad_norm, AdamW, LrSchedule};
use oobleck_models::data::{self, BatchSpec, DataCursor, Dataset, Split};
use oobleck_models::{hf, ModelConfig};
use serde::Serialize;

use crate::config::{load_resolved, save_resolved, TrainConfig};
use crate::progress::Progress;

/// One line of `metrics.jsonl`: a committed step (the runtime's record).
pub use oobleck_core::runtime::StepMetrics;

/// What a finished run reports (`--json` prints it).
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub out: PathBuf,
    pub model: String,
    pub params: usize,
    pub steps: u64,
    pub first_loss: Option<f64>,
    pub final_loss: Option<f64>,
    pub first_val_loss: Option<f64>,
    pub final_val_loss: Option<f64>,
    pub tokens_per_s: f64,
    pub wall_s: f64,
    pub checkpoint: Option<PathBuf>,
    /// `report.html`, when it could be written.
    pub report: Option<PathBuf>,
}

/// Everything a run holds while it trains.
pub struct Trainer {
    pub cfg: TrainConfig,
    pub model_cfg: ModelConfig,
    pub model: Arc<dyn LayeredModel>,
    pub stage: Stage,
    pub opt: AdamW,
    pub sched: LrSchedule,
    pub data: Dataset,
    pub spec: BatchSpec,
    pub step: u64,
    pub out: PathBuf,
    device: Device,
    iters_per_epoch: usize,
    metrics: std::fs::File,
    events: std::fs::File,
}

/// Resolves the model: a preset name, or a directory / hub id with an HF config.
pub fn model_config(cfg: &TrainConfig) -> Result<(ModelConfig, Option<HashMap<String, Tensor>>)> {
    if let Some(src) = &cfg.init_from {
        let pre = hf::locate(src).with_context(|| format!("--init-from {src}"))?;
        let w = hf::load_weights(&pre.dir, &pre.config)?;
        return Ok((pre.config, Some(w)));
    }
    Ok((ModelConfig::preset(&cfg.model)?, None))
}

/// Opens the job's corpus with its tokenizer (the built-in ones by default: nothing is read
/// from `datasets/`, so a node needs only the binary; a `--dataset` path every node must have).
pub fn open_dataset(cfg: &TrainConfig) -> Result<Dataset> {
    let named = |path: &Option<PathBuf>, built_in: &str| {
        path.as_ref()
            .map_or_else(|| built_in.to_owned(), |p| p.display().to_string())
    };
    data::open_dataset(cfg.dataset.as_deref(), cfg.tokenizer.as_deref()).with_context(|| {
        format!(
            "opening dataset {} with tokenizer {}",
            named(&cfg.dataset, data::EMBEDDED_CORPUS_NAME),
            named(&cfg.tokenizer, data::EMBEDDED_TOKENIZER_NAME)
        )
    })
}

/// Checks the job against the model and the data before anything starts: the sequence fits
/// the context, the tokenizer fits the vocabulary, the corpus holds a global batch and the
/// validation split the evaluation batches. Returns the dataset, the batch shape and the
/// iterations per epoch.
pub fn prepare_data(
    cfg: &TrainConfig,
    model_cfg: &ModelConfig,
) -> Result<(Dataset, BatchSpec, usize)> {
    if cfg.seq_len > model_cfg.max_seq_len() {
        bail!(
            "--seq-len {} exceeds the context of {} ({} positions)",
            cfg.seq_len,
            cfg.model,
            model_cfg.max_seq_len()
        );
    }
    let data = open_dataset(cfg)?;
    data.tokenizer().check_vocab(model_cfg.vocab_size())?;
    let spec = BatchSpec {
        seq_len: cfg.seq_len,
        microbatch_size: cfg.microbatch_size,
        num_microbatches: cfg.num_microbatches(),
    };
    let iters_per_epoch = data.split(Split::Train).iterations_per_epoch(&spec)?;
    let val = data.split(Split::Validation);
    if val.num_sequential_batches(cfg.seq_len, cfg.microbatch_size) < cfg.eval_batches {
        bail!(
            "the validation split has {} samples of {} tokens: fewer than --eval-batches {} x \
             --microbatch-size {}",
            val.num_samples(cfg.seq_len),
            cfg.seq_len,
            cfg.eval_batches,
            cfg.microbatch_size
        );
    }
    Ok((data, spec, iters_per_epoch))
}

/// `--out`, or `runs/<model>-<unix seconds>`.
pub fn out_dir(cfg: &TrainConfig) -> PathBuf {
    match &cfg.out {
        Some(o) => o.clone(),
        None => PathBuf::from("runs").join(format!(
            "{}-{}",
            cfg.model.replace('/', "_"),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0)
        )),
    }
}

impl Trainer {
    /// A fresh run in a new directory, or a resumed one from `resume`.
    pub fn start(cfg: TrainConfig, resume: Option<&Path>) -> Result<Self> {
        let (model_cfg, pretrained) = model_config(&cfg)?;
        let (data, spec, iters_per_epoch) = prepare_data(&cfg, &model_cfg)?;
        let device = Device::Cpu;
        let model = model_cfg.build()?;
        let sched = LrSchedule::new(cfg.lr, cfg.final_lr(), cfg.warmup(), cfg.steps)?;
        let mut opt = cfg.optimizer()?;
        let l = model.num_layers();

        let (out, ckpt) = open_run(&cfg, resume)?;
        let (stage, step) = match ckpt {
            Some(ckpt) => {
                let ck = checkpoint::load_checkpoint(&ckpt, &device)?;
                let params: HashMap<String, Tensor> = ck.params.into_iter().collect();
                let layers = model.build_layers(0..l, &device, ParamSource::Tensors(&params))?;
                opt.import_state(&ck.optimizer)?;
                truncate_metrics_after(&out, ck.trainer.step)?;
                (Stage::new(layers)?, ck.trainer.step)
            }
            None => {
                let source = match &pretrained {
                    Some(w) => ParamSource::Tensors(w),
                    None => ParamSource::Init { seed: cfg.seed },
                };
                let layers = model.build_layers(0..l, &device, source)?;
                (Stage::new(layers)?, 0)
            }
        };
        let append = |name: &str| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(out.join(name))
                .with_context(|| format!("opening {}", out.join(name).display()))
        };
        let mut t = Self {
            metrics: append("metrics.jsonl")?,
            events: append("events.jsonl")?,
            cfg,
            model_cfg,
            model,
            stage,
            opt,
            sched,
            data,
            spec,
            step,
            out,
            device,
            iters_per_epoch,
        };
        t.event(serde_json::json!({
            "event": if resume.is_some() { "resume" } else { "start" },
            "step": step,
            "model": t.cfg.model,
            "params": t.model_cfg.num_params(),
        }))?;
        Ok(t)
    }

    fn event(&mut self, v: serde_json::Value) -> Result<()> {
        writeln!(self.events, "{v}").context("writing events.jsonl")
    }

    fn cursor(&self, step: u64) -> DataCursor {
        DataCursor::at_step(step, self.iters_per_epoch)
    }

    /// One optimizer step over the global batch. Returns (mean loss, pre-clip grad norm, lr).
    pub fn train_step(&mut self) -> Result<(f64, f64, f64)> {
        let cursor = self.cursor(self.step);
        let train = self.data.split(Split::Train);
        let nb = self.spec.num_microbatches;
        let mut grads = HashMap::new();
        let mut loss = 0.0;
        for k in 0..nb {
            let batch = train.microbatch_at(&self.spec, self.cfg.seed, cursor, k)?;
            let (inp, tgt) = to_tensors(&batch, &self.device)?;
            let ctx = ForwardCtx {
                targets: Some(&tgt),
                loss_scale: 1.0 / nb as f64,
                train: true,
                dropout_key: DropoutKey {
                    seed: self.cfg.seed,
                    iteration: self.step,
                    microbatch: k as u64,
                },
                rows: None,
            };
            let fwd = self.stage.forward(&inp, &ctx)?;
            loss += f64::from(fwd.output.to_scalar::<f32>()?);
            let g = self.stage.backward(fwd, None)?;
            accumulate(&mut grads, g.params)?;
        }
        let norm = if self.cfg.grad_clip > 0.0 {
            clip_grad_norm(&mut grads, self.cfg.grad_clip)?
        } else {
            oobleck_core::optim::global_grad_norm(&grads)?
        };
        let lr = self.sched.lr_at(self.step);
        self.opt.step(&self.stage.params(), &grads, lr)?;
        self.step += 1;
        Ok((loss, norm, lr))
    }

    /// Mean loss over the first `eval_batches` validation microbatches (corpus order).
    pub fn validation_loss(&self) -> Result<f64> {
        let val = self.data.split(Split::Validation);
        let mut total = 0.0;
        for i in 0..self.cfg.eval_batches {
            let batch = val.sequential_batch(self.cfg.seq_len, self.cfg.microbatch_size, i)?;
            let (inp, tgt) = to_tensors(&batch, &self.device)?;
            let ctx = ForwardCtx {
                targets: Some(&tgt),
                ..ForwardCtx::inference()
            };
            total += f64::from(self.stage.forward(&inp, &ctx)?.output.to_scalar::<f32>()?);
        }
        Ok(total / self.cfg.eval_batches as f64)
    }

    /// Parameters by name (the tied embedding once), for checkpoints and comparisons.
    pub fn params(&self) -> BTreeMap<String, Tensor> {
        self.stage
            .params()
            .into_iter()
            .map(|(n, v)| (n, v.as_tensor().clone()))
            .collect()
    }

    pub fn save_checkpoint(&mut self) -> Result<PathBuf> {
        let started = Instant::now();
        let state = TrainerState {
            step: self.step,
            seed: self.cfg.seed,
            data_cursor: serde_json::to_value(self.cursor(self.step))?,
            config: Some(serde_json::to_value(&self.cfg)?),
        };
        // The HF config beside model.safetensors makes the directory loadable with
        // `from_pretrained`; it is written before the checkpoint is renamed into place.
        let path = checkpoint::save_checkpoint_with(
            &self.out,
            &self.params(),
            &self.opt.export_state()?,
            &state,
            &[(hf::CONFIG_FILE, hf::config_json(&self.model_cfg))],
        )?;
        self.event(serde_json::json!({
            "event": "checkpoint",
            "step": self.step,
            "path": path,
            "duration_s": started.elapsed().as_secs_f64(),
        }))?;
        Ok(path)
    }

    /// Trains to `cfg.steps`, evaluating and checkpointing on schedule; then writes the run's
    /// report, also when training failed.
    pub fn run(&mut self, progress: &mut Progress) -> Result<Summary> {
        let result = self.run_steps(progress);
        crate::report::finish_run(&self.out, result)
    }

    fn run_steps(&mut self, progress: &mut Progress) -> Result<Summary> {
        let started = Instant::now();
        let tokens_per_step = (self.cfg.global_batch_size * self.cfg.seq_len) as f64;
        let mut first_loss = None;
        let mut last_loss = None;
        let mut first_val = None;
        let mut last_val = None;
        let mut last_ckpt = None;
        let mut total_tokens = 0.0;
        if self.step == 0 {
            let v = self.validation_loss()?;
            first_val = Some(v);
            progress.note(&format!("step 0: validation loss {v:.4}"));
        }
        while self.step < self.cfg.steps {
            let t0 = Instant::now();
            let (loss, grad_norm, lr) = self.train_step()?;
            let dt = t0.elapsed().as_secs_f64().max(1e-9);
            total_tokens += tokens_per_step;
            first_loss.get_or_insert(loss);
            last_loss = Some(loss);
            let step = self.step;
            let last = step == self.cfg.steps;
            let eval_now = last || (self.cfg.eval_every > 0 && step % self.cfg.eval_every == 0);
            let val_loss = if eval_now {
                Some(self.validation_loss()?)
            } else {
                None
            };
            if let Some(v) = val_loss {
                last_val = Some(v);
            }
            let m = StepMetrics {
                step,
                loss,
                lr,
                grad_norm,
                samples_per_s: self.cfg.global_batch_size as f64 / dt,
                tokens_per_s: tokens_per_step / dt,
                generation: 0,
                pipelines: 1,
                nodes: 1,
                wall_s: started.elapsed().as_secs_f64(),
                val_loss,
            };
            writeln!(self.metrics, "{}", serde_json::to_string(&m)?)
                .context("writing metrics.jsonl")?;
            progress.step(&m, self.cfg.steps);
            let ckpt_now =
                last || (self.cfg.checkpoint_every > 0 && step % self.cfg.checkpoint_every == 0);
            if ckpt_now {
                last_ckpt = Some(self.save_checkpoint()?);
            }
        }
        progress.finish();
        let wall_s = started.elapsed().as_secs_f64();
        self.event(serde_json::json!({"event": "finish", "step": self.step, "wall_s": wall_s}))?;
        Ok(Summary {
            out: self.out.clone(),
            model: self.cfg.model.clone(),
            params: self.model_cfg.num_params(),
            steps: self.step,
            first_loss,
            final_loss: last_loss,
            first_val_loss: first_val,
            final_val_loss: last_val,
            tokens_per_s: total_tokens / wall_s.max(1e-9),
            wall_s,
            checkpoint: last_ckpt,
            report: None,
        })
    }
}

/// `(inputs, targets)` as `[b, t]` u32 tensors (see [`oobleck_models::workload::to_tensors`]).
pub fn to_tensors(
    batch: &oobleck_models::data::Batch,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    Ok(oobleck_models::workload::to_tensors(batch, device)?)
}

/// The run directory of a job and, with `resume` (`--resume PATH`), the checkpoint it goes on
/// from, checked to continue the same training. A new run gets a fresh directory holding its
/// resolved config; one that already holds a run is refused.
pub fn open_run(cfg: &TrainConfig, resume: Option<&Path>) -> Result<(PathBuf, Option<PathBuf>)> {
    if let Some(path) = resume {
        let (run, ckpt) = find_checkpoint(path)?;
        let saved = load_resolved(&run)?;
        if let Some(changed) = cfg.trajectory_mismatch(&saved) {
            bail!(
                "--resume {}: this run was started with other values of {changed}; resuming \
                 with different values would not continue the same training (start a new run \
                 instead)",
                path.display()
            );
        }
        if cfg.steps != saved.steps {
            // An extended run: its config.json says how far it goes now, so a later plain
            // `--resume RUN` continues the same schedule.
            save_resolved(cfg, &run)?;
        }
        return Ok((run, Some(ckpt)));
    }
    let out = out_dir(cfg);
    if out.join("metrics.jsonl").exists() || out.join("checkpoints").exists() {
        bail!(
            "{} already holds a run; pass --resume {} to continue it, or choose another --out",
            out.display(),
            out.display()
        );
    }
    std::fs::create_dir_all(&out)
        .with_context(|| format!("creating run directory {}", out.display()))?;
    save_resolved(cfg, &out)?;
    Ok((out, None))
}

/// `path` is a run directory (newest checkpoint) or a checkpoint directory; returns
/// `(run directory, checkpoint directory)`.
pub fn find_checkpoint(path: &Path) -> Result<(PathBuf, PathBuf)> {
    if path.join(checkpoint::TRAINER_FILE).is_file() {
        let run = path
            .parent()
            .and_then(Path::parent)
            .with_context(|| format!("{} is not inside <run>/checkpoints/", path.display()))?;
        return Ok((run.to_path_buf(), path.to_path_buf()));
    }
    if !path.is_dir() {
        bail!(
            "--resume {}: no such run or checkpoint directory",
            path.display()
        );
    }
    match checkpoint::latest_checkpoint(path)? {
        Some(c) => Ok((path.to_path_buf(), c)),
        None => bail!(
            "--resume {}: the run has no complete checkpoint yet",
            path.display()
        ),
    }
}

pub use oobleck_core::runtime::driver::truncate_metrics_after;
