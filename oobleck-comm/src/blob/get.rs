//! Downloads and listings: the sink resolves a name under its root and streams the file, or
//! lists a directory's files; [`fetch_blob`], [`list_blobs`] and [`fetch_dir`] ask for them.

use std::fs::{self, File};
use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::client::{Call, Client};
use super::put::partial_path;
use super::wire::{answer, check_name, BlobOp, Refusal, Request, Status, MAX_NAME_BYTES};
use super::{Shared, CHUNK, MAX_LIST};
use crate::error::{CommError, Result};
use crate::key::SecretKey;

/// The sink's side of a get whose request is checked: answers the file's length, SHA-256 and
/// MAC, then streams it in chunks from the handle it hashed. `streaming` is set once the
/// answer is out: from then on a failure can only close the connection, not be answered.
pub(super) fn send_file(
    shared: &Shared,
    s: &mut TcpStream,
    req: &Request,
    sink_nonce: &[u8],
    rel: &Path,
    streaming: &mut bool,
) -> Result<u64, Refusal> {
    let path = resolve(shared, rel, Want::File)?;
    let disk = |what: &str, e: std::io::Error| {
        Refusal(Status::Disk, format!("{what} {}: {e}", rel.display()))
    };
    let mut file = File::open(&path).map_err(|e| disk("opening", e))?;
    let mut buf = vec![0u8; CHUNK];
    let (len, sha) = hash_file(&mut file, &mut buf).map_err(|e| disk("reading", e))?;
    file.seek(SeekFrom::Start(0))
        .map_err(|e| disk("rewinding", e))?;
    let len_le = len.to_le_bytes();
    let mac = req.answer_mac(&shared.key, sink_nonce, &[&len_le, &sha]);
    let ok = answer(Status::Ok, &format!("sending {len} bytes"));
    *streaming = true;
    s.write_all(&[&ok[..], &len_le, &sha, &mac].concat())
        .map_err(|e| Refusal::net("sending the answer", &e))?;
    let mut sent = 0u64;
    while sent < len {
        let want = (len - sent).min(CHUNK as u64) as usize;
        let n = match file.read(&mut buf[..want]) {
            Ok(0) => {
                let why = format!("{} shrank to {sent} of {len} bytes", rel.display());
                return Err(Refusal(Status::Disk, why));
            }
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(disk("reading", e)),
        };
        (s.write_all(&buf[..n]))
            .map_err(|e| Refusal::net(&format!("sending body byte {sent}/{len}"), &e))?;
        sent += n as u64;
    }
    s.flush()
        .map_err(|e| Refusal::net("sending the body", &e))?;
    Ok(len)
}

