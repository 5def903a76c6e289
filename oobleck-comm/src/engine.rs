//! The collective algorithms, shared by every byte-moving backend (TCP, in-process).
//!
//! A backend supplies a [`Transport`] (send one message to one peer) and fills a
//! [`Mailbox`]; the [`Engine`] turns that into the [`Communicator`] operations:
//!
//! ```text
//!  all_reduce, bytes <= direct_max        all_reduce, larger: ring, pipelined per chunk
//!  every member sends to every member      reduce-scatter n-1 steps, then all-gather n-1 steps;
//!  and sums in rank order (1 round)        each received chunk is reduced and forwarded at once
//!
//!  broadcast: small -> root sends to each; large -> chunked chain in ring order from the root
//!  barrier:   every member sends an empty message to every member
//! ```
//!
//! Every member sums in the same order, so results are bit-identical across members.

mod ring;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::{debug_span, warn};

use crate::comm::{group_id, normalize_group, Communicator, Rank};
use crate::error::{CommError, FrameError, Op, Result};
use crate::mailbox::{Due, Key, Mailbox};
use crate::tensor::{add_into, byte_len, decode_meta, encode_meta, DType, TensorBuf};

/// Moves one message to one peer. Implementations must be `Sync`: several operations send
/// concurrently.
pub(crate) trait Transport: Send + Sync {
    /// Sends the concatenation of `parts` as the message `(channel, seq, part)` to `peer`,
    /// giving up at `deadline`.
    fn send(
        &self,
        peer: Rank,
        key: (u64, u64, u32),
        parts: &[&[u8]],
        deadline: Instant,
        op: Op,
        timeout: Duration,
    ) -> Result<()>;
    /// Closes every connection (abort, poisoning). Must not block.
    fn shutdown(&self);
    /// The backend's own all-reduce of `buf` over the sorted group `g`, where it has a better
    /// one (shared memory on one host). `Ok(false)`: not handled, nothing sent that the
    /// engine's algorithms would read; the engine runs its own on the same context.
    fn all_reduce(&self, _cx: &Ctx, _g: &[Rank], _tensor: &mut TensorBuf) -> Result<bool> {
        Ok(false)
    }
    /// Memory for a tensor of `len` bytes that the backend's all-reduce works on in place
    /// (shared memory); `None`: ordinary heap memory.
    fn alloc_shared(&self, _len: usize) -> Option<crate::shm::SharedBytes> {
        None
    }
}

/// Tuning knobs of the algorithms.
#[derive(Debug, Clone, Copy)]
pub struct Tuning {
    /// All-reduces of at most this many bytes use the one-round direct exchange.
    pub direct_max_bytes: usize,
    /// Chunk size of pipelined ring all-reduce and chain broadcast.
    pub chunk_bytes: usize,
    /// Largest message payload (the frame cap of the TCP backend); p2p tensors are split.
    pub max_message_bytes: usize,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            direct_max_bytes: 64 << 10,
            chunk_bytes: 1 << 20,
            // Below glibc's largest mmap threshold (32 MiB), so receive buffers are recycled
            // by malloc instead of being mapped and faulted in afresh for every message.
            max_message_bytes: 8 << 20,
        }
    }
}

const COLLECTIVE: u64 = 1 << 63;

pub(crate) struct Engine<T: Transport> {
    pub rank: Rank,
    pub world: usize,
    pub generation: u64,
    pub transport: T,
    pub mailbox: std::sync::Arc<Mailbox>,
    pub tuning: Tuning,
    group_seq: Mutex<HashMap<u64, u64>>,
    send_seq: Mutex<HashMap<(Rank, u64), u64>>,
    recv_seq: Mutex<HashMap<(Rank, u64), u64>>,
}

/// Per-operation context: deadline and the ids for errors.
pub(crate) struct Ctx {
    pub op: Op,
    pub deadline: Instant,
    pub timeout: Duration,
    /// The message channel: the tag, or the group id with the top bit set.
    pub channel: u64,
    pub seq: u64,
}

impl Ctx {
    pub fn due(&self) -> Due {
        Due {
            deadline: self.deadline,
            op: self.op,
            timeout: self.timeout,
        }
    }
}

