//! Stand-in for the NCCL backend when the crate is built without feature `nccl`: the same
//! public names, and every entry point returns [`CommError::NotCompiled`].

use std::time::Duration;

use crate::comm::{Communicator, Rank};
use crate::error::{CommError, Result};
use crate::tensor::TensorBuf;

fn not_compiled() -> CommError {
    CommError::NotCompiled {
        backend: "nccl",
        feature: "nccl",
    }
}

/// Checks that the CUDA driver and NCCL can be loaded. Always `NotCompiled` here.
pub fn probe() -> Result<()> {
    Err(not_compiled())
}

/// The unique id of an NCCL clique (128 bytes), made by one rank and distributed by the
/// caller's control plane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclId(pub [u8; 128]);

impl NcclId {
    pub fn new() -> Result<Self> {
        Err(not_compiled())
    }
}

enum Never {}

/// An NCCL communicator. Cannot be constructed without feature `nccl`.
pub struct NcclCommunicator {
    never: Never,
}

impl NcclCommunicator {
    pub fn new(
        _rank: Rank,
        _world: usize,
        _generation: u64,
        _device: usize,
        _id: &NcclId,
        _groups: &[Vec<Rank>],
        _timeout: Duration,
    ) -> Result<Self> {
        Err(not_compiled())
    }
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> Rank {
        match self.never {}
    }
    fn world_size(&self) -> usize {
        match self.never {}
    }
    fn generation(&self) -> u64 {
        match self.never {}
    }
    fn send(&self, _: Rank, _: u64, _: &TensorBuf, _: Duration) -> Result<()> {
        match self.never {}
    }
    fn recv(&self, _: Rank, _: u64, _: Duration) -> Result<TensorBuf> {
        match self.never {}
    }
    fn all_reduce(&self, _: &[Rank], _: &mut TensorBuf, _: Duration) -> Result<()> {
        match self.never {}
    }
    fn broadcast(&self, _: &[Rank], _: Rank, _: &mut TensorBuf, _: Duration) -> Result<()> {
        match self.never {}
    }
    fn barrier(&self, _: &[Rank], _: Duration) -> Result<()> {
        match self.never {}
    }
    fn abort(&self) {
        match self.never {}
    }
    fn is_aborted(&self) -> bool {
        match self.never {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_point_says_not_compiled() {
        assert!(matches!(probe(), Err(CommError::NotCompiled { .. })));
        assert!(matches!(NcclId::new(), Err(CommError::NotCompiled { .. })));
        let id = NcclId([0; 128]);
        let r = NcclCommunicator::new(0, 1, 0, 0, &id, &[], Duration::from_secs(1));
        assert!(matches!(
            r,
            Err(CommError::NotCompiled {
                feature: "nccl",
                ..
            })
        ));
    }
}
