//! `/metrics`: the job in the Prometheus text format, written with `prometheus-client` from a
//! fresh registry per scrape (the values are the feed's and the master's at that moment, so
//! nothing is kept in two places).
//!
//! Gauges of the newest committed step come from its `metrics.jsonl` line, so a scrape agrees
//! with the file; membership comes from the master's status when it answers.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;

use oobleck_core::execution::StepTimes;
use oobleck_core::runtime::wire::protocol::ClusterStatus;
use oobleck_core::runtime::wire::records::StepMetrics;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::feed::Feed;

type G = Gauge<f64, AtomicU64>;
type Labels = Vec<(String, String)>;

/// Where a rank runs: `(pipeline, stage, node)`.
pub type Place = (u32, usize, u32);

/// Each rank's pipeline and stage. A pipeline's node `j` holds ranks `first_rank + j * G ..`
/// (`G` devices per node, `planning::instantiate`), given to its stages in order.
pub fn places(status: &ClusterStatus) -> BTreeMap<u32, Place> {
    let mut out = BTreeMap::new();
    for p in &status.pipelines {
        let per_node = |node: u32| {
            let on_node = p
                .stages
                .iter()
                .filter(|s| s.node == node)
                .map(|s| s.devices)
                .sum();
            status
                .nodes
                .iter()
                .find(|n| n.node == node)
                .map_or(on_node, |n| n.devices)
        };
        let mut used: BTreeMap<u32, u32> = BTreeMap::new();
        for (i, st) in p.stages.iter().enumerate() {
            let Some(j) = p.nodes.iter().position(|&n| n == st.node) else {
                continue;
            };
            let offset = used.entry(st.node).or_default();
            let base = p.first_rank + j as u32 * per_node(st.node) + *offset;
            for d in 0..st.devices.max(1) {
                out.insert(base + d, (p.id, i, st.node));
            }
            *offset += st.devices.max(1);
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

/// The job's gauges: name, help, value (left out when unknown). `status`: the master's newest
/// answer, if any; `up`: whether it answered the last request; `fault_threshold`: the job's `f`.
fn job_gauges(
    feed: &Feed,
    status: Option<&ClusterStatus>,
    up: bool,
    fault_threshold: u64,
) -> Vec<(&'static str, &'static str, Option<f64>)> {
    let latest = feed.latest.as_ref();
    let num = |f: fn(&StepMetrics) -> f64| latest.map(f).filter(|x| !x.is_nan());
    let count = |f: fn(&StepMetrics) -> usize| latest.map(f).filter(|n| *n > 0).map(|n| n as f64);
    let of_status = |f: fn(&ClusterStatus) -> f64| status.map(f);
    let f_left = feed.fault_tolerance.unwrap_or(fault_threshold);
    vec![
        (
            "master_up",
            "1 when the master answered the status page's last request",
            Some(f64::from(u8::from(up))),
        ),
        (
            "master_epoch",
            "The epoch of the master serving this page: 1 for the job's first, one more for each \
             that took over (a standby master, or --reattach)",
            of_status(|s| s.epoch as f64).filter(|e| *e > 0.0),
        ),
        (
            "standby_masters",
            "Standby masters that keep a copy of the run and take over if the master is lost",
            of_status(|s| s.standbys.len() as f64),
        ),
        ("step", "The newest committed step", num(|m| m.step as f64)),
        (
            "loss",
            "Training loss of the newest committed step",
            num(|m| m.loss),
        ),
        (
            "val_loss",
            "The newest validation loss",
            feed.val_loss.map(|v| v.1),
        ),
        (
            "tokens_per_second",
            "Tokens per second of the newest committed step",
            num(|m| m.tokens_per_s),
        ),
        (
            "samples_per_second",
            "Samples per second of the newest committed step",
            num(|m| m.samples_per_s),
        ),
        (
            "generation",
            "Plan generation of the newest committed step",
            num(|m| m.generation as f64).or(of_status(|s| s.generation as f64)),
        ),
        (
            "pipelines",
            "Pipelines of the plan in force",
            of_status(|s| s.pipelines.len() as f64).or(count(|m| m.pipelines)),
        ),
        (
            "nodes",
            "Live nodes",
            of_status(|s| s.nodes.len() as f64).or(count(|m| m.nodes)),
        ),
        (
            "expected_nodes",
            "Nodes the job was started with",
            of_status(|s| f64::from(s.expected_nodes)),
        ),
        (
            "fault_tolerance",
            "Node failures the plan in force survives in place",
            Some(f_left as f64),
        ),
    ]
}

/// The text of one scrape (arguments as [`job_gauges`]).
pub fn render(
    feed: &Feed,
    status: Option<&ClusterStatus>,
    up: bool,
    fault_threshold: u64,
) -> String {
    let mut reg = Registry::with_prefix("oobleck");
    for (name, help, v) in job_gauges(feed, status, up, fault_threshold) {
        gauge(&mut reg, name, help, v);
    }
    recoveries(&mut reg, feed);
    stage_times(&mut reg, feed.latest.as_ref(), status);
    let mut out = String::new();
    encode(&mut out, &reg).expect("writing to a String cannot fail");
    out
}

/// The reconfiguration count and each recovery phase's histogram.
fn recoveries(reg: &mut Registry, feed: &Feed) {
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
}

/// One of a rank's step times.
type TimeOf = fn(&StepTimes) -> f64;

/// Per-rank gauges of the newest step's times, labelled with the rank's place.
fn stage_times(reg: &mut Registry, latest: Option<&StepMetrics>, status: Option<&ClusterStatus>) {
    let Some(times) = latest.map(|m| &m.times) else {
        return;
    };
    let places = status.map(places).unwrap_or_default();
    let fields: [(TimeOf, &str, &str); 5] = [
        (
            |t| t.forward_ms,
            "stage_forward_ms",
            "Forward time of the rank's microbatches in the newest step, ms",
        ),
        (
            |t| t.backward_ms,
            "stage_backward_ms",
            "Backward time in the newest step, ms",
        ),
        (
            |t| t.p2p_ms,
            "stage_p2p_wait_ms",
            "Time inside activation and gradient sends and receives in the newest step, ms",
        ),
        (
            |t| t.collective_ms,
            "stage_gradient_sync_ms",
            "Time inside gradient collectives in the newest step, ms",
        ),
        (
            |t| t.step_ms,
            "stage_step_ms",
            "From the step's start to its gradients reduced, ms",
        ),
    ];
    for (field, name, help) in fields {
        let family = Family::<Labels, G>::default();
        for (rank, t) in times {
            let mut labels = vec![("rank".to_string(), rank.to_string())];
            if let Some((p, s, n)) = places.get(rank) {
                labels.push(("pipeline".into(), p.to_string()));
                labels.push(("stage".into(), s.to_string()));
                labels.push(("node".into(), n.to_string()));
            }
            family.get_or_create(&labels).set(field(t));
        }
        reg.register(name, help, family);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status_page::feed::tests::{reconfig_line, resumed_line};
    use oobleck_core::runtime::wire::protocol::{
        NodeStatus, PipelineStatus, RankStatus, StageStatus,
    };
    use prometheus_parse::{Scrape, Value as P};

    fn scrape(text: &str) -> Scrape {
        Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).expect("Prometheus text")
    }

    fn value(s: &Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        s.samples
            .iter()
            .find(|x| x.metric == name && labels.iter().all(|(k, v)| x.labels.get(k) == Some(*v)))
            .map(|x| match &x.value {
                P::Gauge(v) | P::Counter(v) | P::Untyped(v) => *v,
                other => panic!("{name}: {other:?}"),
            })
    }

    /// Two pipelines: p0 on node 0 (one stage), p1 on nodes 1 and 2 (two stages, ranks 1, 2).
    fn status() -> ClusterStatus {
        let node = |n| NodeStatus {
            node: n,
            addr: format!("127.0.0.1:{n}"),
            devices: 1,
            last_seen_ms: 5,
        };
        let stage = |a, b, n| StageStatus {
            layers: (a, b),
            devices: 1,
            node: n,
        };
        let rank = |r, n| RankStatus {
            rank: r,
            node: n,
            times: Default::default(),
            straggler: false,
        };
        ClusterStatus {
            nodes: (0..3).map(node).collect(),
            expected_nodes: 3,
            pipelines: vec![
                PipelineStatus {
                    id: 0,
                    template_nodes: 1,
                    nodes: vec![0],
                    microbatches: 2,
                    stages: vec![stage(0, 4, 0)],
                    first_rank: 0,
                },
                PipelineStatus {
                    id: 1,
                    template_nodes: 2,
                    nodes: vec![1, 2],
                    microbatches: 2,
                    stages: vec![stage(0, 3, 1), stage(3, 4, 2)],
                    first_rank: 1,
                },
            ],
            generation: 1,
            committed_step: Some(7),
            samples_per_s: 4.0,
            joining: vec![],
            draining: vec![],
            spare: vec![],
            ranks: vec![rank(0, 0), rank(1, 1), rank(2, 2)],
            epoch: 3,
            standbys: vec!["127.0.0.1:7001".into()],
        }
    }

    #[test]
    fn a_scrape_parses_and_carries_the_newest_step_and_each_ranks_place() {
        let dir = tempfile::tempdir().unwrap();
        let times = serde_json::json!({"2": {"compute_ms": 80.0, "forward_ms": 30.0,
            "backward_ms": 45.0, "p2p_ms": 2.0, "collective_ms": 5.0, "step_ms": 95.0}});
        let lines = [
            serde_json::json!({"step": 6, "loss": 7.0, "tokens_per_s": 500.0, "val_loss": 7.2,
                               "generation": 0, "wall_s": 6.0}),
            serde_json::json!({"step": 7, "loss": 6.5, "tokens_per_s": 610.5, "generation": 1,
                               "wall_s": 7.0, "times": times}),
        ];
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(dir.path().join("metrics.jsonl"), text).unwrap();
        std::fs::write(
            dir.path().join("events.jsonl"),
            reconfig_line(0) + &resumed_line(&[("detect_s", 0.5), ("copy_s", 0.03)]),
        )
        .unwrap();
        let mut feed = Feed::new(dir.path());
        feed.refresh().unwrap();
        let st = status();
        assert_eq!(
            places(&st)[&2],
            (1, 1, 2),
            "rank 2: pipeline 1, stage 1, node 2"
        );
        let s = scrape(&render(&feed, Some(&st), true, 1));
        for (name, want) in [
            ("oobleck_step", 7.0),
            ("oobleck_loss", 6.5),
            ("oobleck_val_loss", 7.2),
            ("oobleck_tokens_per_second", 610.5),
            ("oobleck_generation", 1.0),
            ("oobleck_pipelines", 2.0),
            ("oobleck_nodes", 3.0),
            ("oobleck_fault_tolerance", 0.0),
            ("oobleck_master_up", 1.0),
            ("oobleck_master_epoch", 3.0),
            ("oobleck_standby_masters", 1.0),
            ("oobleck_reconfigurations_total", 1.0),
        ] {
            assert_eq!(value(&s, name, &[]), Some(want), "{name}");
        }
        let at = [
            ("rank", "2"),
            ("pipeline", "1"),
            ("stage", "1"),
            ("node", "2"),
        ];
        assert_eq!(value(&s, "oobleck_stage_backward_ms", &at), Some(45.0));
        assert_eq!(value(&s, "oobleck_stage_gradient_sync_ms", &at), Some(5.0));
        let h = s
            .samples
            .iter()
            .find(|x| {
                x.metric == "oobleck_reconfiguration_phase_seconds"
                    && x.labels.get("phase") == Some("copy")
            })
            .expect("the copy phase's histogram");
        let P::Histogram(buckets) = &h.value else {
            panic!("{:?}", h.value)
        };
        // 0.03 s falls in the 0.04 bucket and above, not in 0.01 or 0.02.
        let count = |le: f64| buckets.iter().find(|b| b.less_than == le).map(|b| b.count);
        assert_eq!((count(0.02), count(0.04)), (Some(0.0), Some(1.0)));
        // The master down: membership gauges fall back to the metrics line's, which has none.
        let s = scrape(&render(&feed, None, false, 1));
        assert_eq!(value(&s, "oobleck_master_up", &[]), Some(0.0));
        assert_eq!(value(&s, "oobleck_nodes", &[]), None);
        assert_eq!(value(&s, "oobleck_master_epoch", &[]), None);
    }
}
