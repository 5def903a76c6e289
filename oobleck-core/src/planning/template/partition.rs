//! The exact search of one `(n, g)`: prefix and suffix tables of least maximum stage time and
//! every bottleneck stage between them (the method is in the parent module's docs).

use super::{Best, Costs, INF};

/// Searches every layout of `n` nodes for one `g`. `suf` may be shared between calls with the
/// same `g` (it does not depend on `S`).
pub(super) fn search(
    c: &Costs,
    n: u32,
    g: u32,
    m_of: impl Fn(u32) -> u64,
    suf: &mut SufTable,
) -> Option<Best> {
    let per_node = (c.big_g / g) as usize;
    let s = n as usize * per_node;
    let l = c.l;
    if s > l {
        return None;
    }
    let m = m_of(s as u32);
    suf.extend_to(c, g, per_node, s);
    // pre[i][a]: minimal max-w of [0, a) in stages 0..i.
    let width = l + 1;
    let mut pre = vec![INF; (s + 1) * width];
    pre[0] = 0;
    for i in 1..=s {
        let in_flight = (s - (i - 1)) as u64;
        let p2p = c.p2p(i - 1, per_node);
        // Stage i-1 covers [c0, a); at least i-1 layers before it, and at least s-i after.
        for a in i..=(l - (s - i)) {
            // Stage i-1 grows leftwards from one layer: its `w` and memory only grow, so the
            // scan ends once either alone rules out an improvement.
            let mut best = INF;
            for c0 in ((i - 1)..a).rev() {
                let w = c.compute(c0, a, g) + p2p;
                if w >= best || c.memory(c0, a, g, in_flight) > c.mem {
                    break;
                }
                let prev = pre[(i - 1) * width + c0];
                if prev != INF {
                    best = best.min(prev.max(w));
                }
            }
            pre[i * width + a] = best;
        }
    }
    if pre[s * width + l] == INF {
        return None;
    }
    let mut best: Option<(u128, usize, usize, usize)> = None;
    let comm_prefix: Vec<u64> = {
        let mut v = vec![0u64; s + 1];
        for i in 0..s {
            v[i + 1] = v[i] + c.p2p(i, per_node);
        }
        v
    };
    let q = c.q(g);
    for k in 0..s {
        let s_a = s - k - 1;
        let in_flight = (s - k) as u64;
        let p2p = c.p2p(k, per_node);
        let suf_row = suf.row(s_a);
        for a in k..=(l - s_a - 1) {
            let pk = pre[k * width + a];
            if pk == INF {
                continue;
            }
            let c_pre = (c.fwd[a] + c.bwd[a]) * q + comm_prefix[k];
            // `T >= c_pre + m * w` and `w` only grows with `b` (so does memory): once that
            // bound reaches the best found, no later `b` improves on it.
            let beaten = |w: u64, best: &Option<(u128, usize, usize, usize)>| {
                best.is_some_and(|(bt, ..)| c_pre as u128 + m as u128 * w as u128 >= bt)
            };
            if beaten(pk, &best) {
                continue;
            }
            for (b, &sb) in suf_row.iter().enumerate().take(l - s_a + 1).skip(a + 1) {
                let w = c.compute(a, b, g) + p2p;
                if beaten(w, &best) || c.memory(a, b, g, in_flight) > c.mem {
                    break;
                }
                if sb == INF || w < pk || (s_a > 0 && w <= sb) {
                    continue;
                }
                let c_suf = (c.fwd[l] - c.fwd[b] + c.bwd[l] - c.bwd[b]) * q
                    + (comm_prefix[s] - comm_prefix[k + 1]);
                let extra = (2 * c_suf as i128 - s_a as i128 * w as i128).max(0) as u128;
                let t = c_pre as u128 + m as u128 * w as u128 + extra;
                if best.is_none_or(|(bt, ..)| t < bt) {
                    best = Some((t, k, a, b));
                }
            }
        }
    }
    let (t, k, a, b) = best?;
    // Rebuild cuts: prefix [0, a) into k stages with w <= W, suffix [b, L) into s_a stages < W.
    let w_k = c.compute(a, b, g) + c.p2p(k, per_node);
    let mut cuts = Vec::with_capacity(s - 1);
    let mut end = a;
    let mut prefix_cuts = Vec::new();
    for i in (1..=k).rev() {
        let in_flight = (s - (i - 1)) as u64;
        let p2p = c.p2p(i - 1, per_node);
        // The earliest start whose prefix is feasible: deterministic (latest stages longest).
        let start = ((i - 1)..end)
            .find(|&c0| {
                pre[(i - 1) * width + c0] <= w_k
                    && c.memory(c0, end, g, in_flight) <= c.mem
                    && c.compute(c0, end, g) + p2p <= w_k
            })
            .expect("pre[k][a] <= W guarantees a feasible predecessor");
        prefix_cuts.push(start);
        end = start;
    }
    prefix_cuts.reverse();
    cuts.extend(prefix_cuts.into_iter().filter(|&x| x > 0));
    if k > 0 || a > 0 {
        cuts.push(a);
    }
    let mut start = b;
    for j in (1..=(s - k - 1)).rev() {
        cuts.push(start);
        let i = s - j;
        let p2p = c.p2p(i, per_node);
        let next = suf.choose(c, g, j, start, w_k, p2p);
        start = next;
    }
    debug_assert_eq!(start, l);
    debug_assert!(cuts.windows(2).all(|p| p[0] < p[1]) && cuts.len() == s - 1);
    Some(Best {
        objective: t,
        g,
        cuts,
        m,
    })
}

