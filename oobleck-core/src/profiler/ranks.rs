//! Profiles for ranks that share a machine's cores. A local cluster runs every worker process
//! on one machine, and a node runs its `G` workers on one: each rank computes with its share
//! of the cores, beside the others. A profile taken by one process owning every core predicts
//! steps several times shorter than such ranks take (`train` on 4 local nodes, 2 cores: 410 ms
//! predicted, 1928 ms measured). So the layers are timed as the ranks run them: `ranks`
//! copies at once, each in a rayon pool of its share of the cores (the pool Candle's CPU
//! kernels and ours run on), and the fingerprint names that share, so the cache keeps a
//! profile per sharing.
//!
//! Every copy holds its windows of layers (see the module docs of [`super`]), so `ranks`
//! copies of a big model need `ranks` times the memory of one: [`RankShare::within`] sizes the
//! measurement to a memory budget from the layers' estimated sizes. It shrinks the windows to
//! one layer first (the copies still share the cores as the ranks will), then runs fewer
//! copies at once; their times are then scaled by how much more `ranks` copies would have
//! crowded the cores ([`RankShare::time_scale`]), an estimate that the profile line says.

use candle_core::Device;

use super::{
    device_kind, measure_in_windows, median, profile_error, Measured, ProfileRequest, WINDOW_BYTES,
};
use crate::planning::profile::{ms_to_ns, ns_to_ms};
use crate::planning::LayerProfile;
use crate::Result;

/// The cores this process may run on.
pub fn host_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The threads each of `ranks` ranks sharing `cores` cores gets: an equal share, at least one.
pub fn threads_per_rank(cores: usize, ranks: usize) -> usize {
    (cores / ranks.max(1)).max(1)
}

/// The threads a rank gets when `ranks` share this machine: `RAYON_NUM_THREADS` when the user
/// set it (workers inherit it, and it sizes Candle's pool), else [`threads_per_rank`] of the
/// cores this process may run on. The agents give their workers this many (`RAYON_NUM_THREADS`),
/// so the profile and the workers agree.
pub fn rank_threads(ranks: usize) -> usize {
    user_threads().unwrap_or_else(|| threads_per_rank(host_cores(), ranks))
}

/// `RAYON_NUM_THREADS` as the user set it (a positive number), if they did.
pub fn user_threads() -> Option<usize> {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
}

/// The fingerprint's device kind of a profile measured as `ranks` ranks of `threads` threads:
/// `cpu:<model name>x<threads>`, with `/<ranks> ranks` when several share the machine.
/// Other devices are not shared: their kind as [`device_kind`] says.
pub fn shared_device_kind(device: &Device, ranks: usize, threads: usize) -> String {
    if !matches!(device, Device::Cpu) {
        return device_kind(device);
    }
    let model = super::cpu_model_name();
    match ranks {
        0 | 1 => format!("cpu:{model}x{threads}"),
        r => format!("cpu:{model}x{threads}/{r} ranks"),
    }
}

/// How a profile of `ranks` ranks sharing a machine is measured: how many copies at once, in
/// windows of how many bytes (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankShare {
    /// Ranks the profile stands for (its fingerprint names them).
    pub ranks: usize,
    /// Threads of each copy's pool (0: the caller's pool).
    pub threads: usize,
    /// Copies measured at once: `ranks`, or fewer where that many would not fit in memory.
    pub at_once: usize,
    /// The window size of each copy ([`super::measure_in_windows`]).
    pub window_bytes: u64,
}

impl RankShare {
    /// Every rank's copy at once, in windows of [`WINDOW_BYTES`]: the measurement of a model
    /// whose copies fit.
    pub fn all_at_once(ranks: usize, threads: usize) -> RankShare {
        RankShare {
            ranks,
            threads,
            at_once: ranks.max(1),
            window_bytes: WINDOW_BYTES,
        }
    }

    /// The measurement of layers of these sizes (an estimate: the planner's analytical
    /// profile) that fits `budget_bytes`: all copies at once in full windows if they fit,
    /// else in windows of one layer, else as many copies at once as fit in windows of one
    /// layer. `None` when not even one copy of the largest layer fits.
    pub fn within(
        ranks: usize,
        threads: usize,
        layers: &[LayerProfile],
        budget_bytes: u64,
    ) -> Option<RankShare> {
        let ranks = ranks.max(1);
        let fits = |window: u64| (budget_bytes / copy_bytes(layers, window).max(1)) as usize;
        for window_bytes in [WINDOW_BYTES, 0] {
            if fits(window_bytes) >= ranks {
                return Some(RankShare {
                    window_bytes,
                    ..RankShare::all_at_once(ranks, threads)
                });
            }
        }
        let at_once = fits(0);
        (at_once >= 1).then_some(RankShare {
            ranks,
            threads,
            at_once,
            window_bytes: 0,
        })
    }

