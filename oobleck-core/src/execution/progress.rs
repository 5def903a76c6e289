//! Progress marks: what a rank is doing right now, cheap enough to take at every microbatch
//! and every data-plane operation, so that a watchdog outside the compute can tell a rank
//! that is slow from one that is stuck, and name where it is stuck.
//!
//! ```text
//!  StageRunner::run_iteration ── Forward/Backward of microbatch m ──┐
//!  Watched (a Communicator)   ── send/recv (peer, microbatch),      ├─► Progress: a stack of
//!                                all_reduce/broadcast/barrier (#k)  │   what is under way,
//!  the worker's step loop     ── begin_step / end_step / Commit ────┘   a counter that moves
//!                                                                       at every mark, and
//!                                                                       this step's times
//! ```
//!
//! A mark is a mutex lock and a push at entry, a lock and a removal at exit (well under a
//! microsecond; a step has a few dozen). Whoever watches takes a [`Snapshot`] now and then.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use oobleck_comm::{Communicator, DType, Rank, Result as CommResult, TensorBuf};
use serde::{Deserialize, Serialize};

/// One thing a rank can be doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Doing {
    Forward {
        mb: u32,
    },
    Backward {
        mb: u32,
    },
    Optimizer,
    /// A point-to-point send; `mb` and `gradient` come from the 1F1B tag, when it is one.
    Send {
        peer: u32,
        mb: Option<u32>,
        gradient: bool,
    },
    Recv {
        peer: u32,
        mb: Option<u32>,
        gradient: bool,
    },
    /// The `index`-th collective of the step (1-based), over `ranks` ranks, `bytes` long.
    AllReduce {
        index: u32,
        ranks: u32,
        bytes: u64,
    },
    Broadcast {
        index: u32,
        ranks: u32,
        bytes: u64,
    },
    Barrier {
        index: u32,
        ranks: u32,
    },
    /// Waiting for the master's commit of the step: the control plane's business, not watched.
    Commit,
}

/// What a mark's time counts as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Compute,
    P2p,
    Collective,
    /// Waiting for the control plane (a commit).
    Control,
}

impl Doing {
    pub fn kind(&self) -> Kind {
        match self {
            Doing::Forward { .. } | Doing::Backward { .. } | Doing::Optimizer => Kind::Compute,
            Doing::Send { .. } | Doing::Recv { .. } => Kind::P2p,
            Doing::AllReduce { .. } | Doing::Broadcast { .. } | Doing::Barrier { .. } => {
                Kind::Collective
            }
            Doing::Commit => Kind::Control,
        }
    }

    /// Whether the rank waits on its peers here (a data-plane operation), rather than works.
    pub fn waits_on_peers(&self) -> bool {
        matches!(self.kind(), Kind::P2p | Kind::Collective)
    }

    /// In words, for a report: `all_reduce #3 (2 ranks, 1.20 MB)`.
    pub fn describe(&self) -> String {
        let part = |mb: &Option<u32>, gradient: bool| match mb {
            Some(m) if gradient => format!(" of microbatch {m}'s gradient"),
            Some(m) => format!(" of microbatch {m}'s activation"),
            None => String::new(),
        };
        let size = |b: u64| {
            if b < 1_000_000 {
                format!("{:.1} KB", b as f64 / 1e3)
            } else {
                format!("{:.2} MB", b as f64 / 1e6)
            }
        };
        match self {
            Doing::Forward { mb } => format!("the forward of microbatch {mb}"),
            Doing::Backward { mb } => format!("the backward of microbatch {mb}"),
            Doing::Optimizer => "the optimizer step".into(),
            Doing::Send { peer, mb, gradient } => {
                format!("a send{} to rank {peer}", part(mb, *gradient))
            }
            Doing::Recv { peer, mb, gradient } => {
                format!("a receive{} from rank {peer}", part(mb, *gradient))
            }
            Doing::AllReduce {
                index,
                ranks,
                bytes,
            } => format!("all_reduce #{index} ({ranks} ranks, {})", size(*bytes)),
            Doing::Broadcast {
                index,
                ranks,
                bytes,
            } => format!("broadcast #{index} ({ranks} ranks, {})", size(*bytes)),
            Doing::Barrier { index, ranks } => format!("barrier #{index} ({ranks} ranks)"),
            Doing::Commit => "waiting for the commit".into(),
        }
    }
}

