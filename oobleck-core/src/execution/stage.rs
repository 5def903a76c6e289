//! One rank's stage: [`StageRunner`] holds the stage's layers and its place in the layout,
//! exchanges rows with its neighbour devices, and runs iterations and whole steps.
//!
//! `run_iteration` builds an `Iteration` (`stage/iteration.rs`: the call's state, with one
//! handler per instruction of `schedule::device_stream`: `recv_activation`, `forward`,
//! `send_activation`, `recv_gradient`, `backward`, `send_gradient`) and dispatches to it. The
//! last backward goes through `backward_last` when this rank has buckets to all-reduce: it
//! starts a scoped thread (`reduce_buckets`) and runs the backward layer by layer
//! (`StageRunner::backward_overlapped`), handing over each bucket once its layers are done (why
//! that cannot deadlock: `sync.rs`'s header). `finish` joins the thread and builds the
//! [`IterationOutput`]. `train_step` is a whole step: the iteration, `sync_gradients`, AdamW.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use oobleck_comm::{Communicator, Rank};
use tracing::debug_span;

use super::layout::{Layout, Position};
use super::progress::{Doing, Mark, Progress};
use super::sync::{sync_with, IterationOutput, SyncCtx, SyncReport};
use super::{buf_to_tensor, tensor_to_buf};
use crate::model::{LayeredModel, ParamSource, Stage, TiedParam};
use crate::optim::AdamW;
use crate::schedule::{device_stream, DeviceInstruction, Instruction, PeerRows, Schedule};
use crate::{Error, Result};

mod iteration;

use iteration::Iteration;

/// Settings a stage runner needs beyond the layout.
#[derive(Debug, Clone, Copy)]
pub struct StageConfig {
    /// Keys dropout: `(seed, iteration, global microbatch, layer)`.
    pub seed: u64,
    /// `b`: samples per microbatch. A stage of `g` devices gives each `schedule::rows(b, g, d)`.
    pub microbatch_size: u32,
    /// Bound of every send, receive and collective.
    pub timeout: Duration,
    /// Most gradient elements one bucket all-reduce carries (a single larger layer still goes
    /// alone); smaller buckets start sooner during the last backward. `sync::BUCKET_ELEMS` is
    /// the default. Every holder of a layer must use the same value.
    pub bucket_elems: usize,
    /// Compute dtype of the forward and backward passes ([`ForwardCtx::dtype`]): `F32`, or
    /// `BF16` for mixed precision; parameters, gradients and optimizer state stay f32.
    pub dtype: DType,
    /// Activation recomputation: keep only each layer's input per microbatch in flight and
    /// rerun the layer in its backward ([`Stage::forward_recompute`]); about one more forward
    /// of compute for a fraction of the activation memory. Same values either way.
    pub recompute: bool,
    /// The pipeline schedule: 1F1B, or ZB-H1 (each backward split into B and a later W,
    /// `model::weight_grads`). Same values either way; every stage of a pipeline must agree.
    pub schedule: Schedule,
}

/// Sums every gradient of `out` with the other holders of the same parameters, computes the
/// global norm and, with `max_grad_norm`, clips like `optim::clip_grad_norm` on the whole model
/// (`sync.rs`, on what [`StageRunner::sync_ctx`] gives it). Returns the synchronised gradients
/// of this rank's parameters.
pub fn sync_gradients(
    runner: &StageRunner,
    comm: &dyn Communicator,
    out: IterationOutput,
    max_grad_norm: Option<f64>,
) -> Result<(HashMap<String, Tensor>, SyncReport)> {
    sync_with(&runner.sync_ctx(), comm, out, max_grad_norm)
}

/// A rank's stage of one pipeline, with its place in the layout.
pub struct StageRunner {
    stage: Stage,
    rank: Rank,
    pos: Position,
    layout: Layout,
    tied: Vec<TiedParam>,
    /// Devices per stage of this pipeline, for `schedule::device_stream`.
    devices: Vec<u32>,
    /// This device's instruction stream, the same every iteration (`schedule::device_stream`).
    stream: Vec<DeviceInstruction>,
    prev: Vec<Rank>,
    next: Vec<Rank>,
    first_mb: u32,
    total_mb: u32,
    device: Device,
    cfg: StageConfig,
    /// Where its microbatches' compute is marked for a watchdog (`progress`), if anywhere.
    progress: Option<Arc<Progress>>,
}

