//! `--device`: where the workers compute and which device kind the planner models.

use anyhow::{bail, Result};
use oobleck_core::planning::DeviceSpec;
use oobleck_core::runtime::device::{detect_gpus, planner_kind, Gpus};
use oobleck_core::runtime::Compute;

/// Where a job computes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub compute: Compute,
    /// The planner's device kind (`cpu`, `h200-141gb`, ...).
    pub kind: String,
}

/// Resolves `--device` against this build and this machine's GPUs.
pub fn resolve(device: &str) -> Result<Placement> {
    let cpu = Placement {
        compute: Compute::Cpu,
        kind: "cpu".into(),
    };
    let gpus = || detect_gpus().map_err(|e| anyhow::anyhow!("{e}"));
    match device {
        "cpu" => Ok(cpu),
        "auto" => match gpus()? {
            Some(g) => on_gpus(&g),
            None => Ok(cpu),
        },
        "cuda" => match gpus()? {
            Some(g) => on_gpus(&g),
            None if cfg!(feature = "cuda") => {
                bail!("--device cuda: this machine shows no CUDA device; train with --device cpu")
            }
            None => bail!(
                "--device cuda needs a build with CUDA: scripts/build-cuda.sh (or cargo build \
                 --release --features cuda on a machine with the CUDA toolkit); or train with \
                 --device cpu"
            ),
        },
        kind => match DeviceSpec::named(kind) {
            Some(_) if !cfg!(feature = "cuda") => bail!(
                "--device {kind} computes on GPUs, which needs a build with CUDA \
                 (scripts/build-cuda.sh); or train with --device cpu"
            ),
            Some(d) => Ok(Placement {
                compute: Compute::Cuda,
                kind: d.name.into(),
            }),
            None => bail!(
                "--device must be auto, cpu, cuda or a device kind the planner knows ({}), got \
                 {kind:?}",
                DeviceSpec::names().join(", ")
            ),
        },
    }
}

fn on_gpus(g: &Gpus) -> Result<Placement> {
    match planner_kind(&g.name) {
        Some(kind) => Ok(Placement {
            compute: Compute::Cuda,
            kind: kind.into(),
        }),
        None => bail!(
            "the planner has no model of this machine's GPU ({}): pass the nearest kind it \
             knows, --device {}, or --device cpu",
            g.name,
            DeviceSpec::names()
                .into_iter()
                .filter(|n| *n != "cpu")
                .collect::<Vec<_>>()
                .join("|")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_and_auto_without_gpus_compute_on_the_cpu() {
        assert_eq!(resolve("cpu").expect("cpu").compute, Compute::Cpu);
        if !cfg!(feature = "cuda") {
            assert_eq!(resolve("auto").expect("auto").kind, "cpu");
        }
    }

    #[test]
    fn unknown_kinds_and_gpus_without_cuda_are_refused_with_the_way_out() {
        let e = resolve("tpu-v5").expect_err("unknown").to_string();
        assert!(e.contains("h100-80gb") && e.contains("tpu-v5"), "{e}");
        if !cfg!(feature = "cuda") {
            for d in ["cuda", "h100-80gb"] {
                let e = resolve(d).expect_err("no CUDA build").to_string();
                assert!(
                    e.contains("build-cuda.sh") && e.contains("--device cpu"),
                    "{e}"
                );
            }
        }
    }
}
