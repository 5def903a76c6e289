//! Failure traces: which node appears or disappears when. The CSV format is the Oobleck
//! authors' (`reference/traces/`): no header, one event per line, `delta_ms,add|remove,node`,
//! times in integer milliseconds since the trace's start, non-decreasing.

use std::collections::HashSet;

use serde::Serialize;

use super::SimError;

/// A node appears (`add`) or is preempted (`remove`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Change {
    Add,
    Remove,
}

/// One line of a trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TraceEvent {
    pub at_ms: u64,
    pub change: Change,
    pub node: String,
}

/// A checked trace: at least one event, times never go back, a node is only removed while
/// present and only added while absent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    events: Vec<TraceEvent>,
}

impl Trace {
    /// Reads a CSV trace. Blank lines are skipped; everything else must be an event.
    pub fn parse(text: &str) -> Result<Trace, SimError> {
        let mut events = Vec::new();
        let mut lines = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() {
                continue;
            }
            events.push(parse_line(line).map_err(|message| SimError::Trace {
                line: i + 1,
                message,
            })?);
            lines.push(i + 1);
        }
        Trace::checked(events, &lines)
    }

    /// A trace from events in time order (line numbers in errors are 1-based positions).
    pub fn from_events(events: Vec<TraceEvent>) -> Result<Trace, SimError> {
        let lines: Vec<usize> = (1..=events.len()).collect();
        Trace::checked(events, &lines)
    }

    fn checked(events: Vec<TraceEvent>, lines: &[usize]) -> Result<Trace, SimError> {
        if events.is_empty() {
            return Err(SimError::EmptyTrace);
        }
        let mut present: HashSet<&str> = HashSet::new();
        let mut seen: HashSet<&str> = HashSet::new();
        let mut last = 0u64;
        for (e, &line) in events.iter().zip(lines) {
            let err = |message: String| SimError::Trace { line, message };
            if e.at_ms < last {
                return Err(err(format!(
                    "time {} ms comes before the previous line's {last} ms; traces must be \
                     sorted by time",
                    e.at_ms
                )));
            }
            last = e.at_ms;
            match e.change {
                Change::Add if !present.insert(&e.node) => {
                    return Err(err(format!(
                        "`{}` is added while it is already present (added earlier and not \
                         removed since)",
                        e.node
                    )));
                }
                Change::Remove if !present.remove(e.node.as_str()) => {
                    let why = if seen.contains(e.node.as_str()) {
                        "it was already removed"
                    } else {
                        "no earlier line adds it (unknown node)"
                    };
                    return Err(err(format!("`{}` is removed but {why}", e.node)));
                }
                _ => {}
            }
            seen.insert(&e.node);
        }
        Ok(Trace { events })
    }

    pub fn events(&self) -> &[TraceEvent] {
        &self.events
    }

    /// The time of the last event.
    pub fn end_ms(&self) -> u64 {
        self.events.last().map_or(0, |e| e.at_ms)
    }

    /// Nodes present after every event up to and including time `t_ms`.
    pub fn nodes_at(&self, t_ms: u64) -> usize {
        let mut n = 0usize;
        for e in self.events.iter().take_while(|e| e.at_ms <= t_ms) {
            match e.change {
                Change::Add => n += 1,
                Change::Remove => n -= 1,
            }
        }
        n
    }

    /// The most nodes present at once.
    pub fn peak_nodes(&self) -> usize {
        let (mut now, mut peak) = (0usize, 0usize);
        for e in &self.events {
            match e.change {
                Change::Add => now += 1,
                Change::Remove => now -= 1,
            }
            peak = peak.max(now);
        }
        peak
    }

    /// How many nodes the trace removes.
    pub fn removals(&self) -> usize {
        (self.events.iter())
            .filter(|e| e.change == Change::Remove)
            .count()
    }

    /// Nodes present on average over the trace (time-weighted from its first event to its
    /// last; the count at the first event for a trace of one instant).
    pub fn mean_nodes(&self) -> f64 {
        let (first, end) = (self.events[0].at_ms, self.end_ms());
        if end == first {
            return self.nodes_at(first) as f64;
        }
        let (mut now, mut at, mut area) = (0i64, first, 0f64);
        for e in &self.events {
            area += now as f64 * (e.at_ms - at) as f64;
            at = e.at_ms;
            now += match e.change {
                Change::Add => 1,
                Change::Remove => -1,
            };
        }
        area / (end - first) as f64
    }

    /// The trace as CSV, in the format [`Trace::parse`] reads.
    pub fn to_csv(&self) -> String {
        let mut out = String::new();
        for e in &self.events {
            let change = match e.change {
                Change::Add => "add",
                Change::Remove => "remove",
            };
            out.push_str(&format!("{},{change},{}\n", e.at_ms, e.node));
        }
        out
    }
}

