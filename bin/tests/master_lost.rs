//! The master of a job is SIGKILLed: its agents keep their workers (and the trained state they
//! hold) and look for a master for `--master-wait`, saying so. When none comes they stop their
//! workers and exit, leaving no process and no shared-memory segment behind; when one comes
//! back at the address in time it takes them as new nodes and its job runs to its end. And
//! `--master-wait` refuses a value that is no wait.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::masters::*;
use common::*;

/// The agents' wait for a master in the test: long enough that the check that they still run
/// (made as soon as both said they lost the master) cannot race it on a loaded machine.
const MASTER_WAIT_S: u64 = 6;
/// Runs a local 2-node job with a short `--master-wait`, takes its master away with `sig`,
/// and checks that both agents say they lost it (`why` in their line) while every agent and
/// worker still runs, then give up, and that nothing is left once they did.
fn outlive_the_master(sig: &str, why: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("run");
    let wait = MASTER_WAIT_S.to_string();
    // Far more steps than the test lets it run: the master goes in the middle.
    let mut cmd = train_cmd(&out, 100_000, &["--nodes", "2", "--master-wait", &wait]);
    let mut master = cmd.spawn().expect("start train");
    let (stderr, reader) = drain_stderr(&mut master);
    let mut guard = Guard(Some(master));
    wait_for_step(&out, 2, Duration::from_secs(180));
    // 2 agents and their 2 workers.
    let pids = recorded_pids(&out, 4);
    let _strays = Strays(pids.clone());
    signal(sig, guard.0.as_ref().expect("train runs").id());

    // Both agents say they lost it and look for it, and every process still runs.
    wait_for_lines(&stderr, "master lost at step", 2, Duration::from_secs(30));
    let gone: Vec<u32> = pids.iter().copied().filter(|&p| !alive(p)).collect();
    assert!(
        gone.is_empty(),
        "processes gone within the {MASTER_WAIT_S} s wait: {gone:?} of {pids:?}; stderr:\n{}",
        stderr.lock().expect("stderr buffer")
    );
    wait_for_lines(&stderr, why, 2, Duration::from_secs(5));

    // No master comes: each agent gives up, stops its workers and exits.
    let bound = Duration::from_secs(MASTER_WAIT_S) + STOP_BOUND;
    let gave_up = format!("no master within --master-wait {MASTER_WAIT_S} s; stopping workers");
    wait_for_lines(&stderr, &gave_up, 2, bound);
    let start = Instant::now();
    while pids.iter().any(|&p| alive(p)) && start.elapsed() < STOP_BOUND {
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    assert!(left.is_empty(), "processes left behind: {left:?}");
    // A stopped master goes now (SIGKILL ends a stopped process too).
    let mut master = guard.0.take().expect("train");
    let _ = master.kill();
    let status = master.wait().expect("reap the master");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    // Every holder of the stderr pipe exited: no process this test does not know of is left.
    reader.join().expect("stderr reader");
    assert_no_segments(&out);
    let text = stderr.lock().expect("stderr buffer").clone();
    assert!(
        text.contains(&format!("for {MASTER_WAIT_S} s (--master-wait)")),
        "{text}"
    );
}

#[test]
fn agents_outlive_a_killed_master_for_the_master_wait_then_leave_nothing_behind() {
    // Its connections close, and (a local job) the agents' stdin: either says so first.
    outlive_the_master("KILL", "master lost at step");
}

#[test]
fn agents_take_a_master_silent_for_a_lease_for_lost() {
    // SIGSTOP: the connections stay open, the heartbeats stop.
    outlive_the_master("STOP", "silent for its lease of 3000 ms");
}

#[test]
fn a_master_back_in_time_takes_the_waiting_agents_as_new_nodes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let addr = format!("127.0.0.1:{}", free_port());
    let first = dir.path().join("first");
    let mut procs = Children::default();
    let mut master = listening_master(&first, 100_000, &addr);
    let (master_log, master_reader) = drain_stderr(&mut master);
    procs.0.push(master);
    let agents_log = Arc::new(Mutex::new(String::new()));
    let mut readers = vec![master_reader];
    for _ in 0..2 {
        let mut agent = hand_agent(&addr, "120", &[], &[]);
        readers.push(drain_into(&mut agent, &agents_log));
        procs.0.push(agent);
    }
    wait_for_step(&first, 2, Duration::from_secs(180));
    // The 2 workers (the agents, started here, are not the master's to record).
    let first_pids = recorded_pids(&first, 2);
    let _strays = Strays(first_pids.clone());
    procs.0[0].kill().expect("SIGKILL the master");
    procs.0[0].wait().expect("reap the master");
    wait_for_lines(
        &agents_log,
        "master lost at step",
        2,
        Duration::from_secs(30),
    );

    // A master comes back at the address, with a job of its own: the agents join it.
    let second = dir.path().join("second");
    let mut again = listening_master(&second, 3, &addr);
    let (again_log, again_reader) = drain_stderr(&mut again);
    readers.push(again_reader);
    procs.0.push(again);
    wait_for_lines(&agents_log, "found a master at", 2, Duration::from_secs(60));
    let limit = Duration::from_secs(180);
    let start = Instant::now();
    for p in procs.0.iter_mut().skip(1) {
        let left = limit.saturating_sub(start.elapsed());
        let st = wait_exit(p, left);
        assert!(
            st.success(),
            "{st}; master:\n{}\nagents:\n{}",
            again_log.lock().expect("log"),
            agents_log.lock().expect("log")
        );
    }
    assert_eq!(losses(&second).len(), 3, "the second job ran every step");
    // The first job's workers were stopped when their agents joined the second master.
    let all: Vec<u32> = first_pids.into_iter().chain(child_pids(&second)).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while all.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<u32> = all.iter().copied().filter(|&p| alive(p)).collect();
    assert!(left.is_empty(), "processes left behind: {left:?}");
    for r in readers {
        r.join().expect("stderr reader");
    }
    drop(master_log);
}

