//! Bad input on the TCP wire: a raw socket plays rank 1 against a real rank 0 and sends
//! garbage, stale generations and broken frames. Each is refused with a clear error; the
//! process (this test) stays alive.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use oobleck_comm::frame::{self, Header, Kind, ReadOutcome};
use oobleck_comm::{CommError, Communicator, FrameError, TcpCommunicator, TcpConfig};

const GEN: u64 = 5;

fn hello_bytes(generation: u64, from: u32, to: u32, world: u32) -> Vec<u8> {
    let h = Header {
        kind: Kind::Hello,
        generation,
        channel: 0,
        seq: 0,
        part: 0,
        len: 12,
    };
    let mut b = h.encode().to_vec();
    b.extend_from_slice(&frame::encode_hello(from, to, world));
    b
}

/// Starts rank 0 of a world of 2 and completes the handshake as rank 1 after trying a
/// garbage connection and a stale-generation one.
fn rank0_with_raw_rank1() -> (TcpCommunicator, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let mut cfg = TcpConfig::new(0, GEN, vec![addr, "127.0.0.1:9".parse().unwrap()]);
    cfg.connect_timeout = Duration::from_secs(10);
    let rank0 = thread::spawn(move || TcpCommunicator::connect(cfg, Some(l)));

    // Garbage: refused, rank 0 keeps waiting.
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\n\r\n garbage garbage garbage")
        .unwrap();
    drop(s);

    // A peer of the previous generation gets rank 0's Hello (so it can tell why) and a close.
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(&hello_bytes(GEN - 1, 1, 0, 2)).unwrap();
    match frame::read_frame(&mut s, GEN - 1, 64).unwrap() {
        ReadOutcome::Bad(FrameError::StaleGeneration { found: GEN, .. }) => {}
        other => panic!("expected rank 0 to answer with generation {GEN}, got {other:?}"),
    }
    // Then the connection ends (after the Hello's payload).
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert_eq!(rest.len(), 12);

    // The real handshake.
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(&hello_bytes(GEN, 1, 0, 2)).unwrap();
    match frame::read_frame(&mut s, GEN, 64).unwrap() {
        ReadOutcome::Frame(h, p) => {
            assert_eq!(h.kind, Kind::Hello);
            assert_eq!(frame::decode_hello(&p).unwrap(), (0, 1, 2));
        }
        other => panic!("expected a Hello, got {other:?}"),
    }
    // The shared-memory setup that follows every handshake: rank 0's offer, and ours,
    // "off", so the pair stays on TCP and the frames below reach rank 0's reader.
    match frame::read_frame(&mut s, GEN, 1024).unwrap() {
        ReadOutcome::Frame(h, p) => assert_eq!((h.kind, p.first()), (Kind::Local, Some(&1))),
        other => panic!("expected a shared-memory offer, got {other:?}"),
    }
    let offer = Header {
        kind: Kind::Local,
        generation: GEN,
        channel: 0,
        seq: 0,
        part: 0,
        len: 2,
    };
    let mut b = offer.encode().to_vec();
    b.extend_from_slice(&[1, 0]);
    s.write_all(&b).unwrap();
    let comm = rank0
        .join()
        .unwrap()
        .expect("rank 0 connects despite the bad peers");
    (comm, s)
}

/// Sends `bytes` as rank 1 and returns what rank 0's pending `recv` from rank 1 saw.
fn recv_after(bytes: &[u8], close: bool) -> (CommError, Duration) {
    let (comm, mut s) = rank0_with_raw_rank1();
    let start = Instant::now();
    let pending = thread::spawn(move || {
        let r = comm.recv(1, 0, Duration::from_secs(20));
        (r, comm)
    });
    thread::sleep(Duration::from_millis(50));
    s.write_all(bytes).unwrap();
    if close {
        drop(s);
    }
    let (r, _comm) = pending.join().unwrap();
    (
        r.expect_err("a bad frame must fail the recv"),
        start.elapsed(),
    )
}

fn data_header(generation: u64, len: u32) -> Vec<u8> {
    Header {
        kind: Kind::Data,
        generation,
        channel: 0,
        seq: 0,
        part: 0,
        len,
    }
    .encode()
    .to_vec()
}

