//! Corpus, GPT-2 tokenizer, on-disk token cache and deterministic batches.
//!
//! [`open_dataset`] / [`open_tokenizer`] take a user's path or `None` for the built-in corpus
//! and tokenizer, which are compiled in from `datasets/` (embedded.rs): a node running the
//! default job needs no files beside its binary.
//!
//! ```text
//!  datasets/shakespeare.txt ──┐
//!                             ├─ tokenize once ─> <corpus>.tokens (u16 LE, header with the
//!  datasets/gpt2-tokenizer/ ──┘   (corpus.rs)      corpus + tokenizer hashes; mmap'd)
//!                                                          │
//!        split: 5% of documents held out = validation (holdout.rs, runs.rs);
//!               a single text file (one document): its last 5% of tokens
//!                                                          │
//!  (seed, epoch, split) ─> keyed Feistel bijection of the split's windows of seq_len + 1
//!                          tokens, computed per position: sample = order.at(p)   (order.rs)
//!  iteration t  ─> positions [t*B*b, (t+1)*B*b) of that epoch's order
//!  microbatch k ─> positions [k*b, (k+1)*b) of the iteration          (batches.rs)
//!
//!  --data W:SRC ... ─> Megatron's blend rule as a function of the global sample index:
//!                      i ─> (source, index within the source)             (blend.rs)
//!                      each source walks its own epochs            (dataset.rs, batches.rs)
//! ```
//!
//! Data order depends only on `(seed, epoch, iteration, microbatch)` and the corpus/tokenizer
//! bytes, never on which process asks (DESIGN.md section 4): every pipeline can compute its own
//! microbatches, and a replayed iteration after a failure sees exactly the same samples. The
//! order holds nothing per sample (an epoch's order is 64 bytes), so it does not grow with the
//! corpus.

mod batches;
mod blend;
mod cache_dirs;
mod corpus;
mod dataset;
mod embedded;
mod holdout;
mod order;
pub mod prepare;
mod prepared;
mod runs;
mod shards;
mod source;
mod spec;
mod tokenizer;
mod tokens;
mod vocab_checked;

pub use batches::{Batch, BatchSpec, DataCursor, Split, SplitData, VALIDATION_PER_MILLE};
pub use blend::{Blend, BlendIter, BlendPick, BLEND_RESOLUTION};
pub use cache_dirs::{default_cache_dirs, shared_cache_dirs};
pub use corpus::{TokenCache, CACHE_FORMAT_VERSION};
pub use dataset::Dataset;
pub use embedded::{
    open_dataset, open_tokenizer, EMBEDDED_CORPUS, EMBEDDED_CORPUS_NAME, EMBEDDED_TOKENIZER_NAME,
};
pub use holdout::{fraction_millionths, HeldOut, DEFAULT_VAL_FRACTION, MIN_HELD_OUT_DOCUMENTS};
pub use order::EpochOrder;
pub use shards::{
    open_llmc, open_megatron, open_raw_u16, open_shard, DelimiterPlacement, DocumentBoundaries,
    Documents, FirstWord, FormatHint, ShardError, ShardFormat, TokenDtype, TokenShard,
    LLMC_HEADER_BYTES, LLMC_MAGIC_U16, LLMC_MAGIC_U32, MEGATRON_INDEX_MAGIC,
};
pub use source::{resolve_source, DataSource};
pub use spec::{open_data, DataSpec, WeightedSource};
pub use tokenizer::{Gpt2Tokenizer, END_OF_TEXT, END_OF_TEXT_ID, GPT2_VOCAB_SIZE};
pub use tokens::{shards_sha256, ShardSet, FULL_HASH_LIMIT};

use std::path::{Path, PathBuf};

/// File name of the shipped corpus inside `datasets/`.
pub const DEFAULT_CORPUS_FILE: &str = "shakespeare.txt";
/// Folder of the shipped GPT-2 tokenizer inside `datasets/`.
pub const DEFAULT_TOKENIZER_DIR: &str = "gpt2-tokenizer";