/// `suf[j][b]`: least max-w of `[b, L)` split into the last `j` stages; independent of `S`
/// because the in-flight count of the stage `j` from the end is `j` and its link type only
/// depends on `j mod (G / g)`.
pub(super) struct SufTable {
    width: usize,
    rows: Vec<u64>,
    built: usize,
}

impl SufTable {
    pub(super) fn new(l: usize) -> Self {
        let width = l + 1;
        let mut rows = vec![INF; width];
        rows[l] = 0;
        SufTable {
            width,
            rows,
            built: 0,
        }
    }

    fn row(&self, j: usize) -> &[u64] {
        &self.rows[j * self.width..(j + 1) * self.width]
    }

    fn extend_to(&mut self, c: &Costs, g: u32, per_node: usize, s: usize) {
        let l = c.l;
        while self.built < s {
            let j = self.built + 1;
            let mut row = vec![INF; self.width];
            // Stage j-from-end; index relative to a multiple of per_node.
            let i_mod = (per_node - j % per_node) % per_node;
            let p2p = if i_mod == 0 { c.p2p_inter } else { c.p2p_intra };
            for (b, slot) in row.iter_mut().enumerate().take(l - j + 1) {
                // The stage grows rightwards: `w` and memory only grow with `e`.
                let mut best = INF;
                for e in (b + 1)..=(l - (j - 1)) {
                    let w = c.compute(b, e, g) + if b == 0 { 0 } else { p2p };
                    if w >= best || c.memory(b, e, g, j as u64) > c.mem {
                        break;
                    }
                    let next = self.rows[(j - 1) * self.width + e];
                    if next != INF {
                        best = best.min(w.max(next));
                    }
                }
                *slot = best;
            }
            self.rows.extend_from_slice(&row);
            self.built = j;
        }
    }

    /// End of the stage that starts at `b` as the `j`-th from the end, with every stage `< w`.
    fn choose(&self, c: &Costs, g: u32, j: usize, b: usize, w: u64, p2p: u64) -> usize {
        let l = c.l;
        ((b + 1)..=(l - (j - 1)))
            .rev()
            .find(|&e| {
                self.rows[(j - 1) * self.width + e] < w
                    && c.memory(b, e, g, j as u64) <= c.mem
                    && c.compute(b, e, g) + p2p < w
            })
            .expect("suf[j][b] < W guarantees a feasible successor")
    }
}
