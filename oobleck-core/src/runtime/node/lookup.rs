//! When an agent looks for a master after it lost one: the pure schedule of its tries. The
//! agent (`lost.rs`) asks [`Lookup::next`] what to do at each turn and carries it out; this
//! file reads no clock and opens no socket, so the schedule is tested as it is.
//!
//! ```text
//!  round 1: try every address, in order (the master it was given first, then standbys)
//!  pause FIRST_PAUSE, round 2, pause 2 x FIRST_PAUSE, ... each pause doubled up to MAX_PAUSE
//!  the wait (--master-wait) runs out -> give up (a pause never runs past it)
//! ```
//!
//! A master that restarts (its process supervised, a VM rebooted) takes seconds: the first
//! pauses are short so that an agent finds a quick one at once, and the doubling keeps a
//! thousand agents from hammering a master that is coming up; the cap keeps the last try of a
//! long wait within [`MAX_PAUSE`] of a master that appears late.

use std::time::Duration;

/// The pause after the first round of tries.
pub(super) const FIRST_PAUSE: Duration = Duration::from_millis(250);
/// The longest pause between rounds.
pub(super) const MAX_PAUSE: Duration = Duration::from_secs(4);

/// Reads `--master-wait` (and `OOBLECK_MASTER_WAIT`): a whole number of seconds, at least 1.
/// Zero is refused: an agent must give a master that is restarting some time, and one that
/// should stop with its master can be given a short wait.
pub fn parse_master_wait(text: &str) -> Result<Duration, String> {
    let what = "how long an agent that lost its master keeps its workers and looks for one";
    match text.trim().parse::<u64>() {
        Ok(0) => Err(format!(
            "--master-wait 0: must be at least 1 second ({what}; 60 is the default)"
        )),
        Ok(s) => Ok(Duration::from_secs(s)),
        Err(_) => Err(format!(
            "--master-wait {text:?}: expected a whole number of seconds, at least 1 ({what}; \
             60 is the default)"
        )),
    }
}

/// What the agent does next while it looks for a master.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Next {
    /// Try to register with the master at this address (`index` in the list).
    Try { index: usize, addr: String },
    /// Wait this long before the next round.
    Pause(Duration),
    /// The wait ran out with no master found.
    GiveUp,
}

/// The schedule of one search for a master: rounds over the addresses with doubling pauses
/// between them, for at most `wait`.
#[derive(Debug, Clone)]
pub(super) struct Lookup {
    addrs: Vec<String>,
    wait: Duration,
    /// The next address of the round under way; `addrs.len()`: the round is over.
    next: usize,
    /// The pause after the round under way.
    pause: Duration,
}

impl Lookup {
    /// A search over `addrs` (the active master's first; never empty: the agent always has the
    /// address it was started with) that gives up after `wait`.
    pub(super) fn new(addrs: Vec<String>, wait: Duration) -> Lookup {
        debug_assert!(!addrs.is_empty(), "a lookup needs an address");
        Lookup {
            addrs,
            wait,
            next: 0,
            pause: FIRST_PAUSE,
        }
    }

    /// The addresses it looks at, for the agent's messages.
    pub(super) fn addrs(&self) -> &[String] {
        &self.addrs
    }

    /// What to do `elapsed` after the master was lost.
    pub(super) fn next(&mut self, elapsed: Duration) -> Next {
        if elapsed >= self.wait || self.addrs.is_empty() {
            return Next::GiveUp;
        }
        if let Some(addr) = self.addrs.get(self.next) {
            let index = self.next;
            self.next += 1;
            return Next::Try {
                index,
                addr: addr.clone(),
            };
        }
        self.next = 0;
        let pause = self.pause.min(self.wait - elapsed);
        self.pause = (self.pause * 2).min(MAX_PAUSE);
        Next::Pause(pause)
    }

