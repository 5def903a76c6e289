//! The master of a job is SIGKILLed: its agents keep their workers (and the trained state they
//! hold) and look for a master for `--master-wait`, saying so. When none comes they stop their
//! workers and exit, leaving no process and no shared-memory segment behind; when one comes
//! back at the address in time it takes them as new nodes and its job runs to its end. And
//! `--master-wait` refuses a value that is no wait.

mod common;

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::*;

/// The agents' wait for a master in the test: long enough that the check that they still run
/// (made as soon as both said they lost the master) cannot race it on a loaded machine.
const MASTER_WAIT_S: u64 = 6;
/// After the wait, how long the agents may take to stop their workers (5 s grace each at
/// most) and exit: a bound, not a timing.
const STOP_BOUND: Duration = Duration::from_secs(30);

/// Reads the child's stderr to its end on a thread (the agents and workers write there after
/// the master is gone: a pipe nobody reads would block them). The end comes when every
/// process holding it, the agents and workers included, has exited.
fn drain_stderr(child: &mut Child) -> (Arc<Mutex<String>>, JoinHandle<()>) {
    let text = Arc::new(Mutex::new(String::new()));
    let reader = drain_into(child, &text);
    (text, reader)
}

/// [`drain_stderr`] into a buffer shared with other processes.
fn drain_into(child: &mut Child, text: &Arc<Mutex<String>>) -> JoinHandle<()> {
    let mut pipe = child.stderr.take().expect("stderr piped");
    let sink = Arc::clone(text);
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = pipe.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock()
                .expect("stderr buffer")
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    reader
}