    /// The factor the times of `at_once` copies are scaled by to stand for `ranks` copies on
    /// `cores` cores: a copy runs slower by how far the copies running at once oversubscribe
    /// the cores, `max(1, copies x threads / cores)`, so the factor is that of `ranks` over
    /// that of `at_once` (1 when all run at once).
    pub fn time_scale(&self, cores: usize) -> f64 {
        let load = |copies: usize| (copies * self.threads.max(1)) as f64 / cores.max(1) as f64;
        load(self.ranks).max(1.0) / load(self.at_once).max(1.0)
    }

    /// How the ranks are measured, for the profile line: `as 4 ranks of 1 thread(s) at once`,
    /// then what the memory budget changed.
    pub fn describe(&self, cores: usize) -> String {
        let mut words = format!("as {} ranks of {} thread(s)", self.ranks, self.threads);
        if self.at_once == self.ranks {
            words.push_str(" at once");
        } else {
            words.push_str(&format!(
                ", {} at once (times scaled x{:.2} for the cores {} would share)",
                self.at_once,
                self.time_scale(cores),
                self.ranks
            ));
        }
        if self.window_bytes < WINDOW_BYTES {
            words.push_str(", one layer at a time");
        }
        words
    }
}

/// The most one copy of a measurement holds at once, bytes, for layers of these sizes in
/// windows of `window_bytes`: every layer of a window keeps its parameters, its running
/// gradient sum and, while the window is swept, its activations; the backward of the largest
/// layer in it needs about its activations again for temporaries.
pub fn copy_bytes(layers: &[LayerProfile], window_bytes: u64) -> u64 {
    let (mut peak, mut held, mut largest, mut window) = (0u64, 0u64, 0u64, 0u64);
    for l in layers {
        held = held
            .saturating_add(l.param_bytes.saturating_mul(2))
            .saturating_add(l.activation_bytes);
        largest = largest.max(l.activation_bytes);
        window = window.saturating_add(l.param_bytes.saturating_add(l.activation_bytes));
        peak = peak.max(held.saturating_add(largest));
        // As `measure_in_windows` closes a window.
        if window >= window_bytes {
            (held, largest, window) = (0, 0, 0);
        }
    }
    peak
}

/// Measures `req` as `share.ranks` ranks of `share.threads` threads each run it on one CPU
/// machine: `share.at_once` copies at once, each in its own pool (`threads` 0: all in the
/// caller's). Per layer, the times are the median over the copies (scaled by
/// [`RankShare::time_scale`] when fewer than `ranks` ran) and the kept activation bytes the
/// smallest (each copy sees the process's resident memory rise with the others' allocations
/// too); the peaks are the largest. On other devices, one measurement as it is.
pub fn measure_as_ranks(req: &ProfileRequest<'_>, share: &RankShare) -> Result<Measured> {
    if !matches!(req.device, Device::Cpu) {
        return measure_in_windows(req, share.window_bytes);
    }
    let start = std::time::Instant::now();
    let copies: Vec<Result<Measured>> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..share.at_once.max(1))
            .map(|_| sc.spawn(|| in_pool(req, share.threads, share.window_bytes)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(profile_error(req, "a profiling thread panicked".into()))
                })
            })
            .collect()
    });
    let copies = copies.into_iter().collect::<Result<Vec<_>>>()?;
    let mut all = combine(&copies, share.time_scale(host_cores()));
    all.profile.fingerprint.device_kind =
        shared_device_kind(req.device, share.ranks, share.threads);
    all.elapsed = start.elapsed();
    Ok(all)
}

/// One measurement inside a rayon pool of `threads` threads (0: the caller's pool).
fn in_pool(req: &ProfileRequest<'_>, threads: usize, window_bytes: u64) -> Result<Measured> {
    if threads == 0 {
        return measure_in_windows(req, window_bytes);
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| profile_error(req, format!("building a pool of {threads} threads: {e}")))?;
    pool.install(|| measure_in_windows(req, window_bytes))
}

