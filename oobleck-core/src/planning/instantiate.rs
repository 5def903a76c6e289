//! Instantiation: how many pipelines of each template, on which nodes, with how many
//! microbatches each.
//!
//! # Objective
//! `iteration = max_p T_p(nb_p) + sync(P)` with `T_p(nb) = alpha_p + nb * w*_p` (linear, see
//! [`Template::iteration_ns_for`]), `nb_p >= 1`, `sum nb_p = B`, node counts summing to exactly
//! `N`, `P >= f + 1` pipelines. `sync` is the exposed gradient all-reduce: the layers' reductions
//! overlap the backward pass except the last one, layer 0's, so `sync` = one bandwidth-bound
//! ring all-reduce of layer 0's gradient across nodes, `2 * bytes / bw + 2 * latency`, and 0
//! for a single pipeline. (The ring's `(P-1)/P` factor is dropped, an upper bound within 2x, so
//! `sync` does not depend on `P` beyond `P = 1` vs `P > 1` and the search stays a knapsack.)
//!
//! The exact search for the template counts is in [`super::compose`]; here the counts become
//! pipelines on nodes, with ranks and the batch split.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use serde::{Deserialize, Serialize};

use super::compose::{choose_counts, choose_counts_degraded};
use super::profile::{ns_to_ms, ClusterSpec, JobSpec, ModelProfile, Nanos};
use super::template::{Template, TemplateSet};
use super::PlanError;

/// One pipeline: a template bound to nodes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pipeline {
    /// Stable identity; kept across reconfigurations while the pipeline survives.
    pub id: u32,
    /// Node count of its template (templates are keyed by node count).
    pub template_nodes: u32,
    /// Node ids in stage order: node `j` of the template runs on `nodes[j]`.
    pub nodes: Vec<u32>,
    /// Global rank of device 0 of `nodes[0]`; the pipeline owns ranks
    /// `first_rank .. first_rank + nodes.len() * G`, node `j` device `d` being
    /// `first_rank + j * G + d`.
    pub first_rank: u32,
    /// Microbatches per iteration.
    pub microbatches: u32,
    /// `T(microbatches)` of its template, ns.
    pub predicted_ns: Nanos,
}

/// A cluster plan for one generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// Bumped on every reconfiguration.
    pub generation: u64,
    /// `G`.
    pub devices_per_node: u32,
    /// `f`.
    pub fault_threshold: u32,
    /// `B`, microbatches per iteration (never changes during a run).
    pub global_microbatches: u32,
    /// Fewest nodes per pipeline.
    pub min_nodes: u32,
    /// All templates (ascending node count).
    pub templates: Vec<Template>,
    /// Pipelines in rank order.
    pub pipelines: Vec<Pipeline>,
    /// Slowest pipeline, ns.
    pub compute_ns: Nanos,
    /// Exposed gradient sync of this plan, ns (0 for one pipeline).
    pub sync_ns: Nanos,
    /// Exposed gradient sync whenever there is more than one pipeline, ns.
    pub sync_model_ns: Nanos,
    /// Bytes of training state (parameters + gradients + optimizer) per layer: what a layer
    /// copy moves.
    pub layer_state_bytes: Vec<u64>,
    /// `compute_ns + sync_ns`.
    pub iteration_ns: Nanos,
}

impl Plan {
    /// The template of `p`.
    pub fn template_of(&self, p: &Pipeline) -> &Template {
        // Templates are kept in ascending node count.
        self.templates
            .binary_search_by_key(&p.template_nodes, |t| t.nodes)
            .map(|i| &self.templates[i])
            .expect("every pipeline of a plan has a template in the plan")
    }

    /// Total nodes.
    pub fn num_nodes(&self) -> u32 {
        self.pipelines.iter().map(|p| p.nodes.len() as u32).sum()
    }

    /// Microbatch counts in pipeline order.
    pub fn batch_split(&self) -> Vec<u32> {
        self.pipelines.iter().map(|p| p.microbatches).collect()
    }

    /// Predicted iteration time, ms.
    pub fn iteration_ms(&self) -> f64 {
        ns_to_ms(self.iteration_ns)
    }

    /// The template set the plan was made from.
    pub fn template_set(&self) -> TemplateSet {
        TemplateSet {
            min_nodes: self.min_nodes,
            templates: self.templates.clone(),
            layer_state_bytes: self.layer_state_bytes.clone(),
        }
    }

