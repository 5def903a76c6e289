//! Multi-machine mode on one machine: `train --listen` with agents started by hand on other
//! loopback addresses (127.0.0.2, 127.0.0.3), `train --hostfile` starting agents through an
//! ssh stand-in, and the bad inputs of a multi-machine job (a wrong token, a data-plane address
//! a worker cannot bind) ending every process with a clear error.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{free_port, wait_exit, Children, OOBLECK, TRAIN};

const TOKEN: &str = "multi-machine-test-secret";

fn job_args(out: &Path) -> Vec<String> {
    [
        "--model",
        "gpt-tiny",
        "--microbatch-size",
        "2",
        "--global-batch-size",
        "8",
        "--seq-len",
        "32",
        "--eval-batches",
        "1",
        "--sample",
        "0",
        "--steps",
        "3",
        "--fault-threshold",
        "1",
        "--out",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([out.display().to_string()])
    .collect()
}

/// Starts `train` with `args`; its stderr lines arrive on the returned channel.
fn start_train(args: &[String], envs: &[(&str, &str)]) -> (Child, mpsc::Receiver<String>) {
    let mut cmd = Command::new(TRAIN);
    cmd.args(args)
        .env("OOBLECK_BIN", OOBLECK)
        .env_remove("OOBLECK_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("start train");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

fn agent(master: &str, token: &str, host: &str) -> Child {
    agent_in(master, token, host, Path::new("."))
}

/// An agent whose working directory is `cwd`.
fn agent_in(master: &str, token: &str, host: &str, cwd: &Path) -> Child {
    Command::new(OOBLECK)
        .current_dir(cwd)
        .args(["agent", "--master", master, "--host", host])
        .env("OOBLECK_TOKEN", token)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start agent")
}

/// Waits for a stderr line containing `needle`; returns it. Collects every line into `log`.
fn wait_line(
    rx: &mpsc::Receiver<String>,
    needle: &str,
    limit: Duration,
    log: &mut String,
) -> String {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => {
                log.push_str(&l);
                log.push('\n');
                if l.contains(needle) {
                    return l;
                }
            }
            Err(_) => panic!("no line with {needle:?} within {limit:?}; stderr so far:\n{log}"),
        }
    }
}

fn drain(rx: &mpsc::Receiver<String>, log: &mut String) {
    while let Ok(l) = rx.recv_timeout(Duration::from_millis(200)) {
        log.push_str(&l);
        log.push('\n');
    }
}

fn events(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("events.jsonl"))
        .expect("events.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

fn data_addrs(run: &Path) -> Vec<String> {
    events(run)
        .iter()
        .find(|e| e["event"] == "rendezvous")
        .expect("a rendezvous event")["addrs"]
        .as_array()
        .expect("addrs")
        .iter()
        .map(|a| a.as_str().expect("addr").to_string())
        .collect()
}

#[test]
fn agents_started_by_hand_on_other_addresses_train_with_a_listening_master() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let master = format!("127.0.0.1:{}", free_port());
    let mut procs = Children::default();
    // One agent starts before the master is up: it waits for it.
    procs.0.push(agent(&master, TOKEN, "127.0.0.2"));
    std::thread::sleep(Duration::from_millis(500));
    let mut args = job_args(&out);
    args.extend([
        "--listen".into(),
        master.clone(),
        "--expect-nodes".into(),
        "2".into(),
    ]);
    let (train, rx) = start_train(&args, &[("OOBLECK_TOKEN", TOKEN)]);
    procs.0.insert(0, train);
    let mut log = String::new();
    wait_line(
        &rx,
        "master listening on",
        Duration::from_secs(30),
        &mut log,
    );
    // A node with the wrong secret is refused and told why; the job goes on without it.
    let mut intruder = agent(&master, "not-the-secret", "127.0.0.9");
    let st = wait_exit(&mut intruder, Duration::from_secs(20));
    assert!(!st.success());
    let mut err = String::new();
    std::io::Read::read_to_string(intruder.stderr.as_mut().expect("stderr"), &mut err).unwrap();
    assert!(err.contains("refused"), "{err}");
    procs.0.push(agent(&master, TOKEN, "127.0.0.3"));
    let st = wait_exit(&mut procs.0[0], Duration::from_secs(120));
    drain(&rx, &mut log);
    assert!(st.success(), "{log}");
    for a in &mut procs.0[1..] {
        assert!(wait_exit(a, Duration::from_secs(15)).success());
    }
    let mut hosts: Vec<String> = data_addrs(&out)
        .iter()
        .map(|a| a.rsplit_once(':').expect("host:port").0.to_string())
        .collect();
    hosts.sort();
    assert_eq!(hosts, ["127.0.0.2", "127.0.0.3"]);
    assert!(log.contains("done: 3 steps"), "{log}");
    let ck = oobleck_core::checkpoint::latest_checkpoint(&out)
        .expect("list")
        .expect("a checkpoint");
    assert!(ck.ends_with("step-000003"));
}

/// Three agents on 127.0.0.2-4, each in a directory of its own, never told the master's run
/// directory's contents: periodic checkpoints, evaluations, the final checkpoint and a
/// recovery in place after node 1 dies all go over the network. Nothing lands where the
/// agents run.
#[test]
fn a_multi_machine_job_with_a_failure_needs_no_shared_file_system() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("master-run");
    let master = format!("127.0.0.1:{}", free_port());
    let mut args = job_args(&out);
    let steps = args.iter().position(|a| a == "--steps").expect("--steps") + 1;
    args[steps] = "8".into();
    args.extend(
        [
            "--listen",
            &master,
            "--expect-nodes",
            "3",
            "--checkpoint-every",
            "2",
            "--eval-every",
            "4",
            "--inject-failure",
            "1@3",
        ]
        .map(String::from),
    );
    let (train, rx) = start_train(&args, &[("OOBLECK_TOKEN", TOKEN)]);
    let mut procs = Children(vec![train]);
    let mut log = String::new();
    wait_line(
        &rx,
        "master listening on",
        Duration::from_secs(30),
        &mut log,
    );
    let homes: Vec<PathBuf> = (2..5)
        .map(|i| {
            let home = dir.path().join(format!("agent-{i}"));
            std::fs::create_dir_all(&home).expect("agent dir");
            procs
                .0
                .push(agent_in(&master, TOKEN, &format!("127.0.0.{i}"), &home));
            home
        })
        .collect();
    let st = wait_exit(&mut procs.0[0], Duration::from_secs(180));
    drain(&rx, &mut log);
    assert!(st.success(), "{log}");
    assert!(log.contains("done: 8 steps"), "{log}");
    assert!(log.contains("in place at step 3"), "{log}");
    let ev = events(&out);
    let stalls: Vec<f64> = ev
        .iter()
        .filter(|e| e["event"] == "checkpoint")
        .filter_map(|e| e["stall_ms"].as_f64())
        .collect();
    assert!(
        stalls.len() >= 3,
        "periodic and final checkpoints: {stalls:?}"
    );
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).expect("metrics");
    assert!(
        metrics.contains("val_loss"),
        "an evaluation over uploaded state: {metrics}"
    );
    for home in homes {
        let left: Vec<_> = std::fs::read_dir(&home).expect("agent dir").collect();
        assert!(left.is_empty(), "{} has {left:?}", home.display());
    }
    let ck = oobleck_core::checkpoint::latest_checkpoint(&out)
        .expect("list")
        .expect("a checkpoint");
    assert!(ck.ends_with("step-000008"));
}

