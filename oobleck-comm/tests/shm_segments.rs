//! Shared-memory segments left behind by killed processes, and who gets shared memory at all.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Command;
use std::thread;
use std::time::Duration;

use oobleck_comm::{Communicator, DType, ShmFaults, TcpCommunicator, TcpConfig, TensorBuf};

const T: Duration = Duration::from_secs(20);

/// Connects two ranks on loopback with `shm[r]` as rank r's `shared_memory`.
fn pair(generation: u64, shm: [bool; 2]) -> Vec<TcpCommunicator> {
    group(generation, &shm, vec![ShmFaults::default(); 2])
}

/// Connects `shm.len()` ranks on loopback; rank r with `shm[r]` and `faults[r]`.
fn group(generation: u64, shm: &[bool], faults: Vec<ShmFaults>) -> Vec<TcpCommunicator> {
    let ls: Vec<TcpListener> = (0..shm.len())
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<_> = ls.iter().map(|l| l.local_addr().unwrap()).collect();
    let hs: Vec<_> = ls
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let mut cfg = TcpConfig::new(rank, generation, addrs.clone());
            cfg.connect_timeout = Duration::from_secs(10);
            cfg.shared_memory = shm[rank];
            cfg.shm_faults = faults[rank].clone();
            thread::spawn(move || TcpCommunicator::connect(cfg, Some(l)))
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
}

/// A p2p message and an all-reduce large enough for the shared scratch path work.
fn exchange(comms: &[TcpCommunicator]) {
    let n = 300_000;
    thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| {
                s.spawn(move || {
                    let t = TensorBuf::from_f32(vec![n], &vec![r as f32 + 1.0; n]).unwrap();
                    if r == 0 {
                        c.send(1, 3, &t, T).unwrap();
                    } else {
                        assert_eq!(c.recv(0, 3, T).unwrap().to_f32_vec().unwrap()[n - 1], 1.0);
                    }
                    let mut t = t;
                    c.all_reduce(&[0, 1], &mut t, T).unwrap();
                    assert!(t.to_f32_vec().unwrap().iter().all(|&x| x == 3.0));
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    });
}

/// All-reduces `n` inexact f32s (sums depend on the order) over `members`; returns every
/// member's result bytes after checking them against the sum in f64.
fn reduce(comms: &[TcpCommunicator], members: &[usize], n: usize) -> Vec<Vec<u8>> {
    reduce_with(comms, members, n, |_| false)
}

/// As [`reduce`], rank r's tensor from `alloc` when `alloc(r)`, else on the heap.
fn reduce_with(
    comms: &[TcpCommunicator],
    members: &[usize],
    n: usize,
    alloc: impl Fn(usize) -> bool + Sync,
) -> Vec<Vec<u8>> {
    let value = |r: usize, i: usize| ((i * 7919 + r * 104729) % 1000) as f32 * 0.001 + 0.1;
    let alloc = &alloc;
    thread::scope(|s| {
        let hs: Vec<_> = members
            .iter()
            .map(|&r| {
                let c = &comms[r];
                s.spawn(move || {
                    let v: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
                    let mut t = if alloc(r) {
                        let mut t = c.alloc(DType::F32, vec![n]).unwrap();
                        assert!(t.is_shared(), "rank {r}: alloc on a host with peers shares");
                        assert!(t.as_bytes().iter().all(|&b| b == 0), "alloc zero-fills");
                        t.as_bytes_mut().copy_from_slice(bytemuck::cast_slice(&v));
                        t
                    } else {
                        TensorBuf::from_f32(vec![n], &v).unwrap()
                    };
                    c.all_reduce(members, &mut t, T).unwrap();
                    t
                })
            })
            .collect();
        let out: Vec<TensorBuf> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        let got = out[0].to_f32_vec().unwrap();
        for (i, &x) in got.iter().enumerate() {
            let want: f64 = members.iter().map(|&r| value(r, i) as f64).sum();
            assert!((x as f64 - want).abs() < 1e-4, "element {i}: {x} vs {want}");
        }
        out.iter().map(|t| t.as_bytes().to_vec()).collect()
    })
}

fn assert_identical(results: &[Vec<u8>]) {
    assert!(
        results.iter().all(|r| r == &results[0]),
        "members disagree bit for bit"
    );
}

/// Names in /dev/shm of this process and `generation`.
fn segments_of(generation: u64) -> Vec<String> {
    let mine = format!("oobleck-{}-g{generation}-", std::process::id());
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(&mine))
        .collect()
}

