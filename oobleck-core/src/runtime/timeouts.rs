//! Every timeout of a job, in one place, and how they fit together.
//!
//! A failure must be found by the detector meant for it, soon, and never first by a timeout
//! meant for something slower: each level waits longer than the one below it, so the one that
//! fires names the real cause.
//!
//! ```text
//!  level                      what it catches                      default           flag
//!  ─────────────────────────  ───────────────────────────────────  ────────────────  ───────────────
//!  1 progress beat            (a worker's liveness, to its agent)  50 ms / 500 ms    -
//!  2 worker watchdog          a worker hung inside a step: its     1.5 s             --hang-timeout
//!                             beats stop (SIGSTOP, frozen)
//!                             ...or it beats, nothing moves (a     max(1.5 s, 3 x    --hang-factor
//!                             kernel that never returns)           median step);
//!                                                                  first step 30 s
//!  2 ...and at the master      every rank of a step waits on its    the watchdog's    (the same)
//!                             peers, none moves (a collective      limit, once the
//!                             that never returns on any member)    last rank says it
//!  2 control-plane lease      a node whose agent is silent (a      3 s (heartbeat    --lease-ms
//!                             hung or cut-off machine)             every 500 ms)
//!  3 data-plane operation     a peer that never answers though     60 s              -
//!    (DATA_TIMEOUT)           nothing above fired (the last
//!                             resort; a fault of the detectors)
//!  4 ranks' state after an    a rank whose state never comes       = DATA_TIMEOUT    -
//!    abort (Limits::ranks_wait)  (a surviving rank stuck in an op)
//!  5 commit / rendezvous      the master or the other ranks never  3 x DATA_TIMEOUT  -
//!    (COMMIT_TIMEOUT)         finish the step
//!  5 job stall (Limits::stall)  no report at all from any worker   = COMMIT_TIMEOUT  -
//!  6 a broken worker's wait   nobody tells it what comes next      2 x DATA_TIMEOUT  -
//!    (BROKEN_WAIT)
//!  - an agent's master wait   the master lost: the agent keeps its     60 s              --master-wait
//!    (node::DEFAULT_MASTER_WAIT)  workers and looks for a master; the
//!                             workers wait for their commit
//!                             (COMMIT_TIMEOUT) meanwhile, so a wait
//!                             beyond it outlives their state
//! ```
//!
//! The invariants, checked by the test below: the watchdog's first-step limit and the lease
//! are well under the data-plane timeout (so a hung rank is fenced before its peers time out
//! on it, and the failure names the rank, not "rank 2 timed out"); the master waits for ranks'
//! state at least as long as a rank's own operations may take; a worker waits for its commit
//! longer than any rank's step may take to fail; a broken worker waits longer than the master
//! takes to settle and decide. Users set the two levels that depend on their model and
//! cluster: the watchdog (steps of 0.3 s on CPU, 30 s on a large model) and the lease (a
//! busy network).

use std::time::Duration;

/// How long a worker waits on any send, receive or collective of the data plane (level 3).
pub const DATA_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a worker waits for the commit of a step it is ready for, or for the rendezvous
/// (level 5): every other rank has to finish the step first, each of its operations bounded
/// by [`DATA_TIMEOUT`].
pub const COMMIT_TIMEOUT: Duration = DATA_TIMEOUT.saturating_mul(3);

/// How long a worker whose step failed waits for the master's word (level 6).
pub const BROKEN_WAIT: Duration = DATA_TIMEOUT.saturating_mul(2);

/// The watchdog's limit for a worker before it has a step time (its first step after it
/// started): model build and data-plane setup are done by then, but the first microbatch
/// pays for allocations, kernel loading and lazy communicator setup. Well under
/// [`DATA_TIMEOUT`].
pub const FIRST_STEP_HANG: Duration = Duration::from_secs(30);

/// The master's wait for every surviving rank's state after an abort (level 4).
pub const RANKS_WAIT: Duration = DATA_TIMEOUT;

/// The longest a job goes without any worker report before it is declared stuck (level 5).
pub const STALL: Duration = COMMIT_TIMEOUT;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::job::Limits;
    use crate::runtime::spec::WatchSpec;

    #[test]
    fn each_level_waits_longer_than_the_ones_below_it() {
        let watch = WatchSpec::default();
        let limits = Limits::default();
        let first_step = Duration::from_secs_f64(watch.first_step_s);
        assert_eq!(first_step, FIRST_STEP_HANG);
        // Detectors (level 2) fire well before a peer's operation times out (level 3).
        assert!(first_step * 2 <= DATA_TIMEOUT);
        assert!(limits.lease * 10 <= DATA_TIMEOUT);
        assert!(Duration::from_secs_f64(watch.hang_timeout_s) < first_step);
        // The master waits for ranks at least as long as their operations may block.
        assert!(limits.ranks_wait >= DATA_TIMEOUT);
        // A rank waits for its commit longer than a step can take to fail elsewhere.
        assert!(COMMIT_TIMEOUT > limits.ranks_wait + DATA_TIMEOUT);
        assert!(limits.stall >= COMMIT_TIMEOUT);
        // A broken worker outwaits the master's settling and decision.
        assert!(BROKEN_WAIT > limits.ranks_wait + limits.loss_wait);
        // Workers still hold their state when the default master wait runs out.
        assert!(crate::runtime::node::DEFAULT_MASTER_WAIT < COMMIT_TIMEOUT);
    }
}
