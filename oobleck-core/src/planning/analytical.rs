//! Analytical profiles: per-layer times and memory of a GPT-style transformer on a named
//! device, from shapes alone, so a 64-node plan can be made on a laptop.
//!
//! # Layers
//! `L = n_blocks + 2`: layer 0 is the token + position embedding, layers `1..=n_blocks` are
//! the blocks, the last layer is the final LayerNorm + LM head + loss.
//!
//! # Parameters (exact from shapes, `d` = d_model, `f` = ffn width, `V` = vocab, `s` = seq)
//! - embedding: `V*d + s*d`
//! - block: `4d^2 + 2df + 9d + f` (QKV + output projection with biases, two MLP matrices with
//!   biases, two LayerNorms)
//! - head: `2d + V*d`. With a tied embedding the head still holds its own copy of `V*d` (the
//!   two copies are kept equal by gradient sync), so it counts for memory.
//!
//! # Time per microbatch (`b` samples of `s` tokens)
//! Forward FLOPs: block `2bs(4d^2 + 2df) + 4bs^2 d` (matmuls + attention scores and mix);
//! head `2bsdV`; embedding 0. Backward = 2 x forward FLOPs. Each pass takes
//! `max(FLOPs / (peak * efficiency), bytes / memory bandwidth) + launch overhead`, where bytes =
//! parameter bytes read (forward) or read + gradient written (backward) plus the activations
//! read and written. Assumptions: dense bf16/fp16 tensor-core peak for GPUs (fp32 peak for
//! `cpu`; bf16 on `cpu` at [`CPU_BF16_RATE`] of it, see [`DeviceSpec::peak_tflops_for`]), a
//! fixed efficiency (model FLOPs utilisation) per device, no recomputation.
//!
//! # Activation memory per microbatch (kept for backward)
//! Block: `b*s*d*(34 + 5*a*s/d)` bytes in 16-bit (Korthikanti et al. 2022, "Reducing
//! Activation Recomputation", eq. 1 without tensor parallelism), scaled by `dtype bytes / 2`.
//! Embedding: its output `b*s*d*e`. Head: the LayerNorm output `b*s*d*e` plus fp32 logits
//! `4*b*s*V` for the loss. Output (stage boundary) bytes: `b*s*d*e`.

use serde::{Deserialize, Serialize};

use super::profile::{ClusterSpec, Fingerprint, LayerProfile, LinkModel, ModelProfile};

/// Shape of a GPT-style decoder-only transformer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransformerShape {
    pub n_blocks: u32,
    pub d_model: u32,
    pub n_heads: u32,
    /// Feed-forward width (usually `4 * d_model`).
    pub ffn: u32,
    pub vocab: u32,
    pub seq_len: u32,
    pub tied_embedding: bool,
}

impl TransformerShape {
    /// A GPT-2/3 shape with `ffn = 4d`.
    pub const fn gpt(n_blocks: u32, d_model: u32, n_heads: u32, vocab: u32, seq_len: u32) -> Self {
        TransformerShape {
            n_blocks,
            d_model,
            n_heads,
            ffn: 4 * d_model,
            vocab,
            seq_len,
            tied_embedding: true,
        }
    }

    /// Parameter counts per planner layer.
    pub fn layer_params(&self) -> Vec<u64> {
        let d = u64::from(self.d_model);
        let f = u64::from(self.ffn);
        let v = u64::from(self.vocab);
        let s = u64::from(self.seq_len);
        let mut out = Vec::with_capacity(self.n_blocks as usize + 2);
        out.push(v * d + s * d);
        for _ in 0..self.n_blocks {
            out.push(4 * d * d + 2 * d * f + 9 * d + f);
        }
        out.push(2 * d + v * d);
        out
    }

    /// Model parameter count (the tied matrix counted once).
    pub fn num_params(&self) -> u64 {
        let total: u64 = self.layer_params().iter().sum();
        if self.tied_embedding {
            total - u64::from(self.vocab) * u64::from(self.d_model)
        } else {
            total
        }
    }

    /// Canonical description (used in fingerprints).
    pub fn describe(&self) -> String {
        format!(
            "gpt(blocks={},d={},heads={},ffn={},vocab={},seq={},tied={})",
            self.n_blocks,
            self.d_model,
            self.n_heads,
            self.ffn,
            self.vocab,
            self.seq_len,
            self.tied_embedding
        )
    }
}

