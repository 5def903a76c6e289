//! The human-readable table of a report, and the small statistics its numbers go through.

use std::fmt::Write;
use std::time::Duration;

use oobleck_core::schedule::zero_bubble::{self, closed_form, PassTimes};
use oobleck_core::schedule::Schedule;

use super::{Report, Row};

pub(super) fn percentile(xs: &[f64], q: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

pub(super) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

pub(super) fn table(r: &Report) -> String {
    let mut o = String::new();
    header(&mut o, r);
    columns(&mut o, r);
    notes(&mut o, r);
    schedules(&mut o, r);
    o
}

/// Where a configuration ran under both schedules: their iteration, step and bubble side by
/// side with the simulator's, the closed form's ratio at S = 4, m = 8 with equal F, B and W,
/// and last the line `zb-h1/1f1b measured step ratio: X` of the first such configuration.
fn schedules(o: &mut String, r: &Report) {
    let pairs: Vec<(&Row, &Row)> = r
        .rows
        .iter()
        .filter(|a| a.schedule == Schedule::OneFOneB)
        .filter_map(|a| {
            let same = |b: &&Row| (b.stages, b.pipelines) == (a.stages, a.pipelines);
            let zb = r
                .rows
                .iter()
                .filter(same)
                .find(|b| b.schedule == Schedule::ZbH1)?;
            Some((a, zb))
        })
        .collect();
    if pairs.is_empty() {
        return;
    }
    let _ = writeln!(o, "schedules side by side (same stages, same data):");
    for (a, z) in &pairs {
        let _ = writeln!(
            o,
            "  {}x{}, m = {}: iteration 1f1b {:.1} ms, zb-h1 {:.1} ms (ratio {:.3}); step {:.1} \
             vs {:.1} ms (ratio {:.3}); bubble {:.3} vs {:.3}; simulated {:.1} vs {:.1} ms \
             (ratio {:.3})",
            a.stages,
            a.pipelines,
            a.m,
            a.measured_iter_ms,
            z.measured_iter_ms,
            z.measured_iter_ms / a.measured_iter_ms,
            a.step_ms,
            z.step_ms,
            z.step_ms / a.step_ms,
            a.bubble_measured_mean,
            z.bubble_measured_mean,
            a.simulated_iter_ms,
            z.simulated_iter_ms,
            z.simulated_iter_ms / a.simulated_iter_ms,
        );
    }
    let unit = PassTimes { f: 1, b: 1, w: 1 };
    let closed =
        |s| closed_form(Schedule::ZbH1, 4, 8, unit) as f64 / closed_form(s, 4, 8, unit) as f64;
    let sim = |s| zero_bubble::simulate(s, &[unit; 4], &[0; 3], 8).makespan_ns as f64;
    let _ = writeln!(
        o,
        "simulator, S = 4, m = 8, F = B = W: zb-h1/1f1b {:.3} (closed form {:.3})",
        sim(Schedule::ZbH1) / sim(Schedule::OneFOneB),
        closed(Schedule::OneFOneB)
    );
    let (a, z) = pairs[0];
    let _ = writeln!(
        o,
        "zb-h1/1f1b measured step ratio: {:.3}",
        z.step_ms / a.step_ms
    );
}

/// The run's settings and load, then each configuration's stage profiles.
fn header(o: &mut String, r: &Report) {
    let _ = writeln!(
        o,
        "pipeline benchmark: {} (vocab {}), seq {}, microbatch {}, {} warm-up + {} timed \
         iterations, {} core(s), {} rayon thread(s) per rank, TCP on 127.0.0.1",
        r.model,
        r.vocab,
        r.seq_len,
        r.microbatch_size,
        r.warmup,
        r.iters,
        r.cores,
        r.threads_per_rank
    );
    let _ = writeln!(
        o,
        "load average before {}, after {} (other processes share these cores)",
        r.load_before.as_deref().unwrap_or("n/a"),
        r.load_after.as_deref().unwrap_or("n/a")
    );
    for row in &r.rows {
        let stages: Vec<String> = row
            .stage_profile
            .iter()
            .map(|p| {
                format!(
                    "L{}..{} planned {:.1}, alone f {:.1} + b {:.1} (split B {:.1} + W {:.1}), \
                     in pipeline {:.1}",
                    p.layers.0,
                    p.layers.1,
                    p.planned_ms,
                    p.forward_ms,
                    p.backward_ms,
                    p.split_b_ms,
                    p.split_w_ms,
                    p.pipeline_busy_ms
                )
            })
            .collect();
        let _ = writeln!(
            o,
            "  {}x{} {} stages, ms/microbatch: {}; p2p {:.2} ms",
            row.stages,
            row.pipelines,
            row.schedule,
            stages.join(" | "),
            row.p2p_ms
        );
        let _ = writeln!(
            o,
            "      planner: predicted iteration {:.1} ms, measured {:.1} ms, measured/predicted \
             {:.3} (within 10%: {}); stage imbalance (slowest/fastest - 1) planned {:.1}%, \
             in pipeline {:.1}%",
            row.planner_iter_ms,
            row.measured_iter_ms,
            row.ratio_to_planner,
            yes(row.within_10pct_of_planner),
            100.0 * row.planned_imbalance,
            100.0 * row.measured_imbalance
        );
        let _ = writeln!(
            o,
            "      simulator fed the in-pipeline busy times (post hoc): {:.1} ms, measured/that {:.3}",
            row.simulated_from_busy_ms, row.ratio_to_busy_sim
        );
    }
}

/// One line per configuration under a header of columns.
fn columns(o: &mut String, r: &Report) {
    let _ = writeln!(
        o,
        "{:<11} {:>5} {:>3} {:>9} {:>9} {:>6} {:>5} {:>14} {:>7} {:>7} {:>8} {:>8} {:>9} {:>8} {:>8} {:>9} {:>4}",
        "SxP sched", "ranks", "m", "iter ms", "sim ms", "ratio", "<15%", "bubble m/worst", "sim", "theory",
        "sync ms", "overlap", "peer wait", "step ms", "ctl ms", "ctl %", "<2%"
    );
    for row in &r.rows {
        let _ = writeln!(
            o,
            "{:<11} {:>5} {:>3} {:>9.1} {:>9.1} {:>6.3} {:>5} {:>6.3}/{:<7.3} {:>7.3} {:>7.3} {:>8.2} {:>7.0}% {:>9.2} {:>8.1} {:>8.3} {:>8.3}% {:>4}",
            format!("{}x{} {}", row.stages, row.pipelines, row.schedule),
            format!("{}{}", row.ranks, if row.oversubscribed { "*" } else { "" }),
            row.m,
            row.measured_iter_ms,
            row.simulated_iter_ms,
            row.ratio,
            yes(row.within_15pct),
            row.bubble_measured_mean,
            row.bubble_measured_worst,
            row.bubble_simulated_mean,
            row.bubble_theory,
            row.sync_ms,
            row.sync_overlap_pct,
            row.sync_wait_for_peers_ms,
            row.step_ms,
            row.control_plane_ms,
            row.control_plane_pct,
            yes(row.control_plane_within_2pct),
        );
    }
}

/// What the columns mean, the control-plane measurements, and the oversubscription warning.
fn notes(o: &mut String, r: &Report) {
    let _ = writeln!(
        o,
        "iter = makespan of run_iteration (slowest pipeline); sim = schedule::simulate from the \
         isolated stage profiles and p2p (zb-h1: zero_bubble::simulate from the stages' F, B \
         and W, profiled split); bubble = 1 - busy/iter per rank (busy = time outside \
         communicator calls), mean/worst; theory = (S-1)/(m+S-1) (zb-h1: (S-1)/(3m+S-1)); sync = gradient sync of the \
         slowest rank (bucket all-reduces started during its last backward + sync_gradients), \
         overlap = its share run while its main thread was still in the iteration, peer wait = \
         time in sync_gradients while another rank was still in its iteration; step = iteration + sync + AdamW; ctl = control-plane commit round trip."
    );
    for cp in &r.control_plane {
        let _ = writeln!(
            o,
            "control plane, {} agent(s): median {:.3} ms, p90 {:.3} ms over {} steps; ready leg: {}",
            cp.agents, cp.round_trip_ms, cp.p90_ms, cp.steps, cp.ready_leg
        );
    }
    if r.rows.iter().any(|x| x.oversubscribed) {
        let _ = writeln!(
            o,
            "* more rank threads than the {} core(s): ranks share cores, so those rows' measured \
             times include waiting for a core and do not compare with the isolated profiles.",
            r.cores
        );
    }
}
