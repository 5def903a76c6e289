//! Whether a job fits this machine's memory, decided before anything is measured or built:
//! a CPU device is its rank's share of what this process may use ([`HostMemory`]), checked on
//! the analytical profile (a cluster job's pipelines by the planner's bound, the single process
//! by the whole model and one microbatch), refused with the numbers and the ways out.

use anyhow::{bail, Result};
use oobleck_core::planning::{generate_templates, ModelProfile, PlanError};
use oobleck_core::runtime::host_memory::{HostMemory, MemoryBound};
use oobleck_core::runtime::{master, Compute, TrainingSpec, Workload};
use oobleck_models::workload::GptWorkload;

use super::job::LaunchMode;
use crate::config::{training_spec, TrainConfig};

/// This machine's memory for the job: `--host-memory`, else what this process may use.
pub(super) fn host_memory(cfg: &TrainConfig) -> Option<HostMemory> {
    match cfg.host_memory {
        Some(bytes) => Some(HostMemory::given(bytes)),
        None => HostMemory::of_this_machine(),
    }
}

/// The ranks of the job that share one machine's cores and memory: every rank of a local
/// cluster; a node's devices otherwise (its nodes are taken to be machines like this one).
pub(super) fn host_ranks(cfg: &TrainConfig, launch: &LaunchMode) -> usize {
    let ranks = match launch {
        LaunchMode::Local => cfg.nodes * cfg.devices_per_node,
        // A local job's master restarted: its agents run on this machine.
        LaunchMode::Reattach { addr, .. } if addr.ip().is_loopback() => {
            cfg.nodes * cfg.devices_per_node
        }
        LaunchMode::Reattach { .. } => cfg.devices_per_node,
        LaunchMode::Listen { .. } | LaunchMode::Hostfile { .. } | LaunchMode::Scheduled { .. } => {
            cfg.devices_per_node
        }
    };
    ranks.max(1)
}

/// How the ranks of a CPU job share this machine's memory.
pub(super) struct Sharing {
    pub memory: HostMemory,
    /// Ranks on this machine (`--nodes x --devices-per-node` for a local cluster, else the
    /// node's devices).
    pub ranks: usize,
    /// A local cluster: every node is on this machine.
    pub local: bool,
}

