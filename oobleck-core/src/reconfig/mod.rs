//! Reconfiguration decisions: given the current [`Plan`] and the nodes that were lost and/or
//! joined, what the cluster becomes. Pure; see `README.md` beside this file for the rules.
//!
//! The result is a [`ReconfigPlan`]: the next-generation plan (same `B`), the layer copies the
//! runtime must perform, the layers nobody holds any more (the runtime then restores them from
//! a checkpoint), and the fault tolerance left.

mod leave;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

use serde::{Deserialize, Serialize};

pub use leave::{decide_leaving, Donor};

use crate::planning::compose::choose_counts;
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

/// Which layers each `(node, device)` holds at the committed step. [`Holdings::of`] a plan
/// is what its devices hold while it runs; the runtime passes its own record when that differs
/// (a worker that died on a surviving node holds nothing, a reconfiguration that failed during
/// its copies leaves the devices with what they held before it).
///
/// Kept per node, and a device's layers as a range when they are contiguous (a stage's always
/// are), so a 10,000-node plan's holdings take one entry per node and no set per device.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Holdings {
    g: u32,
    /// node -> per device: the layers held, `None` for nothing. No node maps to all `None`.
    by_node: BTreeMap<u32, Vec<Option<Held>>>,
}

/// The layers one device holds: contiguous `[start, end)`, or any other non-empty set. A set
/// that is contiguous is always a range, so equal holdings compare equal.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Held {
    Range(usize, usize),
    Set(BTreeSet<usize>),
}

impl Held {
    fn of(layers: BTreeSet<usize>) -> Option<Held> {
        let (first, last) = (*layers.first()?, *layers.last()?);
        if last - first + 1 == layers.len() {
            Some(Held::Range(first, last + 1))
        } else {
            Some(Held::Set(layers))
        }
    }

    fn contains(&self, layer: usize) -> bool {
        match self {
            Held::Range(a, b) => (*a..*b).contains(&layer),
            Held::Set(s) => s.contains(&layer),
        }
    }

    fn first(&self) -> usize {
        match self {
            Held::Range(a, _) => *a,
            Held::Set(s) => *s.first().expect("a held set is not empty"),
        }
    }

    fn iter(&self) -> Box<dyn Iterator<Item = usize> + '_> {
        match self {
            Held::Range(a, b) => Box::new(*a..*b),
            Held::Set(s) => Box::new(s.iter().copied()),
        }
    }
}

impl Holdings {
    /// What every device of `plan` holds while the plan runs: its stage's layers.
    pub fn of(plan: &Plan) -> Self {
        let mut h = Holdings::empty(plan.devices_per_node);
        let g = plan.devices_per_node as usize;
        for p in &plan.pipelines {
            let t = plan.template_of(p);
            for (j, &node) in p.nodes.iter().enumerate() {
                let mut devices = vec![None; g];
                for s in t.stages.iter().filter(|s| s.node as usize == j) {
                    for d in s.first_device..s.first_device + s.devices {
                        let slot = d as usize;
                        if slot >= devices.len() {
                            devices.resize(slot + 1, None);
                        }
                        devices[slot] = Some(Held::Range(s.layer_start, s.layer_end))
                            .filter(|_| s.layer_start < s.layer_end);
                    }
                }
                h.by_node.insert(node, devices);
            }
        }
        h.by_node.retain(|_, d| d.iter().any(Option::is_some));
        h
    }

    /// Nothing held yet, `devices_per_node` devices per node.
    pub fn empty(devices_per_node: u32) -> Self {
        Holdings {
            g: devices_per_node,
            by_node: BTreeMap::new(),
        }
    }

    /// `(node, device)` holds exactly `layers` (none: it holds nothing).
    pub fn set(&mut self, node: u32, device: u32, layers: BTreeSet<usize>) {
        let held = Held::of(layers);
        let slot = device as usize;
        let devices = self.by_node.entry(node).or_default();
        if slot >= devices.len() {
            devices.resize((self.g as usize).max(slot + 1), None);
        }
        devices[slot] = held;
        if devices.iter().all(Option::is_none) {
            self.by_node.remove(&node);
        }
    }

