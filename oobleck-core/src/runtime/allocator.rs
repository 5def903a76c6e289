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
}
