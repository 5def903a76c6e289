//! A user's own model on the job runtime: a residual MLP classifier on synthetic data, as a
//! [`LayeredModel`] (how the engine cuts it into stages) and a [`Workload`] (its data, its
//! evaluation and what the planner needs to know about it).
//!
//! ```text
//!  x [b, inputs] ──► input: x·W + c ──► block 0: h + gelu(h·W1 + c1)·W2 + c2 ──► ... block N-1
//!    ──► head: h·W + c = logits [b, classes] ──► cross-entropy with y [b] (u32) ──► loss []
//!  layers: 0 = input, 1..=N = blocks, N + 1 = head (L = N + 2)
//! ```
//!
//! The data is a fixed random teacher's labels, `y = argmax(x·T)`, of `x ~ N(0, 1)` drawn
//! from `(seed, step, microbatch)` alone, so any plan of any cluster reads the same batches.

use std::ops::Range;

use candle_core::{Device, Tensor, Var};
use oobleck_core::model::{
    checked_param, seeded_normal, ForwardCtx, Layer, LayeredModel, ParamSource, Stage,
};
use oobleck_core::planning::{DeviceSpec, Dtype, Fingerprint, LayerProfile, ModelProfile};
use oobleck_core::runtime::{BatchShape, BoxError, TrainingSpec, Workload};
use serde::{Deserialize, Serialize};

/// Seeds the teacher and the held-out batch: the task is the same whatever the run's seed.
const TASK_SEED: u64 = 0x7eac_4e55;

/// The model and its data, carried to every worker as the job's workload settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MlpConfig {
    /// Features per sample.
    pub inputs: usize,
    /// Width of the residual stream.
    pub width: usize,
    /// Hidden units inside each block.
    pub hidden: usize,
    /// Residual blocks `N`.
    pub blocks: usize,
    pub classes: usize,
    /// Samples of the held-out batch `evaluate` scores.
    pub eval_samples: usize,
}

impl MlpConfig {
    /// Per layer: multiply-adds, floats kept for the backward and floats out, per sample
    /// (what the planner is told); and parameters.
    fn layer_sizes(&self) -> Vec<[usize; 4]> {
        let (w, h) = (self.width, self.hidden);
        let linear = |i: usize, o: usize| [i * o, i, o, i * o + o];
        // fc1 [w, h] then fc2 [h, w]; the backward keeps the input, fc1's output and its gelu.
        let block = [2 * w * h, w + 2 * h, w, 2 * w * h + h + w];
        let mut sizes = vec![linear(self.inputs, w)];
        sizes.extend(std::iter::repeat_n(block, self.blocks));
        sizes.push(linear(w, self.classes));
        sizes
    }
}

/// The layer list; `Send + Sync`, it only describes the model.
pub struct ResidualMlp(pub MlpConfig);

type Res<T> = oobleck_core::Result<T>;

/// `x·w + b` of one named linear map, `w` stored `[in, out]`.
struct Linear {
    w: Var,
    b: Var,
    names: [String; 2],
}

impl Linear {
    /// `prefix.weight` ~ N(0, std) keyed by (seed, name), `prefix.bias` zeros; or the given
    /// tensors, shape-checked.
    fn new(prefix: &str, shape: [usize; 2], std: f64, dev: &Device, src: ParamSource) -> Res<Self> {
        let names = [format!("{prefix}.weight"), format!("{prefix}.bias")];
        let (w, b) = match src {
            ParamSource::Init { seed } => (
                seeded_normal(seed, &names[0], &shape, std, dev)?,
                Tensor::zeros(shape[1], candle_core::DType::F32, dev)?,
            ),
            ParamSource::Tensors(t) => (
                checked_param(t, &names[0], &shape, dev)?,
                checked_param(t, &names[1], &shape[1..], dev)?,
            ),
        };
        Ok(Self {
            w: Var::from_tensor(&w)?,
            b: Var::from_tensor(&b)?,
            names,
        })
    }

    fn forward(&self, x: &Tensor) -> Res<Tensor> {
        let y = x.matmul(self.w.as_tensor())?; // [b, in] x [in, out] -> [b, out]
        Ok(y.broadcast_add(self.b.as_tensor())?)
    }