/// Length and SHA-256 of what `file` holds from its position on.
fn hash_file(file: &mut File, buf: &mut [u8]) -> std::io::Result<(u64, [u8; 32])> {
    let mut hasher = Sha256::new();
    let mut len = 0u64;
    loop {
        match file.read(buf) {
            Ok(0) => return Ok((len, hasher.finalize().into())),
            Ok(n) => {
                hasher.update(&buf[..n]);
                len += n as u64;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// The sink's side of a list whose request is checked: the files `list_files` finds, with
/// the MAC over them.
pub(super) fn send_list(
    shared: &Shared,
    s: &mut TcpStream,
    req: &Request,
    sink_nonce: &[u8],
    rel: &Path,
) -> Result<usize, Refusal> {
    let dir = resolve(shared, rel, Want::Dir)?;
    let names = list_files(shared, rel, &dir)?;
    let mut payload = (names.len() as u32).to_le_bytes().to_vec();
    for n in &names {
        payload.extend_from_slice(&(n.len() as u16).to_le_bytes());
        payload.extend_from_slice(n.as_bytes());
    }
    let mac = req.answer_mac(&shared.key, sink_nonce, &[&payload]);
    let ok = answer(Status::Ok, &format!("listing {} files", names.len()));
    s.write_all(&[&ok[..], &payload, &mac].concat())
        .and_then(|()| s.flush())
        .map_err(|e| Refusal::net("sending the listing", &e))?;
    Ok(names.len())
}

/// The names (`rel/<file>`, sorted) of the entries of `dir` that a get of them would serve:
/// valid names that resolve to regular files inside the root. Subdirectories, `.partial`
/// files of uploads in flight and links out of the root are left out.
fn list_files(shared: &Shared, rel: &Path, dir: &Path) -> Result<Vec<String>, Refusal> {
    let disk = |e: std::io::Error| Refusal(Status::Disk, format!("listing {}: {e}", rel.display()));
    let rel = rel.to_str().expect("check_name accepts only UTF-8 names");
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).map_err(disk)? {
        let entry = entry.map_err(disk)?;
        let Some(base) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        let name = format!("{rel}/{base}");
        let Ok(path) = check_name(name.as_bytes()) else {
            continue;
        };
        if resolve(shared, &path, Want::File).is_ok() {
            names.push(name);
        }
        if names.len() > MAX_LIST {
            let why = format!("{rel} holds more than {MAX_LIST} files, the most a listing sends");
            return Err(Refusal(Status::TooLarge, why));
        }
    }
    names.sort();
    Ok(names)
}

#[derive(Clone, Copy, PartialEq)]
enum Want {
    File,
    Dir,
}

/// `root/rel` with every symbolic link followed, if it is inside the root and of the kind
/// wanted. (The root's writers are the sink and the master, so the check and the open that
/// follows it do not race an adversary.)
fn resolve(shared: &Shared, rel: &Path, want: Want) -> Result<PathBuf, Refusal> {
    let shown = rel.display();
    let real = match fs::canonicalize(shared.root.join(rel)) {
        Ok(real) => real,
        Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::NotADirectory) => {
            return Err(Refusal(
                Status::NotFound,
                format!("no {shown} under the root"),
            ));
        }
        Err(e) => return Err(Refusal(Status::Disk, format!("resolving {shown}: {e}"))),
    };
    if !real.starts_with(&shared.real_root) {
        let why = format!("{shown} is a symbolic link (or under one) that leads out of the root");
        return Err(Refusal(Status::BadName, why));
    }
    let meta = fs::metadata(&real)
        .map_err(|e| Refusal(Status::Disk, format!("reading metadata of {shown}: {e}")))?;
    match want {
        Want::File if !meta.is_file() => {
            let why = format!("{shown} is not a regular file (to fetch a directory, list it)");
            Err(Refusal(Status::BadName, why))
        }
        Want::Dir if !meta.is_dir() => Err(Refusal(
            Status::BadName,
            format!("{shown} is not a directory"),
        )),
        _ => Ok(real),
    }
}

fn call(
    addr: SocketAddr,
    op: BlobOp,
    name: &str,
    timeout: Duration,
    deadline: Instant,
) -> Call<'_> {
    Call {
        sink: addr,
        op,
        name,
        timeout,
        deadline,
        done: 0,
        len: 0,
    }
}

/// Downloads file `name` (relative to the sink's root) from the [`super::BlobSink`] at `addr`.
/// The bytes are checked against the length and SHA-256 the sink announced under its MAC, so
/// what is returned is the file as the key's holder had it. `timeout` bounds the whole call;
/// a missing file is [`CommError::BlobNotFound`], other failures [`CommError::BlobFetch`].
pub fn fetch_blob(
    addr: SocketAddr,
    key: &SecretKey,
    name: &str,
    timeout: Duration,
) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    let deadline = Instant::now() + timeout;
    fetch_into(
        call(addr, BlobOp::Get, name, timeout, deadline),
        key,
        &mut out,
    )?;
    Ok(out)
}

/// Streams one download into `out`, returning its length once length and hash match.
fn fetch_into(call: Call<'_>, key: &SecretKey, out: &mut dyn Write) -> Result<u64> {
    let mut c = Client::open(call, key, 0, [0; 32])?;
    c.answer()?;
    let mut head = [0u8; 8 + 32];
    c.read(&mut head, "reading the file's length and SHA-256")?;
    let (len_le, sha) = head.split_at(8);
    c.check_answer_mac(key, &[len_le, sha])?;
    let len = u64::from_le_bytes(len_le.try_into().expect("8 bytes"));
    c.call.len = len;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; len.clamp(1, CHUNK as u64) as usize];
    while c.call.done < len {
        let want = (len - c.call.done).min(buf.len() as u64) as usize;
        let what = format!("reading the body (byte {} of {len})", c.call.done);
        c.read(&mut buf[..want], &what)?;
        hasher.update(&buf[..want]);
        out.write_all(&buf[..want])
            .map_err(|e| CommError::io(format!("writing the download of {:?}", c.call.name), &e))?;
        c.call.done += want as u64;
    }
    if hasher.finalize()[..] != *sha {
        return Err(c.call.broken(
            "the body's SHA-256 differs from the one the sink announced: it was corrupted on \
             the way, and nothing was kept"
                .into(),
        ));
    }
    Ok(len)
}

