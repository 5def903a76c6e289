//! Multi-process TCP tests: real processes on 127.0.0.1, killed and stopped with real
//! signals, with shared memory between them (the default on one host; the all-reduce through
//! scratch, or in place on tensors from `alloc`) and with every pair on TCP. The test binary re-executes itself as the peers (`peer_main` with
//! `OOBLECK_COMM_PEER` set); a guard kills every child on any exit path.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use oobleck_comm::{CommError, Communicator, DType, TcpCommunicator, TcpConfig, TensorBuf};

const PEER_ENV: &str = "OOBLECK_COMM_PEER";
/// Peers exit on their own after this long, even if the parent vanished.
const PEER_LIFETIME: Duration = Duration::from_secs(40);

/// Peer mode: bind, report the port, read everyone's addresses, then all-reduce in rounds
/// until an error, reporting each round on stdout.
#[test]
fn peer_main() {
    let Ok(spec) = std::env::var(PEER_ENV) else {
        return; // a normal test run: nothing to do
    };
    let mut it = spec.split(',');
    let rank: usize = it.next().unwrap().parse().unwrap();
    let op_timeout = Duration::from_millis(it.next().unwrap().parse().unwrap());
    let mode = it.next().unwrap_or("tcp");
    let (shm, alloc) = (mode != "tcp", mode == "alloc");
    let born = Instant::now();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    println!("PEER PORT {}", l.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let addrs: Vec<SocketAddr> = line.trim().split(',').map(|a| a.parse().unwrap()).collect();
    let world = addrs.len();
    let mut cfg = TcpConfig::new(rank, 1, addrs);
    cfg.connect_timeout = Duration::from_secs(10);
    cfg.shared_memory = shm;
    let comm = TcpCommunicator::connect(cfg, Some(l)).unwrap();
    println!("PEER SHM {}", comm.shared_memory_peers().len());
    let group: Vec<usize> = (0..world).collect();
    let n = 256 << 10; // 1 MiB of f32: the pipelined ring path
    let mut round = 0u64;
    while born.elapsed() < PEER_LIFETIME {
        let mut t = if alloc {
            let mut t = comm.alloc(DType::F32, vec![n]).unwrap();
            assert!(t.is_shared());
            t.as_bytes_mut()
                .copy_from_slice(bytemuck::cast_slice(&vec![1.0f32; n]));
            t
        } else {
            TensorBuf::from_f32(vec![n], &vec![1.0; n]).unwrap()
        };
        let start = Instant::now();
        match comm.all_reduce(&group, &mut t, op_timeout) {
            Ok(()) => {
                assert_eq!(t.to_f32_vec().unwrap()[n - 1], world as f32);
                assert_eq!(
                    comm.in_place_all_reduces(),
                    if alloc { round + 1 } else { 0 }
                );
                println!("PEER ROUND {round} OK");
            }
            Err(e) => {
                let kind = match e {
                    CommError::PeerLost { .. } => "PeerLost",
                    CommError::Timeout { .. } => "Timeout",
                    CommError::Aborted { .. } => "Aborted",
                    _ => "Other",
                };
                println!("PEER ERR {kind} {}", start.elapsed().as_millis());
                return;
            }
        }
        std::io::stdout().flush().unwrap();
        round += 1;
        thread::sleep(Duration::from_millis(20));
    }
}

/// Kills (SIGKILL) and reaps every child when dropped, whatever happened.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts `world` peers connected to each other; returns them and their stdout lines.
fn start_peers(
    world: usize,
    op_timeout_ms: u64,
    mode: &str,
) -> (Children, Receiver<(usize, String)>) {
    let exe = std::env::current_exe().unwrap();
    let mut kids = Children(Vec::new());
    let (tx, rx) = channel();
    for rank in 0..world {
        let mut child = Command::new(&exe)
            .args(["--exact", "peer_main", "--nocapture", "--test-threads=1"])
            .env(PEER_ENV, format!("{rank},{op_timeout_ms},{mode}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        kids.0.push(child);
        let tx = tx.clone();
        thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                // The harness may print "test peer_main ... " on the same line first.
                if let Some(at) = line.find("PEER ") {
                    if tx.send((rank, line[at + 5..].to_string())).is_err() {
                        return;
                    }
                }
            }
        });
    }
    let mut ports = vec![None; world];
    let deadline = Instant::now() + Duration::from_secs(20);
    while ports.iter().any(Option::is_none) {
        let (r, line) = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("every peer reports its port");
        if let Some(p) = line.strip_prefix("PORT ") {
            ports[r] = Some(p.parse::<u16>().unwrap());
        }
    }
    let list: Vec<String> = ports
        .iter()
        .map(|p| format!("127.0.0.1:{}", p.unwrap()))
        .collect();
    for c in &mut kids.0 {
        writeln!(c.stdin.as_mut().unwrap(), "{}", list.join(",")).unwrap();
    }
    (kids, rx)
}

