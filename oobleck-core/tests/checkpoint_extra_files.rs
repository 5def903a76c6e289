//! A caller's own files inside a checkpoint (the HF `config.json`): written before the rename,
//! so they arrive with the checkpoint, and invisible to verification and loading, so a
//! checkpoint holding one (or one added by hand later) still loads.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use oobleck_core::checkpoint::{
    checkpoint_path, latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint,
    save_checkpoint_with, verify_checkpoint, TrainerState, CHECKPOINTS_DIR,
};

fn state() -> (BTreeMap<String, Tensor>, Vec<(String, Tensor)>) {
    let w = Tensor::new(&[[0.5f32, -1.25], [3.0, 0.0]], &Device::Cpu).unwrap();
    let m = Tensor::new(&[1e-3f32, 2e-3, 3e-3, 4e-3], &Device::Cpu).unwrap();
    let params = BTreeMap::from([("transformer.wte.weight".to_string(), w)]);
    (params, vec![("transformer.wte.weight.exp_avg".into(), m)])
}

fn trainer(step: u64) -> TrainerState {
    TrainerState {
        step,
        seed: 7,
        data_cursor: serde_json::json!({"epoch": 0, "iteration": step}),
        config: None,
    }
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn extra_files_arrive_with_the_checkpoint_and_do_not_disturb_loading() {
    let tmp = tempfile::tempdir().unwrap();
    let (params, opt) = state();
    let config = br#"{"model_type": "gpt2"}"#.to_vec();
    let dir = save_checkpoint_with(
        tmp.path(),
        &params,
        &opt,
        &trainer(4),
        &[("config.json", config.clone())],
    )
    .unwrap();
    assert_eq!(dir, checkpoint_path(tmp.path(), 4));
    assert_eq!(std::fs::read(dir.join("config.json")).unwrap(), config);
    // No temporary directory is left beside it.
    assert_eq!(entries(&tmp.path().join(CHECKPOINTS_DIR)), ["step-000004"]);

    assert_eq!(verify_checkpoint(&dir).unwrap(), trainer(4));
    let ck = load_checkpoint(&dir, &Device::Cpu).unwrap();
    assert_eq!(ck.trainer, trainer(4));
    assert_eq!(ck.params.len(), 1);
    assert_eq!(list_checkpoints(tmp.path()).unwrap(), [(4, dir.clone())]);
    assert_eq!(latest_checkpoint(tmp.path()).unwrap(), Some(dir));
}

#[test]
fn a_file_added_beside_a_plain_checkpoint_does_not_break_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (params, opt) = state();
    let dir = save_checkpoint(tmp.path(), &params, &opt, &trainer(2)).unwrap();
    std::fs::write(dir.join("config.json"), b"{}").unwrap();
    std::fs::write(dir.join("README.md"), b"notes").unwrap();
    assert_eq!(verify_checkpoint(&dir).unwrap(), trainer(2));
    load_checkpoint(&dir, &Device::Cpu).unwrap();
}

#[test]
fn extra_files_may_not_shadow_the_checkpoint_or_leave_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (params, opt) = state();
    for bad in [
        "trainer.json",
        "model.safetensors",
        "optimizer.safetensors",
        "../escape.json",
        "sub/config.json",
        "",
        "..",
        ".tmp-x",
    ] {
        let e = save_checkpoint_with(
            tmp.path(),
            &params,
            &opt,
            &trainer(1),
            &[(bad, b"x".to_vec())],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("plain file name"), "{bad:?}: {e}");
    }
    // Nothing was written: no checkpoint, no temporary directory, nothing outside.
    assert!(!tmp.path().join(CHECKPOINTS_DIR).exists());
    assert!(!tmp.path().join("escape.json").exists());
}
