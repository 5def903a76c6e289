//! `train` started the same way on every node by a scheduler: where each process is comes
//! from its environment. Two `train` processes on this machine each play a node: with
//! `OOBLECK_*` variables, and with the variables `srun` gives two tasks of one host. Node 0
//! runs the master and its own agent, node 1 an agent and a standby master, which takes over
//! when node 0's master is killed; the job trains and both exit 0. A
//! loopback master in an allocation of several hosts, and a missing token, stop at once with
//! what to fix.

mod common;

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use common::masters::{drain_stderr, recorded_pids};
use common::{
    assert_same_training, free_port, losses, single_process, train_cmd, wait_exit, wait_for_step,
    Guard, Strays,
};

/// `train` for node `index` of a 2-step job in `out` with `env` set (no launch flag).
fn node(out: &Path, env: &[(String, String)]) -> Command {
    let mut cmd = train_cmd(out, 2, &[]);
    cmd.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env("OOBLECK_TOKEN", "scheduled-test-secret");
    cmd
}

/// Runs the two nodes of `envs` together (each killed if the test fails) and returns their
/// outputs, node 0's first.
fn run_two(dir: &Path, envs: [Vec<(String, String)>; 2]) -> [Output; 2] {
    let [e0, e1] = envs;
    let mut n1 = Guard(Some(node(&dir.join("unused"), &e1).spawn().unwrap()));
    let mut n0 = Guard(Some(node(&dir.join("run"), &e0).spawn().unwrap()));
    let o0 = n0.finish(Duration::from_secs(240));
    let o1 = n1.finish(Duration::from_secs(60));
    [o0, o1]
}

fn check_trained(dir: &Path, [o0, o1]: &[Output; 2], source: &str) {
    let (e0, e1) = (
        String::from_utf8_lossy(&o0.stderr),
        String::from_utf8_lossy(&o1.stderr),
    );
    assert!(o0.status.success(), "node 0: {e0}");
    assert!(o1.status.success(), "node 1: {e1}");
    assert!(
        e0.contains(&format!(
            "{source}: node 0 of 2; this process is the master"
        )),
        "{e0}"
    );
    assert!(
        e1.contains(&format!("{source}: node 1 of 2; this process is an agent")),
        "{e1}"
    );
    assert!(e0.contains("done: 2 steps"), "{e0}");
    assert_eq!(losses(&dir.join("run")).len(), 2);
    let plan = std::fs::read_to_string(dir.join("run/plan.json")).unwrap();
    assert!(
        plan.contains("\"nodes\": 2") || plan.contains("\"nodes\":2"),
        "{plan}"
    );
    assert!(
        !dir.join("unused").exists(),
        "node 1 wrote no run of its own"
    );
}

fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn oobleck_variables_make_node_0_the_master_and_node_1_its_agent() {
    let dir = tempfile::tempdir().unwrap();
    let master = format!("127.0.0.1:{}", free_port());
    let env = |i: &str| {
        vars(&[
            ("OOBLECK_MASTER", &master),
            ("OOBLECK_NODE_INDEX", i),
            ("OOBLECK_NUM_NODES", "2"),
        ])
    };
    let outs = run_two(dir.path(), [env("0"), env("1")]);
    check_trained(dir.path(), &outs, "OOBLECK_* variables");
}

