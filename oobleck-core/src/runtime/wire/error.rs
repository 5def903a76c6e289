//! The one error type of the control plane.

/// Errors of the control plane: framing, authentication and membership.
///
/// Variants carry the numbers a reader needs to tell a version skew from a corrupt stream from
/// a dead peer. The lead crate error wraps it.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// An I/O call on a control connection failed.
    #[error("control plane: {op}: {source}")]
    Io {
        op: &'static str,
        source: std::io::Error,
    },
    /// A bounded wait ran out.
    #[error("control plane: {op} timed out after {ms} ms")]
    Timeout { op: &'static str, ms: u64 },
    /// The first four bytes of a frame are not the protocol magic: not an Oobleck peer.
    #[error("control plane: bad frame magic {found:02x?} (expected {expected:02x?})")]
    BadMagic { found: [u8; 4], expected: [u8; 4] },
    /// The peer speaks another protocol version.
    #[error(
        "control plane: protocol version {found} is not supported (this binary speaks {supported})"
    )]
    UnsupportedVersion { found: u16, supported: u16 },
    /// Header bits reserved for later versions are set.
    #[error("control plane: reserved header field is {found:#06x}, expected 0")]
    ReservedBits { found: u16 },
    /// A frame announces a body larger than the cap.
    #[error("control plane: frame of {len} bytes exceeds the {max}-byte limit")]
    FrameTooLarge { len: u64, max: u32 },
    /// The peer closed the connection in the middle of a frame.
    #[error("control plane: peer closed mid-frame ({got} of {expected} bytes of the {part})")]
    Truncated {
        part: &'static str,
        expected: usize,
        got: usize,
    },
    /// A frame body that does not decode to a [`super::protocol::Message`].
    #[error("control plane: malformed {len}-byte message body: {reason}")]
    Malformed { len: usize, reason: String },
    /// A message could not be encoded (never expected for the types of this protocol).
    #[error("control plane: cannot encode {kind} message: {reason}")]
    Encode { kind: &'static str, reason: String },
    /// The peer sent a valid message that does not fit the conversation at this point.
    #[error("control plane: expected {expected}, got {got}")]
    Unexpected { expected: &'static str, got: String },
    /// The master refused this peer, with the reason it gave.
    #[error("control plane: refused by master: {reason}")]
    Refused { reason: String },
    /// A shared secret that cannot be used.
    #[error("control plane: invalid token: {reason}")]
    InvalidToken { reason: String },
    /// A message addressed to a node the master does not know (never registered, or lost).
    #[error("control plane: node {node} is not registered")]
    UnknownNode { node: u32 },
    /// The other side of a connection has gone (clean close or lost connection).
    #[error("control plane: connection to {peer} closed")]
    Closed { peer: String },
}

pub type WireResult<T> = std::result::Result<T, WireError>;
