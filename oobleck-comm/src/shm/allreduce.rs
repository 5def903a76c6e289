//! All-reduce among ranks of one host. In place when every member's tensor is in shared
//! memory (`Communicator::alloc`): each member sums its slice of all the tensors and writes the
//! sum into all of them. Otherwise through shared scratch buffers, pipelined in chunks small
//! enough to stay in cache: each byte is read from the caller's tensor once, reduced once by the
//! rank that owns its slice, and written back once.
//!
//! ```text
//!   member i of n; slice j of a tensor (or of a chunk) = its j-th n-th (whole elements)
//!   READY ─▶ every member (state, dtype, length, the scratch's name when new, the shared
//!   tensor's name if any); counters were reset. When any READY named a new scratch:
//!   MAPPED{ok} ─▶ every member, once each tried to map the new ones (then the new scratch
//!   files are unlinked)
//!   every member named a tensor: each maps the others' (kept per group), TENSORS{ok} ─▶ every
//!     member; all ok: add slice i of every other member's tensor to my slice i, copy the sum
//!     into theirs (no member touches another's slice, so no waits until the end)
//!   else, the tensor in chunks of CHUNK bytes, chunk k in slot k%2 of every scratch:
//!     a. wait until every member consumed chunk k-2 (slot k%2 is free again)
//!     b. copy chunk k but my own slice into my slot; filled = k+1
//!     c. wait for every member's filled > k; add slice i of every other member's slot, in
//!        group order, to my tensor's slice i; copy it into my slot; reduced = k+1
//!     d. wait for every member's reduced > k; copy slice j from member j's slot; consumed = k+1
//!   COPIED ─▶ every member; wait for theirs (nobody returns, and reuses its tensor or resets a
//!   counter, while another still reads or writes it)
//! ```
//!
//! Counters live in the owner's scratch header and are waited on by spin, then futex naps;
//! every nap re-checks abort, the peer's failure (its TCP connection) and the op's deadline,
//! so a dead member fails the op with `PeerLost` and a stopped one with `Timeout`. Each slice
//! is summed by one rank in one order (its own part first, then the others' in group order) and
//! copied to the others: results are bit-identical on every member and from run to run (the two
//! paths cut the tensor into slices differently, so their sums may differ in the last bits). A
//! member that cannot allocate its scratch (full tmpfs) says so in READY and every member falls
//! back to the engine's ring all-reduce for that op (the next one tries again). A member that
//! cannot map another's scratch says so in MAPPED (and as BROKEN in every later READY): every
//! member then runs the ring for this op and every later one of the group. A member that
//! cannot map another's tensor says so in TENSORS and the op goes through scratch. All members
//! see the same messages, so they always take the same path.

use std::collections::HashMap;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::warn;

use super::in_place::{self, TensorMaps};
use super::segment::{futex_wait, futex_wake, Segment};
use crate::comm::Rank;
use crate::error::{CommError, FrameError, Result};
use crate::tcp::ShmFaults;
use crate::tensor::{add_into, DType, TensorBuf};

/// Part numbers of the control messages; the engine's ring parts never get this high.
pub(crate) const READY: u32 = u32::MAX;
const MAPPED: u32 = u32::MAX - 1;
const COPIED: u32 = u32::MAX - 2;
// u32::MAX - 3: TENSORS (`in_place.rs`).
/// READY states: no scratch this time; ready; never again (a scratch would not map).
const NONE: u8 = 0;
const OK: u8 = 1;
const BROKEN: u8 = 2;
/// Bytes of one pipelined chunk (a multiple of every element size): two slots of it per rank
/// stay in cache while the members reduce and copy it. At 1 MiB, 4 ranks' slots alone filled
/// a whole 8 MiB L3 and were written back to memory between copy-in and reduce; at 256 KiB
/// the 64 MiB all-reduce's bus bandwidth went 2.31 -> 3.30 GB/s (2 processes) and 1.43 ->
/// 2.20 (4 processes) on the 2-core test machine (128 KiB: more waits, 2.0 and 1.9).
const CHUNK: usize = 256 << 10;
/// Scratch header: the owner's counters, one cache line each.
const HEADER: usize = 4096;
const FILLED: usize = 0;
const REDUCED_AT: usize = 64;
const CONSUMED: usize = 128;
const SCRATCH_LEN: usize = HEADER + 2 * CHUNK;
const SPINS: u32 = 32;
const NAP: Duration = Duration::from_millis(2);

