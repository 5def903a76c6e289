//! Elastic membership on a local cluster: nodes that join a running job (`oobleck add-node`)
//! and nodes that leave on notice (SIGTERM to their agent, `oobleck drain`, a preemption
//! notice file, an HTTP notice endpoint). Each change is taken at a step boundary without a
//! restart: no step is replayed, the workers of the nodes that stay keep their processes, and
//! training ends exactly where an uninterrupted single process ends. No process is left.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use serde_json::json;

const LIMIT: Duration = Duration::from_secs(180);
const WAIT: Duration = Duration::from_secs(60);

/// A run directory beside the uninterrupted single process of `steps` that it must equal.
struct Case {
    dir: tempfile::TempDir,
    out: std::path::PathBuf,
    want: Vec<(u64, f64)>,
    want_params: std::collections::BTreeMap<String, candle_core::Tensor>,
}

impl Case {
    fn new(steps: u64) -> Case {
        let dir = tempfile::tempdir().expect("tempdir");
        let (want, want_params) = single_process(dir.path(), steps);
        let out = dir.path().join("run");
        Case {
            dir,
            out,
            want,
            want_params,
        }
    }

    fn run(&self) -> &str {
        self.out.to_str().expect("utf-8")
    }

    /// `train` ended well: its stderr.
    fn finish(&self, g: &mut Guard) -> String {
        let o = g.finish(LIMIT);
        let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{stderr}");
        stderr
    }

    /// Nothing replayed, every step equal to the single process, none of the `procs`
    /// processes the run reported left.
    fn check(&self, procs: usize) {
        assert_nothing_replayed(&self.out);
        assert_same_training(&self.out, &self.want, &self.want_params);
        assert_all_gone(&self.out, procs);
    }
}

fn cluster(out: &Path, steps: u64, nodes: &str) -> Guard {
    let flags = ["--nodes", nodes, "--fault-threshold", "1"];
    Guard(Some(train_cmd(out, steps, &flags).spawn().expect("train")))
}

/// Every reconfiguration of the run replayed nothing and kept the survivors running.
fn assert_nothing_replayed(out: &Path) {
    for r in reconfig_events(out) {
        assert_eq!(r["replayed_steps"], 0, "{r}");
        assert_eq!(r["in_place"], true, "{r}");
    }
}

/// Each node's worker was one process all along (a worker kept across generations is
/// recorded once): `(node, workers)` for every node.
fn workers_per_node(out: &Path) -> Vec<(u64, usize)> {
    let mut per: std::collections::BTreeMap<u64, usize> = Default::default();
    for e in events(out) {
        if e["event"] == "process" && e["role"] == "worker" {
            *per.entry(e["node"].as_u64().expect("node")).or_default() += 1;
        }
    }
    per.into_iter().collect()
}

/// The agent process of `node` (the parent of its worker), from `/proc`.
fn agent_of(out: &Path, node: u64) -> u32 {
    let worker = events(out)
        .into_iter()
        .find(|e| e["event"] == "process" && e["role"] == "worker" && e["node"] == node)
        .and_then(|e| e["pid"].as_u64())
        .expect("the node's worker") as u32;
    let stat = std::fs::read_to_string(format!("/proc/{worker}/stat")).expect("worker stat");
    let after = stat.rsplit_once(')').expect("stat").1;
    after
        .split_whitespace()
        .nth(1)
        .expect("ppid")
        .parse()
        .expect("pid")
}

#[test]
fn a_node_joins_a_running_job_without_a_restart_and_training_is_unchanged() {
    const STEPS: u64 = 20;
    let c = Case::new(STEPS);
    let out = &c.out;
    let mut strays = Strays::default();
    let mut g = cluster(out, STEPS, "3");
    wait_for_step(out, 3, WAIT);
    strays.add_node(out, &[]);
    let stderr = c.finish(&mut g);
    assert!(
        stderr.contains("reconfigured: node(s) [3] join"),
        "{stderr}"
    );
    let r = reconfig_events(out);
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!(r[0]["joined_nodes"], json!([3]), "{}", r[0]);
    assert_eq!(r[0]["nodes"], json!([0, 1, 2, 3]), "{}", r[0]);
    assert_eq!(workers_per_node(out), [(0, 1), (1, 1), (2, 1), (3, 1)]);
    c.check(3 + 4);
    strays.assert_gone();
}

