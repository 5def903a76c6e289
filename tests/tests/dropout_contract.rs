//! The training contract with dropout on and multi-device stages (DESIGN.md section 4: "Any
//! randomness inside the model (dropout) is keyed by (seed, iteration, microbatch, layer),
//! never by which device runs it").
//!
//! A stage of `g` devices gives each device only its rows of the microbatch, so each device's
//! dropout mask must be exactly those rows of the mask the whole microbatch gets in the
//! single-process run. A tiny GPT with embedding and residual dropout 0.2 is trained for K
//! steps single-process and by a layout whose stages have 2 and 3 devices over microbatches of
//! 4 rows (cuts 2 + 2 and 2 + 1 + 1); the parameters, losses and gradient norms must agree
//! within the tolerance of `execution_contract.rs` (1e-5 absolute, 1e-4 relative on the
//! norm), which only covers floating-point reassociation.
//!
//! Measured (`cargo test -p oobleck-tests --test dropout_contract -- --nocapture`): max |param
//! diff| 1.3e-6 with the row-keyed masks; 6.0e-3 when each device drew the mask of its own slice
//! as if it were a whole microbatch (the bug this test guards). Without dropout the same layout
//! differs by 5.5e-7: the rest is rounding of the dropped activations.
//!
//! Rounding note: with 3-row microbatches (1-row slices) the same layouts differ from the single
//! process by up to 1.1e-5 for some seeds *without* dropout (AdamW's first step normalises
//! near-zero gradient elements whose rounding differs between GEMMs of 1 and 3 rows), which is
//! why this test uses 4-row microbatches.

use std::time::Duration;

use candle_core::{Device, Tensor};
use oobleck_core::execution::{Layout, PipelineSpec, StageSpec, BUCKET_ELEMS};
use oobleck_models::gpt2::{Gpt, GptConfig};
use oobleck_tests::execution::{
    max_param_diff, pipelines, single_process, RunResult, RunSpec, Transport,
};

const VOCAB: usize = 96;
const SEQ: usize = 8;
/// Rows per microbatch: a stage of 3 devices cuts it unevenly (rows 2 + 1 + 1).
const MICRO: usize = 4;
const B: u32 = 4;
const TOL: f64 = 1e-5;
const PDROP: f64 = 0.2;

/// 4 blocks (L = 6 layers), hidden 64; `pdrop` on embedding, residual and attention dropout.
fn model(pdrop: f64) -> Gpt {
    let mut cfg = GptConfig::new(4, 64, 4, SEQ);
    cfg.vocab_size = VOCAB;
    cfg.embd_pdrop = pdrop;
    cfg.resid_pdrop = pdrop;
    cfg.attn_pdrop = pdrop;
    Gpt::new(cfg).expect("a valid tiny config")
}

fn spec() -> RunSpec {
    RunSpec {
        seed: 11,
        steps: 3,
        microbatches: B,
        microbatch_size: MICRO as u32,
        lr: 1e-3,
        max_grad_norm: 0.5,
        timeout: Duration::from_secs(20),
        bucket_elems: BUCKET_ELEMS,
    }
}

/// Seeded synthetic tokens keyed by `(iteration, microbatch)`; targets are the next tokens.
fn data(iteration: u64, mb: u64) -> oobleck_core::Result<(Tensor, Tensor)> {
    // SplitMix64.
    let mut state = iteration.wrapping_mul(1_000_003) ^ mb.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let toks: Vec<u32> = (0..MICRO * (SEQ + 1))
        .map(|_| (next() % VOCAB as u64) as u32)
        .collect();
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for row in toks.chunks_exact(SEQ + 1) {
        x.extend_from_slice(&row[..SEQ]);
        y.extend_from_slice(&row[1..]);
    }
    Ok((
        Tensor::from_vec(x, (MICRO, SEQ), &Device::Cpu)?,
        Tensor::from_vec(y, (MICRO, SEQ), &Device::Cpu)?,
    ))
}

fn stages(cuts: &[(std::ops::Range<usize>, &[usize])]) -> Vec<StageSpec> {
    cuts.iter()
        .map(|(layers, ranks)| StageSpec {
            layers: layers.clone(),
            ranks: ranks.to_vec(),
        })
        .collect()
}

/// Asserts every rank matches the reference; returns the worst parameter difference.
fn compare(label: &str, want: &RunResult, ranks: &[RunResult]) -> f64 {
    let mut worst = 0.0f64;
    let mut worst_name = String::new();
    let mut names = std::collections::BTreeSet::new();
    for (rank, got) in ranks.iter().enumerate() {
        let (d, name, idx) =
            max_param_diff(&got.params, &want.params).expect("same parameter names");
        assert!(
            f64::from(d) <= TOL,
            "{label}: rank {rank}: `{name}`[{idx}] differs by {d}"
        );
        if f64::from(d) > worst {
            worst = f64::from(d);
            worst_name = format!("{name}[{idx}]");
        }
        assert_eq!(got.losses.len(), want.losses.len());
        for (step, (a, b)) in got.losses.iter().zip(&want.losses).enumerate() {
            assert!(
                (a - b).abs() <= TOL,
                "{label}: rank {rank} step {step}: loss {a} vs {b}"
            );
        }
        for (a, b) in got.grad_norms.iter().zip(&want.grad_norms) {
            assert!((a - b).abs() <= 1e-4 * b, "{label}: grad norm {a} vs {b}");
        }
        names.extend(got.params.keys().cloned());
    }
    assert_eq!(
        names.len(),
        want.params.len(),
        "{label}: every parameter held"
    );
    println!("{label}: max |param diff| = {worst:.3e} (`{worst_name}`)");
    worst
}

#[test]
fn dropout_masks_do_not_depend_on_how_a_stage_cuts_the_rows() {
    let m = model(PDROP);
    let spec = spec();
    let want = single_process(&m, &spec, &data).expect("single-process run");
    // Dropout is really on: the same run without it has a different loss.
    let without = single_process(&model(0.0), &spec, &data).expect("run without dropout");
    assert!(
        (want.losses[0] - without.losses[0]).abs() > 1e-4,
        "dropout must change the loss ({} vs {})",
        want.losses[0],
        without.losses[0]
    );
    // Attention dropout alone is live too (it drops attention probabilities, keyed per row).
    let mut attn_only = GptConfig::new(4, 64, 4, SEQ);
    attn_only.vocab_size = VOCAB;
    attn_only.attn_pdrop = PDROP;
    let attn_only = Gpt::new(attn_only).expect("a valid tiny config");
    let attn = single_process(&attn_only, &spec, &data).expect("run with attention dropout");
    assert!(
        (attn.losses[0] - without.losses[0]).abs() > 1e-4,
        "attention dropout must change the loss ({} vs {})",
        attn.losses[0],
        without.losses[0]
    );
    // Pipeline 0: two stages of 2 devices (rows 2 + 1). Pipeline 1: one device, then a stage
    // of 3 devices (rows 1 + 1 + 1), so rows are also re-cut at the stage boundary.
    let layout = Layout::new(
        6,
        B,
        vec![
            PipelineSpec {
                stages: stages(&[(0..3, &[0, 1]), (3..6, &[2, 3])]),
                microbatches: 0..2,
            },
            PipelineSpec {
                stages: stages(&[(0..2, &[4]), (2..6, &[5, 6, 7])]),
                microbatches: 2..B,
            },
        ],
    )
    .expect("valid layout");
    let got = pipelines(&m, &layout, &spec, &data, Transport::Local).expect("multi-device run");
    compare("dropout 0.2, stages of 2 and 3 devices", &want, &got);
}
