//! Stragglers: ranks that stay slower than their peers, named from the times every rank
//! reports with its `Ready` (`StepTimes`). In 1F1B the slowest stage sets every pipeline's
//! pace (the others wait for its activations and gradients, then for its all-reduce), so one
//! slow device costs the whole job, while its peers only show it as p2p and collective wait.
//!
//! What is compared is each rank's *compute* (its microbatches' forward and backward): the waits are
//! what a straggler causes in the others, not a sign of their own slowness. Pipelines of
//! different templates give their ranks different work (the planner balances iteration
//! times, not each rank's compute: a single-node pipeline of all layers next to a two-node
//! one of half the layers each, with their own microbatch counts), so a rank is compared
//! with what its peers take *for the same work*: each rank's compute per unit of the work
//! the plan gives it (its pipeline's microbatches x its stage's profiled forward + backward),
//! the median of its peers' rates, times its own work. With equal work this is the plain
//! median of the peers' compute. (In a normal 3-node gpt-tiny job, pipelines [0] and [1, 2]
//! with 2 microbatches each, rank 0 computes 290-330 ms per step, rank 1 (embedding and
//! blocks) 55-85 ms and rank 2 (the LM head and loss) 245-295 ms: by plain medians rank 0
//! would be 1.8-2.1x its peers in every step, a straggler it is not.)
//!
//! A rank is a straggler when that ratio exceeds `--straggler-factor` in each of
//! [`StragglerRule::STEPS`] consecutive committed steps; it is named once per episode, and the
//! episode ends once it has been within the factor for as many steps in a row. The decision
//! is pure ([`StragglerWatch::observe`]); the machine records and acts on it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use super::machine::JobMachine;
use super::membership::drain_verdict;
use super::Action;
use crate::execution::StepTimes;
use crate::planning::Plan;
use crate::runtime::spec::WatchSpec;
use crate::runtime::wire::protocol::RankStatus;
use crate::runtime::wire::records::Event;

/// When a rank is a straggler.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StragglerRule {
    /// Slower than its peers by more than this factor, ...
    pub factor: f64,
    /// ...in this many consecutive steps.
    pub steps: u32,
    /// Drain a straggler's node (`--evict-stragglers`).
    pub evict: bool,
}

impl StragglerRule {
    /// Five steps: single slow steps are what a loaded machine, a page-cache miss or a busy
    /// neighbour cause, and naming those would train users to ignore the report. Measured on
    /// the shared 2-core test machine (normal gpt-tiny jobs, 20-30 steps, 3 nodes = pipelines
    /// [0] and [1, 2], and 4 nodes): single steps reach 2.3x and 2.8x what the peers take for
    /// the same work (4.1x once, on a rank computing 55 ms), but no rank stays above 1.25x
    /// for five steps in a row, while a rank slowed 2 x 300 ms per step stays at 2.3-3.2x.
    /// At the 0.1-1 s steps of the jobs we run five steps name a straggler within seconds;
    /// evicting it costs a reconfiguration (about a second plus a step, `oobleck bench
    /// recovery`), which five steps at 1.5x already exceed.
    pub const STEPS: u32 = 5;
    /// Below this excess a rank is never slow: timer noise of sub-millisecond computes is
    /// not what holds a pipeline back.
    pub const MIN_EXCESS_MS: f64 = 1.0;

    pub fn of(w: &WatchSpec) -> StragglerRule {
        StragglerRule {
            factor: w.straggler_factor,
            steps: Self::STEPS,
            evict: w.evict_stragglers,
        }
    }
}

impl Default for StragglerRule {
    fn default() -> Self {
        StragglerRule::of(&WatchSpec::default())
    }
}

/// One rank's compute in a step, and the work the plan gives it (any unit; only ratios
/// between ranks count).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankCompute {
    pub rank: u32,
    pub compute_ms: f64,
    pub work: f64,
}

/// A rank named a straggler at `step`: over the last `steps` steps it computed `compute_ms`
/// per step (mean) where its peers took `peers_median_ms` for the same work, `factor` times
/// less.
#[derive(Debug, Clone, PartialEq)]
pub struct Straggler {
    pub rank: u32,
    pub step: u64,
    pub compute_ms: f64,
    pub peers_median_ms: f64,
    pub factor: f64,
    pub steps: u32,
}