#[test]
fn nodes_drained_by_sigterm_and_by_oobleck_drain_leave_with_no_step_replayed() {
    const STEPS: u64 = 24;
    let c = Case::new(STEPS);
    let out = &c.out;
    let run = c.run();
    let mut g = cluster(out, STEPS, "4");
    wait_for_step(out, 3, WAIT);
    let agent = agent_of(out, 1);
    let term = std::process::Command::new("kill")
        .args(["-TERM", &agent.to_string()])
        .status()
        .expect("kill");
    assert!(term.success());
    wait_for_events(out, 1, WAIT, "reconfiguration", |e| {
        e["event"] == "reconfig"
    });
    let unknown = oobleck_tool(&["drain", "9", "--run", run]);
    assert!(!unknown.status.success());
    let err = String::from_utf8_lossy(&unknown.stderr);
    assert!(err.contains("node 9 is not registered"), "{err}");
    let drained = oobleck_tool(&["drain", "2", "--run", run]);
    assert!(
        drained.status.success(),
        "{}",
        String::from_utf8_lossy(&drained.stderr)
    );
    c.finish(&mut g);
    let r = reconfig_events(out);
    assert_eq!(r.len(), 2, "{r:?}");
    assert_eq!(r[0]["drained_nodes"], json!([1]), "{}", r[0]);
    assert!(r[0]["cause"].as_str().expect("cause").contains("SIGTERM"));
    assert_eq!(r[1]["drained_nodes"], json!([2]), "{}", r[1]);
    assert!(r[1]["cause"]
        .as_str()
        .expect("cause")
        .contains("oobleck drain"));
    assert_eq!(r[1]["nodes"], json!([0, 3]), "{}", r[1]);
    c.check(4 + 4);
}

