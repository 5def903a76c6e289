//! `fetch_blob` / `list_blobs` / `fetch_dir` against a `BlobSink`: round trips, refusals, an
//! upload in flight, and replays. A raw client speaks the request format of
//! `oobleck_comm::blob`'s module doc by hand (to replay or alter a request); a fake sink speaks
//! the answers by hand (to send a body that does not match what it announced).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::thread::JoinHandle;
use std::time::Duration;

use oobleck_comm::{fetch_blob, fetch_dir, list_blobs, send_blob, BlobSink, CommError, SecretKey};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sha2::{Digest, Sha256};

/// Generous: a bound on a hang, never a measured duration.
const TIMEOUT: Duration = Duration::from_secs(60);
const LOCAL: &str = "127.0.0.1:0";
const PUT: u8 = 1;
const GET: u8 = 2;
const LIST: u8 = 3;

fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    ChaCha8Rng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

fn sink(key: &SecretKey) -> (BlobSink, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run");
    let sink = BlobSink::bind(LOCAL.parse().unwrap(), key.clone(), root, 64 << 20).unwrap();
    (sink, dir)
}

/// Writes `bytes` at `root/name`, creating directories.
fn put_file(root: &Path, name: &str, bytes: &[u8]) {
    let path = root.join(name);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

/// The names of the entries of `dir`, sorted.
fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

/// The reason of a `BlobFetch` error (panics on any other error).
fn fetch_reason(err: &CommError) -> &str {
    match err {
        CommError::BlobFetch { reason, .. } => reason,
        other => panic!("expected BlobFetch, got {other}"),
    }
}

/// A request of protocol version 2, its MAC under `key` and the sink's `nonce`.
fn request(key: &SecretKey, nonce: &[u8], op: u8, name: &str, len: u64, sha: [u8; 32]) -> Vec<u8> {
    let (cnonce, name, len) = ([5u8; 32], name.as_bytes(), len.to_le_bytes());
    let mac = key.mac(&[b"oobleck-blob", nonce, &[op], &cnonce, name, &len, &sha]);
    let name_len = (name.len() as u16).to_le_bytes();
    let parts: [&[u8]; 9] = [
        b"OBKB",
        &[2, 0],
        &[op],
        &cnonce,
        &name_len,
        name,
        &len,
        &sha,
        &mac,
    ];
    parts.concat()
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
fn put_then_get_round_trips_a_few_megabytes() {
    let key = SecretKey::random();
    let (sink, _dir) = sink(&key);
    let bytes = random_bytes(1, 5 << 20 | 4321);
    let name = "checkpoints/step-000004/params.safetensors";
    send_blob(sink.addr(), &key, name, &bytes, TIMEOUT).unwrap();
    assert_eq!(fetch_blob(sink.addr(), &key, name, TIMEOUT).unwrap(), bytes);
    // Several workers fetch the same file at once.
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (addr, key) = (sink.addr(), key.clone());
            std::thread::spawn(move || fetch_blob(addr, &key, name, TIMEOUT).unwrap())
        })
        .collect();
    for t in threads {
        assert!(t.join().unwrap() == bytes);
    }
    send_blob(sink.addr(), &key, "empty", &[], TIMEOUT).unwrap();
    assert_eq!(
        fetch_blob(sink.addr(), &key, "empty", TIMEOUT).unwrap(),
        b""
    );
}