/// The single-process trainer's check (`--nodes 1`): the whole model, its optimizer state and
/// a microbatch's activations in this process, on the analytical profile, refused in seconds
/// with the numbers as a cluster job is, instead of being killed by the kernel mid-way.
pub fn check_one_process_fits(cfg: &TrainConfig, workload: &GptWorkload) -> Result<()> {
    let one = TrainConfig {
        nodes: 1,
        fault_threshold: 0,
        ..cfg.clone()
    };
    let mut spec = training_spec(&one)?;
    let (Compute::Cpu, Some(memory)) = (spec.compute, host_memory(cfg)) else {
        return Ok(()); // a GPU's memory is the table's; CUDA says so itself
    };
    let has = memory.per_rank(1);
    spec.device_memory_bytes = Some(has);
    let device = spec.device_spec()?;
    let estimate = workload
        .planner_profile(&device, spec.microbatch_size, spec.precision)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let estimate = master::planned_profile(estimate, &spec, workload.tokens_per_sample());
    let state_per_byte = u64::from(spec.job_spec(0).state_bytes_per_param_byte);
    let state: u64 = estimate.layers.iter().map(|l| l.param_bytes).sum::<u64>() * state_per_byte;
    // The microbatches of a step run one after the other: one microbatch's activations at once.
    let activations: u64 = estimate.layers.iter().map(|l| l.activation_bytes).sum();
    if state + activations <= has {
        return Ok(());
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    bail!(
        "the model does not fit in one process: it needs {:.1} GiB ({:.1} GiB of parameters, \
         gradients and optimizer state and {:.1} GiB of activations of a microbatch of {} \
         samples), this process has {:.1} GiB.\nChecked before building the model, on the \
         analytical profile: nothing was measured. This process has {}. Ways out: \
         activation recomputation (`--recompute`), bf16 (`--precision bf16`), a smaller \
         --microbatch-size or --seq-len, a cluster (`--nodes 2` or more here, or more machines \
         with --hostfile or --listen) so that each process holds a part; --host-memory sets \
         this machine's memory where it is known better; a smaller --model (`oobleck models` \
         lists them) needs less",
        gib(state + activations),
        gib(state),
        gib(activations),
        spec.microbatch_size,
        gib(has),
        memory.describe(1)
    )
}

/// Refuses a job whose pipelines cannot fit its devices on the analytical profile `estimate`
/// (as planned: [`master::planned_profile`]; the planner's memory check,
/// [`generate_templates`]'s `ModelTooLarge` and `Infeasible`),
/// before anything is measured: a measured profile of a model that large would take the
/// machine's memory itself. Other problems of the plan are said after profiling, as always.
pub(super) fn check_fits(
    spec: &TrainingSpec,
    estimate: &ModelProfile,
    sharing: &Sharing,
) -> Result<()> {
    let cluster = spec.device_spec()?.cluster(spec.devices_per_node);
    let job = spec.job_spec(spec.fault_threshold);
    match generate_templates(estimate, &cluster, &job, spec.nodes) {
        Err(e @ (PlanError::ModelTooLarge { .. } | PlanError::Infeasible { .. })) => {
            bail!("{}", memory_refusal(&e, sharing))
        }
        _ => Ok(()),
    }
}

/// The planner's refusal, then where a device's memory comes from on this machine and what
/// else changes it.
fn memory_refusal(e: &PlanError, sharing: &Sharing) -> String {
    let Sharing {
        memory,
        ranks,
        local,
    } = sharing;
    let mut text = format!(
        "{e}.\nChecked before profiling, on the analytical profile: nothing was measured. A \
         device here has {}",
        memory.describe(*ranks)
    );
    let shared = memory.bound_for(*ranks) != MemoryBound::AddressSpace;
    if *local && *ranks > 1 && shared {
        text.push_str(
            " by the ranks of this local cluster (--nodes x --devices-per-node): more nodes \
             here share the same memory, more machines (--hostfile or --listen) add theirs",
        );
    }
    text.push_str(
        ". --host-memory sets this machine's memory where it is known better; a smaller \
         --model (`oobleck models` lists them) needs less",
    );
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use oobleck_core::planning::analytical_profile;
    use oobleck_models::ModelConfig;

    const GIB: u64 = 1 << 30;

    /// The job of `train --model M` on a local cluster of 4 nodes (the defaults, and a preset's
    /// recipe) on a machine of `gib` GiB, and the analytical profile it is checked on.
    fn job(model: &str, gib: u64) -> (TrainingSpec, ModelProfile, Sharing) {
        let mut cfg = TrainConfig {
            model: model.into(),
            device: "cpu".into(),
            ..TrainConfig::default()
        };
        cfg.apply_recipe(|_| false);
        let sharing = Sharing {
            memory: HostMemory::given(gib * GIB),
            ranks: host_ranks(&cfg, &LaunchMode::Local),
            local: true,
        };
        let mut spec = training_spec(&cfg).expect("a valid job");
        spec.device_memory_bytes = Some(sharing.memory.per_rank(sharing.ranks));
        let shape = ModelConfig::preset(model)
            .and_then(|m| m.planner_shape(cfg.seq_len))
            .expect("a preset");
        let device = spec.device_spec().expect("cpu");
        let estimate = analytical_profile(model, &shape, &device, 4, spec.precision);
        (spec, estimate, sharing)
    }

    #[test]
    fn a_model_that_cannot_fit_is_refused_with_the_memory_it_needs_and_has() {
        let (spec, estimate, sharing) = job("gpt3-2.7b", 24);
        let e = check_fits(&spec, &estimate, &sharing)
            .expect_err("gpt3-2.7b at 2048 tokens does not fit 24 GiB")
            .to_string();
        assert!(
            e.starts_with(
                "the model does not fit: even one layer per stage needs 210.0 GiB per \
                           device, the device has 5.5 GiB"
            ),
            "{e}"
        );
        assert!(
            e.contains("5.5 GiB each of 4 processes: 24.0 GiB (--host-memory) less 8% slack"),
            "{e}"
        );
        assert!(
            e.contains("nothing was measured") && e.contains("--recompute"),
            "{e}"
        );
    }

    #[test]
    fn a_model_that_fits_passes_and_more_nodes_on_one_machine_do_not_help() {
        let (spec, estimate, sharing) = job("gpt-mini", 24);
        check_fits(&spec, &estimate, &sharing).expect("gpt-mini fits 24 GiB");
        // gpt2 at its whole context fits 4 ranks of 96 GiB, not of 8.
        let (spec, estimate, sharing) = job("gpt2", 96);
        check_fits(&spec, &estimate, &sharing).expect("gpt2 fits 96 GiB");
        let (spec, estimate, sharing) = job("gpt2", 8);
        let e = check_fits(&spec, &estimate, &sharing)
            .expect_err("8 GiB")
            .to_string();
        assert!(e.contains("more nodes here share the same memory"), "{e}");
    }
}
