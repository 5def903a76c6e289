//! The wire: everything the processes of a job say to each other, and nothing else. A leaf:
//! it imports no other room of the runtime, so the master, the node agents, the workers and
//! the tools can all depend on it.
//!
//! ```text
//!   node agent ──TCP──► master                client (status, kill-node) ──TCP──► master
//!     Hello{protocol, binary_version, role, job?}
//!                ◄── Challenge{node, nonce}
//!     AuthResponse{HMAC(token, nonce‖node‖protocol)}
//!                ◄── Welcome{node, heartbeat_ms, lease_ms}   or   Refused{reason} + close
//!     Heartbeat{node, seq} every heartbeat_ms ──►   (silence for lease_ms = lost)
//!                ◄── PlanAssignment / StepCommitted / Shutdown
//!
//!   node agent ──stdin──► worker    WorkerAssignment, then ToWorker lines      (pipe)
//!   node agent ◄─stdout── worker    WorkerReport lines and progress beats      (pipe)
//! ```
//!
//! - [`protocol`]: the control plane's [`Message`] enum and its frames (layout drawn there).
//! - [`auth`]: the shared [`Token`] and the challenge-response.
//! - [`client`]: the connecting side of the handshake, and the one-shot requests of the tools.
//! - [`pipe`]: what a node agent and its workers say over the worker's stdin and stdout.
//! - [`records`]: what workers report ([`WorkerReport`]), and the typed lines of `events.jsonl`
//!   ([`Event`]) and `metrics.jsonl` ([`StepMetrics`]), written and read through the same enums.
//! - [`env`]: the environment variables by which a parent process tells its child what it is.
//!
//! Failure behaviour of the control plane is written down in `README.md` beside this file.

pub mod auth;
pub mod client;
pub mod env;
pub mod error;
pub mod pipe;
pub mod protocol;
pub mod records;

pub use auth::Token;
pub use client::{request_drain, request_kill, request_status};
pub use error::{WireError, WireResult};
pub use pipe::{StateSource, ToWorker, WorkerAssignment};
pub use protocol::Message;
pub use records::{Event, EventLine, StepMetrics, WorkerReport};
