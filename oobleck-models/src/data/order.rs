//! An epoch's sample order as a keyed bijection computed on demand (DESIGN.md section 4).
//!
//! [`EpochOrder::at`]`(p)` is the sample at position `p` of an epoch: a permutation of `0..n`
//! keyed by `(seed, epoch, split)`, evaluated per position in constant time and memory, so no
//! process holds an array that grows with the corpus (the materialised Fisher-Yates order it
//! replaces was 4 bytes per window in every worker).
//!
//! - **Domain**: `n` is embedded in `0..4^h` with `h = max(1, ceil(log2(n) / 2))`, the smallest
//!   even power of two `>= n` (at most `4n`), split into two halves of `h` bits.
//! - **Network**: [`ROUNDS`] rounds of a balanced Feistel network,
//!   `(L, R) -> (R, L ^ F_r(R))`; the output is `L << h | R`. A Feistel network is a bijection
//!   whatever `F` is, so only its mixing quality matters; the inverse runs the rounds backwards.
//! - **Round function**: `F_r(x)` = the top `h` bits of `mix(k_r ^ x)`, where `mix` is the
//!   SplitMix64 finaliser (Steele, Lea, Flood 2014; Stafford's "Mix13" constants), a bijection
//!   of `u64` with full avalanche: every input bit flips each output bit with probability about
//!   1/2. It is two multiplies and three shifts, a few ns, which matters because it runs
//!   `ROUNDS` times per sample. SHA-256 per round would cost a hundred times more for nothing a
//!   data order needs: the order must look random to training, not resist an adversary.
//! - **Keys**: `k_r` is the first 8 bytes (LE) of
//!   `SHA-256("oobleck-data-order" | seed u64 LE | epoch u64 LE | split u8 | r u8)`, split 0 for
//!   train and 1 for validation. SHA-256 runs once per round key when the order is built, so
//!   nearby seeds and epochs give unrelated keys, with no ad-hoc mixing of the three inputs.
//! - **Cycle-walking** (Black and Rogaway 2002): positions and samples live in `0..n` but the
//!   network permutes `0..4^h`, so a value `>= n` is fed back through the network until it
//!   lands in `0..n`. Following one cycle of a permutation from a point of `0..n` must come back
//!   to that point, so the walk ends, and the walk restricted to `0..n` is again a bijection.
//!   A value outside `0..n` lies on at most one walk, so the `n` walks take at most `4^h <= 4n`
//!   passes together: at most 4 per position on average, and a walk of `w` passes has
//!   probability about `(1 - n / 4^h)^(w - 1) <= (3/4)^(w - 1)`.
//!
//! Six rounds: Luby and Rackoff showed that four rounds of independent random functions make
//! a strong pseudorandom permutation; two more buy margin for the narrow halves of small
//! corpora (`h` of a few bits), where each round function is far from a random function.

use sha2::{Digest, Sha256};

use super::Split;

/// Feistel rounds per pass (see the module docs for why six).
pub const ROUNDS: usize = 6;

/// Domain tag of the round keys: another use of SHA-256 over the same numbers cannot collide.
const KEY_TAG: &[u8] = b"oobleck-data-order";

/// The order of one epoch of one split: a bijection of `0..n` keyed by `(seed, epoch, split)`.
///
/// Building one hashes [`ROUNDS`] SHA-256 blocks (about a microsecond); it holds 64 bytes
/// whatever `n` is. `Copy`, `Send` and `Sync`: every thread and process that builds one from
/// the same inputs gets the same order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpochOrder {
    n: u64,
    /// Bits per Feistel half, `h` (1..=32).
    half_bits: u32,
    keys: [u64; ROUNDS],
}

impl EpochOrder {
    /// The order of `n` samples in `epoch` of `split` for `seed`. `n = 0` is an empty order.
    pub fn new(seed: u64, epoch: u64, split: Split, n: u64) -> Self {
        Self::of_source(seed, 0, epoch, split, n)
    }

    /// The order of source `source` of a blend (each source has its own orders). Source 0's is
    /// [`Self::new`]'s; another's round keys also hash `source` (u32 LE) after the round byte,
    /// so a one-source run's order is the same whether or not it is called a blend.
    pub fn of_source(seed: u64, source: u32, epoch: u64, split: Split, n: u64) -> Self {
        let split_byte = match split {
            Split::Train => 0u8,
            Split::Validation => 1,
        };
        let keys = std::array::from_fn(|r| {
            let digest = Sha256::new()
                .chain_update(KEY_TAG)
                .chain_update(seed.to_le_bytes())
                .chain_update(epoch.to_le_bytes())
                .chain_update([split_byte, r as u8]);
            let digest = match source {
                0 => digest.finalize(),
                s => digest.chain_update(s.to_le_bytes()).finalize(),
            };
            let mut word = [0u8; 8];
            word.copy_from_slice(&digest[..8]);
            u64::from_le_bytes(word)
        });
        Self {
            n,
            half_bits: half_bits(n),
            keys,
        }
    }