fn next(map: &Mutex<HashMap<(Rank, u64), u64>>, k: (Rank, u64)) -> u64 {
    let mut m = map.lock().unwrap_or_else(|p| p.into_inner());
    let c = m.entry(k).or_insert(0);
    *c += 1;
    *c - 1
}

impl<T: Transport> Engine<T> {
    pub fn new(
        rank: Rank,
        world: usize,
        generation: u64,
        transport: T,
        mailbox: std::sync::Arc<Mailbox>,
        tuning: Tuning,
    ) -> Self {
        Engine {
            rank,
            world,
            generation,
            transport,
            mailbox,
            tuning,
            group_seq: Mutex::new(HashMap::new()),
            send_seq: Mutex::new(HashMap::new()),
            recv_seq: Mutex::new(HashMap::new()),
        }
    }

    /// Runs an operation; a failure that is not the caller's mistake poisons the communicator.
    fn guarded<R>(&self, op: Op, f: impl FnOnce() -> Result<R>) -> Result<R> {
        if self.mailbox.is_aborted() {
            return Err(self.mailbox.aborted_error());
        }
        let out = f();
        if let Err(e) = &out {
            if !e.is_invalid_argument() && !self.mailbox.is_aborted() {
                warn!(rank = self.rank, generation = self.generation, %op, error = %e, "communicator poisoned");
                self.abort();
            }
        }
        out
    }

    fn collective_ctx(&self, op: Op, sorted: &[Rank], timeout: Duration) -> Ctx {
        let gid = group_id(sorted);
        let mut m = self.group_seq.lock().unwrap_or_else(|p| p.into_inner());
        let c = m.entry(gid).or_insert(0);
        *c += 1;
        Ctx {
            op,
            deadline: Instant::now() + timeout,
            timeout,
            channel: gid | COLLECTIVE,
            seq: *c - 1,
        }
    }

    fn send_part(&self, cx: &Ctx, peer: Rank, part: u32, parts: &[&[u8]]) -> Result<()> {
        self.transport.send(
            peer,
            (cx.channel, cx.seq, part),
            parts,
            cx.deadline,
            cx.op,
            cx.timeout,
        )
    }

    fn recv_part(&self, cx: &Ctx, peer: Rank, part: u32) -> Result<Vec<u8>> {
        let key = Key {
            peer,
            channel: cx.channel,
            seq: cx.seq,
            part,
        };
        self.mailbox.take(key, cx.due())
    }

    /// A received chunk whose length differs from ours: the peers disagree on the tensor.
    /// A p2p receive names another rank of the world and a user tag (below 2^63).
    fn check_recv(&self, src: Rank, tag: u64) -> Result<()> {
        if src >= self.world || src == self.rank || tag & COLLECTIVE != 0 {
            return Err(CommError::Invalid(format!(
                "recv on rank {} from rank {src} with tag {tag} (world {}, tags < 2^63, no self-receives)",
                self.rank, self.world
            )));
        }
        Ok(())
    }

    /// Starts a p2p receive: its context and the tensor header (part 0) from `src`.
    fn recv_meta(
        &self,
        src: Rank,
        tag: u64,
        timeout: Duration,
    ) -> Result<(Ctx, DType, Vec<usize>, usize)> {
        let cx = Ctx {
            op: Op::Recv,
            deadline: Instant::now() + timeout,
            timeout,
            channel: tag,
            seq: next(&self.recv_seq, (src, tag)),
        };
        let meta = self.recv_part(&cx, src, 0)?;
        let (dtype, shape, len) = decode_meta(&meta).map_err(|m| malformed(src, m))?;
        Ok((cx, dtype, shape, len))
    }