/// An `ssh` stand-in: skips options up to `--`, then runs the remote command with `sh -c`, as
/// the remote login shell would.
fn fake_ssh(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("fake-ssh");
    std::fs::write(
        &path,
        "#!/bin/sh\nwhile [ \"$#\" -gt 0 ] && [ \"$1\" != \"--\" ]; do shift; done\nshift\nexec sh -c \"$*\"\n",
    )
    .expect("write fake ssh");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

#[test]
fn hostfile_starts_one_agent_per_host_over_ssh() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let ssh = fake_ssh(dir.path());
    let hostfile = dir.path().join("hosts");
    std::fs::write(
        &hostfile,
        format!(
            "# two nodes on this machine\n127.0.0.1:2201 data=127.0.0.2 oobleck={OOBLECK}\n\
             127.0.0.1:2202 data=127.0.0.3 oobleck={OOBLECK}\n"
        ),
    )
    .expect("write hostfile");
    let listen = format!("127.0.0.1:{}", free_port());
    let mut args = job_args(&out);
    args.extend([
        "--listen".into(),
        listen,
        "--hostfile".into(),
        hostfile.display().to_string(),
    ]);
    let mut procs = Children::default();
    let (train, rx) = start_train(&args, &[("OOBLECK_SSH", ssh.to_str().expect("utf-8"))]);
    procs.0.push(train);
    let st = wait_exit(&mut procs.0[0], Duration::from_secs(120));
    let mut log = String::new();
    drain(&rx, &mut log);
    assert!(st.success(), "{log}");
    assert!(log.contains("starting 2 agents over ssh"), "{log}");
    let mut hosts: Vec<String> = data_addrs(&out)
        .iter()
        .map(|a| a.rsplit_once(':').expect("host:port").0.to_string())
        .collect();
    hosts.sort();
    assert_eq!(hosts, ["127.0.0.2", "127.0.0.3"]);
    // Every process the job started is gone.
    let pids: Vec<u64> = events(&out)
        .iter()
        .filter(|e| e["event"] == "process")
        .filter_map(|e| e["pid"].as_u64())
        .collect();
    assert_eq!(pids.len(), 4, "two ssh and two workers: {pids:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids
        .iter()
        .any(|p| Path::new(&format!("/proc/{p}")).exists() && !zombie(*p))
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    for p in pids {
        assert!(
            !Path::new(&format!("/proc/{p}")).exists() || zombie(p),
            "process {p} outlived the job"
        );
    }
}

fn zombie(pid: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit_once(')')
                .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

#[test]
fn a_worker_that_cannot_bind_its_data_plane_address_ends_the_job_clearly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let mut args = job_args(&out);
    args.extend(["--listen", "127.0.0.1:0", "--expect-nodes", "2"].map(String::from));
    let mut procs = Children::default();
    let (train, rx) = start_train(&args, &[("OOBLECK_TOKEN", TOKEN)]);
    procs.0.push(train);
    let mut log = String::new();
    let line = wait_line(
        &rx,
        "master listening on",
        Duration::from_secs(30),
        &mut log,
    );
    let master = line
        .split_whitespace()
        .nth(3)
        .expect("addr")
        .trim_end_matches(':')
        .to_string();
    procs.0.push(agent(&master, TOKEN, "127.0.0.2"));
    // TEST-NET-3: never an address of this machine.
    procs.0.push(agent(&master, TOKEN, "203.0.113.7"));
    let st = wait_exit(&mut procs.0[0], Duration::from_secs(60));
    drain(&rx, &mut log);
    assert!(!st.success());
    assert!(
        log.contains("cannot bind a data-plane port on 203.0.113.7"),
        "{log}"
    );
    for a in &mut procs.0[1..] {
        wait_exit(a, Duration::from_secs(20));
    }
    assert!(events(&out).iter().any(|e| e["event"] == "abort"));
}

/// Flags, environment, and what the error must say.
type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);

#[test]
fn multi_machine_flags_are_checked_before_anything_starts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let cases: [Case; 4] = [
        (
            &["--listen", "127.0.0.1:0", "--expect-nodes", "2"],
            &[],
            "OOBLECK_TOKEN",
        ),
        (
            &["--listen", "127.0.0.1:0"],
            &[("OOBLECK_TOKEN", TOKEN)],
            "--expect-nodes",
        ),
        (&["--expect-nodes", "2"], &[], "--listen"),
        (
            &[
                "--listen",
                "0.0.0.0:7000",
                "--hostfile",
                "/nonexistent/hosts",
            ],
            &[],
            "must be an IP:PORT the hosts can reach",
        ),
    ];
    for (flags, envs, needle) in cases {
        let mut args = job_args(&out);
        args.extend(flags.iter().map(|s| s.to_string()));
        let (mut train, rx) = start_train(&args, envs);
        let st = wait_exit(&mut train, Duration::from_secs(30));
        let mut log = String::new();
        drain(&rx, &mut log);
        assert!(!st.success(), "{flags:?}");
        assert!(log.contains(needle), "{flags:?}: {log}");
        assert!(!out.exists(), "{flags:?} created the run directory");
    }
}
