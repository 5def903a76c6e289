use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};

use super::*;
use crate::optim::{AdamW, AdamWConfig};

/// Parameters in f32 and bf16 (a seeded pattern, not constants) and the AdamW state (f32
/// moments, i64 steps) after two real steps.
fn sample_state() -> (BTreeMap<String, Tensor>, Vec<(String, Tensor)>) {
    let dev = Device::Cpu;
    let data: Vec<f32> = (0..24)
        .map(|i| ((i * 37 % 11) as f32 - 5.0) / 7.0)
        .collect();
    let w = Var::from_tensor(&Tensor::from_vec(data, (4, 6), &dev).unwrap()).unwrap();
    let b = Var::from_tensor(&Tensor::new(&[0.25f32, -1.5, 3.0e-7], &dev).unwrap()).unwrap();
    let vars = vec![
        ("h.0.mlp.c_fc.weight".to_string(), w.clone()),
        ("h.0.mlp.c_fc.bias".to_string(), b.clone()),
    ];
    let mut opt = AdamW::new(AdamWConfig::default()).unwrap();
    for step in 0..2 {
        let grads: HashMap<String, Tensor> = vars
            .iter()
            .map(|(n, v)| {
                let g = (v.as_tensor() * (0.5 + step as f64)).unwrap();
                (n.clone(), g)
            })
            .collect();
        opt.step(&vars, &grads, 1e-2).unwrap();
    }
    let mut params: BTreeMap<String, Tensor> = vars
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().detach()))
        .collect();
    let wte = Tensor::new(&[[1.0f32, -2.5], [0.007, 65504.0]], &dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    params.insert("wte.weight".to_string(), wte);
    (params, opt.export_state().unwrap())
}

fn trainer(step: u64) -> TrainerState {
    TrainerState {
        step,
        seed: 1234,
        data_cursor: serde_json::json!({"epoch": 1, "iteration": step}),
        config: Some(serde_json::json!({"model": "gpt-tiny"})),
    }
}

/// Dtype, shape and value bits of a tensor, for bit-exact comparison. bf16 is widened to f32,
/// which is exact and injective for non-NaN values (candle offers no bit cast).
fn raw(t: &Tensor) -> (DType, Vec<usize>, Vec<u8>) {
    let flat = t.flatten_all().unwrap();
    let bytes: Vec<u8> = match t.dtype() {
        DType::F32 | DType::BF16 => flat
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::I64 => flat
            .to_vec1::<i64>()
            .unwrap()
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        other => panic!("test does not compare {other:?}"),
    };
    (t.dtype(), t.dims().to_vec(), bytes)
}

fn flip_last_byte(path: &Path) {
    let mut bytes = fs::read(path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    fs::write(path, bytes).unwrap();
}

#[test]
fn round_trip_is_bit_exact_for_f32_bf16_and_i64() {
    let dir = tempfile::tempdir().unwrap();
    let (params, opt) = sample_state();
    let path = save_checkpoint(dir.path(), &params, &opt, &trainer(7)).unwrap();
    assert_eq!(path, dir.path().join("checkpoints").join("step-000007"));

    let ck = load_checkpoint(&path, &Device::Cpu).unwrap();
    assert_eq!(ck.trainer, trainer(7));
    assert_eq!(ck.params.len(), params.len());
    for (name, t) in &params {
        assert_eq!(raw(&ck.params[name]), raw(t), "{name}");
    }
    assert_eq!(ck.params["wte.weight"].dtype(), DType::BF16);
    let names: Vec<&String> = ck.optimizer.iter().map(|(n, _)| n).collect();
    let want: Vec<&String> = opt.iter().map(|(n, _)| n).collect();
    assert_eq!(names, want, "optimizer state comes back sorted by name");
    for ((_, got), (name, t)) in ck.optimizer.iter().zip(&opt) {
        assert_eq!(raw(got), raw(t), "{name}");
    }
    // The loaded state drives an optimizer like the original.
    let mut fresh = AdamW::new(AdamWConfig::default()).unwrap();
    fresh.import_state(&ck.optimizer).unwrap();
    assert_eq!(fresh.step_count("h.0.mlp.c_fc.weight"), Some(2));
    assert_eq!(verify_checkpoint(&path).unwrap(), trainer(7));

    // Same state, same bytes: checksums are reproducible.
    let again = save_checkpoint(dir.path(), &params, &opt, &trainer(8)).unwrap();
    for file in [MODEL_FILE, OPTIMIZER_FILE] {
        assert_eq!(
            sha256_file(&path.join(file)).unwrap(),
            sha256_file(&again.join(file)).unwrap()
        );
    }
}

#[test]
fn flipped_byte_is_a_checksum_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let (params, opt) = sample_state();
    let path = save_checkpoint(dir.path(), &params, &opt, &trainer(3)).unwrap();
    let before = sha256_file(&path.join(OPTIMIZER_FILE)).unwrap();
    flip_last_byte(&path.join(OPTIMIZER_FILE));
    for result in [
        load_checkpoint(&path, &Device::Cpu).map(|_| ()),
        verify_checkpoint(&path).map(|_| ()),
    ] {
        match result {
            Err(Error::Checksum {
                path: p,
                expected,
                actual,
            }) => {
                assert!(p.ends_with(OPTIMIZER_FILE), "{}", p.display());
                assert_eq!(expected, before);
                assert_ne!(actual, expected);
            }
            other => panic!("expected a checksum error, got {other:?}"),
        }
    }
}

