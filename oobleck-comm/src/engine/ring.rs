//! The ring all-reduce for large tensors: reduce-scatter, then all-gather, both pipelined in
//! chunks so every hop of the ring is busy at once.

use super::{Ctx, Engine, Transport};
use crate::comm::Rank;
use crate::error::{CommError, Result};
use crate::mailbox::Key;
use crate::tensor::DType;

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
        // The chunks of a phase whose step k receives segment `seg(k)`, as parts from `first`.
        let phase = |first: usize, seg: &dyn Fn(usize) -> usize| -> Result<Vec<Place>> {
            (0..steps)
                .flat_map(|k| (0..nchunks).map(move |c| (k, c)))
                .map(|(k, c)| {
                    let (a, b) = range(seg(k), c);
                    let part = part(first + k, c)?;
                    Ok(Place { k, c, part, a, b })
                })
                .collect()
        };
        // Reduce-scatter: at step k receive segment (i-k-1), add, forward. The forward after
        // the last step is already the first all-gather step (that segment is complete).
        // Every chunk's place is posted at once to accumulate, so the transport's reader adds
        // the data into the tensor as it arrives (what arrived before is added from the
        // mailbox); each chunk is forwarded as soon as its sum is complete.
        let places = phase(0, &|k| (i + 2 * n - k - 1) % n)?;
        self.take_places(cx, prev, buf, &places, Some(dtype), |p, data| {
            self.send_part(cx, next, part(p.k + 1, p.c)?, &[data])
        })?;
        // All-gather: at step k receive the complete segment (i-k) and forward it, straight
        // into the tensor in the same way.
        let places = phase(steps, &|k| (i + n - k) % n)?;
        self.take_places(cx, prev, buf, &places, None, |p, data| {
            if p.k + 1 < steps {
                self.send_part(cx, next, part(steps + p.k + 1, p.c)?, &[data])?;
            }
            Ok(())
        })
    }

    /// Receives from `prev` the message of each place's part into its bytes of `buf` (`add`:
    /// added to them), in order, calling `filled` on each as soon as it is complete.
    fn take_places(
        &self,
        cx: &Ctx,
        prev: Rank,
        buf: &mut [u8],
        places: &[Place],
        add: Option<DType>,
        mut filled: impl FnMut(&Place, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let base = buf.as_mut_ptr();
        let mut bufs = Vec::with_capacity(places.len());
        for p in places {
            let key = Key {
                peer: prev,
                channel: cx.channel,
                seq: cx.seq,
                part: p.part,
            };
            // SAFETY: the places' byte ranges are disjoint and inside `buf`, which is not
            // touched otherwise until they are unposted.
            let piece: &mut [u8] =
                unsafe { std::slice::from_raw_parts_mut(base.add(p.a), p.b - p.a) };
            bufs.push((key, piece));
        }
        // Parts are consecutive in the order of `places`.
        let want = |key: Key| {
            let p = &places[(key.part - places[0].part) as usize];
            p.b - p.a
        };
        self.mailbox.take_into(
            &mut bufs,
            add,
            cx.due(),
            |key, got| self.length_mismatch(prev, got, want(key)),
            |j, data| filled(&places[j], data),
        )
    }
}

/// One chunk of a ring phase: step `k`, chunk `c`, its message part and its bytes `a..b` of
/// the tensor.
struct Place {
    k: usize,
    c: usize,
    part: u32,
    a: usize,
    b: usize,
}