#[test]
fn close_mid_frame_is_truncated_not_a_hang() {
    let mut b = data_header(GEN, 100);
    b.extend_from_slice(&[1; 10]);
    let (err, took) = recv_after(&b, true);
    assert!(
        matches!(
            err,
            CommError::Frame {
                peer: Some(1),
                source: FrameError::Truncated { .. }
            }
        ),
        "{err}"
    );
    assert!(took < Duration::from_secs(5));
}

#[test]
fn data_frame_of_a_past_generation_is_stale() {
    let (err, _) = recv_after(&data_header(GEN - 1, 0), false);
    assert!(
        matches!(
            err,
            CommError::StaleGeneration {
                peer: 1,
                ours: GEN,
                theirs: 4
            }
        ),
        "{err}"
    );
}

#[test]
fn oversized_wrong_magic_and_unknown_version_frames_are_refused() {
    let (err, _) = recv_after(&data_header(GEN, u32::MAX), false);
    assert!(
        matches!(
            err,
            CommError::Frame {
                source: FrameError::TooLong { .. },
                ..
            }
        ),
        "{err}"
    );
    let mut b = data_header(GEN, 0);
    b[0] = b'X';
    let (err, _) = recv_after(&b, false);
    assert!(
        matches!(
            err,
            CommError::Frame {
                source: FrameError::BadMagic { .. },
                ..
            }
        ),
        "{err}"
    );
    let mut b = data_header(GEN, 0);
    b[4] = 2;
    let (err, _) = recv_after(&b, false);
    assert!(
        matches!(
            err,
            CommError::Frame {
                source: FrameError::BadVersion { found: 2, .. },
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn clean_close_is_peer_lost() {
    let (err, _) = recv_after(&[], true);
    assert!(matches!(err, CommError::PeerLost { rank: 1, .. }), "{err}");
}

#[test]
fn a_stale_rank_cannot_join_a_newer_generation() {
    let l0 = TcpListener::bind("127.0.0.1:0").unwrap();
    let l1 = TcpListener::bind("127.0.0.1:0").unwrap();
    let addrs = vec![l0.local_addr().unwrap(), l1.local_addr().unwrap()];
    let mut new = TcpConfig::new(0, GEN, addrs.clone());
    new.connect_timeout = Duration::from_secs(2);
    let mut old = TcpConfig::new(1, GEN - 1, addrs);
    old.connect_timeout = Duration::from_secs(2);
    let r0 = thread::spawn(move || TcpCommunicator::connect(new, Some(l0)));
    let r1 = TcpCommunicator::connect(old, Some(l1));
    assert!(
        matches!(
            r1,
            Err(CommError::StaleGeneration {
                peer: 0,
                ours: 4,
                theirs: GEN
            })
        ),
        "{:?}",
        r1.err()
    );
    let r0 = r0.join().unwrap();
    assert!(
        matches!(r0, Err(CommError::Timeout { .. })),
        "{:?}",
        r0.err()
    );
}

/// A Data frame header of `len` payload bytes for message `part` of p2p tag 0.
fn part_header(part: u32, len: u32) -> Vec<u8> {
    Header {
        kind: Kind::Data,
        generation: GEN,
        channel: 0,
        seq: 0,
        part,
        len,
    }
    .encode()
    .to_vec()
}

#[test]
fn a_receiver_waiting_into_its_buffer_gives_up_at_its_deadline_mid_frame() {
    let (comm, mut s) = rank0_with_raw_rank1();
    let n = 1000usize;
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        let mut into = oobleck_comm::TensorBuf::zeros(oobleck_comm::DType::F32, vec![n]).unwrap();
        let r = comm.recv_into(1, 0, &mut into, Duration::from_millis(500));
        let _ = tx.send(r);
        drop(comm);
    });
    // The tensor's header (f32, one dim of n), then, once the receive waits with its buffer
    // posted, the first quarter of the data and a stall.
    let mut meta = vec![1u8, 1];
    meta.extend_from_slice(&(n as u64).to_le_bytes());
    let mut b = part_header(0, meta.len() as u32);
    b.extend_from_slice(&meta);
    s.write_all(&b).unwrap();
    thread::sleep(Duration::from_millis(100));
    let mut b = part_header(1, 4 * n as u32);
    b.extend_from_slice(&[7; 1000]);
    s.write_all(&b).unwrap();
    let r = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the receive returns at its deadline, not when the peer resumes");
    let err = r.expect_err("three quarters of the data never came");
    assert!(
        matches!(
            err,
            CommError::Timeout {
                waiting_on: Some(1),
                ..
            }
        ),
        "{err}"
    );
    drop(s);
}