/// Errors of the data pipeline. Each names the file (or split) and the problem.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{what} {path} does not exist")]
    NotFound { what: &'static str, path: PathBuf },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not UTF-8 text (invalid byte sequence at byte {offset})")]
    NotUtf8 { path: PathBuf, offset: usize },
    #[error("{path}: expected a UTF-8 text file, found a folder")]
    NotAFile { path: PathBuf },
    #[error("{path}: corpus is empty")]
    EmptyCorpus { path: PathBuf },
    /// A `--data` glob or folder that names no file.
    #[error("{pattern}: {why}")]
    NoMatch { pattern: PathBuf, why: &'static str },
    #[error("{path}: bad tokenizer file: {problem}")]
    BadTokenizer { path: PathBuf, problem: String },
    #[error("tokenizer failed on {what}: {message}")]
    Tokenize { what: String, message: String },
    /// The tokenizer has more ids than the model has embedding rows. Fewer is fine: the rows
    /// past the tokenizer's ids are padding (see [`Gpt2Tokenizer::check_vocab`]).
    #[error(
        "tokenizer {path} has {tokenizer_vocab} token ids but the model has only {model_vocab} \
         embedding rows (vocab_size), so some ids would have no row; use the model's own \
         tokenizer, or a model with at least {tokenizer_vocab} rows (any rows beyond the \
         tokenizer's ids are padding)"
    )]
    VocabMismatch {
        path: PathBuf,
        tokenizer_vocab: usize,
        model_vocab: usize,
    },
    #[error("token id {id} does not fit the u16 token cache (vocabulary of {vocab} tokens)")]
    VocabTooLarge { id: u32, vocab: usize },
    #[error(
        "no writable cache location for the tokens of {corpus}; tried: {tried}. \
         Pass a writable cache directory (or set OOBLECK_CACHE_DIR)"
    )]
    NoWritableCache { corpus: PathBuf, tried: String },
    #[error(
        "{split} split of {corpus} is too small: {tokens} tokens give {samples} samples of \
         seq_len {seq_len} + 1, but one global batch needs {needed} samples"
    )]
    TooSmall {
        corpus: PathBuf,
        split: Split,
        tokens: usize,
        samples: usize,
        seq_len: usize,
        needed: usize,
    },
    /// A pre-tokenized shard (llm.c, nanoGPT raw, Megatron) that is not what it should be.
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// A blend weight that cannot be a share of the blend (see [`Blend::new`]).
    #[error("blend weight {weight} of source {index}: {problem}")]
    BadBlendWeight {
        index: usize,
        weight: f64,
        problem: &'static str,
    },
    /// Raw documents (`--data corpus.jsonl`) that could not be prepared into the data cache.
    #[error("preparing {path} for training: {error}{hint}")]
    Prepare {
        path: PathBuf,
        error: Box<prepare::PrepareError>,
        /// How to prepare with other settings, after an error about a record or the column.
        hint: &'static str,
    },
    #[error("a blend needs at least one source")]
    EmptyBlend,
    /// A folder `oobleck data prepare` wrote that does not agree with its manifest.
    #[error("{dir}: {problem}")]
    Prepared { dir: PathBuf, problem: String },
    #[error("invalid batch request: {0}")]
    InvalidRequest(String),
}

impl DataError {
    /// [`DataError::Prepare`] of the raw source `path`.
    pub fn prepare(path: &Path, error: prepare::PrepareError) -> Self {
        use prepare::PrepareError as E;
        let hint = match error {
            E::BadRecord { .. } | E::BadRow { .. } | E::NoColumn { .. } => {
                ". `train --data` prepares with the defaults (the text in field or column \
                 \"text\", a bad record stops it); for others run `oobleck data prepare SOURCE \
                 --out DIR` with --text-field or --skip-bad-records, then train with --data DIR"
            }
            _ => "",
        };
        Self::Prepare {
            path: path.to_path_buf(),
            error: Box::new(error),
            hint,
        }
    }
}

/// Result of the data pipeline.
pub type Result<T> = std::result::Result<T, DataError>;

/// `datasets/` of this workspace: the compile-time location when it still exists (so
/// `cargo run` from anywhere finds it), else `./datasets` relative to the working directory.
///
/// This and the two functions below name the source files, for tests and tools that read the
/// files themselves (the tokenizer's reference ids, path-based loading, slices of the corpus).
/// Running code uses [`open_dataset`] / [`open_tokenizer`], which need no `datasets/`.
pub fn default_datasets_dir() -> PathBuf {
    let compiled = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("datasets");
    if compiled.is_dir() {
        compiled
    } else {
        PathBuf::from("datasets")
    }
}

/// The shipped corpus's source file, `datasets/shakespeare.txt` (see `datasets/README.md`);
/// kept for tests and tools that need the file (see [`default_datasets_dir`]).
pub fn default_corpus_path() -> PathBuf {
    default_datasets_dir().join(DEFAULT_CORPUS_FILE)
}

/// The shipped GPT-2 tokenizer's source folder, `datasets/gpt2-tokenizer/`; kept for tests and
/// tools that need the files (see [`default_datasets_dir`]).
pub fn default_tokenizer_dir() -> PathBuf {
    default_datasets_dir().join(DEFAULT_TOKENIZER_DIR)
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Reads a file the user named, turning "missing" into [`DataError::NotFound`].
fn read_input(path: &Path, what: &'static str) -> Result<Vec<u8>> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(bytes),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(DataError::NotFound {
            what,
            path: path.to_path_buf(),
        }),
        Err(e) => Err(io_err(path)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vocabulary_mismatch_asks_for_at_least_the_tokenizer_s_ids() {
        let msg = DataError::VocabMismatch {
            path: PathBuf::from("tok"),
            tokenizer_vocab: 50257,
            model_vocab: 50000,
        }
        .to_string();
        assert!(msg.contains("has 50257 token ids"), "{msg}");
        assert!(msg.contains("only 50000 embedding rows"), "{msg}");
        assert!(msg.contains("at least 50257 rows"), "{msg}");
        assert!(!msg.contains("vocab_size 50257"), "{msg}");
    }
}
