//! `train --init-from DIR` starts from DIR's weights on a cluster as in one process: the first
//! loss of `--nodes 2` equals that of `--nodes 1`, and is clearly below a fresh model's. Both
//! kinds of DIR: one of our checkpoints (OPT, tokenizer files inside) and a GPT-2 in the Hugging
//! Face hub's layout (names without `transformer.`, the causal-mask buffers, an `lm_head.weight`
//! equal to the embedding).

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::process::Output;
use std::time::Duration;

use candle_core::{Device, Tensor};
use common::*;
use oobleck_core::checkpoint::latest_checkpoint;
use oobleck_models::{hf, ModelConfig};

/// [`small_job_cmd`] with a high learning rate (so a few steps move the loss well away from a
/// fresh model's) and `extra`, run to success.
fn train(out: &Path, extra: &[&str]) -> Output {
    let c = small_job_cmd(out, &[&["--lr", "1e-2"][..], extra].concat());
    let o = run(c, Duration::from_secs(90));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "train {extra:?}: {stderr}");
    o
}

/// Trains `model` for 4 steps in one process; returns its first loss (a fresh model's, with the
/// seed every run here shares) and the directory of its final checkpoint.
fn pretrain(dir: &Path, model: &str) -> (f64, std::path::PathBuf) {
    let out = dir.join(format!("pretrain-{model}"));
    train(&out, &["--nodes", "1", "--model", model, "--steps", "4"]);
    let l = losses(&out);
    assert_eq!(l.len(), 4, "{l:?}");
    let ckpt = latest_checkpoint(&out)
        .expect("list checkpoints")
        .expect("a final checkpoint");
    (l[0].1, ckpt)
}

/// The first loss of `train --nodes NODES --init-from FROM --steps 1`; on a cluster, every
/// process it started is gone afterwards.
fn first_loss(dir: &Path, from: &Path, nodes: u32) -> f64 {
    let out = dir.join(format!(
        "from-{}-n{nodes}",
        from.file_name().expect("name").to_string_lossy()
    ));
    let from = from.to_str().expect("utf-8 path");
    let n = nodes.to_string();
    train(&out, &["--nodes", &n, "--init-from", from, "--steps", "1"]);
    let l = losses(&out);
    assert_eq!(l.len(), 1, "{l:?}");
    if nodes > 1 {
        // One agent and one worker per node.
        assert_all_gone(&out, 2 * nodes as usize);
    }
    l[0].1
}

/// The cluster's first loss is the single process's, and below the fresh model's `fresh`.
fn assert_starts_from_the_weights(dir: &Path, from: &Path, fresh: f64) {
    let one = first_loss(dir, from, 1);
    let two = first_loss(dir, from, 2);
    eprintln!(
        "{}: first loss fresh {fresh:.6}, --nodes 1 {one:.6}, --nodes 2 {two:.6}",
        from.display()
    );
    assert!(
        (one - two).abs() < 1e-3,
        "--nodes 2 starts at {two}, --nodes 1 at {one}: the cluster ignored the weights"
    );
    assert!(
        two < fresh - 0.1,
        "--nodes 2 starts at {two}, a fresh model at {fresh}"
    );
}

#[test]
fn a_cluster_starts_from_our_checkpoint() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (fresh, ckpt) = pretrain(dir.path(), "opt-tiny");
    assert_starts_from_the_weights(dir.path(), &ckpt, fresh);
}

/// Writes the checkpoint `ckpt` of a GPT-2 as the hub's `gpt2` repository lays it out.
fn save_hub_layout(ckpt: &Path, dir: &Path) {
    let cfg = ModelConfig::from_hf_json(&ckpt.join(hf::CONFIG_FILE)).expect("config.json");
    let ours = candle_core::safetensors::load(ckpt.join("model.safetensors"), &Device::Cpu)
        .expect("model.safetensors");
    let mut hub: HashMap<String, Tensor> = ours
        .iter()
        .map(|(name, t)| {
            let bare = name.strip_prefix("transformer.").unwrap_or(name);
            (bare.to_string(), t.clone())
        })
        .collect();
    hub.insert("lm_head.weight".into(), hub["wte.weight"].clone());
    hub.insert(
        "h.0.attn.bias".into(),
        Tensor::ones((1, 1, 4, 4), candle_core::DType::F32, &Device::Cpu).expect("buffer"),
    );
    hf::save_pretrained(dir, &cfg, &hub).expect("save");
}

#[test]
fn a_cluster_starts_from_a_gpt2_in_the_hub_layout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (fresh, ckpt) = pretrain(dir.path(), "gpt-tiny");
    let hub = dir.path().join("hub-gpt2");
    save_hub_layout(&ckpt, &hub);
    assert_starts_from_the_weights(dir.path(), &hub, fresh);
}
