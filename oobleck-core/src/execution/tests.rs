//! A toy model with a tied embedding, trained single-process and as heterogeneous pipelines
//! over `LocalNetwork`: parameters and losses must agree.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::time::Duration;

use candle_core::{Device, Tensor, Var};
use oobleck_comm::{Communicator, LocalNetwork, Tuning};

use super::*;
use crate::model::{
    accumulate, seeded_normal, DropoutKey, ForwardCtx, Layer, LayeredModel, ParamSource, Stage,
    TiedParam,
};
use crate::optim::{AdamW, AdamWConfig};
use crate::planning;
use crate::schedule::Schedule;

const V: usize = 7;
const D: usize = 4;

/// Layer 0 looks tokens up in `wte`; layers `1..L-1` are `tanh(x W + b)`; layer `L-1` scores
/// against `wte` again (tied) and returns the scaled cross-entropy.
struct Toy {
    layers: usize,
    seed: u64,
}

struct Embed(Var);
struct Mid(usize, Var, Var);
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
        let e = self.0.as_tensor().index_select(&x.flatten_all()?, 0)?;
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
    fn forward(&self, x: &Tensor, _: &ForwardCtx) -> crate::Result<Tensor> {
        Ok(x.broadcast_matmul(self.1.as_tensor())?
            .broadcast_add(self.2.as_tensor())?
            .tanh()?)
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
        let (b, t, d) = x.dims3()?;
        let logits = x.reshape((b * t, d))?.matmul(&self.1.as_tensor().t()?)?;
        let Some(tg) = ctx.targets else {
            return Ok(logits.reshape((b, t, V))?);
        };
        let loss = candle_nn::loss::cross_entropy(&logits, &tg.flatten_all()?)?;
        Ok(loss.affine(ctx.loss_scale, 0.0)?)
    }
}

impl LayeredModel for Toy {
    fn num_layers(&self) -> usize {
        self.layers
    }
    fn layer_name(&self, i: usize) -> String {
        format!("toy {i}")
    }
    fn build_layers(
        &self,
        range: Range<usize>,
        device: &Device,
        _: ParamSource<'_>,
    ) -> crate::Result<Vec<Box<dyn Layer>>> {
        let p = |name: &str, shape: &[usize], std| -> crate::Result<Var> {
            Ok(Var::from_tensor(&seeded_normal(
                self.seed, name, shape, std, device,
            )?)?)
        };
        // One Var for the tied embedding per call, as the model contract asks.
        let wte = p("wte", &[V, D], 0.5)?;
        let mut out: Vec<Box<dyn Layer>> = Vec::new();
        for i in range {
            if i == 0 {
                out.push(Box::new(Embed(wte.clone())));
            } else if i + 1 == self.layers {
                out.push(Box::new(Head(i, wte.clone())));
            } else {
                out.push(Box::new(Mid(
                    i,
                    p(&format!("h{i}.w"), &[D, D], 0.7)?,
                    p(&format!("h{i}.b"), &[D], 0.1)?,
                )));
            }
        }
        Ok(out)
    }
    fn tied_params(&self) -> Vec<TiedParam> {
        vec![TiedParam {
            name: "wte".into(),
            layers: vec![0, self.layers - 1],
        }]
    }
}

fn data(iteration: u64, mb: u64) -> crate::Result<(Tensor, Tensor)> {
    let (b, t) = (MICRO, 3usize);
    let tok = |k: usize| ((iteration as usize * 5 + mb as usize * 3 + k * k) % V) as u32;
    let ids: Vec<u32> = (0..b * t).map(tok).collect();
    let tg: Vec<u32> = (1..=b * t).map(tok).collect();
    Ok((
        Tensor::from_vec(ids, (b, t), &Device::Cpu)?,
        Tensor::from_vec(tg, (b, t), &Device::Cpu)?,
    ))
}

const B: u32 = 5;
/// Samples per microbatch: 3 so that 2 devices split it unevenly (2 + 1 rows).
const MICRO: usize = 3;
const STEPS: u64 = 3;
const CLIP: f64 = 0.1;
const LR: f64 = 0.05;

type Params = BTreeMap<String, Vec<f32>>;