    /// Samples in the order (positions and samples are both `0..n`).
    pub fn len(&self) -> u64 {
        self.n
    }

    /// True for the order of no samples.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The sample at position `position` (`< n`).
    ///
    /// Panics if `position >= n`: the callers index positions they derived from `n`.
    pub fn at(&self, position: u64) -> u64 {
        self.walk(position, Self::forward)
    }

    /// The position of `sample` (`< n`): the inverse of [`Self::at`].
    ///
    /// Panics if `sample >= n`, like [`Self::at`].
    pub fn position_of(&self, sample: u64) -> u64 {
        self.walk(sample, Self::backward)
    }

    fn walk(&self, start: u64, pass: impl Fn(&Self, u64) -> u64) -> u64 {
        assert!(
            start < self.n,
            "index {start} outside an order of {} samples",
            self.n
        );
        let mut x = start;
        loop {
            x = pass(self, x);
            if x < self.n {
                return x;
            }
        }
    }

    fn mask(&self) -> u64 {
        (1u64 << self.half_bits) - 1
    }

    /// One pass of the network over `0..4^h`.
    fn forward(&self, x: u64) -> u64 {
        let (mut left, mut right) = (x >> self.half_bits, x & self.mask());
        for &key in &self.keys {
            (left, right) = (right, left ^ self.round(key, right));
        }
        left << self.half_bits | right
    }

    /// The inverse of [`Self::forward`].
    fn backward(&self, x: u64) -> u64 {
        let (mut left, mut right) = (x >> self.half_bits, x & self.mask());
        for &key in self.keys.iter().rev() {
            (left, right) = (right ^ self.round(key, left), left);
        }
        left << self.half_bits | right
    }

    /// `F_r(x)`: the top `h` bits of the mixed `key ^ x`; the top bits of a product depend on
    /// every lower input bit, so they are the best mixed.
    fn round(&self, key: u64, x: u64) -> u64 {
        mix(key ^ x) >> (64 - self.half_bits)
    }
}

/// Bits per half of the smallest even power of two `>= n`, at least 1.
fn half_bits(n: u64) -> u32 {
    let bits = 64 - n.saturating_sub(1).leading_zeros();
    bits.div_ceil(2).max(1)
}

