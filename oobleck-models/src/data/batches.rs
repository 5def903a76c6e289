//! Train/validation splits and deterministic batches (DESIGN.md section 4).
//!
//! - **Split**: the last [`VALIDATION_PER_MILLE`]/1000 of the corpus's tokens (rounded down)
//!   are validation, the rest train. A contiguous tail keeps the two apart (no window straddles
//!   them); with the shipped corpus it holds out the last plays in file order.
//! - **Samples**: sample `i` of a split is the window of `seq_len + 1` tokens starting at token
//!   `i * seq_len` of the split: inputs are its first `seq_len` tokens, targets the last
//!   `seq_len` (next-token prediction). A split of `n` tokens has `(n - 1) / seq_len` samples.
//! - **Epoch order**: the sample at position `p` of an epoch is [`EpochOrder::at`]`(p)`, a
//!   bijection of `0..num_samples` keyed by `(seed, epoch, split)` and computed per sample
//!   (order.rs): nothing is held per epoch, so memory does not grow with the corpus.
//! - **Iteration `t`** uses positions `[t*B*b, (t+1)*B*b)` of the epoch order; **microbatch
//!   `k`** is positions `[k*b, (k+1)*b)` of those. The `num_samples % (B*b)` samples left at the
//!   end of an epoch's order are skipped in that epoch (different ones each epoch).

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::corpus::TokenCache;
use super::order::EpochOrder;
use super::shards::{open_shard, FormatHint};
use super::tokenizer::Gpt2Tokenizer;
use super::tokens::{ShardSet, TokenStore};
use super::{DataError, Result};

/// Validation share of the corpus in tokens, per mille (5%).
pub const VALIDATION_PER_MILLE: usize = 50;

/// Which part of the corpus.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    Train,
    Validation,
}

impl std::fmt::Display for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Split::Train => "train",
            Split::Validation => "validation",
        })
    }
}

/// Shape of one iteration's data: `B` microbatches of `b` samples of `seq_len` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchSpec {
    /// Tokens per sample (the model's context used in training).
    pub seq_len: usize,
    /// `b`: samples per microbatch.
    pub microbatch_size: usize,
    /// `B`: microbatches per iteration (global batch = `B * b` samples).
    pub num_microbatches: usize,
}

impl BatchSpec {
    /// Samples per iteration, `B * b`.
    pub fn global_batch_samples(&self) -> usize {
        self.microbatch_size * self.num_microbatches
    }

    fn validate(&self) -> Result<()> {
        if self.seq_len == 0 || self.microbatch_size == 0 || self.num_microbatches == 0 {
            return Err(DataError::InvalidRequest(format!(
                "seq_len, microbatch size and microbatch count must be positive, got {self:?}"
            )));
        }
        Ok(())
    }
}

/// Where training is in the data: checkpoints save it, resume continues from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataCursor {
    /// Epoch of the next iteration (0-based).
    pub epoch: u64,
    /// Iteration within that epoch (0-based).
    pub iteration: u64,
}

impl DataCursor {
    /// The cursor after this iteration.
    pub fn next(self, iterations_per_epoch: usize) -> Self {
        if self.iteration + 1 >= iterations_per_epoch as u64 {
            Self {
                epoch: self.epoch + 1,
                iteration: 0,
            }
        } else {
            Self {
                epoch: self.epoch,
                iteration: self.iteration + 1,
            }
        }
    }

    /// The cursor of global step `step` (0-based) of a run that started at epoch 0.
    pub fn at_step(step: u64, iterations_per_epoch: usize) -> Self {
        let ipe = iterations_per_epoch.max(1) as u64;
        Self {
            epoch: step / ipe,
            iteration: step % ipe,
        }
    }
}

/// `batch_size` samples, row-major: sample `r`'s tokens are `[r*seq_len, (r+1)*seq_len)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
    pub batch_size: usize,
    pub seq_len: usize,
    /// Index within the split of each row's sample (for tests and debugging).
    pub sample_ids: Vec<usize>,
}

