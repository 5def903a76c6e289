//! How much memory a job may use on this machine: the planner's `cpu` device is a share of it
//! (the table's 16 GiB is a laptop's, not this machine's), and the profiler measures within it.
//!
//! What this process may really use is the smallest of three bounds: the kernel's estimate of
//! what can be allocated without swapping (`MemAvailable` in `/proc/meminfo`, or `MemTotal`
//! on kernels without it), the memory limit of its cgroup (v2 `memory.max`, v1
//! `memory.limit_in_bytes`; a container's), and its address-space limit (`ulimit -v`,
//! `RLIMIT_AS`). The first two bound the machine, which the ranks of a local cluster share;
//! the last bounds each process, which every worker inherits. Reading them is here; choosing
//! among them is [`HostMemory::from_sources`], pure, so its tests are tables of texts.

/// The fraction of a bound a job plans on, in percent: room for the master, the agents and
/// the allocator's slack, as the planner's device table keeps 92% of each device's memory
/// for the runtime's context and fragmentation.
pub const USABLE_PERCENT: u64 = 92;

/// Limits at or above this are "no limit" (cgroup v1 writes 2^63 rounded down to a page).
const UNLIMITED: u64 = 1 << 60;

/// What bounds the memory of a job here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryBound {
    /// `MemAvailable` in `/proc/meminfo`.
    Available,
    /// `MemTotal` in `/proc/meminfo` (a kernel without `MemAvailable`).
    Total,
    /// The memory limit of this process's cgroup.
    Cgroup,
    /// `ulimit -v` (`RLIMIT_AS`), per process.
    AddressSpace,
    /// `--host-memory` (or `OOBLECK_HOST_MEMORY`).
    Given,
}

impl MemoryBound {
    /// Where the number comes from, for messages.
    pub fn words(self) -> &'static str {
        match self {
            MemoryBound::Available => "MemAvailable in /proc/meminfo",
            MemoryBound::Total => "MemTotal in /proc/meminfo",
            MemoryBound::Cgroup => "this process's cgroup memory limit",
            MemoryBound::AddressSpace => "ulimit -v",
            MemoryBound::Given => "--host-memory",
        }
    }
}

/// The memory a job may use on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostMemory {
    /// Bytes of the machine (or its cgroup) that every process of the job shares.
    pub shared_bytes: u64,
    /// Bytes each process may map (`ulimit -v`), if limited.
    pub process_bytes: Option<u64>,
    /// What bounds `shared_bytes` (`AddressSpace` only when nothing else is known).
    pub bound: MemoryBound,
}

impl HostMemory {
    /// This machine's, read now; `None` where none of the sources can be read (not Linux).
    pub fn of_this_machine() -> Option<HostMemory> {
        let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
        let cgroup = cgroup_limit_text();
        HostMemory::from_sources(meminfo.as_deref(), cgroup.as_deref(), address_space_limit())
    }

    /// `bytes` given by the user: the machine's, shared by the job's processes.
    pub fn given(bytes: u64) -> HostMemory {
        HostMemory {
            shared_bytes: bytes,
            process_bytes: None,
            bound: MemoryBound::Given,
        }
    }

    /// The smallest of the bounds found in the texts of `/proc/meminfo` and of the cgroup's
    /// limit file (`max`, or bytes) and the address-space limit; `None` when none bounds.
    pub fn from_sources(
        meminfo: Option<&str>,
        cgroup_limit: Option<&str>,
        address_space: Option<u64>,
    ) -> Option<HostMemory> {
        let field = |name: &str| -> Option<u64> {
            let line = meminfo?.lines().find(|l| l.starts_with(name))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib.saturating_mul(1024))
        };
        let machine = match (field("MemAvailable:"), field("MemTotal:")) {
            (Some(b), _) => Some((b, MemoryBound::Available)),
            (None, Some(b)) => Some((b, MemoryBound::Total)),
            (None, None) => None,
        };
        let cgroup = cgroup_limit
            .and_then(|t| t.trim().parse::<u64>().ok())
            .filter(|&b| b < UNLIMITED)
            .map(|b| (b, MemoryBound::Cgroup));
        let shared = [machine, cgroup].into_iter().flatten().min_by_key(|s| s.0);
        let process_bytes = address_space.filter(|&b| b < UNLIMITED);
        let (shared_bytes, bound) = match (shared, process_bytes) {
            (Some(s), _) => s,
            (None, Some(b)) => (b, MemoryBound::AddressSpace),
            (None, None) => return None,
        };
        Some(HostMemory {
            shared_bytes,
            process_bytes,
            bound,
        })
    }

    /// The bytes one of `ranks` processes sharing this machine may plan on: its equal share
    /// of the machine, within its own address-space limit, [`USABLE_PERCENT`] of either.
    pub fn per_rank(&self, ranks: usize) -> u64 {
        let share = self.shared_bytes / ranks.max(1) as u64;
        let bytes = self.process_bytes.map_or(share, |p| p.min(share));
        bytes / 100 * USABLE_PERCENT
    }

    /// What bounds [`HostMemory::per_rank`] for `ranks` processes: the per-process limit when
    /// it is below their share of the machine, else the machine's bound.
    pub fn bound_for(&self, ranks: usize) -> MemoryBound {
        let share = self.shared_bytes / ranks.max(1) as u64;
        match self.process_bytes {
            Some(p) if p < share => MemoryBound::AddressSpace,
            _ => self.bound,
        }
    }

    /// `5.4 GiB each of 4 processes: 23.5 GiB (MemAvailable in /proc/meminfo) less 8% slack,
    /// shared`, in words, for a message about `ranks` processes.
    pub fn describe(&self, ranks: usize) -> String {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let slack = 100 - USABLE_PERCENT;
        match (self.bound_for(ranks), self.process_bytes) {
            (MemoryBound::AddressSpace, Some(p)) => format!(
                "{:.1} GiB per process: {:.1} GiB ({}) less {slack}% slack",
                gib(self.per_rank(ranks)),
                gib(p),
                MemoryBound::AddressSpace.words()
            ),
            (bound, _) if ranks > 1 => format!(
                "{:.1} GiB each of {ranks} processes: {:.1} GiB ({}) less {slack}% slack, shared",
                gib(self.per_rank(ranks)),
                gib(self.shared_bytes),
                bound.words()
            ),
            (bound, _) => format!(
                "{:.1} GiB: {:.1} GiB ({}) less {slack}% slack",
                gib(self.per_rank(ranks)),
                gib(self.shared_bytes),
                bound.words()
            ),
        }
    }
}