/// Where one step's time went on one rank, from its start to its gradients being reduced.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepTimes {
    /// Forward and backward of its microbatches (data reads included), on the rank's main
    /// thread. The optimizer runs after the step's `Ready`, so it is not in here.
    pub compute_ms: f64,
    /// The forward part of `compute_ms` (data reads included).
    #[serde(default)]
    pub forward_ms: f64,
    /// The backward part of `compute_ms`.
    #[serde(default)]
    pub backward_ms: f64,
    /// Inside sends and receives of activations and gradients.
    pub p2p_ms: f64,
    /// Inside collectives (some overlap the last backward: they run on their own thread).
    pub collective_ms: f64,
    /// From the step's start to its gradients being reduced.
    pub step_ms: f64,
    /// Progress marks taken in that time (each entry and exit counts): what the watchdog's
    /// bookkeeping costs per step is this times the cost of one mark.
    #[serde(default)]
    pub marks: u64,
}

/// What a watcher sees of a rank at one moment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    /// Moves at every mark: unchanged between two snapshots means no progress in between.
    pub seq: u64,
    /// The step under way (1-based), or the last one when between steps.
    pub step: u64,
    /// Inside a step (from its start to its commit): the times a watchdog holds it to.
    pub in_step: bool,
    /// What is under way, oldest first (a collective on its own thread can run beside a
    /// backward); empty between marks.
    pub doing: Vec<Doing>,
}

impl Snapshot {
    /// Whether everything under way waits on peers (the rank itself is not what is stuck).
    pub fn waits_on_peers(&self) -> bool {
        !self.doing.is_empty() && self.doing.iter().all(Doing::waits_on_peers)
    }

    /// Whether the rank waits for the control plane (a commit): not watched.
    pub fn waits_for_control(&self) -> bool {
        self.doing.last().is_some_and(|d| d.kind() == Kind::Control)
    }

    /// In words: `all_reduce #3 (2 ranks, 0.52 MB) of step 4`.
    pub fn describe(&self) -> String {
        let what = match self.doing.last() {
            Some(d) => d.describe(),
            None => "between operations".into(),
        };
        format!("{what} of step {}", self.step)
    }
}

#[derive(Debug, Default)]
struct State {
    seq: u64,
    next_id: u64,
    step: u64,
    in_step: bool,
    /// `(id, doing, since)`.
    stack: Vec<(u64, Doing, Instant)>,
    collectives: u32,
    step_started: Option<Instant>,
    /// `seq` when the step began.
    step_seq: u64,
    compute: Duration,
    forward: Duration,
    backward: Duration,
    p2p: Duration,
    collective: Duration,
}

/// A rank's progress marks, shared by its threads and its watcher.
#[derive(Debug, Default)]
pub struct Progress {
    state: Mutex<State>,
}

/// An operation under way: ends when dropped.
pub struct Mark<'a> {
    progress: &'a Progress,
    id: u64,
    doing: Doing,
}

impl Drop for Mark<'_> {
    fn drop(&mut self) {
        let mut s = self.progress.lock();
        s.seq += 1;
        if let Some(i) = s.stack.iter().position(|(id, ..)| *id == self.id) {
            let (_, doing, since) = s.stack.remove(i);
            let spent = since.elapsed();
            match doing {
                Doing::Forward { .. } => s.forward += spent,
                Doing::Backward { .. } => s.backward += spent,
                _ => {}
            }
            match doing.kind() {
                Kind::Compute => s.compute += spent,
                Kind::P2p => s.p2p += spent,
                Kind::Collective => s.collective += spent,
                Kind::Control => {}
            }
        }
    }
}

impl Progress {
    pub fn new() -> Arc<Progress> {
        Arc::new(Progress::default())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `doing` starts now; it ends when the returned mark is dropped.
    pub fn enter(&self, doing: Doing) -> Mark<'_> {
        self.enter_with(|_| doing)
    }

