//! Shared-memory segments: files under `/dev/shm`, mapped by two or more ranks of one host.
//!
//! ```text
//!   name  oobleck-<creator pid>-g<generation>-<what>-<nonce, 32 hex>
//!   life  created O_EXCL, 0600, fully allocated (no SIGBUS on a full tmpfs) ──▶ name sent over
//!         the authenticated TCP connection ──▶ every user maps it ──▶ unlinked at once
//! ```
//!
//! A name is never guessed or reused: it carries a fresh nonce, and a new generation only maps
//! the names its peers sent it, so a segment left by an old or killed process is never joined.
//! Such leftovers (the creator died between create and unlink) are removed by the next creator
//! on this host once their pid is gone ([`remove_stale`]).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU32;
use std::time::Duration;

use memmap2::{MmapOptions, MmapRaw};
use tracing::{debug, warn};

/// Where segments live (tmpfs on Linux).
pub(crate) const SHM_DIR: &str = "/dev/shm";
/// Prefix of every segment name of this crate.
pub(crate) const PREFIX: &str = "oobleck-";

/// A mapped segment. The mapping stays valid after the file is unlinked and after the other
/// users exit; its bytes are only touched through atomics or under the protocol of its user
/// (ring, all-reduce scratch).
pub(crate) struct Segment {
    map: MmapRaw,
    path: PathBuf,
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Segment({}, {} bytes)",
            self.path.display(),
            self.map.len()
        )
    }
}

impl Segment {
    /// Creates a new segment of `len` bytes named for `generation` and `what` (a short tag
    /// of `[a-z0-9-]`), and maps it. The file exists until [`Segment::unlink`].
    pub fn create(generation: u64, what: &str, len: usize) -> std::io::Result<Segment> {
        let nonce = crate::key::nonce();
        let hex: String = nonce[..16].iter().map(|b| format!("{b:02x}")).collect();
        let name = format!("{PREFIX}{}-g{generation}-{what}-{hex}", std::process::id());
        let path = Path::new(SHM_DIR).join(&name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        let seg = (|| {
            allocate(&file, len)?;
            let map = MmapOptions::new().len(len).map_raw(&file)?;
            Ok(Segment {
                map,
                path: path.clone(),
            })
        })();
        if seg.is_err() {
            let _ = std::fs::remove_file(&path);
        }
        seg
    }

    /// Maps the segment `name` (a bare file name a peer sent) of at least `min_len` bytes.
    pub fn open(name: &str, min_len: usize) -> std::io::Result<Segment> {
        if !valid_name(name) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{name:?} is not an oobleck segment name"),
            ));
        }
        let path = Path::new(SHM_DIR).join(name);
        let file = OpenOptions::new().read(true).write(true).open(&path)?;
        let len = file.metadata()?.len() as usize;
        if len < min_len {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("segment {name} has {len} bytes, expected at least {min_len}"),
            ));
        }
        let map = MmapOptions::new().len(len).map_raw(&file)?;
        Ok(Segment { map, path })
    }

    /// The file name to send to the peers.
    pub fn name(&self) -> &str {
        self.path
            .file_name()
            .and_then(|n| n.to_str())
            .expect("created from a UTF-8 name")
    }

    /// Removes the file; the mappings stay. Idempotent.
    pub fn unlink(&self) {
        match std::fs::remove_file(&self.path) {
            Ok(()) => debug!(path = %self.path.display(), "segment unlinked"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => warn!(path = %self.path.display(), error = %e, "cannot unlink segment"),
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// The 4-byte-aligned word at `offset`, as an atomic shared with the other users.
    pub fn atomic_u32(&self, offset: usize) -> &AtomicU32 {
        assert!(
            offset % 4 == 0 && offset + 4 <= self.len(),
            "word inside the mapping"
        );
        // SAFETY: in bounds and aligned (mappings are page-aligned); the memory lives as long
        // as `self`, and every user of this word accesses it atomically.
        unsafe { &*(self.ptr().add(offset) as *const AtomicU32) }
    }

    /// The 8-byte-aligned word at `offset`, as an atomic shared with the other users.
    pub fn atomic_u64(&self, offset: usize) -> &std::sync::atomic::AtomicU64 {
        assert!(
            offset % 8 == 0 && offset + 8 <= self.len(),
            "word inside the mapping"
        );
        // SAFETY: as for `atomic_u32`.
        unsafe { &*(self.ptr().add(offset) as *const std::sync::atomic::AtomicU64) }
    }
}

/// Reserves every page now, so a full tmpfs is an error here rather than a SIGBUS later.
fn allocate(file: &File, len: usize) -> std::io::Result<()> {
    let len = libc::off_t::try_from(len)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "segment too large"))?;
    // SAFETY: a valid open file descriptor.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

fn valid_name(name: &str) -> bool {
    name.starts_with(PREFIX)
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// The creator pid a segment name carries, if it is one of ours.
pub(crate) fn creator_pid(name: &str) -> Option<i32> {
    if !valid_name(name) {
        return None;
    }
    name[PREFIX.len()..].split('-').next()?.parse().ok()
}

/// True when no process `pid` exists (EPERM means it exists under another user).
fn pid_is_gone(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks for existence.
    let rc = unsafe { libc::kill(pid, 0) };
    rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// Removes the segments in `dir` whose creator is gone; returns how many. Segments of live
/// processes (ours included) are left alone; ones we may not remove are skipped.
pub(crate) fn remove_stale(dir: &Path) -> usize {
    let removed = remove_dead(dir);
    for (path, pid) in &removed {
        warn!(path = %path.display(), pid, "removed a shared-memory segment left by a dead process");
    }
    removed.len()
}

/// The segments of this host whose creator is gone, removed: what a job's workers leave
/// when they exit without dropping their communicator (or are killed). Agents and the master
/// call it once their workers are gone, so a finished job leaves nothing in `/dev/shm`.
pub fn remove_segments_of_exited_processes() -> usize {
    let removed = remove_dead(Path::new(SHM_DIR));
    for (path, pid) in &removed {
        debug!(path = %path.display(), pid, "removed a shared-memory segment of an exited process");
    }
    removed.len()
}

/// Removes the segments in `dir` whose creator is gone: their paths and creators.
fn remove_dead(dir: &Path) -> Vec<(PathBuf, i32)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(creator_pid) else {
            continue;
        };
        if pid_is_gone(pid) && std::fs::remove_file(e.path()).is_ok() {
            removed.push((e.path(), pid));
        }
    }
    removed
}

/// Who this host is, for deciding whether two ranks can share memory: the boot id (another
/// machine, or this one after a reboot, differs), the machine id and the tmpfs' device. `None` where unknown
/// (not Linux) or without a `/dev/shm`: never shared.
pub(crate) fn host_identity() -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let machine = std::fs::read_to_string("/etc/machine-id").unwrap_or_default();
    // Containers of one machine share the boot id but not necessarily the tmpfs.
    let shm = std::fs::metadata(SHM_DIR).ok().filter(|m| m.is_dir())?;
    use std::os::unix::fs::MetadataExt;
    Some(format!(
        "{}/{}/{:x}:{:x}",
        boot.trim(),
        machine.trim(),
        shm.dev(),
        shm.ino()
    ))
}

