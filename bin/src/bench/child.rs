//! The benches' `train` child processes and their scratch directories (`bench recovery`,
//! `bench status-flood`).
//!
//! Each `train` starts in a process group of its own (`process_group(0)`), which its agents and
//! their workers inherit: one `kill -KILL -- -PGID` ends the whole local cluster, whatever the
//! master was doing; a run that kills the master alone (`bench recovery`'s master run) takes
//! the group over instead ([`TrainProcess::wait_leaving_with`]). Every wait has a deadline; a
//! child that is dropped before it was waited for (an error, a panic, a timeout) has its group
//! killed and is reaped, and Ctrl-C / SIGTERM of the bench kill every group still running
//! before the bench exits. Being in their own groups, the children do not see the terminal's
//! Ctrl-C themselves, hence the signal thread.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// How often a running child is checked on.
const POLL: Duration = Duration::from_millis(20);
/// How long a SIGKILLed process may take to be reaped before the bench gives up on it.
const REAP: Duration = Duration::from_secs(10);

/// The process groups of the running children, killed on Ctrl-C / SIGTERM of the bench.
#[derive(Clone, Debug, Default)]
pub struct Reaper {
    groups: Arc<Mutex<BTreeSet<u32>>>,
}

impl Reaper {
    /// Starts the thread that waits for Ctrl-C or SIGTERM, kills every registered group, and
    /// exits with status 130.
    pub fn install() -> Result<Reaper> {
        let reaper = Reaper::default();
        let groups = reaper.groups.clone();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the signal watcher's runtime")?;
        std::thread::Builder::new()
            .name("bench-signals".into())
            .spawn(move || {
                let signalled = rt.block_on(async {
                    use tokio::signal::unix::{signal, SignalKind};
                    let Ok(mut term) = signal(SignalKind::terminate()) else {
                        return false;
                    };
                    tokio::select! {
                        r = tokio::signal::ctrl_c() => r.is_ok(),
                        _ = term.recv() => true,
                    }
                });
                if signalled {
                    let live: Vec<u32> = match groups.lock() {
                        Ok(g) => g.iter().copied().collect(),
                        Err(poisoned) => poisoned.into_inner().iter().copied().collect(),
                    };
                    live.into_iter().for_each(kill_group);
                    eprintln!("bench: interrupted; its train processes were killed");
                    std::process::exit(130);
                }
            })
            .context("starting the signal watcher")?;
        Ok(reaper)
    }

    fn register(&self, pgid: u32) {
        self.groups
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(pgid);
    }

    fn unregister(&self, pgid: u32) {
        self.groups
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&pgid);
    }
}

/// What a short helper process (a Python comparator) printed, and how it ended.
#[derive(Debug)]
pub struct Captured {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `cmd` to its end with both pipes read on threads (a chatty child cannot block on a
/// full pipe); past `timeout` it is killed and this is an error. A program that is not there
/// is `Ok(None)`, for the caller to report as unavailable.
pub fn run_captured(cmd: &mut Command, timeout: Duration) -> Result<Option<Captured>> {
    let spawned = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("starting {:?}", cmd.get_program())),
    };
    let drain = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_string(&mut s);
            }
            s
        })
    };
    let out = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let err = drain(child.stderr.take().map(|p| Box::new(p) as _));
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().context("waiting for a child")? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("did not finish within {} s; killed", timeout.as_secs());
        }
        std::thread::sleep(POLL);
    };
    Ok(Some(Captured {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }))
}

