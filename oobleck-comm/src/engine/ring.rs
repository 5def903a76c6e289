//! The ring all-reduce for large tensors: reduce-scatter, then all-gather, both pipelined in
//! chunks so every hop of the ring is busy at once.

use super::{Ctx, Engine, Transport};
use crate::comm::Rank;
use crate::error::{CommError, Result};
use crate::mailbox::Key;
use crate::tensor::{add_into, DType};

impl<T: Transport> Engine<T> {
    /// Reduce-scatter then all-gather around the ring of `g`, each pipelined in chunks of
    /// `chunk_bytes`.
    pub(super) fn all_reduce_ring(
        &self,
        cx: &Ctx,
        g: &[Rank],
        buf: &mut [u8],
        dtype: DType,
    ) -> Result<()> {
        let n = g.len();
        let i = g
            .iter()
            .position(|&r| r == self.rank)
            .expect("member: checked");
        let (next, prev) = (g[(i + 1) % n], g[(i + n - 1) % n]);
        let es = dtype.size();
        let elems = buf.len() / es;
        let seg = |s: usize| (s * elems / n * es, (s + 1) * elems / n * es);
        let chunk = (self.tuning.chunk_bytes / es).max(1) * es;
        let max_seg = (0..n).map(|s| seg(s).1 - seg(s).0).max().unwrap_or(0);
        let nchunks = max_seg.div_ceil(chunk).max(1);
        let range = |s: usize, c: usize| {
            let (a, b) = seg(s);
            ((a + c * chunk).min(b), (a + (c + 1) * chunk).min(b))
        };
        let part = |step: usize, c: usize| -> Result<u32> {
            u32::try_from(step * nchunks + c)
                .map_err(|_| CommError::Invalid("tensor too large for one all_reduce".into()))
        };
        let steps = n - 1;
        for c in 0..nchunks {
            let (a, b) = range(i, c);
            self.send_part(cx, next, part(0, c)?, &[&buf[a..b]])?;
        }
        // Reduce-scatter: at step k receive segment (i-k-1), add, forward. The forward after
        // the last step is already the first all-gather step (that segment is complete).
        for k in 0..steps {
            let s = (i + 2 * n - k - 1) % n;
            for c in 0..nchunks {
                let (a, b) = range(s, c);
                let data = self.recv_part(cx, prev, part(k, c)?)?;
                if data.len() != b - a {
                    return Err(self.length_mismatch(prev, data.len(), b - a));
                }
                add_into(dtype, &mut buf[a..b], &data);
                self.send_part(cx, next, part(k + 1, c)?, &[&buf[a..b]])?;
            }
        }
        // All-gather: at step k receive the complete segment (i-k) and forward it. Every
        // chunk's place in the tensor is posted at once, so the transport's reader copies the
        // data straight there instead of through a message buffer (what arrived before the
        // post is copied from the mailbox as before).
        // (step, chunk, bytes), in the order they arrive: part (steps + k) * nchunks + c.
        let places: Vec<(usize, usize, (usize, usize))> = (0..steps)
            .flat_map(|k| (0..nchunks).map(move |c| (k, c, range((i + n - k) % n, c))))
            .collect();
        let base = buf.as_mut_ptr();
        let mut bufs = Vec::with_capacity(places.len());
        for &(k, c, (a, b)) in &places {
            let key = Key {
                peer: prev,
                channel: cx.channel,
                seq: cx.seq,
                part: part(steps + k, c)?,
            };
            // SAFETY: the ranges of distinct (segment, chunk) pairs are disjoint and inside
            // `buf`, which is not touched otherwise until they are unposted.
            let piece: &mut [u8] = unsafe { std::slice::from_raw_parts_mut(base.add(a), b - a) };
            bufs.push((key, piece));
        }
        let want = |key: Key| {
            let (_, _, (a, b)) = places[key.part as usize - steps * nchunks];
            b - a
        };
        self.mailbox.take_into(
            &mut bufs,
            cx.deadline,
            cx.op,
            cx.timeout,
            |key, got| self.length_mismatch(prev, got, want(key)),
            |j, data| {
                let (k, c, _) = places[j];
                if k + 1 < steps {
                    self.send_part(cx, next, part(steps + k + 1, c)?, &[data])?;
                }
                Ok(())
            },
        )
    }
}
