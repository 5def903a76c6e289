//! The standby masters of a local job (`train --nodes N --standby-masters K`): `train standby`
//! processes started once the master listens, each keeping its copy of the run directory in
//! `<out>.standby-K` and taking over at its own address on this machine when the master is
//! lost. They are not the master's to kill when it dies (that is when they are needed); at the
//! end of the job the master tells them it is over, and they exit.

use std::net::SocketAddr;
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
            let listen = free_local_addr()?;
            let child = Command::new(&exe)
                .arg("standby")
                .args(["--master", &master.to_string()])
                .arg("--copy")
                .arg(&copy)
                .args(["--listen", &listen.to_string()])
                .env("OOBLECK_TOKEN", token.expose())
                .stdin(Stdio::null())
                .spawn()
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
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        self.started.clear();
    }
}

/// A port of 127.0.0.1 free now, for a standby to take over at.
fn free_local_addr() -> Result<SocketAddr> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    l.local_addr().context("finding a free port")
}