impl StageRunner {
    /// Builds the layers `rank` holds in `layout` on `device`.
    pub fn new(
        model: &dyn LayeredModel,
        layout: &Layout,
        rank: Rank,
        device: &Device,
        source: ParamSource<'_>,
        cfg: StageConfig,
    ) -> Result<Self> {
        if layout.num_layers() != model.num_layers() {
            return Err(Error::LayoutDepth {
                layout_layers: layout.num_layers(),
                model_layers: model.num_layers(),
            });
        }
        let pos = layout
            .position(rank)
            .ok_or(Error::RankNotInLayout { rank })?;
        let pipe = &layout.pipelines()[pos.pipeline];
        let devices: Vec<u32> = pipe.stages.iter().map(|s| s.ranks.len() as u32).collect();
        if let Some(stage) = devices.iter().position(|&g| g > cfg.microbatch_size) {
            return Err(Error::StageTooWide {
                pipeline: pos.pipeline,
                stage,
                devices: devices[stage] as usize,
                microbatch_size: cfg.microbatch_size,
            });
        }
        let spec = layout.stage(pos);
        let stage = Stage::new(model.build_layers(spec.layers.clone(), device, source)?)?;
        let num_stages = pipe.stages.len();
        let num_mb = pipe.microbatches.end - pipe.microbatches.start;
        let stream = device_stream(
            cfg.schedule,
            pos.stage,
            &devices,
            pos.device as u32,
            cfg.microbatch_size,
            num_mb,
        );
        Ok(Self {
            stage,
            rank,
            pos,
            layout: layout.clone(),
            tied: model.tied_params(),
            devices,
            stream,
            prev: if pos.stage > 0 {
                pipe.stages[pos.stage - 1].ranks.clone()
            } else {
                Vec::new()
            },
            next: if pos.stage + 1 < num_stages {
                pipe.stages[pos.stage + 1].ranks.clone()
            } else {
                Vec::new()
            },
            first_mb: pipe.microbatches.start,
            total_mb: layout.total_microbatches(),
            device: device.clone(),
            cfg,
            progress: None,
        })
    }

    /// Marks the compute of every microbatch in `progress` from now on (the data plane's
    /// operations are marked by a [`super::Watched`] communicator).
    pub fn watch(&mut self, progress: Arc<Progress>) {
        self.progress = Some(progress);
    }

