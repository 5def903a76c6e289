//! A private Slurm of this host for tests of the shipped `deploy/slurm` recipes (Debian's
//! `slurm-wlm` and `munge`): the configs it writes, munged, slurmctld and one slurmd per node
//! in the foreground as root, stopped by PID when it is dropped (after its jobs), and the
//! `sbatch` of the recipes. Two layouts ([`Layout`]): one node whose tasks each play a node,
//! and two nodes of this host (this Slurm build runs several slurmd on one host, `slurmd -N
//! NAME`) at one `NodeAddr`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{free_port, Guard, OOBLECK, TRAIN};

/// One Slurm cluster at a time: each test starts its own, and 2 cores train one job well.
pub static ONE_CLUSTER: Mutex<()> = Mutex::new(());

/// The job's size on [`Layout::OneNode`] and on [`Layout::Nodes`], and the small model every
/// test here trains.
pub const JOB: [&str; 3] = ["--nodes=1", "--ntasks=2", "--ntasks-per-node=2"];
pub const JOB_OF_NODES: [&str; 2] = ["--nodes=2", "--ntasks-per-node=1"];
pub const FLAGS: &str = "--microbatch-size 2 --global-batch-size 8 --seq-len 32 --eval-batches 1 \
                     --sample 0 --seed 7 --fault-threshold 0";

/// How the test's Slurm lays out this host.
#[derive(Clone)]
pub enum Layout {
    /// One node, `localhost` at 127.0.0.1, whose tasks each play a node.
    OneNode,
    /// Two nodes `n0`, `n1`, each its own slurmd on this host, both at NodeAddr `addr`.
    Nodes { addr: String },
}

impl Layout {
    fn names(&self) -> Vec<String> {
        match self {
            Layout::OneNode => vec!["localhost".into()],
            Layout::Nodes { .. } => vec!["n0".into(), "n1".into()],
        }
    }

    /// The `NodeName` lines of slurm.conf, each with its own slurmd port.
    fn node_lines(&self, cpus: usize) -> String {
        let (addr, own_port) = match self {
            Layout::OneNode => ("127.0.0.1".to_string(), false),
            Layout::Nodes { addr } => (addr.clone(), true),
        };
        let host = hostname();
        self.names()
            .iter()
            .map(|n| {
                let port = match own_port {
                    true => format!(" NodeHostname={host} Port={}", free_port()),
                    false => String::new(),
                };
                format!(
                    "NodeName={n} NodeAddr={addr}{port} CPUs={cpus} RealMemory=1000 \
                     State=UNKNOWN\n"
                )
            })
            .collect()
    }
}

