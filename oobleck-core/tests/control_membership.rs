//! Control-plane membership: joins, losses (closed connection, missed lease), status, and the
//! messages that flow once a node is in.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use oobleck_core::planning::{Pipeline, Plan};
use oobleck_core::runtime::job::LossReason;
use oobleck_core::runtime::master::{Master, MasterConfig, MasterEvent};
use oobleck_core::runtime::node::Agent;
use oobleck_core::runtime::wire::client::{request_kill, request_status, request_stop};
use oobleck_core::runtime::wire::protocol::{
    self, ExitStatus, GenerationStart, Message, Rendezvous,
};
use oobleck_core::runtime::wire::{Token, WireError};
use oobleck_core::runtime::{StateSource, WorkerReport};
use tokio::net::TcpStream;

const T: Duration = Duration::from_secs(5);
// Ten heartbeats per lease: generous enough that a loaded 2-core CI box never evicts a healthy
// agent, short enough to keep the lease test near two seconds.
const HEARTBEAT: Duration = Duration::from_millis(100);
const LEASE: Duration = Duration::from_millis(1000);

async fn fast_master(token: &Token, expected: u32) -> Master {
    let mut config = MasterConfig::new(token.clone(), expected);
    config.heartbeat_interval = HEARTBEAT;
    config.lease = LEASE;
    config.handshake_timeout = Duration::from_millis(1000);
    let addr: SocketAddr = "127.0.0.1:0".parse().expect("a literal address parses");
    Master::bind_with(addr, config).await.unwrap()
}

async fn joined(master: &mut Master) -> u32 {
    match master.next_event(T).await.unwrap() {
        MasterEvent::Joined { node, .. } => node,
        other => panic!("expected a join, got {other:?}"),
    }
}

#[tokio::test]
async fn status_lists_the_registered_nodes_and_the_job_progress() {
    let token = Token::random();
    let master = fast_master(&token, 3).await;
    let mut agents = Vec::new();
    for devices in [1, 2, 3] {
        agents.push(
            Agent::connect_with_devices(master.local_addr(), &token, devices, T)
                .await
                .unwrap(),
        );
    }
    master.wait_for_nodes(T).await.unwrap();
    master.record_commit(7, 123.5);
    let status = request_status(master.local_addr(), &token, T)
        .await
        .unwrap();
    let nodes: Vec<(u32, u32)> = status.nodes.iter().map(|n| (n.node, n.devices)).collect();
    assert_eq!(nodes, vec![(0, 1), (1, 2), (2, 3)]);
    assert_eq!(status.expected_nodes, 3);
    assert_eq!(status.committed_step, Some(7));
    assert_eq!(status.samples_per_s, 123.5);
    // Status is only for holders of the token.
    let err = request_status(master.local_addr(), &Token::new("nope").unwrap(), T)
        .await
        .unwrap_err();
    assert!(matches!(err, WireError::Refused { .. }), "{err}");
}

#[tokio::test]
async fn a_dropped_agent_is_reported_lost_with_its_node_id() {
    let token = Token::random();
    let mut master = fast_master(&token, 2).await;
    let keep = Agent::connect(master.local_addr(), &token, T)
        .await
        .unwrap();
    let gone = Agent::connect(master.local_addr(), &token, T)
        .await
        .unwrap();
    let gone_id = gone.node();
    joined(&mut master).await;
    joined(&mut master).await;
    let start = Instant::now();
    drop(gone);
    match master.next_event(T).await.unwrap() {
        MasterEvent::Lost { node, reason } => {
            assert_eq!(node, gone_id);
            assert_eq!(reason, LossReason::Closed);
        }
        other => panic!("expected a loss, got {other:?}"),
    }
    // A closed connection is seen at once, not after the lease.
    assert!(start.elapsed() < LEASE, "took {:?}", start.elapsed());
    let live: Vec<u32> = master.status().nodes.iter().map(|n| n.node).collect();
    assert_eq!(live, vec![keep.node()]);
}

