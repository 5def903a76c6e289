//! A forming TCP group under a crash or a flood: a peer that is gone is reported as gone (not
//! as a key mismatch), a caller can cancel the forming group at once, and hundreds of idle
//! strangers on a rank's port never keep its real peers out.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use oobleck_comm::{CommError, SecretKey, TcpCommunicator, TcpConfig};

const GEN: u64 = 3;

fn listeners(n: usize) -> (Vec<TcpListener>, Vec<SocketAddr>) {
    let ls: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs = ls.iter().map(|l| l.local_addr().unwrap()).collect();
    (ls, addrs)
}

fn config(rank: usize, peers: Vec<SocketAddr>, key: &SecretKey, secs: u64) -> TcpConfig {
    let mut cfg = TcpConfig::new(rank, GEN, peers).with_key(key.clone());
    cfg.connect_timeout = Duration::from_secs(secs);
    cfg
}

/// Rank 0 died before rank 1 reached it (its port refuses connections): rank 1 says the peer
/// is gone when its deadline passes.
#[test]
fn a_dead_peer_is_reported_gone_not_misconfigured() {
    let (mut ls, addrs) = listeners(2);
    drop(ls.remove(0));
    let err = TcpCommunicator::connect(config(1, addrs, &SecretKey::random(), 1), ls.pop())
        .err()
        .expect("rank 0 is dead");
    let msg = err.to_string();
    assert!(matches!(err, CommError::PeerLost { rank: 0, .. }), "{msg}");
    assert!(
        msg.contains("the rank is gone") && !msg.contains("key"),
        "{msg}"
    );
}

/// The caller's control plane learns that a peer died and cancels: `connect` returns
/// `Aborted` within a fraction of a second, long before its deadline.
#[test]
fn a_forming_group_is_cancelled_at_once() {
    let (mut ls, addrs) = listeners(3);
    drop(ls.remove(0));
    let key = SecretKey::random();
    let cancel = Arc::new(AtomicBool::new(false));
    let ranks: Vec<_> = ls
        .into_iter()
        .zip([1, 2])
        .map(|(l, r)| {
            let mut cfg = config(r, addrs.clone(), &key, 60);
            cfg.cancel = Some(cancel.clone());
            thread::spawn(move || TcpCommunicator::connect(cfg, Some(l)))
        })
        .collect();
    thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    cancel.store(true, Ordering::Relaxed);
    for h in ranks {
        let r = h.join().unwrap();
        assert!(matches!(r, Err(CommError::Aborted { .. })), "{:?}", r.err());
    }
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

/// 300 idle connections (no byte sent) opened to rank 0 before and while the group forms: its
/// acceptor cuts the oldest handshakes to make room, and ranks 1 and 2 get through.
#[test]
fn hundreds_of_idle_strangers_do_not_keep_the_peers_out() {
    let (ls, addrs) = listeners(3);
    let key = SecretKey::random();
    let target = addrs[0];
    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        thread::spawn(move || {
            let mut held = Vec::new();
            while !stop.load(Ordering::Relaxed) && held.len() < 300 {
                if let Ok(s) = TcpStream::connect_timeout(&target, Duration::from_millis(200)) {
                    held.push(s);
                }
            }
            while !stop.load(Ordering::Relaxed) {
                thread::sleep(Duration::from_millis(10));
            }
            held.len()
        })
    };
    thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    let ranks: Vec<_> = ls
        .into_iter()
        .enumerate()
        .map(|(r, l)| {
            let cfg = config(r, addrs.clone(), &key, 30);
            thread::spawn(move || TcpCommunicator::connect(cfg, Some(l)))
        })
        .collect();
    let results: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
    stop.store(true, Ordering::Relaxed);
    let opened = flood.join().unwrap();
    for (r, res) in results.iter().enumerate() {
        assert!(res.is_ok(), "rank {r}: {}", res.as_ref().err().unwrap());
    }
    assert!(opened >= 100, "the flood opened only {opened} connections");
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
}
