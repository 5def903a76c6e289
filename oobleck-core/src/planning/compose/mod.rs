//! Template counts: how many pipelines of each template cover `N` nodes and take `B`
//! microbatches in the least time. The objective is in [`super::instantiate`]'s module docs.
//!
//! # Exact search without enumerating multisets
//! For a makespan budget `tau`, a pipeline of template `t` can take
//! `cap_t(tau) = floor((tau - alpha_t) / w*_t)` microbatches (clipped at `B`), and at least one.
//! A multiset of templates (a *composition*) with `P` pipelines can take exactly the totals
//! `[P, sum cap]`: every microbatch count between its pipelines' minimum of one each and their
//! capacities. A budget is feasible iff some composition with `sum n_t = N`, every `cap >= 1`
//! and the pipeline-count class (one pipeline, or at least `max(f + 1, 2)`) has `B` in that
//! range. A search over budgets finds the least feasible one, and for the chosen composition
//! the greedy "next microbatch to the pipeline that would finish it first" split is optimal for
//! linear increasing costs, so it reaches that budget exactly.
//!
//! Two dynamic programmes over node counts `j = 0..N`, each with pipeline counts tracked only
//! up to `cmax = max(f + 1, 2)` ("at least `cmax`" in the last bucket):
//! - **`B` at least the largest possible pipeline count** (`B >= N / n0`): no composition can
//!   have more pipelines than microbatches, so `P <= B` holds by itself and feasibility is
//!   `max sum cap >= B`, a knapsack maximising capacity. `O(N * T * cmax)` per budget.
//! - **`B` below it** (large clusters, small batches): `P <= B` binds. The programme keeps, for
//!   every `(j, bucket)`, the *set* of totals some composition of `j` nodes can take, as sorted
//!   disjoint intervals: `M_j = union over t of (M_{j - n_t} + [1, cap_t])` (a Minkowski sum
//!   with each pipeline's range), totals above `B` dropped since they only grow. The budget is
//!   feasible iff `B` is in `M_N`. This is exact (the union of the compositions' ranges, nothing
//!   approximated), needs no table of size `N x B`, and costs `O(N * T * cmax * K)` for `K`
//!   intervals per set: `K` is 1 for all but small `j` in practice (every composition's range
//!   overlaps the next), so the cost is that of the plain knapsack. The earlier programme
//!   tracked every pipeline count up to `B` instead, `O(N * T * B)`: 54 s at 10,000 nodes.
//!
//! The budget search moves between *breakpoints*: feasibility depends on `tau` only through the
//! capacities, so a feasible `tau` drops to the least budget with the same capacities and an
//! infeasible one jumps to the next budget where some capacity grows. It ends on the least
//! feasible breakpoint, in a few dozen programmes at most (a binary search's worth), usually
//! fewer.

use super::profile::Nanos;
use super::template::{Template, TemplateSet};
use super::PlanError;

/// Which pipeline counts a plan may have: one (no gradient sync), or at least `cmax`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Single,
    Many,
}

/// The search for `n` nodes and `b` microbatches over one template set.
struct Search<'a> {
    tpls: &'a [Template],
    sizes: Vec<usize>,
    n: usize,
    b: i64,
    cmax: usize,
    /// Nodes of the largest template.
    largest: usize,
    /// Template indices in the order a walk back tries them: the counts to stay close to
    /// (most used first), then the largest.
    order: Vec<usize>,
    /// `b` below the largest possible pipeline count: track totals, not only capacity.
    bounded: bool,
}

