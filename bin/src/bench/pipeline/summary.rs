//! From what the ranks recorded to a row of the table: the simulator's prediction, the measured
//! makespan, bubbles and gradient sync, and the post hoc simulation from in-pipeline busy times.

use std::time::Duration;

use oobleck_core::planning::profile::ns_to_ms;
use oobleck_core::schedule::zero_bubble::{self, closed_form, PassTimes};
use oobleck_core::schedule::{simulate, Schedule, StageTimes};

use super::profile::{imbalance, ProfiledStages};
use super::ranks::{IterRecord, RankResult};
use super::table::ms;
use super::{cores, BenchPipelineArgs, Config, Row, StageProfile};
use crate::bench::median;

/// `(S-1)/(m+S-1)`: the idle fraction of a balanced 1F1B (or GPipe) pipeline.
pub fn theoretical_bubble(stages: usize, m: u32) -> f64 {
    let s = stages as f64;
    (s - 1.0) / (f64::from(m) + s - 1.0)
}

/// The idle fraction of a balanced pipeline under `schedule` with equal F, B and W times:
/// 1F1B's `(S-1)/(m+S-1)`, ZB-H1's `(S-1)/(3m+S-1)` (Qi et al.'s closed forms).
pub fn theoretical_bubble_of(schedule: Schedule, stages: usize, m: u32) -> f64 {
    let unit = PassTimes { f: 1, b: 1, w: 1 };
    let span = closed_form(schedule, stages as u32, m, unit) as f64;
    1.0 - 3.0 * f64::from(m) / span
}

/// The simulated makespan of `stages` under `schedule` and each stage's bubble
/// (`1 - busy / makespan`): 1F1B from the fused forward and backward times, ZB-H1 from the
/// split F, B and W.
fn simulated(
    schedule: Schedule,
    fused: &[StageTimes],
    passes: &[PassTimes],
    p2p_ns: u64,
    m: u32,
) -> (u64, Vec<f64>) {
    let links = vec![p2p_ns; fused.len() - 1];
    let (makespan, work): (u64, Vec<u64>) = match schedule {
        Schedule::OneFOneB => (
            simulate(fused, &links, m).makespan_ns,
            fused.iter().map(|t| t.forward_ns + t.backward_ns).collect(),
        ),
        Schedule::ZbH1 => (
            zero_bubble::simulate(schedule, passes, &links, m).makespan_ns,
            passes.iter().map(|t| t.f + t.b + t.w).collect(),
        ),
    };
    let bubbles = work
        .iter()
        .map(|w| 1.0 - f64::from(m) * *w as f64 / makespan as f64)
        .collect();
    (makespan, bubbles)
}