/// Waits (at most `limit`) until `text` holds `n` lines containing `needle`.
fn wait_for_lines(text: &Mutex<String>, needle: &str, n: usize, limit: Duration) {
    let start = Instant::now();
    loop {
        let seen = text.lock().expect("stderr buffer").matches(needle).count();
        if seen >= n {
            return;
        }
        assert!(
            start.elapsed() < limit,
            "{seen} of {n} lines with {needle:?} within {limit:?}; stderr:\n{}",
            text.lock().expect("stderr buffer")
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The pids of the processes the run recorded (a local job's agents, and the workers), once
/// `want` were.
fn recorded_pids(run: &Path, want: usize) -> Vec<u32> {
    let start = Instant::now();
    loop {
        let pids = child_pids(run);
        if pids.len() >= want {
            return pids;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "only {pids:?} recorded"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sends `signal` (`KILL`, `STOP`) to `pid`.
fn signal(signal: &str, pid: u32) {
    let st = Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .expect("kill");
    assert!(st.success(), "kill -{signal} {pid}");
}

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

/// A `train --listen ADDR --expect-nodes 2` master of `steps` steps writing to `out`.
fn listening_master(out: &Path, steps: u64, addr: &str) -> Child {
    let mut cmd = train_cmd(out, steps, &["--listen", addr, "--expect-nodes", "2"]);
    cmd.env("OOBLECK_TOKEN", TOKEN).stdout(Stdio::null());
    cmd.spawn().expect("start the master")
}

const TOKEN: &str = "master-lost-test-secret";

/// `train agent --master ADDR --master-wait WAIT EXTRA` with the job's token and `env`, its
/// stderr piped (for [`drain_into`]).
fn hand_agent(addr: &str, wait: &str, extra: &[&str], env: &[(&str, &str)]) -> Child {
    Command::new(TRAIN)
        .args(["agent", "--master", addr, "--master-wait", wait])
        .args(extra)
        .env("OOBLECK_TOKEN", TOKEN)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start an agent")
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

/// The events of `run` of kind `kind`.
fn events_of(run: &Path, kind: &str) -> Vec<serde_json::Value> {
    events(run)
        .into_iter()
        .filter(|e| e["event"] == kind)
        .collect()
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

/// A local 2-node job of `steps` steps with one standby master, node 0 slowed (100 ms a
/// microbatch) so that its master goes mid-run, started and run to step 4: its parts
/// ([`StandbyJob::of`]: other shapes, and no standby).
struct StandbyJob {
    dir: tempfile::TempDir,
    out: std::path::PathBuf,
    copy: std::path::PathBuf,
    want: Vec<(u64, f64)>,
    want_params: std::collections::BTreeMap<String, candle_core::Tensor>,
    guard: Guard,
    log: Arc<Mutex<String>>,
    reader: JoinHandle<()>,
    /// The agents, the workers and the standbys, in that order.
    pids: Vec<u32>,
    nodes: usize,
}

impl StandbyJob {
    fn start(steps: u64) -> StandbyJob {
        StandbyJob::with_standbys(steps, 1)
    }

    /// [`StandbyJob::start`] with `standbys` standby masters; `pids` has them all.
    fn with_standbys(steps: u64, standbys: usize) -> StandbyJob {
        StandbyJob::of(steps, standbys, 2, 4)
    }

    /// A local job of `nodes` nodes with `standbys` standby masters, run to step `at`.
    fn of(steps: u64, standbys: usize, nodes: usize, at: u64) -> StandbyJob {
        let dir = tempfile::tempdir().expect("tempdir");
        let (want, want_params) = single_process(dir.path(), steps);
        let out = dir.path().join("run");
        let copy = dir.path().join("run.standby-0");
        let (k, n) = (standbys.to_string(), nodes.to_string());
        let extra = [
            "--nodes",
            n.as_str(),
            "--master-wait",
            "60",
            "--standby-masters",
            k.as_str(),
        ];
        let mut cmd = train_cmd(&out, steps, &extra);
        cmd.env("OOBLECK_TEST_SLOW", "0:100");
        let mut first = cmd.spawn().expect("start train");
        let (log, reader) = drain_stderr(&mut first);
        let guard = Guard(Some(first));
        wait_for_step(&out, at, Duration::from_secs(180));
        let mut pids = recorded_pids(&out, 2 * nodes);
        pids.extend((0..standbys).map(|k| standby_pid(&log, k)));
        StandbyJob {
            dir,
            out,
            copy,
            want,
            want_params,
            guard,
            log,
            reader,
            pids,
            nodes,
        }
    }

    /// Waits for the standby (the job's master once it took over) to finish the job, and
    /// checks that it did, in its copy, as one process would have.
    fn finished_by_the_standby(&self, steps: u64) -> String {
        self.finished_by(0, steps)
    }

    /// [`StandbyJob::finished_by_the_standby`] for standby `k`.
    fn finished_by(&self, k: usize, steps: u64) -> String {
        let standby = self.pids[2 * self.nodes + k];
        let copy = self.dir.path().join(format!("run.standby-{k}"));
        let deadline = Instant::now() + Duration::from_secs(180);
        while alive(standby) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        let text = self.log.lock().expect("log").clone();
        assert!(!alive(standby), "the standby still runs:\n{text}");
        assert!(text.contains(&format!("done: {steps} steps")), "{text}");
        assert_same_training(&copy, &self.want, &self.want_params);
        text
    }
}

/// Waits until none of `pids` runs (at most `STOP_BOUND`); fails naming those left.
fn assert_all_exit(pids: &[u32]) {
    let stop = Instant::now() + STOP_BOUND;
    while pids.iter().any(|&p| alive(p)) && Instant::now() < stop {
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

#[test]
fn a_standby_takes_over_from_its_copy_when_the_master_and_its_run_directory_are_gone() {
    use rand::{Rng, SeedableRng};
    const STEPS: u64 = 20;
    // A 3-node job, its master killed at a seeded step of the first half.
    let at = rand_chacha::ChaCha8Rng::seed_from_u64(36).random_range(3..=10);
    let mut job = StandbyJob::of(STEPS, 1, 3, at);
    let _strays = Strays(job.pids.clone());
    // The master's machine goes, and its disk with it.
    let mut master = job.guard.0.take().expect("train");
    master.kill().expect("SIGKILL the master");
    master.wait().expect("reap the master");
    std::fs::remove_dir_all(&job.out).expect("delete the run directory");

    // The standby takes over from its copy and finishes the job there.
    let text = job.finished_by_the_standby(STEPS);
    assert!(text.contains("taking over at"), "{text}");
    assert_eq!(events_of(&job.copy, "reattach").len(), 1);
    assert_took_over(&job.copy, 3);
    let last = reconfig_events(&job.copy).pop().expect("a reconfiguration");
    assert_eq!(last["in_place"], true, "{last}");
    assert_eq!(last["replayed_steps"], 0, "{last}");
    assert_all_exit(&job.pids);
    job.reader.join().expect("stderr reader");
}

/// The run's master was lost once and the standby at `copy` took over, with its phases, and
/// re-adopted all of the `nodes`.
fn assert_took_over(copy: &Path, nodes: usize) {
    let lost = events_of(copy, "master_lost");
    assert_eq!(lost.len(), 1, "{lost:?}");
    assert_eq!(
        (&lost[0]["lost_epoch"], &lost[0]["epoch"]),
        (&1.into(), &2.into())
    );
    let why = lost[0]["why"].as_str().expect("why");
    assert!(why.starts_with("the standby at "), "{why}");
    let took = events_of(copy, "master_took_over");
    assert_eq!(took.len(), 1, "{took:?}");
    let t = &took[0];
    assert_eq!(t["nodes_back"].as_array().map(Vec::len), Some(nodes), "{t}");
    let phases = ["detect_s", "quorum_s", "readopt_s", "first_commit_s"];
    let sum: f64 = phases
        .iter()
        .map(|p| {
            t["phases"][p]
                .as_f64()
                .unwrap_or_else(|| panic!("{p}: {t}"))
        })
        .sum();
    let total = t["total_s"].as_f64().expect("total_s");
    assert!((sum - total).abs() < 1e-6 && total > 0.0, "{t}");
}

/// Standby master `k`'s pid, from the line the master says it in.
fn standby_pid(log: &Mutex<String>, k: usize) -> u32 {
    let text = log.lock().expect("log").clone();
    let prefix = format!("standby master {k}: pid ");
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .unwrap_or_else(|| panic!("no standby said where it is:\n{text}"))
        .to_string();
    line.split(',').next().expect("pid").parse().expect("a pid")
}

#[test]
fn a_master_stopped_until_its_standby_took_over_steps_down_when_it_wakes() {
    const STEPS: u64 = 24;
    let mut job = StandbyJob::start(STEPS);
    let _strays = Strays(job.pids.clone());
    let master = job.guard.0.as_ref().expect("train").id();
    signal("STOP", master);
    wait_for_lines(&job.log, "re-adopts this node", 2, Duration::from_secs(60));
    // `oobleck status` on the run the person started follows the leader: the stopped master
    // does not answer, the standby that took over does, of epoch 2.
    let run = job.out.display().to_string();
    let o = oobleck_tool(&["status", "--run", &run, "--json", "--timeout", "2"]);
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{said}");
    assert!(said.contains("took over (epoch 2)"), "{said}");
    let status: serde_json::Value = serde_json::from_slice(&o.stdout).expect("status JSON");
    assert_eq!(status["epoch"], 2, "{status}");
    // Woken up, the old master must act on nothing: it steps down.
    signal("CONT", master);
    let st = wait_exit(
        job.guard.0.as_mut().expect("train"),
        Duration::from_secs(30),
    );
    assert!(!st.success(), "the old master went on");
    let text = job.finished_by_the_standby(STEPS);
    assert!(text.contains("was replaced: it was stopped for"), "{text}");
    let epoch = |run: &Path| std::fs::read_to_string(run.join("master.epoch")).expect("epoch");
    assert_eq!(epoch(&job.out).trim(), "1");
    assert_eq!(epoch(&job.copy).trim(), "2");
    assert_all_exit(&job.pids);
    job.reader.join().expect("stderr reader");
    drop(job.dir);
}

#[test]
fn an_agent_started_with_standby_runs_the_standby_that_takes_over() {
    const STEPS: u64 = 16;
    let dir = tempfile::tempdir().expect("tempdir");
    let (want, want_params) = single_process(dir.path(), STEPS);
    let addr = format!("127.0.0.1:{}", free_port());
    let out = dir.path().join("run");
    let copy = dir.path().join("copy");
    let mut procs = Children::default();
    let mut master = listening_master(&out, STEPS, &addr);
    let (master_log, master_reader) = drain_stderr(&mut master);
    procs.0.push(master);
    let log = Arc::new(Mutex::new(String::new()));
    let mut readers = vec![master_reader];
    let slow = [("OOBLECK_TEST_SLOW", "0:100")];
    let copy_arg = copy.display().to_string();
    let with_standby = ["--standby", "--standby-copy", copy_arg.as_str()];
    for extra in [&with_standby[..], &[]] {
        let mut agent = hand_agent(&addr, "60", extra, &slow);
        readers.push(drain_into(&mut agent, &log));
        procs.0.push(agent);
    }
    wait_for_lines(
        &log,
        "standby master beside this agent: pid",
        1,
        Duration::from_secs(30),
    );
    wait_for_step(&out, 4, Duration::from_secs(180));
    let _strays = Strays(recorded_pids(&out, 2));
    procs.0[0].kill().expect("SIGKILL the master");
    procs.0[0].wait().expect("reap the master");
    let start = Instant::now();
    for p in procs.0.iter_mut().skip(1) {
        let st = wait_exit(p, Duration::from_secs(180).saturating_sub(start.elapsed()));
        assert!(st.success(), "{st}; agents:\n{}", log.lock().expect("log"));
    }
    // The agent waits for its standby only while it is one; the master it became finishes.
    let standby = log
        .lock()
        .expect("log")
        .lines()
        .find_map(|l| l.split("standby master beside this agent: pid ").nth(1))
        .and_then(|l| l.split(',').next()?.parse::<u32>().ok())
        .expect("the standby's pid");
    while alive(standby) && start.elapsed() < Duration::from_secs(180) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let text = log.lock().expect("log").clone();
    assert!(!alive(standby), "the standby still runs:\n{text}");
    assert!(text.contains(&format!("done: {STEPS} steps")), "{text}");
    assert_same_training(&copy, &want, &want_params);
    assert_took_over(&copy, 2);
    for r in readers {
        r.join().expect("stderr reader");
    }
    drop(master_log);
}

#[test]
fn of_two_standbys_the_first_takes_over_and_the_second_keeps_its_copy_for_it() {
    const STEPS: u64 = 20;
    let mut job = StandbyJob::with_standbys(STEPS, 2);
    let _strays = Strays(job.pids.clone());
    let mut master = job.guard.0.take().expect("train");
    master.kill().expect("SIGKILL the master");
    master.wait().expect("reap the master");
    let follows = "took over, and this one keeps its copy for it";
    wait_for_lines(&job.log, follows, 1, Duration::from_secs(60));
    // The first to register takes over (not always standby 0: they start together).
    let copy = |k: usize| job.dir.path().join(format!("run.standby-{k}"));
    let text = job.log.lock().expect("log").clone();
    let first = (0..2)
        .find(|&k| text.contains(&format!("from {}\n", copy(k).display())))
        .unwrap_or_else(|| panic!("no standby took over:\n{text}"));
    job.finished_by(first, STEPS);
    assert_took_over(&copy(first), 2);
    // The second had the new master's commits on its disk, and left with the job.
    let second = copy(1 - first);
    let lost_at = events_of(&copy(first), "master_lost")[0]["step"]
        .as_u64()
        .expect("step");
    let got = losses(&second);
    assert!(got.len() as u64 > lost_at + 1, "{got:?}");
    for ((s, l), (ws, wl)) in got.iter().zip(&job.want) {
        assert_eq!(s, ws, "every step once in the second copy");
        assert!((l - wl).abs() < TOL, "step {s}: {l} vs {wl}");
    }
    assert_all_exit(&job.pids);
    job.reader.join().expect("stderr reader");
}

#[test]
fn the_master_and_the_first_of_two_standbys_killed_at_once_the_second_takes_over() {
    const STEPS: u64 = 20;
    let mut job = StandbyJob::with_standbys(STEPS, 2);
    let _strays = Strays(job.pids.clone());
    // The first the master names (standbys.json: the first to register) is ahead.
    let named = std::fs::read_to_string(job.out.join("standbys.json")).expect("standbys.json");
    let named: serde_json::Value = serde_json::from_str(&named).expect("JSON");
    let ahead = named["standbys"][0]
        .as_str()
        .expect("a standby")
        .to_string();
    let text = job.log.lock().expect("log").clone();
    let first = (0..2)
        .find(|&k| text.contains(&format!("standby-{k}, takes over at {ahead}\n")))
        .unwrap_or_else(|| panic!("no standby at {ahead}:\n{text}"));
    let mut master = job.guard.0.take().expect("train");
    master.kill().expect("SIGKILL the master");
    signal("KILL", job.pids[2 * job.nodes + first]);
    master.wait().expect("reap the master");
    // The second waits for the first to take over, in vain, then takes over itself.
    let text = job.finished_by(1 - first, STEPS);
    let second = job.dir.path().join(format!("run.standby-{}", 1 - first));
    assert_took_over(&second, 2);
    assert!(!text.contains("keeps its copy for it"), "{text}");
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
