//! Generated traces: `nodes` nodes from the start, each failing after an exponentially
//! distributed lifetime (mean `mtbf_ms`, one node's mean time between failures, so the
//! cluster sees a failure every `mtbf / nodes` on average), and a replacement node added
//! `replace_after_ms` after each failure. Seeded: the same settings give the same trace.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::trace::{Change, Trace, TraceEvent};
use super::SimError;

/// How to generate a trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Failures {
    pub nodes: u32,
    /// One node's mean time between failures.
    pub mtbf_ms: u64,
    /// Replacements arrive this long after a failure; `None` = never.
    pub replace_after_ms: Option<u64>,
    /// The trace ends here.
    pub duration_ms: u64,
    pub seed: u64,
}

impl Failures {
    fn check(&self) -> Result<(), SimError> {
        let bad = |field: &'static str, value: u64, message: &str| {
            Err(SimError::Setting {
                field,
                value: value.to_string(),
                message: message.into(),
            })
        };
        if self.nodes == 0 {
            return bad("nodes", 0, "a generated trace needs at least one node");
        }
        if self.mtbf_ms == 0 {
            return bad("mtbf", 0, "must be longer than 0 (e.g. 30d)");
        }
        if self.duration_ms == 0 {
            return bad("duration", 0, "must be longer than 0 (e.g. 7d)");
        }
        Ok(())
    }
}

/// Makes the trace. Node `node{i}` for i = 0.. in order of arrival; the trace's last line is
/// at `duration_ms` at the latest (a trace ends at its last event, so a final `add` of a node
/// that will never fail marks the end when nothing happens then).
pub fn generate(f: &Failures) -> Result<Trace, SimError> {
    f.check()?;
    let mut rng = ChaCha8Rng::seed_from_u64(f.seed);
    let lifetime = |rng: &mut ChaCha8Rng| -> u64 {
        // Inverse CDF of the exponential; 1 - u is in (0, 1].
        let u: f64 = rng.random();
        (-(1.0 - u).ln() * f.mtbf_ms as f64).round() as u64
    };
    let mut events = Vec::new();
    // (time, order, change, node): adds and removals by time, ties in creation order.
    let mut queue: BinaryHeap<Reverse<(u64, u64, u8, u32)>> = BinaryHeap::new();
    let mut order = 0u64;
    let mut push = |queue: &mut BinaryHeap<_>, at: u64, kind: u8, node: u32| {
        queue.push(Reverse((at, order, kind, node)));
        order += 1;
    };
    for n in 0..f.nodes {
        push(&mut queue, 0, 0, n);
    }
    let mut next_node = f.nodes;
    while let Some(Reverse((at, _, kind, node))) = queue.pop() {
        if at > f.duration_ms {
            break;
        }
        let change = if kind == 0 {
            Change::Add
        } else {
            Change::Remove
        };
        events.push(TraceEvent {
            at_ms: at,
            change,
            node: format!("node{node}"),
        });
        match change {
            Change::Add => {
                let dies = at.saturating_add(lifetime(&mut rng).max(1));
                push(&mut queue, dies, 1, node);
            }
            Change::Remove => {
                if let Some(delay) = f.replace_after_ms {
                    push(&mut queue, at.saturating_add(delay), 0, next_node);
                    next_node += 1;
                }
            }
        }
    }
    if events.last().is_some_and(|e| e.at_ms < f.duration_ms) {
        // A spare that arrives as the trace ends marks its end, so the simulated span is
        // the duration asked for.
        events.push(TraceEvent {
            at_ms: f.duration_ms,
            change: Change::Add,
            node: format!("node{next_node}"),
        });
    }
    Trace::from_events(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn week(nodes: u32, mtbf_days: u64, seed: u64) -> Trace {
        generate(&Failures {
            nodes,
            mtbf_ms: mtbf_days * 86_400_000,
            replace_after_ms: Some(600_000),
            duration_ms: 7 * 86_400_000,
            seed,
        })
        .unwrap()
    }

    #[test]
    fn seeded_and_about_the_rate_asked() {
        let a = week(1000, 70, 7);
        assert_eq!(a, week(1000, 70, 7), "the same seed gives the same trace");
        assert_ne!(a, week(1000, 70, 8));
        let removals = a.removals() as f64;
        // 1000 nodes x 7 days / 70 days = 100 expected failures (Poisson, sd 10).
        assert!((70.0..130.0).contains(&removals), "{removals}");
        assert_eq!(a.end_ms(), 7 * 86_400_000);
        // Replacements keep the cluster near its size.
        let last = a.nodes_at(a.end_ms());
        assert!((990..=1001).contains(&last), "{last}");
    }

    #[test]
    fn bad_settings_are_errors() {
        let ok = Failures {
            nodes: 3,
            mtbf_ms: 1000,
            replace_after_ms: None,
            duration_ms: 10_000,
            seed: 1,
        };
        assert!(generate(&ok).is_ok());
        for bad in [
            Failures { nodes: 0, ..ok },
            Failures { mtbf_ms: 0, ..ok },
            Failures {
                duration_ms: 0,
                ..ok
            },
        ] {
            let e = generate(&bad).unwrap_err().to_string();
            assert!(e.contains("must") || e.contains("needs"), "{e}");
        }
    }
}
