//! Reconfiguration decisions: given the current [`Plan`] and the nodes that were lost and/or
//! joined, what the cluster becomes. Pure; see `README.md` beside this file for the rules.
//!
//! The result is a [`ReconfigPlan`]: the next-generation plan (same `B`), the layer copies the
//! runtime must perform, the layers nobody holds any more (the runtime then restores them from
//! a checkpoint), and the fault tolerance left.

mod copies;
mod fresh;
mod holdings;
mod leave;
pub mod report;

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

pub use holdings::Holdings;
pub use leave::{decide_leaving, Donor};

use copies::plan_copies;
use fresh::reinstantiate;

use crate::planning::instantiate::{assemble, Ctx};
use crate::planning::{Plan, PlanError, TemplateSet};

/// Copy one layer's training state (parameters + optimizer state) between two devices.
/// Ranks are of the **new** generation; the source still holds the layer from its old role
/// and must keep it until the copy is done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerCopy {
    pub layer: usize,
    pub from_rank: u32,
    pub to_rank: u32,
    pub from_node: u32,
    pub to_node: u32,
    /// Bytes moved.
    pub bytes: u64,
}

/// What happened to a pipeline, for logs and reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Action {
    /// Lost nodes; still fits a (smaller) template.
    Shrink {
        pipeline: u32,
        from_nodes: u32,
        to_nodes: u32,
    },
    /// Took `node` from the largest pipeline that could spare it.
    Borrow {
        pipeline: u32,
        donor: u32,
        node: u32,
    },
    /// `absorbed` joined `into` because no donor could spare a node.
    Merge { into: u32, absorbed: u32 },
    /// Gone entirely (all its nodes were lost).
    Vanish { pipeline: u32 },
    /// A fresh instantiation over all nodes (joins, or when shrink/borrow/merge cannot keep
    /// `min(f + 1, possible)` pipelines on valid templates).
    Reinstantiate { nodes: u32 },
}

/// The decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReconfigPlan {
    /// The next-generation plan.
    pub plan: Plan,
    /// Layer copies, sorted by (to_rank, layer).
    pub copies: Vec<LayerCopy>,
    /// Layers without any surviving holder: restore from a checkpoint.
    pub missing_layers: Vec<usize>,
    /// Simultaneous node losses the new plan survives (`pipelines - 1`).
    pub fault_tolerance: u32,
    /// Surviving nodes left idle because no combination of templates covers them all (only
    /// below `(f + 1) * n0` nodes); they can be re-admitted by a later join.
    pub spare_nodes: Vec<u32>,
    pub actions: Vec<Action>,
    pub lost: Vec<u32>,
    pub joined: Vec<u32>,
    /// Devices of drained nodes that send the layers only they hold ([`decide_leaving`]):
    /// they join the next generation's data plane for its copies, then go.
    #[serde(default)]
    pub donors: Vec<Donor>,
}

impl ReconfigPlan {
    /// Total bytes the copies move.
    pub fn copy_bytes(&self) -> u64 {
        self.copies.iter().map(|c| c.bytes).sum()
    }
}

/// Bytes a pipeline of template `tpl_nodes` on `nodes` would have to receive.
fn moved_bytes(set: &TemplateSet, old: &Holdings, tpl_nodes: u32, nodes: &[u32]) -> u64 {
    let Some(t) = set.get(tpl_nodes) else {
        return u64::MAX;
    };
    let mut total = 0u64;
    old.each_lacking(t, nodes, |_, _, l| {
        total += set.layer_state_bytes.get(l).copied().unwrap_or(0);
    });
    total
}

