//! What the job does with its agents' watchdogs (`runtime/node/watchdog.rs`): a worker found
//! hung is a worker failure at once (its agent fences it; its exit follows), and a step in
//! which every rank only waits on its peers is a data plane that hangs (a collective that
//! never returns on any member), ended by aborting the generation: every rank holds the
//! committed step, so it goes on in place with fresh communicators.

use std::time::Duration;

use super::machine::{JobMachine, Phase};
use crate::runtime::wire::records::{Event, WorkerReport};

/// Whether every rank of a generation of `world` ranks waits on its peers in step `step`,
/// given the step each waiting rank said it waits in.
pub(super) fn all_waiting(world: usize, step: u64, waits_in: impl Iterator<Item = u64>) -> bool {
    world > 0 && waits_in.filter(|&s| s == step).count() == world
}

impl JobMachine {
    /// A watchdog's report: `Hung` or `Waiting`.
    pub(super) fn on_watchdog(&mut self, now: Duration, node: u32, report: WorkerReport) {
        match report {
            WorkerReport::Hung {
                rank,
                what,
                for_s,
                limit_s,
                stopped,
            } => {
                self.record(Event::Hang {
                    generation: self.generation,
                    node,
                    rank,
                    what: what.clone(),
                    for_s,
                    limit_s,
                    stopped,
                });
                let how = if stopped {
                    "stopped (no progress report either)"
                } else {
                    "hung"
                };
                self.node_failure(
                    now,
                    format!(
                        "worker rank {rank} on node {node} {how} in {what} for {for_s:.1} s \
                         (watchdog limit {limit_s:.1} s); its agent fenced it"
                    ),
                );
            }
            WorkerReport::Waiting {
                rank,
                step,
                what,
                for_s,
            } => self.on_waiting(now, rank, step, what, for_s),
            _ => {}
        }
    }

    fn on_waiting(&mut self, now: Duration, rank: u32, step: u64, what: String, for_s: f64) {
        let open = self.committed() + 1;
        let Some(g) = self.gen.as_mut() else {
            return;
        };
        g.waiting.insert(rank, (step, what, for_s));
        if !matches!(self.phase, Phase::Stepping)
            || !all_waiting(g.world, open, g.waiting.values().map(|w| w.0))
        {
            return;
        }
        let each: Vec<String> = g
            .waiting
            .iter()
            .map(|(r, (_, what, s))| format!("rank {r} in {what} for {s:.1} s"))
            .collect();
        self.record(Event::DataPlaneHang {
            generation: self.generation,
            step: open,
            waiting: each.clone(),
        });
        self.node_failure(
            now,
            format!(
                "every rank waits on its peers in step {open} and none moves (the data plane \
                 hangs: {}); ending the generation, whose ranks all hold step {}",
                each.join("; "),
                self.committed()
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn steps(w: &BTreeMap<u32, (u64, (), f64)>) -> impl Iterator<Item = u64> + '_ {
        w.values().map(|v| v.0)
    }

    #[test]
    fn the_data_plane_hangs_only_when_every_rank_waits_in_the_open_step() {
        let mut w: BTreeMap<u32, (u64, (), f64)> = BTreeMap::new();
        w.insert(0, (5, (), 2.0));
        w.insert(1, (5, (), 2.0));
        assert!(!all_waiting(3, 5, steps(&w)), "rank 2 is not waiting");
        w.insert(2, (4, (), 2.0));
        assert!(
            !all_waiting(3, 5, steps(&w)),
            "rank 2 waited in a step that committed"
        );
        w.insert(2, (5, (), 1.8));
        assert!(all_waiting(3, 5, steps(&w)));
        assert!(!all_waiting(0, 5, steps(&BTreeMap::new())));
    }
}