    /// What `(node, device)` holds.
    pub fn layers(&self, node: u32, device: u32) -> Option<BTreeSet<usize>> {
        self.held(node, device).map(|h| h.iter().collect())
    }

    /// Forgets everything `node` held (it is lost).
    pub fn drop_node(&mut self, node: u32) {
        self.by_node.remove(&node);
    }

    /// The layers no device holds, of `0..num_layers`.
    pub fn missing(&self, num_layers: usize) -> Vec<usize> {
        let mut held = vec![false; num_layers];
        for (_, h) in self.devices() {
            for l in h.iter().filter(|&l| l < num_layers) {
                held[l] = true;
            }
        }
        (0..num_layers).filter(|&l| !held[l]).collect()
    }

    /// Every device that holds something, in `(node, device)` order.
    fn devices(&self) -> impl Iterator<Item = ((u32, u32), &Held)> {
        self.by_node.iter().flat_map(|(&node, devices)| {
            devices
                .iter()
                .enumerate()
                .filter_map(move |(d, h)| h.as_ref().map(|h| ((node, d as u32), h)))
        })
    }

    fn held(&self, node: u32, device: u32) -> Option<&Held> {
        self.by_node.get(&node)?.get(device as usize)?.as_ref()
    }

    /// What each device of `node` holds (one lookup for all of them).
    fn node(&self, node: u32) -> &[Option<Held>] {
        self.by_node.get(&node).map_or(&[], Vec::as_slice)
    }

    fn first_layer(&self, node: u32) -> usize {
        self.by_node
            .get(&node)
            .into_iter()
            .flatten()
            .flatten()
            .map(Held::first)
            .min()
            .unwrap_or(usize::MAX)
    }
}

/// Bytes a pipeline of template `tpl_nodes` on `nodes` would have to receive.
fn moved_bytes(set: &TemplateSet, old: &Holdings, tpl_nodes: u32, nodes: &[u32]) -> u64 {
    let Some(t) = set.get(tpl_nodes) else {
        return u64::MAX;
    };
    let mut total = 0u64;
    let mut at = (u32::MAX, &[][..]);
    for s in &t.stages {
        if at.0 != s.node {
            at = (s.node, old.node(nodes[s.node as usize]));
        }
        for d in s.first_device..s.first_device + s.devices {
            let held = at.1.get(d as usize).and_then(Option::as_ref);
            for l in s.layers().filter(|&l| !held.is_some_and(|h| h.contains(l))) {
                total += set.layer_state_bytes.get(l).copied().unwrap_or(0);
            }
        }
    }
    total
}

