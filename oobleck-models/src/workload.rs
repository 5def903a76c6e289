//! The shipped models on the job runtime: a GPT-2/GPT-3/OPT model trained on a token corpus,
//! as an [`oobleck_core::runtime::Workload`].
//!
//! ```text
//!  GptWorkloadConfig (JSON in JobConfig::workload) ──► GptWorkload::factory, on every process
//!    model / init_from ──► ModelConfig ──► Arc<dyn LayeredModel> (+ HF weights)
//!    dataset / tokenizer ──► data::Dataset ──► microbatch (seed, step, k) ──► [b, t] u32 tensors
//! ```
//!
//! Everything here does what the single-process trainer (`bin/src/trainer.rs`) does, so a run
//! on the runtime is bit-identical to it: step `s` reads the iteration at
//! [`DataCursor::at_step`], microbatch `k` of it is [`crate::data::SplitData::microbatch_at`],
//! and the evaluation is the mean loss of the first validation batches in corpus order.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use oobleck_core::model::{ForwardCtx, LayeredModel, ParamSource, Stage};
use oobleck_core::planning::{analytical_profile, DeviceSpec, Dtype, ModelProfile};
use oobleck_core::runtime::{BoxError, TrainingSpec, Workload};
use serde::{Deserialize, Serialize};

use crate::data::{self, Batch, BatchSpec, DataCursor, DataError, Dataset, Split};
use crate::{hf, Error, ModelConfig, Result};

/// What to train: the model and its data. The job runtime carries it as opaque JSON
/// (`JobConfig::workload`) to every process, whose [`GptWorkload::factory`] reads it back.
/// Missing fields take the defaults of `train` (the values below).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GptWorkloadConfig {
    /// Model preset name (see [`crate::preset_names`]). With `init_from` it is only the run's
    /// label, as `train --model` is. Default `gpt-mini`: 4 blocks of width 128, trains on a
    /// laptop CPU.
    pub model: String,
    /// Start from pretrained Hugging Face weights: a directory holding `config.json` and
    /// `model.safetensors`, or a hub id `org/name[@revision]` in the local HF cache (see
    /// [`hf::locate`]); the model is then that config. Default none: a seeded initialisation.
    pub init_from: Option<String>,
    /// Tokens per sample, at most the model's context. Default 64: long enough for sentences,
    /// cheap on a CPU.
    pub seq_len: usize,
    /// `b`: samples per microbatch, of training and of evaluation batches; the runtime's
    /// `TrainingSpec::microbatch_size` must be the same. Default 4: a gpt-mini step near a
    /// second on 2 cores.
    pub microbatch_size: usize,
    /// `B`: microbatches per step (the global batch is `B * b` samples); the runtime's
    /// `TrainingSpec::global_microbatches` must be the same. Default 4: enough for a pipeline
    /// to fill.
    pub num_microbatches: usize,
    /// Validation microbatches (of `microbatch_size` samples) per evaluation: the first ones in
    /// corpus order, so losses compare across steps and runs. Default 4.
    pub eval_batches: usize,
    /// Text corpus (UTF-8), a path every node must have. Default none: the built-in corpus
    /// (`datasets/shakespeare.txt`, compiled in).
    pub dataset: Option<PathBuf>,
    /// GPT-2 tokenizer: `tokenizer.json`, or a directory with `encoder.json` + `vocab.bpe`.
    /// Default none: the built-in GPT-2 tokenizer.
    pub tokenizer: Option<PathBuf>,
}

impl Default for GptWorkloadConfig {
    fn default() -> Self {
        Self {
            model: "gpt-mini".into(),
            init_from: None,
            seq_len: 64,
            microbatch_size: 4,
            num_microbatches: 4,
            eval_batches: 4,
            dataset: None,
            tokenizer: None,
        }
    }
}

impl GptWorkloadConfig {
    /// The model these settings name, without its weights or its corpus (for a tool that
    /// loads a checkpoint's weights instead): `init_from`'s HF config, else the preset.
    pub fn model_config(&self) -> Result<ModelConfig> {
        match &self.init_from {
            Some(src) => Ok(hf::locate(src)?.config),
            None => ModelConfig::preset(&self.model),
        }
    }
}

