//! Tests of `workload/`: the GPT workload against the dataset it wraps, its refusals, its
//! profile and checkpoint files.

use super::*;
use crate::data::{Gpt2Tokenizer, EMBEDDED_CORPUS};
use oobleck_core::planning::analytical_profile;

const SEED: u64 = 7;

/// A temp folder holding `corpus.txt`: the first `bytes` of the shipped corpus (whole
/// lines), so a test tokenizes a few kB, not 5 MB.
fn small_corpus(bytes: usize) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let end = EMBEDDED_CORPUS[..bytes].rfind('\n').expect("a line") + 1;
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, &EMBEDDED_CORPUS[..end]).expect("write corpus");
    (dir, corpus)
}

/// The job's batch of the tests: 3 microbatches of 2 samples.
const BATCH: BatchShape = BatchShape {
    microbatch_size: 2,
    global_microbatches: 3,
};

/// A one-process CPU job of [`BATCH`].
fn job() -> TrainingSpec {
    TrainingSpec {
        steps: 1,
        seed: 0,
        microbatch_size: BATCH.microbatch_size,
        global_microbatches: BATCH.global_microbatches,
        nodes: 1,
        devices_per_node: 1,
        fault_threshold: 0,
        device: "cpu".into(),
        pipeline_nodes: None,
        optimizer: Default::default(),
        lr: oobleck_core::optim::LrSchedule::constant(1e-3).expect("lr"),
        grad_clip: None,
        checkpoint_every: 0,
        eval_every: 0,
        data_plane: Default::default(),
        inject_failures: Vec::new(),
        compute: Default::default(),
        precision: Default::default(),
        recompute: false,
        schedule: Default::default(),
        device_memory_bytes: None,
    }
}

/// gpt-tiny (2 blocks of width 64) on `corpus`, 16 tokens a sample (with [`BATCH`]: 2 samples
/// x 3 microbatches).
fn tiny(corpus: &std::path::Path) -> GptWorkloadConfig {
    GptWorkloadConfig {
        model: "gpt-tiny".into(),
        seq_len: 16,
        eval_batches: 2,
        data: crate::data::DataSpec::path(corpus),
        ..GptWorkloadConfig::default()
    }
}

fn ids(t: &Tensor) -> Vec<Vec<u32>> {
    t.to_vec2::<u32>().expect("a [b, t] u32 tensor")
}

/// The message of `GptWorkload::new(cfg, BATCH)`, which must fail.
fn refusal(cfg: GptWorkloadConfig) -> String {
    refusal_of(cfg, BATCH)
}