#[test]
fn truncated_or_missing_file_is_reported_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let (params, opt) = sample_state();
    let path = save_checkpoint(dir.path(), &params, &opt, &trainer(4)).unwrap();
    let model = path.join(MODEL_FILE);
    let len = fs::metadata(&model).unwrap().len();
    let bytes = fs::read(&model).unwrap();
    fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_checkpoint(&path, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(MODEL_FILE) && err.contains("truncated") && err.contains(&len.to_string()),
        "{err}"
    );

    fs::remove_file(&model).unwrap();
    let err = load_checkpoint(&path, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains(MODEL_FILE) && err.contains("missing"), "{err}");

    fs::remove_file(path.join(TRAINER_FILE)).unwrap();
    let err = verify_checkpoint(&path).unwrap_err().to_string();
    assert!(
        err.contains(TRAINER_FILE) && err.contains("missing"),
        "{err}"
    );
}

#[test]
fn unknown_format_version_or_garbled_trainer_json_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let (params, opt) = sample_state();
    let path = save_checkpoint(dir.path(), &params, &opt, &trainer(5)).unwrap();
    let json_path = path.join(TRAINER_FILE);
    let text = fs::read_to_string(&json_path).unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    doc["format_version"] = serde_json::json!(99);
    fs::write(&json_path, serde_json::to_vec(&doc).unwrap()).unwrap();
    let err = load_checkpoint(&path, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("format version 99"), "{err}");

    let renamed = checkpoint_path(dir.path(), 6);
    fs::write(&json_path, &text).unwrap();
    fs::rename(&path, &renamed).unwrap();
    let err = load_checkpoint(&renamed, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("records step 5"), "{err}");
    fs::rename(&renamed, &path).unwrap();
    assert!(load_checkpoint(&path, &Device::Cpu).is_ok());

    fs::write(&json_path, &text[..text.len() / 2]).unwrap();
    let err = load_checkpoint(&path, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains(TRAINER_FILE) && err.contains("JSON"), "{err}");
}

#[test]
fn existing_checkpoint_is_never_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let (params, opt) = sample_state();
    let path = save_checkpoint(dir.path(), &params, &opt, &trainer(9)).unwrap();
    let digest = sha256_file(&path.join(MODEL_FILE)).unwrap();

    let mut other = params.clone();
    other.insert(
        "extra".to_string(),
        Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap(),
    );
    match save_checkpoint(dir.path(), &other, &opt, &trainer(9)) {
        Err(Error::CheckpointExists { path: p }) => assert_eq!(p, path),
        other => panic!("expected CheckpointExists, got {other:?}"),
    }
    assert_eq!(sha256_file(&path.join(MODEL_FILE)).unwrap(), digest);
    assert!(load_checkpoint(&path, &Device::Cpu).is_ok());
    // Nothing half-written is left beside it.
    let names: Vec<String> = fs::read_dir(dir.path().join(CHECKPOINTS_DIR))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec!["step-000009".to_string()]);
}

#[test]
fn bad_tensor_names_fail_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let (params, mut opt) = sample_state();
    opt.push(opt[0].clone());
    let err = save_checkpoint(dir.path(), &params, &opt, &trainer(1))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(OPTIMIZER_FILE) && err.contains("twice"),
        "{err}"
    );
    assert_eq!(latest_checkpoint(dir.path()).unwrap(), None);
}

