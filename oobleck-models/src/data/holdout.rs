//! Which of a source's tokens are validation (`--val-fraction`): held-out documents, so no
//! validation window shares a document with a training window.
//!
//! - **Documents** are what the store says: a Megatron `.idx`'s, the spans between end-of-text
//!   ids of llm.c and raw shards (each shard's own placement, see [`super::TokenShard`]), and
//!   a text corpus is one document (a file is a document). A document cut across two shards
//!   counts as two.
//! - **Held out**: document `d` (its number in the source's stream order) is validation when
//!   `mix(KEY ^ d) mod 10^6 < fraction * 10^6`, SplitMix64's finaliser with a fixed key: each
//!   document on its own, in one pass, so a corpus grown by appending documents keeps its
//!   held-out set, and the set does not depend on `--seed` (validation losses compare across
//!   seeds). Train and validation then read their documents in stream order as one stream
//!   each ([`TokenRuns`]).
//! - **Too few documents** to hold out by chance (fewer than [`MIN_HELD_OUT_DOCUMENTS`]
//!   expected, i.e. under 200 documents at 5%, or a draw that left either side empty): the last
//!   `fraction` of the source's tokens (rounded down) are validation instead, a contiguous tail
//!   as the single-document text corpus has always had (its last plays, for the shipped one).
//!
//! - **Large corpora** (token shards with at least [`MIN_HELD_OUT_BLOCKS`] blocks of
//!   [`BLOCK_TOKENS`] expected to be held out: 336M tokens at 5%): whole blocks of documents
//!   are drawn instead of single documents, so that no process scans the corpus at start and
//!   no process's memory grows with the number of documents. The stream is cut into blocks of
//!   2^20 tokens; a document belongs to the block its first token lies in, and block `b` is
//!   validation when `mix(KEY ^ b) mod 10^6 < fraction * 10^6`. Only where the draw changes
//!   from one block to the next is the first document start after the block's edge looked up
//!   (a search of a Megatron index, a scan to the next end-of-text id otherwise), so opening
//!   costs a few thousand short reads at 300B tokens and the splits keep one run per change:
//!   about 27 thousand runs, under 1 MB per process, where single documents would be 15
//!   million runs (480 MB) in every process. Below the threshold the document draw above
//!   scans at most `16 * 2^20 / fraction` tokens and keeps at most a few MB of runs. A corpus
//!   that grows across the threshold changes how it is drawn, and so its held-out set (as a
//!   changed `--val-fraction` does); growing on either side of it keeps the set.
//!
//! The fraction is taken in millionths, so `0.05` splits exactly where `5 / 100` of the tokens
//! does, on every machine.

use super::order::mix;
use super::runs::TokenRuns;
use super::tokens::{ShardSet, TokenStore};
use super::{DataError, Result};

/// `--val-fraction`'s default: 5% of the documents (or of the tokens, see the module docs).
pub const DEFAULT_VAL_FRACTION: f64 = 0.05;
/// Held-out documents expected at least: below it the tail is held out instead.
pub const MIN_HELD_OUT_DOCUMENTS: u64 = 10;
/// Tokens per block of the draw over large corpora (see the module docs).
pub const BLOCK_TOKENS: usize = 1 << 20;
/// Held-out blocks expected at least before blocks are drawn instead of documents.
pub const MIN_HELD_OUT_BLOCKS: u64 = 16;
/// The fraction's unit: a millionth.
const SCALE: u64 = 1_000_000;
/// Key of the held-out draw ("oobleckv").
const KEY: u64 = 0x6f6f_626c_6563_6b76;

/// How a source's validation tokens were chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeldOut {
    /// `held` of the source's `documents` documents.
    Documents { held: u64, documents: u64 },
    /// `held` of the source's `blocks` blocks of whole documents (a large corpus).
    Blocks { held: u64, blocks: u64 },
    /// The last tokens of the stream (too few documents to draw from).
    Tail { documents: u64 },
    /// Nothing: validation comes from elsewhere (`--val-data`) or the fraction is zero.
    Nothing,
}

/// A source's two splits.
#[derive(Debug, Clone)]
pub(crate) struct Holdout {
    pub train: TokenRuns,
    pub validation: TokenRuns,
    pub how: HeldOut,
}

