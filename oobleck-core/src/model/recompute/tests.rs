//! A recomputing pass gives the values of the layered one: a small model with a tied
//! embedding and dropout after every middle layer, run as a whole stage and as a middle stage.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};

use super::super::{dropout, seeded_normal, DropoutKey, ForwardCtx, Layer, RowSlice, Stage};

const V: usize = 11;
const D: usize = 8;
const P: f64 = 0.3;

struct Embed(Var);
/// `x + dropout(tanh(x W + b))`.
struct Mid(usize, Var, Var);
/// Scores against the tied `wte`; the scaled cross-entropy when targets are set.
struct Head(usize, Var);

impl Layer for Embed {
    fn index(&self) -> usize {
        0
    }
    fn params(&self) -> Vec<(String, Var)> {
        vec![("wte".into(), self.0.clone())]
    }
    fn forward(&self, x: &Tensor, _: &ForwardCtx) -> crate::Result<Tensor> {
        let (b, t) = x.dims2()?;
        let e = self.0.as_tensor().index_select(&x.flatten_all()?, 0)?; // [b*t, D]
        Ok(e.reshape((b, t, D))?)
    }
}

impl Layer for Mid {
    fn index(&self) -> usize {
        self.0
    }
    fn params(&self) -> Vec<(String, Var)> {
        vec![
            (format!("h{}.b", self.0), self.2.clone()),
            (format!("h{}.w", self.0), self.1.clone()),
        ]
    }
    fn forward(&self, x: &Tensor, ctx: &ForwardCtx) -> crate::Result<Tensor> {
        let h = x
            .broadcast_matmul(self.1.as_tensor())?
            .broadcast_add(self.2.as_tensor())?
            .tanh()?; // [b, t, D]
        Ok(x.add(&dropout(&h, P, ctx, self.0, 0)?)?)
    }
}

impl Layer for Head {
    fn index(&self) -> usize {
        self.0
    }
    fn params(&self) -> Vec<(String, Var)> {
        vec![("wte".into(), self.1.clone())]
    }
    fn forward(&self, x: &Tensor, ctx: &ForwardCtx) -> crate::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let logits = x.reshape((b * t, D))?.matmul(&self.1.as_tensor().t()?)?; // [b*t, V]
        let Some(targets) = ctx.targets else {
            return Ok(logits.reshape((b, t, V))?);
        };
        let loss = candle_nn::loss::cross_entropy(&logits, &targets.flatten_all()?)?;
        Ok(loss.affine(ctx.loss_scale, 0.0)?)
    }
}

/// Layers `range` of a model of `1 + mids + 1` layers, seeded; layer 0 and the head share `wte`.
fn layers(range: std::ops::Range<usize>, mids: usize) -> Vec<Box<dyn Layer>> {
    let d = Device::Cpu;
    let var = |name: &str, shape: &[usize], std| {
        Var::from_tensor(&seeded_normal(3, name, shape, std, &d).unwrap()).unwrap()
    };
    let wte = var("wte", &[V, D], 0.5);
    range
        .map(|i| -> Box<dyn Layer> {
            if i == 0 {
                Box::new(Embed(wte.clone()))
            } else if i == mids + 1 {
                Box::new(Head(i, wte.clone()))
            } else {
                let w = var(&format!("h{i}.w"), &[D, D], 0.4);
                Box::new(Mid(i, w, var(&format!("h{i}.b"), &[D], 0.1)))
            }
        })
        .collect()
}

fn ctx(targets: &Tensor) -> ForwardCtx<'_> {
    ForwardCtx {
        targets: Some(targets),
        loss_scale: 0.25,
        train: true,
        dropout_key: DropoutKey {
            seed: 9,
            iteration: 4,
            microbatch: 2,
        },
        rows: Some(RowSlice {
            offset: 1,
            total: 4,
        }),
        ..ForwardCtx::inference()
    }
}

fn ids(rows: &[[u32; 5]]) -> Tensor {
    let flat: Vec<u32> = rows.iter().flatten().copied().collect();
    Tensor::from_vec(flat, (rows.len(), 5), &Device::Cpu).unwrap()
}

/// Per-layer reports of a backward: the order of the layers and the gradients summed by name.
type Reports = (Vec<usize>, HashMap<String, Tensor>);