/// The message of `GptWorkload::new(cfg, batch)`, which must fail.
fn refusal_of(cfg: GptWorkloadConfig, batch: BatchShape) -> String {
    match GptWorkload::new(cfg, batch) {
        Ok(_) => panic!("the workload should have been refused"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn microbatches_are_the_datasets_across_an_epoch_boundary() {
    let (_dir, corpus) = small_corpus(20_000);
    let w = GptWorkload::new(tiny(&corpus), BATCH).expect("workload");
    let direct =
        Dataset::open_with(&corpus, Arc::new(Gpt2Tokenizer::embedded()), None).expect("dataset");
    let spec = w.batch_spec();
    let ipe = direct
        .split(Split::Train)
        .iterations_per_epoch(&spec)
        .unwrap();
    assert_eq!(w.iterations_per_epoch(), ipe);
    assert!(ipe >= 2, "the corpus gives {ipe} iterations per epoch");
    for step in [0, 1, ipe as u64 - 1, ipe as u64, ipe as u64 + 1] {
        let cursor = DataCursor::at_step(step, ipe);
        for k in 0..spec.num_microbatches {
            let b = direct
                .split(Split::Train)
                .microbatch_at(&spec, SEED, cursor, k)
                .unwrap();
            let (inp, tgt) = w.microbatch(SEED, step, k as u32, &Device::Cpu).unwrap();
            assert_eq!(inp.dims(), [2, 16]);
            assert_eq!(ids(&inp).concat(), b.inputs, "step {step} microbatch {k}");
            assert_eq!(ids(&tgt).concat(), b.targets, "step {step} microbatch {k}");
        }
    }
    // Another seed is another order.
    let a = w.microbatch(SEED, 0, 0, &Device::Cpu).unwrap().0;
    let b = w.microbatch(SEED + 1, 0, 0, &Device::Cpu).unwrap().0;
    assert_ne!(ids(&a), ids(&b));
    // The position, and the identity of the data that `--resume` compares.
    let next = serde_json::json!({
        "epoch": 1,
        "iteration": 1,
        "tokens_sha256": direct.tokens_sha256(),
    });
    assert_eq!(w.data_cursor(ipe as u64 + 1), next);
}

#[test]
fn the_factory_reads_the_config_back_from_json() {
    let (_dir, corpus) = small_corpus(20_000);
    let cfg = tiny(&corpus);
    let json = serde_json::to_value(&cfg).unwrap();
    let back: GptWorkloadConfig = serde_json::from_value(json.clone()).unwrap();
    assert_eq!(back, cfg);
    let w = GptWorkload::factory(&job(), &json).expect("factory");
    assert_eq!(w.name(), "gpt-tiny");
    assert_eq!(w.tokens_per_sample(), 16);
    let preset = ModelConfig::preset("gpt-tiny").unwrap();
    assert_eq!(w.num_params(), preset.num_params());
    assert_eq!(w.model().num_layers(), preset.num_layers());
    assert!(matches!(w.initial_params(3), ParamSource::Init { seed: 3 }));

    // Missing fields are `train`'s defaults; unknown ones are refused by name.
    let partial: GptWorkloadConfig =
        serde_json::from_value(serde_json::json!({ "model": "gpt2" })).unwrap();
    assert_eq!(partial.seq_len, GptWorkloadConfig::default().seq_len);
    let err = GptWorkload::factory(&job(), &serde_json::json!({ "seq_length": 16 }))
        .err()
        .expect("an unknown field")
        .to_string();
    assert!(err.contains("seq_length"), "{err}");
}

/// The batch shape is the job's alone: settings from a master that still sent it in the
/// workload's JSON are refused, saying why, not taken as an unknown field.
#[test]
fn the_factory_takes_the_batch_from_the_job_and_refuses_it_in_the_settings() {
    let (_dir, corpus) = small_corpus(20_000);
    let json = serde_json::to_value(tiny(&corpus)).unwrap();
    let mut spec = job();
    spec.global_microbatches = 5;
    let w = GptWorkload::factory(&spec, &json).expect("factory");
    w.check(&spec).expect("built for the job's batch");
    for field in ["microbatch_size", "num_microbatches"] {
        let mut old = json.clone();
        old[field] = serde_json::json!(2);
        let err = GptWorkload::factory(&job(), &old)
            .err()
            .expect("a batch in the settings")
            .to_string();
        assert!(
            err.contains(&format!("carry `{field}`")) && err.contains("older build"),
            "{err}"
        );
    }
}

#[test]
fn a_sequence_longer_than_the_context_is_refused() {
    let (_dir, corpus) = small_corpus(20_000);
    let cfg = GptWorkloadConfig {
        seq_len: 65,
        ..tiny(&corpus)
    };
    let err = refusal(cfg);
    assert!(
        err.contains("--seq-len 65 exceeds the context of gpt-tiny (64 positions)"),
        "{err}"
    );
}

#[test]
fn an_unknown_preset_lists_the_presets() {
    let (_dir, corpus) = small_corpus(20_000);
    let cfg = GptWorkloadConfig {
        model: "gpt-huge".into(),
        ..tiny(&corpus)
    };
    let err = refusal(cfg);
    assert!(
        err.contains("gpt-huge") && err.contains("gpt-mini"),
        "{err}"
    );
}

#[test]
fn too_little_data_is_refused_with_the_numbers() {
    let (_dir, corpus) = small_corpus(20_000);
    let many_evals = GptWorkloadConfig {
        eval_batches: 1000,
        ..tiny(&corpus)
    };
    let err = refusal(many_evals);
    assert!(err.contains("fewer than --eval-batches 1000"), "{err}");
    let huge_batch = BatchShape {
        global_microbatches: 100_000,
        ..BATCH
    };
    let err = refusal_of(tiny(&corpus), huge_batch);
    assert!(
        err.contains("one global batch needs 200000 samples"),
        "{err}"
    );
}

/// The master's workload is built by its caller: one built for another batch than the job's
/// is refused before anything trains.
#[test]
fn a_workload_built_for_another_batch_than_the_jobs_is_refused() {
    let (_dir, corpus) = small_corpus(20_000);
    let w = GptWorkload::new(tiny(&corpus), BATCH).expect("workload");
    let mut spec = job();
    w.check(&spec).expect("the same batch");
    spec.global_microbatches = 4;
    let e = w.check(&spec).expect_err("another batch").to_string();
    assert!(
        e.contains("built for 3 microbatches of 2 samples, the job has 4 of 2"),
        "{e}"
    );
}

#[test]
fn the_profile_has_one_entry_per_layer() {
    let (_dir, corpus) = small_corpus(20_000);
    let w = GptWorkload::new(tiny(&corpus), BATCH).unwrap();
    let cpu = DeviceSpec::named("cpu").expect("the planner knows cpu");
    let p = w.profile(cpu, 2, Dtype::F32).expect("profile");
    assert_eq!(p.layers.len(), w.model().num_layers());
    p.validate().expect("a valid profile");
    // The model's own planner shape: for a preset, GPT's (ffn = 4d, tied embedding).
    let gpt = oobleck_core::planning::TransformerShape::gpt(2, 64, 4, 50257, 16);
    assert_eq!(p, analytical_profile("gpt-tiny", &gpt, cpu, 2, Dtype::F32));
}

/// `--precision bf16` plans with 2-byte parameters, activations and stage outputs (the f32
/// logits of the loss excepted) and the CPU's bf16 rate; fp32's profile is what it was.
#[test]
fn the_bf16_profile_counts_two_byte_elements() {
    let (_dir, corpus) = small_corpus(20_000);
    let w = GptWorkload::new(tiny(&corpus), BATCH).unwrap();
    let cpu = DeviceSpec::named("cpu").expect("the planner knows cpu");
    let f32p = w.profile(cpu, 2, Dtype::F32).expect("profile");
    let bf16 = w.profile(cpu, 2, Dtype::Bf16).expect("profile");
    bf16.validate().expect("a valid profile");
    assert_eq!(bf16.fingerprint.dtype, "bf16");
    let n = f32p.layers.len();
    for (i, (a, b)) in f32p.layers.iter().zip(&bf16.layers).enumerate() {
        assert_eq!(2 * b.param_bytes, a.param_bytes, "layer {i}");
        assert_eq!(2 * b.output_bytes, a.output_bytes, "layer {i}");
        if i + 1 < n {
            assert_eq!(2 * b.activation_bytes, a.activation_bytes, "layer {i}");
        } else {
            // The head keeps f32 logits for the loss: more than half of fp32's.
            assert!(2 * b.activation_bytes > a.activation_bytes);
        }
    }
    // Blocks are compute-bound here, so they take the CPU's bf16 rate (slower than fp32).
    assert!(bf16.layers[1].forward_ms > f32p.layers[1].forward_ms);
}

#[test]
fn evaluation_is_the_mean_loss_of_the_first_validation_batches() {
    let (_dir, corpus) = small_corpus(20_000);
    let w = GptWorkload::new(tiny(&corpus), BATCH).unwrap();
    let l = w.model().num_layers();
    let whole = |range| {
        let layers = w
            .model()
            .build_layers(range, &Device::Cpu, w.initial_params(SEED))
            .unwrap();
        Stage::new(layers).unwrap()
    };
    let stage = whole(0..l);
    let val = w.dataset().split(Split::Validation);
    let mut expected = 0.0;
    for i in 0..2 {
        let (inp, tgt) =
            to_tensors(&val.sequential_batch(16, 2, i).unwrap(), &Device::Cpu).unwrap();
        let ctx = ForwardCtx {
            targets: Some(&tgt),
            ..ForwardCtx::inference()
        };
        let loss = stage.forward(&inp, &ctx).unwrap().output;
        expected += f64::from(loss.to_scalar::<f32>().unwrap());
    }
    let got = w.evaluate(&stage).unwrap().expect("an evaluation");
    assert_eq!(got, expected / 2.0);
    // A fresh gpt-tiny is near uniform over 50257 tokens: ln(50257) = 10.8.
    assert!((10.0..11.5).contains(&got), "{got}");

    let err = w.evaluate(&whole(1..l)).unwrap_err().to_string();
    assert!(err.contains("whole model"), "{err}");
}

#[test]
fn checkpoints_carry_a_config_json_and_the_tokenizer_that_load_back() {
    let (dir, corpus) = small_corpus(20_000);
    let w = GptWorkload::new(tiny(&corpus), BATCH).unwrap();
    let files = w.checkpoint_files();
    let names: Vec<&str> = files.iter().map(|f| f.0.as_str()).collect();
    assert_eq!(names, ["config.json", "vocab.json", "merges.txt"]);
    let ckpt = dir.path().join("ckpt");
    std::fs::create_dir(&ckpt).unwrap();
    for (name, bytes) in &files {
        std::fs::write(ckpt.join(name), bytes).unwrap();
    }
    let config = ckpt.join("config.json");
    assert_eq!(
        &ModelConfig::from_hf_json(&config).unwrap(),
        w.model_config()
    );
    let tok = Gpt2Tokenizer::in_model_dir(&ckpt).expect("the tokenizer beside the weights");
    let tok = Gpt2Tokenizer::from_path(&tok).unwrap();
    assert_eq!(tok.hash(), w.dataset().tokenizer().hash());
}

#[test]
fn init_from_starts_from_the_pretrained_weights() {
    let (dir, corpus) = small_corpus(20_000);
    let preset = ModelConfig::preset("gpt-tiny").unwrap();
    let model = preset.build().unwrap();
    let layers = model
        .build_layers(
            0..model.num_layers(),
            &Device::Cpu,
            ParamSource::Init { seed: 99 },
        )
        .unwrap();
    let params: HashMap<String, Tensor> = Stage::new(layers)
        .unwrap()
        .params()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().clone()))
        .collect();
    let hf_dir = dir.path().join("hf");
    hf::save_pretrained(&hf_dir, &preset, &params).unwrap();
    let cfg = GptWorkloadConfig {
        init_from: Some(hf_dir.display().to_string()),
        ..tiny(&corpus)
    };
    assert_eq!(
        cfg.model_config().unwrap(),
        preset,
        "the config without the weights"
    );
    let w = GptWorkload::new(cfg, BATCH).unwrap();
    let ParamSource::Tensors(got) = w.initial_params(SEED) else {
        panic!("init_from must give the pretrained tensors");
    };
    assert_eq!(got.len(), params.len());
    let name = "transformer.wte.weight";
    let diff = (got[name].clone() - &params[name]).unwrap().abs().unwrap();
    assert_eq!(diff.max_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
}

/// A measured profile of gpt-tiny has one entry per layer with positive times, and a profile
/// file is used only for the job's microbatch: otherwise the error names both.
#[test]
fn a_measured_profile_file_is_checked_against_the_job() {
    let (dir, corpus) = small_corpus(20_000);
    let w = GptWorkload::new(tiny(&corpus), BATCH).expect("workload");
    let m = w
        .measure_profile(&Device::Cpu, Dtype::F32, 0, 1)
        .expect("measured");
    assert_eq!(m.profile.num_layers(), w.model().num_layers());
    assert!(m
        .profile
        .layers
        .iter()
        .all(|l| l.forward_ms > 0.0 && l.backward_ms > 0.0));
    assert_eq!(m.profile.fingerprint.microbatch_size, 2);
    assert_eq!(m.profile.fingerprint.model, "gpt-tiny seq 16");
    let file = dir.path().join("p.json");
    std::fs::write(&file, m.profile.to_json()).expect("write");
    let with_file = GptWorkload::new(
        GptWorkloadConfig {
            profile: file.display().to_string(),
            ..tiny(&corpus)
        },
        BATCH,
    )
    .expect("workload");
    let cpu = DeviceSpec::named("cpu").expect("cpu");
    let p = with_file
        .profile(cpu, 2, Dtype::F32)
        .expect("the file's profile");
    assert_eq!(p, m.profile);
    let e = with_file
        .profile(cpu, 4, Dtype::F32)
        .expect_err("another microbatch")
        .to_string();
    assert!(
        e.contains("microbatch_size: 2") && e.contains("microbatch 4"),
        "{e}"
    );
}

/// The ids [`Workload::sample_ids`] gives are the windows the microbatch trains, and over two
/// epochs each epoch trains every window of the training split exactly once, except the
/// `n mod (B*b)` at the tail of that epoch's order, which it skips.
#[test]
fn sample_ids_name_the_windows_trained_and_each_epoch_trains_every_window_once() {
    let (_dir, corpus) = small_corpus(6_000);
    let w = GptWorkload::new(tiny(&corpus), BATCH).expect("workload");
    let (spec, ipe) = (w.batch_spec(), w.iterations_per_epoch() as u64);
    let train = w.dataset().split(Split::Train);
    let n = train.num_samples(spec.seq_len) as u64;
    let per_step = spec.global_batch_samples() as u64;
    assert!(ipe >= 2 && n % per_step != 0, "{n} windows, {ipe} steps");
    let mut skipped_before = None;
    for epoch in 0..2 {
        let mut seen = std::collections::BTreeSet::new();
        for step in epoch * ipe..(epoch + 1) * ipe {
            for k in 0..spec.num_microbatches as u32 {
                let samples = w
                    .sample_ids(SEED, step, k)
                    .unwrap()
                    .expect("numbered samples");
                let rows = ids(&w.microbatch(SEED, step, k, &Device::Cpu).unwrap().0);
                for (row, &id) in samples.iter().enumerate() {
                    let window = train.sequential_batch(spec.seq_len, 1, id as usize);
                    assert_eq!(rows[row], window.unwrap().inputs, "step {step} mb {k}");
                    assert!(seen.insert(id), "window {id} twice in epoch {epoch}");
                }
            }
        }
        let order = train.epoch_order(SEED, epoch, spec.seq_len);
        let skipped: Vec<u64> = (ipe * per_step..n).map(|p| order.at(p)).collect();
        seen.extend(skipped.iter().copied());
        assert_eq!(seen, (0..n).collect(), "epoch {epoch}: every window once");
        assert_ne!(skipped_before.replace(skipped.clone()), Some(skipped));
    }
}