/// One row from the profiles and every rank's records (control plane left NaN, filled in by
/// the caller).
pub(super) fn summarise(
    args: &BenchPipelineArgs,
    c: Config,
    schedule: Schedule,
    prof: &ProfiledStages,
    results: &[RankResult],
) -> Row {
    let s = c.stages;
    let m = args.microbatches;
    let world = s * c.pipelines;
    let (ranges, stage_times) = (&prof.ranges, &prof.times);
    // The simulator's prediction from the isolated profiles and the measured p2p time.
    let p2p_ns = if world > 1 {
        median(&results[0].p2p_ns)
    } else {
        0.0
    };
    let (sim_ns, sim_bubbles) = simulated(schedule, stage_times, &prof.passes, p2p_ns as u64, m);
    let sim_ms = sim_ns as f64 / 1e6;
    let samples = Samples::of(results, c, m, args.iters);
    let measured = median(&samples.iter_ms);
    let ratio = measured / sim_ms;
    let (busy_fused, busy_passes) =
        busy_stage_times(stage_times, &prof.passes, &samples.busy_per_mb);
    let (busy_ns, _) = simulated(schedule, &busy_fused, &busy_passes, p2p_ns as u64, m);
    let sim_busy_ms = busy_ns as f64 / 1e6;
    let planner_ms = ns_to_ms(prof.template.iteration_ns_for(u64::from(m)));
    let planned: Vec<f64> = prof
        .template
        .stages
        .iter()
        .map(|st| ns_to_ms(st.time_ns()))
        .collect();
    let busy: Vec<f64> = samples.busy_per_mb.iter().map(|b| median(b)).collect();
    let sync = median(&samples.sync_ms);
    let overlap = median(&samples.overlap_ms);
    Row {
        schedule,
        stages: s,
        pipelines: c.pipelines,
        ranks: world,
        cores: cores(),
        oversubscribed: world * args.threads_per_rank.max(1) > cores(),
        m,
        stage_profile: ranges
            .iter()
            .zip(stage_times.iter().zip(&prof.passes))
            .zip(busy.iter().zip(&planned))
            .map(|((r, (t, p)), (&busy, &planned_ms))| StageProfile {
                layers: (r.start, r.end),
                forward_ms: t.forward_ns as f64 / 1e6,
                backward_ms: t.backward_ns as f64 / 1e6,
                split_b_ms: p.b as f64 / 1e6,
                split_w_ms: p.w as f64 / 1e6,
                planned_ms,
                pipeline_busy_ms: busy,
            })
            .collect(),
        p2p_ms: p2p_ns / 1e6,
        measured_iter_ms: measured,
        planner_iter_ms: planner_ms,
        ratio_to_planner: measured / planner_ms,
        within_10pct_of_planner: (measured / planner_ms - 1.0).abs() <= 0.10,
        planned_imbalance: imbalance(&planned),
        measured_imbalance: imbalance(&busy),
        simulated_iter_ms: sim_ms,
        ratio,
        within_15pct: (ratio - 1.0).abs() <= 0.15,
        simulated_from_busy_ms: sim_busy_ms,
        ratio_to_busy_sim: measured / sim_busy_ms,
        bubble_measured_mean: median(&samples.bub_mean),
        bubble_measured_worst: median(&samples.bub_worst),
        bubble_simulated_mean: sim_bubbles.iter().sum::<f64>() / s as f64,
        bubble_theory: theoretical_bubble_of(schedule, s, m),
        sync_ms: sync,
        sync_overlap_backward_ms: overlap,
        sync_overlap_pct: if sync > 0.0 {
            100.0 * overlap / sync
        } else {
            0.0
        },
        sync_wait_for_peers_ms: median(&samples.wait_ms),
        step_ms: median(&samples.step_ms),
        control_plane_ms: f64::NAN,
        control_plane_pct: f64::NAN,
        control_plane_within_2pct: false,
        loss: results.iter().map(|r| r.loss).fold(f64::NAN, f64::max),
    }
}

/// The split of each stage's in-pipeline busy time per microbatch (median) into forward and
/// backward, and into F, B and W, in the proportions of its isolated profiles: what the post
/// hoc simulation is fed.
fn busy_stage_times(
    stage_times: &[StageTimes],
    passes: &[PassTimes],
    busy_per_mb: &[Vec<f64>],
) -> (Vec<StageTimes>, Vec<PassTimes>) {
    let mut fused = Vec::with_capacity(stage_times.len());
    let mut split = Vec::with_capacity(stage_times.len());
    for ((t, p), busy) in stage_times.iter().zip(passes).zip(busy_per_mb) {
        let busy_ns = median(busy) * 1e6;
        let total = (t.forward_ns + t.backward_ns).max(1) as f64;
        let f = busy_ns * t.forward_ns as f64 / total;
        fused.push(StageTimes {
            forward_ns: f as u64,
            backward_ns: (busy_ns - f).max(0.0) as u64,
        });
        let total = (p.f + p.b + p.w).max(1) as f64;
        let share = |x: u64| (busy_ns * x as f64 / total) as u64;
        split.push(PassTimes {
            f: share(p.f),
            b: share(p.b),
            w: share(p.w),
        });
    }
    (fused, split)
}

/// Per timed iteration, ms unless named otherwise: what the row's medians are taken over.
struct Samples {
    /// The slowest pipeline's makespan.
    iter_ms: Vec<f64>,
    /// First rank's start to the last rank's end of the optimizer step.
    step_ms: Vec<f64>,
    /// The slowest rank's gradient sync, its background part hidden behind its iteration, and
    /// its wait for peers still in their iteration.
    sync_ms: Vec<f64>,
    overlap_ms: Vec<f64>,
    wait_ms: Vec<f64>,
    /// Mean and worst bubble fraction over the ranks.
    bub_mean: Vec<f64>,
    bub_worst: Vec<f64>,
    /// Per stage: its busy time per microbatch, mean over pipelines.
    busy_per_mb: Vec<Vec<f64>>,
}

