//! The in-place all-reduce of tensors from `Communicator::alloc` (see `allreduce.rs` for the
//! protocol around it): the other members' tensor segments, mapped once per group, and the
//! reduce that sums this member's slice of every tensor and writes it into all of them.

use std::collections::HashMap;

use tracing::warn;

use super::allreduce::{slice, Wire};
use super::segment::Segment;
use crate::comm::Rank;
use crate::error::Result;
use crate::tensor::{add_into, TensorBuf};

/// Part number of the message that says whether a member mapped every other member's tensor.
const TENSORS: u32 = u32::MAX - 3;
/// Bytes summed per pass (stays in L1/L2 while it is copied to the members), and how often the
/// failure checks run.
const PASS: usize = 64 << 10;
const CHECK_EVERY: usize = 4 << 20;
/// Other members' tensors kept mapped per group and member, in number and bytes (least
/// recently used go first; a mapping pins its memory even after its owner dropped it).
const MAPS: usize = 64;
const MAP_BYTES: usize = 2 << 30;

/// The other members' shared tensors, by rank: (segment name, mapping), oldest use first.
#[derive(Default)]
pub(super) struct TensorMaps(HashMap<Rank, Vec<(String, Segment)>>);

impl TensorMaps {
    /// Maps (or finds mapped) every other member's tensor, in `others` order, and tells the
    /// members whether that worked (TENSORS); `None` unless it did on every member. The
    /// pointers stay valid while `self` is neither dropped nor asked again. `fail`: the test
    /// hook that makes a new mapping fail.
    pub fn map_all(
        &mut self,
        rank: Rank,
        fail: bool,
        others: &[Rank],
        names: &[String],
        len: usize,
        wire: &Wire,
    ) -> Result<Option<Vec<*mut u8>>> {
        let mut ptrs = Vec::with_capacity(others.len());
        for (&p, name) in others.iter().zip(names) {
            match self.get(p, name, len, fail) {
                Ok(ptr) => ptrs.push(ptr),
                Err(e) => warn!(rank, peer = p, name = %name, error = %e,
                                "cannot map a member's shared tensor; this all-reduce goes through scratch"),
            }
        }
        let ok = ptrs.len() == others.len();
        for &p in others {
            (wire.send)(p, TENSORS, &[&[u8::from(ok)]])?;
        }
        let mut all_ok = ok;
        for &p in others {
            all_ok &= (wire.recv)(p, TENSORS)?.first() == Some(&1);
        }
        Ok(all_ok.then_some(ptrs))
    }

    /// The mapping of member `p`'s tensor segment `name`, from the cache or mapped now.
    fn get(&mut self, p: Rank, name: &str, len: usize, fail: bool) -> std::io::Result<*mut u8> {
        let maps = self.0.entry(p).or_default();
        let seg = match maps.iter().position(|(n, _)| n == name) {
            Some(i) => {
                let hit = maps.remove(i);
                maps.push(hit);
                &maps.last().expect("just pushed").1
            }
            None => {
                if fail {
                    return Err(std::io::Error::from_raw_os_error(libc::ENOMEM));
                }
                let seg = Segment::open(name, len)?;
                let mut bytes: usize = maps.iter().map(|(_, s)| s.len()).sum::<usize>() + seg.len();
                while !maps.is_empty() && (maps.len() >= MAPS || bytes > MAP_BYTES) {
                    bytes -= maps.remove(0).1.len();
                }
                maps.push((name.to_string(), seg));
                &maps.last().expect("just pushed").1
            }
        };
        if seg.len() < len {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("segment {name} has {} bytes, the tensor {len}", seg.len()),
            ));
        }
        Ok(seg.ptr())
    }
}

/// Sums slice i of every member's tensor into ours, in group order, and copies the sum into
/// theirs (`theirs`: the others' mappings, in `others` order).
pub(super) fn reduce(
    rank: Rank,
    g: &[Rank],
    tensor: &mut TensorBuf,
    theirs: &[*mut u8],
    others: &[Rank],
    wire: &Wire,
) -> Result<()> {
    let dtype = tensor.dtype();
    let bytes = tensor.as_bytes_mut();
    let (a, b) = slice(g, rank, bytes.len(), dtype);
    // Only our slice is touched through `acc`; the members write theirs into the same
    // mapping meanwhile, so no slice of the whole tensor is held across the loop.
    let mine = bytes.as_mut_ptr();
    let pass = PASS / dtype.size() * dtype.size();
    for x in (a..b).step_by(pass) {
        let y = (x + pass).min(b);
        if (x - a) % CHECK_EVERY < pass {
            others.iter().try_for_each(|&p| (wire.check)(p))?;
        }
        // SAFETY: bytes x..y of our slice, which only this rank reads or writes during the op,
        // in our mapping and in every member's (all at least `len` bytes long).
        let acc = unsafe { std::slice::from_raw_parts_mut(mine.add(x), y - x) };
        for &t in theirs {
            add_into(dtype, acc, unsafe {
                std::slice::from_raw_parts(t.add(x), y - x)
            });
        }
        for &t in theirs {
            // SAFETY: as above.
            unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr(), t.add(x), y - x) };
        }
    }
    Ok(())
}
