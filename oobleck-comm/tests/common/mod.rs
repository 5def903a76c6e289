//! The conformance suite: one set of checks, run against every backend through a factory.

#![allow(dead_code)] // each test binary uses a different subset

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use oobleck_comm::{CommError, Communicator, DType, Rank, TensorBuf, Tuning};

pub type Comm = Arc<dyn Communicator>;

/// A running group: the endpoints and a way to make a rank die like a killed process.
pub struct Cluster {
    pub comms: Vec<Comm>,
    pub kill: Box<dyn Fn(Rank) + Send + Sync>,
    /// All-reduce inputs come from `Communicator::alloc` (in place in shared memory on a
    /// host), not from the heap.
    pub alloc: bool,
}

pub trait Factory: Sync {
    fn cluster(&self, world: usize, tuning: Tuning) -> Cluster;
}

pub const T: Duration = Duration::from_secs(20);

/// Small chunks so the pipelined paths get many chunks even on small tensors.
pub fn small_chunks() -> Tuning {
    Tuning {
        direct_max_bytes: 256,
        chunk_bytes: 1024,
        max_message_bytes: 4096,
    }
}

/// Runs `f(rank, comm)` on one thread per listed rank, returning the results in rank order.
pub fn on_ranks<R: Send + 'static>(
    c: &Cluster,
    ranks: &[Rank],
    f: impl Fn(Rank, Comm) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let f = Arc::new(f);
    let hs: Vec<_> = ranks
        .iter()
        .map(|&r| {
            let (f, comm) = (f.clone(), c.comms[r].clone());
            thread::spawn(move || f(r, comm))
        })
        .collect();
    hs.into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

/// Rank `r`'s contribution: small integers, exact in every dtype, so sums compare exactly.
fn contribution(dtype: DType, n: usize, r: Rank) -> TensorBuf {
    let v = |i: usize| ((i * 7 + r * 3) % 11) as i64 - 5 + r as i64;
    match dtype {
        DType::F32 => {
            TensorBuf::from_f32(vec![n], &(0..n).map(|i| v(i) as f32).collect::<Vec<_>>())
        }
        DType::I64 => TensorBuf::from_i64(vec![n], &(0..n).map(v).collect::<Vec<_>>()),
        DType::BF16 => TensorBuf::from_bf16(
            vec![n],
            &(0..n)
                .map(|i| half::bf16::from_f32(v(i) as f32))
                .collect::<Vec<_>>(),
        ),
        DType::F16 => TensorBuf::from_f16(
            vec![n],
            &(0..n)
                .map(|i| half::f16::from_f32(v(i) as f32))
                .collect::<Vec<_>>(),
        ),
    }
    .unwrap()
}

/// `t` as an all-reduce input: itself, or copied into a tensor from `comm.alloc` when `alloc`.
fn input(comm: &Comm, alloc: bool, t: TensorBuf) -> TensorBuf {
    if !alloc {
        return t;
    }
    let mut a = comm.alloc(t.dtype(), t.shape().to_vec()).unwrap();
    a.as_bytes_mut().copy_from_slice(t.as_bytes());
    a
}

fn expected_sum(dtype: DType, n: usize, group: &[Rank]) -> TensorBuf {
    let mut acc = vec![0i64; n];
    for &r in group {
        let c = contribution(DType::I64, n, r).to_i64_vec().unwrap();
        acc.iter_mut().zip(c).for_each(|(a, b)| *a += b);
    }
    match dtype {
        DType::I64 => TensorBuf::from_i64(vec![n], &acc).unwrap(),
        DType::F32 => {
            TensorBuf::from_f32(vec![n], &acc.iter().map(|&x| x as f32).collect::<Vec<_>>())
                .unwrap()
        }
        DType::BF16 => TensorBuf::from_bf16(
            vec![n],
            &acc.iter()
                .map(|&x| half::bf16::from_f32(x as f32))
                .collect::<Vec<_>>(),
        )
        .unwrap(),
        DType::F16 => TensorBuf::from_f16(
            vec![n],
            &acc.iter()
                .map(|&x| half::f16::from_f32(x as f32))
                .collect::<Vec<_>>(),
        )
        .unwrap(),
    }
}