/// A tokenized corpus (a text file's token cache, or pre-tokenized shards) with its splits. Cheap to share across threads (`Send + Sync`).
#[derive(Debug)]
pub struct Dataset {
    corpus: PathBuf,
    tokenizer: Arc<Gpt2Tokenizer>,
    tokens: TokenStore,
    train: Range<usize>,
    validation: Range<usize>,
}

impl Dataset {
    /// Opens `corpus` (a UTF-8 text file) with the tokenizer at `tokenizer` (see
    /// [`Gpt2Tokenizer::from_path`]), tokenizing it once into the cache (see [`TokenCache`]).
    /// For "this path or the built-in one" use [`super::open_dataset`].
    pub fn open(corpus: &Path, tokenizer: &Path, cache_dir: Option<&Path>) -> Result<Self> {
        Self::check_corpus_exists(corpus)?;
        let tokenizer = Gpt2Tokenizer::from_path(tokenizer)?;
        Self::open_with(corpus, Arc::new(tokenizer), cache_dir)
    }

    /// Like [`Dataset::open`] with an already loaded tokenizer.
    pub fn open_with(
        corpus: &Path,
        tokenizer: Arc<Gpt2Tokenizer>,
        cache_dir: Option<&Path>,
    ) -> Result<Self> {
        let tokens = TokenCache::open(corpus, &tokenizer, cache_dir)?;
        Ok(Self::from_tokens(
            corpus,
            tokenizer,
            TokenStore::Text(tokens),
        ))
    }

    /// The corpus compiled into the library ([`super::EMBEDDED_CORPUS`]) with `tokenizer`.
    /// Its cache goes to `cache_dir` or the shared cache folders, else stays in memory (see
    /// [`TokenCache::open_bytes`]); [`Self::corpus`] is [`super::EMBEDDED_CORPUS_NAME`].
    pub fn open_embedded(tokenizer: Arc<Gpt2Tokenizer>, cache_dir: Option<&Path>) -> Result<Self> {
        let label = Path::new(super::EMBEDDED_CORPUS_NAME);
        let bytes = super::EMBEDDED_CORPUS.as_bytes();
        let tokens = TokenCache::open_bytes(label, bytes, &tokenizer, cache_dir)?;
        Ok(Self::from_tokens(
            label,
            tokenizer,
            TokenStore::Text(tokens),
        ))
    }

    /// Pre-tokenized `shards` (llm.c, raw u16 with [`FormatHint::RawU16`], Megatron; see
    /// [`open_shard`]), concatenated in this order and read in place. `label` is the source
    /// as the user named it (a folder, a glob), for messages and [`Self::corpus`]. The ids are
    /// taken as `tokenizer`'s; [`Self::check_vocab`] checks they fit.
    pub fn open_shards(
        label: &Path,
        shards: &[PathBuf],
        hint: FormatHint,
        tokenizer: Arc<Gpt2Tokenizer>,
    ) -> Result<Self> {
        let opened = shards
            .iter()
            .map(|path| open_shard(path, hint))
            .collect::<Result<Vec<_>>>()?;
        let set = ShardSet::new(label, opened)?;
        Ok(Self::from_tokens(label, tokenizer, TokenStore::Shards(set)))
    }

    /// [`DataError::NotFound`] unless `corpus` exists (checked before a tokenizer is loaded,
    /// so that a mistyped corpus path is the error reported).
    pub(crate) fn check_corpus_exists(corpus: &Path) -> Result<()> {
        if corpus.exists() {
            Ok(())
        } else {
            Err(DataError::NotFound {
                what: "corpus",
                path: corpus.to_path_buf(),
            })
        }
    }

    fn from_tokens(corpus: &Path, tokenizer: Arc<Gpt2Tokenizer>, tokens: TokenStore) -> Self {
        let n = tokens.len();
        let validation_len = n * VALIDATION_PER_MILLE / 1000;
        Self {
            corpus: corpus.to_path_buf(),
            tokenizer,
            train: 0..n - validation_len,
            validation: n - validation_len..n,
            tokens,
        }
    }

    /// The tokenizer the corpus was encoded with.
    pub fn tokenizer(&self) -> &Arc<Gpt2Tokenizer> {
        &self.tokenizer
    }