/// Waits until every rank in `ranks` reported `pred`, returning the matching lines.
fn wait_for(
    rx: &Receiver<(usize, String)>,
    ranks: &[usize],
    within: Duration,
    pred: impl Fn(&str) -> bool,
) -> Vec<(usize, String)> {
    let deadline = Instant::now() + within;
    let mut seen: Vec<(usize, String)> = Vec::new();
    while !ranks.iter().all(|r| seen.iter().any(|(s, _)| s == r)) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((r, line))
                if ranks.contains(&r) && pred(&line) && seen.iter().all(|(s, _)| *s != r) =>
            {
                seen.push((r, line))
            }
            Ok(_) => {}
            Err(_) => panic!("ranks {ranks:?} did not report in {within:?}; got {seen:?}"),
        }
    }
    seen
}

fn pid(c: &Child) -> Pid {
    Pid::from_raw(c.id() as i32)
}

/// Checks every peer reported the transport asked for (shared memory with all others or none).
fn check_transport(rx: &Receiver<(usize, String)>, world: usize, mode: &str) {
    let want = if mode == "tcp" { 0 } else { world - 1 };
    let all: Vec<usize> = (0..world).collect();
    for (r, line) in wait_for(rx, &all, Duration::from_secs(20), |l| l.starts_with("SHM ")) {
        assert_eq!(line, format!("SHM {want}"), "rank {r}");
    }
}

/// Names of shared-memory segments in /dev/shm created by process `pid`.
fn segments_of(pid: u32) -> Vec<String> {
    let prefix = format!("oobleck-{pid}-");
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

fn sigkilled_peer_fails_the_others_fast_with_peer_lost(mode: &str) {
    let op_timeout_ms = 20_000;
    let (mut kids, rx) = start_peers(3, op_timeout_ms, mode);
    check_transport(&rx, 3, mode);
    wait_for(&rx, &[0, 1, 2], Duration::from_secs(20), |l| {
        l == "ROUND 2 OK"
    });
    kill(pid(&kids.0[2]), Signal::SIGKILL).unwrap();
    let start = Instant::now();
    let errs = wait_for(&rx, &[0, 1], Duration::from_secs(10), |l| {
        l.starts_with("ERR")
    });
    assert!(start.elapsed() < Duration::from_millis(op_timeout_ms / 2));
    for (r, line) in errs {
        assert!(line.starts_with("ERR PeerLost"), "rank {r}: {line}");
    }
    if mode == "alloc" {
        // Its tensors' files stay linked while in use (a member may join a group later), so
        // the killed process leaves them; the next group to form on this host removes them
        // (once the pid is gone: reaped, not a zombie).
        kids.0[2].wait().unwrap();
        let (_next, rx) = start_peers(2, op_timeout_ms, "shm");
        check_transport(&rx, 2, "shm");
    }
    // Every segment was unlinked once mapped: the killed process left nothing behind.
    let left = segments_of(kids.0[2].id());
    assert!(left.is_empty(), "left in /dev/shm: {left:?}");
}

fn sigstopped_peer_makes_the_others_fail_within_their_timeout(mode: &str) {
    let op_timeout_ms = 1500;
    let (kids, rx) = start_peers(3, op_timeout_ms, mode);
    check_transport(&rx, 3, mode);
    wait_for(&rx, &[0, 1, 2], Duration::from_secs(20), |l| {
        l == "ROUND 2 OK"
    });
    kill(pid(&kids.0[1]), Signal::SIGSTOP).unwrap();
    let start = Instant::now();
    let errs = wait_for(&rx, &[0, 2], Duration::from_secs(10), |l| {
        l.starts_with("ERR")
    });
    assert!(
        start.elapsed() < Duration::from_millis(op_timeout_ms) + Duration::from_secs(4),
        "took {:?}",
        start.elapsed()
    );
    assert!(
        errs.iter().any(|(_, l)| l.starts_with("ERR Timeout")),
        "{errs:?}"
    );
    for (r, line) in &errs {
        assert!(
            line.starts_with("ERR Timeout") || line.starts_with("ERR PeerLost"),
            "rank {r}: {line}"
        );
    }
    // The guard SIGKILLs the stopped child too (SIGKILL works on stopped processes).
}

#[test]
fn sigkilled_peer_fails_the_others_fast_with_peer_lost_over_shared_memory() {
    sigkilled_peer_fails_the_others_fast_with_peer_lost("shm");
}

#[test]
fn sigkilled_peer_fails_the_others_fast_with_peer_lost_in_place() {
    sigkilled_peer_fails_the_others_fast_with_peer_lost("alloc");
}

#[test]
fn sigkilled_peer_fails_the_others_fast_with_peer_lost_over_tcp() {
    sigkilled_peer_fails_the_others_fast_with_peer_lost("tcp");
}

#[test]
fn sigstopped_peer_makes_the_others_fail_within_their_timeout_over_shared_memory() {
    sigstopped_peer_makes_the_others_fail_within_their_timeout("shm");
}

#[test]
fn sigstopped_peer_makes_the_others_fail_within_their_timeout_in_place() {
    sigstopped_peer_makes_the_others_fail_within_their_timeout("alloc");
}

#[test]
fn sigstopped_peer_makes_the_others_fail_within_their_timeout_over_tcp() {
    sigstopped_peer_makes_the_others_fail_within_their_timeout("tcp");
}
