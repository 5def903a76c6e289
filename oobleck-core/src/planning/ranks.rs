//! How ranks are numbered in a [`Plan`]: device `d` of node `j` of a pipeline is rank
//! `first_rank + j * G + d`. Every process of a job derives its place from these.

use super::Plan;

/// The ranks a node runs under `plan`: device `d` of node `j` of a pipeline is rank
/// `first_rank + j * G + d` (the numbering of `planning::Pipeline`).
pub fn ranks_of_node(plan: &Plan, node: u32) -> Vec<u32> {
    let g = plan.devices_per_node;
    plan.pipelines
        .iter()
        .flat_map(|p| {
            p.nodes
                .iter()
                .enumerate()
                .filter(move |(_, &n)| n == node)
                .flat_map(move |(j, _)| (0..g).map(move |d| p.first_rank + j as u32 * g + d))
        })
        .collect()
}

/// The lead (device 0) of each stage of pipeline `pipeline`, in stage order: the stage of
/// node `j` of the template that starts on device `d` is led by rank `first_rank + j * G + d`.
/// The leads of pipeline 0, which holds every layer once, keep the state the master assembles.
/// A node runs several stages when its template's stages use fewer than `G` devices, so this
/// is not one rank per node. Empty when the plan has no such pipeline; panics, as
/// [`Plan::template_of`] does, when the pipeline's template is not in the plan (a plan
/// `execution::Layout::from_plan` refuses).
pub fn stage_leads(plan: &Plan, pipeline: usize) -> Vec<u32> {
    let Some(p) = plan.pipelines.get(pipeline) else {
        return Vec::new();
    };
    let g = plan.devices_per_node;
    plan.template_of(p)
        .stages
        .iter()
        .map(|s| p.first_rank + s.node * g + s.first_device)
        .collect()
}

/// Number of ranks (devices) the plan uses.
pub fn world_size(plan: &Plan) -> u32 {
    plan.pipelines
        .iter()
        .map(|p| p.nodes.len() as u32 * plan.devices_per_node)
        .sum()
}

/// Plans whose rank numbering the tests of this module and of `execution::layout` check.
#[cfg(test)]
pub(crate) mod test_plans {
    use crate::planning::{Pipeline, Plan, Stage, Template};

    /// Two pipelines over nodes `[3, 5]` and `[4]`, two devices per node.
    pub(crate) fn plan() -> Plan {
        let pipeline = |id, nodes: Vec<u32>, first_rank| Pipeline {
            id,
            template_nodes: nodes.len() as u32,
            nodes,
            first_rank,
            microbatches: 2,
            predicted_ns: 1_000,
        };
        Plan {
            generation: 2,
            devices_per_node: 2,
            fault_threshold: 1,
            global_microbatches: 4,
            min_nodes: 1,
            templates: Vec::new(),
            pipelines: vec![pipeline(0, vec![3, 5], 0), pipeline(1, vec![4], 4)],
            compute_ns: 1_000,
            sync_ns: 0,
            sync_model_ns: 0,
            layer_state_bytes: vec![64],
            iteration_ns: 1_000,
        }
    }

    /// Two devices per node. Pipeline 0: one node (3) whose two stages use one device each;
    /// pipeline 1: two nodes (4, 5) with one two-device stage each.
    pub(crate) fn plan_with_stages() -> Plan {
        let stage = |layers: std::ops::Range<usize>, node, first_device, devices| Stage {
            layer_start: layers.start,
            layer_end: layers.end,
            node,
            first_device,
            devices,
            forward_ns: 1,
            backward_ns: 1,
            p2p_ns: 0,
            memory_bytes: 1,
        };
        let template = |nodes, stages| Template {
            nodes,
            devices_per_node: 2,
            stages,
            microbatches: 2,
            t1_ns: 2,
            t3_ns: 2,
            bottleneck_stage: 0,
            bottleneck_ns: 2,
            iteration_ns: 4,
            peak_memory_bytes: 1,
        };
        let mut p = plan();
        p.templates = vec![
            template(1, vec![stage(0..2, 0, 0, 1), stage(2..4, 0, 1, 1)]),
            template(2, vec![stage(0..2, 0, 0, 2), stage(2..4, 1, 0, 2)]),
        ];
        p.pipelines[0].nodes = vec![3];
        p.pipelines[0].template_nodes = 1;
        p.pipelines[1].nodes = vec![4, 5];
        p.pipelines[1].template_nodes = 2;
        p.pipelines[1].first_rank = 2;
        p
    }
}

#[cfg(test)]
mod tests {
    use super::test_plans::plan;
    use super::*;

    #[test]
    fn a_node_runs_the_devices_of_its_place_in_each_pipeline() {
        let plan = plan();
        assert_eq!(ranks_of_node(&plan, 3), vec![0, 1]);
        assert_eq!(ranks_of_node(&plan, 5), vec![2, 3]);
        assert_eq!(ranks_of_node(&plan, 4), vec![4, 5]);
        assert!(ranks_of_node(&plan, 9).is_empty());
        assert_eq!(world_size(&plan), 6);
    }
}
