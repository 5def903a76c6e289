//! Train/validation splits and deterministic batches (DESIGN.md section 4).
//!
//! - **Split**: each source's held-out documents are validation, the rest train, each read as
//!   one stream (holdout.rs; a source with too few documents, like one text file, holds out
//!   its last [`VALIDATION_PER_MILLE`]/1000 of tokens, rounded down: the shipped corpus's last
//!   plays). `--val-data` makes another source the whole validation split.
//! - **Samples**: sample `i` of a source's split is the window of `seq_len + 1` tokens starting
//!   at token `i * seq_len` of the split's stream: inputs are its first `seq_len` tokens, targets the last
//!   `seq_len` (next-token prediction). A split of `n` tokens has `(n - 1) / seq_len` samples.
//! - **Epoch order**: the sample at position `p` of an epoch is [`EpochOrder::at`]`(p)`, a
//!   bijection of `0..num_samples` keyed by `(seed, epoch, split)` and computed per sample
//!   (order.rs): nothing is held per epoch, so memory does not grow with the corpus.
//! - **Iteration `t`** uses positions `[t*B*b, (t+1)*B*b)` of the epoch order; **microbatch
//!   `k`** is positions `[k*b, (k+1)*b)` of those. The `num_samples % (B*b)` samples left at the
//!   end of an epoch's order are skipped in that epoch (different ones each epoch).
//! - **Blends** of several sources draw each sample's source by the blend rule (blend.rs) and
//!   let every source walk its own epochs ([`SplitData::microbatch`]).

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::dataset::{Dataset, Mix};
use super::order::EpochOrder;
use super::{DataError, Result};

/// Validation share of a source too small to hold out whole documents, in tokens, per mille:
/// [`super::DEFAULT_VAL_FRACTION`] (5%) in the unit the tail rule of holdout.rs rounds in.
pub const VALIDATION_PER_MILLE: usize = (super::DEFAULT_VAL_FRACTION * 1000.0) as usize;

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

/// A view of one split; all batch functions live here.
///
/// One source: sample `i` is the window of `seq_len + 1` tokens at `i * seq_len` of the
/// source's split stream (see the module docs). A blend: each source's windows are numbered
/// the same way within the source, and a sample's id ([`Batch::sample_ids`]) is its window
/// plus the windows of the sources before it, so ids are unique across sources.
#[derive(Debug, Clone)]
pub struct SplitData<'a> {
    ds: &'a Dataset,
    split: Split,
    mix: &'a Mix,
}

impl<'a> SplitData<'a> {
    pub(crate) fn new(ds: &'a Dataset, split: Split, mix: &'a Mix) -> Self {
        Self { ds, split, mix }
    }

    /// Which split.
    pub fn split(&self) -> Split {
        self.split
    }

    /// Tokens in this split, all sources together.
    pub fn num_tokens(&self) -> usize {
        self.mix.members.iter().map(|m| m.runs.len()).sum()
    }

    /// Windows of `seq_len + 1` tokens (stride `seq_len`) in this split, all sources together.
    pub fn num_samples(&self, seq_len: usize) -> usize {
        self.mix
            .members
            .iter()
            .map(|m| windows(m.runs.len(), seq_len))
            .sum()
    }

    /// Full iterations of `spec` per epoch; an error with the numbers if not even one fits,
    /// or if a source of a blend has no window at all (it names that source).
    pub fn iterations_per_epoch(&self, spec: &BatchSpec) -> Result<usize> {
        spec.validate()?;
        let samples = self.num_samples(spec.seq_len);
        let needed = spec.global_batch_samples();
        let too_small = |label: &Path, tokens, samples, needed| DataError::TooSmall {
            corpus: label.to_path_buf(),
            split: self.split,
            tokens,
            samples,
            seq_len: spec.seq_len,
            needed,
        };
        if samples < needed {
            return Err(too_small(
                self.ds.corpus(),
                self.num_tokens(),
                samples,
                needed,
            ));
        }
        if let Some(empty) = self
            .mix
            .members
            .iter()
            .find(|m| windows(m.runs.len(), spec.seq_len) == 0)
        {
            let label = &self.ds.parts[empty.part].label;
            return Err(too_small(label, empty.runs.len(), 0, 1));
        }
        Ok(samples / needed)
    }

    /// The order of this split's samples in `epoch` for `seed` (of the first source, for a
    /// blend): a bijection of `0..num_samples(seq_len)`, computed per position (about a
    /// microsecond to build, 64 bytes whatever the corpus).
    pub fn epoch_order(&self, seed: u64, epoch: u64, seq_len: usize) -> EpochOrder {
        let n = windows(self.mix.members[0].runs.len(), seq_len) as u64;
        EpochOrder::new(seed, epoch, self.split, n)
    }

    /// Microbatch `k` of iteration `iteration` of `epoch`: `b * seq_len` inputs and targets.
    ///
    /// One source: positions `iteration * B * b + k * b ..` of the epoch's order. A blend:
    /// global sample `g = (epoch * I + iteration) * B * b + k * b + r` (I: iterations per
    /// epoch) is [`super::Blend::at`]`(g)` = (source `s`, its `j`-th sample), and source `s` walks its
    /// own epochs: its sample is position `j mod n_s` of its order of epoch `j div n_s`
    /// ([`EpochOrder::of_source`]). A small source with a large weight is repeated sooner than
    /// a large one; every source's share holds for every prefix of the run.
    pub fn microbatch(
        &self,
        spec: &BatchSpec,
        seed: u64,
        epoch: u64,
        iteration: u64,
        k: usize,
    ) -> Result<Batch> {
        let picks = self.picks(spec, seed, epoch, iteration, k)?;
        self.gather(&picks, spec.seq_len)
    }

