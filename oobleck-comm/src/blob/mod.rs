//! Authenticated file transfer with the master's run directory, so workers need no shared file
//! system. [`BlobSink`] listens on the master and serves one request per connection: an
//! upload ([`send_blob`]: a worker's safetensors state), a download ([`fetch_blob`]) or a
//! listing of a directory's files ([`list_blobs`]; [`fetch_dir`] lists and downloads them all,
//! e.g. every worker loading `checkpoints/step-000004/` when the job falls back to it).
//!
//! Every integer is little-endian:
//!
//! ```text
//!  sink -> client  hello    | magic "OBKB" [4] | version u16 = 2 | nonce [32]                 |
//!  client -> sink  request  | magic "OBKB" [4] | version u16 = 2 | op u8 | cnonce [32]       |
//!                           | name_len u16 | name [name_len] | len u64 | sha256 [32] | mac [32] |
//!  sink -> client  answer   | status u8 | msg_len u16 | msg [msg_len] (UTF-8)                |
//!
//!  op 1, put:  client -> sink  body     | len bytes                    (only after status 0) |
//!              sink -> client  answer   | status u8 | msg_len u16 | msg   (0 = stored, renamed) |
//!  op 2, get:  after status 0, sink -> client
//!                              file     | len u64 | sha256 [32] | mac [32] | body [len]       |
//!  op 3, list: after status 0, sink -> client
//!                              listing  | count u32 | count x (name_len u16 | name) | mac [32] |
//! ```
//!
//! * Request: `mac = key.mac(["oobleck-blob", nonce, op, cnonce, name, len, sha256])`. The
//!   sink's fresh nonce makes a recorded request useless to replay; the MAC binds the
//!   operation and the name, so an upload's header cannot pass for a download or a listing
//!   (nor the reverse), and the length and hash, so an upload cannot be altered. A get or a
//!   list sends `len` 0 and `sha256` 0. The body of an upload is vouched for by the hash.
//! * Answers to get and list carry `mac = key.mac(["oobleck-sink", cnonce, nonce, op,
//!   name_len, name, payload])`, the payload being `len | sha256` or the listing from `count`
//!   on. The client's fresh `cnonce` makes the sink prove it holds the key too, so a worker
//!   never loads a file from something else that answers at the master's address.
//! * The sink checks, in this order, the magic and version (version 1, uploads only, is
//!   refused with a message naming both versions), the operation, the MAC, the zeros of a
//!   get or list, and the name (a relative path of plain components; no `..`, no absolute
//!   path, not ending in `.partial`), and answers a refusal (status != 0, with the reason)
//!   instead of the first status 0. Statuses: 0 ok, 1 bad header, 2 bad MAC, 3 bad name,
//!   4 too large, 5 name being uploaded by another connection, 6 SHA-256 mismatch,
//!   7 connection broke, 8 disk error on the sink, 9 not found.
//! * Put: `len <= max_bytes` is checked before any body is read. The body is streamed to
//!   `root/<name>.partial` in chunks while hashed; on a hash mismatch, a short body, a closed
//!   connection or a stop of the sink the partial file is deleted and nothing appears under
//!   the final name. Otherwise the file is fsynced and renamed to `root/<name>` (replacing an
//!   older file) before the final status 0 is sent.
//! * Get: `root/<name>` with symbolic links followed must be a regular file inside the root
//!   (else bad name; missing: not found). The sink hashes it and then streams it, in chunks,
//!   from one open handle; as uploads replace files by rename, a get sees an old or a new file
//!   whole, and a file whose first upload is in flight does not exist yet. The client checks
//!   the MAC, then the length and SHA-256 of the body. A failure after status 0 closes the
//!   connection (no answer can follow a body that was started).
//! * List: the regular files directly in `root/<name>` that a get would serve (no
//!   subdirectories, no `.partial` files), as names relative to the root, sorted, at most
//!   65 536 of them.
//! * Every read and write has a timeout: the client's is its deadline for the whole call;
//!   the sink gives up on a connection after 60 s without progress, and serves at most 64
//!   connections at once (closing further ones at once).

mod client;
mod get;
mod put;
mod wire;

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io::{ErrorKind, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{info, warn};

pub use get::{fetch_blob, fetch_dir, list_blobs};
pub use put::send_blob;

use crate::error::{CommError, Result};
use crate::key::{self, SecretKey};
use wire::{check_name, write_answer, BlobOp, Refusal, Status};

/// The sink drops a connection after this long without a byte read or written.
const IDLE: Duration = Duration::from_secs(60);
/// Body bytes read or written per call: bounds the memory of each transfer.
const CHUNK: usize = 1 << 20;
/// Connections served at once; further connections are closed at once (a worker retries).
const MAX_CONNECTIONS: usize = 64;
/// Most files in one listing (its names take at most 16.8 MB).
const MAX_LIST: usize = 1 << 16;
/// How often the accept loop looks at the stop flag.
const ACCEPT_POLL: Duration = Duration::from_millis(10);

/// What a successful [`send_blob`] measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlobReceipt {
    /// Bytes of the file now on the sink's disk.
    pub bytes: u64,
    /// Seconds from the call to the sink's final answer (hashing and fsync included).
    pub seconds: f64,
}