fn check_all_reduce(c: &Cluster, group: &[Rank], dtype: DType, n: usize) {
    let (g, alloc) = (group.to_vec(), c.alloc);
    let out = on_ranks(c, group, move |r, comm| {
        let mut t = input(&comm, alloc, contribution(dtype, n, r));
        comm.all_reduce(&g, &mut t, T).map(|_| t)
    });
    let want = expected_sum(dtype, n, group);
    for (r, got) in group.iter().zip(out) {
        let got =
            got.unwrap_or_else(|e| panic!("rank {r}: all_reduce of {n} {dtype:?} failed: {e}"));
        assert!(
            got == want,
            "rank {r}: wrong all_reduce of {n} {dtype:?} over {group:?}"
        );
    }
}

pub fn p2p_round_trips_every_dtype_and_matches_tags(f: &dyn Factory) {
    let c = f.cluster(2, small_chunks());
    let out = on_ranks(&c, &[0, 1], |r, comm| {
        let tensors = [
            contribution(DType::F32, 1, 0),
            TensorBuf::zeros(DType::I64, vec![2, 0, 3]).unwrap(),
            contribution(DType::BF16, 5000, 1),
            contribution(DType::F16, 3, 2),
            contribution(DType::I64, 10_000, 3),
        ];
        if r == 0 {
            for (i, t) in tensors.iter().enumerate() {
                comm.send(1, i as u64, t, T)?;
            }
            comm.send(1, 99, &tensors[0], T)?;
            comm.send(1, 100, &tensors[4], T)?;
            Ok::<_, CommError>(vec![])
        } else {
            // Receive out of send order: tags are independent queues.
            // recv_into reuses a buffer of the right dtype and size and takes the shape.
            let mut into = TensorBuf::zeros(DType::I64, vec![2, 5000]).unwrap();
            comm.recv_into(0, 100, &mut into, T)?;
            assert_eq!(into, tensors[4]);
            let late = comm.recv(0, 99, T)?;
            let mut got: Vec<TensorBuf> = (0..tensors.len())
                .rev()
                .map(|i| comm.recv(0, i as u64, T))
                .collect::<Result<_, CommError>>()?;
            got.reverse();
            assert_eq!(late, tensors[0]);
            assert_eq!(got.as_slice(), &tensors);
            Ok(got)
        }
    });
    for o in out {
        o.unwrap();
    }
}

pub fn all_reduce_is_exact_from_one_element_to_large(f: &dyn Factory) {
    let c = f.cluster(4, small_chunks());
    let all = [0, 1, 2, 3];
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::I64] {
        for n in [1, 3, 4, 63, 64, 65, 1000, 4097] {
            check_all_reduce(&c, &all, dtype, n);
        }
    }
    let c = f.cluster(3, Tuning::default());
    for n in [1, (64 << 10) / 4 + 1, (3 << 20) / 4 + 7] {
        check_all_reduce(&c, &[0, 1, 2], DType::F32, n);
    }
}

pub fn all_reduce_of_64_mib(f: &dyn Factory) {
    let c = f.cluster(2, Tuning::default());
    check_all_reduce(&c, &[0, 1], DType::F32, (64 << 20) / 4);
}

pub fn all_reduce_over_odd_subgroups(f: &dyn Factory) {
    let c = f.cluster(5, small_chunks());
    for g in [vec![0, 2, 3], vec![4, 1], vec![4, 1, 3, 0], vec![2]] {
        check_all_reduce(&c, &g, DType::F32, 777);
        check_all_reduce(&c, &g, DType::I64, 5);
    }
}

/// Overlapping groups {0,1,2} and {1,2,3} and the disjoint {0,3}, each driven by its own
/// thread on every member, all at once.
pub fn concurrent_ops_on_different_subgroups(f: &dyn Factory) {
    let c = f.cluster(4, small_chunks());
    let groups: Vec<Vec<Rank>> = vec![vec![0, 1, 2], vec![1, 2, 3], vec![0, 3]];
    let mut hs = Vec::new();
    for g in &groups {
        for &r in g {
            let (g, comm, alloc) = (g.clone(), c.comms[r].clone(), c.alloc);
            hs.push(thread::spawn(move || {
                for round in 0..5 {
                    let n = 100 + 997 * round;
                    let mut t = input(&comm, alloc, contribution(DType::F32, n, r));
                    comm.all_reduce(&g, &mut t, T)?;
                    assert!(
                        t == expected_sum(DType::F32, n, &g),
                        "rank {r} group {g:?} round {round}"
                    );
                    let mut b = if r == g[round % g.len()] {
                        contribution(DType::I64, n, r)
                    } else {
                        TensorBuf::zeros(DType::I64, vec![n]).unwrap()
                    };
                    comm.broadcast(&g, g[round % g.len()], &mut b, T)?;
                    assert!(b == contribution(DType::I64, n, g[round % g.len()]));
                }
                Ok::<_, CommError>(())
            }));
        }
    }
    for h in hs {
        h.join().expect("thread panicked").unwrap();
    }
}