    /// Checks that the model's `model_vocab` embedding rows cover the tokenizer's ids
    /// ([`Gpt2Tokenizer::check_vocab`]) and, for shards, that every stored id is one of the
    /// tokenizer's: below its vocabulary, which the first check bounds by the model's, so each
    /// id has a row and decodes. The error names the shard, the id and where it is. A text
    /// corpus's ids come from the tokenizer, so only the first check applies to it.
    pub fn check_vocab(&self, model_vocab: usize) -> Result<()> {
        self.tokenizer.check_vocab(model_vocab)?;
        let vocab = self.tokenizer.vocab_size();
        self.tokens
            .shards()
            .iter()
            .try_for_each(|shard| shard.check_vocab(vocab))
    }

    /// The corpus file, or the data source as named ([`super::EMBEDDED_CORPUS_NAME`] for the
    /// built-in corpus).
    pub fn corpus(&self) -> &Path {
        &self.corpus
    }

    /// The token cache file in use; `None` when the tokens are held in memory or read from
    /// shards in place.
    pub fn cache_path(&self) -> Option<&Path> {
        self.tokens.cache_path()
    }

    /// Identifies the exact training data (not yet recorded in checkpoints: `--resume` compares
    /// the `--data` path and format only). A text corpus: SHA-256
    /// (hex) of its token ids as u16 LE, as the cache header holds it. Shards: file names,
    /// formats, dtypes, token counts and token bytes, all of them under 1 GiB of tokens, else
    /// sampled at fixed places (the rule is [`super::shards_sha256`]'s).
    pub fn tokens_sha256(&self) -> &str {
        self.tokens.tokens_sha256()
    }

    /// Tokens of the whole corpus.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Appends tokens `range` of the whole corpus (both splits, in order) to `out`: for tools
    /// and tests that need the ids themselves. Panics if `range` ends past [`Self::num_tokens`].
    pub fn copy_tokens(&self, range: Range<usize>, out: &mut Vec<u32>) -> Result<()> {
        self.tokens.extend_into(range.start, range.len(), out)
    }

    /// One split of the corpus.
    pub fn split(&self, split: Split) -> SplitData<'_> {
        let range = match split {
            Split::Train => self.train.clone(),
            Split::Validation => self.validation.clone(),
        };
        SplitData {
            ds: self,
            split,
            range,
        }
    }
}

/// A view of one split; all batch functions live here.
#[derive(Debug, Clone)]
pub struct SplitData<'a> {
    ds: &'a Dataset,
    split: Split,
    range: Range<usize>,
}

