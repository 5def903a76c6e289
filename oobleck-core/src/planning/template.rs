//! Pipeline templates: for each node count, the stages that minimise the 1F1B cost model.
//!
//! # Layout
//! A template for `n` nodes of `G` devices uses one stage width `g` (a divisor of `G`) for all
//! its stages, so each node hosts `G / g` consecutive stages and `S = n * G / g`. (The authors'
//! `develop` branch also forced an equal in-node split; here it also means adjacent stages never
//! need their batch slices re-cut.) A stage on `g` devices splits each microbatch of `b` samples
//! along the batch dimension, so its compute time is `work * ceil(b / g) / b` and each device
//! holds the whole stage's parameters and `ceil(b / g) / b` of its activations.
//!
//! # Cost model (DESIGN.md section 3)
//! `w_i = F_i + B_i + p_i` where `p_i` is the point-to-point time of the stage's input
//! activation and output gradient: `2 * (latency + bytes / bandwidth)` over the in-node link, or
//! the cross-node link when stage `i` is the first on its node (`p_0 = 0`). `bytes` is the
//! largest layer output of the profile (all hidden states for a transformer), which keeps `p_i`
//! a function of `i` alone. With `k*` the rightmost slowest stage,
//! `T1 = sum w`, `T3 = sum_{i >= k*} w_i`:
//!
//! ```text
//! closed(m) = T1 + (m - S + k* - 1) * w_k* + T3            (Eq. 1-4 of the paper, 0-based k*)
//! chain(m)  = (T1 - T3) + m * w_k*                          (a path of the 1F1B DAG)
//! T(m)      = max(closed(m), chain(m))
//!           = sum_{i<k*} w_i + m * w_k* + max(0, sum_{i>k*} (2 w_i - w_k*))
//! ```
//! `closed` is the exact 1F1B makespan for equal stages, where it is never below `chain`. For a
//! bottleneck followed by much faster stages `closed` falls below `chain`, which every 1F1B run
//! must take (stage `k*` runs `m` forwards and backwards after the first activation reaches it and
//! before the last gradient leaves), so `T` is floored by it.
//!
//! # Exact optimisation
//! `T` depends on the bottleneck and the suffix after it, so optimal substructure on sub-ranges
//! fails (the original's memoised divide and conquer is not exact). Here, for each `g` and `S`:
//! `pre[i][a]` = least possible maximum `w` over partitions of layers `[0, a)` into stages
//! `0..i` (memory respected), and `suf[j][b]` the same for `[b, L)` split into the last `j`
//! stages. For every bottleneck stage `k` on layers `[a, b)` with `W = w_k(a, b)`, the
//! partition exists iff `pre[k][a] <= W` and `suf[S-k-1][b] < W`, and then `T` is fixed by
//! `(k, a, b)`: the sums of `w` over prefix and suffix do not depend on where the cuts fall
//! (compute is additive in layers, `p_i` depends on the index only). Cost: `O(S * L^2)` per
//! `(n, g)` at worst, exact, and independent of the number of ways to cut.
//!
//! In practice far less: a stage's `w` and memory only grow as it takes more layers, so each
//! scan of the tables stops once one of them alone rules out an improvement (about a balanced
//! stage's worth of layers), and the bottleneck loop stops once `prefix + m * w` reaches the
//! best found. Measured (`cargo bench -p oobleck-core --bench planner`, 2 cores): the set for
//! `n = 1..64` takes 0.8 ms at 48 layers, 5 ms at 96 and 26 ms at 192 (about `L^2.3`); at 96
//! layers 3.2 ms for `n <= 32`, 5 ms for 64, 6 ms for 128 (no layout has more stages than
//! layers, so large `n` add little), and 4 to 5 ms for `G` from 2 to 8.
//!
//! All times inside the search are integers in units of `1/b` ns, so `work * ceil(b/g) / b`
//! is exact and ties do not depend on summation order.

use serde::{Deserialize, Serialize};

use super::profile::{ns_to_ms, ClusterSpec, JobSpec, ModelProfile, Nanos};
use super::PlanError;

mod partition;

use partition::{search, SufTable};

