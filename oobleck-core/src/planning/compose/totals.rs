//! The totals programme: for `B` below the largest possible pipeline count, the set of
//! microbatch totals compositions of `j` nodes can take within a budget.

use super::Search;

/// Per `(j, bucket)`: the totals some composition of `j` nodes can take, as sorted, disjoint,
/// non-adjacent inclusive intervals, stored one state after another.
#[derive(Default)]
pub(super) struct Totals {
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

    /// Fills every `(j, bucket)`; with `shortcut`, stops early where the rows repeat (see
    /// [`Repeat`]) and says so; the rows after that are not filled.
    pub(super) fn build(&mut self, s: &Search, caps: &[i64], shortcut: bool) -> Option<Repeat> {
        let b = s.b as u32;
        self.buckets = s.cmax + 1;
        // Largest templates first: their predecessors have the fewest pipelines, so the
        // candidates come nearly sorted.
        let usable = s.usable(caps);
        let mut watch = Watch::new(&usable, s).filter(|_| shortcut);
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
            if let Some(w) = watch.as_mut() {
                // Close row `j` for the watch's lookups; reopened unless the search stops here.
                self.start.push(self.spans.len() as u32);
                let found = w.row(self, s.cmax, j, b);
                if found.is_some() {
                    return found;
                }
                self.start.pop();
            }
        }
        self.start.push(self.spans.len() as u32);
        None
    }

    /// Appends the union of `items` as one state's intervals.
    fn push_union(&mut self, items: &mut Vec<(u32, u32)>) {
        merge(items);
        self.spans.extend_from_slice(items);
    }

    /// Whether a composition of `s.n` nodes in bucket `end` can take `x` microbatches, from
    /// rows filled up to where they repeat (`repeat`), or all of them.
    pub(super) fn contains(&self, s: &Search, end: usize, x: u32, repeat: Option<&Repeat>) -> bool {
        let Some(r) = repeat else {
            return self
                .get(s.n, end)
                .iter()
                .any(|&(lo, hi)| lo <= x && x <= hi);
        };
        if end != s.cmax {
            // Past `cmax` largest templates, fewer than `cmax` pipelines cannot cover the nodes.
            return false;
        }
        let at = r.from + (s.n - r.from) % r.unit;
        let mut set = self.get(at, end).to_vec();
        for _ in 0..(s.n - at) / r.unit {
            if set.is_empty() {
                break;
            }
            set = plus(&set, &r.step, s.b as u32);
        }
        set.iter().any(|&(lo, hi)| lo <= x && x <= hi)
    }

    /// Walks back from total `b` at `(n, end)`: one pipeline at a time, a template and a
    /// predecessor total `y` with `y + 1 <= x <= y + cap`, templates in [`Search::order`].
    pub(super) fn trace(&self, s: &Search, caps: &[i64], end: usize) -> Vec<u32> {
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

/// Sorts `items` and merges overlapping and adjacent intervals, in place.
fn merge(items: &mut Vec<(u32, u32)>) {
    items.sort_unstable();
    let mut out = 0;
    for i in 0..items.len() {
        let (lo, hi) = items[i];
        if out > 0 && lo <= items[out - 1].1.saturating_add(1) {
            items[out - 1].1 = items[out - 1].1.max(hi);
        } else {
            items[out] = (lo, hi);
            out += 1;
        }
    }
    items.truncate(out);
}

/// `{x + y : x in a, y in b} ∩ [0, cap]`, merged.
fn plus(a: &[(u32, u32)], b: &[(u32, u32)], cap: u32) -> Vec<(u32, u32)> {
    let mut out = Vec::with_capacity(a.len() * b.len());
    for &(alo, ahi) in a {
        for &(blo, bhi) in b {
            let lo = alo.saturating_add(blo);
            if lo <= cap {
                out.push((lo, ahi.saturating_add(bhi).min(cap)));
            }
        }
    }
    merge(&mut out);
    out
}

/// Where the totals programme's rows repeat: from row `from` on, the last bucket of row `j` is
/// that of row `j - unit` plus `step`, the totals some composition of exactly `unit` nodes
/// can take (`{x + y}`, clipped at `b`).
///
/// Why: the argument of [`super::capacity::Repeat`] with sets. Adding `step` (`H`) and adding
/// one pipeline of template `t` (`h_t`) are both Minkowski sums followed by the clip, so they
/// commute and distribute over unions; if `L` rows in a row past `cmax` largest templates (and
/// `unit` more) satisfy `M_j = H(M_{j - unit})`, then `M_{J + L} = union_t h_t(H(M_{J + L -
/// n_t - unit})) = H(M_{J + L - unit})`, and so on. The unit is the least common multiple of
/// the best capacity-per-node template's size and the largest one's: past the first few
/// hundred nodes the fewest pipelines grow with the largest template and the most microbatches
/// with the best one, so both ends of the totals repeat with it.
pub(super) struct Repeat {
    from: usize,
    unit: usize,
    step: Vec<(u32, u32)>,
}

/// Watches the rows for a [`Repeat`].
struct Watch {
    unit: usize,
    /// Rows needed in a row.
    span: usize,
    /// First row compared with the row `unit` before it.
    first: usize,
    step: Vec<(u32, u32)>,
    run: usize,
}

impl Watch {
    fn new(usable: &[(usize, i64)], s: &Search) -> Option<Watch> {
        let (best, _) = super::capacity::best_per_node(usable)?;
        let largest = usable.iter().map(|u| u.0).max()?;
        let unit = best / gcd(best, largest) * largest;
        let first = s.cmax * s.largest + 1 + unit;
        // The induction needs `largest` rows in a row; reading row `n` off needs `unit` of them.
        let span = unit.max(largest);
        (first + span <= s.n).then_some(Watch {
            unit,
            span,
            first,
            step: Vec::new(),
            run: 0,
        })
    }

    /// Row `j` is filled (its states closed in `t.start`): the repeat, once `span` rows in a
    /// row follow it.
    fn row(&mut self, t: &Totals, c: usize, j: usize, b: u32) -> Option<Repeat> {
        if j < self.first {
            return None;
        }
        if j == self.first {
            let mut all: Vec<(u32, u32)> =
                (1..=c).flat_map(|p| t.get(self.unit, p)).copied().collect();
            merge(&mut all);
            self.step = all;
        }
        let expect = plus(t.get(j - self.unit, c), &self.step, b);
        self.run = if t.get(j, c) == expect.as_slice() {
            self.run + 1
        } else {
            0
        };
        (self.run >= self.span).then(|| Repeat {
            from: j + 1 - self.span,
            unit: self.unit,
            step: std::mem::take(&mut self.step),
        })
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn union_merges_overlapping_and_adjacent_intervals_only() {
        let mut t = Totals::default();
        t.push_union(&mut vec![
            (5, 6),
            (1, 2),
            (3, 4),
            (9, 12),
            (10, 11),
            (14, 14),
        ]);
        assert_eq!(t.spans, vec![(1, 6), (9, 12), (14, 14)]);
    }
}