fn parse_line(line: &str) -> Result<TraceEvent, String> {
    let fields: Vec<&str> = line.split(',').map(str::trim).collect();
    let [at, change, node] = fields[..] else {
        return Err(format!(
            "expected 3 comma-separated fields `delta_ms,add|remove,node`, found {}: `{line}`",
            fields.len()
        ));
    };
    let at_ms = at.parse::<u64>().map_err(|_| {
        if at.starts_with('-') {
            format!("time `{at}` is negative; times are milliseconds since the trace's start")
        } else {
            format!("time `{at}` is not a whole number of milliseconds")
        }
    })?;
    let change = match change {
        "add" => Change::Add,
        "remove" => Change::Remove,
        other => return Err(format!("`{other}` is neither `add` nor `remove`")),
    };
    if node.is_empty() || node.chars().any(char::is_whitespace) {
        return Err(format!(
            "node name `{node}` must be non-empty without spaces"
        ));
    }
    Ok(TraceEvent {
        at_ms,
        change,
        node: node.to_string(),
    })
}

/// A duration such as `90s`, `10m`, `6h`, `70d`, `250ms` (or a bare number of seconds), in
/// milliseconds.
pub fn parse_duration_ms(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let scale = match unit {
        "ms" => 1.0,
        "" | "s" => 1e3,
        "m" | "min" => 60e3,
        "h" => 3600e3,
        "d" => 86_400e3,
        _ => {
            return Err(format!(
                "duration `{text}`: unknown unit `{unit}` (use ms, s, m, h or d, e.g. 90s, \
                 10m, 6h, 70d)"
            ))
        }
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("duration `{text}` does not start with a number (e.g. 6h)"))?;
    let ms = value * scale;
    if !ms.is_finite() || ms > 1e15 {
        return Err(format!("duration `{text}` is too long"));
    }
    Ok(ms.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err_of(text: &str) -> String {
        Trace::parse(text).unwrap_err().to_string()
    }

    #[test]
    fn reads_the_authors_format() {
        let t = Trace::parse("0,add,node1\n0,add,node2\n\n600,remove,node1\n").unwrap();
        assert_eq!(t.events().len(), 3);
        assert_eq!(t.end_ms(), 600);
        assert_eq!(t.nodes_at(0), 2);
        assert_eq!(t.nodes_at(600), 1);
        // 2 nodes for the whole span (the removal is its last instant).
        assert_eq!(t.mean_nodes(), 2.0);
        let t = Trace::parse("0,add,a\n0,add,b\n300,remove,a\n900,add,c\n").unwrap();
        assert_eq!(t.mean_nodes(), (2.0 * 300.0 + 600.0) / 900.0);
        assert_eq!((t.peak_nodes(), t.removals()), (2, 1));
        assert_eq!(Trace::parse(&t.to_csv()).unwrap(), t);
    }

    #[test]
    fn bad_traces_name_the_line() {
        assert_eq!(
            Trace::parse("").unwrap_err(),
            SimError::EmptyTrace,
            "an empty file"
        );
        assert!(err_of("0,add,a\n5,remove,b").contains("line 2: `b` is removed but no earlier"));
        assert!(err_of("0,add,a\n5,remove,a\n6,remove,a")
            .contains("line 3: `a` is removed but it was already removed"));
        assert!(err_of("0,add,a\n0,add,a").contains("line 2: `a` is added while"));
        assert!(err_of("9,add,a\n5,add,b").contains("line 2: time 5 ms comes before"));
        assert!(err_of("-5,add,a").contains("line 1: time `-5` is negative"));
        assert!(err_of("x,add,a").contains("line 1: time `x` is not a whole"));
        assert!(err_of("0,join,a").contains("`join` is neither"));
        assert!(err_of("0,add").contains("expected 3 comma-separated fields"));
        assert!(err_of("0,add,a b").contains("without spaces"));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration_ms("90s"), Ok(90_000));
        assert_eq!(parse_duration_ms("10m"), Ok(600_000));
        assert_eq!(parse_duration_ms("6h"), Ok(21_600_000));
        assert_eq!(parse_duration_ms("70d"), Ok(6_048_000_000));
        assert_eq!(parse_duration_ms("250ms"), Ok(250));
        assert_eq!(parse_duration_ms("1.5h"), Ok(5_400_000));
        assert!(parse_duration_ms("6w")
            .unwrap_err()
            .contains("unknown unit `w`"));
        assert!(parse_duration_ms("h")
            .unwrap_err()
            .contains("does not start"));
    }
}

#[cfg(test)]
mod shipped {
    use super::*;

    /// Every trace shipped in `datasets/simulator/traces` (the authors' artifact) is valid.
    #[test]
    fn the_authors_traces_parse() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../datasets/simulator/traces");
        let mut files = Vec::new();
        for sub in ["", "scaled"] {
            for e in std::fs::read_dir(format!("{dir}/{sub}")).unwrap() {
                let p = e.unwrap().path();
                if p.extension().is_some_and(|x| x == "csv") {
                    files.push(p);
                }
            }
        }
        assert_eq!(files.len(), 10, "{files:?}");
        for p in files {
            let t = Trace::parse(&std::fs::read_to_string(&p).unwrap());
            assert!(t.is_ok(), "{}: {:?}", p.display(), t.err());
        }
    }
}