/// Sleeps until `word` differs from `expected`, a wake, or `timeout` (spurious returns are
/// fine: callers re-check their condition).
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned u32 for the duration of the call; a shared (not
    // PRIVATE) futex, since the waker may be another process mapping the same page.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every waiter on `word`, in any process.
pub(crate) fn futex_wake(word: &AtomicU32) {
    // SAFETY: as for `futex_wait`.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_the_creator_pid_and_nothing_else_parses() {
        assert_eq!(creator_pid("oobleck-123-g7-pair-0-1-abcdef"), Some(123));
        assert_eq!(creator_pid("oobleck-x-g7"), None);
        assert_eq!(creator_pid("other-123-g7"), None);
        assert_eq!(creator_pid("oobleck-123-../../etc"), None);
    }

    #[test]
    fn a_created_segment_is_shared_and_disappears_when_unlinked() {
        let a = Segment::create(3, "test", 8192).unwrap();
        let b = Segment::open(a.name(), 8192).unwrap();
        a.atomic_u64(64)
            .store(42, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(
            b.atomic_u64(64).load(std::sync::atomic::Ordering::SeqCst),
            42
        );
        a.unlink();
        assert!(Segment::open(a.name(), 1).is_err());
        // Still shared after the unlink.
        b.atomic_u64(64)
            .store(7, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(
            a.atomic_u64(64).load(std::sync::atomic::Ordering::SeqCst),
            7
        );
        assert!(Segment::open("../etc/passwd", 1).is_err());
    }
}
