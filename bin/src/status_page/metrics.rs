//! `/metrics`: the job in the Prometheus text format, written with `prometheus-client` from a
//! fresh registry per scrape (the values are the feed's and the master's at that moment, so
//! nothing is kept in two places).
//!
//! Gauges of the newest committed step come from its `metrics.jsonl` line, so a scrape agrees
//! with the file; membership comes from the master's status when it answers.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;

use oobleck_core::elastic::protocol::ClusterStatus;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use serde_json::Value;

use super::feed::Feed;

type G = Gauge<f64, AtomicU64>;
type Labels = Vec<(String, String)>;

/// Where a rank runs: `(pipeline, stage, node)`.
pub type Place = (u32, usize, u32);

/// Each rank's pipeline and stage: a pipeline's ranks are numbered from its lowest, stage by
/// stage, `devices` ranks per stage (the order `planning` assigns them).
pub fn places(status: &ClusterStatus) -> BTreeMap<u32, Place> {
    let mut out = BTreeMap::new();
    for p in &status.pipelines {
        let Some(first) = status
            .ranks
            .iter()
            .filter(|r| p.nodes.contains(&r.node))
            .map(|r| r.rank)
            .min()
        else {
            continue;
        };
        let mut rank = first;
        for (i, st) in p.stages.iter().enumerate() {
            for _ in 0..st.devices.max(1) {
                out.insert(rank, (p.id, i, st.node));
                rank += 1;
            }
        }
    }
    out
}

fn gauge(reg: &mut Registry, name: &str, help: &str, v: Option<f64>) {
    if let Some(v) = v.filter(|v| v.is_finite()) {
        let g = G::default();
        g.set(v);
        reg.register(name, help, g);
    }
}

fn phase_histogram() -> Histogram {
    // 10 ms to about 3 minutes.
    Histogram::new(exponential_buckets(0.01, 2.0, 15))
}

/// The text of one scrape. `status`: the master's newest answer, if any; `up`: whether it
/// answered the last poll; `fault_threshold`: the job's `f`.
pub fn render(
    feed: &Feed,
    status: Option<&ClusterStatus>,
    up: bool,
    fault_threshold: u64,
) -> String {
    let mut reg = Registry::with_prefix("oobleck");
    let num = |k: &str| feed.latest.as_ref().and_then(|m| m[k].as_f64());
    gauge(
        &mut reg,
        "master_up",
        "1 when the master answered the status page's last poll",
        Some(f64::from(u8::from(up))),
    );
    gauge(&mut reg, "step", "The newest committed step", num("step"));
    gauge(
        &mut reg,
        "loss",
        "Training loss of the newest committed step",
        num("loss"),
    );
    gauge(
        &mut reg,
        "val_loss",
        "The newest validation loss",
        feed.val_loss.map(|v| v.1),
    );
    gauge(
        &mut reg,
        "tokens_per_second",
        "Tokens per second of the newest committed step",
        num("tokens_per_s"),
    );
    gauge(
        &mut reg,
        "samples_per_second",
        "Samples per second of the newest committed step",
        num("samples_per_s"),
    );
    gauge(
        &mut reg,
        "generation",
        "Plan generation of the newest committed step",
        num("generation").or(status.map(|s| s.generation as f64)),
    );
    gauge(
        &mut reg,
        "pipelines",
        "Pipelines of the plan in force",
        status
            .map(|s| s.pipelines.len() as f64)
            .or(num("pipelines")),
    );
    gauge(
        &mut reg,
        "nodes",
        "Live nodes",
        status.map(|s| s.nodes.len() as f64).or(num("nodes")),
    );
    gauge(
        &mut reg,
        "expected_nodes",
        "Nodes the job was started with",
        status.map(|s| f64::from(s.expected_nodes)),
    );
    let f_left = feed.fault_tolerance.unwrap_or(fault_threshold);
    gauge(
        &mut reg,
        "fault_tolerance",
        "Node failures the plan in force survives in place",
        Some(f_left as f64),
    );
    let reconfigs = Counter::<u64>::default();
    reconfigs.inc_by(feed.reconfigs);
    reg.register(
        "reconfigurations",
        "Reconfigurations (failures, joins, drains)",
        reconfigs,
    );
    let phases =
        Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(phase_histogram);
    for r in &feed.recoveries {
        for (phase, s) in r {
            let name = phase.strip_suffix("_s").unwrap_or(phase).to_string();
            phases
                .get_or_create(&vec![("phase".into(), name)])
                .observe(*s);
        }
    }
    reg.register(
        "reconfiguration_phase_seconds",
        "Recovery phases, from failure to the first commit",
        phases,
    );
    stage_times(&mut reg, feed.latest.as_ref(), status);
    let mut out = String::new();
    encode(&mut out, &reg).expect("writing to a String cannot fail");
    out
}

/// Per-rank gauges of the newest step's times, labelled with the rank's place.
fn stage_times(reg: &mut Registry, latest: Option<&Value>, status: Option<&ClusterStatus>) {
    let Some(times) = latest.and_then(|m| m["times"].as_object()) else {
        return;
    };
    let places = status.map(places).unwrap_or_default();
    let fields = [
        (
            "forward_ms",
            "stage_forward_ms",
            "Forward time of the rank's microbatches in the newest step, ms",
        ),
        (
            "backward_ms",
            "stage_backward_ms",
            "Backward time in the newest step, ms",
        ),
        (
            "p2p_ms",
            "stage_p2p_wait_ms",
            "Time inside activation and gradient sends and receives in the newest step, ms",
        ),
        (
            "collective_ms",
            "stage_gradient_sync_ms",
            "Time inside gradient collectives in the newest step, ms",
        ),
        (
            "step_ms",
            "stage_step_ms",
            "From the step's start to its gradients reduced, ms",
        ),
    ];
    for (field, name, help) in fields {
        let family = Family::<Labels, G>::default();
        for (rank, t) in times {
            let Some(v) = t[field].as_f64() else { continue };
            let mut labels = vec![("rank".to_string(), rank.clone())];
            if let Some((p, s, n)) = rank.parse().ok().and_then(|r: u32| places.get(&r)) {
                labels.push(("pipeline".into(), p.to_string()));
                labels.push(("stage".into(), s.to_string()));
                labels.push(("node".into(), n.to_string()));
            }
            family.get_or_create(&labels).set(v);
        }
        reg.register(name, help, family);
    }
}
