//! What the run directory says, read as it grows: the newest `metrics.jsonl` line, the last
//! events of `events.jsonl`, and the few totals `/metrics` reports. Each read takes only what
//! was appended since the last one; a file that shrank (a resumed run truncates its metrics)
//! is read again from the start.

use std::collections::{BTreeMap, VecDeque};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use oobleck_core::runtime::wire::records::{Event, StepMetrics};
use oobleck_core::runtime::wire::EventLine;
use serde_json::Value;

/// Events kept for the page.
pub const EVENTS_KEPT: usize = 200;

/// The appended complete lines of one file.
#[derive(Debug)]
pub struct Tail {
    path: PathBuf,
    offset: u64,
    /// A last line not yet ended by a newline (being written).
    partial: Vec<u8>,
}

impl Tail {
    pub fn new(path: PathBuf) -> Tail {
        Tail {
            path,
            offset: 0,
            partial: Vec::new(),
        }
    }

    /// The complete lines appended since the last call, and whether the file was read anew
    /// from its start (it shrank). A missing file has no lines.
    pub fn read_new(&mut self) -> std::io::Result<(Vec<String>, bool)> {
        let mut f = match std::fs::File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), false)),
            Err(e) => return Err(e),
        };
        let len = f.metadata()?.len();
        let restarted = len < self.offset;
        if restarted {
            self.offset = 0;
            self.partial.clear();
        }
        f.seek(SeekFrom::Start(self.offset))?;
        let mut buf = Vec::new();
        f.take(len - self.offset).read_to_end(&mut buf)?;
        self.offset += buf.len() as u64;
        self.partial.extend_from_slice(&buf);
        let Some(end) = self.partial.iter().rposition(|&b| b == b'\n') else {
            return Ok((Vec::new(), restarted));
        };
        let rest = self.partial.split_off(end + 1);
        let done = std::mem::replace(&mut self.partial, rest);
        let lines = String::from_utf8_lossy(&done)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect();
        Ok((lines, restarted))
    }
}

/// The run directory as the page and `/metrics` see it.
#[derive(Debug)]
pub struct Feed {
    metrics: Tail,
    events: Tail,
    /// The newest metrics line.
    pub latest: Option<StepMetrics>,
    /// The newest validation loss and its step.
    pub val_loss: Option<(u64, f64)>,
    /// The last [`EVENTS_KEPT`] events, oldest first, as the page shows them (each line's
    /// `event` kind and fields, also of kinds this binary does not know).
    pub recent: VecDeque<Value>,
    /// Committed-step lines and events read so far (they version the charts).
    pub metric_lines: u64,
    pub event_lines: u64,
    /// A `finish` or `abort` event was seen.
    pub finished: bool,
    /// Reconfigurations (`reconfig` events).
    pub reconfigs: u64,
    /// The fault tolerance the newest reconfiguration left.
    pub fault_tolerance: Option<u64>,
    /// Each recovery's phases (`resumed` events), seconds.
    pub recoveries: Vec<BTreeMap<String, f64>>,
    /// Lines that did not parse (skipped).
    pub bad_lines: u64,
}

impl Feed {
    pub fn new(run: &Path) -> Feed {
        Feed {
            metrics: Tail::new(run.join("metrics.jsonl")),
            events: Tail::new(run.join("events.jsonl")),
            latest: None,
            val_loss: None,
            recent: VecDeque::new(),
            metric_lines: 0,
            event_lines: 0,
            finished: false,
            reconfigs: 0,
            fault_tolerance: None,
            recoveries: Vec::new(),
            bad_lines: 0,
        }
    }

    /// Reads what was appended. I/O errors are returned; unparsable lines are counted.
    pub fn refresh(&mut self) -> std::io::Result<()> {
        let (lines, restarted) = self.metrics.read_new()?;
        if restarted {
            self.latest = None;
            self.val_loss = None;
            self.metric_lines = 0;
        }
        for l in lines {
            match serde_json::from_str::<StepMetrics>(&l) {
                Ok(m) => {
                    self.metric_lines += 1;
                    if let Some(val) = m.val_loss {
                        self.val_loss = Some((m.step, val));
                    }
                    self.latest = Some(m);
                }
                Err(_) => self.bad_lines += 1,
            }
        }
        let (lines, restarted) = self.events.read_new()?;
        if restarted {
            self.forget_events();
        }
        for l in lines {
            match EventLine::parse(&l) {
                Ok(e) => self.take_event(e),
                Err(_) => self.bad_lines += 1,
            }
        }
        Ok(())
    }

    fn forget_events(&mut self) {
        self.recent.clear();
        self.event_lines = 0;
        self.finished = false;
        self.reconfigs = 0;
        self.fault_tolerance = None;
        self.recoveries.clear();
    }

