//! Measured model profiles: every layer's forward and backward time and its sizes, taken by
//! running the layers through the model traits on a real device (the planner's
//! [`crate::planning`] stays pure; this module is the one that touches a device).
//!
//! Each layer is built alone (`build_layers(i..i + 1)`) and run as a one-layer [`Stage`] on
//! the output of the layers before it, the way a pipeline stage boundary runs it: its input
//! is a fresh `Var` (so its backward also computes the input gradient the previous stage
//! needs), and its backward starts from a gradient of ones of its output (the last layer from
//! its loss) and adds the parameter gradients into a running sum, as a worker accumulates
//! them over a step's microbatches. After `warmup` untimed passes, `repeats` timed ones give
//! the median of each pass. On CUDA every timed pass ends with `Device::synchronize`; on CPU Candle runs
//! eagerly, so a pass is finished when its call returns.
//!
//! Sizes: parameter and output bytes are exact (element counts times the dtype size). The
//! bytes kept for the backward are what the graph keeps alive: measured on CPU as the rise of
//! the process's resident memory over the first (cold) forward of the layer, before the
//! allocator has freed memory it could reuse, and never below the output's bytes. On CUDA
//! there is no allocator counter through Candle, so the output bytes are a lower bound there.
//! The peak of a forward + backward (reported beside the profile, not planned on) is the
//! Linux peak-RSS counter (`VmHWM`, reset through `/proc/self/clear_refs`) above the resident
//! memory before the pass; `None` where that is unavailable (not Linux, or CUDA).

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};

use crate::model::{ForwardCtx, LayeredModel, ParamSource, Stage};
use crate::planning::profile::{ms_to_ns, ns_to_ms};
use crate::planning::{Fingerprint, LayerProfile, ModelProfile};
use crate::{Error, Result};

pub mod cache;
mod ranks;
#[cfg(test)]
mod tests;

pub use ranks::{
    host_cores, measure_as_ranks, rank_threads, shared_device_kind, threads_per_rank, user_threads,
};

/// What to measure: a model, one sample microbatch and how many passes.
pub struct ProfileRequest<'a> {
    pub model: &'a dyn LayeredModel,
    /// The fingerprint's model description (e.g. the preset name and shape).
    pub model_name: String,
    /// Inputs `[b, t]` of one microbatch (u32 token ids for a GPT).
    pub inputs: &'a Tensor,
    /// Targets of the same microbatch.
    pub targets: &'a Tensor,
    pub device: &'a Device,
    /// Compute dtype (`F32` or `BF16`).
    pub dtype: DType,
    /// Untimed passes per layer before the timed ones.
    pub warmup: usize,
    /// Timed passes per layer (the median is kept); at least 1.
    pub repeats: usize,
}

/// A measured profile and what was seen beside it.
#[derive(Debug, Clone)]
pub struct Measured {
    pub profile: ModelProfile,
    /// Peak resident memory of one forward + backward of each layer above the memory before
    /// it, bytes; `None` where it cannot be measured (see the module docs).
    pub peak_bytes: Vec<Option<u64>>,
    /// Wall time of the whole measurement.
    pub elapsed: Duration,
}

/// The device kind of a fingerprint: `cpu:<model name>x<threads>` on CPU (so a profile
/// taken on another machine or thread count is not reused), `cuda:<ordinal>` on CUDA.
pub fn device_kind(device: &Device) -> String {
    match device {
        Device::Cpu => format!(
            "cpu:{}x{}",
            cpu_model_name(),
            candle_core::utils::get_num_threads()
        ),
        Device::Cuda(_) => match device.location() {
            candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
            _ => "cuda".into(),
        },
        other => format!("{:?}", other.location()),
    }
}

fn cpu_model_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.split_whitespace().collect::<Vec<_>>().join(" "))
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// The fingerprint a measurement of `req` gets.
pub fn fingerprint(req: &ProfileRequest<'_>) -> Result<Fingerprint> {
    Ok(Fingerprint {
        model: req.model_name.clone(),
        microbatch_size: u32::try_from(req.inputs.dims().first().copied().unwrap_or(0))
            .map_err(|_| profile_error(req, "the microbatch is too large".into()))?,
        dtype: dtype_name(req.dtype)
            .map_err(|reason| profile_error(req, reason))?
            .into(),
        device_kind: device_kind(req.device),
    })
}

fn dtype_name(d: DType) -> std::result::Result<&'static str, String> {
    match d {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        other => Err(format!("cannot profile in {other:?}: use f32 or bf16")),
    }
}

fn profile_error(req: &ProfileRequest<'_>, reason: String) -> Error {
    Error::Profile {
        model: req.model_name.clone(),
        reason,
    }
}

