use std::ops::Range;

use super::*;
use crate::execution::{PipelineSpec, StageSpec};
use crate::model::{Layer, TiedParam};
use crate::optim::{AdamWConfig, LrSchedule};
use crate::planning::{Pipeline, Plan, Stage, Template};
use crate::runtime::spec::{DataPlane, JobConfig, TrainingSpec};

/// The shape of gpt-tiny (embedding, 2 blocks, head; the embedding tied to the head) with no
/// layers behind it: collective groups and plan checks only look at the shape.
struct Shape {
    layers: usize,
}

impl LayeredModel for Shape {
    fn num_layers(&self) -> usize {
        self.layers
    }
    fn layer_name(&self, i: usize) -> String {
        format!("layer {i}")
    }
    fn build_layers(
        &self,
        range: Range<usize>,
        _: &Device,
        _: ParamSource<'_>,
    ) -> crate::Result<Vec<Box<dyn Layer>>> {
        Err(crate::Error::workload(format!(
            "a shape has no layers to build ({range:?})"
        )))
    }
    fn tied_params(&self) -> Vec<TiedParam> {
        vec![TiedParam {
            name: "wte".into(),
            layers: vec![0, self.layers - 1],
        }]
    }
}

#[test]
fn collective_groups_cover_buckets_tied_weights_and_everyone_once() {
    let model = Shape { layers: 4 };
    let n = model.num_layers();
    // Pipeline 0: one stage on rank 0; pipeline 1: two stages (ranks 1 and 2).
    let layout = Layout::new(
        n,
        4,
        vec![
            PipelineSpec {
                stages: vec![StageSpec::single(0..n, 0)],
                microbatches: 0..2,
            },
            PipelineSpec {
                stages: vec![StageSpec::single(0..2, 1), StageSpec::single(2..n, 2)],
                microbatches: 2..4,
            },
        ],
    )
    .expect("layout");
    let groups = collective_groups(&layout, &model).expect("groups");
    // Layers 0-1 are held by ranks 0 and 1, the rest by 0 and 2; the tied embedding spans
    // ranks 0, 1 and 2, which is also everyone.
    assert_eq!(groups, vec![vec![0, 1], vec![0, 1, 2], vec![0, 2]]);
}

fn training() -> TrainingSpec {
    TrainingSpec {
        steps: 3,
        seed: 7,
        microbatch_size: 2,
        global_microbatches: 4,
        nodes: 2,
        devices_per_node: 1,
        fault_threshold: 1,
        device: "cpu".into(),
        pipeline_nodes: None,
        optimizer: AdamWConfig::default(),
        lr: LrSchedule::constant(1e-3).expect("lr"),
        grad_clip: Some(1.0),
        checkpoint_every: 0,
        eval_every: 0,
        data_plane: DataPlane::Tcp,
        inject_failures: Vec::new(),
        compute: Default::default(),
        precision: Default::default(),
        recompute: false,
        schedule: Default::default(),
        device_memory_bytes: None,
    }
}

fn stage(layers: Range<usize>, node: u32) -> Stage {
    Stage {
        layer_start: layers.start,
        layer_end: layers.end,
        node,
        first_device: 0,
        devices: 1,
        forward_ns: 1,
        backward_ns: 1,
        p2p_ns: 0,
        memory_bytes: 1,
    }
}

