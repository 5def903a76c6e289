//! Measured model profiles: every layer's forward and backward time and its sizes, taken by
//! running the layers through the model traits on a real device (the planner's
//! [`crate::planning`] stays pure; this module is the one that touches a device).
//!
//! Layers are timed the way a pipeline stage runs them: in windows of consecutive layers,
//! each built alone (`build_layers(i..i + 1)`) as a one-layer [`Stage`]. A window grows until
//! its parameters and kept activations reach [`WINDOW_BYTES`] (at least one layer); then it
//! is swept `warmup + repeats` times: the forwards in order, each on the previous layer's
//! output (cut from the graph as a fresh `Var`, as at a stage boundary, so each backward
//! also computes its input gradient), then the backwards in reverse, each from the next
//! layer's input gradient (the window's last layer from a gradient of ones of its output, or
//! from its loss), adding the parameter gradients into a running sum as a worker does over a
//! step's microbatches. Each layer's time is the median of its timed sweeps. Timing a layer
//! alone, again and again, keeps its weights and activations in the caches, which a stage
//! running many layers does not: on gpt-mini (vocab 4096, 2 cores) the 2-stage pipeline's
//! first stage was predicted at 14.9 ms and took 17.0 (measured/predicted 1.22); swept in
//! windows, 1.00. On CUDA every timed pass ends with `Device::synchronize`; on CPU Candle
//! runs eagerly, so a pass is finished when its call returns.
//!
//! Sizes: parameter and output bytes are exact (element counts times the dtype size). The
//! bytes kept for the backward are what the graph keeps alive: measured on CPU as the rise of
//! the process's resident memory over the first (cold) forward of the layer, before the
//! allocator has freed memory it could reuse, and never below the output's bytes. On CUDA
//! there is no allocator counter through Candle, so the output bytes are a lower bound there.
//! The peak of that cold forward + backward of the layer (reported beside the profile, not
//! planned on) is the Linux peak-RSS counter (`VmHWM`, reset through `/proc/self/clear_refs`)
//! above the resident memory before the pass; `None` where that is unavailable (not Linux,
//! or CUDA).

use std::collections::HashMap;
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
    copy_bytes, host_cores, measure_as_ranks, rank_threads, shared_device_kind, threads_per_rank,
    user_threads, RankShare,
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

/// The parameters plus kept activations a window of layers holds before it is swept (see
/// the module docs): big enough that a window works through more memory than the caches
/// hold, small enough for a laptop.
pub const WINDOW_BYTES: u64 = 1 << 30;

/// Measures every layer of `req.model` (see the module docs for how).
pub fn measure(req: &ProfileRequest<'_>) -> Result<Measured> {
    measure_in_windows(req, WINDOW_BYTES)
}