/// One rank in one step: its compute and what its peers took for its work.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Seen {
    compute_ms: f64,
    peers_ms: f64,
}

impl Seen {
    fn slow(&self, factor: f64) -> bool {
        self.compute_ms > factor * self.peers_ms
            && self.compute_ms - self.peers_ms >= StragglerRule::MIN_EXCESS_MS
    }
}

/// The recent steps of one generation and the ranks named in them.
#[derive(Debug, Clone, Default)]
pub struct StragglerWatch {
    /// The last `rule.steps` consecutive committed steps, oldest first.
    window: VecDeque<(u64, BTreeMap<u32, Seen>)>,
    /// Ranks in an episode (named, not yet recovered).
    named: BTreeSet<u32>,
}

impl StragglerWatch {
    /// Ranks are renumbered by a new generation: what was seen is about other ranks.
    pub fn reset(&mut self) {
        self.window.clear();
        self.named.clear();
    }

    /// Ranks in an episode now.
    pub fn named(&self) -> &BTreeSet<u32> {
        &self.named
    }

    /// Committed `step`'s computes (the ranks that said); the ranks named stragglers by it.
    pub fn observe(
        &mut self,
        rule: &StragglerRule,
        step: u64,
        ranks: &[RankCompute],
    ) -> Vec<Straggler> {
        let n = rule.steps.max(1) as usize;
        if self.window.back().is_some_and(|(s, _)| s + 1 != step) {
            // A step went by unseen (or was replayed): the run of steps starts again.
            self.window.clear();
        }
        self.window.push_back((step, against_peers(ranks)));
        while self.window.len() > n {
            self.window.pop_front();
        }
        if self.window.len() < n {
            return Vec::new();
        }
        let ranks: BTreeSet<u32> = self
            .window
            .iter()
            .flat_map(|(_, m)| m.keys())
            .copied()
            .collect();
        let mut out = Vec::new();
        for rank in ranks {
            let seen: Vec<Seen> = self
                .window
                .iter()
                .filter_map(|(_, m)| m.get(&rank).copied())
                .collect();
            let slow = seen.iter().filter(|s| s.slow(rule.factor)).count();
            if slow == n && self.named.insert(rank) {
                let mean = |f: fn(&Seen) -> f64| seen.iter().map(f).sum::<f64>() / n as f64;
                let (compute_ms, peers_median_ms) = (mean(|s| s.compute_ms), mean(|s| s.peers_ms));
                out.push(Straggler {
                    rank,
                    step,
                    compute_ms,
                    peers_median_ms,
                    factor: compute_ms / peers_median_ms.max(1e-9),
                    steps: n as u32,
                });
            } else if slow == 0 && seen.len() == n {
                self.named.remove(&rank);
            }
        }
        out
    }
}

/// The machine's straggler group: the rule and what it saw of the running generation. Only
/// this file changes it.
#[derive(Debug, Clone, Default)]
pub(super) struct Stragglers {
    rule: StragglerRule,
    watch: StragglerWatch,
}

impl Stragglers {
    /// Names stragglers by `rule` from now on.
    pub(super) fn set_rule(&mut self, rule: StragglerRule) {
        self.rule = rule;
    }

    /// A new generation renumbers the ranks: what was seen is about other ranks.
    pub(super) fn new_generation(&mut self) {
        self.watch.reset();
    }

    /// The rule, for tests that change it on a running machine.
    #[cfg(test)]
    pub(super) fn rule_mut(&mut self) -> &mut StragglerRule {
        &mut self.rule
    }
}

/// Each rank's compute next to its peers' median rate times its own work.
fn against_peers(ranks: &[RankCompute]) -> BTreeMap<u32, Seen> {
    let usable: Vec<&RankCompute> = ranks
        .iter()
        .filter(|r| r.work > 0.0 && r.compute_ms.is_finite() && r.compute_ms >= 0.0)
        .collect();
    usable
        .iter()
        .filter_map(|r| {
            let rates: Vec<f64> = usable
                .iter()
                .filter(|o| o.rank != r.rank)
                .map(|o| o.compute_ms / o.work)
                .collect();
            let peers_ms = median(rates)? * r.work;
            Some((
                r.rank,
                Seen {
                    compute_ms: r.compute_ms,
                    peers_ms,
                },
            ))
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    })
}

