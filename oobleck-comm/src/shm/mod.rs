//! Shared memory between ranks of one host: the pieces the TCP backend uses when two ranks
//! find they share a host (`src/tcp/local.rs` decides that and sets the pairs up).
//!
//! ```text
//!   segment.rs    /dev/shm files: named with pid, generation and a nonce, unlinked once mapped,
//!                 leftovers of dead pids removed; futex wait/wake
//!   ring.rs       one SPSC byte ring per direction of a pair: p2p and control messages,
//!                 streamed, delivered into the Mailbox by a reader thread per link (or
//!                 straight into a receiver's posted buffer when it is already waiting)
//!   allreduce.rs  all-reduce of a group on one host: in place on every member's shared
//!                 tensor when all have one, else copy in, reduce a slice from every
//!                 member's scratch, copy out
//!   in_place.rs   the in-place path: mapping the members' tensors, summing a slice of all
//!   buffer.rs     tensors in shared memory (`Communicator::alloc`), pooled per communicator
//! ```
//!
//! Failure detection stays on the TCP connection of each pair: its EOF stops the link (after
//! delivering every complete message already in the ring) and fails the peer.

mod allreduce;
mod buffer;
mod in_place;
mod ring;
mod segment;

pub(crate) use allreduce::{Scratch, Wire};
pub(crate) use buffer::{Pool, SharedBytes};
pub(crate) use ring::{read_loop, Link, Ring, RingWriter, RING_HEADER};
pub use segment::remove_segments_of_exited_processes;
pub(crate) use segment::{host_identity, remove_stale, Segment, SHM_DIR};
