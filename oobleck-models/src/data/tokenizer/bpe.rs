//! GPT-2's byte-level BPE on bytes, the encoding half of [`super::Gpt2Tokenizer`] for
//! vocabularies built from a vocabulary and a merges file (GPT-2's, OPT's).
//!
//! The ids equal those of the `tokenizers` crate's `BPE` model behind GPT-2's `ByteLevel`
//! pre-tokenizer (the exactness tests compare the two on the shipped corpus and on fuzzed
//! Unicode): per piece of [`super::pretokenize`], the bytes start as one symbol each and the
//! adjacent pair of lowest merge rank is merged until none is left, the leftmost first among
//! equal ranks. Speed comes from
//! - working on bytes: the printable characters GPT-2 maps bytes to are only the vocabulary's
//!   spelling, undone once when the tables are built;
//! - a whole-piece lookup: most pieces (`" the"`, `" world"`) are one token, found by one hash
//!   lookup instead of merges; only tokens whose merges give back the token itself are in that
//!   table, so it cannot disagree with merging;
//! - merges keyed by a pair of ids packed in a `u64` with a multiplicative hash;
//! - a per-thread cache of the pieces that needed merges (a tenth of the corpus's pieces, half
//!   of the time before it).

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use super::pretokenize;

/// Pieces of more symbols than this are merged with a heap (O(n log n)); shorter ones by a
/// scan for the lowest rank per merge (O(n²), faster for words).
const HEAP_ABOVE: usize = 64;

/// GPT-2's byte-level BPE tables, on bytes.
pub(super) struct ByteLevelBpe {
    /// Id of each single byte.
    byte_ids: [u32; 256],
    /// `(left id, right id)` packed by [`pair_key`] -> `(rank, merged id)`.
    merges: HashMap<u64, (u32, u32), FastHash>,
    /// Bytes of a token -> its id, for tokens that merging their bytes gives back.
    whole: HashMap<Box<[u8]>, u32, FastHash>,
    /// Tells these tables' entries in a thread's [`PieceCache`] from another tokenizer's.
    id: u64,
}

/// The printable characters GPT-2 spells bytes with (`bytes_to_unicode` of OpenAI's
/// `encoder.py`): printable Latin-1 bytes stand for themselves, the others for U+0100 onwards
/// in byte order.
pub(super) fn byte_chars() -> [char; 256] {
    let mut chars = ['\0'; 256];
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        chars[b as usize] = if printable {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(next - 1).expect("U+0100..U+0143 are characters")
        };
    }
    chars
}

impl ByteLevelBpe {
    /// The tables of a vocabulary (`token -> id`, tokens spelled with [`byte_chars`]) and its
    /// merges in rank order. `None` when the vocabulary cannot be expressed on bytes (a byte
    /// without a token of its own): such a tokenizer keeps the `tokenizers` crate's path.
    pub(super) fn new<'a>(
        vocab: impl IntoIterator<Item = (&'a str, u32)> + Clone,
        merges: &[(String, String)],
    ) -> Option<Self> {
        let chars = byte_chars();
        let mut unbyte: HashMap<char, u8, FastHash> = HashMap::default();
        for (b, c) in chars.iter().enumerate() {
            unbyte.insert(*c, b as u8);
        }
        let ids: HashMap<&str, u32, FastHash> = vocab.clone().into_iter().collect();
        let mut byte_ids = [0u32; 256];
        for (b, c) in chars.iter().enumerate() {
            byte_ids[b] = *ids.get(c.to_string().as_str())?;
        }
        // As the `tokenizers` crate builds its map: a later duplicate pair overrides.
        let mut pairs = HashMap::with_capacity_and_hasher(merges.len(), FastHash::default());
        let mut joined = String::new();
        for (rank, (a, b)) in merges.iter().enumerate() {
            joined.clear();
            joined.push_str(a);
            joined.push_str(b);
            let merged = ids.get(joined.as_str())?;
            pairs.insert(
                pair_key(*ids.get(a.as_str())?, *ids.get(b.as_str())?),
                (rank as u32, *merged),
            );
        }
        let mut bpe = Self {
            byte_ids,
            merges: pairs,
            whole: HashMap::default(),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        };
        bpe.whole = bpe.self_merging_tokens(vocab, &unbyte);
        Some(bpe)
    }

