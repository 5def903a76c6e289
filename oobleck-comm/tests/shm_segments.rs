//! Shared-memory segments left behind by killed processes, and who gets shared memory at all.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Command;
use std::thread;
use std::time::Duration;

use oobleck_comm::{Communicator, ShmFaults, TcpCommunicator, TcpConfig, TensorBuf};

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
    let value = |r: usize, i: usize| ((i * 7919 + r * 104729) % 1000) as f32 * 0.001 + 0.1;
    thread::scope(|s| {
        let hs: Vec<_> = members
            .iter()
            .map(|&r| {
                let c = &comms[r];
                s.spawn(move || {
                    let v: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
                    let mut t = TensorBuf::from_f32(vec![n], &v).unwrap();
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
