//! Profile types: what the planner knows about a model, a cluster and a job.
//!
//! A [`ModelProfile`] is stored as JSON (times in milliseconds, sizes in bytes, so people can
//! read and edit it). It is validated on load ([`ModelProfile::from_json`]) and carries a
//! [`Fingerprint`] so a profile measured for another model, microbatch size, dtype or device is
//! detected ([`ModelProfile::check_fingerprint`]) rather than silently used.
//!
//! Inside the planner every time is an integer number of **nanoseconds** ([`Nanos`]): sums and
//! comparisons are then exact, which makes the optimum well defined (no float ties that depend
//! on summation order) and lets the brute-force checks compare costs with `==`.

use serde::{Deserialize, Serialize};

use super::PlanError;

/// Time in integer nanoseconds.
pub type Nanos = u64;

/// Converts milliseconds to nanoseconds, rounding to nearest.
pub fn ms_to_ns(ms: f64) -> Nanos {
    (ms * 1.0e6).round() as Nanos
}

/// Converts nanoseconds to milliseconds (for display and JSON).
pub fn ns_to_ms(ns: Nanos) -> f64 {
    ns as f64 / 1.0e6
}

/// What a profile was measured (or estimated) for. Two profiles are interchangeable only if
/// their fingerprints are equal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fingerprint {
    /// Canonical description of the model configuration (e.g. the preset name and shape).
    pub model: String,
    /// Samples per microbatch the times and activation sizes are for.
    pub microbatch_size: u32,
    /// Parameter/activation dtype, e.g. `f32` or `bf16`.
    pub dtype: String,
    /// Device kind, e.g. `a100-80gb` or `cpu`.
    pub device_kind: String,
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The flags' words, so the line says which one to change.
        write!(
            f,
            "model: {}, microbatch_size: {}, dtype: {}, device_kind: {}",
            self.model, self.microbatch_size, self.dtype, self.device_kind
        )
    }
}

/// One layer: forward and backward time of one microbatch on one device, and its memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerProfile {
    /// Human-readable name (`embedding`, `block.3`, `head`).
    pub name: String,
    /// Forward time of one microbatch, milliseconds.
    pub forward_ms: f64,
    /// Backward time of one microbatch, milliseconds (measured, not 3x forward).
    pub backward_ms: f64,
    /// Bytes of the layer's parameters in the training dtype.
    pub param_bytes: u64,
    /// Bytes of activations the layer keeps for its backward pass, per microbatch.
    pub activation_bytes: u64,
    /// Bytes of the layer's output per microbatch (what a stage boundary after this layer sends).
    pub output_bytes: u64,
}

/// Latency + bandwidth model of one kind of link.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkModel {
    /// One-way latency per message, microseconds.
    pub latency_us: f64,
    /// Bandwidth, gigabytes (1e9 bytes) per second.
    pub bandwidth_gbps: f64,
}

impl LinkModel {
    /// Time to move `bytes` over this link once: `latency + bytes / bandwidth`.
    pub fn transfer_ns(&self, bytes: u64) -> Nanos {
        let ns = self.latency_us * 1.0e3 + bytes as f64 / self.bandwidth_gbps;
        ns.round() as Nanos
    }

    fn validate(&self, which: &'static str) -> Result<(), PlanError> {
        if !self.bandwidth_gbps.is_finite() || self.bandwidth_gbps <= 0.0 {
            return Err(PlanError::InvalidCluster {
                field: which,
                value: self.bandwidth_gbps,
            });
        }
        if !self.latency_us.is_finite() || self.latency_us < 0.0 {
            return Err(PlanError::InvalidCluster {
                field: which,
                value: self.latency_us,
            });
        }
        Ok(())
    }
}

/// The machines: how much memory a device has, how many devices a node has, and the links.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    /// Device kind (must match the profile's fingerprint).
    pub device_kind: String,
    /// Usable memory of one device, bytes.
    pub device_memory_bytes: u64,
    /// Devices per node (`G`).
    pub devices_per_node: u32,
    /// Link between devices of one node.
    pub intra_node: LinkModel,
    /// Link between nodes.
    pub inter_node: LinkModel,
}

impl ClusterSpec {
    /// Checks every field is usable.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.device_memory_bytes == 0 {
            return Err(PlanError::InvalidCluster {
                field: "device_memory_bytes",
                value: 0.0,
            });
        }
        if self.devices_per_node == 0 {
            return Err(PlanError::InvalidCluster {
                field: "devices_per_node",
                value: 0.0,
            });
        }
        self.intra_node.validate("intra_node")?;
        self.inter_node.validate("inter_node")
    }

    /// Divisors of `G`: the device counts a stage may use.
    pub fn stage_device_counts(&self) -> Vec<u32> {
        let g = self.devices_per_node;
        (1..=g).filter(|d| g % d == 0).collect()
    }
}

/// A model profile: one [`LayerProfile`] per layer, for one microbatch size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelProfile {
    pub fingerprint: Fingerprint,
    pub layers: Vec<LayerProfile>,
}

