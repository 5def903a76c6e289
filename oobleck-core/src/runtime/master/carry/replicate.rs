//! The master's loop keeps its standbys' copies of the run directory up to date
//! ([`super::super::mirror`]) and tells the agents where the standbys are. At a commit, the
//! logs and the commit record go first and every standby must have them on its disk before
//! any agent hears of the step: a standby's copy is complete up to the last committed step.
//! What that costs the master is written to `events.jsonl` every [`STANDBY_COST_COMMITS`]
//! commits (`standby_cost`: `oobleck bench recovery` checks it against the step time).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use super::Driver;
use crate::runtime::master::mirror::{self, Mirror};
use crate::runtime::master::rundir;
use crate::runtime::wire::records::{Event, STANDBY_COST_COMMITS};
use crate::runtime::wire::Message;

/// Bytes of checkpoint files sent to each standby per turn of the loop (about 20 turns a
/// second): checkpoints stream at up to ~40 MB/s without holding the loop up for long.
const BUDGET: u64 = 2 << 20;
/// The longest the loop waits for room in a standby's outbox to tell it the standbys.
const POLL_BOUND: Duration = Duration::from_millis(500);
/// The least time between two looks at the run directory outside commits.
const EVERY: Duration = Duration::from_millis(100);

/// What the loop knows of its standbys.
#[derive(Default)]
pub(in crate::runtime::master) struct Mirrors {
    /// What each standby (by its id) has been sent.
    sent: BTreeMap<u64, Mirror>,
    /// The standbys' addresses and the nodes last told them.
    told: (Vec<String>, BTreeSet<u32>),
    last: Option<Instant>,
    /// A standby has been connected: one may take over when this master goes silent.
    pub had: bool,
    /// The time spent on the standbys since the last `standby_cost` event.
    cost: Cost,
}

/// The master's time on its standbys over the commits of one `standby_cost` event.
#[derive(Default)]
struct Cost {
    /// Each commit's replication, ms.
    commits_ms: Vec<f64>,
    /// Replication between those commits, ms in all.
    mirror_ms: f64,
}

impl Cost {
    /// The event once there are enough commits (and a fresh window), else `None`.
    fn take_event(&mut self, standbys: usize) -> Option<Event> {
        if (self.commits_ms.len() as u64) < STANDBY_COST_COMMITS {
            return None;
        }
        let Cost {
            mut commits_ms,
            mirror_ms,
        } = std::mem::take(self);
        // Sorts them too: the last is the largest.
        let median = crate::profiler::median(&mut commits_ms);
        let n = commits_ms.len();
        Some(Event::StandbyCost {
            standbys,
            commits: n as u64,
            commit_mean_ms: commits_ms.iter().sum::<f64>() / n as f64,
            commit_median_ms: median,
            commit_max_ms: commits_ms[n - 1],
            mirror_ms,
        })
    }
}

