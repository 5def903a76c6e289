//! Discovery against environments as each scheduler sets them (the variables their docs and
//! real jobs show; values made up), and the failures that must be loud.

use std::net::{IpAddr, Ipv4Addr};

use super::*;

/// An `sbatch --nodes 4 --ntasks-per-node 1 --gpus-per-node 8` job's `srun` task on its third
/// node.
const SLURM: &[(&str, &str)] = &[
    ("SLURM_JOB_ID", "48213"),
    ("SLURM_JOB_NAME", "oobleck"),
    ("SLURM_JOB_NODELIST", "gpu-[07-09],gpu-12"),
    ("SLURM_JOB_NUM_NODES", "4"),
    ("SLURM_NNODES", "4"),
    ("SLURM_NODELIST", "gpu-[07-09],gpu-12"),
    ("SLURM_STEP_ID", "0"),
    ("SLURM_STEP_NODELIST", "gpu-[07-09],gpu-12"),
    ("SLURM_STEP_NUM_NODES", "4"),
    ("SLURM_STEP_NUM_TASKS", "4"),
    ("SLURM_NTASKS", "4"),
    ("SLURM_PROCID", "2"),
    ("SLURM_LOCALID", "0"),
    ("SLURM_NODEID", "2"),
    ("SLURMD_NODENAME", "gpu-09"),
    ("SLURM_GPUS_ON_NODE", "8"),
    ("SLURM_GPUS_PER_NODE", "8"),
    ("SLURM_CPUS_ON_NODE", "96"),
];

/// A LeaderWorkerSet pod, worker 3 of a group of 4.
const LWS: &[(&str, &str)] = &[
    ("LWS_LEADER_ADDRESS", "train-0.train.default"),
    ("LWS_GROUP_SIZE", "4"),
    ("LWS_WORKER_INDEX", "3"),
    ("HOSTNAME", "train-0-3"),
];

/// A JobSet pod: replicated job `nodes`, pod 1 of an indexed Job.
const JOBSET: &[(&str, &str)] = &[
    ("JOBSET_NAME", "gpt"),
    ("REPLICATED_JOB_NAME", "nodes"),
    ("JOB_INDEX", "0"),
    ("JOB_COMPLETION_INDEX", "1"),
    ("JOB_GLOBAL_INDEX", "1"),
    ("HOSTNAME", "gpt-nodes-0-1"),
];

/// A SkyPilot task on node 1 of 2 (`num_nodes: 2`, `accelerators: H100:8`).
const SKYPILOT: &[(&str, &str)] = &[
    ("SKYPILOT_NODE_RANK", "1"),
    ("SKYPILOT_NODE_IPS", "10.0.1.17\n10.0.1.23"),
    ("SKYPILOT_NUM_NODES", "2"),
    ("SKYPILOT_NUM_GPUS_PER_NODE", "8"),
    ("SKYPILOT_TASK_ID", "sky-2026-12-07-train_1"),
];

fn found(vars: &[(&str, &str)]) -> Placement {
    discover(&Env::from_pairs(vars.iter().copied()))
        .unwrap()
        .unwrap()
}

fn error(vars: &[(&str, &str)]) -> String {
    discover(&Env::from_pairs(vars.iter().copied())).unwrap_err()
}

fn with(
    base: &[(&'static str, &'static str)],
    extra: &[(&'static str, &'static str)],
) -> Vec<(&'static str, &'static str)> {
    let mut vars: Vec<_> = base
        .iter()
        .filter(|(k, _)| !extra.iter().any(|(e, _)| e == k))
        .copied()
        .collect();
    vars.extend(extra.iter().copied().filter(|(_, v)| !v.is_empty()));
    vars
}

#[test]
fn each_scheduler_says_the_node_the_nodes_and_the_master() {
    let slurm = found(SLURM);
    assert_eq!(
        (
            slurm.source,
            slurm.node_index,
            slurm.num_nodes,
            slurm.devices_per_node
        ),
        (Source::Slurm, 2, Some(4), Some(8))
    );
    assert_eq!(slurm.master_addr(), "gpu-07:29400");
    assert!(!slurm.is_master_node());

    let lws = found(LWS);
    assert_eq!((lws.node_index, lws.num_nodes), (3, Some(4)));
    assert_eq!(lws.master_addr(), "train-0.train.default:29400");

    let jobset = found(JOBSET);
    assert_eq!((jobset.node_index, jobset.num_nodes), (1, None));
    assert_eq!(jobset.master_host, "gpt-nodes-0-0.gpt");

    let sky = found(SKYPILOT);
    assert_eq!(
        (sky.node_index, sky.num_nodes, sky.devices_per_node),
        (1, Some(2), Some(8))
    );
    assert_eq!(sky.master_addr(), "10.0.1.17:29400");

    assert_eq!(
        discover(&Env::from_pairs([("HOME", "/root")])).unwrap(),
        None
    );
    // The batch script itself (no srun step): not a task, nothing discovered.
    let batch = with(SLURM, &[("SLURM_STEP_ID", "")]);
    assert_eq!(
        discover(&Env::from_pairs(batch.iter().copied())).unwrap(),
        None
    );
}

