//! Helpers of the local-cluster tests: running `train`, reading a run directory, comparing
//! with the single-process trainer, and checking that no process is left behind.
#![allow(dead_code)] // each test binary uses its own subset

pub mod cdp;
pub mod masters;
pub mod slurm;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use oobleck_core::checkpoint::{latest_checkpoint, load_checkpoint};
use oobleck_core::runtime::wire::EventLine;

pub const TRAIN: &str = env!("CARGO_BIN_EXE_train");
pub const OOBLECK: &str = env!("CARGO_BIN_EXE_oobleck");
pub const TOL: f64 = 1e-5;

/// Kills the child if the test fails while it runs.
pub struct Guard(pub Option<Child>);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Every `train` here: one evaluation batch, no text sample, seed 7.
const EVAL_SAMPLE_SEED: [&str; 6] = ["--eval-batches", "1", "--sample", "0", "--seed", "7"];

pub fn train_cmd(out: &Path, steps: u64, extra: &[&str]) -> Command {
    let mut c = Command::new(TRAIN);
    c.args([
        "--model",
        "gpt-tiny",
        "--microbatch-size",
        "2",
        "--global-batch-size",
        "8",
        "--seq-len",
        "32",
    ])
    .args(EVAL_SAMPLE_SEED)
    // f = 0 (a failure ends the job) unless the test asks for more.
    .args(if extra.contains(&"--fault-threshold") {
        &[][..]
    } else {
        &["--fault-threshold", "0"][..]
    })
    .arg("--steps")
    .arg(steps.to_string());
    out_extra_and_pipes(&mut c, out, extra);
    c
}

/// `train` with a small job (2 microbatches of 2 samples of 16 tokens, no warmup, so the second
/// step already moves; f = 0) writing to `out`, then `extra` (the model, `--nodes`, `--steps`,
/// a learning rate...).
pub fn small_job_cmd(out: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(TRAIN);
    c.args([
        "--microbatch-size",
        "2",
        "--global-batch-size",
        "4",
        "--seq-len",
        "16",
    ])
    .args(EVAL_SAMPLE_SEED)
    .args(["--warmup-steps", "0", "--fault-threshold", "0"]);
    out_extra_and_pipes(&mut c, out, extra);
    c
}

/// The end of every `train` command here: `--out out`, `extra`, the `oobleck` binary to start
/// agents with, no stdin, and stdout and stderr captured.
fn out_extra_and_pipes(c: &mut Command, out: &Path, extra: &[&str]) {
    c.arg("--out")
        .arg(out)
        .args(extra)
        .env("OOBLECK_BIN", OOBLECK)
        .env("RUST_BACKTRACE", "0")
        // The analytical profile plans the same pipelines on every run; a measured one depends
        // on the machine's load (`--profile measured` is tested in profile_cli.rs).
        .env("OOBLECK_PROFILE", "analytical")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
}

impl Guard {
    /// Waits for the child to end within `limit` (killed otherwise) and returns its output.
    pub fn finish(&mut self, limit: Duration) -> Output {
        let start = Instant::now();
        while self
            .0
            .as_mut()
            .expect("child")
            .try_wait()
            .expect("poll train")
            .is_none()
        {
            assert!(start.elapsed() < limit, "train ran past {limit:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
        self.0
            .take()
            .expect("child")
            .wait_with_output()
            .expect("train output")
    }
}

/// Runs `train` to completion within `limit` (killed otherwise).
pub fn run(mut cmd: Command, limit: Duration) -> Output {
    Guard(Some(cmd.spawn().expect("start train"))).finish(limit)
}

/// The uninterrupted single-process run of `steps` the fault tests compare with: its
/// per-step losses and final parameters.
pub fn single_process(dir: &Path, steps: u64) -> (Vec<(u64, f64)>, BTreeMap<String, Tensor>) {
    let single = dir.join("single");
    let o = run(
        train_cmd(&single, steps, &["--nodes", "1"]),
        Duration::from_secs(120),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    (losses(&single), final_params(&single))
}

pub fn losses(run: &Path) -> Vec<(u64, f64)> {
    per_step(run, "loss")
}

/// `(step, value of key)` of every line of the run's `metrics.jsonl`, in file order.
pub fn per_step(run: &Path, key: &str) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            let value = v[key].as_f64().unwrap_or_else(|| panic!("no {key} in {l}"));
            (v["step"].as_u64().expect("step"), value)
        })
        .collect()
}

