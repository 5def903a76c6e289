//! The plan of a generation: pinned pipeline sizes, or the planner's choice from the
//! workload's profile.

use crate::planning::{
    gradient_sync_ns, instantiate_with_sizes, plan_with_pipelines, template::generate_templates,
    ModelProfile, Plan,
};
use crate::runtime::error::{Result, RuntimeError};
use crate::runtime::spec::TrainingSpec;

/// The pipelines `sizes` pins, as node ids in stage order, after checking they use exactly
/// the nodes of the job.
pub fn pinned_pipelines(sizes: &[u32], nodes: &[u32]) -> Result<Vec<Vec<u32>>> {
    let list = || {
        sizes
            .iter()
            .map(|s| s.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    if sizes.contains(&0) {
        return Err(RuntimeError::Invalid(format!(
            "--pipeline-nodes {}: every pipeline needs at least one node",
            list()
        )));
    }
    let total: u32 = sizes.iter().sum();
    if total as usize != nodes.len() {
        return Err(RuntimeError::Invalid(format!(
            "--pipeline-nodes {} uses {total} nodes but the job has {} (--nodes {}): the \
             pipeline sizes must add up to the node count",
            list(),
            nodes.len(),
            nodes.len()
        )));
    }
    let mut it = nodes.iter().copied();
    Ok(sizes
        .iter()
        .map(|&s| it.by_ref().take(s as usize).collect())
        .collect())
}

/// The profile the planner plans `spec` with: the workload's `profile`, or with `--recompute`
/// its [`ModelProfile::with_recompute`] (less activation memory, a longer backward). Layer 0
/// then keeps its input, the token ids of a microbatch: 4 bytes (u32) per token.
pub fn planned_profile(
    profile: ModelProfile,
    spec: &TrainingSpec,
    tokens_per_sample: usize,
) -> ModelProfile {
    if !spec.recompute {
        return profile;
    }
    let ids = 4 * u64::from(spec.microbatch_size) * tokens_per_sample as u64;
    profile.with_recompute(ids)
}

/// The plan for `nodes` (sorted ids) with fault threshold `f`.
pub fn plan_for(
    spec: &TrainingSpec,
    profile: &ModelProfile,
    nodes: &[u32],
    f: u32,
    pinned: Option<&[u32]>,
) -> Result<Plan> {
    let device = spec.device_spec()?;
    let g = spec.devices_per_node;
    let cluster = device.cluster(g);
    let job = spec.job_spec(f);
    let n = nodes.len() as u32;
    let plan_err = |what: String, e: crate::planning::PlanError| RuntimeError::Plan {
        nodes: nodes.len(),
        reason: format!("{what}: {e}"),
    };
    let set = generate_templates(profile, &cluster, &job, n)
        .map_err(|e| plan_err(format!("planning pipeline templates for {n} nodes"), e))?;
    let sync = gradient_sync_ns(profile, &cluster);
    match pinned {
        Some(sizes) => {
            let pipes = pinned_pipelines(sizes, nodes)?;
            plan_with_pipelines(&set, &job, g, sync, pipes)
                .map_err(|e| plan_err(format!("--pipeline-nodes {sizes:?}"), e))
        }
        None => instantiate_with_sizes(&set, &job, g, sync, nodes, 0)
            .map_err(|e| plan_err(format!("instantiating pipelines on {n} nodes"), e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_sizes_must_cover_the_nodes() {
        let nodes = [0, 1, 2];
        assert_eq!(
            pinned_pipelines(&[1, 2], &nodes).expect("valid"),
            vec![vec![0], vec![1, 2]]
        );
        let e = pinned_pipelines(&[2, 2], &nodes).expect_err("too many");
        assert!(
            format!("{e}").contains("uses 4 nodes but the job has 3"),
            "{e}"
        );
        assert!(pinned_pipelines(&[0, 3], &nodes).is_err());
    }
}