impl SplitData<'_> {
    /// Which split.
    pub fn split(&self) -> Split {
        self.split
    }

    /// Tokens in this split.
    pub fn num_tokens(&self) -> usize {
        self.range.len()
    }

    /// Windows of `seq_len + 1` tokens (stride `seq_len`) in this split.
    pub fn num_samples(&self, seq_len: usize) -> usize {
        if seq_len == 0 {
            return 0;
        }
        self.range.len().saturating_sub(1) / seq_len
    }

    /// Full iterations of `spec` per epoch; an error with the numbers if not even one fits.
    pub fn iterations_per_epoch(&self, spec: &BatchSpec) -> Result<usize> {
        spec.validate()?;
        let samples = self.num_samples(spec.seq_len);
        let needed = spec.global_batch_samples();
        if samples < needed {
            return Err(DataError::TooSmall {
                corpus: self.ds.corpus.clone(),
                split: self.split,
                tokens: self.range.len(),
                samples,
                seq_len: spec.seq_len,
                needed,
            });
        }
        Ok(samples / needed)
    }

    /// The order of this split's samples in `epoch` for `seed`: a bijection of
    /// `0..num_samples(seq_len)`, computed per position (about a microsecond to build, 64
    /// bytes whatever the corpus).
    pub fn epoch_order(&self, seed: u64, epoch: u64, seq_len: usize) -> EpochOrder {
        EpochOrder::new(seed, epoch, self.split, self.num_samples(seq_len) as u64)
    }

    /// Microbatch `k` of iteration `iteration` of `epoch`: `b * seq_len` inputs and targets.
    pub fn microbatch(
        &self,
        spec: &BatchSpec,
        seed: u64,
        epoch: u64,
        iteration: u64,
        k: usize,
    ) -> Result<Batch> {
        let iterations = self.iterations_per_epoch(spec)?;
        if iteration >= iterations as u64 || k >= spec.num_microbatches {
            return Err(DataError::InvalidRequest(format!(
                "iteration {iteration} microbatch {k} is outside {iterations} iterations x {} \
                 microbatches of the {} split",
                spec.num_microbatches, self.split
            )));
        }
        let order = self.epoch_order(seed, epoch, spec.seq_len);
        let start = iteration as usize * spec.global_batch_samples() + k * spec.microbatch_size;
        let ids: Vec<usize> = (start..start + spec.microbatch_size)
            .map(|p| order.at(p as u64) as usize)
            .collect();
        self.gather(&ids, spec.seq_len)
    }

    /// Microbatch `k` of the iteration at `cursor`.
    pub fn microbatch_at(
        &self,
        spec: &BatchSpec,
        seed: u64,
        cursor: DataCursor,
        k: usize,
    ) -> Result<Batch> {
        self.microbatch(spec, seed, cursor.epoch, cursor.iteration, k)
    }

    /// Samples `[index * batch_size, (index + 1) * batch_size)` in corpus order, for
    /// evaluation (no shuffling, so validation loss is comparable across steps and runs).
    pub fn sequential_batch(
        &self,
        seq_len: usize,
        batch_size: usize,
        index: usize,
    ) -> Result<Batch> {
        let batches = self.num_sequential_batches(seq_len, batch_size);
        if seq_len == 0 || batch_size == 0 || index >= batches {
            return Err(DataError::InvalidRequest(format!(
                "sequential batch {index} of {batch_size} x {seq_len}: the {} split has {} \
                 samples, {batches} batches",
                self.split,
                self.num_samples(seq_len)
            )));
        }
        let ids: Vec<usize> = (index * batch_size..(index + 1) * batch_size).collect();
        self.gather(&ids, seq_len)
    }

    /// Whole batches of `batch_size` samples that [`Self::sequential_batch`] can serve.
    pub fn num_sequential_batches(&self, seq_len: usize, batch_size: usize) -> usize {
        if batch_size == 0 {
            return 0;
        }
        self.num_samples(seq_len) / batch_size
    }

    fn gather(&self, sample_ids: &[usize], seq_len: usize) -> Result<Batch> {
        let mut inputs = Vec::with_capacity(sample_ids.len() * seq_len);
        let mut targets = Vec::with_capacity(sample_ids.len() * seq_len);
        for &s in sample_ids {
            let at = self.range.start + s * seq_len;
            // In bounds: s < num_samples, so at + seq_len + 1 <= range.end.
            self.ds.tokens.extend_into(at, seq_len, &mut inputs)?;
            self.ds.tokens.extend_into(at + 1, seq_len, &mut targets)?;
        }
        Ok(Batch {
            inputs,
            targets,
            batch_size: sample_ids.len(),
            seq_len,
            sample_ids: sample_ids.to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_wraps_to_the_next_epoch() {
        let c = DataCursor::default();
        assert_eq!(
            c.next(3),
            DataCursor {
                epoch: 0,
                iteration: 1
            }
        );
        assert_eq!(
            DataCursor {
                epoch: 0,
                iteration: 2
            }
            .next(3),
            DataCursor {
                epoch: 1,
                iteration: 0
            }
        );
        assert_eq!(
            DataCursor::at_step(7, 3),
            DataCursor {
                epoch: 2,
                iteration: 1
            }
        );
        let json = serde_json::to_string(&DataCursor {
            epoch: 4,
            iteration: 9,
        })
        .unwrap();
        assert_eq!(json, r#"{"epoch":4,"iteration":9}"#);
    }

    #[test]
    fn datasets_can_be_shared_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Dataset>();
    }
}
