//! The file system under a run directory: how much is free there, what it is called, and how
//! large a checkpoint of a model is, so a save that cannot fit says so in numbers.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Bytes of a checkpoint per parameter: fp32 weights and AdamW's two moments (also under
/// `--precision bf16`, whose master weights and optimizer state stay fp32).
const CHECKPOINT_BYTES_PER_PARAM: u64 = 12;

/// Free space of the file system holding a path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Space {
    /// Its mount point and type, as a person would look it up (`/tmp/run (tmpfs)`).
    pub filesystem: String,
    /// Bytes an unprivileged process may still write.
    pub free_bytes: u64,
}

/// The bytes a checkpoint of a model of `params` parameters takes.
pub fn checkpoint_bytes(params: usize) -> u64 {
    params as u64 * CHECKPOINT_BYTES_PER_PARAM
}

/// The free space where `path` is (its nearest existing ancestor), or `None` where the system
/// does not say.
pub fn space(path: &Path) -> Option<Space> {
    let existing = path.ancestors().find(|p| p.exists())?;
    let real = existing.canonicalize().ok()?;
    let c = CString::new(real.as_os_str().as_bytes()).ok()?;
    // SAFETY: `c` is a valid NUL-terminated path and `st` a properly sized out-parameter.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    // fsblkcnt_t and c_ulong are u64 on 64-bit Linux, narrower elsewhere.
    #[allow(clippy::useless_conversion)]
    let free_bytes = u64::from(st.f_bavail).saturating_mul(u64::from(st.f_frsize));
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let filesystem = match mount_of(&mounts, &real) {
        Some((point, kind)) => format!("{} ({kind})", point.display()),
        None => real.display().to_string(),
    };
    Some(Space {
        filesystem,
        free_bytes,
    })
}

/// The mount point holding `path` and its file system type, from `/proc/self/mountinfo`
/// text: the longest mount point that is an ancestor of `path`.
fn mount_of(mountinfo: &str, path: &Path) -> Option<(PathBuf, String)> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let point = unescape(left.split(' ').nth(4)?);
            let kind = right.split(' ').next()?.to_string();
            path.starts_with(&point).then_some((point, kind))
        })
        .max_by_key(|(point, _)| point.as_os_str().len())
}

/// A mountinfo field with its octal escapes (`\040` for a space) decoded.
fn unescape(field: &str) -> PathBuf {
    let mut out = Vec::with_capacity(field.len());
    let b = field.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let octal = b.get(i + 1..i + 4).and_then(|d| {
            let s = std::str::from_utf8(d).ok()?;
            u8::from_str_radix(s, 8).ok()
        });
        match (b[i], octal) {
            (b'\\', Some(c)) => {
                out.push(c);
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    PathBuf::from(std::ffi::OsStr::from_bytes(&out))
}

/// A save of the state after `step` that failed, with the numbers of the disk it was for.
#[derive(Debug, Clone, PartialEq)]
pub struct SaveFailure {
    pub step: u64,
    /// The checkpoint it was to write.
    pub path: PathBuf,
    /// Where `path` is, when the system says.
    pub space: Option<Space>,
    pub needed_bytes: u64,
    pub error: String,
    /// The save is tried again (the final one, while `--save-wait` lasts).
    pub retrying: bool,
}

impl SaveFailure {
    /// Measures the disk under `out` for a checkpoint of `step` of `needed_bytes`.
    pub fn measure(
        out: &Path,
        step: u64,
        needed_bytes: u64,
        error: String,
        retrying: bool,
    ) -> Self {
        SaveFailure {
            step,
            path: super::checkpoint_path(out, step),
            space: space(out),
            needed_bytes,
            error,
            retrying,
        }
    }

    /// The warning a person reads; `next` says what happens now.
    pub fn warning(&self, next: &str) -> String {
        let room = self.space.as_ref().map_or(String::new(), |s| {
            format!(
                " ({} free on {}, a checkpoint needs about {})",
                human_bytes(s.free_bytes),
                s.filesystem,
                human_bytes(self.needed_bytes)
            )
        });
        format!(
            "warning: the checkpoint of step {} was not saved to {}: {}{room}; {next}",
            self.step,
            self.path.display(),
            self.error
        )
    }
}

/// `n` bytes for a person: `1.5 GB`, `40.0 MB`, `512 B`.
pub fn human_bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.1} GB", n as f64 / 1e9),
        n if n >= 1 << 20 => format!("{:.1} MB", n as f64 / 1e6),
        n if n >= 1 << 10 => format!("{:.1} kB", n as f64 / 1e3),
        n => format!("{n} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_mount_point_above_a_path_names_its_file_system() {
        let info = "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n\
                    40 22 0:35 / /tmp/full rw shared:20 - tmpfs tmpfs rw,size=12288k\n\
                    41 22 0:36 / /tmp/with\\040space rw - tmpfs tmpfs rw\n";
        let of = |p: &str| mount_of(info, Path::new(p));
        assert_eq!(
            of("/tmp/full/run/checkpoints"),
            Some((PathBuf::from("/tmp/full"), "tmpfs".into()))
        );
        assert_eq!(of("/work/run"), Some((PathBuf::from("/"), "ext4".into())));
        assert_eq!(
            of("/tmp/with space/x"),
            Some((PathBuf::from("/tmp/with space"), "tmpfs".into()))
        );
        assert_eq!(of("/tmp/fuller").map(|m| m.1), Some("ext4".into()));
    }

    #[test]
    fn the_space_of_a_directory_not_made_yet_is_that_of_its_parent() {
        let dir = tempfile::tempdir().unwrap();
        let s = space(&dir.path().join("run/checkpoints")).expect("statvfs");
        assert!(s.free_bytes > 0, "{s:?}");
        assert!(s.filesystem.contains('('), "{}", s.filesystem);
        assert_eq!(checkpoint_bytes(1_000), 12_000);
        assert_eq!(human_bytes(40_000_000), "40.0 MB");
        assert_eq!(human_bytes(512), "512 B");
    }
}