#[test]
fn latest_checkpoint_ignores_temporaries_and_sorts_by_number() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(latest_checkpoint(dir.path()).unwrap(), None);
    let (params, opt) = sample_state();
    save_checkpoint(dir.path(), &params, &opt, &trainer(999_999)).unwrap();
    let newest = save_checkpoint(dir.path(), &params, &opt, &trainer(1_000_000)).unwrap();
    save_checkpoint(dir.path(), &params, &opt, &trainer(12)).unwrap();
    let root = dir.path().join(CHECKPOINTS_DIR);
    // A crashed save of a later step, an empty directory under a final-looking name, and a file.
    let crashed = root.join(".tmp-step-2000000-77-0");
    fs::create_dir(&crashed).unwrap();
    fs::write(crashed.join(MODEL_FILE), b"partial").unwrap();
    fs::create_dir(root.join("step-3000000")).unwrap();
    fs::write(root.join("step-4000000"), b"not a directory").unwrap();
    fs::create_dir(root.join("step-12x")).unwrap();

    assert_eq!(latest_checkpoint(dir.path()).unwrap(), Some(newest.clone()));
    let steps: Vec<u64> = list_checkpoints(dir.path())
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(steps, vec![12, 999_999, 1_000_000]);

    assert_eq!(remove_stale_temp_dirs(dir.path()).unwrap(), 1);
    assert!(!crashed.exists());
    assert_eq!(latest_checkpoint(dir.path()).unwrap(), Some(newest));
}

#[test]
fn prune_keeps_the_newest_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let (params, opt) = sample_state();
    for step in [10, 20, 30, 40] {
        save_checkpoint(dir.path(), &params, &opt, &trainer(step)).unwrap();
    }
    assert!(prune(dir.path(), 0).is_err());
    let removed = prune(dir.path(), 2).unwrap();
    assert_eq!(
        removed,
        vec![
            checkpoint_path(dir.path(), 10),
            checkpoint_path(dir.path(), 20)
        ]
    );
    let left: Vec<u64> = list_checkpoints(dir.path())
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(left, vec![30, 40]);
    assert_eq!(
        fs::read_dir(dir.path().join(CHECKPOINTS_DIR))
            .unwrap()
            .count(),
        2
    );
}

/// The names under `checkpoints/`, sorted.
fn names_in(out_dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(out_dir.join(CHECKPOINTS_DIR))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// The one `step-NNNNNN.invalid-<digits>` directory beside `path`, checking its name.
fn moved_aside(path: &Path) -> std::path::PathBuf {
    let prefix = format!("{}.invalid-", path.file_name().unwrap().to_str().unwrap());
    let aside: Vec<_> = fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_str().unwrap();
            name.strip_prefix(&prefix)
                .is_some_and(|secs| !secs.is_empty() && secs.bytes().all(|b| b.is_ascii_digit()))
        })
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    aside[0].clone()
}

#[test]
fn saving_over_a_checkpoint_with_a_flipped_byte_moves_it_aside() {
    let dir = tempfile::tempdir().unwrap();
    let (params, opt) = sample_state();
    let path = save_checkpoint(dir.path(), &params, &opt, &trainer(9)).unwrap();
    flip_last_byte(&path.join(MODEL_FILE));
    let corrupt = fs::read(path.join(MODEL_FILE)).unwrap();

    let again = save_checkpoint(dir.path(), &params, &opt, &trainer(9)).unwrap();
    assert_eq!(again, path);
    assert_eq!(verify_checkpoint(&path).unwrap(), trainer(9));
    // The bad one is kept, untouched, under a name no reader takes for a checkpoint.
    let aside = moved_aside(&path);
    assert_eq!(fs::read(aside.join(MODEL_FILE)).unwrap(), corrupt);
    assert_eq!(names_in(dir.path()).len(), 2);
    assert_eq!(
        list_checkpoints(dir.path()).unwrap(),
        vec![(9, path.clone())]
    );
    assert_eq!(checkpoint_dirs(dir.path()).unwrap(), vec![(9, path)]);
}

#[test]
fn saving_over_a_checkpoint_without_trainer_json_moves_it_aside() {
    let dir = tempfile::tempdir().unwrap();
    let (params, opt) = sample_state();
    let path = save_checkpoint(dir.path(), &params, &opt, &trainer(4)).unwrap();
    fs::remove_file(path.join(TRAINER_FILE)).unwrap();
    // Invisible to the old reader (no trainer.json), but in the way of the save.
    assert_eq!(latest_checkpoint(dir.path()).unwrap(), None);

    save_checkpoint(dir.path(), &params, &opt, &trainer(4)).unwrap();
    assert_eq!(verify_checkpoint(&path).unwrap(), trainer(4));
    let aside = moved_aside(&path);
    assert!(aside.join(MODEL_FILE).is_file() && !aside.join(TRAINER_FILE).exists());
    // A second bad one of the same step in the same second gets a name of its own.
    fs::remove_file(path.join(MODEL_FILE)).unwrap();
    save_checkpoint(dir.path(), &params, &opt, &trainer(4)).unwrap();
    assert_eq!(verify_checkpoint(&path).unwrap(), trainer(4));
    assert_eq!(names_in(dir.path()).len(), 3, "{:?}", names_in(dir.path()));
}