/// One group's scratch buffers: ours and those of the other members, by rank.
#[derive(Default)]
struct GroupScratch {
    mine: Option<Segment>,
    /// Ours is new and still linked (unlinked once every member has mapped it).
    linked: bool,
    theirs: HashMap<Rank, Segment>,
    /// We could not map a member's scratch: this group never uses shared scratch again.
    broken: bool,
    /// Every member knows some member is broken: skip straight to the ring.
    off: bool,
    /// The other members' shared tensors this group all-reduced in place.
    tensors: TensorMaps,
}

/// What the READY exchange settled.
struct Agreed {
    /// Every member is ready to use its scratch.
    scratch: bool,
    /// Every member passed a shared tensor: the others' names, in group order.
    tensors: Option<Vec<String>>,
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
    /// Test hooks: mapping another member's scratch or tensor fails.
    faults: ShmFaults,
    completed: std::sync::atomic::AtomicU64,
    in_place: std::sync::atomic::AtomicU64,
}

/// Sends the control message `part` (the concatenation of the slices) to a member.
pub(crate) type SendFn<'a> = &'a dyn Fn(Rank, u32, &[&[u8]]) -> Result<()>;

/// How the op talks to the members: send a control message, receive one.
pub(crate) struct Wire<'a> {
    pub send: SendFn<'a>,
    pub recv: &'a dyn Fn(Rank, u32) -> Result<Vec<u8>>,
    /// Asked between naps while waiting on a member: abort, its failure, the deadline.
    pub check: &'a dyn Fn(Rank) -> Result<()>,
}

fn malformed(peer: Rank, msg: String) -> CommError {
    CommError::Frame {
        peer: Some(peer),
        source: FrameError::Malformed(msg),
    }
}

impl Scratch {
    pub fn new(rank: Rank, generation: u64, faults: ShmFaults) -> Self {
        Scratch {
            rank,
            generation,
            groups: Mutex::new(HashMap::new()),
            faults,
            completed: Default::default(),
            in_place: Default::default(),
        }
    }

    /// All-reduces that ran through shared memory (scratch or in place).
    pub fn completed(&self) -> u64 {
        self.completed.load(SeqCst)
    }

    /// All-reduces that ran in place on the members' shared tensors.
    pub fn completed_in_place(&self) -> u64 {
        self.in_place.load(SeqCst)
    }

    /// All-reduces `tensor` over the sorted group `g` (group id `gid`). `Ok(false)`: a member
    /// had no scratch and not every member a shared tensor, nothing was reduced, and the
    /// caller must run another algorithm.
    pub fn all_reduce(
        &self,
        gid: u64,
        g: &[Rank],
        tensor: &mut TensorBuf,
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
        if gs.off {
            return Ok(false);
        }
        let others: Vec<Rank> = g.iter().copied().filter(|&p| p != self.rank).collect();
        let (dtype, len) = (tensor.dtype(), tensor.as_bytes().len());
        let agreed = self.agree(&mut gs, gid, &others, tensor, wire)?;
        let theirs = match &agreed.tensors {
            Some(names) => {
                let fail = self.faults.map_tensor;
                gs.tensors
                    .map_all(self.rank, fail, &others, names, len, wire)?
            }
            None => None,
        };
        if let Some(theirs) = theirs {
            in_place::reduce(self.rank, g, tensor, &theirs, &others, wire)?;
            self.in_place.fetch_add(1, SeqCst);
        } else if agreed.scratch {
            self.chunks(&gs, g, &others, tensor.as_bytes_mut(), dtype, wire)?;
        } else {
            return Ok(false);
        }
        round(&others, COPIED, wire)?;
        self.completed.fetch_add(1, SeqCst);
        Ok(true)
    }