    /// The tokens of several bytes whose merges end in the token itself, by their bytes (all
    /// 50,000 of GPT-2's, but a vocabulary need not be so; checked in parallel, as it is most
    /// of the time of building the tables).
    fn self_merging_tokens<'a>(
        &self,
        vocab: impl IntoIterator<Item = (&'a str, u32)>,
        unbyte: &HashMap<char, u8, FastHash>,
    ) -> HashMap<Box<[u8]>, u32, FastHash> {
        let tokens: Vec<(&str, u32)> = vocab.into_iter().collect();
        tokens
            .par_chunks(4096)
            .flat_map_iter(|chunk| {
                let mut out = Vec::new();
                chunk.iter().filter_map(move |&(token, id)| {
                    // A token not spelled in bytes (a special one) is never a merge result.
                    let bytes = token
                        .chars()
                        .map(|c| unbyte.get(&c).copied())
                        .collect::<Option<Vec<u8>>>()?;
                    out.clear();
                    if bytes.len() >= 2 {
                        self.merge(&bytes, &mut out);
                    }
                    (out == [id]).then(|| (bytes.into_boxed_slice(), id))
                })
            })
            .collect()
    }

    /// Appends the ids of `text` (no special tokens in it) to `out`.
    pub(super) fn encode_ordinary(&self, text: &str, out: &mut Vec<u32>) {
        PIECE_CACHE.with(|cache| {
            let mut cache = cache.borrow_mut();
            if cache.owner != self.id {
                cache.owner = self.id;
                cache.ids.clear();
            }
            for piece in pretokenize::pieces(text) {
                self.encode_piece(piece.as_bytes(), &mut cache, out);
            }
        });
    }

    /// Appends the ids of one piece of the pre-tokenizer.
    #[inline]
    fn encode_piece(&self, piece: &[u8], cache: &mut PieceCache, out: &mut Vec<u32>) {
        if let [b] = piece {
            out.push(self.byte_ids[*b as usize]);
        } else if let Some(&id) = self.whole.get(piece) {
            out.push(id);
        } else if let Some(ids) = cache.ids.get(piece) {
            out.extend_from_slice(ids);
        } else {
            let start = out.len();
            self.merge(piece, out);
            if piece.len() <= CACHED_PIECE_BYTES {
                if cache.ids.len() >= CACHED_PIECES {
                    cache.ids.clear();
                }
                cache.ids.insert(piece.into(), out[start..].into());
            }
        }
    }

    /// Rank and merged id of the pair `(a, b)`, or `(u32::MAX, _)` if it does not merge.
    #[inline]
    fn rank(&self, a: u32, b: u32) -> (u32, u32) {
        self.merges
            .get(&pair_key(a, b))
            .copied()
            .unwrap_or((u32::MAX, 0))
    }

    /// BPE merges of `bytes`, appended to `out`.
    fn merge(&self, bytes: &[u8], out: &mut Vec<u32>) {
        if bytes.len() > HEAP_ABOVE {
            self.merge_with_heap(bytes, out);
        } else {
            self.merge_by_scan(bytes, out);
        }
    }

    /// Merges by scanning for the lowest rank each time (the left pair wins a tie).
    fn merge_by_scan(&self, bytes: &[u8], out: &mut Vec<u32>) {
        let mut ids: Vec<u32> = bytes.iter().map(|&b| self.byte_ids[b as usize]).collect();
        // ranks[i]: (rank, merged id) of the pair (ids[i], ids[i + 1]).
        let mut ranks: Vec<(u32, u32)> = ids.windows(2).map(|w| self.rank(w[0], w[1])).collect();
        loop {
            let mut best = 0;
            for (i, r) in ranks.iter().enumerate().skip(1) {
                if r.0 < ranks[best].0 {
                    best = i;
                }
            }
            match ranks.get(best) {
                Some(&(rank, merged)) if rank != u32::MAX => {
                    ids[best] = merged;
                    ids.remove(best + 1);
                    ranks.remove(best);
                    if best > 0 {
                        ranks[best - 1] = self.rank(ids[best - 1], merged);
                    }
                    if best + 1 < ids.len() {
                        ranks[best] = self.rank(merged, ids[best + 1]);
                    }
                }
                _ => break,
            }
        }
        out.extend_from_slice(&ids);
    }

