//! All-reduce among ranks of one host through shared scratch buffers: every byte is copied
//! once in, reduced once by the rank that owns its slice, and copied once out.
//!
//! ```text
//!   member i of n, tensor of S bytes, slice k = [k*S/n, (k+1)*S/n)
//!   1. copy the tensor into my scratch (a segment of mine, mapped by the group's members)
//!   2. READY ─▶ every member  (dtype, length, and the scratch's name when it is new)
//!   3. slice i = sum over members in group order of their scratch's slice i, read in place;
//!      written to my tensor and my scratch
//!   4. REDUCED ─▶ every member; wait for theirs (the scratch may now be unlinked: all mapped it)
//!   5. copy slice k from member k's scratch, for every k != i
//!   6. COPIED ─▶ every member; wait for theirs (no scratch is overwritten while still read)
//! ```
//!
//! Each slice is summed by one rank in one order and copied to the others, so the result is
//! bit-identical everywhere. Control messages go through the ordinary transport (the rings),
//! so every wait has the op's deadline and fails fast with `PeerLost` when a member dies, like
//! any other op. A member that cannot allocate its scratch (full tmpfs) says so in READY and
//! every member falls back to the engine's ring all-reduce for that op.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tracing::warn;

use super::segment::Segment;
use crate::comm::Rank;
use crate::error::{CommError, FrameError, Result};
use crate::tensor::{add_into, DType};

/// Part numbers of the control messages; the engine's ring parts never get this high.
pub(crate) const READY: u32 = u32::MAX;
const REDUCED: u32 = u32::MAX - 1;
const COPIED: u32 = u32::MAX - 2;
/// Reduce in blocks that stay in cache while every member's contribution is added.
const BLOCK: usize = 64 << 10;
/// Scratch sizes are rounded up to this, so growing tensors do not re-create it every op.
const GRAIN: usize = 1 << 20;

/// One group's scratch buffers: ours and those of the other members, by rank.
#[derive(Default)]
struct GroupScratch {
    mine: Option<Segment>,
    /// Ours is new and still linked (unlinked once every member has mapped it).
    linked: bool,
    theirs: HashMap<Rank, Segment>,
}

impl Drop for GroupScratch {
    fn drop(&mut self) {
        if let (true, Some(s)) = (self.linked, &self.mine) {
            s.unlink();
        }
    }
}

/// Scratch buffers of every group this rank all-reduced over through shared memory.
pub(crate) struct Scratch {
    rank: Rank,
    generation: u64,
    groups: Mutex<HashMap<u64, Arc<Mutex<GroupScratch>>>>,
}

/// Sends the control message `part` (the concatenation of the slices) to a member.
pub(crate) type SendFn<'a> = &'a dyn Fn(Rank, u32, &[&[u8]]) -> Result<()>;

/// How the op talks to the members: send a control message, receive one.
pub(crate) struct Wire<'a> {
    pub send: SendFn<'a>,
    pub recv: &'a dyn Fn(Rank, u32) -> Result<Vec<u8>>,
}

fn malformed(peer: Rank, msg: String) -> CommError {
    CommError::Frame {
        peer: Some(peer),
        source: FrameError::Malformed(msg),
    }
}

impl Scratch {
    pub fn new(rank: Rank, generation: u64) -> Self {
        Scratch {
            rank,
            generation,
            groups: Mutex::new(HashMap::new()),
        }
    }

