//! What the watchdog's bookkeeping costs a worker, timed in the bench process with the real
//! types: a progress mark (`Progress::enter` and the drop of its `Mark`, as every microbatch
//! and data-plane operation takes), and a progress beat (a `Snapshot`, its line and a write
//! and flush to a pipe another process reads, as the worker's beat thread does to its
//! agent's pipe). Each is timed over many repetitions, a few rounds, the median round kept.
//!
//! The marks run with a beat thread taking snapshots beside them, as in a worker (the lock the
//! two share is the only contention a mark meets).

use std::hint::black_box;
use std::io::Write;
use std::process::{ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use oobleck_core::execution::{Doing, Progress};
use oobleck_core::runtime::wire::pipe::progress_line;
use oobleck_core::runtime::wire::pipe::BEAT;

use super::hang::MarkCosts;
use crate::bench::median;

/// Marks (entries and their drops) per round.
const MARK_PAIRS: u32 = 500_000;
/// Beats per round.
const BEATS: u32 = 20_000;
/// Rounds of each; the median is kept.
const ROUNDS: usize = 5;

/// Times a mark and a beat.
pub fn measure() -> Result<MarkCosts> {
    let mark_ns = median(&(0..ROUNDS).map(|_| mark_round()).collect::<Vec<_>>());
    let mut beats = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        beats.push(beat_round()?);
    }
    Ok(MarkCosts {
        mark_ns,
        beat_us: median(&beats),
        beat_period_s: BEAT.as_secs_f64(),
    })
}

/// One round of marks inside a step, under a backward as a collective thread's would be: ns
/// per mark (an entry or an exit, as `StepTimes::marks` counts them).
fn mark_round() -> f64 {
    let p = Progress::new();
    p.begin_step(1);
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (p, stop) = (p.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                black_box(p.snapshot());
                std::thread::sleep(BEAT);
            }
        })
    };
    let outer = p.enter(Doing::Backward { mb: 0 });
    let t = Instant::now();
    for i in 0..MARK_PAIRS {
        let m = p.enter(black_box(Doing::Forward { mb: i & 7 }));
        drop(black_box(m));
    }
    let ns = t.elapsed().as_secs_f64() * 1e9 / f64::from(2 * MARK_PAIRS);
    drop(outer);
    stop.store(true, Ordering::Relaxed);
    let _ = watcher.join();
    ns
}

/// One round of beats into a pipe another process drains (`cat`, as the agent reads its
/// workers' pipes): µs per beat.
fn beat_round() -> Result<f64> {
    let mut cat = Command::new("cat")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .context("starting cat to read the beats")?;
    let pipe = cat.stdin.take().expect("stdin is piped");
    // The pipe is closed on return, whatever happened: cat then exits.
    let us = beats_into(pipe);
    let _ = cat.wait();
    us
}

fn beats_into(mut pipe: ChildStdin) -> Result<f64> {
    let p = Progress::new();
    p.begin_step(7);
    let _bwd = p.enter(Doing::Backward { mb: 3 });
    let _ar = p.enter(Doing::AllReduce {
        index: 2,
        ranks: 2,
        bytes: 1 << 20,
    });
    let t = Instant::now();
    for _ in 0..BEATS {
        let s = p.snapshot();
        writeln!(pipe, "{}", progress_line(black_box(&s))).context("writing a beat")?;
        pipe.flush().context("flushing a beat")?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e6 / f64::from(BEATS))
}
