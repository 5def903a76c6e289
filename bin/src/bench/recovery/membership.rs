//! The drain + join run, its pure part: when the bench drains a node and adds one (from the
//! flags), which reconfigurations of the run they became, and the targets they are held to.
//!
//! **What a join or drain costs.** Either is asked for at any time (`oobleck drain`, or an
//! `oobleck add-node` agent registering); the master takes it at the next step boundary, so
//! the step under way finishes first: the job trains while it waits, up to one step by design
//! (`wait_boundary_s`). From that boundary the job stops, reconfigures and computes the next
//! step, which commits `since_failure_s` after the boundary. Without the reconfiguration that
//! commit would have come one step time after it, so the cost, the training time lost, is
//!
//! ```text
//! cost = since_failure_s - step        (step: the fault-free run's median step time)
//! ```
//!
//! and the targets are **a drain costs under 1 s, a join under 1.5 s**, checked as boundary ->
//! next commit under 1 s + step and 1.5 s + step (the form of the failure target, 1.5 s +
//! step). The table also shows request -> next commit = `wait_boundary_s + since_failure_s`,
//! what a user waits for, unchecked: the wait is training time. Both must replay no step.

use anyhow::{bail, Result};
use serde::Serialize;

use super::records::Event;
use super::summary::{check, Check, Recovery, RunInput, RunSummary};
use super::BenchRecoveryArgs;

/// A drain may cost this much (s) over the step it delays.
pub const DRAIN_COST_S: f64 = 1.0;
/// A join may cost this much: it copies every layer the new pipeline needs.
pub const JOIN_COST_S: f64 = 1.5;

/// What the bench does to the running job from outside.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Act {
    /// `oobleck drain NODE --run DIR`.
    Drain,
    /// `oobleck add-node --run DIR`.
    Join,
}

/// When the bench drains which node and adds one (pure, from the flags).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MembershipPlan {
    /// The node drained: the highest, as the failures take.
    pub drain_node: u32,
    /// The drain is asked for once this step committed (taken at the boundary after the next).
    pub drain_after: u64,
    /// The node is added once this step committed.
    pub join_after: u64,
}

impl MembershipPlan {
    /// `None` with `--no-membership`. By default the drain after 3/8 of the steps and the join
    /// after 17/24: about a third and two thirds in, 45 and 85 of the default 120 steps, between
    /// the checkpoints of `--checkpoint-every 40` as the failures are.
    pub fn new(a: &BenchRecoveryArgs) -> Result<Option<MembershipPlan>> {
        if a.no_membership {
            return Ok(None);
        }
        let f = a.fault_threshold;
        if a.nodes < f + 2 {
            bail!(
                "draining a node of --nodes {} leaves fewer than f + 1 = {} pipelines' nodes; \
                 pass --nodes {} or more, or --no-membership",
                a.nodes,
                f + 1,
                f + 2
            );
        }
        let drain_after = a.drain_after_step.unwrap_or(a.steps * 3 / 8);
        let join_after = a.join_after_step.unwrap_or(a.steps * 17 / 24);
        for (flag, s) in [
            ("--drain-after-step", drain_after),
            ("--join-after-step", join_after),
        ] {
            // Asked for after step s, taken after s + 1: step s + 2 is the first commit after.
            if s == 0 || s + 2 > a.steps {
                bail!(
                    "{flag} {s}: between 1 and steps - 2 = {} (a commit must follow the \
                     reconfiguration); pass --steps 8 or more",
                    a.steps.saturating_sub(2)
                );
            }
        }
        if drain_after.abs_diff(join_after) < 3 {
            bail!(
                "--drain-after-step {drain_after} and --join-after-step {join_after}: at least \
                 3 steps apart, so that they are two reconfigurations"
            );
        }
        Ok(Some(MembershipPlan {
            drain_node: (a.nodes - 1) as u32,
            drain_after,
            join_after,
        }))
    }

    /// The acts in the order they are due.
    pub fn acts(&self) -> [(Act, u64); 2] {
        let mut acts = [(Act::Drain, self.drain_after), (Act::Join, self.join_after)];
        acts.sort_by_key(|&(_, s)| s);
        acts
    }

    /// The act to do now, `done` of them done and step `committed` the newest commit.
    pub fn due(&self, committed: u64, done: usize) -> Option<Act> {
        let (act, after) = *self.acts().get(done)?;
        (committed >= after).then_some(act)
    }
}

