//! The [`Communicator`] trait: what every backend offers.

use std::time::Duration;

use crate::error::{CommError, Result};
use crate::tensor::{DType, TensorBuf};

/// A process's index in one generation of the group (0-based, dense).
pub type Rank = usize;

/// A communicator for one generation of a fixed group of ranks.
///
/// # Operations
/// * `send`/`recv`: point to point, matched by `(peer, tag)` in FIFO order per pair and tag.
/// * `all_reduce` (sum), `broadcast`, `barrier`: over any subgroup (a set of ranks that
///   includes the caller, in any order; duplicates are an error). Every member must call the
///   same operation with the same group, the same byte length and the same root, and the
///   members must issue the operations on one group in the same order. Operations on
///   *different* groups may run concurrently from different threads. The result of
///   `all_reduce` is bit-identical on every member.
///
/// # Thread-safety
/// `Send + Sync`: any method may be called from any thread, concurrently. `abort` in
/// particular is meant to be called from another thread (a failure detector, the control
/// plane) while operations are blocked.
///
/// # Failure contract
/// * Every operation has a timeout and returns within it (plus scheduling noise), whatever
///   the peers do: [`CommError::Timeout`] when a peer is stalled (e.g. SIGSTOP),
///   [`CommError::PeerLost`] as soon as a peer's connection closes (SIGKILL, mid-frame close,
///   bad frame), [`CommError::StaleGeneration`] when a peer of another generation speaks.
/// * Any error other than [`CommError::Invalid`] (caller mistakes, checked before anything
///   is sent) **poisons** the communicator: it aborts itself and closes its connections, so
///   the failure reaches the peers at once instead of after their own timeouts. Every later
///   operation fails with [`CommError::Aborted`]. Recovery is a new communicator for the
///   next generation, never a retry on this one.
/// * `abort` unblocks every pending operation at once (they return `Aborted`) and is
///   idempotent.
/// * Data already received from a peer before it died is still delivered; an operation
///   fails only if it needs something the dead peer never sent.
pub trait Communicator: Send + Sync {
    fn rank(&self) -> Rank;
    fn world_size(&self) -> usize;
    fn generation(&self) -> u64;

    /// Sends `tensor` (dtype, shape and bytes) to `dst`. May return before `dst` received it.
    fn send(&self, dst: Rank, tag: u64, tensor: &TensorBuf, timeout: Duration) -> Result<()>;

    /// Receives the next tensor that `src` sent with `tag`.
    fn recv(&self, src: Rank, tag: u64, timeout: Duration) -> Result<TensorBuf>;

    /// Receives the next tensor that `src` sent with `tag` into `dst`, reusing its
    /// allocation (no fresh pages per message for large tensors received repeatedly). The
    /// message must have `dst`'s dtype and byte length; `dst` takes the sender's shape.
    fn recv_into(&self, src: Rank, tag: u64, dst: &mut TensorBuf, timeout: Duration) -> Result<()> {
        let t = self.recv(src, tag, timeout)?;
        if t.dtype() != dst.dtype() || t.as_bytes().len() != dst.as_bytes().len() {
            // The whole message was consumed, so the communicator stays consistent.
            return Err(CommError::Invalid(format!(
                "recv_into a {:?} buffer of {} bytes, got {:?} of {} bytes",
                dst.dtype(),
                dst.as_bytes().len(),
                t.dtype(),
                t.as_bytes().len()
            )));
        }
        *dst = t;
        Ok(())
    }

    /// A zero-filled tensor in the memory this communicator all-reduces fastest. On a rank
    /// whose peers share its host that is a shared-memory segment: an `all_reduce` in which
    /// every member passes such a tensor reads and writes the members' tensors in place
    /// instead of copying them through scratch and back (on the 2-core test machine about
    /// twice the bus bandwidth). Elsewhere, and for tensors of at most a few tens of KiB
    /// (which take the one-round exchange anyway), it is ordinary heap memory. Use it for
    /// tensors that are all-reduced again and again (gradient buckets); dropping one returns
    /// its memory to the communicator for the next `alloc` of that size. A clone is on the
    /// heap. After a failed `all_reduce` the contents are undefined (a stalled member may
    /// still write its slice): drop the tensor with the communicator.
    fn alloc(&self, dtype: DType, shape: Vec<usize>) -> Result<TensorBuf> {
        TensorBuf::zeros(dtype, shape)
    }

    /// Sums `tensor` elementwise over `group`, in place.
    fn all_reduce(&self, group: &[Rank], tensor: &mut TensorBuf, timeout: Duration) -> Result<()>;

    /// Copies `root`'s tensor into every member's `tensor` (same dtype and byte length).
    fn broadcast(
        &self,
        group: &[Rank],
        root: Rank,
        tensor: &mut TensorBuf,
        timeout: Duration,
    ) -> Result<()>;

    /// Returns once every member of `group` has entered the barrier.
    fn barrier(&self, group: &[Rank], timeout: Duration) -> Result<()>;

    /// Fails every pending and future operation with `Aborted` and closes the connections.
    fn abort(&self);

    /// True once aborted (explicitly or by poisoning).
    fn is_aborted(&self) -> bool;
}

/// Validates a group for a communicator of `world` ranks and returns it sorted.
pub(crate) fn normalize_group(group: &[Rank], me: Rank, world: usize) -> Result<Vec<Rank>> {
    let mut g = group.to_vec();
    g.sort_unstable();
    if let Some(w) = g.windows(2).find(|w| w[0] == w[1]) {
        return Err(CommError::Invalid(format!(
            "rank {} appears twice in group {group:?}",
            w[0]
        )));
    }
    if let Some(&r) = g.iter().find(|&&r| r >= world) {
        return Err(CommError::Invalid(format!(
            "rank {r} in group {group:?} is outside the world of {world}"
        )));
    }
    if g.binary_search(&me).is_err() {
        return Err(CommError::Invalid(format!(
            "rank {me} called a collective on group {group:?} it is not a member of"
        )));
    }
    Ok(g)
}

/// A stable 63-bit id of a sorted group (FNV-1a), the same on every rank.
pub(crate) fn group_id(sorted: &[Rank]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &r in sorted {
        for b in (r as u64).to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h & !(1 << 63)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_sorted_and_checked() {
        assert_eq!(normalize_group(&[3, 0, 1], 1, 4).unwrap(), vec![0, 1, 3]);
        assert!(normalize_group(&[0, 0], 0, 4).is_err());
        assert!(normalize_group(&[0, 4], 0, 4).is_err());
        assert!(normalize_group(&[0, 2], 1, 4).is_err());
    }

    #[test]
    fn group_ids_depend_on_members_only() {
        assert_eq!(group_id(&[0, 1, 3]), group_id(&[0, 1, 3]));
        assert_ne!(group_id(&[0, 1, 3]), group_id(&[0, 1, 2]));
        assert_eq!(group_id(&[5]) >> 63, 0);
    }
}
