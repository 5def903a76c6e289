//! Which surviving device sends each layer a new holder lacks.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};

use super::holdings::{Held, Holdings};
use super::LayerCopy;
use crate::planning::Plan;

/// Copies each new holder needs, sources spread over surviving old holders by bytes assigned.
pub(super) fn plan_copies(
    new_plan: &Plan,
    old: &Holdings,
    lost: &BTreeSet<u32>,
) -> (Vec<LayerCopy>, Vec<usize>) {
    let wants = wanted(new_plan, old);
    if wants.is_empty() {
        return (Vec::new(), Vec::new());
    }
    let mut sources = Sources::new(new_plan, old, lost);
    let mut copies = Vec::new();
    let mut missing = BTreeSet::new();
    for (layer, to_rank, to_node) in wants {
        let bytes = new_plan.layer_state_bytes[layer];
        let Some((from_rank, src)) = sources.take(layer, bytes) else {
            missing.insert(layer);
            continue;
        };
        copies.push(LayerCopy {
            layer,
            from_rank,
            to_rank,
            from_node: src.0,
            to_node,
            bytes,
        });
    }
    copies.sort_by_key(|c| (c.to_rank, c.layer));
    (copies, missing.into_iter().collect())
}

/// The bytes the node of `new_plan` that lacks the most must receive.
pub(super) fn most_received(new_plan: &Plan, old: &Holdings) -> u64 {
    let mut into: std::collections::HashMap<u32, u64> = std::collections::HashMap::new();
    for (layer, _, node) in wanted(new_plan, old) {
        *into.entry(node).or_default() += new_plan.layer_state_bytes[layer];
    }
    into.into_values().max().unwrap_or(0)
}

/// Every `(layer, new rank, node)` a device of `new_plan` needs and does not hold, in plan
/// order (the order sources are assigned in).
fn wanted(new_plan: &Plan, old: &Holdings) -> Vec<(usize, u32, u32)> {
    let g = new_plan.devices_per_node;
    let mut wants = Vec::new();
    for p in &new_plan.pipelines {
        old.each_lacking(new_plan.template_of(p), &p.nodes, |s, d, l| {
            wants.push((l, p.first_rank + s.node * g + d, p.nodes[s.node as usize]));
        });
    }
    wants
}

/// The surviving holders of each layer, least loaded first: the copy source is the holder
/// with the fewest bytes assigned so far (ties: the lower new rank). Holders are the new plan's
/// devices (a spare node runs no worker, so it cannot send) that held the layer before. Per
/// layer, a cursor walks those devices in rank order for the next holder nobody has charged
/// yet (all at 0 bytes, so the next one found is the least loaded of them), and charged ones
/// wait in a heap with lazy updates (a holder's load grows with copies of other layers too; a
/// stale entry is re-queued when it surfaces). A decision with a few copies on a 10,000-node
/// plan looks at a few devices per copy, not at every holder of every layer.
/// A holder in a layer's heap: `(bytes charged when queued, new rank, (node, device))`.
type Charged = (u64, u32, (u32, u32));

struct Sources<'a> {
    g: u32,
    /// The new plan's surviving nodes in rank order: `(first rank, node, what it holds)`.
    slots: Vec<(u32, u32, &'a [Option<Held>])>,
    /// Per layer: the next device to look at, `slot * g + device`.
    cursor: Vec<usize>,
    heaps: Vec<BinaryHeap<Reverse<Charged>>>,
    /// Bytes charged so far, by new rank.
    load: Vec<u64>,
}

impl<'a> Sources<'a> {
    fn new(new_plan: &Plan, old: &'a Holdings, lost: &BTreeSet<u32>) -> Self {
        let g = new_plan.devices_per_node;
        let mut slots: Vec<(u32, u32, &[Option<Held>])> = Vec::new();
        for p in &new_plan.pipelines {
            for (j, &node) in p.nodes.iter().enumerate() {
                if !lost.contains(&node) {
                    slots.push((p.first_rank + j as u32 * g, node, old.node(node)));
                }
            }
        }
        slots.sort_unstable_by_key(|s| s.0);
        let layers = new_plan.layer_state_bytes.len();
        Sources {
            g,
            slots,
            cursor: vec![0; layers],
            heaps: vec![BinaryHeap::new(); layers],
            load: vec![0; (new_plan.num_nodes() * g) as usize],
        }
    }

    /// The first holder of `layer` at or after device position `at`, with its position.
    fn holder_from(&self, layer: usize, mut at: usize) -> Option<(usize, u32, (u32, u32))> {
        let g = self.g as usize;
        while let Some(&(first, node, held)) = self.slots.get(at / g) {
            let d = at % g;
            if held
                .get(d)
                .and_then(Option::as_ref)
                .is_some_and(|h| h.contains(layer))
            {
                return Some((at, first + d as u32, (node, d as u32)));
            }
            at += 1;
        }
        None
    }

    /// The source (new rank, device) for a copy of `layer` of `bytes`, charged to it; `None`
    /// when nobody holds the layer.
    fn take(&mut self, layer: usize, bytes: u64) -> Option<(u32, (u32, u32))> {
        let mut at = *self.cursor.get(layer)?;
        // Holders charged through other layers leave the cursor for the heap.
        let fresh = loop {
            match self.holder_from(layer, at) {
                Some((pos, r, h)) if self.load[r as usize] > 0 => {
                    let now = self.load[r as usize];
                    self.heaps[layer].push(Reverse((now, r, h)));
                    at = pos + 1;
                }
                found => break found,
            }
        };
        self.cursor[layer] = fresh.map_or(self.slots.len() * self.g as usize, |f| f.0);
        while let Some(&Reverse((queued, r, h))) = self.heaps[layer].peek() {
            let now = self.load[r as usize];
            if now == queued {
                break;
            }
            self.heaps[layer].pop();
            self.heaps[layer].push(Reverse((now, r, h)));
        }
        let fresh = fresh.map(|(pos, r, h)| (pos, (0, r, h)));
        let queued = self.heaps[layer].peek().map(|Reverse(x)| *x);
        let (now, r, h) = match (fresh, queued) {
            (Some((_, f)), Some(q)) if q < f => self.heaps[layer].pop().map(|Reverse(x)| x)?,
            (Some((pos, f)), _) => {
                self.cursor[layer] = pos + 1;
                f
            }
            (None, Some(_)) => self.heaps[layer].pop().map(|Reverse(x)| x)?,
            (None, None) => return None,
        };
        self.load[r as usize] = now + bytes;
        self.heaps[layer].push(Reverse((now + bytes, r, h)));
        Some((r, h))
    }
}