    /// Every node of the plan.
    pub fn nodes(&self) -> Vec<u32> {
        self.pipelines
            .iter()
            .flat_map(|p| p.nodes.iter().copied())
            .collect()
    }
}

/// Exposed gradient-sync time for more than one pipeline (see the module docs).
pub fn gradient_sync_ns(profile: &ModelProfile, cluster: &ClusterSpec) -> Nanos {
    let bytes = profile.layers.first().map_or(0, |l| l.param_bytes);
    2 * cluster.inter_node.transfer_ns(bytes)
}

/// Splits `global` microbatches over pipelines with `T_p(nb) = alpha_p + nb * slope_p`,
/// `nb_p >= 1`, minimising the slowest. Ties go to the lower index. Returns `None` when
/// `global < alphas.len()`.
///
/// The greedy "next microbatch to the pipeline that would finish it first" (ties: lower index)
/// takes the `global - P` smallest *slots* `(alpha_p + k * slope_p, p)`, `k >= 2`, in that
/// order, since each pipeline's slots only grow. So a search finds the time `T` of the last
/// slot taken: every slot before `T` is taken, and the rest at exactly `T` go by index. That
/// is `O(P log T)` instead of a heap's `O(B log P)` (160,000 microbatches over 2,500 pipelines
/// at 10,000 nodes). A zero slope (infinitely many slots at one time) keeps the heap.
pub fn split_batch(alphas: &[Nanos], slopes: &[Nanos], global: u32) -> Option<Vec<u32>> {
    let p = alphas.len();
    if p == 0 || (global as usize) < p {
        return None;
    }
    if slopes.contains(&0) {
        return Some(split_batch_greedy(alphas, slopes, global));
    }
    let extra = u64::from(global) - p as u64;
    // Slots of pipeline i at or before `t`: k in 2..=(t - alpha) / slope.
    let slots = |i: usize, t: Nanos| match t.checked_sub(alphas[i]) {
        Some(d) => (d / slopes[i]).saturating_sub(1),
        None => 0,
    };
    // Pipelines of one template share `(alpha, slope)`: the search counts each distinct pair
    // once, times how many pipelines have it (thousands of pipelines, a handful of pairs).
    let mut distinct: Vec<(Nanos, Nanos, u64)> = Vec::new();
    {
        let mut pairs: Vec<(Nanos, Nanos)> =
            alphas.iter().copied().zip(slopes.iter().copied()).collect();
        pairs.sort_unstable();
        for (a, b) in pairs {
            match distinct.last_mut() {
                Some(last) if (last.0, last.1) == (a, b) => last.2 += 1,
                _ => distinct.push((a, b, 1)),
            }
        }
    }
    let count = |t: Nanos| {
        let per = |&(a, b, m): &(Nanos, Nanos, u64)| match t.checked_sub(a) {
            Some(d) => (d / b).saturating_sub(1).saturating_mul(m),
            None => 0,
        };
        distinct.iter().map(per).fold(0u64, u64::saturating_add)
    };
    let mut nb = vec![1u32; p];
    if extra == 0 {
        return Some(nb);
    }
    let (mut lo, mut hi) = (0u64, Nanos::MAX);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if count(mid) >= extra {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let t = lo;
    let mut left = extra;
    for (i, n) in nb.iter_mut().enumerate() {
        let before = slots(i, t - 1);
        *n += before as u32;
        left -= before;
    }
    for (i, n) in nb.iter_mut().enumerate() {
        if left == 0 {
            break;
        }
        if slots(i, t) > slots(i, t - 1) {
            *n += 1;
            left -= 1;
        }
    }
    Some(nb)
}

/// The greedy split itself, one microbatch at a time from a heap (also for zero slopes).
fn split_batch_greedy(alphas: &[Nanos], slopes: &[Nanos], global: u32) -> Vec<u32> {
    let p = alphas.len();
    let mut nb = vec![1u32; p];
    let mut heap: BinaryHeap<Reverse<(Nanos, usize)>> = (0..p)
        .map(|i| Reverse((alphas[i].saturating_add(2 * slopes[i]), i)))
        .collect();
    for _ in p..global as usize {
        let Reverse((_, i)) = heap.pop().expect("p > 0");
        nb[i] += 1;
        let next = alphas[i].saturating_add(u64::from(nb[i] + 1).saturating_mul(slopes[i]));
        heap.push(Reverse((next, i)));
    }
    nb
}

/// Plans from scratch: templates are generated for `nodes.len()` nodes.
pub fn instantiate(
    profile: &ModelProfile,
    cluster: &ClusterSpec,
    job: &JobSpec,
    nodes: &[u32],
) -> Result<Plan, PlanError> {
    let set = super::template::generate_templates(profile, cluster, job, nodes.len() as u32)?;
    instantiate_with_sizes(
        &set,
        job,
        cluster.devices_per_node,
        gradient_sync_ns(profile, cluster),
        nodes,
        0,
    )
}

/// Chooses template counts and the batch split for `nodes` (ids, in the order ranks are
/// given) using an existing template set.
pub fn instantiate_with_sizes(
    set: &TemplateSet,
    job: &JobSpec,
    devices_per_node: u32,
    sync_ns: Nanos,
    nodes: &[u32],
    generation: u64,
) -> Result<Plan, PlanError> {
    instantiate_by(
        choose_counts,
        set,
        job,
        devices_per_node,
        sync_ns,
        nodes,
        generation,
    )
}

/// [`instantiate_with_sizes`] when `nodes` may be too few for `f + 1` pipelines or fit no
/// exact cover: degraded as a reconfiguration degrades (fewer replicas first, then fewer
/// nodes; the last nodes are left spare). The plan keeps `job`'s `f` as its target, as a
/// reconfiguration's plans do, so that later joins restore it.
pub fn instantiate_degraded(
    set: &TemplateSet,
    job: &JobSpec,
    devices_per_node: u32,
    sync_ns: Nanos,
    nodes: &[u32],
    generation: u64,
) -> Result<Plan, PlanError> {
    instantiate_by(
        choose_counts_degraded,
        set,
        job,
        devices_per_node,
        sync_ns,
        nodes,
        generation,
    )
}

/// How template counts are chosen (`compose::choose_counts` or its degraded form).
type ChooseCounts = fn(&TemplateSet, u32, u32, u32, Nanos, &[u32]) -> Result<Vec<u32>, PlanError>;

/// The plan of the counts `choose` picks for `nodes`.
fn instantiate_by(
    choose: ChooseCounts,
    set: &TemplateSet,
    job: &JobSpec,
    devices_per_node: u32,
    sync_ns: Nanos,
    nodes: &[u32],
    generation: u64,
) -> Result<Plan, PlanError> {
    let n = nodes.len() as u32;
    let counts = choose(
        set,
        job.global_microbatches,
        job.fault_threshold,
        n,
        sync_ns,
        &[],
    )?;
    plan_of_counts(
        set,
        job,
        devices_per_node,
        sync_ns,
        nodes,
        &counts,
        generation,
    )
}

/// The plan of `counts` pipelines per template over the first of `nodes`.
fn plan_of_counts(
    set: &TemplateSet,
    job: &JobSpec,
    devices_per_node: u32,
    sync_ns: Nanos,
    nodes: &[u32],
    counts: &[u32],
    generation: u64,
) -> Result<Plan, PlanError> {
    // Pipelines by ascending template size, contiguous node blocks.
    let mut sizes: Vec<usize> = Vec::new();
    for (t, &c) in counts.iter().enumerate() {
        sizes.extend(std::iter::repeat_n(t, c as usize));
    }
    let mut groups = Vec::with_capacity(sizes.len());
    let mut off = 0usize;
    for &t in &sizes {
        let n = set.templates[t].nodes as usize;
        groups.push((t, nodes[off..off + n].to_vec()));
        off += n;
    }
    let ids: Vec<u32> = (0..groups.len() as u32).collect();
    let ctx = Ctx {
        global_microbatches: job.global_microbatches,
        fault_threshold: job.fault_threshold,
        devices_per_node,
        sync_ns,
    };
    assemble(set, &ctx, groups, &ids, generation)
}

/// A plan with the given pipelines (node ids in stage order), e.g. pinned by the user
/// (`--pipeline-nodes`) or in tests. Each pipeline needs a template of its size.
pub fn plan_with_pipelines(
    set: &TemplateSet,
    job: &JobSpec,
    devices_per_node: u32,
    sync_ns: Nanos,
    pipelines: Vec<Vec<u32>>,
) -> Result<Plan, PlanError> {
    let sizes: Vec<u32> = set.templates.iter().map(|t| t.nodes).collect();
    let mut groups = Vec::with_capacity(pipelines.len());
    for nodes in pipelines {
        let t = sizes
            .iter()
            .position(|&s| s as usize == nodes.len())
            .ok_or_else(|| PlanError::NoComposition {
                nodes: nodes.len() as u32,
                min_pipelines: 1,
                sizes: sizes.clone(),
            })?;
        groups.push((t, nodes));
    }
    let ids: Vec<u32> = (0..groups.len() as u32).collect();
    let ctx = Ctx {
        global_microbatches: job.global_microbatches,
        fault_threshold: job.fault_threshold,
        devices_per_node,
        sync_ns,
    };
    assemble(set, &ctx, groups, &ids, 0)
}

/// What [`assemble`] needs besides the groups.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ctx {
    pub(crate) global_microbatches: u32,
    pub(crate) fault_threshold: u32,
    pub(crate) devices_per_node: u32,
    pub(crate) sync_ns: Nanos,
}

