//! The loop's accounting against a step-by-step count, and a fixed reactor on small traces.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;

fn book() -> Book {
    Book::new()
}

/// Steps and checkpoints one at a time, as the closed form must agree with.
fn step_by_step(run: &Running, t: f64) -> (u64, f64) {
    let (mut now, mut steps, mut since_ckpt, mut ckpt_ms) = (0.0, 0u64, 0u64, 0.0);
    loop {
        if run.checkpoint_every > 0 && since_ckpt == run.checkpoint_every {
            if now + run.checkpoint_ms > t {
                return (steps, ckpt_ms);
            }
            now += run.checkpoint_ms;
            ckpt_ms += run.checkpoint_ms;
            since_ckpt = 0;
        } else {
            if now + run.step_ms > t {
                return (steps, ckpt_ms);
            }
            now += run.step_ms;
            steps += 1;
            since_ckpt += 1;
        }
    }
}

#[test]
fn closed_form_matches_step_by_step() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for _ in 0..2000 {
        let run = Running {
            step_ms: rng.random_range(1..50) as f64,
            samples_per_step: 8.0,
            redundant_share: 0.25,
            checkpoint_every: rng.random_range(0..6),
            checkpoint_ms: rng.random_range(0..40) as f64,
        };
        let t = rng.random_range(0..3000) as f64;
        // In two pieces, as the loop advances between events.
        let cut = rng.random_range(0..=t as u64) as f64;
        let mut b = book();
        let since = b.train(&run, 0.0, cut);
        b.train(&run, since, t);
        let (steps, ckpt) = step_by_step(&run, t);
        assert_eq!(b.steps, steps, "{run:?} t {t} cut {cut}");
        assert_eq!(b.ledger.get(TimeKind::Checkpointing), ckpt, "{run:?} t {t}");
        let work = steps as f64 * run.step_ms;
        assert!((b.ledger.get(TimeKind::Useful) - 0.75 * work).abs() < 1e-6);
        assert!((b.ledger.get(TimeKind::Redundant) - 0.25 * work).abs() < 1e-6);
        assert_eq!(b.samples, 8.0 * steps as f64);
    }
}

/// Who was lost and who joined, at each question.
type Asked = Vec<(Vec<u32>, Vec<u32>)>;

/// Trains at 100 ms steps; every change costs a 1 s pause, a loss also `loss`; records
/// what it was asked.
struct Fixed {
    asked: Asked,
    loss: Loss,
}

impl Reactor for Fixed {
    fn react(&mut self, lost: &[u32], joined: &[u32], _: &[u32]) -> Result<Reaction, SimError> {
        self.asked.push((lost.to_vec(), joined.to_vec()));
        Ok(Reaction::Stop {
            loss: if lost.is_empty() {
                Loss::Nothing
            } else {
                self.loss
            },
            pause: vec![(TimeKind::Reconfiguration, 1000.0)],
            then: Some(Running {
                step_ms: 100.0,
                samples_per_step: 10.0,
                redundant_share: 0.0,
                checkpoint_every: 10,
                checkpoint_ms: 50.0,
            }),
            counted: Counted::Reconfiguration,
            note: None,
        })
    }
}

fn replay(csv: &str, loss: Loss, end_ms: u64) -> (Outcome, Asked) {
    let trace = Trace::parse(csv).unwrap();
    let mut r = Fixed {
        asked: Vec::new(),
        loss,
    };
    let opts = LoopOptions {
        startup_ms: 500,
        end_ms,
    };
    let out = run_loop(&trace, &mut r, opts, "fixed".into()).unwrap();
    (out, r.asked)
}

#[test]
fn every_millisecond_is_accounted_once() {
    let csv = "0,add,a\n0,add,b\n3080,remove,a\n4000,add,c\n4100,remove,c\n9000,add,d\n";
    for loss in [Loss::InFlight, Loss::SinceCheckpoint] {
        let (out, asked) = replay(csv, loss, 20_000);
        // The span starts when the first nodes are usable (0 + 500 ms start-up).
        assert_eq!((out.start_ms, out.end_ms), (500, 20_000));
        let f = out.time_fractions;
        let sum: f64 = TimeKind::ALL.iter().map(|&k| f.get(k)).sum();
        assert!((sum - 1.0).abs() < 1e-12, "{f:?}");
        // c is removed before its start-up ends: it never joins. d joins at 9500.
        let joins: Vec<&Vec<u32>> = asked.iter().map(|a| &a.1).collect();
        assert_eq!(joins, [&vec![0, 1], &vec![], &vec![3]], "{asked:?}");
        assert_eq!(out.failures, 2);
        assert_eq!(out.reconfigurations, 3);
        let (useful, lost) = (f.useful * 19_500.0, f.lost * 19_500.0);
        assert!(
            lost > 0.0 && useful > 0.0,
            "{f:?} {asked:?} {:?}",
            out.timeline
        );
        // Samples kept are 10 per 100 ms of useful time (whole steps, plus the step in
        // flight at the end pro rata).
        assert!(
            (out.samples - useful / 10.0).abs() < 1e-6,
            "{} {useful}",
            out.samples
        );
        assert!((out.average_samples_per_s - out.samples / 19.5).abs() < 1e-9);
    }
    // A rollback loses what the steps since the checkpoint did: more than the in-flight
    // step alone.
    let (a, _) = replay(csv, Loss::InFlight, 20_000);
    let (b, _) = replay(csv, Loss::SinceCheckpoint, 20_000);
    assert!(b.time_fractions.lost > a.time_fractions.lost);
    assert!(b.steps < a.steps);
}

#[test]
fn joins_wait_for_the_step_boundary() {
    // Training from 1500 (ready at 500, then a 1 s pause) in 100 ms steps; e is usable
    // at 2040 and admitted at the end of the step in flight, 2100.
    let (out, asked) = replay("0,add,a\n1540,add,e\n", Loss::InFlight, 5000);
    assert_eq!(asked.len(), 2, "{asked:?}");
    assert_eq!(out.timeline.first().map(|p| p.t_ms), Some(500));
    assert!(
        out.timeline
            .iter()
            .any(|p| p.t_ms == 2100 && p.samples_per_s == 0.0),
        "{:?}",
        out.timeline
    );
}