/// A GPT/OPT model with its corpus, checked to fit each other (see [`GptWorkload::new`]).
/// `Send + Sync`: the dataset and the model are shared read-only.
pub struct GptWorkload {
    cfg: GptWorkloadConfig,
    model_cfg: ModelConfig,
    model: Arc<dyn LayeredModel>,
    /// HF weights by parameter name (`init_from`), on the CPU.
    pretrained: Option<HashMap<String, Tensor>>,
    data: Dataset,
    spec: BatchSpec,
    iterations_per_epoch: usize,
}

impl GptWorkload {
    /// Resolves the model (a preset, or `init_from` with its weights), opens the corpus and
    /// checks them against each other: the sequence fits the context, the tokenizer fits the
    /// vocabulary, the training split holds a global batch and the validation split the
    /// evaluation batches.
    pub fn new(cfg: GptWorkloadConfig) -> Result<Self> {
        let (model_cfg, pretrained) = resolve_model(&cfg)?;
        let (data, spec, iterations_per_epoch) = prepare_data(&cfg, &model_cfg)?;
        let model = model_cfg.build()?;
        Ok(Self {
            cfg,
            model_cfg,
            model,
            pretrained,
            data,
            spec,
            iterations_per_epoch,
        })
    }

    /// The runtime's factory (`oobleck_core::runtime::Factory`): reads a
    /// [`GptWorkloadConfig`] from the job's workload JSON and builds the workload.
    pub fn factory(config: &serde_json::Value) -> std::result::Result<Box<dyn Workload>, BoxError> {
        let cfg: GptWorkloadConfig = serde_json::from_value(config.clone())
            .map_err(|e| format!("the GPT workload's settings: {e}"))?;
        Ok(Box::new(Self::new(cfg)?))
    }

    pub fn config(&self) -> &GptWorkloadConfig {
        &self.cfg
    }

    pub fn model_config(&self) -> &ModelConfig {
        &self.model_cfg
    }

    pub fn dataset(&self) -> &Dataset {
        &self.data
    }

    /// The shape of a step's data: `B` microbatches of `b` samples of `seq_len` tokens.
    pub fn batch_spec(&self) -> BatchSpec {
        self.spec
    }

    /// Steps per pass over the training split.
    pub fn iterations_per_epoch(&self) -> usize {
        self.iterations_per_epoch
    }

    /// Where the data stream stands after `step` committed steps.
    pub fn cursor(&self, step: u64) -> DataCursor {
        DataCursor::at_step(step, self.iterations_per_epoch)
    }

    /// Microbatch `k` of step `step` (0-based) of the training split, for `seed`.
    pub fn train_batch(&self, seed: u64, step: u64, k: usize) -> Result<Batch> {
        let train = self.data.split(Split::Train);
        Ok(train.microbatch_at(&self.spec, seed, self.cursor(step), k)?)
    }

    /// Mean loss of the whole model (`stage` holds every layer) over the first
    /// `eval_batches` validation microbatches in corpus order, on the device of its parameters.
    pub fn validation_loss(&self, stage: &Stage) -> Result<f64> {
        let layers = self.model.num_layers();
        if stage.range() != (0..layers) {
            return Err(Error::Invalid(format!(
                "evaluation needs the whole model, layers 0..{layers}; the stage holds {:?}",
                stage.range()
            )));
        }
        let device = stage
            .params()
            .first()
            .map_or(Device::Cpu, |(_, v)| v.device().clone());
        let val = self.data.split(Split::Validation);
        let mut total = 0.0;
        for i in 0..self.cfg.eval_batches {
            let batch = val.sequential_batch(self.cfg.seq_len, self.cfg.microbatch_size, i)?;
            let (inp, tgt) = to_tensors(&batch, &device)?;
            let ctx = ForwardCtx {
                targets: Some(&tgt),
                ..ForwardCtx::inference()
            };
            total += f64::from(stage.forward(&inp, &ctx)?.output.to_scalar::<f32>()?);
        }
        Ok(total / self.cfg.eval_batches as f64)
    }

