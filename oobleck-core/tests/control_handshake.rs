//! Control-plane admission: who the master lets in, and that refusing a peer never hurts it.

use std::net::SocketAddr;
use std::time::Duration;

use oobleck_core::runtime::master::{Master, MasterConfig, MasterEvent};
use oobleck_core::runtime::node::Agent;
use oobleck_core::runtime::wire::protocol::{self, Message, PeerRole, Return, PROTOCOL_VERSION};
use oobleck_core::runtime::wire::{client, Token, WireError};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const T: Duration = Duration::from_secs(5);

fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().expect("a literal address parses")
}

/// Sends raw bytes as a stranger would and returns what the master answers (None: it closed).
async fn poke(master: SocketAddr, bytes: &[u8]) -> Option<Message> {
    let mut s = TcpStream::connect(master).await.unwrap();
    s.write_all(bytes).await.unwrap();
    protocol::read_frame(&mut s, T).await.unwrap()
}

fn refusal(msg: Option<Message>) -> String {
    match msg {
        Some(Message::Refused { reason }) => reason,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn hello(protocol: u16, binary_version: &str) -> Message {
    Message::Hello {
        protocol,
        binary_version: binary_version.into(),
        role: PeerRole::Agent { devices: 1 },
        job: None,
    }
}

#[tokio::test]
async fn agents_with_the_token_register_with_consecutive_node_ids() {
    let token = Token::random();
    let master = Master::bind(localhost(), token.clone(), 2).await.unwrap();
    let a = Agent::connect(master.local_addr(), &token, T)
        .await
        .unwrap();
    let b = Agent::connect_with_devices(master.local_addr(), &token, 4, T)
        .await
        .unwrap();
    assert_eq!((a.node(), b.node()), (0, 1));
    let nodes = master.wait_for_nodes(T).await.unwrap();
    let summary: Vec<(u32, u32)> = nodes.iter().map(|n| (n.node, n.devices)).collect();
    assert_eq!(summary, vec![(0, 1), (1, 4)]);
    assert_eq!(master.refused_count(), 0);
}

#[tokio::test]
async fn a_wrong_token_is_refused_with_a_reason_and_the_next_agent_still_gets_in() {
    let token = Token::new("the-real-one").unwrap();
    let master = Master::bind(localhost(), token.clone(), 1).await.unwrap();
    let wrong = Token::new("a-guess").unwrap();
    let err = Agent::connect(master.local_addr(), &wrong, T)
        .await
        .err()
        .unwrap();
    match err {
        WireError::Refused { reason } => assert!(reason.contains("wrong token"), "{reason}"),
        other => panic!("expected a refusal, got {other}"),
    }
    let ok = Agent::connect(master.local_addr(), &token, T)
        .await
        .unwrap();
    assert_eq!(master.wait_for_nodes(T).await.unwrap().len(), 1);
    // Ids are never reused, so the refused agent's reserved id is skipped.
    assert_eq!(ok.node(), 1);
    assert_eq!(master.refused_count(), 1);
}

#[tokio::test]
async fn an_agent_of_another_job_sharing_the_token_is_refused_naming_both_jobs() {
    let secret = "one-secret-two-jobs";
    let ours = Token::new(secret).unwrap().for_job(Some("101"));
    let master = Master::bind(localhost(), ours.clone(), 2).await.unwrap();
    let at = master.local_addr();
    let theirs = Token::new(secret).unwrap().for_job(Some("202"));
    for reason in [
        refused_for(Agent::connect(at, &theirs, T).await.err().unwrap()),
        refused_for(
            Agent::reconnect(at, &theirs, back(0, 3, 1), T)
                .await
                .err()
                .unwrap(),
        ),
    ] {
        assert!(
            reason.contains("this agent is of job \"202\"")
                && reason.contains("this master runs job \"101\"")
                && reason.contains("OOBLECK_JOB"),
            "{reason}"
        );
    }
    // An agent that names no job has nothing to compare; one of this job gets in.
    let _unnamed = Agent::connect(at, &Token::new(secret).unwrap(), T)
        .await
        .unwrap();
    let _ours = Agent::connect(at, &ours, T).await.unwrap();
    assert_eq!(master.wait_for_nodes(T).await.unwrap().len(), 2);
    assert_eq!(master.refused_count(), 2);
}

#[tokio::test]
async fn other_protocol_or_binary_versions_are_refused_with_both_numbers() {
    let token = Token::random();
    let master = Master::bind(localhost(), token.clone(), 1).await.unwrap();
    let addr = master.local_addr();

    let future = protocol::encode_frame_with_version(&hello(99, "0.1.0"), 99).unwrap();
    let reason = refusal(poke(addr, &future).await);
    assert!(
        reason.contains("99") && reason.contains(&PROTOCOL_VERSION.to_string()),
        "{reason}"
    );

    let skewed = protocol::encode_frame(&hello(PROTOCOL_VERSION + 1, "0.1.0")).unwrap();
    let reason = refusal(poke(addr, &skewed).await);
    assert!(reason.contains("protocol version"), "{reason}");

    let other_binary = protocol::encode_frame(&hello(PROTOCOL_VERSION, "0.0.0-other")).unwrap();
    let reason = refusal(poke(addr, &other_binary).await);
    assert!(reason.contains("0.0.0-other"), "{reason}");

    assert_eq!(master.refused_count(), 3);
    Agent::connect(addr, &token, T).await.unwrap();
    assert_eq!(master.wait_for_nodes(T).await.unwrap().len(), 1);
}

#[tokio::test]
async fn garbage_oversize_and_out_of_order_frames_are_refused_and_the_master_lives_on() {
    let token = Token::random();
    let master = Master::bind(localhost(), token.clone(), 1).await.unwrap();
    let addr = master.local_addr();

    let reason = refusal(poke(addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await);
    assert!(reason.contains("magic"), "{reason}");

    let mut oversize = protocol::MAGIC.to_vec();
    oversize.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    oversize.extend_from_slice(&0u16.to_be_bytes());
    oversize.extend_from_slice(&u32::MAX.to_be_bytes());
    let reason = refusal(poke(addr, &oversize).await);
    assert!(reason.contains("exceeds"), "{reason}");

    let mut malformed = oversize[..8].to_vec();
    malformed.extend_from_slice(&4u32.to_be_bytes());
    malformed.extend_from_slice(b"{{{{");
    let reason = refusal(poke(addr, &malformed).await);
    assert!(reason.contains("malformed"), "{reason}");

    // Skipping the handshake: a heartbeat before hello.
    let early = protocol::encode_frame(&Message::Heartbeat { node: 0, seq: 1 }).unwrap();
    let reason = refusal(poke(addr, &early).await);
    assert!(reason.contains("expected hello"), "{reason}");

    // A peer that connects and leaves without a word is not a refusal.
    drop(TcpStream::connect(addr).await.unwrap());

    assert_eq!(master.refused_count(), 4);
    let agent = Agent::connect(addr, &token, T).await.unwrap();
    assert_eq!(
        master.wait_for_nodes(T).await.unwrap()[0].node,
        agent.node()
    );
}

#[tokio::test]
async fn a_flood_of_silent_connections_is_capped_and_agents_get_in_once_it_clears() {
    let token = Token::random();
    let mut config = MasterConfig::new(token.clone(), 1);
    config.max_pending_handshakes = 2;
    config.handshake_timeout = Duration::from_millis(500);
    let master = Master::bind_with(localhost(), config).await.unwrap();
    let addr = master.local_addr();
    // Two silent peers hold both handshake slots...
    let mut silent = Vec::new();
    for _ in 0..2 {
        silent.push(TcpStream::connect(addr).await.unwrap());
    }
    // ...so a third is refused at once, and says why.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let reason = refusal(poke(addr, b"").await);
    assert!(reason.contains("too many connections"), "{reason}");
    // Once the silent peers time out their slots free up.
    for s in &mut silent {
        let reason = refusal(protocol::read_frame(s, T).await.unwrap());
        assert!(reason.contains("timed out"), "{reason}");
    }
    Agent::connect(addr, &token, T).await.unwrap();
    assert_eq!(master.refused_count(), 3);
}

#[tokio::test]
async fn a_storm_of_silent_strangers_cannot_keep_an_agent_or_a_tool_out() {
    let token = Token::random();
    let mut config = MasterConfig::new(token.clone(), 1);
    config.max_pending_handshakes = 4;
    config.handshake_timeout = Duration::from_secs(30);
    let master = Master::bind_with(localhost(), config).await.unwrap();
    let addr = master.local_addr();
    // Strangers fill every handshake slot and say nothing, for far longer than a real peer
    // needs; a slot held past the eviction age goes to the next newcomer.
    let mut silent = Vec::new();
    for _ in 0..4 {
        silent.push(TcpStream::connect(addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    let agent = Agent::connect(addr, &token, T).await.unwrap();
    assert_eq!(agent.node(), 0);
    let reason = refusal(protocol::read_frame(&mut silent[0], T).await.unwrap());
    assert!(reason.contains("this was the oldest"), "{reason}");
    // A tool gets in the same way while the others still hold theirs.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let status = client::request_status(addr, &token, T).await.unwrap();
    assert_eq!(status.nodes.len(), 1);
}

/// A master's agent come back: node `node`, at committed step `committed`, having seen a
/// master of `epoch`.
fn back(node: u32, committed: u64, epoch: u64) -> Return {
    Return {
        node,
        devices: 1,
        generation: 0,
        committed,
        ranks: vec![node],
        without_master_ms: 3000,
        epoch,
    }
}

/// A master restarted with `--reattach` (epoch 2), expecting nodes 0 and 1 back, whose run
/// directory recorded step 5 as committed.
async fn reattaching(token: &Token) -> Master {
    let mut config = MasterConfig::new(token.clone(), 2);
    config.epoch = 2;
    config.returning = [0, 1].into();
    config.recorded = Some(5);
    Master::bind_with(localhost(), config).await.unwrap()
}

fn refused_for(e: WireError) -> String {
    match e {
        WireError::Refused { reason } => reason,
        other => panic!("expected a refusal, got {other}"),
    }
}

#[tokio::test]
async fn a_stranger_claiming_a_higher_epoch_is_refused_for_its_token_and_replaces_nothing() {
    let token = Token::random();
    let mut master = reattaching(&token).await;
    let wrong = Token::new("a-guess").unwrap();
    let e = Agent::reconnect(master.local_addr(), &wrong, back(0, 5, 99), T)
        .await
        .err()
        .unwrap();
    assert!(refused_for(e).contains("wrong token"));
    // The master was not told it was replaced: its next word is the refusal.
    match master.next_event(T).await.unwrap() {
        MasterEvent::Refused { reason, .. } => assert!(reason.contains("wrong token"), "{reason}"),
        other => panic!("expected the refusal, got {other:?}"),
    }
    // Its agent still comes back with its own id.
    let a = Agent::reconnect(master.local_addr(), &token, back(0, 5, 1), T)
        .await
        .unwrap();
    assert_eq!((a.node(), a.adopted()), (0, true));
}

#[tokio::test]
async fn an_agent_of_a_higher_epoch_tells_the_master_it_was_replaced() {
    let token = Token::random();
    let mut master = reattaching(&token).await;
    let e = Agent::reconnect(master.local_addr(), &token, back(0, 5, 3), T)
        .await
        .err()
        .unwrap();
    let reason = refused_for(e);
    assert!(
        reason.contains("epoch 2 is behind the agent's 3"),
        "{reason}"
    );
    match master.next_event(T).await.unwrap() {
        MasterEvent::Replaced { epoch } => assert_eq!(epoch, 3),
        other => panic!("expected replaced, got {other:?}"),
    }
}

#[tokio::test]
async fn a_master_whose_run_directory_is_behind_its_agents_takes_none_back() {
    let token = Token::random();
    let master = reattaching(&token).await;
    // Node 0 committed step 6; this master's copy recorded step 5: a stale copy.
    let e = Agent::reconnect(master.local_addr(), &token, back(0, 6, 1), T)
        .await
        .err()
        .unwrap();
    let reason = refused_for(e);
    assert!(
        reason.contains("recorded step 5 as committed, and this agent committed step 6"),
        "{reason}"
    );
    assert!(reason.contains("stale copy"), "{reason}");
    // Its id stays for the agent with a step the directory holds (one behind is fine).
    let a = Agent::reconnect(master.local_addr(), &token, back(0, 4, 1), T)
        .await
        .unwrap();
    assert_eq!((a.node(), a.adopted()), (0, true));
}

#[tokio::test]
async fn a_standby_with_another_jobs_token_is_refused_and_the_job_goes_on() {
    use oobleck_core::runtime::master::{run_standby, StandbyOptions};
    let token = Token::random();
    let master = Master::bind(localhost(), token.clone(), 1).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let opts = StandbyOptions {
        master: master.local_addr().to_string(),
        token: "another-jobs-token".into(),
        copy: dir.path().join("copy"),
        listen: "127.0.0.1:9".parse().unwrap(),
        wait: Duration::from_secs(1),
    };
    let e = tokio::task::spawn_blocking(move || run_standby(&opts))
        .await
        .unwrap()
        .expect_err("refused");
    let text = e.to_string();
    assert!(text.contains("wrong token"), "{text}");
    assert!(master.standbys().is_empty());
    // The job's own agent still gets in.
    Agent::connect(master.local_addr(), &token, T)
        .await
        .unwrap();
    assert_eq!(master.wait_for_nodes(T).await.unwrap().len(), 1);
}
