//! [`TokenRuns`]: a split of one source's token stream, as the runs of the stream it keeps.
//!
//! Holding out documents (holdout.rs) cuts a source's stream into the documents kept for
//! training and those held out for validation; each split reads its documents as one stream,
//! in stream order, so its windows of `seq_len + 1` tokens are ranges of that stream exactly
//! as they were of the whole source before (batches.rs never sees the gaps). Adjacent
//! documents of the same split merge into one run, so the memory is two words per run (per
//! gap between held-out documents), not per document or token.

use std::ops::Range;

use super::tokens::TokenStore;
use super::Result;

/// Ranges of a token stream read as one stream: position `p` of the split is stream position
/// `starts[k] + (p - offsets[k])` for the run `k` holding it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct TokenRuns {
    /// Stream position of each run's first token.
    starts: Vec<usize>,
    /// Split position of each run's first token (the lengths of the runs before it).
    offsets: Vec<usize>,
    len: usize,
    /// Stream position just past the last run.
    end: usize,
}

impl TokenRuns {
    /// One run: `range` of the stream.
    pub fn whole(range: Range<usize>) -> Self {
        let mut runs = Self::default();
        runs.push(range);
        runs
    }

    /// Appends `range` of the stream (after every range pushed before), merging it with the
    /// last run when they touch. An empty range adds nothing.
    pub fn push(&mut self, range: Range<usize>) {
        if range.is_empty() {
            return;
        }
        debug_assert!(
            self.starts.is_empty() || self.end <= range.start,
            "runs are pushed in stream order"
        );
        if self.starts.is_empty() || self.end != range.start {
            self.starts.push(range.start);
            self.offsets.push(self.len);
        }
        self.len += range.len();
        self.end = range.end;
    }

    /// Tokens in the split.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Number of separate runs (for tests and the log).
    pub fn num_runs(&self) -> usize {
        self.starts.len()
    }

    /// The stream ranges of the runs, in order.
    #[cfg(test)]
    pub fn ranges(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        (0..self.starts.len()).map(|k| {
            let run_end = self.offsets.get(k + 1).copied().unwrap_or(self.len);
            self.starts[k]..self.starts[k] + run_end - self.offsets[k]
        })
    }

    /// Appends split tokens `[at, at + n)` of `store`, from as many runs as the range crosses.
    /// Panics if the range ends past [`Self::len`]: callers index within checked windows.
    pub fn extend_into(
        &self,
        store: &TokenStore,
        at: usize,
        n: usize,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        assert!(
            at + n <= self.len,
            "split range {at}..{} outside the split's {} tokens",
            at + n,
            self.len
        );
        let (mut at, end) = (at, at + n);
        while at < end {
            let k = self.offsets.partition_point(|&o| o <= at) - 1;
            let run_end = self.offsets.get(k + 1).copied().unwrap_or(self.len);
            let take = (end - at).min(run_end - at);
            store.extend_into(self.starts[k] + at - self.offsets[k], take, out)?;
            at += take;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn touching_ranges_merge_and_gaps_start_a_run() {
        let mut runs = TokenRuns::default();
        runs.push(0..10);
        runs.push(10..15);
        runs.push(15..15);
        runs.push(20..30);
        assert_eq!(runs.len(), 25);
        assert_eq!(runs.num_runs(), 2);
        assert_eq!(runs.starts, [0, 20]);
        assert_eq!(runs.offsets, [0, 15]);
        assert_eq!(TokenRuns::whole(5..5).num_runs(), 0);
        assert_eq!(runs.ranges().collect::<Vec<_>>(), [0..15, 20..30]);
    }
}