#[tokio::test]
async fn a_stalled_agent_is_lost_after_its_lease_while_a_healthy_one_stays() {
    let token = Token::random();
    let mut master = fast_master(&token, 2).await;
    let healthy = Agent::connect(master.local_addr(), &token, T)
        .await
        .unwrap();
    let stalled = Agent::connect(master.local_addr(), &token, T)
        .await
        .unwrap();
    assert_eq!(stalled.timings(), (HEARTBEAT, LEASE));
    joined(&mut master).await;
    joined(&mut master).await;
    // A lease of normal traffic: heartbeats keep both alive.
    let err = master.next_event(LEASE).await.unwrap_err();
    assert!(matches!(err, WireError::Timeout { .. }), "{err}");
    let start = Instant::now();
    stalled.pause_heartbeats(true);
    match master.next_event(T).await.unwrap() {
        MasterEvent::Lost { node, reason } => {
            assert_eq!(node, stalled.node());
            assert_eq!(
                reason,
                LossReason::LeaseExpired {
                    lease_ms: LEASE.as_millis() as u64
                }
            );
        }
        other => panic!("expected a loss, got {other:?}"),
    }
    let took = start.elapsed();
    // The last heartbeat went out about one interval before the pause; allow for scheduling.
    assert!(took >= LEASE / 2, "lost after only {took:?}");
    assert!(
        took < LEASE + Duration::from_secs(2),
        "lost only after {took:?}"
    );
    let live: Vec<u32> = master.status().nodes.iter().map(|n| n.node).collect();
    assert_eq!(live, vec![healthy.node()]);
}

#[tokio::test]
async fn messages_flow_both_ways_and_an_agent_sees_its_master_go() {
    let token = Token::random();
    let mut master = fast_master(&token, 1).await;
    let mut agent = Agent::connect(master.local_addr(), &token, T)
        .await
        .unwrap();
    let node = joined(&mut master).await;

    let commit = Message::StepCommitted {
        step: 3,
        generation: 1,
        last: false,
    };
    master.send_to(node, commit.clone()).await.unwrap();
    assert_eq!(agent.recv(T).await.unwrap(), commit);

    let status = ExitStatus {
        code: None,
        signal: Some(9),
    };
    agent
        .report_worker_exit(5, 1, status, Some("out of memory".into()), T)
        .await
        .unwrap();
    assert_eq!(
        master.next_event(T).await.unwrap(),
        MasterEvent::Worker {
            node,
            generation: 1,
            report: WorkerReport::Exited {
                rank: 5,
                status,
                error: Some("out of memory".into()),
            },
        }
    );
    assert!(matches!(
        master.send_to(node + 1, commit).await,
        Err(WireError::UnknownNode { .. })
    ));

    drop(master);
    let err = agent.recv(T).await.unwrap_err();
    assert!(matches!(err, WireError::Closed { .. }), "{err}");
}