    /// The READY (and MAPPED) exchange over `tensor`'s dtype, length and shared segment.
    fn agree(
        &self,
        gs: &mut GroupScratch,
        gid: u64,
        others: &[Rank],
        tensor: &TensorBuf,
        wire: &Wire,
    ) -> Result<Agreed> {
        let (dtype, len) = (tensor.dtype(), tensor.as_bytes().len());
        let tensor = tensor.shared_name();
        let created = self.ensure_mine(gs, gid);
        if let Some(mine) = &gs.mine {
            // Nobody reads them now: the previous op ended with everyone's COPIED, and this
            // one's reads start after our READY.
            for c in [FILLED, REDUCED_AT, CONSUMED] {
                mine.atomic_u32(c).store(0, SeqCst);
            }
        }
        let state = match (gs.broken, gs.mine.is_some()) {
            (true, _) => BROKEN,
            (false, true) => OK,
            (false, false) => NONE,
        };
        let scratch_name = created.as_deref().unwrap_or("");
        let mut ready = Vec::with_capacity(11 + 256);
        ready.push(state);
        ready.push(dtype.code());
        ready.extend_from_slice(&(len as u64).to_le_bytes());
        // Segment names are at most 128 bytes (`segment::valid_name`).
        ready.push(scratch_name.len() as u8);
        ready.extend_from_slice(scratch_name.as_bytes());
        ready.extend_from_slice(tensor.unwrap_or("").as_bytes());
        for &p in others {
            (wire.send)(p, READY, &[&ready])?;
        }
        let (mut all_ok, mut any_new, mut any_broken) =
            (state == OK, created.is_some(), state == BROKEN);
        let mut names = tensor.map(|_| Vec::with_capacity(others.len()));
        for &p in others {
            let r = self.take_ready(gs, p, len, dtype, wire)?;
            all_ok &= r.state == OK;
            any_new |= r.new_scratch;
            any_broken |= r.state == BROKEN;
            names = names.zip(r.tensor).map(|(mut v, n)| {
                v.push(n);
                v
            });
        }
        if any_new {
            // Every member saw the same names, so all of them run this round.
            for &p in others {
                (wire.send)(p, MAPPED, &[&[u8::from(!gs.broken)]])?;
            }
            all_ok &= !gs.broken;
            for &p in others {
                let m = (wire.recv)(p, MAPPED)?;
                all_ok &= m.first() == Some(&1);
                any_broken |= m.first() != Some(&1);
            }
            any_broken |= gs.broken;
            if gs.linked {
                // Every member has tried to map it; nobody opens it by name again.
                gs.mine.as_ref().expect("linked implies present").unlink();
                gs.linked = false;
            }
        }
        if any_broken {
            warn!(
                rank = self.rank,
                generation = self.generation,
                "a member cannot map the shared scratch; this group all-reduces over the ring"
            );
            gs.off = true;
        }
        Ok(Agreed {
            scratch: all_ok && !any_broken,
            tensors: names,
        })
    }