/// `train --resume RUN --reattach`, the master restarted on the run directory, its stdout
/// dropped and its stderr captured.
fn reattach_cmd(run: &Path) -> Command {
    let mut c = Command::new(TRAIN);
    c.arg("--resume")
        .arg(run)
        .arg("--reattach")
        .env("OOBLECK_PROFILE", "analytical")
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

#[test]
fn a_master_restarted_with_reattach_takes_back_its_agents_and_workers_and_loses_no_step() {
    const STEPS: u64 = 20;
    let mut job = StandbyJob::of(STEPS, 0, 2, 4);
    let _strays = Strays(job.pids.clone());
    let workers_before: Vec<u64> = events_of(&job.out, "process")
        .iter()
        .filter(|e| e["role"] == "worker")
        .filter_map(|e| e["pid"].as_u64())
        .collect();
    let mut first = job.guard.0.take().expect("train");
    first.kill().expect("SIGKILL the master");
    first.wait().expect("reap the master");
    wait_for_lines(&job.log, "master lost at step", 2, Duration::from_secs(30));

    let mut again = reattach_cmd(&job.out).spawn().expect("restart the master");
    let (again_log, again_reader) = drain_stderr(&mut again);
    job.guard = Guard(Some(again));
    let st = wait_exit(
        job.guard.0.as_mut().expect("train"),
        Duration::from_secs(180),
    );
    assert!(
        st.success(),
        "{st}; restarted master:\n{}\nagents:\n{}",
        again_log.lock().expect("log"),
        job.log.lock().expect("log")
    );
    again_reader.join().expect("stderr reader");
    wait_for_lines(&job.log, "re-adopts this node", 2, Duration::from_secs(5));

    // Every step once, as one process trains them; nothing loaded, nothing replayed.
    assert_same_training(&job.out, &job.want, &job.want_params);
    assert_eq!(events_of(&job.out, "reattach").len(), 1);
    assert!(events_of(&job.out, "resume").is_empty());
    assert_eq!(events_of(&job.out, "returned").len(), 2);
    let reconfig = events_of(&job.out, "reconfig");
    let last = reconfig
        .last()
        .expect("a reconfiguration after the re-adoption");
    assert_eq!(last["in_place"], true, "{last}");
    assert_eq!(last["replayed_steps"], 0, "{last}");
    assert!(last["checkpoint"].is_null(), "{last}");
    // The same worker processes trained on: none was started again.
    let workers_after: std::collections::BTreeSet<u64> = events_of(&job.out, "process")
        .iter()
        .filter(|e| e["role"] == "worker")
        .filter_map(|e| e["pid"].as_u64())
        .collect();
    let before: std::collections::BTreeSet<u64> = workers_before.into_iter().collect();
    assert_eq!(workers_after, before);
    // The restarted master shut the agents down: nothing is left.
    assert_all_exit(&job.pids);
    job.reader.join().expect("stderr reader");
    assert_no_segments(&job.out);
}

#[test]
fn a_master_stopped_longer_than_its_lease_without_a_standby_starts_again_and_loses_no_step() {
    const STEPS: u64 = 20;
    let mut job = StandbyJob::of(STEPS, 0, 2, 4);
    let _strays = Strays(job.pids.clone());
    let master = job.guard.0.as_ref().expect("train").id();
    signal("STOP", master);
    wait_for_lines(&job.log, "master lost at step", 2, Duration::from_secs(30));
    // Woken, it finds it was stopped past its lease: it starts again on its run directory
    // (the same process) and takes its agents back.
    signal("CONT", master);
    let st = wait_exit(
        job.guard.0.as_mut().expect("train"),
        Duration::from_secs(180),
    );
    let text = job.log.lock().expect("log").clone();
    assert!(st.success(), "{st}:\n{text}");
    assert!(text.contains("near or past its lease of 3000 ms"), "{text}");
    assert_same_training(&job.out, &job.want, &job.want_params);
    let lost = events_of(&job.out, "master_lost");
    assert_eq!(lost.len(), 1, "{lost:?}");
    let why = lost[0]["why"].as_str().expect("why");
    assert!(why.contains("was stopped for"), "{why}");
    assert_eq!(events_of(&job.out, "master_took_over").len(), 1);
    let last = reconfig_events(&job.out).pop().expect("a reconfiguration");
    assert_eq!(last["in_place"], true, "{last}");
    assert_eq!(last["replayed_steps"], 0, "{last}");
    assert!(events_of(&job.out, "resume").is_empty());
    assert_all_exit(&job.pids);
    job.reader.join().expect("stderr reader");
}

/// `train --resume RUN --reattach EXTRA`: refused, with its message.
fn reattach_refused(run: &Path, extra: &[&str]) -> String {
    let o = reattach_cmd(run).args(extra).output().expect("run train");
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        !o.status.success(),
        "--reattach {extra:?} was accepted: {stderr}"
    );
    stderr
}

