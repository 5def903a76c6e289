//! The shipped `deploy/slurm/train.sbatch` on a real Slurm (Debian's `slurm-wlm` and `munge`):
//! the test writes its own configs, starts munged, slurmctld and slurmd in the foreground as
//! root, and stops them by PID when it ends, also when it fails. This Slurm build supports
//! several slurmd on one host, but their node names would then have to resolve to distinct
//! non-loopback addresses (`train` refuses a loopback master in an allocation of several hosts),
//! so the job runs on one node with 2 tasks, each task playing a node; a join job adds a third.
//! The jobs' ends are `sbatch --wait`'s, which polls at growing intervals: most of each test's
//! time is that wait.
//!
//! Without slurmctld the tests fail, saying what to install: `.ci/run` installs it.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{free_port, losses, Guard, OOBLECK, TRAIN};

/// One Slurm cluster at a time: each test starts its own, and 2 cores train one job well.
static ONE_CLUSTER: Mutex<()> = Mutex::new(());

/// The job's size and the small model every test here trains.
const JOB: [&str; 3] = ["--nodes=1", "--ntasks=2", "--ntasks-per-node=2"];
const FLAGS: &str = "--microbatch-size 2 --global-batch-size 8 --seq-len 32 --eval-batches 1 \
                     --sample 0 --seed 7 --fault-threshold 0";

/// A private Slurm of this host: its daemons (killed on drop, after its jobs) and its files.
struct Slurm {
    dir: tempfile::TempDir,
    daemons: Vec<Child>,
}

impl Drop for Slurm {
    fn drop(&mut self) {
        // Jobs first: their slurmstepd would outlive slurmd.
        let _ = self.cmd("scancel").args(["--full", "--user=root"]).status();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(20)
            && self.jobs().is_some_and(|j| !j.is_empty())
        {
            std::thread::sleep(Duration::from_millis(200));
        }
        for d in self.daemons.iter_mut().rev() {
            let _ = d.kill();
            let _ = d.wait();
        }
    }
}

