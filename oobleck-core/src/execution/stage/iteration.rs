//! One iteration of a [`StageRunner`]: the call's state ([`Iteration`]) and one handler per
//! instruction of its stream (1F1B, or ZB-H1 with its B and W), with the overlapped last backward, whose bucket
//! all-reduces run on a scoped background thread (`reduce_buckets`).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::mpsc;
use std::thread::{Scope, ScopedJoinHandle};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use oobleck_comm::Communicator;

use super::StageRunner;
use crate::execution::progress::Doing;
use crate::execution::sync::{
    all_reduce_named, sync_buckets, IterationOutput, OverlapStats, SyncBucket,
};
use crate::model::weight_grads::PendingWeights;
use crate::model::{accumulate, DropoutKey, ForwardCtx, RowSlice, StageForward};
use crate::schedule::{rows, DeviceInstruction, Instruction, PeerRows, Schedule};
use crate::{Error, Result};

/// A bucket handed to the background thread, with its gradients by name.
type BucketJob = (SyncBucket, HashMap<String, Tensor>);
/// What the background thread gives back per bucket: the summed gradients, start and end.
type BucketDone = (Range<usize>, HashMap<String, Tensor>, Instant, Instant);

/// Message tags: `iteration | microbatch | kind`, below bit 63 (reserved for collectives).
fn tag(iteration: u64, mb: u32, gradient: bool) -> u64 {
    ((iteration & 0x3fff_ffff) << 32) | (u64::from(mb) << 1) | u64::from(gradient)
}

impl StageRunner {
    /// The layer-by-layer backward of the iteration's last microbatch (its fused backward, or
    /// its W under ZB-H1): accumulates each layer's gradients into `grads` and hands every
    /// bucket of `buckets` (descending first layer) to `tx` as soon as no layer still to run
    /// touches its parameters. Returns the stage input's gradient (None from a W).
    fn backward_overlapped(
        &self,
        work: LastBackward,
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
        let mut on_layer = |layer: usize, g: HashMap<String, Tensor>| -> Result<()> {
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
        };
        let input = match work {
            LastBackward::Fused { fwd, upstream } => {
                self.stage
                    .backward_layers(fwd, upstream.as_ref(), &mut on_layer)?
            }
            LastBackward::Weights(pending) => {
                self.stage.backward_weights(pending, &mut on_layer)?;
                None
            }
        };
        if next != buckets.len() {
            return Err(self.broken(format!(
                "{} gradient buckets were never final in the backward (a broken layout)",
                buckets.len() - next
            )));
        }
        Ok(input)
    }
}

/// The work of the iteration's last backward, which runs layer by layer.
enum LastBackward {
    /// 1F1B's backward (B and W at once) of the last microbatch.
    Fused {
        fwd: StageForward,
        upstream: Option<Tensor>,
    },
    /// ZB-H1's last W.
    Weights(PendingWeights),
}

/// The state of one [`StageRunner::run_iteration`] call, which its instruction handlers share.
/// `'scope` is the call's thread scope (the background all-reduce thread runs in it), `'env`
/// what the call borrows.
pub(super) struct Iteration<'scope, 'env> {
    runner: &'env StageRunner,
    comm: &'env dyn Communicator,
    iteration: u64,
    /// `b`: rows of a microbatch, of which this device computes `lo..hi`.
    b: u32,
    lo: u32,
    hi: u32,
    /// This device's share of the global-batch mean: its rows of each microbatch, of B.
    loss_scale: f64,
    /// Received activations, until their forward.
    inputs: HashMap<u32, Tensor>,
    /// Forward passes, until their backward.
    stash: HashMap<u32, StageForward>,
    /// Received output gradients, until their backward.
    upstream: HashMap<u32, Tensor>,
    /// ZB-H1: what each microbatch's B left for its W.
    pending: HashMap<u32, PendingWeights>,
    /// Input gradients, until they are sent.
    to_send: HashMap<u32, Tensor>,
    /// Parameter gradients summed over the microbatches so far.
    grads: HashMap<String, Tensor>,
    /// Sum of this device's scaled losses (last stage).
    loss: f64,
    /// This rank's buckets that have an all-reduce, in the global order.
    buckets: Vec<SyncBucket>,
    /// Where in the stream the last backward is (under ZB-H1: the last W).
    last_bwd: Option<usize>,
    /// The microbatch of that backward when it runs layer by layer (there are buckets).
    layered_mb: Option<u32>,
    /// ZB-H1: every backward is split into B and W; W reports layer by layer from a one-graph
    /// pass too, so no forward needs its graph cut per layer.
    split: bool,
    /// The bucket all-reduce thread, once the last backward started it.
    background: Option<ScopedJoinHandle<'scope, Result<Vec<BucketDone>>>>,
}

