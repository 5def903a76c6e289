//! Standby masters (`train --standby-masters K`, `train agent --standby`): when the master is
//! lost (SIGKILL, its run directory deleted, SIGSTOP), a standby takes over from its copy of
//! the run directory and the job goes on with no step lost; with several, the first takes
//! over and the others follow it.

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::masters::*;
use common::*;

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
    // Where the job's master is now: the standby's address (what join.sbatch asks).
    let o = oobleck_tool(&["status", "--run", &run, "--leader", "--timeout", "2"]);
    let leader = String::from_utf8_lossy(&o.stdout).trim().to_string();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let standbys = std::fs::read_to_string(job.out.join("standbys.json")).expect("standbys.json");
    assert!(
        !leader.is_empty() && standbys.contains(&format!("\"{leader}\"")),
        "{leader:?} is not a standby of {standbys}"
    );
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