impl Driver<'_> {
    /// Brings every standby's copy up to date ([`Self::mirror`]), timed while there is one.
    pub(in crate::runtime::master) async fn replicate(&mut self, commit: bool) {
        let started = Instant::now();
        let standbys = self.mirror(commit).await;
        if standbys == 0 {
            return;
        }
        let ms = started.elapsed().as_secs_f64() * 1e3;
        let cost = &mut self.mirrors.cost;
        match commit {
            true => cost.commits_ms.push(ms),
            false => cost.mirror_ms += ms,
        }
        if let Some(e) = cost.take_event(standbys) {
            if let Err(e) = self.p.files.event(&e) {
                tracing::warn!(error = %e, "writing the standbys' cost to events.jsonl");
            }
        }
    }

    /// Brings every standby's copy up to date; the standbys there were. At a `commit`, only
    /// the logs and records are sent, and each standby must acknowledge them within a lease
    /// or it is dropped.
    async fn mirror(&mut self, commit: bool) -> usize {
        let standbys = self.p.master.standbys();
        let ids: BTreeSet<u64> = standbys.iter().map(|s| s.0).collect();
        self.mirrors.had |= !ids.is_empty();
        self.mirrors.sent.retain(|id, _| ids.contains(id));
        self.tell_agents(&standbys).await;
        let due = self.mirrors.last.is_none_or(|t| t.elapsed() >= EVERY);
        if standbys.is_empty() || !(commit || due) {
            return standbys.len();
        }
        self.mirrors.last = Some(Instant::now());
        // A commit sends the logs and records alone: no walk through the checkpoints.
        let (files, budget) = match commit {
            true => (mirror::records(&self.p.out), 0),
            false => (mirror::files(&self.p.out), BUDGET),
        };
        let lease = self.p.master.lease();
        let count = standbys.len();
        for (id, listen) in standbys {
            let m = self.mirrors.sent.entry(id).or_default();
            let records = match m.records(&self.p.out, &files, budget) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "reading the run directory for a standby");
                    continue;
                }
            };
            let seq = m.seq;
            let sent = self.p.master.send_standby(id, records, lease).await;
            let done = match sent {
                Ok(()) if commit => self.acknowledged(id, seq, lease).await,
                other => other,
            };
            if let Err(why) = done {
                self.p.master.drop_standby(id);
                self.mirrors.sent.remove(&id);
                self.p.observer.note(&format!(
                    "standby master {listen} dropped: {why}; the job goes on without it"
                ));
            }
        }
        count
    }

    /// Waits until standby `id` has record `seq` on its disk, at most `limit`.
    async fn acknowledged(&self, id: u64, seq: u64, limit: Duration) -> Result<(), String> {
        let start = Instant::now();
        loop {
            match self.p.master.standby_acked(id) {
                None => return Err("it is gone".into()),
                Some(a) if a >= seq => return Ok(()),
                Some(_) if start.elapsed() >= limit => {
                    return Err(format!("it did not write the commit within {limit:?}"))
                }
                Some(_) => tokio::time::sleep(Duration::from_micros(200)).await,
            }
        }
    }

    /// Tells every agent where the standbys take over, when that or the agents changed.
    async fn tell_agents(&mut self, standbys: &[(u64, String)]) {
        let addrs: Vec<String> = standbys.iter().map(|s| s.1.clone()).collect();
        if addrs.is_empty() && self.mirrors.told.0.is_empty() {
            // No standby, now or before: nothing to tell.
            return;
        }
        let nodes: BTreeSet<u32> = self.p.master.node_ids().into_iter().collect();
        if (&addrs, &nodes) == (&self.mirrors.told.0, &self.mirrors.told.1) {
            return;
        }
        let msg = Message::Standbys {
            addrs: addrs.clone(),
        };
        if addrs != self.mirrors.told.0 {
            if let Err(e) = rundir::write_standbys(&self.p.out, &addrs) {
                tracing::warn!(error = %e, "naming the standbys in the run directory");
            }
            // Each standby learns who is ahead of it: when the master is lost, the first
            // of them takes over and the others follow it.
            // One that takes no message is dropped (`send_standby`).
            for &(id, _) in standbys {
                let _ = (self.p.master)
                    .send_standby(id, vec![(msg.clone(), Vec::new())], POLL_BOUND)
                    .await;
            }
        }
        // A node that misses it hears it again when the membership changes next.
        let _ = self.p.master.broadcast(&msg).await;
        self.mirrors.told = (addrs, nodes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_of_commits_is_one_event_and_the_next_starts_empty() {
        let mut c = Cost {
            commits_ms: (1..STANDBY_COST_COMMITS).map(|i| i as f64).collect(),
            mirror_ms: 5.0,
        };
        assert!(c.take_event(1).is_none());
        c.commits_ms.push(100.0);
        // 1..=19 ms and 100 ms: the median 10.5, the mean 290 / 20.
        let e = Event::StandbyCost {
            standbys: 1,
            commits: 20,
            commit_mean_ms: 14.5,
            commit_median_ms: 10.5,
            commit_max_ms: 100.0,
            mirror_ms: 5.0,
        };
        assert_eq!(c.take_event(1), Some(e));
        assert!(c.commits_ms.is_empty() && c.mirror_ms == 0.0);
    }
}
