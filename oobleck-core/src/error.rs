//! The one error type of `oobleck-core`.

/// Errors of the engine library.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Plan(#[from] crate::planning::PlanError),
    #[error(transparent)]
    Elastic(#[from] crate::elastic::ElasticError),
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Msg(String),
    /// A data-plane operation failed (timeout, lost peer, abort): the step cannot commit.
    #[error(transparent)]
    Comm(#[from] oobleck_comm::CommError),
    /// A parameter's gradient, optimizer state or configuration is unusable.
    #[error("optimizer: parameter `{name}`: {reason}")]
    Optimizer { name: String, reason: String },
    /// A checkpoint file's bytes do not hash to the checksum recorded for it.
    #[error("{path}: checksum mismatch: expected sha256 {expected}, found {actual}")]
    Checksum {
        path: std::path::PathBuf,
        expected: String,
        actual: String,
    },
    /// A checkpoint is missing a file, truncated, or holds something unreadable.
    #[error("{path}: corrupt checkpoint: {reason}")]
    CorruptCheckpoint {
        path: std::path::PathBuf,
        reason: String,
    },
    /// Refused to replace a complete checkpoint that is already on disk.
    #[error("{path}: a checkpoint already exists here; refusing to overwrite it")]
    CheckpointExists { path: std::path::PathBuf },
}

pub type Result<T> = std::result::Result<T, Error>;
