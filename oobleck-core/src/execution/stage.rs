//! One rank's stage: runs the 1F1B instruction stream of one iteration.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor, Var};
use oobleck_comm::{Communicator, Rank};
use tracing::debug_span;

use super::layout::{Layout, Position};
use super::progress::{Doing, Mark, Progress};
use super::sync::{
    all_reduce_named, sync_buckets, sync_gradients, SyncBucket, SyncCtx, SyncReport,
};
use super::{buf_to_tensor, tensor_to_buf};
use crate::model::{
    accumulate, DropoutKey, ForwardCtx, LayeredModel, ParamSource, RowSlice, Stage, StageForward,
    TiedParam,
};
use crate::optim::AdamW;
use crate::schedule::{device_stream, rows, Instruction, PeerRows};
use crate::{Error, Result};

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
}

/// What one iteration of a stage produced.
pub struct IterationOutput {
    /// Parameter gradients summed over this pipeline's microbatches (not yet synchronised).
    pub grads: HashMap<String, Tensor>,
    /// Sum of this device's scaled losses (last stage only; 0 elsewhere).
    pub loss: f64,
    /// The gradient buckets already all-reduced during the last backward (their entries of
    /// `grads` are summed over the holders); `sync_gradients` does the rest.
    pub(super) reduced: Vec<Range<usize>>,
    /// Timing of those overlapped all-reduces.
    pub overlap: OverlapStats,
}

/// How the bucket all-reduces of one iteration overlapped this rank's own work.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OverlapStats {
    /// Wall time of the all-reduces run on the background thread.
    pub collective: Duration,
    /// The part of `collective` that ran while the main thread was still busy with the
    /// iteration (the rest of the backward, sending the input gradient).
    pub hidden: Duration,
    /// How many buckets were reduced in the background.
    pub buckets: usize,
}

/// A bucket handed to the background thread, with its gradients by name.
type BucketJob = (SyncBucket, HashMap<String, Tensor>);
/// What the background thread gives back per bucket: the summed gradients, start and end.
type BucketDone = (Range<usize>, HashMap<String, Tensor>, Instant, Instant);

/// A rank's stage of one pipeline, with its place in the layout.
pub struct StageRunner {
    stage: Stage,
    rank: Rank,
    pos: Position,
    layout: Layout,
    tied: Vec<TiedParam>,
    /// Devices per stage of this pipeline, for `schedule::device_stream`.
    devices: Vec<u32>,
    prev: Vec<Rank>,
    next: Vec<Rank>,
    first_mb: u32,
    num_mb: u32,
    total_mb: u32,
    device: Device,
    cfg: StageConfig,
    /// Where its microbatches' compute is marked for a watchdog (`progress`), if anywhere.
    progress: Option<Arc<Progress>>,
}

