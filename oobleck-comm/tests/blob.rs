//! `BlobSink` / `send_blob`: round trips, concurrency, and every refusal. The raw client below
//! speaks the wire format drawn in `oobleck_comm::blob`'s module doc by hand, to send what
//! `send_blob` never would (a wrong hash, a body cut short, no body at all).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use oobleck_comm::{send_blob, BlobSink, CommError, SecretKey};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sha2::{Digest, Sha256};

/// Generous: a bound on a hang, never a measured duration.
const TIMEOUT: Duration = Duration::from_secs(60);
const LOCAL: &str = "127.0.0.1:0";

fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    ChaCha8Rng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

fn sink(key: &SecretKey, max_bytes: u64) -> (BlobSink, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run");
    let sink = BlobSink::bind(LOCAL.parse().unwrap(), key.clone(), root, max_bytes).unwrap();
    (sink, dir)
}

/// Every file under `dir`, relative to it, sorted.
fn files(dir: &Path) -> Vec<PathBuf> {
    fn walk(base: &Path, dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(base, &p, out);
            } else {
                out.push(p.strip_prefix(base).unwrap().to_path_buf());
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// A client that speaks the protocol by hand.
struct Raw {
    s: TcpStream,
    nonce: Vec<u8>,
}

impl Raw {
    fn connect(addr: SocketAddr) -> Raw {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        s.set_write_timeout(Some(TIMEOUT)).unwrap();
        let mut hello = [0u8; 38];
        s.read_exact(&mut hello).unwrap();
        assert_eq!(&hello[..6], b"OBKB\x02\x00");
        Raw {
            s,
            nonce: hello[6..].to_vec(),
        }
    }

    fn header(&mut self, key: &SecretKey, name: &str, len: u64, sha: [u8; 32]) {
        self.header_bytes(key, name.as_bytes(), len, sha);
    }

    /// A put request (op 1) of protocol version 2.
    fn header_bytes(&mut self, key: &SecretKey, name: &[u8], len: u64, sha: [u8; 32]) {
        let (op, cnonce) = ([1u8], [7u8; 32]);
        let len = len.to_le_bytes();
        let mac = key.mac(&[b"oobleck-blob", &self.nonce, &op, &cnonce, name, &len, &sha]);
        let mut h = b"OBKB\x02\x00".to_vec();
        h.extend_from_slice(&op);
        h.extend_from_slice(&cnonce);
        h.extend_from_slice(&(name.len() as u16).to_le_bytes());
        h.extend_from_slice(name);
        h.extend_from_slice(&len);
        h.extend_from_slice(&sha);
        h.extend_from_slice(&mac);
        self.s.write_all(&h).unwrap();
    }

    /// (status, message)
    fn answer(&mut self) -> (u8, String) {
        let mut head = [0u8; 3];
        self.s.read_exact(&mut head).unwrap();
        let mut msg = vec![0u8; usize::from(u16::from_le_bytes([head[1], head[2]]))];
        self.s.read_exact(&mut msg).unwrap();
        (head[0], String::from_utf8(msg).unwrap())
    }
}

#[test]
fn a_few_megabytes_round_trip_under_a_nested_name() {
    let key = SecretKey::random();
    let (sink, dir) = sink(&key, 64 << 20);
    let bytes = random_bytes(1, 5 << 20 | 12345);
    let name = "gen-1/stage-0/params.safetensors";
    let receipt = send_blob(sink.addr(), &key, name, &bytes, TIMEOUT).unwrap();
    assert_eq!(receipt.bytes, bytes.len() as u64);
    assert!(receipt.seconds >= 0.0);
    assert_eq!(std::fs::read(sink.root().join(name)).unwrap(), bytes);
    // Uploading the same name again replaces the file; an empty file is a file too.
    send_blob(sink.addr(), &key, name, &[], TIMEOUT).unwrap();
    assert_eq!(std::fs::read(sink.root().join(name)).unwrap(), b"");
    assert_eq!(files(dir.path()), vec![Path::new("run").join(name)]);
}

#[test]
fn concurrent_uploads_from_several_threads_all_land() {
    let key = SecretKey::random();
    let (sink, _dir) = sink(&key, 64 << 20);
    let addr = sink.addr();
    let threads: Vec<_> = (0..8u64)
        .map(|i| {
            let key = key.clone();
            std::thread::spawn(move || {
                let bytes = random_bytes(100 + i, (1 << 20) + i as usize * 7919);
                let name = format!("gen-2/rank-{i}/state.safetensors");
                send_blob(addr, &key, &name, &bytes, TIMEOUT).unwrap();
                (name, bytes)
            })
        })
        .collect();
    for t in threads {
        let (name, bytes) = t.join().unwrap();
        assert_eq!(
            std::fs::read(sink.root().join(&name)).unwrap(),
            bytes,
            "{name}"
        );
    }
}

#[test]
fn a_wrong_key_is_refused_and_writes_nothing() {
    let (sink, dir) = sink(&SecretKey::random(), 1 << 20);
    let err = send_blob(
        sink.addr(),
        &SecretKey::random(),
        "x.bin",
        b"hello",
        TIMEOUT,
    )
    .unwrap_err();
    assert!(matches!(err, CommError::BlobUnauthorized { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("another job's or generation's key"),
        "{err}"
    );
    sink.stop();
    assert_eq!(files(dir.path()), Vec::<PathBuf>::new());
}

#[test]
fn names_that_leave_the_root_or_are_not_plain_are_refused() {
    let key = SecretKey::random();
    let (sink, dir) = sink(&key, 1 << 20);
    let long = "n".repeat(256);
    for name in [
        "../x",
        "/etc/x",
        "a//b",
        "a/./b",
        "a/../../x",
        "",
        "a/",
        "x\0y",
        ".",
        "a\\b",
        "a\nb",
        "state.partial",
        &long,
    ] {
        let err = send_blob(sink.addr(), &key, name, b"data", TIMEOUT).unwrap_err();
        let CommError::BlobRefused { message, .. } = &err else {
            panic!("{name:?}: {err}");
        };
        assert!(message.contains("relative path"), "{name:?}: {message}");
    }
    // A name that is not UTF-8 (only a hand-made header can send one).
    let mut raw = Raw::connect(sink.addr());
    raw.header_bytes(&key, &[0xff, b'a'], 4, Sha256::digest(b"data").into());
    let (status, message) = raw.answer();
    assert!(status != 0 && message.contains("not UTF-8"), "{message}");
    sink.stop();
    // Nothing escaped: the parent of the root holds only the (empty) root.
    assert_eq!(files(dir.path()), Vec::<PathBuf>::new());
}

#[test]
fn names_of_plain_components_are_stored_as_given() {
    let key = SecretKey::random();
    let (sink, dir) = sink(&key, 1 << 20);
    let names = [
        "a",
        "a.b/c..d",
        "ünïcode/ß",
        "gen-3/stage-1/params.safetensors",
    ];
    for name in names {
        send_blob(sink.addr(), &key, name, name.as_bytes(), TIMEOUT).unwrap();
        assert_eq!(
            std::fs::read(sink.root().join(name)).unwrap(),
            name.as_bytes()
        );
    }
    let mut want: Vec<PathBuf> = names.iter().map(|n| Path::new("run").join(n)).collect();
    want.sort();
    assert_eq!(files(dir.path()), want);
}

#[test]
fn a_client_that_closes_mid_body_leaves_neither_file_nor_partial() {
    let key = SecretKey::random();
    let (sink, dir) = sink(&key, 64 << 20);
    let body = random_bytes(7, 1 << 20);
    let mut raw = Raw::connect(sink.addr());
    raw.header(
        &key,
        "cut/state.bin",
        body.len() as u64,
        Sha256::digest(&body).into(),
    );
    assert_eq!(raw.answer().0, 0);
    // The sink opened the partial file before it said "send the body".
    let partial = sink.root().join("cut/state.bin.partial");
    assert!(partial.exists());
    raw.s.write_all(&body[..100_000]).unwrap();
    drop(raw);
    // Stopping joins the connection's thread, so its clean-up has run when this returns.
    sink.stop();
    assert!(!partial.exists());
    assert_eq!(files(dir.path()), Vec::<PathBuf>::new());
}

#[test]
fn a_body_that_does_not_match_its_hash_is_refused() {
    let key = SecretKey::random();
    let (sink, dir) = sink(&key, 64 << 20);
    let body = random_bytes(8, 300_000);
    let mut wrong: [u8; 32] = Sha256::digest(&body).into();
    wrong[0] ^= 1;
    let mut raw = Raw::connect(sink.addr());
    raw.header(&key, "bad.bin", body.len() as u64, wrong);
    assert_eq!(raw.answer().0, 0);
    raw.s.write_all(&body).unwrap();
    let (status, message) = raw.answer();
    assert_ne!(status, 0);
    assert!(message.contains("SHA-256"), "{message}");
    sink.stop();
    assert_eq!(files(dir.path()), Vec::<PathBuf>::new());
}

#[test]
fn more_than_max_bytes_is_refused_before_the_body() {
    let key = SecretKey::random();
    let (sink, dir) = sink(&key, 1000);
    // By hand: the refusal comes in answer to the header alone.
    let mut raw = Raw::connect(sink.addr());
    raw.header(&key, "big.bin", 1001, [0; 32]);
    let (status, message) = raw.answer();
    assert_ne!(status, 0);
    assert!(
        message.contains("1001 bytes exceed") && message.contains("1000"),
        "{message}"
    );
    // And through the client, whose error carries the sink's message.
    let err = send_blob(sink.addr(), &key, "big.bin", &[0; 1001], TIMEOUT).unwrap_err();
    let CommError::BlobRefused { message, .. } = &err else {
        panic!("{err}");
    };
    assert!(message.contains("limit of 1000 bytes"), "{message}");
    send_blob(sink.addr(), &key, "fits.bin", &[1; 1000], TIMEOUT).unwrap();
    sink.stop();
    assert_eq!(files(dir.path()), vec![PathBuf::from("run/fits.bin")]);
}

#[test]
fn silent_clients_do_not_block_another_upload() {
    let key = SecretKey::random();
    let (sink, _dir) = sink(&key, 1 << 20);
    // One never reads the hello, one stops halfway through its header.
    let _mute = TcpStream::connect(sink.addr()).unwrap();
    let mut half = Raw::connect(sink.addr());
    half.s.write_all(b"OBKB\x02\x00\x01").unwrap();
    let bytes = random_bytes(9, 200_000);
    send_blob(sink.addr(), &key, "ok.bin", &bytes, TIMEOUT).unwrap();
    assert_eq!(std::fs::read(sink.root().join("ok.bin")).unwrap(), bytes);
}

#[test]
fn dropping_the_sink_breaks_off_open_connections_and_returns() {
    let key = SecretKey::random();
    let (sink, dir) = sink(&key, 64 << 20);
    let _mute = TcpStream::connect(sink.addr()).unwrap();
    let mut mid = Raw::connect(sink.addr());
    mid.header(&key, "mid.bin", 1 << 20, [0; 32]);
    assert_eq!(mid.answer().0, 0);
    mid.s.write_all(&[0; 1000]).unwrap();
    let (done_tx, done_rx) = mpsc::channel();
    std::thread::spawn(move || {
        drop(sink);
        done_tx.send(()).unwrap();
    });
    // A bound on a hang, well under the sink's 60 s idle limit, which is what it would wait
    // out if it did not shut its open connections down.
    done_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("drop of the sink hung");
    // The uploader mid-body learns the connection is gone (an answer or a close, never a hang).
    let mut rest = Vec::new();
    let _ = mid.s.read_to_end(&mut rest);
    assert_eq!(files(dir.path()), Vec::<PathBuf>::new());
}

#[test]
fn a_mute_or_missing_sink_fails_with_a_transfer_error() {
    let key = SecretKey::random();
    // Accepts (the kernel does, from its backlog) but never says hello.
    let mute = TcpListener::bind(LOCAL).unwrap();
    let short = Duration::from_millis(200);
    let err = send_blob(mute.local_addr().unwrap(), &key, "x", b"x", short).unwrap_err();
    let CommError::BlobTransfer { reason, .. } = &err else {
        panic!("{err}");
    };
    assert!(reason.contains("timeout"), "{err}");
    let gone = mute.local_addr().unwrap();
    drop(mute);
    let err = send_blob(gone, &key, "x", b"x", short).unwrap_err();
    assert!(matches!(err, CommError::BlobTransfer { .. }), "{err}");
    assert!(err.to_string().contains("reachable"), "{err}");
}

#[test]
fn a_second_upload_of_a_name_in_flight_is_refused_not_interleaved() {
    let key = SecretKey::random();
    let (sink, _dir) = sink(&key, 1 << 20);
    let mut first = Raw::connect(sink.addr());
    first.header(&key, "same.bin", 3, Sha256::digest(b"one").into());
    assert_eq!(first.answer().0, 0);
    let err = send_blob(sink.addr(), &key, "same.bin", b"two", TIMEOUT).unwrap_err();
    assert!(err.to_string().contains("in progress"), "{err}");
    first.s.write_all(b"one").unwrap();
    assert_eq!(first.answer(), (0, "stored 3 bytes".to_string()));
    assert_eq!(std::fs::read(sink.root().join("same.bin")).unwrap(), b"one");
    send_blob(sink.addr(), &key, "same.bin", b"two", TIMEOUT).unwrap();
}
