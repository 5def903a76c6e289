//! The one error type of `oobleck-models`.

use std::path::PathBuf;

/// Errors of the model library. Variants name the file or preset a reader needs.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Core(#[from] oobleck_core::Error),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Data(#[from] crate::data::DataError),
    #[error("unknown model `{name}`; presets: {known}")]
    UnknownModel { name: String, known: String },
    #[error("{path}: {reason}")]
    BadConfig { path: PathBuf, reason: String },
    #[error("{path}: {reason}")]
    BadWeights { path: PathBuf, reason: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid model config: {0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl From<Error> for oobleck_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Core(e) => e,
            Error::Candle(e) => oobleck_core::Error::Candle(e),
            other => oobleck_core::Error::Msg(other.to_string()),
        }
    }
}