/// The compute each rank of `plan` is given per step: its pipeline's microbatches times its
/// stage's profiled forward + backward per microbatch (ns). Ranks of no stage are left out.
pub fn planned_work(plan: &Plan) -> BTreeMap<u32, f64> {
    let g = plan.devices_per_node;
    let mut work = BTreeMap::new();
    for p in &plan.pipelines {
        for s in &plan.template_of(p).stages {
            let per_mb = (s.forward_ns + s.backward_ns) as f64;
            for d in s.first_device..s.first_device + s.devices {
                let rank = p.first_rank + s.node * g + d;
                work.insert(rank, f64::from(p.microbatches) * per_mb);
            }
        }
    }
    work
}

impl JobMachine {
    /// Committed `step`'s times: names the ranks that became stragglers with it (draining
    /// their nodes with `--evict-stragglers`) and shows every rank's times to status.
    pub(super) fn on_step_times(
        &mut self,
        now: Duration,
        step: u64,
        times: &BTreeMap<u32, StepTimes>,
    ) {
        let Some(g) = self.gen.as_ref() else { return };
        if times.is_empty() {
            return;
        }
        let mut work = planned_work(&g.plan);
        if times.keys().any(|r| work.get(r).is_none_or(|w| *w <= 0.0)) {
            // A profile without compute times: compare plain computes.
            work = times.keys().map(|&r| (r, 1.0)).collect();
        }
        let ranks: Vec<RankCompute> = times
            .iter()
            .map(|(&rank, t)| RankCompute {
                rank,
                compute_ms: t.compute_ms,
                work: work[&rank],
            })
            .collect();
        let Stragglers { rule, watch } = &mut self.stragglers;
        for s in watch.observe(rule, step, &ranks) {
            self.on_straggler(now, s);
        }
        let Some(g) = self.gen.as_ref() else { return };
        let named = self.stragglers.watch.named();
        let ranks = times
            .iter()
            .filter_map(|(&rank, &times)| {
                Some(RankStatus {
                    rank,
                    node: g.node_of(rank)?,
                    times,
                    straggler: named.contains(&rank),
                })
            })
            .collect();
        self.push(Action::RankTimes { step, ranks });
    }

