//! A fresh instantiation over survivors and joined nodes that keeps what it can of the old
//! pipelines.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::{arrange, Groups, Holdings};
use crate::planning::compose::choose_counts_degraded;
use crate::planning::instantiate::Ctx;
use crate::planning::{Plan, PlanError, TemplateSet};

/// Template counts for `total` nodes, degraded as far as needed (see
/// [`choose_counts_degraded`]); among equally fast compositions, the one closest to `plan`'s
/// templates.
fn degrade_counts(
    set: &TemplateSet,
    ctx: &Ctx,
    total: u32,
    plan: &Plan,
) -> Result<Vec<u32>, PlanError> {
    let prefer: Vec<u32> = (set.templates.iter())
        .map(|t| {
            plan.pipelines
                .iter()
                .filter(|p| p.template_nodes == t.nodes)
                .count() as u32
        })
        .collect();
    let (global, f, sync) = (ctx.global_microbatches, ctx.fault_threshold, ctx.sync_ns);
    choose_counts_degraded(set, global, f, total, sync, &prefer)
}

/// Fresh template counts over survivors + joined nodes; existing pipelines are kept whole where
/// a pipeline of their size is wanted, then extended, then broken up for the rest. Returns the
/// groups and the spare nodes.
pub(super) fn reinstantiate(
    set: &TemplateSet,
    ctx: &Ctx,
    old: &Holdings,
    groups: Vec<(u32, Vec<u32>)>,
    joined: &BTreeSet<u32>,
    plan: &Plan,
) -> Result<(Groups, Vec<u32>), PlanError> {
    let total = groups.iter().map(|g| g.1.len()).sum::<usize>() + joined.len();
    let counts = degrade_counts(set, ctx, total as u32, plan)?;
    let mut slots: Vec<usize> = Vec::new();
    for (t, &c) in counts.iter().enumerate() {
        slots.extend(std::iter::repeat_n(
            set.templates[t].nodes as usize,
            c as usize,
        ));
    }
    slots.sort_unstable_by(|a, b| b.cmp(a));
    let mut left = Left::new(groups);
    let mut free: VecDeque<u32> = joined.iter().copied().collect();
    let mut out: Vec<(u32, Vec<u32>)> = Vec::new();
    let mut open: Vec<usize> = Vec::new();
    // Exact matches keep a pipeline untouched.
    for s in slots {
        match left.take(s..=s) {
            Some(g) => out.push(g),
            None => open.push(s),
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
        let group = left.take(..=s).or_else(|| {
            let mut g = left.take(..)?;
            free.extend(g.1.split_off(s));
            Some(g)
        });
        let (id, mut nodes) = group.unwrap_or_else(|| {
            let id = next_id;
            next_id += 1;
            (id, Vec::new())
        });
        while nodes.len() < s {
            if free.is_empty() {
                // Break the smallest remaining group into free nodes.
                let g = left
                    .smallest()
                    .expect("slot sizes sum to at most the node count");
                free.extend(g.1);
            }
            nodes.extend(free.pop_front());
        }
        out.push((id, nodes));
    }
    for g in &mut out {
        arrange(set, old, &mut g.1);
    }
    let mut spare: Vec<u32> = free.into_iter().chain(left.into_nodes()).collect();
    spare.sort_unstable();
    Ok((out, spare))
}

/// A pipeline as `(id, nodes)`.
type Group = (u32, Vec<u32>);

/// The groups not placed yet, by size; within a size in id order. Taking one is `O(log)`, not
/// a scan and shift of a list of every pipeline (2,500 of them at 10,000 nodes).
struct Left {
    by_len: BTreeMap<usize, VecDeque<Group>>,
}

impl Left {
    fn new(mut groups: Groups) -> Self {
        groups.sort_by_key(|g| g.0);
        let mut by_len: BTreeMap<usize, VecDeque<Group>> = BTreeMap::new();
        for g in groups {
            by_len.entry(g.1.len()).or_default().push_back(g);
        }
        Left { by_len }
    }

    /// The largest group whose size is in `sizes` (lowest id among equals).
    fn take(&mut self, sizes: impl std::ops::RangeBounds<usize>) -> Option<Group> {
        let (&len, _) = self.by_len.range(sizes).next_back()?;
        self.pop(len, VecDeque::pop_front)
    }

    /// The smallest group (highest id among equals).
    fn smallest(&mut self) -> Option<Group> {
        let (&len, _) = self.by_len.iter().next()?;
        self.pop(len, VecDeque::pop_back)
    }

    fn pop(&mut self, len: usize, end: fn(&mut VecDeque<Group>) -> Option<Group>) -> Option<Group> {
        let bucket = self.by_len.get_mut(&len)?;
        let g = end(bucket);
        if bucket.is_empty() {
            self.by_len.remove(&len);
        }
        g
    }

    fn into_nodes(self) -> impl Iterator<Item = u32> {
        self.by_len.into_values().flatten().flat_map(|g| g.1)
    }
}