/// Training dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    #[default]
    F32,
    Bf16,
}

impl Dtype {
    /// The Candle dtype layers compute in.
    pub fn candle(self) -> candle_core::DType {
        match self {
            Dtype::F32 => candle_core::DType::F32,
            Dtype::Bf16 => candle_core::DType::BF16,
        }
    }

    pub fn bytes(self) -> u64 {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
        }
    }

    /// Persistent training state per byte of a profile's parameters (`param_bytes`, counted
    /// in this dtype), for [`super::JobSpec::state_bytes_per_param_byte`]. f32: weights,
    /// gradients, Adam m and v, 4 bytes each: 16 B per parameter = 4 x 4 B. bf16 (mixed
    /// precision): the f32 master weights (4 B), their bf16 working copy (2 B), f32 gradients
    /// (4 B: autograd casts them back to the master's dtype) and f32 m and v (4 + 4 B): 18 B
    /// per parameter = 9 x 2 B.
    pub fn state_bytes_per_param_byte(self) -> u32 {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 => 9,
        }
    }
}

/// A named device: compute, memory and links of a typical node built from it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DeviceSpec {
    pub name: &'static str,
    /// Dense peak, TFLOP/s (bf16/fp16 tensor cores for GPUs, fp32 for `cpu`).
    pub peak_tflops: f64,
    /// Fraction of peak a transformer layer reaches.
    pub efficiency: f64,
    /// Memory bandwidth, GB/s.
    pub memory_gbps: f64,
    /// Usable device memory, bytes (nominal minus runtime context and fragmentation, 8%).
    pub memory_bytes: u64,
    /// Per-layer, per-pass fixed overhead (kernel launches), microseconds.
    pub launch_overhead_us: f64,
    /// Link between devices of one node (NVLink, or shared memory for `cpu`).
    pub intra_node: LinkModel,
    /// Link between nodes (typical NIC of a cloud instance of this device).
    pub inter_node: LinkModel,
}

const MIB: u64 = 1 << 20;

/// bf16 compute on a CPU, as a fraction of its fp32 rate: Candle's CPU backend has no bf16
/// GEMM (it widens to f32, multiplies and narrows back) and the fused f32 kernels of
/// `oobleck-models` do not take bf16, so a bf16 step is slower, not faster. Measured on the
/// 2-core dev machine (AMD EPYC, AVX-512): one gpt-small-bench block (d = 512, b = 4,
/// s = 256) forward + backward takes 0.83 s in f32 and 2.2 s in bf16 (0.38).
pub const CPU_BF16_RATE: f64 = 0.4;

const fn usable(mib: u64) -> u64 {
    mib * MIB / 100 * 92
}

/// The named devices. Memory sizes are what `nvidia-smi` reports for each part.
pub const DEVICES: &[DeviceSpec] = &[
    DeviceSpec {
        name: "a100-40gb",
        peak_tflops: 312.0,
        efficiency: 0.5,
        memory_gbps: 1555.0,
        memory_bytes: usable(40_960),
        launch_overhead_us: 20.0,
        intra_node: LinkModel {
            latency_us: 5.0,
            bandwidth_gbps: 300.0,
        },
        inter_node: LinkModel {
            latency_us: 10.0,
            bandwidth_gbps: 25.0,
        },
    },
    DeviceSpec {
        name: "a100-80gb",
        peak_tflops: 312.0,
        efficiency: 0.5,
        memory_gbps: 2039.0,
        memory_bytes: usable(81_920),
        launch_overhead_us: 20.0,
        intra_node: LinkModel {
            latency_us: 5.0,
            bandwidth_gbps: 300.0,
        },
        inter_node: LinkModel {
            latency_us: 10.0,
            bandwidth_gbps: 25.0,
        },
    },
    DeviceSpec {
        name: "h100-80gb",
        peak_tflops: 989.0,
        efficiency: 0.45,
        memory_gbps: 3350.0,
        memory_bytes: usable(81_559),
        launch_overhead_us: 15.0,
        intra_node: LinkModel {
            latency_us: 4.0,
            bandwidth_gbps: 450.0,
        },
        inter_node: LinkModel {
            latency_us: 8.0,
            bandwidth_gbps: 50.0,
        },
    },
    DeviceSpec {
        name: "h200-141gb",
        peak_tflops: 989.0,
        efficiency: 0.45,
        memory_gbps: 4800.0,
        memory_bytes: usable(143_771),
        launch_overhead_us: 15.0,
        intra_node: LinkModel {
            latency_us: 4.0,
            bandwidth_gbps: 450.0,
        },
        inter_node: LinkModel {
            latency_us: 8.0,
            bandwidth_gbps: 50.0,
        },
    },
    DeviceSpec {
        name: "v100-32gb",
        peak_tflops: 125.0,
        efficiency: 0.45,
        memory_gbps: 900.0,
        memory_bytes: usable(32_768),
        launch_overhead_us: 25.0,
        intra_node: LinkModel {
            latency_us: 6.0,
            bandwidth_gbps: 150.0,
        },
        inter_node: LinkModel {
            latency_us: 15.0,
            bandwidth_gbps: 12.5,
        },
    },
    // A 16 GiB laptop; `train` plans on this machine's memory instead (see `with_memory`).
    DeviceSpec {
        name: "cpu",
        peak_tflops: 0.2,
        efficiency: 0.5,
        memory_gbps: 20.0,
        memory_bytes: usable(16_384),
        launch_overhead_us: 50.0,
        intra_node: LinkModel {
            latency_us: 20.0,
            bandwidth_gbps: 5.0,
        },
        inter_node: LinkModel {
            latency_us: 50.0,
            bandwidth_gbps: 1.25,
        },
    },
];