#[test]
fn saving_over_a_valid_checkpoint_or_a_plain_file_still_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let (params, opt) = sample_state();
    let path = save_checkpoint(dir.path(), &params, &opt, &trainer(2)).unwrap();
    match save_checkpoint(dir.path(), &params, &opt, &trainer(2)) {
        Err(Error::CheckpointExists { path: p }) => assert_eq!(p, path),
        other => panic!("expected CheckpointExists, got {other:?}"),
    }
    // A file under a checkpoint's name is not ours to move.
    let file = checkpoint_path(dir.path(), 3);
    fs::write(&file, b"someone's notes").unwrap();
    match save_checkpoint(dir.path(), &params, &opt, &trainer(3)) {
        Err(Error::CheckpointExists { path: p }) => assert_eq!(p, file),
        other => panic!("expected CheckpointExists, got {other:?}"),
    }
    assert_eq!(fs::read(&file).unwrap(), b"someone's notes");
    assert_eq!(names_in(dir.path()), vec!["step-000002", "step-000003"]);
}

#[test]
fn newest_valid_skips_corrupt_and_incomplete_checkpoints_saying_why() {
    let dir = tempfile::tempdir().unwrap();
    let (params, opt) = sample_state();
    for step in [2, 4, 6, 8] {
        save_checkpoint(dir.path(), &params, &opt, &trainer(step)).unwrap();
    }
    let path = |step| checkpoint_path(dir.path(), step);
    flip_last_byte(&path(8).join(MODEL_FILE));
    fs::remove_file(path(6).join(TRAINER_FILE)).unwrap();
    let json = path(4).join(TRAINER_FILE);
    let mut doc: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&json).unwrap()).unwrap();
    doc["format_version"] = serde_json::json!(99);
    fs::write(&json, serde_json::to_vec(&doc).unwrap()).unwrap();

    let fallback = newest_valid(checkpoint_dirs(dir.path()).unwrap());
    assert_eq!(fallback.chosen, Some((2, path(2))));
    let skipped: Vec<(u64, &Path, String)> = fallback
        .skipped
        .iter()
        .map(|s| (s.step, s.path.as_path(), s.reason.to_string()))
        .collect();
    assert_eq!(skipped.len(), 3, "{skipped:?}");
    assert_eq!((skipped[0].0, skipped[0].1), (8, path(8).as_path()));
    assert!(
        skipped[0].2.contains(MODEL_FILE) && skipped[0].2.contains("checksum mismatch"),
        "{}",
        skipped[0].2
    );
    assert_eq!((skipped[1].0, skipped[1].1), (6, path(6).as_path()));
    assert!(
        skipped[1].2.contains(TRAINER_FILE) && skipped[1].2.contains("missing"),
        "{}",
        skipped[1].2
    );
    assert_eq!((skipped[2].0, skipped[2].1), (4, path(4).as_path()));
    assert!(
        skipped[2].2.contains("format version 99"),
        "{}",
        skipped[2].2
    );

    // Nothing valid at all: nothing chosen, everything named.
    fs::remove_dir_all(path(2)).unwrap();
    let fallback = newest_valid(checkpoint_dirs(dir.path()).unwrap());
    assert!(fallback.chosen.is_none());
    assert_eq!(fallback.skipped.len(), 3);
    assert!(newest_valid(Vec::new()).chosen.is_none());
}

#[test]
fn moved_aside_directories_are_not_checkpoints_to_any_reader_or_prune() {
    let dir = tempfile::tempdir().unwrap();
    let (params, opt) = sample_state();
    let kept = save_checkpoint(dir.path(), &params, &opt, &trainer(10)).unwrap();
    // A complete, valid checkpoint of a later step under a moved-aside name.
    let later = save_checkpoint(dir.path(), &params, &opt, &trainer(60)).unwrap();
    let aside = later.with_file_name("step-000060.invalid-123");
    fs::rename(&later, &aside).unwrap();
    assert_eq!(checkpoint_step(&aside), None);
    assert_eq!(checkpoint_step(&kept), Some(10));

    assert_eq!(
        list_checkpoints(dir.path()).unwrap(),
        vec![(10, kept.clone())]
    );
    assert_eq!(
        checkpoint_dirs(dir.path()).unwrap(),
        vec![(10, kept.clone())]
    );
    assert_eq!(latest_checkpoint(dir.path()).unwrap(), Some(kept.clone()));
    let fallback = newest_valid(checkpoint_dirs(dir.path()).unwrap());
    assert_eq!(fallback.chosen, Some((10, kept)));
    assert!(fallback.skipped.is_empty());
    assert!(prune(dir.path(), 1).unwrap().is_empty());
    assert_eq!(remove_stale_temp_dirs(dir.path()).unwrap(), 0);
    assert!(aside.join(TRAINER_FILE).is_file());
}
