//! What can go wrong while preparing: each variant names the file and the place in it.

use std::path::PathBuf;

use crate::data::DataError;

/// Errors of `oobleck data prepare`.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error("source {pattern} matches no file")]
    NoMatch { pattern: String },
    #[error("source {path} does not exist")]
    NotFound { path: PathBuf },
    #[error("bad glob pattern {pattern}: {problem}")]
    BadPattern { pattern: String, problem: String },
    #[error(
        "{path}: unknown format (expected .txt, .md, .jsonl or .json, each optionally \
         compressed as .gz or .zst, or .parquet)"
    )]
    UnknownFormat { path: PathBuf },
    /// A source that could not be opened or read (gone, unreadable, an I/O error).
    #[error("{path}: cannot read: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A compressed source whose stream ends early or does not decode.
    #[error(
        "{path}: {codec} stream is truncated or corrupt after {offset} decompressed bytes: \
         {source}"
    )]
    Decompress {
        path: PathBuf,
        codec: &'static str,
        offset: u64,
        source: std::io::Error,
    },
    /// `offset` counts bytes of the (decompressed) text from its start.
    #[error("{path}: not UTF-8 text (invalid byte sequence at byte {offset}{at_line})")]
    NotUtf8 {
        path: PathBuf,
        offset: u64,
        /// ", line N" for JSONL, empty for a text file.
        at_line: String,
    },
    /// A JSONL record that is no JSON object with the text field; `--skip-bad-records` skips it.
    #[error("{path}, line {line}: {problem} (pass --skip-bad-records to skip such records)")]
    BadRecord {
        path: PathBuf,
        line: u64,
        problem: String,
    },
    /// A Parquet row whose text is null or not UTF-8; `--skip-bad-records` skips it.
    #[error(
        "{path}, row {row} (counting from 0): {problem} (pass --skip-bad-records to skip such \
         records)"
    )]
    BadRow {
        path: PathBuf,
        row: u64,
        problem: String,
    },
    #[error("{path}: no column \"{column}\" (columns: {columns}); pass --text-field NAME")]
    NoColumn {
        path: PathBuf,
        column: String,
        columns: String,
    },
    /// A Parquet file that does not decode (corrupt, truncated, a codec not built in).
    #[error("{path}: cannot read as Parquet: {problem}")]
    Parquet { path: PathBuf, problem: String },
    #[error(
        "the sources hold no documents: nothing to prepare{}",
        if *skipped_records > 0 {
            format!(
                " (all {skipped_records} records were bad and skipped by --skip-bad-records: \
                 is the text under another field? pass --text-field NAME)"
            )
        } else {
            String::new()
        }
    )]
    Empty { skipped_records: u64 },
    /// The output folder holds a preparation of something else; resuming would mix the two.
    #[error(
        "{dir} was prepared with a different {what} (there: {was}; now: {now}); pass another \
         --out, or remove {dir} to start over"
    )]
    Mismatch {
        dir: PathBuf,
        what: String,
        was: String,
        now: String,
    },
    #[error("{path}: not a manifest of `oobleck data prepare`: {problem}")]
    BadManifest { path: PathBuf, problem: String },
    #[error("{path}: cannot write: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what} must be at least 1")]
    Zero { what: &'static str },
    #[error(transparent)]
    Data(#[from] DataError),
}

/// Result of preparation.
pub type Result<T> = std::result::Result<T, PrepareError>;

pub(crate) fn write_err(
    path: &std::path::Path,
) -> impl FnOnce(std::io::Error) -> PrepareError + '_ {
    move |source| PrepareError::Write {
        path: path.to_path_buf(),
        source,
    }
}

pub(crate) fn read_err(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> PrepareError + '_ {
    move |source| match source.kind() {
        std::io::ErrorKind::NotFound => PrepareError::NotFound {
            path: path.to_path_buf(),
        },
        _ => PrepareError::Read {
            path: path.to_path_buf(),
            source,
        },
    }
}
