//! The conformance suite on the in-process backend, plus its injected faults.

mod common;

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::{on_ranks, Cluster, Comm, Factory, T};
use oobleck_comm::{CommError, DType, LocalNetwork, TensorBuf, Tuning};

struct Local;

impl Factory for Local {
    fn cluster(&self, world: usize, tuning: Tuning) -> Cluster {
        let net = LocalNetwork::new(world, 1);
        let comms = net
            .communicators(tuning)
            .into_iter()
            .map(|c| Arc::new(c) as Comm)
            .collect();
        Cluster {
            comms,
            kill: Box::new(move |r| net.drop_rank(r)),
            alloc: false,
        }
    }
}

conformance_suite!(Local);

fn network(world: usize) -> (LocalNetwork, Cluster) {
    let net = LocalNetwork::new(world, 3);
    let comms = net
        .communicators(common::small_chunks())
        .into_iter()
        .map(|c| Arc::new(c) as Comm)
        .collect();
    let n2 = net.clone();
    (
        net,
        Cluster {
            comms,
            kill: Box::new(move |r| n2.drop_rank(r)),
            alloc: false,
        },
    )
}

#[test]
fn cut_link_fails_ops_across_it_and_spares_the_rest() {
    let (net, c) = network(4);
    net.cut_link(0, 1);
    let out = on_ranks(&c, &[0, 1], |r, comm| {
        let mut t = TensorBuf::zeros(DType::F32, vec![10]).unwrap();
        comm.all_reduce(&[0, 1], &mut t, T).map(|_| r)
    });
    for o in out {
        assert!(matches!(o, Err(CommError::PeerLost { .. })), "{o:?}");
    }
    let out = on_ranks(&c, &[2, 3], |_, comm| {
        let mut t = TensorBuf::from_f32(vec![2], &[1.0, 2.0]).unwrap();
        comm.all_reduce(&[2, 3], &mut t, T).map(|_| t)
    });
    for o in out {
        assert_eq!(o.unwrap().to_f32_vec().unwrap(), vec![2.0, 4.0]);
    }
}

#[test]
fn delayed_link_slows_but_completes() {
    let (net, c) = network(2);
    net.set_delay(1, 0, Duration::from_millis(150));
    let start = Instant::now();
    let out = on_ranks(&c, &[0, 1], |_, comm| {
        let mut t = TensorBuf::from_f32(vec![3000], &[1.0; 3000]).unwrap();
        comm.all_reduce(&[0, 1], &mut t, T).map(|_| t)
    });
    for o in out {
        assert_eq!(o.unwrap().to_f32_vec().unwrap(), vec![2.0; 3000]);
    }
    assert!(start.elapsed() >= Duration::from_millis(150));
}

#[test]
fn stalled_rank_times_out_its_peers_and_resume_delivers_later_traffic() {
    let (net, c) = network(3);
    net.stall(2);
    let timeout = Duration::from_millis(300);
    let start = Instant::now();
    let out = on_ranks(&c, &[0, 1, 2], move |r, comm| {
        let mut t = TensorBuf::from_f32(vec![8], &[r as f32; 8]).unwrap();
        comm.all_reduce(&[0, 1, 2], &mut t, timeout)
    });
    assert!(start.elapsed() < timeout + Duration::from_secs(3));
    assert!(out.iter().all(|o| o.is_err()), "{out:?}");
    assert!(
        out.iter()
            .any(|o| matches!(o, Err(CommError::Timeout { .. }))),
        "{out:?}"
    );
    net.resume(2);

    // Stall then resume before the deadline: the operation completes.
    let (net, c) = network(2);
    net.stall(1);
    let resumer = {
        let net = net.clone();
        thread::spawn(move || {
            thread::sleep(Duration::from_millis(100));
            net.resume(1);
        })
    };
    let out = on_ranks(&c, &[0, 1], |_, comm| {
        let mut t = TensorBuf::from_i64(vec![1], &[5]).unwrap();
        comm.all_reduce(&[0, 1], &mut t, T).map(|_| t)
    });
    resumer.join().unwrap();
    for o in out {
        assert_eq!(o.unwrap().to_i64_vec().unwrap(), vec![10]);
    }
}

#[test]
fn dropped_rank_sees_aborted_and_others_peer_lost() {
    let (net, c) = network(2);
    net.drop_rank(1);
    let t = TensorBuf::zeros(DType::F32, vec![1]).unwrap();
    assert!(matches!(
        c.comms[1].send(0, 0, &t, T),
        Err(CommError::Aborted { .. })
    ));
    assert!(matches!(
        c.comms[0].recv(1, 0, T),
        Err(CommError::PeerLost { rank: 1, .. })
    ));
    assert!(
        c.comms[0].is_aborted(),
        "a failed op poisons the survivor's communicator"
    );
}
