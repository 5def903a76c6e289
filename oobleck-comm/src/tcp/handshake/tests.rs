use std::net::SocketAddr;

use super::*;

fn cfg(rank: Rank, generation: u64, world: usize) -> TcpConfig {
    let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
    TcpConfig::new(rank, generation, vec![addr; world])
}

/// A MAC verifies only for the exact purpose, generation, ranks, world and nonces.
#[test]
fn a_hello_mac_binds_every_field() {
    let key = SecretKey::from_bytes([3; KEY_BYTES]);
    let (a, b) = ([1; KEY_BYTES], [2; KEY_BYTES]);
    let mac = hello_mac(&cfg(2, 7, 3), &key, 0, &a, &b);
    let ok = |c: &TcpConfig, from, to, theirs: &Nonce, ours: &Nonce| {
        key.verify(&[&mac_input(c, from, to, theirs, ours)], &mac)
    };
    assert!(ok(&cfg(0, 7, 3), 2, 0, &a, &b));
    assert!(!ok(&cfg(0, 8, 3), 2, 0, &a, &b), "generation");
    assert!(!ok(&cfg(0, 7, 4), 2, 0, &a, &b), "world");
    assert!(!ok(&cfg(0, 7, 3), 0, 2, &a, &b), "direction");
    assert!(!ok(&cfg(0, 7, 3), 1, 0, &a, &b), "sender");
    assert!(!ok(&cfg(0, 7, 3), 2, 0, &b, &a), "nonces");
    assert!(!SecretKey::from_bytes([4; KEY_BYTES])
        .verify(&[&mac_input(&cfg(0, 7, 3), 2, 0, &a, &b)], &mac));
    // The purpose label is part of it: the same fields without it do not verify.
    let input = mac_input(&cfg(0, 7, 3), 2, 0, &a, &b);
    assert!(!key.verify(&[&input[LABEL.len()..]], &mac));
}