pub fn broadcast_small_and_chunked_from_any_root(f: &dyn Factory) {
    let c = f.cluster(4, small_chunks());
    for (group, root, n) in [
        (vec![0, 1, 2, 3], 2, 5),
        (vec![3, 1, 0], 1, 10_000),
        (vec![1, 3], 3, 2049),
    ] {
        let g = group.clone();
        let out = on_ranks(&c, &group, move |r, comm| {
            let mut t = if r == root {
                contribution(DType::F32, n, r)
            } else {
                TensorBuf::zeros(DType::F32, vec![n]).unwrap()
            };
            comm.broadcast(&g, root, &mut t, T).map(|_| t)
        });
        for o in out {
            assert!(o.unwrap() == contribution(DType::F32, n, root));
        }
    }
}

pub fn barrier_waits_for_every_member(f: &dyn Factory) {
    let c = f.cluster(3, Tuning::default());
    let start = Instant::now();
    let out = on_ranks(&c, &[0, 1, 2], move |r, comm| {
        if r == 2 {
            thread::sleep(Duration::from_millis(300));
        }
        comm.barrier(&[0, 1, 2], T)?;
        comm.barrier(&[0, 1, 2], T)?;
        Ok::<_, CommError>(start.elapsed())
    });
    for o in out {
        assert!(
            o.unwrap() >= Duration::from_millis(300),
            "a rank left the barrier early"
        );
    }
}

/// Caller mistakes are reported, do not poison, and nothing is sent.
pub fn invalid_arguments_are_errors_that_do_not_poison(f: &dyn Factory) {
    let c = f.cluster(3, Tuning::default());
    let comm = &c.comms[0];
    let mut t = contribution(DType::F32, 4, 0);
    assert!(matches!(
        comm.all_reduce(&[1, 2], &mut t, T),
        Err(CommError::Invalid(_))
    ));
    assert!(matches!(
        comm.all_reduce(&[0, 0, 1], &mut t, T),
        Err(CommError::Invalid(_))
    ));
    assert!(matches!(
        comm.all_reduce(&[0, 7], &mut t, T),
        Err(CommError::Invalid(_))
    ));
    assert!(matches!(
        comm.broadcast(&[0, 1], 2, &mut t, T),
        Err(CommError::Invalid(_))
    ));
    assert!(matches!(comm.send(0, 1, &t, T), Err(CommError::Invalid(_))));
    assert!(matches!(comm.send(5, 1, &t, T), Err(CommError::Invalid(_))));
    assert!(matches!(
        comm.recv(1, 1 << 63, T),
        Err(CommError::Invalid(_))
    ));
    assert!(!comm.is_aborted());
    check_all_reduce(&c, &[0, 1, 2], DType::F32, 10);
}

/// Members that disagree on the tensor size get an error, not a hang or garbage.
pub fn mismatched_sizes_fail_instead_of_hanging(f: &dyn Factory) {
    let c = f.cluster(2, small_chunks());
    let alloc = c.alloc;
    let out = on_ranks(&c, &[0, 1], move |r, comm| {
        let mut t = input(&comm, alloc, contribution(DType::F32, 100 + r, r));
        comm.all_reduce(&[0, 1], &mut t, Duration::from_secs(5))
    });
    assert!(out.iter().all(|o| o.is_err()), "{out:?}");
}

/// A rank that dies mid-operation makes every other member fail fast with `PeerLost`.
pub fn dead_peer_fails_pending_ops_with_peer_lost(f: &dyn Factory) {
    let c = f.cluster(4, small_chunks());
    let kill_at = Duration::from_millis(200);
    let start = Instant::now();
    let hs: Vec<_> = (0..3)
        .map(|r| {
            let (comm, alloc) = (c.comms[r].clone(), c.alloc);
            thread::spawn(move || {
                let mut t = input(&comm, alloc, contribution(DType::F32, 10_000, r));
                comm.all_reduce(&[0, 1, 2, 3], &mut t, T)
            })
        })
        .collect();
    thread::sleep(kill_at);
    (c.kill)(3);
    for (r, h) in hs.into_iter().enumerate() {
        let res = h.join().unwrap();
        assert!(
            matches!(res, Err(CommError::PeerLost { .. })),
            "rank {r}: {res:?}"
        );
    }
    assert!(start.elapsed() < T / 2, "took {:?}", start.elapsed());
}