fn hostname() -> String {
    let o = Command::new("hostname").output().expect("hostname");
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

/// This machine's first non-loopback IPv4 address (`hostname -I`), where Slurm's nodes of
/// [`Layout::Nodes`] are.
pub fn lan_addr() -> String {
    let o = Command::new("hostname")
        .arg("-I")
        .output()
        .expect("hostname -I");
    String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .filter_map(|a| a.parse::<std::net::Ipv4Addr>().ok())
        .find(|a| !a.is_loopback())
        .unwrap_or_else(|| {
            panic!(
                "this machine has no non-loopback IPv4 address (`hostname -I`: {:?}): Slurm's \
                 nodes need one that is not loopback",
                String::from_utf8_lossy(&o.stdout)
            )
        })
        .to_string()
}

/// A private Slurm of this host: its daemons (killed on drop, after its jobs) and its files.
pub struct Slurm {
    dir: tempfile::TempDir,
    daemons: Vec<Child>,
    layout: Layout,
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
    /// Writes the configs and starts munged, slurmctld and one slurmd per node; returns once
    /// every node is idle.
    pub fn start(layout: Layout) -> Slurm {
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
            layout,
        };
        slurm.write_configs();
        slurm.start_daemons();
        slurm.wait_idle();
        eprintln!(
            "slurm: nodes idle {:.1} s after the start",
            start.elapsed().as_secs_f64()
        );
        slurm
    }

    pub fn path(&self, name: &str) -> PathBuf {
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
             StateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool/%n\n\
             SlurmctldPidFile={d}/slurmctld.pid\nSlurmdPidFile={d}/slurmd-%n.pid\n\
             SlurmctldLogFile={d}/log/slurmctld.log\nSlurmdLogFile={d}/log/slurmd-%n.log\n\
             ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n\
             JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n\
             SchedulerType=sched/builtin\nSchedulerParameters=sched_interval=1\n\
             SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n\
             SlurmdParameters=config_overrides\nReturnToService=2\nMpiDefault=none\n\
             {nodes}PartitionName=test Nodes={names} Default=YES MaxTime=INFINITE State=UP\n",
            nodes = self.layout.node_lines(cpus),
            names = self.layout.names().join(","),
        );
        std::fs::write(self.path("slurm.conf"), conf).unwrap();
        std::fs::write(self.path("cgroup.conf"), "CgroupPlugin=autodetect\n").unwrap();
    }

    fn daemon(&mut self, bin: &str, args: &[String]) {
        let n = self.daemons.len();
        let log = std::fs::File::create(self.path(&format!("log/{bin}-{n}.out"))).unwrap();
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
        for name in self.layout.names() {
            std::fs::create_dir_all(self.path("spool").join(&name)).unwrap();
            self.daemon("slurmd", &["-D".into(), "-N".into(), name]);
        }
    }

    /// Polls `ready` for up to 60 s, failing with the daemons' logs.
    pub fn wait_for(&self, what: &str, ready: impl Fn() -> bool) {
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
        let nodes = self.layout.names().len();
        self.wait_for("the nodes (sinfo: idle)", || {
            let o = self.cmd("sinfo").args(["-h", "-N", "-o", "%t"]).output();
            o.is_ok_and(|o| {
                let states = String::from_utf8_lossy(&o.stdout).to_string();
                states.lines().filter(|s| s.trim() == "idle").count() == nodes
            })
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
    pub fn cmd(&self, bin: &str) -> Command {
        let mut c = Command::new(bin);
        c.env("SLURM_CONF", self.path("slurm.conf"));
        c
    }

    /// The ids of the jobs in the queue, if squeue answers.
    pub fn jobs(&self) -> Option<Vec<String>> {
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
    pub fn submit(&self, run: &Path, steps: u64, port: u16, env: &[(&str, &str)]) -> Guard {
        let size: &[&str] = match self.layout {
            Layout::OneNode => &JOB,
            Layout::Nodes { .. } => &JOB_OF_NODES,
        };
        let mut c = self.sbatch("train.sbatch", run, port, size);
        c.env("MODEL", "gpt-tiny")
            .env("STEPS", steps.to_string())
            .env("TRAIN_FLAGS", FLAGS)
            .env("OOBLECK_PROFILE", "analytical")
            .envs(env.iter().copied());
        Guard(Some(c.spawn().expect("starting sbatch")))
    }

    /// `sbatch --wait` of the shipped join.sbatch: one more node for job `id`.
    pub fn join(&self, id: &str, run: &Path, port: u16) -> Guard {
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
    pub fn the_job(&self) -> String {
        let jobs = self.jobs().expect("squeue");
        assert_eq!(jobs.len(), 1, "{jobs:?}");
        jobs[0].clone()
    }

    /// `scancel --signal=USR1 --batch id`: what Slurm sends before a time limit.
    pub fn usr1(&self, id: &str) {
        let o = self
            .cmd("scancel")
            .args(["--signal=USR1", "--batch", id])
            .output()
            .unwrap();
        assert!(o.status.success(), "scancel: {o:?}");
    }

    /// SIGKILLs the job's master, as if node 0's machine died: task 0 execs `train`, and the
    /// script keeps its pid in `run`.
    pub fn kill_master(&self, run: &Path) {
        let pid = std::fs::read_to_string(run.join("master.pid")).expect("master.pid");
        let kill = Command::new("kill")
            .args(["-KILL", pid.trim()])
            .status()
            .expect("kill");
        assert!(kill.success(), "no master to kill");
    }

    /// Polls until `run` has committed `n` steps.
    pub fn wait_steps(&self, run: &Path, n: usize) {
        self.wait_for(&format!("{n} committed steps"), || {
            std::fs::read_to_string(run.join("metrics.jsonl")).is_ok_and(|m| m.lines().count() >= n)
        });
    }

    /// The job's output file (both runs of a requeued job: the script appends).
    pub fn job_output(&self, sbatch: &Output) -> String {
        let id = String::from_utf8_lossy(&sbatch.stdout).trim().to_string();
        std::fs::read_to_string(self.path(&format!("job-{id}.out")))
            .unwrap_or_else(|e| panic!("job {id}'s output: {e}; logs:\n{}", self.logs()))
    }
}