impl<'scope, 'env> Iteration<'scope, 'env> {
    /// The state before the first instruction of `stream`.
    pub(super) fn new(
        runner: &'env StageRunner,
        comm: &'env dyn Communicator,
        iteration: u64,
        stream: &[DeviceInstruction],
    ) -> Self {
        let b = runner.cfg.microbatch_size;
        let (lo, hi) = rows(
            b,
            runner.devices[runner.pos.stage],
            runner.pos.device as u32,
        );
        let loss_scale = f64::from(hi - lo) / (f64::from(b) * f64::from(runner.total_mb));
        // The last backward of the stream (of the last microbatch): after it every gradient
        // of a layer is final as soon as that layer's backward is, so it runs layer by layer
        // and each bucket's all-reduce starts on a background thread once its layers are done.
        // Buckets go in descending first layer, one at a time (see `sync`'s header).
        let buckets: Vec<SyncBucket> = sync_buckets(&runner.sync_ctx())
            .into_iter()
            .filter(|b| b.needs_collective())
            .collect();
        let last_bwd = stream.iter().rposition(|di| {
            matches!(
                di.instruction,
                Instruction::Backward { .. } | Instruction::BackwardWeight { .. }
            )
        });
        let layered_mb = match last_bwd.map(|i| &stream[i].instruction) {
            Some(Instruction::Backward { mb } | Instruction::BackwardWeight { mb })
                if !buckets.is_empty() =>
            {
                Some(*mb)
            }
            _ => None,
        };
        Self {
            runner,
            comm,
            iteration,
            b,
            lo,
            hi,
            loss_scale,
            inputs: HashMap::new(),
            stash: HashMap::new(),
            upstream: HashMap::new(),
            pending: HashMap::new(),
            to_send: HashMap::new(),
            grads: HashMap::new(),
            loss: 0.0,
            buckets,
            last_bwd,
            layered_mb,
            split: runner.cfg.schedule == Schedule::ZbH1,
            background: None,
        }
    }

    /// Receives microbatch `mb`'s activation rows from the previous stage's `peers`.
    pub(super) fn recv_activation(&mut self, mb: u32, peers: &[PeerRows]) -> Result<()> {
        let r = self.runner;
        let x = r.recv_rows(self.comm, &r.prev, peers, tag(self.iteration, mb, false))?;
        self.inputs.insert(mb, x);
        Ok(())
    }

    /// The forward of microbatch `mb` on this device's rows: of the token ids from `data` on
    /// the first stage, of the received activation elsewhere; the last stage adds the loss.
    pub(super) fn forward(
        &mut self,
        mb: u32,
        data: &mut dyn FnMut(u64, u64) -> Result<(Tensor, Tensor)>,
    ) -> Result<()> {
        let r = self.runner;
        let global = u64::from(r.first_mb + mb);
        let _mark = r.mark(Doing::Forward {
            mb: r.first_mb + mb,
        });
        let (b, lo, hi) = (self.b, self.lo, self.hi);
        let (ids, targets) = if r.is_first() || r.is_last() {
            let (i, tg) = data(self.iteration, global)?;
            (
                Some(own_rows(&i, b, lo, hi)?),
                Some(own_rows(&tg, b, lo, hi)?),
            )
        } else {
            (None, None)
        };
        let x = if r.is_first() {
            ids.ok_or_else(|| r.missing("token ids", mb))?
        } else {
            self.inputs
                .remove(&mb)
                .ok_or_else(|| r.missing("activation", mb))?
        };
        let targets = if r.is_last() { targets.as_ref() } else { None };
        let ctx = self.forward_ctx(global, targets);
        // Both backward paths take any of the three passes.
        let fwd = if r.cfg.recompute {
            r.stage.forward_recompute(&x, &ctx)?
        } else if self.layered_mb == Some(mb) && !self.split {
            r.stage.forward_layered(&x, &ctx)?
        } else {
            r.stage.forward(&x, &ctx)?
        };
        if r.is_last() {
            self.loss += f64::from(fwd.output.to_scalar::<f32>()?);
        }
        self.stash.insert(mb, fwd);
        Ok(())
    }