impl Search<'_> {
    /// Bucket of the class's final state.
    fn bucket(&self, class: Class) -> usize {
        match class {
            Class::Single => 1,
            Class::Many => self.cmax,
        }
    }

    /// Buckets a state of bucket `c` is reached from by adding one pipeline.
    fn preds(&self, c: usize) -> impl Iterator<Item = usize> {
        let stay = (c == self.cmax).then_some(c);
        c.checked_sub(1).into_iter().chain(stay)
    }

    /// Whether `j` nodes can form a composition in bucket `c` at all: exactly `c < cmax`
    /// pipelines cover at most `c` largest templates (this keeps the small buckets to small
    /// `j`, so large clusters cost one bucket per node count, not `cmax`).
    fn reachable(&self, j: usize, c: usize) -> bool {
        c == self.cmax || j <= c * self.largest
    }

    /// The templates that can take a microbatch at all within `caps`, as `(nodes, capacity)`,
    /// largest first.
    fn usable(&self, caps: &[i64]) -> Vec<(usize, i64)> {
        (self.sizes.iter().copied().zip(caps.iter().copied()))
            .rev()
            .filter(|&(_, cap)| cap >= 1)
            .collect()
    }

    fn feasible(&self, caps: &[i64], class: Class, tables: &mut Tables) -> bool {
        let end = self.bucket(class);
        if self.bounded {
            tables.totals.build(self, caps);
            tables.totals.contains(self.n, end, self.b as u32)
        } else {
            self.max_capacity(caps, &mut tables.best);
            tables.best[self.n * (self.cmax + 1) + end] >= self.b
        }
    }

    /// `best[j][c]` = max total capacity (capped at `b`) of compositions of `j` nodes in
    /// bucket `c`, or -1 when there is none.
    fn max_capacity(&self, caps: &[i64], best: &mut Vec<i64>) {
        let w = self.cmax + 1;
        best.clear();
        best.resize((self.n + 1) * w, -1);
        best[0] = 0;
        let usable = self.usable(caps);
        for j in 1..=self.n {
            for c in (1..=self.cmax).filter(|&c| self.reachable(j, c)) {
                let stay = c == self.cmax;
                let mut top = -1;
                for &(sz, cap) in usable.iter().filter(|&&(sz, _)| sz <= j) {
                    let base = (j - sz) * w;
                    let v = if stay {
                        best[base + c - 1].max(best[base + c])
                    } else {
                        best[base + c - 1]
                    };
                    if v >= 0 {
                        top = top.max((v + cap).min(self.b));
                    }
                }
                best[j * w + c] = top;
            }
        }
    }

    /// Counts per template of a composition that is feasible at `caps` in `class`.
    fn counts(&self, caps: &[i64], class: Class, tables: &mut Tables) -> Vec<u32> {
        if self.bounded {
            tables.totals.build(self, caps);
            return tables.totals.trace(self, caps, self.bucket(class));
        }
        self.max_capacity(caps, &mut tables.best);
        let w = self.cmax + 1;
        let best = &tables.best;
        let mut counts = vec![0u32; self.tpls.len()];
        let (mut j, mut c) = (self.n, self.bucket(class));
        while j > 0 {
            // The first (smallest template, then bucket) predecessor that gives this state its
            // value: the choice the capacity programme records, so plans stay as they were.
            let here = best[j * w + c];
            let (t, p) = (0..self.sizes.len())
                .filter(|&t| self.sizes[t] <= j && caps[t] >= 1)
                .flat_map(|t| self.preds(c).map(move |p| (t, p)))
                .find(|&(t, p)| {
                    let v = best[(j - self.sizes[t]) * w + p];
                    v >= 0 && (v + caps[t]).min(self.b) == here
                })
                .expect("a reachable state has a predecessor");
            counts[t] += 1;
            j -= self.sizes[t];
            c = p;
        }
        counts
    }
}

/// Reusable tables of the two programmes.
#[derive(Default)]
struct Tables {
    best: Vec<i64>,
    totals: Totals,
}

/// Per `(j, bucket)`: the totals some composition of `j` nodes can take, as sorted, disjoint,
/// non-adjacent inclusive intervals, stored one state after another.
#[derive(Default)]
struct Totals {
    buckets: usize,
    start: Vec<u32>,
    spans: Vec<(u32, u32)>,
    scratch: Vec<(u32, u32)>,
}

impl Totals {
    fn get(&self, j: usize, c: usize) -> &[(u32, u32)] {
        let i = j * self.buckets + c;
        &self.spans[self.start[i] as usize..self.start[i + 1] as usize]
    }

    fn build(&mut self, s: &Search, caps: &[i64]) {
        let b = s.b as u32;
        self.buckets = s.cmax + 1;
        // Largest templates first: their predecessors have the fewest pipelines, so the
        // candidates come nearly sorted.
        let usable = s.usable(caps);
        self.start.clear();
        self.spans.clear();
        for j in 0..=s.n {
            for c in 0..=s.cmax {
                self.start.push(self.spans.len() as u32);
                if j == 0 {
                    if c == 0 {
                        self.spans.push((0, 0));
                    }
                    continue;
                }
                if !s.reachable(j, c) {
                    continue;
                }
                let mut scratch = std::mem::take(&mut self.scratch);
                scratch.clear();
                for &(sz, cap) in usable.iter().filter(|&&(sz, _)| sz <= j) {
                    let cap = cap as u32;
                    for p in s.preds(c) {
                        for &(lo, hi) in self.get(j - sz, p) {
                            if lo < b {
                                scratch.push((lo + 1, hi.saturating_add(cap).min(b)));
                            }
                        }
                    }
                }
                self.push_union(&mut scratch);
                self.scratch = scratch;
            }
        }
        self.start.push(self.spans.len() as u32);
    }