#[test]
fn list_and_fetch_dir_bring_a_whole_checkpoint_directory() {
    let key = SecretKey::random();
    let (sink, dir) = sink(&key);
    let step = "checkpoints/step-000004";
    let files = [
        ("params.safetensors", random_bytes(2, 3 << 20)),
        ("optimizer.safetensors", random_bytes(3, 1 << 20 | 17)),
        ("meta.json", b"{\"step\":4}".to_vec()),
    ];
    for (base, bytes) in &files {
        put_file(sink.root(), &format!("{step}/{base}"), bytes);
    }
    // Neither a subdirectory, nor another step, nor a partial file is part of the listing.
    put_file(sink.root(), &format!("{step}/sub/x.bin"), b"x");
    put_file(
        sink.root(),
        "checkpoints/step-000003/params.safetensors",
        b"old",
    );
    put_file(sink.root(), &format!("{step}/late.bin.partial"), b"half");
    let listed = list_blobs(sink.addr(), &key, step, TIMEOUT).unwrap();
    let want: Vec<String> = ["meta.json", "optimizer.safetensors", "params.safetensors"]
        .iter()
        .map(|b| format!("{step}/{b}"))
        .collect();
    assert_eq!(listed, want);
    let local = dir.path().join("worker/ckpt");
    let total = fetch_dir(sink.addr(), &key, step, &local, TIMEOUT).unwrap();
    let sum: usize = files.iter().map(|(_, b)| b.len()).sum();
    assert_eq!(total, sum as u64);
    assert_eq!(
        entries(&local),
        ["meta.json", "optimizer.safetensors", "params.safetensors"]
    );
    for (base, bytes) in &files {
        assert!(std::fs::read(local.join(base)).unwrap() == *bytes, "{base}");
    }
    // A directory with no files lists as empty.
    std::fs::create_dir_all(sink.root().join("empty")).unwrap();
    assert!(list_blobs(sink.addr(), &key, "empty", TIMEOUT)
        .unwrap()
        .is_empty());
}

#[test]
fn a_wrong_key_is_refused_for_get_and_list() {
    let key = SecretKey::random();
    let (sink, _dir) = sink(&key);
    put_file(sink.root(), "d/a.bin", b"secret");
    let other = SecretKey::random();
    let local = tempfile::tempdir().unwrap();
    let unused = local.path().join("ckpt");
    let errs = [
        fetch_blob(sink.addr(), &other, "d/a.bin", TIMEOUT).unwrap_err(),
        list_blobs(sink.addr(), &other, "d", TIMEOUT).unwrap_err(),
        fetch_dir(sink.addr(), &other, "d", &unused, TIMEOUT).unwrap_err(),
    ];
    for err in &errs {
        let reason = fetch_reason(err);
        assert!(
            reason.contains("another job's or generation's key"),
            "{err}"
        );
    }
    assert!(!unused.exists());
}

#[test]
fn names_that_leave_the_root_are_refused() {
    let key = SecretKey::random();
    let (sink, dir) = sink(&key);
    std::fs::write(dir.path().join("outside.bin"), b"not yours").unwrap();
    put_file(sink.root(), "d/a.bin", b"a");
    for name in [
        "../outside.bin",
        "/etc/passwd",
        "d/../../outside.bin",
        "",
        "d//a.bin",
        "d/./a.bin",
        "d/a.bin.partial",
        "d\\a.bin",
    ] {
        let err = fetch_blob(sink.addr(), &key, name, TIMEOUT).unwrap_err();
        assert!(
            fetch_reason(&err).contains("relative path"),
            "{name:?}: {err}"
        );
    }
    for name in ["..", "/", "", "d/..", "d/"] {
        let err = list_blobs(sink.addr(), &key, name, TIMEOUT).unwrap_err();
        assert!(
            fetch_reason(&err).contains("relative path"),
            "{name:?}: {err}"
        );
    }
    // A directory is not a file.
    let err = fetch_blob(sink.addr(), &key, "d", TIMEOUT).unwrap_err();
    assert!(fetch_reason(&err).contains("not a regular file"), "{err}");
}