/// One stage of a template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stage {
    /// First layer (inclusive).
    pub layer_start: usize,
    /// Last layer (exclusive).
    pub layer_end: usize,
    /// Node of the template (0-based) that runs this stage.
    pub node: u32,
    /// First device of that node the stage uses.
    pub first_device: u32,
    /// Devices of the stage (`g`).
    pub devices: u32,
    /// Forward compute time of one microbatch, ns.
    pub forward_ns: Nanos,
    /// Backward compute time of one microbatch, ns.
    pub backward_ns: Nanos,
    /// Point-to-point time charged to this stage per microbatch (receive activation + send
    /// gradient), ns.
    pub p2p_ns: Nanos,
    /// Peak memory of one device of the stage under 1F1B, bytes.
    pub memory_bytes: u64,
}

impl Stage {
    /// `w = F + B + p`, ns.
    pub fn time_ns(&self) -> Nanos {
        self.forward_ns + self.backward_ns + self.p2p_ns
    }
    /// Layers of the stage.
    pub fn layers(&self) -> std::ops::Range<usize> {
        self.layer_start..self.layer_end
    }
}

/// A pipeline template: how `nodes` nodes run the whole model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Template {
    /// Node count `n`.
    pub nodes: u32,
    /// Devices per node `G`.
    pub devices_per_node: u32,
    /// Stages in order; they cover every layer once.
    pub stages: Vec<Stage>,
    /// The `m` the template was optimised for.
    pub microbatches: u64,
    /// `T1 = sum w`, ns.
    pub t1_ns: Nanos,
    /// `T3 = sum_{i >= k*} w_i`, ns.
    pub t3_ns: Nanos,
    /// `k*`: the rightmost slowest stage.
    pub bottleneck_stage: usize,
    /// `w_k*`, ns.
    pub bottleneck_ns: Nanos,
    /// `T(microbatches)`, ns.
    pub iteration_ns: Nanos,
    /// Largest per-device memory over stages, bytes.
    pub peak_memory_bytes: u64,
}

impl Template {
    /// Stage count `S`.
    pub fn num_stages(&self) -> usize {
        self.stages.len()
    }

    /// The constant part of `T(m) = alpha + m * w_k*`, ns (see the module docs).
    pub fn alpha_ns(&self) -> Nanos {
        let prefix = self.t1_ns - self.t3_ns;
        let after = (self.t3_ns - self.bottleneck_ns) as i128;
        let s_a = (self.stages.len() - self.bottleneck_stage - 1) as i128;
        let extra = (2 * after - s_a * self.bottleneck_ns as i128).max(0);
        prefix + extra as Nanos
    }

    /// Predicted time of one iteration of `m` microbatches, ns. Linear in `m`.
    pub fn iteration_ns_for(&self, m: u64) -> Nanos {
        self.alpha_ns()
            .saturating_add(m.saturating_mul(self.bottleneck_ns))
    }

    /// The Eq. 1-4 closed form alone (may be below `iteration_ns_for` for an early bottleneck).
    pub fn closed_form_ns(&self, m: u64) -> i128 {
        let s = self.stages.len() as i128;
        self.t1_ns as i128
            + (m as i128 - s + self.bottleneck_stage as i128 - 1) * self.bottleneck_ns as i128
            + self.t3_ns as i128
    }

    /// Devices used (`n * G`).
    pub fn devices(&self) -> u32 {
        self.stages.iter().map(|s| s.devices).sum()
    }

    /// Human summary of the predicted time, ms.
    pub fn iteration_ms(&self) -> f64 {
        ns_to_ms(self.iteration_ns)
    }
}

/// Templates for a job plus `n0`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateSet {
    /// Fewest nodes one pipeline needs.
    pub min_nodes: u32,
    /// One template per feasible node count, ascending.
    pub templates: Vec<Template>,
    /// Training-state bytes per layer (parameters x state factor).
    pub layer_state_bytes: Vec<u64>,
}

impl TemplateSet {
    /// The template of exactly `n` nodes.
    pub fn get(&self, n: u32) -> Option<&Template> {
        self.templates
            .binary_search_by_key(&n, |t| t.nodes)
            .ok()
            .map(|i| &self.templates[i])
    }
}

const INF: u64 = u64::MAX;

/// Everything the search needs, in exact internal units (`1/b` ns).
pub(crate) struct Costs {
    l: usize,
    mb: u64,
    /// Prefix sums (ns) of forward, backward, params, activations.
    fwd: Vec<u64>,
    bwd: Vec<u64>,
    param: Vec<u64>,
    act: Vec<u64>,
    state_factor: u64,
    mem: u64,
    big_g: u32,
    /// p2p of a stage that is first on its node / not, internal units.
    p2p_inter: u64,
    p2p_intra: u64,
}

