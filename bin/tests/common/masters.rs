//! What the tests of a lost master share (`master_lost.rs`, `standby_masters.rs`): reading the
//! stderr of a job, its processes, hand-started agents, and a local job run to mid-run with
//! standby masters or none ([`StandbyJob`]).

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::*;

/// After the wait, how long the agents may take to stop their workers (5 s grace each at
/// most) and exit: a bound, not a timing.
pub const STOP_BOUND: Duration = Duration::from_secs(30);

/// Reads the child's stderr to its end on a thread (the agents and workers write there after
/// the master is gone: a pipe nobody reads would block them). The end comes when every
/// process holding it, the agents and workers included, has exited.
pub fn drain_stderr(child: &mut Child) -> (Arc<Mutex<String>>, JoinHandle<()>) {
    let text = Arc::new(Mutex::new(String::new()));
    let reader = drain_into(child, &text);
    (text, reader)
}

/// [`drain_stderr`] into a buffer shared with other processes.
pub fn drain_into(child: &mut Child, text: &Arc<Mutex<String>>) -> JoinHandle<()> {
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
pub fn wait_for_lines(text: &Mutex<String>, needle: &str, n: usize, limit: Duration) {
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
pub fn recorded_pids(run: &Path, want: usize) -> Vec<u32> {
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
pub fn signal(signal: &str, pid: u32) {
    let st = Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .expect("kill");
    assert!(st.success(), "kill -{signal} {pid}");
}

/// A `train --listen ADDR --expect-nodes 2` master of `steps` steps writing to `out`.
pub fn listening_master(out: &Path, steps: u64, addr: &str) -> Child {
    let mut cmd = train_cmd(out, steps, &["--listen", addr, "--expect-nodes", "2"]);
    cmd.env("OOBLECK_TOKEN", TOKEN).stdout(Stdio::null());
    cmd.spawn().expect("start the master")
}

pub const TOKEN: &str = "master-lost-test-secret";

/// `train agent --master ADDR --master-wait WAIT EXTRA` with the job's token and `env`, its
/// stderr piped (for [`drain_into`]).
pub fn hand_agent(addr: &str, wait: &str, extra: &[&str], env: &[(&str, &str)]) -> Child {
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

/// The events of `run` of kind `kind`.
pub fn events_of(run: &Path, kind: &str) -> Vec<serde_json::Value> {
    events(run)
        .into_iter()
        .filter(|e| e["event"] == kind)
        .collect()
}

/// A local 2-node job of `steps` steps with one standby master, node 0 slowed (100 ms a
/// microbatch) so that its master goes mid-run, started and run to step 4: its parts
/// ([`StandbyJob::of`]: other shapes, and no standby).
pub struct StandbyJob {
    pub dir: tempfile::TempDir,
    pub out: std::path::PathBuf,
    pub copy: std::path::PathBuf,
    pub want: Vec<(u64, f64)>,
    pub want_params: std::collections::BTreeMap<String, candle_core::Tensor>,
    pub guard: Guard,
    pub log: Arc<Mutex<String>>,
    pub reader: JoinHandle<()>,
    /// The agents, the workers and the standbys, in that order.
    pub pids: Vec<u32>,
    pub nodes: usize,
}

impl StandbyJob {
    pub fn start(steps: u64) -> StandbyJob {
        StandbyJob::with_standbys(steps, 1)
    }

    /// [`StandbyJob::start`] with `standbys` standby masters; `pids` has them all.
    pub fn with_standbys(steps: u64, standbys: usize) -> StandbyJob {
        StandbyJob::of(steps, standbys, 2, 4)
    }

    /// A local job of `nodes` nodes with `standbys` standby masters, run to step `at`.
    pub fn of(steps: u64, standbys: usize, nodes: usize, at: u64) -> StandbyJob {
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
    pub fn finished_by_the_standby(&self, steps: u64) -> String {
        self.finished_by(0, steps)
    }

    /// [`StandbyJob::finished_by_the_standby`] for standby `k`.
    pub fn finished_by(&self, k: usize, steps: u64) -> String {
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
pub fn assert_all_exit(pids: &[u32]) {
    let stop = Instant::now() + STOP_BOUND;
    while pids.iter().any(|&p| alive(p)) && Instant::now() < stop {
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

/// Standby master `k`'s pid, from the line the master says it in.
pub fn standby_pid(log: &Mutex<String>, k: usize) -> u32 {
    let text = log.lock().expect("log").clone();
    let prefix = format!("standby master {k}: pid ");
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .unwrap_or_else(|| panic!("no standby said where it is:\n{text}"))
        .to_string();
    line.split(',').next().expect("pid").parse().expect("a pid")
}
