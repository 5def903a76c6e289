//! Communicators for Oobleck-rs: the data plane that moves tensors between workers.
//!
//! ```text
//!            Communicator (trait: send/recv, all_reduce, broadcast, barrier, abort)
//!                 │
//!     ┌───────────┼──────────────────────┬──────────────────────────┐
//!  TcpCommunicator  LocalCommunicator        NcclCommunicator (feature `nccl`,
//!  (CPU, any host;  (threads, faults)         otherwise a NotCompiled stub)
//!   shared memory
//!   with ranks on
//!   the same host)
//!     │                │
//!     └── Engine: ring / direct all-reduce, chain broadcast, barrier (engine.rs)
//!            over a Transport (one message to one peer) + a Mailbox (messages by key)
//! ```
//!
//! Tensors are [`TensorBuf`]: little-endian bytes + [`DType`] + shape; this crate knows
//! nothing of models. A communicator serves one *generation* of a fixed group of ranks;
//! reconfiguration builds a new one. See [`Communicator`] for the thread-safety and failure
//! contract, `README.md` for the summary, and [`frame`] for the wire format.

pub mod blob;
mod comm;
mod engine;
mod error;
pub mod frame;
mod key;
mod local;
mod mailbox;
#[cfg(feature = "nccl")]
mod nccl;
#[cfg(not(feature = "nccl"))]
#[path = "nccl_stub.rs"]
mod nccl;
pub mod refusals;
mod shm;
mod tcp;
mod tensor;

pub use blob::{fetch_blob, fetch_dir, list_blobs, send_blob, BlobReceipt, BlobSink};
pub use comm::{Communicator, Rank};
pub use engine::Tuning;
pub use error::{CommError, FrameError, Op, Result};
pub use key::{nonce, SecretKey, KEY_BYTES};
pub use local::{LocalCommunicator, LocalNetwork};
pub use nccl::{probe as probe_nccl, NcclCommunicator, NcclId};
pub use shm::remove_segments_of_exited_processes;
#[doc(hidden)]
pub use tcp::ShmFaults;
pub use tcp::{TcpCommunicator, TcpConfig};
pub use tensor::{DType, TensorBuf};