/// Two one-node pipelines of a 4-layer model (one stage each), two microbatches each.
fn assignment() -> WorkerAssignment {
    let template = Template {
        nodes: 1,
        devices_per_node: 1,
        stages: vec![stage(0..4, 0)],
        microbatches: 2,
        t1_ns: 2,
        t3_ns: 2,
        bottleneck_stage: 0,
        bottleneck_ns: 2,
        iteration_ns: 4,
        peak_memory_bytes: 1,
    };
    let pipeline = |id: u32| Pipeline {
        id,
        template_nodes: 1,
        nodes: vec![id],
        first_rank: id,
        microbatches: 2,
        predicted_ns: 4,
    };
    WorkerAssignment {
        generation: 1,
        rank: 1,
        node: 1,
        plan: Plan {
            generation: 1,
            devices_per_node: 1,
            fault_threshold: 1,
            global_microbatches: 4,
            min_nodes: 1,
            templates: vec![template],
            pipelines: vec![pipeline(0), pipeline(1)],
            compute_ns: 4,
            sync_ns: 0,
            sync_model_ns: 0,
            layer_state_bytes: vec![1; 4],
            iteration_ns: 4,
        },
        host: "127.0.0.1".into(),
        run_dir: "/runs/x".into(),
        job: JobConfig {
            training: training(),
            workload: serde_json::json!({ "preset": "tiny" }),
            watch: Default::default(),
            save_wait_s: crate::runtime::DEFAULT_SAVE_WAIT_S,
        },
        nccl_id: None,
        key: oobleck_comm::SecretKey::random(),
        source: crate::runtime::wire::pipe::StateSource::Peers {
            step: 3,
            copies: vec![crate::reconfig::LayerCopy {
                layer: 2,
                from_rank: 0,
                to_rank: 1,
                from_node: 0,
                to_node: 1,
                bytes: 64,
            }],
            donors: vec![crate::reconfig::Donor {
                node: 2,
                device: 0,
                rank: 2,
            }],
        },
        state_sink: "127.0.0.1:7100".into(),
        state_key: oobleck_comm::SecretKey::random(),
    }
}

#[test]
fn an_assignment_round_trips_as_one_json_line() {
    let a = assignment();
    let line = serde_json::to_string(&a).expect("json");
    assert!(!line.contains('\n'));
    assert_eq!(
        serde_json::from_str::<WorkerAssignment>(&line).expect("back"),
        a
    );
}

#[test]
fn a_plan_that_agrees_with_the_job_passes_and_lays_out() {
    let a = assignment();
    let model = Shape { layers: 4 };
    check_plan(&a, &model).expect("agrees");
    let layout = Layout::from_plan(&a.plan, 4).expect("layout");
    assert_eq!(layout.ranks(), vec![0, 1]);
}

#[test]
fn a_plan_for_another_batch_devices_or_model_is_refused_with_both_numbers() {
    let model = Shape { layers: 4 };
    let mut a = assignment();
    a.plan.global_microbatches = 8;
    let e = check_plan(&a, &model).expect_err("batch").to_string();
    assert!(
        e.contains("rank 1: the plan has 8 microbatches per step, but this worker's job has 4"),
        "{e}"
    );
    assert!(e.contains("TrainingSpec::job_spec"), "{e}");

    let mut a = assignment();
    a.job.training.devices_per_node = 2;
    let e = check_plan(&a, &model).expect_err("devices").to_string();
    assert!(e.contains("the plan has 1 devices per node"), "{e}");

    let e = check_plan(&assignment(), &Shape { layers: 6 })
        .expect_err("layers")
        .to_string();
    assert!(
        e.contains("the plan has 4 layers, but this worker's job has 6"),
        "{e}"
    );
    assert!(e.contains("the workload the factory builds"), "{e}");
}

#[test]
fn the_rendezvous_must_name_every_rank_once_with_an_ip_and_port() {
    let r = |rank, addr: &str| Rendezvous {
        rank,
        addr: addr.into(),
    };
    let addrs = peer_addrs(0, &[r(1, "127.0.0.1:2"), r(0, "127.0.0.1:1")], 2).expect("ok");
    assert_eq!(
        addrs,
        vec![
            "127.0.0.1:1".parse::<SocketAddr>().expect("literal"),
            "127.0.0.1:2".parse().expect("literal")
        ]
    );
    let err = |list: &[Rendezvous]| peer_addrs(0, list, 2).expect_err("bad").to_string();
    assert!(err(&[r(0, "127.0.0.1:1")]).contains("no address for rank 1"));
    assert!(err(&[r(0, "127.0.0.1:1"), r(0, "127.0.0.1:1")]).contains("lists rank 0 twice"));
    assert!(err(&[r(2, "127.0.0.1:1")]).contains("names rank 2 of 2"));
    assert!(err(&[r(0, "somewhere")]).contains("is not IP:PORT"));
}
