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
    let g = new_plan.devices_per_node;
    let wants = wanted(new_plan, old);
    let mut needed = vec![false; new_plan.layer_state_bytes.len()];
    for w in &wants {
        needed[w.0] = true;
    }
    // Surviving old holders of the layers someone needs that are ranks of the new plan (a
    // spare node runs no worker, so it cannot send), in new-rank order.
    let mut holders: Vec<Vec<(u32, (u32, u32))>> = vec![Vec::new(); needed.len()];
    for p in &new_plan.pipelines {
        for (j, &node) in p.nodes.iter().enumerate() {
            if lost.contains(&node) {
                continue;
            }
            let first = p.first_rank + j as u32 * g;
            for (d, held) in old.node(node).iter().enumerate().take(g as usize) {
                for l in held.iter().flat_map(Held::iter) {
                    if needed.get(l) == Some(&true) {
                        holders[l].push((first + d as u32, (node, d as u32)));
                    }
                }
            }
        }
    }
    let mut sources = Sources::new(holders, new_plan.num_nodes() * g);
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
/// with the fewest bytes assigned so far (ties: the lower new rank). Per layer, the holders
/// nobody has charged yet are taken in rank order from a cursor (all at 0 bytes, so the next
/// one is the least loaded of them), and charged ones wait in a heap with lazy updates (a
/// holder's load grows with copies of other layers too; a stale entry is re-queued when it
/// surfaces). A decision with a few copies on a 10,000-node plan touches a few holders, not
/// every one of them for each copy.
/// A holder in a layer's heap: `(bytes charged when queued, new rank, (node, device))`.
type Charged = (u64, u32, (u32, u32));

struct Sources {
    /// Per layer: `(new rank, (node, device))` of each holder, in rank order.
    holders: Vec<Vec<(u32, (u32, u32))>>,
    cursor: Vec<usize>,
    heaps: Vec<BinaryHeap<Reverse<Charged>>>,
    /// Bytes charged so far, by new rank.
    load: Vec<u64>,
}

impl Sources {
    fn new(holders: Vec<Vec<(u32, (u32, u32))>>, world: u32) -> Self {
        Sources {
            cursor: vec![0; holders.len()],
            heaps: vec![BinaryHeap::new(); holders.len()],
            holders,
            load: vec![0; world as usize],
        }
    }

    /// The source (new rank, device) for a copy of `layer` of `bytes`, charged to it; `None`
    /// when nobody holds the layer.
    fn take(&mut self, layer: usize, bytes: u64) -> Option<(u32, (u32, u32))> {
        let list = self.holders.get(layer)?;
        let mut at = self.cursor[layer];
        // Holders charged through other layers leave the cursor for the heap.
        while let Some(&(r, h)) = list.get(at).filter(|&&(r, _)| self.load[r as usize] > 0) {
            let now = self.load[r as usize];
            self.heaps[layer].push(Reverse((now, r, h)));
            at += 1;
        }
        self.cursor[layer] = at;
        while let Some(&Reverse((queued, r, h))) = self.heaps[layer].peek() {
            let now = self.load[r as usize];
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
        self.load[r as usize] = now + bytes;
        self.heaps[layer].push(Reverse((now + bytes, r, h)));
        Some((r, h))
    }
}