#[cfg(unix)]
#[test]
fn symlinks_are_followed_only_inside_the_root() {
    use std::os::unix::fs::symlink;
    let key = SecretKey::random();
    let (sink, dir) = sink(&key);
    let outside = dir.path().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("secret"), b"not yours").unwrap();
    put_file(sink.root(), "d/real.bin", b"real");
    symlink(outside.join("secret"), sink.root().join("d/leak")).unwrap();
    symlink(sink.root().join("d/real.bin"), sink.root().join("d/inner")).unwrap();
    symlink(&outside, sink.root().join("escape")).unwrap();
    assert_eq!(
        list_blobs(sink.addr(), &key, "d", TIMEOUT).unwrap(),
        ["d/inner", "d/real.bin"]
    );
    assert_eq!(
        fetch_blob(sink.addr(), &key, "d/inner", TIMEOUT).unwrap(),
        b"real"
    );
    for err in [
        fetch_blob(sink.addr(), &key, "d/leak", TIMEOUT).unwrap_err(),
        fetch_blob(sink.addr(), &key, "escape/secret", TIMEOUT).unwrap_err(),
        list_blobs(sink.addr(), &key, "escape", TIMEOUT).unwrap_err(),
    ] {
        assert!(
            fetch_reason(&err).contains("leads out of the root"),
            "{err}"
        );
    }
}

#[test]
fn a_missing_file_or_directory_is_not_found_by_name() {
    let key = SecretKey::random();
    let (sink, _dir) = sink(&key);
    put_file(sink.root(), "d/a.bin", b"a");
    let name = "checkpoints/step-000009/params.safetensors";
    let err = fetch_blob(sink.addr(), &key, name, TIMEOUT).unwrap_err();
    assert!(
        matches!(&err, CommError::BlobNotFound { name: n, .. } if n == name),
        "{err}"
    );
    assert!(err.to_string().contains(name), "{err}");
    assert!(err.to_string().contains("checkpoint step exists"), "{err}");
    // Under a file, rather than a directory.
    let err = fetch_blob(sink.addr(), &key, "d/a.bin/x", TIMEOUT).unwrap_err();
    assert!(matches!(err, CommError::BlobNotFound { .. }), "{err}");
    let err = list_blobs(sink.addr(), &key, "checkpoints/step-000009", TIMEOUT).unwrap_err();
    assert!(matches!(err, CommError::BlobNotFound { .. }), "{err}");
}

#[test]
fn a_file_being_uploaded_is_neither_listed_nor_fetchable() {
    let key = SecretKey::random();
    let (sink, _dir) = sink(&key);
    let old = random_bytes(4, 300_000);
    send_blob(sink.addr(), &key, "ckpt/old.bin", &old, TIMEOUT).unwrap();
    // A first upload of new.bin, and a replacement of old.bin, both paused mid-body.
    let (new, newer) = (random_bytes(5, 1 << 20), random_bytes(6, 1 << 20));
    let mut uploads = Vec::new();
    for (name, body) in [("ckpt/new.bin", &new), ("ckpt/old.bin", &newer)] {
        let mut raw = Raw::connect(sink.addr());
        let sha: [u8; 32] = Sha256::digest(body).into();
        let req = request(&key, &raw.nonce, PUT, name, body.len() as u64, sha);
        raw.s.write_all(&req).unwrap();
        assert_eq!(raw.answer().0, 0, "{name}");
        raw.s.write_all(&body[..100_000]).unwrap();
        uploads.push((raw, body));
    }
    assert!(sink.root().join("ckpt/new.bin.partial").exists());
    assert_eq!(
        list_blobs(sink.addr(), &key, "ckpt", TIMEOUT).unwrap(),
        ["ckpt/old.bin"]
    );
    let err = fetch_blob(sink.addr(), &key, "ckpt/new.bin", TIMEOUT).unwrap_err();
    assert!(matches!(err, CommError::BlobNotFound { .. }), "{err}");
    let err = fetch_blob(sink.addr(), &key, "ckpt/new.bin.partial", TIMEOUT).unwrap_err();
    assert!(fetch_reason(&err).contains(".partial"), "{err}");
    // The file being replaced is served whole, as it was.
    assert!(fetch_blob(sink.addr(), &key, "ckpt/old.bin", TIMEOUT).unwrap() == old);
    for (raw, body) in &mut uploads {
        raw.s.write_all(&body[100_000..]).unwrap();
        assert_eq!(raw.answer().0, 0);
    }
    let listed = list_blobs(sink.addr(), &key, "ckpt", TIMEOUT).unwrap();
    assert_eq!(listed, ["ckpt/new.bin", "ckpt/old.bin"]);
    assert!(fetch_blob(sink.addr(), &key, "ckpt/new.bin", TIMEOUT).unwrap() == new);
    assert!(fetch_blob(sink.addr(), &key, "ckpt/old.bin", TIMEOUT).unwrap() == newer);
}