/// One act the driver sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Sent {
    pub act: Act,
    /// The newest committed step when it was sent.
    pub after_step: u64,
}

/// What the driver saw besides the run's records.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Outcome {
    pub sent: Vec<Sent>,
    /// The agent `oobleck add-node` started.
    pub agent_pid: Option<u32>,
    /// `train`'s exit -> that agent gone, seconds (`None`: it had to be killed, or none ran).
    pub agent_exit_s: Option<f64>,
}

/// The drain + join run's two reconfigurations, as the report carries them.
#[derive(Clone, Debug, Serialize)]
pub struct Membership {
    pub plan: MembershipPlan,
    pub outcome: Outcome,
    pub drain: Option<Recovery>,
    pub join: Option<Recovery>,
    /// The id the added node registered with (its `join` event during the run).
    pub joined_node: Option<u32>,
    /// Drains the master refused, in its words.
    pub refusals: Vec<String>,
    /// The fault-free run's median step time, s, which the costs are over.
    pub step_s: Option<f64>,
    /// Boundary -> next commit minus `step_s`: the training time each lost (module docs).
    pub drain_cost_s: Option<f64>,
    pub join_cost_s: Option<f64>,
}

impl Membership {
    /// Finds the drain and the join among the run's reconfigurations; their costs are over
    /// `step_s`, the fault-free median step time.
    pub fn new(
        plan: &MembershipPlan,
        outcome: Outcome,
        run: &RunInput,
        summary: &RunSummary,
        step_s: Option<f64>,
    ) -> Self {
        let node = plan.drain_node;
        let drain = summary
            .recoveries
            .iter()
            .find(|r| r.drained_nodes.contains(&node) && r.lost_nodes.is_empty());
        let join = summary
            .recoveries
            .iter()
            .find(|r| !r.joined_nodes.is_empty() && r.lost_nodes.is_empty());
        let events = || run.segments.iter().flat_map(|s| s.events.iter());
        // The first nodes register before the first plan; a join after it is the added node.
        let joined_node = events()
            .skip_while(|e| !matches!(e, Event::Plan { .. }))
            .find_map(|e| match e {
                Event::Join { node, .. } => Some(*node),
                _ => None,
            });
        let refusals = events()
            .filter_map(|e| match e {
                Event::DrainRefused { node, refusal, .. } => {
                    Some(format!("node {node}: {refusal}"))
                }
                _ => None,
            })
            .collect();
        let cost = |r: Option<&Recovery>| Some(r?.since_failure_s? - step_s?);
        Membership {
            plan: plan.clone(),
            outcome,
            drain: drain.cloned(),
            join: join.cloned(),
            joined_node: joined_node.or_else(|| join.and_then(|j| j.joined_nodes.first().copied())),
            refusals,
            step_s,
            drain_cost_s: cost(drain),
            join_cost_s: cost(join),
        }
    }
}

