//! The one error type of `oobleck-core`.

use std::ops::Range;
use std::path::PathBuf;

use oobleck_comm::Rank;

/// Errors of the engine library.
///
/// Variants carry the ids and numbers a reader needs (which parameter, which pipeline and
/// stage, which layers, the value given and the one wanted), so a log line says what to fix.
/// Candle's and the data plane's own errors are wrapped whole. (The planner's and the control
/// plane's errors reach users through [`crate::runtime::RuntimeError`], not through this type.)
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tensor operation failed inside Candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A data-plane operation failed (timeout, lost peer, abort): the step cannot commit.
    #[error(transparent)]
    Comm(#[from] oobleck_comm::CommError),
    /// A file-system call on `path` failed.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },

    /// An error from user code (a model's layers, a workload's data or evaluation), as text.
    /// The library itself never returns it; new code should prefer [`Error::Workload`], which
    /// keeps the source error.
    #[error("{0}")]
    Msg(String),
    /// An error from user code (a model's layers, a workload's data or evaluation), kept whole
    /// so its source chain survives. Build it with [`Error::workload`].
    #[error(transparent)]
    Workload(Box<dyn std::error::Error + Send + Sync>),

    /// A layer profile cannot be measured as asked (`what`: the request or the measurement).
    #[error("profiling {model}: {reason}")]
    Profile { model: String, reason: String },
    /// A scalar argument or config value outside its domain (`op` is the function or config
    /// that checks it, `want` the condition it fails).
    #[error("{op}: {name} = {value} must be {want}")]
    InvalidArgument {
        op: &'static str,
        name: &'static str,
        value: f64,
        want: &'static str,
    },
    /// A learning-rate schedule that breaks `0 <= min_lr <= max_lr` (finite) or
    /// `warmup_steps <= total_steps`.
    #[error(
        "lr schedule: {reason} (max_lr {max_lr}, min_lr {min_lr}, warmup_steps {warmup_steps}, \
         total_steps {total_steps})"
    )]
    LrSchedule {
        reason: &'static str,
        max_lr: f64,
        min_lr: f64,
        warmup_steps: u64,
        total_steps: u64,
    },
    /// A parameter's gradient, optimizer state or configuration is unusable.
    #[error("optimizer: parameter `{name}`: {reason}")]
    Optimizer { name: String, reason: String },

    /// A layer range that is empty or reaches past the model's `layers` layers.
    #[error("layer range {start}..{end} is not a non-empty range inside 0..{layers}")]
    LayerRange {
        start: usize,
        end: usize,
        layers: usize,
    },
    /// The layers given to a stage are empty or not consecutive (their indices, in order).
    #[error("a stage needs a non-empty run of consecutive layers, got layers {indices:?}")]
    StageLayers { indices: Vec<usize> },
    /// A tied parameter lists no layers, or a layer the model does not have.
    #[error(
        "a tied parameter lists layers {layers:?}; it needs at least one, each below the \
         model's {num_layers}"
    )]
    TiedLayers {
        layers: Vec<usize>,
        num_layers: usize,
    },
    /// A tensor expected for parameter `name` is absent.
    #[error("missing parameter `{name}` (expected shape {shape:?})")]
    MissingParameter { name: String, shape: Vec<usize> },
    /// A tensor given for parameter `name` has the wrong shape.
    #[error("parameter `{name}` has shape {found:?}, the model config expects {expected:?}")]
    ParameterShape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    /// A parameter the stage holds got no gradient (`when` says at which point it was needed).
    #[error("no gradient for parameter `{name}` {when}")]
    MissingGradient { name: String, when: &'static str },
    /// A tensor passed between stages, devices or the data source has the wrong shape.
    #[error("{what} has shape {found:?}; expected {expected}")]
    Shape {
        what: String,
        found: Vec<usize>,
        expected: String,
    },
    /// A buffer from the data plane holds another element type than the one expected.
    #[error("expected a {expected:?} tensor from the data plane, got {found:?}")]
    DataPlaneDType {
        expected: oobleck_comm::DType,
        found: oobleck_comm::DType,
    },

    /// A layout for a model of no layers, or with no pipelines.
    #[error("execution layout: needs at least one layer and one pipeline, got {num_layers} layers and {pipelines} pipelines")]
    EmptyLayout { num_layers: usize, pipelines: usize },
    /// A pipeline whose stages do not tile the model's layers with non-empty consecutive ranges.
    #[error(
        "execution layout: pipeline {pipeline}'s stages hold layers {stages:?}; they must cover \
         0..{num_layers} with non-empty consecutive ranges"
    )]
    PipelineLayers {
        pipeline: usize,
        stages: Vec<Range<usize>>,
        num_layers: usize,
    },
    /// A stage of a layout with no devices.
    #[error("execution layout: pipeline {pipeline} stage {stage} has no devices")]
    NoDevices { pipeline: usize, stage: usize },
    /// A rank listed in two stages of a layout.
    #[error("execution layout: rank {rank} holds more than one stage")]
    DuplicateRank { rank: Rank },
    /// The pipelines' microbatch runs (in pipeline order) do not partition `0..total` with at
    /// least one microbatch each.
    #[error(
        "execution layout: pipelines run microbatches {runs:?}; they must cover 0..{total} in \
         pipeline order with at least one each"
    )]
    PipelineMicrobatches { runs: Vec<Range<u64>>, total: u32 },
    /// A plan whose pipeline cannot be laid out (a template it lacks, a stage wider than a node).
    #[error("plan: pipeline {pipeline} {reason}")]
    PlanPipeline { pipeline: u32, reason: String },
    /// A layout built for a model of another depth.
    #[error("layout has {layout_layers} layers, the model {model_layers}")]
    LayoutDepth {
        layout_layers: usize,
        model_layers: usize,
    },
    /// A rank asked to work in a layout that gives it no stage.
    #[error("rank {rank} holds no stage in the layout")]
    RankNotInLayout { rank: Rank },
    /// A stage split over more devices than a microbatch has rows.
    #[error(
        "pipeline {pipeline} stage {stage} has {devices} devices; a microbatch of \
         {microbatch_size} samples cannot give each a row"
    )]
    StageTooWide {
        pipeline: usize,
        stage: usize,
        devices: usize,
        microbatch_size: u32,
    },
    /// The stage holding `layers` broke an invariant of its 1F1B schedule or of its overlapped
    /// gradient sync: a bug in the schedule or the layout, not bad input.
    #[error("stage of layers {layers:?}: {reason}")]
    Schedule {
        layers: Range<usize>,
        reason: String,
    },

    /// A checkpoint file could not be encoded.
    #[error("{path}: cannot serialise: {source}")]
    Encode {
        path: PathBuf,
        source: serde_json::Error,
    },
    /// A tensor that cannot go into checkpoint file `file` (empty or repeated name, a dtype
    /// safetensors cannot hold).
    #[error("{file}: tensor `{name}`: {reason}")]
    UnsavableTensor {
        file: &'static str,
        name: String,
        reason: String,
    },
    /// A caller's extra file for checkpoint `checkpoint` is named so that it would land outside
    /// the checkpoint's directory, shadow one of its own files or look like a save in progress.
    #[error(
        "{checkpoint}: extra checkpoint file `{name}` must be a plain file name other than {}, \
         {} and {}, not starting with `.tmp-`",
        crate::checkpoint::MODEL_FILE,
        crate::checkpoint::OPTIMIZER_FILE,
        crate::checkpoint::TRAINER_FILE
    )]
    ExtraFileName { checkpoint: PathBuf, name: String },
    /// A checkpoint file's bytes do not hash to the checksum recorded for it.
    #[error("{path}: checksum mismatch: expected sha256 {expected}, found {actual}")]
    Checksum {
        path: PathBuf,
        expected: String,
        actual: String,
    },
    /// A checkpoint is missing a file, truncated, or holds something unreadable.
    #[error("{path}: corrupt checkpoint: {reason}")]
    CorruptCheckpoint { path: PathBuf, reason: String },
    /// Refused to replace a complete checkpoint that is already on disk.
    #[error("{path}: a checkpoint already exists here; refusing to overwrite it")]
    CheckpointExists { path: PathBuf },
}

impl Error {
    /// Wraps an error of user code (a workload's data or evaluation) as [`Error::Workload`];
    /// a `String` or `&str` works too.
    pub fn workload(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Workload(e.into())
    }
}

pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workload_errors_keep_their_text_and_source() {
        assert_eq!(
            Error::workload("shard 3 is empty").to_string(),
            "shard 3 is empty"
        );
        let io = std::io::Error::other("disk gone");
        let e = Error::workload(Error::Io {
            path: "data/train.bin".into(),
            source: io,
        });
        assert_eq!(e.to_string(), "data/train.bin: disk gone");
        let source = std::error::Error::source(&e).expect("the wrapped error's source");
        assert_eq!(source.to_string(), "disk gone");
    }
}
