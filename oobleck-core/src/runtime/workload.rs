//! What a job trains: [`Workload`], implemented by the user next to its [`LayeredModel`], and
//! the [`Factory`] that builds one in every worker process.

use candle_core::{Device, Tensor};

use super::error::BoxError;
use super::spec::TrainingSpec;
use crate::model::{LayeredModel, ParamSource, Stage};
use crate::planning::{DeviceSpec, Dtype, ModelProfile};

/// A model and its data, as the runtime trains it on any plan.
///
/// The runtime builds one in every worker process (through the factory given to
/// [`super::take_over`]) and one in the master; each must describe the same model and
/// data. Implementations are used from one thread at a time but must be `Send + Sync`.
///
/// The training contract (DESIGN.md section 4) rests on [`Workload::microbatch`]: the data
/// of `(step, microbatch)` must depend only on the seed, the step and the index, never on
/// which process asks, so any plan computes the same steps.
pub trait Workload: Send + Sync {
    /// A short name for progress lines and the summary (`"gpt-mini"`).
    fn name(&self) -> String;
    /// Trainable parameters of the whole model.
    fn num_params(&self) -> usize;
    /// The model, as an ordered list of layers.
    fn model(&self) -> &dyn LayeredModel;
    /// Parameter values at step 0: a seeded initialisation (the default) or pretrained ones.
    fn initial_params(&self, seed: u64) -> ParamSource<'_> {
        ParamSource::Init { seed }
    }
    /// Inputs and targets of microbatch `microbatch` (0-based, of the global batch's `B`) of
    /// step `step` (0-based: the step being computed), on `device`.
    fn microbatch(
        &self,
        seed: u64,
        step: u64,
        microbatch: u32,
        device: &Device,
    ) -> std::result::Result<(Tensor, Tensor), BoxError>;
    /// The ids of the samples in microbatch `microbatch` of step `step` (as
    /// [`Workload::microbatch`] numbers them), for the step's sample hash in `metrics.jsonl`
    /// ([`crate::runtime::wire::records::StepData`]): a run can then be checked to train the
    /// same samples at every step, whatever its plan, failures and resumes. `None` (the
    /// default): the workload does not number its samples, and no hash is written.
    fn sample_ids(
        &self,
        seed: u64,
        step: u64,
        microbatch: u32,
    ) -> std::result::Result<Option<Vec<u64>>, BoxError> {
        let _ = (seed, step, microbatch);
        Ok(None)
    }
    /// What the planner needs: per-layer times and sizes for microbatches of
    /// `microbatch_size` samples on `device`, computing in `precision` (the job's
    /// [`TrainingSpec::precision`]: with bf16, activations and parameters count 2 bytes per
    /// element and compute runs at the device's bf16 rate). It must have
    /// [`LayeredModel::num_layers`] layers.
    fn profile(
        &self,
        device: &DeviceSpec,
        microbatch_size: u32,
        precision: Dtype,
    ) -> std::result::Result<ModelProfile, BoxError>;
    /// A held-out loss of the whole model (all layers in `model`); `None`: no evaluation.
    fn evaluate(&self, model: &Stage) -> std::result::Result<Option<f64>, BoxError> {
        let _ = model;
        Ok(None)
    }
    /// Tokens per sample, for the tokens/s of the metrics (1 for models without sequences).
    fn tokens_per_sample(&self) -> usize {
        1
    }
    /// Where the data stream stands after `step` committed steps, for `trainer.json`.
    fn data_cursor(&self, step: u64) -> serde_json::Value {
        serde_json::json!({ "step": step })
    }
    /// Refuses a job whose runtime settings disagree with the workload's own (a workload built
    /// by its caller for another job's batch shape, for instance: its data order depends on
    /// it). The master and every worker call it before training.
    fn check(&self, spec: &TrainingSpec) -> std::result::Result<(), BoxError> {
        let _ = spec;
        Ok(())
    }
    /// Files written beside the tensors of every checkpoint (`config.json` of the Hugging Face
    /// layout, for instance): `(file name, bytes)`.
    fn checkpoint_files(&self) -> Vec<(String, Vec<u8>)> {
        Vec::new()
    }
}

/// Builds a worker's workload from the job's runtime settings ([`super::JobConfig::training`]:
/// the batch shape, [`TrainingSpec::batch`], comes from there alone) and its opaque workload
/// settings ([`super::JobConfig::workload`]).
pub type Factory = dyn Fn(&TrainingSpec, &serde_json::Value) -> std::result::Result<Box<dyn Workload>, BoxError>
    + Send
    + Sync;
