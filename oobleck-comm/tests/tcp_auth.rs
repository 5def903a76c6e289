//! The keyed handshake of the TCP backend: a group whose ranks share the generation's key
//! forms while strangers hit its ports, and every process that cannot prove the key (no key,
//! another key, a replayed handshake, silence) is refused without disturbing the group. A rank
//! given another key fails `connect` with `AuthFailed`, never a hang.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use oobleck_comm::frame::{self, Header, KeyedHello, Kind, ReadOutcome};
use oobleck_comm::{
    CommError, Communicator, Result, SecretKey, TcpCommunicator, TcpConfig, TensorBuf, KEY_BYTES,
};

const GEN: u64 = 11;

/// What a Hello's MAC covers, written from `frame.rs`'s module doc (so the doc is checked).
fn mac_input(
    generation: u64,
    from: u32,
    to: u32,
    world: u32,
    theirs: &[u8],
    ours: &[u8],
) -> Vec<u8> {
    [
        b"oobleck-data-hello".as_slice(),
        &generation.to_le_bytes(),
        &frame::encode_hello(from, to, world),
        theirs,
        ours,
    ]
    .concat()
}

fn frame_bytes(kind: Kind, generation: u64, payload: &[u8]) -> Vec<u8> {
    let h = Header {
        kind,
        generation,
        channel: 0,
        seq: 0,
        part: 0,
        len: payload.len() as u32,
    };
    let mut b = h.encode().to_vec();
    b.extend_from_slice(payload);
    b
}

fn listeners(n: usize) -> (Vec<TcpListener>, Vec<SocketAddr>) {
    let ls: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs = ls.iter().map(|l| l.local_addr().unwrap()).collect();
    (ls, addrs)
}

fn config(rank: usize, peers: Vec<SocketAddr>, key: Option<&SecretKey>, secs: u64) -> TcpConfig {
    let mut cfg = TcpConfig::new(rank, GEN, peers);
    cfg.key = key.cloned();
    cfg.connect_timeout = Duration::from_secs(secs);
    cfg
}

fn spawn_rank(cfg: TcpConfig, l: TcpListener) -> JoinHandle<Result<TcpCommunicator>> {
    thread::spawn(move || TcpCommunicator::connect(cfg, Some(l)))
}

