//! Uploads: the sink streams a body to `<name>.partial` and renames it; [`send_blob`] sends it.

use std::collections::HashSet;
use std::fs::{self, File};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::client::{Call, Client};
use super::wire::{write_answer, BlobOp, Refusal, Request, Status};
use super::{BlobReceipt, Shared, CHUNK};
use crate::error::Result;
use crate::key::SecretKey;

/// The sink's side of an upload whose request is checked (MAC, name): refuses a body over
/// `max_bytes`, streams the body to the partial file and renames it. Returns the stored length.
pub(super) fn receive(
    shared: &Shared,
    s: &mut TcpStream,
    h: &Request,
    rel: PathBuf,
) -> Result<u64, Refusal> {
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
        let mut p = Partial {
            busy,
            rel,
            tmp: partial_path(&dest),
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

/// `<path>.partial`: where a file is written before it is renamed to `path`.
pub(super) fn partial_path(path: &Path) -> PathBuf {
    let mut tmp = path.to_path_buf().into_os_string();
    tmp.push(".partial");
    PathBuf::from(tmp)
}

/// Uploads `bytes` as `name` to the [`super::BlobSink`] at `addr`. Returns once the sink has
/// the whole file on disk under its final name, so the caller can then tell the master it is
/// there. `timeout` bounds the whole call; the sink's refusals carry its reason.
pub fn send_blob(
    addr: SocketAddr,
    key: &SecretKey,
    name: &str,
    bytes: &[u8],
    timeout: Duration,
) -> Result<BlobReceipt> {
    let start = Instant::now();
    let call = Call {
        sink: addr,
        op: BlobOp::Put,
        name,
        timeout,
        deadline: start + timeout,
        done: 0,
        len: bytes.len() as u64,
    };
    let sha256: [u8; 32] = Sha256::digest(bytes).into();
    let mut c = Client::open(call, key, bytes.len() as u64, sha256)?;
    c.answer()?;
    for chunk in bytes.chunks(CHUNK) {
        c.write(chunk)?;
        c.call.done += chunk.len() as u64;
    }
    c.answer()?;
    Ok(BlobReceipt {
        bytes: bytes.len() as u64,
        seconds: start.elapsed().as_secs_f64(),
    })
}