/// A member that never shows up (stalled) makes the others fail within their timeout.
pub fn silent_peer_times_out_within_the_deadline(f: &dyn Factory) {
    let c = f.cluster(3, Tuning::default());
    let timeout = Duration::from_millis(400);
    let start = Instant::now();
    let alloc = c.alloc;
    let out = on_ranks(&c, &[0, 1], move |r, comm| {
        // Shared tensors only come above the one-round size: a larger one then.
        let n = if alloc { 100_000 } else { 100 };
        let mut t = input(&comm, alloc, contribution(DType::F32, n, r));
        comm.all_reduce(&[0, 1, 2], &mut t, timeout)
    });
    let took = start.elapsed();
    assert!(took < timeout + Duration::from_secs(3), "took {took:?}");
    assert!(
        out.iter()
            .any(|o| matches!(o, Err(CommError::Timeout { .. }))),
        "{out:?}"
    );
    // The one that timed out first poisons itself, so the other may see it leave instead.
    assert!(
        out.iter().all(|o| matches!(
            o,
            Err(CommError::Timeout { .. } | CommError::PeerLost { .. })
        )),
        "{out:?}"
    );
    assert!(c.comms[0].is_aborted() && c.comms[1].is_aborted());
    let mut t = contribution(DType::F32, 1, 0);
    assert!(matches!(
        c.comms[0].all_reduce(&[0, 1], &mut t, T),
        Err(CommError::Aborted { .. })
    ));
}

/// `abort` from another thread unblocks every pending operation at once.
pub fn abort_from_another_thread_unblocks_everything(f: &dyn Factory) {
    let c = f.cluster(3, Tuning::default());
    let comm = c.comms[0].clone();
    let (start, c_alloc) = (Instant::now(), c.alloc);
    let pending: Vec<_> = (0..3)
        .map(|i| {
            let comm = comm.clone();
            thread::spawn(move || match i {
                0 => comm.recv(1, 5, T).map(|_| ()),
                1 => comm.barrier(&[0, 2], T),
                _ => {
                    let mut t = input(
                        &comm,
                        c_alloc,
                        TensorBuf::zeros(DType::F32, vec![1 << 20]).unwrap(),
                    );
                    comm.all_reduce(&[0, 1, 2], &mut t, T)
                }
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(200));
    comm.abort();
    for h in pending {
        let res = h.join().unwrap();
        assert!(matches!(res, Err(CommError::Aborted { .. })), "{res:?}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "took {:?}",
        start.elapsed()
    );
    assert!(matches!(
        comm.barrier(&[0, 1], T),
        Err(CommError::Aborted { .. })
    ));
    // The peers see it leave.
    let res = c.comms[1].recv(0, 1, T);
    assert!(
        matches!(res, Err(CommError::PeerLost { rank: 0, .. })),
        "{res:?}"
    );
}

/// One `#[test]` per check of the suite for the factory expression given.
#[macro_export]
macro_rules! conformance_suite {
    ($factory:expr; $($check:ident),+ $(,)?) => {
        $(
            #[test]
            fn $check() {
                common::$check(&$factory);
            }
        )+
    };
    ($factory:expr) => {
        $crate::conformance_suite!($factory;
            p2p_round_trips_every_dtype_and_matches_tags,
            all_reduce_is_exact_from_one_element_to_large,
            all_reduce_of_64_mib,
            all_reduce_over_odd_subgroups,
            concurrent_ops_on_different_subgroups,
            broadcast_small_and_chunked_from_any_root,
            barrier_waits_for_every_member,
            invalid_arguments_are_errors_that_do_not_poison,
            mismatched_sizes_fail_instead_of_hanging,
            dead_peer_fails_pending_ops_with_peer_lost,
            silent_peer_times_out_within_the_deadline,
            abort_from_another_thread_unblocks_everything,
        );
    };
}
