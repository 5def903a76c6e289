//! Where a generation's state comes from: initialisation, a checkpoint fetched from the
//! master, or, in place, what the worker holds plus the layers its peers send; and the test
//! hooks that fail a worker at exact points of that.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use oobleck_comm::Communicator;

use super::state::{exchange, CopyHooks, CopyStats, Held};
use super::{not_formed, protocol, FormError, DATA_TIMEOUT};
use crate::checkpoint::load_checkpoint;
use crate::runtime::error::{Context, Result, RuntimeError};
use crate::runtime::net::resolve;
use crate::runtime::wire::pipe::{StateSource, WorkerAssignment};

/// A test hook for failures at exact points: `OOBLECK_TEST_KILL=POINT:GENERATION:NODE:STEP`
/// makes the worker of `NODE` SIGKILL itself at `POINT` (`sync`: before the gradient sync of
/// step `STEP`; `copy`: in the layer copies at committed step `STEP`, after its first layer;
/// `connect`, with `STEP` 0: in the rendezvous, 200 ms after it got its peers' addresses, so
/// they are connecting to it; `deploy`, with `STEP` 0: as it starts the generation, before
/// it binds its port, so the rendezvous has not gone out) of generation `GENERATION`. Real failure injection: the process dies by the signal, as
/// when a machine goes.
pub const TEST_KILL_ENV: &str = "OOBLECK_TEST_KILL";

/// Dies here if [`TEST_KILL_ENV`] says so.
pub(super) fn test_kill_point(point: &str, a: &WorkerAssignment, step: u64) {
    let Ok(spec) = std::env::var(TEST_KILL_ENV) else {
        return;
    };
    let want = format!("{point}:{}:{}:{step}", a.generation, a.node);
    if spec.split(',').any(|s| s.trim() == want) {
        if point == "connect" {
            std::thread::sleep(Duration::from_millis(200));
        }
        eprintln!("oobleck worker: {TEST_KILL_ENV}={want}: SIGKILL");
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &std::process::id().to_string()])
            .status();
        std::thread::sleep(Duration::from_secs(5));
    }
}

/// A test hook: `OOBLECK_TEST_CORRUPT=GENERATION:NODE` makes the worker of `NODE` flip a bit
/// of the first layer it sends in generation `GENERATION`'s copies, after its checksum.
pub const TEST_CORRUPT_ENV: &str = "OOBLECK_TEST_CORRUPT";

fn test_corrupt(a: &WorkerAssignment) -> bool {
    std::env::var(TEST_CORRUPT_ENV)
        .is_ok_and(|s| s.trim() == format!("{}:{}", a.generation, a.node))
}

/// The state a generation's stage is built from.
pub(super) struct Loaded {
    /// The stage's parameters by name; `None` at step 0 of a fresh job: the workload's own
    /// ([`crate::runtime::Workload::initial_params`], pretrained weights or a seeded init).
    pub params: Option<HashMap<String, Tensor>>,
    pub optimizer: Vec<(String, Tensor)>,
    pub step: u64,
}

/// The state of this rank's `stage` (its layers), from where the assignment says. In place,
/// the layers it lacks arrive from their holders; on failure it keeps only what it held.
pub(super) fn load(
    a: &WorkerAssignment,
    comm: &dyn Communicator,
    stage: &BTreeSet<usize>,
    mut held: Held,
) -> std::result::Result<(Loaded, CopyStats), FormError> {
    let rank = a.rank;
    match &a.source {
        StateSource::Init => Ok((
            Loaded {
                params: None,
                optimizer: Vec::new(),
                step: 0,
            },
            CopyStats::default(),
        )),
        StateSource::Checkpoint { path } => {
            let ck = fetch_checkpoint(a, path).map_err(|e| not_formed(e, Held::nothing(0)))?;
            let loaded = Loaded {
                params: Some(ck.params.into_iter().collect()),
                optimizer: ck.optimizer,
                step: ck.trainer.step,
            };
            Ok((loaded, CopyStats::default()))
        }
        StateSource::Peers { step, copies, .. } => {
            if held.layers.is_empty() {
                held.step = *step;
            }
            if held.step != *step {
                let e = protocol(
                    rank,
                    format!(
                        "the plan resumes at step {step}, but this worker holds step {}",
                        held.step
                    ),
                );
                return Err(not_formed(e, held));
            }
            let before = held.layer_list();
            let hooks = CopyHooks {
                after_first: || test_kill_point("copy", a, *step),
                corrupt_next_send: test_corrupt(a),
            };
            let copied = match exchange(comm, rank, &mut held, copies, DATA_TIMEOUT, hooks) {
                Ok(c) => c,
                Err(e) => {
                    held.layers.retain(|l, _| before.contains(l));
                    return Err(not_formed(e, held));
                }
            };
            let (params, optimizer) = match held.tensors_of(stage, rank) {
                Ok(t) => t,
                Err(e) => {
                    held.layers.retain(|l, _| before.contains(l));
                    return Err(not_formed(e, held));
                }
            };
            let loaded = Loaded {
                params: Some(params),
                optimizer,
                step: *step,
            };
            Ok((loaded, copied))
        }
    }
}

/// How long fetching a checkpoint from the master may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(600);

/// Loads checkpoint `path` (a directory on the master's machine). One inside the run
/// directory is fetched over the network into a directory of this worker's own, so workers need
/// no shared file system; one outside it (a `--resume` from elsewhere) must be readable here.
fn fetch_checkpoint(a: &WorkerAssignment, path: &Path) -> Result<crate::checkpoint::Checkpoint> {
    let rank = a.rank;
    let Some(name) = path.strip_prefix(&a.run_dir).ok().and_then(|p| p.to_str()) else {
        return load_checkpoint(path, &Device::Cpu).with_ctx(|| {
            format!(
                "rank {rank}: loading {} (outside the run directory, so it is read from this \
                 machine's disk)",
                path.display()
            )
        });
    };
    let local = tempfile::Builder::new()
        .prefix("oobleck-checkpoint-")
        .tempdir()
        .ctx("a directory for the fetched checkpoint")?;
    let dir = local.path().join(path.file_name().unwrap_or_default());
    std::fs::create_dir_all(&dir).map_err(|source| RuntimeError::Io {
        path: dir.clone(),
        source,
    })?;
    let sink = resolve(&a.state_sink)?;
    let started = Instant::now();
    let bytes =
        oobleck_comm::fetch_dir(sink, &a.state_key, name, &dir, FETCH_TIMEOUT).with_ctx(|| {
            format!("rank {rank}: fetching checkpoint {name} from the master at {sink}")
        })?;
    tracing::info!(
        rank,
        checkpoint = name,
        mb = bytes as f64 / 1e6,
        secs = started.elapsed().as_secs_f64(),
        "fetched the checkpoint"
    );
    load_checkpoint(&dir, &Device::Cpu)
        .with_ctx(|| format!("rank {rank}: loading checkpoint {name} fetched from the master"))
}