    fn params(&self) -> Vec<(String, Var)> {
        vec![
            (self.names[0].clone(), self.w.clone()),
            (self.names[1].clone(), self.b.clone()),
        ]
    }
}

/// What a layer is.
enum Kind {
    Input(Linear),
    Block(Linear, Linear),
    Head(Linear),
}

struct MlpLayer {
    index: usize,
    kind: Kind,
}

impl Layer for MlpLayer {
    fn index(&self) -> usize {
        self.index
    }

    fn params(&self) -> Vec<(String, Var)> {
        let mut p = match &self.kind {
            Kind::Input(l) | Kind::Head(l) => l.params(),
            Kind::Block(a, b) => [a.params(), b.params()].concat(),
        };
        p.sort_by(|a, b| a.0.cmp(&b.0));
        p
    }

    fn forward(&self, x: &Tensor, ctx: &ForwardCtx) -> Res<Tensor> {
        match &self.kind {
            Kind::Input(l) => l.forward(x), // [b, inputs] -> [b, width]
            Kind::Block(fc1, fc2) => Ok((x + fc2.forward(&fc1.forward(x)?.gelu()?)?)?),
            Kind::Head(l) => {
                let logits = l.forward(x)?; // [b, classes]
                let Some(y) = ctx.targets else {
                    return Ok(logits);
                };
                let loss = candle_nn::loss::cross_entropy(&logits, y)?; // mean over the rows
                Ok(loss.affine(ctx.loss_scale, 0.0)?)
            }
        }
    }
}

impl LayeredModel for ResidualMlp {
    fn num_layers(&self) -> usize {
        self.0.blocks + 2
    }

    fn layer_name(&self, i: usize) -> String {
        oobleck_core::model::transformer_layer_name(i, self.0.blocks).replace("embedding", "input")
    }

    fn build_layers(
        &self,
        range: Range<usize>,
        dev: &Device,
        src: ParamSource<'_>,
    ) -> Res<Vec<Box<dyn Layer>>> {
        oobleck_core::model::check_layer_range(&range, self.num_layers())?;
        let c = self.0;
        let lin = |name: &str, shape: [usize; 2]| {
            // Fan-in scaled, but a block's second map starts small: each block starts near
            // the identity.
            let std = match name.ends_with("fc2") {
                true => 0.02,
                false => 1.0 / (shape[0] as f64).sqrt(),
            };
            Linear::new(name, shape, std, dev, src)
        };
        let mut layers: Vec<Box<dyn Layer>> = Vec::new();
        for index in range {
            let kind = match index {
                0 => Kind::Input(lin("input", [c.inputs, c.width])?),
                i if i == c.blocks + 1 => Kind::Head(lin("head", [c.width, c.classes])?),
                i => Kind::Block(
                    lin(&format!("blocks.{}.fc1", i - 1), [c.width, c.hidden])?,
                    lin(&format!("blocks.{}.fc2", i - 1), [c.hidden, c.width])?,
                ),
            };
            layers.push(Box::new(MlpLayer { index, kind }));
        }
        Ok(layers)
    }
}

/// The residual MLP with its synthetic task.
pub struct MlpWorkload {
    model: ResidualMlp,
    /// The teacher `T` `[inputs, classes]`, on the CPU.
    teacher: Tensor,
    /// The job's global batch (its `b` is the rows of a microbatch).
    batch: BatchShape,
}

impl MlpWorkload {
    /// The workload of `cfg`, drawing microbatches of the job's `batch`
    /// ([`TrainingSpec::batch`]).
    pub fn new(cfg: MlpConfig, batch: BatchShape) -> Result<Self, BoxError> {
        let c = cfg;
        let sizes = [
            c.inputs,
            c.width,
            c.hidden,
            c.classes,
            batch.microbatch_size as usize,
            c.eval_samples,
        ];
        if sizes.contains(&0) {
            return Err(format!("every size of the residual MLP must be at least 1: {c:?}").into());
        }
        let teacher = seeded_normal(
            TASK_SEED,
            "teacher",
            &[c.inputs, c.classes],
            1.0,
            &Device::Cpu,
        )?;
        Ok(Self {
            model: ResidualMlp(cfg),
            teacher,
            batch,
        })
    }

