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
//! # Exact search without enumerating multisets
//! For a makespan budget `tau`, a pipeline of template `t` can take
//! `cap_t(tau) = floor((tau - alpha_t) / w*_t)` microbatches. A budget is feasible iff some
//! multiset of templates with `sum n_t = N` (and the pipeline-count constraints) has every
//! `cap >= 1` and `sum cap >= B`: an unbounded knapsack over node counts that maximises total
//! capacity, `O(N * T * C)` for `T` templates and `C` tracked pipeline counts (`C = f + 2`
//! normally; `C = B + 1` when `B` is below the largest possible pipeline count, to enforce
//! `P <= B`). A binary search over integer nanoseconds finds the least feasible budget
//! (`O(log T_max)` knapsacks). For the chosen multiset the greedy "next microbatch to the
//! pipeline that would finish it first" split is optimal for linear increasing costs, so it
//! reaches that budget exactly.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use serde::{Deserialize, Serialize};

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
        self.templates
            .iter()
            .find(|t| t.nodes == p.template_nodes)
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
pub fn split_batch(alphas: &[Nanos], slopes: &[Nanos], global: u32) -> Option<Vec<u32>> {
    let p = alphas.len();
    if p == 0 || (global as usize) < p {
        return None;
    }
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
    Some(nb)
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
    let counts = choose_counts(
        set,
        job.global_microbatches,
        job.fault_threshold,
        nodes.len() as u32,
        sync_ns,
    )?;
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

/// Knapsack over node counts. `cmax` tracked pipeline counts; `exact` = counts are exact
/// (else the last bucket means "at least cmax").
struct Knap {
    n: usize,
    cmax: usize,
    exact: bool,
    sizes: Vec<usize>,
}

impl Knap {
    /// `best[j][c]` = max total capacity (capped at `b`), or -1 when unreachable.
    fn run(&self, caps: &[i64], b: i64, mut choice: Option<&mut Vec<(u16, u32)>>) -> Vec<i64> {
        let w = self.cmax + 1;
        let mut best = vec![-1i64; (self.n + 1) * w];
        best[0] = 0;
        if let Some(ch) = choice.as_deref_mut() {
            ch.clear();
            ch.resize((self.n + 1) * w, (u16::MAX, 0));
        }
        for j in 1..=self.n {
            for (t, &sz) in self.sizes.iter().enumerate() {
                if sz > j || caps[t] < 1 {
                    continue;
                }
                let base = (j - sz) * w;
                for c in 0..=self.cmax {
                    let v = best[base + c];
                    if v < 0 {
                        continue;
                    }
                    let c2 = if self.exact {
                        if c + 1 > self.cmax {
                            continue;
                        }
                        c + 1
                    } else {
                        (c + 1).min(self.cmax)
                    };
                    let nv = (v + caps[t]).min(b);
                    let slot = j * w + c2;
                    if nv > best[slot] {
                        best[slot] = nv;
                        if let Some(ch) = choice.as_deref_mut() {
                            ch[slot] = (t as u16, c as u32);
                        }
                    }
                }
            }
        }
        best
    }
}

/// Which pipeline counts a search class accepts.
type CountClass = Box<dyn Fn(usize) -> bool>;

/// Template counts (indexed like `set.templates`) of the best composition for `n` nodes.
pub(crate) fn choose_counts(
    set: &TemplateSet,
    global_microbatches: u32,
    fault_threshold: u32,
    n: u32,
    sync_ns: Nanos,
) -> Result<Vec<u32>, PlanError> {
    let tpls = &set.templates;
    let sizes: Vec<usize> = tpls.iter().map(|t| t.nodes as usize).collect();
    let need = fault_threshold as usize + 1;
    let b = global_microbatches as i64;
    let n_min = sizes.iter().copied().min().unwrap_or(1).max(1);
    let p_max = n as usize / n_min;
    let exact = (b as usize) < p_max;
    let cmax = if exact { b as usize } else { need.max(2) };
    let knap = Knap {
        n: n as usize,
        cmax,
        exact,
        sizes: sizes.clone(),
    };
    // Classes of pipeline counts with their own sync: P == 1 (if allowed) and P >= max(f+1, 2).
    let accept_single = need <= 1;
    let classes: Vec<(CountClass, Nanos)> = {
        let mut v: Vec<(CountClass, Nanos)> = Vec::new();
        if accept_single {
            v.push((Box::new(|c| c == 1), 0));
        }
        v.push((Box::new(move |c| c >= need.max(2)), sync_ns));
        v
    };
    let row = |best: &[i64], f: &dyn Fn(usize) -> bool| -> i64 {
        (0..=cmax)
            .filter(|&c| f(c))
            .map(|c| best[n as usize * (cmax + 1) + c])
            .max()
            .unwrap_or(-1)
    };
    let inf_caps = vec![b; tpls.len()];
    let unlimited = knap.run(&inf_caps, b, None);
    let hi = tpls
        .iter()
        .map(|t| t.iteration_ns_for(b as u64))
        .max()
        .unwrap_or(0);
    let mut best: Option<(Nanos, usize, Nanos)> = None; // (total, class, tau)
    for (ci, (f, sync)) in classes.iter().enumerate() {
        if row(&unlimited, f.as_ref()) < b {
            continue;
        }
        // Least tau with capacity >= B.
        let (mut lo, mut hi) = (0u64, hi);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let caps = capacities(tpls, mid, b);
            if row(&knap.run(&caps, b, None), f.as_ref()) >= b {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        let total = lo + sync;
        if best.is_none_or(|(bt, ..)| total < bt) {
            best = Some((total, ci, lo));
        }
    }
    let Some((_, ci, tau)) = best else {
        // Distinguish "batch too small" from "no composition at all".
        let loose = Knap {
            n: n as usize,
            cmax: need,
            exact: false,
            sizes: sizes.clone(),
        };
        let caps = vec![b.max(1); tpls.len()];
        let r = loose.run(&caps, i64::MAX, None);
        if r[n as usize * (need + 1) + need] >= 0 {
            let min_p = n
                .div_ceil(*sizes.iter().max().unwrap_or(&1) as u32)
                .max(need as u32);
            return Err(PlanError::BatchTooSmall {
                global_microbatches,
                pipelines: min_p,
            });
        }
        return Err(PlanError::NoComposition {
            nodes: n,
            min_pipelines: need as u32,
            sizes: sizes.iter().map(|&s| s as u32).collect(),
        });
    };
    let caps = capacities(tpls, tau, b);
    let mut choice = Vec::new();
    let table = knap.run(&caps, b, Some(&mut choice));
    let f = &classes[ci].0;
    let w = cmax + 1;
    let c_end = (0..=cmax)
        .filter(|&c| f(c) && table[n as usize * w + c] >= b)
        .max_by_key(|&c| (table[n as usize * w + c], Reverse(c)))
        .expect("the budget was feasible for this class");
    let mut counts = vec![0u32; tpls.len()];
    let (mut j, mut c) = (n as usize, c_end);
    while j > 0 {
        let (t, prev_c) = choice[j * w + c];
        counts[t as usize] += 1;
        j -= sizes[t as usize];
        c = prev_c as usize;
    }
    Ok(counts)
}

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
