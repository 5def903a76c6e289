//! Keeping freed memory for the next step's tensors.
//!
//! A training step allocates and frees the same large tensors every time (activations of
//! 16 MiB and more, gradients, the optimizer's scratch). glibc's malloc serves each allocation
//! above its mmap threshold with a fresh `mmap` and returns it with `munmap` when freed, so
//! every step pays the kernel to fault in and zero every page again: on the 2-core benchmark
//! (`oobleck bench train`) a fifth of the CPU time went to `clear_page` and page-fault
//! handling, most of it inside the matrix multiplies and element-wise kernels.
//!
//! [`retain_freed_memory`] tells malloc to take large blocks from the heap instead and to
//! keep freed memory rather than trim it, so the second step reuses the first step's pages.
//! The resident size then stays at the step's peak instead of falling between steps; a worker
//! reaches that peak every step anyway.

/// Makes malloc reuse freed memory across steps (see the module docs). Returns whether the
/// settings took (glibc on Linux only; elsewhere it does nothing and returns false). Call it
/// once, early, in a process that computes (a worker, a benchmark); settings in the
/// environment (`MALLOC_MMAP_MAX_`, `MALLOC_TRIM_THRESHOLD_`, `MALLOC_TOP_PAD_`) win.
pub fn retain_freed_memory() -> bool {
    imp::retain_freed_memory()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod imp {
    /// Heap growth per `brk`: one step's fresh tensors in few system calls.
    const TOP_PAD: libc::c_int = 256 << 20;
    /// Never give the heap's top back to the system (the next step needs it again).
    const TRIM_THRESHOLD: libc::c_int = libc::c_int::MAX;

    pub(super) fn retain_freed_memory() -> bool {
        let set_by_env = [
            "MALLOC_MMAP_MAX_",
            "MALLOC_TRIM_THRESHOLD_",
            "MALLOC_TOP_PAD_",
        ]
        .iter()
        .any(|v| std::env::var_os(v).is_some());
        if set_by_env {
            return false;
        }
        // SAFETY: mallopt only changes malloc's tunables; it is called before this process
        // allocates anything large, and glibc serialises it with allocations.
        unsafe {
            libc::mallopt(libc::M_MMAP_MAX, 0) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
                && libc::mallopt(libc::M_TOP_PAD, TOP_PAD) == 1
        }
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
mod imp {
    pub(super) fn retain_freed_memory() -> bool {
        false
    }
}