/// Serves uploads into, and downloads and listings from, a directory. Each connection is
/// served on its own thread, so a slow or silent client never holds up another. Dropping it
/// (or [`BlobSink::stop`]) closes the listener and every open connection, deletes their
/// partial files and joins the threads.
pub struct BlobSink {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

struct Shared {
    key: SecretKey,
    root: PathBuf,
    /// `root` with its symbolic links resolved: what a get's resolved path must start with.
    real_root: PathBuf,
    max_bytes: u64,
    stop: AtomicBool,
    /// A clone of every open connection, so `stop` can shut them down mid-read.
    open: Mutex<HashMap<u64, TcpStream>>,
    /// Names being uploaded now: a second upload of one of them is refused, not interleaved.
    busy: Mutex<HashSet<PathBuf>>,
}

impl BlobSink {
    /// Listens on `addr` (port 0 picks a free port, see [`BlobSink::addr`]) and serves the
    /// files under `root` (created if missing); each upload is at most `max_bytes` long.
    pub fn bind(addr: SocketAddr, key: SecretKey, root: PathBuf, max_bytes: u64) -> Result<Self> {
        fs::create_dir_all(&root)
            .map_err(|e| CommError::io(format!("create blob root {}", root.display()), &e))?;
        let real_root = fs::canonicalize(&root)
            .map_err(|e| CommError::io(format!("resolve blob root {}", root.display()), &e))?;
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
            real_root,
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

    /// The directory uploads land in and downloads come from.
    pub fn root(&self) -> &Path {
        &self.shared.root
    }

    /// Stops accepting, breaks off transfers in flight and joins every thread.
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

/// What one connection asked for and how far it got, for the log and the last answer.
struct Served {
    op: Option<BlobOp>,
    name: String,
    /// A get's body has started: a failure now can only close the connection.
    streaming: bool,
}

fn serve(shared: &Shared, mut stream: TcpStream, peer: SocketAddr) {
    let started = Instant::now();
    let mut req = Served {
        op: None,
        name: String::new(),
        streaming: false,
    };
    let result = handle(shared, &mut stream, &mut req);
    let (op, name) = (req.op.map(BlobOp::noun), req.name.as_str());
    match result {
        Ok(n) => {
            let secs = started.elapsed().as_secs_f64();
            info!(%peer, op, name, n, secs, "blob request served");
            if req.op == Some(BlobOp::Put) {
                let _ = write_answer(&mut stream, Status::Ok, &format!("stored {n} bytes"));
            }
        }
        Err(Refusal(status, message)) => {
            warn!(%peer, op, name, ?status, reason = %message, "blob request refused");
            // The client may be gone (a short body); then there is no one left to tell. After
            // a get's body started, an answer would be read as body bytes: only close.
            if !req.streaming {
                let _ = write_answer(&mut stream, status, &message);
            }
        }
    }
}

/// One request: the hello, the request's checks, then the operation. Returns what it moved
/// (bytes stored or sent, or files listed); `req` is filled in as soon as each part is known.
fn handle(shared: &Shared, s: &mut TcpStream, req: &mut Served) -> Result<u64, Refusal> {
    let nonce = key::nonce();
    (s.write_all(&wire::hello(&nonce))).map_err(|e| Refusal::net("sending the hello", &e))?;
    let r = wire::read_request(s)?;
    req.op = Some(r.op);
    req.name = String::from_utf8_lossy(&r.name).into_owned();
    if !r.verifies(&shared.key, &nonce) {
        let why = "the MAC does not verify: the client was given another job's or generation's key";
        return Err(Refusal(Status::Unauthorized, why.into()));
    }
    if r.op != BlobOp::Put && (r.len != 0 || r.sha256 != [0; 32]) {
        let why = format!("a {} request carries length 0 and hash 0", r.op.noun());
        return Err(Refusal(Status::BadHeader, why));
    }
    let rel = check_name(&r.name).map_err(|why| Refusal(Status::BadName, why))?;
    match r.op {
        BlobOp::Put => put::receive(shared, s, &r, rel),
        BlobOp::Get => get::send_file(shared, s, &r, &nonce, &rel, &mut req.streaming),
        BlobOp::List => get::send_list(shared, s, &r, &nonce, &rel).map(|n| n as u64),
    }
}
