//! Profiles for ranks that share a machine's cores. A local cluster runs every worker process
//! on one machine, and a node runs its `G` workers on one: each rank computes with its share
//! of the cores, beside the others. A profile taken by one process owning every core predicts
//! steps several times shorter than such ranks take (`train` on 4 local nodes, 2 cores: 410 ms
//! predicted, 1928 ms measured). So the layers are timed as the ranks run them: `ranks`
//! copies at once, each in a rayon pool of its share of the cores (the pool Candle's CPU
//! kernels and ours run on), and the fingerprint names that share, so the cache keeps a
//! profile per sharing.

use candle_core::Device;

use super::{device_kind, measure, median, profile_error, Measured, ProfileRequest};
use crate::planning::profile::{ms_to_ns, ns_to_ms};
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

/// Measures `req` as `ranks` ranks of `threads` threads each run it on one CPU machine:
/// `ranks` copies at once, each in its own pool (`threads` 0: all in the caller's). Per layer, the times are the median over the
/// copies and the kept activation bytes the smallest (each copy sees the process's resident
/// memory rise with the others' allocations too); the peaks are the largest. On other devices,
/// one [`measure`] as it is.
pub fn measure_as_ranks(
    req: &ProfileRequest<'_>,
    ranks: usize,
    threads: usize,
) -> Result<Measured> {
    if !matches!(req.device, Device::Cpu) {
        return measure(req);
    }
    let start = std::time::Instant::now();
    let copies: Vec<Result<Measured>> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..ranks.max(1))
            .map(|_| sc.spawn(|| in_pool(req, threads)))
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
    let mut all = combine(&copies);
    all.profile.fingerprint.device_kind = shared_device_kind(req.device, ranks, threads);
    all.elapsed = start.elapsed();
    Ok(all)
}

/// One measurement inside a rayon pool of `threads` threads (0: the caller's pool).
fn in_pool(req: &ProfileRequest<'_>, threads: usize) -> Result<Measured> {
    if threads == 0 {
        return measure(req);
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| profile_error(req, format!("building a pool of {threads} threads: {e}")))?;
    pool.install(|| measure(req))
}

/// The copies' measurements as one (see [`measure_as_ranks`]); `copies` is not empty.
fn combine(copies: &[Measured]) -> Measured {
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
        layer.forward_ms = ns_to_ms(ms_to_ns(median(&mut f)));
        layer.backward_ms = ns_to_ms(ms_to_ns(median(&mut b)));
        layer.activation_bytes = copies
            .iter()
            .map(|c| c.profile.layers[i].activation_bytes)
            .min()
            .unwrap_or(layer.activation_bytes);
        out.peak_bytes[i] = copies.iter().filter_map(|c| c.peak_bytes[i]).max();
    }
    out
}
