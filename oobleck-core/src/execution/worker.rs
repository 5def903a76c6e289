//! One rank's stage: runs the 1F1B instruction stream of one iteration.

use std::collections::HashMap;
use std::time::Duration;

use candle_core::{Device, Tensor};
use oobleck_comm::{Communicator, Rank};
use tracing::debug_span;

use super::layout::{Layout, Position};
use super::{buf_to_tensor, tensor_to_buf};
use crate::model::{
    accumulate, DropoutKey, ForwardCtx, LayeredModel, ParamSource, Stage, StageForward, TiedParam,
};
use crate::schedule::{stage_stream, Instruction};
use crate::{Error, Result};

/// Settings a worker needs beyond the layout.
#[derive(Debug, Clone, Copy)]
pub struct WorkerConfig {
    /// Keys dropout: `(seed, iteration, global microbatch, layer)`.
    pub seed: u64,
    /// Bound of every send, receive and collective.
    pub timeout: Duration,
}

/// What one iteration of a stage produced.
pub struct IterationOutput {
    /// Parameter gradients summed over this pipeline's microbatches (not yet synchronised).
    pub grads: HashMap<String, Tensor>,
    /// Sum of this pipeline's scaled losses (last stage only; 0 elsewhere).
    pub loss: f64,
}

/// A rank's stage of one pipeline, with its place in the layout.
pub struct StageWorker {
    pub(super) stage: Stage,
    pub(super) rank: Rank,
    pub(super) pos: Position,
    pub(super) layout: Layout,
    pub(super) tied: Vec<TiedParam>,
    num_stages: usize,
    prev: Option<Rank>,
    next: Option<Rank>,
    first_mb: u32,
    num_mb: u32,
    total_mb: u32,
    device: Device,
    pub(super) cfg: WorkerConfig,
}

/// Message tags: `iteration | microbatch | kind`, below bit 63 (reserved for collectives).
fn tag(iteration: u64, mb: u32, gradient: bool) -> u64 {
    ((iteration & 0x3fff_ffff) << 32) | (u64::from(mb) << 1) | u64::from(gradient)
}