    /// Counts what the page totals from the events this binary knows, and keeps every event
    /// (a newer kind too) for the page's list.
    fn take_event(&mut self, line: EventLine) {
        self.event_lines += 1;
        match line.known() {
            Some(Event::Finish { .. } | Event::Abort { .. }) => self.finished = true,
            Some(Event::Reconfig {
                fault_tolerance, ..
            }) => {
                self.reconfigs += 1;
                self.fault_tolerance = Some(u64::from(*fault_tolerance));
            }
            Some(Event::Resumed { phases, .. }) => self.recoveries.push(phases.clone()),
            _ => {}
        }
        if self.recent.len() == EVENTS_KEPT {
            self.recent.pop_front();
        }
        let mut shown = line.fields();
        shown.insert("event".into(), line.kind().into());
        self.recent.push_back(Value::Object(shown));
    }

    /// Changes whenever a chart would: a step committed or an event logged.
    pub fn charts_version(&self) -> u64 {
        self.metric_lines * 1_000_003 + self.event_lines
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::Write;

    fn append(path: &Path, text: &str) {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        f.write_all(text.as_bytes()).unwrap();
    }

    /// A `metrics.jsonl` line as the runtime writes it.
    pub(crate) fn metrics_line(step: u64, loss: f64, val_loss: Option<f64>) -> String {
        serde_json::json!({"step": step, "loss": loss, "tokens_per_s": 100.0,
            "generation": 0, "wall_s": step as f64, "val_loss": val_loss})
        .to_string()
    }

    /// An `events.jsonl` line as the runtime writes it.
    pub(crate) fn line(e: &Event) -> String {
        format!("{}\n", serde_json::to_string(e).unwrap())
    }

    fn checkpoint_line(step: u64) -> String {
        line(&Event::Checkpoint {
            step,
            path: format!("checkpoints/step-{step:06}"),
            duration_s: 0.1,
            stall_ms: 1.0,
        })
    }

    pub(crate) fn reconfig_line(fault_tolerance: u32) -> String {
        let mut e = serde_json::json!({"event": "reconfig", "generation": 1, "lost_nodes": [2],
            "nodes": [0, 1], "failed_in_step": 3, "from_step": 2, "replayed_steps": 0,
            "detect_s": 0.5, "in_place": true, "checkpoint": null});
        e["fault_tolerance"] = fault_tolerance.into();
        let typed: Event = serde_json::from_value(e).expect("a reconfig event");
        line(&typed)
    }

    pub(crate) fn resumed_line(phases: &[(&str, f64)]) -> String {
        line(&Event::Resumed {
            generation: 1,
            step: 3,
            since_failure_s: 1.0,
            phases: phases.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            copy_bytes: 0,
        })
    }

    #[test]
    fn a_tail_returns_complete_lines_once_and_restarts_when_the_file_shrinks() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.jsonl");
        let mut t = Tail::new(p.clone());
        assert_eq!(t.read_new().unwrap(), (vec![], false), "missing file");
        append(&p, "a\nb\npart");
        assert_eq!(t.read_new().unwrap().0, vec!["a", "b"]);
        assert_eq!(t.read_new().unwrap().0, Vec::<String>::new());
        append(&p, "ial\n\nc\n");
        assert_eq!(t.read_new().unwrap().0, vec!["partial", "c"]);
        std::fs::write(&p, "x\n").unwrap();
        assert_eq!(t.read_new().unwrap(), (vec!["x".to_string()], true));
    }

    #[test]
    fn the_feed_keeps_the_newest_step_the_last_events_and_the_recoveries() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        let mut f = Feed::new(run);
        f.refresh().unwrap();
        assert!(f.latest.is_none() && f.recent.is_empty());
        append(
            &run.join("metrics.jsonl"),
            &format!(
                "{}\nnot json\n{}\n",
                metrics_line(1, 9.5, Some(9.7)),
                metrics_line(2, 9.0, None)
            ),
        );
        let mut events = String::new();
        for i in 0..EVENTS_KEPT + 5 {
            events.push_str(&checkpoint_line(i as u64));
        }
        events.push_str(&reconfig_line(0));
        events.push_str(&resumed_line(&[("detect_s", 0.5), ("copy_s", 0.25)]));
        events.push_str(&line(&Event::Finish {
            step: 2,
            wall_s: 3.0,
        }));
        append(&run.join("events.jsonl"), &events);
        f.refresh().unwrap();
        assert_eq!(f.latest.as_ref().unwrap().step, 2);
        assert_eq!((f.metric_lines, f.bad_lines), (2, 1));
        assert_eq!(f.val_loss, Some((1, 9.7)), "kept past a line without one");
        assert_eq!(f.recent.len(), EVENTS_KEPT);
        assert_eq!(f.recent.back().unwrap()["event"], "finish");
        assert_eq!(
            (f.reconfigs, f.fault_tolerance, f.finished),
            (1, Some(0), true)
        );
        assert_eq!(f.recoveries[0]["copy_s"], 0.25);
        let v = f.charts_version();
        f.refresh().unwrap();
        assert_eq!(f.charts_version(), v, "nothing new");
    }
}