#[test]
fn reattach_refuses_what_it_cannot_take_back_and_says_what_to_do() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A run that finished: nothing waits for a master.
    let done = dir.path().join("done");
    let o = common::run(
        train_cmd(&done, 2, &["--nodes", "2"]),
        Duration::from_secs(120),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let e = reattach_refused(&done, &[]);
    assert!(e.contains("last step (2 of 2) is committed"), "{e}");
    // A run whose master still runs: its address is taken.
    let live = dir.path().join("live");
    let mut cmd = train_cmd(&live, 100_000, &["--nodes", "2", "--master-wait", "1"]);
    let mut master = cmd.spawn().expect("start train");
    let (log, reader) = drain_stderr(&mut master);
    let mut guard = Guard(Some(master));
    wait_for_step(&live, 1, Duration::from_secs(180));
    let pids = recorded_pids(&live, 4);
    let _strays = Strays(pids.clone());
    let e = reattach_refused(&live, &[]);
    assert!(
        e.contains("is in use") && e.contains("still running"),
        "{e}"
    );
    // Its master killed, and its agents gone after their wait: none comes back.
    let mut master = guard.0.take().expect("train");
    master.kill().expect("SIGKILL the master");
    master.wait().expect("reap the master");
    let gave_up = "no master within --master-wait 1 s; stopping workers";
    wait_for_lines(&log, gave_up, 2, STOP_BOUND);
    let e = reattach_refused(&live, &["--master-wait", "1"]);
    assert!(
        e.contains("no agent of the lost master came back within 11 s")
            && e.contains("`train --resume RUN` without --reattach"),
        "{e}"
    );
    reader.join().expect("stderr reader");
    // And --reattach is for a run: it needs --resume.
    let o = Command::new(TRAIN)
        .arg("--reattach")
        .stdin(Stdio::null())
        .output()
        .expect("run train");
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("--resume"), "{e}");
}

/// The parent of process `pid` (`/proc/PID/stat`, field 4).
fn parent_of(pid: u32) -> u32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    // The name (field 2) is in parentheses and may hold spaces: fields follow its `)`.
    let rest = &stat[stat.rfind(')').expect("a stat line") + 2..];
    rest.split(' ')
        .nth(1)
        .expect("ppid")
        .parse()
        .expect("a pid")
}

