//! ZB-H1 against 1F1B, against the closed forms on a grid of (S, m, F, B, W), and the
//! invariants of the streams it ran.

use super::*;
use crate::schedule::StageTimes;

const EQUAL: PassTimes = PassTimes { f: 1, b: 1, w: 1 };

/// 1F1B and ZB-H1 on `s` stages of times `t`, with free links.
fn both(s: usize, m: u32, t: PassTimes) -> (PassSimulation, PassSimulation) {
    let stages = vec![t; s];
    let p2p = vec![0; s - 1];
    (
        simulate(Schedule::OneFOneB, &stages, &p2p, m),
        simulate(Schedule::ZbH1, &stages, &p2p, m),
    )
}

/// Pipelines whose stages and links all differ: `(stages, p2p)`.
fn uneven(s: usize) -> (Vec<PassTimes>, Vec<Nanos>) {
    let stages = (0..s as u64)
        .map(|i| PassTimes {
            f: 3 + (i * 5) % 7,
            b: 4 + (i * 3) % 5,
            w: 2 + (i * 7) % 6,
        })
        .collect();
    let p2p = (0..s.saturating_sub(1) as u64)
        .map(|i| (i * 2) % 3)
        .collect();
    (stages, p2p)
}

#[test]
fn with_equal_pass_times_zb_h1_takes_the_papers_share_of_1f1b() {
    // Qi et al.: (m (F+B+W) + (S-1)(F+B-W)) / ((m+S-1)(F+B+W)) at m = 8.
    for (s, want) in [(2, 25.0 / 27.0), (4, 27.0 / 33.0), (5, 28.0 / 36.0)] {
        let (one, zb) = both(s, 8, EQUAL);
        let ratio = zb.makespan_ns as f64 / one.makespan_ns as f64;
        eprintln!("S = {s}, m = 8: zb-h1/1f1b = {ratio:.3}");
        assert!((ratio - want).abs() < 1e-9, "S = {s}: {ratio} vs {want}");
    }
    let (one, zb) = both(4, 8, EQUAL);
    assert!((zb.makespan_ns as f64 / one.makespan_ns as f64 - 0.818).abs() < 0.03);
}

#[test]
fn makespans_meet_the_closed_forms_at_equal_times_and_bound_them_otherwise() {
    let mut gap: f64 = 1.0;
    for s in 1..=6usize {
        for m in 1..=12u32 {
            for (f, b, w) in
                (1..=3).flat_map(|f| (1..=3).flat_map(move |b| (1..=3).map(move |w| (f, b, w))))
            {
                let t = PassTimes { f, b, w };
                let (one, zb) = both(s, m, t);
                let at = format!("S = {s}, m = {m}, {t:?}");
                assert_eq!(
                    one.makespan_ns,
                    closed_form(Schedule::OneFOneB, s as u32, m, t),
                    "{at}"
                );
                assert!(zb.makespan_ns <= one.makespan_ns, "{at}");
                if m >= s as u32 {
                    let cz = closed_form(Schedule::ZbH1, s as u32, m, t);
                    assert!(zb.makespan_ns >= cz, "{at}: {} below {cz}", zb.makespan_ns);
                    if f == b && b == w {
                        assert_eq!(zb.makespan_ns, cz, "{at}");
                    }
                    gap = gap.max(zb.makespan_ns as f64 / cz as f64);
                }
            }
        }
    }
    // Unequal times: the greedy fill stays within this of the paper's form (its worst: W > F).
    eprintln!("zb-h1 / its closed form, worst on the grid: {gap:.3}");
    assert!(gap < 1.3, "{gap}");
}

#[test]
fn one_f_one_b_here_is_schedule_simulate_with_the_backward_fused() {
    for s in 1..=5 {
        let (stages, p2p) = uneven(s);
        let fused: Vec<StageTimes> = stages
            .iter()
            .map(|t| StageTimes {
                forward_ns: t.f,
                backward_ns: t.b + t.w,
            })
            .collect();
        for m in 1..=9 {
            let here = simulate(Schedule::OneFOneB, &stages, &p2p, m);
            let there = crate::schedule::simulate(&fused, &p2p, m);
            assert_eq!(here.makespan_ns, there.makespan_ns, "S = {s}, m = {m}");
            assert!(simulate(Schedule::ZbH1, &stages, &p2p, m).makespan_ns <= here.makespan_ns);
        }
    }
}

/// When each `(pass, mb)` of stage `i` started and ended.
fn times(sim: &PassSimulation, st: &[PassTimes], i: usize, pass: Pass, mb: u32) -> (Nanos, Nanos) {
    let k = sim.streams[i]
        .iter()
        .position(|&x| x == (pass, mb))
        .unwrap_or_else(|| panic!("stage {i} never ran {pass:?}{mb}"));
    let start = sim.starts[i][k];
    let len = match pass {
        Pass::F => st[i].f,
        Pass::B => st[i].b,
        Pass::W => st[i].w,
    };
    (start, start + len)
}