#[test]
fn a_request_cannot_be_replayed_as_another_operation_or_on_another_connection() {
    let key = SecretKey::random();
    let (sink, _dir) = sink(&key);
    put_file(sink.root(), "d/a.bin", b"secret");
    let sha: [u8; 32] = Sha256::digest(b"upload").into();
    // (the op the MAC was made for, the op byte sent); the same op is the control: accepted.
    let cases = [
        (PUT, PUT),
        (GET, GET),
        (LIST, LIST),
        (PUT, GET),
        (PUT, LIST),
    ];
    for (made, sent) in cases
        .into_iter()
        .chain([(GET, PUT), (LIST, GET), (GET, LIST)])
    {
        let mut raw = Raw::connect(sink.addr());
        let (name, len, sha) = match made {
            PUT => ("d/b.bin", 6, sha),
            LIST => ("d", 0, [0; 32]),
            _ => ("d/a.bin", 0, [0; 32]),
        };
        let mut req = request(&key, &raw.nonce, made, name, len, sha);
        req[6] = sent;
        raw.s.write_all(&req).unwrap();
        let (status, message) = raw.answer();
        if made == sent {
            assert_eq!(status, 0, "op {made}: {message}");
            continue;
        }
        assert_eq!(status, 2, "made {made}, sent {sent}: {message}");
        assert!(message.contains("MAC does not verify"), "{message}");
    }
    // A get captured on one connection, replayed on the next: the nonce differs.
    let first = Raw::connect(sink.addr());
    let captured = request(&key, &first.nonce, GET, "d/a.bin", 0, [0; 32]);
    let mut second = Raw::connect(sink.addr());
    second.s.write_all(&captured).unwrap();
    assert_eq!(second.answer().0, 2);
}

#[test]
fn a_request_of_another_version_is_refused_with_both_versions() {
    let key = SecretKey::random();
    let (sink, _dir) = sink(&key);
    let mut raw = Raw::connect(sink.addr());
    let mut req = request(&key, &raw.nonce, GET, "d/a.bin", 0, [0; 32]);
    req[4] = 1;
    raw.s.write_all(&req).unwrap();
    let (status, message) = raw.answer();
    assert_eq!(status, 1);
    assert!(
        message.contains("version 2") && message.contains("version 1"),
        "{message}"
    );
    // An operation byte this version does not know.
    let mut raw = Raw::connect(sink.addr());
    let mut req = request(&key, &raw.nonce, GET, "d/a.bin", 0, [0; 32]);
    req[6] = 9;
    raw.s.write_all(&req).unwrap();
    let (status, message) = raw.answer();
    assert!(
        status == 1 && message.contains("unknown operation 9"),
        "{message}"
    );
}

/// What a fake sink read of a request.
struct Asked {
    op: u8,
    name: Vec<u8>,
    nonce: [u8; 32],
    cnonce: [u8; 32],
}

impl Asked {
    /// The answer MAC of the module doc, under `key`.
    fn mac(&self, key: &SecretKey, payload: &[&[u8]]) -> [u8; 32] {
        let name_len = (self.name.len() as u16).to_le_bytes();
        let head: [&[u8]; 6] = [
            b"oobleck-sink",
            &self.cnonce,
            &self.nonce,
            &[self.op],
            &name_len,
            &self.name,
        ];
        key.mac(&[&head[..], payload].concat())
    }
}