impl ModelProfile {
    /// Parses and validates a profile from JSON.
    pub fn from_json(text: &str) -> Result<Self, PlanError> {
        let p: ModelProfile =
            serde_json::from_str(text).map_err(|e| PlanError::ProfileFormat(e.to_string()))?;
        p.validate()?;
        Ok(p)
    }

    /// Pretty JSON (deterministic: field order is the struct order).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a profile always serialises")
    }

    /// Rejects empty profiles, negative/NaN/infinite times and zero-sized parameters.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.layers.is_empty() {
            return Err(PlanError::InvalidProfile {
                layer: 0,
                field: "layers",
                value: 0.0,
            });
        }
        if self.fingerprint.microbatch_size == 0 {
            return Err(PlanError::InvalidProfile {
                layer: 0,
                field: "fingerprint.microbatch_size",
                value: 0.0,
            });
        }
        for (i, l) in self.layers.iter().enumerate() {
            check_non_negative(i, "forward_ms", l.forward_ms)?;
            check_non_negative(i, "backward_ms", l.backward_ms)?;
            // Times beyond a day per microbatch are a unit mistake, and would overflow `Nanos` sums.
            for (field, v) in [("forward_ms", l.forward_ms), ("backward_ms", l.backward_ms)] {
                if v > 8.64e7 {
                    return Err(PlanError::InvalidProfile {
                        layer: i,
                        field,
                        value: v,
                    });
                }
            }
        }
        if self.layers.iter().all(|l| l.param_bytes == 0) {
            return Err(PlanError::InvalidProfile {
                layer: 0,
                field: "param_bytes (all layers zero)",
                value: 0.0,
            });
        }
        Ok(())
    }

    /// Errors if this profile was made for something else than `expected`.
    pub fn check_fingerprint(&self, expected: &Fingerprint) -> Result<(), PlanError> {
        if &self.fingerprint != expected {
            return Err(PlanError::StaleProfile {
                found: Box::new(self.fingerprint.clone()),
                expected: Box::new(expected.clone()),
            });
        }
        Ok(())
    }

    /// Number of layers `L`.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The profile of the same model trained with activation recomputation (`--recompute`):
    /// a layer keeps only its input per microbatch in flight (layer 0: `input_bytes`, the
    /// token ids of a microbatch; layer `i`: the output of layer `i - 1`), capped at what it
    /// kept before (its graph held that input already), and its backward runs its forward
    /// again first. The one layer's graph rebuilt at a time during a backward is not counted,
    /// as the working memory of a forward is not.
    pub fn with_recompute(&self, input_bytes: u64) -> ModelProfile {
        let mut out = self.clone();
        let mut input = input_bytes;
        for l in &mut out.layers {
            l.activation_bytes = l.activation_bytes.min(input);
            l.backward_ms += l.forward_ms;
            input = l.output_bytes;
        }
        out
    }
}

/// The job: fault threshold, batch and how much memory training state takes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// Fault threshold `f`: at least `f + 1` pipelines.
    pub fault_threshold: u32,
    /// Samples per microbatch `b` (must equal the profile's).
    pub microbatch_size: u32,
    /// Global batch `B`, in microbatches.
    pub global_microbatches: u32,
    /// Bytes of persistent training state per byte of parameters: weights + gradients +
    /// optimizer state. 4 for fp32 AdamW (w, g, m, v); the original used 6 (unexplained).
    pub state_bytes_per_param_byte: u32,
    /// Microbatch count templates are optimised for.
    pub template_microbatches: TemplateMicrobatches,
}

impl JobSpec {
    /// The job spec of training `global_microbatches` microbatches of `microbatch_size`
    /// samples at `precision` with AdamW, fault threshold `fault_threshold`: the one derivation
    /// `train` plans with (`runtime::TrainingSpec::job_spec`) and `oobleck plan` prints.
    pub fn training(
        fault_threshold: u32,
        microbatch_size: u32,
        global_microbatches: u32,
        precision: super::Dtype,
    ) -> JobSpec {
        JobSpec {
            fault_threshold,
            microbatch_size,
            global_microbatches,
            state_bytes_per_param_byte: precision.state_bytes_per_param_byte(),
            template_microbatches: TemplateMicrobatches::Auto,
        }
    }
}

/// Which `m` a template is optimised for (its `T(m)` can be re-evaluated for any `m` later).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TemplateMicrobatches {
    /// A fixed `m`.
    Fixed(u32),
    /// `m = c * S` (the original used `c = 4`).
    PerStage(u32),
    /// `m = max(1, round(B * n / N))`: the share of the global batch a pipeline of `n` of the
    /// `N` nodes gets when all pipelines run about equally fast. This is what instantiation
    /// really gives a pipeline, so it is the default.
    Auto,
}

impl TemplateMicrobatches {
    /// The `m` for a template of `n` nodes and `stages` stages in a job of `total_nodes` nodes.
    pub fn resolve(&self, n: u32, stages: u32, total_nodes: u32, global_microbatches: u32) -> u64 {
        match *self {
            TemplateMicrobatches::Fixed(m) => u64::from(m.max(1)),
            TemplateMicrobatches::PerStage(c) => u64::from(c.max(1)) * u64::from(stages),
            TemplateMicrobatches::Auto => {
                let num = u64::from(global_microbatches) * u64::from(n);
                let den = u64::from(total_nodes.max(1));
                ((num + den / 2) / den).max(1)
            }
        }
    }
}