#[test]
fn every_pass_runs_once_after_its_inputs_and_zb_h1_holds_no_more_than_1f1b() {
    for s in 1..=5 {
        let (st, p2p) = uneven(s);
        for m in 1..=10u32 {
            let one = simulate(Schedule::OneFOneB, &st, &p2p, m);
            let zb = simulate(Schedule::ZbH1, &st, &p2p, m);
            for (sim, schedule) in [(&one, Schedule::OneFOneB), (&zb, Schedule::ZbH1)] {
                for i in 0..s {
                    let mut ran = sim.streams[i].clone();
                    ran.sort_by_key(|&(p, mb)| (mb, p as u8));
                    let all: Vec<(Pass, u32)> = (0..m)
                        .flat_map(|mb| [(Pass::F, mb), (Pass::B, mb), (Pass::W, mb)])
                        .collect();
                    assert_eq!(ran, all, "stage {i}: every pass of every microbatch once");
                    for mb in 0..m {
                        let f = times(sim, &st, i, Pass::F, mb);
                        let b = times(sim, &st, i, Pass::B, mb);
                        let w = times(sim, &st, i, Pass::W, mb);
                        assert!(
                            f.1 <= b.0 && b.1 <= w.0,
                            "stage {i} mb {mb}: F, B, W in order"
                        );
                        if i > 0 {
                            let before = times(sim, &st, i - 1, Pass::F, mb).1 + p2p[i - 1];
                            assert!(f.0 >= before, "stage {i}: F{mb} before its activation");
                        }
                        if i + 1 < s {
                            // A fused backward sends its gradient after W; ZB-H1's after B.
                            let sent = match schedule {
                                Schedule::OneFOneB => times(sim, &st, i + 1, Pass::W, mb).1,
                                Schedule::ZbH1 => times(sim, &st, i + 1, Pass::B, mb).1,
                            };
                            assert!(b.0 >= sent + p2p[i], "stage {i}: B{mb} before its gradient");
                        }
                    }
                    // One pass at a time on a stage.
                    let mut spans: Vec<(Nanos, Nanos)> = sim.streams[i]
                        .iter()
                        .map(|&(p, mb)| times(sim, &st, i, p, mb))
                        .collect();
                    spans.sort();
                    assert!(
                        spans.windows(2).all(|w| w[0].1 <= w[1].0),
                        "stage {i} overlaps"
                    );
                }
            }
            let most = |x: &PassSimulation| x.peak_held.iter().copied().max().unwrap_or(0);
            assert!(
                most(&zb) <= most(&one),
                "S = {s}, m = {m}: {:?} vs {:?}",
                zb.peak_held,
                one.peak_held
            );
            assert_eq!(most(&one), (s as u32).min(m));
        }
    }
}

/// Runs every stage's instruction stream with buffered sends and blocking receives, as the
/// data plane does, until no stage can go on. Returns how many instructions each stage ran
/// and how many messages were sent but never received.
fn run_streams(streams: &[Vec<Instruction>]) -> (Vec<usize>, usize) {
    use std::collections::HashSet;
    let s = streams.len();
    let mut sent: HashSet<(usize, u32, bool)> = HashSet::new(); // (to stage, mb, gradient)
    let mut pc = vec![0usize; s];
    let mut progressed = true;
    while progressed {
        progressed = false;
        for i in 0..s {
            while let Some(&ins) = streams[i].get(pc[i]) {
                match ins {
                    Instruction::RecvActivation { mb } if !sent.remove(&(i, mb, false)) => break,
                    Instruction::RecvGradient { mb } if !sent.remove(&(i, mb, true)) => break,
                    Instruction::SendActivation { mb } => assert!(sent.insert((i + 1, mb, false))),
                    Instruction::SendGradient { mb } => assert!(sent.insert((i - 1, mb, true))),
                    _ => {}
                }
                pc[i] += 1;
                progressed = true;
            }
        }
    }
    (pc, sent.len())
}

/// ZB-H1's instruction streams, also with fewer microbatches than stages: every F, B and W of
/// every microbatch exactly once per stage, each W after its B, each B's gradient sent right
/// after it, and the stages run to the end with blocking receives (no deadlock).
#[test]
fn zb_h1_instruction_streams_are_complete_and_run_to_the_end() {
    for s in 1..=6usize {
        for m in 1..=9u32 {
            let streams: Vec<_> = (0..s).map(|i| stage_stream(i, s, m)).collect();
            for (i, st) in streams.iter().enumerate() {
                for mb in 0..m {
                    let at = |want: Instruction| {
                        let hits: Vec<_> = (0..st.len()).filter(|&k| st[k] == want).collect();
                        assert_eq!(hits.len(), 1, "S={s} m={m} stage {i}: {want:?} in {st:?}");
                        hits[0]
                    };
                    let f = at(Instruction::Forward { mb });
                    let b = at(Instruction::BackwardInput { mb });
                    let w = at(Instruction::BackwardWeight { mb });
                    assert!(f < b && b < w, "S={s} m={m} stage {i} mb {mb}");
                    if i > 0 {
                        assert_eq!(st[b + 1], Instruction::SendGradient { mb });
                    }
                }
                let fused = st
                    .iter()
                    .filter(|x| matches!(x, Instruction::Backward { .. }));
                assert_eq!(fused.count(), 0, "ZB-H1 runs no fused backward");
            }
            let (ran, unread) = run_streams(&streams);
            assert_eq!(unread, 0, "S={s} m={m}: messages nobody received");
            for (i, st) in streams.iter().enumerate() {
                assert_eq!(ran[i], st.len(), "S={s} m={m}: stage {i} stopped early");
            }
        }
    }
}

/// 1F1B through the same runner, so the runner is no rubber stamp: its streams run too, and
/// a stream whose receive comes before the matching send deadlocks.
#[test]
fn the_stream_runner_finds_a_deadlock() {
    let streams: Vec<_> = (0..3)
        .map(|i| crate::schedule::stage_stream(i, 3, 4))
        .collect();
    let lengths: Vec<usize> = streams.iter().map(Vec::len).collect();
    assert_eq!(run_streams(&streams), (lengths, 0));
    let mut broken = streams.clone();
    // Stage 1 waits for microbatch 1's gradient before it forwarded microbatch 0.
    broken[1].insert(0, Instruction::RecvGradient { mb: 1 });
    let (ran, _) = run_streams(&broken);
    assert_eq!(ran[1], 0, "{ran:?}");
}
