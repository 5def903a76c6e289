//! The single-process trainer: every layer in one stage, all microbatches of a step on this
//! process. It follows the training contract of DESIGN.md section 4 (data by
//! `(seed, epoch, iteration, microbatch)`, loss scaled by `b / (B*b)`, optimizer on the summed
//! gradient), so the distributed runtime can be checked against it step for step.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use oobleck_core::checkpoint::space::{self, SaveFailure};
use oobleck_core::checkpoint::{self, TrainerState};
use oobleck_core::model::{accumulate, DropoutKey, ForwardCtx, ParamSource, Stage};
use oobleck_core::optim::{clip_grad_norm, AdamW, LrSchedule};
use oobleck_core::runtime::wire::records::{SampleHash, StartInfo, StepData};
use oobleck_core::runtime::{Event, Workload};
use oobleck_models::workload::{to_tensors, GptWorkload};

use crate::config::{batch_shape, workload_config, TrainConfig};
use crate::generate::whole_model;
use crate::progress::Progress;
use crate::run_dir::{open_run, truncate_metrics_after, StepMetrics, Summary};
use crate::stop_signals::StopSignals;

/// Everything a run holds while it trains.
pub struct Trainer {
    pub cfg: TrainConfig,
    /// The model (a preset or `--init-from`) and its corpus, checked against each other: what
    /// the cluster job trains (built from the same [`workload_config`] and [`batch_shape`]),
    /// so data, evaluation and checkpoint files are the same code on one process and on many.
    pub workload: GptWorkload,
    pub stage: Stage,
    pub opt: AdamW,
    pub sched: LrSchedule,
    pub step: u64,
    pub out: PathBuf,
    pub device: Device,
    metrics: std::fs::File,
    events: std::fs::File,
    /// A signal asks it to stop after the step it is in (see [`Trainer::stop_on_signals`]).
    stop: Option<StopSignals>,
}

