//! Who the failure runs kill and when, and the pipelines each of their jobs starts with: pure,
//! from the flags (and, for the restart run, from what the in-place run recovered to).

use anyhow::{bail, Result};
use serde::Serialize;

use super::records::Event;
use super::summary::RunInput;
use super::BenchRecoveryArgs;

/// Who is killed when, and the pipelines each job starts with (pure, from the flags).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FailurePlan {
    /// `(node, step)`: `node` dies after `step` commits.
    pub failures: Vec<(usize, u64)>,
    /// Pipeline sizes in nodes of the first job.
    pub pins: Vec<usize>,
}

impl FailurePlan {
    pub fn new(a: &BenchRecoveryArgs) -> Result<FailurePlan> {
        let f = a.fault_threshold;
        if f == 0 {
            bail!("recovery in place needs --fault-threshold 1 or more");
        }
        if a.nodes < f + 2 {
            bail!(
                "--nodes {} leaves no node to lose with f = {f}: at least f + 1 pipelines must \
                 fit on the nodes left; pass --nodes {} or more",
                a.nodes,
                f + 2
            );
        }
        let pins = match &a.pipeline_nodes {
            Some(p) => p.clone(),
            None => even_split(a.nodes, f + 1),
        };
        if pins.iter().sum::<usize>() != a.nodes || pins.contains(&0) || pins.len() < f + 1 {
            bail!(
                "--pipeline-nodes {pins:?}: need at least f + 1 = {} pipelines of 1+ nodes \
                 adding up to --nodes {}",
                f + 1,
                a.nodes
            );
        }
        let most = a.nodes - (f + 1);
        if let Some(n) = a.failures.filter(|&n| n > most || n == 0) {
            bail!("--failures {n}: between 1 and nodes - (f + 1) = {most}");
        }
        if a.fail_every == 0 {
            bail!("--fail-every must be at least 1");
        }
        let failures: Vec<(usize, u64)> = (1..)
            .map(|k| k * a.fail_every + a.fail_offset)
            .take_while(|&s| s < a.steps)
            .take(a.failures.unwrap_or(most))
            .enumerate()
            .map(|(i, s)| (a.nodes - 1 - i, s))
            .collect();
        if failures.is_empty() {
            bail!(
                "no failure fits in --steps {}: the first would be after step {}",
                a.steps,
                a.fail_every + a.fail_offset
            );
        }
        Ok(FailurePlan { failures, pins })
    }
}

/// `nodes` into `parts` sizes as even as possible, larger first.
fn even_split(nodes: usize, parts: usize) -> Vec<usize> {
    (0..parts)
        .map(|i| nodes / parts + usize::from(i < nodes % parts))
        .collect()
}

/// One node fewer: taken from the last of the largest pipelines (dropped if it empties).
fn shrink(pins: &[usize]) -> Vec<usize> {
    let mut p = pins.to_vec();
    if let Some(max) = p.iter().copied().max() {
        if let Some(i) = p.iter().rposition(|&x| x == max) {
            p[i] -= 1;
        }
    }
    p.retain(|&x| x > 0);
    p
}

/// Pipeline sizes of each job of the restart run: those the in-place run recovered to after
/// each failure, where it did, else [`shrink`].
pub(super) fn restart_shapes(plan: &FailurePlan, in_place: &RunInput) -> Vec<Vec<usize>> {
    let recovered: Vec<Vec<usize>> = in_place
        .segments
        .iter()
        .flat_map(|s| &s.events)
        .filter_map(|e| match e {
            Event::Reconfig { new_pipelines, .. } => {
                Some(new_pipelines.iter().map(Vec::len).collect())
            }
            _ => None,
        })
        .collect();
    let mut shapes = vec![plan.pins.clone()];
    for k in 0..plan.failures.len() {
        let want = shapes[k].iter().sum::<usize>() - 1;
        let next = match recovered.get(k) {
            Some(r) if r.iter().sum::<usize>() == want => r.clone(),
            _ => shrink(&shapes[k]),
        };
        shapes.push(next);
    }
    shapes
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: BenchRecoveryArgs,
    }

    /// The bench's arguments from `extra` flags, as clap parses them.
    pub(in crate::bench::recovery) fn args(extra: &[&str]) -> BenchRecoveryArgs {
        Cli::parse_from(std::iter::once("bench").chain(extra.iter().copied())).a
    }

    #[test]
    fn defaults_kill_two_nodes_between_checkpoints() {
        let p = FailurePlan::new(&args(&[])).unwrap();
        assert_eq!(p.pins, vec![2, 2]);
        assert_eq!(p.failures, vec![(3, 60), (2, 100)]);
    }

    #[test]
    fn more_failures_than_the_tolerance_allows_are_refused() {
        let e = FailurePlan::new(&args(&["--failures", "3"])).unwrap_err();
        assert!(e.to_string().contains("nodes - (f + 1) = 2"), "{e}");
        assert!(FailurePlan::new(&args(&["--fault-threshold", "0"])).is_err());
        assert!(FailurePlan::new(&args(&["--steps", "50"])).is_err());
    }

    #[test]
    fn shrinking_takes_from_the_last_largest_pipeline() {
        assert_eq!(shrink(&[2, 2]), vec![2, 1]);
        assert_eq!(shrink(&[2, 1]), vec![1, 1]);
        assert_eq!(shrink(&[1, 1]), vec![1]);
        assert_eq!(even_split(5, 2), vec![3, 2]);
    }
}
