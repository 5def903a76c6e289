//! Tensors that live in shared memory: what `Communicator::alloc` hands out on a rank whose
//! group shares its host, so that the all-reduce reads and writes every member's tensor in
//! place (`allreduce.rs`, "in place") instead of copying it through scratch and back.
//!
//! ```text
//!   alloc ──▶ a free segment of the same size from the pool (zeroed), else a new one
//!             (`oobleck-<pid>-g<generation>-t-r<rank>-<nonce>`, linked while it is in use)
//!   all-reduce ──▶ its name travels in READY; the members map it once and keep the mapping
//!   drop ──▶ back to the pool, name and all, so the members' mappings stay good for the next
//!            step's buffer of the same size ──▶ unlinked when the pool is full, closed
//!            (abort) or dropped with the communicator
//! ```
//!
//! A buffer's file stays linked while it is in use (a member that joins a group later must
//! still be able to map it); a killed process's files are removed by the next creator on the
//! host ([`super::remove_stale`]), as for every segment.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tracing::warn;

use super::segment::Segment;

/// Free segments the pool keeps, at most, in number and in bytes.
const POOL_MAX: usize = 256;
const POOL_MAX_BYTES: usize = 2 << 30;
const PAGE: usize = 4096;

/// The bytes of a tensor in a shared segment (the first `len` bytes of it).
pub(crate) struct SharedBytes {
    seg: Option<Segment>,
    len: usize,
    pool: Weak<Pool>,
}

impl std::fmt::Debug for SharedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedBytes({} bytes in {:?})", self.len, self.seg)
    }
}

impl SharedBytes {
    fn seg(&self) -> &Segment {
        self.seg.as_ref().expect("present until drop")
    }

    /// The segment's file name, for the members to map.
    pub fn name(&self) -> &str {
        self.seg().name()
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes inside the mapping, which lives as long as `self`. Other
        // processes write into it only inside an all-reduce, which holds `&mut` of the tensor.
        unsafe { std::slice::from_raw_parts(self.seg().ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as for `as_slice`; `&mut self` is the only handle of this process.
        unsafe { std::slice::from_raw_parts_mut(self.seg().ptr(), self.len) }
    }
}

impl Drop for SharedBytes {
    fn drop(&mut self) {
        let seg = self.seg.take().expect("present until drop");
        match self.pool.upgrade() {
            Some(pool) => pool.give_back(seg),
            None => seg.unlink(),
        }
    }
}

/// One communicator's shared tensor segments that are not in use.
pub(crate) struct Pool {
    rank: usize,
    generation: u64,
    /// `None` once closed: every segment given back from then on is unlinked.
    free: Mutex<Option<Vec<Segment>>>,
    /// A failed allocation was reported (once per communicator, not once per step).
    warned: AtomicBool,
}

impl Pool {
    pub fn new(rank: usize, generation: u64) -> Arc<Pool> {
        Arc::new(Pool {
            rank,
            generation,
            free: Mutex::new(Some(Vec::new())),
            warned: AtomicBool::new(false),
        })
    }

    /// A zero-filled shared buffer of `len > 0` bytes; `None` (with a warning) where no
    /// segment can be had (a full `/dev/shm`) or the pool is closed.
    pub fn alloc(self: &Arc<Self>, len: usize) -> Option<SharedBytes> {
        let cap = len.div_ceil(PAGE).max(1) * PAGE;
        let reused = {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            let free = free.as_mut()?;
            free.iter()
                .position(|s| s.len() == cap)
                .map(|i| free.swap_remove(i))
        };
        let seg = match reused {
            Some(s) => {
                // SAFETY: a free segment: no handle of this process uses it, and the members
                // touch it only inside an all-reduce of a buffer that holds it.
                unsafe { std::ptr::write_bytes(s.ptr(), 0, len) };
                s
            }
            None => match Segment::create(self.generation, &format!("t-r{}", self.rank), cap) {
                Ok(s) => s,
                Err(e) => {
                    if !self.warned.swap(true, Ordering::Relaxed) {
                        warn!(rank = self.rank, generation = self.generation, bytes = cap, error = %e,
                              "no shared memory for a tensor (is /dev/shm small or full?); such \
                               tensors live on the heap and all-reduce through scratch, which is \
                               slower (said once)");
                    }
                    return None;
                }
            },
        };
        Some(SharedBytes {
            seg: Some(seg),
            len,
            pool: Arc::downgrade(self),
        })
    }

    fn give_back(&self, seg: Segment) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        match free.as_mut() {
            Some(f)
                if f.len() < POOL_MAX
                    && f.iter().map(Segment::len).sum::<usize>() + seg.len() <= POOL_MAX_BYTES =>
            {
                f.push(seg)
            }
            _ => seg.unlink(),
        }
    }

    /// Unlinks every free segment and every one given back from now on (abort).
    pub fn close(&self) {
        let free = self.free.lock().unwrap_or_else(|p| p.into_inner()).take();
        for s in free.into_iter().flatten() {
            s.unlink();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_buffer_comes_back_zeroed_under_its_name_and_goes_when_closed() {
        let pool = Pool::new(0, 91);
        let mut a = pool.alloc(10_000).unwrap();
        assert_eq!(a.as_slice(), &[0u8; 10_000][..]);
        a.as_mut_slice().fill(7);
        let name = a.name().to_string();
        drop(a);
        let b = pool.alloc(9_000).unwrap();
        assert_eq!(b.name(), name, "same page count: the same segment");
        assert!(b.as_slice().iter().all(|&x| x == 0));
        let c = pool.alloc(100_000).unwrap();
        assert_ne!(c.name(), name);
        let path = std::path::Path::new(super::super::SHM_DIR).join(&name);
        drop(b);
        assert!(path.exists(), "kept in the pool");
        pool.close();
        assert!(!path.exists(), "closing unlinks the free ones");
        let c_path = std::path::Path::new(super::super::SHM_DIR).join(c.name());
        drop(c);
        assert!(!c_path.exists(), "given back after close: unlinked");
        assert!(pool.alloc(10).is_none());
    }
}