/// The regular files directly in directory `dir_name` (relative to the sink's root) of the
/// [`super::BlobSink`] at `addr`: their names relative to the root (`dir_name/<file>`),
/// sorted. Files of uploads in flight are not listed. `timeout` bounds the whole call.
pub fn list_blobs(
    addr: SocketAddr,
    key: &SecretKey,
    dir_name: &str,
    timeout: Duration,
) -> Result<Vec<String>> {
    let deadline = Instant::now() + timeout;
    list_in(call(addr, BlobOp::List, dir_name, timeout, deadline), key)
}

fn list_in(call: Call<'_>, key: &SecretKey) -> Result<Vec<String>> {
    let mut c = Client::open(call, key, 0, [0; 32])?;
    c.answer()?;
    let what = "reading the listing";
    let mut count = [0u8; 4];
    c.read(&mut count, what)?;
    let n = u32::from_le_bytes(count) as usize;
    if n > MAX_LIST {
        let why = format!("the listing claims {n} files, more than the {MAX_LIST} a sink sends");
        return Err(c.call.broken(why));
    }
    let mut payload = count.to_vec();
    let mut names = Vec::with_capacity(n);
    for _ in 0..n {
        let mut len = [0u8; 2];
        c.read(&mut len, what)?;
        let len_n = usize::from(u16::from_le_bytes(len));
        if len_n > MAX_NAME_BYTES {
            return Err(c
                .call
                .broken(format!("the listing holds a name of {len_n} bytes")));
        }
        let mut name = vec![0u8; len_n];
        c.read(&mut name, what)?;
        payload.extend_from_slice(&len);
        payload.extend_from_slice(&name);
        names.push(name);
    }
    c.check_answer_mac(key, &[&payload])?;
    names.into_iter().map(|n| listed_name(&c.call, n)).collect()
}

/// A listed name as [`fetch_dir`] may use it: a valid name directly in the listed directory.
fn listed_name(call: &Call<'_>, raw: Vec<u8>) -> Result<String> {
    if let Err(why) = check_name(&raw) {
        return Err(call.broken(format!("the listing holds a bad name: {why}")));
    }
    let name = String::from_utf8(raw).expect("check_name accepts only UTF-8 names");
    let base = name
        .strip_prefix(call.name)
        .and_then(|rest| rest.strip_prefix('/'));
    match base {
        Some(base) if !base.contains('/') => Ok(name),
        _ => Err(call.broken(format!(
            "the listing names {name:?}, which is not directly in {:?}",
            call.name
        ))),
    }
}

/// Downloads every file [`list_blobs`] lists in `dir_name` into `local_dir` (created if
/// missing), each under its own file name, written to `<file>.partial`, fsynced and renamed,
/// so a failure leaves no partial file under a final name. `timeout` bounds the whole call,
/// all files together. Returns the bytes fetched.
pub fn fetch_dir(
    addr: SocketAddr,
    key: &SecretKey,
    dir_name: &str,
    local_dir: &Path,
    timeout: Duration,
) -> Result<u64> {
    let deadline = Instant::now() + timeout;
    let names = list_in(call(addr, BlobOp::List, dir_name, timeout, deadline), key)?;
    let io = |what: &str, p: &Path, e: std::io::Error| {
        CommError::io(format!("{what} {}", p.display()), &e)
    };
    fs::create_dir_all(local_dir).map_err(|e| io("creating", local_dir, e))?;
    let mut total = 0;
    for name in &names {
        let base = name
            .rsplit('/')
            .next()
            .expect("rsplit yields at least one piece");
        let dest = local_dir.join(base);
        total += fetch_file(call(addr, BlobOp::Get, name, timeout, deadline), key, &dest)?;
    }
    File::open(local_dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io("fsync of", local_dir, e))?;
    Ok(total)
}

/// One download to `dest` by way of `dest.partial`, which is removed on any failure.
fn fetch_file(call: Call<'_>, key: &SecretKey, dest: &Path) -> Result<u64> {
    let io = |what: &str, p: &Path, e: std::io::Error| {
        CommError::io(format!("{what} {}", p.display()), &e)
    };
    let tmp = partial_path(dest);
    let mut file = File::create(&tmp).map_err(|e| io("creating", &tmp, e))?;
    let fetched = fetch_into(call, key, &mut file).and_then(|len| {
        file.sync_all().map_err(|e| io("fsync of", &tmp, e))?;
        fs::rename(&tmp, dest).map_err(|e| io("rename to", dest, e))?;
        Ok(len)
    });
    if fetched.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    fetched
}