    /// Appends the union of `items` as one state's intervals.
    fn push_union(&mut self, items: &mut [(u32, u32)]) {
        items.sort_unstable();
        let first = self.spans.len();
        for &(lo, hi) in items.iter() {
            let open = self.spans.len() > first;
            match self.spans.last_mut() {
                Some(last) if open && lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
                _ => self.spans.push((lo, hi)),
            }
        }
    }

    fn contains(&self, j: usize, c: usize, x: u32) -> bool {
        self.get(j, c).iter().any(|&(lo, hi)| lo <= x && x <= hi)
    }

    /// Walks back from total `b` at `(n, end)`: one pipeline at a time, a template and a
    /// predecessor total `y` with `y + 1 <= x <= y + cap`, templates in [`Search::order`].
    fn trace(&self, s: &Search, caps: &[i64], end: usize) -> Vec<u32> {
        let mut counts = vec![0u32; s.tpls.len()];
        let (mut j, mut c, mut x) = (s.n, end, s.b as u32);
        while j > 0 {
            let (t, p, y) = (s.order.iter().copied())
                .filter(|&t| s.sizes[t] <= j && caps[t] >= 1)
                .flat_map(|t| s.preds(c).map(move |p| (t, p)))
                .find_map(|(t, p)| {
                    let cap = caps[t] as u32;
                    self.get(j - s.sizes[t], p).iter().find_map(|&(lo, hi)| {
                        let y = hi.min(x - 1);
                        (y >= lo && y + cap >= x).then_some((t, p, y))
                    })
                })
                .expect("every total of a state comes from a predecessor");
            counts[t] += 1;
            j -= s.sizes[t];
            c = p;
            x = y;
        }
        debug_assert_eq!((c, x), (0, 0));
        counts
    }
}

/// Template counts (indexed like `set.templates`) of the best composition for `n` nodes.
/// Among compositions equally fast, `prefer` (counts per template, e.g. the current plan's;
/// empty for none) steers the choice where pipelines may outnumber microbatches: there many
/// compositions tie, and a reconfiguration that keeps the current templates copies far less
/// (2 nodes joining 2,500 four-node pipelines, 1 microbatch each: 67 layer copies, not
/// 103,119).
pub(crate) fn choose_counts(
    set: &TemplateSet,
    global_microbatches: u32,
    fault_threshold: u32,
    n: u32,
    sync_ns: Nanos,
    prefer: &[u32],
) -> Result<Vec<u32>, PlanError> {
    let tpls = &set.templates;
    let sizes: Vec<usize> = tpls.iter().map(|t| t.nodes as usize).collect();
    let mut order: Vec<usize> = (0..tpls.len()).rev().collect();
    order.sort_by_key(|&t| std::cmp::Reverse(prefer.get(t).copied().unwrap_or(0)));
    let need = fault_threshold as usize + 1;
    let n_min = sizes.iter().copied().min().unwrap_or(1).max(1);
    let search = Search {
        tpls,
        n: n as usize,
        b: i64::from(global_microbatches),
        cmax: need.max(2),
        largest: sizes.iter().copied().max().unwrap_or(1),
        order,
        bounded: (global_microbatches as usize) < n as usize / n_min,
        sizes,
    };
    let mut tables = Tables::default();
    let mut classes = vec![(Class::Many, sync_ns)];
    if need <= 1 {
        classes.insert(0, (Class::Single, 0));
    }
    let mut best: Option<(Nanos, Class, Nanos)> = None;
    for (class, sync) in classes {
        let Some(tau) = least_budget(&search, class, &mut tables) else {
            continue;
        };
        if best.is_none_or(|(total, ..)| tau + sync < total) {
            best = Some((tau + sync, class, tau));
        }
    }
    let Some((_, class, tau)) = best else {
        return Err(why_infeasible(&search, global_microbatches, need));
    };
    Ok(search.counts(&capacities(tpls, tau, search.b), class, &mut tables))
}