    /// The ids of [`Self::microbatch`]'s samples ([`Batch::sample_ids`]) without reading
    /// their tokens.
    pub fn microbatch_ids(
        &self,
        spec: &BatchSpec,
        seed: u64,
        epoch: u64,
        iteration: u64,
        k: usize,
    ) -> Result<Vec<usize>> {
        let picks = self.picks(spec, seed, epoch, iteration, k)?;
        Ok(picks
            .iter()
            .map(|&(source, window)| self.sample_id(source, window, spec.seq_len))
            .collect())
    }

    /// (source, window within it) of each sample of microbatch `k` (see [`Self::microbatch`]).
    fn picks(
        &self,
        spec: &BatchSpec,
        seed: u64,
        epoch: u64,
        iteration: u64,
        k: usize,
    ) -> Result<Vec<(usize, usize)>> {
        let iterations = self.iterations_per_epoch(spec)?;
        if iteration >= iterations as u64 || k >= spec.num_microbatches {
            return Err(DataError::InvalidRequest(format!(
                "iteration {iteration} microbatch {k} is outside {iterations} iterations x {} \
                 microbatches of the {} split",
                spec.num_microbatches, self.split
            )));
        }
        let b = spec.microbatch_size;
        let within = iteration as usize * spec.global_batch_samples() + k * b;
        if self.mix.members.len() == 1 {
            let order = self.epoch_order(seed, epoch, spec.seq_len);
            return Ok((within..within + b)
                .map(|p| (0, order.at(p as u64) as usize))
                .collect());
        }
        let global = epoch * (iterations * spec.global_batch_samples()) as u64 + within as u64;
        Ok(self
            .mix
            .blend
            .iter_from(global)
            .take(b)
            .map(|pick| {
                let n = windows(self.mix.members[pick.source].runs.len(), spec.seq_len) as u64;
                let order =
                    EpochOrder::of_source(seed, pick.source as u32, pick.index / n, self.split, n);
                (pick.source, order.at(pick.index % n) as usize)
            })
            .collect())
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
    /// evaluation (no shuffling, so validation loss is comparable across steps and runs). A
    /// blend takes sample `i` from [`super::Blend::at`]`(i)` = (source, its `j`-th), window `j` of
    /// that source in order (from its first again past its last).
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
        let first = index * batch_size;
        let picks: Vec<(usize, usize)> = if self.mix.members.len() == 1 {
            (first..first + batch_size).map(|i| (0, i)).collect()
        } else {
            self.mix
                .blend
                .iter_from(first as u64)
                .take(batch_size)
                .map(|pick| {
                    let n = windows(self.mix.members[pick.source].runs.len(), seq_len) as u64;
                    (pick.source, (pick.index % n.max(1)) as usize)
                })
                .collect()
        };
        self.gather(&picks, seq_len)
    }

    /// Whole batches of `batch_size` samples that [`Self::sequential_batch`] can serve (none
    /// for a blend one of whose sources has no window).
    pub fn num_sequential_batches(&self, seq_len: usize, batch_size: usize) -> usize {
        if batch_size == 0 || seq_len == 0 {
            return 0;
        }
        let some_empty = self
            .mix
            .members
            .iter()
            .any(|m| windows(m.runs.len(), seq_len) == 0);
        if self.mix.members.len() > 1 && some_empty {
            return 0;
        }
        self.num_samples(seq_len) / batch_size
    }

    /// A sample's id: its window plus the windows of the sources before its own.
    fn sample_id(&self, source: usize, window: usize, seq_len: usize) -> usize {
        let before: usize = self.mix.members[..source]
            .iter()
            .map(|m| windows(m.runs.len(), seq_len))
            .sum();
        before + window
    }

    /// The windows `picks` (source, window within it) as a batch (ids: [`Self::sample_id`]).
    fn gather(&self, picks: &[(usize, usize)], seq_len: usize) -> Result<Batch> {
        let mut inputs = Vec::with_capacity(picks.len() * seq_len);
        let mut targets = Vec::with_capacity(picks.len() * seq_len);
        let mut sample_ids = Vec::with_capacity(picks.len());
        for &(source, window) in picks {
            let member = &self.mix.members[source];
            let tokens = &self.ds.parts[member.part].tokens;
            let at = window * seq_len;
            // In bounds: window < its windows, so at + seq_len + 1 <= the runs' length.
            member.runs.extend_into(tokens, at, seq_len, &mut inputs)?;
            member
                .runs
                .extend_into(tokens, at + 1, seq_len, &mut targets)?;
            sample_ids.push(self.sample_id(source, window, seq_len));
        }
        Ok(Batch {
            inputs,
            targets,
            batch_size: picks.len(),
            seq_len,
            sample_ids,
        })
    }
}

/// Windows of `seq_len + 1` tokens at stride `seq_len` in `tokens` tokens.
fn windows(tokens: usize, seq_len: usize) -> usize {
    if seq_len == 0 {
        return 0;
    }
    tokens.saturating_sub(1) / seq_len
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
