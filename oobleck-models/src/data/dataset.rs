//! [`Dataset`]: the opened sources of a run, each split into train and validation, and the
//! blend that interleaves them (the batches themselves are batches.rs's).
//!
//! ```text
//!  --data [W:]SRC ... ─> one Part per source: its TokenStore (text cache or shards) and,
//!                        unless --val-data, its held-out documents     (holdout.rs)
//!  train split       ─> every source's train runs, blended by the weights (blend.rs)
//!  validation split  ─> every source's held-out runs, by the same weights;
//!                       or --val-data's whole stream, alone
//! ```
//!
//! A single source with no weight is the case every earlier run was: its blend is the one
//! source, its batches are drawn as before (batches.rs), and its identity is the source's own.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::blend::Blend;
use super::corpus::TokenCache;
use super::holdout::{hold_out, HeldOut, DEFAULT_VAL_FRACTION};
use super::runs::TokenRuns;
use super::shards::{open_shard, FormatHint};
use super::tokenizer::{Gpt2Tokenizer, END_OF_TEXT_ID};
use super::tokens::{ShardSet, TokenStore};
use super::vocab_checked::check_vocab_once;
use super::{DataError, Result, Split, SplitData};

/// One opened source: what the user named, its tokens and how its validation was chosen.
#[derive(Debug)]
pub(crate) struct Part {
    pub label: PathBuf,
    pub tokens: TokenStore,
    pub held_out: HeldOut,
}

/// One source's runs within a split.
#[derive(Debug)]
pub(crate) struct Member {
    /// Index into [`Dataset`]'s parts.
    pub part: usize,
    pub runs: TokenRuns,
}

/// A split: its members and the blend that picks among them.
#[derive(Debug)]
pub(crate) struct Mix {
    pub members: Vec<Member>,
    pub blend: Blend,
}

/// A tokenized corpus (text caches or pre-tokenized shards, one source or a weighted blend)
/// with its splits. Cheap to share across threads (`Send + Sync`).
#[derive(Debug)]
pub struct Dataset {
    corpus: PathBuf,
    tokenizer: Arc<Gpt2Tokenizer>,
    pub(crate) parts: Vec<Part>,
    pub(crate) train: Mix,
    pub(crate) validation: Mix,
    identity: String,
}

