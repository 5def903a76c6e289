//! The workload names what it trains (a preset, or an imported model's directory and shape, and
//! the padding rows of a vocabulary larger than the tokenizer's) and trains on the ids the model
//! was trained with: an `init_from` directory's own tokenizer, never GPT-2's ids for an OPT
//! checkpoint that does not say which ids it used.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use oobleck_core::model::{ParamSource, Stage};
use oobleck_core::runtime::{BatchShape, Workload};
use oobleck_models::data::{default_tokenizer_dir, Gpt2Tokenizer, EMBEDDED_CORPUS};
use oobleck_models::workload::{GptWorkload, GptWorkloadConfig};
use oobleck_models::{hf, ModelConfig};

/// `dir/corpus.txt`: the first 20 kB of the shipped corpus (whole lines).
fn small_corpus(dir: &Path) -> PathBuf {
    let end = EMBEDDED_CORPUS[..20_000].rfind('\n').expect("a line") + 1;
    let corpus = dir.join("corpus.txt");
    std::fs::write(&corpus, &EMBEDDED_CORPUS[..end]).expect("write corpus");
    corpus
}

/// The job's batch: 2 microbatches of 2 samples.
const BATCH: BatchShape = BatchShape {
    microbatch_size: 2,
    global_microbatches: 2,
};

/// `model` on `corpus`, 16 tokens a sample.
fn settings(model: &str, corpus: &Path) -> GptWorkloadConfig {
    GptWorkloadConfig {
        model: model.into(),
        seq_len: 16,
        eval_batches: 1,
        data: oobleck_models::data::DataSpec::path(corpus),
        ..GptWorkloadConfig::default()
    }
}

/// Writes `cfg` with seeded weights as a Hugging Face model directory `dir` (no tokenizer).
fn save_model(dir: &Path, cfg: &ModelConfig) {
    let model = cfg.build().unwrap();
    let layers = model
        .build_layers(
            0..model.num_layers(),
            &Device::Cpu,
            ParamSource::Init { seed: 3 },
        )
        .unwrap();
    let params: HashMap<String, Tensor> = Stage::new(layers)
        .unwrap()
        .params()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().clone()))
        .collect();
    hf::save_pretrained(dir, cfg, &params).unwrap();
}

fn refusal(cfg: GptWorkloadConfig) -> String {
    match GptWorkload::new(cfg, BATCH) {
        Ok(_) => panic!("the workload should have been refused"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_preset_is_named_and_an_opt_preset_says_its_padding_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = small_corpus(tmp.path());
    let gpt = GptWorkload::new(settings("gpt-tiny", &corpus), BATCH).unwrap();
    assert_eq!(gpt.name(), "gpt-tiny");
    for opt in ["opt-tiny", "opt-tiny-postln"] {
        let w = GptWorkload::new(settings(opt, &corpus), BATCH).unwrap();
        assert_eq!(
            w.name(),
            format!(
                "{opt} (vocabulary 50272 ids, 15 of them padding beyond the tokenizer's 50257)"
            )
        );
    }
}

#[test]
fn init_from_is_named_by_its_directory_and_shape_not_the_preset_label() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = small_corpus(tmp.path());
    let mut shape = ModelConfig::preset("gpt-tiny").unwrap();
    if let ModelConfig::Gpt(c) = &mut shape {
        c.n_layer = 3;
        c.n_embd = 32;
    }
    let dir = tmp.path().join("hf-gpt2");
    save_model(&dir, &shape);
    let w = GptWorkload::new(
        GptWorkloadConfig {
            init_from: Some(dir.display().to_string()),
            ..settings("gpt-mini", &corpus)
        },
        BATCH,
    )
    .unwrap();
    assert_eq!(
        w.name(),
        format!(
            "{} (gpt2: 3 blocks, hidden 32, 4 heads, vocabulary 50257 ids)",
            dir.display()
        )
    );
    assert_eq!(w.num_params(), shape.num_params());
    // A GPT-2 directory without tokenizer files is on OpenAI's ids: the built-in tokenizer.
    assert_eq!(
        w.dataset().tokenizer().hash(),
        Gpt2Tokenizer::embedded().hash()
    );
}

#[test]
fn an_opt_checkpoint_trains_on_its_own_tokenizer_and_is_refused_without_one() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = small_corpus(tmp.path());
    let dir = tmp.path().join("hf-opt");
    save_model(&dir, &ModelConfig::preset("opt-tiny").unwrap());
    let cfg = GptWorkloadConfig {
        init_from: Some(dir.display().to_string()),
        ..settings("opt-tiny", &corpus)
    };

    let err = refusal(cfg.clone());
    for part in [
        "hf-opt",
        "OPT",
        "tokenizer.json",
        "vocab.json",
        "--tokenizer",
    ] {
        assert!(err.contains(part), "{part} not in: {err}");
    }
    assert!(cfg.tokenizer_path().is_err());

    // Named explicitly: used.
    let named = GptWorkloadConfig {
        tokenizer: Some(default_tokenizer_dir()),
        ..cfg.clone()
    };
    assert_eq!(
        named.tokenizer_path().unwrap(),
        Some(default_tokenizer_dir())
    );
    GptWorkload::new(named, BATCH).unwrap();

    // Shipped beside the weights (as Hugging Face repositories and our checkpoints do): used.
    for (name, bytes) in Gpt2Tokenizer::embedded().files() {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    assert_eq!(cfg.tokenizer_path().unwrap(), Some(dir.clone()));
    let w = GptWorkload::new(cfg, BATCH).unwrap();
    assert_eq!(w.dataset().tokenizer().source(), dir);
    assert!(w.name().contains("15 of them padding"), "{}", w.name());
}

#[test]
fn a_tokenizer_with_more_ids_than_the_model_has_rows_is_refused_with_both_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = small_corpus(tmp.path());
    let mut small = ModelConfig::preset("gpt-tiny").unwrap();
    if let ModelConfig::Gpt(c) = &mut small {
        c.vocab_size = 50000;
    }
    let dir = tmp.path().join("small-vocab");
    save_model(&dir, &small);
    let err = refusal(GptWorkloadConfig {
        init_from: Some(dir.display().to_string()),
        ..settings("gpt-tiny", &corpus)
    });
    assert!(
        err.contains("50257") && err.contains("50000") && err.contains("tokenizer"),
        "{err}"
    );
}

#[test]
fn a_family_we_do_not_build_is_named_with_the_ones_we_do() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = small_corpus(tmp.path());
    let dir = tmp.path().join("llama");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        br#"{"model_type": "llama", "hidden_size": 64, "vocab_size": 32000}"#,
    )
    .unwrap();
    let err = refusal(GptWorkloadConfig {
        init_from: Some(dir.display().to_string()),
        ..settings("gpt-tiny", &corpus)
    });
    for part in ["config.json", "`llama`", "gpt2", "opt"] {
        assert!(err.contains(part), "{part} not in: {err}");
    }
}
