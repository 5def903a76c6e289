//! Control plane: the framed, versioned, authenticated protocol between the master, the node
//! agents and tools, and the membership layer on top of it.
//!
//! ```text
//!   agent ──TCP──► master                     client (status, kill-node) ──TCP──► master
//!     Hello{protocol, binary_version, role}
//!                ◄── Challenge{node, nonce}
//!     AuthResponse{HMAC(token, nonce‖node‖protocol)}
//!                ◄── Welcome{node, heartbeat_ms, lease_ms}   or   Refused{reason} + close
//!     Heartbeat{node, seq} every heartbeat_ms ──►   (silence for lease_ms = lost)
//!                ◄── PlanAssignment / StepCommitted / Shutdown
//! ```
//!
//! - [`protocol`]: the [`protocol::Message`] enum and its frames (layout drawn there).
//! - [`auth`]: the shared token and the challenge-response.
//! - [`master`]: accepts and authenticates peers, assigns node ids, tracks leases, serves status,
//!   reports joins and losses as [`master::MasterEvent`]s.
//!   Its connection tasks (handshake, lease-bounded reader, heartbeating writer) live in the
//!   private `conn` module.
//! - [`agent`]: registers with the master and heartbeats; [`agent::request_status`] and
//!   [`agent::request_kill`] are the tool side.
//!
//! Failure behaviour is written down in `README.md` beside this file.

pub mod agent;
pub mod auth;
mod conn;
pub mod error;
pub mod master;
pub mod protocol;

pub use agent::Agent;
pub use auth::Token;
pub use error::{ElasticError, ElasticResult};
pub use master::{Master, MasterConfig, MasterEvent};
pub use protocol::Message;
