//! `oobleck bench ...`: measurements that compare side by side in one run and print a table.
//! Not part of the product's path: nothing outside this folder imports it.
//!
//! - [`data`]: tokenization against tiktoken and HF tokenizers, the loader's share of a step,
//!   and peak memory on corpora of 100 MB and 5 GB.
//! - [`train`]: one training step of Candle against PyTorch eager on the same CPU threads.
//! - [`pipeline`]: a real 1F1B pipeline measured against the `schedule/` simulator.
//! - [`recovery`]: the same job fault-free, recovering in place, and restarting from a
//!   checkpoint; hangs, joins and drains.
//! - [`simulate`]: how long the cluster simulator takes as clusters and traces grow.
//! - [`status_flood`]: a training job's tokens/s alone and beside a flood of status requests.

mod child;
pub mod data;
pub mod pipeline;
pub mod recovery;
pub mod simulate;
pub mod status_flood;
pub mod train;

/// The median (the mean of the middle two for an even count); NaN for none.
pub fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    oobleck_core::profiler::median(&mut xs.to_vec())
}
