//! How a [`GptWorkload`] answers the planner: its analytical profile, or one measured on this
//! machine's CPU (cached on disk by the model, the share of the host and the precision), or
//! one read from a profile file.

use candle_core::{Device, Tensor};
use oobleck_core::planning::{analytical_profile, DeviceSpec, Dtype, ModelProfile};
use oobleck_core::profiler::RankShare;
use oobleck_core::runtime::host_memory::HostMemory;

use super::{to_tensors, GptWorkload};
use crate::{Error, Result};

impl GptWorkload {
    /// [`Workload::profile`]: by `cfg.profile` (`analytical`, `measured`, or a file), each
    /// answer kept for the next question of the same device, size and precision.
    pub(super) fn profile_for(
        &self,
        device: &DeviceSpec,
        microbatch_size: u32,
        precision: Dtype,
    ) -> Result<ModelProfile> {
        let key = format!("{}/{microbatch_size}/{precision:?}", device.name);
        let mut known = self.profiles.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, p)) = known.iter().find(|(k, _)| *k == key) {
            return Ok(p.clone());
        }
        let p = match self.cfg.profile.as_str() {
            "measured" if device.name == "cpu" => self.cached_cpu_profile(precision)?,
            "analytical" | "measured" => {
                self.planner_profile(device, microbatch_size, precision)?
            }
            path => self.file_profile(path.as_ref(), microbatch_size, precision)?,
        };
        known.push((key, p.clone()));
        Ok(p)
    }

    /// The planner's analytical profile for microbatches of `microbatch_size` samples on
    /// `device` computing in `precision` (bf16: 2-byte activations and parameters, the
    /// device's bf16 rate), one entry per layer of the model.
    pub fn planner_profile(
        &self,
        device: &DeviceSpec,
        microbatch_size: u32,
        precision: Dtype,
    ) -> Result<ModelProfile> {
        let shape = self.model_cfg.planner_shape(self.cfg.seq_len)?;
        let profile =
            analytical_profile(&self.cfg.model, &shape, device, microbatch_size, precision);
        if profile.layers.len() != self.model.num_layers() {
            return Err(Error::Invalid(format!(
                "the analytical profile of {} has {} layers, the model {}",
                self.cfg.model,
                profile.layers.len(),
                self.model.num_layers()
            )));
        }
        Ok(profile)
    }
    /// The fingerprint's model of a measured profile: the preset (or `init_from`) and the
    /// sequence length, which the times depend on.
    pub fn measured_model_name(&self) -> String {
        let what = self.cfg.init_from.as_deref().unwrap_or(&self.cfg.model);
        format!("{what} seq {}", self.cfg.seq_len)
    }

    /// Measures every layer on `device` with microbatch 0 of step 0 as the sample (see
    /// [`oobleck_core::profiler`]): `warmup` untimed and `repeats` timed passes per layer, on
    /// the CPU within this machine's memory ([`GptWorkload::measurement`]).
    pub fn measure_profile(
        &self,
        device: &Device,
        precision: Dtype,
        warmup: usize,
        repeats: usize,
    ) -> Result<oobleck_core::profiler::Measured> {
        let share = self.measurement(device)?;
        self.measure_as(device, precision, warmup, repeats, share.as_ref())
    }

    /// [`GptWorkload::measure_profile`] measured as `share` says (`None`: one copy as it is).
    fn measure_as(
        &self,
        device: &Device,
        precision: Dtype,
        warmup: usize,
        repeats: usize,
        share: Option<&RankShare>,
    ) -> Result<oobleck_core::profiler::Measured> {
        use oobleck_core::profiler::{measure, measure_as_ranks, measure_in_windows};
        let (inputs, targets) = to_tensors(&self.train_batch(0, 0, 0)?, device)?;
        let req = self.profile_request(&inputs, &targets, device, precision, warmup, repeats);
        Ok(match share {
            Some(share) if share.ranks > 1 => measure_as_ranks(&req, share)?,
            Some(share) => measure_in_windows(&req, share.window_bytes)?,
            None => measure(&req)?,
        })
    }

    /// As how many ranks of how many threads each a profile on `device` is measured: `None`
    /// for one process owning the machine (see [`GptWorkloadConfig::host_ranks`]).
    fn rank_share(&self, device: &Device) -> Option<(usize, usize)> {
        let ranks = self.cfg.host_ranks;
        (ranks > 1 && device.is_cpu()).then(|| (ranks, oobleck_core::profiler::rank_threads(ranks)))
    }

    /// The memory a measurement here may use: `host_memory_bytes`, else this machine's.
    fn host_memory(&self) -> Option<HostMemory> {
        match self.cfg.host_memory_bytes {
            Some(bytes) => Some(HostMemory::given(bytes)),
            None => HostMemory::of_this_machine(),
        }
    }

    /// How a CPU profile is measured within this process's memory ([`RankShare::within`], on
    /// the sizes of the analytical profile): every rank's copy at once in full windows where
    /// they fit, as always. `None` on a GPU, or where the machine's memory is not known. A
    /// model whose largest layer alone does not fit is refused, with what it needs.
    fn measurement(&self, device: &Device) -> Result<Option<RankShare>> {
        if !device.is_cpu() {
            return Ok(None);
        }
        let (ranks, threads) = self.rank_share(device).unwrap_or((1, 0));
        let Some(memory) = self.host_memory() else {
            return Ok(Some(RankShare::all_at_once(ranks, threads)));
        };
        let cpu = DeviceSpec::named("cpu").expect("the planner's table has `cpu`");
        let b = self.batch.microbatch_size;
        // In f32 whatever `precision` is: Candle's CPU backend computes bf16 by widening to
        // f32 (see `CPU_BF16_RATE`), and with bf16 sizes 4 copies of gpt3-350m at 2048 tokens
        // were estimated at 14.5 GB and took 19 GB.
        let sizes = self.planner_profile(cpu, b, Dtype::F32)?.layers;
        let budget = memory.per_rank(1);
        RankShare::within(ranks, threads, &sizes, budget)
            .map(Some)
            .ok_or_else(|| {
                let need = oobleck_core::profiler::copy_bytes(&sizes, 0);
                Error::Invalid(format!(
                    "profiling {} needs {:.1} GiB at once (its largest layer's forward and \
                     backward on a microbatch of {b} x {} tokens), and this process may use {}. \
                     Ways out: a smaller --microbatch-size or --seq-len, --precision bf16, more \
                     memory (--host-memory if it is known better), or --profile analytical, \
                     which measures nothing",
                    self.cfg.model,
                    need as f64 / (1u64 << 30) as f64,
                    self.cfg.seq_len,
                    memory.describe(1)
                ))
            })
    }

    /// How a measurement is run, for the profile line: `, as 4 ranks of 1 thread(s) at once`
    /// (nothing for one process in full windows), then the budget when it changed anything.
    fn measurement_words(&self, share: Option<&RankShare>) -> String {
        let Some(share) = share else {
            return String::new();
        };
        let full = RankShare::all_at_once(share.ranks, share.threads);
        let words = match share.ranks {
            1 if *share == full => return String::new(),
            1 => "one layer at a time".to_string(),
            _ => share.describe(oobleck_core::profiler::host_cores()),
        };
        match self.host_memory() {
            Some(m) if *share != full => format!(", {words}, to fit in {}", m.describe(1)),
            _ => format!(", {words}"),
        }
    }

    /// The fingerprint [`GptWorkload::measure_profile`] gives on `device`.
    pub fn measured_fingerprint(
        &self,
        device: &Device,
        precision: Dtype,
    ) -> Result<oobleck_core::planning::Fingerprint> {
        let (inputs, targets) = to_tensors(&self.train_batch(0, 0, 0)?, device)?;
        let req = self.profile_request(&inputs, &targets, device, precision, 0, 1);
        let mut fp = oobleck_core::profiler::fingerprint(&req)?;
        if let Some((ranks, threads)) = self.rank_share(device) {
            fp.device_kind = oobleck_core::profiler::shared_device_kind(device, ranks, threads);
        }
        Ok(fp)
    }

    /// The measured CPU profile of this workload's microbatch, from the profile cache or
    /// measured now (then cached); says which on stderr.
    fn cached_cpu_profile(&self, precision: Dtype) -> Result<ModelProfile> {
        use oobleck_core::profiler::cache::{self, Source};
        let device = Device::Cpu;
        let fp = self.measured_fingerprint(&device, precision)?;
        let dir = cache::default_dir().ok_or_else(|| {
            Error::Invalid("no profile cache directory: set OOBLECK_CACHE_DIR or HOME".into())
        })?;
        let start = std::time::Instant::now();
        let (p, source) = cache::load_or_measure(&dir, &fp, || {
            let share = self.measurement(&device)?;
            eprintln!(
                "profiling {}: {} layers, microbatch {}{} ...",
                self.cfg.model,
                self.model.num_layers(),
                self.batch.microbatch_size,
                self.measurement_words(share.as_ref())
            );
            Ok(self
                .measure_as(&device, precision, 2, 5, share.as_ref())?
                .profile)
        })?;
        let secs = start.elapsed().as_secs_f64();
        match source {
            Source::Cached(path) => eprintln!("profile from cache {}", path.display()),
            Source::Measured(path) => {
                eprintln!("profiled in {secs:.1} s, cached at {}", path.display())
            }
            Source::Remeasured { path, reason } => eprintln!(
                "the profile cache entry {} was corrupt ({reason}): measured again in {secs:.1} s",
                path.display()
            ),
        }
        Ok(p)
    }

    /// A profile file, which must be for this job's microbatch and dtype.
    fn file_profile(
        &self,
        path: &std::path::Path,
        microbatch_size: u32,
        precision: Dtype,
    ) -> Result<ModelProfile> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::Invalid(format!(
                "reading the profile {}: {e} (profile is analytical, measured or a file)",
                path.display()
            ))
        })?;
        let p = ModelProfile::from_json(&text)
            .map_err(|e| Error::Invalid(format!("profile {}: {e}", path.display())))?;
        let dtype = if precision == Dtype::Bf16 {
            "bf16"
        } else {
            "f32"
        };
        let found = &p.fingerprint;
        let model = self.measured_model_name();
        let same_model = found.model == model || found.model == self.cfg.model;
        if !same_model || found.microbatch_size != microbatch_size || found.dtype != dtype {
            return Err(Error::Invalid(format!(
                "profile {} was made for {found:?}, this job needs {model} with microbatch \
                 {microbatch_size} in {dtype}: measure one with `oobleck profile --model {} \
                 --microbatch-size {microbatch_size} --seq-len {}`",
                path.display(),
                self.cfg.model,
                self.cfg.seq_len
            )));
        }
        Ok(p)
    }

    fn profile_request<'a>(
        &'a self,
        inputs: &'a Tensor,
        targets: &'a Tensor,
        device: &'a Device,
        precision: Dtype,
        warmup: usize,
        repeats: usize,
    ) -> oobleck_core::profiler::ProfileRequest<'a> {
        oobleck_core::profiler::ProfileRequest {
            model: self.model.as_ref(),
            model_name: self.measured_model_name(),
            inputs,
            targets,
            device,
            dtype: match precision {
                Dtype::Bf16 => candle_core::DType::BF16,
                _ => candle_core::DType::F32,
            },
            warmup,
            repeats,
        }
    }
}