    /// Receives a p2p tensor's body (parts 1.., `max_message_bytes` each) into `dst`; a
    /// transport that streams may copy it straight there.
    fn recv_parts_into(&self, cx: &Ctx, src: Rank, dst: &mut [u8]) -> Result<()> {
        let max = self.tuning.max_message_bytes.max(1);
        if u32::try_from(dst.len().div_ceil(max)).is_err() {
            return Err(malformed(src, "too many parts".into()));
        }
        let total = dst.len();
        let mut bufs: Vec<(Key, &mut [u8])> = dst
            .chunks_mut(max)
            .enumerate()
            .map(|(p, piece)| {
                let key = Key {
                    peer: src,
                    channel: cx.channel,
                    seq: cx.seq,
                    part: p as u32 + 1,
                };
                (key, piece)
            })
            .collect();
        // Part p (from 1) holds bytes (p-1)*max .. min(p*max, total).
        let piece_len = |k: Key| (total - (k.part as usize - 1) * max).min(max);
        self.mailbox.take_into(
            &mut bufs,
            None,
            cx.due(),
            |k, got| self.length_mismatch(src, got, piece_len(k)),
            |_, _| Ok(()),
        )
    }

    fn length_mismatch(&self, peer: Rank, got: usize, want: usize) -> CommError {
        CommError::Frame {
            peer: Some(peer),
            source: FrameError::Malformed(format!(
                "chunk of {got} bytes where rank {} expected {want}: members passed tensors of different sizes",
                self.rank
            )),
        }
    }

    fn all_reduce_direct(&self, cx: &Ctx, g: &[Rank], buf: &mut [u8], dtype: DType) -> Result<()> {
        for &p in g.iter().filter(|&&p| p != self.rank) {
            self.send_part(cx, p, 0, &[buf])?;
        }
        let mine = buf.to_vec();
        for (idx, &p) in g.iter().enumerate() {
            let theirs;
            let data: &[u8] = if p == self.rank {
                &mine
            } else {
                theirs = self.recv_part(cx, p, 0)?;
                if theirs.len() != buf.len() {
                    return Err(self.length_mismatch(p, theirs.len(), buf.len()));
                }
                &theirs
            };
            if idx == 0 {
                buf.copy_from_slice(data);
            } else {
                add_into(dtype, buf, data);
            }
        }
        Ok(())
    }

    fn broadcast_inner(&self, cx: &Ctx, g: &[Rank], root: Rank, buf: &mut [u8]) -> Result<()> {
        let n = g.len();
        let ri = g
            .iter()
            .position(|&r| r == root)
            .expect("root in group: checked");
        let i = g
            .iter()
            .position(|&r| r == self.rank)
            .expect("member: checked");
        let chunk = self.tuning.chunk_bytes.max(1);
        if buf.len() <= chunk {
            if self.rank == root {
                for &p in g.iter().filter(|&&p| p != root) {
                    self.send_part(cx, p, 0, &[buf])?;
                }
            } else {
                let data = self.recv_part(cx, root, 0)?;
                if data.len() != buf.len() {
                    return Err(self.length_mismatch(root, data.len(), buf.len()));
                }
                buf.copy_from_slice(&data);
            }
            return Ok(());
        }
        // Chain in ring order starting at the root, pipelined per chunk.
        let pos = (i + n - ri) % n;
        let next = (pos + 1 < n).then(|| g[(i + 1) % n]);
        let prev = g[(i + n - 1) % n];
        for (c, piece) in buf.chunks_mut(chunk).enumerate() {
            let c = u32::try_from(c)
                .map_err(|_| CommError::Invalid("tensor too large for one broadcast".into()))?;
            if pos != 0 {
                let data = self.recv_part(cx, prev, c)?;
                if data.len() != piece.len() {
                    return Err(self.length_mismatch(prev, data.len(), piece.len()));
                }
                piece.copy_from_slice(&data);
            }
            if let Some(nx) = next {
                self.send_part(cx, nx, c, &[piece])?;
            }
        }
        Ok(())
    }
}

impl<T: Transport> Communicator for Engine<T> {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn generation(&self) -> u64 {
        self.generation
    }