fn flat(params: &[(String, Var)]) -> Params {
    params
        .iter()
        .map(|(n, v)| (n.clone(), v.flatten_all().unwrap().to_vec1().unwrap()))
        .collect()
}

/// The reference: one stage of all layers, the bin trainer's `train_step` loop.
fn single(model: &Toy) -> (Vec<f64>, Params) {
    let stage = Stage::new(
        model
            .build_layers(0..model.layers, &Device::Cpu, ParamSource::Init { seed: 0 })
            .unwrap(),
    )
    .unwrap();
    let mut opt = AdamW::new(AdamWConfig::default()).unwrap();
    let mut losses = Vec::new();
    for it in 0..STEPS {
        let mut grads = HashMap::new();
        let mut loss = 0.0;
        for k in 0..B {
            let (x, tg) = data(it, u64::from(k)).unwrap();
            let ctx = ForwardCtx {
                targets: Some(&tg),
                loss_scale: 1.0 / f64::from(B),
                train: true,
                dropout_key: DropoutKey::default(),
                rows: None,
                dtype: candle_core::DType::F32,
            };
            let fwd = stage.forward(&x, &ctx).unwrap();
            loss += f64::from(fwd.output.to_scalar::<f32>().unwrap());
            accumulate(&mut grads, stage.backward(fwd, None).unwrap().params).unwrap();
        }
        let norm = crate::optim::clip_grad_norm(&mut grads, CLIP).unwrap();
        assert!(
            it > 0 || norm > CLIP,
            "the test must exercise clipping (norm {norm})"
        );
        opt.step(&stage.params(), &grads, LR).unwrap();
        losses.push(loss);
    }
    (losses, flat(&stage.params()))
}