impl Samples {
    fn of(results: &[RankResult], c: Config, m: u32, iters: usize) -> Samples {
        let s = c.stages;
        let world = s * c.pipelines;
        let (mut iter_ms, mut step_ms, mut sync_ms, mut wait_ms) = (vec![], vec![], vec![], vec![]);
        let mut overlap_ms = vec![];
        let (mut bub_mean, mut bub_worst) = (vec![], vec![]);
        let mut busy_per_mb: Vec<Vec<f64>> = vec![vec![]; s];
        for k in 0..iters {
            let rec: Vec<IterRecord> = results.iter().map(|r| r.records[k]).collect();
            let mut worst_makespan = Duration::ZERO;
            let mut bubbles = Vec::with_capacity(world);
            let mut busy_sum = vec![0.0; s];
            for p in 0..c.pipelines {
                let rs = &rec[p * s..(p + 1) * s];
                let start = rs.iter().map(|r| r.start).min().expect("stages");
                let end = rs.iter().map(|r| r.iter_end).max().expect("stages");
                let makespan = end - start;
                worst_makespan = worst_makespan.max(makespan);
                for (i, r) in rs.iter().enumerate() {
                    let busy = (r.iter_end - r.start).saturating_sub(r.comm_in_iter);
                    bubbles.push(1.0 - busy.as_secs_f64() / makespan.as_secs_f64());
                    busy_sum[i] += ms(busy) / f64::from(m) / c.pipelines as f64;
                }
            }
            for (i, b) in busy_sum.into_iter().enumerate() {
                busy_per_mb[i].push(b);
            }
            iter_ms.push(ms(worst_makespan));
            bub_mean.push(bubbles.iter().sum::<f64>() / bubbles.len() as f64);
            bub_worst.push(bubbles.iter().copied().fold(f64::MIN, f64::max));
            let first = rec.iter().map(|r| r.start).min().expect("ranks");
            step_ms.push(ms(
                rec.iter().map(|r| r.step_end).max().expect("ranks") - first
            ));
            // Sync of the slowest rank: its background bucket all-reduces (during its last
            // backward) plus the rest in `sync_gradients`; overlap = the background part that ran
            // while its main thread was still computing or sending.
            let sync_of = |r: &IterRecord| r.bg_sync + (r.sync_end - r.iter_end);
            let slow = rec.iter().max_by_key(|r| sync_of(r)).expect("ranks");
            sync_ms.push(ms(sync_of(slow)));
            overlap_ms.push(ms(slow.bg_hidden));
            let last_iter_end = rec.iter().map(|r| r.iter_end).max().expect("ranks");
            wait_ms.push(ms(last_iter_end
                .min(slow.sync_end)
                .saturating_sub(slow.iter_end)));
        }
        Samples {
            iter_ms,
            step_ms,
            sync_ms,
            overlap_ms,
            wait_ms,
            bub_mean,
            bub_worst,
            busy_per_mb,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bubble_formula_is_s_minus_1_over_m_plus_s_minus_1() {
        assert_eq!(theoretical_bubble(1, 8), 0.0);
        assert!((theoretical_bubble(2, 8) - 1.0 / 9.0).abs() < 1e-12);
        assert!((theoretical_bubble(4, 4) - 3.0 / 7.0).abs() < 1e-12);
        for (s, m) in [(1, 8), (2, 8), (4, 4), (5, 3)] {
            let one = theoretical_bubble_of(Schedule::OneFOneB, s, m);
            assert!((one - theoretical_bubble(s, m)).abs() < 1e-12, "{s} {m}");
        }
        // ZB-H1: (S-1)/(3m+S-1).
        let zb = theoretical_bubble_of(Schedule::ZbH1, 4, 8);
        assert!((zb - 3.0 / 27.0).abs() < 1e-12, "{zb}");
    }
}
