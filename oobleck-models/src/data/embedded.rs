//! The shipped corpus and GPT-2 tokenizer, compiled into the library so that a machine running
//! the default job needs only the binary: nothing is read from `datasets/` at run time.
//!
//! [`open_dataset`] and [`open_tokenizer`] are the one entry point for "this path, or the
//! built-in one". The built-in corpus's token cache lives in the shared cache folders (never
//! beside a source file, see [`super::corpus`]); when none is writable its tokens are kept in
//! memory. A user's corpus (`--dataset PATH`) stays a path that every node must have.
//!
//! The bytes are those of `datasets/shakespeare.txt` and `datasets/gpt2-tokenizer/` (see
//! `datasets/README.md`), so the built-in tokenizer has the same [`Gpt2Tokenizer::hash`] as
//! the folder, and the built-in corpus shares its token cache with a copy of that file.

use std::path::Path;
use std::sync::Arc;

use super::dataset::Dataset;
use super::tokenizer::Gpt2Tokenizer;
use super::Result;

/// The shipped corpus, `datasets/shakespeare.txt` (5,054,025 bytes of ASCII text).
pub const EMBEDDED_CORPUS: &str = include_str!("../../../datasets/shakespeare.txt");
/// GPT-2's `encoder.json` (token -> id), as in `datasets/gpt2-tokenizer/`.
pub(crate) const EMBEDDED_ENCODER_JSON: &[u8] =
    include_bytes!("../../../datasets/gpt2-tokenizer/encoder.json");
/// GPT-2's `vocab.bpe` (the 50,000 merges), as in `datasets/gpt2-tokenizer/`.
pub(crate) const EMBEDDED_VOCAB_BPE: &[u8] =
    include_bytes!("../../../datasets/gpt2-tokenizer/vocab.bpe");

/// How the built-in corpus is named in messages and in its cache file's name (it has no path).
pub const EMBEDDED_CORPUS_NAME: &str = "<built-in>/shakespeare.txt";
/// How the built-in tokenizer is named in messages (its [`Gpt2Tokenizer::source`]).
pub const EMBEDDED_TOKENIZER_NAME: &str = "<built-in>/gpt2-tokenizer";

/// The tokenizer at `path` (see [`Gpt2Tokenizer::from_path`]), or the built-in GPT-2 one.
pub fn open_tokenizer(path: Option<&Path>) -> Result<Gpt2Tokenizer> {
    match path {
        Some(path) => Gpt2Tokenizer::from_path(path),
        None => Ok(Gpt2Tokenizer::embedded()),
    }
}

/// The corpus at `corpus` (a UTF-8 text file every node must have) or the built-in one,
/// tokenized with the tokenizer at `tokenizer` or the built-in GPT-2 one. The token cache goes
/// to its default place (see [`super::TokenCache`]); with no writable place the tokens are
/// kept in memory.
pub fn open_dataset(corpus: Option<&Path>, tokenizer: Option<&Path>) -> Result<Dataset> {
    if let Some(corpus) = corpus {
        // Checked before the tokenizer loads, so a mistyped corpus path is the error reported.
        Dataset::check_corpus_exists(corpus)?;
    }
    let tokenizer = Arc::new(open_tokenizer(tokenizer)?);
    match corpus {
        Some(corpus) => Dataset::open_with(corpus, tokenizer, None),
        None => Dataset::open_embedded(tokenizer, None),
    }
}