    /// The planner's analytical profile for microbatches of `microbatch_size` samples on
    /// `device`, one entry per layer of the model.
    pub fn planner_profile(
        &self,
        device: &DeviceSpec,
        microbatch_size: u32,
    ) -> Result<ModelProfile> {
        let shape = self.model_cfg.planner_shape(self.cfg.seq_len)?;
        let profile =
            analytical_profile(&self.cfg.model, &shape, device, microbatch_size, Dtype::F32);
        if profile.layers.len() != self.model.num_layers() {
            return Err(Error::Invalid(format!(
                "the analytical profile of {} has {} layers, the model {}",
                self.cfg.model,
                profile.layers.len(),
                self.model.num_layers()
            )));
        }
        Ok(profile)
    }
}

impl Workload for GptWorkload {
    /// The data's batch shape is the runtime's: `b` and `B` must be the same numbers.
    fn check(&self, spec: &TrainingSpec) -> std::result::Result<(), BoxError> {
        let (b, mb) = (self.cfg.microbatch_size, self.cfg.num_microbatches);
        if b as u64 != u64::from(spec.microbatch_size)
            || mb as u64 != u64::from(spec.global_microbatches)
        {
            return Err(format!(
                "the GPT workload batches {mb} microbatches of {b} samples, the job {} of {}: \
                 build both from the same settings",
                spec.global_microbatches, spec.microbatch_size
            )
            .into());
        }
        Ok(())
    }

    fn name(&self) -> String {
        self.cfg.model.clone()
    }

    fn num_params(&self) -> usize {
        self.model_cfg.num_params()
    }

    fn model(&self) -> &dyn LayeredModel {
        self.model.as_ref()
    }

    fn initial_params(&self, seed: u64) -> ParamSource<'_> {
        match &self.pretrained {
            Some(w) => ParamSource::Tensors(w),
            None => ParamSource::Init { seed },
        }
    }

    fn microbatch(
        &self,
        seed: u64,
        step: u64,
        microbatch: u32,
        device: &Device,
    ) -> std::result::Result<(Tensor, Tensor), BoxError> {
        let batch = self.train_batch(seed, step, microbatch as usize)?;
        Ok(to_tensors(&batch, device)?)
    }

    fn profile(
        &self,
        device: &DeviceSpec,
        microbatch_size: u32,
    ) -> std::result::Result<ModelProfile, BoxError> {
        Ok(self.planner_profile(device, microbatch_size)?)
    }

    fn evaluate(&self, model: &Stage) -> std::result::Result<Option<f64>, BoxError> {
        Ok(Some(self.validation_loss(model)?))
    }

    fn tokens_per_sample(&self) -> usize {
        self.cfg.seq_len
    }

    fn data_cursor(&self, step: u64) -> serde_json::Value {
        serde_json::to_value(self.cursor(step)).expect("a data cursor is two integers")
    }

    fn checkpoint_files(&self) -> Vec<(String, Vec<u8>)> {
        vec![(hf::CONFIG_FILE.into(), hf::config_json(&self.model_cfg))]
    }
}

/// `(inputs, targets)` of `batch` as `[b, t]` u32 tensors on `device`.
pub fn to_tensors(batch: &Batch, device: &Device) -> Result<(Tensor, Tensor)> {
    let shape = (batch.batch_size, batch.seq_len);
    Ok((
        Tensor::from_slice(&batch.inputs, shape, device)?,
        Tensor::from_slice(&batch.targets, shape, device)?,
    ))
}

/// The model: `init_from`'s HF config and weights, else the preset.
fn resolve_model(
    cfg: &GptWorkloadConfig,
) -> Result<(ModelConfig, Option<HashMap<String, Tensor>>)> {
    if let Some(src) = &cfg.init_from {
        let pre = hf::locate(src)?;
        let w = hf::load_weights(&pre.dir, &pre.config)?;
        return Ok((pre.config, Some(w)));
    }
    Ok((cfg.model_config()?, None))
}

