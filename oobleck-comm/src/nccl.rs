//! NCCL backend (feature `nccl`), through cudarc's NCCL and driver bindings.
//!
//! ```text
//!  caller threads ──Job (host tensor, deadline)──▶ owner thread ──▶ CUDA context, stream,
//!       ▲                                              │            NCCL comm + one split
//!       └────────────── reply / Aborted ◀──────────────┘            comm per declared group
//!  abort(): sets a flag; the owner thread, which never blocks on the GPU (it polls
//!  cuStreamQuery + ncclCommGetAsyncError), calls ncclCommAbort on every comm.
//! ```
//!
//! * Every NCCL handle lives and dies on one owner thread: no handle crosses threads and
//!   nothing here is `unsafe impl Sync`.
//! * Init is non-blocking (`ncclConfig_t.blocking = 0`) and polled against a deadline, so a
//!   peer that never arrives costs a `Timeout`, not a wedged process.
//! * Subgroups are declared up front (`groups`), because `ncclCommSplit` is collective over
//!   the whole parent communicator; an operation on an undeclared group is `Invalid`.
//! * Tensors are host [`TensorBuf`]s staged through device memory. Point-to-point messages are
//!   a fixed-size metadata message then the data; NCCL matches them in order per pair, so tags
//!   must be received in the order they were sent.
//! * The CUDA driver and NCCL are probed with `dlopen` before cudarc touches them (cudarc
//!   panics when a library is missing). cudarc looks for `libnccl.so` (and `.so.1`, `.so.12`,
//!   ...), not `libnccl.so.2`, the name the PyPI wheel `nvidia-nccl-cu12` ships: link it,
//!   e.g. `ln -s $SITE/nvidia/nccl/lib/libnccl.so.2 $DIR/libnccl.so` with `$DIR` on
//!   `LD_LIBRARY_PATH`; [`probe`] says so when it sees only `libnccl.so.2`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::sys;
use tracing::warn;

use crate::comm::{normalize_group, Communicator, Rank};
use crate::error::{CommError, Op, Result};
use crate::tensor::{decode_meta, encode_meta, DType, TensorBuf};

/// Bytes of the fixed-size metadata message of a p2p send (dtype, ndim, up to 32 dims).
const META_BYTES: usize = 2 + 8 * 32;
const POLL: Duration = Duration::from_micros(50);

fn unavailable(what: &str, reason: impl Into<String>) -> CommError {
    CommError::Unavailable {
        what: what.to_string(),
        reason: reason.into(),
    }
}

/// Checks that the CUDA driver and an NCCL that cudarc can load are present, without
/// letting cudarc panic.
pub fn probe() -> Result<()> {
    // SAFETY: loading these libraries runs their initialisers, which is what using them
    // requires anyway; no symbol is called here.
    let driver = unsafe { libloading::Library::new("libcuda.so.1") };
    if let Err(e) = driver {
        return Err(unavailable("CUDA driver (libcuda.so.1)", e.to_string()));
    }
    // The name cudarc opens when it loads NCCL at run time. (Not `sys::is_culib_present`: that
    // exists only when cudarc loads dynamically, and beside candle's `cuda` feature it links.)
    // SAFETY: as above.
    if unsafe { libloading::Library::new("libnccl.so") }.is_ok() {
        return Ok(());
    }
    // SAFETY: as above.
    match unsafe { libloading::Library::new("libnccl.so.2") } {
        Ok(_) => Err(unavailable(
            "NCCL",
            "found libnccl.so.2 but cudarc loads libnccl.so: symlink libnccl.so -> libnccl.so.2 \
             in a directory on LD_LIBRARY_PATH",
        )),
        Err(e) => Err(unavailable(
            "NCCL (libnccl.so / libnccl.so.2)",
            e.to_string(),
        )),
    }
}

/// The unique id of an NCCL clique (128 bytes), made by one rank with [`NcclId::new`] and
/// distributed by the caller's control plane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclId(pub [u8; 128]);