/// Every rank of `layout` trained `STEPS` steps (with activation recomputation if `recompute`)
/// under `schedule`.
fn distributed(
    model: &Toy,
    layout: Layout,
    recompute: bool,
    schedule: Schedule,
) -> Vec<(Vec<f64>, Params)> {
    let world = layout.ranks().len();
    let comms = LocalNetwork::new(world, 0).communicators(Tuning::default());
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let layout = layout.clone();
                s.spawn(move || {
                    let cfg = StageConfig {
                        seed: 0,
                        microbatch_size: MICRO as u32,
                        timeout: Duration::from_secs(20),
                        bucket_elems: super::BUCKET_ELEMS,
                        dtype: candle_core::DType::F32,
                        recompute,
                        schedule,
                    };
                    let w = StageRunner::new(
                        model,
                        &layout,
                        rank,
                        &Device::Cpu,
                        ParamSource::Init { seed: 0 },
                        cfg,
                    )
                    .unwrap();
                    let mut opt = AdamW::new(AdamWConfig::default()).unwrap();
                    let mut losses = Vec::new();
                    for it in 0..STEPS {
                        let r = w
                            .train_step(&comm, it, &mut data, &mut opt, LR, Some(CLIP))
                            .unwrap();
                        losses.push(r.loss);
                    }
                    (losses, flat(&w.params()))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Every rank's losses and parameters within 1e-5 of the single process's (`what` names the
/// run in a failure).
fn assert_like_single(
    ranks: &[(Vec<f64>, Params)],
    want_losses: &[f64],
    want: &Params,
    what: &str,
) {
    for (rank, (losses, params)) in ranks.iter().enumerate() {
        for (a, b) in losses.iter().zip(want_losses) {
            assert!(
                (a - b).abs() <= 1e-5,
                "rank {rank} ({what}): loss {a} vs {b}"
            );
        }
        for (name, v) in params {
            let d = max_diff(v, &want[name]);
            assert!(d <= 1e-5, "rank {rank} ({what}): `{name}` differs by {d}");
        }
    }
}

#[test]
fn heterogeneous_pipelines_match_the_single_process_step() {
    let model = Toy { layers: 6, seed: 3 };
    let (want_losses, want) = single(&model);
    let st = StageSpec::single;
    let layout = Layout::new(
        6,
        B,
        vec![
            PipelineSpec {
                stages: vec![st(0..3, 0), st(3..6, 1)],
                microbatches: 0..2,
            },
            PipelineSpec {
                stages: vec![st(0..2, 2), st(2..3, 3), st(3..6, 4)],
                microbatches: 2..5,
            },
        ],
    )
    .unwrap();
    // With activation recomputation too, and under ZB-H1: the same values.
    let runs = [
        (false, Schedule::OneFOneB),
        (true, Schedule::OneFOneB),
        (false, Schedule::ZbH1),
        (true, Schedule::ZbH1),
    ];
    for (recompute, schedule) in runs {
        let mut seen = std::collections::BTreeSet::new();
        let ranks = distributed(&model, layout.clone(), recompute, schedule);
        for (rank, (losses, params)) in ranks.into_iter().enumerate() {
            for (a, b) in losses.iter().zip(&want_losses) {
                assert!(
                    (a - b).abs() <= 1e-5,
                    "rank {rank} ({recompute}, {schedule}): loss {a} vs {b}"
                );
            }
            for (name, v) in &params {
                let d = max_diff(v, &want[name]);
                assert!(
                    d <= 1e-5,
                    "rank {rank} ({recompute}, {schedule}): `{name}` differs by {d}"
                );
                seen.insert(name.clone());
            }
        }
        assert_eq!(seen.len(), want.len(), "every parameter is held somewhere");
    }
    // The reference moved away from the initial values, so equal results are not vacuous.
    let init = Stage::new(
        model
            .build_layers(0..6, &Device::Cpu, ParamSource::Init { seed: 0 })
            .unwrap(),
    )
    .unwrap();
    let init = flat(&init.params());
    assert!(max_diff(&init["h2.w"], &want["h2.w"]) > 1e-3);
    assert!(max_diff(&init["wte"], &want["wte"]) > 1e-3);
}

#[test]
fn a_single_stage_pipeline_holds_the_tied_parameter_once() {
    let model = Toy { layers: 4, seed: 9 };
    let (want_losses, want) = single(&model);
    let st = StageSpec::single;
    let layout = Layout::new(
        4,
        B,
        vec![
            PipelineSpec {
                stages: vec![st(0..4, 0)],
                microbatches: 0..1,
            },
            PipelineSpec {
                stages: vec![st(0..1, 1), st(1..4, 2)],
                microbatches: 1..5,
            },
        ],
    )
    .unwrap();
    // Under both schedules: the same values.
    for schedule in [Schedule::OneFOneB, Schedule::ZbH1] {
        let ranks = distributed(&model, layout.clone(), false, schedule);
        assert_like_single(&ranks, &want_losses, &want, &schedule.to_string());
    }
}

#[test]
fn a_lost_stage_fails_every_rank_instead_of_hanging() {
    let model = Toy { layers: 6, seed: 3 };
    let st = StageSpec::single;
    let layout = Layout::new(
        6,
        B,
        vec![
            PipelineSpec {
                stages: vec![st(0..3, 0), st(3..6, 1)],
                microbatches: 0..2,
            },
            PipelineSpec {
                stages: vec![st(0..2, 2), st(2..3, 3), st(3..6, 4)],
                microbatches: 2..5,
            },
        ],
    )
    .unwrap();
    let net = LocalNetwork::new(5, 0);
    let comms = net.communicators(Tuning::default());
    // The middle stage of pipeline 1 dies before the step: its neighbours lose it at once,
    // and pipeline 0 learns of it through the gradient all-reduce with pipeline 1.
    net.drop_rank(3);
    let results: Vec<crate::Result<SyncReport>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .filter(|(rank, _)| *rank != 3)
            .map(|(rank, comm)| {
                let layout = layout.clone();
                let model = &model;
                s.spawn(move || {
                    let cfg = StageConfig {
                        seed: 0,
                        microbatch_size: MICRO as u32,
                        timeout: Duration::from_secs(10),
                        bucket_elems: super::BUCKET_ELEMS,
                        dtype: candle_core::DType::F32,
                        recompute: false,
                        schedule: Schedule::OneFOneB,
                    };
                    let w = StageRunner::new(
                        model,
                        &layout,
                        rank,
                        &Device::Cpu,
                        ParamSource::Init { seed: 0 },
                        cfg,
                    )?;
                    let mut opt = AdamW::new(AdamWConfig::default())?;
                    let r = w.train_step(&comm, 0, &mut data, &mut opt, LR, Some(CLIP));
                    if r.is_err() {
                        comm.abort();
                    }
                    r
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(results.len(), 4);
    for r in results {
        match r {
            Err(crate::Error::Comm(_)) => {}
            other => panic!("expected a comm error, got {other:?}"),
        }
    }
}

#[test]
fn multi_device_stages_recut_rows_and_match_the_single_process_step() {
    let model = Toy { layers: 6, seed: 5 };
    let (want_losses, want) = single(&model);
    let st = |layers, ranks: &[usize]| StageSpec {
        layers,
        ranks: ranks.to_vec(),
    };
    // g = 2 -> 1 (rows 2 + 1 gathered), and 1 -> 3 -> 2 (rows cut 1+1+1, re-cut 2+1).
    let layout = Layout::new(
        6,
        B,
        vec![
            PipelineSpec {
                stages: vec![st(0..3, &[0, 1]), st(3..6, &[2])],
                microbatches: 0..2,
            },
            PipelineSpec {
                stages: vec![st(0..2, &[3]), st(2..4, &[4, 5, 6]), st(4..6, &[7, 8])],
                microbatches: 2..5,
            },
        ],
    )
    .unwrap();
    assert_eq!(layout.holders(0), vec![0, 1, 3]);
    // Under both schedules: the same values.
    for schedule in [Schedule::OneFOneB, Schedule::ZbH1] {
        let ranks = distributed(&model, layout.clone(), false, schedule);
        assert_like_single(&ranks, &want_losses, &want, &schedule.to_string());
    }
}

#[test]
fn rejects_a_stage_with_more_devices_than_microbatch_rows() {
    let model = Toy { layers: 4, seed: 1 };
    let layout = Layout::new(
        4,
        1,
        vec![PipelineSpec {
            stages: vec![StageSpec {
                layers: 0..4,
                ranks: vec![0, 1],
            }],
            microbatches: 0..1,
        }],
    )
    .unwrap();
    let cfg = |b| StageConfig {
        seed: 0,
        microbatch_size: b,
        timeout: Duration::from_secs(1),
        bucket_elems: super::BUCKET_ELEMS,
        dtype: candle_core::DType::F32,
        recompute: false,
        schedule: Schedule::OneFOneB,
    };
    let build = |b| {
        StageRunner::new(
            &model,
            &layout,
            1,
            &Device::Cpu,
            ParamSource::Init { seed: 0 },
            cfg(b),
        )
    };
    assert!(build(1).is_err());
    assert!(build(0).is_err());
    let w = build(2).unwrap();
    assert_eq!(
        w.position(),
        Position {
            pipeline: 0,
            stage: 0,
            device: 1
        }
    );
    assert!(StageRunner::new(
        &model,
        &layout,
        2,
        &Device::Cpu,
        ParamSource::Init { seed: 0 },
        cfg(2)
    )
    .is_err());
}

/// A template of `nodes` nodes with 2 devices each from `(layers, node, first_device, g)`.
fn template(nodes: u32, stages: &[(Range<usize>, u32, u32, u32)]) -> planning::Template {
    let stages: Vec<planning::Stage> = stages
        .iter()
        .map(|(l, node, first_device, devices)| planning::Stage {
            layer_start: l.start,
            layer_end: l.end,
            node: *node,
            first_device: *first_device,
            devices: *devices,
            forward_ns: 1_000,
            backward_ns: 2_000,
            p2p_ns: 0,
            memory_bytes: 0,
        })
        .collect();
    let n = stages.len() as u64;
    planning::Template {
        nodes,
        devices_per_node: 2,
        stages,
        microbatches: 4,
        t1_ns: 3_000 * n,
        t3_ns: 3_000,
        bottleneck_stage: n as usize - 1,
        bottleneck_ns: 3_000,
        iteration_ns: 3_000 * (n + 3),
        peak_memory_bytes: 0,
    }
}

#[test]
fn a_plan_of_heterogeneous_multi_device_pipelines_trains_like_one_process() {
    let set = planning::TemplateSet {
        min_nodes: 2,
        templates: vec![
            template(2, &[(0..3, 0, 0, 2), (3..6, 1, 0, 2)]),
            template(
                3,
                &[
                    (0..2, 0, 0, 1),
                    (2..3, 0, 1, 1),
                    (3..5, 1, 0, 2),
                    (5..6, 2, 0, 2),
                ],
            ),
        ],
        layer_state_bytes: vec![0; 6],
    };
    let job = planning::JobSpec {
        fault_threshold: 1,
        microbatch_size: MICRO as u32,
        global_microbatches: B,
        state_bytes_per_param_byte: 4,
        template_microbatches: planning::TemplateMicrobatches::Auto,
    };
    let plan =
        planning::plan_with_pipelines(&set, &job, 2, 0, vec![vec![0, 1], vec![2, 3, 4]]).unwrap();
    let layout = Layout::from_plan(&plan, 6).unwrap();
    let ranks: Vec<Vec<Vec<usize>>> = layout
        .pipelines()
        .iter()
        .map(|p| p.stages.iter().map(|s| s.ranks.clone()).collect())
        .collect();
    assert_eq!(
        ranks,
        vec![
            vec![vec![0, 1], vec![2, 3]],
            vec![vec![4], vec![5], vec![6, 7], vec![8, 9]]
        ]
    );
    assert!(Layout::from_plan(&plan, 7).is_err());

    let model = Toy {
        layers: 6,
        seed: 21,
    };
    let (want_losses, want) = single(&model);
    // Under both schedules: the same values.
    for schedule in [Schedule::OneFOneB, Schedule::ZbH1] {
        let ranks = distributed(&model, layout.clone(), false, schedule);
        assert_like_single(&ranks, &want_losses, &want, &schedule.to_string());
    }
}

/// The layer-by-layer backward gives the one-call backward's gradients (the tied `wte` of a
/// stage holding layers 0 and L-1 summed over both layers), layer by layer from the top.
#[test]
fn layered_backward_matches_the_one_call_backward() {
    let model = Toy { layers: 5, seed: 4 };
    let (ids, targets) = data(0, 0).unwrap();
    for range in [0..5, 1..4, 0..3, 2..5] {
        let stage = Stage::new(
            model
                .build_layers(range.clone(), &Device::Cpu, ParamSource::Init { seed: 4 })
                .unwrap(),
        )
        .unwrap();
        let last = range.end == 5;
        let ctx = ForwardCtx {
            targets: last.then_some(&targets),
            loss_scale: 0.25,
            ..ForwardCtx::inference()
        };
        let x = if range.start == 0 {
            ids.clone()
        } else {
            seeded_normal(
                1,
                "x",
                &[ids.dims()[0], ids.dims()[1], D],
                1.0,
                &Device::Cpu,
            )
            .unwrap()
        };
        let whole_fwd = stage.forward(&x, &ctx).unwrap();
        let up = (!last)
            .then(|| seeded_normal(2, "g", whole_fwd.output.dims(), 1.0, &Device::Cpu).unwrap());
        let whole = stage.backward(whole_fwd, up.as_ref()).unwrap();

        let fwd = stage.forward_layered(&x, &ctx).unwrap();
        let mut order = Vec::new();
        let mut grads = HashMap::new();
        let input = stage
            .backward_layers(fwd, up.as_ref(), &mut |layer, g| {
                order.push(layer);
                accumulate(&mut grads, g)
            })
            .unwrap();
        assert_eq!(order, range.clone().rev().collect::<Vec<_>>(), "{range:?}");
        assert_eq!(grads.len(), whole.params.len(), "{range:?}");
        for (name, g) in &whole.params {
            let d = max_diff(&vec1(g), &vec1(&grads[name]));
            assert!(d <= 1e-6, "{range:?}: `{name}` differs by {d}");
        }
        match (&whole.input, &input) {
            (None, None) => assert_eq!(range.start, 0),
            (Some(a), Some(b)) => assert!(max_diff(&vec1(a), &vec1(b)) <= 1e-6, "{range:?}"),
            _ => panic!("{range:?}: input gradients disagree on existing"),
        }
        // The one-call backward of a layered pass sums the layers' shares the same way.
        let again = stage
            .backward(stage.forward_layered(&x, &ctx).unwrap(), up.as_ref())
            .unwrap();
        for (name, g) in &whole.params {
            assert!(
                max_diff(&vec1(g), &vec1(&again.params[name])) <= 1e-6,
                "`{name}`"
            );
        }
    }
}

fn vec1(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}
