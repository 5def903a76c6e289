//! The one error type of the job runtime.

use std::path::PathBuf;

/// An error from user code: a [`super::Workload`]'s data, evaluation or profile, or the
/// factory that builds it on a worker. `anyhow::Error` and every `std::error::Error` convert.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Errors of the job runtime: the master, the node supervisor and the worker loop.
///
/// The job's own decisions ([`super::job::JobMachine`]) end a job with one of the first
/// variants, each carrying the ids and numbers a reader needs; I/O on the way gets
/// [`RuntimeError::Context`] with what was being done.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A node or worker of the running generation is gone and the job cannot go on without
    /// it (fault threshold 0, or the failure repeats while the generation forms).
    #[error("{what}")]
    NodeFailure { what: String },
    /// A signal asked the job to stop before its first step: nothing was trained to save.
    #[error("stopped by {signal} before the first step: nothing was trained")]
    StoppedEarly { signal: String },
    /// A second signal stopped the job at once, without the checkpoint the first asked for.
    #[error("stopped at once by a second {signal}; {}", newest.as_deref().map_or(
        "no checkpoint was written yet".to_string(),
        |n| format!("the newest checkpoint is {n}")))]
    Interrupted {
        signal: String,
        newest: Option<String>,
    },
    /// The final state could not be saved within `--save-wait`.
    #[error(
        "the state after the final step {step} could not be saved: {error}; {}. Free space \
         where --out is (or pass a larger --save-wait) and run again{}",
        newest.as_deref().map_or("every trained step is lost (no checkpoint was written)".into(),
            |n| format!("the steps after the checkpoint {n} are lost")),
        newest.as_deref().map_or("", |_| " with --resume on the run directory")
    )]
    FinalSaveLost {
        step: u64,
        error: String,
        newest: Option<String>,
    },
    /// Nothing was heard from any process for `secs` seconds.
    #[error("no progress for {secs} s; the job is stuck")]
    Stalled { secs: u64 },
    /// The agents did not all register in time.
    #[error("only {joined} of {expected} agents registered within {secs} s")]
    NodesMissing {
        joined: usize,
        expected: usize,
        secs: u64,
    },
    /// A node was lost before the first plan.
    #[error("node {node} was lost while the cluster formed ({reason})")]
    LostWhileForming { node: u32, reason: String },
    /// Two ranks computed different global values for one step: a bug, never a failure.
    #[error(
        "ranks disagree on step {step}: rank {rank_a} has loss {loss_a}, grad norm {norm_a}; \
         rank {rank_b} has {loss_b}, {norm_b}"
    )]
    RanksDisagree {
        step: u64,
        rank_a: u32,
        loss_a: f64,
        norm_a: f64,
        rank_b: u32,
        loss_b: f64,
        norm_b: f64,
    },
    /// A committed step that nothing holds any more: no checkpoint of it and no replica that
    /// survived. A bug of the job's bookkeeping, never a failure (a failure beyond `f` restarts
    /// from a checkpoint instead).
    #[error("invalid job: step {step} is committed, but no checkpoint or replica holds it")]
    StepHeldNowhere { step: u64 },
    /// The machine was answered something it did not ask for (`what` arrived): a bug of the
    /// master that feeds it, never a failure.
    #[error("invalid job: {what} arrived while none was asked for")]
    Unasked { what: &'static str },
    /// A step's reports were weighed with none in them: a bug, never a failure.
    #[error("invalid job: no rank reported step {step}")]
    NoReports { step: u64 },
    /// A rank reported something that does not fit the step the job is at.
    #[error("rank {rank}: {what}")]
    OutOfStep { rank: u32, what: String },
    /// Failures kept coming with no step committed in between.
    #[error("{failure}: {recoveries} recoveries in a row without a committed step; giving up")]
    GaveUp { recoveries: u32, failure: String },
    /// No node is left to go on with.
    #[error("every node is lost ({failure}); {newest}")]
    AllLost { failure: String, newest: String },
    /// No plan fits the nodes.
    #[error("planning {nodes} nodes: {reason}")]
    Plan { nodes: usize, reason: String },
    /// The user's workload failed.
    #[error("the workload: {0}")]
    Workload(#[source] BoxError),
    /// The process was started as an agent or worker of a job, but its `main` went on to
    /// something else: it did not call [`super::take_over`] first.
    #[error(
        "this process was started as an oobleck {role} (OOBLECK_ROLE={role}), but its main() \
         did not hand over to the runtime: call `oobleck_core::runtime::take_over(factory)` at \
         the top of main(), before anything else"
    )]
    NotEntered { role: String },
    /// A job setting that cannot work.
    #[error("invalid job: {0}")]
    Invalid(String),
    /// This master was replaced by a newer one (a standby that took over): it steps down,
    /// touching nothing of the job (`why` says how it knows).
    #[error("this master (epoch {epoch}) was replaced: {why}; it steps down and leaves the job to the master that took over")]
    Replaced { epoch: u64, why: String },
    /// This master, with no standby, was stopped (SIGSTOP, a frozen VM) for longer than its
    /// lease: its agents took it for lost and look for a master. It decides nothing more and
    /// leaves them running, so that it starts again on its run directory (`--reattach`) and
    /// takes them back with their workers, losing no step.
    #[error("this master (epoch {epoch}) was stopped for {waited_ms} ms, near or past its lease of {lease_ms} ms, and its agents took it for lost; it starts again on its run directory to take them back")]
    StoppedTooLong {
        epoch: u64,
        waited_ms: u64,
        lease_ms: u64,
    },
    /// The plan a worker received disagrees with the job it was given: `plan` against
    /// `config` of `quantity`; `hint` says what to fix.
    #[error(
        "rank {rank}: the plan has {plan} {quantity}, but this worker's job has {config}; {hint}"
    )]
    PlanMismatch {
        rank: u32,
        quantity: &'static str,
        plan: u64,
        config: u64,
        hint: &'static str,
    },
    /// Something passed between the runtime's processes arrived unusable or out of order (a
    /// plan before the job, a rendezvous without some rank, a malformed pipe line), or did not
    /// come in time, or a pipe closed: `who` found it (`rank 3`, `node 1`).
    #[error("{who}: {what}")]
    Protocol { who: String, what: String },
    /// A layer copy of an in-place reconfiguration arrived different from what its sender
    /// sent (the sender's checksum or shape does not match).
    #[error(
        "layer {layer} from rank {from}: tensor {tensor} arrived corrupted ({detail}); the \
         job recovers again, from another holder or the newest checkpoint"
    )]
    CopyCorrupt {
        layer: usize,
        from: u32,
        tensor: String,
        detail: String,
    },
    /// An I/O step failed; `what` says which.
    #[error("{what}: {source}")]
    Context { what: String, source: BoxError },
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Wire(#[from] crate::runtime::wire::WireError),
    #[error(transparent)]
    Spec(#[from] crate::runtime::spec::SpecError),
    #[error(transparent)]
    Core(#[from] crate::Error),
}

pub type Result<T> = std::result::Result<T, RuntimeError>;

/// `.ctx("what was being done")` on any result, as `anyhow::Context` would.
pub trait Context<T> {
    fn ctx(self, what: impl Into<String>) -> Result<T>;
    fn with_ctx<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T>;
}

impl<T, E: Into<BoxError>> Context<T> for std::result::Result<T, E> {
    fn ctx(self, what: impl Into<String>) -> Result<T> {
        self.map_err(|e| RuntimeError::Context {
            what: what.into(),
            source: e.into(),
        })
    }

    fn with_ctx<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|e| RuntimeError::Context {
            what: what().into(),
            source: e.into(),
        })
    }
}

impl<T> Context<T> for Option<T> {
    fn ctx(self, what: impl Into<String>) -> Result<T> {
        self.ok_or_else(|| RuntimeError::Invalid(what.into()))
    }

    fn with_ctx<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.ok_or_else(|| RuntimeError::Invalid(what().into()))
    }
}

impl RuntimeError {
    /// Wraps a user error.
    pub fn workload(e: impl Into<BoxError>) -> RuntimeError {
        RuntimeError::Workload(e.into())
    }
}

/// The messages of `e` and of its sources, skipping a source whose text an outer message
/// already includes (most of this crate's errors print their source).
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> Vec<String> {
    let mut lines = vec![e.to_string()];
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !lines.iter().any(|l| l.contains(&text)) {
            lines.push(text);
        }
        source = s.source();
    }
    lines
}