/// Message tags: `iteration | microbatch | kind`, below bit 63 (reserved for collectives).
fn tag(iteration: u64, mb: u32, gradient: bool) -> u64 {
    ((iteration & 0x3fff_ffff) << 32) | (u64::from(mb) << 1) | u64::from(gradient)
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
        Ok(Self {
            stage,
            rank,
            pos,
            layout: layout.clone(),
            tied: model.tied_params(),
            devices,
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
            num_mb: pipe.microbatches.end - pipe.microbatches.start,
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
    /// 1F1B order, on this device's rows of each microbatch. `data(iteration,
    /// global_microbatch)` gives the whole microbatch `(token ids, targets)`, both `[b, t]`
    /// u32; it is called only on the first stage (for the inputs) and the last stage (for the
    /// targets).
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
        let b = self.cfg.microbatch_size;
        let (lo, hi) = rows(b, self.devices[self.pos.stage], self.pos.device as u32);
        // This device's share of the global-batch mean: its rows of each microbatch, of B.
        let loss_scale = f64::from(hi - lo) / (f64::from(b) * f64::from(self.total_mb));
        let mut inputs: HashMap<u32, Tensor> = HashMap::new();
        let mut stash: HashMap<u32, StageForward> = HashMap::new();
        let mut upstream: HashMap<u32, Tensor> = HashMap::new();
        let mut to_send: HashMap<u32, Tensor> = HashMap::new();
        let mut grads = HashMap::new();
        let mut loss = 0.0;
        let missing = |what: &str, mb: u32| {
            self.broken(format!(
                "1F1B stream: {what} of microbatch {mb} missing (a broken schedule)"
            ))
        };
        let stream = device_stream(
            self.pos.stage,
            &self.devices,
            self.pos.device as u32,
            b,
            self.num_mb,
        );
        // The last backward of the stream (of the last microbatch): after it every gradient
        // of a layer is final as soon as that layer's backward is, so it runs layer by layer
        // and each bucket's all-reduce starts on a background thread once its layers are done.
        // Buckets go in descending first layer, one at a time (see `sync`'s header).
        let buckets: Vec<SyncBucket> = sync_buckets(&self.sync_ctx())
            .into_iter()
            .filter(|b| b.needs_collective())
            .collect();
        let last_bwd = stream
            .iter()
            .rposition(|di| matches!(di.instruction, Instruction::Backward { .. }));
        let layered_mb = match last_bwd.map(|i| &stream[i].instruction) {
            Some(Instruction::Backward { mb }) if !buckets.is_empty() => Some(*mb),
            _ => None,
        };
        let timeout = self.cfg.timeout;
        std::thread::scope(|scope| -> Result<IterationOutput> {
            let mut background = None;
            for (at, di) in stream.into_iter().enumerate() {
                match di.instruction {
                    Instruction::RecvActivation { mb } => {
                        let x =
                            self.recv_rows(comm, &self.prev, &di.peers, tag(iteration, mb, false))?;
                        inputs.insert(mb, x);
                    }
                    Instruction::Forward { mb } => {
                        let global = u64::from(self.first_mb + mb);
                        let _mark = self.mark(Doing::Forward {
                            mb: self.first_mb + mb,
                        });
                        let (ids, targets) = if self.is_first() || self.is_last() {
                            let (i, tg) = data(iteration, global)?;
                            (
                                Some(own_rows(&i, b, lo, hi)?),
                                Some(own_rows(&tg, b, lo, hi)?),
                            )
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
                            // Dropout masks are keyed by the microbatch's rows, not this slice's.
                            rows: Some(RowSlice {
                                offset: lo as usize,
                                total: b as usize,
                            }),
                            dtype: self.cfg.dtype,
                        };
                        // Both backward paths below take any of the three passes.
                        let fwd = if self.cfg.recompute {
                            self.stage.forward_recompute(&x, &ctx)?
                        } else if layered_mb == Some(mb) {
                            self.stage.forward_layered(&x, &ctx)?
                        } else {
                            self.stage.forward(&x, &ctx)?
                        };
                        if self.is_last() {
                            loss += f64::from(fwd.output.to_scalar::<f32>()?);
                        }
                        stash.insert(mb, fwd);
                    }
                    Instruction::SendActivation { mb } => {
                        let out = &stash.get(&mb).ok_or_else(|| missing("forward", mb))?.output;
                        self.send_rows(
                            comm,
                            &self.next,
                            &di.peers,
                            lo,
                            out,
                            tag(iteration, mb, false),
                        )?;
                    }
                    Instruction::RecvGradient { mb } => {
                        let g =
                            self.recv_rows(comm, &self.next, &di.peers, tag(iteration, mb, true))?;
                        upstream.insert(mb, g);
                    }
                    Instruction::Backward { mb } => {
                        let _mark = self.mark(Doing::Backward {
                            mb: self.first_mb + mb,
                        });
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
                        let gi = if layered_mb == Some(mb) && Some(at) == last_bwd {
                            let (tx, rx) = mpsc::channel::<BucketJob>();
                            background = Some(scope.spawn(move || -> Result<Vec<BucketDone>> {
                                let mut done = Vec::new();
                                for (bucket, mut g) in rx {
                                    let t0 = Instant::now();
                                    all_reduce_named(
                                        comm,
                                        &bucket.holders,
                                        &bucket.names,
                                        &mut g,
                                        timeout,
                                    )?;
                                    done.push((bucket.layers, g, t0, Instant::now()));
                                }
                                Ok(done)
                            }));
                            match self.backward_overlapped(
                                fwd,
                                up.as_ref(),
                                &buckets,
                                &mut grads,
                                &tx,
                            ) {
                                Ok(gi) => gi,
                                Err(e) => {
                                    // A failed all-reduce stops the thread, then the hand-over
                                    // fails: report the all-reduce's error, the cause.
                                    drop(tx);
                                    return Err(match background.take().map(|h| h.join()) {
                                        Some(Ok(Err(cause))) => cause,
                                        _ => e,
                                    });
                                }
                            }
                        } else {
                            let g = self.stage.backward(fwd, up.as_ref())?;
                            accumulate(&mut grads, g.params)?;
                            g.input
                        };
                        if let Some(gi) = gi {
                            to_send.insert(mb, gi);
                        }
                    }
                    Instruction::SendGradient { mb } => {
                        let g = to_send
                            .remove(&mb)
                            .ok_or_else(|| missing("input gradient", mb))?;
                        self.send_rows(
                            comm,
                            &self.prev,
                            &di.peers,
                            lo,
                            &g,
                            tag(iteration, mb, true),
                        )?;
                    }
                }
            }
            let main_done = Instant::now();
            let mut reduced = Vec::new();
            let mut overlap = OverlapStats::default();
            if let Some(h) = background {
                let done = h
                    .join()
                    .map_err(|_| self.broken("the gradient all-reduce thread panicked".into()))??;
                for (layers, g, t0, t1) in done {
                    overlap.collective += t1 - t0;
                    overlap.hidden += main_done.min(t1).saturating_duration_since(t0);
                    overlap.buckets += 1;
                    grads.extend(g);
                    reduced.push(layers);
                }
            }
            Ok(IterationOutput {
                grads,
                loss,
                reduced,
                overlap,
            })
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

    /// The layer-by-layer backward of the iteration's last microbatch: accumulates each
    /// layer's gradients into `grads` and hands every bucket of `buckets` (descending first
    /// layer) to `tx` as soon as no layer still to run touches its parameters. Returns the
    /// stage input's gradient.
    fn backward_overlapped(
        &self,
        fwd: StageForward,
        upstream: Option<&Tensor>,
        buckets: &[SyncBucket],
        grads: &mut HashMap<String, Tensor>,
        tx: &mpsc::Sender<BucketJob>,
    ) -> Result<Option<Tensor>> {
        // The lowest layer of this stage that lists each name: a bucket is final once the
        // backward is done down to its lowest layer and to every such layer of its names.
        let mut lowest: HashMap<String, usize> = HashMap::new();
        for l in self.stage.layers() {
            for (name, _) in l.params() {
                lowest.entry(name).or_insert(l.index());
            }
        }
        let ready_at: Vec<usize> = buckets
            .iter()
            .map(|b| {
                b.names
                    .iter()
                    .filter_map(|n| lowest.get(n).copied())
                    .fold(b.layers.start, usize::min)
            })
            .collect();
        let mut next = 0;
        let input = self.stage.backward_layers(fwd, upstream, &mut |layer, g| {
            accumulate(grads, g)?;
            while next < buckets.len() && ready_at[next] >= layer {
                let bucket = &buckets[next];
                let mut part = HashMap::with_capacity(bucket.names.len());
                for n in &bucket.names {
                    let t = grads.get(n).ok_or_else(|| Error::MissingGradient {
                        name: n.clone(),
                        when: "in its bucket",
                    })?;
                    part.insert(n.clone(), t.clone());
                }
                tx.send((bucket.clone(), part))
                    .map_err(|_| self.broken("the gradient all-reduce thread stopped".into()))?;
                next += 1;
            }
            Ok(())
        })?;
        if next != buckets.len() {
            return Err(self.broken(format!(
                "{} gradient buckets were never final in the backward (a broken layout)",
                buckets.len() - next
            )));
        }
        Ok(input)
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

/// Rows `[lo, hi)` of a whole microbatch, after checking it has `b` rows.
fn own_rows(t: &Tensor, b: u32, lo: u32, hi: u32) -> Result<Tensor> {
    if t.dims().first() != Some(&(b as usize)) {
        return Err(Error::Shape {
            what: "the data source's microbatch".into(),
            found: t.dims().to_vec(),
            expected: format!("{b} rows"),
        });
    }
    if lo == 0 && hi == b {
        return Ok(t.clone());
    }
    Ok(t.narrow(0, lo as usize, (hi - lo) as usize)?)
}