/// A sink speaking the answers by hand: serves `conns` connections in turn with `serve`.
fn fake_sink(
    conns: usize,
    serve: impl Fn(&Asked, &mut TcpStream) + Send + 'static,
) -> (SocketAddr, JoinHandle<()>) {
    let listener = TcpListener::bind(LOCAL).unwrap();
    let addr = listener.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        for _ in 0..conns {
            let (mut s, _) = listener.accept().unwrap();
            let nonce = [3u8; 32];
            s.write_all(&[&b"OBKB\x02\x00"[..], &nonce].concat())
                .unwrap();
            let mut fixed = [0u8; 41];
            s.read_exact(&mut fixed).unwrap();
            let mut name = vec![0u8; usize::from(u16::from_le_bytes([fixed[39], fixed[40]]))];
            s.read_exact(&mut name).unwrap();
            s.read_exact(&mut [0u8; 72]).unwrap();
            let cnonce = fixed[7..39].try_into().unwrap();
            serve(
                &Asked {
                    op: fixed[6],
                    name,
                    nonce,
                    cnonce,
                },
                &mut s,
            );
        }
    });
    (addr, t)
}

/// A get's answer announcing `announced`, then `body`.
fn fake_get(key: &SecretKey, asked: &Asked, s: &mut TcpStream, announced: &[u8], body: &[u8]) {
    let (len, sha) = (
        (announced.len() as u64).to_le_bytes(),
        Sha256::digest(announced),
    );
    let mac = asked.mac(key, &[&len, &sha]);
    s.write_all(&[&[0u8, 0, 0][..], &len, &sha, &mac, body].concat())
        .unwrap();
}

#[test]
fn a_body_unlike_the_announced_one_fails_and_fetch_dir_keeps_nothing() {
    let key = SecretKey::random();
    let k = key.clone();
    // A listing of one file, then a get whose body has one bit flipped.
    let (addr, t) = fake_sink(2, move |asked, s| {
        if asked.op == LIST {
            let name = b"d/a.bin";
            let payload = [
                &1u32.to_le_bytes()[..],
                &(name.len() as u16).to_le_bytes(),
                name,
            ]
            .concat();
            let mac = asked.mac(&k, &[&payload]);
            s.write_all(&[&[0u8, 0, 0][..], &payload, &mac].concat())
                .unwrap();
        } else {
            let good = random_bytes(7, 200_000);
            let mut bad = good.clone();
            bad[123_456] ^= 1;
            fake_get(&k, asked, s, &good, &bad);
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let err = fetch_dir(addr, &key, "d", dir.path(), TIMEOUT).unwrap_err();
    assert!(fetch_reason(&err).contains("SHA-256 differs"), "{err}");
    assert!(entries(dir.path()).is_empty(), "{:?}", entries(dir.path()));
    t.join().unwrap();
}

#[test]
fn a_body_cut_short_or_an_answer_without_the_key_fails() {
    let key = SecretKey::random();
    let k = key.clone();
    let (addr, t) = fake_sink(1, move |asked, s| {
        let body = random_bytes(8, 1000);
        fake_get(&k, asked, s, &body, &body[..500]);
    });
    let err = fetch_blob(addr, &key, "a.bin", TIMEOUT).unwrap_err();
    assert!(fetch_reason(&err).contains("of 1000"), "{err}");
    t.join().unwrap();
    // Something that speaks the protocol but holds another key is not believed.
    let (addr, t) = fake_sink(1, move |asked, s| {
        fake_get(&SecretKey::random(), asked, s, b"forged", b"forged");
    });
    let err = fetch_blob(addr, &key, "a.bin", TIMEOUT).unwrap_err();
    assert!(fetch_reason(&err).contains("MAC does not verify"), "{err}");
    t.join().unwrap();
}

#[test]
fn a_mute_sink_fails_within_the_timeout() {
    let key = SecretKey::random();
    let mute = TcpListener::bind(LOCAL).unwrap();
    let short = Duration::from_millis(200);
    let addr = mute.local_addr().unwrap();
    let err = fetch_blob(addr, &key, "x", short).unwrap_err();
    assert!(fetch_reason(&err).contains("timeout"), "{err}");
    let err = list_blobs(addr, &key, "x", short).unwrap_err();
    assert!(fetch_reason(&err).contains("timeout"), "{err}");
}
