//! `/api/status`: the page's one JSON document (`README.md` here has the schema,
//! `oobleck status` prints its `cluster`). Built here from the feed, the master's newest answer
//! and the job's configuration, with no I/O.

use serde_json::{json, Map, Value};

use super::feed::Feed;
use super::MasterView;

/// The fields of `config.json` the page's header shows.
const JOB_FIELDS: [&str; 5] = [
    "model",
    "steps",
    "fault_threshold",
    "global_batch_size",
    "nodes",
];

/// The job's header: `model`, `total_steps`, `fault_threshold`... from `config.json` (an empty
/// object before it exists or when it does not parse).
pub fn job(config: Option<&Value>, run_dir: &str) -> Value {
    let mut out = Map::new();
    out.insert("run_dir".into(), run_dir.into());
    if let Some(c) = config {
        for k in JOB_FIELDS {
            if let Some(v) = c.get(k) {
                let name = if k == "steps" { "total_steps" } else { k };
                out.insert(name.into(), v.clone());
            }
        }
    }
    Value::Object(out)
}

/// The newest step in the page's terms (`null` before the first).
fn latest(feed: &Feed) -> Value {
    let Some(m) = &feed.latest else {
        return Value::Null;
    };
    let count = |n: usize| if n > 0 { Value::from(n) } else { Value::Null };
    let mut out = Map::new();
    out.insert("step".into(), m.step.into());
    // A NaN (a diverged loss) is shown as `null`, as the metrics line has it.
    out.insert("loss".into(), m.loss.into());
    out.insert("tokens_per_s".into(), m.tokens_per_s.into());
    out.insert("samples_per_s".into(), m.samples_per_s.into());
    out.insert("wall_s".into(), m.wall_s.into());
    out.insert("generation".into(), m.generation.into());
    out.insert("pipelines".into(), count(m.pipelines));
    out.insert("nodes".into(), count(m.nodes));
    out.insert(
        "val_loss".into(),
        feed.val_loss.map_or(Value::Null, |v| v.1.into()),
    );
    Value::Object(out)
}

/// The whole document. `can_act`: whether the asking request may act.
pub fn status(
    job: Value,
    feed: &Feed,
    master: &MasterView,
    fault_threshold: u64,
    can_act: bool,
) -> Value {
    json!({
        "job": job,
        "connected": master.up,
        "error": master.error,
        "finished": feed.finished,
        "can_act": can_act,
        "fault_tolerance_left": feed.fault_tolerance.unwrap_or(fault_threshold),
        "charts_version": feed.charts_version(),
        "latest": latest(feed),
        "cluster": master.status,
        "events": feed.recent,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn the_document_has_every_field_of_the_schema_before_and_after_a_step() {
        let dir = tempfile::tempdir().unwrap();
        let mut feed = Feed::new(dir.path());
        let job = job(
            Some(&json!({"model": "gpt-tiny", "steps": 40, "fault_threshold": 1, "lr": 1e-3})),
            "/r",
        );
        assert_eq!(
            job,
            json!({"run_dir": "/r", "model": "gpt-tiny", "total_steps": 40,
                               "fault_threshold": 1})
        );
        let down = MasterView {
            error: Some("no answer".into()),
            ..MasterView::default()
        };
        let v = status(job.clone(), &feed, &down, 1, false);
        for k in [
            "job",
            "connected",
            "error",
            "finished",
            "can_act",
            "fault_tolerance_left",
            "charts_version",
            "latest",
            "cluster",
            "events",
        ] {
            assert!(v.get(k).is_some(), "{k} missing: {v}");
        }
        assert_eq!(
            (v["latest"].clone(), v["cluster"].clone()),
            (Value::Null, Value::Null)
        );
        assert_eq!(v["error"], "no answer");
        let mut f = std::fs::File::create(dir.path().join("metrics.jsonl")).unwrap();
        writeln!(
            f,
            "{}",
            json!({"step": 3, "loss": 7.5, "tokens_per_s": 600.0, "generation": 1,
                                 "wall_s": 2.0, "val_loss": 7.9})
        )
        .unwrap();
        let mut f = std::fs::File::create(dir.path().join("events.jsonl")).unwrap();
        write!(f, "{}", crate::status_page::feed::tests::reconfig_line(0)).unwrap();
        feed.refresh().unwrap();
        let v = status(job, &feed, &MasterView::default(), 1, true);
        assert_eq!(v["latest"]["step"], 3);
        assert_eq!(v["latest"]["val_loss"], 7.9);
        assert_eq!(v["latest"]["nodes"], Value::Null, "absent fields are null");
        assert_eq!(v["fault_tolerance_left"], 0, "the reconfiguration's, not f");
        assert_eq!(v["events"][0]["event"], "reconfig");
        assert_eq!(v["can_act"], true);
    }
}