impl NcclId {
    pub fn new() -> Result<Self> {
        probe()?;
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: `id` is a valid out-pointer; the library is present (probed above).
        let r = unsafe { sys::ncclGetUniqueId(&mut id) };
        check(r, "ncclGetUniqueId")?;
        Ok(NcclId(id.internal.map(|c| c as u8)))
    }
}

fn check(r: sys::ncclResult_t, what: &str) -> Result<()> {
    match r {
        sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
        e => Err(unavailable("NCCL", format!("{what} failed: {e:?}"))),
    }
}

fn nccl_dtype(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::I64 => sys::ncclDataType_t::ncclInt64,
    }
}

fn config() -> sys::ncclConfig_t {
    const UNDEF: i32 = i32::MIN; // NCCL_CONFIG_UNDEF_INT
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 2 * 10000 + 30 * 100,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

enum Work {
    Send {
        dst: Rank,
        tensor: TensorBuf,
    },
    Recv {
        src: Rank,
    },
    AllReduce {
        group: Vec<Rank>,
        tensor: TensorBuf,
    },
    Broadcast {
        group: Vec<Rank>,
        root: Rank,
        tensor: TensorBuf,
    },
}

struct Job {
    work: Work,
    op: Op,
    deadline: Instant,
    timeout: Duration,
    reply: Sender<Result<Option<TensorBuf>>>,
}

/// An NCCL communicator for one generation; one owner thread holds every NCCL handle.
pub struct NcclCommunicator {
    rank: Rank,
    world: usize,
    generation: u64,
    groups: Vec<Vec<Rank>>,
    jobs: Mutex<Option<Sender<Job>>>,
    aborted: Arc<AtomicBool>,
    owner: Mutex<Option<JoinHandle<()>>>,
}

impl NcclCommunicator {
    /// Joins the clique `id` as `rank` of `world` on CUDA device `device`, and splits one
    /// sub-communicator per entry of `groups` (every rank passes the same list). Fails
    /// with `Timeout` if the clique does not form within `timeout`.
    pub fn new(
        rank: Rank,
        world: usize,
        generation: u64,
        device: usize,
        id: &NcclId,
        groups: &[Vec<Rank>],
        timeout: Duration,
    ) -> Result<Self> {
        if rank >= world || i32::try_from(world).is_err() {
            return Err(CommError::Invalid(format!("rank {rank} of world {world}")));
        }
        let mut sorted = Vec::new();
        for g in groups {
            let mut g = g.clone();
            g.sort_unstable();
            g.dedup();
            if g.iter().any(|&r| r >= world) {
                return Err(CommError::Invalid(format!(
                    "group {g:?} outside world {world}"
                )));
            }
            sorted.push(g);
        }
        probe()?;
        let aborted = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<()>>();
        let setup = Setup {
            rank,
            world,
            generation,
            device,
            id: id.clone(),
            groups: sorted.clone(),
            deadline: Instant::now() + timeout,
            timeout,
        };
        let flag = aborted.clone();
        let owner = std::thread::Builder::new()
            .name(format!("nccl-owner-{rank}"))
            .spawn(move || owner_main(setup, rx, ready_tx, flag))
            .map_err(|e| CommError::io("spawn nccl owner thread", &e))?;
        let ready = ready_rx
            .recv_timeout(timeout + Duration::from_secs(5))
            .unwrap_or_else(|_| {
                aborted.store(true, Ordering::SeqCst);
                Err(CommError::Timeout {
                    op: Op::Connect,
                    after: timeout,
                    rank,
                    generation,
                    waiting_on: None,
                })
            });
        if let Err(e) = ready {
            aborted.store(true, Ordering::SeqCst);
            drop(tx);
            let _ = owner.join();
            return Err(e);
        }
        Ok(NcclCommunicator {
            rank,
            world,
            generation,
            groups: sorted,
            jobs: Mutex::new(Some(tx)),
            aborted,
            owner: Mutex::new(Some(owner)),
        })
    }

    fn aborted_err(&self) -> CommError {
        CommError::Aborted {
            rank: self.rank,
            generation: self.generation,
        }
    }

    /// Hands `work` to the owner thread and waits for it, watching the abort flag.
    fn submit(&self, op: Op, work: Work, timeout: Duration) -> Result<Option<TensorBuf>> {
        if self.aborted.load(Ordering::SeqCst) {
            return Err(self.aborted_err());
        }
        let (reply, rx) = mpsc::channel();
        let deadline = Instant::now() + timeout;
        let job = Job {
            work,
            op,
            deadline,
            timeout,
            reply,
        };
        let sent = self
            .jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|tx| tx.send(job).is_ok())
            .unwrap_or(false);
        if !sent {
            return Err(self.aborted_err());
        }
        // The owner enforces the deadline itself; the grace covers a wedged driver call.
        let hard = deadline + Duration::from_secs(5);
        loop {
            if self.aborted.load(Ordering::SeqCst) {
                return Err(self.aborted_err());
            }
            match rx.recv_timeout(Duration::from_millis(10)) {
                Ok(r) => {
                    if let Err(e) = &r {
                        if !e.is_invalid_argument() {
                            self.abort();
                        }
                    }
                    return r;
                }
                Err(RecvTimeoutError::Timeout) if Instant::now() < hard => {}
                Err(_) => {
                    self.abort();
                    return Err(CommError::Timeout {
                        op,
                        after: timeout,
                        rank: self.rank,
                        generation: self.generation,
                        waiting_on: None,
                    });
                }
            }
        }
    }

    fn check_group(&self, group: &[Rank]) -> Result<Vec<Rank>> {
        let g = normalize_group(group, self.rank, self.world)?;
        if g.len() == self.world || self.groups.contains(&g) {
            Ok(g)
        } else {
            Err(CommError::Invalid(format!(
                "group {g:?} was not declared when this NCCL communicator was made"
            )))
        }
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        self.abort();
        self.jobs.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = self.owner.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = h.join();
        }
    }
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> Rank {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn generation(&self) -> u64 {
        self.generation
    }

    fn send(&self, dst: Rank, _tag: u64, tensor: &TensorBuf, timeout: Duration) -> Result<()> {
        if dst >= self.world || dst == self.rank || tensor.shape().len() > 32 {
            return Err(CommError::Invalid(format!(
                "nccl send to rank {dst} of a {}-dim tensor",
                tensor.shape().len()
            )));
        }
        let work = Work::Send {
            dst,
            tensor: tensor.clone(),
        };
        self.submit(Op::Send, work, timeout).map(|_| ())
    }

    fn recv(&self, src: Rank, _tag: u64, timeout: Duration) -> Result<TensorBuf> {
        if src >= self.world || src == self.rank {
            return Err(CommError::Invalid(format!("nccl recv from rank {src}")));
        }
        self.submit(Op::Recv, Work::Recv { src }, timeout)?
            .ok_or_else(|| unavailable("NCCL", "recv returned no tensor"))
    }

    fn all_reduce(&self, group: &[Rank], tensor: &mut TensorBuf, timeout: Duration) -> Result<()> {
        let group = self.check_group(group)?;
        let placeholder = TensorBuf::zeros(tensor.dtype(), vec![0])?;
        let work = Work::AllReduce {
            group,
            tensor: std::mem::replace(tensor, placeholder),
        };
        *tensor = self
            .submit(Op::AllReduce, work, timeout)?
            .ok_or_else(|| unavailable("NCCL", "all_reduce returned no tensor"))?;
        Ok(())
    }

    fn broadcast(
        &self,
        group: &[Rank],
        root: Rank,
        tensor: &mut TensorBuf,
        timeout: Duration,
    ) -> Result<()> {
        let group = self.check_group(group)?;
        if group.binary_search(&root).is_err() {
            return Err(CommError::Invalid(format!("root {root} not in {group:?}")));
        }
        let placeholder = TensorBuf::zeros(tensor.dtype(), vec![0])?;
        let work = Work::Broadcast {
            group,
            root,
            tensor: std::mem::replace(tensor, placeholder),
        };
        *tensor = self
            .submit(Op::Broadcast, work, timeout)?
            .ok_or_else(|| unavailable("NCCL", "broadcast returned no tensor"))?;
        Ok(())
    }

    fn barrier(&self, group: &[Rank], timeout: Duration) -> Result<()> {
        let mut one = TensorBuf::zeros(DType::F32, vec![1])?;
        self.all_reduce(group, &mut one, timeout)
    }

    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            warn!(
                rank = self.rank,
                generation = self.generation,
                "nccl communicator aborted"
            );
        }
    }

    fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }
}

