//! Where a worker computes: what GPUs the machine has, which planner device kind they are, and
//! opening a worker's device.
//!
//! A `--features cuda` build links the CUDA driver library (`libcuda.so`, from the NVIDIA
//! driver); on a machine without it such a binary does not start at all (the dynamic loader
//! names the missing library), so GPU builds are for GPU machines and the default build is the
//! CPU one.

use candle_core::Device;

use super::error::{Result, RuntimeError};
use super::spec::Compute;
use crate::planning::Dtype;

/// The GPUs a `--features cuda` build sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpus {
    pub count: usize,
    /// The first device's name as the driver reports it (`NVIDIA H200`).
    pub name: String,
}

/// The GPUs of this machine: `Ok(None)` for a build without CUDA or a machine without GPUs,
/// an error when the driver is there but fails. Asked once per process (`--device` is
/// resolved at validation, for the job spec and for a worker's ordinal check; opening a CUDA
/// context each time would cost every one of them).
pub fn detect_gpus() -> Result<Option<Gpus>> {
    static SEEN: std::sync::OnceLock<std::result::Result<Option<Gpus>, String>> =
        std::sync::OnceLock::new();
    SEEN.get_or_init(probe_gpus)
        .clone()
        .map_err(RuntimeError::Invalid)
}

fn probe_gpus() -> std::result::Result<Option<Gpus>, String> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::CudaContext;
        let count = match CudaContext::device_count() {
            Ok(n) => n.max(0) as usize,
            // No device or no usable driver: the CPU it is.
            Err(_) => return Ok(None),
        };
        if count == 0 {
            return Ok(None);
        }
        let name = CudaContext::new(0)
            .and_then(|c| c.name())
            .map_err(|e| format!("CUDA device 0 does not open: {e}"))?;
        Ok(Some(Gpus { count, name }))
    }
    #[cfg(not(feature = "cuda"))]
    Ok(None)
}

/// The planner's device kind for a GPU the driver names `name` (`NVIDIA H100 80GB HBM3` ->
/// `h100-80gb`), if it knows that part.
pub fn planner_kind(name: &str) -> Option<&'static str> {
    let n = name.to_ascii_lowercase();
    let kinds: [(&str, &[&str], &str); 5] = [
        ("h200", &[], "h200-141gb"),
        ("h100", &[], "h100-80gb"),
        ("a100", &["40gb"], "a100-40gb"),
        ("a100", &[], "a100-80gb"),
        ("v100", &[], "v100-32gb"),
    ];
    kinds
        .iter()
        .find(|(part, extra, _)| n.contains(part) && extra.iter().all(|e| n.contains(e)))
        .map(|k| k.2)
}

/// Opens the device a worker computes on: the CPU, or CUDA ordinal `ordinal`.
pub fn open(compute: Compute, ordinal: u32) -> Result<Device> {
    match compute {
        Compute::Cpu => Ok(Device::Cpu),
        Compute::Cuda => open_cuda(ordinal),
    }
}

/// Refuses bf16 on a GPU without it (compute capability below 8.0: V100, T4), before anything
/// is started. The CPU computes bf16 in software (slowly; for tests and parity).
pub fn check_precision(compute: Compute, ordinal: u32, precision: Dtype) -> Result<()> {
    if precision != Dtype::Bf16 || compute == Compute::Cpu {
        return Ok(());
    }
    let (major, minor) = compute_capability(ordinal)?;
    if major < 8 {
        return Err(RuntimeError::Invalid(format!(
            "--precision bf16 needs a GPU of compute capability 8.0 or later (A100, H100, \
             H200); CUDA device {ordinal} is {major}.{minor}: train with --precision fp32"
        )));
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn compute_capability(ordinal: u32) -> Result<(i32, i32)> {
    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    CudaContext::new(ordinal as usize)
        .and_then(|c| c.compute_capability())
        .map_err(|e| RuntimeError::Invalid(format!("CUDA device {ordinal} does not open: {e}")))
}

#[cfg(not(feature = "cuda"))]
fn compute_capability(ordinal: u32) -> Result<(i32, i32)> {
    open_cuda(ordinal).map(|_| (0, 0))
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: u32) -> Result<Device> {
    let seen = detect_gpus()?.map_or(0, |g| g.count);
    if ordinal as usize >= seen {
        return Err(RuntimeError::Invalid(format!(
            "CUDA device {ordinal} does not exist: this machine shows {seen} (check \
             CUDA_VISIBLE_DEVICES and --devices-per-node, or train with --device cpu)"
        )));
    }
    Device::new_cuda(ordinal as usize)
        .map_err(|e| RuntimeError::Invalid(format!("CUDA device {ordinal} does not open: {e}")))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_ordinal: u32) -> Result<Device> {
    Err(RuntimeError::Invalid(
        "this build has no CUDA: build with `cargo build --release --features cuda` (see \
         scripts/build-cuda.sh) or train with --device cpu"
            .into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_names_map_to_planner_kinds() {
        let cases = [
            ("NVIDIA H200", Some("h200-141gb")),
            ("NVIDIA H100 80GB HBM3", Some("h100-80gb")),
            ("NVIDIA A100-SXM4-40GB", Some("a100-40gb")),
            ("NVIDIA A100-SXM4-80GB", Some("a100-80gb")),
            ("Tesla V100-SXM2-32GB", Some("v100-32gb")),
            ("NVIDIA GeForce RTX 4090", None),
        ];
        for (name, kind) in cases {
            assert_eq!(planner_kind(name), kind, "{name}");
        }
    }

    #[test]
    fn the_cpu_opens_everywhere_and_cuda_only_in_a_cuda_build() {
        assert!(open(Compute::Cpu, 0).expect("cpu").is_cpu());
        if !cfg!(feature = "cuda") {
            let e = open(Compute::Cuda, 0)
                .expect_err("no CUDA in this build")
                .to_string();
            assert!(
                e.contains("--features cuda") && e.contains("--device cpu"),
                "{e}"
            );
            assert_eq!(detect_gpus().expect("no error without CUDA"), None);
            assert!(check_precision(Compute::Cuda, 0, Dtype::Bf16).is_err());
        }
        for p in [Dtype::F32, Dtype::Bf16] {
            check_precision(Compute::Cpu, 0, p).expect("the CPU computes either");
        }
    }
}