    fn send(&self, dst: Rank, tag: u64, tensor: &TensorBuf, timeout: Duration) -> Result<()> {
        let _span = debug_span!(
            "send",
            rank = self.rank,
            dst,
            tag,
            bytes = tensor.as_bytes().len()
        )
        .entered();
        if dst >= self.world || dst == self.rank || tag & COLLECTIVE != 0 {
            return Err(CommError::Invalid(format!(
                "send from rank {} to rank {dst} with tag {tag} (world {}, tags < 2^63, no self-sends)",
                self.rank, self.world
            )));
        }
        let meta = encode_meta(tensor)?;
        self.guarded(Op::Send, || {
            let cx = Ctx {
                op: Op::Send,
                deadline: Instant::now() + timeout,
                timeout,
                channel: tag,
                seq: next(&self.send_seq, (dst, tag)),
            };
            self.send_part(&cx, dst, 0, &[&meta])?;
            let max = self.tuning.max_message_bytes.max(1);
            for (c, piece) in tensor.as_bytes().chunks(max).enumerate() {
                let part = u32::try_from(c + 1)
                    .map_err(|_| CommError::Invalid("tensor too large to send".into()))?;
                self.send_part(&cx, dst, part, &[piece])?;
            }
            Ok(())
        })
    }

    fn recv(&self, src: Rank, tag: u64, timeout: Duration) -> Result<TensorBuf> {
        let _span = debug_span!("recv", rank = self.rank, src, tag).entered();
        self.check_recv(src, tag)?;
        self.guarded(Op::Recv, || {
            let (cx, dtype, shape, len) = self.recv_meta(src, tag, timeout)?;
            let bad = |msg: String| malformed(src, msg);
            let max = self.tuning.max_message_bytes.max(1);
            let nparts = len.div_ceil(max);
            let data = if nparts == 0 {
                Vec::new()
            } else if nparts == 1 {
                self.recv_part(&cx, src, 1)?
            } else {
                let mut out = vec![0u8; len];
                self.recv_parts_into(&cx, src, &mut out)?;
                out
            };
            if data.len() != len {
                return Err(bad(format!(
                    "tensor of {shape:?} {dtype:?} needs {len} bytes, got {}",
                    data.len()
                )));
            }
            TensorBuf::from_bytes(dtype, shape, data)
        })
    }

    fn recv_into(&self, src: Rank, tag: u64, dst: &mut TensorBuf, timeout: Duration) -> Result<()> {
        self.check_recv(src, tag)?;
        self.guarded(Op::Recv, || {
            let (cx, dtype, shape, len) = self.recv_meta(src, tag, timeout)?;
            let bad = |msg: String| malformed(src, msg);
            if dtype != dst.dtype() || len != dst.as_bytes().len() {
                return Err(bad(format!(
                    "got {dtype:?} {shape:?} for a {:?} buffer of {} bytes",
                    dst.dtype(),
                    dst.as_bytes().len()
                )));
            }
            self.recv_parts_into(&cx, src, dst.as_bytes_mut())?;
            dst.set_shape(shape)?;
            Ok(())
        })
    }

    fn all_reduce(&self, group: &[Rank], tensor: &mut TensorBuf, timeout: Duration) -> Result<()> {
        let bytes = tensor.as_bytes().len();
        let _span = debug_span!(
            "all_reduce",
            rank = self.rank,
            generation = self.generation,
            bytes,
            members = group.len()
        )
        .entered();
        let g = normalize_group(group, self.rank, self.world)?;
        if g.len() == 1 {
            return Ok(());
        }
        let dtype = tensor.dtype();
        self.guarded(Op::AllReduce, || {
            let cx = self.collective_ctx(Op::AllReduce, &g, timeout);
            let small = bytes <= self.tuning.direct_max_bytes || bytes / dtype.size() < g.len();
            if !small && self.transport.all_reduce(&cx, &g, tensor)? {
                return Ok(());
            }
            let buf = tensor.as_bytes_mut();
            if small {
                self.all_reduce_direct(&cx, &g, buf, dtype)
            } else {
                self.all_reduce_ring(&cx, &g, buf, dtype)
            }
        })
    }

    fn alloc(&self, dtype: DType, shape: Vec<usize>) -> Result<TensorBuf> {
        let len = byte_len(dtype, &shape)?;
        // Small tensors take the one-round exchange, which has nothing to gain from sharing.
        // (After an abort the transport has no shared memory to give.)
        if len <= self.tuning.direct_max_bytes {
            return TensorBuf::zeros(dtype, shape);
        }
        match self.transport.alloc_shared(len) {
            Some(bytes) => Ok(TensorBuf::shared(dtype, shape, bytes)),
            None => TensorBuf::zeros(dtype, shape),
        }
    }