impl Trainer {
    /// A fresh run in a new directory, or a resumed one from `resume`.
    pub fn start(cfg: TrainConfig, resume: Option<&Path>) -> Result<Self> {
        let workload = GptWorkload::new(workload_config(&cfg), batch_shape(&cfg)?)?;
        crate::cluster::memory::check_one_process_fits(&cfg, &workload)?;
        let placement = crate::placement::resolve(&cfg.device)?;
        let device = oobleck_core::runtime::device::open(placement.compute, 0)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let sched = LrSchedule::new(cfg.lr, cfg.final_lr(), cfg.warmup(), cfg.steps)?;
        let mut opt = cfg.optimizer()?;
        let model = workload.model();

        let (out, ckpt) = open_run(&cfg, resume, workload.dataset())?;
        let (stage, step) = match ckpt {
            Some((ckpt, _)) => {
                let ck = checkpoint::load_checkpoint(&ckpt, &device)?;
                let params: HashMap<String, Tensor> = ck.params.into_iter().collect();
                let stage = whole_model(model, &device, ParamSource::Tensors(&params))?;
                opt.import_state(&ck.optimizer)?;
                truncate_metrics_after(&out, ck.trainer.step)?;
                (stage, ck.trainer.step)
            }
            None => (
                whole_model(model, &device, workload.initial_params(cfg.seed))?,
                0,
            ),
        };
        let append = |name: &str| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(out.join(name))
                .with_context(|| format!("opening {}", out.join(name).display()))
        };
        let info = StartInfo {
            step,
            checkpoint: None,
            model: Some(cfg.model.clone()),
            params: Some(workload.num_params()),
            nodes: None,
            master: None,
            pid: None,
        };
        let mut t = Self {
            metrics: append("metrics.jsonl")?,
            events: append("events.jsonl")?,
            cfg,
            workload,
            stage,
            opt,
            sched,
            step,
            out,
            device,
            stop: None,
        };
        t.event(&match resume {
            Some(_) => Event::Resume(info),
            None => Event::Start(info),
        })?;
        Ok(t)
    }

    fn event(&mut self, e: &Event) -> Result<()> {
        let line = serde_json::to_string(e).context("an event serialises")?;
        writeln!(self.events, "{line}").context("writing events.jsonl")
    }

    /// One optimizer step over the global batch. Returns (mean loss, pre-clip grad norm, lr,
    /// the step's data: what a cluster job writes for the same step).
    pub fn train_step(&mut self) -> Result<(f64, f64, f64, StepData)> {
        let nb = self.workload.batch_spec().num_microbatches;
        let dtype = self.compute_dtype();
        let mut grads = HashMap::new();
        let mut loss = 0.0;
        let mut samples = SampleHash::default();
        for k in 0..nb {
            let batch = self.workload.train_batch(self.cfg.seed, self.step, k)?;
            samples = samples + SampleHash::of(batch.sample_ids.iter().map(|&i| i as u64));
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
                dtype,
            };
            // --recompute: one microbatch is in flight here, so only the graph of all layers
            // at once is saved (one layer's at a time instead); the values are the same.
            let fwd = if self.cfg.recompute {
                self.stage.forward_recompute(&inp, &ctx)?
            } else {
                self.stage.forward(&inp, &ctx)?
            };
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
        let cursor = self.workload.cursor(self.step);
        let data = StepData {
            epoch: Some(cursor.epoch),
            iteration: Some(cursor.iteration),
            samples: samples.hex(),
        };
        self.step += 1;
        Ok((loss, norm, lr, data))
    }

    /// What the forward passes compute in: `--precision bf16` is mixed precision (bf16
    /// compute, the f32 parameters as master weights, f32 optimizer state); else f32. The
    /// config was validated to one of the two.
    pub fn compute_dtype(&self) -> DType {
        self.cfg.precision.dtype().candle()
    }

    /// Mean loss over the first `eval_batches` validation microbatches (corpus order).
    pub fn validation_loss(&self) -> Result<f64> {
        Ok(self.workload.validation_loss(&self.stage)?)
    }

    /// Parameters by name (the tied embedding once), for checkpoints and comparisons.
    pub fn params(&self) -> BTreeMap<String, Tensor> {
        self.stage
            .params()
            .into_iter()
            .map(|(n, v)| (n, v.as_tensor().clone()))
            .collect()
    }

    /// Saves a checkpoint of this step. One that fails is said and recorded; a periodic one is
    /// then skipped (`None`), the final one tried again for `--save-wait` before the run
    /// ends with its steps lost.
    fn checkpoint(&mut self, last: bool) -> Result<Option<PathBuf>> {
        let deadline = Instant::now() + Duration::from_secs(self.cfg.save_wait_s);
        let mut pause = Duration::from_secs(1);
        loop {
            let e = match self.save_checkpoint() {
                Ok(path) => return Ok(Some(path)),
                Err(e) => e,
            };
            let retrying = last && Instant::now() + pause < deadline;
            let needed = space::checkpoint_bytes(self.workload.num_params());
            let error = format!("{e:#}");
            let failure = SaveFailure::measure(&self.out, self.step, needed, error, retrying);
            eprintln!(
                "{}",
                failure.warning(match (last, retrying) {
                    (false, _) => "training goes on; the next checkpoint tries again",
                    (true, true) => "the trained state is kept in memory and saved again shortly",
                    (true, false) => "no time is left (--save-wait)",
                })
            );
            self.event(&Event::checkpoint_failed(&failure))?;
            if !last {
                return Ok(None);
            }
            if !retrying {
                anyhow::bail!(
                    "the state after the final step {} could not be saved: {e:#}; the steps \
                     after the newest checkpoint in {} are lost. Free space where --out is (or \
                     pass a larger --save-wait) and run again with --resume on the run directory",
                    self.step,
                    self.out.display()
                );
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_secs(10));
        }
    }

    pub fn save_checkpoint(&mut self) -> Result<PathBuf> {
        let started = Instant::now();
        let state = TrainerState {
            step: self.step,
            seed: self.cfg.seed,
            data_cursor: self.workload.data_cursor(self.step),
            config: Some(serde_json::to_value(&self.cfg)?),
        };
        // The workload's files, as a cluster checkpoint has them: the HF config.json beside
        // model.safetensors makes the directory loadable with `from_pretrained`. They are
        // written before the checkpoint is renamed into place.
        let files = self.workload.checkpoint_files();
        let extra: Vec<(&str, Vec<u8>)> = files
            .iter()
            .map(|(name, bytes)| (name.as_str(), bytes.clone()))
            .collect();
        let path = checkpoint::save_checkpoint_with(
            &self.out,
            &self.params(),
            &self.opt.export_state()?,
            &state,
            &extra,
        )?;
        let duration_s = started.elapsed().as_secs_f64();
        self.event(&Event::Checkpoint {
            step: self.step,
            path: path.display().to_string(),
            duration_s,
            // One process: training waits for the whole write.
            stall_ms: duration_s * 1e3,
        })?;
        Ok(path)
    }

    /// From now on SIGTERM and SIGINT stop the run after the step they come in, with its
    /// checkpoint (a second one: at once), as they stop a cluster job.
    pub fn stop_on_signals(&mut self) -> Result<()> {
        self.stop = Some(StopSignals::listen(&self.out)?);
        Ok(())
    }

    /// The signal that asked to stop after this step, recorded once.
    fn stop_requested(&mut self) -> Result<bool> {
        let Some(signal) = self.stop.as_ref().and_then(StopSignals::requested) else {
            return Ok(false);
        };
        if self.step < self.cfg.steps {
            let step = self.step;
            self.event(&Event::StopRequested {
                signal: signal.to_string(),
                step,
            })?;
        }
        Ok(true)
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
            let (loss, grad_norm, lr, data) = self.train_step()?;
            let dt = t0.elapsed().as_secs_f64().max(1e-9);
            total_tokens += tokens_per_step;
            first_loss.get_or_insert(loss);
            last_loss = Some(loss);
            let step = self.step;
            let last = step == self.cfg.steps || self.stop_requested()?;
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
                microbatches: String::new(),
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
                times: Default::default(),
                data: Some(data),
            };
            writeln!(self.metrics, "{}", serde_json::to_string(&m)?)
                .context("writing metrics.jsonl")?;
            progress.step(&m, self.cfg.steps);
            let ckpt_now =
                last || (self.cfg.checkpoint_every > 0 && step % self.cfg.checkpoint_every == 0);
            if ckpt_now {
                last_ckpt = self.checkpoint(last)?.or(last_ckpt);
            }
            if last {
                break;
            }
        }
        progress.finish();
        let wall_s = started.elapsed().as_secs_f64();
        self.event(&Event::Finish {
            step: self.step,
            wall_s,
        })?;
        Ok(Summary {
            out: self.out.clone(),
            model: self.cfg.model.clone(),
            params: self.workload.num_params(),
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