/// An opened source and its blend weight (`None`: in proportion to its tokens).
pub(crate) struct Opened {
    pub label: PathBuf,
    pub tokens: TokenStore,
    pub weight: Option<f64>,
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
        Self::single(corpus, tokenizer, TokenStore::Text(tokens))
    }

    /// The corpus compiled into the library ([`super::EMBEDDED_CORPUS`]) with `tokenizer`.
    /// Its cache goes to `cache_dir` or the shared cache folders, else stays in memory (see
    /// [`TokenCache::open_bytes`]); [`Self::corpus`] is [`super::EMBEDDED_CORPUS_NAME`].
    pub fn open_embedded(tokenizer: Arc<Gpt2Tokenizer>, cache_dir: Option<&Path>) -> Result<Self> {
        let label = Path::new(super::EMBEDDED_CORPUS_NAME);
        let bytes = super::EMBEDDED_CORPUS.as_bytes();
        let tokens = TokenCache::open_bytes(label, bytes, &tokenizer, cache_dir)?;
        Self::single(label, tokenizer, TokenStore::Text(tokens))
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
        let set = open_shard_set(label, shards, hint)?;
        Self::single(label, tokenizer, TokenStore::Shards(set))
    }

    /// One source, 5% of its documents held out ([`DEFAULT_VAL_FRACTION`]).
    fn single(label: &Path, tokenizer: Arc<Gpt2Tokenizer>, tokens: TokenStore) -> Result<Self> {
        let millionths = super::holdout::fraction_millionths(DEFAULT_VAL_FRACTION)?;
        let opened = Opened {
            label: label.to_path_buf(),
            tokens,
            weight: None,
        };
        Self::blend(tokenizer, vec![opened], Validation::HeldOut(millionths))
    }

    /// The blend of `sources` (in this order) with validation from `validation`.
    pub(crate) fn blend(
        tokenizer: Arc<Gpt2Tokenizer>,
        sources: Vec<Opened>,
        validation: Validation,
    ) -> Result<Self> {
        let weights = blend_weights(&sources)?;
        let blend = Blend::new(&weights)?;
        let millionths = match validation {
            Validation::HeldOut(m) => m,
            Validation::Source(_) => 0,
        };
        let mut parts = Vec::with_capacity(sources.len() + 1);
        let (mut train, mut held) = (Vec::new(), Vec::new());
        for (i, source) in sources.into_iter().enumerate() {
            let split = hold_out(&source.tokens, millionths, END_OF_TEXT_ID);
            log_split(&source.label, &split.how, &split.train, &split.validation);
            train.push(Member {
                part: i,
                runs: split.train,
            });
            held.push(Member {
                part: i,
                runs: split.validation,
            });
            parts.push(Part {
                label: source.label,
                tokens: source.tokens,
                held_out: split.how,
            });
        }
        let identity = identity(&parts, blend.parts());
        let validation = match validation {
            Validation::HeldOut(_) => Mix {
                members: held,
                blend: blend.clone(),
            },
            Validation::Source(opened) => {
                let runs = TokenRuns::whole(0..opened.tokens.len());
                parts.push(Part {
                    label: opened.label,
                    tokens: opened.tokens,
                    held_out: HeldOut::Nothing,
                });
                Mix {
                    members: vec![Member {
                        part: parts.len() - 1,
                        runs,
                    }],
                    blend: Blend::new(&[1.0])?,
                }
            }
        };
        Ok(Self {
            corpus: corpus_label(&parts, train.len()),
            tokenizer,
            train: Mix {
                members: train,
                blend,
            },
            validation,
            parts,
            identity,
        })
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

    /// The tokenizer the corpus was encoded with.
    pub fn tokenizer(&self) -> &Arc<Gpt2Tokenizer> {
        &self.tokenizer
    }

    /// Checks that the model's `model_vocab` embedding rows cover the tokenizer's ids
    /// ([`Gpt2Tokenizer::check_vocab`]) and, for shards, that every stored id is one of the
    /// tokenizer's: below its vocabulary, which the first check bounds by the model's, so each
    /// id has a row and decodes. The error names the shard, the id and where it is. A text
    /// corpus's ids come from the tokenizer, so only the first check applies to it. A shard
    /// is scanned once per machine (vocab_checked.rs), not by every process.
    pub fn check_vocab(&self, model_vocab: usize) -> Result<()> {
        self.tokenizer.check_vocab(model_vocab)?;
        let vocab = self.tokenizer.vocab_size();
        self.parts
            .iter()
            .flat_map(|p| p.tokens.shards())
            .try_for_each(|shard| check_vocab_once(shard, vocab))
    }

    /// The data source as named: the corpus file, the shards' path, or for a blend
    /// `blend of N: a + b + ...` ([`super::EMBEDDED_CORPUS_NAME`] for the built-in corpus).
    pub fn corpus(&self) -> &Path {
        &self.corpus
    }

    /// The first source's token cache file; `None` when its tokens are held in memory or read
    /// from shards in place.
    pub fn cache_path(&self) -> Option<&Path> {
        self.parts[0].tokens.cache_path()
    }

    /// Identifies the exact training data, which checkpoints record and `--resume` compares.
    /// One source: its tokens' identity (a text corpus: SHA-256 (hex) of its token ids as u16
    /// LE, as the cache header holds it; shards: file names, formats, dtypes, token counts and
    /// token bytes, all of them under 1 GiB of tokens, else sampled at fixed places, the rule
    /// of [`super::shards_sha256`]). A blend: SHA-256 of `oobleck blend v2` (v1 was
    /// Megatron's rule, whose samples differ, so `--resume` refuses a checkpoint of it), then
    /// each source's integer blend part and identity, one line each. `--val-data` is not part
    /// of it: it changes no training sample.
    pub fn tokens_sha256(&self) -> &str {
        &self.identity
    }

    /// Each training source as named and its own identity (see [`Self::tokens_sha256`]), in
    /// `--data` order: what `--resume` names when one of them changed.
    pub fn source_identities(&self) -> Vec<(PathBuf, String)> {
        self.train
            .members
            .iter()
            .map(|m| {
                let part = &self.parts[m.part];
                (part.label.clone(), part.tokens.tokens_sha256().to_string())
            })
            .collect()
    }

    /// How each training source's validation was chosen, in `--data` order.
    pub fn held_out(&self) -> Vec<HeldOut> {
        self.train
            .members
            .iter()
            .map(|m| self.parts[m.part].held_out)
            .collect()
    }

    /// Tokens of the training sources together (both splits).
    pub fn num_tokens(&self) -> usize {
        self.train
            .members
            .iter()
            .map(|m| self.parts[m.part].tokens.len())
            .sum()
    }

    /// Appends tokens `range` of the training sources' streams, concatenated in order (both
    /// splits), to `out`: for tools and tests that need the ids themselves. Panics if `range`
    /// ends past [`Self::num_tokens`].
    pub fn copy_tokens(&self, range: Range<usize>, out: &mut Vec<u32>) -> Result<()> {
        let mut skip = range.start;
        let mut left = range.len();
        for member in &self.train.members {
            let tokens = &self.parts[member.part].tokens;
            if skip >= tokens.len() {
                skip -= tokens.len();
                continue;
            }
            let take = left.min(tokens.len() - skip);
            tokens.extend_into(skip, take, out)?;
            (skip, left) = (0, left - take);
            if left == 0 {
                break;
            }
        }
        assert_eq!(left, 0, "token range {range:?} outside the sources' tokens");
        Ok(())
    }

    /// One split of the data.
    pub fn split(&self, split: Split) -> SplitData<'_> {
        let mix = match split {
            Split::Train => &self.train,
            Split::Validation => &self.validation,
        };
        SplitData::new(self, split, mix)
    }
}

