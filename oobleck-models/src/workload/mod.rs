//! The shipped models on the job runtime: a GPT-2/GPT-3/OPT model trained on a token corpus,
//! as an [`oobleck_core::runtime::Workload`].
//!
//! ```text
//!  GptWorkloadConfig (JSON in JobConfig::workload) ─┬─► GptWorkload::factory, on every process
//!  TrainingSpec::batch (b, B; JobConfig::training) ──┘
//!    model / init_from ──► ModelConfig ──► Arc<dyn LayeredModel> (+ HF weights)
//!    dataset / tokenizer ──► data::Dataset ──► microbatch (seed, step, k) ──► [b, t] u32 tensors
//! ```
//!
//! The batch shape is the job's alone: the settings here do not repeat it.
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
use oobleck_core::planning::{DeviceSpec, Dtype, ModelProfile};
use oobleck_core::runtime::{BatchShape, BoxError, TrainingSpec, Workload};
use serde::{Deserialize, Serialize};

use crate::data::{self, Batch, BatchSpec, DataCursor, DataError, Dataset, Gpt2Tokenizer, Split};
use crate::{hf, Error, ModelConfig, Result};

mod profile;

/// What to train: the model and its data. The job runtime carries it as opaque JSON
/// (`JobConfig::workload`) to every process, whose [`GptWorkload::factory`] reads it back.
/// Missing fields take the defaults of `train` (the values below). The batch shape is not
/// here: it is the job's ([`TrainingSpec::batch`]), given to [`GptWorkload::new`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// Validation microbatches (of the job's `b` samples) per evaluation: the first ones in
    /// corpus order, so losses compare across steps and runs. Default 4.
    pub eval_batches: usize,
    /// Training and validation data: paths every node must have (UTF-8 text files, or
    /// pre-tokenized shards: a file, a Megatron pair or prefix, a folder, or a glob expanded on
    /// each node; see [`data::resolve_source`]), blended by weight, with the held-out share or
    /// the validation source, and how a shard with no header is read (see [`data::DataSpec`]).
    /// Default: the built-in corpus (`datasets/shakespeare.txt`, compiled in), 5% held out.
    pub data: data::DataSpec,
    /// GPT-2 tokenizer: `tokenizer.json`, or a directory with `encoder.json` + `vocab.bpe`.
    /// Default none: with `init_from`, the tokenizer its directory ships (see
    /// [`GptWorkloadConfig::tokenizer_path`]); else the built-in GPT-2 tokenizer.
    pub tokenizer: Option<PathBuf>,
    /// Where the planner's profile comes from: `analytical` (the default: estimated from the
    /// shape and the device's table rates), `measured` (on a CPU job: every layer measured on
    /// this machine, or reused from the profile cache; other devices stay analytical, their
    /// presets are too big to measure here), or the path of a profile JSON (`oobleck profile
    /// --out`), which must be for this job's microbatch and dtype.
    pub profile: String,
    /// Worker processes that share this machine's cores while the job trains (a local cluster
    /// of `N` nodes of `G` devices: `N * G`; a node of a multi-machine job: `G`). A measured CPU
    /// profile times the layers as that many ranks run them: as many copies at once, each with
    /// its share of the cores. Default 1: one process owns the machine (`--nodes 1`,
    /// `oobleck profile`).
    pub host_ranks: usize,
    /// This machine's memory, bytes, as the user gave it (`train --host-memory`): a measured
    /// profile is taken within it. Default none: what this process may use, read from the
    /// machine ([`HostMemory::of_this_machine`]).
    pub host_memory_bytes: Option<u64>,
}