impl DeviceSpec {
    /// Looks a device up by name.
    pub fn named(name: &str) -> Option<&'static DeviceSpec> {
        DEVICES.iter().find(|d| d.name == name)
    }

    /// This device with `bytes` of usable memory: a CPU's is the machine's, known only where
    /// the job runs (`runtime::host_memory`), so the table's `cpu` entry is a laptop's default.
    pub fn with_memory(&self, bytes: u64) -> DeviceSpec {
        DeviceSpec {
            memory_bytes: bytes,
            ..*self
        }
    }

    /// Names of all devices.
    pub fn names() -> Vec<&'static str> {
        DEVICES.iter().map(|d| d.name).collect()
    }

    /// A cluster of these devices.
    pub fn cluster(&self, devices_per_node: u32) -> ClusterSpec {
        ClusterSpec {
            device_kind: self.name.to_string(),
            device_memory_bytes: self.memory_bytes,
            devices_per_node,
            intra_node: self.intra_node,
            inter_node: self.inter_node,
        }
    }

    /// Dense peak for computing in `dtype`, TFLOP/s. A GPU's table peak is its bf16
    /// tensor-core rate, which f32 profiles have always used as well (TF32-class matmuls), so
    /// f32 plans are what they were. The `cpu` peak is fp32's; bf16 there runs at
    /// [`CPU_BF16_RATE`] of it.
    pub fn peak_tflops_for(&self, dtype: Dtype) -> f64 {
        match dtype {
            Dtype::Bf16 if self.name == "cpu" => self.peak_tflops * CPU_BF16_RATE,
            _ => self.peak_tflops,
        }
    }

    fn pass_ms(&self, dtype: Dtype, flops: f64, bytes: f64) -> f64 {
        let compute_s = flops / (self.peak_tflops_for(dtype) * 1e12 * self.efficiency);
        let memory_s = bytes / (self.memory_gbps * 1e9);
        compute_s.max(memory_s) * 1e3 + self.launch_overhead_us * 1e-3
    }
}