pub fn events(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("events.jsonl"))
        .expect("events.jsonl")
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            // Every line the job wrote reads back through the enum that wrote it.
            match EventLine::from_value(v.clone()) {
                Ok(EventLine::Known(_)) => v,
                other => {
                    panic!("events.jsonl line {l:?} does not read back as an Event: {other:?}")
                }
            }
        })
        .collect()
}

/// The pids of every agent and worker the run reported.
pub fn child_pids(run: &Path) -> Vec<u32> {
    events(run)
        .iter()
        .filter(|e| e["event"] == "process")
        .map(|e| e["pid"].as_u64().expect("pid") as u32)
        .collect()
}

/// True while `pid` is a live process (a zombie counts as gone: it runs nothing).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
            .unwrap_or(false),
        Err(_) => false,
    }
}

pub fn assert_all_gone(run: &Path, want: usize) {
    let pids = child_pids(run);
    assert_eq!(pids.len(), want, "processes reported: {pids:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

/// Fails if a process of the run left a shared-memory segment in `/dev/shm` (waits a little
/// for processes still exiting to be reaped and swept).
pub fn assert_no_segments(run: &Path) {
    let pids = child_pids(run);
    let left = || -> Vec<String> {
        std::fs::read_dir("/dev/shm")
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .filter(|n| {
                let pid = n.strip_prefix("oobleck-").and_then(|r| r.split('-').next());
                pid.and_then(|p| p.parse::<u32>().ok())
                    .is_some_and(|p| pids.contains(&p))
            })
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !left().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(left(), Vec::<String>::new(), "segments left in /dev/shm");
}

/// `(step, val_loss)` of every metrics line that has one, in file order.
pub fn val_losses(run: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            Some((v["step"].as_u64()?, v["val_loss"].as_f64()?))
        })
        .collect()
}

pub fn params_at(run: &Path, step: u64) -> BTreeMap<String, Tensor> {
    let ck = oobleck_core::checkpoint::checkpoint_path(run, step);
    load_checkpoint(&ck, &Device::Cpu).expect("load").params
}

pub fn final_params(run: &Path) -> BTreeMap<String, Tensor> {
    let ck = latest_checkpoint(run).expect("list").expect("a checkpoint");
    load_checkpoint(&ck, &Device::Cpu).expect("load").params
}

pub fn max_diff(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> f64 {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "checkpoints hold different tensors"
    );
    a.iter()
        .map(|(k, t)| {
            let d = (t - &b[k])
                .and_then(|d| d.abs())
                .and_then(|d| d.flatten_all())
                .and_then(|d| d.max(0))
                .and_then(|d| d.to_scalar::<f32>())
                .expect("diff");
            f64::from(d)
        })
        .fold(0.0, f64::max)
}

/// Every step of `run` once, in order, with the single process's loss; the final parameters
/// within `TOL` of the single process's.
pub fn assert_same_training(
    run: &Path,
    want: &[(u64, f64)],
    want_params: &BTreeMap<String, Tensor>,
) {
    let got = losses(run);
    assert_eq!(
        got.iter().map(|l| l.0).collect::<Vec<_>>(),
        want.iter().map(|l| l.0).collect::<Vec<_>>(),
        "every step once in metrics.jsonl"
    );
    for ((s, l), (_, wl)) in got.iter().zip(want) {
        assert!((l - wl).abs() < TOL, "step {s}: {l} vs {wl}");
    }
    let d = max_diff(&final_params(run), want_params);
    eprintln!("final parameters within {d:e} of the single process");
    assert!(d < TOL, "final parameters differ by {d}");
}

/// Waits (at most 60 s) for the run's first checkpoint, then SIGKILLs the worker process of
/// rank `rank` from outside, as a crash would.
pub fn kill_worker_once_checkpointed(out: &Path, rank: u32) {
    let start = Instant::now();
    let worker = loop {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no checkpoint within 60 s"
        );
        if latest_checkpoint(out).ok().flatten().is_some() {
            let w = events(out)
                .into_iter()
                .find(|e| e["event"] == "process" && e["role"] == "worker" && e["rank"] == rank);
            break w.expect("worker reported")["pid"].as_u64().expect("pid") as u32;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let killed = Command::new("kill")
        .args(["-9", &worker.to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
}

/// Runs `oobleck ARGS...` (a tool talking to a running job) within 15 s.
pub fn oobleck_tool(args: &[&str]) -> Output {
    let mut c = Command::new(OOBLECK);
    c.args(args)
        .env_remove("OOBLECK_TOKEN")
        .env("OOBLECK_BIN", OOBLECK)
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    run(c, Duration::from_secs(15))
}

/// Waits for `child` to exit within `limit`; returns its status.
pub fn wait_exit(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(st) = child.try_wait().expect("poll") {
            return st;
        }
        assert!(Instant::now() < deadline, "process ran past {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A free port on 127.0.0.1 (bound and released: a small window, fine for a test).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// Child processes a test started itself (masters and agents of a multi-machine job): each
/// killed and reaped when the test ends, also on failure.
#[derive(Default)]
pub struct Children(pub Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Processes a test started outside `train` (agents of `oobleck add-node`): killed when the
/// test ends, also on failure.
#[derive(Default)]
pub struct Strays(pub Vec<u32>);

impl Drop for Strays {
    fn drop(&mut self) {
        for &pid in self.0.iter().filter(|&&p| alive(p)) {
            let _ = Command::new("kill")
                .args(["-9", &pid.to_string()])
                .stderr(Stdio::null())
                .status();
        }
    }
}

impl Strays {
    /// `oobleck add-node --run RUN EXTRA...`: one more local agent for the running job.
    pub fn add_node(&mut self, run: &Path, extra: &[&str]) -> u32 {
        let run_s = run.to_str().expect("utf-8 path");
        let o = oobleck_tool(&[&["add-node", "--run", run_s][..], extra].concat());
        let said = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(
            o.status.success(),
            "{said}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let pid: u32 = said
            .split("(pid ")
            .nth(1)
            .and_then(|s| s.split(')').next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no pid in {said:?}"));
        self.0.push(pid);
        pid
    }

    /// Every stray is gone within 10 s.
    pub fn assert_gone(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.0.iter().any(|&p| alive(p)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let left: Vec<u32> = self.0.iter().copied().filter(|&p| alive(p)).collect();
        assert!(left.is_empty(), "added agents left behind: {left:?}");
    }
}

/// Waits (at most `limit`) until the run has committed `step`.
pub fn wait_for_step(run: &Path, step: u64, limit: Duration) {
    let start = Instant::now();
    loop {
        let done = std::fs::read_to_string(run.join("metrics.jsonl")).is_ok_and(|m| {
            m.lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .any(|v| v["step"].as_u64().is_some_and(|s| s >= step))
        });
        if done {
            return;
        }
        assert!(
            start.elapsed() < limit,
            "step {step} not committed within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits (at most `limit`) until `count` events satisfy `pred`.
pub fn wait_for_events(
    run: &Path,
    count: usize,
    limit: Duration,
    what: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) {
    let start = Instant::now();
    loop {
        let n = std::fs::read_to_string(run.join("events.jsonl")).map_or(0, |t| {
            t.lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .filter(|e| pred(e))
                .count()
        });
        if n >= count {
            return;
        }
        assert!(start.elapsed() < limit, "no {what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The run's `reconfig` events, in order.
pub fn reconfig_events(run: &Path) -> Vec<serde_json::Value> {
    events(run)
        .into_iter()
        .filter(|e| e["event"] == "reconfig")
        .collect()
}