    /// The next collective of the step starts now: `make(its 1-based index)` says which.
    pub fn enter_collective(&self, make: impl FnOnce(u32) -> Doing) -> Mark<'_> {
        self.enter_with(|s| {
            s.collectives += 1;
            make(s.collectives)
        })
    }

    fn enter_with(&self, doing: impl FnOnce(&mut State) -> Doing) -> Mark<'_> {
        let mut s = self.lock();
        let doing = doing(&mut s);
        s.seq += 1;
        s.next_id += 1;
        let id = s.next_id;
        s.stack.push((id, doing, Instant::now()));
        Mark {
            progress: self,
            id,
            doing,
        }
    }

    /// Step `step` (1-based) starts: its times and collective count start from zero.
    pub fn begin_step(&self, step: u64) {
        let mut s = self.lock();
        s.seq += 1;
        s.step = step;
        s.in_step = true;
        s.collectives = 0;
        s.step_started = Some(Instant::now());
        s.step_seq = s.seq;
        s.compute = Duration::ZERO;
        s.forward = Duration::ZERO;
        s.backward = Duration::ZERO;
        s.p2p = Duration::ZERO;
        s.collective = Duration::ZERO;
    }

    /// The step's gradients are reduced: its times so far.
    pub fn step_times(&self) -> StepTimes {
        let s = self.lock();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        StepTimes {
            compute_ms: ms(s.compute),
            forward_ms: ms(s.forward),
            backward_ms: ms(s.backward),
            p2p_ms: ms(s.p2p),
            collective_ms: ms(s.collective),
            step_ms: s.step_started.map_or(0.0, |t| ms(t.elapsed())),
            marks: s.seq - s.step_seq,
        }
    }

    /// The step is over (committed and applied, or abandoned): nothing to watch until the
    /// next one begins.
    pub fn end_step(&self) {
        let mut s = self.lock();
        s.seq += 1;
        s.in_step = false;
    }

    pub fn snapshot(&self) -> Snapshot {
        let s = self.lock();
        Snapshot {
            seq: s.seq,
            step: s.step,
            in_step: s.in_step,
            doing: s.stack.iter().map(|(_, d, _)| *d).collect(),
        }
    }
}

/// What a 1F1B message tag says: `(microbatch, gradient)`; `None` for collectives' tags.
fn tag_parts(tag: u64) -> Option<(u32, bool)> {
    (tag >> 63 == 0).then_some((((tag >> 1) & 0x7fff_ffff) as u32, tag & 1 == 1))
}

/// Called with each data-plane operation once it is marked, before it runs: where a test
/// injects a fault inside an operation.
pub type OpHook = Arc<dyn Fn(&Doing) + Send + Sync>;

/// A communicator whose every operation is marked in `progress`.
pub struct Watched {
    inner: Arc<dyn Communicator>,
    progress: Arc<Progress>,
    hook: Option<OpHook>,
}

impl Watched {
    pub fn new(inner: Arc<dyn Communicator>, progress: Arc<Progress>) -> Watched {
        Watched {
            inner,
            progress,
            hook: None,
        }
    }

    /// Calls `hook` inside every operation (see [`OpHook`]).
    pub fn with_hook(self, hook: OpHook) -> Watched {
        Watched {
            hook: Some(hook),
            ..self
        }
    }

    /// Runs `op` under `mark`.
    fn marked<T>(&self, mark: Mark<'_>, op: impl FnOnce() -> T) -> T {
        if let Some(h) = &self.hook {
            h(&mark.doing);
        }
        op()
    }

    fn p2p(peer: Rank, tag: u64, send: bool) -> Doing {
        let (mb, gradient) = match tag_parts(tag) {
            Some((m, g)) => (Some(m), g),
            None => (None, false),
        };
        let peer = peer as u32;
        if send {
            Doing::Send { peer, mb, gradient }
        } else {
            Doing::Recv { peer, mb, gradient }
        }
    }
}