/// The targets of the drain and the join (none checked when either run failed).
pub fn membership_checks(fault_free: &RunSummary, run: &RunSummary, m: &Membership) -> Vec<Check> {
    let step_s = fault_free.step_s.filter(|_| fault_free.ok && run.ok);
    let usable = |r: &Option<Recovery>| r.clone().filter(|_| run.ok);
    let (drain, join) = (usable(&m.drain), usable(&m.join));
    let next = |r: &Option<Recovery>, cost: f64| {
        let limit = step_s.map_or(f64::NAN, |s| cost + s);
        let measured = r.as_ref().and_then(|r| r.since_failure_s);
        (limit, measured.filter(|_| step_s.is_some()))
    };
    let (dl, dm) = next(&drain, DRAIN_COST_S);
    let (jl, jm) = next(&join, JOIN_COST_S);
    let replayed = |r: &Option<Recovery>| r.as_ref().map(|r| r.replayed_steps as f64);
    vec![
        check("drain: boundary -> next commit (s)", dl, false, dm),
        check("join: boundary -> next commit (s)", jl, false, jm),
        check("drain: steps replayed", 1.0, false, replayed(&drain)),
        check("join: steps replayed", 1.0, false, replayed(&join)),
    ]
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::plan::tests::args;
    use super::super::records::{parse_events, parse_metrics};
    use super::super::summary::{summarize, Job, RunKind, Segment};
    use super::*;

    #[test]
    fn defaults_drain_the_highest_node_a_third_in_and_join_two_thirds_in() {
        let p = MembershipPlan::new(&args(&[])).unwrap().unwrap();
        assert_eq!((p.drain_node, p.drain_after, p.join_after), (3, 45, 85));
        assert_eq!(p.due(44, 0), None);
        assert_eq!(p.due(45, 0), Some(Act::Drain));
        assert_eq!(p.due(84, 1), None);
        assert_eq!(p.due(90, 1), Some(Act::Join));
        assert_eq!(p.due(120, 2), None);
        assert!(MembershipPlan::new(&args(&["--no-membership"]))
            .unwrap()
            .is_none());
    }

    #[test]
    fn a_join_before_the_drain_is_done_first() {
        let p = MembershipPlan::new(&args(&[
            "--join-after-step",
            "10",
            "--drain-after-step",
            "20",
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(p.acts(), [(Act::Join, 10), (Act::Drain, 20)]);
        assert_eq!(p.due(15, 0), Some(Act::Join));
    }

    #[test]
    fn acts_too_late_too_close_or_with_too_few_nodes_are_refused() {
        let e = MembershipPlan::new(&args(&["--join-after-step", "119"])).unwrap_err();
        assert!(e.to_string().contains("steps - 2 = 118"), "{e}");
        let e = MembershipPlan::new(&args(&["--drain-after-step", "84"])).unwrap_err();
        assert!(e.to_string().contains("3 steps apart"), "{e}");
        let e = MembershipPlan::new(&args(&["--nodes", "2"])).unwrap_err();
        assert!(e.to_string().contains("--no-membership"), "{e}");
    }

    const JOB: Job = Job {
        steps: 8,
        tokens_per_step: 100,
        failures: 0,
    };

    /// The lines a drain of node 3 after step 3 and a join of node 4 after step 5 leave
    /// (trimmed from a real run), with `drain_since` and `join_since` s to the next commit.
    fn events(drain_since: f64, join_since: f64) -> String {
        let reconfig = |gen, from, cause: &str, joined: &str, drained: &str| {
            format!(
                "{{\"event\":\"reconfig\",\"generation\":{gen},\"lost_nodes\":[],\"nodes\":[0,1,2],\
                 \"failed_in_step\":{from},\"checkpoint\":null,\"from_step\":{from},\"replayed_steps\":0,\"detect_s\":0.01,\"in_place\":true,\"copies\":1,\
                 \"copy_bytes\":100,\"new_pipelines\":[[0,1],[2]],\"cause\":\"{cause}\",\
                 \"joined_nodes\":[{joined}],\"drained_nodes\":[{drained}]}}\n"
            )
        };
        let resumed = |gen, step, since: f64, wait: f64| {
            format!(
                "{{\"event\":\"resumed\",\"generation\":{gen},\"step\":{step},\"since_failure_s\":\
                 {since},\"copy_bytes\":50,\"phases\":{{\"wait_boundary_s\":{wait},\"detect_s\":\
                 0.01,\"decide_s\":0.0001,\"restart_s\":0.5,\"connect_copy_s\":0.3,\
                 \"connect_max_s\":0.1,\"copy_max_s\":0.2,\"first_step_s\":0.9}}}}\n"
            )
        };
        [
            "{\"event\":\"start\",\"step\":0}\n".to_string(),
            "{\"event\":\"join\",\"node\":3,\"addr\":\"127.0.0.1:1\"}\n".into(),
            "{\"event\":\"plan\",\"generation\":0,\"pipelines\":[]}\n".into(),
            "{\"event\":\"drain\",\"node\":3,\"reason\":\"oobleck drain\"}\n".into(),
            "{\"event\":\"released\",\"node\":3,\"reason\":\"drained\"}\n".into(),
            reconfig(1, 4, "node 3 drains (oobleck drain)", "", "3"),
            resumed(1, 5, drain_since, 0.6),
            "{\"event\":\"join\",\"node\":4,\"addr\":\"127.0.0.1:2\"}\n".into(),
            reconfig(2, 6, "node(s) [4] join (adds a pipeline: 2 -> 3)", "4", ""),
            resumed(2, 7, join_since, 0.4),
            "{\"event\":\"finish\",\"step\":8,\"wall_s\":12.0}\n".into(),
        ]
        .concat()
    }

    pub(in super::super) fn summary(
        kind: RunKind,
        events: &str,
        steps: u64,
    ) -> (RunInput, RunSummary) {
        let metrics: String = (1..=steps)
            .map(|s| {
                format!(
                    "{{\"step\":{s},\"loss\":1.0,\"tokens_per_s\":1.0,\"generation\":0,\"wall_s\":{}}}\n",
                    s as f64
                )
            })
            .collect();
        let input = RunInput {
            kind,
            segments: vec![Segment {
                wall_s: steps as f64 + 1.0,
                gap_s: 0.0,
                events: parse_events(events).unwrap(),
                metrics: parse_metrics(&metrics).unwrap(),
                load_1m: None,
            }],
            error: None,
        };
        let s = summarize(&input, &JOB);
        (input, s)
    }

    pub(in super::super) fn membership(
        drain_since: f64,
        join_since: f64,
    ) -> (RunSummary, Membership) {
        let plan = MembershipPlan {
            drain_node: 3,
            drain_after: 3,
            join_after: 5,
        };
        let (input, s) = summary(RunKind::Membership, &events(drain_since, join_since), 8);
        let m = Membership::new(&plan, Outcome::default(), &input, &s, Some(1.0));
        (s, m)
    }

    #[test]
    fn the_drain_and_the_join_are_found_and_timed_from_their_request() {
        let (s, m) = membership(1.8, 2.1);
        assert_eq!(s.recoveries.len(), 2);
        let drain = m.drain.as_ref().unwrap();
        assert_eq!(drain.cause, "node 3 drains (oobleck drain)");
        assert_eq!(drain.since_failure_s, Some(1.8));
        assert_eq!(drain.event_to_commit_s(), Some(1.8 + 0.6));
        let join = m.join.as_ref().unwrap();
        assert_eq!(join.joined_nodes, vec![4]);
        assert_eq!(join.event_to_commit_s(), Some(2.1 + 0.4));
        assert_eq!(m.joined_node, Some(4));
        // Over a fault-free step of 1 s: the drain lost 0.8 s, the join 1.1 s.
        assert!((m.drain_cost_s.unwrap() - 0.8).abs() < 1e-9);
        assert!((m.join_cost_s.unwrap() - 1.1).abs() < 1e-9);
        assert!(m.refusals.is_empty());
    }

    #[test]
    fn costs_are_checked_against_the_fault_free_step_time() {
        let (_, ff) = summary(RunKind::FaultFree, "{\"event\":\"start\",\"step\":0}\n", 8);
        assert_eq!(ff.step_s, Some(1.0));
        // A drain 1.8 s from its boundary to the next commit: under 1 + 1 s. A join 2.6 s:
        // over 1.5 + 1 s.
        let (s, m) = membership(1.8, 2.6);
        let c = membership_checks(&ff, &s, &m);
        let pass: Vec<Option<bool>> = c.iter().map(|c| c.pass).collect();
        assert_eq!(pass, vec![Some(true), Some(false), Some(true), Some(true)]);
        assert_eq!((c[0].limit, c[1].limit), (2.0, 2.5));
        assert_eq!(c[1].measured, Some(2.6));
    }

    #[test]
    fn a_refused_drain_leaves_its_targets_unchecked() {
        let refused = "{\"event\":\"start\",\"step\":0}\n\
                       {\"event\":\"drain_refused\",\"node\":3,\"reason\":\"oobleck drain\",\
                       \"refusal\":\"draining leaves 1 of 2 nodes\"}\n";
        let plan = MembershipPlan {
            drain_node: 3,
            drain_after: 3,
            join_after: 5,
        };
        let (input, s) = summary(RunKind::Membership, refused, 8);
        let m = Membership::new(&plan, Outcome::default(), &input, &s, None);
        assert_eq!(m.drain_cost_s, None);
        assert_eq!(m.refusals, vec!["node 3: draining leaves 1 of 2 nodes"]);
        let (_, ff) = summary(RunKind::FaultFree, "", 8);
        let c = membership_checks(&ff, &s, &m);
        assert!(c.iter().all(|c| c.pass.is_none()), "{c:?}");
    }
}