#[test]
fn slurm_tasks_on_one_host_each_play_a_node() {
    let one_host = with(
        SLURM,
        &[
            ("SLURM_STEP_NODELIST", "localhost"),
            ("SLURM_JOB_NODELIST", "localhost"),
            ("SLURM_STEP_NUM_NODES", "1"),
            ("SLURM_NNODES", "1"),
            ("SLURM_STEP_NUM_TASKS", "3"),
            ("SLURM_PROCID", "1"),
        ],
    );
    let p = found(&one_host);
    assert_eq!((p.node_index, p.num_nodes, p.hosts), (1, Some(3), Some(1)));
    // One host: its loopback master is right.
    let loopback = |_: &str| Ok(vec![IpAddr::V4(Ipv4Addr::LOCALHOST)]);
    check(&p, Some(3), loopback).unwrap();
}

#[test]
fn oobleck_variables_come_first_and_the_port_is_settable() {
    let vars = with(
        SLURM,
        &[
            ("OOBLECK_MASTER", "[fd00::1]:7000"),
            ("OOBLECK_NODE_INDEX", "0"),
        ],
    );
    let p = found(&vars);
    assert_eq!((p.source, p.node_index), (Source::Oobleck, 0));
    assert_eq!(p.master_addr(), "[fd00::1]:7000");
    assert!(p.is_master_node());
    let port = with(SKYPILOT, &[("OOBLECK_MASTER_PORT", "31000")]);
    assert_eq!(found(&port).master_addr(), "10.0.1.17:31000");
}

#[test]
fn missing_and_malformed_variables_are_named() {
    for (vars, says) in [
        (with(SLURM, &[("SLURM_PROCID", "")]), "SLURM_PROCID is not"),
        (
            with(
                SLURM,
                &[
                    ("SLURM_STEP_NODELIST", "gpu-[07-09"),
                    ("SLURM_JOB_NODELIST", ""),
                ],
            ),
            "SLURM_STEP_NODELIST=\"gpu-[07-09\"",
        ),
        (
            with(SLURM, &[("SLURM_STEP_NUM_NODES", "3")]),
            "SLURM_STEP_NUM_NODES=3 but",
        ),
        (
            with(SLURM, &[("SLURM_PROCID", "4")]),
            "index 4 is outside the job's 4 nodes",
        ),
        (
            with(LWS, &[("LWS_WORKER_INDEX", "x")]),
            "LWS_WORKER_INDEX=\"x\"",
        ),
        (
            with(JOBSET, &[("REPLICATED_JOB_NAME", "")]),
            "REPLICATED_JOB_NAME is not",
        ),
        (
            with(SKYPILOT, &[("SKYPILOT_NUM_NODES", "3")]),
            "SKYPILOT_NUM_NODES=3 but",
        ),
        (
            with(SLURM, &[("SLURM_STEP_NUM_TASKS", ""), ("SLURM_NTASKS", "")]),
            "neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS",
        ),
        (
            vec![("OOBLECK_MASTER", "host-without-port")],
            "not HOST:PORT",
        ),
        (
            with(SKYPILOT, &[("OOBLECK_MASTER_PORT", "99999")]),
            "OOBLECK_MASTER_PORT",
        ),
    ] {
        let err = error(&vars);
        assert!(err.contains(says), "{vars:?}: {err}");
    }
}

#[test]
fn two_schedulers_that_name_different_masters_are_refused() {
    let mut both = SLURM.to_vec();
    both.extend(SKYPILOT.iter().copied());
    let err = error(&both);
    assert!(
        err.contains("gpu-07") && err.contains("10.0.1.17") && err.contains("OOBLECK_MASTER"),
        "{err}"
    );
}