/// Estimates a [`ModelProfile`] of `shape` on `device` for microbatches of `microbatch_size`.
pub fn analytical_profile(
    model_name: &str,
    shape: &TransformerShape,
    device: &DeviceSpec,
    microbatch_size: u32,
    dtype: Dtype,
) -> ModelProfile {
    let e = dtype.bytes() as f64;
    let b = f64::from(microbatch_size);
    let s = f64::from(shape.seq_len);
    let d = f64::from(shape.d_model);
    let f = f64::from(shape.ffn);
    let v = f64::from(shape.vocab);
    let a = f64::from(shape.n_heads);
    let hidden = b * s * d * e;
    let params = shape.layer_params();
    let n = params.len();
    let mut layers = Vec::with_capacity(n);
    for (i, &p) in params.iter().enumerate() {
        let pbytes = p as f64 * e;
        let (name, flops, act, io) = if i == 0 {
            // Gather rows of the embedding tables: memory-bound.
            ("embedding".to_string(), 0.0, hidden, 2.0 * hidden)
        } else if i == n - 1 {
            let flops = 2.0 * b * s * d * v;
            let act = hidden + 4.0 * b * s * v;
            ("head".to_string(), flops, act, hidden + 4.0 * b * s * v)
        } else {
            let flops = 2.0 * b * s * (4.0 * d * d + 2.0 * d * f) + 4.0 * b * s * s * d;
            let act = b * s * d * (34.0 + 5.0 * a * s / d) * e / 2.0;
            (format!("block.{}", i - 1), flops, act, 2.0 * hidden + act)
        };
        let fwd = device.pass_ms(dtype, flops, pbytes + io);
        let bwd = device.pass_ms(dtype, 2.0 * flops, 2.0 * pbytes + 2.0 * io);
        layers.push(LayerProfile {
            name,
            forward_ms: round_us(fwd),
            backward_ms: round_us(bwd),
            param_bytes: p * dtype.bytes(),
            activation_bytes: act.round() as u64,
            output_bytes: hidden.round() as u64,
        });
    }
    ModelProfile {
        fingerprint: Fingerprint {
            model: format!("{model_name} {}", shape.describe()),
            microbatch_size,
            dtype: dtype.name().to_string(),
            device_kind: device.name.to_string(),
        },
        layers,
    }
}

/// Rounds to whole nanoseconds expressed in ms, so JSON round trips are exact.
fn round_us(ms: f64) -> f64 {
    (ms * 1e6).round() / 1e6
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_small_parameter_count_matches_published() {
        let s = TransformerShape::gpt(12, 768, 12, 50257, 1024);
        // Hugging Face gpt2: 124,439,808 parameters.
        assert_eq!(s.num_params(), 124_439_808);
    }

    #[test]
    fn gpt3_6_7b_is_about_6_7_billion() {
        let s = TransformerShape::gpt(32, 4096, 32, 50257, 2048);
        let p = s.num_params() as f64 / 1e9;
        assert!((6.5..6.9).contains(&p), "{p}");
    }

    #[test]
    fn analytical_profile_is_valid_and_backward_is_slower() {
        let s = TransformerShape::gpt(4, 128, 4, 50257, 128);
        let dev = DeviceSpec::named("a100-80gb").expect("known");
        let p = analytical_profile("gpt-mini", &s, dev, 2, Dtype::F32);
        p.validate().expect("valid");
        assert_eq!(p.layers.len(), 6);
        for l in &p.layers {
            assert!(l.backward_ms >= l.forward_ms);
        }
        let back = ModelProfile::from_json(&p.to_json()).expect("round trip");
        assert_eq!(back, p);
    }

    /// bf16 halves every byte count but the head's f32 logits, and plans 18 B of state per
    /// parameter (9 per bf16 parameter byte) against f32's 16 (4 per f32 byte). On a GPU the
    /// compute-bound blocks take the same time (the table's peak is the tensor-core rate);
    /// on `cpu` they are slower.
    #[test]
    fn a_bf16_profile_counts_two_bytes_and_its_state_eighteen_per_parameter() {
        let s = TransformerShape::gpt(4, 1024, 16, 50257, 1024);
        for (dev, slower) in [("a100-80gb", false), ("cpu", true)] {
            let dev = DeviceSpec::named(dev).expect("known");
            let f = analytical_profile("m", &s, dev, 8, Dtype::F32);
            let h = analytical_profile("m", &s, dev, 8, Dtype::Bf16);
            assert_eq!(h.fingerprint.dtype, "bf16");
            for (a, b) in f.layers.iter().zip(&h.layers) {
                assert_eq!(a.param_bytes, 2 * b.param_bytes);
                assert_eq!(a.output_bytes, 2 * b.output_bytes);
            }
            assert_eq!(
                f.layers[1].activation_bytes,
                2 * h.layers[1].activation_bytes
            );
            let (fb, hb) = (f.layers[1].forward_ms, h.layers[1].forward_ms);
            assert_eq!(
                hb > fb,
                slower,
                "{}: block forward {fb} ms (f32), {hb} (bf16)",
                dev.name
            );
        }
        let per_param = |d: Dtype| d.bytes() as u32 * d.state_bytes_per_param_byte();
        assert_eq!((per_param(Dtype::F32), per_param(Dtype::Bf16)), (16, 18));
    }
}