#[test]
fn a_master_and_a_node_killed_at_once_cost_one_reattach_and_one_recovery_in_place() {
    const STEPS: u64 = 16;
    let dir = tempfile::tempdir().expect("tempdir");
    let (want, want_params) = single_process(dir.path(), STEPS);
    let addr = format!("127.0.0.1:{}", free_port());
    let out = dir.path().join("run");
    let mut procs = Children::default();
    let mut cmd = train_cmd(
        &out,
        STEPS,
        &[
            "--listen",
            &addr,
            "--expect-nodes",
            "3",
            "--fault-threshold",
            "1",
        ],
    );
    cmd.env("OOBLECK_TOKEN", TOKEN).stdout(Stdio::null());
    let mut master = cmd.spawn().expect("start the master");
    let (master_log, master_reader) = drain_stderr(&mut master);
    procs.0.push(master);
    let agents_log = Arc::new(Mutex::new(String::new()));
    let mut readers = vec![master_reader];
    for _ in 0..3 {
        let mut agent = hand_agent(&addr, "60", &[], &[("OOBLECK_TEST_SLOW", "0:100")]);
        readers.push(drain_into(&mut agent, &agents_log));
        procs.0.push(agent);
    }
    wait_for_step(&out, 4, Duration::from_secs(180));
    let workers = recorded_pids(&out, 3);
    let _strays = Strays(workers.clone());
    let worker_of_2 = events_of(&out, "process")
        .iter()
        .find(|e| e["role"] == "worker" && e["node"] == 2)
        .and_then(|e| e["pid"].as_u64())
        .expect("node 2's worker") as u32;
    let agent_of_2 = parent_of(worker_of_2);
    // The master, node 2's agent and its worker, as one machine's crash and another's.
    for pid in [procs.0[0].id(), agent_of_2, worker_of_2] {
        signal("KILL", pid);
    }
    procs.0[0].wait().expect("reap the master");
    wait_for_lines(
        &agents_log,
        "master lost at step",
        2,
        Duration::from_secs(30),
    );

    let mut again = reattach_cmd(&out)
        .env("OOBLECK_TOKEN", TOKEN)
        .spawn()
        .expect("restart the master");
    let (again_log, again_reader) = drain_stderr(&mut again);
    readers.push(again_reader);
    let st = wait_exit(&mut again, Duration::from_secs(180));
    procs.0.push(again);
    assert!(
        st.success(),
        "{st}; restarted master:\n{}\nagents:\n{}",
        again_log.lock().expect("log"),
        agents_log.lock().expect("log")
    );
    let text = again_log.lock().expect("log").clone();
    assert!(text.contains("re-adopting 2 of 3 nodes"), "{text}");
    assert_same_training(&out, &want, &want_params);
    let last = reconfig_events(&out).pop().expect("a reconfiguration");
    assert_eq!(last["in_place"], true, "{last}");
    assert_eq!(last["lost_nodes"], serde_json::json!([2]), "{last}");
    assert_eq!(last["replayed_steps"], 0, "{last}");
    // The two agents left stopped when the job ended; the killed node's are gone.
    for p in procs.0.iter_mut().skip(1) {
        if let Ok(None) = p.try_wait() {
            wait_exit(p, STOP_BOUND);
        }
    }
    let left: Vec<u32> = workers.iter().copied().filter(|&p| alive(p)).collect();
    assert!(left.is_empty(), "processes left behind: {left:?}");
    for r in readers {
        r.join().expect("stderr reader");
    }
    drop(master_log);
}

/// `train` (and `train agent`) with `--master-wait VALUE`: refused, saying what it takes.
fn refused(args: &[&str]) -> String {
    let o = Command::new(TRAIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run train");
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "{args:?} was accepted: {stderr}");
    stderr
}

#[test]
fn a_master_wait_that_is_no_wait_is_refused_with_what_it_takes() {
    for bad in ["0", "soon", "1.5"] {
        for cmd in [
            &["--master-wait", bad][..],
            &[
                "agent",
                "--master",
                "127.0.0.1:1",
                "--token",
                "t",
                "--master-wait",
                bad,
            ][..],
        ] {
            let e = refused(cmd);
            assert!(
                e.contains("--master-wait") && e.contains("at least 1"),
                "{cmd:?}: {e}"
            );
        }
    }
}