impl Communicator for Watched {
    fn rank(&self) -> Rank {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn generation(&self) -> u64 {
        self.inner.generation()
    }
    fn send(&self, dst: Rank, tag: u64, tensor: &TensorBuf, timeout: Duration) -> CommResult<()> {
        self.marked(self.progress.enter(Self::p2p(dst, tag, true)), || {
            self.inner.send(dst, tag, tensor, timeout)
        })
    }
    fn recv(&self, src: Rank, tag: u64, timeout: Duration) -> CommResult<TensorBuf> {
        self.marked(self.progress.enter(Self::p2p(src, tag, false)), || {
            self.inner.recv(src, tag, timeout)
        })
    }
    fn recv_into(
        &self,
        src: Rank,
        tag: u64,
        dst: &mut TensorBuf,
        timeout: Duration,
    ) -> CommResult<()> {
        self.marked(self.progress.enter(Self::p2p(src, tag, false)), || {
            self.inner.recv_into(src, tag, dst, timeout)
        })
    }
    fn alloc(&self, dtype: DType, shape: Vec<usize>) -> CommResult<TensorBuf> {
        self.inner.alloc(dtype, shape)
    }
    fn all_reduce(
        &self,
        group: &[Rank],
        tensor: &mut TensorBuf,
        timeout: Duration,
    ) -> CommResult<()> {
        let (ranks, bytes) = (group.len() as u32, tensor.as_bytes().len() as u64);
        let mark = self.progress.enter_collective(|index| Doing::AllReduce {
            index,
            ranks,
            bytes,
        });
        self.marked(mark, || self.inner.all_reduce(group, tensor, timeout))
    }
    fn broadcast(
        &self,
        group: &[Rank],
        root: Rank,
        tensor: &mut TensorBuf,
        timeout: Duration,
    ) -> CommResult<()> {
        let (ranks, bytes) = (group.len() as u32, tensor.as_bytes().len() as u64);
        let mark = self.progress.enter_collective(|index| Doing::Broadcast {
            index,
            ranks,
            bytes,
        });
        self.marked(mark, || self.inner.broadcast(group, root, tensor, timeout))
    }
    fn barrier(&self, group: &[Rank], timeout: Duration) -> CommResult<()> {
        let ranks = group.len() as u32;
        let mark = self
            .progress
            .enter_collective(|index| Doing::Barrier { index, ranks });
        self.marked(mark, || self.inner.barrier(group, timeout))
    }
    fn abort(&self) {
        self.inner.abort()
    }
    fn is_aborted(&self) -> bool {
        self.inner.is_aborted()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_nest_across_threads_and_count_their_time_by_kind() {
        let p = Progress::new();
        p.begin_step(4);
        let bwd = p.enter(Doing::Backward { mb: 2 });
        let ar = p.enter(Doing::AllReduce {
            index: 3,
            ranks: 2,
            bytes: 1 << 20,
        });
        let s = p.snapshot();
        assert_eq!(s.step, 4);
        assert!(s.in_step && !s.waits_on_peers(), "{s:?}");
        assert_eq!(s.describe(), "all_reduce #3 (2 ranks, 1.05 MB) of step 4");
        // The backward ends first (another thread's collective goes on): the rank now only
        // waits on its peers.
        drop(bwd);
        let s2 = p.snapshot();
        assert!(s2.seq > s.seq && s2.waits_on_peers(), "{s2:?}");
        drop(ar);
        assert!(p.snapshot().doing.is_empty());
        let _c = p.enter(Doing::Commit);
        assert!(p.snapshot().waits_for_control());
        let t = p.step_times();
        assert!(t.compute_ms >= 0.0 && t.step_ms >= t.compute_ms, "{t:?}");
        // The backward is counted as such, within compute; no forward ran.
        assert!(
            t.backward_ms > 0.0 && t.backward_ms <= t.compute_ms,
            "{t:?}"
        );
        assert_eq!(t.forward_ms, 0.0, "{t:?}");
        // Two marks entered and left, one entered, after the step began.
        assert_eq!(t.marks, 5, "{t:?}");
        p.end_step();
        assert!(!p.snapshot().in_step);
    }

    #[test]
    fn a_1f1b_tag_names_its_microbatch_and_a_collective_tag_none() {
        // `worker::tag(iteration 7, microbatch 5, gradient)`.
        let t = (7u64 << 32) | (5 << 1) | 1;
        assert_eq!(tag_parts(t), Some((5, true)));
        assert_eq!(tag_parts(1 << 63), None);
        let d = Doing::Recv {
            peer: 2,
            mb: Some(5),
            gradient: false,
        };
        assert_eq!(
            d.describe(),
            "a receive of microbatch 5's activation from rank 2"
        );
    }
}
