//! The shipped `deploy/slurm/train.sbatch` on a real Slurm (Debian's `slurm-wlm` and `munge`):
//! each test starts its own (`common::slurm`: its configs, munged, slurmctld and slurmd in the
//! foreground as root, stopped by PID when the test ends, also when it fails). Two layouts:
//! one node whose 2 tasks each play a node (a join job adds a third), and, since this Slurm
//! build runs several slurmd on one host (`slurmd -N NAME`), 2 nodes named `n0` and `n1` whose
//! `NodeAddr` is this machine's non-loopback address, one task each, as on a real cluster
//! (`train` finds the master at node 0's `NodeAddr`; at a loopback one it refuses to start).
//! The jobs' ends are `sbatch --wait`'s, which polls at growing intervals: most of each test's
//! time is that wait.
//!
//! Without slurmctld the tests fail, saying what to install: `.ci/run` installs it.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::slurm::{lan_addr, Layout, Slurm, FLAGS, ONE_CLUSTER};
use common::{free_port, losses, Guard, TRAIN};

fn steps(run: &Path) -> Vec<u64> {
    losses(run).into_iter().map(|(s, _)| s).collect()
}

#[test]
fn train_sbatch_trains_a_job_of_two_tasks_that_each_play_a_node() {
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|p| p.into_inner());
    let slurm = Slurm::start(Layout::OneNode);
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
    // On two Slurm nodes, as a cluster's job is.
    let slurm = Slurm::start(Layout::Nodes { addr: lan_addr() });
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
    let slurm = Slurm::start(Layout::OneNode);
    let run = slurm.path("run");
    let total = 30;
    // No checkpoint before the last step; agents that lose the master stop after 2 s. Node
    // 0's workers sleep 100 ms a microbatch: the master dies at step 2 of 30.
    let flags = format!("{FLAGS} --checkpoint-every 0 --master-wait 2");
    // No standby master: this job's master is its only one.
    let env = [
        ("TRAIN_FLAGS", flags.as_str()),
        ("OOBLECK_TEST_SLOW", "0:100"),
        ("OOBLECK_STANDBY", "0"),
    ];
    let mut first = slurm.submit(&run, total, free_port(), &env);
    slurm.wait_steps(&run, 2);
    let id = slurm.the_job();
    // The master's machine dies (task 0 execs `train`: its pid is the master's): the job
    // ends with no checkpoint written.
    slurm.kill_master(&run);
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
    let slurm = Slurm::start(Layout::OneNode);
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
            "oobleck: joining job {id}, master 127.0.0.1:{port}"
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

#[test]
fn train_sbatch_trains_on_two_slurm_nodes_and_their_master_refuses_another_jobs_agent() {
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|p| p.into_inner());
    let addr = lan_addr();
    let slurm = Slurm::start(Layout::Nodes { addr: addr.clone() });
    let run = slurm.path("run");
    let (port, total) = (free_port(), 30);
    // Node 0's workers sleep 100 ms a microbatch: the job trains while the stranger knocks.
    let mut sbatch = slurm.submit(&run, total, port, &[("OOBLECK_TEST_SLOW", "0:100")]);
    slurm.wait_steps(&run, 2);
    let id = slurm.the_job();
    // An agent of another job that was given the same token (one OOBLECK_TOKEN in a user's
    // shell for two jobs) reaches this job's master: refused, naming both jobs.
    let token = std::fs::read_to_string(run.join("oobleck-token")).expect("the job's token");
    let stranger = Command::new(TRAIN)
        .args([
            "agent",
            "--master",
            &format!("{addr}:{port}"),
            "--wait",
            "10",
        ])
        .env("OOBLECK_TOKEN", token.trim())
        .env("OOBLECK_JOB", "999999")
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the stranger");
    let refused = Guard(Some(stranger)).finish(Duration::from_secs(60));
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{said}");
    assert!(
        said.contains(&format!(
            "this agent is of job \"999999\" and this master runs job \"{id}\""
        )),
        "{said}"
    );
    let out = sbatch.finish(Duration::from_secs(300));
    let log = slurm.job_output(&out);
    assert!(out.status.success(), "sbatch: {out:?}\n{log}");
    assert!(log.contains("on n[0-1]"), "{log}");
    for node in [
        "node 0 of 2; this process is the master",
        "node 1 of 2; this process is an agent",
    ] {
        assert!(log.contains(&format!("Slurm: {node}")), "{log}");
    }
    // Node 1 found the master at node 0's NodeAddr, not at the name `n0`.
    assert!(
        log.contains(&format!("the master at {addr}:{port}")),
        "{log}"
    );
    assert!(log.contains(&format!("done: {total} steps")), "{log}");
    assert_eq!(steps(&run), (1..=total).collect::<Vec<_>>());
}

/// Node 0's machine dies: the standby master on node 1 takes over. Then Slurm's USR1 (a
/// time limit) reaches the master the standby became, on node 1, through `oobleck stop`: it
/// stops with a checkpoint in its copy, the job requeues and goes on from that copy.
#[test]
fn node_0s_master_killed_the_standby_on_node_1_goes_on_and_usr1_requeues_from_its_copy() {
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|p| p.into_inner());
    let slurm = Slurm::start(Layout::Nodes { addr: lan_addr() });
    let run = slurm.path("run");
    let copy = slurm.path("run.standby");
    let total = 40;
    let mut sbatch = slurm.submit(&run, total, free_port(), &[("OOBLECK_TEST_SLOW", "0:100")]);
    // The standby on n1 holds step 3 in its copy: node 0's machine dies (task 0 execs
    // `train`: its pid is the master's).
    slurm.wait_steps(&copy, 3);
    slurm.kill_master(&run);
    let lost_at = steps(&run).len() as u64;
    slurm.wait_steps(&copy, lost_at as usize + 3);
    slurm.usr1(&slurm.the_job());
    let out = sbatch.finish(Duration::from_secs(300));
    let log = slurm.job_output(&out);
    assert!(out.status.success(), "sbatch: {out:?}\n{log}");
    let took_over = format!(
        "the standby master on node 1 took over and ended with status 0: the run went on in {}",
        copy.display()
    );
    assert!(log.contains(&took_over), "{log}");
    assert!(log.contains("Slurm USR1: stopping after step"), "{log}");
    assert!(log.contains("requeueing"), "{log}");
    assert!(
        log.contains(&format!("(restart 1) --resume {}", copy.display())),
        "{log}"
    );
    assert!(log.contains(&format!("done: {total} steps")), "{log}");
    // No step lost or repeated: the copy committed 1..=total, in order.
    assert_eq!(steps(&copy), (1..=total).collect::<Vec<_>>(), "{log}");
}

#[test]
fn a_job_whose_first_node_is_at_a_loopback_address_fails_at_once_naming_it() {
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|p| p.into_inner());
    let slurm = Slurm::start(Layout::Nodes {
        addr: "127.0.0.1".into(),
    });
    let run = slurm.path("run");
    let start = Instant::now();
    let out = slurm
        .submit(&run, 6, free_port(), &[])
        .finish(Duration::from_secs(120));
    let log = slurm.job_output(&out);
    assert!(!out.status.success(), "{log}");
    assert!(
        log.contains("the master's address 127.0.0.1 (the NodeAddr of SLURM_STEP_NODELIST's first node) is a loopback address"),
        "{log}"
    );
    assert!(!run.join("metrics.jsonl").exists(), "{log}");
    eprintln!(
        "the job failed {:.1} s after its submission",
        start.elapsed().as_secs_f64()
    );
}