/// `VmHWM` of a `/proc/PID/status`, in bytes; `None` once the process is gone.
fn high_water_mark(status: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(status).ok()?;
    let line = text.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// SIGKILL to every process of group `pgid` (gone already is fine).
fn kill_group(pgid: u32) {
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{pgid}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// How a waited-for child ended.
#[derive(Debug)]
pub struct Exit {
    pub status: ExitStatus,
    /// Spawn to exit, seconds.
    pub wall_s: f64,
}

/// One running `train` (or `oobleck` tool) and its process group; killed and reaped on drop
/// unless waited for.
#[derive(Debug)]
pub struct TrainProcess {
    child: Child,
    /// The binary's file name, for messages.
    what: String,
    pgid: u32,
    reaper: Reaper,
    started: Instant,
    reaped: bool,
}

impl TrainProcess {
    /// Starts `bin args` in a new process group, its stdout and stderr written to `log.stdout`
    /// and `log.stderr`.
    pub fn spawn(reaper: &Reaper, bin: &Path, args: &[String], log: &Path) -> Result<Self> {
        let open = |ext: &str| {
            let p = log.with_extension(ext);
            File::create(&p).with_context(|| format!("creating {}", p.display()))
        };
        let (stdout, stderr) = (open("stdout")?, open("stderr")?);
        let started = Instant::now();
        let child = Command::new(bin)
            .args(args)
            // The error, not anyhow's backtrace, at the end of stderr (the bench shows it).
            .env("RUST_LIB_BACKTRACE", "0")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let pgid = child.id();
        reaper.register(pgid);
        Ok(TrainProcess {
            child,
            what: bin.file_name().map_or_else(
                || bin.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            ),
            pgid,
            reaper: reaper.clone(),
            started,
            reaped: false,
        })
    }

    /// Waits for the exit, at most `timeout`; past it the group is killed and this is an error.
    /// Whatever the master left running in its group is killed too.
    pub fn wait(self, timeout: Duration) -> Result<Exit> {
        self.wait_with(timeout, || {})
    }

    /// [`wait`](Self::wait), calling `tick` at every look at the child (the membership run
    /// drains and joins from there).
    pub fn wait_with(mut self, timeout: Duration, mut tick: impl FnMut()) -> Result<Exit> {
        let exit = self.wait_exit(timeout, &mut tick)?;
        kill_group(self.pgid);
        self.reaper.unregister(self.pgid);
        Ok(exit)
    }

    /// Waits for the exit of a tool that leaves a process behind in its group (the agent of
    /// `oobleck add-node`): the group is not killed but handed over, still registered.
    pub fn wait_leaving(self, timeout: Duration) -> Result<(Exit, Group)> {
        self.wait_leaving_with(timeout, || {})
    }

    /// [`wait_leaving`](Self::wait_leaving), calling `tick` at every look at the child (the
    /// master run SIGKILLs the master from there, and its agents live on in the group).
    pub fn wait_leaving_with(
        mut self,
        timeout: Duration,
        mut tick: impl FnMut(),
    ) -> Result<(Exit, Group)> {
        let exit = self.wait_exit(timeout, &mut tick)?;
        let group = Group {
            pgid: self.pgid,
            reaper: self.reaper.clone(),
            done: false,
        };
        Ok((exit, group))
    }

    /// The process's id, which is also its group's.
    pub fn pid(&self) -> u32 {
        self.pgid
    }

    fn wait_exit(&mut self, timeout: Duration, tick: &mut dyn FnMut()) -> Result<Exit> {
        let deadline = self.started + timeout;
        loop {
            if let Some(status) = self.child.try_wait().context("waiting for a child")? {
                self.reaped = true;
                return Ok(Exit {
                    status,
                    wall_s: self.started.elapsed().as_secs_f64(),
                });
            }
            if Instant::now() >= deadline {
                self.kill_and_reap();
                bail!(
                    "{} (pid {}) was still running after {} s; killed",
                    self.what,
                    self.pgid,
                    timeout.as_secs()
                );
            }
            tick();
            std::thread::sleep(POLL);
        }
    }

    /// Waits for the exit like [`wait`](Self::wait), also reading the peak resident memory
    /// of the process itself, in bytes: its `VmHWM` (`/proc/PID/status`), read at every look
    /// until it exits. Not `ru_maxrss`: Linux carries the parent's peak over a fork and an
    /// exec into it, so a child of a large bench would read as large as the bench.
    pub fn wait_peak_rss(self, timeout: Duration) -> Result<(Exit, u64)> {
        let status = PathBuf::from(format!("/proc/{}/status", self.child.id()));
        let mut peak = 0;
        let exit = self.wait_with(timeout, || {
            peak = peak.max(high_water_mark(&status).unwrap_or(0));
        })?;
        if peak == 0 {
            bail!(
                "{} read no VmHWM (it ended before the first look)",
                status.display()
            );
        }
        Ok((exit, peak))
    }

    fn kill_and_reap(&mut self) {
        if self.reaped {
            return;
        }
        kill_group(self.pgid);
        let deadline = Instant::now() + REAP;
        while Instant::now() < deadline {
            match self.child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) => std::thread::sleep(POLL),
            }
        }
        self.reaped = true;
        self.reaper.unregister(self.pgid);
    }
}