/// `fraction` in millionths; an error unless `0 <= fraction < 1`.
pub fn fraction_millionths(fraction: f64) -> Result<u64> {
    if !(0.0..1.0).contains(&fraction) {
        return Err(DataError::InvalidRequest(format!(
            "--val-fraction {fraction}: the share of documents held out for validation must be \
             at least 0 and below 1 (0.05 is 5%)"
        )));
    }
    Ok((fraction * SCALE as f64).round() as u64)
}

/// Splits `store` with `millionths` of its documents held out (see the module docs); the
/// documents are found with the tokenizer's `end_of_text` id.
pub(crate) fn hold_out(store: &TokenStore, millionths: u64, end_of_text: u32) -> Holdout {
    hold_out_in_blocks_of(store, millionths, end_of_text, BLOCK_TOKENS)
}

/// [`hold_out`] with blocks of `block_tokens` (tests use small ones).
fn hold_out_in_blocks_of(
    store: &TokenStore,
    millionths: u64,
    end_of_text: u32,
    block_tokens: usize,
) -> Holdout {
    let n = store.len();
    if millionths == 0 {
        return Holdout {
            train: TokenRuns::whole(0..n),
            validation: TokenRuns::default(),
            how: HeldOut::Nothing,
        };
    }
    if let TokenStore::Shards(set) = store {
        let blocks = n.div_ceil(block_tokens) as u64;
        let expected = u128::from(blocks) * u128::from(millionths);
        if expected >= u128::from(MIN_HELD_OUT_BLOCKS) * u128::from(SCALE) {
            if let Some(split) = hold_out_blocks(set, millionths, end_of_text, block_tokens) {
                return split;
            }
        }
    }
    hold_out_documents(store, millionths, end_of_text)
}

/// Whether draw `i` (a document's or a block's number) is held out.
fn drawn(i: u64, millionths: u64) -> bool {
    mix(KEY ^ i) % SCALE < millionths
}

/// The block draw of the module docs; `None` if it left either split empty.
fn hold_out_blocks(
    set: &ShardSet,
    millionths: u64,
    end_of_text: u32,
    block_tokens: usize,
) -> Option<Holdout> {
    let n = set.len();
    let blocks = n.div_ceil(block_tokens);
    let (mut train, mut validation) = (TokenRuns::default(), TokenRuns::default());
    let (mut from, mut held) = (0usize, 0u64);
    let mut was_held = drawn(0, millionths);
    // The last lookup: the first document start at or after `asked` is `found`, so it is also
    // the answer for any later edge up to `found` (a corpus with few delimiters is scanned
    // once, not once per edge).
    let (mut asked, mut found) = (0usize, 0usize);
    for b in 0..blocks as u64 {
        let is_held = drawn(b, millionths);
        held += u64::from(is_held);
        if b > 0 && is_held != was_held {
            let at = b as usize * block_tokens;
            if !(asked..=found).contains(&at) {
                (asked, found) = (at, set.first_document_start(end_of_text, at));
            }
            let edge = found;
            let split = if was_held {
                &mut validation
            } else {
                &mut train
            };
            split.push(from..edge);
            (from, was_held) = (edge, is_held);
        }
    }
    let split = if was_held {
        &mut validation
    } else {
        &mut train
    };
    split.push(from..n);
    (train.len() > 0 && validation.len() > 0).then_some(Holdout {
        train,
        validation,
        how: HeldOut::Blocks {
            held,
            blocks: blocks as u64,
        },
    })
}