/// Node 1 runs a standby master beside its agent. When node 0's `train` (the master) is
/// SIGKILLed mid-run, the standby takes over from its copy beside the run directory of node 1's
/// command line; node 1's `train` lives on until the master it became has ended the job (a
/// scheduler ends a task's processes with it), and the job trains every step once, as one
/// process does.
#[test]
fn node_1s_standby_takes_over_when_node_0s_master_is_killed() {
    const STEPS: u64 = 12;
    let dir = tempfile::tempdir().unwrap();
    let (want, want_params) = single_process(dir.path(), STEPS);
    let master = format!("127.0.0.1:{}", free_port());
    let start = |i: &str, out: &str| {
        let mut cmd = train_cmd(&dir.path().join(out), STEPS, &[]);
        cmd.env("OOBLECK_TOKEN", "scheduled-test-secret")
            .env("OOBLECK_MASTER", &master)
            .env("OOBLECK_NODE_INDEX", i)
            .env("OOBLECK_NUM_NODES", "2")
            // Node 0's workers sleep 100 ms a microbatch: the master dies mid-run.
            .env("OOBLECK_TEST_SLOW", "0:100")
            .stdout(std::process::Stdio::null());
        let mut child = cmd.spawn().expect("start train");
        let (log, reader) = drain_stderr(&mut child);
        (Guard(Some(child)), log, reader)
    };
    let (mut n1, log1, r1) = start("1", "unused");
    let (mut n0, _log0, r0) = start("0", "run");
    let copy = dir.path().join("unused.standby");
    wait_for_step(&copy, 3, Duration::from_secs(180));
    // Node 0's agent and workers outlive their master, and go back to the standby.
    let _strays = Strays(recorded_pids(&dir.path().join("run"), 2));
    let master_proc = n0.0.as_mut().expect("node 0");
    master_proc.kill().expect("SIGKILL node 0's master");
    master_proc.wait().expect("reap node 0's master");
    let st = wait_exit(n1.0.as_mut().expect("node 1"), Duration::from_secs(180));
    let text = log1.lock().expect("log").clone();
    assert!(st.success(), "{st}: {text}");
    for said in [
        format!("node 1 of 2; this process is an agent of the master at {master}, and its standby"),
        "is the job's master now; waiting for it to end the job".into(),
        format!("done: {STEPS} steps"),
    ] {
        assert!(text.contains(&said), "{said:?} not in:\n{text}");
    }
    assert_same_training(&copy, &want, &want_params);
    drop(n0);
    for r in [r0, r1] {
        r.join().expect("stderr reader");
    }
}

#[test]
fn two_srun_tasks_on_one_host_train_as_two_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let env = |task: &str| {
        vars(&[
            ("SLURM_JOB_ID", "4242"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_JOB_NODELIST", "localhost"),
            ("SLURM_STEP_NODELIST", "localhost"),
            ("SLURM_STEP_NUM_NODES", "1"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_PROCID", task),
            ("SLURM_NODEID", "0"),
            ("OOBLECK_MASTER_PORT", &port),
        ])
    };
    let outs = run_two(dir.path(), [env("0"), env("1")]);
    check_trained(dir.path(), &outs, "Slurm");
}

#[test]
fn a_loopback_master_of_several_hosts_and_a_missing_token_stop_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let slurm = vars(&[
        ("SLURM_JOB_ID", "4243"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_STEP_NODELIST", "localhost,gpu-b"),
        ("SLURM_STEP_NUM_TASKS", "2"),
        ("SLURM_PROCID", "1"),
    ]);
    let o = common::run(node(&dir.path().join("a"), &slurm), Duration::from_secs(30));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("localhost (SLURM_STEP_NODELIST) resolves to") && err.contains("loopback"),
        "{err}"
    );
    // OOBLECK_MASTER alone says where the master is, not which node this is.
    let o = common::run(
        node(
            &dir.path().join("c"),
            &vars(&[("OOBLECK_MASTER", "10.0.0.1:29400")]),
        ),
        Duration::from_secs(30),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("OOBLECK_NODE_INDEX is not"), "{err}");
    let sky = vars(&[
        ("SKYPILOT_NODE_RANK", "1"),
        ("SKYPILOT_NODE_IPS", "10.0.0.1\n10.0.0.2"),
        ("SKYPILOT_NUM_NODES", "2"),
    ]);
    let mut cmd = node(&dir.path().join("b"), &sky);
    cmd.env_remove("OOBLECK_TOKEN");
    let o = common::run(cmd, Duration::from_secs(30));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("export OOBLECK_TOKEN"), "{err}");
}
