//! The C allocator's settings for a training process.
//!
//! A training step allocates and frees the same large buffers every step (activations,
//! gradients, the optimizer's temporaries). glibc's malloc serves blocks above its mmap
//! threshold (128 KiB, raised on the fly up to 32 MiB) with fresh `mmap`s and gives freed
//! memory at the top of its heaps back to the kernel (above 128 KiB), so each step faults
//! every such page in again, zeroed by the kernel. Measured with `oobleck bench train` (the
//! issue's 6 x 512 GPT, 2 cores): 4.0 M minor faults in 7 steps and 15 s of system time
//! against 29 s of user time; with the settings below 1.3 M faults, 5.8 s of system time, and
//! 595 tokens/s instead of 452, at the same peak resident memory (the freed memory is kept
//! for the next step, not added to the peak).

/// The mmap threshold glibc allows at most on 64-bit targets (`HEAP_MAX_SIZE / 2`).
pub const MMAP_THRESHOLD: usize = 32 << 20;

/// Keeps freed memory for reuse: a fixed 32 MiB mmap threshold (blocks below it come from
/// the heap and are reused) and a trim threshold of 2 GiB (freed memory stays mapped).
/// Called by [`super::take_over`], so every agent and worker and the user's own process get
/// it; does nothing when the user set glibc's own knobs (`GLIBC_TUNABLES`, `MALLOC_*_`), or
/// off Linux with glibc. Returns whether it changed the settings.
pub fn tune_allocator() -> bool {
    let user_set = std::env::vars_os().any(|(k, _)| {
        let k = k.to_string_lossy();
        k == "GLIBC_TUNABLES" || (k.starts_with("MALLOC_") && k.ends_with('_'))
    });
    !user_set && set_thresholds()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_thresholds() -> bool {
    // SAFETY: mallopt only changes malloc's parameters; it takes malloc's own lock, so it is
    // safe to call at any time from any thread.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX) == 1
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_thresholds() -> bool {
    false
}

/// Blocks of at least this many bytes are kept by [`TrainingAlloc`] when freed.
pub const LARGE_BLOCK: usize = MMAP_THRESHOLD;
/// At most this many bytes of freed large blocks are kept, in at most [`CACHED_BLOCKS`].
pub const CACHE_BYTES: usize = 2 << 30;
/// Slots of the cache.
pub const CACHED_BLOCKS: usize = 16;

/// The global allocator of a training binary: the system allocator, except that freed blocks
/// of at least [`LARGE_BLOCK`] bytes (above glibc's largest mmap threshold, so each is a
/// fresh mapping every time: the logits, the LM head's and the embedding's gradients) are
/// kept and handed out again for a request of the same size, without faulting their pages in
/// again. Install it in the binary:
///
/// ```ignore
/// #[global_allocator]
/// static ALLOC: oobleck_core::runtime::TrainingAlloc = oobleck_core::runtime::TrainingAlloc;
/// ```
///
/// Every block it hands out is the system allocator's own, so `realloc` and `dealloc` of any
/// block stay valid there. A zeroed request served from the cache is zeroed with `memset`
/// (cheaper than the page faults of a fresh mapping, which the kernel zeroes too).
pub struct TrainingAlloc;

/// The kept blocks: `(bytes, address, when kept)`, bytes 0 for a free slot. A fixed array
/// under a `Mutex` (futex-based, allocation-free): the allocator must not allocate.
struct Cache {
    slots: [(usize, usize, u64); CACHED_BLOCKS],
    bytes: usize,
    clock: u64,
}

static CACHE: std::sync::Mutex<Cache> = std::sync::Mutex::new(Cache::new());

impl Cache {
    const fn new() -> Cache {
        Cache {
            slots: [(0, 0, 0); CACHED_BLOCKS],
            bytes: 0,
            clock: 0,
        }
    }

    /// A kept block of exactly `size` bytes, taken out of the cache.
    fn take(&mut self, size: usize) -> Option<*mut u8> {
        let slot = self.slots.iter_mut().find(|s| s.0 == size)?;
        let ptr = slot.1 as *mut u8;
        *slot = (0, 0, 0);
        self.bytes -= size;
        Some(ptr)
    }

    /// Keeps `ptr` of `size` bytes, first giving the longest-kept blocks to `free` until it
    /// fits (sizes no longer asked for do not stay forever); false (nothing kept, nothing
    /// freed) when `size` alone is over [`CACHE_BYTES`].
    fn keep(&mut self, ptr: *mut u8, size: usize, mut free: impl FnMut(*mut u8, usize)) -> bool {
        if size > CACHE_BYTES {
            return false;
        }
        while self.bytes + size > CACHE_BYTES || self.slots.iter().all(|s| s.0 != 0) {
            let oldest = self
                .slots
                .iter_mut()
                .filter(|s| s.0 != 0)
                .min_by_key(|s| s.2)
                .expect("a full cache has a kept block");
            free(oldest.1 as *mut u8, oldest.0);
            self.bytes -= oldest.0;
            *oldest = (0, 0, 0);
        }
        self.clock += 1;
        let slot = self.slots.iter_mut().find(|s| s.0 == 0).expect("room made");
        *slot = (size, ptr as usize, self.clock);
        self.bytes += size;
        true
    }
}

fn cacheable(layout: std::alloc::Layout) -> bool {
    layout.size() >= LARGE_BLOCK && layout.align() <= 16
}

fn cache() -> std::sync::MutexGuard<'static, Cache> {
    CACHE.lock().unwrap_or_else(|p| p.into_inner())
}

// SAFETY: every block comes from `System` (kept blocks too: they were `System`'s and are
// handed out once), with the size and alignment asked for: kept blocks are reused only for
// the same size, and `cacheable` limits them to alignments `System`'s malloc always gives.
unsafe impl std::alloc::GlobalAlloc for TrainingAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        if cacheable(layout) {
            if let Some(p) = cache().take(layout.size()) {
                return p;
            }
        }
        std::alloc::System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        if cacheable(layout) {
            if let Some(p) = cache().take(layout.size()) {
                p.write_bytes(0, layout.size());
                return p;
            }
        }
        std::alloc::System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // Evicted blocks go back to `System` under the cache's lock (free never calls us).
        let free = |p: *mut u8, size: usize| {
            std::alloc::System.dealloc(p, std::alloc::Layout::from_size_align_unchecked(size, 16))
        };
        if cacheable(layout) && cache().keep(ptr, layout.size(), free) {
            return;
        }
        std::alloc::System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new: usize) -> *mut u8 {
        std::alloc::System.realloc(ptr, layout, new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Minor page faults of the calling thread so far.
    #[cfg(target_os = "linux")]
    fn thread_faults() -> i64 {
        // SAFETY: getrusage writes one `rusage` into the zeroed struct we own.
        unsafe {
            let mut u: libc::rusage = std::mem::zeroed();
            assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut u), 0);
            u.ru_minflt
        }
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn a_freed_large_block_is_reused_without_faulting_its_pages_again() {
        assert!(set_thresholds());
        let len = 16 << 20;
        let touch = |v: Vec<u8>| std::hint::black_box(v).len();
        touch(vec![1u8; len]);
        let before = thread_faults();
        touch(vec![2u8; len]);
        let faults = thread_faults() - before;
        // Under glibc's defaults the second block is a fresh mapping: 4096 faults of 4 KiB.
        assert!(
            faults < 256,
            "{faults} page faults for a reused 16 MiB block"
        );
    }

    #[test]
    fn a_freed_large_block_is_handed_out_again_for_the_same_size_zeroed_if_asked() {
        use std::alloc::{GlobalAlloc, Layout};
        // A size no other test asks for, so the shared cache's other users cannot take it.
        let layout = Layout::from_size_align(LARGE_BLOCK + 4096 * 7, 8).unwrap();
        let other = Layout::from_size_align(LARGE_BLOCK + 4096 * 9, 8).unwrap();
        let a = TrainingAlloc;
        // SAFETY: each block is used within its layout and freed once with it.
        unsafe {
            let p = a.alloc(layout);
            assert!(!p.is_null());
            p.write_bytes(7, layout.size());
            a.dealloc(p, layout);
            let q = a.alloc_zeroed(layout);
            assert_eq!(q, p, "the kept block is reused");
            assert!(std::slice::from_raw_parts(q, layout.size())
                .iter()
                .all(|&b| b == 0));
            let r = a.alloc(other);
            assert_ne!(r, q, "another size is a new block");
            a.dealloc(r, other);
            a.dealloc(q, layout);
            // Small blocks are the system allocator's business alone.
            let small = Layout::from_size_align(4096, 8).unwrap();
            let s = a.alloc(small);
            a.dealloc(s, small);
        }
    }

    #[test]
    fn the_cache_keeps_at_most_its_bytes_and_slots_evicting_the_longest_kept() {
        let mut c = Cache::new();
        let mut freed = Vec::new();
        let big = CACHE_BYTES / 2 + 1;
        assert!(c.keep(0x1000 as *mut u8, big, |p, n| freed.push((p as usize, n))));
        assert!(c.keep(0x2000 as *mut u8, big, |p, n| freed.push((p as usize, n))));
        assert_eq!(
            freed,
            vec![(0x1000, big)],
            "over CACHE_BYTES: the first one goes"
        );
        assert_eq!(c.take(big), Some(0x2000 as *mut u8));
        assert_eq!(c.take(big), None);
        assert_eq!(c.bytes, 0);
        assert!(!c.keep(0x3000 as *mut u8, CACHE_BYTES + 1, |_, _| panic!(
            "nothing to free"
        )));
        freed.clear();
        for i in 0..=CACHED_BLOCKS {
            let p = (0x1000 * (i + 1)) as *mut u8;
            assert!(c.keep(p, LARGE_BLOCK + i, |p, n| freed.push((p as usize, n))));
        }
        assert_eq!(
            freed,
            vec![(0x1000, LARGE_BLOCK)],
            "every slot taken: the oldest goes"
        );
        assert_eq!(c.take(LARGE_BLOCK), None);
        assert_eq!(c.take(LARGE_BLOCK + 1), Some(0x2000 as *mut u8));
    }
}