/// A notice endpoint in the style of AWS's: 404 until `notice` is set, then 200 with a body.
struct NoticeServer {
    url: String,
    notice: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl NoticeServer {
    fn start() -> NoticeServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let url = format!(
            "http://{}/spot/instance-action",
            listener.local_addr().expect("addr")
        );
        let (notice, stop) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let (n, s) = (notice.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let Ok((mut c, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                let _ = c.set_nonblocking(false);
                let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
                let mut buf = [0u8; 2048];
                let _ = c.read(&mut buf);
                let reply = if n.load(Ordering::Relaxed) {
                    let body = r#"{"action": "terminate", "time": "2026-12-01T12:00:00Z"}"#;
                    format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    )
                } else {
                    "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                        .to_string()
                };
                let _ = c.write_all(reply.as_bytes());
            }
        });
        NoticeServer {
            url,
            notice,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for NoticeServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn nodes_drained_by_a_notice_file_and_an_http_notice_leave_with_no_step_replayed() {
    const STEPS: u64 = 30;
    let c = Case::new(STEPS);
    let out = &c.out;
    let notice_file = c.dir.path().join("preempted");
    let server = NoticeServer::start();
    let mut strays = Strays::default();
    let mut g = cluster(out, STEPS, "2");
    wait_for_step(out, 2, WAIT);
    let fast = ["--notice-interval", "0.05"];
    let file_arg = notice_file.to_str().expect("utf-8");
    strays.add_node(
        out,
        &[&["--preemption-notice", file_arg][..], &fast].concat(),
    );
    strays.add_node(
        out,
        &[&["--preemption-notice", &server.url][..], &fast].concat(),
    );
    wait_for_events(out, 1, WAIT, "a plan on 4 nodes", |e| {
        e["event"] == "reconfig" && e["nodes"].as_array().is_some_and(|n| n.len() == 4)
    });
    std::fs::write(&notice_file, "spot reclaim").expect("notice file");
    server.notice.store(true, Ordering::Relaxed);
    c.finish(&mut g);
    let drains: Vec<String> = events(out)
        .into_iter()
        .filter(|e| e["event"] == "drain")
        .map(|e| e["reason"].as_str().expect("reason").to_string())
        .collect();
    assert_eq!(drains.len(), 2, "{drains:?}");
    assert!(
        drains
            .iter()
            .any(|r| r.contains("preemption notice file") && r.contains("spot reclaim")),
        "{drains:?}"
    );
    assert!(
        drains
            .iter()
            .any(|r| r.contains("preemption notice from http://") && r.contains("HTTP 200")),
        "{drains:?}"
    );
    let last = reconfig_events(out).pop().expect("a reconfiguration");
    assert_eq!(last["nodes"], json!([0, 1]), "{last}");
    c.check(2 + 4);
    strays.assert_gone();
}

/// 2 nodes with f = 1 run two pipelines; one dies, so the job goes on with one pipeline and
/// tolerates no further failure. A node that joins is admitted at once (it restores fault
/// tolerance) and the job tolerates one failure again. Meanwhile: a drain of the last node
/// is refused with the numbers, an agent with the wrong token is refused and the job goes on
/// undisturbed, and a notice endpoint that cannot be reached is warned about, not obeyed.
#[test]
fn a_join_raises_the_fault_tolerance_a_failure_lowered_and_bad_requests_disturb_nothing() {
    const STEPS: u64 = 30;
    let c = Case::new(STEPS);
    let out = &c.out;
    let run = c.run();
    let mut strays = Strays::default();
    let mut g = cluster(out, STEPS, "2");
    wait_for_step(out, 2, WAIT);
    let killed = oobleck_tool(&["kill-node", "1", "--run", run]);
    assert!(
        killed.status.success(),
        "{}",
        String::from_utf8_lossy(&killed.stderr)
    );
    wait_for_events(out, 1, WAIT, "recovery", |e| e["event"] == "resumed");
    let refused = oobleck_tool(&["drain", "0", "--run", run]);
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains("draining leaves 0 of 1 nodes; the smallest pipeline needs 1"),
        "{err}"
    );
    let addr = std::fs::read_to_string(out.join("master.json")).expect("master.json");
    let addr: serde_json::Value = serde_json::from_str(&addr).expect("json");
    let mut intruder = std::process::Command::new(OOBLECK);
    intruder
        .args(["agent", "--master", addr["addr"].as_str().expect("addr")])
        .args(["--token", "not-the-token", "--wait", "5"])
        .env("RUST_BACKTRACE", "0")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let intruder = run_tool(intruder);
    assert!(!intruder.status.success());
    let said = String::from_utf8_lossy(&intruder.stderr);
    assert!(said.contains("refused"), "{said}");
    strays.add_node(
        out,
        &[
            "--preemption-notice",
            "http://127.0.0.1:1/",
            "--notice-interval",
            "0.05",
        ],
    );
    c.finish(&mut g);
    let r = reconfig_events(out);
    assert_eq!(r.len(), 2, "{r:?}");
    assert_eq!(
        (r[0]["lost_nodes"].clone(), r[0]["fault_tolerance"].clone()),
        (json!([1]), json!(0)),
        "{}",
        r[0]
    );
    assert_eq!(
        (
            r[1]["joined_nodes"].clone(),
            r[1]["fault_tolerance"].clone()
        ),
        (json!([3]), json!(1)),
        "{}",
        r[1]
    );
    assert!(
        r[1]["cause"]
            .as_str()
            .expect("cause")
            .contains("restores fault tolerance"),
        "{}",
        r[1]
    );
    assert!(events(out).iter().all(|e| e["event"] != "drain"));
    let logs = std::fs::read_dir(out.join("logs")).expect("logs");
    let log: String = logs
        .map(|l| std::fs::read_to_string(l.expect("entry").path()).expect("log"))
        .collect();
    assert!(log.contains("unreachable"), "{log}");
    c.check(2 + 3);
    strays.assert_gone();
}

fn run_tool(c: std::process::Command) -> std::process::Output {
    run(c, Duration::from_secs(20))
}

/// One pipeline over 2 nodes (f = 0), so the drained node holds the only replica of its
/// layers: it joins the next generation's data plane as a donor, sends them to the node that
/// stays, and only then goes. Nothing is replayed and no checkpoint is used.
#[test]
fn a_drained_node_with_the_only_replica_copies_its_layers_off_before_it_goes() {
    const STEPS: u64 = 16;
    let c = Case::new(STEPS);
    let out = &c.out;
    let run = c.run();
    let flags = ["--nodes", "2", "--pipeline-nodes", "2"];
    let mut g = Guard(Some(train_cmd(out, STEPS, &flags).spawn().expect("train")));
    wait_for_step(out, 3, WAIT);
    let drained = oobleck_tool(&["drain", "1", "--run", run]);
    assert!(
        drained.status.success(),
        "{}",
        String::from_utf8_lossy(&drained.stderr)
    );
    let stderr = c.finish(&mut g);
    assert!(
        stderr.contains("they are copied off before it leaves"),
        "{stderr}"
    );
    let r = reconfig_events(out);
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!(r[0]["drained_nodes"], json!([1]), "{}", r[0]);
    assert!(r[0]["copies"].as_u64().is_some_and(|c| c >= 1), "{}", r[0]);
    assert!(r[0]["checkpoint"].is_null(), "{}", r[0]);
    let released = events(out)
        .into_iter()
        .find(|e| e["event"] == "released")
        .expect("a released event");
    assert!(
        released["reason"]
            .as_str()
            .expect("reason")
            .contains("copied off"),
        "{released}"
    );
    c.check(2 + 2);
}