/// The copies' measurements as one (see [`measure_as_ranks`]), times multiplied by `scale`;
/// `copies` is not empty.
fn combine(copies: &[Measured], scale: f64) -> Measured {
    let mut out = copies[0].clone();
    for (i, layer) in out.profile.layers.iter_mut().enumerate() {
        let mut f: Vec<f64> = copies
            .iter()
            .map(|c| c.profile.layers[i].forward_ms)
            .collect();
        let mut b: Vec<f64> = copies
            .iter()
            .map(|c| c.profile.layers[i].backward_ms)
            .collect();
        // Whole nanoseconds, as `measure` keeps them (a profile survives its JSON round trip).
        layer.forward_ms = ns_to_ms(ms_to_ns(median(&mut f) * scale));
        layer.backward_ms = ns_to_ms(ms_to_ns(median(&mut b) * scale));
        layer.activation_bytes = copies
            .iter()
            .map(|c| c.profile.layers[i].activation_bytes)
            .min()
            .unwrap_or(layer.activation_bytes);
        out.peak_bytes[i] = copies.iter().filter_map(|c| c.peak_bytes[i]).max();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    /// An embedding, `blocks` blocks and a head, sized like a GPT in f32 (params, activations).
    fn layers(blocks: usize, block: (u64, u64)) -> Vec<LayerProfile> {
        let layer = |(param_bytes, activation_bytes): (u64, u64)| LayerProfile {
            name: String::new(),
            forward_ms: 1.0,
            backward_ms: 2.0,
            param_bytes,
            activation_bytes,
            output_bytes: 1,
        };
        let mut v = vec![layer((GIB / 4, GIB / 32))];
        v.extend((0..blocks).map(|_| layer(block)));
        v.push(layer((GIB / 4, GIB)));
        v
    }

    #[test]
    fn a_copy_holds_its_window_and_the_largest_layer_again() {
        let small = layers(4, (GIB / 64, GIB / 64));
        // One window of the whole model: 2 x params + activations, plus the head's again.
        let held: u64 = small
            .iter()
            .map(|l| 2 * l.param_bytes + l.activation_bytes)
            .sum();
        assert_eq!(copy_bytes(&small, u64::MAX), held + GIB);
        // One layer at a time: the head alone is the most.
        assert_eq!(copy_bytes(&small, 0), 2 * (GIB / 4) + 2 * GIB);
    }

    #[test]
    fn copies_that_fit_are_measured_as_before() {
        // gpt-mini-like: every copy is far below the budget.
        let small = layers(4, (GIB / 64, GIB / 64));
        let share = RankShare::within(4, 1, &small, 20 * GIB).expect("fits");
        assert_eq!(share, RankShare::all_at_once(4, 1));
        assert_eq!(share.time_scale(2), 1.0);
        assert_eq!(share.describe(2), "as 4 ranks of 1 thread(s) at once");
    }

    #[test]
    fn a_budget_shrinks_the_windows_then_the_copies_at_once() {
        // Blocks of 6 GiB of activations (gpt3-350m at 2048 tokens is about 3).
        let big = layers(8, (GIB / 16, 6 * GIB));
        let one = copy_bytes(&big, 0);
        assert_eq!(one, 2 * (GIB / 16) + 12 * GIB);
        // Windows of one layer are enough for 2 ranks in 25 GiB, full windows (the embedding
        // with the first block) are not.
        assert!(copy_bytes(&big, WINDOW_BYTES) > 25 * GIB / 2);
        let two = RankShare::within(2, 1, &big, 25 * GIB).expect("fits");
        assert_eq!((two.at_once, two.window_bytes), (2, 0));
        // 4 ranks in 25 GiB: 2 copies at once; 4 of 1 thread on 2 cores crowd them 2x.
        let four = RankShare::within(4, 1, &big, 25 * GIB).expect("fits");
        assert_eq!((four.ranks, four.at_once, four.window_bytes), (4, 2, 0));
        assert_eq!(four.time_scale(2), 2.0);
        assert_eq!(
            four.time_scale(16),
            1.0,
            "16 cores are not crowded by 4 copies"
        );
        assert_eq!(
            four.describe(2),
            "as 4 ranks of 1 thread(s), 2 at once (times scaled x2.00 for the cores 4 would \
             share), one layer at a time"
        );
        // Less than one copy of the largest layer: nothing to measure.
        assert_eq!(RankShare::within(4, 1, &big, one - 1), None);
        assert_eq!(
            RankShare::within(1, 2, &big, one).map(|s| s.at_once),
            Some(1)
        );
    }
}
