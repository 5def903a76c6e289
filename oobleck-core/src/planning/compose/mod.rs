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
//!
//! A probe does not fill all `N` rows: past a few hundred nodes the rows *repeat* (row `j` is
//! row `j - u` plus a fixed step, the unbounded-knapsack periodicity of Gilmore and Gomory), and
//! once they provably do, row `N` is read off the repeat. [`capacity::Repeat`] and
//! [`totals::Repeat`] give the argument; the composition itself is traced back through a full
//! table once, at the chosen budget, so plans are those the full programme gives. At 10,000
//! nodes a probe fills a few hundred rows instead of 10,000 (the planner bench's whole
//! instantiation went from 2.7-7.7 ms to 1.2-2.5 ms).

mod capacity;
mod totals;

use super::profile::Nanos;
use super::template::{Template, TemplateSet};
use super::PlanError;
use totals::Totals;

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
            let repeat = tables.totals.build(self, caps, true);
            tables
                .totals
                .contains(self, end, self.b as u32, repeat.as_ref())
        } else {
            let repeat = self.max_capacity(caps, &mut tables.best, true);
            self.capacity_at(&tables.best, repeat, end) >= self.b
        }
    }

    /// Counts per template of a composition that is feasible at `caps` in `class`.
    fn counts(&self, caps: &[i64], class: Class, tables: &mut Tables) -> Vec<u32> {
        if self.bounded {
            tables.totals.build(self, caps, false);
            return tables.totals.trace(self, caps, self.bucket(class));
        }
        self.max_capacity(caps, &mut tables.best, false);
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

/// [`choose_counts`] for `total` nodes, degraded as far as needed: with `f + 1` pipelines if
/// possible, else with as many pipelines as the nodes allow, and only then with fewer nodes
/// (the rest spare). The error is the first one met (every node, the `f` asked for).
pub(crate) fn choose_counts_degraded(
    set: &TemplateSet,
    global_microbatches: u32,
    fault_threshold: u32,
    total: u32,
    sync_ns: Nanos,
    prefer: &[u32],
) -> Result<Vec<u32>, PlanError> {
    let n_min = set.templates.first().map_or(1, |t| t.nodes);
    let mut first_err = None;
    for f in (0..=fault_threshold).rev() {
        for used in (n_min..=total).rev() {
            match choose_counts(set, global_microbatches, f, used, sync_ns, prefer) {
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
        pipeline_nodes: n_min,
        pipelines: 1,
        state_bytes: set.layer_state_bytes.iter().sum(),
        node_bytes: 0,
    }))
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
    loose.max_capacity(&vec![1; s.tpls.len()], &mut best, false);
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
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;

    /// A random search without templates (the programmes read only sizes and capacities):
    /// up to five sizes of 1..=12 nodes, capacities 0..=6, up to 600 nodes, and a batch cap
    /// that clips the totals early or late.
    fn random_case(rng: &mut ChaCha8Rng) -> (Search<'static>, Vec<i64>) {
        let mut sizes: Vec<usize> = (0..rng.random_range(1..=5))
            .map(|_| rng.random_range(1..=12))
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        let caps = sizes.iter().map(|_| rng.random_range(0..=6)).collect();
        let n = rng.random_range(1..=600);
        let b = if rng.random_bool(0.5) {
            rng.random_range(1..=n as i64)
        } else {
            rng.random_range(1..=8 * n as i64)
        };
        let search = Search {
            tpls: &[],
            largest: *sizes.last().expect("at least one size"),
            sizes,
            n,
            b,
            cmax: rng.random_range(2..=4),
            order: Vec::new(),
            bounded: false,
        };
        (search, caps)
    }

    #[test]
    fn capacity_read_off_where_the_rows_repeat_equals_the_full_programme() {
        let mut rng = ChaCha8Rng::seed_from_u64(17);
        let (mut full, mut short, mut repeats) = (Vec::new(), Vec::new(), 0);
        for case in 0..500 {
            let (s, caps) = random_case(&mut rng);
            assert!(s.max_capacity(&caps, &mut full, false).is_none());
            let repeat = s.max_capacity(&caps, &mut short, true);
            repeats += usize::from(repeat.is_some());
            for end in [1, s.cmax] {
                let want = full[s.n * (s.cmax + 1) + end];
                assert_eq!(s.capacity_at(&short, repeat, end), want, "case {case}");
            }
        }
        // The shortcut is exercised, not only the fallback.
        assert!(repeats > 200, "{repeats} of 500 cases repeated");
    }

    #[test]
    fn totals_read_off_where_the_rows_repeat_equal_the_full_programme() {
        let mut rng = ChaCha8Rng::seed_from_u64(18);
        let (mut full, mut short, mut repeats) = (Totals::default(), Totals::default(), 0);
        for case in 0..500 {
            let (s, caps) = random_case(&mut rng);
            assert!(full.build(&s, &caps, false).is_none());
            let repeat = short.build(&s, &caps, true);
            repeats += usize::from(repeat.is_some());
            let b = s.b as u32;
            let xs: Vec<u32> = (0..24)
                .map(|_| rng.random_range(0..=b))
                .chain([b])
                .collect();
            for end in [1, s.cmax] {
                for &x in &xs {
                    let want = full.contains(&s, end, x, None);
                    let got = short.contains(&s, end, x, repeat.as_ref());
                    assert_eq!(got, want, "case {case}, bucket {end}, total {x}");
                }
            }
        }
        assert!(repeats > 100, "{repeats} of 500 cases repeated");
    }
}