impl StageWorker {
    /// Builds the layers `rank` holds in `layout` on `device`.
    pub fn new(
        model: &dyn LayeredModel,
        layout: &Layout,
        rank: Rank,
        device: &Device,
        source: ParamSource<'_>,
        cfg: WorkerConfig,
    ) -> Result<Self> {
        if layout.num_layers() != model.num_layers() {
            return Err(Error::Msg(format!(
                "layout has {} layers, the model {}",
                layout.num_layers(),
                model.num_layers()
            )));
        }
        let pos = layout
            .position(rank)
            .ok_or_else(|| Error::Msg(format!("rank {rank} holds no stage in the layout")))?;
        let pipe = &layout.pipelines()[pos.pipeline];
        let spec = layout.stage(pos);
        let stage = Stage::new(model.build_layers(spec.layers.clone(), device, source)?)?;
        let num_stages = pipe.stages.len();
        Ok(Self {
            stage,
            rank,
            pos,
            layout: layout.clone(),
            tied: model.tied_params(),
            num_stages,
            prev: (pos.stage > 0).then(|| pipe.stages[pos.stage - 1].rank),
            next: (pos.stage + 1 < num_stages).then(|| pipe.stages[pos.stage + 1].rank),
            first_mb: pipe.microbatches.start,
            num_mb: pipe.microbatches.end - pipe.microbatches.start,
            total_mb: layout.total_microbatches(),
            device: device.clone(),
            cfg,
        })
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

    pub fn config(&self) -> &WorkerConfig {
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
        self.pos.stage + 1 == self.num_stages
    }

    /// Runs iteration `iteration`: every microbatch of this pipeline forward and backward in
    /// 1F1B order. `data(iteration, global_microbatch)` gives `(token ids, targets)`, both
    /// `[b, t]` u32; it is called only on the first stage (for the inputs) and the last stage
    /// (for the targets).
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
            stage = self.pos.stage
        )
        .entered();
        let t = self.cfg.timeout;
        let loss_scale = 1.0 / f64::from(self.total_mb);
        let mut inputs: HashMap<u32, Tensor> = HashMap::new();
        let mut stash: HashMap<u32, StageForward> = HashMap::new();
        let mut upstream: HashMap<u32, Tensor> = HashMap::new();
        let mut to_send: HashMap<u32, Tensor> = HashMap::new();
        let mut grads = HashMap::new();
        let mut loss = 0.0;
        let missing = |what: &str, mb: u32| {
            Error::Msg(format!(
                "1F1B stream: {what} of microbatch {mb} missing (a broken schedule)"
            ))
        };
        for ins in stage_stream(self.pos.stage, self.num_stages, self.num_mb) {
            match ins {
                Instruction::RecvActivation { mb } => {
                    let src = self.prev.ok_or_else(|| missing("previous stage", mb))?;
                    let b = comm.recv(src, tag(iteration, mb, false), t)?;
                    inputs.insert(mb, buf_to_tensor(&b, &self.device)?);
                }
                Instruction::Forward { mb } => {
                    let global = u64::from(self.first_mb + mb);
                    let need_data = self.is_first() || self.is_last();
                    let (ids, targets) = if need_data {
                        let (i, tg) = data(iteration, global)?;
                        (Some(i), Some(tg))
                    } else {
                        (None, None)
                    };
                    let x = if self.is_first() {
                        ids.ok_or_else(|| missing("token ids", mb))?
                    } else {
                        inputs
                            .remove(&mb)
                            .ok_or_else(|| missing("activation", mb))?
                    };
                    let ctx = ForwardCtx {
                        targets: if self.is_last() {
                            targets.as_ref()
                        } else {
                            None
                        },
                        loss_scale,
                        train: true,
                        dropout_key: DropoutKey {
                            seed: self.cfg.seed,
                            iteration,
                            microbatch: global,
                        },
                    };
                    let fwd = self.stage.forward(&x, &ctx)?;
                    if self.is_last() {
                        loss += f64::from(fwd.output.to_scalar::<f32>()?);
                    }
                    stash.insert(mb, fwd);
                }
                Instruction::SendActivation { mb } => {
                    let dst = self.next.ok_or_else(|| missing("next stage", mb))?;
                    let out = &stash.get(&mb).ok_or_else(|| missing("forward", mb))?.output;
                    comm.send(dst, tag(iteration, mb, false), &tensor_to_buf(out)?, t)?;
                }
                Instruction::RecvGradient { mb } => {
                    let src = self.next.ok_or_else(|| missing("next stage", mb))?;
                    let b = comm.recv(src, tag(iteration, mb, true), t)?;
                    upstream.insert(mb, buf_to_tensor(&b, &self.device)?);
                }
                Instruction::Backward { mb } => {
                    let fwd = stash.remove(&mb).ok_or_else(|| missing("forward", mb))?;
                    let up = if self.is_last() {
                        None
                    } else {
                        Some(
                            upstream
                                .remove(&mb)
                                .ok_or_else(|| missing("gradient", mb))?,
                        )
                    };
                    let g = self.stage.backward(fwd, up.as_ref())?;
                    accumulate(&mut grads, g.params)?;
                    if let Some(gi) = g.input {
                        to_send.insert(mb, gi);
                    }
                }
                Instruction::SendGradient { mb } => {
                    let dst = self.prev.ok_or_else(|| missing("previous stage", mb))?;
                    let g = to_send
                        .remove(&mb)
                        .ok_or_else(|| missing("input gradient", mb))?;
                    comm.send(dst, tag(iteration, mb, true), &tensor_to_buf(&g)?, t)?;
                }
            }
        }
        Ok(IterationOutput { grads, loss })
    }
}
