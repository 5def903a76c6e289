//! Starting chromium with its DevTools pipe on fds 3 and 4, and making sure none of it
//! outlives the test: its process group, and the crashpad handlers that leave the group.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// The environment variable that marks every process of one browser with its profile path.
const TAG: &str = "OOBLECK_CDP_PROFILE";
/// The flags issue 15 fixes; the pipe, window size and profile directory follow.
const FLAGS: &str = "--headless --no-sandbox --disable-gpu --disable-background-networking \
                     --disable-component-update --disable-sync --no-first-run";

/// Starts `exe` in its own process group with its command pipe on fd 3 and its reply pipe on
/// fd 4; returns the child, our write end and our read end.
pub(super) fn spawn(exe: &Path, profile: &Path) -> Result<(Child, File, File)> {
    let (cmd_read, cmd_write) = pipe()?;
    let (out_read, out_write) = pipe()?;
    let log = File::create(profile.join("stderr.log")).context("creating stderr.log")?;
    let mut cmd = Command::new(exe);
    cmd.args(FLAGS.split_whitespace())
        .arg("--remote-debugging-pipe")
        .arg("--window-size=1280,800")
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg("about:blank")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .env(TAG, profile)
        .process_group(0);
    let (r, w) = (cmd_read.as_raw_fd(), out_write.as_raw_fd());
    // SAFETY: `map_fds` makes only async-signal-safe calls (fcntl, dup2) between fork and exec.
    unsafe { cmd.pre_exec(move || map_fds(r, w)) };
    let child = cmd
        .spawn()
        .with_context(|| format!("starting {}", exe.display()))?;
    // Our copies of the browser's ends close here, so its death reads as end of file.
    drop((cmd_read, out_write));
    Ok((child, File::from(cmd_write), File::from(out_read)))
}

/// `$OOBLECK_CHROMIUM` (which must exist when set), else the first browser on `PATH`.
pub(super) fn find_browser() -> Result<Option<PathBuf>> {
    if let Some(p) = std::env::var_os("OOBLECK_CHROMIUM") {
        let p = PathBuf::from(p);
        if !p.is_file() {
            bail!("$OOBLECK_CHROMIUM is {} which is not a file", p.display());
        }
        return Ok(Some(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .flat_map(|name| std::env::split_paths(&path).map(move |dir| dir.join(name)))
        .find(|p| p.is_file());
    Ok(found)
}

/// A pipe whose both ends close on exec (the child gets its ends through `map_fds`).
fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error()).context("creating a pipe for the browser");
    }
    // SAFETY: pipe2 succeeded, so both are open descriptors that nothing else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// In the child: the command pipe's read end becomes fd 3, the reply pipe's write end fd 4.
/// Both are first copied above 10 so that mapping one cannot clobber the other when either
/// already sits on 3 or 4; `dup2` clears close-on-exec on its target.
fn map_fds(read: RawFd, write: RawFd) -> std::io::Result<()> {
    // SAFETY (whole function): fcntl and dup2 on descriptors this process holds.
    let high = |fd| unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10) };
    let (r, w) = (high(read), high(write));
    if r < 0 || w < 0 || unsafe { libc::dup2(r, 3) } < 0 || unsafe { libc::dup2(w, 4) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Kills the browser's process group, reaps the browser, then kills and waits (up to 5 s) for
/// whatever of it still runs, crashpad handlers included.
pub(super) fn kill_all(child: &mut Child, profile: &Path) {
    let pgid = child.id() as libc::pid_t;
    // SAFETY: plain syscall; the group is ours (process_group(0) at spawn) and its leader
    // is not reaped yet, so the id cannot have been reused.
    unsafe { libc::kill(-pgid, libc::SIGKILL) };
    let _ = child.wait();
    // Crashpad handlers leave the group (setsid) but keep our tag; the rest of the group
    // may take a moment to die.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = processes_of(pgid as u32, profile);
        if left.is_empty() || Instant::now() > deadline {
            break;
        }
        for pid in left {
            // SAFETY: plain syscall on a pid that was one of ours a moment ago.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The live (not zombie) processes of the browser whose group is `pgid` and profile
/// `profile`: its process group, and those that left it (crashpad handlers call setsid) but
/// kept `TAG=<profile>` in their environment. (The group's members are not found by the tag:
/// they overwrite their environment block with their process title.)
pub fn processes_of(pgid: u32, profile: &Path) -> Vec<u32> {
    let tag = format!("{TAG}={}", profile.display()).into_bytes();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let pids = dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok());
    let tagged = |pid: u32| {
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        env.split(|&b| b == 0).any(|kv| kv == tag)
    };
    pids.filter(|&pid| match state_and_group(pid) {
        Some((state, group)) => state != "Z" && (group == pgid || tagged(pid)),
        None => false,
    })
    .collect()
}

/// A process's state letter and process group, from `/proc/PID/stat`.
fn state_and_group(pid: u32) -> Option<(String, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the `(comm)`, which may itself hold spaces: state, ppid, pgrp.
    let mut f = stat.rsplit_once(')')?.1.split_whitespace();
    let (state, _ppid, group) = (f.next()?, f.next()?, f.next()?);
    Some((state.to_string(), group.parse().ok()?))
}
