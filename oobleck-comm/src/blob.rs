//! Authenticated uploads of files (a worker's safetensors state) to the master's run directory,
//! so workers need no shared file system. [`BlobSink`] listens on the master; [`send_blob`]
//! uploads one file and returns once the sink has it on disk under its final name.
//!
//! One upload per connection; every integer is little-endian:
//!
//! ```text
//!  sink -> client  hello    | magic "OBKB" [4] | version u16 | nonce [32]                    |
//!  client -> sink  header   | magic "OBKB" [4] | version u16 | name_len u16 | name [name_len] |
//!                           | len u64 | sha256 [32] | mac [32]                                 |
//!  sink -> client  answer   | status u8 | msg_len u16 | msg [msg_len] (UTF-8)                 |
//!  client -> sink  body     | len bytes                              (only after status 0)    |
//!  sink -> client  answer   | status u8 | msg_len u16 | msg [msg_len]   (0 = stored, renamed) |
//! ```
//!
//! * `mac = key.mac(["oobleck-blob", nonce, name, len, sha256])`: the sink's fresh nonce makes
//!   a recorded upload useless to replay, and the MAC binds the name, length and hash, so the
//!   header cannot be altered. The body itself is vouched for by the hash.
//! * The sink checks, in this order, the magic and version, the MAC, the name (see
//!   [`check_name`]) and `len <= max_bytes` before it reads any body, and answers a refusal
//!   (status != 0, with the reason) instead of the first status 0. Statuses: 0 ok, 1 bad
//!   header, 2 bad MAC, 3 bad name, 4 too large, 5 name being uploaded by another connection,
//!   6 SHA-256 mismatch, 7 connection broke, 8 disk error on the sink.
//! * The body is streamed to `root/<name>.partial` in chunks while hashed; on a hash mismatch,
//!   a short body, a closed connection or a stop of the sink the partial file is deleted and
//!   nothing appears under the final name. Otherwise the file is fsynced and renamed to
//!   `root/<name>` (replacing an older file) before the final status 0 is sent.
//! * Every read and write has a timeout: the client's is its deadline for the whole upload;
//!   the sink gives up on a connection after 60 s ([`IDLE`]) without progress.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tracing::{info, warn};

use crate::error::{CommError, Result};
use crate::key::{self, SecretKey, KEY_BYTES};

const MAGIC: [u8; 4] = *b"OBKB";
const VERSION: u16 = 1;
/// Purpose label bound into every upload's MAC, so it cannot pass for another protocol's.
const LABEL: &[u8] = b"oobleck-blob";
/// Longest name, in bytes (a common file-name limit; names are short relative paths).
const MAX_NAME_BYTES: usize = 255;
/// The sink drops a connection after this long without a byte read or written.
const IDLE: Duration = Duration::from_secs(60);
/// Body bytes read or written per call: bounds the sink's memory per upload.
const CHUNK: usize = 1 << 20;
/// Uploads served at once; further connections are closed at once (a worker retries).
const MAX_CONNECTIONS: usize = 64;
/// How often the accept loop looks at the stop flag.
const ACCEPT_POLL: Duration = Duration::from_millis(10);
/// Longest message the sink sends in an answer.
const MAX_MESSAGE: usize = 1024;
const HELLO_LEN: usize = 4 + 2 + KEY_BYTES;

/// The status byte of an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Status {
    Ok = 0,
    BadHeader = 1,
    Unauthorized = 2,
    BadName = 3,
    TooLarge = 4,
    Busy = 5,
    Checksum = 6,
    Short = 7,
    Disk = 8,
}

/// What a successful [`send_blob`] measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlobReceipt {
    /// Bytes of the file now on the sink's disk.
    pub bytes: u64,
    /// Seconds from the call to the sink's final answer (hashing and fsync included).
    pub seconds: f64,
}