/// The least feasible budget of `class`, or `None` when no budget is.
///
/// Galloping up from a lower bound (doubling steps) brackets it, then bisection between
/// breakpoints narrows the bracket; either way a feasible probe drops to the least budget with
/// its capacities and an infeasible one jumps to the next breakpoint.
fn least_budget(s: &Search, class: Class, tables: &mut Tables) -> Option<Nanos> {
    let top = s
        .tpls
        .iter()
        .map(|t| t.iteration_ns_for(s.b as u64))
        .max()
        .unwrap_or(0);
    if !s.feasible(&capacities(s.tpls, top, s.b), class, tables) {
        return None;
    }
    let probe = |tau: Nanos, tables: &mut Tables| {
        let caps = capacities(s.tpls, tau, s.b);
        if s.feasible(&caps, class, tables) {
            Ok(floor_breakpoint(s.tpls, &caps).min(tau))
        } else {
            Err(next_breakpoint(s.tpls, &caps, s.b).max(tau + 1))
        }
    };
    // Below `lo` nothing is feasible; `hi` is.
    let (mut lo, mut hi) = (lower_bound(s).min(top), top);
    let mut step = (lo / 16).max(1);
    while lo < hi {
        let at = lo.saturating_add(step).min(hi);
        match probe(at, tables) {
            Ok(f) => {
                hi = f.max(lo);
                break;
            }
            Err(next) => lo = next.min(hi),
        }
        step = step.saturating_mul(2);
    }
    while lo < hi {
        match probe(lo + (hi - lo) / 2, tables) {
            Ok(f) => hi = f.max(lo),
            Err(next) => lo = next.min(hi),
        }
    }
    Some(lo)
}

/// No budget below this is feasible: `B <= sum cap_p <= sum (tau - alpha_p) / w_p`, and that
/// sum is at most `N` times the best per-node rate `(tau - alpha_t) / (n_t w_t)`, so some
/// template has `tau >= alpha_t + B n_t w_t / N`.
fn lower_bound(s: &Search) -> Nanos {
    let n = s.n.max(1) as u128;
    s.tpls
        .iter()
        .map(|t| {
            let work = s.b as u128 * u128::from(t.nodes) * u128::from(t.bottleneck_ns) / n;
            t.alpha_ns()
                .saturating_add(work.min(u128::from(Nanos::MAX)) as Nanos)
        })
        .min()
        .unwrap_or(0)
}

/// The least budget whose capacities are `caps`.
fn floor_breakpoint(tpls: &[Template], caps: &[i64]) -> Nanos {
    tpls.iter()
        .zip(caps)
        .filter(|(_, &c)| c >= 1)
        .map(|(t, &c)| t.alpha_ns() + c as u64 * t.bottleneck_ns)
        .max()
        .unwrap_or(0)
}

/// The least budget at which some capacity grows beyond `caps`.
fn next_breakpoint(tpls: &[Template], caps: &[i64], b: i64) -> Nanos {
    tpls.iter()
        .zip(caps)
        .filter(|(_, &c)| c < b)
        .map(|(t, &c)| t.alpha_ns() + (c as u64 + 1) * t.bottleneck_ns)
        .min()
        .unwrap_or(Nanos::MAX)
}

/// Distinguishes "batch too small" from "no composition at all".
fn why_infeasible(s: &Search, global_microbatches: u32, need: usize) -> PlanError {
    let loose = Search {
        tpls: s.tpls,
        sizes: s.sizes.clone(),
        n: s.n,
        b: i64::MAX,
        cmax: need.max(1),
        largest: s.largest,
        order: s.order.clone(),
        bounded: false,
    };
    let mut best = Vec::new();
    loose.max_capacity(&vec![1; s.tpls.len()], &mut best);
    if best[s.n * (loose.cmax + 1) + loose.cmax] >= 0 {
        return PlanError::BatchTooSmall {
            global_microbatches,
            pipelines: (s.n as u32).div_ceil(s.largest as u32).max(need as u32),
        };
    }
    PlanError::NoComposition {
        nodes: s.n as u32,
        min_pipelines: need as u32,
        sizes: s.sizes.iter().map(|&x| x as u32).collect(),
    }
}

/// Microbatches each template can take within `tau`, clipped at `b`.
fn capacities(tpls: &[Template], tau: Nanos, b: i64) -> Vec<i64> {
    tpls.iter()
        .map(|t| {
            let a = t.alpha_ns();
            if tau < a || t.bottleneck_ns == 0 {
                return if tau >= a { b } else { 0 };
            }
            (((tau - a) / t.bottleneck_ns) as i64).min(b)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn union_merges_overlapping_and_adjacent_intervals_only() {
        let mut t = Totals::default();
        t.push_union(&mut [(5, 6), (1, 2), (3, 4), (9, 12), (10, 11), (14, 14)]);
        assert_eq!(t.spans, vec![(1, 6), (9, 12), (14, 14)]);
    }
}