    fn mark(&self, doing: Doing) -> Option<Mark<'_>> {
        self.progress.as_ref().map(|p| p.enter(doing))
    }

    pub fn stage(&self) -> &Stage {
        &self.stage
    }

    pub fn rank(&self) -> Rank {
        self.rank
    }

    pub fn position(&self) -> Position {
        self.pos
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Where this stage computes (its parameters live there).
    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn config(&self) -> &StageConfig {
        &self.cfg
    }

    /// Parameters by name (a tied parameter held twice in this stage appears once).
    pub fn params(&self) -> Vec<(String, candle_core::Var)> {
        self.stage.params()
    }

    fn is_first(&self) -> bool {
        self.pos.stage == 0
    }

    fn is_last(&self) -> bool {
        self.pos.stage + 1 == self.devices.len()
    }

    /// Runs iteration `iteration`: every microbatch of this pipeline forward and backward in
    /// the order of its schedule (1F1B, or ZB-H1), on this device's rows of each microbatch. `data(iteration,
    /// global_microbatch)` gives the whole microbatch `(token ids, targets)`, both `[b, t]`
    /// u32; it is called only on the first stage (for the inputs) and the last stage (for the
    /// targets). Each instruction goes to its handler on `Iteration`.
    pub fn run_iteration(
        &self,
        comm: &dyn Communicator,
        iteration: u64,
        data: &mut dyn FnMut(u64, u64) -> Result<(Tensor, Tensor)>,
    ) -> Result<IterationOutput> {
        let _span = debug_span!(
            "iteration",
            rank = self.rank,
            iteration,
            pipeline = self.pos.pipeline,
            stage = self.pos.stage,
            device = self.pos.device
        )
        .entered();
        let stream = &self.stream;
        std::thread::scope(|scope| -> Result<IterationOutput> {
            let mut it = Iteration::new(self, comm, iteration, stream);
            for (at, di) in stream.iter().enumerate() {
                let peers = di.peers.as_slice();
                match di.instruction {
                    Instruction::RecvActivation { mb } => it.recv_activation(mb, peers)?,
                    Instruction::Forward { mb } => it.forward(mb, data)?,
                    Instruction::SendActivation { mb } => it.send_activation(mb, peers)?,
                    Instruction::RecvGradient { mb } => it.recv_gradient(mb, peers)?,
                    Instruction::Backward { mb } => it.backward(scope, at, mb)?,
                    Instruction::SendGradient { mb } => it.send_gradient(mb, peers)?,
                    Instruction::BackwardInput { mb } => it.backward_input(mb)?,
                    Instruction::BackwardWeight { mb } => it.backward_weight(scope, at, mb)?,
                }
            }
            it.finish()
        })
    }

    /// One full training step of this rank: the 1F1B iteration, gradient sync and clipping,
    /// then AdamW at learning rate `lr` on this rank's parameters. Every replica of a
    /// parameter receives the same summed gradient, so all replicas stay identical.
    pub fn train_step(
        &self,
        comm: &dyn Communicator,
        iteration: u64,
        data: &mut dyn FnMut(u64, u64) -> Result<(Tensor, Tensor)>,
        opt: &mut AdamW,
        lr: f64,
        max_grad_norm: Option<f64>,
    ) -> Result<SyncReport> {
        let out = self.run_iteration(comm, iteration, data)?;
        let (grads, report) = sync_gradients(self, comm, out, max_grad_norm)?;
        let params: Vec<(String, Var)> = self.stage.params();
        opt.step(&params, &grads, lr)?;
        Ok(report)
    }

    /// What the gradient sync (`sync.rs`) needs of this stage.
    pub(super) fn sync_ctx(&self) -> SyncCtx<'_> {
        SyncCtx {
            rank: self.rank,
            layout: &self.layout,
            range: self.stage.range(),
            layers: self.stage.layers(),
            tied: &self.tied,
            timeout: self.cfg.timeout,
            bucket_elems: self.cfg.bucket_elems,
        }
    }

    /// Receives the overlapping rows from each neighbour device and stacks them in row order.
    fn recv_rows(
        &self,
        comm: &dyn Communicator,
        ranks: &[Rank],
        peers: &[PeerRows],
        tag: u64,
    ) -> Result<Tensor> {
        let mut parts = Vec::with_capacity(peers.len());
        for p in peers {
            let src = *ranks
                .get(p.device as usize)
                .ok_or_else(|| self.no_neighbour(p.device))?;
            let buf = comm.recv(src, tag, self.cfg.timeout)?;
            let part = buf_to_tensor(&buf, &self.device)?;
            if part.dims().first() != Some(&((p.end - p.start) as usize)) {
                return Err(Error::Shape {
                    what: format!("the rows rank {src} sent"),
                    found: part.dims().to_vec(),
                    expected: format!("{} rows", p.end - p.start),
                });
            }
            parts.push(part);
        }
        match parts.len() {
            0 => Err(self.broken("a receive with no peers (a broken schedule)".into())),
            1 => Ok(parts.pop().expect("one part")),
            _ => Ok(Tensor::cat(&parts, 0)?),
        }
    }

    /// An invariant of this stage's schedule or gradient sync that does not hold.
    fn broken(&self, reason: String) -> Error {
        Error::Schedule {
            layers: self.stage.range(),
            reason,
        }
    }

    /// What the 1F1B stream needed for microbatch `mb` and did not have.
    fn missing(&self, what: &str, mb: u32) -> Error {
        self.broken(format!(
            "1F1B stream: {what} of microbatch {mb} missing (a broken schedule)"
        ))
    }

    fn no_neighbour(&self, device: u32) -> Error {
        self.broken(format!(
            "neighbour device {device} is not in the layout (a broken schedule)"
        ))
    }

    /// Sends each neighbour device the rows it handles out of this device's rows `[lo, ..)`.
    fn send_rows(
        &self,
        comm: &dyn Communicator,
        ranks: &[Rank],
        peers: &[PeerRows],
        lo: u32,
        t: &Tensor,
        tag: u64,
    ) -> Result<()> {
        for p in peers {
            let dst = *ranks
                .get(p.device as usize)
                .ok_or_else(|| self.no_neighbour(p.device))?;
            let part = t.narrow(0, (p.start - lo) as usize, (p.end - p.start) as usize)?;
            comm.send(dst, tag, &tensor_to_buf(&part)?, self.cfg.timeout)?;
        }
        Ok(())
    }
}