#[test]
fn a_loopback_master_and_a_count_against_expect_nodes_are_loud() {
    let p = found(SLURM);
    let lan = |_: &str| Ok(vec![IpAddr::V4(Ipv4Addr::new(10, 0, 0, 7))]);
    check(&p, None, lan).unwrap();
    check(&p, Some(4), lan).unwrap();
    let err = check(&p, Some(5), lan).unwrap_err();
    assert!(
        err.contains("--expect-nodes 5") && err.contains("4 nodes"),
        "{err}"
    );
    let hosts_file = |_: &str| Ok(vec![IpAddr::V4(Ipv4Addr::new(127, 0, 1, 1))]);
    let err = check(&p, None, hosts_file).unwrap_err();
    assert!(
        err.contains("gpu-07") && err.contains("SLURM_STEP_NODELIST") && err.contains("127.0.1.1"),
        "{err}"
    );
    // One node: the master is this machine; loopback is right.
    let mut one = p.clone();
    one.num_nodes = Some(1);
    one.hosts = Some(1);
    one.node_index = 0;
    check(&one, None, hosts_file).unwrap();
    let gone = |_: &str| Err(std::io::Error::other("no such host"));
    assert!(check(&p, None, gone)
        .unwrap_err()
        .contains("does not resolve"));
}

#[test]
fn an_agent_needs_only_where_its_master_is() {
    let env = Env::from_pairs([("OOBLECK_MASTER", "oobleck-master:29400")]);
    assert_eq!(
        master_from_env(&env).unwrap().master_addr(),
        "oobleck-master:29400"
    );
    assert_eq!(discover(&env).unwrap().unwrap().node_index, UNKNOWN_INDEX);
    let none = master_from_env(&Env::from_pairs([("HOME", "/root")])).unwrap_err();
    assert!(none.contains("OOBLECK_MASTER=HOST:PORT"), "{none}");
}

#[test]
fn each_scheduler_names_the_job_and_oobleck_job_names_it_over_them() {
    let jobs: Vec<Option<String>> = [SLURM, LWS, JOBSET, SKYPILOT]
        .iter()
        .map(|vars| found(vars).job)
        .collect();
    assert_eq!(
        jobs,
        [
            Some("48213".into()),
            Some("train-0.train.default".into()),
            Some("gpt".into()),
            Some("sky-2026-12-07-train_1".into())
        ]
    );
    let named = with(SLURM, &[("OOBLECK_JOB", "pretrain-7")]);
    assert_eq!(found(&named).job.as_deref(), Some("pretrain-7"));
    let own = [
        ("OOBLECK_MASTER", "10.0.0.1:29400"),
        ("OOBLECK_JOB", "pretrain-7"),
    ];
    assert_eq!(found(&own).job.as_deref(), Some("pretrain-7"));
    assert_eq!(found(&own[..1]).job, None);
}

/// `scontrol show node gpu-07 --oneliner` of a node whose name is not its address.
const NODE_LINE: &str = "NodeName=gpu-07 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUTot=96 \
                         AvailableFeatures=(null) NodeAddr=10.1.0.7 NodeHostName=rack3-07 \
                         Version=22.05.8 OS=Linux 6.1.0 RealMemory=1000 State=IDLE";

#[test]
fn the_slurm_master_is_where_slurm_reaches_the_first_node() {
    assert_eq!(node_addr_in(NODE_LINE).as_deref(), Some("10.1.0.7"));
    assert_eq!(node_addr_in("NodeName=x NodeAddr=(null)"), None);
    assert_eq!(node_addr_in("Node gpu-99 not found"), None);
    let env = |addr: NodeAddrFn| Env::from_pairs(SLURM.iter().copied()).with_node_addr(addr);
    let p = discover(&env(|n| (n == "gpu-07").then(|| "10.1.0.7".into())))
        .unwrap()
        .unwrap();
    assert_eq!(p.master_addr(), "10.1.0.7:29400");
    assert!(p.master_from.contains("NodeAddr"), "{}", p.master_from);
    // A NodeAddr that is the name, or none: the name, from the node list.
    for addr in [(|n| Some(n.to_string())) as NodeAddrFn, |_| None] {
        let p = discover(&env(addr)).unwrap().unwrap();
        assert_eq!(
            (p.master_host.as_str(), p.master_from),
            ("gpu-07", "SLURM_STEP_NODELIST")
        );
    }
    // A loopback NodeAddr in a job of 4 hosts: loud, naming where it came from.
    let p = discover(&env(|_| Some("127.0.0.1".into())))
        .unwrap()
        .unwrap();
    let err = check(&p, None, lookup).unwrap_err();
    assert!(
        err.contains("127.0.0.1")
            && err.contains("is a loopback address")
            && err.contains("NodeAddr"),
        "{err}"
    );
}
