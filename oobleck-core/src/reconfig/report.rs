//! A reconfiguration decision as a human-readable table (pure: returns a `String`; `oobleck
//! plan --fail` prints it, golden tests compare it).

use std::fmt::Write;

use super::ReconfigPlan;
use crate::planning::report::{gib, plan_table};

/// A reconfiguration decision.
pub fn reconfig_table(r: &ReconfigPlan) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "lost {:?}, joined {:?}", r.lost, r.joined);
    for a in &r.actions {
        let _ = writeln!(out, "  {}", serde_json::to_string(a).unwrap_or_default());
    }
    out.push_str(&plan_table(&r.plan));
    let _ = writeln!(
        out,
        "layer copies: {} ({:.2} GiB); fault tolerance left: {}",
        r.copies.len(),
        gib(r.copy_bytes()),
        r.fault_tolerance
    );
    if !r.spare_nodes.is_empty() {
        let _ = writeln!(
            out,
            "spare nodes (no template combination covers them): {:?}",
            r.spare_nodes
        );
    }
    if !r.missing_layers.is_empty() {
        let _ = writeln!(
            out,
            "layers without a surviving replica (restore from checkpoint): {:?}",
            r.missing_layers
        );
    }
    out
}
