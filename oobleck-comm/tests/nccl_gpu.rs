//! One NCCL rank's whole life on a real GPU (feature `nccl`; `scripts/device-check.sh` runs it
//! with `--ignored`): init, all-reduce, abort, and a fresh communicator after the abort, as a
//! reconfiguration does with each generation.
#![cfg(feature = "nccl")]

use std::time::Duration;

use oobleck_comm::{Communicator, NcclCommunicator, NcclId, TensorBuf};

#[test]
#[ignore = "needs an NVIDIA GPU and NCCL: scripts/device-check.sh runs it"]
fn one_rank_inits_reduces_aborts_and_comes_back() {
    let timeout = Duration::from_secs(60);
    let values = [1.0f32, -2.0, 3.5, 0.25];
    for generation in 0..2 {
        let id = NcclId::new().expect("an NCCL unique id");
        let comm = NcclCommunicator::new(0, 1, generation, 0, &id, &[vec![0]], timeout)
            .expect("a one-rank clique on GPU 0");
        assert_eq!((comm.rank(), comm.world_size()), (0, 1));
        let mut buf = TensorBuf::from_f32(vec![values.len()], &values).unwrap();
        comm.all_reduce(&[0], &mut buf, timeout)
            .expect("all-reduce");
        assert_eq!(buf.to_f32_vec().unwrap(), values);
        comm.abort();
        assert!(comm.is_aborted());
        let after = comm.all_reduce(&[0], &mut buf, timeout);
        assert!(after.is_err(), "an aborted communicator refuses work");
        println!("nccl generation {generation}: init, all-reduce, abort ok");
    }
}
