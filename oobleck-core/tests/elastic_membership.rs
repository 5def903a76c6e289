//! Control-plane membership: joins, losses (closed connection, missed lease), status, and the
//! messages that flow once a node is in.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use oobleck_core::elastic::agent::request_status;
use oobleck_core::elastic::master::LossReason;
use oobleck_core::elastic::protocol::{self, ExitStatus, Message};
use oobleck_core::elastic::{Agent, ElasticError, Master, MasterConfig, MasterEvent, Token};
use tokio::net::TcpStream;

const T: Duration = Duration::from_secs(5);
const HEARTBEAT: Duration = Duration::from_millis(50);
const LEASE: Duration = Duration::from_millis(400);

async fn fast_master(token: &Token, expected: u32) -> Master {
    let mut config = MasterConfig::new(token.clone(), expected);
    config.heartbeat_interval = HEARTBEAT;
    config.lease = LEASE;
    config.handshake_timeout = Duration::from_millis(300);
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
    assert!(matches!(err, ElasticError::Refused { .. }), "{err}");
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
    // Two leases of normal traffic: heartbeats keep both alive.
    let err = master.next_event(LEASE * 2).await.unwrap_err();
    assert!(matches!(err, ElasticError::Timeout { .. }), "{err}");
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
    // The last heartbeat went out at most one interval before the pause.
    assert!(took >= LEASE - HEARTBEAT, "lost after only {took:?}");
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
    };
    master.send_to(node, commit.clone()).await.unwrap();
    assert_eq!(agent.recv(T).await.unwrap(), commit);

    let status = ExitStatus {
        code: None,
        signal: Some(9),
    };
    agent.report_worker_exit(5, status, T).await.unwrap();
    assert_eq!(
        master.next_event(T).await.unwrap(),
        MasterEvent::WorkerExited {
            node,
            rank: 5,
            status
        }
    );
    assert!(matches!(
        master.send_to(node + 1, commit).await,
        Err(ElasticError::UnknownNode { .. })
    ));

    drop(master);
    let err = agent.recv(T).await.unwrap_err();
    assert!(matches!(err, ElasticError::Closed { .. }), "{err}");
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
