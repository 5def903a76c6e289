//! Human-readable tables of templates and plans (a reconfiguration's is `reconfig::report`) (pure: returns `String`s;
//! the `oobleck plan` command prints them, golden tests compare them).

use std::fmt::Write;

use super::profile::ns_to_ms;
use super::{Plan, Template, TemplateSet};

pub(crate) fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Compact stage list: `[0-9)x8@n0 [9-17)x8@n1 ...` (layer range, devices, node).
pub fn stages_summary(t: &Template) -> String {
    t.stages
        .iter()
        .map(|s| {
            format!(
                "[{}-{})x{}@n{}",
                s.layer_start, s.layer_end, s.devices, s.node
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// One line per template.
pub fn templates_table(set: &TemplateSet) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "n0 = {} node(s)", set.min_nodes);
    let _ = writeln!(
        out,
        "{:>5} {:>6} {:>4} {:>12} {:>10} {:>10}  stages [layers)xdevices@node",
        "nodes", "stages", "m", "T(m) ms", "w* ms", "mem GiB"
    );
    for t in &set.templates {
        let _ = writeln!(
            out,
            "{:>5} {:>6} {:>4} {:>12.3} {:>10.3} {:>10.2}  {}",
            t.nodes,
            t.num_stages(),
            t.microbatches,
            ns_to_ms(t.iteration_ns),
            ns_to_ms(t.bottleneck_ns),
            gib(t.peak_memory_bytes),
            stages_summary(t)
        );
    }
    out
}

/// The pipelines of a plan.
pub fn plan_table(plan: &Plan) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "generation {}: {} pipelines on {} nodes, B = {} microbatches, f = {}",
        plan.generation,
        plan.pipelines.len(),
        plan.num_nodes(),
        plan.global_microbatches,
        plan.fault_threshold
    );
    let _ = writeln!(
        out,
        "{:>4} {:>5} {:>7} {:>12} {:>12}  nodes",
        "id", "nodes", "micro", "T ms", "ranks"
    );
    for p in &plan.pipelines {
        let last = p.first_rank + p.nodes.len() as u32 * plan.devices_per_node;
        let _ = writeln!(
            out,
            "{:>4} {:>5} {:>7} {:>12.3} {:>12}  {}",
            p.id,
            p.template_nodes,
            p.microbatches,
            ns_to_ms(p.predicted_ns),
            format!("{}..{}", p.first_rank, last),
            compact_ids(&p.nodes)
        );
    }
    let _ = writeln!(
        out,
        "predicted iteration: {:.3} ms = slowest pipeline {:.3} ms + gradient sync {:.3} ms",
        ns_to_ms(plan.iteration_ns),
        ns_to_ms(plan.compute_ns),
        ns_to_ms(plan.sync_ns)
    );
    out
}

/// `0-3,7,9-10`.
pub fn compact_ids(ids: &[u32]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < ids.len() {
        let mut j = i;
        while j + 1 < ids.len() && ids[j + 1] == ids[j] + 1 {
            j += 1;
        }
        parts.push(if j > i {
            format!("{}-{}", ids[i], ids[j])
        } else {
            ids[i].to_string()
        });
        i = j + 1;
    }
    parts.join(",")
}
