//! The worker's ends of its pipe: the agent's lines on stdin, the reports on stdout.
//!
//! This module owns the process's stdin and stdout (the pipe protocol of [`crate::runtime::wire::pipe`]),
//! so it prints: the worker's stderr is its log, which the agent passes on.

use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use oobleck_comm::Communicator;

use super::protocol;
use crate::runtime::error::{Context, Result};
use crate::runtime::wire::pipe::{ToWorker, WorkerAssignment};
use crate::runtime::wire::records::WorkerReport;

/// How long a worker waits for its assignment on stdin.
const ASSIGNMENT_TIMEOUT: Duration = Duration::from_secs(30);

/// Exit code of a worker whose agent closed its stdin.
const ORPHANED: i32 = 3;

/// Stops the running generation from the stdin thread, the moment the master says the
/// generation failed: while it forms, its data plane stops connecting (`cancel`); once
/// formed, the communicator is aborted (every blocked operation returns) and the step's data
/// source refuses the next microbatch (compute with no communication stops too).
pub(super) struct AbortSwitch {
    /// The generation this worker forms or runs; `u64::MAX` before its first.
    generation: AtomicU64,
    rank: AtomicU64,
    aborted: AtomicBool,
    /// Given to the forming data plane (`TcpConfig::cancel`); set with `aborted`.
    cancel: Mutex<Arc<AtomicBool>>,
    comm: Mutex<Option<Arc<dyn Communicator>>>,
}

impl Default for AbortSwitch {
    fn default() -> AbortSwitch {
        AbortSwitch {
            // No generation yet: an abort that comes first is for nobody here.
            generation: AtomicU64::new(u64::MAX),
            rank: AtomicU64::new(0),
            aborted: AtomicBool::new(false),
            cancel: Mutex::new(Arc::new(AtomicBool::new(false))),
            comm: Mutex::new(None),
        }
    }
}

impl AbortSwitch {
    /// This worker starts forming `generation` as `rank`: an abort of it from now on stops
    /// its rendezvous. Returns the flag its data plane's connect watches.
    pub(super) fn prepare(&self, generation: u64, rank: u32) -> Arc<AtomicBool> {
        let cancel = Arc::new(AtomicBool::new(false));
        *self.cancel.lock().unwrap_or_else(|p| p.into_inner()) = cancel.clone();
        *self.comm.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.aborted.store(false, Ordering::SeqCst);
        self.rank.store(u64::from(rank), Ordering::SeqCst);
        self.generation.store(generation, Ordering::SeqCst);
        cancel
    }

    /// Generation `generation` runs on `comm` from now on (aborted at once if its abort
    /// already came).
    pub(super) fn arm(&self, generation: u64, rank: u32, comm: Arc<dyn Communicator>) {
        if self.generation.load(Ordering::SeqCst) != generation {
            self.prepare(generation, rank);
        }
        *self.comm.lock().unwrap_or_else(|p| p.into_inner()) = Some(comm.clone());
        if self.is_set() {
            comm.abort();
        }
    }

    /// Whether the running generation was aborted.
    pub(super) fn is_set(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    fn trigger(&self, generation: u64) {
        if self.generation.load(Ordering::SeqCst) != generation {
            return;
        }
        let first = !self.aborted.swap(true, Ordering::SeqCst);
        self.cancel
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .store(true, Ordering::SeqCst);
        if let Some(c) = self.comm.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            c.abort();
        }
        if first {
            let rank = self.rank.load(Ordering::SeqCst) as u32;
            // Nothing to do if stdout is gone: the agent is, too.
            let _ = report(generation, &WorkerReport::Stopping { rank });
        }
    }
}

/// The worker's stdin: the assignment, then the agent's messages. A thread reads it and ends
/// the process when it closes: the agent that started us is gone, so nobody would ever
/// commit a step or collect our results.
pub(super) struct Inbox {
    rank: u32,
    rx: mpsc::Receiver<Result<ToWorker>>,
    pub(super) abort: Arc<AbortSwitch>,
    /// A message read too early, handed out again first.
    unread: std::cell::RefCell<Option<ToWorker>>,
}

impl Inbox {
    /// Starts reading stdin; returns the assignment (its first line) and the rest.
    pub(super) fn start(rank: u32) -> Result<(WorkerAssignment, Inbox)> {
        let (first_tx, first_rx) = mpsc::channel();
        let (tx, rx) = mpsc::channel();
        let abort = Arc::new(AbortSwitch::default());
        let switch = abort.clone();
        std::thread::spawn(move || read_stdin(rank, first_tx, tx, &switch));
        let line = first_rx
            .recv_timeout(ASSIGNMENT_TIMEOUT)
            .map_err(|_| {
                protocol(
                    rank,
                    format!("no assignment on stdin within {ASSIGNMENT_TIMEOUT:?}"),
                )
            })?
            .ctx("reading the assignment from stdin")?;
        let a = serde_json::from_str(line.trim()).ctx("parsing the assignment from stdin")?;
        Ok((
            a,
            Inbox {
                rank,
                rx,
                abort,
                unread: Default::default(),
            },
        ))
    }

    /// The next message from the agent, waiting at most `timeout`.
    pub(super) fn next(&self, timeout: Duration, waiting_for: &str) -> Result<ToWorker> {
        if let Some(m) = self.unread.borrow_mut().take() {
            return Ok(m);
        }
        match self.rx.recv_timeout(timeout) {
            Ok(m) => m,
            Err(mpsc::RecvTimeoutError::Timeout) => Err(protocol(
                self.rank,
                format!("no {waiting_for} from the agent within {timeout:?}"),
            )),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Err(protocol(self.rank, "the agent's stdin closed".into()))
            }
        }
    }

    /// Hands `m` out again on the next [`Inbox::next`].
    pub(super) fn unread(&self, m: ToWorker) {
        *self.unread.borrow_mut() = Some(m);
    }
}

fn read_stdin(
    rank: u32,
    first: mpsc::Sender<std::io::Result<String>>,
    rest: mpsc::Sender<Result<ToWorker>>,
    abort: &AbortSwitch,
) {
    let stdin = std::io::stdin();
    let mut lock = stdin.lock();
    let mut line = String::new();
    let _ = first.send(lock.read_line(&mut line).map(|_| line.clone()));
    loop {
        line.clear();
        match lock.read_line(&mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                let msg = serde_json::from_str::<ToWorker>(line.trim());
                if let Ok(ToWorker::Abort { generation }) = msg {
                    abort.trigger(generation);
                    continue;
                }
                let msg = msg.map_err(|e| {
                    protocol(
                        rank,
                        format!("malformed message from the agent: {:?}: {e}", line.trim()),
                    )
                });
                if rest.send(msg).is_err() {
                    break;
                }
            }
        }
    }
    eprintln!("oobleck worker: its agent closed stdin; exiting");
    std::process::exit(ORPHANED);
}

/// Writes `r`, a report of a worker of `generation`, on stdout for the agent.
pub(super) fn report(generation: u64, r: &WorkerReport) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", r.line(generation)).ctx("writing a report to stdout")?;
    out.flush().ctx("flushing stdout")
}