impl Costs {
    pub(crate) fn new(profile: &ModelProfile, cluster: &ClusterSpec, job: &JobSpec) -> Self {
        let l = profile.layers.len();
        let mut fwd = vec![0u64; l + 1];
        let mut bwd = vec![0u64; l + 1];
        let mut param = vec![0u64; l + 1];
        let mut act = vec![0u64; l + 1];
        for (i, ly) in profile.layers.iter().enumerate() {
            fwd[i + 1] = fwd[i] + super::profile::ms_to_ns(ly.forward_ms);
            bwd[i + 1] = bwd[i] + super::profile::ms_to_ns(ly.backward_ms);
            param[i + 1] = param[i].saturating_add(ly.param_bytes);
            act[i + 1] = act[i].saturating_add(ly.activation_bytes);
        }
        let boundary = profile.layers[..l.saturating_sub(1)]
            .iter()
            .map(|x| x.output_bytes)
            .max()
            .unwrap_or(0);
        let mb = u64::from(job.microbatch_size.max(1));
        Costs {
            l,
            mb,
            fwd,
            bwd,
            param,
            act,
            state_factor: u64::from(job.state_bytes_per_param_byte),
            mem: cluster.device_memory_bytes,
            big_g: cluster.devices_per_node,
            p2p_inter: 2 * cluster.inter_node.transfer_ns(boundary) * mb,
            p2p_intra: 2 * cluster.intra_node.transfer_ns(boundary) * mb,
        }
    }

    fn q(&self, g: u32) -> u64 {
        self.mb.div_ceil(u64::from(g))
    }

    /// p2p of stage `i` when `per_node` stages share a node (internal units).
    fn p2p(&self, i: usize, per_node: usize) -> u64 {
        if i == 0 {
            0
        } else if i % per_node == 0 {
            self.p2p_inter
        } else {
            self.p2p_intra
        }
    }

    /// Compute part of `w` for layers `[a, b)` on `g` devices (internal units).
    fn compute(&self, a: usize, b: usize, g: u32) -> u64 {
        (self.fwd[b] - self.fwd[a] + self.bwd[b] - self.bwd[a]) * self.q(g)
    }

    /// Peak bytes on one device of a stage `[a, b)` on `g` devices with `in_flight` microbatches.
    fn memory(&self, a: usize, b: usize, g: u32, in_flight: u64) -> u64 {
        let persist = (self.param[b] - self.param[a]).saturating_mul(self.state_factor);
        let act = (self.act[b] - self.act[a])
            .saturating_mul(self.q(g))
            .div_ceil(self.mb);
        persist.saturating_add(act.saturating_mul(in_flight))
    }
}

/// The internal result of one `(n, g)` search.
#[derive(Debug, Clone)]
pub(crate) struct Best {
    /// `T(m)` in internal units.
    pub(crate) objective: u128,
    g: u32,
    cuts: Vec<usize>,
    m: u64,
}

/// Exact `T(m)` of a given layout in internal units, or `None` if memory does not fit.
/// `cuts` are the stage starts after 0 (length `S - 1`, strictly increasing, inside `(0, L)`).
/// Public for brute-force tests.
pub fn evaluate_layout(
    profile: &ModelProfile,
    cluster: &ClusterSpec,
    job: &JobSpec,
    total_nodes: u32,
    g: u32,
    cuts: &[usize],
) -> Option<u128> {
    let c = Costs::new(profile, cluster, job);
    let s = cuts.len() + 1;
    let per_node = (c.big_g / g) as usize;
    if s % per_node != 0 {
        return None;
    }
    let n = (s / per_node) as u32;
    let m = job
        .template_microbatches
        .resolve(n, s as u32, total_nodes, job.global_microbatches);
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(c.l);
    let mut w = Vec::with_capacity(s);
    for i in 0..s {
        let (a, b) = (bounds[i], bounds[i + 1]);
        if a >= b || c.memory(a, b, g, (s - i) as u64) > c.mem {
            return None;
        }
        w.push(c.compute(a, b, g) + c.p2p(i, per_node));
    }
    Some(objective_of(&w, m))
}