/// The SplitMix64 finaliser (a bijection of `u64`).
pub(crate) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checks that `order` maps `0..n` onto `0..n` and that [`EpochOrder::position_of`] undoes
    /// it, with a bitset of the samples seen.
    fn assert_permutation(order: &EpochOrder) {
        let n = order.len();
        let mut seen = vec![0u64; n.div_ceil(64) as usize];
        for p in 0..n {
            let s = order.at(p);
            assert!(s < n, "position {p} of {n} gave sample {s}");
            let (word, bit) = ((s / 64) as usize, 1u64 << (s % 64));
            assert_eq!(seen[word] & bit, 0, "sample {s} twice in an order of {n}");
            seen[word] |= bit;
            assert_eq!(order.position_of(s), p, "inverse of position {p} of {n}");
        }
    }

    #[test]
    fn every_order_of_up_to_2000_samples_is_a_permutation() {
        for n in 1..=2000 {
            assert_permutation(&EpochOrder::new(0, 0, Split::Train, n));
            assert_permutation(&EpochOrder::new(7, 3, Split::Validation, n));
        }
    }

    #[test]
    fn random_sizes_up_to_100_000_are_permutations() {
        // Sizes drawn by SplitMix64 from a fixed state, plus the edges of the domain: a power
        // of four (the domain exactly) and one past it (a domain almost four times n).
        let mut state = 0x5eed_u64;
        let mut sizes: Vec<u64> = (0..16)
            .map(|_| {
                state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
                2001 + mix(state) % 98_000
            })
            .collect();
        sizes.extend([4096, 4097, 65_536, 65_537, 100_000]);
        for (i, &n) in sizes.iter().enumerate() {
            assert_permutation(&EpochOrder::new(i as u64, 1, Split::Train, n));
        }
    }

    #[test]
    fn orders_are_keyed_by_seed_epoch_and_split() {
        let first = |seed, epoch, split| -> Vec<u64> {
            let order = EpochOrder::new(seed, epoch, split, 1000);
            (0..50).map(|p| order.at(p)).collect()
        };
        let base = first(7, 0, Split::Train);
        assert_eq!(base, first(7, 0, Split::Train));
        assert_ne!(base, first(8, 0, Split::Train));
        assert_ne!(base, first(7, 1, Split::Train));
        assert_ne!(base, first(7, 0, Split::Validation));
        // Seed and epoch are separate inputs, not summed or xored into one number.
        assert_ne!(first(1, 0, Split::Train), first(0, 1, Split::Train));
    }

    #[test]
    fn cycle_walking_ends_for_any_size() {
        assert_eq!(EpochOrder::new(3, 0, Split::Train, 1).at(0), 0);
        assert!(EpochOrder::new(3, 0, Split::Train, 0).is_empty());
        // One past a power of four: the domain is almost 4n, the longest walks are longest.
        // Up to 2^64 - 1 (halves of 32 bits), far beyond 2^40 windows.
        let mut sizes: Vec<u64> = (1..32).map(|k| (1u64 << (2 * k)) + 1).collect();
        sizes.extend([1 << 40, (1 << 40) + 1, u64::MAX / 3, u64::MAX]);
        for n in sizes {
            let order = EpochOrder::new(11, 2, Split::Train, n);
            for p in [0, 1, n / 2, n - 1] {
                let s = order.at(p);
                assert!(s < n, "position {p} of {n} gave {s}");
                assert_eq!(order.position_of(s), p, "n = {n}");
            }
        }
    }

    #[test]
    fn an_order_looks_shuffled() {
        // A uniformly random permutation of 10,000 has 1 fixed point on average, no
        // correlation between position and sample, and consecutive samples n/3 apart on
        // average. Bounds are loose (many standard deviations); the identity or a rotation
        // fails all three.
        let n = 10_000u64;
        let order = EpochOrder::new(42, 0, Split::Train, n);
        let samples: Vec<f64> = (0..n).map(|p| order.at(p) as f64).collect();
        let fixed = (0..n).filter(|&p| order.at(p) == p).count();
        assert!(fixed < 10, "{fixed} fixed points");
        let mean = (n - 1) as f64 / 2.0;
        let var: f64 = (0..n).map(|p| (p as f64 - mean).powi(2)).sum();
        let cov: f64 = samples
            .iter()
            .enumerate()
            .map(|(p, s)| (p as f64 - mean) * (s - mean))
            .sum();
        assert!((cov / var).abs() < 0.05, "correlation {}", cov / var);
        let gap: f64 = samples.windows(2).map(|w| (w[1] - w[0]).abs()).sum::<f64>();
        let gap = gap / (n - 1) as f64 / n as f64;
        assert!((0.30..0.37).contains(&gap), "mean gap {gap} n");
    }

    #[test]
    fn epoch_order_is_pinned() {
        // Pins the documented algorithm: a change here changes every run's data order. The
        // expected values were computed independently by a Python script written from the
        // module docs alone (hashlib.sha256 for the round keys, integer arithmetic masked to
        // 64 bits for the finaliser, the same Feistel rounds and cycle-walk).
        let order = EpochOrder::new(1234, 5, Split::Train, 12);
        let got: Vec<u64> = (0..12).map(|p| order.at(p)).collect();
        assert_eq!(got, PINNED_12);
        let order = EpochOrder::new(1, 0, Split::Validation, 1_000_003);
        let got: Vec<u64> = (0..6).map(|p| order.at(p)).collect();
        assert_eq!(got, PINNED_1M);
        let order = EpochOrder::new(u64::MAX, 1 << 33, Split::Train, 1 << 40);
        let got: Vec<u64> = (0..4).map(|p| order.at(p)).collect();
        assert_eq!(got, PINNED_2_40);
    }

    const PINNED_12: [u64; 12] = [10, 5, 8, 7, 3, 11, 6, 1, 2, 4, 0, 9];
    const PINNED_1M: [u64; 6] = [251269, 188344, 332232, 935380, 294050, 587027];
    const PINNED_2_40: [u64; 4] = [574995586769, 429378418608, 996604180928, 794755305823];

    /// Not a check: prints what one `at` costs (`--ignored --nocapture`; oobleck-models is
    /// built with opt-level 3 even in the dev profile).
    #[test]
    #[ignore = "a timing to read, not a check"]
    fn print_the_cost_of_at() {
        for n in [1u64 << 20, (1 << 20) + 1, 1 << 40, 3 << 39] {
            let order = EpochOrder::new(1, 0, Split::Train, n);
            let calls = n.min(2_000_000);
            let start = std::time::Instant::now();
            let mut sum = 0u64;
            for p in 0..calls {
                sum = sum.wrapping_add(order.at(std::hint::black_box(p)));
            }
            let ns = start.elapsed().as_nanos() as f64 / calls as f64;
            eprintln!("n = {n}: {ns:.1} ns per at() (checksum {sum})");
        }
        let start = std::time::Instant::now();
        for e in 0..10_000u64 {
            std::hint::black_box(EpochOrder::new(1, e, Split::Train, 1 << 30));
        }
        let ns = start.elapsed().as_nanos() as f64 / 10_000.0;
        eprintln!("{ns:.0} ns per EpochOrder::new");
    }
}
