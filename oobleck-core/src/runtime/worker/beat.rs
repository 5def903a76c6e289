//! The worker's progress beats: a thread of its own prints the rank's progress
//! ([`crate::execution::Snapshot`]) on stdout for the agent's watchdog, whatever the training
//! thread is doing. A beat goes out within [`BEAT`] of any progress, and every [`IDLE_BEAT`]
//! when there is none, so the agent tells a process that is stuck (beats, no progress) from one
//! that does not run at all (SIGSTOP, no beats).

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use crate::execution::Progress;
use crate::runtime::wire::pipe::{progress_line, BEAT, IDLE_BEAT};

/// Exit code of a worker whose beats cannot be written (its pipe to the agent broke).
const PIPE_BROKEN: i32 = 4;

/// Starts the beat thread of this worker process.
pub(super) fn start(progress: Arc<Progress>) {
    std::thread::Builder::new()
        .name("progress-beat".into())
        .spawn(move || beat(&progress))
        .expect("starting the progress-beat thread");
}

fn beat(progress: &Progress) {
    let mut last: Option<(u64, bool)> = None;
    let mut sent = Instant::now();
    loop {
        let s = progress.snapshot();
        let key = (s.seq, s.in_step);
        if last != Some(key) || sent.elapsed() >= IDLE_BEAT {
            let mut out = std::io::stdout().lock();
            if writeln!(out, "{}", progress_line(&s))
                .and_then(|()| out.flush())
                .is_err()
            {
                // The agent reads every report through this pipe: without it nothing this
                // worker does can count, and nobody could stop it.
                eprintln!("oobleck worker: its pipe to the agent broke; exiting");
                std::process::exit(PIPE_BROKEN);
            }
            last = Some(key);
            sent = Instant::now();
        }
        std::thread::sleep(BEAT);
    }
}