    /// Steps a to d of the module docs for every chunk of `buf`.
    fn chunks(
        &self,
        gs: &GroupScratch,
        g: &[Rank],
        others: &[Rank],
        buf: &mut [u8],
        dtype: DType,
        wire: &Wire,
    ) -> Result<()> {
        let mine = self.scratch_of(gs, self.rank);
        let publish = |counter: usize, v: u32| {
            mine.atomic_u32(counter).store(v, SeqCst);
            futex_wake(mine.atomic_u32(counter));
        };
        let wait = |counter: usize, at_least: u32| -> Result<()> {
            for &p in others {
                wait_for(self.scratch_of(gs, p), counter, at_least, || {
                    (wire.check)(p)
                })?;
            }
            Ok(())
        };
        for (k, chunk) in buf.chunks_mut(CHUNK).enumerate() {
            let k32 = k as u32;
            let slot = HEADER + (k % 2) * CHUNK;
            if k >= 2 {
                wait(CONSUMED, k32 - 1)?;
            }
            // Our own slice is summed from the tensor itself (step c): the others only.
            let (a, b) = slice(g, self.rank, chunk.len(), dtype);
            for (from, to) in [(0, a), (b, chunk.len())] {
                // SAFETY: our own slot, free since every member consumed chunk k-2 (or fresh).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        chunk.as_ptr().add(from),
                        mine.ptr().add(slot + from),
                        to - from,
                    )
                };
            }
            publish(FILLED, k32 + 1);
            wait(FILLED, k32 + 1)?;
            self.reduce_my_slice(gs, g, slot, &mut chunk[a..b], a, dtype);
            publish(REDUCED_AT, k32 + 1);
            wait(REDUCED_AT, k32 + 1)?;
            self.copy_other_slices(gs, g, slot, chunk, dtype);
            publish(CONSUMED, k32 + 1);
        }
        Ok(())
    }

    /// Makes sure we have a scratch for this group; returns the name of a new one.
    fn ensure_mine(&self, gs: &mut GroupScratch, gid: u64) -> Option<String> {
        if gs.mine.is_some() {
            return None;
        }
        let what = format!("ar-r{}-{gid:x}", self.rank);
        match Segment::create(self.generation, &what, SCRATCH_LEN) {
            Ok(s) => {
                let name = s.name().to_string();
                gs.mine = Some(s);
                gs.linked = true;
                Some(name)
            }
            Err(e) => {
                warn!(rank = self.rank, generation = self.generation, bytes = SCRATCH_LEN, error = %e,
                      "no shared-memory scratch for all-reduce; this op uses the ring over the links");
                None
            }
        }
    }

    /// Reads `p`'s READY and maps its new scratch if it names one (a failure marks us broken).
    fn take_ready(
        &self,
        gs: &mut GroupScratch,
        p: Rank,
        len: usize,
        dtype: DType,
        wire: &Wire,
    ) -> Result<Ready> {
        let m = (wire.recv)(p, READY)?;
        let sl = m.get(10).map_or(0, |&l| l as usize);
        if m.len() < 11 + sl || m[0] > BROKEN {
            return Err(malformed(
                p,
                format!(
                    "all-reduce READY of {} bytes, state {:?}",
                    m.len(),
                    m.first()
                ),
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
        let (scratch, tensor) = (text(p, &m[11..11 + sl])?, text(p, &m[11 + sl..])?);
        if !scratch.is_empty() {
            match self.map(scratch) {
                Ok(seg) => {
                    gs.theirs.insert(p, seg);
                }
                Err(e) => {
                    warn!(rank = self.rank, peer = p, name = scratch, error = %e,
                          "cannot map a member's shared-memory scratch; the group uses the ring");
                    gs.broken = true;
                }
            }
        }
        if m[0] == OK && !gs.broken && !gs.theirs.contains_key(&p) {
            return Err(malformed(p, "all-reduce without a scratch".into()));
        }
        Ok(Ready {
            state: m[0],
            new_scratch: !scratch.is_empty(),
            tensor: (!tensor.is_empty()).then(|| tensor.to_string()),
        })
    }

    fn map(&self, name: &str) -> std::io::Result<Segment> {
        if self.faults.map_scratch {
            return Err(std::io::Error::from_raw_os_error(libc::ENOMEM));
        }
        Segment::open(name, SCRATCH_LEN)
    }

    fn scratch_of<'a>(&self, gs: &'a GroupScratch, r: Rank) -> &'a Segment {
        if r == self.rank {
            gs.mine.as_ref().expect("checked in all_reduce")
        } else {
            &gs.theirs[&r]
        }
    }

    /// Adds slice i (bytes `a..a + acc.len()` of the chunk) of every other member's `slot`
    /// to `acc`, our tensor's slice i, and copies the sum into our slot.
    fn reduce_my_slice(
        &self,
        gs: &GroupScratch,
        g: &[Rank],
        slot: usize,
        acc: &mut [u8],
        a: usize,
        dtype: DType,
    ) {
        let b = a + acc.len();
        for &r in g.iter().filter(|&&r| r != self.rank) {
            // SAFETY: every member wrote its slot before its `filled` and does not touch our
            // slice of it again in this chunk.
            let src = unsafe {
                std::slice::from_raw_parts(self.scratch_of(gs, r).ptr().add(slot + a), b - a)
            };
            add_into(dtype, acc, src);
        }
        let mine = self.scratch_of(gs, self.rank);
        // SAFETY: our slot's slice i, read by the others only after our `reduced`.
        unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr(), mine.ptr().add(slot + a), b - a) };
    }

    fn copy_other_slices(
        &self,
        gs: &GroupScratch,
        g: &[Rank],
        slot: usize,
        chunk: &mut [u8],
        dtype: DType,
    ) {
        for &r in g.iter().filter(|&&r| r != self.rank) {
            let (a, b) = slice(g, r, chunk.len(), dtype);
            let src = self.scratch_of(gs, r);
            // SAFETY: `r` finished its slice before its `reduced` and keeps the slot until our
            // `consumed`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.ptr().add(slot + a),
                    chunk[a..b].as_mut_ptr(),
                    b - a,
                )
            };
        }
    }
}

/// A segment name from member `p`'s READY.
fn text(p: Rank, b: &[u8]) -> Result<&str> {
    std::str::from_utf8(b).map_err(|_| malformed(p, "segment name is not UTF-8".into()))
}

/// One member's READY.
struct Ready {
    state: u8,
    new_scratch: bool,
    tensor: Option<String>,
}

/// Waits until the counter at `counter` in `seg` reaches `at_least`.
fn wait_for(
    seg: &Segment,
    counter: usize,
    at_least: u32,
    check: impl Fn() -> Result<()>,
) -> Result<()> {
    let word = seg.atomic_u32(counter);
    for _ in 0..SPINS {
        if word.load(SeqCst) >= at_least {
            return Ok(());
        }
        std::hint::spin_loop();
    }
    loop {
        let v = word.load(SeqCst);
        if v >= at_least {
            return Ok(());
        }
        check()?;
        futex_wait(word, v, NAP);
    }
}

/// Byte range of member `r`'s slice (whole elements).
pub(super) fn slice(g: &[Rank], r: Rank, len: usize, dtype: DType) -> (usize, usize) {
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