    /// `s` was just named: said, recorded, and its node drained if asked and possible.
    fn on_straggler(&mut self, now: Duration, s: Straggler) {
        let Some(node) = self.gen.as_ref().and_then(|g| g.node_of(s.rank)) else {
            return;
        };
        let evict = self.stragglers.rule.evict && s.step < self.spec.steps;
        let verdict = match evict {
            false => None,
            true if self.membership.is_draining(node) => Some(Ok(())),
            true => Some(drain_verdict(&self.drain_case(node, false)).map(|_| ())),
        };
        let mut note = format!(
            "rank {} on node {node} is a straggler: compute {:.0} ms per step vs its peers' \
             {:.0} ms ({:.1}x) for {} steps; in 1F1B it holds every pipeline back",
            s.rank, s.compute_ms, s.peers_median_ms, s.factor, s.steps
        );
        match &verdict {
            None if !self.stragglers.rule.evict => note.push_str(&format!(
                " (`oobleck drain {node}`, or --evict-stragglers, takes its node out)"
            )),
            // The last step: nothing left to drain it for.
            None => {}
            Some(Ok(())) => note.push_str(&format!(
                "; --evict-stragglers: node {node} drains at the next step boundary"
            )),
            Some(Err(why)) => note.push_str(&format!(
                "; --evict-stragglers: node {node} is not drained ({why}); training goes on"
            )),
        }
        self.note(note);
        let evicted = matches!(verdict, Some(Ok(())));
        let drain_now = evicted && !self.membership.is_draining(node);
        self.record(Event::Straggler {
            generation: self.generation,
            step: s.step,
            node,
            rank: s.rank,
            compute_ms: s.compute_ms,
            peers_median_ms: s.peers_median_ms,
            factor: s.factor,
            steps: s.steps,
            evicted,
            refusal: verdict.and_then(Result::err),
        });
        if drain_now {
            let reason = format!(
                "straggler: rank {} computes {:.1}x its peers",
                s.rank, s.factor
            );
            self.on_drain_requested(now, node, reason, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(factor: f64) -> StragglerRule {
        StragglerRule {
            factor,
            steps: 5,
            evict: false,
        }
    }

    /// Ranks of equal work computing `ms[i]`.
    fn even(ms: &[f64]) -> Vec<RankCompute> {
        ms.iter()
            .enumerate()
            .map(|(i, &compute_ms)| RankCompute {
                rank: i as u32,
                compute_ms,
                work: 1.0,
            })
            .collect()
    }

    /// Each step's computes, and the `(step, rank)`s named.
    type Steps = Vec<Vec<RankCompute>>;
    type Named = Vec<(u64, u32)>;

    /// Feeds steps `first..` with `per_step[i]`; the ranks named at each step.
    fn run(
        w: &mut StragglerWatch,
        r: &StragglerRule,
        first: u64,
        per_step: &[Vec<RankCompute>],
    ) -> Vec<(u64, u32)> {
        let mut out = Vec::new();
        for (i, ranks) in per_step.iter().enumerate() {
            let step = first + i as u64;
            out.extend(
                w.observe(r, step, ranks)
                    .into_iter()
                    .map(|s| (step, s.rank)),
            );
        }
        out
    }

    #[test]
    fn a_rank_slow_for_five_steps_in_a_row_is_named_once_with_the_numbers() {
        let mut w = StragglerWatch::default();
        let steps: Vec<_> = (0..9)
            .map(|_| even(&[100.0, 310.0, 120.0, 110.0]))
            .collect();
        let named = run(&mut w, &rule(1.5), 1, &steps[..5]);
        assert_eq!(named, [(5, 1)]);
        let mut w = StragglerWatch::default();
        let s = (1..=5)
            .flat_map(|step| w.observe(&rule(1.5), step, &steps[0]))
            .next()
            .expect("named at step 5");
        // Its peers' median: 110 ms (of 100, 110, 120).
        assert_eq!((s.rank, s.step, s.steps), (1, 5, 5));
        assert!((s.compute_ms - 310.0).abs() < 1e-9 && (s.peers_median_ms - 110.0).abs() < 1e-9);
        assert!((s.factor - 310.0 / 110.0).abs() < 1e-9, "{s:?}");
        // Still slow: not named again.
        assert!(run(&mut w, &rule(1.5), 6, &steps[5..]).is_empty());
    }

    #[test]
    fn slow_steps_that_are_not_consecutive_name_nobody() {
        // (computes of ranks 0..3 per step) -> ranks named
        let fast = even(&[100.0, 100.0, 100.0]);
        let slow = even(&[100.0, 200.0, 100.0]);
        let table: Vec<(Steps, Named)> = vec![
            // Four slow steps, one fast, four slow: never five in a row.
            (
                [
                    vec![slow.clone(); 4],
                    vec![fast.clone()],
                    vec![slow.clone(); 4],
                ]
                .concat(),
                vec![],
            ),
            // Exactly at the factor is not above it.
            (vec![even(&[100.0, 150.0, 100.0]); 8], vec![]),
            // Just above it, five times: named at the fifth.
            (vec![even(&[100.0, 151.0, 100.0]); 5], vec![(5, 1)]),
            // Fewer than five steps seen.
            (vec![slow.clone(); 4], vec![]),
            // Two ranks of two: each is the other's peer; the slow one is named.
            (vec![even(&[100.0, 400.0]); 5], vec![(5, 1)]),
            // One rank: no peers, nothing to compare.
            (vec![even(&[500.0]); 6], vec![]),
            // Tiny computes: 0.6 ms against 0.2 ms is noise, not a straggler.
            (vec![even(&[0.2, 0.6, 0.2]); 6], vec![]),
        ];
        for (i, (steps, want)) in table.into_iter().enumerate() {
            let mut w = StragglerWatch::default();
            assert_eq!(run(&mut w, &rule(1.5), 1, &steps), want, "case {i}");
        }
    }

    #[test]
    fn a_straggler_is_named_again_only_after_it_recovered_for_as_many_steps() {
        let mut w = StragglerWatch::default();
        let (fast, slow) = (even(&[100.0, 100.0, 100.0]), even(&[100.0, 300.0, 100.0]));
        let r = rule(1.5);
        assert_eq!(run(&mut w, &r, 1, &vec![slow.clone(); 5]), [(5, 1)]);
        // Fast for four steps, slow again: the same episode.
        let back = [vec![fast.clone(); 4], vec![slow.clone(); 5]].concat();
        assert!(run(&mut w, &r, 6, &back).is_empty());
        assert_eq!(w.named().iter().copied().collect::<Vec<_>>(), [1]);
        // Fast for five: recovered; five slow steps later it is named again.
        let again = [vec![fast.clone(); 5], vec![slow.clone(); 5]].concat();
        assert_eq!(run(&mut w, &r, 15, &again), [(24, 1)]);
    }

    #[test]
    fn a_gap_in_the_steps_or_a_new_generation_starts_the_count_again() {
        let slow = even(&[100.0, 300.0, 100.0]);
        let r = rule(1.5);
        let mut w = StragglerWatch::default();
        assert!(run(&mut w, &r, 1, &vec![slow.clone(); 4]).is_empty());
        // Steps 3 and on replayed after a failure: the run restarts at step 3.
        assert!(run(&mut w, &r, 3, &vec![slow.clone(); 4]).is_empty());
        assert_eq!(run(&mut w, &r, 7, std::slice::from_ref(&slow)), [(7, 1)]);
        // A new generation renumbers the ranks: named again, five steps into it.
        w.reset();
        assert!(w.named().is_empty());
        assert_eq!(run(&mut w, &r, 8, &vec![slow.clone(); 5]), [(12, 1)]);
    }

    #[test]
    fn ranks_with_different_planned_work_are_compared_for_the_same_work() {
        // Rank 0: a one-node pipeline of every layer with 1 microbatch; ranks 1 and 2: the two
        // halves of a two-node pipeline with 3 microbatches (each 1.5x rank 0's work).
        let ranks = |c0: f64, c1: f64, c2: f64| {
            vec![
                RankCompute {
                    rank: 0,
                    compute_ms: c0,
                    work: 2.0,
                },
                RankCompute {
                    rank: 1,
                    compute_ms: c1,
                    work: 3.0,
                },
                RankCompute {
                    rank: 2,
                    compute_ms: c2,
                    work: 3.0,
                },
            ]
        };
        let r = rule(1.5);
        // Computing as planned: 100 ms vs 150 ms is their work, not a straggler.
        let mut w = StragglerWatch::default();
        assert!(run(&mut w, &r, 1, &vec![ranks(100.0, 150.0, 150.0); 8]).is_empty());
        // Rank 0 at 2x its rate: named, against the 100 ms its peers would take.
        let mut w = StragglerWatch::default();
        let named: Vec<Straggler> = (1..=5)
            .flat_map(|s| w.observe(&r, s, &ranks(200.0, 150.0, 150.0)))
            .collect();
        assert_eq!(named.len(), 1);
        assert_eq!(named[0].rank, 0);
        assert!((named[0].peers_median_ms - 100.0).abs() < 1e-9, "{named:?}");
        // Ranks that do not say (or have no work) are left out, not taken as zero.
        let mut odd = ranks(100.0, 150.0, 150.0);
        odd[1].work = 0.0;
        let mut w = StragglerWatch::default();
        assert!(run(&mut w, &r, 1, &vec![odd; 6]).is_empty());
    }

    #[test]
    fn planned_work_follows_the_pipelines_microbatches_and_stages() {
        // Pipelines [0] and [1, 2] with 1 and 3 microbatches; stage F + B of 10 + 20 (the
        // one-node template), 4 + 8 and 6 + 12 (the two-node one).
        let mut plan = crate::runtime::job::tests::plan(&[&[0], &[1, 2]]);
        plan.pipelines[0].microbatches = 1;
        plan.pipelines[1].microbatches = 3;
        for t in &mut plan.templates {
            let ns: &[u64] = if t.nodes == 1 { &[10] } else { &[4, 6] };
            for (s, &f) in t.stages.iter_mut().zip(ns) {
                (s.forward_ns, s.backward_ns) = (f, 2 * f);
            }
        }
        let got: Vec<(u32, f64)> = planned_work(&plan).into_iter().collect();
        assert_eq!(got, [(0, 30.0), (1, 36.0), (2, 54.0)]);
    }
}