impl Ctx {
    pub(crate) fn of(plan: &Plan) -> Self {
        Ctx {
            global_microbatches: plan.global_microbatches,
            fault_threshold: plan.fault_threshold,
            devices_per_node: plan.devices_per_node,
            sync_ns: plan.sync_model_ns,
        }
    }
}

/// Builds a plan from `(template index, nodes)` groups with pipeline `ids`: ranks and the
/// batch split.
pub(crate) fn assemble(
    set: &TemplateSet,
    ctx: &Ctx,
    groups: Vec<(usize, Vec<u32>)>,
    ids: &[u32],
    generation: u64,
) -> Result<Plan, PlanError> {
    let devices_per_node = ctx.devices_per_node;
    let alphas: Vec<Nanos> = groups
        .iter()
        .map(|(t, _)| set.templates[*t].alpha_ns())
        .collect();
    let slopes: Vec<Nanos> = groups
        .iter()
        .map(|(t, _)| set.templates[*t].bottleneck_ns)
        .collect();
    let nb =
        split_batch(&alphas, &slopes, ctx.global_microbatches).ok_or(PlanError::BatchTooSmall {
            global_microbatches: ctx.global_microbatches,
            pipelines: groups.len() as u32,
        })?;
    let mut pipelines = Vec::with_capacity(groups.len());
    let mut rank = 0u32;
    for (i, (t, nodes)) in groups.into_iter().enumerate() {
        let tpl = &set.templates[t];
        let n = nodes.len() as u32;
        pipelines.push(Pipeline {
            id: ids[i],
            template_nodes: tpl.nodes,
            nodes,
            first_rank: rank,
            microbatches: nb[i],
            predicted_ns: tpl.iteration_ns_for(u64::from(nb[i])),
        });
        rank += n * devices_per_node;
    }
    let compute = pipelines.iter().map(|p| p.predicted_ns).max().unwrap_or(0);
    let sync = if pipelines.len() > 1 { ctx.sync_ns } else { 0 };
    Ok(Plan {
        generation,
        devices_per_node,
        fault_threshold: ctx.fault_threshold,
        global_microbatches: ctx.global_microbatches,
        min_nodes: set.min_nodes,
        templates: set.templates.clone(),
        pipelines,
        compute_ns: compute,
        sync_ns: sync,
        sync_model_ns: ctx.sync_ns,
        layer_state_bytes: set.layer_state_bytes.clone(),
        iteration_ns: compute + sync,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn the_searched_split_is_the_greedy_split() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
        for _ in 0..2000 {
            let p = rng.random_range(1..8usize);
            let alphas: Vec<Nanos> = (0..p).map(|_| rng.random_range(0..60)).collect();
            // Small ranges make ties between pipelines common.
            let slopes: Vec<Nanos> = (0..p).map(|_| rng.random_range(1..6)).collect();
            let global = rng.random_range(p as u32..60);
            assert_eq!(
                split_batch(&alphas, &slopes, global),
                Some(split_batch_greedy(&alphas, &slopes, global)),
                "alphas {alphas:?} slopes {slopes:?} global {global}"
            );
        }
        assert_eq!(split_batch(&[0, 0], &[0, 3], 5), Some(vec![4, 1]));
    }
}
