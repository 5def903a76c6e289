//! Nodes that leave on notice ("drain") are still up while the cluster reconfigures, so
//! layers that only they hold can be copied off them before they go: they take part in the
//! next generation's data plane as **donors**, ranks after the plan's own that hold layers,
//! send them, and run no stage.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::{decide_with, Holdings, LayerCopy, ReconfigPlan};
use crate::planning::{Plan, PlanError};

/// A device of a leaving node that sends layers nobody else holds. Its rank follows the new
/// plan's ranks (`world`, `world + 1`, ... in `(node, device)` order).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Donor {
    pub node: u32,
    pub device: u32,
    pub rank: u32,
}

/// [`decide_with`] after losing `lost` (failed: they hold nothing) and `leaving` (drained:
/// still up, holding what `old` says), gaining `joined`. Layers only the leaving nodes hold
/// are copied off them ([`ReconfigPlan::donors`]); the rest comes from the nodes that stay.
pub fn decide_leaving(
    plan: &Plan,
    old: &Holdings,
    lost: &[u32],
    leaving: &[u32],
    joined: &[u32],
) -> Result<ReconfigPlan, PlanError> {
    let mut staying = old.clone();
    for &n in leaving {
        staying.drop_node(n);
    }
    let gone: Vec<u32> = lost.iter().chain(leaving).copied().collect();
    let mut r = decide_with(plan, &staying, &gone, joined)?;
    if !r.missing_layers.is_empty() {
        copy_off(&mut r, old, leaving);
    }
    Ok(r)
}

/// Adds copies of `r.missing_layers` from the devices of `leaving` that hold them (in `old`),
/// spread by bytes; those devices become donors. Layers no leaving device holds stay missing.
fn copy_off(r: &mut ReconfigPlan, old: &Holdings, leaving: &[u32]) {
    let plan = &r.plan;
    let g = plan.devices_per_node;
    let world: u32 = plan
        .pipelines
        .iter()
        .map(|p| p.nodes.len() as u32 * g)
        .sum();
    let leaving: BTreeSet<u32> = leaving.iter().copied().collect();
    let mut holders: BTreeMap<usize, Vec<(u32, u32)>> = BTreeMap::new();
    for ((node, d), layers) in old.devices() {
        if leaving.contains(&node) {
            for l in layers.iter() {
                holders.entry(l).or_default().push((node, d));
            }
        }
    }
    let missing: BTreeSet<usize> = r.missing_layers.iter().copied().collect();
    let mut load: BTreeMap<(u32, u32), u64> = BTreeMap::new();
    let mut wanted: Vec<(usize, (u32, u32), u32, u32)> = Vec::new();
    for p in &plan.pipelines {
        let t = plan.template_of(p);
        for s in &t.stages {
            let node = p.nodes[s.node as usize];
            for d in s.first_device..s.first_device + s.devices {
                let rank = p.first_rank + s.node * g + d;
                for l in s.layers().filter(|l| missing.contains(l)) {
                    let Some(src) = holders.get(&l).and_then(|h| {
                        h.iter()
                            .min_by_key(|h| (load.get(h).copied().unwrap_or(0), **h))
                            .copied()
                    }) else {
                        continue;
                    };
                    *load.entry(src).or_insert(0) += plan.layer_state_bytes[l];
                    wanted.push((l, src, rank, node));
                }
            }
        }
    }
    let donors: Vec<(u32, u32)> = load.keys().copied().collect();
    let rank_of =
        |src: (u32, u32)| world + donors.iter().position(|&d| d == src).unwrap_or(0) as u32;
    let covered: BTreeSet<usize> = wanted.iter().map(|w| w.0).collect();
    for (layer, src, to_rank, to_node) in wanted {
        r.copies.push(LayerCopy {
            layer,
            from_rank: rank_of(src),
            to_rank,
            from_node: src.0,
            to_node,
            bytes: plan.layer_state_bytes[layer],
        });
    }
    r.copies.sort_by_key(|c| (c.to_rank, c.layer));
    r.missing_layers.retain(|l| !covered.contains(l));
    r.donors = donors
        .iter()
        .map(|&(node, device)| Donor {
            node,
            device,
            rank: rank_of((node, device)),
        })
        .collect();
}