/// Orders a pipeline's nodes to keep the most state in place: of (the given order, nodes
/// sorted by the first layer they hold, nodes sorted by id) the one that moves the fewest bytes
/// (ties: that order). Returns the bytes moved.
pub(super) fn arrange(set: &TemplateSet, old: &Holdings, nodes: &mut Vec<u32>) -> u64 {
    let given = moved_bytes(set, old, nodes.len() as u32, nodes);
    if given == 0 {
        // Nothing moves (an untouched pipeline): no order can do better, and ties keep this.
        return 0;
    }
    let mut by_layer = nodes.clone();
    by_layer.sort_by_key(|&n| (old.first_layer(n), n));
    let mut by_id = nodes.clone();
    by_id.sort_unstable();
    let mut best = (given, nodes.clone());
    for cand in [by_layer, by_id] {
        let m = moved_bytes(set, old, cand.len() as u32, &cand);
        if m < best.0 {
            best = (m, cand);
        }
    }
    *nodes = best.1;
    best.0
}

/// Decides the reconfiguration after losing `lost` and gaining `joined` nodes, every device
/// holding its stage of `plan`.
pub fn decide(plan: &Plan, lost: &[u32], joined: &[u32]) -> Result<ReconfigPlan, PlanError> {
    decide_with(plan, &Holdings::of(plan), lost, joined)
}

/// [`decide`] where the devices hold `old` (the runtime's record) instead of their stages of
/// `plan`: the node order and the copies follow what is really held.
pub fn decide_with(
    plan: &Plan,
    old: &Holdings,
    lost: &[u32],
    joined: &[u32],
) -> Result<ReconfigPlan, PlanError> {
    let mut r = layout(plan, old, lost, joined)?;
    let lost: BTreeSet<u32> = r.lost.iter().copied().collect();
    (r.copies, r.missing_layers) = plan_copies(&r.plan, old, &lost);
    Ok(r)
}

/// [`decide_with`] for joins alone when only the size of the copies matters (the simulator):
/// the same new plan, with `copies` left empty (no source is chosen for any of them), and the
/// bytes the node that receives the most must receive. After joins alone every layer still
/// has its holders, so nothing can be missing.
pub fn decide_joins(
    plan: &Plan,
    old: &Holdings,
    joined: &[u32],
) -> Result<(ReconfigPlan, u64), PlanError> {
    let r = layout(plan, old, &[], joined)?;
    let most = copies::most_received(&r.plan, old);
    Ok((r, most))
}

/// The new plan of a decision: pipelines, batch split, spares and actions; no copies yet.
fn layout(
    plan: &Plan,
    old: &Holdings,
    lost: &[u32],
    joined: &[u32],
) -> Result<ReconfigPlan, PlanError> {
    let current: BTreeSet<u32> = plan.nodes().into_iter().collect();
    let lost: BTreeSet<u32> = lost.iter().copied().collect();
    let joined: BTreeSet<u32> = joined.iter().copied().collect();
    if let Some(&node) = lost.iter().find(|n| !current.contains(n)) {
        return Err(PlanError::UnknownNode { node });
    }
    if let Some(&node) = joined
        .iter()
        .find(|n| current.contains(n) || lost.contains(n))
    {
        return Err(PlanError::DuplicateNode { node });
    }
    let set = plan.template_set();
    let ctx = Ctx::of(plan);
    let n_min = set.templates.first().map_or(1, |t| t.nodes) as usize;
    let mut actions = Vec::new();

    // Survivors of each pipeline, identities kept.
    let mut groups: Vec<(u32, Vec<u32>)> = Vec::new();
    for p in &plan.pipelines {
        let nodes: Vec<u32> = p
            .nodes
            .iter()
            .copied()
            .filter(|n| !lost.contains(n))
            .collect();
        if nodes.is_empty() {
            actions.push(Action::Vanish { pipeline: p.id });
        } else {
            if nodes.len() < p.nodes.len() {
                actions.push(Action::Shrink {
                    pipeline: p.id,
                    from_nodes: p.nodes.len() as u32,
                    to_nodes: nodes.len() as u32,
                });
            }
            groups.push((p.id, nodes));
        }
    }
    let survivors: usize = groups.iter().map(|g| g.1.len()).sum();
    let total = survivors + joined.len();
    let want = (plan.fault_threshold as usize + 1)
        .min(total / n_min.max(1))
        .max(1);

    let incremental = if joined.is_empty() {
        shrink_borrow_merge(&set, old, groups.clone(), n_min, &mut actions)
    } else {
        None
    };
    let (groups, spare_nodes) = match incremental {
        Some(g) if g.len() >= want => (g, Vec::new()),
        _ => {
            actions.push(Action::Reinstantiate {
                nodes: total as u32,
            });
            reinstantiate(&set, &ctx, old, groups, &joined, plan)?
        }
    };
    let mut groups = groups;
    groups.sort_by_key(|g| g.0);
    let ids: Vec<u32> = groups.iter().map(|g| g.0).collect();
    let with_tpl: Vec<(usize, Vec<u32>)> = groups
        .into_iter()
        .map(|(_, nodes)| {
            let t = set
                .templates
                .iter()
                .position(|t| t.nodes as usize == nodes.len())
                .expect("every group was sized to an existing template");
            (t, nodes)
        })
        .collect();
    let new_plan = assemble(&set, &ctx, with_tpl, &ids, plan.generation + 1)?;
    Ok(ReconfigPlan {
        fault_tolerance: new_plan.pipelines.len() as u32 - 1,
        spare_nodes,
        plan: new_plan,
        copies: Vec::new(),
        missing_layers: Vec::new(),
        actions,
        lost: lost.into_iter().collect(),
        joined: joined.into_iter().collect(),
        donors: Vec::new(),
    })
}

