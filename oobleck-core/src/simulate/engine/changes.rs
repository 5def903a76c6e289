//! Trace lines and start-up completions, in time order: what changes at each instant.

use std::collections::{BTreeSet, HashMap, VecDeque};

use crate::simulate::outcome::Mark;
use crate::simulate::trace::{Change, Trace};

/// Trace events and start-up completions, in time order.
pub(super) struct Changes<'a> {
    trace: &'a Trace,
    next: usize,
    ids: HashMap<&'a str, u32>,
    starting: VecDeque<(u64, u32)>,
    removed_early: BTreeSet<u32>,
    next_id: u32,
    startup_ms: u64,
}

/// The changes that happen at one instant.
#[derive(Default)]
pub(super) struct Instant {
    pub(super) lost: Vec<u32>,
    pub(super) joined: Vec<u32>,
    pub(super) marks: Vec<Mark>,
}

impl<'a> Changes<'a> {
    pub(super) fn new(trace: &'a Trace, startup_ms: u64) -> Self {
        Changes {
            trace,
            next: 0,
            ids: HashMap::new(),
            starting: VecDeque::new(),
            removed_early: BTreeSet::new(),
            next_id: 0,
            startup_ms,
        }
    }

    pub(super) fn next_time(&self) -> Option<u64> {
        let a = self.trace.events().get(self.next).map(|e| e.at_ms);
        let b = self.starting.front().map(|s| s.0);
        match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Everything at time `t`: trace lines first, then nodes finishing their start-up.
    pub(super) fn take(&mut self, t: u64, usable: &mut BTreeSet<u32>) -> Instant {
        let mut now = Instant::default();
        while let Some(e) = self.trace.events().get(self.next).filter(|e| e.at_ms == t) {
            self.next += 1;
            now.marks.push(Mark {
                t_ms: t,
                change: e.change,
                node: e.node.clone(),
            });
            match e.change {
                Change::Add => {
                    let id = self.next_id;
                    self.next_id += 1;
                    self.ids.insert(&e.node, id);
                    self.starting.push_back((t + self.startup_ms, id));
                }
                Change::Remove => {
                    let id = self.ids.remove(e.node.as_str()).expect("checked trace");
                    if usable.remove(&id) {
                        now.lost.push(id);
                    } else {
                        self.removed_early.insert(id);
                    }
                }
            }
        }
        while let Some(&(at, id)) = self.starting.front().filter(|s| s.0 == t) {
            let _ = at;
            self.starting.pop_front();
            if !self.removed_early.remove(&id) {
                usable.insert(id);
                now.joined.push(id);
            }
        }
        now
    }
}
