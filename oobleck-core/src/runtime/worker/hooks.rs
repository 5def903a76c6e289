//! Test hooks for hangs and slowness, read from the environment the agent passes on (never set
//! in a real job): a worker that stops itself with SIGSTOP at a chosen place, as a GPU kernel
//! or a collective that never returns would leave it, and a worker slowed on purpose.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use super::inbox::AbortSwitch;
use crate::execution::{Doing, OpHook, Progress};
use crate::runtime::wire::pipe::WorkerAssignment;

/// `OOBLECK_TEST_HANG=GENERATION:NODE:STEP:WHERE[,...]`: the worker of `NODE` in generation
/// `GENERATION` stops itself with SIGSTOP in step `STEP` (1-based), `WHERE` being `compute`
/// (the forward of the first microbatch it reads), `p2p` (its first receive), `all_reduce`
/// (its first all-reduce) or `commit` (waiting for the step's commit). Three more acts do
/// not stop the process: `stuck` (the forward never returns while the process runs on, as a
/// GPU kernel that hangs), `close_stdout` (the worker closes its pipe to the agent in that
/// forward) and `all_reduce_stuck` (its first all-reduce does not return until the
/// generation is aborted, as a hung NCCL collective does until `ncclCommAbort`). Once per
/// process. Read once, when first needed: the places it is looked at are on the step's path.
pub const TEST_HANG_ENV: &str = "OOBLECK_TEST_HANG";

/// `OOBLECK_TEST_SLOW=NODE:MS`: the workers of `NODE` sleep `MS` ms in the forward of every
/// microbatch they read (a slow device, still making progress).
pub const TEST_SLOW_ENV: &str = "OOBLECK_TEST_SLOW";

/// How long a hook stays inside its operation before it stops: long enough for a progress
/// beat to say where it is.
const BEFORE_STOP: Duration = Duration::from_millis(200);

static HUNG: AtomicBool = AtomicBool::new(false);

/// One entry of [`TEST_HANG_ENV`]: `(generation, node, step, what)`.
type Want = (u64, u32, u64, String);

/// [`TEST_HANG_ENV`], parsed once (empty when unset; entries that do not parse are ignored).
fn wants() -> &'static [Want] {
    static WANTS: OnceLock<Vec<Want>> = OnceLock::new();
    WANTS.get_or_init(|| {
        let spec = std::env::var(TEST_HANG_ENV).unwrap_or_default();
        spec.split(',')
            .filter_map(|s| {
                let mut f = s.trim().splitn(4, ':');
                let generation = f.next()?.parse().ok()?;
                let node = f.next()?.parse().ok()?;
                let step = f.next()?.parse().ok()?;
                Some((generation, node, step, f.next()?.to_string()))
            })
            .collect()
    })
}

/// The places a hang can be injected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Place {
    Compute,
    P2p,
    AllReduce,
    Commit,
}

/// What the hook does at a `compute` place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Act {
    Stop,
    Stuck,
    CloseStdout,
    StuckUntilAbort,
}

/// What [`TEST_HANG_ENV`] asks node `node` to do at `place` in step `step` of `generation`.
fn wanted(generation: u64, node: u32, step: u64, place: Place) -> Option<Act> {
    let want = wants()
        .iter()
        .find(|w| (w.0, w.1, w.2) == (generation, node, step))?;
    let names: &[(&str, Act)] = match place {
        Place::Compute => &[
            ("compute", Act::Stop),
            ("stuck", Act::Stuck),
            ("close_stdout", Act::CloseStdout),
        ],
        Place::P2p => &[("p2p", Act::Stop)],
        Place::AllReduce => &[
            ("all_reduce", Act::Stop),
            ("all_reduce_stuck", Act::StuckUntilAbort),
        ],
        Place::Commit => &[("commit", Act::Stop)],
    };
    names
        .iter()
        .find_map(|(name, act)| (*name == want.3).then_some(*act))
}

/// Hangs here if [`TEST_HANG_ENV`] says so.
pub(super) fn hang_point(generation: u64, node: u32, step: u64, place: Place, abort: &AbortSwitch) {
    if HUNG.load(Ordering::SeqCst) {
        return;
    }
    let Some(act) = wanted(generation, node, step, place) else {
        return;
    };
    HUNG.store(true, Ordering::SeqCst);
    std::thread::sleep(BEFORE_STOP);
    eprintln!("oobleck worker: {TEST_HANG_ENV}: node {node}, step {step}: {act:?}");
    match act {
        Act::Stop => {
            let _ = std::process::Command::new("kill")
                .args(["-STOP", &std::process::id().to_string()])
                .status();
        }
        // The process runs on (its beats too); this thread never comes back.
        Act::Stuck => loop {
            std::thread::sleep(Duration::from_secs(3600));
        },
        Act::CloseStdout => close_stdout(),
        Act::StuckUntilAbort => {
            while !abort.is_set() {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Closes this process's stdout (file descriptor 1), as a broken pipe leaves it.
fn close_stdout() {
    use std::os::fd::FromRawFd;
    let _guard = std::io::stdout().lock();
    // SAFETY: fd 1 is this process's stdout, open since it started; the `File` takes it
    // over and closes it when dropped, while the stdout lock keeps Rust's own writers out.
    drop(unsafe { std::fs::File::from_raw_fd(1) });
}

/// The sleep [`TEST_SLOW_ENV`] asks of node `node`'s workers per microbatch (read once).
pub(super) fn slowness(node: u32) -> Option<Duration> {
    static SLOW: OnceLock<Option<(u32, Duration)>> = OnceLock::new();
    let slow = SLOW.get_or_init(|| {
        let spec = std::env::var(TEST_SLOW_ENV).ok()?;
        let (n, ms) = spec.trim().split_once(':')?;
        Some((n.parse().ok()?, Duration::from_millis(ms.parse().ok()?)))
    });
    slow.filter(|(n, _)| *n == node).map(|(_, d)| d)
}

/// The data-plane hook of [`TEST_HANG_ENV`] for the worker of `a`, if it is set: it stops
/// the worker inside the first receive or all-reduce the variable names.
pub(super) fn hang_hook(
    a: &WorkerAssignment,
    progress: &Arc<Progress>,
    abort: &Arc<AbortSwitch>,
) -> Option<OpHook> {
    if wants().is_empty() {
        return None;
    }
    let (generation, node, progress) = (a.generation, a.node, progress.clone());
    let abort = abort.clone();
    Some(Arc::new(move |doing: &Doing| {
        let place = match doing {
            Doing::Recv { .. } => Place::P2p,
            Doing::AllReduce { .. } => Place::AllReduce,
            _ => return,
        };
        hang_point(generation, node, progress.snapshot().step, place, &abort);
    }))
}