/// Forms a keyed group of 3 once, rank 2 reaching rank 0 through a relay that records what
/// rank 2 sends: the bytes of a real, successful handshake, for a replay.
fn capture_a_real_hello(key: &SecretKey) -> Vec<u8> {
    let (ls, addrs) = listeners(3);
    let relay = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut via_relay = addrs.clone();
    via_relay[0] = relay.local_addr().unwrap();
    let rank0 = addrs[0];
    let recorder = thread::spawn(move || {
        let (client, _) = relay.accept().unwrap();
        let server = TcpStream::connect(rank0).unwrap();
        let (mut c_out, mut s_in) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        let back = thread::spawn(move || {
            let _ = std::io::copy(&mut s_in, &mut c_out);
            let _ = c_out.shutdown(Shutdown::Write);
        });
        let (mut client, mut server) = (client, server);
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = client.read(&mut buf) {
            seen.extend_from_slice(&buf[..n]);
            if server.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = server.shutdown(Shutdown::Write);
        back.join().unwrap();
        seen
    });
    let ranks: Vec<_> = ls
        .into_iter()
        .enumerate()
        .map(|(r, l)| {
            let peers = if r == 2 {
                via_relay.clone()
            } else {
                addrs.clone()
            };
            spawn_rank(config(r, peers, Some(key), 10), l)
        })
        .collect();
    for r in ranks {
        r.join()
            .unwrap()
            .expect("the earlier group forms through the relay");
    }
    // The group is dropped: its connections close and the relay ends.
    let mut seen = recorder.join().unwrap();
    let header: [u8; frame::HEADER_LEN] = seen[..frame::HEADER_LEN].try_into().unwrap();
    let h = Header::decode(&header, GEN, 1024).unwrap();
    assert_eq!(
        (h.kind, h.len as usize),
        (Kind::Hello, frame::KEYED_HELLO_LEN)
    );
    // The Hello, without the shared-memory setup frames that follow it.
    seen.truncate(frame::HEADER_LEN + frame::KEYED_HELLO_LEN);
    seen
}

/// The frame kinds rank 0 sends a stranger before closing on it.
fn read_until_closed(mut s: TcpStream) -> Vec<Kind> {
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut kinds = Vec::new();
    while let Ok(ReadOutcome::Frame(h, _)) = frame::read_frame(&mut s, GEN, 1024) {
        kinds.push(h.kind);
    }
    kinds
}

/// A stranger with a key of its own: it answers the challenge with a well-formed Hello.
fn wrong_key_stranger(mut s: TcpStream) -> Vec<Kind> {
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let ReadOutcome::Frame(h, nonce) = frame::read_frame(&mut s, GEN, 1024).unwrap() else {
        panic!("rank 0 challenges every connection");
    };
    assert_eq!(h.kind, Kind::Challenge);
    let ours = [7u8; KEY_BYTES];
    let hello = KeyedHello {
        from: 2,
        to: 0,
        world: 3,
        nonce: ours,
        mac: SecretKey::random().mac(&[&mac_input(GEN, 2, 0, 3, &nonce, &ours)]),
    };
    s.write_all(&frame_bytes(Kind::Hello, GEN, &hello.encode()))
        .unwrap();
    let mut kinds = vec![h.kind];
    kinds.extend(read_until_closed(s));
    kinds
}

#[test]
fn a_keyed_group_forms_and_reduces_while_strangers_are_refused() {
    let key = SecretKey::random();
    let replay = capture_a_real_hello(&key);
    let (ls, addrs) = listeners(3);

    // The strangers connect first, so rank 0 accepts them before its real peers. Each claims
    // to be rank 2. The silent one comes first: were the handshakes serial, it would hold rank
    // 0 past the group's deadline (4 s, below the 5 s handshake timeout).
    let connect = || TcpStream::connect(addrs[0]).unwrap();
    let silent = connect();
    let mut no_key = connect();
    no_key
        .write_all(&frame_bytes(
            Kind::Hello,
            GEN,
            &frame::encode_hello(2, 0, 3),
        ))
        .unwrap();
    let wrong_key = connect();
    let mut replayed = connect();
    replayed.write_all(&replay).unwrap();
    let strangers: Vec<(&str, JoinHandle<Vec<Kind>>)> = vec![
        ("silent", thread::spawn(move || read_until_closed(silent))),
        ("no key", thread::spawn(move || read_until_closed(no_key))),
        (
            "wrong key",
            thread::spawn(move || wrong_key_stranger(wrong_key)),
        ),
        ("replay", thread::spawn(move || read_until_closed(replayed))),
    ];

    let ranks: Vec<_> = ls
        .into_iter()
        .enumerate()
        .map(|(r, l)| {
            let cfg = config(r, addrs.clone(), Some(&key), 4);
            thread::spawn(move || {
                let comm = TcpCommunicator::connect(cfg, Some(l))?;
                let mut t = TensorBuf::from_f32(vec![4], &[r as f32 + 1.0; 4])?;
                comm.all_reduce(&[0, 1, 2], &mut t, Duration::from_secs(20))?;
                t.to_f32_vec()
            })
        })
        .collect();
    for (r, h) in ranks.into_iter().enumerate() {
        let sum = h
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(sum, vec![6.0; 4], "rank {r}");
    }
    for (what, h) in strangers {
        // Challenged, never answered with a Hello, then closed on.
        assert_eq!(h.join().unwrap(), vec![Kind::Challenge], "{what} stranger");
    }
}

#[test]
fn a_rank_given_another_key_fails_connect_with_an_auth_error() {
    let (key, other) = (SecretKey::random(), SecretKey::random());
    let (ls, addrs) = listeners(3);
    let ranks: Vec<_> = ls
        .into_iter()
        .enumerate()
        .map(|(r, l)| {
            let k = if r == 2 { &other } else { &key };
            spawn_rank(config(r, addrs.clone(), Some(k), 3), l)
        })
        .collect();
    let results: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
    let err = results[2].as_ref().err().expect("rank 2 holds another key");
    assert!(
        matches!(err, CommError::AuthFailed { rank: 2, peer: 0, addr, generation: GEN, .. } if *addr == addrs[0]),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("different keys") && msg.contains(&addrs[0].to_string()),
        "{msg}"
    );
    for r in [0, 1] {
        assert!(
            matches!(
                &results[r],
                Err(CommError::Timeout {
                    waiting_on: Some(2),
                    ..
                })
            ),
            "rank {r}: {:?}",
            results[r].as_ref().err()
        );
    }
}

#[test]
fn a_connector_refuses_a_squatter_that_cannot_prove_the_key() {
    let key = SecretKey::random();
    let (mut ls, addrs) = listeners(2);
    let squatter = ls.remove(0);
    let k = key.clone();
    let fake = thread::spawn(move || {
        let (mut s, _) = squatter.accept().unwrap();
        let ours = [5u8; KEY_BYTES];
        s.write_all(&frame_bytes(Kind::Challenge, GEN, &ours))
            .unwrap();
        let ReadOutcome::Frame(_, p) = frame::read_frame(&mut s, GEN, 1024).unwrap() else {
            panic!("rank 1 answers the challenge");
        };
        let hello = KeyedHello::decode(&p).unwrap();
        // Rank 1's MAC is the one the wire format documents.
        assert!(k.verify(&[&mac_input(GEN, 1, 0, 2, &ours, &hello.nonce)], &hello.mac));
        let answer = KeyedHello {
            from: 0,
            to: 1,
            world: 2,
            nonce: ours,
            mac: [0; KEY_BYTES],
        };
        s.write_all(&frame_bytes(Kind::Hello, GEN, &answer.encode()))
            .unwrap();
        s
    });
    let r1 = TcpCommunicator::connect(config(1, addrs.clone(), Some(&key), 10), ls.pop());
    let _squatter_conn = fake.join().unwrap();
    let err = r1.err().expect("a squatter's answer does not verify");
    assert!(
        matches!(
            &err,
            CommError::AuthFailed {
                rank: 1,
                peer: 0,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("does not prove our key"), "{err}");
}

#[test]
fn an_unkeyed_rank_fails_with_an_auth_error_against_a_keyed_group() {
    let key = SecretKey::random();
    let (mut ls, addrs) = listeners(2);
    let r1 = spawn_rank(config(1, addrs.clone(), None, 3), ls.pop().unwrap());
    let r0 = spawn_rank(config(0, addrs, Some(&key), 3), ls.pop().unwrap());
    let err = r1.join().unwrap().err().expect("rank 1 has no key");
    assert!(
        matches!(
            &err,
            CommError::AuthFailed {
                rank: 1,
                peer: 0,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("was given none"), "{err}");
    let r0 = r0.join().unwrap();
    assert!(
        matches!(r0, Err(CommError::Timeout { .. })),
        "{:?}",
        r0.err()
    );
}

#[test]
fn a_keyed_rank_of_another_generation_is_stale() {
    let key = SecretKey::random();
    let (mut ls, addrs) = listeners(2);
    let mut old = config(1, addrs.clone(), Some(&key), 3);
    old.generation = GEN - 1;
    let r1 = spawn_rank(old, ls.pop().unwrap());
    let r0 = spawn_rank(config(0, addrs, Some(&key), 3), ls.pop().unwrap());
    let r1 = r1.join().unwrap();
    assert!(
        matches!(
            r1,
            Err(CommError::StaleGeneration {
                peer: 0,
                ours: 10,
                theirs: GEN
            })
        ),
        "{:?}",
        r1.err()
    );
    assert!(r0.join().unwrap().is_err());
}
