//! Every preset is usable: its config validates and its layer list has the planner's layer
//! count; where its first and last layers fit a small CPU budget they are built with seeded
//! weights and run (token ids -> embedding -> LM head -> a loss near ln(vocab)); where they do
//! not, the planner makes pipeline templates for it on A100s, as `oobleck plan` would. A
//! preset whose shapes do not connect, whose config is invalid or that no cluster could hold
//! fails here.

use candle_core::{Device, Tensor};
use oobleck_core::model::{ForwardCtx, ParamSource, Stage};
use oobleck_core::planning::{
    analytical_profile, template::generate_templates, DeviceSpec, Dtype, JobSpec,
    TemplateMicrobatches,
};
use oobleck_models::{preset_names, ModelConfig};

/// Largest first or last layer (parameters) built on the CPU. 32M takes in opt-350m (28.8M:
/// a 512-wide embedding of 50272 ids, 2050 positions and both projections), the one large
/// preset with post-LN blocks and projected embeddings; the whole test takes about 4 s on 2
/// cores. The wider presets are planned instead.
const BUILD_LIMIT: usize = 32_000_000;

/// Context of the planned presets. At their full 2048 tokens the 66B and 175B presets do not
/// fit an 80 GB device even with one layer per stage: under 1F1B the first of ~100 stages holds
/// the activations of as many microbatches, so without activation recomputation `oobleck plan`
/// says "the model does not fit" there (with `--recompute` they plan); that is memory, not a
/// broken preset.
const PLAN_SEQ_LEN: usize = 512;

/// Parameters of layer 0 (token and position embeddings, OPT's projection) and of the last
/// layer (a tied head holds the token embedding again, plus the final LayerNorm).
fn edge_layer_params(cfg: &ModelConfig) -> usize {
    let (_, d, _, _) = cfg.dims();
    let width = match cfg {
        ModelConfig::Gpt(_) => d,
        ModelConfig::Opt(c) => c.embed_dim(),
    };
    cfg.vocab_size() * width + cfg.max_seq_len() * d + 2 * d * width
}

/// Builds layers 0 and L-1 and runs 4 tokens through them (the blocks in between are skipped:
/// both sides of them are `[b, t, hidden]`); returns the loss.
fn run_edges(cfg: &ModelConfig) -> f32 {
    let model = cfg.build().unwrap();
    let last = model.num_layers() - 1;
    let build = |r: std::ops::Range<usize>| {
        Stage::new(
            model
                .build_layers(r, &Device::Cpu, ParamSource::Init { seed: 1 })
                .unwrap(),
        )
        .unwrap()
    };
    let (first, head) = (build(0..1), build(last..last + 1));
    let ids = Tensor::new(&[[464u32, 2068, 7586, 21831]], &Device::Cpu).unwrap();
    let hidden = first
        .forward(&ids, &ForwardCtx::inference())
        .unwrap()
        .output;
    assert_eq!(hidden.dims(), [1, 4, cfg.dims().1]);
    let targets = Tensor::new(&[[2068u32, 7586, 21831, 18045]], &Device::Cpu).unwrap();
    let ctx = ForwardCtx {
        targets: Some(&targets),
        ..ForwardCtx::inference()
    };
    head.forward(&hidden, &ctx)
        .unwrap()
        .output
        .to_scalar::<f32>()
        .unwrap()
}

/// Pipeline templates for the preset on up to 64 nodes of 8 A100-80GB (bf16, as `oobleck plan`
/// defaults) for samples of `PLAN_SEQ_LEN` tokens; returns the fewest nodes a pipeline needs.
fn plan(name: &str, cfg: &ModelConfig) -> u32 {
    let shape = cfg
        .planner_shape(PLAN_SEQ_LEN.min(cfg.max_seq_len()))
        .unwrap();
    let device = DeviceSpec::named("a100-80gb").unwrap();
    let profile = analytical_profile(name, &shape, device, 1, Dtype::Bf16);
    assert_eq!(profile.layers.len(), cfg.num_layers(), "{name}");
    let job = JobSpec {
        fault_threshold: 0,
        microbatch_size: 1,
        global_microbatches: 64,
        state_bytes_per_param_byte: Dtype::Bf16.state_bytes_per_param_byte(),
        template_microbatches: TemplateMicrobatches::Auto,
    };
    let set = generate_templates(&profile, &device.cluster(8), &job, 64)
        .unwrap_or_else(|e| panic!("{name}: no pipeline template on 64 nodes: {e}"));
    assert!(!set.templates.is_empty(), "{name}: no template");
    set.min_nodes
}

#[test]
fn every_preset_builds_its_edge_layers_or_plans() {
    let (mut built, mut planned) = (Vec::new(), Vec::new());
    for name in preset_names() {
        let cfg = ModelConfig::preset(name).unwrap();
        let model = cfg.build().unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(model.num_layers(), cfg.num_layers(), "{name}");
        if edge_layer_params(&cfg) <= BUILD_LIMIT {
            let loss = run_edges(&cfg);
            let uniform = (cfg.vocab_size() as f32).ln();
            assert!(
                loss.is_finite() && (loss - uniform).abs() < 1.0,
                "{name}: loss {loss}, a fresh model is near ln(vocab) = {uniform}"
            );
            built.push(name);
        } else {
            planned.push(format!("{name} ({} nodes)", plan(name, &cfg)));
        }
    }
    eprintln!("built on the CPU: {built:?}\nplanned: {planned:?}");
    // The tiny preset of each family and OPT's post-LN variant are the ones CI trains.
    for tiny in ["gpt-tiny", "opt-tiny", "opt-tiny-postln"] {
        assert!(built.contains(&tiny), "{tiny} must build: {built:?}");
    }
    assert!(
        planned.iter().any(|p| p.starts_with("opt-175b")),
        "{planned:?}"
    );
}

#[test]
fn the_post_ln_variant_is_shaped_as_opt_350m() {
    let (ModelConfig::Opt(tiny), ModelConfig::Opt(big)) = (
        ModelConfig::preset("opt-tiny-postln").unwrap(),
        ModelConfig::preset("opt-350m").unwrap(),
    ) else {
        panic!("both are OPT presets");
    };
    assert!(!tiny.do_layer_norm_before && !big.do_layer_norm_before);
    assert_eq!(tiny.embed_dim() * 2, tiny.hidden_size);
    assert_eq!(big.embed_dim() * 2, big.hidden_size);
    let names = preset_names();
    let at = |n: &str| names.iter().position(|&x| x == n).unwrap();
    assert_eq!(at("opt-tiny-postln"), at("opt-tiny") + 1);
}