    /// How long one try may take `elapsed` after the loss: what is left of the wait, at most
    /// `cap` (a master that accepts the connection but never answers must not hold the agent
    /// past its wait).
    pub(super) fn try_limit(&self, elapsed: Duration, cap: Duration) -> Duration {
        self.wait.saturating_sub(elapsed).min(cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn try_(index: usize, addr: &str) -> Next {
        Next::Try {
            index,
            addr: addr.into(),
        }
    }

    /// Runs the schedule as if every try failed at once and every pause were slept in full:
    /// the steps it takes, and when (ms after the loss) each was taken.
    fn simulate(addrs: &[&str], wait: Duration) -> Vec<(u64, Next)> {
        let mut l = Lookup::new(addrs.iter().map(|a| a.to_string()).collect(), wait);
        let mut t = Duration::ZERO;
        let mut out = Vec::new();
        loop {
            let n = l.next(t);
            out.push((t.as_millis() as u64, n.clone()));
            match n {
                Next::Pause(d) => t += d,
                Next::Try { .. } => {}
                Next::GiveUp => return out,
            }
            assert!(out.len() < 1000, "the schedule never ends: {out:?}");
        }
    }

    #[test]
    fn one_address_is_tried_with_doubling_pauses_until_the_wait_ends() {
        let m = "127.0.0.1:7000";
        let got = simulate(&[m], Duration::from_secs(3));
        let want = vec![
            (0, try_(0, m)),
            (0, Next::Pause(ms(250))),
            (250, try_(0, m)),
            (250, Next::Pause(ms(500))),
            (750, try_(0, m)),
            (750, Next::Pause(ms(1000))),
            (1750, try_(0, m)),
            // The last pause is cut to the wait: it never sleeps past it.
            (1750, Next::Pause(ms(1250))),
            (3000, Next::GiveUp),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn every_address_is_tried_each_round_the_active_master_first() {
        let got = simulate(&["m:1", "s1:1", "s2:1"], ms(400));
        let want = vec![
            (0, try_(0, "m:1")),
            (0, try_(1, "s1:1")),
            (0, try_(2, "s2:1")),
            (0, Next::Pause(ms(250))),
            (250, try_(0, "m:1")),
            (250, try_(1, "s1:1")),
            (250, try_(2, "s2:1")),
            (250, Next::Pause(ms(150))),
            (400, Next::GiveUp),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn pauses_stop_doubling_at_the_cap_and_a_long_wait_keeps_trying() {
        let got = simulate(&["m:1"], Duration::from_secs(60));
        let pauses: Vec<Duration> = got
            .iter()
            .filter_map(|(_, n)| match n {
                Next::Pause(d) => Some(*d),
                _ => None,
            })
            .collect();
        assert_eq!(
            pauses[..6],
            [ms(250), ms(500), ms(1000), ms(2000), ms(4000), ms(4000)]
        );
        assert!(pauses.iter().all(|&p| p <= MAX_PAUSE));
        let tries = got
            .iter()
            .filter(|(_, n)| matches!(n, Next::Try { .. }))
            .count();
        // 0.25 + 0.5 + 1 + 2 = 3.75 s of growing pauses, then one try every 4 s to 60 s.
        assert_eq!(tries, 5 + 14);
        assert_eq!(got.last(), Some(&(60_000, Next::GiveUp)));
    }

    #[test]
    fn a_try_never_runs_past_the_wait() {
        let l = Lookup::new(vec!["m:1".into()], Duration::from_secs(3));
        assert_eq!(l.try_limit(ms(0), ms(10_000)), ms(3000));
        assert_eq!(l.try_limit(ms(2900), ms(10_000)), ms(100));
        assert_eq!(l.try_limit(ms(500), ms(1000)), ms(1000));
        assert_eq!(l.try_limit(ms(5000), ms(1000)), ms(0));
    }

    #[test]
    fn the_wait_is_a_whole_number_of_seconds_at_least_one() {
        assert_eq!(parse_master_wait("60"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_master_wait(" 3 "), Ok(Duration::from_secs(3)));
        for bad in ["0", "", "abc", "-1", "1.5", "60s"] {
            let e = parse_master_wait(bad).expect_err(bad);
            assert!(e.starts_with("--master-wait"), "{bad}: {e}");
            assert!(e.contains("at least 1"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_wait_that_has_run_out_gives_up_before_any_try() {
        let mut l = Lookup::new(vec!["m:1".into()], ms(10));
        assert_eq!(l.next(ms(10)), Next::GiveUp);
    }
}