#[test]
fn a_group_with_one_pair_on_tcp_all_reduces_over_the_ring_on_every_rank() {
    // Rank 0 cannot create the segment for its pair with rank 2 (as on a full /dev/shm):
    // 0-1 and 1-2 share memory, 0-2 talks TCP.
    let mut faults = vec![ShmFaults::default(); 3];
    faults[0].pair_with = vec![2];
    let comms = group(14, &[true; 3], faults);
    assert_eq!(comms[0].shared_memory_peers(), vec![1]);
    assert_eq!(comms[1].shared_memory_peers(), vec![0, 2]);
    assert_eq!(comms[2].shared_memory_peers(), vec![1]);
    for _ in 0..2 {
        assert_identical(&reduce(&comms, &[0, 1, 2], 300_000));
    }
    assert!(comms.iter().all(|c| c.shared_memory_all_reduces() == 0));
    // A sub-group whose pairs all share memory still uses the scratch.
    assert_identical(&reduce(&comms, &[1, 2], 300_000));
    assert_eq!(comms[1].shared_memory_all_reduces(), 1);
    assert_eq!(comms[2].shared_memory_all_reduces(), 1);
    assert!(segments_of(14).is_empty());
}

#[test]
fn a_scratch_that_will_not_map_sends_the_group_to_the_ring_for_good() {
    let mut faults = vec![ShmFaults::default(); 3];
    faults[2].map_scratch = true;
    let comms = group(15, &[true; 3], faults);
    assert!(comms.iter().all(|c| c.shared_memory_peers().len() == 2));
    for _ in 0..3 {
        assert_identical(&reduce(&comms, &[0, 1, 2], 300_000));
    }
    assert!(comms.iter().all(|c| c.shared_memory_all_reduces() == 0));
    // The scratch files were unlinked once every member had tried them.
    assert!(segments_of(15).is_empty(), "{:?}", segments_of(15));
    // Without rank 2 the scratch path works.
    assert_identical(&reduce(&comms, &[0, 1], 300_000));
    assert_eq!(comms[0].shared_memory_all_reduces(), 1);
}

#[test]
fn tensors_from_alloc_all_reduce_in_place_and_come_back_from_the_pool() {
    let comms = group(31, &[true; 3], vec![ShmFaults::default(); 3]);
    // Not a multiple of 3 elements, nor of the in-place pass.
    let n = 300_001;
    assert_identical(&reduce(&comms, &[0, 1, 2], n));
    let in_place = reduce_with(&comms, &[0, 1, 2], n, |_| true);
    assert_identical(&in_place);
    assert_eq!(
        reduce_with(&comms, &[0, 1, 2], n, |_| true),
        in_place,
        "the same bits from run to run"
    );
    for c in &comms {
        assert_eq!(c.shared_memory_all_reduces(), 3);
        assert_eq!(c.in_place_all_reduces(), 2);
    }
    // The next step's tensors come back from the pools under the same names: no new files,
    // and the members' mappings are reused.
    let files = segments_of(31).len();
    assert_identical(&reduce_with(&comms, &[0, 1, 2], n, |_| true));
    assert_eq!(segments_of(31).len(), files);
    // A subgroup, and a tensor of another size.
    assert_identical(&reduce_with(&comms, &[0, 2], 70_000, |_| true));
    assert_eq!(comms[0].in_place_all_reduces(), 4);
    assert_eq!(comms[1].in_place_all_reduces(), 3);
    drop(comms);
    assert!(
        segments_of(31).is_empty(),
        "dropping the communicators unlinks their tensors' files: {:?}",
        segments_of(31)
    );
}