fn run_backward(
    stage: &Stage,
    fwd: super::StageForward,
    upstream: Option<&Tensor>,
) -> (Reports, Option<Tensor>) {
    let (mut order, mut grads) = (Vec::new(), HashMap::new());
    let input = stage
        .backward_layers(fwd, upstream, &mut |i, g| {
            order.push(i);
            super::super::accumulate(&mut grads, g)
        })
        .unwrap();
    ((order, grads), input)
}

/// Largest |a - b| / max(1, |a|) over the elements.
fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs() / x.abs().max(1.0))
        .fold(0.0, f32::max)
}

fn assert_same_grads(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) {
    let mut names: Vec<_> = a.keys().collect();
    names.sort();
    assert_eq!(names.len(), b.len());
    for name in names {
        let d = rel_diff(&a[name], &b[name]);
        assert!(d <= 1e-6, "{name}: relative difference {d}");
    }
}

#[test]
fn recompute_gives_the_loss_and_gradients_of_the_layered_pass() {
    let stage = Stage::new(layers(0..5, 3)).unwrap();
    let x = ids(&[[1, 4, 2, 9, 0], [3, 3, 7, 10, 5]]);
    let targets = ids(&[[4, 2, 9, 0, 6], [3, 7, 10, 5, 1]]);
    let layered = stage.forward_layered(&x, &ctx(&targets)).unwrap();
    let again = stage.forward_recompute(&x, &ctx(&targets)).unwrap();
    let loss = layered.output.to_scalar::<f32>().unwrap();
    assert_eq!(again.output.to_scalar::<f32>().unwrap(), loss);
    // Dropout is active, so equal losses are not those of two dropout-free passes.
    let eval = ForwardCtx {
        train: false,
        ..ctx(&targets)
    };
    let plain = stage.forward(&x, &eval).unwrap().output;
    assert_ne!(plain.to_scalar::<f32>().unwrap(), loss);

    let ((order_a, grads_a), input_a) = run_backward(&stage, layered, None);
    let ((order_b, grads_b), input_b) = run_backward(&stage, again, None);
    assert_eq!(order_a, [4, 3, 2, 1, 0]);
    assert_eq!(order_b, order_a);
    assert!(input_a.is_none() && input_b.is_none());
    assert_same_grads(&grads_a, &grads_b);
}

#[test]
fn a_middle_stage_recomputes_its_input_gradient() {
    let stage = Stage::new(layers(1..4, 4)).unwrap();
    let d = Device::Cpu;
    let x = seeded_normal(5, "x", &[2, 5, D], 1.0, &d).unwrap();
    let up = seeded_normal(5, "up", &[2, 5, D], 1.0, &d).unwrap();
    let targets = Tensor::zeros((2, 5), DType::U32, &d).unwrap(); // unused: no head here
    let layered = stage.forward_layered(&x, &ctx(&targets)).unwrap();
    let again = stage.forward_recompute(&x, &ctx(&targets)).unwrap();
    assert_eq!(rel_diff(&layered.output, &again.output), 0.0);
    let ((order_a, grads_a), input_a) = run_backward(&stage, layered, Some(&up));
    let ((order_b, grads_b), input_b) = run_backward(&stage, again, Some(&up));
    assert_eq!(order_b, order_a);
    assert_same_grads(&grads_a, &grads_b);
    let d = rel_diff(&input_a.unwrap(), &input_b.unwrap());
    assert!(d <= 1e-6, "input gradient: relative difference {d}");
    // The one-call backward takes a recomputing pass too, summing the tied shares by name.
    let one = stage
        .backward(
            stage.forward_recompute(&x, &ctx(&targets)).unwrap(),
            Some(&up),
        )
        .unwrap();
    assert_same_grads(&grads_a, &one.params);
}

#[test]
fn a_recomputing_pass_of_another_stage_is_an_error() {
    let x = ids(&[[1, 2, 3, 4, 5]]);
    let targets = ids(&[[2, 3, 4, 5, 6]]);
    let whole = Stage::new(layers(0..4, 2)).unwrap();
    let first = Stage::new(layers(0..2, 2)).unwrap();
    let fwd = whole.forward_recompute(&x, &ctx(&targets)).unwrap();
    let e = first.backward(fwd, None).err().expect("4 inputs, 2 layers");
    assert!(e.to_string().contains("forward_recompute"), "{e}");
}
