//! Strangers on both planes of a real job (issue 43): a storm of idle TCP connections to every
//! worker's data-plane port while generations form, and to the master's control port while
//! the job trains. Neither disturbs the job; refusals are logged aggregated (a few lines, not
//! one each) and recorded in `events.jsonl`; `oobleck status` answers during the storm.

mod common;

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::*;

/// The two storms run one at a time: the control-port storm's tens of thousands of sockets
/// fill the machine's `/proc/net/tcp`, which the data-port storm reads to find the workers'
/// ports, and a slow read can miss a short rendezvous (no stranger met, none recorded).
static ONE_STORM: Mutex<()> = Mutex::new(());

fn one_storm() -> MutexGuard<'static, ()> {
    ONE_STORM.lock().unwrap_or_else(|e| e.into_inner())
}

const STEPS: u64 = 8;
/// Idle connections the storm keeps open to each port it knows.
const PER_PORT: usize = 100;

/// Connections kept open to a set of ports, topped up as the listener cuts them, from a thread
/// until dropped.
struct Storm {
    stop: Arc<AtomicBool>,
    opened: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Storm {
    /// Every `tick`, asks `targets` for the addresses to hold and keeps `per_port` idle
    /// connections open to each; with `garbage`, each new connection also sends a line that is
    /// no handshake (so it is refused at once rather than cut when its time is up).
    fn start(
        per_port: usize,
        garbage: bool,
        targets: impl Fn() -> Vec<SocketAddr> + Send + 'static,
    ) -> Storm {
        let stop = Arc::new(AtomicBool::new(false));
        let opened = Arc::new(AtomicU64::new(0));
        let (s, o) = (stop.clone(), opened.clone());
        let thread = std::thread::spawn(move || {
            let mut held: BTreeMap<SocketAddr, Vec<TcpStream>> = BTreeMap::new();
            while !s.load(Ordering::Relaxed) {
                for addr in targets() {
                    let conns = held.entry(addr).or_default();
                    conns.retain(still_open);
                    while conns.len() < per_port {
                        let Ok(mut c) =
                            TcpStream::connect_timeout(&addr, Duration::from_millis(50))
                        else {
                            break; // the backlog is full, or the port is gone
                        };
                        if garbage {
                            let _ = c.write_all(b"GET /api/status HTTP/1.1\r\n\r\n");
                        }
                        o.fetch_add(1, Ordering::Relaxed);
                        conns.push(c);
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        Storm {
            stop,
            opened,
            thread: Some(thread),
        }
    }

    fn opened(&self) -> u64 {
        self.opened.load(Ordering::Relaxed)
    }
}

impl Drop for Storm {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Whether the other end has not closed the connection (what it sent is read and ignored).
fn still_open(c: &TcpStream) -> bool {
    let _ = c.set_nonblocking(true);
    let mut buf = [0u8; 512];
    loop {
        match (&*c).read(&mut buf) {
            Ok(0) => return false,
            Ok(_) => continue,
            Err(e) => return e.kind() == ErrorKind::WouldBlock,
        }
    }
}

/// The TCP ports `pid` listens on, as a port scanner on this machine would find them: the
/// socket inodes among its descriptors, looked up in `/proc/net/tcp`.
fn listening_ports(pid: u32) -> Vec<u16> {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    let inodes: Vec<String> = fds
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_str()?.to_string();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // local_address is "HEXIP:HEXPORT"; state 0A is LISTEN; the inode is column 9.
            let listening = cols.get(3) == Some(&"0A");
            let ours = cols.get(9).is_some_and(|i| inodes.iter().any(|n| n == i));
            let port = cols.get(1)?.split(':').nth(1)?;
            (listening && ours).then(|| u16::from_str_radix(port, 16).ok())?
        })
        .collect()
}

/// The data-plane ports of every live worker of the run (none before it has events).
fn worker_ports(run: &Path) -> Vec<SocketAddr> {
    let text = std::fs::read_to_string(run.join("events.jsonl")).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["event"] == "process" && e["role"] == "worker")
        .filter_map(|e| e["pid"].as_u64())
        .flat_map(|pid| listening_ports(pid as u32))
        .map(|port| SocketAddr::from(([127, 0, 0, 1], port)))
        .collect()
}

fn refused_events(run: &Path, data_plane: bool) -> Vec<serde_json::Value> {
    events(run)
        .into_iter()
        .filter(|e| e["event"] == "refused" && e.get("rank").is_some() == data_plane)
        .collect()
}

fn stderr_lines_with(stderr: &str, what: &str) -> usize {
    stderr.lines().filter(|l| l.contains(what)).count()
}

/// A 3-node f = 1 job whose node 1 fails after step 3: every worker's data port is held by a
/// hundred idle strangers from the moment it listens, through generation 0's rendezvous and
/// generation 1's. The job trains as the single process does, loses no healthy node, resumes
/// within seconds, and records the refusals (with the worker's rank) in `events.jsonl`.
#[test]
fn idle_strangers_on_the_workers_data_ports_do_not_disturb_the_job() {
    let _one = one_storm();
    let dir = tempfile::tempdir().expect("tempdir");
    let (want, want_params) = single_process(dir.path(), STEPS);
    let out: PathBuf = dir.path().join("run");
    // The hang watchdog's 1.5 s default is no part of this test: on 2 busy cores, with the
    // storm reconnecting to every port, a forward right after a recovery's layer copies once
    // stalled past it, and the fenced workers cascaded into giving up (CI at 42b775b).
    let flags = [
        "--nodes",
        "3",
        "--fault-threshold",
        "1",
        "--inject-failure",
        "1@3",
        "--hang-timeout",
        "6",
    ];
    let mut g = Guard(Some(
        train_cmd(&out, STEPS, &flags).spawn().expect("start train"),
    ));
    let watched = out.clone();
    let storm = Storm::start(PER_PORT, false, move || worker_ports(&watched));
    let o = g.finish(Duration::from_secs(240));
    drop(storm);
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{stderr}");
    assert_same_training(&out, &want, &want_params);
    let lost: Vec<_> = events(&out)
        .into_iter()
        .filter(|e| e["event"] == "lost")
        .collect();
    assert_eq!(lost.len(), 1, "only the injected failure: {lost:?}");
    let since: Vec<f64> = events(&out)
        .iter()
        .filter(|e| e["event"] == "resumed")
        .filter_map(|e| e["since_failure_s"].as_f64())
        .collect();
    eprintln!("seconds from the failure to the next commit: {since:?}");
    assert!(since.iter().all(|s| *s < 10.0), "{since:?}");
    let refused = refused_events(&out, true);
    let counted: u64 = refused.iter().filter_map(|e| e["count"].as_u64()).sum();
    eprintln!(
        "{} data-plane refused records, {counted} refusals; {} lines on stderr",
        refused.len(),
        stderr_lines_with(&stderr, "data plane: refused")
    );
    // How many strangers a listener meets depends on how long its group takes to form (tens
    // on this machine: 69 in one run); that it meets some and they are recorded does not.
    assert!(counted > 0, "the strangers' refusals are recorded");
    assert!(refused
        .iter()
        .all(|e| e["rank"].is_u64() && e["node"].is_u64()));
    assert!(
        stderr_lines_with(&stderr, "data plane: refused") < 100,
        "refusals are logged aggregated: {stderr}"
    );
    assert_no_segments(&out);
}

/// The master's control port under a storm (hundreds of idle connections, and connections
/// that send an HTTP request instead of a handshake) while the job trains: training goes on,
/// `oobleck status` answers, the master's log holds a few lines about it, not one per
/// connection, and `events.jsonl` has the count.
#[test]
fn a_storm_on_the_control_port_leaves_status_answering_and_the_log_short() {
    let _one = one_storm();
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let mut cmd = train_cmd(&out, 10_000, &["--nodes", "2", "--eval-every", "0"]);
    let mut g = Guard(Some(cmd.spawn().expect("start train")));
    let pid = g.0.as_ref().expect("child").id();
    wait_for_step(&out, 1, Duration::from_secs(60));
    let master: SocketAddr = events(&out)
        .iter()
        .find_map(|e| e["master"].as_str().map(str::to_string))
        .expect("the start event names the master")
        .parse()
        .expect("an address");
    let idle = Storm::start(300, false, move || vec![master]);
    let noisy = Storm::start(50, true, move || vec![master]);
    let storm_began = Instant::now();
    let step_before = losses(&out).last().map_or(0, |(s, _)| *s);
    let mut answered = 0;
    while storm_began.elapsed() < Duration::from_secs(8) {
        let run_s = out.to_str().expect("utf-8 path");
        let st = oobleck_tool(&["status", "--json", "--run", run_s]);
        assert!(
            st.status.success(),
            "status during the storm: {}",
            String::from_utf8_lossy(&st.stderr)
        );
        answered += 1;
        std::thread::sleep(Duration::from_millis(500));
    }
    let opened = idle.opened() + noisy.opened();
    drop((idle, noisy));
    let step_after = losses(&out).last().map_or(0, |(s, _)| *s);
    // The counts of an address and reason are said (and recorded) once per 10 s.
    wait_for_events(
        &out,
        1,
        Duration::from_secs(20),
        "a summary of the refusals",
        |e| e["event"] == "refused" && e["count"].as_u64().is_some_and(|c| c > 1),
    );
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(sent.success());
    let o = g.finish(Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{stderr}");
    let lines = stderr_lines_with(&stderr, "refused");
    let refused = refused_events(&out, false);
    let counted: u64 = refused.iter().filter_map(|e| e["count"].as_u64()).sum();
    eprintln!(
        "{opened} stranger connections in 8 s; status answered {answered} times; steps \
         {step_before} -> {step_after}; {lines} log lines and {} records of {counted} refusals",
        refused.len()
    );
    assert!(answered >= 5, "status answered {answered} times");
    assert!(
        step_after > step_before,
        "training went on during the storm"
    );
    assert!(opened >= 1000, "the storm opened only {opened} connections");
    assert!(lines <= 20, "{lines} lines about refusals: {stderr}");
    assert!(counted >= 500, "refusals recorded: {refused:?}");
    assert_no_segments(&out);
}