#[tokio::test]
async fn a_peer_that_never_says_hello_is_cut_off_by_the_handshake_timeout() {
    let token = Token::random();
    let master = fast_master(&token, 1).await;
    let mut silent = TcpStream::connect(master.local_addr()).await.unwrap();
    match protocol::read_frame(&mut silent, T).await.unwrap() {
        Some(Message::Refused { reason }) => assert!(reason.contains("timed out"), "{reason}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(master.refused_count(), 1);
}

/// A two-pipeline plan over `nodes` (one node per pipeline); the protocol does not care
/// whether it is a good plan, only that it names registered nodes.
fn plan_over(generation: u64, nodes: [u32; 2]) -> Plan {
    let pipelines = nodes
        .iter()
        .enumerate()
        .map(|(i, &n)| Pipeline {
            id: i as u32,
            template_nodes: 1,
            nodes: vec![n],
            first_rank: i as u32,
            microbatches: 4,
            predicted_ns: 1_000,
        })
        .collect();
    Plan {
        generation,
        devices_per_node: 1,
        fault_threshold: 1,
        global_microbatches: 8,
        min_nodes: 1,
        templates: Vec::new(),
        pipelines,
        compute_ns: 1_000,
        sync_ns: 0,
        sync_model_ns: 0,
        layer_state_bytes: vec![64],
        iteration_ns: 1_000,
    }
}

/// A generation's start: a fresh key, initial state.
fn start(rendezvous: Vec<Rendezvous>, nccl_unique_id: Option<Vec<u8>>) -> GenerationStart {
    GenerationStart {
        rendezvous,
        nccl_unique_id,
        key: oobleck_comm::SecretKey::random(),
        source: StateSource::Init,
        state_port: 7100,
        state_key: oobleck_comm::SecretKey::random(),
    }
}

#[tokio::test]
async fn the_master_distributes_the_plan_rendezvous_and_generation_then_commits() {
    let token = Token::random();
    let master = fast_master(&token, 2).await;
    let mut a = Agent::connect(master.local_addr(), &token, T)
        .await
        .unwrap();
    let mut b = Agent::connect(master.local_addr(), &token, T)
        .await
        .unwrap();
    master.wait_for_nodes(T).await.unwrap();

    let err = master
        .assign_plan(&plan_over(1, [0, 9]), start(Vec::new(), None))
        .await
        .unwrap_err();
    assert!(matches!(err, WireError::UnknownNode { node: 9 }), "{err}");
    assert_eq!(
        master.status().generation,
        0,
        "a refused plan is not recorded"
    );

    let plan = plan_over(1, [a.node(), b.node()]);
    let rendezvous: Vec<Rendezvous> = (0..2)
        .map(|rank| Rendezvous {
            rank,
            addr: format!("127.0.0.1:{}", 40_000 + rank),
        })
        .collect();
    let unreached = master
        .assign_plan(&plan, start(rendezvous.clone(), Some(vec![5; 128])))
        .await
        .unwrap();
    assert!(unreached.is_empty());
    for agent in [&mut a, &mut b] {
        match agent.recv(T).await.unwrap() {
            Message::PlanAssignment {
                generation,
                plan: got,
                start,
            } => {
                assert_eq!(generation, 1);
                assert_eq!(*got, plan);
                assert_eq!(start.rendezvous, rendezvous);
                assert_eq!(start.nccl_unique_id, Some(vec![5; 128]));
                assert_eq!(start.source, StateSource::Init);
            }
            other => panic!("expected a plan, got {other:?}"),
        }
    }
    assert!(master.commit_step(0, 10.0, false).await.is_empty());
    for agent in [&mut a, &mut b] {
        assert_eq!(
            agent.recv(T).await.unwrap(),
            Message::StepCommitted {
                step: 0,
                generation: 1,
                last: false
            }
        );
    }
    let status = request_status(master.local_addr(), &token, T)
        .await
        .unwrap();
    assert_eq!(status.generation, 1);
    assert_eq!(status.committed_step, Some(0));
    let layout: Vec<Vec<u32>> = status.pipelines.iter().map(|p| p.nodes.clone()).collect();
    assert_eq!(layout, vec![vec![a.node()], vec![b.node()]]);
}

#[tokio::test]
async fn kill_node_requests_reach_the_driver_and_unknown_nodes_are_refused() {
    let token = Token::random();
    let mut master = fast_master(&token, 1).await;
    let agent = Agent::connect(master.local_addr(), &token, T)
        .await
        .unwrap();
    joined(&mut master).await;
    request_kill(master.local_addr(), &token, agent.node(), T)
        .await
        .unwrap();
    assert_eq!(
        master.next_event(T).await.unwrap(),
        MasterEvent::KillRequested { node: agent.node() }
    );
    let err = request_kill(master.local_addr(), &token, 77, T)
        .await
        .unwrap_err();
    match err {
        WireError::Refused { reason } => assert!(reason.contains("77"), "{reason}"),
        other => panic!("expected a refusal, got {other}"),
    }
}

#[tokio::test]
async fn a_stop_request_reaches_the_driver_saying_who_asked_and_a_wrong_token_is_refused() {
    let token = Token::random();
    let mut master = fast_master(&token, 1).await;
    let _agent = Agent::connect(master.local_addr(), &token, T)
        .await
        .unwrap();
    joined(&mut master).await;
    let status = request_stop(master.local_addr(), &token, "Slurm USR1", T)
        .await
        .unwrap();
    assert_eq!(status.nodes.len(), 1);
    assert_eq!(
        master.next_event(T).await.unwrap(),
        MasterEvent::StopRequested {
            reason: "Slurm USR1".into()
        }
    );
    let err = request_stop(master.local_addr(), &Token::random(), "a guess", T)
        .await
        .unwrap_err();
    match err {
        WireError::Refused { reason } => assert!(reason.contains("wrong token"), "{reason}"),
        other => panic!("expected a refusal, got {other}"),
    }
}

#[tokio::test]
async fn shutdown_reaches_every_agent_before_the_connections_close() {
    let token = Token::random();
    let master = fast_master(&token, 2).await;
    let mut agents = Vec::new();
    for _ in 0..2 {
        agents.push(
            Agent::connect(master.local_addr(), &token, T)
                .await
                .unwrap(),
        );
    }
    master.wait_for_nodes(T).await.unwrap();
    assert!(master.shutdown("job finished", T).await.is_empty());
    for agent in &mut agents {
        assert_eq!(
            agent.recv(T).await.unwrap(),
            Message::Shutdown {
                reason: "job finished".into()
            }
        );
        let err = agent.recv(T).await.unwrap_err();
        assert!(matches!(err, WireError::Closed { .. }), "{err}");
    }
}

#[tokio::test]
async fn worker_reports_reach_the_driver_as_sent_and_a_report_for_another_node_is_a_violation() {
    let token = Token::random();
    let mut master = fast_master(&token, 2).await;
    let honest = Agent::connect(master.local_addr(), &token, T)
        .await
        .unwrap();
    let liar = Agent::connect(master.local_addr(), &token, T)
        .await
        .unwrap();
    joined(&mut master).await;
    joined(&mut master).await;
    let node = honest.node();
    let reports = [
        WorkerReport::Ready {
            rank: 1,
            step: 4,
            loss: 2.5,
            grad_norm: 0.75,
            microbatches: vec![0, 1],
            samples: None,
            times: None,
        },
        WorkerReport::Exited {
            rank: 1,
            status: ExitStatus {
                code: Some(1),
                signal: None,
            },
            error: Some("Error: rank 1: step 5: rank 0 lost".into()),
        },
    ];
    for report in reports {
        let msg = Message::Worker {
            node,
            generation: 3,
            report: report.clone(),
        };
        honest.send(msg, T).await.unwrap();
        assert_eq!(
            master.next_event(T).await.unwrap(),
            MasterEvent::Worker {
                node,
                generation: 3,
                report,
            }
        );
    }
    // A node speaks only for itself: a report under another node id ends its connection.
    let msg = Message::Worker {
        node,
        generation: 3,
        report: WorkerReport::Listening {
            rank: 0,
            addr: "127.0.0.1:9".into(),
            pid: 1,
        },
    };
    liar.send(msg, T).await.unwrap();
    match master.next_event(T).await.unwrap() {
        MasterEvent::Lost {
            node: lost,
            reason: LossReason::Protocol(why),
        } => {
            assert_eq!(lost, liar.node());
            assert!(why.contains("unexpected worker"), "{why}");
        }
        other => panic!("expected the liar lost, got {other:?}"),
    }
}