/// Shrink, borrow, merge. `None` when some group ends without a template.
fn shrink_borrow_merge(
    set: &TemplateSet,
    old: &Holdings,
    mut groups: Vec<(u32, Vec<u32>)>,
    n_min: usize,
    actions: &mut Vec<Action>,
) -> Option<Vec<(u32, Vec<u32>)>> {
    // Borrow: each short pipeline (in id order) takes the last node of the largest pipeline
    // that stays at or above n0 after giving it (ties: the later pipeline).
    for i in 0..groups.len() {
        while groups[i].1.len() < n_min {
            let donor = match (0..groups.len())
                .filter(|&j| j != i && groups[j].1.len() > n_min)
                .max_by_key(|&j| (groups[j].1.len(), j))
            {
                Some(d) => d,
                None => break,
            };
            let node = groups[donor].1.pop().expect("donor has > n0 nodes");
            actions.push(Action::Borrow {
                pipeline: groups[i].0,
                donor: groups[donor].0,
                node,
            });
            groups[i].1.push(node);
        }
    }
    // Merge: the smallest short group joins the partner (another short group first, else a
    // full one) for which merging adds the least state to move (bytes of the merged pipeline
    // minus what the partner would move on its own); ties: the smaller, then lower id.
    while let Some(i) = (0..groups.len())
        .filter(|&j| groups[j].1.len() < n_min)
        .min_by_key(|&j| (groups[j].1.len(), groups[j].0))
    {
        let short_exists = (0..groups.len()).any(|j| j != i && groups[j].1.len() < n_min);
        let partner = (0..groups.len())
            .filter(|&j| j != i && (!short_exists || groups[j].1.len() < n_min))
            .filter(|&j| {
                set.get((groups[i].1.len() + groups[j].1.len()) as u32)
                    .is_some()
            })
            .min_by_key(|&j| {
                let mut nodes: Vec<u32> = groups[j].1.iter().chain(&groups[i].1).copied().collect();
                let merged = arrange(set, old, &mut nodes);
                let mut alone = groups[j].1.clone();
                let alone = if groups[j].1.len() >= n_min {
                    arrange(set, old, &mut alone)
                } else {
                    0
                };
                (
                    merged as i128 - alone as i128,
                    groups[j].1.len(),
                    groups[j].0,
                )
            })?;
        let absorbed = groups.remove(i);
        let j = if partner > i { partner - 1 } else { partner };
        actions.push(Action::Merge {
            into: groups[j].0,
            absorbed: absorbed.0,
        });
        groups[j].1.extend(absorbed.1);
    }
    for g in &mut groups {
        set.get(g.1.len() as u32)?;
        arrange(set, old, &mut g.1);
    }
    Some(groups)
}

/// Pipelines as `(id, nodes)`.
type Groups = Vec<(u32, Vec<u32>)>;