/// `T(m)` of stage times `w` (any unit).
pub fn objective_of(w: &[u64], m: u64) -> u128 {
    let wmax = *w.iter().max().expect("at least one stage");
    let k = w.iter().rposition(|&x| x == wmax).expect("max exists");
    let pre: u128 = w[..k].iter().map(|&x| x as u128).sum();
    let after: i128 = w[k + 1..]
        .iter()
        .map(|&x| 2 * x as i128 - wmax as i128)
        .sum();
    pre + m as u128 * wmax as u128 + after.max(0) as u128
}

/// Builds the [`Template`] record of a search result.
fn materialise(c: &Costs, n: u32, best: &Best) -> Template {
    let g = best.g;
    let per_node = (c.big_g / g) as usize;
    let s = best.cuts.len() + 1;
    let mut bounds = vec![0];
    bounds.extend_from_slice(&best.cuts);
    bounds.push(c.l);
    let q = c.q(g);
    let to_ns = |x: u64| x.div_ceil(c.mb);
    let mut stages = Vec::with_capacity(s);
    let mut w_int = Vec::with_capacity(s);
    for i in 0..s {
        let (a, b) = (bounds[i], bounds[i + 1]);
        let p2p = c.p2p(i, per_node);
        w_int.push(c.compute(a, b, g) + p2p);
        stages.push(Stage {
            layer_start: a,
            layer_end: b,
            node: (i / per_node) as u32,
            first_device: ((i % per_node) as u32) * g,
            devices: g,
            forward_ns: to_ns((c.fwd[b] - c.fwd[a]) * q),
            backward_ns: to_ns((c.bwd[b] - c.bwd[a]) * q),
            p2p_ns: to_ns(p2p),
            memory_bytes: c.memory(a, b, g, (s - i) as u64),
        });
    }
    let wmax = *w_int.iter().max().expect("stages");
    let k = w_int.iter().rposition(|&x| x == wmax).expect("max");
    let t1: u64 = stages.iter().map(Stage::time_ns).sum();
    let t3: u64 = stages[k..].iter().map(Stage::time_ns).sum();
    let mut t = Template {
        nodes: n,
        devices_per_node: c.big_g,
        peak_memory_bytes: stages.iter().map(|s| s.memory_bytes).max().unwrap_or(0),
        bottleneck_ns: stages[k].time_ns(),
        stages,
        microbatches: best.m,
        t1_ns: t1,
        t3_ns: t3,
        bottleneck_stage: k,
        iteration_ns: 0,
    };
    t.iteration_ns = t.iteration_ns_for(best.m);
    t
}

/// The best template for exactly `n` nodes, with its exact objective (internal units), or
/// `None` when no layout of `n` nodes fits in memory or `n` has more stages than layers.
pub fn best_template(
    profile: &ModelProfile,
    cluster: &ClusterSpec,
    job: &JobSpec,
    total_nodes: u32,
    n: u32,
) -> Option<(Template, u128)> {
    let c = Costs::new(profile, cluster, job);
    let mut sufs: Vec<(u32, SufTable)> = cluster
        .stage_device_counts()
        .into_iter()
        .rev()
        .map(|g| (g, SufTable::new(c.l)))
        .collect();
    best_for_n(&c, job, total_nodes, n, &mut sufs)
}

fn best_for_n(
    c: &Costs,
    job: &JobSpec,
    total_nodes: u32,
    n: u32,
    sufs: &mut [(u32, SufTable)],
) -> Option<(Template, u128)> {
    let mut best: Option<Best> = None;
    let work = c.fwd[c.l] + c.bwd[c.l];
    let max_layer = (0..c.l)
        .map(|i| c.fwd[i + 1] - c.fwd[i] + c.bwd[i + 1] - c.bwd[i])
        .max()
        .unwrap_or(0);
    // Narrow stages first (usually the best under memory pressure), then skip any width whose
    // lower bound `T >= m * W >= m * max(work * q / S, max layer * q)` cannot beat the best.
    // Ties go to the wider stages (fewer stages).
    for (g, suf) in sufs.iter_mut().rev() {
        let m_of = |s: u32| {
            job.template_microbatches
                .resolve(n, s, total_nodes, job.global_microbatches)
        };
        let s = u64::from(n) * u64::from(c.big_g / *g);
        if s as usize > c.l {
            continue;
        }
        if let Some(b) = &best {
            let q = c.q(*g);
            let w_lb = (work * q).div_ceil(s).max(max_layer * q);
            let lb = u128::from(m_of(s as u32)) * u128::from(w_lb);
            if lb > b.objective {
                continue;
            }
        }
        if let Some(b) = search(c, n, *g, m_of, suf) {
            if best.as_ref().is_none_or(|x| {
                b.objective < x.objective || (b.objective == x.objective && b.g > x.g)
            }) {
                best = Some(b);
            }
        }
    }
    best.map(|b| (materialise(c, n, &b), b.objective))
}