#[test]
fn in_place_sums_are_exact_in_every_dtype() {
    let comms = group(35, &[true; 3], vec![ShmFaults::default(); 3]);
    let n = 100_003;
    // Small integers: exact in every dtype, so the expected sum is exact too.
    let value = |r: usize, i: usize| ((i % 61) + 5 * r) as f32;
    let bytes_of = |dtype: DType, v: &[f32]| -> Vec<u8> {
        match dtype {
            DType::F32 => TensorBuf::from_f32(vec![n], v),
            DType::BF16 => TensorBuf::from_bf16(
                vec![n],
                &v.iter()
                    .map(|&x| half::bf16::from_f32(x))
                    .collect::<Vec<_>>(),
            ),
            DType::F16 => TensorBuf::from_f16(
                vec![n],
                &v.iter()
                    .map(|&x| half::f16::from_f32(x))
                    .collect::<Vec<_>>(),
            ),
            DType::I64 => {
                TensorBuf::from_i64(vec![n], &v.iter().map(|&x| x as i64).collect::<Vec<_>>())
            }
        }
        .unwrap()
        .into_bytes()
    };
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::I64] {
        let out: Vec<Vec<u8>> = thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .enumerate()
                .map(|(r, c)| {
                    s.spawn(move || {
                        let v: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
                        let mut t = c.alloc(dtype, vec![n]).unwrap();
                        t.as_bytes_mut().copy_from_slice(&bytes_of(dtype, &v));
                        c.all_reduce(&[0, 1, 2], &mut t, T).unwrap();
                        t.into_bytes()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let want: Vec<f32> = (0..n).map(|i| (0..3).map(|r| value(r, i)).sum()).collect();
        assert_identical(&out);
        assert_eq!(out[0], bytes_of(dtype, &want), "{dtype:?}");
    }
    assert_eq!(comms[0].in_place_all_reduces(), 4);
}

#[test]
fn an_op_where_a_member_has_no_shared_tensor_or_cannot_map_one_goes_through_scratch() {
    let mut faults = vec![ShmFaults::default(); 3];
    faults[1].map_tensor = true;
    let comms = group(32, &[true; 3], faults);
    let n = 200_003;
    let mixed = reduce_with(&comms, &[0, 1, 2], n, |r| r != 2);
    assert_identical(&mixed);
    let unmapped = reduce_with(&comms, &[0, 1, 2], n, |_| true);
    assert_eq!(unmapped, mixed);
    for c in &comms {
        assert_eq!(c.shared_memory_all_reduces(), 2);
        assert_eq!(c.in_place_all_reduces(), 0);
    }
    // Without rank 1 (whose mapping fails) the same tensors go in place.
    reduce_with(&comms, &[0, 2], n, |_| true);
    assert_eq!(comms[0].in_place_all_reduces(), 1);
}

#[test]
fn alloc_shares_only_what_the_shared_all_reduce_would_take() {
    let on_tcp = pair(33, [false, false]);
    assert!(!on_tcp[0]
        .alloc(DType::F32, vec![1 << 20])
        .unwrap()
        .is_shared());
    let comms = pair(34, [true, true]);
    let small = comms[0].alloc(DType::BF16, vec![4, 8]).unwrap();
    assert!(
        !small.is_shared(),
        "a one-round all-reduce has nothing to gain"
    );
    assert_eq!(small, TensorBuf::zeros(DType::BF16, vec![4, 8]).unwrap());
    let big = comms[0].alloc(DType::I64, vec![3, 100_000]).unwrap();
    assert!(big.is_shared());
    assert_eq!(big.shape(), &[3, 100_000]);
    assert_eq!(big.to_i64_vec().unwrap(), vec![0; 300_000]);
    let copy = big.clone();
    assert!(!copy.is_shared(), "a clone lives on the heap");
    assert_eq!(copy, big);
    assert!(comms[0].alloc(DType::F32, vec![usize::MAX, 2]).is_err());
    comms[0].abort();
    assert!(!comms[0]
        .alloc(DType::F32, vec![1 << 20])
        .unwrap()
        .is_shared());
}

/// A pid that no process has now: a child that already exited and was reaped.
fn dead_pid() -> u32 {
    let mut c = Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    pid
}

/// A file that looks like a real pair segment of generation `generation` (right magic and
/// ranks), its rings full of garbage: what a SIGKILLed creator leaves if it dies before
/// the unlink.
fn plant(pid: u32, generation: u64, nonce: &str) -> PathBuf {
    let path = PathBuf::from(format!(
        "/dev/shm/oobleck-{pid}-g{generation}-pair-0-1-{nonce}"
    ));
    let mut bytes = vec![0xabu8; 3 << 20];
    bytes[0..8].copy_from_slice(b"OBKSHMP1");
    bytes[8..16].copy_from_slice(&generation.to_le_bytes());
    bytes[16..24].copy_from_slice(&(1u64 << 32).to_le_bytes());
    bytes[24..32].copy_from_slice(&(1u64 << 20).to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn a_dead_processs_segment_is_removed_and_never_joined() {
    let dead = plant(dead_pid(), 11, "00112233445566778899aabbccddeeff");
    // A live process's segment (ours, under a name no communicator of ours would pick) stays.
    let live = plant(std::process::id(), 11, "ffeeddccbbaa99887766554433221100");
    let comms = pair(11, [true, true]);
    assert_eq!(comms[0].shared_memory_peers(), vec![1]);
    assert_eq!(comms[1].shared_memory_peers(), vec![0]);
    exchange(&comms);
    assert!(
        !dead.exists(),
        "the segment of a dead pid is removed when rank 0 creates its own"
    );
    assert!(live.exists(), "the segment of a live pid is left alone");
    std::fs::remove_file(&live).unwrap();
}

#[test]
fn a_rank_with_shared_memory_off_keeps_its_pairs_on_tcp() {
    for shm in [[true, false], [false, true]] {
        let comms = pair(12, shm);
        assert!(
            comms.iter().all(|c| c.shared_memory_peers().is_empty()),
            "{shm:?}"
        );
        exchange(&comms);
    }
}

#[test]
fn no_segment_outlives_the_setup_of_a_healthy_group() {
    let comms = pair(13, [true, true]);
    exchange(&comms);
    let mine = format!("oobleck-{}-g13-", std::process::id());
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(&mine))
        .collect();
    assert!(left.is_empty(), "still linked: {left:?}");
}

/// A tensor of several messages (8 MiB each by default) with a recognisable pattern.
fn big(n: usize, salt: u32) -> TensorBuf {
    let v: Vec<f32> = (0..n as u32).map(|i| (i ^ salt) as f32).collect();
    TensorBuf::from_f32(vec![n], &v).unwrap()
}

#[test]
fn p2p_over_shared_memory_arrives_whole_whether_or_not_the_receiver_waits_first() {
    let comms = pair(16, [true, true]);
    let n = (20 << 20) / 4 + 5; // three messages, the last one short
    thread::scope(|s| {
        // The receiver waits first (its buffers are posted before the data comes) ...
        let rx = s.spawn(|| {
            let mut into = TensorBuf::zeros(oobleck_comm::DType::F32, vec![n]).unwrap();
            comms[1].recv_into(0, 1, &mut into, T).unwrap();
            into
        });
        thread::sleep(Duration::from_millis(100));
        comms[0].send(1, 1, &big(n, 7), T).unwrap();
        assert!(rx.join().unwrap() == big(n, 7));
    });
    // ... or the whole message is sent (queued in the mailbox) before anyone receives.
    comms[0].send(1, 2, &big(n, 9), T).unwrap();
    let mut into = TensorBuf::zeros(oobleck_comm::DType::F32, vec![n]).unwrap();
    comms[1].recv_into(0, 2, &mut into, T).unwrap();
    assert!(into == big(n, 9));
    // And into a fresh tensor (several messages gathered into one buffer).
    comms[0].send(1, 3, &big(n, 5), T).unwrap();
    assert!(comms[1].recv(0, 3, T).unwrap() == big(n, 5));
}

#[test]
fn a_sender_that_dies_mid_message_fails_a_waiting_receiver_without_hanging() {
    let comms = pair(17, [true, true]);
    let n = (64 << 20) / 4;
    thread::scope(|s| {
        let rx = s.spawn(|| {
            let mut into = TensorBuf::zeros(oobleck_comm::DType::F32, vec![n]).unwrap();
            comms[1].recv_into(0, 1, &mut into, T).map(|()| into)
        });
        let tx = s.spawn(|| comms[0].send(1, 1, &big(n, 3), T));
        thread::sleep(Duration::from_millis(30));
        comms[0].abort();
        let _ = tx.join().unwrap();
        match rx.join().unwrap() {
            Ok(t) => assert!(t == big(n, 3), "a whole message must be right"),
            Err(e) => assert!(
                matches!(e, oobleck_comm::CommError::PeerLost { rank: 0, .. }),
                "{e}"
            ),
        }
    });
}
