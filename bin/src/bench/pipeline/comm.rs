//! The data plane of the benchmark: TCP ranks on 127.0.0.1, each behind a communicator that
//! counts the wall time spent inside its calls (the part of a rank's iteration that is not busy).

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use oobleck_comm::{Communicator, DType, Rank, TcpCommunicator, TcpConfig, TensorBuf};

/// A communicator that counts the wall time spent inside its calls.
pub(super) struct TimedComm<C> {
    inner: C,
    busy_ns: AtomicU64,
}

impl<C: Communicator> TimedComm<C> {
    pub(super) fn new(inner: C) -> Self {
        Self {
            inner,
            busy_ns: AtomicU64::new(0),
        }
    }

    pub(super) fn in_comm(&self) -> Duration {
        Duration::from_nanos(self.busy_ns.load(Ordering::Relaxed))
    }

    fn timed<R>(&self, f: impl FnOnce() -> R) -> R {
        let t = Instant::now();
        let r = f();
        self.busy_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }
}

impl<C: Communicator> Communicator for TimedComm<C> {
    fn rank(&self) -> Rank {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn generation(&self) -> u64 {
        self.inner.generation()
    }
    fn send(
        &self,
        dst: Rank,
        tag: u64,
        tensor: &TensorBuf,
        timeout: Duration,
    ) -> oobleck_comm::Result<()> {
        self.timed(|| self.inner.send(dst, tag, tensor, timeout))
    }
    fn recv(&self, src: Rank, tag: u64, timeout: Duration) -> oobleck_comm::Result<TensorBuf> {
        self.timed(|| self.inner.recv(src, tag, timeout))
    }
    fn recv_into(
        &self,
        src: Rank,
        tag: u64,
        dst: &mut TensorBuf,
        timeout: Duration,
    ) -> oobleck_comm::Result<()> {
        self.timed(|| self.inner.recv_into(src, tag, dst, timeout))
    }
    fn alloc(&self, dtype: DType, shape: Vec<usize>) -> oobleck_comm::Result<TensorBuf> {
        self.inner.alloc(dtype, shape)
    }
    fn all_reduce(
        &self,
        group: &[Rank],
        tensor: &mut TensorBuf,
        timeout: Duration,
    ) -> oobleck_comm::Result<()> {
        self.timed(|| self.inner.all_reduce(group, tensor, timeout))
    }
    fn broadcast(
        &self,
        group: &[Rank],
        root: Rank,
        tensor: &mut TensorBuf,
        timeout: Duration,
    ) -> oobleck_comm::Result<()> {
        self.timed(|| self.inner.broadcast(group, root, tensor, timeout))
    }
    fn barrier(&self, group: &[Rank], timeout: Duration) -> oobleck_comm::Result<()> {
        self.timed(|| self.inner.barrier(group, timeout))
    }
    fn abort(&self) {
        self.inner.abort()
    }
    fn is_aborted(&self) -> bool {
        self.inner.is_aborted()
    }
}

/// Connects `world` TCP ranks on 127.0.0.1 (each on its own port 0 listener).
pub(super) fn connect_tcp(world: usize, timeout: Duration) -> Result<Vec<TcpCommunicator>> {
    let listeners = (0..world)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()
        .context("binding 127.0.0.1:0")?;
    let addrs: Vec<SocketAddr> = listeners
        .iter()
        .map(|l| l.local_addr())
        .collect::<std::io::Result<_>>()?;
    let comms: Vec<Result<TcpCommunicator>> = std::thread::scope(|s| {
        let hs: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                let mut cfg = TcpConfig::new(rank, 0, addrs.clone());
                cfg.connect_timeout = timeout;
                s.spawn(move || {
                    TcpCommunicator::connect(cfg, Some(l))
                        .with_context(|| format!("rank {rank}: connecting"))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("connect panicked")))
            })
            .collect()
    });
    comms.into_iter().collect()
}