    /// The runtime's factory: the workload from the job's settings (an [`MlpConfig`]) and
    /// its batch.
    pub fn factory(
        spec: &TrainingSpec,
        settings: &serde_json::Value,
    ) -> Result<Box<dyn Workload>, BoxError> {
        let cfg: MlpConfig = serde_json::from_value(settings.clone())
            .map_err(|e| format!("the residual MLP's settings: {e}"))?;
        Ok(Box::new(Self::new(cfg, spec.batch())?))
    }

    /// `rows` samples named `name`: x ~ N(0, 1) `[rows, inputs]`, y = argmax(x·T) `[rows]` u32.
    fn samples(
        &self,
        seed: u64,
        name: &str,
        rows: usize,
        dev: &Device,
    ) -> Result<(Tensor, Tensor), BoxError> {
        let x = seeded_normal(seed, name, &[rows, self.model.0.inputs], 1.0, &Device::Cpu)?;
        let y = x.matmul(&self.teacher)?.argmax(1)?; // [rows]
        Ok((x.to_device(dev)?, y.to_device(dev)?))
    }
}

impl Workload for MlpWorkload {
    fn name(&self) -> String {
        let c = self.model.0;
        format!("residual-mlp-{}x{}", c.blocks, c.width)
    }

    fn num_params(&self) -> usize {
        let sizes = self.model.0.layer_sizes();
        sizes.iter().map(|[.., params]| params).sum()
    }

    fn model(&self) -> &dyn LayeredModel {
        &self.model
    }

    fn microbatch(
        &self,
        seed: u64,
        step: u64,
        mb: u32,
        dev: &Device,
    ) -> Result<(Tensor, Tensor), BoxError> {
        let rows = self.batch.microbatch_size as usize;
        self.samples(seed, &format!("data/{step}/{mb}"), rows, dev)
    }

    /// Per-layer estimates from the device's peak: 2 FLOPs per multiply-add forward, twice
    /// that backward, plus the device's launch overhead per pass. This model computes in f32
    /// whatever the job's precision (its layers ignore `ForwardCtx::dtype`), so the profile is
    /// f32's.
    fn profile(
        &self,
        device: &DeviceSpec,
        microbatch_size: u32,
        _precision: Dtype,
    ) -> Result<ModelProfile, BoxError> {
        let b = u64::from(microbatch_size);
        let flops_per_ms = device.peak_tflops * device.efficiency * 1e9;
        let launch_ms = device.launch_overhead_us / 1e3;
        let sizes = self.model.0.layer_sizes();
        let layers = sizes
            .into_iter()
            .enumerate()
            .map(|(i, [macs, kept, out, params])| {
                let forward_ms = 2.0 * (b * macs as u64) as f64 / flops_per_ms + launch_ms;
                LayerProfile {
                    name: self.model.layer_name(i),
                    forward_ms,
                    backward_ms: 2.0 * forward_ms,
                    param_bytes: 4 * params as u64,
                    activation_bytes: 4 * b * kept as u64,
                    output_bytes: 4 * b * out as u64,
                }
            })
            .collect();
        Ok(ModelProfile {
            fingerprint: Fingerprint {
                model: self.name(),
                microbatch_size,
                dtype: "f32".into(),
                device_kind: device.name.into(),
            },
            layers,
        })
    }

    /// The mean cross-entropy of a held-out batch the training never draws.
    fn evaluate(&self, model: &Stage) -> Result<Option<f64>, BoxError> {
        let layers = self.model.num_layers();
        if model.range() != (0..layers) {
            return Err(format!(
                "evaluation needs layers 0..{layers}, got {:?}",
                model.range()
            )
            .into());
        }
        let rows = self.model.0.eval_samples;
        let (x, y) = self.samples(TASK_SEED, "held-out", rows, &Device::Cpu)?;
        let ctx = ForwardCtx {
            targets: Some(&y),
            ..ForwardCtx::inference()
        };
        let loss = model.forward(&x, &ctx)?.output; // []
        Ok(Some(f64::from(loss.to_scalar::<f32>()?)))
    }
}