/// The document draw (or the tail, for too few documents) of the module docs.
fn hold_out_documents(store: &TokenStore, millionths: u64, end_of_text: u32) -> Holdout {
    let n = store.len();
    let (mut train, mut validation) = (TokenRuns::default(), TokenRuns::default());
    let mut documents = 0u64;
    let mut held = 0u64;
    store.for_each_document(end_of_text, |range| {
        if drawn(documents, millionths) {
            validation.push(range);
            held += 1;
        } else {
            train.push(range);
        }
        documents += 1;
    });
    let enough = u128::from(documents) * u128::from(millionths)
        >= u128::from(MIN_HELD_OUT_DOCUMENTS) * u128::from(SCALE);
    if enough && train.len() > 0 && validation.len() > 0 {
        return Holdout {
            train,
            validation,
            how: HeldOut::Documents { held, documents },
        };
    }
    let tail = (n as u128 * u128::from(millionths) / u128::from(SCALE)) as usize;
    Holdout {
        train: TokenRuns::whole(0..n - tail),
        validation: TokenRuns::whole(n - tail..n),
        how: HeldOut::Tail { documents },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fractions_are_exact_millionths_and_checked() {
        assert_eq!(fraction_millionths(0.05).unwrap(), 50_000);
        assert_eq!(fraction_millionths(0.0).unwrap(), 0);
        for bad in [1.0, -0.1, f64::NAN, 2.0] {
            let msg = fraction_millionths(bad).unwrap_err().to_string();
            assert!(msg.contains("--val-fraction"), "{msg}");
        }
    }

    use crate::data::shards::{fixtures, open_shard, FormatHint};
    use std::ops::Range;

    const E: u32 = 50_256;

    /// Two llm.c shards of `docs` documents each (document `d`: the delimiter, then `len(d)`
    /// ids), as one store.
    fn store(dir: &std::path::Path, docs: u32, len: impl Fn(u32) -> u32) -> TokenStore {
        let shards = (0..2)
            .map(|s| {
                let mut ids = Vec::new();
                for d in s * docs..(s + 1) * docs {
                    ids.push(E);
                    ids.extend((0..len(d)).map(|i| 1 + (d + i) % 1000));
                }
                let bytes = fixtures::llmc_bytes(20240520, 1, &ids);
                let path = fixtures::write(dir, &format!("s{s}.bin"), &bytes);
                open_shard(&path, FormatHint::Detect).unwrap()
            })
            .collect();
        TokenStore::Shards(ShardSet::new(dir, shards).unwrap())
    }

    fn covers(runs: &TokenRuns, doc: &Range<usize>) -> bool {
        runs.ranges()
            .any(|r| r.start <= doc.start && doc.end <= r.end)
    }

    #[test]
    fn a_large_corpus_holds_out_whole_documents_by_the_draw_of_their_block() {
        let dir = tempfile::tempdir().unwrap();
        // 2 x 700 documents of 1 to 40 tokens (many longer than a block), 16-token blocks.
        let store = store(dir.path(), 700, |d| d * 7 % 40);
        let (k, millionths) = (16, 100_000);
        let split = hold_out_in_blocks_of(&store, millionths, E, k);
        let HeldOut::Blocks { held, blocks } = split.how else {
            panic!("{:?}", split.how);
        };
        assert_eq!(blocks as usize, store.len().div_ceil(k));
        let want_held = (0..blocks).filter(|&b| drawn(b, millionths)).count() as u64;
        assert_eq!(held, want_held);
        assert!(held >= 16, "{held} of {blocks}");
        let mut held_docs = 0;
        store.for_each_document(E, |doc| {
            let is_held = drawn((doc.start / k) as u64, millionths);
            let (mine, other) = match is_held {
                true => (&split.validation, &split.train),
                false => (&split.train, &split.validation),
            };
            assert!(
                doc.is_empty() || covers(mine, &doc),
                "{doc:?} held {is_held}"
            );
            assert!(doc.is_empty() || !covers(other, &doc), "{doc:?}");
            held_docs += usize::from(is_held);
        });
        assert!(held_docs > 0);
        assert_eq!(split.train.len() + split.validation.len(), store.len());
        // Below the threshold the documents themselves are drawn.
        let few = hold_out_in_blocks_of(&store, millionths, E, 1 << 20);
        assert!(
            matches!(few.how, HeldOut::Documents { .. }),
            "{:?}",
            few.how
        );
    }

    #[test]
    fn blocks_are_drawn_from_the_expected_count_of_sixteen_held_out() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path(), 100, |_| 9); // 2000 tokens
                                                   // 2000 tokens in blocks of 10: 200 blocks; 8% expects exactly 16 of them.
        let at = hold_out_in_blocks_of(&store, 80_000, E, 10);
        assert!(
            matches!(at.how, HeldOut::Blocks { blocks: 200, .. }),
            "{:?}",
            at.how
        );
        let below = hold_out_in_blocks_of(&store, 79_999, E, 10);
        assert!(
            matches!(below.how, HeldOut::Documents { .. }),
            "{:?}",
            below.how
        );
    }

    #[test]
    fn the_tail_at_5_percent_is_the_per_mille_rule_it_replaces() {
        for n in [0usize, 1, 19, 20, 1_338_024, 5_000_001] {
            let tail = (n as u128 * 50_000 / 1_000_000) as usize;
            assert_eq!(tail, n * 50 / 1000, "n = {n}");
        }
    }
}