/// Measures every layer of `req.model` (see the module docs for how).
pub fn measure(req: &ProfileRequest<'_>) -> Result<Measured> {
    if req.repeats == 0 {
        return Err(profile_error(req, "it needs at least 1 repeat".into()));
    }
    let start = Instant::now();
    let fingerprint = fingerprint(req)?;
    let ctx = ForwardCtx {
        targets: Some(req.targets),
        loss_scale: 1.0,
        train: true,
        dropout_key: Default::default(),
        rows: None,
        dtype: req.dtype,
    };
    let mut layers = Vec::with_capacity(req.model.num_layers());
    let mut peaks = Vec::with_capacity(req.model.num_layers());
    let mut x = req.inputs.clone();
    for i in 0..req.model.num_layers() {
        let built = req
            .model
            .build_layers(i..i + 1, req.device, ParamSource::Init { seed: 0 })?;
        let stage = Stage::new(built)?;
        let (layer, peak, out) = measure_layer(req, &stage, &x, &ctx)?;
        layers.push(LayerProfile {
            name: req.model.layer_name(i),
            ..layer
        });
        peaks.push(peak);
        x = out;
    }
    let profile = ModelProfile {
        fingerprint,
        layers,
    };
    profile
        .validate()
        .map_err(|e| profile_error(req, format!("the measured profile is not valid: {e}")))?;
    Ok(Measured {
        profile,
        peak_bytes: peaks,
        elapsed: start.elapsed(),
    })
}

/// One layer: its profile (name left empty), peak bytes, and its output (detached) for the
/// next layer.
fn measure_layer(
    req: &ProfileRequest<'_>,
    stage: &Stage,
    x: &Tensor,
    ctx: &ForwardCtx,
) -> Result<(LayerProfile, Option<u64>, Tensor)> {
    let cpu = matches!(req.device, Device::Cpu);
    let rss0 = rss_bytes();
    let fwd = stage.forward(x, ctx)?;
    let kept = rss_bytes().zip(rss0).map(|(a, b)| a.saturating_sub(b));
    let out = fwd.output.detach();
    let output_bytes = bytes_of(&out);
    let upstream = if out.rank() == 0 {
        None
    } else {
        Some(out.ones_like()?)
    };
    // The backward adds its gradients into a running sum, as a worker's does over the
    // microbatches of a step (for a large layer that add is a tenth of its backward).
    let mut acc = stage.backward(fwd, upstream.as_ref())?.params;
    let mut fwd_ms = Vec::with_capacity(req.repeats);
    let mut bwd_ms = Vec::with_capacity(req.repeats);
    let mut peak = None;
    for r in 0..req.warmup + req.repeats {
        let base = if cpu { reset_peak_rss() } else { None };
        let t0 = Instant::now();
        let fwd = stage.forward(x, ctx)?;
        req.device.synchronize()?;
        let t1 = Instant::now();
        crate::model::accumulate(&mut acc, stage.backward(fwd, upstream.as_ref())?.params)?;
        req.device.synchronize()?;
        let t2 = Instant::now();
        if r >= req.warmup {
            fwd_ms.push((t1 - t0).as_secs_f64() * 1e3);
            bwd_ms.push((t2 - t1).as_secs_f64() * 1e3);
            let p = base.zip(peak_rss()).map(|(b, p)| p.saturating_sub(b));
            peak = peak.max(p);
        }
    }
    let param_bytes = stage.params().iter().map(|(_, v)| bytes_of(v)).sum();
    let activation_bytes = if cpu {
        kept.unwrap_or(0).max(output_bytes)
    } else {
        output_bytes
    };
    let layer = LayerProfile {
        name: String::new(),
        // Whole nanoseconds, as the planner reads them back (`ModelProfile::from_json`), so a
        // profile survives its JSON round trip unchanged.
        forward_ms: ns_to_ms(ms_to_ns(median(&mut fwd_ms))),
        backward_ms: ns_to_ms(ms_to_ns(median(&mut bwd_ms))),
        param_bytes,
        activation_bytes,
        output_bytes,
    };
    Ok((layer, peak, out))
}

fn bytes_of(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// The median of `v` (the mean of the middle two for an even count); `v` is not empty.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn status_kib(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok()
}

/// Resident memory of this process, bytes (Linux; `None` elsewhere).
fn rss_bytes() -> Option<u64> {
    status_kib("VmRSS:").map(|k| k * 1024)
}

fn peak_rss() -> Option<u64> {
    status_kib("VmHWM:").map(|k| k * 1024)
}

/// Resets the peak-RSS counter to the current RSS and returns it; `None` when not possible.
fn reset_peak_rss() -> Option<u64> {
    std::fs::write("/proc/self/clear_refs", "5").ok()?;
    rss_bytes()
}
