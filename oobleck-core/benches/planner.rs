//! Planner speed: templates for 96 layers (n = 1..64, G = 1 and 8), instantiation at
//! N = 64/256/1024 with f = 3, one reconfiguration decision at N = 1024.
//!
//! `cargo bench -p oobleck-core --bench planner`
//! Targets (2-core machine): all 96-layer templates < 100 ms, instantiation at 1,024 nodes
//! < 1 s, a reconfiguration decision < 10 ms.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use oobleck_core::planning::{
    analytical_profile, generate_templates, gradient_sync_ns, instantiate_with_sizes, DeviceSpec,
    Dtype, JobSpec, TemplateMicrobatches, TransformerShape,
};
use oobleck_core::reconfig::decide;

/// GPT-3 175B has 96 blocks (98 planner layers); a 94-block model gives exactly 96 layers.
const SHAPE_96: TransformerShape = TransformerShape::gpt(94, 4096, 32, 50257, 2048);

fn job(f: u32, b: u32, global: u32) -> JobSpec {
    JobSpec {
        fault_threshold: f,
        microbatch_size: b,
        global_microbatches: global,
        state_bytes_per_param_byte: 8,
        template_microbatches: TemplateMicrobatches::Auto,
    }
}

fn templates(c: &mut Criterion) {
    let dev = DeviceSpec::named("h200-141gb").expect("device");
    let mut group = c.benchmark_group("templates_96_layers_n1_to_64");
    group.sample_size(10);
    for g in [1u32, 8] {
        let profile = analytical_profile("bench-96", &SHAPE_96, dev, 1, Dtype::Bf16);
        let cluster = dev.cluster(g);
        // f = 0 and N = 64: templates for every n in [n0, 64].
        let j = job(0, 1, 256);
        group.bench_with_input(BenchmarkId::new("G", g), &g, |b, _| {
            b.iter(|| generate_templates(&profile, &cluster, &j, 64).expect("templates"))
        });
    }
    group.finish();
}

fn instantiation(c: &mut Criterion) {
    let dev = DeviceSpec::named("a100-80gb").expect("device");
    let profile = analytical_profile(
        "gpt3-6.7b",
        &TransformerShape::gpt(32, 4096, 32, 50257, 2048),
        dev,
        1,
        Dtype::Bf16,
    );
    let cluster = dev.cluster(1);
    let mut group = c.benchmark_group("instantiate_f3");
    group.sample_size(10);
    for n in [64u32, 256, 1024] {
        let j = job(3, 1, 4 * n);
        let set = generate_templates(&profile, &cluster, &j, n).expect("templates");
        let nodes: Vec<u32> = (0..n).collect();
        let sync = gradient_sync_ns(&profile, &cluster);
        group.bench_with_input(BenchmarkId::new("N", n), &n, |b, _| {
            b.iter(|| instantiate_with_sizes(&set, &j, 1, sync, &nodes, 0).expect("plan"))
        });
    }
    group.finish();
}

fn reconfiguration(c: &mut Criterion) {
    let dev = DeviceSpec::named("a100-80gb").expect("device");
    let profile = analytical_profile(
        "gpt3-6.7b",
        &TransformerShape::gpt(32, 4096, 32, 50257, 2048),
        dev,
        1,
        Dtype::Bf16,
    );
    let cluster = dev.cluster(1);
    let n = 1024u32;
    let j = job(3, 1, 4 * n);
    let set = generate_templates(&profile, &cluster, &j, n).expect("templates");
    let nodes: Vec<u32> = (0..n).collect();
    let plan = instantiate_with_sizes(&set, &j, 1, gradient_sync_ns(&profile, &cluster), &nodes, 0)
        .expect("plan");
    let mut group = c.benchmark_group("reconfigure_N1024");
    group.sample_size(20);
    group.bench_function("lose_3_nodes", |b| {
        b.iter(|| decide(&plan, &[5, 517, 1000], &[]).expect("decision"))
    });
    group.finish();
}

criterion_group!(benches, templates, instantiation, reconfiguration);
criterion_main!(benches);