/// Generates `n0` and one template per feasible node count in `[n0, N - f * n0]`.
pub fn generate_templates(
    profile: &ModelProfile,
    cluster: &ClusterSpec,
    job: &JobSpec,
    total_nodes: u32,
) -> Result<TemplateSet, PlanError> {
    profile.validate()?;
    cluster.validate()?;
    job.validate(profile)?;
    let c = Costs::new(profile, cluster, job);
    let mut sufs: Vec<(u32, SufTable)> = cluster
        .stage_device_counts()
        .into_iter()
        .rev()
        .map(|g| (g, SufTable::new(c.l)))
        .collect();
    // No layout has more stages than layers, so n <= L bounds every template.
    let n_cap = c.l as u32;
    let Some((n0, first)) =
        (1..=n_cap).find_map(|n| best_for_n(&c, job, total_nodes, n, &mut sufs).map(|t| (n, t.0)))
    else {
        return Err(finest_split_need(&c));
    };
    let need = u64::from(n0) * (u64::from(job.fault_threshold) + 1);
    if u64::from(total_nodes) < need {
        return Err(PlanError::Infeasible {
            nodes: total_nodes,
            min_nodes: need.min(u64::from(u32::MAX)) as u32,
            pipeline_nodes: n0,
            pipelines: job.fault_threshold + 1,
            state_bytes: c.param[c.l].saturating_mul(c.state_factor),
            node_bytes: c.mem.saturating_mul(u64::from(c.big_g)),
        });
    }
    let n_max = (total_nodes - job.fault_threshold * n0).min(n_cap);
    let mut templates = vec![first];
    for n in (n0 + 1)..=n_max {
        if let Some((t, _)) = best_for_n(&c, job, total_nodes, n, &mut sufs) {
            templates.push(t);
        }
    }
    Ok(TemplateSet {
        min_nodes: n0,
        templates,
        layer_state_bytes: profile
            .layers
            .iter()
            .map(|l| {
                l.param_bytes
                    .saturating_mul(u64::from(job.state_bytes_per_param_byte))
            })
            .collect(),
    })
}

/// What the finest possible split (one layer per stage on `G` devices, `S = L`) needs on a
/// device of its worst stage, as [`PlanError::ModelTooLarge`]. The worst is a layer whose state
/// alone exceeds the device if there is one (no recomputation helps it), else the largest need;
/// the first on ties.
fn finest_split_need(c: &Costs) -> PlanError {
    let in_flight = |i: usize| (c.l - i) as u64;
    let worst = (0..c.l)
        .rev()
        .max_by_key(|&i| {
            let state_too_large = c.memory_parts(i, i + 1, c.big_g).0 > c.mem;
            (state_too_large, c.memory(i, i + 1, c.big_g, in_flight(i)))
        })
        .unwrap_or(0);
    let (state_bytes, per_microbatch) = c.memory_parts(worst, worst + 1, c.big_g);
    PlanError::ModelTooLarge {
        needed_bytes: c.memory(worst, worst + 1, c.big_g, in_flight(worst)),
        device_bytes: c.mem,
        layer: worst,
        state_bytes,
        activation_bytes: per_microbatch.saturating_mul(in_flight(worst)),
        in_flight: in_flight(worst),
        samples_per_device: c.q(c.big_g),
    }
}

impl Costs {
    /// The two parts of [`Costs::memory`]: persistent state, and activations per microbatch.
    fn memory_parts(&self, a: usize, b: usize, g: u32) -> (u64, u64) {
        let persist = (self.param[b] - self.param[a]).saturating_mul(self.state_factor);
        let act = (self.act[b] - self.act[a])
            .saturating_mul(self.q(g))
            .div_ceil(self.mb);
        (persist, act)
    }
}
