//! The conformance suite on the TCP backend, all ranks as threads of this process on
//! 127.0.0.1 (multi-process tests with real signals are in `tcp_processes.rs`), three times:
//! with shared memory (the default between ranks of one host; checked to be in use), with it
//! and all-reduce inputs from `alloc` (reduced in place), and with it turned off, every pair on
//! TCP.

mod common;

use std::net::TcpListener;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use common::{Cluster, Comm, Factory};
use oobleck_comm::{TcpCommunicator, TcpConfig, Tuning};

/// The TCP backend; `shm`: shared memory between the ranks (all on this host) or none;
/// `alloc`: all-reduce inputs from `Communicator::alloc`.
struct Tcp {
    shm: bool,
    alloc: bool,
}

/// Connects `world` ranks over loopback, each on its own port.
pub fn tcp_group(world: usize, generation: u64, tuning: Tuning, shm: bool) -> Vec<TcpCommunicator> {
    let listeners: Vec<TcpListener> = (0..world)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<_> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let hs: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let mut cfg = TcpConfig::new(rank, generation, addrs.clone());
            cfg.tuning = tuning;
            cfg.connect_timeout = Duration::from_secs(10);
            cfg.shared_memory = shm;
            thread::spawn(move || TcpCommunicator::connect(cfg, Some(l)))
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
}

impl Factory for Tcp {
    fn cluster(&self, world: usize, tuning: Tuning) -> Cluster {
        let group = tcp_group(world, 7, tuning, self.shm);
        for (r, c) in group.iter().enumerate() {
            let want: Vec<usize> = if self.shm {
                (0..world).filter(|&p| p != r).collect()
            } else {
                vec![]
            };
            assert_eq!(
                c.shared_memory_peers(),
                want,
                "rank {r}: shared-memory peers"
            );
        }
        let comms: Vec<Comm> = group.into_iter().map(|c| Arc::new(c) as Comm).collect();
        let handles = comms.clone();
        Cluster {
            comms,
            // Aborting closes every socket of that rank: what its peers see when it dies.
            kill: Box::new(move |r| handles[r].abort()),
            alloc: self.alloc,
        }
    }
}

mod shared_memory {
    use super::{common, Tcp};
    use crate::conformance_suite;
    conformance_suite!(Tcp {
        shm: true,
        alloc: false
    });
}

mod in_place {
    use super::{common, Tcp};
    use crate::conformance_suite;
    conformance_suite!(Tcp {
        shm: true,
        alloc: true
    });
}

mod forced_tcp {
    use super::{common, Tcp};
    use crate::conformance_suite;
    conformance_suite!(Tcp {
        shm: false,
        alloc: false
    });
}
