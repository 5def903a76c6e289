//! The capacity programme: for `B` at least the largest possible pipeline count, the most
//! microbatches compositions of `j` nodes can take within a budget, and where its rows repeat.

use super::Search;

impl Search<'_> {
    /// `best[n][end]` from rows filled up to where they repeat (`repeat`), or all of them.
    pub(super) fn capacity_at(&self, best: &[i64], repeat: Option<Repeat>, end: usize) -> i64 {
        let w = self.cmax + 1;
        let Some(r) = repeat else {
            return best[self.n * w + end];
        };
        if end != self.cmax {
            // Past `cmax` largest templates, fewer than `cmax` pipelines cannot cover the nodes.
            return -1;
        }
        let at = r.from + (self.n - r.from) % r.unit;
        let v = best[at * w + end];
        let k = ((self.n - at) / r.unit) as i64;
        if v < 0 {
            -1
        } else {
            v.saturating_add(k.saturating_mul(r.gain)).min(self.b)
        }
    }

    /// `best[j][c]` = max total capacity (capped at `b`) of compositions of `j` nodes in
    /// bucket `c`, or -1 when there is none. With `shortcut`, stops early where the rows
    /// repeat (see [`Repeat`]) and says so; the rows after that are not filled.
    pub(super) fn max_capacity(
        &self,
        caps: &[i64],
        best: &mut Vec<i64>,
        shortcut: bool,
    ) -> Option<Repeat> {
        let w = self.cmax + 1;
        best.clear();
        best.resize((self.n + 1) * w, -1);
        best[0] = 0;
        let usable = self.usable(caps);
        let mut watch = Watch::new(&usable, self.cmax * self.largest).filter(|_| shortcut);
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
            if let Some(r) = watch
                .as_mut()
                .and_then(|r| r.row(best, w, self.cmax, j, self.b))
            {
                return Some(r);
            }
        }
        None
    }
}

/// Where the capacity programme's rows repeat: from row `from` on, every row is the row `unit`
/// nodes earlier plus one more pipeline of the `unit`-node template (`gain` microbatches),
/// capped at `b`, in the last bucket.
///
/// Why that holds for every later row once it holds for `L` consecutive rows `[J, J + L)`,
/// `L` the largest usable template and `J` past `cmax` largest templates (so a row only reads
/// the last bucket of the `L` rows before it): write `f(v) = min(b, v + gain)` (and
/// `f(-1) = -1`) and `g_t` for adding a pipeline of template `t`. Row `j = J + L` is
/// `max_t g_t(best[j - n_t])`; each `best[j - n_t]` is in the window, so it is
/// `f(best[j - n_t - unit])`; `g_t` and `f` commute and `f` is monotone, so row `j` is
/// `f(max_t g_t(best[j - unit - n_t])) = f(best[j - unit])`. Induction carries it on (the
/// unbounded-knapsack periodicity of Gilmore and Gomory). On large clusters the rows repeat
/// after a few hundred nodes, so a 10,000-node probe fills a few hundred rows, not 10,000.
#[derive(Debug, Clone, Copy)]
pub(super) struct Repeat {
    from: usize,
    unit: usize,
    gain: i64,
}

/// Watches the rows for a [`Repeat`] with the best capacity per node template.
struct Watch {
    unit: usize,
    gain: i64,
    /// Rows needed in a row.
    span: usize,
    /// First row that reads only the last bucket.
    pure: usize,
    run: usize,
}

impl Watch {
    fn new(usable: &[(usize, i64)], pure: usize) -> Option<Watch> {
        let (unit, gain) = best_per_node(usable)?;
        let span = usable.iter().map(|u| u.0).max()?;
        Some(Watch {
            unit,
            gain,
            span,
            pure: pure + 1,
            run: 0,
        })
    }

    /// Row `j` is filled: the repeat, once `span` rows in a row follow it.
    fn row(&mut self, best: &[i64], w: usize, c: usize, j: usize, b: i64) -> Option<Repeat> {
        if j < self.pure {
            return None;
        }
        let earlier = best[(j - self.unit) * w + c];
        let expect = if earlier < 0 {
            -1
        } else {
            (earlier + self.gain).min(b)
        };
        self.run = if best[j * w + c] == expect {
            self.run + 1
        } else {
            0
        };
        (self.run >= self.span).then(|| Repeat {
            from: j + 1 - self.span,
            unit: self.unit,
            gain: self.gain,
        })
    }
}

/// The usable template `(nodes, capacity)` with the most microbatches per node; ties: the
/// smaller template (the shorter period). Both programmes' repeats are built on it.
pub(super) fn best_per_node(usable: &[(usize, i64)]) -> Option<(usize, i64)> {
    usable.iter().copied().max_by(|a, b| {
        ((a.1 as i128 * b.0 as i128).cmp(&(b.1 as i128 * a.0 as i128))).then(b.0.cmp(&a.0))
    })
}