/// Where validation comes from.
pub(crate) enum Validation {
    /// This many millionths of each source's documents.
    HeldOut(u64),
    /// A source of its own, read whole.
    Source(Opened),
}

/// Shards opened and concatenated as one stream.
pub(crate) fn open_shard_set(
    label: &Path,
    shards: &[PathBuf],
    hint: FormatHint,
) -> Result<ShardSet> {
    let opened = shards
        .iter()
        .map(|path| open_shard(path, hint))
        .collect::<Result<Vec<_>>>()?;
    ShardSet::new(label, opened)
}

/// The weights of `sources`: all given, or none (then each source's token count).
fn blend_weights(sources: &[Opened]) -> Result<Vec<f64>> {
    let given = sources.iter().filter(|s| s.weight.is_some()).count();
    if given == 0 {
        return Ok(sources.iter().map(|s| s.tokens.len() as f64).collect());
    }
    if given < sources.len() {
        let missing = sources
            .iter()
            .find(|s| s.weight.is_none())
            .expect("some source has no weight");
        return Err(DataError::InvalidRequest(format!(
            "--data {} has no weight but other sources have one: give every source a weight \
             (--data 0.7:web --data 0.3:code) or none (each source then weighs its tokens)",
            missing.label.display()
        )));
    }
    Ok(sources.iter().map(|s| s.weight.unwrap_or(0.0)).collect())
}

/// See [`Dataset::tokens_sha256`].
fn identity(parts: &[Part], blend_parts: &[u64]) -> String {
    if parts.len() == 1 {
        return parts[0].tokens.tokens_sha256().to_string();
    }
    let mut hash = Sha256::new();
    hash.update(b"oobleck blend v2\n");
    for (part, share) in parts.iter().zip(blend_parts) {
        hash.update(format!("{share} {}\n", part.tokens.tokens_sha256()).as_bytes());
    }
    hex::encode(hash.finalize())
}

fn corpus_label(parts: &[Part], sources: usize) -> PathBuf {
    if sources == 1 {
        return parts[0].label.clone();
    }
    let names: Vec<String> = parts[..sources]
        .iter()
        .map(|p| p.label.display().to_string())
        .collect();
    PathBuf::from(format!("blend of {sources}: {}", names.join(" + ")))
}

fn log_split(label: &Path, how: &HeldOut, train: &TokenRuns, validation: &TokenRuns) {
    let (held, of, what) = match *how {
        HeldOut::Documents { held, documents } => (held, documents, "documents"),
        HeldOut::Blocks { held, blocks } => (held, blocks, "blocks of whole documents"),
        HeldOut::Tail { documents } => {
            return tracing::debug!(
                source = %label.display(),
                "validation: the last {} tokens ({documents} documents, too few to hold out whole ones)",
                validation.len()
            );
        }
        HeldOut::Nothing => return,
    };
    tracing::info!(
        source = %label.display(),
        "validation: {held} of {of} {what} held out ({} tokens; {} train tokens in {} runs)",
        validation.len(),
        train.len(),
        train.num_runs()
    );
}