/// Receives uploads into a directory. Each connection is served on its own thread, so a slow
/// or silent client never holds up another. Dropping it (or [`BlobSink::stop`]) closes the
/// listener and every open connection, deletes their partial files and joins the threads.
pub struct BlobSink {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

struct Shared {
    key: SecretKey,
    root: PathBuf,
    max_bytes: u64,
    stop: AtomicBool,
    /// A clone of every open connection, so `stop` can shut them down mid-read.
    open: Mutex<HashMap<u64, TcpStream>>,
    /// Names being uploaded now: a second upload of one of them is refused, not interleaved.
    busy: Mutex<HashSet<PathBuf>>,
}

impl BlobSink {
    /// Listens on `addr` (port 0 picks a free port, see [`BlobSink::addr`]) and stores uploads
    /// under `root` (created if missing), each at most `max_bytes` long.
    pub fn bind(addr: SocketAddr, key: SecretKey, root: PathBuf, max_bytes: u64) -> Result<Self> {
        fs::create_dir_all(&root)
            .map_err(|e| CommError::io(format!("create blob root {}", root.display()), &e))?;
        let listener = TcpListener::bind(addr)
            .map_err(|e| CommError::io(format!("bind blob sink {addr}"), &e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| CommError::io("blob sink local address", &e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| CommError::io("blob sink set_nonblocking", &e))?;
        let shared = Arc::new(Shared {
            key,
            root,
            max_bytes,
            stop: AtomicBool::new(false),
            open: Mutex::new(HashMap::new()),
            busy: Mutex::new(HashSet::new()),
        });
        let acceptor = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("blob-accept".into())
                .spawn(move || accept_loop(&listener, &shared))
                .map_err(|e| CommError::io("spawn blob sink thread", &e))?
        };
        info!(%addr, root = %shared.root.display(), max_bytes, "blob sink listening");
        Ok(BlobSink {
            addr,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// The address the sink listens on (with the port it got when bound to port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The directory uploads land in.
    pub fn root(&self) -> &Path {
        &self.shared.root
    }

    /// Stops accepting, breaks off uploads in flight and joins every thread.
    pub fn stop(mut self) {
        self.shut();
    }

    fn shut(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(acceptor) = self.acceptor.take() {
            // The accept loop sees the flag within ACCEPT_POLL, shuts every connection down
            // (which wakes their blocked reads and writes) and joins their threads.
            if acceptor.join().is_err() {
                warn!(addr = %self.addr, "blob sink accept thread panicked");
            }
        }
    }
}

impl Drop for BlobSink {
    fn drop(&mut self) {
        self.shut();
    }
}

impl Shared {
    fn open(&self) -> MutexGuard<'_, HashMap<u64, TcpStream>> {
        // A panicking handler cannot leave the map half-updated (one insert or remove).
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    let mut handlers: Vec<JoinHandle<()>> = Vec::new();
    let mut next_id = 0u64;
    while !shared.stop.load(Ordering::Acquire) {
        handlers.retain(|h| !h.is_finished());
        match listener.accept() {
            Ok((stream, peer)) if handlers.len() >= MAX_CONNECTIONS => {
                warn!(%peer, limit = MAX_CONNECTIONS, "blob sink busy: connection closed");
                drop(stream);
            }
            Ok((stream, peer)) => {
                next_id += 1;
                match spawn_handler(shared, stream, peer, next_id) {
                    Ok(h) => handlers.push(h),
                    Err(e) => warn!(%peer, error = %e, "blob sink could not serve a connection"),
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(ACCEPT_POLL),
            Err(e) => {
                // E.g. out of file descriptors: keep serving the open connections.
                warn!(error = %e, "blob sink accept failed");
                std::thread::sleep(ACCEPT_POLL);
            }
        }
    }
    for s in shared.open().values() {
        let _ = s.shutdown(Shutdown::Both);
    }
    for h in handlers {
        let _ = h.join();
    }
}

fn spawn_handler(
    shared: &Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    id: u64,
) -> std::io::Result<JoinHandle<()>> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(IDLE))?;
    stream.set_write_timeout(Some(IDLE))?;
    stream.set_nodelay(true)?;
    // Registered before the thread starts, so a stop that comes later always sees it.
    shared.open().insert(id, stream.try_clone()?);
    let thread_shared = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name(format!("blob-conn-{id}"))
        .spawn(move || {
            serve(&thread_shared, stream, peer);
            thread_shared.open().remove(&id);
        });
    if spawned.is_err() {
        shared.open().remove(&id);
    }
    spawned
}

/// A refusal: the status and reason the client is told.
struct Refusal(Status, String);

impl Refusal {
    fn net(what: &str, e: &std::io::Error) -> Refusal {
        Refusal(Status::Short, format!("connection broke while {what}: {e}"))
    }
}

fn serve(shared: &Shared, mut stream: TcpStream, peer: SocketAddr) {
    let started = Instant::now();
    let mut name = String::new();
    let (status, message) = match receive(shared, &mut stream, &mut name) {
        Ok(len) => {
            let secs = started.elapsed().as_secs_f64();
            info!(%peer, name, bytes = len, secs, "blob stored");
            (Status::Ok, format!("stored {len} bytes"))
        }
        Err(Refusal(status, message)) => {
            warn!(%peer, name, ?status, reason = %message, "blob upload refused");
            (status, message)
        }
    };
    // The client may be gone (a short body); then there is no one left to tell.
    let _ = write_answer(&mut stream, status, &message);
}

/// One upload: checks the header, streams the body to the partial file, renames it.
/// Returns the stored length; `name` is set as soon as it is known (for the logs).
fn receive(shared: &Shared, s: &mut TcpStream, name: &mut String) -> Result<u64, Refusal> {
    let nonce = key::nonce();
    let hello = [&MAGIC[..], &VERSION.to_le_bytes(), &nonce].concat();
    s.write_all(&hello)
        .map_err(|e| Refusal::net("sending the hello", &e))?;
    let h = read_header(s)?;
    *name = String::from_utf8_lossy(&h.name).into_owned();
    let parts: [&[u8]; 5] = [LABEL, &nonce, &h.name, &h.len.to_le_bytes(), &h.sha256];
    if !shared.key.verify(&parts, &h.mac) {
        let why =
            "the MAC does not verify: the uploader was given another job's or generation's key";
        return Err(Refusal(Status::Unauthorized, why.into()));
    }
    let rel = check_name(&h.name).map_err(|why| Refusal(Status::BadName, why))?;
    if h.len > shared.max_bytes {
        let why = format!(
            "{} bytes exceed this sink's limit of {} bytes",
            h.len, shared.max_bytes
        );
        return Err(Refusal(Status::TooLarge, why));
    }
    let mut partial = Partial::create(shared, rel)?;
    write_answer(s, Status::Ok, "send the body").map_err(|e| Refusal::net("answering", &e))?;
    let sha = stream_body(s, partial.file(), h.len)?;
    if sha != h.sha256 {
        let why = "the body's SHA-256 differs from the header's: it was corrupted on the way";
        return Err(Refusal(Status::Checksum, why.into()));
    }
    partial.commit()?;
    Ok(h.len)
}

struct Header {
    name: Vec<u8>,
    len: u64,
    sha256: [u8; 32],
    mac: [u8; KEY_BYTES],
}

fn read_header(s: &mut TcpStream) -> Result<Header, Refusal> {
    let read = |s: &mut TcpStream, buf: &mut [u8]| {
        (s.read_exact(buf)).map_err(|e| Refusal::net("reading the header", &e))
    };
    let mut fixed = [0u8; 8];
    read(s, &mut fixed)?;
    let version = u16::from_le_bytes([fixed[4], fixed[5]]);
    if fixed[..4] != MAGIC || version != VERSION {
        let why = format!(
            "not a blob upload of version {VERSION} (magic {:02x?}, version {version})",
            &fixed[..4]
        );
        return Err(Refusal(Status::BadHeader, why));
    }
    let mut name = vec![0u8; usize::from(u16::from_le_bytes([fixed[6], fixed[7]]))];
    read(s, &mut name)?;
    let mut tail = [0u8; 8 + 32 + KEY_BYTES];
    read(s, &mut tail)?;
    Ok(Header {
        name,
        len: u64::from_le_bytes(tail[..8].try_into().expect("8 bytes")),
        sha256: tail[8..40].try_into().expect("32 bytes"),
        mac: tail[40..].try_into().expect("32 bytes"),
    })
}

/// Copies exactly `len` body bytes into `file`, returning their SHA-256.
fn stream_body(s: &mut TcpStream, file: &mut File, len: u64) -> Result<[u8; 32], Refusal> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; len.clamp(1, CHUNK as u64) as usize];
    let mut got = 0u64;
    while got < len {
        let want = (len - got).min(buf.len() as u64) as usize;
        let n = match s.read(&mut buf[..want]) {
            Ok(0) => {
                let why = format!("the connection closed after {got} of {len} body bytes");
                return Err(Refusal(Status::Short, why));
            }
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(Refusal::net(&format!("reading body byte {got}/{len}"), &e)),
        };
        hasher.update(&buf[..n]);
        file.write_all(&buf[..n])
            .map_err(|e| Refusal(Status::Disk, format!("writing the partial file: {e}")))?;
        got += n as u64;
    }
    Ok(hasher.finalize().into())
}

/// `root/<name>.partial` while its upload runs: the name is in the sink's `busy` set, and the
/// file is deleted on drop unless committed (before the name is freed, so a later upload of
/// it never shares the file).
struct Partial<'a> {
    busy: &'a Mutex<HashSet<PathBuf>>,
    rel: PathBuf,
    tmp: PathBuf,
    dest: PathBuf,
    file: Option<File>,
    committed: bool,
}

impl<'a> Partial<'a> {
    fn create(shared: &'a Shared, rel: PathBuf) -> Result<Partial<'a>, Refusal> {
        let disk = |what: String, e: std::io::Error| Refusal(Status::Disk, format!("{what}: {e}"));
        let busy = &shared.busy;
        if !busy
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(rel.clone())
        {
            let why = format!("another upload of {} is in progress", rel.display());
            return Err(Refusal(Status::Busy, why));
        }
        let dest = shared.root.join(&rel);
        let mut tmp = dest.clone().into_os_string();
        tmp.push(".partial");
        let mut p = Partial {
            busy,
            rel,
            tmp: PathBuf::from(tmp),
            dest,
            file: None,
            committed: false,
        };
        if let Some(dir) = p.dest.parent() {
            fs::create_dir_all(dir).map_err(|e| disk(format!("creating {}", dir.display()), e))?;
        }
        let file = File::create(&p.tmp);
        p.file = Some(file.map_err(|e| disk(format!("creating {}", p.tmp.display()), e))?);
        Ok(p)
    }

    fn file(&mut self) -> &mut File {
        self.file
            .as_mut()
            .expect("create returns a Partial only with its file open")
    }

    /// fsync, rename to the final name, fsync the directory so the rename survives a crash.
    fn commit(mut self) -> Result<(), Refusal> {
        let disk = |what: &str, p: &Path, e: std::io::Error| {
            Refusal(Status::Disk, format!("{what} {}: {e}", p.display()))
        };
        let synced = self.file().sync_all();
        synced.map_err(|e| disk("fsync of", &self.tmp, e))?;
        fs::rename(&self.tmp, &self.dest).map_err(|e| disk("rename to", &self.dest, e))?;
        self.committed = true;
        if let Some(dir) = self.dest.parent() {
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| disk("fsync of", dir, e))?;
        }
        Ok(())
    }
}

impl Drop for Partial<'_> {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_file(&self.tmp);
        }
        let mut busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        busy.remove(&self.rel);
    }
}