    /// The training context of the forward of global microbatch `global`.
    fn forward_ctx<'t>(&self, global: u64, targets: Option<&'t Tensor>) -> ForwardCtx<'t> {
        let cfg = &self.runner.cfg;
        ForwardCtx {
            targets,
            loss_scale: self.loss_scale,
            train: true,
            dropout_key: DropoutKey {
                seed: cfg.seed,
                iteration: self.iteration,
                microbatch: global,
            },
            // Dropout masks are keyed by the microbatch's rows, not this slice's.
            rows: Some(RowSlice {
                offset: self.lo as usize,
                total: self.b as usize,
            }),
            dtype: cfg.dtype,
        }
    }

    /// Sends the output of microbatch `mb`'s forward to the next stage's `peers`.
    pub(super) fn send_activation(&self, mb: u32, peers: &[PeerRows]) -> Result<()> {
        let r = self.runner;
        let out = &self
            .stash
            .get(&mb)
            .ok_or_else(|| r.missing("forward", mb))?
            .output;
        let tag = tag(self.iteration, mb, false);
        r.send_rows(self.comm, &r.next, peers, self.lo, out, tag)
    }

    /// Receives the gradient of microbatch `mb`'s output from the next stage's `peers`.
    pub(super) fn recv_gradient(&mut self, mb: u32, peers: &[PeerRows]) -> Result<()> {
        let r = self.runner;
        let g = r.recv_rows(self.comm, &r.next, peers, tag(self.iteration, mb, true))?;
        self.upstream.insert(mb, g);
        Ok(())
    }

    /// The backward of microbatch `mb`, instruction `at` of the stream: adds its parameter
    /// gradients to `grads` and keeps its input gradient for `send_gradient`. The stream's
    /// last backward, when there are buckets, goes through [`Self::backward_last`].
    pub(super) fn backward(
        &mut self,
        scope: &'scope Scope<'scope, 'env>,
        at: usize,
        mb: u32,
    ) -> Result<()> {
        let r = self.runner;
        let _mark = r.mark(Doing::Backward {
            mb: r.first_mb + mb,
        });
        let (fwd, up) = self.take_for_backward(mb)?;
        let gi = if self.is_last_layered(at, mb) {
            let work = LastBackward::Fused { fwd, upstream: up };
            self.backward_last(scope, work)?
        } else {
            let g = r.stage.backward(fwd, up.as_ref())?;
            accumulate(&mut self.grads, g.params)?;
            g.input
        };
        if let Some(gi) = gi {
            self.to_send.insert(mb, gi);
        }
        Ok(())
    }

    /// Whether instruction `at`, of microbatch `mb`, is the last backward (1F1B) or W (ZB-H1),
    /// run layer by layer with the bucket all-reduces beside it.
    fn is_last_layered(&self, at: usize, mb: u32) -> bool {
        self.layered_mb == Some(mb) && Some(at) == self.last_bwd
    }

    /// Microbatch `mb`'s forward pass and (not on the last stage) its output's gradient.
    fn take_for_backward(&mut self, mb: u32) -> Result<(StageForward, Option<Tensor>)> {
        let r = self.runner;
        let fwd = self
            .stash
            .remove(&mb)
            .ok_or_else(|| r.missing("forward", mb))?;
        let up = if r.is_last() {
            None
        } else {
            Some(
                self.upstream
                    .remove(&mb)
                    .ok_or_else(|| r.missing("gradient", mb))?,
            )
        };
        Ok((fwd, up))
    }

    /// ZB-H1's B of microbatch `mb`: its input gradient, kept for `send_gradient`, and what
    /// its W has to do.
    pub(super) fn backward_input(&mut self, mb: u32) -> Result<()> {
        let r = self.runner;
        let _mark = r.mark(Doing::Backward {
            mb: r.first_mb + mb,
        });
        let (fwd, up) = self.take_for_backward(mb)?;
        let (gi, pending) = r.stage.backward_inputs(fwd, up.as_ref())?;
        if let Some(gi) = gi {
            self.to_send.insert(mb, gi);
        }
        self.pending.insert(mb, pending);
        Ok(())
    }

    /// ZB-H1's W of microbatch `mb`, instruction `at` of the stream: adds the weight gradients
    /// its B left to `grads`; the stream's last W, when there are buckets, goes through
    /// [`Self::backward_last`].
    pub(super) fn backward_weight(
        &mut self,
        scope: &'scope Scope<'scope, 'env>,
        at: usize,
        mb: u32,
    ) -> Result<()> {
        let r = self.runner;
        let _mark = r.mark(Doing::Backward {
            mb: r.first_mb + mb,
        });
        let pending = self
            .pending
            .remove(&mb)
            .ok_or_else(|| r.missing("input gradient pass (B)", mb))?;
        if self.is_last_layered(at, mb) {
            self.backward_last(scope, LastBackward::Weights(pending))?;
            return Ok(());
        }
        let grads = &mut self.grads;
        r.stage
            .backward_weights(pending, &mut |_, g| accumulate(grads, g))
    }

    /// The last backward, layer by layer: starts the background thread, which all-reduces the
    /// buckets one at a time as [`StageRunner::backward_overlapped`] hands them over. Returns
    /// the stage input's gradient.
    fn backward_last(
        &mut self,
        scope: &'scope Scope<'scope, 'env>,
        work: LastBackward,
    ) -> Result<Option<Tensor>> {
        let (tx, rx) = mpsc::channel::<BucketJob>();
        let (comm, timeout) = (self.comm, self.runner.cfg.timeout);
        self.background = Some(scope.spawn(move || reduce_buckets(comm, rx, timeout)));
        let r = self.runner;
        match r.backward_overlapped(work, &self.buckets, &mut self.grads, &tx) {
            Ok(gi) => Ok(gi),
            Err(e) => {
                // A failed all-reduce stops the thread, then the hand-over fails: report the
                // all-reduce's error, the cause.
                drop(tx);
                Err(match self.background.take().map(|h| h.join()) {
                    Some(Ok(Err(cause))) => cause,
                    _ => e,
                })
            }
        }
    }

    /// Sends the gradient of microbatch `mb`'s input to the previous stage's `peers`.
    pub(super) fn send_gradient(&mut self, mb: u32, peers: &[PeerRows]) -> Result<()> {
        let r = self.runner;
        let g = self
            .to_send
            .remove(&mb)
            .ok_or_else(|| r.missing("input gradient", mb))?;
        let tag = tag(self.iteration, mb, true);
        r.send_rows(self.comm, &r.prev, peers, self.lo, &g, tag)
    }

    /// After the last instruction: joins the background thread, whose summed buckets replace
    /// their local sums in `grads`, and times how much of it the main thread's work hid.
    pub(super) fn finish(self) -> Result<IterationOutput> {
        let main_done = Instant::now();
        let mut grads = self.grads;
        let mut reduced = Vec::new();
        let mut overlap = OverlapStats::default();
        if let Some(h) = self.background {
            let done = h.join().map_err(|_| {
                self.runner
                    .broken("the gradient all-reduce thread panicked".into())
            })??;
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
            loss: self.loss,
            reduced,
            overlap,
        })
    }
}

/// The background thread of the last backward: all-reduces each bucket `rx` hands over, in
/// that order, until the sender is dropped or an all-reduce fails (which ends the thread).
fn reduce_buckets(
    comm: &dyn Communicator,
    rx: mpsc::Receiver<BucketJob>,
    timeout: Duration,
) -> Result<Vec<BucketDone>> {
    let mut done = Vec::new();
    for (bucket, mut g) in rx {
        let t0 = Instant::now();
        all_reduce_named(comm, &bucket.holders, &bucket.names, &mut g, timeout)?;
        done.push((bucket.layers, g, t0, Instant::now()));
    }
    Ok(done)
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