/// Opens the corpus and checks it and the batch shape against the model; returns the dataset,
/// the batch shape and the iterations per epoch. The messages name `train`'s flags, the one
/// way most users set these fields.
fn prepare_data(
    cfg: &GptWorkloadConfig,
    model_cfg: &ModelConfig,
) -> Result<(Dataset, BatchSpec, usize)> {
    if cfg.seq_len > model_cfg.max_seq_len() {
        return Err(Error::Invalid(format!(
            "--seq-len {} exceeds the context of {} ({} positions)",
            cfg.seq_len,
            cfg.model,
            model_cfg.max_seq_len()
        )));
    }
    if cfg.eval_batches == 0 {
        return Err(DataError::InvalidRequest("--eval-batches must be at least 1".into()).into());
    }
    let data = data::open_dataset(cfg.dataset.as_deref(), cfg.tokenizer.as_deref())?;
    data.tokenizer().check_vocab(model_cfg.vocab_size())?;
    let spec = BatchSpec {
        seq_len: cfg.seq_len,
        microbatch_size: cfg.microbatch_size,
        num_microbatches: cfg.num_microbatches,
    };
    let iterations_per_epoch = data.split(Split::Train).iterations_per_epoch(&spec)?;
    let val = data.split(Split::Validation);
    if val.num_sequential_batches(cfg.seq_len, cfg.microbatch_size) < cfg.eval_batches {
        return Err(DataError::InvalidRequest(format!(
            "the validation split has {} samples of {} tokens: fewer than --eval-batches {} x \
             --microbatch-size {}",
            val.num_samples(cfg.seq_len),
            cfg.seq_len,
            cfg.eval_batches,
            cfg.microbatch_size
        ))
        .into());
    }
    Ok((data, spec, iterations_per_epoch))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{Gpt2Tokenizer, EMBEDDED_CORPUS};

    const SEED: u64 = 7;

    /// A temp folder holding `corpus.txt`: the first `bytes` of the shipped corpus (whole
    /// lines), so a test tokenizes a few kB, not 5 MB.
    fn small_corpus(bytes: usize) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("temp dir");
        let end = EMBEDDED_CORPUS[..bytes].rfind('\n').expect("a line") + 1;
        let corpus = dir.path().join("corpus.txt");
        std::fs::write(&corpus, &EMBEDDED_CORPUS[..end]).expect("write corpus");
        (dir, corpus)
    }

    /// gpt-tiny (2 blocks of width 64) on `corpus`: 16 tokens x 2 samples x 3 microbatches.
    fn tiny(corpus: &std::path::Path) -> GptWorkloadConfig {
        GptWorkloadConfig {
            model: "gpt-tiny".into(),
            seq_len: 16,
            microbatch_size: 2,
            num_microbatches: 3,
            eval_batches: 2,
            dataset: Some(corpus.to_path_buf()),
            ..GptWorkloadConfig::default()
        }
    }

    fn ids(t: &Tensor) -> Vec<Vec<u32>> {
        t.to_vec2::<u32>().expect("a [b, t] u32 tensor")
    }

    /// The message of `GptWorkload::new(cfg)`, which must fail.
    fn refusal(cfg: GptWorkloadConfig) -> String {
        match GptWorkload::new(cfg) {
            Ok(_) => panic!("the workload should have been refused"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn microbatches_are_the_datasets_across_an_epoch_boundary() {
        let (_dir, corpus) = small_corpus(20_000);
        let w = GptWorkload::new(tiny(&corpus)).expect("workload");
        let direct = Dataset::open_with(&corpus, Arc::new(Gpt2Tokenizer::embedded()), None)
            .expect("dataset");
        let spec = w.batch_spec();
        let ipe = direct
            .split(Split::Train)
            .iterations_per_epoch(&spec)
            .unwrap();
        assert_eq!(w.iterations_per_epoch(), ipe);
        assert!(ipe >= 2, "the corpus gives {ipe} iterations per epoch");
        for step in [0, 1, ipe as u64 - 1, ipe as u64, ipe as u64 + 1] {
            let cursor = DataCursor::at_step(step, ipe);
            for k in 0..spec.num_microbatches {
                let b = direct
                    .split(Split::Train)
                    .microbatch_at(&spec, SEED, cursor, k)
                    .unwrap();
                let (inp, tgt) = w.microbatch(SEED, step, k as u32, &Device::Cpu).unwrap();
                assert_eq!(inp.dims(), [2, 16]);
                assert_eq!(ids(&inp).concat(), b.inputs, "step {step} microbatch {k}");
                assert_eq!(ids(&tgt).concat(), b.targets, "step {step} microbatch {k}");
            }
        }
        // Another seed is another order.
        let a = w.microbatch(SEED, 0, 0, &Device::Cpu).unwrap().0;
        let b = w.microbatch(SEED + 1, 0, 0, &Device::Cpu).unwrap().0;
        assert_ne!(ids(&a), ids(&b));
        let next = serde_json::json!({ "epoch": 1, "iteration": 1 });
        assert_eq!(w.data_cursor(ipe as u64 + 1), next);
    }

    #[test]
    fn the_factory_reads_the_config_back_from_json() {
        let (_dir, corpus) = small_corpus(20_000);
        let cfg = tiny(&corpus);
        let json = serde_json::to_value(&cfg).unwrap();
        let back: GptWorkloadConfig = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(back, cfg);
        let w = GptWorkload::factory(&json).expect("factory");
        assert_eq!(w.name(), "gpt-tiny");
        assert_eq!(w.tokens_per_sample(), 16);
        let preset = ModelConfig::preset("gpt-tiny").unwrap();
        assert_eq!(w.num_params(), preset.num_params());
        assert_eq!(w.model().num_layers(), preset.num_layers());
        assert!(matches!(w.initial_params(3), ParamSource::Init { seed: 3 }));

        // Missing fields are `train`'s defaults; unknown ones are refused by name.
        let partial: GptWorkloadConfig =
            serde_json::from_value(serde_json::json!({ "model": "gpt2" })).unwrap();
        assert_eq!(partial.seq_len, GptWorkloadConfig::default().seq_len);
        let err = GptWorkload::factory(&serde_json::json!({ "seq_length": 16 }))
            .err()
            .expect("an unknown field")
            .to_string();
        assert!(err.contains("seq_length"), "{err}");
    }

    #[test]
    fn a_sequence_longer_than_the_context_is_refused() {
        let (_dir, corpus) = small_corpus(20_000);
        let cfg = GptWorkloadConfig {
            seq_len: 65,
            ..tiny(&corpus)
        };
        let err = refusal(cfg);
        assert!(
            err.contains("--seq-len 65 exceeds the context of gpt-tiny (64 positions)"),
            "{err}"
        );
    }

    #[test]
    fn an_unknown_preset_lists_the_presets() {
        let (_dir, corpus) = small_corpus(20_000);
        let cfg = GptWorkloadConfig {
            model: "gpt-huge".into(),
            ..tiny(&corpus)
        };
        let err = refusal(cfg);
        assert!(
            err.contains("gpt-huge") && err.contains("gpt-mini"),
            "{err}"
        );
    }

    #[test]
    fn too_little_data_is_refused_with_the_numbers() {
        let (_dir, corpus) = small_corpus(20_000);
        let many_evals = GptWorkloadConfig {
            eval_batches: 1000,
            ..tiny(&corpus)
        };
        let err = refusal(many_evals);
        assert!(err.contains("fewer than --eval-batches 1000"), "{err}");
        let huge_batch = GptWorkloadConfig {
            num_microbatches: 100_000,
            ..tiny(&corpus)
        };
        let err = refusal(huge_batch);
        assert!(
            err.contains("one global batch needs 200000 samples"),
            "{err}"
        );
    }

    #[test]
    fn a_job_batching_otherwise_than_the_workload_is_refused() {
        let (_dir, corpus) = small_corpus(20_000);
        let w = GptWorkload::new(tiny(&corpus)).expect("workload");
        let mut spec = TrainingSpec {
            steps: 1,
            seed: 0,
            microbatch_size: 2,
            global_microbatches: 3,
            nodes: 1,
            devices_per_node: 1,
            fault_threshold: 0,
            device: "cpu".into(),
            pipeline_nodes: None,
            optimizer: Default::default(),
            lr: oobleck_core::optim::LrSchedule::constant(1e-3).expect("lr"),
            grad_clip: None,
            checkpoint_every: 0,
            eval_every: 0,
            data_plane: Default::default(),
            inject_failures: Vec::new(),
        };
        w.check(&spec).expect("the same batch");
        spec.global_microbatches = 4;
        let e = w.check(&spec).expect_err("another batch").to_string();
        assert!(
            e.contains("3 microbatches of 2 samples, the job 4 of 2"),
            "{e}"
        );
    }

    #[test]
    fn the_profile_has_one_entry_per_layer() {
        let (_dir, corpus) = small_corpus(20_000);
        let w = GptWorkload::new(tiny(&corpus)).unwrap();
        let cpu = DeviceSpec::named("cpu").expect("the planner knows cpu");
        let p = w.profile(cpu, 2).expect("profile");
        assert_eq!(p.layers.len(), w.model().num_layers());
        p.validate().expect("a valid profile");
        // The model's own planner shape: for a preset, GPT's (ffn = 4d, tied embedding).
        let gpt = oobleck_core::planning::TransformerShape::gpt(2, 64, 4, 50257, 16);
        assert_eq!(p, analytical_profile("gpt-tiny", &gpt, cpu, 2, Dtype::F32));
    }

    #[test]
    fn evaluation_is_the_mean_loss_of_the_first_validation_batches() {
        let (_dir, corpus) = small_corpus(20_000);
        let w = GptWorkload::new(tiny(&corpus)).unwrap();
        let l = w.model().num_layers();
        let whole = |range| {
            let layers = w
                .model()
                .build_layers(range, &Device::Cpu, w.initial_params(SEED))
                .unwrap();
            Stage::new(layers).unwrap()
        };
        let stage = whole(0..l);
        let val = w.dataset().split(Split::Validation);
        let mut expected = 0.0;
        for i in 0..2 {
            let (inp, tgt) =
                to_tensors(&val.sequential_batch(16, 2, i).unwrap(), &Device::Cpu).unwrap();
            let ctx = ForwardCtx {
                targets: Some(&tgt),
                ..ForwardCtx::inference()
            };
            let loss = stage.forward(&inp, &ctx).unwrap().output;
            expected += f64::from(loss.to_scalar::<f32>().unwrap());
        }
        let got = w.evaluate(&stage).unwrap().expect("an evaluation");
        assert_eq!(got, expected / 2.0);
        // A fresh gpt-tiny is near uniform over 50257 tokens: ln(50257) = 10.8.
        assert!((10.0..11.5).contains(&got), "{got}");

        let err = w.evaluate(&whole(1..l)).unwrap_err().to_string();
        assert!(err.contains("whole model"), "{err}");
    }

    #[test]
    fn checkpoints_carry_a_config_json_that_loads_back() {
        let (dir, corpus) = small_corpus(20_000);
        let w = GptWorkload::new(tiny(&corpus)).unwrap();
        let files = w.checkpoint_files();
        assert_eq!(files.len(), 1);
        assert_eq!(files[0].0, "config.json");
        let path = dir.path().join("config.json");
        std::fs::write(&path, &files[0].1).unwrap();
        assert_eq!(&ModelConfig::from_hf_json(&path).unwrap(), w.model_config());
    }

    #[test]
    fn init_from_starts_from_the_pretrained_weights() {
        let (dir, corpus) = small_corpus(20_000);
        let preset = ModelConfig::preset("gpt-tiny").unwrap();
        let model = preset.build().unwrap();
        let layers = model
            .build_layers(
                0..model.num_layers(),
                &Device::Cpu,
                ParamSource::Init { seed: 99 },
            )
            .unwrap();
        let params: HashMap<String, Tensor> = Stage::new(layers)
            .unwrap()
            .params()
            .into_iter()
            .map(|(n, v)| (n, v.as_tensor().clone()))
            .collect();
        let hf_dir = dir.path().join("hf");
        hf::save_pretrained(&hf_dir, &preset, &params).unwrap();
        let cfg = GptWorkloadConfig {
            init_from: Some(hf_dir.display().to_string()),
            ..tiny(&corpus)
        };
        assert_eq!(
            cfg.model_config().unwrap(),
            preset,
            "the config without the weights"
        );
        let w = GptWorkload::new(cfg).unwrap();
        let ParamSource::Tensors(got) = w.initial_params(SEED) else {
            panic!("init_from must give the pretrained tensors");
        };
        assert_eq!(got.len(), params.len());
        let name = "transformer.wte.weight";
        let diff = (got[name].clone() - &params[name]).unwrap().abs().unwrap();
        assert_eq!(diff.max_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    }
}