/// A name as the sink accepts it: a relative path of normal components, which it stores
/// under its root. Returns the reason (saying what a name must look like) otherwise.
fn check_name(raw: &[u8]) -> Result<PathBuf, String> {
    let rule = "a blob name is a relative path of 1 to 255 bytes of UTF-8 whose '/'-separated \
                components are not empty, '.' or '..', with no NUL, backslash or control \
                characters and not ending in '.partial' (e.g. 'gen-3/stage-1/params.safetensors')";
    let got = String::from_utf8_lossy(raw);
    let bad = |why: &str| Err(format!("{rule}; got {got:?}: {why}"));
    let Ok(name) = std::str::from_utf8(raw) else {
        return bad("not UTF-8");
    };
    if name.is_empty() || name.len() > MAX_NAME_BYTES {
        return bad(&format!("{} bytes", name.len()));
    }
    if name.starts_with('/') {
        return bad("absolute");
    }
    if let Some(c) = name.chars().find(|&c| c.is_control() || c == '\\') {
        return bad(&format!("contains {c:?}"));
    }
    if let Some(c) = name
        .split('/')
        .find(|c| c.is_empty() || *c == "." || *c == "..")
    {
        return bad(&format!("has a component {c:?}"));
    }
    if name.ends_with(".partial") {
        return bad("ends in '.partial', the suffix of files being uploaded");
    }
    // What is left has only `Component::Normal`s: it stays under the root it is joined to.
    Ok(PathBuf::from(name))
}