struct Setup {
    rank: Rank,
    world: usize,
    generation: u64,
    device: usize,
    id: NcclId,
    groups: Vec<Vec<Rank>>,
    deadline: Instant,
    timeout: Duration,
}

/// The NCCL state of the owner thread. Never leaves that thread (`ncclComm_t` is a raw
/// pointer, so this type is neither `Send` nor `Sync`).
struct Owner {
    rank: Rank,
    generation: u64,
    stream: Arc<CudaStream>,
    world_comm: sys::ncclComm_t,
    /// Sub-communicators by sorted group (only the groups this rank belongs to).
    subs: HashMap<Vec<Rank>, sys::ncclComm_t>,
    aborted: Arc<AtomicBool>,
    dead: bool,
}

fn owner_main(
    setup: Setup,
    jobs: Receiver<Job>,
    ready: Sender<Result<()>>,
    aborted: Arc<AtomicBool>,
) {
    let mut owner = match Owner::init(&setup, aborted) {
        Ok(o) => {
            let _ = ready.send(Ok(()));
            o
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    loop {
        match jobs.recv_timeout(Duration::from_millis(20)) {
            Ok(job) => {
                let r = owner.run(job.work, job.op, job.deadline, job.timeout);
                let _ = job.reply.send(r);
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        if owner.aborted.load(Ordering::SeqCst) && !owner.dead {
            owner.abort_all();
        }
    }
    owner.abort_all();
}

impl Owner {
    fn init(s: &Setup, aborted: Arc<AtomicBool>) -> Result<Owner> {
        let ctx = CudaContext::new(s.device)
            .map_err(|e| unavailable(&format!("CUDA device {}", s.device), e.to_string()))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| unavailable("CUDA stream", e.to_string()))?;
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        for (d, b) in id.internal.iter_mut().zip(s.id.0) {
            *d = b as std::ffi::c_char;
        }
        let mut cfg = config();
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer and config; rank/world were range-checked by the caller.
        let r = unsafe {
            sys::ncclCommInitRankConfig(&mut comm, s.world as i32, id, s.rank as i32, &mut cfg)
        };
        let mut owner = Owner {
            rank: s.rank,
            generation: s.generation,
            stream,
            world_comm: comm,
            subs: HashMap::new(),
            aborted,
            dead: false,
        };
        let fail = |owner: &mut Owner, e: CommError| {
            owner.abort_all();
            Err(e)
        };
        if let Err(e) = check(r, "ncclCommInitRankConfig") {
            return fail(&mut owner, e);
        }
        if let Err(e) = owner.wait_ready(comm, s.deadline, Op::Connect, s.timeout) {
            return fail(&mut owner, e);
        }
        for g in &s.groups {
            let member = g.binary_search(&s.rank).is_ok();
            let color = if member { 0 } else { -1 }; // NCCL_SPLIT_NOCOLOR
            let mut sub: sys::ncclComm_t = std::ptr::null_mut();
            let mut cfg = config();
            // SAFETY: `comm` is initialised; valid out-pointer and config.
            let r = unsafe { sys::ncclCommSplit(comm, color, s.rank as i32, &mut sub, &mut cfg) };
            if let Err(e) = check(r, "ncclCommSplit") {
                return fail(&mut owner, e);
            }
            if let Err(e) = owner.wait_ready(comm, s.deadline, Op::Connect, s.timeout) {
                return fail(&mut owner, e);
            }
            if member {
                if let Err(e) = owner.wait_ready(sub, s.deadline, Op::Connect, s.timeout) {
                    return fail(&mut owner, e);
                }
                owner.subs.insert(g.clone(), sub);
            }
        }
        Ok(owner)
    }

    /// Polls a communicator's async state until it is ready, failed, aborted or late.
    fn wait_ready(
        &self,
        comm: sys::ncclComm_t,
        deadline: Instant,
        op: Op,
        timeout: Duration,
    ) -> Result<()> {
        loop {
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: `comm` came from a successful (possibly in-progress) init.
            let r = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
            check(r, "ncclCommGetAsyncError")?;
            match state {
                sys::ncclResult_t::ncclSuccess => return Ok(()),
                sys::ncclResult_t::ncclInProgress => {}
                e => {
                    return Err(CommError::PeerLost {
                        rank: usize::MAX,
                        generation: self.generation,
                        reason: format!("NCCL reported {e:?}"),
                    })
                }
            }
            self.check_live(deadline, op, timeout)?;
            std::thread::sleep(POLL);
        }
    }

    fn check_live(&self, deadline: Instant, op: Op, timeout: Duration) -> Result<()> {
        if self.aborted.load(Ordering::SeqCst) {
            return Err(CommError::Aborted {
                rank: self.rank,
                generation: self.generation,
            });
        }
        if Instant::now() >= deadline {
            return Err(CommError::Timeout {
                op,
                after: timeout,
                rank: self.rank,
                generation: self.generation,
                waiting_on: None,
            });
        }
        Ok(())
    }

    /// Waits for the stream without blocking on it, watching the comm, abort and deadline.
    fn wait_stream(
        &self,
        comm: sys::ncclComm_t,
        deadline: Instant,
        op: Op,
        timeout: Duration,
    ) -> Result<()> {
        loop {
            // SAFETY: the stream belongs to this thread's context and outlives the call.
            let q = unsafe { cudarc::driver::sys::cuStreamQuery(self.stream.cu_stream()) };
            match q {
                cudarc::driver::sys::CUresult::CUDA_SUCCESS => return Ok(()),
                cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return Err(unavailable("CUDA stream", format!("{e:?}"))),
            }
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: `comm` is initialised.
            unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
            if !matches!(
                state,
                sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
            ) {
                return Err(CommError::PeerLost {
                    rank: usize::MAX,
                    generation: self.generation,
                    reason: format!("NCCL reported {state:?}"),
                });
            }
            self.check_live(deadline, op, timeout)?;
            std::thread::sleep(POLL);
        }
    }

    fn comm_for(&self, group: &[Rank], world: usize) -> sys::ncclComm_t {
        if group.len() == world {
            self.world_comm
        } else {
            *self
                .subs
                .get(group)
                .expect("group checked against the declared list")
        }
    }

    fn run(
        &mut self,
        work: Work,
        op: Op,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Option<TensorBuf>> {
        if self.dead {
            return Err(CommError::Aborted {
                rank: self.rank,
                generation: self.generation,
            });
        }
        let r = self.run_inner(work, op, deadline, timeout);
        if r.is_err() {
            self.abort_all();
        }
        r
    }

    fn staged(&self, bytes: &[u8]) -> Result<cudarc::driver::CudaSlice<u8>> {
        // A zero-length allocation is invalid in CUDA: stage at least one byte.
        let src: &[u8] = if bytes.is_empty() { &[0] } else { bytes };
        self.stream
            .clone_htod(src)
            .map_err(|e| unavailable("CUDA memcpy", e.to_string()))
    }

    fn back(&self, dev: &cudarc::driver::CudaSlice<u8>, len: usize) -> Result<Vec<u8>> {
        let mut host = vec![0u8; len.max(1)];
        self.stream
            .memcpy_dtoh(dev, &mut host)
            .map_err(|e| unavailable("CUDA memcpy", e.to_string()))?;
        host.truncate(len);
        Ok(host)
    }

    fn run_inner(
        &mut self,
        work: Work,
        op: Op,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Option<TensorBuf>> {
        let world = self.world_size_of_world_comm();
        let cu = self.stream.cu_stream() as sys::cudaStream_t;
        match work {
            Work::AllReduce { group, tensor } | Work::Broadcast { group, tensor, .. }
                if tensor.as_bytes().is_empty() =>
            {
                let _ = group;
                Ok(Some(tensor))
            }
            Work::AllReduce { group, tensor } => {
                let comm = self.comm_for(&group, world);
                let mut dev = self.staged(tensor.as_bytes())?;
                let count = tensor.elem_count();
                {
                    let (p, _sync) = dev.device_ptr_mut(&self.stream);
                    // SAFETY: `p` points to `count` elements of the dtype on this stream.
                    let r = unsafe {
                        sys::ncclAllReduce(
                            p as *const _,
                            p as *mut _,
                            count,
                            nccl_dtype(tensor.dtype()),
                            sys::ncclRedOp_t::ncclSum,
                            comm,
                            cu,
                        )
                    };
                    check(r, "ncclAllReduce")?;
                }
                self.wait_stream(comm, deadline, op, timeout)?;
                let host = self.back(&dev, tensor.as_bytes().len())?;
                TensorBuf::from_bytes(tensor.dtype(), tensor.shape().to_vec(), host).map(Some)
            }
            Work::Broadcast {
                group,
                root,
                tensor,
            } => {
                let comm = self.comm_for(&group, world);
                let root_idx = group.iter().position(|&r| r == root).expect("root checked") as i32;
                let mut dev = self.staged(tensor.as_bytes())?;
                {
                    let (p, _sync) = dev.device_ptr_mut(&self.stream);
                    // SAFETY: `p` holds the tensor's bytes on this stream.
                    let r = unsafe {
                        sys::ncclBroadcast(
                            p as *const _,
                            p as *mut _,
                            tensor.as_bytes().len(),
                            sys::ncclDataType_t::ncclUint8,
                            root_idx,
                            comm,
                            cu,
                        )
                    };
                    check(r, "ncclBroadcast")?;
                }
                self.wait_stream(comm, deadline, op, timeout)?;
                let host = self.back(&dev, tensor.as_bytes().len())?;
                TensorBuf::from_bytes(tensor.dtype(), tensor.shape().to_vec(), host).map(Some)
            }
            Work::Send { dst, tensor } => {
                let mut meta = encode_meta(&tensor)?;
                meta.resize(META_BYTES, 0);
                let m = self.staged(&meta)?;
                let d = self.staged(tensor.as_bytes())?;
                {
                    let (mp, _s1) = m.device_ptr(&self.stream);
                    // SAFETY: device buffers of the stated sizes on this stream.
                    let r = unsafe {
                        sys::ncclSend(
                            mp as *const _,
                            META_BYTES,
                            sys::ncclDataType_t::ncclUint8,
                            dst as i32,
                            self.world_comm,
                            cu,
                        )
                    };
                    check(r, "ncclSend")?;
                }
                if !tensor.as_bytes().is_empty() {
                    let (dp, _s2) = d.device_ptr(&self.stream);
                    // SAFETY: as above.
                    let r = unsafe {
                        sys::ncclSend(
                            dp as *const _,
                            tensor.as_bytes().len(),
                            sys::ncclDataType_t::ncclUint8,
                            dst as i32,
                            self.world_comm,
                            cu,
                        )
                    };
                    check(r, "ncclSend")?;
                }
                self.wait_stream(self.world_comm, deadline, op, timeout)?;
                Ok(None)
            }
            Work::Recv { src } => {
                let mut m = self.staged(&[0u8; META_BYTES])?;
                {
                    let (mp, _s) = m.device_ptr_mut(&self.stream);
                    // SAFETY: META_BYTES device bytes on this stream.
                    let r = unsafe {
                        sys::ncclRecv(
                            mp as *mut _,
                            META_BYTES,
                            sys::ncclDataType_t::ncclUint8,
                            src as i32,
                            self.world_comm,
                            cu,
                        )
                    };
                    check(r, "ncclRecv")?;
                }
                self.wait_stream(self.world_comm, deadline, op, timeout)?;
                let meta = self.back(&m, META_BYTES)?;
                let ndim = meta[1] as usize;
                let (dtype, shape, len) = decode_meta(&meta[..(2 + 8 * ndim).min(META_BYTES)])
                    .map_err(|e| CommError::PeerLost {
                        rank: src,
                        generation: self.generation,
                        reason: e,
                    })?;
                let mut d = self.staged(&vec![0u8; len])?;
                if len > 0 {
                    {
                        let (dp, _s) = d.device_ptr_mut(&self.stream);
                        // SAFETY: `len` device bytes on this stream.
                        let r = unsafe {
                            sys::ncclRecv(
                                dp as *mut _,
                                len,
                                sys::ncclDataType_t::ncclUint8,
                                src as i32,
                                self.world_comm,
                                cu,
                            )
                        };
                        check(r, "ncclRecv")?;
                    }
                    self.wait_stream(self.world_comm, deadline, op, timeout)?;
                }
                let host = self.back(&d, len)?;
                TensorBuf::from_bytes(dtype, shape, host).map(Some)
            }
        }
    }

    fn world_size_of_world_comm(&self) -> usize {
        let mut n: i32 = 0;
        // SAFETY: the world comm is initialised; `n` is a valid out-pointer.
        unsafe { sys::ncclCommCount(self.world_comm, &mut n) };
        n.max(0) as usize
    }

    /// `ncclCommAbort` on every communicator: never waits for peers.
    fn abort_all(&mut self) {
        if self.dead {
            return;
        }
        self.dead = true;
        self.aborted.store(true, Ordering::SeqCst);
        for (_, c) in self.subs.drain() {
            // SAFETY: each sub-communicator is aborted exactly once, on its owner thread.
            unsafe { sys::ncclCommAbort(c) };
        }
        if !self.world_comm.is_null() {
            // SAFETY: as above.
            unsafe { sys::ncclCommAbort(self.world_comm) };
            self.world_comm = std::ptr::null_mut();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_driver_or_nccl_is_an_error_not_a_panic() {
        match probe() {
            Ok(()) | Err(CommError::Unavailable { .. }) => {}
            Err(e) => panic!("probe must report Unavailable, got {e}"),
        }
        let id = NcclId([0; 128]);
        let r = NcclCommunicator::new(3, 2, 0, 0, &id, &[], Duration::from_secs(1));
        assert!(matches!(r, Err(CommError::Invalid(_))));
    }

    /// Exercises the FFI path end to end where a GPU and NCCL exist (the device checks);
    /// elsewhere `probe` fails first and there is nothing to run.
    #[test]
    fn single_rank_clique_reduces_broadcasts_and_aborts_where_a_gpu_exists() {
        if probe().is_err() {
            return;
        }
        let id = NcclId::new().unwrap();
        let c =
            NcclCommunicator::new(0, 1, 9, 0, &id, &[vec![0]], Duration::from_secs(60)).unwrap();
        let mut t = TensorBuf::from_f32(vec![3], &[1.0, 2.0, 3.0]).unwrap();
        c.all_reduce(&[0], &mut t, Duration::from_secs(10)).unwrap();
        assert_eq!(t.to_f32_vec().unwrap(), vec![1.0, 2.0, 3.0]);
        c.broadcast(&[0], 0, &mut t, Duration::from_secs(10))
            .unwrap();
        c.barrier(&[0], Duration::from_secs(10)).unwrap();
        c.abort();
        assert!(matches!(
            c.barrier(&[0], Duration::from_secs(1)),
            Err(CommError::Aborted { .. })
        ));
    }
}
