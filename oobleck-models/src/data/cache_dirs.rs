//! Where a token cache goes when the caller names no folder (see [`super::corpus`] for the
//! whole rule): `$OOBLECK_CACHE_DIR` alone if set; else beside the corpus, then
//! `$XDG_CACHE_HOME/oobleck-rs` (or `~/.cache/oobleck-rs`), then the system temp folder.
//!
//! The environment is read in one place ([`CacheEnv::of_process`]); the order is pure code on
//! those values, so its tests pass made-up variables and change no process environment.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Cache folders tried, in order, when the caller names none (see the module docs). Each comes
/// with whether the file name must carry the corpus hash (shared folders may hold caches of
/// several corpora with the same file name).
pub fn default_cache_dirs(corpus: &Path) -> Vec<(PathBuf, bool)> {
    CacheEnv::of_process().dirs_for(corpus)
}

/// The cache folders that are not beside a corpus, in order: `$OOBLECK_CACHE_DIR` alone if
/// set; else `$XDG_CACHE_HOME/oobleck-rs` (or `~/.cache/oobleck-rs`), then the temp folder.
/// Used for the built-in corpus, whose cache file names always carry its hash.
pub fn shared_cache_dirs() -> Vec<PathBuf> {
    CacheEnv::of_process().shared_dirs()
}

/// What the default cache folders depend on: read from the environment in one place, then
/// resolved by pure code (tested with made-up variables, no process environment changed).
struct CacheEnv {
    /// `$OOBLECK_CACHE_DIR` if set and not empty: then the only default place.
    own: Option<PathBuf>,
    /// `$XDG_CACHE_HOME` if set and not empty, else `$HOME/.cache`.
    user: Option<PathBuf>,
    /// The system temp folder.
    temp: PathBuf,
}

impl CacheEnv {
    fn of_process() -> Self {
        Self::from_vars(|name| std::env::var_os(name), std::env::temp_dir())
    }

    fn from_vars(var: impl Fn(&str) -> Option<OsString>, temp: PathBuf) -> Self {
        let set = |name| var(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        let home_cache = || var("HOME").map(|h| PathBuf::from(h).join(".cache"));
        Self {
            own: set("OOBLECK_CACHE_DIR"),
            user: set("XDG_CACHE_HOME").or_else(home_cache),
            temp,
        }
    }

    fn shared_dirs(&self) -> Vec<PathBuf> {
        if let Some(own) = &self.own {
            return vec![own.clone()];
        }
        let user = self.user.iter().map(|u| u.join("oobleck-rs"));
        user.chain([self.temp.join("oobleck-rs-cache")]).collect()
    }

    fn dirs_for(&self, corpus: &Path) -> Vec<(PathBuf, bool)> {
        let shared = self.shared_dirs().into_iter().map(|d| (d, true));
        if self.own.is_some() {
            return shared.collect();
        }
        let parent = corpus.parent().filter(|p| !p.as_os_str().is_empty());
        let beside = (parent.unwrap_or(Path::new(".")).to_path_buf(), false);
        std::iter::once(beside).chain(shared).collect()
    }
}

/// `flock(LOCK_EX)`: waits for the exclusive lock of `file`, held until the file is closed or
/// its process ends (an advisory lock the OS drops when its process dies). std's `File::lock`
/// is the same call from Rust 1.89, above our MSRV.
pub(crate) fn flock_exclusive(file: &std::fs::File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    loop {
        // SAFETY: flock only reads the descriptor, which `file` keeps open for the call.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `flock(LOCK_EX | LOCK_NB)`: takes the exclusive lock of `file` if nobody holds it (`true`),
/// or says someone does (`false`) without waiting.
pub(crate) fn try_flock_exclusive(file: &std::fs::File) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    loop {
        // SAFETY: flock only reads the descriptor, which `file` keeps open for the call.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::WouldBlock => return Ok(false),
            std::io::ErrorKind::Interrupted => continue,
            _ => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`CacheEnv`] of the variables `vars`, with `/tmp` as the temp folder.
    fn env(vars: &[(&str, &str)]) -> CacheEnv {
        let var = |name: &str| vars.iter().find(|v| v.0 == name).map(|v| v.1.into());
        CacheEnv::from_vars(var, "/tmp".into())
    }

    fn dirs(env: &CacheEnv, corpus: &str) -> Vec<(String, bool)> {
        let shown = |(d, hashed): (PathBuf, bool)| (d.display().to_string(), hashed);
        env.dirs_for(Path::new(corpus))
            .into_iter()
            .map(shown)
            .collect()
    }

    #[test]
    fn oobleck_cache_dir_is_the_only_default_place_when_set() {
        let e = env(&[("OOBLECK_CACHE_DIR", "/own"), ("XDG_CACHE_HOME", "/xdg")]);
        assert_eq!(e.shared_dirs(), [PathBuf::from("/own")]);
        assert_eq!(dirs(&e, "/data/c.txt"), [("/own".into(), true)]);
    }

    #[test]
    fn default_places_are_beside_the_corpus_then_the_user_cache_then_temp() {
        let xdg = env(&[
            ("OOBLECK_CACHE_DIR", ""),
            ("XDG_CACHE_HOME", "/xdg"),
            ("HOME", "/h"),
        ]);
        assert_eq!(
            dirs(&xdg, "/data/c.txt"),
            [
                ("/data".into(), false),
                ("/xdg/oobleck-rs".into(), true),
                ("/tmp/oobleck-rs-cache".into(), true)
            ]
        );
        assert_eq!(dirs(&xdg, "c.txt")[0], (".".into(), false));
        let home = env(&[("XDG_CACHE_HOME", ""), ("HOME", "/h")]);
        assert_eq!(
            home.shared_dirs(),
            [
                PathBuf::from("/h/.cache/oobleck-rs"),
                "/tmp/oobleck-rs-cache".into()
            ]
        );
        assert_eq!(
            env(&[]).shared_dirs(),
            [PathBuf::from("/tmp/oobleck-rs-cache")]
        );
    }
}