fn write_answer(s: &mut TcpStream, status: Status, message: &str) -> std::io::Result<()> {
    let mut end = message.len().min(MAX_MESSAGE);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    let len = (end as u16).to_le_bytes();
    s.write_all(&[&[status as u8][..], &len, &message.as_bytes()[..end]].concat())?;
    s.flush()
}

/// Uploads `bytes` as `name` to the [`BlobSink`] at `addr`. Returns once the sink has the
/// whole file on disk under its final name, so the caller can then tell the master it is there.
/// `timeout` bounds the whole call; the sink's refusals carry its reason.
pub fn send_blob(
    addr: SocketAddr,
    key: &SecretKey,
    name: &str,
    bytes: &[u8],
    timeout: Duration,
) -> Result<BlobReceipt> {
    let start = Instant::now();
    let name_len = u16::try_from(name.len()).map_err(|_| {
        CommError::Invalid(format!(
            "blob name of {} bytes (at most {MAX_NAME_BYTES})",
            name.len()
        ))
    })?;
    let mut up = Upload {
        sink: addr,
        name,
        len: bytes.len() as u64,
        sent: 0,
        timeout,
        deadline: start + timeout,
    };
    let sha256: [u8; 32] = Sha256::digest(bytes).into();
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(|e| up.fail("connect", &e))?;
    let _ = s.set_nodelay(true);
    let mut hello = [0u8; HELLO_LEN];
    let what = "reading the sink's hello (a sink serving its limit of uploads closes new ones)";
    up.read(&mut s, &mut hello, what)?;
    if hello[..4] != MAGIC || hello[4..6] != VERSION.to_le_bytes() {
        return Err(up.broken(format!(
            "the peer is not a blob sink of version {VERSION} (hello starts {:02x?})",
            &hello[..6]
        )));
    }
    let nonce = &hello[6..];
    let len = up.len.to_le_bytes();
    let mac = key.mac(&[LABEL, nonce, name.as_bytes(), &len, &sha256]);
    let (version, name_len) = (VERSION.to_le_bytes(), name_len.to_le_bytes());
    let header = [
        &MAGIC[..],
        &version,
        &name_len,
        name.as_bytes(),
        &len,
        &sha256,
        &mac,
    ];
    up.write(&mut s, &header.concat())?;
    up.answer(&mut s)?;
    for chunk in bytes.chunks(CHUNK) {
        up.write(&mut s, chunk)?;
        up.sent += chunk.len() as u64;
    }
    up.answer(&mut s)?;
    Ok(BlobReceipt {
        bytes: up.len,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The client's side of one upload: every read and write stops at `deadline`.
struct Upload<'a> {
    sink: SocketAddr,
    name: &'a str,
    len: u64,
    sent: u64,
    timeout: Duration,
    deadline: Instant,
}

impl Upload<'_> {
    fn broken(&self, reason: String) -> CommError {
        CommError::BlobTransfer {
            sink: self.sink,
            name: self.name.to_string(),
            sent: self.sent,
            len: self.len,
            reason,
        }
    }

    fn fail(&self, what: &str, e: &std::io::Error) -> CommError {
        let reason = match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => {
                format!("{what}: past the upload's timeout of {:?}", self.timeout)
            }
            _ => format!("{what}: {e}"),
        };
        self.broken(reason)
    }

    /// The time left, or a timeout error once it is spent.
    fn left(&self, what: &str) -> Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.fail(what, &ErrorKind::TimedOut.into()));
        }
        Ok(left)
    }

    fn read(&self, s: &mut TcpStream, mut buf: &mut [u8], what: &str) -> Result<()> {
        while !buf.is_empty() {
            s.set_read_timeout(Some(self.left(what)?))
                .map_err(|e| self.fail(what, &e))?;
            match s.read(buf) {
                Ok(0) => return Err(self.fail(what, &ErrorKind::UnexpectedEof.into())),
                Ok(n) => buf = &mut buf[n..],
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(self.fail(what, &e)),
            }
        }
        Ok(())
    }

    /// Writes `buf`; if the sink broke the connection off, returns its reason when it gave one.
    fn write(&self, s: &mut TcpStream, mut buf: &[u8]) -> Result<()> {
        while !buf.is_empty() {
            s.set_write_timeout(Some(self.left("sending")?))
                .map_err(|e| self.fail("sending", &e))?;
            match s.write(buf) {
                Ok(0) => return Err(self.fail("sending", &ErrorKind::WriteZero.into())),
                Ok(n) => buf = &buf[n..],
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    // A sink that refuses mid-body (a disk error) answers, then closes.
                    let err = self.fail("sending", &e);
                    return Err(match self.answer(s) {
                        Err(refused @ CommError::BlobRefused { .. }) => refused,
                        _ => err,
                    });
                }
            }
        }
        Ok(())
    }

    /// Reads one answer: `Ok` for status 0, else the sink's refusal.
    fn answer(&self, s: &mut TcpStream) -> Result<()> {
        let what = "reading the sink's answer";
        let mut head = [0u8; 3];
        self.read(s, &mut head, what)?;
        let mut msg = vec![0u8; usize::from(u16::from_le_bytes([head[1], head[2]]))];
        self.read(s, &mut msg, what)?;
        let message = String::from_utf8_lossy(&msg).into_owned();
        let (sink, name) = (self.sink, self.name.to_string());
        match head[0] {
            0 => Ok(()),
            s if s == Status::Unauthorized as u8 => Err(CommError::BlobUnauthorized { sink, name }),
            _ => Err(CommError::BlobRefused {
                sink,
                name,
                message,
            }),
        }
    }
}