/// [`measure`] with windows of `window_bytes` (0: every layer is swept alone).
pub fn measure_in_windows(req: &ProfileRequest<'_>, window_bytes: u64) -> Result<Measured> {
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
    let n = req.model.num_layers();
    let mut layers: Vec<LayerProfile> = Vec::with_capacity(n);
    let mut peaks = Vec::with_capacity(n);
    let mut window = Window::default();
    let mut x = req.inputs.clone();
    for i in 0..n {
        let built = req
            .model
            .build_layers(i..i + 1, req.device, ParamSource::Init { seed: 0 })?;
        let (layer, peak, out) = window.push(req, Stage::new(built)?, &x, &ctx)?;
        layers.push(LayerProfile {
            name: req.model.layer_name(i),
            ..layer
        });
        peaks.push(peak);
        x = out;
        if window.bytes >= window_bytes || i + 1 == n {
            let times = std::mem::take(&mut window).sweep(req, &ctx)?;
            let first = layers.len() - times.len();
            for (l, (f, b)) in layers[first..].iter_mut().zip(times) {
                (l.forward_ms, l.backward_ms) = (f, b);
            }
        }
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

/// Consecutive one-layer stages waiting to be swept, with the first one's input and each
/// one's running sum of parameter gradients.
#[derive(Default)]
struct Window {
    stages: Vec<Stage>,
    input: Option<Tensor>,
    acc: Vec<HashMap<String, Tensor>>,
    bytes: u64,
}

impl Window {
    /// Adds `stage`, run on `x`: its profile (name and times left empty), its peak bytes, and
    /// its output (detached) for the next layer.
    fn push(
        &mut self,
        req: &ProfileRequest<'_>,
        stage: Stage,
        x: &Tensor,
        ctx: &ForwardCtx,
    ) -> Result<(LayerProfile, Option<u64>, Tensor)> {
        let cpu = matches!(req.device, Device::Cpu);
        // The cold pass gives the kept bytes (its forward) and the peak (forward + backward).
        let base = if cpu { reset_peak_rss() } else { None };
        let rss0 = rss_bytes();
        let fwd = stage.forward(x, ctx)?;
        let kept = rss_bytes().zip(rss0).map(|(a, b)| a.saturating_sub(b));
        let out = fwd.output.detach();
        let output_bytes = bytes_of(&out);
        let upstream = ones_upstream(&out)?;
        let acc = stage.backward(fwd, upstream.as_ref())?.params;
        let peak = base.zip(peak_rss()).map(|(b, p)| p.saturating_sub(b));
        let param_bytes = stage.params().iter().map(|(_, v)| bytes_of(v)).sum();
        let activation_bytes = if cpu {
            kept.unwrap_or(0).max(output_bytes)
        } else {
            output_bytes
        };
        if self.stages.is_empty() {
            self.input = Some(x.clone());
        }
        self.bytes += param_bytes + activation_bytes;
        self.stages.push(stage);
        self.acc.push(acc);
        let layer = LayerProfile {
            name: String::new(),
            forward_ms: 0.0,
            backward_ms: 0.0,
            param_bytes,
            activation_bytes,
            output_bytes,
        };
        Ok((layer, peak, out))
    }

    /// Sweeps the window (see the module docs): each layer's median forward and backward
    /// milliseconds, in whole nanoseconds as the planner reads them back
    /// (`ModelProfile::from_json`), so a profile survives its JSON round trip unchanged.
    fn sweep(mut self, req: &ProfileRequest<'_>, ctx: &ForwardCtx) -> Result<Vec<(f64, f64)>> {
        let n = self.stages.len();
        let mut fwd_ms = vec![Vec::with_capacity(req.repeats); n];
        let mut bwd_ms = vec![Vec::with_capacity(req.repeats); n];
        let Some(input) = self.input.take() else {
            return Ok(Vec::new());
        };
        let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
        for r in 0..req.warmup + req.repeats {
            let timed = r >= req.warmup;
            let mut passes = Vec::with_capacity(n);
            let mut x = input.clone();
            for (k, stage) in self.stages.iter().enumerate() {
                let t0 = Instant::now();
                let fwd = stage.forward(&x, ctx)?;
                req.device.synchronize()?;
                if timed {
                    fwd_ms[k].push(ms(t0));
                }
                x = fwd.output.clone();
                passes.push(fwd);
            }
            let mut g = ones_upstream(&x)?;
            for (k, (stage, fwd)) in self.stages.iter().zip(passes).enumerate().rev() {
                let t0 = Instant::now();
                let grads = stage.backward(fwd, g.as_ref())?;
                crate::model::accumulate(&mut self.acc[k], grads.params)?;
                req.device.synchronize()?;
                if timed {
                    bwd_ms[k].push(ms(t0));
                }
                g = grads.input;
            }
        }
        let whole = |v: &mut Vec<f64>| ns_to_ms(ms_to_ns(median(v)));
        Ok(fwd_ms
            .iter_mut()
            .zip(&mut bwd_ms)
            .map(|(f, b)| (whole(f), whole(b)))
            .collect())
    }
}

/// The gradient a layer's output starts its backward from: ones, or none for a scalar loss.
fn ones_upstream(out: &Tensor) -> Result<Option<Tensor>> {
    Ok(if out.rank() == 0 {
        None
    } else {
        Some(out.ones_like()?)
    })
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