impl Default for GptWorkloadConfig {
    fn default() -> Self {
        Self {
            model: "gpt-mini".into(),
            init_from: None,
            seq_len: 64,
            eval_batches: 4,
            data: data::DataSpec::default(),
            tokenizer: None,
            profile: "analytical".into(),
            host_ranks: 1,
            host_memory_bytes: None,
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

    /// The tokenizer to use (`None`: the built-in GPT-2 one). The ids must be those the model
    /// was trained with, so with `init_from` and no `tokenizer`, the model directory's own
    /// tokenizer is used (`tokenizer.json`, or `vocab.json` + `merges.txt`: what Hugging Face
    /// repositories and this project's checkpoints hold). A directory without one is a GPT-2
    /// model on OpenAI's ids, the built-in tokenizer's; an OPT directory without one is
    /// refused, since OPT's ids are not GPT-2's (see `datasets/README.md`).
    pub fn tokenizer_path(&self) -> Result<Option<PathBuf>> {
        let pretrained = match &self.init_from {
            Some(src) if self.tokenizer.is_none() => Some(hf::locate(src)?),
            _ => None,
        };
        self.tokenizer_of(pretrained.as_ref())
    }

    /// [`Self::tokenizer_path`] with `init_from` already located.
    fn tokenizer_of(&self, pretrained: Option<&hf::Pretrained>) -> Result<Option<PathBuf>> {
        if self.tokenizer.is_some() {
            return Ok(self.tokenizer.clone());
        }
        let Some(pre) = pretrained else {
            return Ok(None);
        };
        if let Some(path) = Gpt2Tokenizer::in_model_dir(&pre.dir) {
            return Ok(Some(path));
        }
        match pre.config {
            ModelConfig::Gpt(_) => Ok(None),
            ModelConfig::Opt(_) => Err(Error::BadConfig {
                path: pre.dir.clone(),
                reason: "an OPT model with no tokenizer beside it (tokenizer.json, or vocab.json \
                         + merges.txt). OPT checkpoints number their tokens with OPT's own ids, \
                         not the built-in GPT-2 tokenizer's (\"Hello\" is 31414 in OPT, 15496 in \
                         GPT-2), so training on GPT-2's ids would scramble what it learned: copy \
                         the tokenizer files that came with the model into this directory, or \
                         name them with --tokenizer (datasets/gpt2-tokenizer for an OPT model \
                         trained from scratch on GPT-2's ids)"
                    .into(),
            }),
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
    /// What is trained, in words (see [`Workload::name`]).
    description: String,
    /// The job's global batch ([`TrainingSpec::batch`]): `spec` is it with `seq_len`.
    batch: BatchShape,
    /// The profiles [`Workload::profile`] gave, by device, microbatch and precision: the job
    /// asks more than once (to check the plan before anything starts, then to plan), and a
    /// measured profile is measured, or read from the cache and said, once.
    profiles: std::sync::Mutex<Vec<(String, ModelProfile)>>,
}

impl GptWorkload {
    /// Resolves the model (a preset, or `init_from` with its weights), opens the corpus and
    /// checks them against each other and the job's `batch` ([`TrainingSpec::batch`]): the
    /// sequence fits the context, the tokenizer fits the vocabulary, the training split holds
    /// a global batch and the validation split the evaluation batches.
    pub fn new(cfg: GptWorkloadConfig, batch: BatchShape) -> Result<Self> {
        let located = cfg.init_from.as_deref().map(hf::locate).transpose()?;
        let model_cfg = match &located {
            Some(pre) => pre.config.clone(),
            None => cfg.model_config()?,
        };
        // Tokenizer and data first: a refusal there comes before reading the weights.
        let tokenizer = cfg.tokenizer_of(located.as_ref())?;
        let (data, spec, iterations_per_epoch) =
            prepare_data(&cfg, batch, &model_cfg, tokenizer.as_deref())?;
        let pretrained = located
            .map(|pre| hf::load_weights(&pre.dir, &pre.config))
            .transpose()?;
        let model = model_cfg.build()?;
        let description = describe(&cfg, &model_cfg, data.tokenizer().vocab_size());
        Ok(Self {
            cfg,
            model_cfg,
            model,
            pretrained,
            data,
            spec,
            iterations_per_epoch,
            description,
            batch,
            profiles: Default::default(),
        })
    }

    /// The runtime's factory (`oobleck_core::runtime::Factory`): reads a
    /// [`GptWorkloadConfig`] from the job's workload JSON and builds the workload for the
    /// batch of the job's `spec`. Settings that carry a batch shape (`microbatch_size`,
    /// `num_microbatches`: a master built before the job's spec alone held it) are refused,
    /// saying so: master and workers must be one build.
    pub fn factory(
        spec: &TrainingSpec,
        config: &serde_json::Value,
    ) -> std::result::Result<Box<dyn Workload>, BoxError> {
        if let Some(field) = REMOVED_BATCH_FIELDS
            .iter()
            .find(|f| config.get(**f).is_some())
        {
            return Err(format!(
                "the GPT workload's settings carry `{field}`, which the job's training spec \
                 alone holds now: the master that sent them is an older build than this worker; \
                 run one build of oobleck on every node"
            )
            .into());
        }
        let cfg: GptWorkloadConfig = serde_json::from_value(config.clone())
            .map_err(|e| format!("the GPT workload's settings: {e}"))?;
        Ok(Box::new(Self::new(cfg, spec.batch())?))
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

    /// The job's global batch this workload was built for.
    pub fn batch(&self) -> BatchShape {
        self.batch
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
            let batch = val.sequential_batch(self.cfg.seq_len, self.spec.microbatch_size, i)?;
            let (inp, tgt) = to_tensors(&batch, &device)?;
            let ctx = ForwardCtx {
                targets: Some(&tgt),
                ..ForwardCtx::inference()
            };
            total += f64::from(stage.forward(&inp, &ctx)?.output.to_scalar::<f32>()?);
        }
        Ok(total / self.cfg.eval_batches as f64)
    }
}

impl Workload for GptWorkload {
    /// The workload was built for this job's batch: the factory builds it from the spec, but
    /// the master's is built by its caller, which could pass another job's.
    fn check(&self, spec: &TrainingSpec) -> std::result::Result<(), BoxError> {
        let (mine, job) = (self.batch, spec.batch());
        if mine != job {
            return Err(format!(
                "the GPT workload was built for {} microbatches of {} samples, the job has {} of \
                 {}: build it from the job's TrainingSpec::batch",
                mine.global_microbatches,
                mine.microbatch_size,
                job.global_microbatches,
                job.microbatch_size
            )
            .into());
        }
        Ok(())
    }

    /// What is trained: the preset (`gpt-mini`), or with `init_from` the model's reference and
    /// shape (`DIR (gpt2: 5 blocks, hidden 64, 4 heads, vocabulary 50257 ids)`), and, when the model
    /// has more embedding rows than the tokenizer has ids, how many are padding.
    fn name(&self) -> String {
        self.description.clone()
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

    /// The windows of the microbatch, numbered within the training split (a blend's: after
    /// the windows of the sources before its own; see [`Batch::sample_ids`]), found without
    /// reading their tokens: the worker that calls it reads them once, in `microbatch`.
    fn sample_ids(
        &self,
        seed: u64,
        step: u64,
        microbatch: u32,
    ) -> std::result::Result<Option<Vec<u64>>, BoxError> {
        let cursor = self.cursor(step);
        let train = self.data.split(Split::Train);
        let ids = train.microbatch_ids(
            &self.spec,
            seed,
            cursor.epoch,
            cursor.iteration,
            microbatch as usize,
        )?;
        Ok(Some(ids.into_iter().map(|i| i as u64).collect()))
    }

    fn profile(
        &self,
        device: &DeviceSpec,
        microbatch_size: u32,
        precision: Dtype,
    ) -> std::result::Result<ModelProfile, BoxError> {
        Ok(self.profile_for(device, microbatch_size, precision)?)
    }

    fn evaluate(&self, model: &Stage) -> std::result::Result<Option<f64>, BoxError> {
        Ok(Some(self.validation_loss(model)?))
    }

    fn tokens_per_sample(&self) -> usize {
        self.cfg.seq_len
    }

    /// The data position and the identity of the data (`tokens_sha256`; a blend adds each
    /// source's under `sources`), which `--resume` compares with the data it is given.
    fn data_cursor(&self, step: u64) -> serde_json::Value {
        let mut v = serde_json::to_value(self.cursor(step)).expect("a data cursor is two integers");
        v["tokens_sha256"] = self.data.tokens_sha256().into();
        let sources = self.data.source_identities();
        if sources.len() > 1 {
            // A blend also records each source's identity, so that `--resume` can say which
            // of them changed.
            v["sources"] = sources
                .iter()
                .map(|(path, sha)| serde_json::json!({"data": path, "tokens_sha256": sha}))
                .collect();
        }
        v
    }

    /// `config.json` and the tokenizer's files: the checkpoint is a Hugging Face model
    /// directory that names the ids it was trained with (`--init-from` it reads them back).
    fn checkpoint_files(&self) -> Vec<(String, Vec<u8>)> {
        let mut files = vec![(hf::CONFIG_FILE.into(), hf::config_json(&self.model_cfg))];
        let tokenizer = self.data.tokenizer().files();
        files.extend(tokenizer.into_iter().map(|(n, b)| (n.into(), b.to_vec())));
        files
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

/// Fields of [`GptWorkloadConfig`] that held the batch shape before the job's spec alone did.
const REMOVED_BATCH_FIELDS: [&str; 2] = ["microbatch_size", "num_microbatches"];

/// [`GptWorkload`]'s name: the preset or `init_from` with its shape, and the padding rows.
fn describe(cfg: &GptWorkloadConfig, model: &ModelConfig, tokenizer_vocab: usize) -> String {
    let padding = model.vocab_size().saturating_sub(tokenizer_vocab);
    let note = match padding {
        0 => String::new(),
        n => format!(", {n} of them padding beyond the tokenizer's {tokenizer_vocab}"),
    };
    match &cfg.init_from {
        Some(src) => format!("{src} ({}{note})", model.shape_summary()),
        None if padding == 0 => cfg.model.clone(),
        None => format!(
            "{} (vocabulary {} ids{note})",
            cfg.model,
            model.vocab_size()
        ),
    }
}

/// Opens the corpus and checks it and the batch shape against the model; returns the dataset,
/// the batch shape and the iterations per epoch. The messages name `train`'s flags, the one
/// way most users set these fields.
fn prepare_data(
    cfg: &GptWorkloadConfig,
    batch: BatchShape,
    model_cfg: &ModelConfig,
    tokenizer: Option<&std::path::Path>,
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
    let data = data::open_data(&cfg.data, tokenizer)?;
    // More model rows than tokenizer ids is padding (OPT's), said in the workload's name; a
    // shard's ids must all be the tokenizer's.
    data.check_vocab(model_cfg.vocab_size())?;
    let spec = BatchSpec {
        seq_len: cfg.seq_len,
        microbatch_size: batch.microbatch_size as usize,
        num_microbatches: batch.global_microbatches as usize,
    };
    let iterations_per_epoch = data.split(Split::Train).iterations_per_epoch(&spec)?;
    let val = data.split(Split::Validation);
    if val.num_sequential_batches(cfg.seq_len, spec.microbatch_size) < cfg.eval_batches {
        return Err(DataError::InvalidRequest(format!(
            "the validation split has {} samples of {} tokens: fewer than --eval-batches {} x \
             --microbatch-size {}",
            val.num_samples(cfg.seq_len),
            cfg.seq_len,
            cfg.eval_batches,
            spec.microbatch_size
        ))
        .into());
    }
    Ok((data, spec, iterations_per_epoch))
}

#[cfg(test)]
mod tests;
