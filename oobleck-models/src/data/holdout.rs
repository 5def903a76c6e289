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
//! The fraction is taken in millionths, so `0.05` splits exactly where `5 / 100` of the tokens
//! does, on every machine.

use super::order::mix;
use super::runs::TokenRuns;
use super::tokens::TokenStore;
use super::{DataError, Result};

/// `--val-fraction`'s default: 5% of the documents (or of the tokens, see the module docs).
pub const DEFAULT_VAL_FRACTION: f64 = 0.05;
/// Held-out documents expected at least: below it the tail is held out instead.
pub const MIN_HELD_OUT_DOCUMENTS: u64 = 10;
/// The fraction's unit: a millionth.
const SCALE: u64 = 1_000_000;
/// Key of the held-out draw ("oobleckv").
const KEY: u64 = 0x6f6f_626c_6563_6b76;

/// How a source's validation tokens were chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeldOut {
    /// `held` of the source's `documents` documents.
    Documents { held: u64, documents: u64 },
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
    let n = store.len();
    if millionths == 0 {
        return Holdout {
            train: TokenRuns::whole(0..n),
            validation: TokenRuns::default(),
            how: HeldOut::Nothing,
        };
    }
    let (mut train, mut validation) = (TokenRuns::default(), TokenRuns::default());
    let mut documents = 0u64;
    let mut held = 0u64;
    store.for_each_document(end_of_text, |range| {
        if mix(KEY ^ documents) % SCALE < millionths {
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

    #[test]
    fn the_tail_at_5_percent_is_the_per_mille_rule_it_replaces() {
        for n in [0usize, 1, 19, 20, 1_338_024, 5_000_001] {
            let tail = (n as u128 * 50_000 / 1_000_000) as usize;
            assert_eq!(tail, n * 50 / 1000, "n = {n}");
        }
    }
}