impl Drop for TrainProcess {
    fn drop(&mut self) {
        self.kill_and_reap();
    }
}

/// A process group whose leader exited and left a process the bench did not start directly
/// (the agent of `oobleck add-node`, reparented away from the bench): killed on drop and on
/// Ctrl-C unless [`Group::wait_gone`] saw it go.
#[derive(Debug)]
pub struct Group {
    pgid: u32,
    reaper: Reaper,
    done: bool,
}

impl Group {
    /// Waits at most `timeout` for every one of `pids` of this group to be gone; past it the
    /// group is killed. The seconds it took, or `None` if it had to be killed.
    pub fn wait_gone(&mut self, pids: &[u32], timeout: Duration) -> Option<f64> {
        let t0 = Instant::now();
        while pids.iter().any(|&pid| alive_in_group(pid, self.pgid)) {
            if t0.elapsed() >= timeout {
                self.kill();
                return None;
            }
            std::thread::sleep(POLL);
        }
        self.done = true;
        self.reaper.unregister(self.pgid);
        Some(t0.elapsed().as_secs_f64())
    }

    fn kill(&mut self) {
        if !self.done {
            kill_group(self.pgid);
            self.reaper.unregister(self.pgid);
            self.done = true;
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Whether `pid` runs (not a zombie: nobody may reap it here) in process group `pgid`, from
/// `/proc/PID/stat` (`pid (comm) state ppid pgrp ...`).
pub fn alive_in_group(pid: u32, pgid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return false;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let running = f.first().is_some_and(|s| !matches!(*s, "Z" | "X" | "x"));
    running && f.get(2).and_then(|g| g.parse::<u32>().ok()) == Some(pgid)
}

/// The bench's scratch directory (one run directory per run), removed on drop unless kept.
#[derive(Debug)]
pub struct Scratch {
    pub root: PathBuf,
    keep: bool,
}

impl Scratch {
    /// A fresh directory for bench `name` under `parent` (default: the system temp directory).
    pub fn create(name: &str, parent: Option<&Path>, keep: bool) -> Result<Scratch> {
        let parent = parent.map_or_else(std::env::temp_dir, Path::to_path_buf);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let root = parent.join(format!(
            "oobleck-bench-{name}-{}-{nanos:09}",
            std::process::id()
        ));
        std::fs::create_dir_all(&root)
            .with_context(|| format!("creating scratch directory {}", root.display()))?;
        Ok(Scratch { root, keep })
    }

    /// Keeps the directory after the bench (to look at a failed run).
    pub fn keep(&mut self) {
        self.keep = true;
    }

    pub fn kept(&self) -> bool {
        self.keep
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

/// The `name` binary beside the running one, or the one `--{name}-bin` gives.
pub fn binary(name: &str, given: Option<&Path>) -> Result<PathBuf> {
    let path = match given {
        Some(p) => p.to_path_buf(),
        None => std::env::current_exe()
            .context("locating the running binary")?
            .with_file_name(name),
    };
    if !path.is_file() {
        bail!(
            "{} not found: build it with `cargo build --release -p oobleck-cli` or pass \
             --{name}-bin",
            path.display()
        );
    }
    Ok(path)
}

/// The last `lines` lines of a text file (for error reports); empty if unreadable.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
