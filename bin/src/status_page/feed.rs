//! What the run directory says, read as it grows: the newest `metrics.jsonl` line, the last
//! events of `events.jsonl`, and the few totals `/metrics` reports. Each read takes only what
//! was appended since the last one; a file that shrank (a resumed run truncates its metrics)
//! is read again from the start.

use std::collections::{BTreeMap, VecDeque};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

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
    pub latest: Option<Value>,
    /// The newest validation loss and its step.
    pub val_loss: Option<(u64, f64)>,
    /// The last [`EVENTS_KEPT`] events, oldest first.
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
            match serde_json::from_str::<Value>(&l) {
                Ok(v) if v.get("step").is_some() => {
                    self.metric_lines += 1;
                    if let (Some(step), Some(val)) = (v["step"].as_u64(), v["val_loss"].as_f64()) {
                        self.val_loss = Some((step, val));
                    }
                    self.latest = Some(v);
                }
                _ => self.bad_lines += 1,
            }
        }
        let (lines, restarted) = self.events.read_new()?;
        if restarted {
            self.forget_events();
        }
        for l in lines {
            match serde_json::from_str::<Value>(&l) {
                Ok(v) if v.get("event").and_then(Value::as_str).is_some() => self.take_event(v),
                _ => self.bad_lines += 1,
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

    /// Lenient by design: the page counts what it can read of any line with a kind, even one
    /// whose other fields are missing or of another binary's shape, so it reads by key rather
    /// than through `wire::EventLine` (which would set such a line aside as unknown).
    fn take_event(&mut self, v: Value) {
        self.event_lines += 1;
        match v["event"].as_str().unwrap_or("") {
            "finish" | "abort" => self.finished = true,
            "reconfig" => {
                self.reconfigs += 1;
                self.fault_tolerance = v["fault_tolerance"].as_u64().or(self.fault_tolerance);
            }
            "resumed" => {
                let phases = v["phases"]
                    .as_object()
                    .map(|m| {
                        m.iter()
                            .filter_map(|(k, x)| Some((k.clone(), x.as_f64()?)))
                            .collect()
                    })
                    .unwrap_or_default();
                self.recoveries.push(phases);
            }
            _ => {}
        }
        if self.recent.len() == EVENTS_KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back(v);
    }

    /// Changes whenever a chart would: a step committed or an event logged.
    pub fn charts_version(&self) -> u64 {
        self.metric_lines * 1_000_003 + self.event_lines
    }
}

#[cfg(test)]
mod tests {
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
            "{\"step\":1,\"loss\":9.5,\"val_loss\":9.7}\nnot json\n{\"step\":2,\"loss\":9.0}\n",
        );
        let mut events = String::new();
        for i in 0..EVENTS_KEPT + 5 {
            events.push_str(&format!("{{\"event\":\"checkpoint\",\"step\":{i}}}\n"));
        }
        events.push_str(
            "{\"event\":\"reconfig\",\"fault_tolerance\":0}\n\
             {\"event\":\"resumed\",\"phases\":{\"detect_s\":0.5,\"copy_s\":0.25}}\n\
             {\"event\":\"finish\"}\n",
        );
        append(&run.join("events.jsonl"), &events);
        f.refresh().unwrap();
        assert_eq!(f.latest.as_ref().unwrap()["step"], 2);
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
