//! Every model family trains from the command line: `train` on a 2-node local cluster runs two
//! steps of the tiny preset of GPT, of pre-LN OPT and of post-LN OPT (opt-350m's architecture)
//! with a finite, falling loss, and its first line names what it trains: the preset (with
//! OPT's padding rows beyond the tokenizer's ids), or an `--init-from` model's directory and
//! shape. A model family we do not build is refused by name.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::process::Output;
use std::time::Duration;

use candle_core::{Device, Tensor};
use common::*;
use oobleck_cli::generate::whole_model;
use oobleck_core::model::ParamSource;
use oobleck_models::{hf, ModelConfig};

/// [`small_job_cmd`] with `extra`, run within 90 s.
fn train(out: &Path, extra: &[&str]) -> Output {
    run(small_job_cmd(out, extra), Duration::from_secs(90))
}

fn first_line(o: &Output) -> String {
    let stderr = String::from_utf8_lossy(&o.stderr);
    stderr.lines().next().unwrap_or_default().to_string()
}

#[test]
fn the_tiny_preset_of_every_family_trains_on_a_local_cluster() {
    let dir = tempfile::tempdir().expect("tempdir");
    let padded = " (vocabulary 50272 ids, 15 of them padding beyond the tokenizer's 50257): ";
    for (model, named) in [
        ("gpt-tiny", "training gpt-tiny: ".to_string()),
        ("opt-tiny", format!("training opt-tiny{padded}")),
        (
            "opt-tiny-postln",
            format!("training opt-tiny-postln{padded}"),
        ),
    ] {
        let out = dir.path().join(model);
        let o = train(&out, &["--nodes", "2", "--model", model, "--steps", "2"]);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{model}: {stderr}");
        assert!(first_line(&o).starts_with(&named), "{model}: {stderr}");
        assert!(
            first_line(&o).contains("local cluster of 2 nodes"),
            "{stderr}"
        );
        let l = losses(&out);
        assert_eq!(l.len(), 2, "{model}: {l:?}");
        assert!(l.iter().all(|(_, v)| v.is_finite()), "{model}: {l:?}");
        // A fresh model is near ln(vocab) = 10.8; one AdamW step at lr 2e-3 lowers it.
        assert!((10.0..11.5).contains(&l[0].1), "{model}: {l:?}");
        assert!(l[1].1 < l[0].1, "{model}: the loss must fall: {l:?}");
        assert_all_gone(&out, 4);
    }
}

/// Writes a GPT-2 of 3 blocks of width 32 (not a preset's shape) as a Hugging Face directory.
fn save_gpt2(dir: &Path) -> ModelConfig {
    let mut cfg = ModelConfig::preset("gpt-tiny").expect("preset");
    if let ModelConfig::Gpt(c) = &mut cfg {
        c.n_layer = 3;
        c.n_embd = 32;
    }
    let model = cfg.build().expect("model");
    let stage =
        whole_model(model.as_ref(), &Device::Cpu, ParamSource::Init { seed: 5 }).expect("stage");
    let params: HashMap<String, Tensor> = stage
        .params()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().clone()))
        .collect();
    hf::save_pretrained(dir, &cfg, &params).expect("save");
    cfg
}

#[test]
fn the_first_line_names_an_imported_model_by_directory_and_shape() {
    let dir = tempfile::tempdir().expect("tempdir");
    let hf_dir = dir.path().join("hf-gpt2");
    let cfg = save_gpt2(&hf_dir);
    let want = format!(
        "training {} (gpt2: 3 blocks, hidden 32, 4 heads, vocabulary 50257 ids): {:.2}M \
         parameters, 5 layers, on ",
        hf_dir.display(),
        cfg.num_params() as f64 / 1e6
    );
    let from = hf_dir.to_str().expect("utf-8");
    for nodes in ["1", "2"] {
        let out = dir.path().join(format!("n{nodes}"));
        let o = train(
            &out,
            &["--nodes", nodes, "--init-from", from, "--steps", "1"],
        );
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "--nodes {nodes}: {stderr}");
        assert!(
            first_line(&o).starts_with(&want),
            "--nodes {nodes}: {stderr}"
        );
        assert!(!first_line(&o).contains("gpt-mini"), "{stderr}");
    }
}

#[test]
fn an_init_from_family_we_do_not_build_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let llama = dir.path().join("llama");
    std::fs::create_dir(&llama).expect("dir");
    std::fs::write(
        llama.join("config.json"),
        br#"{"model_type": "llama", "hidden_size": 64, "vocab_size": 32000}"#,
    )
    .expect("config");
    let from = llama.to_str().expect("utf-8");
    let o = train(
        &dir.path().join("run"),
        &["--init-from", from, "--steps", "1"],
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    for part in ["`llama`", "gpt2", "opt", "config.json"] {
        assert!(stderr.contains(part), "{part} not in: {stderr}");
    }
}