/// The text of this process's cgroup memory limit, if it has one: cgroup v2 `memory.max` of
/// its own group (from `/proc/self/cgroup`) or the mounted root's (a container's), else v1's
/// `memory.limit_in_bytes`.
fn cgroup_limit_text() -> Option<String> {
    let own = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("0::").map(str::to_string))
        })
        .map(|path| format!("/sys/fs/cgroup{}/memory.max", path.trim_end_matches('/')));
    let candidates = own.into_iter().chain([
        "/sys/fs/cgroup/memory.max".to_string(),
        "/sys/fs/cgroup/memory/memory.limit_in_bytes".to_string(),
    ]);
    candidates
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .find(|t| t.trim() != "max")
}

/// `RLIMIT_AS` of this process, bytes; `None` when unlimited or unknown.
fn address_space_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` through a pointer to a live, owned value.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) };
    (rc == 0 && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MEMINFO: &str = "MemTotal:       24683772 kB\nMemFree:         8589212 kB\n\
                           MemAvailable:   23587472 kB\nBuffers:           41572 kB\n";

    #[test]
    fn the_smallest_bound_wins_and_is_named() {
        let m = HostMemory::from_sources(Some(MEMINFO), Some("max\n"), None).expect("meminfo");
        assert_eq!(m.shared_bytes, 23_587_472 * 1024);
        assert_eq!(m.bound, MemoryBound::Available);
        let m = HostMemory::from_sources(Some(MEMINFO), Some("8589934592\n"), None).expect("cg");
        assert_eq!((m.shared_bytes, m.bound), (8 * GIB, MemoryBound::Cgroup));
        // cgroup v1's "no limit" is a huge number.
        let m = HostMemory::from_sources(Some(MEMINFO), Some("9223372036854771712"), None)
            .expect("v1 unlimited");
        assert_eq!(m.bound, MemoryBound::Available);
        let m = HostMemory::from_sources(Some("MemTotal: 1024 kB\n"), None, None).expect("old");
        assert_eq!((m.shared_bytes, m.bound), (1 << 20, MemoryBound::Total));
        assert_eq!(HostMemory::from_sources(None, None, None), None);
        let m = HostMemory::from_sources(None, None, Some(4 * GIB)).expect("ulimit -v alone");
        assert_eq!(
            (m.shared_bytes, m.bound),
            (4 * GIB, MemoryBound::AddressSpace)
        );
    }

    #[test]
    fn ranks_share_the_machine_but_each_process_has_its_own_address_space() {
        let m = HostMemory::from_sources(Some(MEMINFO), None, Some(8 * GIB)).expect("both");
        // One process: ulimit -v is below the machine.
        assert_eq!(m.per_rank(1), 8 * GIB / 100 * 92);
        assert_eq!(m.bound_for(1), MemoryBound::AddressSpace);
        // Four processes: each has 8 GiB of address space but a quarter of 22.5 GiB.
        assert_eq!(m.per_rank(4), 23_587_472 * 1024 / 4 / 100 * 92);
        assert_eq!(m.bound_for(4), MemoryBound::Available);
        let words = m.describe(4);
        assert!(
            words.starts_with("5.2 GiB each of 4 processes: 22.5 GiB (MemAvailable"),
            "{words}"
        );
        assert!(m.describe(1).contains("(ulimit -v)"), "{}", m.describe(1));
    }

    #[test]
    fn given_memory_is_shared_and_named_for_its_flag() {
        let m = HostMemory::given(4 * GIB);
        assert_eq!(m.per_rank(2), 2 * GIB / 100 * 92);
        assert!(
            m.describe(1).contains("(--host-memory)"),
            "{}",
            m.describe(1)
        );
    }
}
