//! One reading of the run directory and the master, shared by every request until it is
//! older than the refresh interval ([`REFRESH`]): a thousand `/api/status` requests in a
//! quarter of a second read the run files once, ask the master once, and build and serialize
//! the document once (twice: with and without `can_act`). `/metrics` is rendered once per
//! reading too, on its first scrape. A page nobody looks at reads nothing.

use std::path::Path;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use oobleck_core::runtime::wire::protocol::ClusterStatus;
use serde_json::Value;

use super::feed::Feed;
use super::MasterView;

/// How old a reading may be when a request comes: `oobleck status` and a scrape see the step
/// committed a moment ago, and a flood of requests costs four readings a second.
pub const REFRESH: Duration = Duration::from_millis(250);

/// What the page knows, as of [`Snapshot::taken`].
#[derive(Debug)]
pub struct Snapshot {
    pub feed: Feed,
    pub master: MasterView,
    taken: Option<Instant>,
    /// `/api/status` as sent: without `can_act` and with it (built on the first request).
    status: Option<[Bytes; 2]>,
    /// `/metrics` as sent (rendered on the first scrape).
    metrics: Option<Bytes>,
}

impl Snapshot {
    pub fn new(run: &Path) -> Snapshot {
        Snapshot {
            feed: Feed::new(run),
            master: MasterView::default(),
            taken: None,
            status: None,
            metrics: None,
        }
    }

    /// Whether a request at `now` must take a new reading first.
    pub fn stale(&self, now: Instant, every: Duration) -> bool {
        self.taken
            .is_none_or(|t| now.saturating_duration_since(t) >= every)
    }

    /// A new reading: the run files read up to `now`, and the master's `answer` (an error
    /// names `master`).
    pub fn take(
        &mut self,
        answer: Result<ClusterStatus, impl std::fmt::Display>,
        master: std::net::SocketAddr,
        now: Instant,
    ) {
        if let Err(e) = self.feed.refresh() {
            tracing::warn!(error = %e, "status page: reading the run files");
        }
        self.master.record(answer, master, now);
        self.taken = Some(now);
        self.status = None;
        self.metrics = None;
    }

    /// The `/api/status` document of this reading, for a request that may act or not.
    pub fn status_json(&mut self, job: &Value, fault_threshold: u64, can_act: bool) -> Bytes {
        let (feed, master) = (&self.feed, &self.master);
        let docs = self.status.get_or_insert_with(|| {
            let mut doc = super::view::status(job.clone(), feed, master, fault_threshold, false);
            let looking = to_bytes(&doc);
            doc["can_act"] = true.into();
            [looking, to_bytes(&doc)]
        });
        docs[usize::from(can_act)].clone()
    }

    /// The `/metrics` text of this reading.
    pub fn metrics_text(&mut self, fault_threshold: u64) -> Bytes {
        let (feed, master) = (&self.feed, &self.master);
        self.metrics
            .get_or_insert_with(|| {
                let text = super::metrics::render(
                    feed,
                    master.status.as_ref(),
                    master.up,
                    fault_threshold,
                );
                Bytes::from(text)
            })
            .clone()
    }
}

fn to_bytes(doc: &Value) -> Bytes {
    // A `Value` has string keys and no custom serializer: writing it to memory cannot fail.
    Bytes::from(serde_json::to_vec(doc).expect("a JSON value serializes"))
}

impl MasterView {
    /// The master's answer (or its silence) at `now`.
    fn record(
        &mut self,
        answer: Result<ClusterStatus, impl std::fmt::Display>,
        master: std::net::SocketAddr,
        now: Instant,
    ) {
        match answer {
            Ok(s) => {
                self.status = Some(s);
                self.up = true;
                self.error = None;
                self.answered = Some(now);
            }
            Err(e) => {
                self.up = false;
                let since = self.answered.map_or(String::new(), |t| {
                    format!(
                        " (last answer {:.0} s ago)",
                        now.saturating_duration_since(t).as_secs_f64()
                    )
                });
                self.error = Some(format!(
                    "the master at {master} does not answer: {e}{since}"
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reading_is_reused_until_it_is_as_old_as_the_interval() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Snapshot::new(dir.path());
        let t0 = Instant::now();
        let every = Duration::from_millis(250);
        assert!(s.stale(t0, every), "no reading yet");
        let master: std::net::SocketAddr = "127.0.0.1:9".parse().unwrap();
        s.take(Err::<ClusterStatus, _>("refused"), master, t0);
        for (ms, stale) in [(0, false), (249, false), (250, true), (1000, true)] {
            let now = t0 + Duration::from_millis(ms);
            assert_eq!(s.stale(now, every), stale, "{ms} ms");
        }
    }

    #[test]
    fn the_document_is_built_once_per_reading_and_differs_only_in_can_act() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Snapshot::new(dir.path());
        let master: std::net::SocketAddr = "127.0.0.1:9".parse().unwrap();
        let t0 = Instant::now();
        s.take(Err::<ClusterStatus, _>("refused"), master, t0);
        let job = serde_json::json!({"run_dir": "/r"});
        let a = s.status_json(&job, 1, false);
        assert_eq!(a.as_ptr(), s.status_json(&job, 1, false).as_ptr(), "reused");
        let b = s.status_json(&job, 1, true);
        let (a, b): (Value, Value) = (
            serde_json::from_slice(&a).unwrap(),
            serde_json::from_slice(&b).unwrap(),
        );
        assert_eq!(a["can_act"], false);
        assert_eq!(b["can_act"], true);
        let error = a["error"].as_str().unwrap();
        assert!(
            error.contains("the master at 127.0.0.1:9 does not answer: refused"),
            "{error}"
        );
        s.take(
            Err::<ClusterStatus, _>("refused"),
            master,
            t0 + Duration::from_secs(2),
        );
        let again: Value = serde_json::from_slice(&s.status_json(&job, 1, false)).unwrap();
        assert_eq!(again["can_act"], false);
        assert!(
            again["error"].as_str().unwrap().ends_with("refused"),
            "never answered, so no last answer: {again}"
        );
    }
}
