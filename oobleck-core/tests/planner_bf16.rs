//! The planner under `--precision bf16`: 18 B of training state per parameter (f32 master,
//! bf16 working copy, f32 gradient, f32 Adam m and v) against fp32's 16, and half the
//! activations. A long-context model whose activations dominate needs fewer nodes per
//! pipeline in bf16 (gpt3-1.3b on one-A100-40GB nodes: 1 instead of 2); the state of every
//! layer is 18/16 of fp32's.

use oobleck_core::planning::{
    analytical_profile, generate_templates, DeviceSpec, Dtype, JobSpec, TemplateMicrobatches,
    TransformerShape,
};

fn job(dtype: Dtype) -> JobSpec {
    JobSpec {
        fault_threshold: 0,
        microbatch_size: 1,
        global_microbatches: 64,
        state_bytes_per_param_byte: dtype.state_bytes_per_param_byte(),
        template_microbatches: TemplateMicrobatches::Auto,
    }
}

#[test]
fn bf16_plans_more_state_and_fewer_nodes_for_an_activation_bound_model() {
    // gpt3-1.3b at its 2048-token context on nodes of one A100-40GB: 0.96 GB of f32
    // activations per block and sample against 0.4 GB of f32 training state per block.
    let shape = TransformerShape::gpt(24, 2048, 16, 50257, 2048);
    let dev = DeviceSpec::named("a100-40gb").expect("known");
    let cluster = dev.cluster(1);
    let sets: Vec<_> = [Dtype::F32, Dtype::Bf16]
        .into_iter()
        .map(|d| {
            let p = analytical_profile("gpt3-1.3b", &shape, dev, 1, d);
            generate_templates(&p, &cluster, &job(d), 16).expect("plannable")
        })
        .collect();
    let (f32s, bf16) = (&sets[0], &sets[1]);
    for (a, b) in f32s.layer_state_bytes.iter().zip(&bf16.layer_state_bytes) {
        assert_eq!(a * 18, b * 16, "state bytes of a layer: fp32 {a}, bf16 {b}");
    }
    eprintln!(
        "fewest nodes per pipeline: fp32 {}, bf16 {}",
        f32s.min_nodes, bf16.min_nodes
    );
    assert!(
        bf16.min_nodes < f32s.min_nodes,
        "bf16 needs {} nodes, fp32 {}",
        bf16.min_nodes,
        f32s.min_nodes
    );
}
