//! The table and JSON of `oobleck simulate`.

use oobleck_core::simulate::{Outcome, TimeFractions, TimeKind, Trace};

use super::{SimulateArgs, SimulateOutput};

/// What was simulated.
#[derive(Debug, serde::Serialize)]
pub struct TraceSummary {
    /// The file, or how the trace was generated.
    pub name: String,
    pub events: usize,
    pub adds: usize,
    pub removals: usize,
    pub start_nodes: usize,
    pub peak_nodes: usize,
    /// Time-weighted over the trace: the node count of the fault-free yardstick.
    pub mean_nodes: f64,
    pub duration_ms: u64,
}

impl TraceSummary {
    pub fn of(trace: &Trace, args: &SimulateArgs) -> TraceSummary {
        let name = match (&args.trace, &args.generate_failures) {
            (Some(path), _) => path.display().to_string(),
            (None, Some(mtbf)) => format!(
                "{} nodes, node MTBF {mtbf}, replacements after {}, {}, seed {}",
                args.nodes.unwrap_or(0),
                args.replace_after,
                args.duration,
                args.seed
            ),
            (None, None) => "trace".into(),
        };
        let removals = trace.removals();
        TraceSummary {
            name,
            events: trace.events().len(),
            adds: trace.events().len() - removals,
            removals,
            start_nodes: trace.nodes_at(trace.events()[0].at_ms),
            peak_nodes: trace.peak_nodes(),
            mean_nodes: trace.mean_nodes(),
            duration_ms: trace.end_ms(),
        }
    }
}

/// One policy's numbers.
#[derive(Debug, serde::Serialize)]
pub struct PolicyRow {
    pub policy: String,
    pub average_samples_per_s: f64,
    /// Against the fault-free yardstick of its family (None when there is none).
    pub of_fault_free: Option<f64>,
    pub time_fractions: TimeFractions,
    pub start_ms: u64,
    pub end_ms: u64,
    pub steps: u64,
    pub failures: u64,
    pub reconfigurations: u64,
    pub restarts: u64,
    pub notes: Vec<String>,
    /// Throughput over time: `[t_ms, samples_per_s]` from each point to the next.
    pub timeline: Vec<(u64, f64)>,
}

impl PolicyRow {
    pub fn of(o: &Outcome, fault_free: Option<f64>) -> PolicyRow {
        PolicyRow {
            policy: o.policy.clone(),
            average_samples_per_s: o.average_samples_per_s,
            of_fault_free: fault_free
                .filter(|&f| f > 0.0)
                .map(|f| o.average_samples_per_s / f),
            time_fractions: o.time_fractions,
            start_ms: o.start_ms,
            end_ms: o.end_ms,
            steps: o.steps,
            failures: o.failures,
            reconfigurations: o.reconfigurations,
            restarts: o.restarts,
            notes: o.notes.clone(),
            timeline: o
                .timeline
                .iter()
                .map(|p| (p.t_ms, p.samples_per_s))
                .collect(),
        }
    }
}

/// Hours with one decimal, or minutes under two hours.
fn span(ms: u64) -> String {
    let h = ms as f64 / 3.6e6;
    if h >= 2.0 {
        format!("{h:.1} h")
    } else {
        format!("{:.1} min", ms as f64 / 6e4)
    }
}

/// The human-readable output.
pub fn table(out: &SimulateOutput, setup: &str) -> String {
    let t = &out.trace;
    let mut s = format!(
        "trace: {}: {} events ({} adds, {} removals), {} nodes at the start, at most {}, \
         {:.1} on average, {}\n",
        t.name,
        t.events,
        t.adds,
        t.removals,
        t.start_nodes,
        t.peak_nodes,
        t.mean_nodes,
        span(t.duration_ms)
    );
    if out.policies.iter().any(|p| !p.policy.starts_with("table/")) {
        s.push_str(&format!("{setup}\n"));
    }
    s.push('\n');
    s.push_str("| policy | samples/s | of fault-free |");
    for k in TimeKind::ALL {
        s.push_str(&format!(" {} |", k.name()));
    }
    s.push_str(" failures | in place | restarts |\n|---|---:|---:|");
    s.push_str(&"---:|".repeat(TimeKind::ALL.len() + 3));
    s.push('\n');
    for p in &out.policies {
        let kept = p
            .of_fault_free
            .map_or("-".to_string(), |k| format!("{:.1} %", k * 100.0));
        s.push_str(&format!(
            "| {} | {:.2} | {kept} |",
            p.policy, p.average_samples_per_s
        ));
        for k in TimeKind::ALL {
            s.push_str(&format!(" {:.1} % |", p.time_fractions.get(k) * 100.0));
        }
        s.push_str(&format!(
            " {} | {} | {} |\n",
            p.failures, p.reconfigurations, p.restarts
        ));
    }
    s.push_str(
        "\nfault-free: the fastest plan on the trace's average node count with no fault \
         tolerance and no checkpoints (table policies: their own table at that count), i.e. the \
         same node-hours with no failure to handle; time fractions are of each policy's \
         averaged span\n",
    );
    for p in &out.policies {
        for n in &p.notes {
            s.push_str(&format!("{}: {n}\n", p.policy));
        }
    }
    s
}
