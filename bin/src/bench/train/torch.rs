//! The PyTorch side of `oobleck bench train`: `bin/benches/torch_train.py` in a child process,
//! its JSON result read back.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use super::super::child::run_captured;
use super::{BenchTrainArgs, FrameworkResult, Shape, TorchOutcome};

fn torch_script(args: &BenchTrainArgs) -> PathBuf {
    args.torch_script
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/torch_train.py"))
}

/// Runs the PyTorch side in a child process. A missing interpreter or torch is `Unavailable`;
/// a script that fails otherwise is an error (a broken reference must not look like "n/a").
pub(super) fn bench_torch(
    args: &BenchTrainArgs,
    shape: &Shape,
    threads: usize,
) -> Result<TorchOutcome> {
    let script = torch_script(args);
    if !script.is_file() {
        return Ok(TorchOutcome::Unavailable {
            unavailable: format!("script {} not found", script.display()),
        });
    }
    let mut cmd = Command::new(&args.python);
    cmd.arg(&script)
        .args(["--layers", &shape.layers.to_string()])
        .args(["--hidden", &shape.hidden.to_string()])
        .args(["--heads", &shape.heads.to_string()])
        .args(["--seq-len", &shape.seq_len.to_string()])
        .args(["--microbatch-size", &shape.batch.to_string()])
        .args(["--vocab", &shape.vocab.to_string()])
        .args(["--warmup", &args.warmup.to_string()])
        .args(["--steps", &args.steps.to_string()])
        .args(["--seed", &args.seed.to_string()])
        .args(["--threads", &threads.to_string()]);
    let timeout = Duration::from_secs(args.torch_timeout_s);
    let ran = run_captured(&mut cmd, timeout)
        .context("the PyTorch side (--torch-timeout-s bounds it)")?;
    let Some(ran) = ran else {
        return Ok(TorchOutcome::Unavailable {
            unavailable: format!("{} not found", args.python),
        });
    };
    parse_torch_output(&ran.stdout, &ran.stderr, ran.status.success(), &script)
}

/// The script's last stdout line is JSON: a [`FrameworkResult`] or `{"unavailable": why}`.
fn parse_torch_output(
    stdout: &str,
    stderr: &str,
    success: bool,
    script: &std::path::Path,
) -> Result<TorchOutcome> {
    let last = stdout.lines().rev().find(|l| !l.trim().is_empty());
    if !success {
        bail!(
            "{} failed:\n{}",
            script.display(),
            stderr.lines().rev().take(20).collect::<Vec<_>>().join("\n")
        );
    }
    let line = last.with_context(|| format!("{} printed nothing", script.display()))?;
    let v: serde_json::Value = serde_json::from_str(line)
        .with_context(|| format!("{} printed `{line}`, not JSON", script.display()))?;
    if let Some(why) = v.get("unavailable").and_then(|w| w.as_str()) {
        return Ok(TorchOutcome::Unavailable {
            unavailable: why.to_string(),
        });
    }
    let r: FrameworkResult = serde_json::from_value(v)
        .with_context(|| format!("{} printed an unexpected result `{line}`", script.display()))?;
    Ok(TorchOutcome::Measured(r))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_output_unavailable_and_failures_are_told_apart() {
        let p = std::path::Path::new("torch_train.py");
        let na = parse_torch_output("{\"unavailable\": \"torch not installed\"}\n", "", true, p);
        assert!(matches!(na.unwrap(), TorchOutcome::Unavailable { .. }));
        assert!(parse_torch_output("", "Traceback", false, p).is_err());
        assert!(parse_torch_output("garbage", "", true, p).is_err());
    }
}