/// Orders a pipeline's nodes to keep the most state in place: of (the given order, nodes
/// sorted by the first layer they hold, nodes sorted by id) the one that moves the fewest bytes
/// (ties: that order). Returns the bytes moved.
fn arrange(set: &TemplateSet, old: &Holdings, nodes: &mut Vec<u32>) -> u64 {
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
    let (copies, missing_layers) = plan_copies(&new_plan, old, &lost);
    Ok(ReconfigPlan {
        fault_tolerance: new_plan.pipelines.len() as u32 - 1,
        spare_nodes,
        plan: new_plan,
        copies,
        missing_layers,
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

/// Template counts for `total` nodes: with `f + 1` pipelines if possible, else with as many
/// pipelines as the nodes allow, and only then with fewer nodes (the rest spare).
fn degrade_counts(set: &TemplateSet, ctx: &Ctx, total: u32) -> Result<Vec<u32>, PlanError> {
    let n_min = set.templates.first().map_or(1, |t| t.nodes);
    let mut first_err = None;
    for f in (0..=ctx.fault_threshold).rev() {
        for used in (n_min..=total).rev() {
            match choose_counts(set, ctx.global_microbatches, f, used, ctx.sync_ns) {
                Ok(c) => return Ok(c),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
    }
    Err(first_err.unwrap_or(PlanError::Infeasible {
        nodes: total,
        min_nodes: n_min,
    }))
}

/// Fresh template counts over survivors + joined nodes; existing pipelines are kept whole where
/// a pipeline of their size is wanted, then extended, then broken up for the rest. Returns the
/// groups and the spare nodes.
/// Pipelines as `(id, nodes)`.
type Groups = Vec<(u32, Vec<u32>)>;

fn reinstantiate(
    set: &TemplateSet,
    ctx: &Ctx,
    old: &Holdings,
    groups: Vec<(u32, Vec<u32>)>,
    joined: &BTreeSet<u32>,
    plan: &Plan,
) -> Result<(Groups, Vec<u32>), PlanError> {
    let total = groups.iter().map(|g| g.1.len()).sum::<usize>() + joined.len();
    let counts = degrade_counts(set, ctx, total as u32)?;
    let mut slots: Vec<usize> = Vec::new();
    for (t, &c) in counts.iter().enumerate() {
        slots.extend(std::iter::repeat_n(
            set.templates[t].nodes as usize,
            c as usize,
        ));
    }
    slots.sort_unstable_by(|a, b| b.cmp(a));
    let mut left: Vec<(u32, Vec<u32>)> = groups;
    left.sort_by_key(|g| (std::cmp::Reverse(g.1.len()), g.0));
    let mut free: Vec<u32> = joined.iter().copied().collect();
    let mut out: Vec<(u32, Vec<u32>)> = Vec::new();
    let mut open: Vec<usize> = Vec::new();
    // Exact matches keep a pipeline untouched.
    for s in slots {
        if let Some(k) = left.iter().position(|g| g.1.len() == s) {
            out.push(left.remove(k));
        } else {
            open.push(s);
        }
    }
    let mut next_id = plan
        .pipelines
        .iter()
        .map(|p| p.id)
        .max()
        .map_or(0, |m| m + 1);
    for s in open {
        // The largest remaining group that fits, padded; else the prefix of the largest.
        let group = if let Some(k) = left.iter().position(|g| g.1.len() <= s) {
            Some(left.remove(k))
        } else if !left.is_empty() {
            let mut g = left.remove(0);
            free.extend(g.1.split_off(s));
            Some(g)
        } else {
            None
        };
        let (id, mut nodes) = group.unwrap_or_else(|| {
            let id = next_id;
            next_id += 1;
            (id, Vec::new())
        });
        while nodes.len() < s {
            if free.is_empty() {
                // Break the smallest remaining group into free nodes.
                let g = left
                    .pop()
                    .expect("slot sizes sum to at most the node count");
                free.extend(g.1);
            }
            nodes.push(free.remove(0));
        }
        out.push((id, nodes));
    }
    for g in &mut out {
        arrange(set, old, &mut g.1);
    }
    let mut spare: Vec<u32> = free
        .into_iter()
        .chain(left.into_iter().flat_map(|g| g.1))
        .collect();
    spare.sort_unstable();
    Ok((out, spare))
}

/// Copies each new holder needs, sources spread over surviving old holders by bytes assigned.
fn plan_copies(
    new_plan: &Plan,
    old: &Holdings,
    lost: &BTreeSet<u32>,
) -> (Vec<LayerCopy>, Vec<usize>) {
    let g = new_plan.devices_per_node;
    let num_layers = new_plan.layer_state_bytes.len();
    // Surviving old holders per layer that are ranks of the new plan (a spare node runs no
    // worker, so it cannot send), in new-rank order.
    let mut holders: Vec<Vec<(u32, (u32, u32))>> = vec![Vec::new(); num_layers];
    for p in &new_plan.pipelines {
        for (j, &node) in p.nodes.iter().enumerate() {
            if lost.contains(&node) {
                continue;
            }
            let first = p.first_rank + j as u32 * g;
            for (d, held) in old.node(node).iter().enumerate().take(g as usize) {
                for l in held.iter().flat_map(Held::iter) {
                    if let Some(h) = holders.get_mut(l) {
                        h.push((first + d as u32, (node, d as u32)));
                    }
                }
            }
        }
    }
    let mut sources = Sources::new(holders);
    let mut copies = Vec::new();
    let mut missing = BTreeSet::new();
    for p in &new_plan.pipelines {
        let t = new_plan.template_of(p);
        let mut at = (u32::MAX, &[][..]);
        for s in &t.stages {
            let node = p.nodes[s.node as usize];
            if at.0 != s.node {
                at = (s.node, old.node(node));
            }
            for d in s.first_device..s.first_device + s.devices {
                let held = at.1.get(d as usize).and_then(Option::as_ref);
                for l in s.layers().filter(|&l| !held.is_some_and(|h| h.contains(l))) {
                    let bytes = new_plan.layer_state_bytes[l];
                    let Some((from_rank, src)) = sources.take(l, bytes) else {
                        missing.insert(l);
                        continue;
                    };
                    copies.push(LayerCopy {
                        layer: l,
                        from_rank,
                        to_rank: p.first_rank + s.node * g + d,
                        from_node: src.0,
                        to_node: node,
                        bytes,
                    });
                }
            }
        }
    }
    copies.sort_by_key(|c| (c.to_rank, c.layer));
    (copies, missing.into_iter().collect())
}

/// The surviving holders of each layer, least loaded first: the copy source is the holder
/// with the fewest bytes assigned so far (ties: the lower new rank). Per layer, the holders
/// nobody has charged yet are taken in rank order from a cursor (all at 0 bytes, so the next
/// one is the least loaded of them), and charged ones wait in a heap with lazy updates (a
/// holder's load grows with copies of other layers too; a stale entry is re-queued when it
/// surfaces). A decision with a few copies on a 10,000-node plan touches a few holders, not
/// every one of them for each copy.
struct Sources {
    /// Per layer: `(new rank, (node, device))` of each holder, in rank order.
    holders: Vec<Vec<(u32, (u32, u32))>>,
    cursor: Vec<usize>,
    heaps: Vec<BinaryHeap<Reverse<(u64, u32, (u32, u32))>>>,
    load: BTreeMap<(u32, u32), u64>,
}

impl Sources {
    fn new(holders: Vec<Vec<(u32, (u32, u32))>>) -> Self {
        Sources {
            cursor: vec![0; holders.len()],
            heaps: vec![BinaryHeap::new(); holders.len()],
            holders,
            load: BTreeMap::new(),
        }
    }

    fn load_of(&self, h: (u32, u32)) -> u64 {
        self.load.get(&h).copied().unwrap_or(0)
    }

    /// The source (new rank, device) for a copy of `layer` of `bytes`, charged to it; `None`
    /// when nobody holds the layer.
    fn take(&mut self, layer: usize, bytes: u64) -> Option<(u32, (u32, u32))> {
        let list = self.holders.get(layer)?;
        let mut at = self.cursor[layer];
        // Holders charged through other layers leave the cursor for the heap.
        while let Some(&(r, h)) = list.get(at).filter(|&&(_, h)| self.load_of(h) > 0) {
            let now = self.load_of(h);
            self.heaps[layer].push(Reverse((now, r, h)));
            at += 1;
        }
        self.cursor[layer] = at;
        while let Some(&Reverse((queued, r, h))) = self.heaps[layer].peek() {
            let now = self.load_of(h);
            if now == queued {
                break;
            }
            self.heaps[layer].pop();
            self.heaps[layer].push(Reverse((now, r, h)));
        }
        let fresh = list.get(at).map(|&(r, h)| (0, r, h));
        let queued = self.heaps[layer].peek().map(|Reverse(x)| *x);
        let (now, r, h) = match (fresh, queued) {
            (Some(f), Some(q)) if q < f => self.heaps[layer].pop().map(|Reverse(x)| x)?,
            (Some(f), _) => {
                self.cursor[layer] += 1;
                f
            }
            (None, Some(_)) => self.heaps[layer].pop().map(|Reverse(x)| x)?,
            (None, None) => return None,
        };
        self.load.insert(h, now + bytes);
        self.heaps[layer].push(Reverse((now + bytes, r, h)));
        Some((r, h))
    }
}
