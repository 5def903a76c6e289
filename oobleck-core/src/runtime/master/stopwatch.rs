//! Notices that the master's process was stopped (SIGSTOP, a frozen VM): a thread that ticks
//! every [`TICK`] and keeps the longest gap between two ticks beyond it. Only a stop of the
//! whole process makes a gap of seconds (the loop's own work never blocks this thread), so a
//! gap longer than the lease means the agents heard no heartbeat for a lease too.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often the thread looks at the clock.
const TICK: Duration = Duration::from_millis(100);

/// The ticking thread, stopped and joined when dropped.
pub(super) struct StopWatch {
    start: Instant,
    /// The longest gap so far, ms.
    longest_ms: Arc<AtomicU64>,
    /// The last tick, ms after `start`.
    last_ms: Arc<AtomicU64>,
    done: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl StopWatch {
    pub fn start() -> StopWatch {
        let start = Instant::now();
        let longest_ms = Arc::new(AtomicU64::new(0));
        let last_ms = Arc::new(AtomicU64::new(0));
        let done = Arc::new(AtomicBool::new(false));
        let (l, t, d) = (longest_ms.clone(), last_ms.clone(), done.clone());
        let thread = std::thread::Builder::new()
            .name("oobleck-stopwatch".into())
            .spawn(move || {
                let mut last = Instant::now();
                while !d.load(Ordering::Relaxed) {
                    std::thread::sleep(TICK);
                    let now = Instant::now();
                    let gap = now.duration_since(last).saturating_sub(TICK);
                    l.fetch_max(gap.as_millis() as u64, Ordering::Relaxed);
                    t.store(
                        now.duration_since(start).as_millis() as u64,
                        Ordering::Relaxed,
                    );
                    last = now;
                }
            })
            .ok();
        StopWatch {
            start,
            longest_ms,
            last_ms,
            done,
            thread,
        }
    }

    /// The longest the process was stopped since the watch started, the stop it may just have
    /// woken from included (before the thread ticked again: the other threads may run first).
    pub fn longest(&self) -> Duration {
        let now = self.start.elapsed().as_millis() as u64;
        let since = now.saturating_sub(self.last_ms.load(Ordering::Relaxed));
        let current = since.saturating_sub(TICK.as_millis() as u64);
        Duration::from_millis(self.longest_ms.load(Ordering::Relaxed).max(current))
    }
}

impl Drop for StopWatch {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_running_process_shows_no_stop() {
        let w = StopWatch::start();
        std::thread::sleep(Duration::from_millis(350));
        // Scheduling noise only: far below any lease.
        assert!(w.longest() < Duration::from_secs(1), "{:?}", w.longest());
    }
}
