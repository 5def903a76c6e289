//! The standby masters of a local job (`train --nodes N --standby-masters K`): `train standby`
//! processes started once the master listens, each keeping its copy of the run directory in
//! `<out>.standby-K` and taking over at its own address on this machine when the master is
//! lost. They are not the master's to kill when it dies (that is when they are needed); at the
//! end of the job the master tells them it is over, and they exit.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use oobleck_core::runtime::wire::Token;

/// How long standbys get to exit after the job, before they are killed.
const EXIT_GRACE: Duration = Duration::from_secs(10);

/// The standbys to start, and those started.
pub struct LocalStandbys {
    count: usize,
    out: PathBuf,
    started: Vec<Child>,
}

impl LocalStandbys {
    pub fn new(count: usize, out: &Path) -> LocalStandbys {
        LocalStandbys {
            count,
            out: out.to_path_buf(),
            started: Vec::new(),
        }
    }

    /// Where standby `k` keeps its copy.
    pub fn copy_of(out: &Path, k: usize) -> PathBuf {
        let name = out.file_name().unwrap_or_default().to_string_lossy();
        out.with_file_name(format!("{name}.standby-{k}"))
    }

    /// Starts the standbys of the master at `master`; a line for each.
    pub fn start(&mut self, master: SocketAddr, token: &Token) -> Result<Vec<String>> {
        let exe = std::env::current_exe().context("locating the running binary")?;
        let mut said = Vec::new();
        for k in 0..self.count {
            let copy = Self::copy_of(&self.out, k);
            // A copy left by an earlier run of this directory is not this run's.
            let _ = std::fs::remove_dir_all(&copy);
            let listen = free_addr(std::net::Ipv4Addr::LOCALHOST.into())?;
            let child = spawn_standby(&exe, &master.to_string(), &copy, listen, token)
                .with_context(|| format!("starting standby master {k}"))?;
            said.push(format!(
                "standby master {k}: pid {}, copy of the run in {}, takes over at {listen}",
                child.id(),
                copy.display()
            ));
            self.started.push(child);
        }
        Ok(said)
    }

    /// This master was replaced (by one of its standbys, say): they are left running.
    pub fn leave(&mut self) {
        self.started.clear();
    }

    /// After the job: waits for the standbys to exit (the master told them it is over), and
    /// kills those that do not within the grace.
    pub fn finish(&mut self) {
        let deadline = Instant::now() + EXIT_GRACE;
        for child in &mut self.started {
            let _ = end_by(child, deadline, |_| false);
        }
        self.started.clear();
    }
}

/// `train standby --master MASTER --copy COPY --listen LISTEN`, from this binary (`exe`).
fn spawn_standby(
    exe: &Path,
    master: &str,
    copy: &Path,
    listen: SocketAddr,
    token: &Token,
) -> std::io::Result<Child> {
    Command::new(exe)
        .arg("standby")
        .args(["--master", master])
        .arg("--copy")
        .arg(copy)
        .args(["--listen", &listen.to_string()])
        .env("OOBLECK_TOKEN", token.expose())
        .stdin(Stdio::null())
        .spawn()
}

/// A port of `ip` free now, for a standby to take over at.
fn free_addr(ip: IpAddr) -> Result<SocketAddr> {
    let l = std::net::TcpListener::bind((ip, 0))
        .with_context(|| format!("finding a free port on {ip}"))?;
    l.local_addr().context("finding a free port")
}

/// The standby master an agent runs beside it (`train agent --standby`): started before the
/// agent registers, so the master has it from the job's start. Once it took over it is the
/// job's master, and outlives the agent; otherwise it ends with the job (the master tells it),
/// and the agent waits for that at its own end, killing it after a grace.
pub struct AgentStandby {
    child: Child,
}

impl AgentStandby {
    /// Starts it for the master at `master`: its copy in `copy` (which must not hold another
    /// run's files), taking over at `listen`, or by default at a free port of the address this
    /// machine reaches the master from (`host`, if given).
    pub fn start(
        master: &str,
        token: &Token,
        copy: &Path,
        listen: Option<&str>,
        host: Option<&str>,
    ) -> Result<AgentStandby> {
        let master_addr = super::resolve(master)?;
        let listen = match listen {
            Some(l) => super::resolve(l)?,
            None => free_addr(match host {
                Some(h) => h
                    .parse()
                    .with_context(|| format!("--host {h}: not an IP"))?,
                None => ip_toward(master_addr)?,
            })?,
        };
        check_empty(copy)?;
        let exe = std::env::current_exe().context("locating the running binary")?;
        let child = spawn_standby(&exe, master, copy, listen, token)
            .context("starting the standby master (--standby)")?;
        eprintln!(
            "oobleck agent: standby master beside this agent: pid {}, copy of the run in {}, \
             takes over at {listen}",
            child.id(),
            copy.display()
        );
        Ok(AgentStandby { child })
    }

    /// At the agent's end: a standby that took over is the job's master, and the agent waits
    /// for it to end the job (a scheduler ends a task's processes with the task: Slurm's step
    /// would kill the master with the agent); any other gets [`EXIT_GRACE`] to hear that the
    /// job is over, then is killed. Returns its exit status when it took over (the job's
    /// result), `None` otherwise.
    pub fn finish(mut self) -> Option<std::process::ExitStatus> {
        if !end_by(&mut self.child, Instant::now() + EXIT_GRACE, took_over) {
            return None;
        }
        eprintln!(
            "oobleck agent: the standby beside this agent (pid {}) is the job's master now; \
             waiting for it to end the job",
            self.child.id()
        );
        self.child.wait().ok()
    }
}

/// Waits for the standby `child` to exit until `deadline`, then kills it, unless `keep` says
/// (of its pid) that it is left to run. Whether it was left running.
fn end_by(child: &mut Child, deadline: Instant, keep: impl Fn(u32) -> bool) -> bool {
    loop {
        if !matches!(child.try_wait(), Ok(None)) {
            return false;
        }
        if keep(child.id()) {
            return true;
        }
        if Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    false
}

/// The standby `pid` became the job's master: it runs `train --resume COPY --reattach` now.
fn took_over(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|c| c.split(|&b| b == 0).any(|a| a == b"--reattach"))
}

/// The IP of this machine that a packet to `to` leaves from (no packet is sent).
fn ip_toward(to: SocketAddr) -> Result<IpAddr> {
    let any: SocketAddr = match to {
        SocketAddr::V4(_) => "0.0.0.0:0".parse().expect("an address"),
        SocketAddr::V6(_) => "[::]:0".parse().expect("an address"),
    };
    let s = std::net::UdpSocket::bind(any).context("finding this machine's address")?;
    s.connect(to)
        .with_context(|| format!("finding the address this machine reaches {to} from"))?;
    Ok(s.local_addr()
        .context("finding this machine's address")?
        .ip())
}

/// Whether `dir` can take a standby's copy: absent (the standby makes it) or empty.
pub(super) fn is_empty_or_absent(dir: &Path) -> bool {
    std::fs::read_dir(dir).map_or(true, |mut entries| entries.next().is_none())
}

/// A standby's copy starts empty: files of another run in it would be taken for this one's.
fn check_empty(copy: &Path) -> Result<()> {
    if !is_empty_or_absent(copy) {
        anyhow::bail!(
            "--standby-copy {}: not empty (a copy of an earlier run?); remove it, or pass \
             another directory",
            copy.display()
        );
    }
    Ok(())
}