impl std::str::FromStr for TemplateMicrobatches {
    type Err = String;
    /// `auto`, `12` (fixed) or `4s` (per stage).
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s == "auto" {
            return Ok(TemplateMicrobatches::Auto);
        }
        if let Some(c) = s.strip_suffix('s') {
            let c: u32 = c
                .parse()
                .map_err(|_| format!("`{s}`: expected N, Ns or auto"))?;
            if c == 0 {
                return Err(format!("`{s}`: the multiple must be at least 1"));
            }
            return Ok(TemplateMicrobatches::PerStage(c));
        }
        let m: u32 = s
            .parse()
            .map_err(|_| format!("`{s}`: expected N, Ns or auto"))?;
        if m == 0 {
            return Err(format!("`{s}`: at least 1 microbatch"));
        }
        Ok(TemplateMicrobatches::Fixed(m))
    }
}

impl JobSpec {
    /// Checks the job against the profile.
    pub fn validate(&self, profile: &ModelProfile) -> Result<(), PlanError> {
        if self.microbatch_size == 0 || self.microbatch_size != profile.fingerprint.microbatch_size
        {
            return Err(PlanError::MicrobatchMismatch {
                job: self.microbatch_size,
                profile: profile.fingerprint.microbatch_size,
            });
        }
        if self.global_microbatches == 0 {
            return Err(PlanError::BatchTooSmall {
                global_microbatches: 0,
                pipelines: self.fault_threshold + 1,
            });
        }
        if self.state_bytes_per_param_byte == 0 {
            return Err(PlanError::InvalidCluster {
                field: "state_bytes_per_param_byte",
                value: 0.0,
            });
        }
        Ok(())
    }
}

fn check_non_negative(layer: usize, field: &'static str, v: f64) -> Result<(), PlanError> {
    if !v.is_finite() || v < 0.0 {
        return Err(PlanError::InvalidProfile {
            layer,
            field,
            value: v,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::template::best_template;
    use super::super::{analytical_profile, DeviceSpec, Dtype, TransformerShape};
    use super::*;

    fn gpt(b: u32) -> ModelProfile {
        let shape = TransformerShape::gpt(6, 512, 8, 8192, 512);
        let device = DeviceSpec::named("a100-40gb").expect("a known device");
        analytical_profile("test", &shape, device, b, Dtype::Bf16)
    }

    fn job(b: u32) -> JobSpec {
        JobSpec {
            fault_threshold: 0,
            microbatch_size: b,
            global_microbatches: 16,
            state_bytes_per_param_byte: 8,
            template_microbatches: TemplateMicrobatches::Fixed(8),
        }
    }

    #[test]
    fn recompute_keeps_each_layers_input_and_runs_its_forward_twice() {
        let p = gpt(2);
        let r = p.with_recompute(4 * 2 * 512);
        assert_eq!(r.fingerprint, p.fingerprint);
        for (i, (a, b)) in p.layers.iter().zip(&r.layers).enumerate() {
            let input = if i == 0 {
                4 * 2 * 512
            } else {
                p.layers[i - 1].output_bytes
            };
            assert_eq!(
                b.activation_bytes,
                a.activation_bytes.min(input),
                "layer {i}"
            );
            assert!(b.activation_bytes < a.activation_bytes, "layer {i}");
            assert_eq!(b.backward_ms, a.backward_ms + a.forward_ms, "layer {i}");
            assert_eq!(
                (b.forward_ms, b.param_bytes, b.output_bytes),
                (a.forward_ms, a.param_bytes, a.output_bytes)
            );
        }
        // An input larger than what a layer keeps anyway changes nothing of its memory.
        let r = p.with_recompute(u64::MAX);
        assert_eq!(r.layers[0].activation_bytes, p.layers[0].activation_bytes);
    }

    /// One node of one device has one layout (a single stage), so the two templates differ
    /// only by recomputation: less memory, a longer iteration.
    #[test]
    fn a_template_with_recompute_needs_less_memory_and_more_time() {
        let device = DeviceSpec::named("a100-40gb").expect("a known device");
        let cluster = device.cluster(1);
        let p = gpt(2);
        let r = p.with_recompute(4 * 2 * 512);
        let (plain, _) = best_template(&p, &cluster, &job(2), 1, 1).expect("fits");
        let (again, _) = best_template(&r, &cluster, &job(2), 1, 1).expect("fits");
        assert_eq!(plain.stages.len(), 1);
        assert_eq!(again.stages.len(), 1);
        assert!(again.peak_memory_bytes < plain.peak_memory_bytes);
        assert!(again.iteration_ns > plain.iteration_ns);
        let (b0, b1) = (plain.stages[0].backward_ns, again.stages[0].backward_ns);
        assert_eq!(b1, b0 + again.stages[0].forward_ns);
    }
}