impl Slurm {
    /// Writes the configs and starts munged, slurmctld and slurmd; returns once the node is idle.
    fn start() -> Slurm {
        for bin in ["munged", "slurmctld", "slurmd", "sbatch"] {
            assert!(
                Command::new("which")
                    .arg(bin)
                    .output()
                    .is_ok_and(|o| o.status.success()),
                "{bin} is not installed (or not on PATH): `apt-get install slurm-wlm munge` (Debian's packages; \
                 .ci/run installs them)"
            );
        }
        let uid = Command::new("id").arg("-u").output().expect("id -u");
        assert_eq!(
            String::from_utf8_lossy(&uid.stdout).trim(),
            "0",
            "slurmd runs jobs as root here: run this test as root"
        );
        let start = Instant::now();
        let dir = tempfile::tempdir().unwrap();
        let mut slurm = Slurm {
            dir,
            daemons: Vec::new(),
        };
        slurm.write_configs();
        slurm.start_daemons();
        slurm.wait_idle();
        eprintln!(
            "slurm: node idle {:.1} s after the start",
            start.elapsed().as_secs_f64()
        );
        slurm
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn write_configs(&self) {
        use std::os::unix::fs::PermissionsExt;
        let d = self.dir.path();
        // munged needs every directory above its socket to be searchable by all.
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        for sub in ["state", "spool", "log"] {
            std::fs::create_dir(d.join(sub)).unwrap();
        }
        let mut key = vec![0u8; 1024];
        std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom").unwrap(), &mut key)
            .unwrap();
        std::fs::write(d.join("munge.key"), key).unwrap();
        std::fs::set_permissions(d.join("munge.key"), std::fs::Permissions::from_mode(0o600))
            .unwrap();
        // 2 tasks of a job and 1 of a join job (config_overrides: declared, not detected).
        let cpus = std::thread::available_parallelism().map_or(4, |n| n.get().max(4));
        let (ctld, slurmd) = (free_port(), free_port());
        let d = d.display();
        // cred_expire=5: a requeued job may start 6 s later (120 s by default).
        let conf = format!(
            "ClusterName=oobleck-test\nSlurmctldHost=localhost\nSlurmUser=root\nSlurmdUser=root\n\
             AuthType=auth/munge\nAuthInfo=socket={d}/munge.sock,cred_expire=5\n\
             CryptoType=crypto/munge\nSlurmctldPort={ctld}\nSlurmdPort={slurmd}\n\
             StateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool\n\
             SlurmctldPidFile={d}/slurmctld.pid\nSlurmdPidFile={d}/slurmd.pid\n\
             SlurmctldLogFile={d}/log/slurmctld.log\nSlurmdLogFile={d}/log/slurmd.log\n\
             ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n\
             JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n\
             SchedulerType=sched/builtin\nSchedulerParameters=sched_interval=1\n\
             SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n\
             SlurmdParameters=config_overrides\nReturnToService=2\nMpiDefault=none\n\
             NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN\n\
             PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP\n"
        );
        std::fs::write(self.path("slurm.conf"), conf).unwrap();
        std::fs::write(self.path("cgroup.conf"), "CgroupPlugin=autodetect\n").unwrap();
    }

    fn daemon(&mut self, bin: &str, args: &[String]) {
        let log = std::fs::File::create(self.path(&format!("log/{bin}.out"))).unwrap();
        let child = Command::new(bin)
            .args(args)
            .env("SLURM_CONF", self.path("slurm.conf"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {bin}: {e}"));
        self.daemons.push(child);
    }

    fn start_daemons(&mut self) {
        let d = self.dir.path().display().to_string();
        let munged = [
            "-F".into(),
            format!("--socket={d}/munge.sock"),
            format!("--key-file={d}/munge.key"),
            format!("--pid-file={d}/munged.pid"),
            format!("--log-file={d}/log/munged.log"),
            format!("--seed-file={d}/munge.seed"),
        ];
        self.daemon("munged", &munged);
        self.wait_for("munged's socket", || self.path("munge.sock").exists());
        self.daemon("slurmctld", &["-D".into(), "-i".into()]);
        self.daemon("slurmd", &["-D".into(), "-N".into(), "localhost".into()]);
    }

    /// Polls `ready` for up to 60 s, failing with the daemons' logs.
    fn wait_for(&self, what: &str, ready: impl Fn() -> bool) {
        let start = Instant::now();
        while !ready() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{what} not ready in 60 s; logs:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn wait_idle(&self) {
        self.wait_for("the node (sinfo: idle)", || {
            let o = self.cmd("sinfo").args(["-h", "-N", "-o", "%t"]).output();
            o.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "idle")
        });
    }

    fn logs(&self) -> String {
        let mut all = String::new();
        for entry in std::fs::read_dir(self.path("log"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            all += &format!("== {}\n", entry.path().display());
            all += &tail.into_iter().rev().collect::<Vec<_>>().join("\n");
            all += "\n";
        }
        all
    }

    /// A Slurm client command of this cluster.
    fn cmd(&self, bin: &str) -> Command {
        let mut c = Command::new(bin);
        c.env("SLURM_CONF", self.path("slurm.conf"));
        c
    }

    /// The ids of the jobs in the queue, if squeue answers.
    fn jobs(&self) -> Option<Vec<String>> {
        let o = self.cmd("squeue").args(["-h", "-o", "%i"]).output().ok()?;
        o.status.success().then(|| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .map(String::from)
                .collect()
        })
    }

    /// `sbatch --wait` of the shipped train.sbatch training `steps` steps into `run` on
    /// master port `port`, with `env` set too.
    fn submit(&self, run: &Path, steps: u64, port: u16, env: &[(&str, &str)]) -> Guard {
        let mut c = self.sbatch("train.sbatch", run, port, &JOB);
        c.env("MODEL", "gpt-tiny")
            .env("STEPS", steps.to_string())
            .env("TRAIN_FLAGS", FLAGS)
            .env("OOBLECK_PROFILE", "analytical")
            .envs(env.iter().copied());
        Guard(Some(c.spawn().expect("starting sbatch")))
    }

    /// `sbatch --wait` of the shipped join.sbatch: one more node for job `id`.
    fn join(&self, id: &str, run: &Path, port: u16) -> Guard {
        let mut c = self.sbatch("join.sbatch", run, port, &["--nodes=1", "--ntasks=1"]);
        c.arg(id);
        Guard(Some(c.spawn().expect("starting sbatch")))
    }

    fn sbatch(&self, script: &str, run: &Path, port: u16, size: &[&str]) -> Command {
        let script = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/slurm")
            .join(script);
        let mut c = self.cmd("sbatch");
        c.args(["--wait", "--parsable"])
            .args(size)
            .arg(format!("--output={}/job-%j.out", self.dir.path().display()))
            .arg(format!("--chdir={}", self.dir.path().display()))
            .arg(script)
            .env("RUN_DIR", run)
            .env("TRAIN_BIN", TRAIN)
            .env("OOBLECK_BIN", OOBLECK)
            .env("OOBLECK_MASTER_PORT", port.to_string())
            .env("RUST_BACKTRACE", "0")
            .env_remove("OOBLECK_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    /// The id of the one job in the queue.
    fn the_job(&self) -> String {
        let jobs = self.jobs().expect("squeue");
        assert_eq!(jobs.len(), 1, "{jobs:?}");
        jobs[0].clone()
    }

    /// `scancel --signal=USR1 --batch id`: what Slurm sends before a time limit.
    fn usr1(&self, id: &str) {
        let o = self
            .cmd("scancel")
            .args(["--signal=USR1", "--batch", id])
            .output()
            .unwrap();
        assert!(o.status.success(), "scancel: {o:?}");
    }

    /// Polls until `run` has committed `n` steps.
    fn wait_steps(&self, run: &Path, n: usize) {
        self.wait_for(&format!("{n} committed steps"), || {
            std::fs::read_to_string(run.join("metrics.jsonl")).is_ok_and(|m| m.lines().count() >= n)
        });
    }

    /// The job's output file (both runs of a requeued job: the script appends).
    fn job_output(&self, sbatch: &Output) -> String {
        let id = String::from_utf8_lossy(&sbatch.stdout).trim().to_string();
        std::fs::read_to_string(self.path(&format!("job-{id}.out")))
            .unwrap_or_else(|e| panic!("job {id}'s output: {e}; logs:\n{}", self.logs()))
    }
}

fn steps(run: &Path) -> Vec<u64> {
    losses(run).into_iter().map(|(s, _)| s).collect()
}

#[test]
fn train_sbatch_trains_a_job_of_two_tasks_that_each_play_a_node() {
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|p| p.into_inner());
    let slurm = Slurm::start();
    let run = slurm.path("run");
    let out = slurm
        .submit(&run, 6, free_port(), &[])
        .finish(Duration::from_secs(180));
    let log = slurm.job_output(&out);
    assert!(out.status.success(), "sbatch: {out:?}\n{log}");
    assert!(
        log.contains("Slurm: node 0 of 2; this process is the master"),
        "{log}"
    );
    assert!(
        log.contains("Slurm: node 1 of 2; this process is an agent"),
        "{log}"
    );
    assert!(log.contains("done: 6 steps"), "{log}");
    assert!(log.contains("oobleck: srun ended with status 0"), "{log}");
    assert_eq!(steps(&run), (1..=6).collect::<Vec<_>>());
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(run.join("oobleck-token"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "the token is the user's alone");
}

#[test]
fn usr1_to_the_batch_script_stops_with_a_checkpoint_and_the_requeued_job_resumes() {
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|p| p.into_inner());
    let slurm = Slurm::start();
    let run = slurm.path("run");
    let total = 40;
    let mut sbatch = slurm.submit(&run, total, free_port(), &[]);
    slurm.wait_steps(&run, 2);
    slurm.usr1(&slurm.the_job());
    let out = sbatch.finish(Duration::from_secs(300));
    let log = slurm.job_output(&out);
    assert!(out.status.success(), "sbatch: {out:?}\n{log}");
    // The first run stopped early with its checkpoint; the requeued one went on from it.
    let stopped = log
        .lines()
        .find_map(|l| {
            l.strip_prefix("stopped at step ")?
                .split_once(" of ")?
                .0
                .parse::<u64>()
                .ok()
        })
        .unwrap_or_else(|| panic!("the master did not stop at USR1:\n{log}"));
    assert!(stopped < total, "{log}");
    let ckpt = format!(
        "checkpoint: {}/checkpoints/step-{stopped:06}",
        run.display()
    );
    assert!(log.contains(&ckpt), "{log}");
    assert!(log.contains("(restart 1) --resume"), "{log}");
    assert!(log.contains(&format!("done: {total} steps")), "{log}");
    // No step lost or repeated: the committed steps are 1..=total, in order.
    assert_eq!(steps(&run), (1..=total).collect::<Vec<_>>());
}

#[test]
fn a_job_requeued_before_its_first_checkpoint_starts_again_keeping_its_first_attempt() {
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|p| p.into_inner());
    let slurm = Slurm::start();
    let run = slurm.path("run");
    let total = 30;
    // No checkpoint before the last step; agents that lose the master stop after 2 s. Node
    // 0's workers sleep 100 ms a microbatch: the master dies at step 2 of 30.
    let flags = format!("{FLAGS} --checkpoint-every 0 --master-wait 2");
    let env = [
        ("TRAIN_FLAGS", flags.as_str()),
        ("OOBLECK_TEST_SLOW", "0:100"),
    ];
    let mut first = slurm.submit(&run, total, free_port(), &env);
    slurm.wait_steps(&run, 2);
    let id = slurm.the_job();
    // The master's machine dies (task 0 execs `train`: its pid is the master's): the job
    // ends with no checkpoint written.
    let pid = std::fs::read_to_string(run.join("master.pid")).expect("master.pid");
    let kill = Command::new("kill")
        .args(["-KILL", pid.trim()])
        .status()
        .expect("kill");
    assert!(kill.success(), "no master to kill");
    let out = first.finish(Duration::from_secs(120));
    assert!(
        !out.status.success(),
        "the job ended well without its master"
    );
    assert!(!run.join("checkpoints").exists());
    // Requeued, as Slurm does after a node failure.
    let requeue = slurm
        .cmd("scontrol")
        .args(["requeue", &id])
        .output()
        .expect("scontrol");
    assert!(requeue.status.success(), "scontrol requeue: {requeue:?}");
    slurm.wait_for("the requeued job's end", || {
        slurm.jobs().is_some_and(|j| j.is_empty())
    });
    let log = slurm.job_output(&out);
    assert!(
        log.contains("has no checkpoint yet: starting again"),
        "{log}"
    );
    assert!(log.contains("(restart 1) --out"), "{log}");
    let attempts: Vec<PathBuf> = std::fs::read_dir(run.parent().expect("parent"))
        .expect("ls")
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| p.to_string_lossy().contains("run.attempt-"))
        .collect();
    assert_eq!(attempts.len(), 1, "{attempts:?}");
    assert!(attempts[0].join("metrics.jsonl").exists());
    assert_eq!(steps(&run), (1..=total).collect::<Vec<_>>(), "{log}");
}

#[test]
fn join_sbatch_adds_a_node_of_another_allocation_to_the_running_job() {
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|p| p.into_inner());
    let slurm = Slurm::start();
    let run = slurm.path("run");
    let port = free_port();
    // Many steps: the job ends when USR1 stops it (without a requeue), after the join.
    let mut train = slurm.submit(&run, 100_000, port, &[("REQUEUE_ON_USR1", "0")]);
    slurm.wait_steps(&run, 2);
    let id = slurm.the_job();
    let mut join = slurm.join(&id, &run, port);
    let train_log = slurm.path(&format!("job-{id}.out"));
    slurm.wait_for("the joined node's admission", || {
        std::fs::read_to_string(&train_log).is_ok_and(|l| l.contains("] join"))
    });
    slurm.usr1(&id);
    let out = train.finish(Duration::from_secs(120));
    let log = slurm.job_output(&out);
    assert!(out.status.success(), "sbatch: {out:?}\n{log}");
    let joined = join.finish(Duration::from_secs(120));
    let join_log = slurm.job_output(&joined);
    assert!(joined.status.success(), "join: {joined:?}\n{join_log}");
    assert!(
        join_log.contains(&format!(
            "oobleck: joining job {id}, master localhost:{port}"
        )),
        "{join_log}"
    );
    assert!(log.contains("reconfigured: node(s) [2] join"), "{log}");
    let steps = steps(&run);
    assert_eq!(
        steps,
        (1..=steps.len() as u64).collect::<Vec<_>>(),
        "no step lost"
    );
}