    /// Merges with a min-heap of `(rank, position)` over a linked list of symbols, as the
    /// `tokenizers` crate does: stale entries are recognised by the pair at their position
    /// no longer merging into their id (a position's pair only ever grows, so a different
    /// pair there spells a longer, different token).
    fn merge_with_heap(&self, bytes: &[u8], out: &mut Vec<u32>) {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;

        let n = bytes.len();
        let mut ids: Vec<u32> = bytes.iter().map(|&b| self.byte_ids[b as usize]).collect();
        let mut next: Vec<usize> = (1..=n).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut alive = vec![true; n];
        let mut heap = BinaryHeap::with_capacity(n);
        for i in 0..n - 1 {
            let (rank, merged) = self.rank(ids[i], ids[i + 1]);
            if rank != u32::MAX {
                heap.push(Reverse((rank, i, merged)));
            }
        }
        while let Some(Reverse((_, pos, merged))) = heap.pop() {
            let right = next[pos];
            if !alive[pos] || right >= n || self.rank(ids[pos], ids[right]).1 != merged {
                continue;
            }
            ids[pos] = merged;
            alive[right] = false;
            next[pos] = next[right];
            if next[pos] < n {
                prev[next[pos]] = pos;
            }
            let before = prev[pos];
            if before < n {
                let (rank, m) = self.rank(ids[before], merged);
                if rank != u32::MAX {
                    heap.push(Reverse((rank, before, m)));
                }
            }
            if next[pos] < n {
                let (rank, m) = self.rank(merged, ids[next[pos]]);
                if rank != u32::MAX {
                    heap.push(Reverse((rank, pos, m)));
                }
            }
        }
        let mut i = 0;
        while i < n {
            out.push(ids[i]);
            i = next[i];
        }
    }
}

/// Pieces of several tokens seen last on this thread, with their ids: names and rare words
/// recur in a document and a corpus, and one lookup is cheaper than their merges again.
/// Thread-local, so threads never wait on each other; keyed by the tables' [`ByteLevelBpe::id`]
/// as a thread may encode with several tokenizers.
struct PieceCache {
    owner: u64,
    ids: HashMap<Box<[u8]>, Box<[u32]>, FastHash>,
}

/// Bounds of [`PieceCache`]: at most this many pieces (then it starts over) of at most this
/// many bytes (a few MB a thread).
const CACHED_PIECES: usize = 1 << 15;
const CACHED_PIECE_BYTES: usize = 32;

thread_local! {
    static PIECE_CACHE: RefCell<PieceCache> = RefCell::new(PieceCache {
        owner: 0,
        ids: HashMap::default(),
    });
}

/// Source of [`ByteLevelBpe::id`]s (0 is no tables).
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The key of the pair `(a, b)` in the merges table.
#[inline]
fn pair_key(a: u32, b: u32) -> u64 {
    (u64::from(a) << 32) | u64::from(b)
}

/// A multiplicative hash (the one `rustc` uses, "FxHash"): a few cycles for a `u64` key or a
/// short word, where the standard SipHash costs as much as the rest of a piece's encoding.
/// The keys are tokens of a vocabulary and pieces of text, nothing an attacker picks to
/// collide a server's tables.
#[derive(Default, Clone, Copy)]
pub(super) struct FxHasher {
    hash: u64,
}

type FastHash = BuildHasherDefault<FxHasher>;

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, mut bytes: &[u8]) {
        while bytes.len() >= 8 {
            self.add(u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")));
            bytes = &bytes[8..];
        }
        if bytes.len() >= 4 {
            self.add(u64::from(u32::from_le_bytes(
                bytes[..4].try_into().expect("4 bytes"),
            )));
            bytes = &bytes[4..];
        }
        for &b in bytes {
            self.add(u64::from(b));
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.hash
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_chars_are_gpt2s() {
        let chars = byte_chars();
        assert_eq!(chars[b'A' as usize], 'A');
        assert_eq!(chars[b' ' as usize], 'Ġ');
        assert_eq!(chars[b'\n' as usize], 'Ċ');
        assert_eq!(chars[0], 'Ā');
        assert_eq!(chars[0xAD], 'Ń');
        assert_eq!(chars[0x7F], 'ġ');
        let distinct: std::collections::HashSet<char> = chars.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }
}