    /// All-reduces `buf` over the sorted group `g` (group id `gid`). `Ok(false)`: a member had
    /// no scratch, nothing was reduced, and the caller must run another algorithm.
    pub fn all_reduce(
        &self,
        gid: u64,
        g: &[Rank],
        buf: &mut [u8],
        dtype: DType,
        wire: &Wire,
    ) -> Result<bool> {
        let gs = self
            .groups
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(gid)
            .or_default()
            .clone();
        let mut gs = gs.lock().unwrap_or_else(|p| p.into_inner());
        let created = self.ensure_mine(&mut gs, gid, buf.len());
        if let Some(mine) = &gs.mine {
            // SAFETY: our own scratch, at least `buf.len()` bytes; no member reads it before
            // our READY (and the previous op ended with everyone's COPIED).
            unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), mine.ptr(), buf.len()) };
        }
        let mut ready = Vec::with_capacity(10 + 128);
        ready.push(u8::from(gs.mine.is_some()));
        ready.push(dtype.code());
        ready.extend_from_slice(&(buf.len() as u64).to_le_bytes());
        if let Some(name) = &created {
            ready.extend_from_slice(name.as_bytes());
        }
        let others: Vec<Rank> = g.iter().copied().filter(|&p| p != self.rank).collect();
        for &p in &others {
            (wire.send)(p, READY, &[&ready])?;
        }
        let mut all_ok = gs.mine.is_some();
        for &p in &others {
            all_ok &= self.take_ready(&mut gs, p, buf.len(), dtype, wire)?;
        }
        if !all_ok {
            return Ok(false);
        }
        self.reduce_my_slice(&gs, g, buf, dtype);
        round(&others, REDUCED, wire)?;
        if gs.linked {
            gs.mine.as_ref().expect("linked implies present").unlink();
            gs.linked = false;
        }
        self.copy_other_slices(&gs, g, buf, dtype);
        round(&others, COPIED, wire)?;
        Ok(true)
    }

    /// Makes sure our scratch holds `len` bytes; returns the name of a new one.
    fn ensure_mine(&self, gs: &mut GroupScratch, gid: u64, len: usize) -> Option<String> {
        if gs.mine.as_ref().is_some_and(|s| s.len() >= len) {
            return None;
        }
        if let Some(old) = gs.mine.take() {
            old.unlink();
        }
        let size = len.div_ceil(GRAIN).max(1) * GRAIN;
        let what = format!("ar-r{}-{gid:x}", self.rank);
        match Segment::create(self.generation, &what, size) {
            Ok(s) => {
                let name = s.name().to_string();
                gs.mine = Some(s);
                gs.linked = true;
                Some(name)
            }
            Err(e) => {
                warn!(rank = self.rank, generation = self.generation, bytes = size, error = %e,
                      "no shared-memory scratch for all-reduce; this op uses the ring over the links");
                None
            }
        }
    }

    /// Reads `p`'s READY, maps its new scratch if it names one; false if `p` has none.
    fn take_ready(
        &self,
        gs: &mut GroupScratch,
        p: Rank,
        len: usize,
        dtype: DType,
        wire: &Wire,
    ) -> Result<bool> {
        let m = (wire.recv)(p, READY)?;
        if m.len() < 10 {
            return Err(malformed(
                p,
                format!("all-reduce READY of {} bytes", m.len()),
            ));
        }
        let theirs = u64::from_le_bytes(m[2..10].try_into().expect("8 bytes")) as usize;
        if theirs != len || m[1] != dtype.code() {
            return Err(malformed(
                p,
                format!(
                    "all-reduce of {theirs} bytes (dtype code {}) where rank {} has {len} bytes \
                     of {dtype:?}: members passed different tensors",
                    m[1], self.rank
                ),
            ));
        }
        if m.len() > 10 {
            let name = std::str::from_utf8(&m[10..])
                .map_err(|_| malformed(p, "scratch name is not UTF-8".into()))?;
            let seg = Segment::open(name, len).map_err(|e| CommError::Unavailable {
                what: format!("shared-memory scratch {name} of rank {p}"),
                reason: format!(
                    "{e}; ranks that share a host must share {} (set OOBLECK_COMM_SHM=0 to use TCP)",
                    super::segment::SHM_DIR
                ),
            })?;
            gs.theirs.insert(p, seg);
        }
        if m[0] == 0 {
            return Ok(false);
        }
        match gs.theirs.get(&p) {
            Some(s) if s.len() >= len => Ok(true),
            _ => Err(malformed(
                p,
                format!("all-reduce of {len} bytes without a scratch that large"),
            )),
        }
    }

    fn scratch_of<'a>(&self, gs: &'a GroupScratch, r: Rank) -> &'a Segment {
        if r == self.rank {
            gs.mine.as_ref().expect("checked in all_reduce")
        } else {
            &gs.theirs[&r]
        }
    }

    fn reduce_my_slice(&self, gs: &GroupScratch, g: &[Rank], buf: &mut [u8], dtype: DType) {
        let (a, b) = slice(g, self.rank, buf.len(), dtype);
        let mine = self.scratch_of(gs, self.rank);
        let mut at = a;
        while at < b {
            let end = (at + BLOCK).min(b);
            let acc = &mut buf[at..end];
            for (k, &r) in g.iter().enumerate() {
                // SAFETY: slice `i` of every scratch is written only by its owner before its
                // READY and never again in this op, so it is stable while we read it.
                let src = unsafe {
                    std::slice::from_raw_parts(self.scratch_of(gs, r).ptr().add(at), end - at)
                };
                if k == 0 {
                    acc.copy_from_slice(src);
                } else {
                    add_into(dtype, acc, src);
                }
            }
            // SAFETY: our own scratch's slice i, read by the others only after our REDUCED.
            unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr(), mine.ptr().add(at), end - at) };
            at = end;
        }
    }

    fn copy_other_slices(&self, gs: &GroupScratch, g: &[Rank], buf: &mut [u8], dtype: DType) {
        for &r in g.iter().filter(|&&r| r != self.rank) {
            let (a, b) = slice(g, r, buf.len(), dtype);
            let src = self.scratch_of(gs, r);
            // SAFETY: `r` finished its slice before its REDUCED and keeps it until our COPIED.
            unsafe {
                std::ptr::copy_nonoverlapping(src.ptr().add(a), buf[a..b].as_mut_ptr(), b - a)
            };
        }
    }
}

/// Byte range of member `r`'s slice (whole elements).
fn slice(g: &[Rank], r: Rank, len: usize, dtype: DType) -> (usize, usize) {
    let n = g.len();
    let k = g.iter().position(|&x| x == r).expect("member of the group");
    let (es, elems) = (dtype.size(), len / dtype.size());
    (k * elems / n * es, (k + 1) * elems / n * es)
}

/// Sends an empty `part` to every other member, then waits for theirs.
fn round(others: &[Rank], part: u32, wire: &Wire) -> Result<()> {
    for &p in others {
        (wire.send)(p, part, &[])?;
    }
    for &p in others {
        (wire.recv)(p, part)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_cover_the_tensor_in_whole_elements() {
        let g = [1, 4, 7];
        let mut end = 0;
        for &r in &g {
            let (a, b) = slice(&g, r, 40, DType::F32);
            assert_eq!(a, end);
            assert_eq!(a % 4, 0);
            end = b;
        }
        assert_eq!(end, 40);
    }
}