    fn broadcast(
        &self,
        group: &[Rank],
        root: Rank,
        tensor: &mut TensorBuf,
        timeout: Duration,
    ) -> Result<()> {
        let _span = debug_span!(
            "broadcast",
            rank = self.rank,
            root,
            bytes = tensor.as_bytes().len()
        )
        .entered();
        let g = normalize_group(group, self.rank, self.world)?;
        if g.binary_search(&root).is_err() {
            return Err(CommError::Invalid(format!(
                "broadcast root {root} is not in group {group:?}"
            )));
        }
        if g.len() == 1 {
            return Ok(());
        }
        self.guarded(Op::Broadcast, || {
            let cx = self.collective_ctx(Op::Broadcast, &g, timeout);
            self.broadcast_inner(&cx, &g, root, tensor.as_bytes_mut())
        })
    }

    fn barrier(&self, group: &[Rank], timeout: Duration) -> Result<()> {
        let _span = debug_span!("barrier", rank = self.rank, members = group.len()).entered();
        let g = normalize_group(group, self.rank, self.world)?;
        self.guarded(Op::Barrier, || {
            let cx = self.collective_ctx(Op::Barrier, &g, timeout);
            for &p in g.iter().filter(|&&p| p != self.rank) {
                self.send_part(&cx, p, 0, &[])?;
            }
            for &p in g.iter().filter(|&&p| p != self.rank) {
                self.recv_part(&cx, p, 0)?;
            }
            Ok(())
        })
    }

    fn abort(&self) {
        self.mailbox.abort();
        self.transport.shutdown();
    }

    fn is_aborted(&self) -> bool {
        self.mailbox.is_aborted()
    }
}

/// Implements [`Communicator`] for a newtype around an `Engine` by delegation.
macro_rules! delegate_communicator {
    ($ty:ty, $($field:tt)+) => {
        impl $crate::comm::Communicator for $ty {
            fn rank(&self) -> $crate::comm::Rank { self.$($field)+.rank() }
            fn world_size(&self) -> usize { self.$($field)+.world_size() }
            fn generation(&self) -> u64 { self.$($field)+.generation() }
            fn send(&self, dst: $crate::comm::Rank, tag: u64, tensor: &$crate::tensor::TensorBuf, timeout: std::time::Duration) -> $crate::error::Result<()> {
                self.$($field)+.send(dst, tag, tensor, timeout)
            }
            fn recv(&self, src: $crate::comm::Rank, tag: u64, timeout: std::time::Duration) -> $crate::error::Result<$crate::tensor::TensorBuf> {
                self.$($field)+.recv(src, tag, timeout)
            }
            fn recv_into(&self, src: $crate::comm::Rank, tag: u64, dst: &mut $crate::tensor::TensorBuf, timeout: std::time::Duration) -> $crate::error::Result<()> {
                self.$($field)+.recv_into(src, tag, dst, timeout)
            }
            fn alloc(&self, dtype: $crate::tensor::DType, shape: Vec<usize>) -> $crate::error::Result<$crate::tensor::TensorBuf> {
                self.$($field)+.alloc(dtype, shape)
            }
            fn all_reduce(&self, group: &[$crate::comm::Rank], tensor: &mut $crate::tensor::TensorBuf, timeout: std::time::Duration) -> $crate::error::Result<()> {
                self.$($field)+.all_reduce(group, tensor, timeout)
            }
            fn broadcast(&self, group: &[$crate::comm::Rank], root: $crate::comm::Rank, tensor: &mut $crate::tensor::TensorBuf, timeout: std::time::Duration) -> $crate::error::Result<()> {
                self.$($field)+.broadcast(group, root, tensor, timeout)
            }
            fn barrier(&self, group: &[$crate::comm::Rank], timeout: std::time::Duration) -> $crate::error::Result<()> {
                self.$($field)+.barrier(group, timeout)
            }
            fn abort(&self) { self.$($field)+.abort() }
            fn is_aborted(&self) -> bool { self.$($field)+.is_aborted() }
        }
    };
}
pub(crate) use delegate_communicator;

/// A frame from `peer` whose content makes no sense.
fn malformed(peer: Rank, msg: String) -> CommError {
    CommError::Frame {
        peer: Some(peer),
        source: FrameError::Malformed(msg),
    }
}
