//! The one error type of this crate.

use std::net::SocketAddr;
use std::time::Duration;

use crate::Rank;

/// Which operation an error happened in (for `Timeout` and logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Connect,
    Send,
    Recv,
    AllReduce,
    Broadcast,
    Barrier,
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            Op::Connect => "connect",
            Op::Send => "send",
            Op::Recv => "recv",
            Op::AllReduce => "all_reduce",
            Op::Broadcast => "broadcast",
            Op::Barrier => "barrier",
        };
        f.write_str(s)
    }
}

/// Why a frame was rejected by the decoder.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("bad magic {found:#010x} (expected {expected:#010x}): not an oobleck-comm peer")]
    BadMagic { found: u32, expected: u32 },
    #[error("unsupported protocol version {found} (this build speaks {supported})")]
    BadVersion { found: u16, supported: u16 },
    #[error("unknown frame kind {0}")]
    BadKind(u16),
    #[error("frame of {len} bytes exceeds the cap of {cap} bytes")]
    TooLong { len: u64, cap: u64 },
    #[error("connection closed mid-frame after {got} of {want} bytes")]
    Truncated { got: usize, want: usize },
    #[error("frame from generation {found}, this communicator is generation {expected}")]
    StaleGeneration { found: u64, expected: u64 },
    #[error("malformed payload: {0}")]
    Malformed(String),
}

/// Errors of every communicator operation.
///
/// Every variant carries the ids a reader needs to act on it (ranks, generation, the op).
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommError {
    /// A peer died, closed its connection, or sent something this side cannot accept.
    #[error("rank {rank} lost (generation {generation}): {reason}")]
    PeerLost {
        rank: Rank,
        generation: u64,
        reason: String,
    },
    /// The operation did not complete before its deadline (e.g. a stalled peer).
    #[error(
        "{op} on rank {rank} timed out after {:.1} s (generation {generation}, waiting on {})",
        after.as_secs_f64(),
        waiting_on.map_or("no one peer".into(), |r| format!("rank {r}"))
    )]
    Timeout {
        op: Op,
        after: Duration,
        rank: Rank,
        generation: u64,
        waiting_on: Option<Rank>,
    },
    /// `abort` was called (here, or implicitly after an earlier failure).
    #[error("communicator of rank {rank} aborted (generation {generation})")]
    Aborted { rank: Rank, generation: u64 },
    /// A peer spoke for a different generation of the cluster plan.
    #[error("rank {peer} is at generation {theirs}, this communicator is generation {ours}")]
    StaleGeneration { peer: Rank, ours: u64, theirs: u64 },
    /// The handshake with a peer did not prove the generation's key: the two ranks were given
    /// different keys (or only one of them a key), or something other than rank `peer`
    /// answers at its address.
    #[error(
        "rank {rank} could not authenticate with rank {peer} at {addr} (generation {generation}): \
         {reason}. Every rank of a generation must be started with that generation's key from \
         the master: check that both ranks run the same plan, and that nothing else listens on {addr}"
    )]
    AuthFailed {
        rank: Rank,
        peer: Rank,
        addr: SocketAddr,
        generation: u64,
        reason: String,
    },
    /// The backend was not compiled in (cargo feature off).
    #[error("backend {backend} not compiled in: rebuild with `--features {feature}`")]
    NotCompiled {
        backend: &'static str,
        feature: &'static str,
    },
    /// A runtime dependency (driver, shared library, device) is missing.
    #[error("{what} unavailable: {reason}")]
    Unavailable { what: String, reason: String },
    /// A caller-side mistake: bad rank, bad group, mismatched shapes.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A bad frame on the wire.
    #[error("bad frame from {}: {source}", peer.map_or("a peer not yet known".into(), |r| format!("rank {r}")))]
    Frame {
        peer: Option<Rank>,
        #[source]
        source: FrameError,
    },
    /// An I/O error outside of a peer's connection (bind, listen).
    #[error("{context}: {message}")]
    Io { context: String, message: String },
    /// A blob sink refused an upload; `message` is the sink's reason (a bad name, too large,
    /// a corrupted body, a disk error on the sink).
    #[error("blob sink {sink} refused the upload of {name:?}: {message}")]
    BlobRefused {
        sink: SocketAddr,
        name: String,
        message: String,
    },
    /// A blob sink refused an upload whose MAC does not verify under its key.
    #[error(
        "blob sink {sink} refused the upload of {name:?}: its MAC does not verify, so the \
         uploader was given another job's or generation's key than the sink's (check that the \
         worker uploads with the key of the sink's current generation)"
    )]
    BlobUnauthorized { sink: SocketAddr, name: String },
    /// An upload broke off before the sink's final answer: no connection, a timeout, or a
    /// connection closed early. The file is not on the sink.
    #[error(
        "upload of {name:?} to blob sink {sink} failed after {sent} of {len} bytes: {reason} \
         (check that the master is up and reachable there and that the timeout fits the size)"
    )]
    BlobTransfer {
        sink: SocketAddr,
        name: String,
        sent: u64,
        len: u64,
        reason: String,
    },
    /// A blob sink has no file (or, for a listing, no directory) of this name under its root.
    #[error(
        "blob sink {sink} has no {name:?} under its run directory (check that the master wrote          it, e.g. that the checkpoint step exists, and that the name is relative to the run          directory)"
    )]
    BlobNotFound { sink: SocketAddr, name: String },
    /// A download or a listing (`what`) from a blob sink failed: refused (a bad name, a wrong
    /// key), broken off (no connection, a timeout, a connection closed early), or its bytes did
    /// not match the length, hash or MAC the sink announced. Nothing is kept of a download.
    #[error(
        "{what} of {name:?} from blob sink {sink} failed: {reason} (check that the master is          up and reachable there and that the timeout fits the size)"
    )]
    BlobFetch {
        sink: SocketAddr,
        what: &'static str,
        name: String,
        reason: String,
    },
}

impl CommError {
    /// True for errors caused by the caller's arguments; they leave the communicator usable.
    /// Every other error poisons it (see the failure contract on [`crate::Communicator`]).
    pub fn is_invalid_argument(&self) -> bool {
        matches!(self, CommError::Invalid(_))
    }

    pub(crate) fn io(context: impl Into<String>, err: &std::io::Error) -> Self {
        CommError::Io {
            context: context.into(),
            message: err.to_string(),
        }
    }
}

/// `Result` with [`CommError`].
pub type Result<T, E = CommError> = std::result::Result<T, E>;
