//! `oobleck profile`: measures every layer of a model preset on a device (forward and
//! backward time, sizes), prints a table and writes the profile JSON that `oobleck plan
//! --profile` and `train --profile FILE` read. Profiles are cached by fingerprint (see
//! `oobleck_core::profiler::cache`), so measuring the same model, microbatch, dtype and
//! device again reuses the entry unless `--no-cache`.

use std::path::PathBuf;

use anyhow::{bail, Context};
use candle_core::Device;
use oobleck_core::planning::ModelProfile;
use oobleck_core::profiler::cache::{self, Source};
use oobleck_core::runtime::BatchShape;
use oobleck_models::workload::{GptWorkload, GptWorkloadConfig};

/// Measure a model's per-layer profile.
#[derive(Debug, Clone, clap::Args)]
pub struct ProfileArgs {
    /// Model preset (gpt-tiny, gpt-mini, gpt2, ...).
    #[arg(long)]
    pub model: String,
    /// Device to measure on: cpu or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Samples per microbatch.
    #[arg(long, default_value_t = 4)]
    pub microbatch_size: usize,
    /// Tokens per sample.
    #[arg(long, default_value_t = 64)]
    pub seq_len: usize,
    /// Compute dtype: f32 or bf16.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: crate::config::Precision,
    /// Where to write the profile JSON (default: only the cache).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Timed passes per layer (the median is kept).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Untimed passes per layer first.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Measure even when the cache holds this profile (the entry is then rewritten).
    #[arg(long)]
    pub no_cache: bool,
}

/// Parses `cpu` or `cuda:N` (`cuda` is `cuda:0`).
pub fn parse_device(s: &str) -> anyhow::Result<Device> {
    if s == "cpu" {
        return Ok(Device::Cpu);
    }
    let ordinal = match s.strip_prefix("cuda") {
        Some("") => 0,
        Some(rest) => match rest.strip_prefix(':').and_then(|n| n.parse().ok()) {
            Some(n) => n,
            None => bail!("unknown device `{s}`: cpu or cuda:N"),
        },
        None => bail!("unknown device `{s}`: cpu or cuda:N"),
    };
    Device::new_cuda(ordinal)
        .with_context(|| format!("opening {s} (this build needs the `cuda` feature and a GPU)"))
}

/// The profile (cached or measured) and where it came from.
pub fn profile(args: &ProfileArgs) -> anyhow::Result<(ModelProfile, Source)> {
    if args.repeats == 0 || args.microbatch_size == 0 || args.seq_len == 0 {
        bail!("--repeats, --microbatch-size and --seq-len must be at least 1");
    }
    let device = parse_device(&args.device)?;
    let dtype = args.dtype.dtype();
    // One microbatch of the measured size: a profile times a layer on one microbatch.
    let batch = BatchShape {
        microbatch_size: u32::try_from(args.microbatch_size)
            .with_context(|| format!("--microbatch-size {}", args.microbatch_size))?,
        global_microbatches: 1,
    };
    let workload = GptWorkload::new(
        GptWorkloadConfig {
            model: args.model.clone(),
            seq_len: args.seq_len,
            eval_batches: 1,
            ..Default::default()
        },
        batch,
    )
    .with_context(|| format!("building {} for profiling", args.model))?;
    let fp = workload.measured_fingerprint(&device, dtype)?;
    let Some(dir) = cache::default_dir() else {
        bail!("no cache directory: set OOBLECK_CACHE_DIR or HOME");
    };
    let measure = || -> oobleck_core::Result<ModelProfile> {
        let m = workload
            .measure_profile(&device, dtype, args.warmup, args.repeats)
            .map_err(oobleck_core::Error::from)?;
        Ok(m.profile)
    };
    if args.no_cache {
        let p = measure()?;
        let path = cache::store(&dir, &p)?;
        return Ok((p, Source::Measured(path)));
    }
    Ok(cache::load_or_measure(&dir, &fp, measure)?)
}

/// One line per layer: times, sizes.
pub fn render(p: &ModelProfile) -> String {
    let mut s = format!(
        "{:<4} {:<14} {:>10} {:>11} {:>11} {:>12} {:>11}\n",
        "#", "layer", "fwd ms", "bwd ms", "params MiB", "kept MiB", "out MiB"
    );
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    for (i, l) in p.layers.iter().enumerate() {
        s.push_str(&format!(
            "{:<4} {:<14} {:>10.3} {:>11.3} {:>11.2} {:>12.2} {:>11.3}\n",
            i,
            l.name,
            l.forward_ms,
            l.backward_ms,
            mib(l.param_bytes),
            mib(l.activation_bytes),
            mib(l.output_bytes)
        ));
    }
    let (f, b): (f64, f64) = p.layers.iter().fold((0.0, 0.0), |(f, b), l| {
        (f + l.forward_ms, b + l.backward_ms)
    });
    s.push_str(&format!("{:<19} {f:>10.3} {b:>11.3}\n", "total"));
    s
}

/// Runs `oobleck profile`.
pub fn run(args: &ProfileArgs) -> anyhow::Result<()> {
    let start = std::time::Instant::now();
    let (p, source) = profile(args)?;
    match &source {
        Source::Cached(path) => eprintln!("profile from cache {}", path.display()),
        Source::Measured(path) => eprintln!(
            "measured in {:.1} s, cached at {}",
            start.elapsed().as_secs_f64(),
            path.display()
        ),
        Source::Remeasured { path, reason } => eprintln!(
            "the cache entry {} was corrupt ({reason}): measured again in {:.1} s",
            path.display(),
            start.elapsed().as_secs_f64()
        ),
    }
    println!("profile: {}", p.fingerprint);
    print!("{}", render(&p));
    if let Some(out) = &args.out {
        std::fs::write(out, p.to_json()).with_context(|| format!("writing {}", out.display()))?;
        println!("wrote {}", out.display());
    }
    Ok(())
}
